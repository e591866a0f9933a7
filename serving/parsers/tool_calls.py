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

Text outside the markup is content; whitespace between or after calls is dropped.
`feed_events` / `finish_events` stream the calls as SGLang and vLLM do: a
`ToolCallStart` as soon as a call's name is complete (GLM: the text after `<tool_call>` up
to `<arg_key>`, a newline or `</tool_call>`; DSML: a whole `<｜DSML｜invoke name="...">`
tag) and names one of the request's tools, then `ToolCallArgs` fragments whose
concatenation is the arguments' JSON text (`{"k": "v", "n": 3}`, as `json.dumps` writes
it): a string value streams as it arrives (JSON-escaped, holding back what may be the
start of its closing tag), a typed (or DSML string="false") value goes out whole at its
closing tag, and `}` at the call's end. Nothing of an open block, not even a partial start
tag, leaks into the content.

A block whose first name is not one of the tools, or that does not parse up to its first
name, is parsed once its closing tag has arrived: its calls go out whole then, or the
whole block as content when it does not parse (or is never closed). Malformed markup
after a call has started streaming (or the output ending inside the block) closes that
call's arguments as valid JSON (a string value in progress gets its `"`, then `}`) and
the rest of the block, from the first element not parsed, is content. Never an
exception. `feed` / `finish` give the same with each call whole (a `ToolCall`, at its end).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from serving.parsers._text import find_first, held_suffix

# A parameter declared with one of these JSON-schema types is parsed as JSON.
_JSON_TYPES = frozenset({"number", "integer", "boolean", "object", "array", "null"})


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the JSON text of the arguments object


@dataclass(frozen=True)
class ToolCallStart:
    """A call begins: its name (its arguments follow as `ToolCallArgs`)."""

    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    """A fragment of the open call's arguments JSON text; `end`: the call's last one."""

    text: str
    end: bool = False


Event = str | ToolCallStart | ToolCallArgs  # a str is content


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


