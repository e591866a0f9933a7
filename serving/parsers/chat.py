"""`ChatOutputParser`: the reasoning and tool-call parsers chained for one chat request.

Text deltas go through the reasoning parser first (when the server has one and the
request keeps `separate_reasoning`), its content through the tool-call parser (when the
server has one and the request asked for tools). `feed` / `finish` give a `ChatDelta`:
reasoning text, content text and the OpenAI stream deltas of the tool calls: a call's
`id`, `type` and `function.name` with empty arguments as soon as its name is parsed, then
`function.arguments` fragments as they are parsed (one delta per call and step; their
concatenation is the arguments' JSON text). The whole output is kept too (`reasoning`,
`content`, `tool_calls` with each call's whole arguments), for a non-streaming response.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from serving.parsers.reasoning import ReasoningParser, reasoning_parser
from serving.parsers.tool_calls import (
    Event,
    ToolCall,
    ToolCallArgs,
    ToolCallParser,
    ToolCallStart,
    tool_call_parser,
)


@dataclasses.dataclass(frozen=True)
class ChatParserConfig:
    """The server's parsers (`--reasoning-parser`, `--tool-call-parser`); None: none."""

    reasoning: str | None = None
    tool_call: str | None = None


@dataclasses.dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class JsonToolCalls:
    """The answer of a request whose `tool_choice` forced calls (`required`: a JSON array
    of `{"name", "parameters"}`; a named function: its arguments object), held until the
    output ends, then turned into `ToolCall`s. Output that is not such JSON (a length
    stop mid-answer) comes back as content."""

    start = ""  # no markup: nothing interrupts the reasoning

    def __init__(self, function: str | None) -> None:
        self.function = function  # the named function, or None for `required`
        self._buf = ""

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        return []

    def finish(self) -> list[str | ToolCall]:
        buf, self._buf = self._buf, ""
        try:
            value = json.loads(buf)
        except ValueError:
            return [buf] if buf else []
        if self.function is not None and isinstance(value, dict):
            return [ToolCall(self.function, json.dumps(value, ensure_ascii=False))]
        if not isinstance(value, list):
            return [buf]
        calls: list[str | ToolCall] = [
            ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            for c in value
            if isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c
        ]
        return calls or [buf]


class ChatOutputParser:
    def __init__(
        self,
        config: ChatParserConfig,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        separate_reasoning: bool = True,
        parallel_tool_calls: bool = True,
        forced_tool: str | None = None,
    ) -> None:
        # `forced_tool`: `tool_choice` forced the calls ("" for `required`, else the
        # function's name); the answer is JSON (`serving.http.chat_output`).
        self.tools: ToolCallParser | JsonToolCalls | None = None
        if forced_tool is not None:
            self.tools = JsonToolCalls(forced_tool or None)
        elif config.tool_call is not None and tools:
            self.tools = tool_call_parser(config.tool_call, tools)
        self.thinking: ReasoningParser | None = None
        if config.reasoning is not None and separate_reasoning:
            interrupt = (self.tools.start,) if isinstance(self.tools, ToolCallParser) else ()
            self.thinking = reasoning_parser(
                config.reasoning, chat_template_kwargs, interrupt=interrupt
            )
        self.parallel_tool_calls = parallel_tool_calls
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[dict[str, Any]] = []  # the OpenAI `message.tool_calls`
        self._open: int | None = None  # the index of the call whose arguments stream

    @property
    def has_reasoning(self) -> bool:
        return self.thinking is not None

    def feed(self, text: str) -> ChatDelta:
        return self._step(text, final=False)

    def finish(self) -> ChatDelta:
        return self._step("", final=True)

    def _step(self, text: str, *, final: bool) -> ChatDelta:
        delta = ChatDelta()
        if self.thinking is not None:
            reasoning, content = self.thinking.feed(text)
            if final:
                more_r, more_c = self.thinking.finish()
                reasoning, content = reasoning + more_r, content + more_c
            delta.reasoning = reasoning
        else:
            content = text
        if self.tools is None:
            delta.content = content
        else:
            parts = []
            for event in self._events(content, final):
                if isinstance(event, ToolCallStart):
                    self._start(event.name, delta.tool_calls)
                elif isinstance(event, ToolCallArgs):
                    self._arguments(event, delta.tool_calls)
                else:
                    parts.append(event)
            delta.content = "".join(parts)
        self.reasoning += delta.reasoning
        self.content += delta.content
        return delta

    def _events(self, text: str, final: bool) -> list[Event]:
        if isinstance(self.tools, ToolCallParser):
            events = self.tools.feed_events(text)
            return events + self.tools.finish_events() if final else events
        assert self.tools is not None
        items = self.tools.feed(text) + (self.tools.finish() if final else [])
        out: list[Event] = []
        for item in items:  # JsonToolCalls: each call whole
            if isinstance(item, ToolCall):
                out += [ToolCallStart(item.name), ToolCallArgs(item.arguments, end=True)]
            else:
                out.append(item)
        return out

    def _start(self, name: str, deltas: list[dict[str, Any]]) -> None:
        if self.tool_calls and not self.parallel_tool_calls:
            self._open = None  # parallel_tool_calls=false: the first call only
            return
        self._open = len(self.tool_calls)
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        self.tool_calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        )
        deltas.append(
            {
                "index": self._open,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        )

    def _arguments(self, event: ToolCallArgs, deltas: list[dict[str, Any]]) -> None:
        index = self._open
        if index is None:
            return
        if event.end:
            self._open = None
        if not event.text:
            return
        self.tool_calls[index]["function"]["arguments"] += event.text
        last = deltas[-1] if deltas else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += event.text  # one delta per call and step
        else:
            deltas.append({"index": index, "function": {"arguments": event.text}})
