"""The drafter's command line: every setting has a flag and a SPECDEC_DRAFTER_* variable, and reaches the config."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from drafter_service.__main__ import parse_config
from drafter_service.config import DrafterConfig
from specdec.flags import flags
from tests.taken_ports import start_on_a_taken_port

SETTINGS = {  # flag -> (config field path, a value other than its default)
    "--max-sessions": ("max_sessions", 5),
    "--max-draft-tokens": ("max_draft_tokens", 8),
    "--max-workers": ("max_workers", 4),
    "--session-idle-timeout-seconds": ("session_idle_timeout_s", 30.0),
    "--grace-seconds": ("grace_s", 1.0),
    "--min-ngram": ("ngram.n_min", 3),
    "--min-global-count": ("ngram.min_global_count", 3),
    "--admin-port": ("admin_port", 50071),
    "--max-session-bytes-per-caller": ("max_session_bytes_per_caller", 1 << 20),
    "--max-write-calls": ("max_write_calls", 2),
    "--max-calls-per-caller": ("max_calls_per_caller", 3),
    "--max-pending-write-tokens": ("max_pending_write_tokens", 1000),
    "--max-write-wait-seconds": ("max_write_wait_s", 5.0),
    "--connection-age-seconds": ("connections.connection_age_s", 60.0),
    "--max-auxiliary-streams": ("connections.max_auxiliary_streams", 2),
    "--metrics-port": ("metrics_port", 9200),
    "--health-port": ("health_port", 50061),
    "--log-url": ("log.url", "nats://nats-0.nats:4222,nats://nats-1.nats:4222"),
    "--log-max-serving-lag": ("log.max_serving_lag", 50),
    "--log-duplicate-window-seconds": ("log.duplicate_window_s", 30.0),
}


def get(config, path: str):
    for name in path.split("."):
        config = getattr(config, name)
    return config


@pytest.mark.parametrize("flag", SETTINGS)
def test_each_setting_reaches_the_config_from_its_flag_and_its_variable(flag, monkeypatch):
    path, value = SETTINGS[flag]
    assert get(DrafterConfig(), path) != value
    assert get(parse_config([flag, str(value)]), path) == value
    monkeypatch.setenv("SPECDEC_DRAFTER_" + flag[2:].replace("-", "_").upper(), str(value))
    assert get(parse_config([]), path) == value


def test_every_field_of_the_config_is_a_flag():
    derived = {".".join(flag.path) for flag in flags(DrafterConfig)}
    nested = ("ngram", "connections", "log")
    leaves = {f.name for f in dataclasses.fields(DrafterConfig) if f.name not in nested}
    for part in nested:
        leaves |= {f"{part}.{f.name}" for f in dataclasses.fields(getattr(DrafterConfig(), part))}
    assert derived == leaves


def test_without_flags_the_config_is_the_dataclass_default():
    assert parse_config([]) == DrafterConfig()


def test_help_lists_the_serving_flags_with_their_variables_and_defaults(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(SPECDEC_DRAFTER_METRICS_PORT; default 9101)" in shown and "(SPECDEC_DRAFTER_HEALTH_PORT; default none)" in shown
    for variable in ("TLS_CERT", "TLS_KEY", "TLS_CLIENT_CA"):
        assert f"(SPECDEC_DRAFTER_{variable}; default none)" in shown


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-sessions", "0"], "--max-sessions must be >= 1, got 0"),
        (["--max-bytes", "1000"], "--max-bytes must be >= 65536, got 1000"),
        (["--min-ngram", "5"], "need 1 <= n_min <= n_max, got n_min=5, n_max=4"),
        (["--backup-dir", "data/drafter/backups"], "must lie outside the table directory 'data/drafter'"),
        (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["--health-port", "-5"], "--health-port must be >= 0, got -5"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_config(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_limits_hold_in_process_too():
    with pytest.raises(ValueError, match=r"^max_sessions must be >= 1, got 0$"):
        DrafterConfig(max_sessions=0)


def test_the_offline_check_imports_neither_grpc_nor_the_server():
    """``python -m drafter_service.check`` reads a store offline: the store's lifecycle and config
    live apart from the gRPC servicer, so it loads neither (checked in a fresh interpreter)."""
    probe = "import sys, drafter_service.check; print(sorted(m for m in ('grpc', 'drafter_service.server') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--health-port", "--admin-port"])
def test_a_port_already_taken_ends_the_drafter_with_one_line_naming_its_flag(flag, tmp_path):
    last, port = start_on_a_taken_port("drafter_service", {"--port": "0", "--metrics-port": "-1", "--db": str(tmp_path / "db")}, flag)
    assert last.startswith("drafter: cannot start: cannot listen for "), last
    assert f"127.0.0.1:{port}" in last and f"({flag}: 0 takes a free port" in last, last


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--log-url", "http://nats:4222"], "is not nats://HOST:PORT"),
        (["--log-url", "nats://nats:99999"], "port out of range"),
        (["--log-url", " , "], "names no server"),
        (["--log-url", "nats://n:4222", "--log-stream", "a.b"], "--log-stream"),
        (["--log-url", "nats://n:4222", "--log-subject-prefix", "a..b"], "--log-subject-prefix"),
        (["--log-url", "nats://n:4222", "--log-password", "p"], "--log-password needs --log-user"),
        (["--log-url", "nats://n:4222", "--log-user", "u", "--log-nkey-file", "/k"], "give one"),
        (["--log-url", "nats://n:4222", "--log-tls-cert", "c.pem", "--log-tls-key", "k.pem"], "--log-tls-ca"),
        (["--log-url", "nats://n:4222", "--log-user", "u", "--log-password-file", "/nonexistent"], "cannot read --log-password-file"),
    ],
)
def test_a_wrong_log_setting_is_a_usage_error_naming_its_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_config(flags)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
