"""Command-line flags and environment variables derived from config dataclasses.

Each field of a service's config dataclass is a flag, so a setting cannot
exist in the config without reaching the command line, and its default is
written once (as vLLM's ``EngineArgs.add_cli_args`` does). The rules:

* flag: the field's name with dashes, its ``_s`` unit suffix spelled out:
  ``max_batch_size`` -> ``--max-batch-size``, ``grace_s`` -> ``--grace-seconds``;
  a ``_bytes`` field takes sizes (``8MiB``, ``1GiB``, ``65536``) and shows its default so;
* a ``bool`` field that defaults to True is turned off by ``--no-NAME``
  (``calibrate`` -> ``--no-calibrate``); one that defaults to False is turned on by ``--NAME``;
* environment variable: the prefix plus the flag's name in upper case with
  underscores (``SPECDEC_VERIFIER_MAX_BATCH_SIZE``, ``SPECDEC_VERIFIER_NO_CALIBRATE``);
  a flag given on the command line wins; a bool variable gives its flag for
  1/true/yes and not for 0/false/no;
* ``T | None`` fields take ``none`` (or an empty variable) for None, and
  the ``off`` value a setting names (``--metrics-port -1``) too;
* a field whose default is itself a dataclass is flattened into its fields'
  flags, their names behind the ``prefix`` its ``nested`` declaration gives
  (``drafter.backoff_s`` -> ``--drafter-backoff``);
* a setting may name its flag outright (``flag="drafter"``), and a field
  that is set at run time, never by hand, is ``derived`` (no flag);
* help, lower bound and choices come from the field's metadata (``setting``); a
  ``bool`` field's help says what its flag does (``--no-calibrate``: what skipping does);
* ``--help`` lists the flags in groups: a field's ``group``, else the group its
  nested config is declared with;
* a renamed flag keeps its old names (``formerly``; a seconds flag also its name
  without the unit) as hidden aliases, flag and variable, that warn when used.

``add_flags`` declares the flags and ``from_args`` builds the config, checks
the bounds (a usage error names the flag), and nests the parts again.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

GENERAL = "general"  # the --help group of a flag that names none
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    minimum: float | None = None,
    choices: Sequence[str] | None = None,
    flag: str | None = None,
    off: int | None = None,
    group: str | None = None,
    formerly: Sequence[str] = (),
    **kwargs,
) -> Any:
    """A config field with what its flag says: ``help``, the ``minimum`` and ``choices`` it
    accepts, its name when not the field's (``flag``, without dashes), a number that
    also means None (``off``), the ``--help`` group it is listed in, and the names it
    had before (``formerly``, without dashes), still accepted."""
    metadata = {"help": help, "minimum": minimum, "choices": choices, "flag": flag, "off": off, "group": group, "formerly": tuple(formerly)}
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def nested(factory: Callable[[], Any], *, prefix: str = "", group: str | None = None) -> Any:
    """A config dataclass inside another, its flags named ``prefix`` + their own names and
    listed under ``group`` (unless a field names its own)."""
    return dataclasses.field(default_factory=factory, metadata={"prefix": prefix, "group": group})


def derived(default: Any) -> Any:
    """A field the program sets at run time (no flag, no variable)."""
    return dataclasses.field(default=default, metadata={"derived": True})


@dataclasses.dataclass(frozen=True)
class _Flag:
    path: tuple[str, ...]  # field names from the top config down to this field
    name: str  # flag without dashes: max-batch-size
    kind: type  # int, float, str or bool
    optional: bool  # None allowed
    default: Any
    help: str
    minimum: float | None
    choices: Sequence[str] | None
    off: int | None = None  # a number the flag also takes for None
    group: str = GENERAL
    formerly: tuple[str, ...] = ()  # older names, without dashes, still accepted

    @property
    def is_bytes(self) -> bool:
        return self.kind is int and "bytes" in self.path[-1].split("_")

    @property
    def is_seconds(self) -> bool:
        return self.path[-1].endswith("_s")

    @property
    def dest(self) -> str:
        return "__".join(self.path)

    @property
    def option(self) -> str:
        if self.kind is bool and self.default:
            return "--no-" + self.name
        return "--" + self.name

    def variable(self, prefix: str) -> str:
        return prefix + self.option[2:].replace("-", "_").upper()

    def former_variables(self, prefix: str) -> list[str]:
        """The variables of its former names (an on/off flag has none: ``_walk`` refuses them)."""
        return [prefix + old.replace("-", "_").upper() for old in self.formerly]

    @property
    def metavar(self) -> str:
        """What stands for its value in ``--help`` and the reference: SECONDS, BYTES, N, NUMBER or its name's last word."""
        if self.is_seconds:
            return "SECONDS"
        if self.is_bytes:
            return "BYTES"
        return {int: "N", float: "NUMBER"}.get(self.kind) or self.name.split("-")[-1].upper()

    def shown_default(self) -> str:
        """The default as ``--help`` and the reference write it: 8MiB, 10s, none."""
        if self.default is None:
            return "none"
        if self.is_bytes:
            return format_size(self.default)
        if self.is_seconds:
            return f"{self.default:g}s"
        return str(self.default)


