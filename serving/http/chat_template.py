"""A model directory's chat template: load it, render OpenAI chat messages into a prompt.

HF model directories carry the template either as `chat_template.jinja` (newer
`transformers`) or as the `chat_template` key of `tokenizer_config.json` (a string, or a
list of `{"name", "template"}` of which `"default"` is used). The file wins when both
exist, as in `transformers`. Templates are untrusted input (they come with downloaded
weights), so they run in jinja2's immutable sandbox, with the same environment options
and helpers (`raise_exception`, `strftime_now`, its `tojson`) that `transformers` gives
them.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cpkv_jax.errors import CheckpointError, InputError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The variables `ChatTemplate.render` sets itself.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)


def _raise_exception(message: str) -> None:
    # Templates call this to refuse a conversation (e.g. roles that do not alternate).
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # `transformers`' `tojson`: templates call it with json.dumps' keywords (GLM's
    # `tool | tojson(ensure_ascii=False)`), which jinja2's own filter does not take.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _special_token_text(value: object) -> str:
    """`bos_token` / `eos_token` of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return ""


@runtime_checkable
class ChatRenderer(Protocol):
    """What the chat endpoint renders prompts with: a model dir's Jinja template
    (`ChatTemplate`) or a built-in format (`serving.http.deepseek_v32_template`)."""

    source: str

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str: ...


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointError(
                f"the chat template does not compile (line {e.lineno}: {e.message}); "
                "fix chat_template.jinja / tokenizer_config.json in the model dir"
            ) from e
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages` (dicts with at least `role` and `content`).

        `tools` (OpenAI tool definitions) is the template's `tools` variable, as
        `transformers` passes it; `template_kwargs` (a request's `chat_template_kwargs`,
        e.g. `enable_thinking`) are further template variables, and may not replace the
        ones above (`InputError`). A template that refuses the conversation
        (`raise_exception`), or that trips the sandbox, raises `InputError` with the
        template's message: it is the request's fault.
        """
        extra = dict(template_kwargs or {})
        clash = sorted(set(extra) & RESERVED_TEMPLATE_VARIABLES)
        if clash:
            raise InputError(
                f"chat_template_kwargs may not set {clash}: the server sets those variables"
            )
        try:
            return self._template.render(
                **extra,
                messages=[dict(m) for m in messages],
                tools=None if tools is None else [dict(t) for t in tools],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:  # includes the sandbox's SecurityError
            raise InputError(f"the chat template rejected the messages: {e}") from e


def load_chat_template(model_path: str | Path) -> ChatTemplate | None:
    """The chat template of an HF model dir, or None when it has none.

    Reads `chat_template.jinja`, else `tokenizer_config.json["chat_template"]`; the bos /
    eos token strings come from `tokenizer_config.json` when present.
    """
    root = Path(model_path)
    cfg: dict[str, Any] = {}
    cfg_path = root / TOKENIZER_CONFIG_FILE
    if cfg_path.is_file():
        try:
            loaded = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from e
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{cfg_path} must hold a JSON object, got {type(loaded)}")
        cfg = loaded
    source: str | None = None
    file_path = root / CHAT_TEMPLATE_FILE
    if file_path.is_file():
        source = file_path.read_text()
    else:
        raw = cfg.get("chat_template")
        if isinstance(raw, str):
            source = raw
        elif isinstance(raw, list):
            named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
            default = named.get("default")
            if not isinstance(default, str):
                raise CheckpointError(
                    f"{cfg_path}: chat_template is a list without a 'default' template "
                    f"(names: {sorted(str(n) for n in named)}); add one named 'default'"
                )
            source = default
        elif raw is not None:
            raise CheckpointError(
                f"{cfg_path}: chat_template must be a string or a list of named templates, "
                f"got {type(raw).__name__}"
            )
    if source is None:
        return None
    return ChatTemplate(
        source,
        bos_token=_special_token_text(cfg.get("bos_token")),
        eos_token=_special_token_text(cfg.get("eos_token")),
    )
