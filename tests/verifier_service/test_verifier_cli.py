"""The verifier's command line: every setting has a flag and a SPECDEC_VERIFIER_* variable, and reaches the config."""

from __future__ import annotations

import dataclasses

import pytest

from specdec.flags import flags
from verifier_service.__main__ import parse_config
from verifier_service.serving.config import VerifierConfig

SETTINGS = {  # flag -> (config field path, a value other than its default)
    "--max-batch-size": ("engine.max_batch_size", 3),
    "--max-queued": ("scheduler.max_queued", 5),
    "--max-new-tokens": ("engine.max_new_tokens_limit", 100),
    "--max-sequence-tokens": ("engine.max_sequence_tokens", 1024),
    "--prefill-chunk-tokens": ("engine.prefill_chunk_tokens", 64),
    "--max-speculative-tokens": ("engine.max_speculative_tokens", 4),
    "--max-adaptive-k": ("engine.max_adaptive_k", 5),
    "--max-message-bytes": ("max_message_bytes", 1 << 20),
    "--max-stop-strings": ("engine.max_stop_strings", 4),
    "--max-stop-string-length": ("engine.max_stop_string_length", 32),
    "--drafter-timeout-seconds": ("drafter.timeout_s", 0.5),
    "--drafter-backoff-seconds": ("drafter.backoff_s", 2.0),
    "--drafter-open-tokens-per-call": ("drafter.open_tokens_per_call", 1000),
    "--drafter-max-pending-observations": ("drafter.max_pending_observations", 7),
    "--grace-seconds": ("grace_s", 3.0),
    "--health-port": ("health_port", 50062),
    "--metrics-port": ("metrics_port", 9200),
}


def get(config, path: str):
    for name in path.split("."):
        config = getattr(config, name)
    return config


def leaf_paths(cls, prefix: str = "") -> list[str]:
    paths = []
    for field in dataclasses.fields(cls):
        if field.metadata.get("derived"):  # set at run time (the drafter link's vocabulary)
            continue
        default = getattr(cls(), field.name)
        if dataclasses.is_dataclass(default):
            paths += leaf_paths(type(default), f"{prefix}{field.name}.")
        else:
            paths.append(prefix + field.name)
    return paths


@pytest.mark.parametrize("flag", SETTINGS)
def test_each_setting_reaches_the_config_from_its_flag_and_its_variable(flag, monkeypatch):
    path, value = SETTINGS[flag]
    assert get(VerifierConfig(), path) != value
    assert get(parse_config([flag, str(value)]), path) == value
    monkeypatch.setenv("SPECDEC_VERIFIER_" + flag[2:].replace("-", "_").upper(), str(value))
    assert get(parse_config([]), path) == value
    assert get(parse_config([flag, str(value + 1)]), path) == value + 1  # the command line wins


def test_every_field_of_the_config_is_a_flag():
    """No setting can be added to the config (or the engine's, or the scheduler's) without reaching the command line."""
    derived = {".".join(flag.path) for flag in flags(VerifierConfig)}
    assert derived == set(leaf_paths(VerifierConfig))
    assert {"engine.max_adaptive_k", "scheduler.max_queued", "calibrate", "drafter.target", "tls_cert", "metrics_port"} <= derived


def test_without_flags_the_config_is_the_dataclass_default():
    assert parse_config([]) == VerifierConfig()


