"""The chat output parsers (`serving.parsers`): the exact GLM-4.5 / GLM-4.7 (GLM-5) and
DeepSeek-V3.2 DSML tool-call formats, the `<think>` reasoning split, and their streaming:
every output is fed whole, split in two at every position, and char by char, and each
way must give the same reasoning, content and calls (so no partial markup ever leaks into
the content or reasoning: they only grow). A call's arguments stream in fragments: each
way, they concatenate to the same JSON text, and a long string value streams as it
arrives."""

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
from serving.parsers.tool_calls import ToolCallArgs, ToolCallStart

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
        "<tool_call>f<arg_key>city",  # never closed (not a tool: nothing streamed)
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


# ---- streamed arguments ----------------------------------------------------------------


def stream_chat(config: ChatParserConfig, deltas: list[str], **kw: Any):
    """`deltas` through a `ChatOutputParser`: (reasoning, content, calls), each call a dict
    of its name, its argument fragments and the step (index in `deltas`; `len(deltas)`:
    `finish`) each came at. Checks the stream's shape: a call's header (id, type, name,
    empty arguments) before any of its fragments, no empty fragment, and the fragments
    concatenated are `message.tool_calls`' arguments."""
    p = ChatOutputParser(config, **kw)
    reasoning, content, calls = "", "", []
    for step, d in enumerate([*(p.feed(x) for x in deltas), p.finish()]):
        reasoning += d.reasoning
        content += d.content
        for tc in d.tool_calls:
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["type"] == "function"
                assert tc["id"].startswith("call_") and tc["function"]["arguments"] == ""
                calls.append({"name": tc["function"]["name"], "fragments": [], "steps": []})
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                assert tc["index"] < len(calls) and tc["function"]["arguments"]
                calls[tc["index"]]["fragments"].append(tc["function"]["arguments"])
                calls[tc["index"]]["steps"].append(step)
    assert reasoning == p.reasoning and content == p.content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in p.tool_calls] == [
        (c["name"], "".join(c["fragments"])) for c in calls
    ]
    return reasoning, content, calls


def check_streaming(
    config: ChatParserConfig, text: str, want: dict[str, Any], **kw: Any
) -> list[dict[str, Any]]:
    """At every split, `want`'s reasoning, content and calls, each call's arguments exactly
    its `json.dumps`; the calls of the char-by-char feed are returned."""
    want_calls = [(name, json.dumps(args, ensure_ascii=False)) for name, args in want["calls"]]
    for deltas in splits(text):
        reasoning, content, calls = stream_chat(config, deltas, **kw)
        assert (reasoning, content) == (want["reasoning"], want["content"]), deltas
        assert [(c["name"], "".join(c["fragments"])) for c in calls] == want_calls, deltas
    return calls


# A long string value: unicode, quotes, a backslash, a newline, a tab, and what looks like
# the start of each format's closing tags.
CODE = (
    "def f(x):\n\treturn \"Zürich 東京\" + '\\\\' + x  # a < b, </arg </tool "
    f"</{B}DSML{B}para </{B}DSML{B}inv done"
)
STREAMED_CALLS = [
    ("get_weather", {"city": CODE, "days": 3, "metric": False, "opts": {"a": [1, "x"]}}),
    ("now", {}),
    ("get_weather", {"code": '"</arg_valu>"'}),
]
GLM_STREAMED = (
    "plan</think>Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>"
    f"{CODE}</arg_value><arg_key>days</arg_key><arg_value>3</arg_value>"
    "<arg_key>metric</arg_key><arg_value>false</arg_value>"
    '<arg_key>opts</arg_key><arg_value>{"a": [1, "x"]}</arg_value></tool_call>\n'
    "<tool_call>now</tool_call>"
    '<tool_call>get_weather<arg_key>code</arg_key><arg_value>"</arg_valu>"</arg_value>'
    "</tool_call> Done."
)
GLM45_STREAMED = (
    "Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>"
    f"{CODE}</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
    "<arg_key>metric</arg_key>\n<arg_value>false</arg_value>\n"
    '<arg_key>opts</arg_key>\n<arg_value>{"a": [1, "x"]}</arg_value>\n</tool_call>\n'
    "<tool_call>now\n</tool_call>\n"
    '<tool_call>get_weather\n<arg_key>code</arg_key>\n<arg_value>"</arg_valu>"</arg_value>\n'
    "</tool_call> Done."
)
P, P_END = f"<{B}DSML{B}parameter", f"</{B}DSML{B}parameter>"
DSML_STREAMED = (
    f"Let me check.<{B}DSML{B}function_calls>\n"
    f'<{B}DSML{B}invoke name="get_weather">\n'
    f'{P} name="city" string="true">{CODE}{P_END}\n'
    f'{P} name="days" string="false">3{P_END}\n'
    f'{P} name="metric" string="false">false{P_END}\n'
    f'{P} name="opts" string="false">{{"a": [1, "x"]}}{P_END}\n'
    f"</{B}DSML{B}invoke>\n"
    f'<{B}DSML{B}invoke name="now">\n</{B}DSML{B}invoke>\n'
    f'<{B}DSML{B}invoke name="get_weather">\n'
    f'{P} name="code" string="true">"</{B}DSML{B}paramete>"{P_END}\n'
    f"</{B}DSML{B}invoke>\n"
    f"</{B}DSML{B}function_calls> Done."
)


