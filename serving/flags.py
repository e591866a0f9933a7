"""Command-line flags generated from a frozen dataclass: one field per flag.

Used by `cpkv-serve` (`serving.server_args.ServerArgs`) and `cpkv-router`
(`serving.router.config.RouterConfig`). Each field is declared with `arg(...)`, which
keeps its help text (and, optionally, help group, parser, metavar, and whatever else a
caller wants to read back) in `dataclasses.field(metadata=...)`. The flag name is the
field name with dashes (`page_size` -> `--page-size`), and the argparse wiring comes
from the annotation:

- `bool` -> `--flag` (store_true; the field must default to False);
- `Literal[...]` -> `choices`;
- `tuple[X, ...]` -> one or more values, repeatable (`--f A B --f C` -> `("A", "B", "C")`);
- `int` / `float` / `str` -> that type; `X | None` also accepts `none` (-> None);
- `metadata["parse"]` (e.g. a byte-size reader) replaces the annotation's converter.

A field without a default is a required flag. Every flag but a bool or tuple one says
its default in its help (`metadata["format_default"]` renders it, e.g. `2GiB`).

Secrets (API keys): `arg(..., env="NAME", secret=True)`. `env`: when the flag is not
given, `from_cli` takes the value of that environment variable (when it is set), so the
value need not be on the command line, which any user of the machine can read; the help
names the variable, never its value. `secret`: the dataclass `repr` leaves the field
out and `redacted_dict` prints `<redacted>` for it, so logs and `--check-config` never
show it.

Parse errors raise the caller's error class with argparse's one-line message
(`RaisingParser`), instead of printing usage and exiting; `--help` still exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

T = TypeVar("T")


def arg(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    group: str | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    format_default: Callable[[Any], str] | None = None,
    env: str | None = None,
    secret: bool = False,
    **extra: Any,
) -> Any:
    """A dataclass field that is one flag.

    help: the flag's help text; group: the key of its help group (see
    `add_dataclass_args`); parse: converts the command-line string instead of the
    annotation's type; metavar: the value's name in `--help`; format_default: renders the
    default in the help; env: the environment variable `from_cli` reads when the flag is
    not given; secret: keep the value out of `repr` and `redacted_dict`. `extra` is
    stored in the metadata as is, for the caller.
    """
    metadata = {
        "help": help,
        "group": group,
        "parse": parse,
        "metavar": metavar,
        "format_default": format_default,
        "env": env,
        "secret": secret,
        **extra,
    }
    return dataclasses.field(default=default, metadata=metadata, repr=not secret)


def flag_name(field_name: str) -> str:
    """`page_size` -> `--page-size`."""
    return "--" + field_name.replace("_", "-")


def unwrap_optional(tp: Any) -> tuple[bool, Any]:
    """`X | None` -> (True, X); `X` -> (False, X)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != len(typing.get_args(tp)) - 1 or len(args) != 1:
            raise TypeError(f"only `X | None` unions are supported as flag types, got {tp}")
        return True, args[0]
    return False, tp


def parse_int(text: str) -> int:
    """`int`, with a message that names what was expected."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def parse_float(text: str) -> float:
    """`float`, with a message that names what was expected."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def _cli_converter(convert: Callable[[str], Any], optional: bool) -> Callable[[str], Any]:
    """argparse `type=`: `none` -> None when optional; our message survives argparse."""

    def parse(text: str) -> Any:
        if optional and text.strip().lower() == "none":
            return None
        try:
            return convert(text)
        except (ValueError, TypeError) as e:
            # argparse replaces a ValueError's text by "invalid <type> value"; keep ours.
            raise argparse.ArgumentTypeError(str(e) or f"invalid value {text!r}") from e

    return parse


def default_text(default: Any, meta: Mapping[str, Any]) -> str:
    """How `--help` shows a default: `none`, `''`, or `meta["format_default"]`/`str`."""
    if default is None:
        return "none"
    if meta.get("format_default") is not None:
        return meta["format_default"](default)
    if default == "":
        return "''"
    return str(default)


