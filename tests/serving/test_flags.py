"""`serving.flags`: a dataclass's fields become argparse flags (shared by `cpkv-serve` and
`cpkv-router`; their own tests check their parsers in full)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest

from serving import flags


class DemoError(ValueError):
    pass


def _hex(text: str) -> int:
    return int(text, 16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Demo:
    name: str = flags.arg(help="required", group="a", metavar="NAME")
    urls: tuple[str, ...] = flags.arg((), help="several", group="a", metavar="URL")
    count: int = flags.arg(3, help="an int", group="b")
    limit: float | None = flags.arg(None, help="optional", group="b")
    mask: int = flags.arg(255, help="hex", group="b", parse=_hex, format_default=hex)
    level: Literal["lo", "hi"] = flags.arg("lo", help="choice", group="b")
    verbose: bool = flags.arg(False, help="switch", group="b")


GROUPS = {"a": "first", "b": "second"}


def parser(**kw):
    p = flags.RaisingParser(prog="demo", error_class=DemoError)
    flags.add_dataclass_args(p, Demo, **kw)
    return p


def test_types_defaults_and_tuples():
    got = flags.from_cli(Demo, parser(groups=GROUPS), ["--name", "x"])
    assert got == Demo(name="x")
    argv = ["--name", "x", "--urls", "a", "b", "--urls", "c", "--count", "4", "--limit", "none"]
    argv += ["--mask", "ff0", "--level", "hi", "--verbose"]
    got = flags.from_cli(Demo, parser(groups=GROUPS), argv)
    assert got == Demo(
        name="x", urls=("a", "b", "c"), count=4, limit=None, mask=0xFF0, level="hi", verbose=True
    )
    assert flags.from_cli(Demo, parser(), ["--name", "x", "--limit", "1.5"]).limit == 1.5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: --name"),
        (["--name", "x", "--count", "x"], "argument --count: invalid int value: 'x'"),
        (["--name", "x", "--limit", "x"], "argument --limit: could not convert string to float"),
        (["--name", "x", "--level", "mid"], "argument --level: invalid choice: 'mid'"),
        (["--name", "x", "--urls"], "argument --urls: expected at least one argument"),
    ],
)
def test_errors_raise_the_callers_class(argv, message):
    with pytest.raises(DemoError, match=message):
        flags.from_cli(Demo, parser(), argv)


def test_converters_keep_their_own_message():
    p = parser(converters={int: flags.parse_int, float: flags.parse_float})
    with pytest.raises(DemoError, match="argument --count: expected an integer, got 'x'"):
        flags.from_cli(Demo, p, ["--name", "x", "--count", "x"])
    with pytest.raises(DemoError, match="argument --limit: expected a number, got 'x'"):
        flags.from_cli(Demo, p, ["--name", "x", "--limit", "x"])


def test_help_groups_defaults_and_metavars():
    p = parser(groups=GROUPS, type_metavar=True)
    by_flag = {a.option_strings[0]: a for a in p._actions if a.option_strings}
    titles = {g.title: {a.option_strings[0] for a in g._group_actions} for g in p._action_groups}
    assert titles["first"] == {"--name", "--urls"}
    assert titles["second"] == {"--count", "--limit", "--mask", "--level", "--verbose"}
    assert by_flag["--count"].help == "an int (default: 3)"
    assert by_flag["--limit"].help == "optional (default: none)"
    assert by_flag["--mask"].help == "hex (default: 0xff)"
    assert by_flag["--urls"].help == "several"  # a tuple's default is "none given"
    assert by_flag["--verbose"].help == "switch"
    assert (by_flag["--count"].metavar, by_flag["--urls"].metavar) == ("INT", "URL")
    plain = {a.option_strings[0]: a for a in parser()._actions if a.option_strings}
    assert plain["--count"].metavar is None  # argparse's default: COUNT


def test_field_checks():
    assert flags.flag_name("page_size") == "--page-size"
    assert flags.unwrap_optional(int | None) == (True, int)
    assert flags.unwrap_optional(int) == (False, int)
    with pytest.raises(TypeError, match="X | None"):
        flags.unwrap_optional(int | str)

    @dataclasses.dataclass(frozen=True)
    class BadBool:
        on: bool = flags.arg(True, help="x")

    with pytest.raises(TypeError, match="must default to False"):
        flags.add_dataclass_args(parser(), BadBool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WithSecret:
    user: str = flags.arg("me", help="a user", group="a")
    token: str | None = flags.arg(None, help="a token", group="a", env="DEMO_TOKEN", secret=True)


def test_env_fallback_and_secrets():
    p = flags.RaisingParser(prog="demo", error_class=DemoError)
    flags.add_dataclass_args(p, WithSecret)
    (action,) = [a for a in p._actions if a.dest == "token"]
    assert action.help == "a token (default: $DEMO_TOKEN if set, else none)"
    assert flags.from_cli(WithSecret, p, [], environ={}).token is None
    assert flags.from_cli(WithSecret, p, [], environ={"DEMO_TOKEN": "t1"}).token == "t1"
    # Empty is kept, for the caller to refuse (an unset shell variable is not "no key").
    assert flags.from_cli(WithSecret, p, [], environ={"DEMO_TOKEN": ""}).token == ""
    got = flags.from_cli(WithSecret, p, ["--token", "t2"], environ={"DEMO_TOKEN": "t1"})
    assert got.token == "t2" and "t2" not in repr(got)
    assert flags.redacted_dict(got) == {"user": "me", "token": "<redacted>"}
    assert flags.redacted_dict(WithSecret()) == {"user": "me", "token": None}
