"""Request bodies of the HTTP API (pydantic v2) and their mapping to `serving.engine.api` types.

Every body is strict, on every endpoint: an unknown field is refused (a typo such as
`max_token` must not silently fall back to a default), and types are not coerced (`"5"`
is not an int, `1` is not a bool; an int is accepted where a float is expected, as JSON
does not tell them apart). Non-finite floats are refused. Validation errors become HTTP
400 through `describe_validation_error`, which names each offending field.

OpenAI fields that this server cannot honour are accepted only at the value that means
"off" (`n=1`, `echo=false`, `presence_penalty=0`, `top_logprobs=0`, ...), and any other
value is a 400 that says so. Defaults: `/generate` uses `SamplingParams`'
(greedy, 16 new tokens, SGLang-native clients set what they need); the OpenAI endpoints
use OpenAI's (temperature 1, top_p 1; `max_tokens` 16 for completions, and for chat "as
many as the context leaves").
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from serving.engine.api import MAX_NEW_TOKENS_LIMIT, SamplingParams

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
_HOST_PORT = re.compile(r"^[^\s:]+:\d{1,5}$|^\[[0-9a-fA-F:.]+\]:\d{1,5}$")
OPENAI_DEFAULT_TEMPERATURE = 1.0
OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default


class _Body(BaseModel):
    model_config = _STRICT


def _stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


# ---- /generate (SGLang-style native API) ----------------------------------------------


class GenerateSamplingParams(_Body):
    """`sampling_params` of `/generate`; unset fields keep `SamplingParams`' defaults."""

    max_new_tokens: int = SamplingParams.max_new_tokens
    temperature: float = SamplingParams.temperature
    top_p: float = SamplingParams.top_p
    top_k: int = SamplingParams.top_k
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def to_engine(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=_stop_tuple(self.stop),
            ignore_eos=self.ignore_eos,
        )


class _PDFields(_Body):
    """Set by the PD router (`serving.router.pd_bodies`) on every generation endpoint, never
    by end users; see `engine.api.GenerateRequest`. `decode_transfer_target` is "host:port"."""

    bootstrap_room: str | None = Field(default=None, min_length=1, max_length=256)
    decode_transfer_target: str | None = None
    bootstrap_cp_size: int | None = Field(default=None, ge=1, le=4096)

    @model_validator(mode="after")
    def _check_pd(self) -> _PDFields:
        target = self.decode_transfer_target
        if target is not None and not _HOST_PORT.match(target):
            raise ValueError(f"decode_transfer_target must be 'host:port', got {target!r}")
        return self

    def pd_fields(self) -> dict[str, str | int | None]:
        """Keyword arguments of `GenerateRequest` for the PD fields."""
        return {
            "bootstrap_room": self.bootstrap_room,
            "decode_transfer_target": self.decode_transfer_target,
            "bootstrap_cp_size": self.bootstrap_cp_size,
        }


