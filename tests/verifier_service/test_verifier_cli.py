"""The verifier's command line: every setting has a flag and a SPECDEC_VERIFIER_* variable, and reaches the config."""

from __future__ import annotations

import dataclasses

import pytest

from specdec.flags import flags
from verifier_service.__main__ import parse_config
from verifier_service.server import SERVING_FIELDS, VerifierConfig

SETTINGS = {  # flag -> (config field path, a value other than its default)
    "--max-batch-size": ("engine.max_batch_size", 3),
    "--max-queued": ("scheduler.max_queued", 5),
    "--max-new-tokens-limit": ("engine.max_new_tokens_limit", 100),
    "--max-sequence-tokens": ("engine.max_sequence_tokens", 1024),
    "--prefill-chunk-tokens": ("engine.prefill_chunk_tokens", 64),
    "--max-speculative-tokens": ("engine.max_speculative_tokens", 4),
    "--adaptive-max-k": ("engine.adaptive_max_k", 5),
    "--max-message-bytes": ("max_message_bytes", 1 << 20),
    "--stop-strings-limit": ("engine.stop_strings_limit", 4),
    "--stop-string-length-limit": ("engine.stop_string_length_limit", 32),
    "--drafter-timeout": ("drafter_timeout_s", 0.5),
    "--drafter-backoff": ("drafter_backoff_s", 2.0),
    "--grace": ("grace_s", 3.0),
    "--health-port": ("health_port", 50062),
}


def get(config, path: str):
    for name in path.split("."):
        config = getattr(config, name)
    return config


def leaf_paths(cls, prefix: str = "") -> list[str]:
    paths = []
    for field in dataclasses.fields(cls):
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
    derived = {".".join(flag.path) for flag in flags(VerifierConfig, skip=SERVING_FIELDS)}
    assert derived | set(SERVING_FIELDS) == set(leaf_paths(VerifierConfig))
    assert {"engine.adaptive_max_k", "engine.max_batch_size", "scheduler.max_queued", "calibrate"} <= derived


def test_without_flags_the_config_is_the_dataclass_default_but_for_the_metrics_port():
    assert dataclasses.replace(parse_config([]), metrics_port=None) == VerifierConfig()


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
        (["--stop-strings-limit", "0"], "--stop-strings-limit must be >= 1, got 0"),
        (["--stop-string-length-limit", "0"], "--stop-string-length-limit must be >= 1, got 0"),
        (["--max-message-bytes", "0"], "--max-message-bytes must be >= 1, got 0"),
        (["--max-batch-size", "0"], "--max-batch-size must be >= 1, got 0"),
        (["--max-speculative-tokens", "-1"], "--max-speculative-tokens must be >= 0, got -1"),
        (["--grace", "soon"], "argument --grace: invalid float value: 'soon'"),
        (["--max-sequence-tokens", "lots"], "argument --max-sequence-tokens: invalid int or none value: 'lots'"),
        (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        (["--drafter-tls-cert", "c.pem"], "--drafter-tls-cert and --drafter-tls-key go together"),
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
