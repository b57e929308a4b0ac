"""Command-line flags and environment variables derived from config dataclasses.

Each field of a service's config dataclass is a flag, so a setting cannot
exist in the config without reaching the command line, and its default is
written once (as vLLM's ``EngineArgs.add_cli_args`` does). The rules:

* flag: the field's name with dashes, less a ``_s`` unit suffix (seconds):
  ``max_batch_size`` -> ``--max-batch-size``, ``grace_s`` -> ``--grace``;
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
* help, lower bound and choices come from the field's metadata (``setting``).

``add_flags`` declares the flags and ``from_args`` builds the config, checks
the bounds (a usage error names the flag), and nests the parts again.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

_BOOL_WORDS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    minimum: float | None = None,
    choices: Sequence[str] | None = None,
    flag: str | None = None,
    off: int | None = None,
    **kwargs,
) -> Any:
    """A config field with what its flag says: ``help``, the ``minimum`` and ``choices`` it
    accepts, its name when not the field's (``flag``, without dashes), and a number that
    also means None (``off``)."""
    metadata = {"help": help, "minimum": minimum, "choices": choices, "flag": flag, "off": off}
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def nested(factory: Callable[[], Any], *, prefix: str = "") -> Any:
    """A config dataclass inside another, its flags named ``prefix`` + their own names."""
    return dataclasses.field(default_factory=factory, metadata={"prefix": prefix})


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


def flags(cls: type, skip: Sequence[str] = ()) -> list[_Flag]:
    """The flags of config dataclass ``cls`` (and the dataclasses it nests), less the fields in ``skip``."""
    found = list(_walk(cls, (), set(skip), ""))
    names = [flag.name for flag in found]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise TypeError(f"{cls.__name__}: fields of nested configs share flag names {duplicated}; each setting needs one owner")
    return found


def _walk(cls: type, path: tuple[str, ...], skip: set[str], prefix: str) -> Iterator[_Flag]:
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for field in dataclasses.fields(cls):
        meta = field.metadata
        if field.name in skip or field.name.startswith("_") or meta.get("derived"):
            continue
        default = getattr(defaults, field.name)
        if dataclasses.is_dataclass(default):
            yield from _walk(type(default), (*path, field.name), skip, prefix + meta.get("prefix", ""))
            continue
        kind, optional = _kind(hints[field.name], f"{cls.__name__}.{field.name}")
        name = meta.get("flag") or prefix + field.name.removesuffix("_s").replace("_", "-")
        help_text = meta.get("help") or ""
        yield _Flag(
            (*path, field.name), name, kind, optional, default, help_text, meta.get("minimum"), meta.get("choices"), meta.get("off")
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
    return flag.kind(text)


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
    if flag.choices:
        return None  # argparse shows them
    if flag.path[-1].endswith("_s"):
        return "SECONDS"
    return {int: "N", float: "NUMBER"}.get(flag.kind) or flag.name.split("-")[-1].upper()


def add_flags(parser: argparse.ArgumentParser, cls: type, env_prefix: str, skip: Sequence[str] = ()) -> None:
    """Declare a flag for every field of ``cls``, its default from ``env_prefix`` + NAME when set."""
    for flag in flags(cls, skip):
        variable = flag.variable(env_prefix)
        default = flag.default
        if variable in os.environ:
            try:
                default = _parse(flag, os.environ[variable])
            except ValueError as error:
                parser.error(f"{variable}: {error}")
            if flag.kind is bool and flag.default:  # NO_NAME=1: the field is off
                default = not default
        if flag.kind is bool:
            action = "store_false" if flag.default else "store_true"
            help_text = f"{'off: ' if flag.default else ''}{flag.help} ({variable}=1)"
            parser.add_argument(flag.option, dest=flag.dest, action=action, default=default, help=help_text)
            continue
        shown = "none" if flag.default is None else flag.default
        help_text = f"{flag.help} ({variable}; default {shown})"
        parser.add_argument(
            flag.option,
            dest=flag.dest,
            type=_parser(flag),
            default=default,
            choices=flag.choices,
            metavar=_metavar(flag),
            help=help_text,
        )


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