def json_typed(schema: Any) -> bool:
    """Whether a parameter of this JSON `schema` is parsed as JSON (module docstring)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    return bool(kinds) and "string" not in kinds and kinds <= _JSON_TYPES


def typed_value(schema: Any, raw: str) -> Any:
    """`raw` as the type its parameter's `schema` declares (module docstring)."""
    if not json_typed(schema):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _json_args(args: Mapping[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _escaped(text: str) -> str:
    """`text` JSON-escaped without its quotes: escaping is per character, so the pieces of
    a string escaped one by one concatenate to the whole string escaped."""
    return _dump(text)[1:-1]


def _pending(rest: str, *tags: str) -> bool:
    """Whether `rest` may still become one of the tags that begin with `tags` (a proper
    prefix of one, or one whose closing `>` has not arrived)."""
    return any(t.startswith(rest) or (rest.startswith(t) and ">" not in rest) for t in tags)


class ToolCallParser:
    """One output's tool calls. `feed_events(delta)` and `finish_events()` give content
    strings, `ToolCallStart`s and `ToolCallArgs` in output order; `feed` / `finish` the
    content and whole `ToolCall`s. Subclasses set the block's `start` / `end` tags,
    `parse_block` (the text between them -> its calls, or None when malformed), `_head`
    (a block's first call name) and `_step_call` (one step of a streaming block)."""

    name = ""
    start = ""
    end = ""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.schemas = schema_properties(tools)
        # text | head (after `start`, before the first name) | whole (buffered to the end
        # tag) | call (streaming, parsed by the subclass) | between (after a block)
        self._state = "text"
        self._buf = ""
        self._open = False  # a call streams: its arguments are not closed yet
        self._schema: dict[str, Any] = {}  # the open call's parameters
        self._nargs = 0  # arguments of the open call sent so far
        self._in_string = False  # inside a string value (its opening quote sent)
        self._whole: tuple[str, list[str]] | None = None  # `feed`'s call being assembled

    def parse_block(self, body: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def _head(self, buf: str) -> tuple[str, int] | None:
        """The block's first call name and where it ends in `buf` (the text after the start
        tag): None while it may still come, "" when the block does not parse up to it."""
        raise NotImplementedError

    def _step_call(self, out: list[Event]) -> bool:
        """Parse on in a streaming block; False when more text is needed."""
        raise NotImplementedError

    # ---- streaming --------------------------------------------------------------------

    def feed_events(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return _nonempty(out)

    def finish_events(self) -> list[Event]:
        out: list[Event] = []
        while self._state == "call":  # the output ended inside a streaming block
            if self._in_string:  # what was held back is the value's text after all
                out.append(ToolCallArgs(_escaped(self._buf)))
                self._buf = ""
            self._abandon(out, self._buf.lstrip())
            while self._step(out):
                pass
        buf, self._buf = self._buf, ""
        if self._state in ("head", "whole"):
            out.append(self.start + buf)  # never closed: it was not a call
        elif not (self._state == "between" and not buf.strip()):
            out.append(buf)
        self._state = "text"
        return _nonempty(out)

    def _step(self, out: list[Event]) -> bool:
        buf = self._buf
        if self._state == "text":
            i = buf.find(self.start)
            if i < 0:
                keep = held_suffix(buf, (self.start,))
                out.append(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return False
            out.append(buf[:i])
            self._state, self._buf = "head", buf[i + len(self.start) :]
        elif self._state == "head":
            head = self._head(buf)
            if head is None:
                return False
            name, n = head
            if not name or name not in self.schemas:
                self._state = "whole"
                return True
            self._start_call(out, name)
            self._state, self._buf = "call", buf[n:]
        elif self._state == "whole":
            j = buf.find(self.end)
            if j < 0:
                return False
            body, self._buf = buf[:j], buf[j + len(self.end) :]
            calls = self.parse_block(body)
            if calls is None:
                out.append(self.start + body + self.end)
                self._state = "text"
            else:
                for call in calls:
                    out += [ToolCallStart(call.name), ToolCallArgs(call.arguments, end=True)]
                self._state = "between"
        elif self._state == "call":
            return self._step_call(out)
        else:  # between: drop whitespace before the next block or the end
            rest = buf.lstrip()
            if rest.startswith(self.start):
                self._state, self._buf = "text", rest
            elif not rest or self.start.startswith(rest):
                return False
            else:
                self._state = "text"
        return True

    def _start_call(self, out: list[Event], name: str) -> None:
        out.append(ToolCallStart(name))
        self._open, self._schema, self._nargs = True, self.schemas.get(name, {}), 0

    def _argument(self, out: list[Event], key: str, value: str) -> None:
        """Send a `"key": ` and `value` (a JSON text, or the opening quote of a string)."""
        out.append(ToolCallArgs(("{" if self._nargs == 0 else ", ") + _dump(key) + ": " + value))
        self._nargs += 1

    def _close_call(self, out: list[Event]) -> None:
        text = ('"' if self._in_string else "") + ("}" if self._nargs else "{}")
        out.append(ToolCallArgs(text, end=True))
        self._open = self._in_string = False

    def _close_block(self, out: list[Event], after: str) -> None:
        if self._open:
            self._close_call(out)
        self._state, self._buf = "between", after

    def _abandon(self, out: list[Event], rest: str) -> None:
        """Malformed markup in a streaming block: the open call's arguments close as valid
        JSON and `rest`, the block's text from what did not parse on, is content."""
        if self._open:
            self._close_call(out)
        self._state, self._buf = "text", rest

    def _stream_string(self, out: list[Event], close: str) -> bool:
        """Send the string value in `_buf` up to its `close` tag, holding back a suffix
        that may be the start of that tag or of the block's end tag."""
        buf = self._buf
        i, tag = find_first(buf, (close, self.end))
        if i < 0:
            keep = held_suffix(buf, (close, self.end))
            out.append(ToolCallArgs(_escaped(buf[: len(buf) - keep])))
            self._buf = buf[len(buf) - keep :]
            return False
        if tag == self.end:  # the block ends inside the value: malformed
            out.append(ToolCallArgs(_escaped(buf[:i])))
            self._abandon(out, buf[i:])
            return True
        out.append(ToolCallArgs(_escaped(buf[:i]) + '"'))
        self._in_string, self._buf = False, buf[i + len(close) :]
        return True

    # ---- whole calls ------------------------------------------------------------------

    def feed(self, text: str) -> list[str | ToolCall]:
        return self._assemble(self.feed_events(text))

    def finish(self) -> list[str | ToolCall]:
        return self._assemble(self.finish_events())

    def _assemble(self, events: list[Event]) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        for e in events:
            if isinstance(e, ToolCallStart):
                self._whole = (e.name, [])
            elif isinstance(e, ToolCallArgs):
                assert self._whole is not None
                self._whole[1].append(e.text)
                if e.end:
                    out.append(ToolCall(self._whole[0], "".join(self._whole[1])))
                    self._whole = None
            else:
                out.append(e)
        return out


def _nonempty(events: list[Event]) -> list[Event]:
    return [e for e in events if (e.text if isinstance(e, ToolCallArgs) else e != "")]


class Glm45ToolCallParser(ToolCallParser):
    name = "glm45"
    start = "<tool_call>"
    end = "</tool_call>"
    _NAME = re.compile(r"[^\s<>]+")
    _KEY, _KEY_END = "<arg_key>", "</arg_key>"
    _VALUE, _VALUE_END = "<arg_value>", "</arg_value>"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        k = body.find(self._KEY)
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
            key, pos = _tagged(body, pos, self._KEY, self._KEY_END)
            if key is None:
                return None
            while pos < len(body) and body[pos].isspace():
                pos += 1
            value, pos = _tagged(body, pos, self._VALUE, self._VALUE_END)
            if value is None:
                return None
            key = key.strip()
            args[key] = typed_value(schema.get(key), value)
        return [ToolCall(name, _json_args(args))]

    def _head(self, buf: str) -> tuple[str, int] | None:
        rest = buf.lstrip()
        i, _ = find_first(rest, (self._KEY, "\n", self.end))
        if i < 0:
            return None
        name = rest[:i].strip()
        return (name if self._NAME.fullmatch(name) else ""), len(buf) - len(rest) + i

    def _step_call(self, out: list[Event]) -> bool:
        if self._in_string:
            return self._stream_string(out, self._VALUE_END)
        rest = self._buf.lstrip()
        if rest.startswith(self.end):
            self._close_block(out, rest[len(self.end) :])
        elif rest.startswith(self._KEY):
            return self._pair(out, rest)
        elif _pending(rest, self._KEY, self.end):
            self._buf = rest
            return False
        else:
            self._abandon(out, rest)
        return True

    def _pair(self, out: list[Event], rest: str) -> bool:
        """`<arg_key>K</arg_key><arg_value>` at the start of `rest`: a string value starts
        streaming; a typed one waits for its `</arg_value>` and goes out whole."""
        self._buf = rest  # parsed again from here while incomplete
        inner = rest[len(self._KEY) :]
        i, tag = find_first(inner, (self._KEY_END, self._KEY, self.end))
        if i < 0:
            return False
        if tag != self._KEY_END:
            self._abandon(out, rest)
            return True
        key = inner[:i].strip()
        after = inner[i + len(self._KEY_END) :]
        value = after.lstrip()
        if not value.startswith(self._VALUE):
            if not self._VALUE.startswith(value):
                self._abandon(out, rest)
                return True
            return False
        value = value[len(self._VALUE) :]
        schema = self._schema.get(key)
        if not json_typed(schema):
            self._argument(out, key, '"')
            self._in_string, self._buf = True, value
            return True
        j, tag = find_first(value, (self._VALUE_END, self.end))
        if j < 0:
            return False
        if tag != self._VALUE_END:
            self._abandon(out, rest)
            return True
        self._argument(out, key, _dump(typed_value(schema, value[:j])))
        self._buf = value[j + len(self._VALUE_END) :]
        return True


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
    _INVOKE_OPEN = f"<{_DSML}invoke"
    _INVOKE_END = f"</{_DSML}invoke>"
    _INVOKE_END_RE = re.compile(rf"\s*{_INVOKE_END}")
    _PARAM = re.compile(rf'\s*<{_DSML}parameter\s+name="([^"<>]+)"\s+string="(true|false)"\s*>')
    _PARAM_OPEN = f"<{_DSML}parameter"
    _PARAM_END = f"</{_DSML}parameter>"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        pos = 0
        while body[pos:].strip():
            parsed = self._invoke(body, pos)
            if parsed is None:
                return None
            call, pos = parsed
            calls.append(call)
        return calls or None

    def _invoke(self, body: str, pos: int) -> tuple[ToolCall, int] | None:
        """The whole invoke at `pos` of `body` and the position after it, or None."""
        m = self._INVOKE.match(body, pos)
        if m is None:
            return None
        name, pos = m.group(1).strip(), m.end()
        args: dict[str, Any] = {}
        while (end := self._INVOKE_END_RE.match(body, pos)) is None:
            p = self._PARAM.match(body, pos)
            if p is None:
                return None
            close = body.find(self._PARAM_END, p.end())
            if close < 0:
                return None
            raw = body[p.end() : close]
            args[p.group(1)] = raw if p.group(2) == "true" else _json_or_raw(raw)
            pos = close + len(self._PARAM_END)
        return ToolCall(name, _json_args(args)), end.end()

    def _head(self, buf: str) -> tuple[str, int] | None:
        rest = buf.lstrip()
        if rest.startswith(self._INVOKE_OPEN) and ">" in rest:
            m = self._INVOKE.match(buf)
            return (m.group(1).strip(), m.end()) if m else ("", 0)
        if _pending(rest, self._INVOKE_OPEN) or self.end.startswith(rest):
            return None
        return "", 0

    def _step_call(self, out: list[Event]) -> bool:
        if self._in_string:
            return self._stream_string(out, self._PARAM_END)
        rest = self._buf.lstrip()
        if not self._open:  # between invokes
            if rest.startswith(self.end):
                self._close_block(out, rest[len(self.end) :])
                return True
            if rest.startswith(self._INVOKE_OPEN) and ">" in rest:
                return self._next_invoke(out, rest)
            if _pending(rest, self._INVOKE_OPEN, self.end):
                self._buf = rest
                return False
        elif rest.startswith(self._INVOKE_END):
            self._close_call(out)
            self._buf = rest[len(self._INVOKE_END) :]
            return True
        elif rest.startswith(self._PARAM_OPEN) and ">" in rest:
            return self._param(out, rest)
        elif _pending(rest, self._PARAM_OPEN, self._INVOKE_END):
            self._buf = rest
            return False
        self._abandon(out, rest)
        return True

    def _next_invoke(self, out: list[Event], rest: str) -> bool:
        """An invoke after the block's first: a tool's streams, another name's goes out
        whole once it has parsed."""
        m = self._INVOKE.match(rest)
        if m is None:
            self._abandon(out, rest)
            return True
        name = m.group(1).strip()
        if name in self.schemas:
            self._start_call(out, name)
            self._buf = rest[m.end() :]
            return True
        j = rest.find(self.end)
        parsed = self._invoke(rest if j < 0 else rest[:j], 0)
        if parsed is None:
            self._buf = rest
            if j < 0:
                return False  # it may parse once more has arrived
            self._abandon(out, rest)
            return True
        call, pos = parsed
        out += [ToolCallStart(call.name), ToolCallArgs(call.arguments, end=True)]
        self._buf = rest[pos:]
        return True

    def _param(self, out: list[Event], rest: str) -> bool:
        """A `<｜DSML｜parameter ...>` tag at the start of `rest`: string="true" streams,
        string="false" waits for its closing tag and goes out whole."""
        p = self._PARAM.match(rest)
        if p is None:
            self._abandon(out, rest)
            return True
        value = rest[p.end() :]
        if p.group(2) == "true":
            self._argument(out, p.group(1), '"')
            self._in_string, self._buf = True, value
            return True
        j, tag = find_first(value, (self._PARAM_END, self.end))
        if j < 0:
            self._buf = rest
            return False
        if tag != self._PARAM_END:
            self._abandon(out, rest)
            return True
        self._argument(out, p.group(1), _dump(_json_or_raw(value[:j])))
        self._buf = value[j + len(self._PARAM_END) :]
        return True


def _json_or_raw(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "glm45": Glm45ToolCallParser,
    "glm47": Glm47ToolCallParser,
    "deepseekv32": DeepSeekV32ToolCallParser,
}


def tool_call_parser(name: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ToolCallParser:
    """A fresh parser of format `name` for one request with these `tools`."""
    return TOOL_CALL_PARSERS[name](tools)