class GenerateBody(_PDFields):
    """`POST /generate`: exactly one of `text` / `input_ids`, plus the PD fields."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    rid: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _check(self) -> GenerateBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("send exactly one of 'text' and 'input_ids'")
        return self


# ---- OpenAI-compatible endpoints -------------------------------------------------------


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAICommon(_PDFields):
    """Fields shared by `/v1/completions` and `/v1/chat/completions`.

    `top_k`, `ignore_eos` and `stop_token_ids` are extensions (as in vLLM / SGLang); the PD
    fields come from the router, which forwards OpenAI bodies as they are.
    """

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None  # accepted and ignored (OpenAI abuse-monitoring id)
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @model_validator(mode="after")
    def _check_common(self) -> _OpenAICommon:
        if self.n not in (None, 1):
            raise ValueError(f"n must be 1 (one choice per request is supported), got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0.0):
                raise ValueError(f"{name} is not supported: send 0 or omit it, got {value}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def to_engine(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=(
                OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
            ),
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=_stop_tuple(self.stop),
            ignore_eos=self.ignore_eos,
        )


class CompletionBody(_OpenAICommon):
    """`POST /v1/completions`. One prompt per request: a string or a list of token ids.

    `logprobs` accepts only 0: the chosen token's log-prob is returned for each token, and
    top alternatives (`logprobs > 0`) are not computed by the engine.
    """

    prompt: str | list[int]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False

    @model_validator(mode="after")
    def _check(self) -> CompletionBody:
        if len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        if self.echo:
            raise ValueError("echo=true is not supported: send echo=false or omit it")
        if self.logprobs not in (None, 0):
            raise ValueError(
                f"logprobs={self.logprobs} asks for top alternatives, which are not supported; "
                "send logprobs=0 to get the chosen tokens' log-probs"
            )
        return self

    def max_new_tokens(self) -> int:
        if self.max_tokens is None:
            return OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS
        return self.max_tokens


class TextContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One chat message; `content` is text or a list of text parts (joined for the template)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _needs_content(self) -> ChatMessage:
        # OpenAI answers 400 here too: only an assistant turn carrying tool calls may omit
        # content, and this server accepts no tool calls.
        if self.content is None:
            raise ValueError(
                f"a {self.role} message needs `content` (text or text parts); a message "
                "without content is valid only for an assistant turn with tool_calls, "
                "which this server does not accept"
            )
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, str]:
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionBody(_OpenAICommon):
    """`POST /v1/chat/completions`. `logprobs=true` returns the chosen tokens' log-probs;
    `top_logprobs` accepts only 0 (no alternatives)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionBody:
        if self.top_logprobs not in (None, 0):
            raise ValueError(
                f"top_logprobs={self.top_logprobs} is not supported (no alternatives are "
                "computed); send 0 or omit it"
            )
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise ValueError(
                f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                f"({self.max_completion_tokens}) disagree; send one of them"
            )
        return self

    def max_new_tokens(self, prompt_tokens: int, context_length: int) -> int:
        """The requested limit, or what the context leaves after the prompt (at least 1, so
        that an over-long prompt is reported by the context-length check)."""
        explicit = self.max_completion_tokens
        if explicit is None:
            explicit = self.max_tokens
        if explicit is not None:
            return explicit
        return max(1, min(context_length - prompt_tokens, MAX_NEW_TOKENS_LIMIT))


class ProfileBody(_Body):
    """`POST /start_profile`: where to write the trace (default: the server's profile dir)."""

    output_dir: str | None = Field(default=None, min_length=1)


# ---- errors ----------------------------------------------------------------------------


def describe_validation_error(err: ValidationError, *, max_errors: int = 3) -> str:
    """One line naming each bad field, e.g. `sampling_params.max_new_tokens: Input should
    be a valid integer (got '5')`. Union branches are folded into their field."""
    parts: list[str] = []
    seen: set[str] = set()
    for e in err.errors(include_url=False):
        kind = e["type"]
        if kind == "json_invalid":
            return f"the request body is not valid JSON: {e['msg']}"
        # pydantic names union branches in `loc` (`prompt.str`, `prompt.list[int]`).
        loc = ".".join(str(p) for p in e["loc"] if not _is_branch_name(p))
        if kind == "model_type" and not loc:
            msg = f"the request body must be a JSON object, got {repr(e.get('input'))[:60]}"
        elif kind == "extra_forbidden":
            msg = f"unknown field '{loc}' (this API refuses fields it does not know)"
        elif kind == "missing":
            msg = f"missing required field '{loc}'"
        else:
            where = f"{loc}: " if loc else ""
            shown = repr(e.get("input"))
            got = f" (got {shown[:60]})" if "input" in e and kind != "value_error" else ""
            msg = f"{where}{e['msg'].removeprefix('Value error, ')}{got}"
        if msg not in seen:
            seen.add(msg)
            parts.append(msg)
    more = len(parts) - max_errors
    text = "; ".join(parts[:max_errors])
    return text + (f"; and {more} more" if more > 0 else "")


def _is_branch_name(part: str | int) -> bool:
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "none"}
        or part.startswith(("list[", "function-", "constrained-"))
    )
