"""DeepSeek-V3.2's chat format, built in: its HF checkpoint ships no Jinja chat template,
only Python that encodes messages (`encoding/encoding_dsv32.py`), so the server renders
that format itself when a `deepseek_v32` model dir has no template of its own.

The format (as DeepSeek's encoder, SGLang and vLLM render it):
- `<｜begin▁of▁sentence｜>`, then the system message's text; request `tools` follow it as a
  `## Tools` section listing each tool's JSON schema and the DSML call syntax that
  `--tool-call-parser deepseekv32` reads back. With tools and no system message, an empty
  one is added first, so the tools are always in the prompt.
- a user turn is `<｜User｜>{text}<｜Assistant｜>`, then `<think>` when the model is to
  think (the last user turn, thinking mode) or `</think>` otherwise;
- an assistant turn is `{reasoning}</think>` (thinking mode, after the last user turn
  only; earlier turns' reasoning is dropped), its text, its tool calls as a DSML
  `function_calls` block, then `<｜end▁of▁sentence｜>`;
- tool results are `<function_results>` with one `<result>` per call, in call order, then
  `<think>` or `</think>` as after a user turn.

Thinking is off unless `chat_template_kwargs` sets `thinking` (or `enable_thinking`) to
true: the default of `--reasoning-parser deepseek-v3`, which reads the output the same way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from cpkv_jax.errors import InputError
from serving.parsers.reasoning import REASONING_PARSERS

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

# The tools section, word for word as the model was trained on it.
_TOOLS_SECTION = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{dsml}function_calls>" block like the following as part of your reply to the user:
<{dsml}function_calls>
<{dsml}invoke name="$FUNCTION_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$FUNCTION_NAME2">
...
</{dsml}invoke>
</{dsml}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<{dsml}function_calls>
...
</{dsml}function_calls>

<function_results>
...
</function_results>

{think_start}...thinking about results{think_end}

Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""  # noqa: E501


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _tools_section(tools: Sequence[Mapping[str, Any]]) -> str:
    schemas = "\n".join(_json(t.get("function", t)) for t in tools)
    return _TOOLS_SECTION.format(
        dsml=DSML, think_start=THINK_START, think_end=THINK_END, schemas=schemas
    )


def _arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    raw = call.get("function", {}).get("arguments", {})
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise InputError(
                f"tool call {call.get('id')!r}: arguments are not JSON ({raw[:80]!r})"
            ) from None
    if not isinstance(raw, Mapping):
        raise InputError(f"tool call {call.get('id')!r}: arguments must be a JSON object")
    return dict(raw)


def _tool_calls_block(calls: Sequence[Mapping[str, Any]]) -> str:
    """An assistant turn's calls in DSML: a string value as it is (`string="true"`),
    anything else as JSON."""
    invokes = []
    for call in calls:
        params = "\n".join(
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>"
            for key, v in _arguments(call).items()
        )
        name = call.get("function", {}).get("name", "")
        invokes.append(f'<{DSML}invoke name="{name}">\n{params}\n</{DSML}invoke>')
    joined = "\n".join(invokes)
    return f"\n\n<{DSML}function_calls>\n{joined}\n</{DSML}function_calls>"


class DeepSeekV32ChatTemplate:
    """`ChatTemplate`'s interface (`render`) for DeepSeek-V3.2's format."""

    source = "built-in: DeepSeek-V3.2 encoding"
    bos_token = BOS
    eos_token = EOS

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        # Read as `--reasoning-parser deepseek-v3` reads the output.
        thinking = REASONING_PARSERS["deepseek-v3"].thinking(template_kwargs)
        msgs = [dict(m) for m in messages]
        if not msgs:
            raise InputError("messages is empty: send at least one message")
        if tools and msgs[0].get("role") != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        last_user = max(
            (i for i, m in enumerate(msgs) if m.get("role") in ("user", "developer")),
            default=-1,
        )
        turns = (self._turn(i, msgs, last_user, thinking, tools) for i in range(len(msgs)))
        prompt = BOS + "".join(turns)
        if not add_generation_prompt and msgs[-1].get("role") in ("user", "developer"):
            # The assistant's opening is the generation prompt here; without it the
            # prompt ends with the user's turn.
            for opener in (ASSISTANT + THINK_START, ASSISTANT + THINK_END):
                if prompt.endswith(opener):
                    return prompt[: -len(opener)]
        return prompt

    @staticmethod
    def _turn(
        i: int,
        msgs: list[dict[str, Any]],
        last_user: int,
        thinking: bool,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> str:
        m = msgs[i]
        role, content = m.get("role"), m.get("content") or ""
        # The assistant's turn opens thinking after the last user turn (and tool results
        # past it), in thinking mode; it opens closed everywhere else.
        opener = THINK_START if thinking and i >= last_user else THINK_END
        if role == "system":
            return content + ("\n\n" + _tools_section(tools) if tools else "")
        if role == "developer":
            return f"{USER}\n\n# The user's message is: {content}{ASSISTANT}{opener}"
        if role == "user":
            return f"{USER}{content}{ASSISTANT}{opener}"
        if role == "assistant":
            reasoning = ""
            calls = m.get("tool_calls") or []
            if thinking and i > last_user:
                reasoning = (m.get("reasoning_content") or "") + THINK_END
            block = _tool_calls_block(calls) if calls else ""
            return f"{reasoning}{content}{block}{EOS}"
        if role == "tool":
            # The k-th tool message after an assistant turn answers its k-th call.
            j = i - 1
            while j >= 0 and msgs[j].get("role") == "tool":
                j -= 1
            calls = (msgs[j].get("tool_calls") or []) if j >= 0 else []
            k = i - j
            if j < 0 or msgs[j].get("role") != "assistant" or k > len(calls):
                raise InputError(
                    f"messages[{i}] is a tool result without a matching tool call in the "
                    "assistant message before it"
                )
            text = ("\n\n<function_results>" if k == 1 else "") + f"\n<result>{content}</result>"
            if k == len(calls):
                text += "\n</function_results>\n\n" + opener
            return text
        raise InputError(f"messages[{i}] has role {role!r}, which DeepSeek-V3.2's format lacks")


def builtin_chat_template(model_type: str) -> DeepSeekV32ChatTemplate | None:
    """The built-in template for a model dir without one (`model_type` of config.json)."""
    return DeepSeekV32ChatTemplate() if model_type == "deepseek_v32" else None
