"""Typed config dataclasses and the small helper that turns their fields into CLI flags.

Each part of mileage declares its own dataclass next to the code it configures (torchtitan style);
`option()` attaches the flag name and help text to a field, and `add_options`/`from_namespace`
build the argparse group and read it back. There is no central arguments file.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import threading
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from mileage.errors import UserError

T = TypeVar("T")

# the range of a signed 64-bit integer: torch, numpy and the checkpoint's JSON readers hold every
# integer flag in one, so a value past it overflows somewhere downstream (a --seed of 2**70 did)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def finite_float(text: str) -> float:
    """argparse type of every float flag: a number, never nan or +-inf (which compare false
    against every bound, so no range check after parsing could refuse them)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int64(text: str) -> int:
    """argparse type of every integer flag: an integer within the signed 64-bit range."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not INT64_MIN <= value <= INT64_MAX:
        raise argparse.ArgumentTypeError(
            f"{text} does not fit a signed 64-bit integer (the range torch and the checkpoint "
            f"files hold integers in): give a value from {INT64_MIN} to {INT64_MAX}"
        )
    return value


def timeout_seconds(text: str) -> float:
    """argparse type of every `*_timeout` float flag: seconds a wait can be given (positive, at
    most the longest wait Python's threading and sockets take; more raised OverflowError
    mid-run)."""
    value = finite_float(text)
    if not 0 < value <= threading.TIMEOUT_MAX:
        raise argparse.ArgumentTypeError(
            f"expected seconds above 0 and at most {threading.TIMEOUT_MAX:g} (the longest wait "
            f"Python can make), got {text!r}"
        )
    return value


# the argparse type each annotated type parses with (others parse with the type itself)
PARSERS: dict[Any, Callable[[str], Any]] = {float: finite_float, int: int64}


def _parser_of(kind: Any, name: str = "") -> Callable[[str], Any]:
    if kind is float and name.endswith("_timeout"):
        return timeout_seconds
    return PARSERS.get(kind, kind)


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: typing.Sequence[Any] | None = None,
    nargs: str | None = None,
) -> Any:
    """A dataclass field that is also a CLI flag (`--field-name` unless `flag` is given).

    A list field is repeatable (each use appends one value), or with `nargs="+"` takes all its
    values after one flag (miles' `--eval-prompt-data name path [name path ...]`).

    A bool field whose default is False becomes a `store_true` switch; one whose default is True
    needs an explicit negative `flag` such as `--no-load-optim` and becomes `store_false`.
    """
    meta = {"help": help, "flag": flag, "choices": choices, "nargs": nargs}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _base_type(annotation: Any) -> Any:
    """int | None -> int; leaves plain types alone."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def _flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def add_options(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """Register every `option()` field of dataclass `cls` as a flag in a group named `title`."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if "help" not in field.metadata:
            continue
        name = _flag_name(field)
        default = (
            field.default if field.default is not dataclasses.MISSING else field.default_factory()
        )
        kind = _base_type(hints[field.name])
        if typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            if field.metadata.get("nargs"):
                group.add_argument(
                    name,
                    dest=field.name,
                    nargs=field.metadata["nargs"],
                    type=_parser_of(item),
                    default=None,
                    help=field.metadata["help"],
                    metavar=item.__name__.upper(),
                )
                continue
            # a repeatable flag: each use appends one value
            group.add_argument(
                name,
                dest=field.name,
                action="append",
                type=_parser_of(item),
                default=None,
                help=field.metadata["help"] + " (repeatable)",
                metavar=item.__name__.upper(),
            )
            continue
        if kind is bool and default is None:  # --flag / --no-flag / neither (decided later)
            group.add_argument(
                name,
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=field.metadata["help"],
            )
            continue
        if kind is bool:
            action = "store_false" if default else "store_true"
            if default and not field.metadata.get("flag"):
                raise TypeError(
                    f"{cls.__name__}.{field.name}: a True-default bool needs a --no-... flag"
                )
            group.add_argument(name, dest=field.name, action=action, help=field.metadata["help"])
            continue
        group.add_argument(
            name,
            dest=field.name,
            type=_parser_of(kind, field.name),
            default=default,
            choices=field.metadata.get("choices"),
            help=field.metadata["help"],
            metavar=None if field.metadata.get("choices") else kind.__name__.upper(),
        )


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    """Build dataclass `cls` from the parsed flags (fields without a flag keep their default)."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    for name, value in values.items():
        if isinstance(value, list) and not _is_list_field(cls, name):
            # argparse turns `--flag=--` into an empty list, not an error
            raise UserError(f"argument {flag_of(cls, name)}: expected one value, got {value!r}")
    # a repeatable flag never given parses as None; the field's default is an empty list
    values = {k: v for k, v in values.items() if v is not None or not _is_list_field(cls, k)}
    return cls(**values)


def _is_list_field(cls: type, name: str) -> bool:
    return typing.get_origin(_base_type(typing.get_type_hints(cls)[name])) is list


def flag_of(cls: type, field_name: str) -> str:
    """The CLI spelling of a config field, for error messages that name the flag."""
    for field in dataclasses.fields(cls):
        if field.name == field_name:
            return _flag_name(field)
    raise KeyError(field_name)