def test_help_lists_every_flag_with_its_variable_and_default(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for flag in flags(VerifierConfig):
        assert flag.option in shown, flag.option
        assert flag.variable("SPECDEC_VERIFIER_") in shown, flag.option
    assert "Prometheus /metrics port (0: a free one; -1 or none: off) (SPECDEC_VERIFIER_METRICS_PORT; default 9102)" in shown
    assert "--drafter DRAFTER the drafter service: HOST:PORT, replicas sharing one learned state as HOST:PORT,HOST:PORT" in shown
    assert "(none: no speculation) (SPECDEC_VERIFIER_DRAFTER; default none)" in shown
    assert "(SPECDEC_VERIFIER_TLS_CERT; default none)" in shown


@pytest.mark.parametrize("flag", ["--metrics-port", "--health-port"])
def test_a_port_is_off_at_minus_one_or_none(flag):
    path = flag[2:].replace("-", "_")
    assert getattr(parse_config([flag, "-1"]), path) is None
    assert getattr(parse_config([flag, "none"]), path) is None
    assert getattr(parse_config([flag, "0"]), path) == 0


def test_the_drafter_link_reaches_the_client_config():
    link = parse_config(["--drafter", "10.0.0.2:50051", "--drafter-tls-ca", "ca.pem", "--drafter-observe-timeout-seconds", "3"]).drafter
    assert (link.target, link.tls_ca, link.observe_timeout_s, link.vocabulary) == ("10.0.0.2:50051", "ca.pem", 3.0, "")


def test_a_bool_setting_that_defaults_on_has_a_no_flag_and_variable(monkeypatch):
    assert parse_config([]).calibrate is True
    assert parse_config(["--no-calibrate"]).calibrate is False
    monkeypatch.setenv("SPECDEC_VERIFIER_NO_CALIBRATE", "1")
    assert parse_config([]).calibrate is False
    monkeypatch.setenv("SPECDEC_VERIFIER_NO_CALIBRATE", "0")
    assert parse_config([]).calibrate is True


def test_an_optional_setting_takes_none(monkeypatch):
    assert parse_config(["--max-sequence-tokens", "512", "--max-sequence-tokens", "none"]).engine.max_sequence_tokens is None
    monkeypatch.setenv("SPECDEC_VERIFIER_MAX_SEQUENCE_TOKENS", "")
    assert parse_config([]).engine.max_sequence_tokens is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-stop-strings", "0"], "--max-stop-strings must be >= 1, got 0"),
        (["--max-stop-string-length", "0"], "--max-stop-string-length must be >= 1, got 0"),
        (["--max-message-bytes", "0"], "--max-message-bytes must be >= 1, got 0"),
        (["--max-batch-size", "0"], "--max-batch-size must be >= 1, got 0"),
        (["--max-speculative-tokens", "-1"], "--max-speculative-tokens must be >= 0, got -1"),
        (["--grace-seconds", "soon"], "argument --grace-seconds: invalid float value: 'soon'"),
        (["--max-sequence-tokens", "lots"], "argument --max-sequence-tokens: invalid int or none value: 'lots'"),
        (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        (["--drafter-tls-cert", "c.pem"], "--drafter-tls-cert and --drafter-tls-key go together"),
        (["--drafter-tls-cert", "c.pem", "--drafter-tls-key", "k.pem"], "--drafter-tls-cert needs --drafter-tls-ca"),
        (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["--metrics-port", "-2"], "--metrics-port must be >= 0, got -2"),
        (["--drafter-timeout-seconds", "0"], "--drafter-timeout-seconds must be >= 0.001, got 0.0"),
        (["--draft-head-vocabulary", "1"], "--draft-head-vocabulary is 0 (every token the head was trained on) or at least 2, got 1"),
        (["--shared-scope", "docs"], "--shared-scope 'docs' is no scope of --api-key-file"),
        (["--scope-secret", "short"], "the scope secret must be at least 16 characters"),
        (["--scope-secret-file", "/nonexistent/secret"], "cannot read --scope-secret-file /nonexistent/secret"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_config(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_variable_is_a_usage_error_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_VERIFIER_MAX_QUEUED", "many")
    with pytest.raises(SystemExit) as exited:
        parse_config([])
    assert exited.value.code == 2
    assert "SPECDEC_VERIFIER_MAX_QUEUED: invalid literal for int() with base 10: 'many'" in capsys.readouterr().err


def test_the_health_port_is_off_unless_asked_for():
    assert parse_config([]).health_port is None
    assert parse_config(["--health-port", "-1"]).health_port is None
