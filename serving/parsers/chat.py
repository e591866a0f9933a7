"""`ChatOutputParser`: the reasoning and tool-call parsers chained for one chat request.

Text deltas go through the reasoning parser first (when the server has one and the
request keeps `separate_reasoning`), its content through the tool-call parser (when the
server has one and the request asked for tools). `feed` / `finish` give a `ChatDelta`:
reasoning text, content text and the OpenAI stream deltas of the tool calls parsed (each
call as two: `id`, `type` and `function.name` with empty arguments, then its arguments).
The whole output is kept too (`reasoning`, `content`, `tool_calls`), for a non-streaming
response.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from serving.parsers.reasoning import ReasoningParser, reasoning_parser
from serving.parsers.tool_calls import ToolCall, ToolCallParser, tool_call_parser


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


class ChatOutputParser:
    def __init__(
        self,
        config: ChatParserConfig,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        separate_reasoning: bool = True,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.tools: ToolCallParser | None = None
        if config.tool_call is not None and tools:
            self.tools = tool_call_parser(config.tool_call, tools)
        self.thinking: ReasoningParser | None = None
        if config.reasoning is not None and separate_reasoning:
            interrupt = (self.tools.start,) if self.tools is not None else ()
            self.thinking = reasoning_parser(
                config.reasoning, chat_template_kwargs, interrupt=interrupt
            )
        self.parallel_tool_calls = parallel_tool_calls
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[dict[str, Any]] = []  # the OpenAI `message.tool_calls`

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
            items = self.tools.feed(content)
            if final:
                items += self.tools.finish()
            parts = []
            for item in items:
                if isinstance(item, ToolCall):
                    delta.tool_calls.extend(self._call(item))
                else:
                    parts.append(item)
            delta.content = "".join(parts)
        self.reasoning += delta.reasoning
        self.content += delta.content
        return delta

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        if self.tool_calls and not self.parallel_tool_calls:
            return []  # parallel_tool_calls=false: the first call only
        index = len(self.tool_calls)
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        function = {"name": call.name, "arguments": call.arguments}
        self.tool_calls.append({"id": call_id, "type": "function", "function": function})
        return [
            {
                "index": index,
                "id": call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            },
            {"index": index, "function": {"arguments": call.arguments}},
        ]