def flags(cls: type, skip: Sequence[str] = ()) -> list[_Flag]:
    """The flags of config dataclass ``cls`` (and the dataclasses it nests), less the fields in ``skip``."""
    found = list(_walk(cls, (), set(skip), ""))
    names = [flag.name for flag in found]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise TypeError(f"{cls.__name__}: fields of nested configs share flag names {duplicated}; each setting needs one owner")
    return found


def _walk(cls: type, path: tuple[str, ...], skip: set[str], prefix: str, group: str = GENERAL) -> Iterator[_Flag]:
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for field in dataclasses.fields(cls):
        meta = field.metadata
        if field.name in skip or field.name.startswith("_") or meta.get("derived"):
            continue
        default = getattr(defaults, field.name)
        if dataclasses.is_dataclass(default):
            inner = meta.get("group") or group
            yield from _walk(type(default), (*path, field.name), skip, prefix + meta.get("prefix", ""), inner)
            continue
        kind, optional = _kind(hints[field.name], f"{cls.__name__}.{field.name}")
        formerly = tuple(meta.get("formerly") or ())
        if kind is bool and formerly:
            raise TypeError(f"{cls.__name__}.{field.name}: a renamed on/off flag keeps no alias (its aliases store values only)")
        if meta.get("flag"):
            name = meta["flag"]
        elif field.name.endswith("_s"):
            name = prefix + field.name.removesuffix("_s").replace("_", "-") + "-seconds"
            formerly += (prefix + field.name.removesuffix("_s").replace("_", "-"),)
        else:
            name = prefix + field.name.replace("_", "-")
        yield _Flag(
            (*path, field.name),
            name,
            kind,
            optional,
            default,
            meta.get("help") or "",
            meta.get("minimum"),
            meta.get("choices"),
            meta.get("off"),
            meta.get("group") or group,
            formerly,
        )


def _kind(hint: Any, where: str) -> tuple[type, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        [inner] = [arg for arg in args if arg is not type(None)]
        return _kind(inner, where)[0], True
    if hint in (int, float, str, bool):
        return hint, False
    raise TypeError(f"{where}: a flag needs int, float, str or bool (or one of them | None), not {hint}")


def _parse(flag: _Flag, text: str) -> Any:
    if flag.optional and (text.strip().lower() in ("", "none") or flag.off is not None and text.strip() == str(flag.off)):
        return None
    if flag.kind is bool:
        try:
            return _BOOL_WORDS[text.strip().lower()]
        except KeyError:
            raise ValueError(f"expected one of {sorted(_BOOL_WORDS)}, got {text!r}") from None
    if flag.is_bytes:
        return parse_size(text)
    return flag.kind(text)


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)
_SIZE_UNITS = "kmgt"


def parse_size(text: str) -> int:
    """Bytes from ``65536``, ``64KiB``, ``8MiB``, ``1GiB``, ``8M`` (binary) or ``8MB`` (decimal)."""
    match = _SIZE.fullmatch(text)
    if match is None or (match[3] and not match[2]):
        raise ValueError(f"expected a size in bytes such as 65536, 64KiB, 8MiB or 1GiB, got {text!r}")
    number, unit, binary, b = match.groups()
    scale = 1
    if unit:
        power = _SIZE_UNITS.index(unit.lower()) + 1
        scale = 1000**power if b and not binary else 1024**power
    value = float(number) * scale
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def format_size(value: int) -> str:
    """The shortest exact binary form of a byte count: 8388608 -> 8MiB, 1000 -> 1000."""
    for power in range(len(_SIZE_UNITS), 0, -1):
        if value and value % 1024**power == 0:
            return f"{value // 1024**power}{_SIZE_UNITS[power - 1].upper()}iB"
    return str(value)


def check_minimums(config: Any) -> None:
    """Raise ValueError for a field of ``config`` below its ``setting`` minimum (for configs built in-process)."""
    for field in dataclasses.fields(config):
        minimum, value = field.metadata.get("minimum"), getattr(config, field.name)
        if minimum is not None and value is not None and value < minimum:
            raise ValueError(f"{field.name} must be >= {minimum}, got {value}")


