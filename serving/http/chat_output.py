"""Tools and reasoning of `/v1/chat/completions`: which `tools` a request may send with
the server's parsers (`--tool-call-parser`, `--reasoning-parser`), and the response
fields that the parsers make (`message.tool_calls`, `message.reasoning_content`,
`finish_reason: "tool_calls"`, and the stream deltas of each).

`tool_choice`: `"auto"` (the default with tools) renders the tools into the prompt and
parses the calls the model makes; `"none"` neither renders nor parses them. `"required"`
and a named function are refused (400): they promise that the model calls a tool (that
one), and only constrained decoding (a grammar over the call markup, which this server
does not have yet) can keep that promise; accepting them unconstrained would let a
client rely on a call that may not come. `parallel_tool_calls: false` keeps the first
parsed call only. Without `--tool-call-parser`, `tools` must be empty and `tool_choice`
`"none"` / `"auto"`, as before.
"""

from __future__ import annotations

from typing import Any

from serving.http.errors import ApiError
from serving.http.models import ChatCompletionBody, off
from serving.parsers import ChatOutputParser, ChatParserConfig


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
    if choice not in (None, "none", "auto"):
        shown = choice if isinstance(choice, str) else choice.model_dump()
        raise ApiError(
            400,
            off("none", "auto").refusal("tool_choice", shown)
            + ": forcing a tool call needs constrained decoding, which this server does "
            "not have yet",
        )
    return None if choice == "none" else tools


def output_parser(
    body: ChatCompletionBody, parsers: ChatParserConfig, tools: list[dict] | None
) -> ChatOutputParser | None:
    """The request's output parser, or None when the text is the output as it is."""
    parser = ChatOutputParser(
        parsers,
        tools=tools,
        chat_template_kwargs=body.chat_template_kwargs,
        separate_reasoning=body.separate_reasoning,
        parallel_tool_calls=body.parallel_tool_calls,
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
