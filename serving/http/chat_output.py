"""Tools and reasoning of `/v1/chat/completions`: which `tools` a request may send with
the server's parsers (`--tool-call-parser`, `--reasoning-parser`), and the response
fields that the parsers make (`message.tool_calls`, `message.reasoning_content`,
`finish_reason: "tool_calls"`, and the stream deltas of each).

`tool_choice`: `"auto"` (the default with tools) renders the tools into the prompt and
parses the calls the model makes; `"none"` neither renders nor parses them. `"required"`
and a named function force calls by constrained decoding, as vLLM and SGLang do: the
answer must be JSON (`forced_tool_grammar`), an array of `{"name", "parameters"}` objects
naming the tools (one at most with `parallel_tool_calls: false`), or the named function's
arguments object; `JsonToolCalls` turns it into `tool_calls`. With a reasoning parser
whose output starts in reasoning, the constraint starts after the reasoning's end tag
(`grammar_after_reasoning`): the model thinks freely first. `parallel_tool_calls: false`
keeps the first parsed call only. Without `--tool-call-parser`, `tools` must be empty and
`tool_choice` `"none"` / `"auto"`, as before.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from cpkv_jax.tokenizer import Tokenizer
from serving.engine.api import Grammar
from serving.http.errors import ApiError
from serving.http.models import ChatCompletionBody, NamedToolChoice, off
from serving.parsers import ChatOutputParser, ChatParserConfig
from serving.parsers.reasoning import REASONING_PARSERS


def request_tools(body: ChatCompletionBody, parsers: ChatParserConfig) -> list[dict] | None:
    """The tools to render and parse for `body` (None: none), or a 400 (module doc)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    choice = body.tool_choice
    if parsers.tool_call is None or not tools:
        if tools:
            raise ApiError(
                400,
                off([]).refusal("tools", tools)
                + " (start the server with --tool-call-parser to accept tools)",
            )
        if choice not in (None, "none", "auto"):
            shown = choice if isinstance(choice, str) else choice.model_dump()
            raise ApiError(400, off("none", "auto").refusal("tool_choice", shown))
        return None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name")
        names = [t["function"]["name"] for t in tools]
        if name not in names:
            raise ApiError(
                400,
                f"tool_choice names the function {name!r}, which is not one of the tools {names}",
            )
    return None if choice == "none" else tools


def forced_tool_grammar(body: ChatCompletionBody, tools: list[dict] | None) -> Grammar | None:
    """The JSON schema that forces the calls `tool_choice` asks for (module doc), or None
    (`auto`, `none`): a 400 when the body also asks for another constraint."""
    choice = body.tool_choice
    if tools is None or choice in (None, "none", "auto"):
        return None
    if body.grammar() is not None:
        raise ApiError(
            400,
            "tool_choice 'required' or a named function constrains the output itself: "
            "drop response_format (and the other structured-output fields)",
        )

    def params(tool: dict) -> dict:
        return tool["function"].get("parameters") or {"type": "object"}

    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t["function"]["name"] == choice.function.get("name"))
        return Grammar("json_schema", json.dumps(params(tool)))
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": params(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return Grammar("json_schema", json.dumps(schema))


def grammar_after_reasoning(
    grammar: Grammar | None,
    body: ChatCompletionBody,
    parsers: ChatParserConfig,
    tokenizer: Tokenizer | None,
) -> Grammar | None:
    """`grammar`, applying only after the reasoning block's end tag when the server has a
    reasoning parser and this request's output starts in reasoning (SGLang's and vLLM's
    rule: the model thinks freely, then answers under the constraint)."""
    if grammar is None or parsers.reasoning is None or not body.separate_reasoning:
        return grammar
    fmt = REASONING_PARSERS[parsers.reasoning]
    if not fmt.thinking(body.chat_template_kwargs) or tokenizer is None:
        return grammar
    return dataclasses.replace(grammar, after=tuple(tokenizer.encode(fmt.end)))


def output_parser(
    body: ChatCompletionBody, parsers: ChatParserConfig, tools: list[dict] | None
) -> ChatOutputParser | None:
    """The request's output parser, or None when the text is the output as it is."""
    choice = body.tool_choice
    forced = None
    if tools is not None and choice not in (None, "none", "auto"):
        forced = choice.function.get("name") if isinstance(choice, NamedToolChoice) else ""
    parser = ChatOutputParser(
        parsers,
        tools=tools,
        chat_template_kwargs=body.chat_template_kwargs,
        separate_reasoning=body.separate_reasoning,
        parallel_tool_calls=body.parallel_tool_calls,
        forced_tool=forced,
    )
    if parser.tools is None and parser.thinking is None:
        return None
    return parser


def finish_reason(parser: ChatOutputParser | None, reason: str | None) -> str | None:
    """`"tool_calls"` for an output that stopped after calling tools."""
    if parser is not None and parser.tool_calls and reason == "stop":
        return "tool_calls"
    return reason


def message(parser: ChatOutputParser | None, text: str) -> dict[str, Any]:
    """The non-streaming `message` for the whole output `text`."""
    if parser is None:
        return {"role": "assistant", "content": text}
    parser.feed(text)
    parser.finish()
    out: dict[str, Any] = {"role": "assistant", "content": parser.content}
    if parser.has_reasoning:
        out["reasoning_content"] = parser.reasoning or None
    if parser.tool_calls:
        out["tool_calls"] = parser.tool_calls
        out["content"] = parser.content or None
    return out


def stream_deltas(parser: ChatOutputParser | None, text: str, final: bool) -> list[dict]:
    """The stream `delta`s of one chunk's text (`final`: the output ends here)."""
    if parser is None:
        return [{"content": text}] if text else []
    d = parser.finish() if final and not text else parser.feed(text)
    if final and text:
        end = parser.finish()
        d.reasoning += end.reasoning
        d.content += end.content
        d.tool_calls += end.tool_calls
    out: list[dict] = []
    if d.reasoning:
        out.append({"reasoning_content": d.reasoning})
    if d.content:
        out.append({"content": d.content})
    out.extend({"tool_calls": [tc]} for tc in d.tool_calls)
    return out
