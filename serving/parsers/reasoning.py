"""Reasoning parsers: a model's `<think>...</think>` block becomes `reasoning_content`,
the rest `content` (SGLang's `--reasoning-parser`; names and switches as SGLang's).

- `glm45` (GLM-4.5 .. GLM-5): thinks by default, and GLM-5's template opens `<think>`
  itself, so the output starts inside the reasoning (an explicit leading `<think>` is
  dropped too); `chat_template_kwargs` `{"enable_thinking": false}` (or `"thinking"`)
  turns that off, and then only an explicit leading `<think>` opens a reasoning block.
- `deepseek-v3` (DeepSeek-V3.x): the same tags, but thinking is off unless the request
  sets `{"thinking": true}` (or `"enable_thinking"`) in `chat_template_kwargs`.

After `</think>` everything is content (its leading whitespace dropped). A tool call that
starts inside the reasoning (`interrupt`, the tool-call parser's start marker) ends the
reasoning there: the marker and what follows are content, for the tool-call parser.
The parser is incremental: a delta ending in `</th` holds those characters back until the
next delta (or `finish`) resolves them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from serving.parsers._text import find_first, held_suffix


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    name: str
    thinks_by_default: bool
    start: str = "<think>"
    end: str = "</think>"

    def thinking(self, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether the model starts in reasoning for a request with these template kwargs."""
        kwargs = chat_template_kwargs or {}
        for key in ("enable_thinking", "thinking"):
            value = kwargs.get(key)
            if isinstance(value, bool):
                return value
        return self.thinks_by_default


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "glm45": ReasoningFormat("glm45", thinks_by_default=True),
    "deepseek-v3": ReasoningFormat("deepseek-v3", thinks_by_default=False),
}


class ReasoningParser:
    """One output's reasoning split: `feed(delta) -> (reasoning, content)`, then `finish`."""

    def __init__(
        self, fmt: ReasoningFormat, *, in_reasoning: bool, interrupt: Sequence[str] = ()
    ) -> None:
        self.fmt = fmt
        self._in_reasoning = in_reasoning
        self._interrupt = tuple(interrupt)
        # opening: only whitespace or part of a leading `<think>` seen; reasoning; after_end:
        # the content's leading whitespace is dropped; content: everything passes.
        self._state = "opening"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf = self._buf
            if self._state == "opening":
                rest = buf.lstrip()
                start = self.fmt.start
                if rest.startswith(start):
                    self._state, self._buf = "reasoning", rest[len(start) :]
                elif not rest or start.startswith(rest):
                    break  # only whitespace, or maybe the start of `<think>`: wait
                else:
                    self._state = "reasoning" if self._in_reasoning else "content"
            elif self._state == "reasoning":
                i, marker = find_first(buf, (self.fmt.end, *self._interrupt))
                if i < 0:
                    keep = held_suffix(buf, (self.fmt.end, *self._interrupt))
                    reasoning.append(buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    break
                reasoning.append(buf[:i])
                if marker == self.fmt.end:
                    self._state, self._buf = "after_end", buf[i + len(marker) :]
                else:  # a tool call ends the reasoning; the call is content
                    self._state, self._buf = "content", buf[i:]
            elif self._state == "after_end":
                rest = buf.lstrip()
                self._buf = rest
                if not rest:
                    break
                self._state = "content"
            else:
                content.append(buf)
                self._buf = ""
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held back, once the output has ended."""
        buf, self._buf = self._buf, ""
        if self._state == "reasoning" or (self._state == "opening" and self._in_reasoning):
            return buf, ""
        if self._state == "after_end":
            return "", ""
        return "", buf


def reasoning_parser(
    name: str,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    *,
    interrupt: Sequence[str] = (),
) -> ReasoningParser:
    """A fresh parser of format `name` for one request."""
    fmt = REASONING_PARSERS[name]
    return ReasoningParser(
        fmt, in_reasoning=fmt.thinking(chat_template_kwargs), interrupt=interrupt
    )
