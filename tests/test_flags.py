"""specdec.flags on configs of its own: naming rules, nesting, and refusing what it cannot derive."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from specdec.flags import add_flags, format_size, from_args, nested, parse_size, setting, warn_unknown_variables


@dataclass(frozen=True)
class Inner:
    depth: int = setting(3, minimum=1, help="how deep")


@dataclass(frozen=True)
class Outer:
    timeout_s: float = setting(0.5, help="seconds to wait")
    verbose: bool = setting(False, help="say more")
    name: str | None = setting(None, help="who")
    inner: Inner = field(default_factory=Inner)
    given: int = 0  # left to the caller


def parse(argv, cls=Outer, **given):
    parser = argparse.ArgumentParser()
    add_flags(parser, cls, "TEST_", skip=("given",))
    return from_args(parser, cls, parser.parse_args(argv), skip=("given",), **given)


def test_names_units_bools_nesting_and_given_fields():
    assert parse([]) == Outer()
    config = parse(["--timeout-seconds", "2", "--verbose", "--name", "x", "--depth", "5"], given=7)
    assert config == Outer(2.0, True, "x", Inner(5), 7)


def test_variables_follow_the_flag_names(monkeypatch):
    monkeypatch.setenv("TEST_TIMEOUT_SECONDS", "1.5")
    monkeypatch.setenv("TEST_VERBOSE", "yes")
    monkeypatch.setenv("TEST_DEPTH", "9")
    assert parse([]) == Outer(1.5, True, None, Inner(9))


def test_nested_configs_may_not_share_a_flag():
    @dataclass(frozen=True)
    class Clash:
        depth: int = 1
        inner: Inner = field(default_factory=Inner)

    with pytest.raises(TypeError, match=r"share flag names \['depth'\]; each setting needs one owner"):
        parse([], cls=Clash)


def test_a_field_of_a_type_no_flag_can_carry_is_refused():
    @dataclass(frozen=True)
    class Listy:
        items: list = field(default_factory=list)

    with pytest.raises(TypeError, match=r"Listy.items: a flag needs int, float, str or bool"):
        parse([], cls=Listy)


@dataclass(frozen=True)
class Renamed:
    max_depth: int = setting(3, formerly=["depth-limit"], help="how deep")
    wait_s: float = setting(1.0, help="seconds to wait")


def test_former_names_still_work_and_say_what_replaced_them(monkeypatch, capsys):
    assert parse(["--depth-limit", "7", "--wait", "2"], cls=Renamed) == Renamed(7, 2.0)
    err = capsys.readouterr().err
    assert "--depth-limit is deprecated and will be removed; use --max-depth" in err
    assert "--wait is deprecated and will be removed; use --wait-seconds" in err
    monkeypatch.setenv("TEST_DEPTH_LIMIT", "9")
    assert parse([], cls=Renamed) == Renamed(9, 1.0)
    assert "TEST_DEPTH_LIMIT is deprecated and will be removed; use TEST_MAX_DEPTH" in capsys.readouterr().err
    monkeypatch.setenv("TEST_MAX_DEPTH", "4")  # the new name wins over the old
    assert parse([], cls=Renamed) == Renamed(4, 1.0)


def test_former_names_stay_out_of_help():
    parser = argparse.ArgumentParser()
    add_flags(parser, Renamed, "TEST_")
    text = parser.format_help()
    assert "--max-depth" in text and "--wait-seconds" in text
    assert "--depth-limit" not in text and "--wait " not in text


@dataclass(frozen=True)
class Sized:
    max_bytes: int = setting(8 << 20, minimum=1024, help="bytes kept")
    cache_bytes: int | None = setting(None, help="bytes cached")


@pytest.mark.parametrize(
    "text, size",
    [("65536", 65536), ("64KiB", 64 << 10), ("8MiB", 8 << 20), ("1GiB", 1 << 30), ("8M", 8 << 20), ("8MB", 8_000_000), ("1.5kib", 1536)],
)
def test_byte_flags_take_sizes(text, size):
    assert parse_size(text) == size
    assert parse(["--max-bytes", text], cls=Sized).max_bytes == size


@pytest.mark.parametrize("text", ["8 MiBs", "MiB", "1.5", "-3", "8iB", "0.3KiB"])
def test_a_size_that_is_no_whole_number_of_bytes_is_a_usage_error(text, capsys):
    with pytest.raises(SystemExit):
        parse(["--max-bytes", text], cls=Sized)
    assert "--max-bytes" in capsys.readouterr().err


def test_byte_defaults_are_shown_in_binary_units():
    assert [format_size(n) for n in (8 << 20, 1 << 30, 1536, 1000, 0)] == ["8MiB", "1GiB", "1536", "1000", "0"]
    parser = argparse.ArgumentParser()
    add_flags(parser, Sized, "TEST_")
    text = " ".join(parser.format_help().split())
    assert "--max-bytes BYTES bytes kept (TEST_MAX_BYTES; default 8MiB)" in text


@dataclass(frozen=True)
class Grouped:
    port: int = setting(1, group="server", help="port")
    inner: Inner = nested(Inner, group="inner things")
    loose: int = setting(2, help="no group")


def test_help_lists_flags_in_their_groups():
    parser = argparse.ArgumentParser()
    add_flags(parser, Grouped, "TEST_")
    text = parser.format_help().split("options:")[1]
    assert text.index("server:") < text.index("--port") < text.index("inner things:") < text.index("--depth")
    assert text.index("general:") < text.index("--loose")


def test_variables_that_name_no_flag_are_reported(monkeypatch, capsys):
    monkeypatch.setenv("TEST_DEPTH_LIMIT", "1")  # a former name: known
    monkeypatch.setenv("TEST_WAIT", "1")  # a seconds flag's former name: known
    monkeypatch.setenv("TEST_MAX_DEPHT", "1")
    parser = argparse.ArgumentParser(prog="prog")
    warn_unknown_variables(parser, Renamed, "TEST_")
    assert capsys.readouterr().err == "prog: TEST_MAX_DEPHT names no flag and is ignored (--help lists each flag's variable)\n"


def test_an_on_off_flag_cannot_keep_a_former_name():
    @dataclass(frozen=True)
    class Toggled:
        quiet: bool = setting(False, formerly=["silent"], help="say less")

    with pytest.raises(TypeError, match="Toggled.quiet: a renamed on/off flag keeps no alias"):
        parse([], cls=Toggled)