@pytest.mark.parametrize(
    ("config", "text", "reasoning", "code"),
    [
        (GLM47, GLM_STREAMED, "plan", '"</arg_valu>"'),
        (GLM45, GLM45_STREAMED, "", '"</arg_valu>"'),
        (DSV32, DSML_STREAMED, "", f'"</{B}DSML{B}paramete>"'),
    ],
    ids=["glm47", "glm45", "deepseekv32"],
)
def test_arguments_stream_in_fragments_at_every_split(config, text, reasoning, code):
    kw: dict[str, Any] = {"tools": TOOLS}
    if config is GLM45:
        kw["chat_template_kwargs"] = {"enable_thinking": False}
    calls = [*STREAMED_CALLS[:2], ("get_weather", {"code": code})]
    want = {"reasoning": reasoning, "content": "Let me check. Done.", "calls": calls}
    by_char = check_streaming(config, text, want, **kw)
    # Fed char by char, the long value streams as it arrives: all of it has gone out, in
    # many fragments, before its closing tag has (step i is text[i]).
    first = by_char[0]
    value_end = text.index(CODE) + len(CODE)
    before = "".join(
        f for f, s in zip(first["fragments"], first["steps"], strict=True) if s < value_end
    )
    assert before == '{"city": "' + json.dumps(CODE, ensure_ascii=False)[1:-1]
    assert len(first["fragments"]) > len(CODE) // 2
    # parallel_tool_calls=false: nothing of the later calls
    _, _, first_only = stream_chat(config, list(text), parallel_tool_calls=False, **kw)
    got = [(c["name"], json.loads("".join(c["fragments"]))) for c in first_only]
    assert got == calls[:1]


