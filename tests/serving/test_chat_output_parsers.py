"""The chat output parsers (`serving.parsers`): the exact GLM-4.5 / GLM-4.7 (GLM-5) and
DeepSeek-V3.2 DSML tool-call formats, the `<think>` reasoning split, and their streaming:
every output is fed whole, split in two at every position, and char by char, and each
way must give the same reasoning, content and calls (so no partial markup ever leaks into
the content or reasoning: they only grow)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from serving.parsers import (
    ChatOutputParser,
    ChatParserConfig,
    ToolCall,
    reasoning_parser,
    tool_call_parser,
)
from serving.parsers._text import held_suffix

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "hours": {"type": "array"},
                "opts": {"type": "object"},
                "code": {"type": "string"},
                "ratio": {"type": ["number", "null"]},
            },
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]
B = "｜"  # U+FF5C


def splits(text: str) -> list[list[str]]:
    """`text` whole, split in two at every position, and char by char."""
    return [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]


def run_chat(config: ChatParserConfig, deltas: list[str], **kw: Any) -> dict[str, Any]:
    p = ChatOutputParser(config, **kw)
    reasoning, content, calls = "", "", {}
    order: list[tuple[int, str]] = []
    for d in [*(p.feed(x) for x in deltas), p.finish()]:
        reasoning += d.reasoning
        content += d.content
        for tc in d.tool_calls:
            i = tc["index"]
            if "id" in tc:
                assert i not in calls and tc["type"] == "function" and tc["id"].startswith("call_")
                calls[i] = {"name": tc["function"]["name"], "arguments": ""}
                order.append((i, "name"))
            calls[i]["arguments"] += tc["function"]["arguments"]
            order.append((i, "args"))
    assert reasoning == p.reasoning and content == p.content
    assert [c["function"]["name"] for c in p.tool_calls] == [calls[i]["name"] for i in calls]
    got_calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return {"reasoning": reasoning, "content": content, "calls": got_calls}


def check_every_split(config: ChatParserConfig, text: str, want: dict[str, Any], **kw: Any):
    for deltas in splits(text):
        got = run_chat(config, deltas, **kw)
        assert got == want, (deltas, got)


GLM47 = ChatParserConfig(reasoning="glm45", tool_call="glm47")
GLM45 = ChatParserConfig(reasoning="glm45", tool_call="glm45")
DSV32 = ChatParserConfig(reasoning="deepseek-v3", tool_call="deepseekv32")


# ---- GLM-4.7 / GLM-5 -------------------------------------------------------------------


def test_glm47_reasoning_content_and_a_typed_call_at_every_split():
    text = (
        "Need weather.</think>\n\nChecking."
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich 東京</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value>"
        "<arg_key>metric</arg_key><arg_value>true</arg_value>"
        "<arg_key>hours</arg_key><arg_value>[1, 2]</arg_value>"
        '<arg_key>opts</arg_key><arg_value>{"a": "b"}</arg_value>'
        "<arg_key>code</arg_key><arg_value>007</arg_value>"
        "<arg_key>ratio</arg_key><arg_value>not json</arg_value></tool_call>"
    )
    args = {
        "city": "Zürich 東京",
        "days": 3,
        "metric": True,
        "hours": [1, 2],
        "opts": {"a": "b"},
        "code": "007",  # a string parameter stays a string
        "ratio": "not json",  # a number that does not parse is kept as the string
    }
    want = {"reasoning": "Need weather.", "content": "Checking.", "calls": [("get_weather", args)]}
    check_every_split(GLM47, text, want, tools=TOOLS)


def test_glm47_several_calls_and_a_zero_argument_call():
    text = (
        "<think>plan</think>"
        "<tool_call>now</tool_call>\n"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>"
        "\n"
    )
    want = {
        "reasoning": "plan",
        "content": "",
        "calls": [("now", {}), ("get_weather", {"city": "Oslo"})],
    }
    check_every_split(GLM47, text, want, tools=TOOLS)
    # parallel_tool_calls=false keeps the first call only
    got = run_chat(GLM47, [text], tools=TOOLS, parallel_tool_calls=False)
    assert got["calls"] == [("now", {})]


def test_a_tool_call_inside_the_reasoning_ends_it():
    text = "thinking<tool_call>now</tool_call>"
    want = {"reasoning": "thinking", "content": "", "calls": [("now", {})]}
    check_every_split(GLM47, text, want, tools=TOOLS)


def test_glm45_with_newlines():
    text = (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    )
    want = {
        "reasoning": "",
        "content": "",
        "calls": [("get_weather", {"city": "Paris", "days": 2})],
    }
    check_every_split(
        GLM45, text, want, tools=TOOLS, chat_template_kwargs={"enable_thinking": False}
    )


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>get weather</tool_call>",  # a name with a space
        "<tool_call></tool_call>",  # no name
        "<tool_call>f<arg_key>a</arg_key></tool_call>",  # a key without a value
        "<tool_call>f<arg_value>1</arg_value></tool_call>",  # a value without a key
        "<tool_call>f<arg_key>a</arg_key>x<arg_value>1</arg_value></tool_call>",
        "<tool_call>get_weather<arg_key>city",  # never closed
        "<tool_call",  # a partial start tag at the end
    ],
)
def test_glm_malformed_markup_is_content(bad):
    text = "Hi " + bad
    want = {"reasoning": "", "content": text, "calls": []}
    cfg = ChatParserConfig(tool_call="glm47")
    check_every_split(cfg, text, want, tools=TOOLS)


def test_text_after_a_call_is_content():
    cfg = ChatParserConfig(tool_call="glm47")
    got = run_chat(cfg, ["<tool_call>now</tool_call> and then < more"], tools=TOOLS)
    assert got == {"reasoning": "", "content": " and then < more", "calls": [("now", {})]}


def test_without_tools_the_markup_is_content():
    text = "<tool_call>now</tool_call>"
    got = run_chat(ChatParserConfig(tool_call="glm47"), [text])
    assert got == {"reasoning": "", "content": text, "calls": []}


# ---- DeepSeek-V3.2 DSML ----------------------------------------------------------------

DSML_TWO = (
    f"Let me check.\n\n<{B}DSML{B}function_calls>\n"
    f'<{B}DSML{B}invoke name="get_weather">\n'
    f'<{B}DSML{B}parameter name="city" string="true">北京 "quoted"</{B}DSML{B}parameter>\n'
    f'<{B}DSML{B}parameter name="days" string="false">5</{B}DSML{B}parameter>\n'
    f'<{B}DSML{B}parameter name="opts" string="false">{{"x": [1, null]}}</{B}DSML{B}parameter>\n'
    f"</{B}DSML{B}invoke>\n"
    f'<{B}DSML{B}invoke name="now">\n'
    f"</{B}DSML{B}invoke>\n"
    f"</{B}DSML{B}function_calls>"
)


def test_dsml_two_invokes_at_every_split():
    want = {
        "reasoning": "",
        "content": "Let me check.\n\n",
        "calls": [
            ("get_weather", {"city": '北京 "quoted"', "days": 5, "opts": {"x": [1, None]}}),
            ("now", {}),
        ],
    }
    check_every_split(DSV32, DSML_TWO, want, tools=TOOLS)


def test_dsml_with_thinking_on():
    text = "hmm</think>ok" + DSML_TWO.removeprefix("Let me check.\n\n")
    got = run_chat(DSV32, [text], tools=TOOLS, chat_template_kwargs={"thinking": True})
    assert got["reasoning"] == "hmm" and got["content"] == "ok" and len(got["calls"]) == 2


@pytest.mark.parametrize(
    "bad",
    [
        f"<{B}DSML{B}function_calls></{B}DSML{B}function_calls>",  # no invoke
        f'<{B}DSML{B}function_calls><{B}DSML{B}invoke name="f"></{B}DSML{B}function_calls>',
        f"<{B}DSML{B}function_calls><{B}DSML{B}invoke></{B}DSML{B}invoke>"
        f"</{B}DSML{B}function_calls>",
        f'<{B}DSML{B}function_calls><{B}DSML{B}invoke name="f"><{B}DSML{B}parameter '
        f'name="a">1</{B}DSML{B}parameter></{B}DSML{B}invoke></{B}DSML{B}function_calls>',
        '<|DSML|function_calls><|DSML|invoke name="f"></|DSML|invoke></|DSML|function_calls>',
        f'<{B}DSML{B}function_calls><{B}DSML{B}invoke name="f">',  # never closed
    ],
)
def test_dsml_malformed_markup_is_content(bad):
    want = {"reasoning": "", "content": bad, "calls": []}
    check_every_split(DSV32, bad, want, tools=TOOLS)


def test_dsml_string_false_that_does_not_parse_stays_a_string():
    p = tool_call_parser("deepseekv32", TOOLS)
    text = (
        f'<{B}DSML{B}function_calls><{B}DSML{B}invoke name="f"><{B}DSML{B}parameter name="a" '
        f'string="false">oops</{B}DSML{B}parameter></{B}DSML{B}invoke></{B}DSML{B}function_calls>'
    )
    assert p.feed(text) + p.finish() == [ToolCall("f", '{"a": "oops"}')]


# ---- reasoning -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kwargs", "text", "reasoning", "content"),
    [
        ("glm45", None, "a</think>\n\nb", "a", "b"),  # GLM-5: starts in reasoning
        ("glm45", None, "<think>a</think>b", "a", "b"),  # an explicit <think> is dropped
        ("glm45", None, "still thinking", "still thinking", ""),  # cut off in reasoning
        ("glm45", {"enable_thinking": False}, "a</think>b", "", "a</think>b"),
        ("glm45", {"enable_thinking": False}, " <think>a</think>b", "a", "b"),
        ("glm45", {"thinking": False}, "plain", "", "plain"),
        ("deepseek-v3", None, "a</think>b", "", "a</think>b"),  # off by default
        ("deepseek-v3", {"thinking": True}, "a</think>b", "a", "b"),
        ("deepseek-v3", {"enable_thinking": True}, "<think>a</think>b", "a", "b"),
        ("deepseek-v3", None, "<think>a</think>b", "a", "b"),
        ("deepseek-v3", None, "<thin", "", "<thin"),
        ("glm45", None, "a</th", "a</th", ""),
        ("glm45", None, "", "", ""),
    ],
)
def test_reasoning_split_at_every_position(name, kwargs, text, reasoning, content):
    for deltas in splits(text) if text else [[""]]:
        p = reasoning_parser(name, kwargs)
        got = [p.feed(d) for d in deltas] + [p.finish()]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == (reasoning, content)


def test_a_partial_end_tag_is_held_back():
    p = reasoning_parser("glm45")
    assert p.feed("abc</th") == ("abc", "")
    assert p.feed("ink>x") == ("", "x")
    p = reasoning_parser("glm45")
    assert p.feed("abc</th") == ("abc", "")
    assert p.feed("at") == ("</that", "")


def test_separate_reasoning_off_gives_everything_as_content():
    got = run_chat(GLM47, ["a</think>b"], separate_reasoning=False)
    assert got == {"reasoning": "", "content": "a</think>b", "calls": []}


def test_held_suffix():
    assert held_suffix("abc</th", ["</think>"]) == 4
    assert held_suffix("abc<", ["</think>", "<tool_call>"]) == 1
    assert held_suffix("abc", ["</think>"]) == 0
    assert held_suffix("</think>", ["</think>"]) == 0  # whole markers are found, not held
