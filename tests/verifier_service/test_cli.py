"""The verifier's command line: every limit has a flag and a SPECDEC_VERIFIER_* variable, and reaches the config."""

from __future__ import annotations

import pytest

from verifier_service.__main__ import parse_config
from verifier_service.server import VerifierConfig

LIMIT_FLAGS = {  # flag -> (config field, a value other than its default)
    "--max-batch-size": ("max_batch_size", 3),
    "--max-queued": ("max_queued", 5),
    "--max-new-tokens-limit": ("max_new_tokens_limit", 100),
    "--max-sequence-tokens": ("max_sequence_tokens", 1024),
    "--prefill-chunk-tokens": ("prefill_chunk_tokens", 64),
    "--max-speculative-tokens": ("max_speculative_tokens", 4),
    "--max-message-bytes": ("max_message_bytes", 1 << 20),
    "--stop-strings-limit": ("stop_strings_limit", 4),
    "--stop-string-length-limit": ("stop_string_length_limit", 32),
    "--health-port": ("health_port", 50062),
}


@pytest.mark.parametrize("flag", LIMIT_FLAGS)
def test_each_limit_reaches_the_config_from_its_flag_and_its_variable(flag, monkeypatch):
    field, value = LIMIT_FLAGS[flag]
    assert getattr(VerifierConfig(), field) != value
    assert getattr(parse_config([flag, str(value)]), field) == value
    monkeypatch.setenv("SPECDEC_VERIFIER_" + flag[2:].replace("-", "_").upper(), str(value))
    assert getattr(parse_config([]), field) == value


@pytest.mark.parametrize("flag", ["--stop-strings-limit", "--stop-string-length-limit", "--max-message-bytes"])
def test_a_limit_below_one_is_a_usage_error(flag, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_config([flag, "0"])
    assert exited.value.code == 2
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err


def test_the_health_port_is_off_unless_asked_for():
    assert parse_config([]).health_port is None
    assert parse_config(["--health-port", "-1"]).health_port is None