class RaisingParser(argparse.ArgumentParser):
    """Parse errors raise `error_class(message)` (one line) instead of usage + exit."""

    def __init__(self, *args: Any, error_class: type[Exception], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.error_class = error_class

    def error(self, message: str) -> typing.NoReturn:
        raise self.error_class(message)


def add_dataclass_args(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    groups: Mapping[str, str] | None = None,
    converters: Mapping[type, Callable[[str], Any]] | None = None,
    type_metavar: bool = False,
    help_format: Mapping[str, Any] | None = None,
) -> None:
    """Add one flag per field of the dataclass `cls` to `parser`.

    groups: help-group key -> title, in `--help` order; every field's `group` must be one
        of them. None: the flags go into the parser's own options.
    converters: the string -> value function per annotation type (`int`, `float`, `str`).
        A converter that is the type itself is handed to argparse as is (its message:
        "invalid int value: 'x'"); any other is wrapped so its own message is kept.
        Default: the types themselves.
    type_metavar: a typed flag without a `metavar` shows its type (`INT`) instead of
        argparse's default (the flag's name upper-cased).
    help_format: `str.format` keywords applied to every help text (None: texts as is).
    """
    converters = converters if converters is not None else {}
    hints = typing.get_type_hints(cls)
    containers: dict[str, Any] = {}
    if groups is not None:
        containers = {key: parser.add_argument_group(title) for key, title in groups.items()}
    for f in dataclasses.fields(cls):
        optional, base = unwrap_optional(hints[f.name])
        meta = f.metadata
        help_text = meta["help"] if help_format is None else meta["help"].format(**help_format)
        kwargs: dict[str, Any] = {"dest": f.name}
        is_tuple = typing.get_origin(base) is tuple
        if f.default is dataclasses.MISSING:
            kwargs["required"] = True
        elif is_tuple:
            kwargs["default"] = None  # `extend` would add to the default; `from_cli` fills it
        else:
            kwargs["default"] = f.default
            shown = default_text(f.default, meta)
            if meta.get("env"):  # the variable's name, never its value
                help_text += f" (default: ${meta['env']} if set, else {shown})"
            elif base is not bool:
                help_text += f" (default: {shown})"
        if base is bool:
            if f.default is not False:
                raise TypeError(f"boolean flag {f.name} must default to False")
            kwargs["action"] = "store_true"
        elif typing.get_origin(base) is Literal:
            kwargs["choices"] = typing.get_args(base)
            if optional:
                raise TypeError(f"{f.name}: optional Literal flags are not supported")
            if meta["metavar"]:
                kwargs["metavar"] = meta["metavar"]
        else:
            if is_tuple:
                item, ellipsis = typing.get_args(base)
                if ellipsis is not Ellipsis:
                    raise TypeError(f"{f.name}: only `tuple[X, ...]` flags are supported")
                kwargs.update(nargs="+", action="extend")
                base = item
            convert = meta["parse"] or converters.get(base, base)
            if convert is base and not optional:
                kwargs["type"] = base
            else:
                kwargs["type"] = _cli_converter(convert, optional)
            if meta["metavar"] or type_metavar:
                kwargs["metavar"] = meta["metavar"] or base.__name__.upper()
        kwargs["help"] = help_text
        container = parser if groups is None else containers[meta["group"]]
        container.add_argument(flag_name(f.name), **kwargs)


def from_cli(
    cls: type[T],
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Parse `argv` with `parser` (built by `add_dataclass_args` for `cls`) into a `cls`;
    an omitted tuple flag gets its field's default, an omitted flag with an `env` variable
    takes the variable's value when it is set in `environ` (default: `os.environ`), even
    empty (for the caller's validation to refuse), else its default; a flag given on the
    command line wins. No validation beyond the parser's."""
    environ = os.environ if environ is None else environ
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = vars(parser.parse_args(argv))
    # "Not given" must differ from "given its default": an explicit `--warmup all` beats
    # $CPKV_WARMUP (argparse also takes a flag's unambiguous abbreviation).
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}

    def on_command_line(flag: str) -> bool:
        return any(flag.startswith(a) for a in given)

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        hint = hints[f.name]
        if typing.get_origin(hint) is tuple:
            ns[f.name] = f.default if ns[f.name] is None else tuple(ns[f.name])
        env = f.metadata.get("env")
        if env and not on_command_line(flag_name(f.name)) and env in environ:
            value = environ[env]
            choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else None
            if choices is not None and value not in choices:
                parser.error(
                    f"${env}={value!r} is not a choice of {flag_name(f.name)} "
                    f"({', '.join(map(str, choices))})"
                )
            ns[f.name] = value
    return cls(**ns)


REDACTED = "<redacted>"


def redacted_dict(obj: Any) -> dict[str, Any]:
    """`dataclasses.asdict(obj)` with every `secret` field that is set as `<redacted>`."""
    out = dataclasses.asdict(obj)
    for f in dataclasses.fields(obj):
        if f.metadata.get("secret") and out[f.name] is not None:
            out[f.name] = REDACTED
    return out
