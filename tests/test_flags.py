"""specdec.flags on configs of its own: naming rules, nesting, and refusing what it cannot derive."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from specdec.flags import add_flags, from_args, setting


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
    config = parse(["--timeout", "2", "--verbose", "--name", "x", "--depth", "5"], given=7)
    assert config == Outer(2.0, True, "x", Inner(5), 7)


def test_variables_follow_the_flag_names(monkeypatch):
    monkeypatch.setenv("TEST_TIMEOUT", "1.5")
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
