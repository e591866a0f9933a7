"""Tool-call parsers: a model's tool-call markup becomes OpenAI `tool_calls` (SGLang's
`--tool-call-parser`, same names).

- `glm45` (GLM-4.5 / 4.6): `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n
  </tool_call>`, one call per block;
- `glm47` (GLM-4.7, GLM-5): the same without the newlines
  (`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`); a call
  without arguments is `<tool_call>NAME</tool_call>`. Both GLM parsers accept either
  spacing. A value is a string unless the tool's JSON schema declares the parameter
  number / integer / boolean / object / array / null, and then it is `json.loads`ed when
  it parses (kept as the string when it does not);
- `deepseekv32` (DeepSeek-V3.2 "DSML"): `<｜DSML｜function_calls>` around one or more
  `<｜DSML｜invoke name="NAME">` ... `</｜DSML｜invoke>`, each holding
  `<｜DSML｜parameter name="P" string="true|false">VALUE</｜DSML｜parameter>` (string="true":
  the raw string; "false": a JSON value, kept as the string when it does not parse).

Text outside the markup is content; whitespace between or after calls is dropped. A block
is parsed once its closing tag has arrived, so a stream gets each call whole (its name,
then its arguments); until then nothing of it, not even a partial start tag, leaks into
the content. Malformed markup (a block that does not parse, or one never closed) is
returned as content, never an exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from serving.parsers._text import held_suffix

# A parameter declared with one of these JSON-schema types is parsed as JSON.
_JSON_TYPES = frozenset({"number", "integer", "boolean", "object", "array", "null"})


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the JSON text of the arguments object


def schema_properties(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """`{tool name: {parameter: its JSON schema}}` from OpenAI `tools`."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


def typed_value(schema: Any, raw: str) -> Any:
    """`raw` as the type its parameter's `schema` declares (module docstring)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if not kinds or "string" in kinds or not kinds <= _JSON_TYPES:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _json_args(args: Mapping[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


class ToolCallParser:
    """One output's tool calls: `feed(delta)` and `finish()` give a list of content strings
    and `ToolCall`s in output order. Subclasses set the block's `start` / `end` tags and
    `parse_block` (the text between them -> its calls, or None when malformed)."""

    name = ""
    start = ""
    end = ""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.schemas = schema_properties(tools)
        self._state = "text"  # text | block (after `start`) | between (after a call)
        self._buf = ""

    def parse_block(self, body: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        while True:
            buf = self._buf
            if self._state == "text":
                i = buf.find(self.start)
                if i < 0:
                    keep = held_suffix(buf, (self.start,))
                    out.append(buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    break
                out.append(buf[:i])
                self._state, self._buf = "block", buf[i + len(self.start) :]
            elif self._state == "block":
                j = buf.find(self.end)
                if j < 0:
                    break
                body, self._buf = buf[:j], buf[j + len(self.end) :]
                calls = self.parse_block(body)
                if calls is None:
                    out.append(self.start + body + self.end)
                    self._state = "text"
                else:
                    out.extend(calls)
                    self._state = "between"
            else:  # between: drop whitespace before the next block or the end
                rest = buf.lstrip()
                if rest.startswith(self.start):
                    self._state, self._buf = "text", rest
                elif not rest or self.start.startswith(rest):
                    break
                else:
                    self._state = "text"
        return [x for x in out if x != ""]

    def finish(self) -> list[str | ToolCall]:
        buf, self._buf = self._buf, ""
        if self._state == "block":
            return [self.start + buf]  # never closed: it was not a call
        if self._state == "between" and not buf.strip():
            return []
        return [buf] if buf else []


class Glm45ToolCallParser(ToolCallParser):
    name = "glm45"
    start = "<tool_call>"
    end = "</tool_call>"
    _NAME = re.compile(r"[^\s<>]+")

    def parse_block(self, body: str) -> list[ToolCall] | None:
        k = body.find("<arg_key>")
        name = (body if k < 0 else body[:k]).strip()
        if not self._NAME.fullmatch(name):
            return None
        schema = self.schemas.get(name, {})
        args: dict[str, Any] = {}
        pos = len(body) if k < 0 else k
        while True:
            while pos < len(body) and body[pos].isspace():
                pos += 1
            if pos == len(body):
                break
            key, pos = _tagged(body, pos, "<arg_key>", "</arg_key>")
            if key is None:
                return None
            while pos < len(body) and body[pos].isspace():
                pos += 1
            value, pos = _tagged(body, pos, "<arg_value>", "</arg_value>")
            if value is None:
                return None
            key = key.strip()
            args[key] = typed_value(schema.get(key), value)
        return [ToolCall(name, _json_args(args))]


class Glm47ToolCallParser(Glm45ToolCallParser):
    name = "glm47"


def _tagged(body: str, pos: int, open_tag: str, close_tag: str) -> tuple[str | None, int]:
    """The text of `open_tag`...`close_tag` at `pos`, and the position after it."""
    if not body.startswith(open_tag, pos):
        return None, pos
    end = body.find(close_tag, pos + len(open_tag))
    if end < 0:
        return None, pos
    inner = body[pos + len(open_tag) : end]
    if open_tag in inner:
        return None, pos
    return inner, end + len(close_tag)


_BAR = "｜"  # FULLWIDTH VERTICAL LINE, U+FF5C
_DSML = f"{_BAR}DSML{_BAR}"


class DeepSeekV32ToolCallParser(ToolCallParser):
    name = "deepseekv32"
    start = f"<{_DSML}function_calls>"
    end = f"</{_DSML}function_calls>"
    _INVOKE = re.compile(rf'\s*<{_DSML}invoke\s+name="([^"<>]+)"\s*>')
    _INVOKE_END = re.compile(rf"\s*</{_DSML}invoke>")
    _PARAM = re.compile(rf'\s*<{_DSML}parameter\s+name="([^"<>]+)"\s+string="(true|false)"\s*>')
    _PARAM_END = f"</{_DSML}parameter>"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        pos = 0
        while body[pos:].strip():
            m = self._INVOKE.match(body, pos)
            if m is None:
                return None
            name, pos = m.group(1).strip(), m.end()
            args: dict[str, Any] = {}
            while (end := self._INVOKE_END.match(body, pos)) is None:
                p = self._PARAM.match(body, pos)
                if p is None:
                    return None
                close = body.find(self._PARAM_END, p.end())
                if close < 0:
                    return None
                raw = body[p.end() : close]
                if p.group(2) == "true":
                    args[p.group(1)] = raw
                else:
                    try:
                        args[p.group(1)] = json.loads(raw)
                    except ValueError:
                        args[p.group(1)] = raw
                pos = close + len(self._PARAM_END)
            pos = end.end()
            calls.append(ToolCall(name, _json_args(args)))
        return calls or None


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "glm45": Glm45ToolCallParser,
    "glm47": Glm47ToolCallParser,
    "deepseekv32": DeepSeekV32ToolCallParser,
}


def tool_call_parser(name: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ToolCallParser:
    """A fresh parser of format `name` for one request with these `tools`."""
    return TOOL_CALL_PARSERS[name](tools)
