"""Tool calls and reasoning through the real HTTP app (`build_app` over `MockEngine`,
with `--tool-call-parser` / `--reasoning-parser` as `chat_parsers`), from an httpx
client, streaming and not.

The mock echoes its prompt, and the chat template here renders only the last message's
content and the EOS token, so a request's last message is the model output the test
scripts (a thinking block and a tool call in GLM-5's or DeepSeek-V3.2's markup), ending
with "stop" at the EOS. The byte tokenizer streams it about one character per chunk, so
the stream goes through every hold-back of partial markup.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from support.http_client import VOCAB, Served, sse

from cpkv_jax.tools.make_tiny_checkpoint import CHAT_TEMPLATE
from serving.engine.mock import MockEngine
from serving.http.app import build_app
from serving.http.chat_template import ChatTemplate
from serving.http.metrics import ServerMetrics
from serving.parsers import ChatParserConfig, ToolCall, tool_call_parser

ECHO_TEMPLATE = "{{ messages[-1]['content'] }}{{ eos_token }}"
B = "｜"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
GLM5_OUTPUT = (
    "The user wants the weather.</think>\n\nLet me look."
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value>"
    "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
)
DSV32_OUTPUT = (
    "The user wants the weather.</think>Let me look.\n\n"
    f"<{B}DSML{B}function_calls>\n"
    f'<{B}DSML{B}invoke name="get_weather">\n'
    f'<{B}DSML{B}parameter name="city" string="true">Zürich</{B}DSML{B}parameter>\n'
    f'<{B}DSML{B}parameter name="days" string="false">3</{B}DSML{B}parameter>\n'
    f"</{B}DSML{B}invoke>\n"
    f"</{B}DSML{B}function_calls>"
)
CASES = {
    "glm5": (ChatParserConfig(reasoning="glm45", tool_call="glm47"), GLM5_OUTPUT, None),
    "dsv32": (
        ChatParserConfig(reasoning="deepseek-v3", tool_call="deepseekv32"),
        DSV32_OUTPUT,
        {"thinking": True},
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def chat_srv(request, tok) -> Iterator[SimpleNamespace]:
    parsers, output, kwargs = CASES[request.param]
    engine = MockEngine(tok)
    loop = engine.loop(idle_wait_s=0.01, name=f"engine-{request.param}")
    app = build_app(
        loop,
        model_name="m",
        tokenizer=tok,
        vocab_size=VOCAB,
        context_length=4096,  # room for the scripted output in the prompt and the reply
        chat_template=ChatTemplate(ECHO_TEMPLATE, eos_token="<|eos|>"),
        metrics=ServerMetrics(),
        chat_parsers=parsers,
    )
    server = Served(app, lifespan="off")
    http = httpx.Client(base_url=server.url, timeout=20)
    yield SimpleNamespace(http=http, output=output, kwargs=kwargs)
    http.close()
    server.stop()
    asyncio.run(loop.shutdown(1.0))


def chat_body(s: SimpleNamespace, content: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "tools": [WEATHER],
        "temperature": 0,
    }
    if s.kwargs:
        body["chat_template_kwargs"] = s.kwargs
    return {**body, **extra}


def post(s: SimpleNamespace, body: dict[str, Any]) -> httpx.Response:
    r = s.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def test_non_streaming_gets_tool_calls_and_reasoning(chat_srv):
    r = post(chat_srv, chat_body(chat_srv, chat_srv.output)).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["reasoning_content"] == "The user wants the weather."
    assert msg["content"].strip() == "Let me look."
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Zürich", "days": 3}


def test_streaming_gets_the_same_as_deltas(chat_srv):
    events = sse(post(chat_srv, chat_body(chat_srv, chat_srv.output, stream=True)))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert reasoning == "The user wants the weather."
    assert content.strip() == "Let me look."
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:  # the name comes first, with the id
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Zürich", "days": 3}
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}


def test_separate_reasoning_off_and_tool_choice_none(chat_srv):
    out = chat_srv.output
    r = post(chat_srv, chat_body(chat_srv, out, separate_reasoning=False, tool_choice="none"))
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": out}
    assert choice["finish_reason"] == "stop"


def test_a_conversation_with_tool_calls_and_tool_results(chat_srv):
    """The assistant's tool call and the tool's answer go back as the next turn."""
    first = post(chat_srv, chat_body(chat_srv, chat_srv.output)).json()
    msg = first["choices"][0]["message"]
    body = chat_body(chat_srv, "")
    body["messages"] += [
        {**msg, "content": None},
        {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "Sunny, 21C"},
    ]
    second = post(chat_srv, body).json()["choices"][0]
    assert second["finish_reason"] == "stop"
    text = (second["message"]["reasoning_content"] or "") + (second["message"]["content"] or "")
    assert text == "Sunny, 21C"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        # Forcing calls needs the grammar backend, which a server without a tokenizer.json
        # (this one: its engine is the mock) does not have; the real model's in
        # test_serving_e2e.py.
        ({"tool_choice": "required"}, "tokenizer.json"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tokenizer"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not one of"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "drop response_format",
        ),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
    ],
)
def test_refused_requests(chat_srv, extra, named):
    r = chat_srv.http.post("/v1/chat/completions", json=chat_body(chat_srv, "hi", **extra))
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text


def test_a_server_without_a_parser_still_refuses_tools(srv):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    r = srv.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert "--tool-call-parser" in r.json()["error"]["message"]


def test_tools_reach_the_template():
    t = ChatTemplate(
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments.city }}>"
        "{% endfor %}{{ m.tool_call_id or '' }};{% endfor %}{{ enable_thinking }}"
    )
    msgs = [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "cold", "tool_call_id": "c1"},
    ]  # fmt: skip
    got = t.render(msgs, tools=[WEATHER], template_kwargs={"enable_thinking": False})
    assert got == "[get_weather]assistant:<get_weather Oslo>;tool:coldc1;False"


def test_the_tiny_template_renders_tools_calls_and_results():
    t = ChatTemplate(CHAT_TEMPLATE, bos_token="B", eos_token="E")
    plain = [{"role": "user", "content": "q"}]
    assert t.render(plain) == "B<|user|>\nqE\n<|assistant|>\n"  # unchanged without tools
    msgs = [
        *plain,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
        {"role": "tool", "content": "cold", "tool_call_id": "c1"},
    ]  # fmt: skip
    got = t.render(msgs, tools=[WEATHER])
    assert got.startswith("B<|system|>\n# Tools\n{") and '"name": "get_weather"' in got
    assert got.endswith(
        "<|user|>\nqE\n<|assistant|>\n<tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>2</arg_value>"
        "</tool_call>E\n<|tool|>\ncoldE\n<|assistant|>\n"
    )
    # and the glm47 parser reads back what the template writes
    call = got.split("<|assistant|>\n")[1].removesuffix("E\n<|tool|>\ncoldE\n")
    p = tool_call_parser("glm47", [WEATHER])
    assert p.feed(call) + p.finish() == [ToolCall("get_weather", '{"city": "Oslo", "days": 2}')]


def test_tojson_takes_the_keywords_of_transformers():
    t = ChatTemplate("{{ tools[0] | tojson(ensure_ascii=False) }}|{{ 'é' | tojson }}")
    assert t.render([], tools=[{"a": "é"}]) == '{"a": "é"}|"é"'


def test_forced_calls_parse_from_their_json_and_malformed_json_is_content():
    """`JsonToolCalls`: `required`'s array of {name, parameters}, a named function's
    arguments object; anything else (cut by max_tokens) comes back as content."""
    from serving.parsers.chat import JsonToolCalls

    p = JsonToolCalls(None)
    assert p.feed('[{"name": "get_weather", "parameters": {"city": "Zürich"}}, ') == []
    assert p.feed('{"name": "f", "parameters": {}}]') == []
    assert p.finish() == [
        ToolCall("get_weather", '{"city": "Zürich"}'),
        ToolCall("f", "{}"),
    ]
    named = JsonToolCalls("get_weather")
    named.feed('{"city": "Oslo", "days": 2}')
    assert named.finish() == [ToolCall("get_weather", '{"city": "Oslo", "days": 2}')]
    cut = JsonToolCalls(None)
    cut.feed('[{"name": "get_weather", "param')
    assert cut.finish() == ['[{"name": "get_weather", "param']
    odd = JsonToolCalls(None)
    odd.feed('{"name": "x"}')
    assert odd.finish() == ['{"name": "x"}']


def test_the_forced_grammar_names_the_tools_and_waits_for_the_reasoning_end():
    """`forced_tool_grammar`: `required` is an array of the tools' calls (at most one with
    `parallel_tool_calls: false`), a named function its parameters' schema;
    `grammar_after_reasoning` starts it after `</think>` when the output starts in
    reasoning (glm45 by default, not with `enable_thinking: false`)."""
    from cpkv_jax.tokenizer import Tokenizer
    from cpkv_jax.tools.make_tiny_checkpoint import build_byte_tokenizer
    from serving.http.chat_output import forced_tool_grammar, grammar_after_reasoning
    from serving.http.models import ChatCompletionBody

    def body(**kw):
        base = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
        return ChatCompletionBody.model_validate({**base, **kw})

    tools = [WEATHER]
    assert forced_tool_grammar(body(tool_choice="auto"), tools) is None
    g = forced_tool_grammar(body(tool_choice="required", parallel_tool_calls=False), tools)
    schema = json.loads(g.source)
    assert g.kind == "json_schema" and schema["minItems"] == 1 and schema["maxItems"] == 1
    (call,) = schema["items"]["anyOf"]
    assert call["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert call["properties"]["parameters"] == WEATHER["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    g = forced_tool_grammar(body(tool_choice=named), tools)
    assert json.loads(g.source) == WEATHER["function"]["parameters"]
    tok = Tokenizer(build_byte_tokenizer())
    config = ChatParserConfig(reasoning="glm45", tool_call="glm47")
    after = grammar_after_reasoning(g, body(tool_choice=named), config, tok)
    assert after.after == tuple(tok.encode("</think>")) and after.source == g.source
    off = body(tool_choice=named, chat_template_kwargs={"enable_thinking": False})
    assert grammar_after_reasoning(g, off, config, tok) == g
    assert grammar_after_reasoning(g, body(), ChatParserConfig(tool_call="glm47"), tok) == g