def test_a_glm47_call_streams_as_header_then_fragments():
    text = (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    )
    p = ChatOutputParser(ChatParserConfig(tool_call="glm47"), tools=TOOLS)
    deltas = [tc for ch in text for tc in p.feed(ch).tool_calls] + p.finish().tool_calls
    assert deltas[0]["id"].startswith("call_")
    header = {"index": 0, "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    assert {k: v for k, v in deltas[0].items() if k != "id"} == header
    fragments = ['{"city": "', "O", "s", "l", "o", '"', ', "days": 3', "}"]
    assert deltas[1:] == [{"index": 0, "function": {"arguments": f}} for f in fragments]
    # fed whole: the header and the whole arguments, as before
    p = ChatOutputParser(ChatParserConfig(tool_call="glm47"), tools=TOOLS)
    _, args = p.feed(text).tool_calls
    assert args == {"index": 0, "function": {"arguments": '{"city": "Oslo", "days": 3}'}}
    assert p.tool_calls[0]["function"]["arguments"] == '{"city": "Oslo", "days": 3}'


def test_the_events_of_the_tool_call_parser():
    p = tool_call_parser("glm47", TOOLS)
    assert p.feed_events("a<tool_call>now<arg_key>x") == ["a", ToolCallStart("now")]
    assert p.feed_events("</arg_key><arg_value>y</arg") == [
        ToolCallArgs('{"x": "'),
        ToolCallArgs("y"),
    ]
    assert p.feed_events("_value></tool_call>b") == [
        ToolCallArgs('"'),
        ToolCallArgs("}", end=True),
        "b",
    ]


# ---- malformed markup after a call has started streaming --------------------------------

GLM47_CALLS = ChatParserConfig(tool_call="glm47")
GW = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>"
DSML_GW = f'<{B}DSML{B}function_calls><{B}DSML{B}invoke name="get_weather">'
DSML_CITY = f'{DSML_GW}{P} name="city" string="true">'


@pytest.mark.parametrize(
    ("config", "text", "content", "calls"),
    [
        # the output ends after the name, in a key, in a string value, in what may be its
        # closing tag (it was the value's text), in a typed value
        (GLM47_CALLS, "Hi <tool_call>get_weather<arg_key>city", "Hi <arg_key>city", [{}]),
        (GLM47_CALLS, "Hi <tool_call>get_weather\n", "Hi ", [{}]),
        (GLM47_CALLS, GW + "Os", "", [{"city": "Os"}]),
        (GLM47_CALLS, GW + "Os</arg_va", "", [{"city": "Os</arg_va"}]),
        (
            GLM47_CALLS,
            GW + "Oslo</arg_value><arg_key>days</arg_key><arg_value>3",
            "<arg_key>days</arg_key><arg_value>3",
            [{"city": "Oslo"}],
        ),
        # garbage where a key or a value should be; the next block parses again
        (
            GLM47_CALLS,
            GW + "Oslo</arg_value>oops</tool_call><tool_call>now</tool_call>",
            "oops</tool_call>",
            [{"city": "Oslo"}, {}],
        ),
        (
            GLM47_CALLS,
            "<tool_call>get_weather<arg_key>days</arg_key>x<arg_value>3</arg_value></tool_call>",
            "<arg_key>days</arg_key>x<arg_value>3</arg_value></tool_call>",
            [{}],
        ),
        # the block ends inside a string value, inside a key
        (GLM47_CALLS, GW + 'a "b</tool_call>c', "</tool_call>c", [{"city": 'a "b'}]),
        (
            GLM47_CALLS,
            "<tool_call>get_weather<arg_key>ci</tool_call>",
            "<arg_key>ci</tool_call>",
            [{}],
        ),
        (DSV32, DSML_CITY + "Os", "", [{"city": "Os"}]),
        (DSV32, DSML_CITY + f"Os</{B}DSML{B}param", "", [{"city": f"Os</{B}DSML{B}param"}]),
        (
            DSV32,
            DSML_GW + f'{P} name="days" string="false">3',
            f'{P} name="days" string="false">3',
            [{}],
        ),
        (
            DSV32,
            DSML_CITY + f"Oslo{P_END}oops</{B}DSML{B}invoke></{B}DSML{B}function_calls>",
            f"oops</{B}DSML{B}invoke></{B}DSML{B}function_calls>",
            [{"city": "Oslo"}],
        ),
        (
            DSV32,
            DSML_CITY + f"Oslo</{B}DSML{B}function_calls>!",
            f"</{B}DSML{B}function_calls>!",
            [{"city": "Oslo"}],
        ),
        # after a whole invoke, the block is cut off before the next one
        (DSV32, DSML_GW + f"</{B}DSML{B}invoke>\n<{B}DSML{B}inv", f"<{B}DSML{B}inv", [{}]),
    ],
)
def test_malformed_markup_after_a_call_started_closes_its_arguments(config, text, content, calls):
    """The streamed arguments stay valid JSON (the value parsed so far closed), the rest
    of the block is content; never an exception."""
    names = ["get_weather", "now"][: len(calls)]
    want = {"reasoning": "", "content": content, "calls": list(zip(names, calls, strict=True))}
    check_streaming(config, text, want, tools=TOOLS)


@pytest.mark.parametrize(
    ("config", "text", "calls"),
    [
        (
            GLM47_CALLS,
            "<tool_call>other<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
            [("other", {"a": "1"})],
        ),
        (
            DSV32,
            f'<{B}DSML{B}function_calls><{B}DSML{B}invoke name="other">{P} name="a" '
            f'string="false">[1]{P_END}</{B}DSML{B}invoke><{B}DSML{B}invoke name="now">'
            f"</{B}DSML{B}invoke></{B}DSML{B}function_calls>",
            [("other", {"a": [1]}), ("now", {})],
        ),
    ],
)
def test_a_block_whose_name_is_not_a_tool_is_parsed_whole(config, text, calls):
    """Its calls come whole at the block's end, even a tool's after it in the block."""
    want = {"reasoning": "", "content": "", "calls": calls}
    by_char = check_streaming(config, text, want, tools=TOOLS)
    assert all(c["steps"] == [len(text) - 1] for c in by_char)  # one fragment, at the end
    # cut off, or malformed: the whole block is content
    for bad in (text[:-1], text.replace("</", "<", 1)):
        want = {"reasoning": "", "content": bad, "calls": []}
        check_streaming(config, bad, want, tools=TOOLS)


def test_dsml_an_invoke_of_another_name_after_a_streamed_one_comes_whole():
    text = (
        f'{DSML_GW}</{B}DSML{B}invoke><{B}DSML{B}invoke name="other">{P} name="a" '
        f'string="true">x{P_END}</{B}DSML{B}invoke></{B}DSML{B}function_calls>'
    )
    want = {"reasoning": "", "content": "", "calls": [("get_weather", {}), ("other", {"a": "x"})]}
    by_char = check_streaming(DSV32, text, want, tools=TOOLS)
    invoke_end = f"</{B}DSML{B}invoke>"
    # it arrives whole, with the last character of its closing tag
    last = text.index(invoke_end + f"</{B}DSML{B}function_calls>") + len(invoke_end) - 1
    assert by_char[1]["steps"] == [last]
