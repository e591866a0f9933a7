"""The built-in DeepSeek-V3.2 chat format (`serving.http.deepseek_v32_template`) against
prompts that DeepSeek's own encoder rendered (`data/deepseek_v32_chat.json` names the
encoder and how it was run): chat and thinking modes, earlier reasoning dropped, tools,
parallel calls with typed and unicode arguments, tool results. Messages reach the
template as the chat endpoint passes them (`ChatMessage.for_template`: a call's JSON
arguments as a dict)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpkv_jax.errors import InputError
from serving.http.deepseek_v32_template import (
    ASSISTANT,
    THINK_END,
    DeepSeekV32ChatTemplate,
    builtin_chat_template,
)
from serving.http.models import ChatCompletionBody
from serving.parsers.tool_calls import ToolCall, tool_call_parser

GOLDEN = json.loads((Path(__file__).parent / "data" / "deepseek_v32_chat.json").read_text())
TEMPLATE = DeepSeekV32ChatTemplate()


def _as_endpoint_passes_them(messages: list[dict]) -> list[dict]:
    body = ChatCompletionBody.model_validate({"model": "m", "messages": messages})
    return [m.for_template() for m in body.messages]


@pytest.mark.parametrize("name", sorted(GOLDEN["want"]))
def test_renders_what_deepseeks_encoder_renders(name):
    case = GOLDEN["cases"][name]
    kwargs = {"thinking": case["mode"] == "thinking"}
    got = TEMPLATE.render(
        _as_endpoint_passes_them(case["messages"]), tools=case.get("tools"), template_kwargs=kwargs
    )
    assert got == GOLDEN["want"][name]
    # JSON-string arguments (a client's history as sent) render the same.
    raw = TEMPLATE.render(case["messages"], tools=case.get("tools"), template_kwargs=kwargs)
    assert raw == got


def test_thinking_switches_and_the_generation_prompt():
    msgs = [{"role": "user", "content": "Hi"}]
    assert TEMPLATE.render(msgs).endswith(ASSISTANT + THINK_END)  # chat mode by default
    for key in ("thinking", "enable_thinking"):
        assert TEMPLATE.render(msgs, template_kwargs={key: True}).endswith(ASSISTANT + "<think>")
    for kwargs in ({}, {"thinking": True}):
        bare = TEMPLATE.render(msgs, add_generation_prompt=False, template_kwargs=kwargs)
        assert bare.endswith("<｜User｜>Hi")


def test_tools_without_a_system_message_get_an_empty_one():
    case = GOLDEN["cases"]["tools_chat_unicode"]
    assert case["messages"][0] == {"role": "system", "content": ""}
    got = TEMPLATE.render(case["messages"][1:], tools=case["tools"])
    assert got == GOLDEN["want"]["tools_chat_unicode"]


def test_rendered_calls_parse_back_with_the_deepseekv32_parser():
    case = GOLDEN["cases"]["tools_thinking"]
    rendered = TEMPLATE.render(case["messages"][:3], tools=case["tools"])
    block = rendered[rendered.index("<｜DSML｜function_calls>") : rendered.rindex("<｜end")]
    parser = tool_call_parser("deepseekv32", case["tools"])
    calls = [x for x in parser.feed(block) + parser.finish() if isinstance(x, ToolCall)]
    sent = case["messages"][2]["tool_calls"]
    assert [c.name for c in calls] == [c["function"]["name"] for c in sent]
    assert [json.loads(c.arguments) for c in calls] == [
        json.loads(c["function"]["arguments"]) for c in sent
    ]


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "empty"),
        ([{"role": "tool", "content": "x"}], "without a matching tool call"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
             {"role": "tool", "content": "x"}],
            "without a matching tool call",
        ),
        ([{"role": "narrator", "content": "x"}], "role 'narrator'"),
    ],
)  # fmt: skip
def test_bad_conversations_are_input_errors(messages, match):
    with pytest.raises(InputError, match=match):
        TEMPLATE.render(messages)


def test_only_deepseek_v32_gets_the_built_in_format():
    assert isinstance(builtin_chat_template("deepseek_v32"), DeepSeekV32ChatTemplate)
    assert builtin_chat_template("glm_moe_dsa") is None  # GLM-5 ships its template