def _parser(flag: _Flag):
    def parse(text: str) -> Any:
        return _parse(flag, text)

    parse.__name__ = flag.kind.__name__ + (" or none" if flag.optional else "")  # argparse's "invalid int value: 'x'"
    return parse


def _metavar(flag: _Flag) -> str | None:
    return None if flag.choices else flag.metavar  # argparse shows choices itself


def _warn_renamed(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    print(f"{parser.prog}: {old} is deprecated and will be removed; use {new}", file=sys.stderr)


class _Renamed(argparse.Action):
    """A flag's former name: stores into the flag's destination and says it was renamed."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        _warn_renamed(parser, option_string or self.option_strings[0], self.new)
        setattr(namespace, self.dest, values)


def _environment(parser: argparse.ArgumentParser, flag: _Flag, prefix: str) -> tuple[str, str] | None:
    """(variable, text) of the variable that sets ``flag``: its own, else a former name's (warned)."""
    variable = flag.variable(prefix)
    if variable in os.environ:
        return variable, os.environ[variable]
    for former in flag.former_variables(prefix):
        if former in os.environ:
            _warn_renamed(parser, former, variable)
            return former, os.environ[former]
    return None


def add_flags(parser: argparse.ArgumentParser, cls: type, env_prefix: str, skip: Sequence[str] = ()) -> None:
    """Declare a flag for every field of ``cls``, in ``--help`` groups, its default from
    ``env_prefix`` + NAME when set."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in flags(cls, skip):
        group = groups.get(flag.group)
        if group is None:
            group = groups[flag.group] = parser.add_argument_group(flag.group)
        variable = flag.variable(env_prefix)
        default = flag.default
        given = _environment(parser, flag, env_prefix)
        if given is not None:
            try:
                default = _parse(flag, given[1])
            except ValueError as error:
                parser.error(f"{given[0]}: {error}")
            if flag.kind is bool and flag.default:  # NO_NAME=1: the field is off
                default = not default
        if flag.kind is bool:
            action = "store_false" if flag.default else "store_true"
            group.add_argument(flag.option, dest=flag.dest, action=action, default=default, help=f"{flag.help} ({variable}=1)")
            continue
        help_text = f"{flag.help} ({variable}; default {flag.shown_default()})"
        kwargs: dict[str, Any] = {"dest": flag.dest, "type": _parser(flag), "choices": flag.choices, "metavar": _metavar(flag)}
        group.add_argument(flag.option, default=default, help=help_text, **kwargs)
        for old in flag.formerly:
            group.add_argument("--" + old, action=_Renamed, new=flag.option, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


def warn_unknown_variables(parser: argparse.ArgumentParser, cls: type, env_prefix: str) -> None:
    """Say which ``env_prefix`` variables name no flag of ``cls`` (a typo, or a flag since
    removed), since they are otherwise ignored without a word."""
    known = set()
    for flag in flags(cls):
        known.update([flag.variable(env_prefix), *flag.former_variables(env_prefix)])
    for variable in sorted(name for name in os.environ if name.startswith(env_prefix) and name not in known):
        print(f"{parser.prog}: {variable} names no flag and is ignored (--help lists each flag's variable)", file=sys.stderr)


def from_args(parser: argparse.ArgumentParser, cls: type, args: argparse.Namespace, skip: Sequence[str] = (), **given: Any) -> Any:
    """``cls`` from the flags ``add_flags`` declared (bounds checked: a usage error names
    the flag), with ``given`` for the top-level fields left out by ``skip``."""
    values: dict[tuple[str, ...], Any] = {}
    for flag in flags(cls, skip):
        value = getattr(args, flag.dest)
        if flag.minimum is not None and value is not None and value < flag.minimum:
            parser.error(f"{flag.option} must be >= {flag.minimum}, got {value}")
        values[flag.path] = value
    return _build(cls, (), values, given)


def _build(cls: type, path: tuple[str, ...], values: dict, given: dict) -> Any:
    defaults = cls()
    kwargs = {}
    for field in dataclasses.fields(cls):
        key = (*path, field.name)
        if key in values:
            kwargs[field.name] = values[key]
        elif not path and field.name in given:
            kwargs[field.name] = given[field.name]
        elif dataclasses.is_dataclass(getattr(defaults, field.name)):
            kwargs[field.name] = _build(type(getattr(defaults, field.name)), key, values, given)
    return cls(**kwargs)
