"""Request bodies of the HTTP API (pydantic v2) and their mapping to `serving.engine.api` types.

Every body is strict, on every endpoint: an unknown field is refused (a typo such as
`max_token` must not silently fall back to a default; OpenAI answers 400 too), and types
are not coerced (`"5"` is not an int, `1` is not a bool; an int is accepted where a float
is expected, as JSON does not tell them apart). Non-finite floats are refused. Validation
errors become HTTP 400 through `describe_validation_error`, which names each offending
field.

Clients of the field send more than this server implements: SGLang's `bench_serving`
sends `lora_path: null` and `logprob_start_len: -1` to `/generate` and `best_of: 1` to
`/v1/completions`, vLLM and SGLang clients their own extensions, the `openai` client
whatever its caller set. So every field of the APIs these bodies model (OpenAI's
completions and chat-completions request, vLLM's and SGLang's extensions of them, and
SGLang's `GenerateReqInput` and `SamplingParams` for `/generate`) is known here: the
ones this server implements are model fields, and each of the others is a row of its
body's `NEUTRAL` table (`Neutral`): accepted at the value that asks for nothing (`null`
always; `best_of: 1`, `n: 1`, `echo: false`, `logprob_start_len: -1`,
`length_penalty: 1`, ...), or, for a hint or label that changes nothing here (`user`,
`session_id`, `log_metrics`, ...), at any value of its JSON type; any other value is a
400 naming the field and the values it would accept. A table row never reaches the
engine. A `null` is an omitted field (its default) everywhere.

Defaults: `/generate` uses `SamplingParams`' (greedy, 16 new tokens, SGLang-native clients
set what they need); the OpenAI endpoints use OpenAI's (temperature 1, top_p 1;
`max_tokens` 16 for completions, and for chat "as many as the context leaves").
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from serving.engine.api import (
    MAX_NEW_TOKENS_LIMIT,
    TOP_LOGPROBS_LIMIT,
    Grammar,
    GrammarKind,
    SamplingParams,
)

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
_HOST_PORT = re.compile(r"^[^\s:]+:\d{1,5}$|^\[[0-9a-fA-F:.]+\]:\d{1,5}$")
OPENAI_DEFAULT_TEMPERATURE = 1.0
OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default
# The most choices one request may ask for: `n` (OpenAI's limit is 128), and `n` times the
# number of prompts of a batched `/v1/completions` (each choice is one engine request).
MAX_N = 128
MAX_CHOICES = 1024


# ---- fields accepted only where they ask for nothing ----------------------------------

# The JSON kinds a `Neutral.kinds` row may name, as its error message says them.
_KIND_NAMES: dict[type, str] = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    dict: "an object",
    list: "an array",
}


def _json_equal(a: object, b: object) -> bool:
    """JSON equality: `true` is not `1`, `0` is `0.0`."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def _json_kind(value: object, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, kind)


@dataclasses.dataclass(frozen=True)
class Neutral:
    """How a request field this server does not implement is accepted: `null`, or one of
    `values` (what means "off"), or, with `kinds`, any value of those JSON kinds (a hint
    or label that changes nothing here, accepted and ignored)."""

    values: tuple[Any, ...] = ()
    kinds: tuple[type, ...] = ()

    def accepts(self, value: object) -> bool:
        if value is None:
            return True
        if self.kinds:
            return any(_json_kind(value, k) for k in self.kinds)
        return any(_json_equal(value, v) for v in self.values)

    def refusal(self, name: str, value: object) -> str:
        """Why `value` is refused for field `name`, and what would be accepted."""
        shown = json.dumps(value, default=repr)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        if self.kinds:
            kinds = " or ".join(_KIND_NAMES[k] for k in self.kinds)
            return f"{name} must be {kinds} or null (accepted and ignored), got {shown}"
        fix = "omit it (or send null)"
        if self.values:
            fix = f"send {' or '.join(json.dumps(v) for v in self.values)} (or omit it)"
        return f"{name}={shown} is not supported by this server: {fix}"


def off(*values: Any) -> Neutral:
    """A field accepted at `null` or `values`, the values that ask for nothing."""
    return Neutral(values=values)


def ignored(*kinds: type) -> Neutral:
    """A field accepted at any value of the JSON `kinds` (or `null`), and ignored."""
    return Neutral(kinds=kinds)


class _Body(BaseModel):
    """A strict body. `NEUTRAL` names the fields of the modelled API that this server does
    not implement (`Neutral`); they are checked and dropped before validation, so they
    never reach the model fields (a name in both is a bug, refused at class creation).
    A null field is an omitted one (the APIs' "nullable" fields mean "unset" by null), so
    `"logprobs": null` is `logprobs`' default; a required field stays required."""

    model_config = _STRICT
    NEUTRAL: ClassVar[Mapping[str, Neutral]] = {}

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        both = sorted(set(cls.NEUTRAL) & set(cls.model_fields))
        if both:
            raise TypeError(f"{cls.__name__}: {both} are both model fields and NEUTRAL rows")

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral(cls, data: Any) -> Any:
        """Check and drop the `NEUTRAL` rows; a null model field means its default."""
        if not isinstance(data, dict):
            return data
        table = cls.NEUTRAL
        refused = [
            table[k].refusal(k, v)
            for k, v in data.items()
            if k in table and not table[k].accepts(v)
        ]
        if refused:
            raise ValueError("; ".join(refused))
        fields = cls.model_fields
        return {
            k: v for k, v in data.items() if k not in table and (v is not None or k not in fields)
        }


def _check_top_logprobs(field: str, n: int) -> None:
    if not 0 <= n <= TOP_LOGPROBS_LIMIT:
        raise ValueError(f"{field} must be in [0, {TOP_LOGPROBS_LIMIT}], got {n}")


def _logit_bias(bias: Mapping[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token ids as JSON object keys) as (id, value) pairs."""
    if not bias:
        return ()
    try:
        return tuple((int(k), float(v)) for k, v in bias.items())
    except ValueError:
        bad = next(k for k in bias if not k.strip().lstrip("-").isdigit())
        raise ValueError(f"logit_bias keys are token ids, got {bad!r}") from None


def _stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


# ---- /generate (SGLang-style native API) ----------------------------------------------

# SGLang's `SamplingParams` fields that this server does not implement.
GENERATE_SAMPLING_NEUTRAL: Mapping[str, Neutral] = {
    "stop_regex": off([]),
    "n": off(1),
    "structural_tag": off(),
    "spaces_between_special_tokens": off(True),
    "custom_params": off({}),
    "stream_interval": ignored(int),  # stream events follow the engine's chunks
}

# SGLang's `GenerateReqInput` fields that this server does not implement (`bootstrap_room`
# is a PD field, `PDFields`). SGLang's gateway `smg` sends `log_metrics`, `background`,
# `no_logs`, `return_bytes`, `return_entropy` (and `return_text_in_logprobs`, a model
# field) on every `/generate`, at their defaults unless its client set them.
GENERATE_NEUTRAL: Mapping[str, Neutral] = {
    "session_id": ignored(str),  # an identity only: it does not change the prompt
    "input_embeds": off(),
    "image_data": off([]),
    "video_data": off([]),
    "audio_data": off([]),
    "mm_hashes": off(),
    "mm_content_hashes": off(),
    "use_audio_in_video": off(False),
    "video_config": off(),
    "token_ids_logprob": off([]),
    "return_sampling_mask": off(False),
    "return_flat_raw_top_logprobs": off(False),
    "return_flat_raw_top_logprobs_b64": off(False),
    "log_metrics": ignored(bool),  # SGLang: skip this request in its metrics (health probes)
    "return_hidden_states": off(False),
    "return_routed_experts": off(False),
    "routed_experts_start_len": off(0),
    "return_indexer_topk": off(False),
    "modalities": off([]),
    "session_params": off(),
    "lora_path": off(),
    "lora_id": off(),
    "custom_logit_processor": off(),
    "positional_embed_overrides": off(),
    "bootstrap_pair_key": off(),
    "decode_tp_size": off(),
    "routed_dp_rank": off(),
    "data_parallel_rank": off(),
    "disagg_prefill_dp_rank": off(),
    "kv_router_hint": off(),
    "routing_key": ignored(str),
    "conversation_id": ignored(str),
    "http_worker_ipc": off(),
    "background": off(False),  # SGLang: run detached (Responses API); nothing here does
    "require_reasoning": off(False),
    "max_thinking_tokens": off(),
    "priority": off(0),
    "extra_key": off(),
    "no_logs": ignored(bool),  # SGLang: keep the contents out of logs; never logged here
    "custom_labels": ignored(dict),
    "return_bytes": off(False),  # SGLang: raw bytes of generated images; text only here
    "return_entropy": off(False),  # SGLang: each token's distribution entropy; not computed
    "return_prompt_token_ids": off(False),
    "external_trace_header": off(),
    "received_time": off(),
    "need_wait_for_mm_inputs": off(),
    "num_items_assigned": off(),
    "encoder_urls": off(),
    "max_dynamic_patch": off(),
    "min_dynamic_patch": off(),
    "image_max_dynamic_patch": off(),
    "video_max_dynamic_patch": off(),
    "images_config": off(),
    "multi_item_delimiter_indices": off(),
    "cache_salt": off(),
}


class GenerateSamplingParams(_Body):
    """`sampling_params` of `/generate`; unset fields keep `SamplingParams`' defaults.
    `sampling_seed` is SGLang's name for `seed`."""

    NEUTRAL: ClassVar[Mapping[str, Neutral]] = GENERATE_SAMPLING_NEUTRAL

    max_new_tokens: int = SamplingParams.max_new_tokens
    temperature: float = SamplingParams.temperature
    top_p: float = SamplingParams.top_p
    top_k: int = SamplingParams.top_k
    min_p: float = SamplingParams.min_p
    frequency_penalty: float = SamplingParams.frequency_penalty
    presence_penalty: float = SamplingParams.presence_penalty
    repetition_penalty: float = SamplingParams.repetition_penalty
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    sampling_seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = SamplingParams.skip_special_tokens
    no_stop_trim: bool = SamplingParams.no_stop_trim
    min_new_tokens: int = SamplingParams.min_new_tokens
    # SGLang's structured output: at most one (`serving.grammar`).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @model_validator(mode="after")
    def _check_seed(self) -> GenerateSamplingParams:
        _logit_bias(self.logit_bias)  # keys must be token ids
        self.grammar()
        if None not in (self.seed, self.sampling_seed) and self.seed != self.sampling_seed:
            raise ValueError(
                f"seed ({self.seed}) and sampling_seed ({self.sampling_seed}) disagree; "
                "send one of them"
            )
        return self

    def to_engine(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=_logit_bias(self.logit_bias),
            seed=self.seed if self.seed is not None else self.sampling_seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=_stop_tuple(self.stop),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim,
            min_new_tokens=self.min_new_tokens,
            grammar=self.grammar(),
        )

    def grammar(self) -> Grammar | None:
        return _one_grammar(
            {
                "json_schema": _schema_grammar(self.json_schema),
                "regex": _grammar_of("regex", self.regex),
                "ebnf": _grammar_of("ebnf", self.ebnf),
            }
        )


class PDFields(_Body):
    """Set by the PD router (`serving.router.pd_bodies`) on every generation endpoint, never
    by end users; see `engine.api.GenerateRequest`. `decode_transfer_target` is "host:port".
    SGLang's gateway sends `bootstrap_host` / `bootstrap_port` and an integer room instead
    (`serving.http.gateway_pd`); the room is kept as its exact decimal text."""

    bootstrap_room: str | int | None = None
    decode_transfer_target: str | None = None
    bootstrap_cp_size: int | None = Field(default=None, ge=1, le=4096)
    bootstrap_host: str | None = Field(default=None, min_length=1, max_length=255)
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)

    @model_validator(mode="after")
    def _check_pd(self) -> PDFields:
        room = self.bootstrap_room
        if isinstance(room, int) and not 0 <= room < 2**64:
            raise ValueError(f"bootstrap_room must be in [0, 2**64), got {room}")
        if isinstance(room, str) and not 1 <= len(room) <= 256:
            raise ValueError("bootstrap_room must be 1 to 256 characters")
        if self.bootstrap_host is not None and room is None:
            raise ValueError("bootstrap_host goes with a bootstrap_room")
        target = self.decode_transfer_target
        if target is not None and not _HOST_PORT.match(target):
            raise ValueError(f"decode_transfer_target must be 'host:port', got {target!r}")
        return self

    def pd_fields(self) -> dict[str, str | int | None]:
        """Keyword arguments of `GenerateRequest` for the PD fields."""
        room = self.bootstrap_room
        return {
            "bootstrap_room": None if room is None else str(room),  # an int exactly
            "decode_transfer_target": self.decode_transfer_target,
            "bootstrap_cp_size": self.bootstrap_cp_size,
        }


# The `model` SGLang's gateway `smg` puts in a `/generate` whose client named none.
GATEWAY_ANY_MODEL = "unknown"


class GenerateBody(PDFields):
    """`POST /generate`: exactly one of `text` / `input_ids`, plus the PD fields.

    `model` is not SGLang's (its `/generate` serves its one model) but SGLang's gateway
    `smg` always sends it: the client's, `"unknown"` (`GATEWAY_ANY_MODEL`) when the client
    named none, or null (`sglang-router` 0.3); checked like the OpenAI routes' `model`.
    `return_text_in_logprobs` puts each token's text in `output_token_logprobs`.
    `logprob_start_len` >= 0 (with `return_logprob`) adds `meta_info.input_token_logprobs`
    (and `input_top_logprobs`) for the prompt tokens from there on, as SGLang; -1, the
    default, only the output's."""

    NEUTRAL: ClassVar[Mapping[str, Neutral]] = GENERATE_NEUTRAL

    # A list of texts or of token-id lists is a batch (SGLang's): one result per prompt.
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    model: str | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0  # with return_logprob: `meta_info.output_top_logprobs`
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None

    @model_validator(mode="after")
    def _check(self) -> GenerateBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("send exactly one of 'text' and 'input_ids'")
        prompts = self.text if self.text is not None else self.input_ids
        if self.batched() and not prompts:
            raise ValueError("a batch needs at least one prompt")
        if self.batched() and self.stream:
            raise ValueError("stream=true takes one prompt: stream each prompt of the batch")
        rids = [self.rid] if isinstance(self.rid, str) else self.rid or []
        if any(not 1 <= len(r) <= 256 for r in rids):
            raise ValueError("rid: each id must be 1 to 256 characters")
        if self.rid is not None and (
            isinstance(self.rid, list) != self.batched()
            or (isinstance(self.rid, list) and len(self.rid) != len(self.prompts()))
        ):
            raise ValueError("rid: a list of ids goes with a batch of as many prompts")
        _check_top_logprobs("top_logprobs_num", self.top_logprobs_num)
        if self.logprob_start_len < -1:
            raise ValueError(
                f"logprob_start_len must be -1 (output log-probs only) or a prompt index, got "
                f"{self.logprob_start_len}"
            )
        return self

    def prompt_logprobs_from(self) -> int | None:
        """The engine's `prompt_logprobs_from` (None: no prompt log-probs)."""
        if not self.return_logprob or self.logprob_start_len < 0:
            return None
        return self.logprob_start_len

    def batched(self) -> bool:
        if isinstance(self.text, list):
            return True
        return self.input_ids is not None and any(isinstance(x, list) for x in self.input_ids)

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts of the request: one unless it is a batch."""
        if self.text is not None:
            return self.text if isinstance(self.text, list) else [self.text]
        assert self.input_ids is not None
        return self.input_ids if self.batched() else [self.input_ids]  # type: ignore[list-item]


# ---- OpenAI-compatible endpoints -------------------------------------------------------

# Fields of both OpenAI endpoints (OpenAI's, then vLLM's and SGLang's extensions) that this
# server does not implement.
_OPENAI_BOTH_NEUTRAL: Mapping[str, Neutral] = {
    # OpenAI
    "user": ignored(str),  # an end-user id for abuse monitoring
    # vLLM
    "best_of": off(1),
    "use_beam_search": off(False),
    "length_penalty": off(1),
    "spaces_between_special_tokens": off(True),
    "truncate_prompt_tokens": off(),
    "allowed_token_ids": off(),
    "bad_words": off([]),
    "prompt_logprobs": off(),
    "add_special_tokens": off(False),  # prompts are tokenized as they are
    "guided_decoding_backend": ignored(str),
    "guided_whitespace_pattern": off(),
    "structural_tag": off(),
    "priority": off(0),
    "request_id": ignored(str),
    "logits_processors": off([]),
    "return_tokens_as_token_ids": off(False),
    "cache_salt": off(),
    "kv_transfer_params": off(),
    "vllm_xargs": off({}),
    # SGLang
    "return_hidden_states": off(False),
    "return_routed_experts": off(False),
    "routed_experts_start_len": off(0),
    "return_cached_tokens_details": off(False),
    "stop_regex": off([]),
    "lora_path": off(),
    "session_id": ignored(str),
    "session_params": off(),
    "custom_params": off({}),
    "custom_logit_processor": off(),
    "images_config": off(),
    "routed_dp_rank": off(),
    "disagg_prefill_dp_rank": off(),
    "data_parallel_rank": off(),
    "rid": ignored(str),
    "extra_key": off(),
    "ngram_corpus_id": off(),
    "custom_labels": ignored(dict),
}

COMPLETIONS_NEUTRAL: Mapping[str, Neutral] = {
    **_OPENAI_BOTH_NEUTRAL,
    "suffix": off(""),  # OpenAI
    "prompt_embeds": off(),  # vLLM
    "return_token_ids": ignored(bool),  # SGLang; every choice carries its `token_ids`
}

CHAT_NEUTRAL: Mapping[str, Neutral] = {
    **_OPENAI_BOTH_NEUTRAL,
    "echo": off(False),  # vLLM: echo the last message; not implemented for chat
    # OpenAI
    "audio": off(),
    "function_call": off("none"),
    "functions": off([]),
    "metadata": ignored(dict),
    "modalities": off(["text"]),
    "prediction": off(),
    "prompt_cache_key": ignored(str),
    "reasoning_effort": off(),
    "safety_identifier": ignored(str),
    "service_tier": off("auto", "default"),
    "store": off(False),
    "verbosity": off("medium"),
    "web_search_options": off(),
    # vLLM
    "add_generation_prompt": off(True),
    "continue_final_message": off(False),
    "documents": off([]),
    "chat_template": off(),
    "mm_processor_kwargs": off({}),
    "include_reasoning": off(True),
    # SGLang
    "return_prompt_token_ids": off(False),
    "return_token_ids": off(False),
    "return_meta_info": off(False),
    "task": off(),
    "stream_reasoning": ignored(bool),
    "max_dynamic_patch": off(),
    "min_dynamic_patch": off(),
    "use_audio_in_video": off(False),
    "input_ids": off(),
}


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`: OpenAI's named schema (`schema` is a JSON schema;
    `strict` is accepted: the output always follows the schema here)."""

    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True
    )

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: `text` (no constraint), `json_object` (any JSON
    object) or `json_schema` (the output follows `json_schema.schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                "response_format: json_schema goes with type 'json_schema' and only with it"
            )
        return self

    def grammar(self) -> Grammar | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Grammar("json_schema", json.dumps({"type": "object"}))
        assert self.json_schema is not None
        schema = self.json_schema.schema_
        # OpenAI: a missing schema is any JSON value.
        return Grammar("json_schema", json.dumps({} if schema is None else schema))


def _grammar_of(kind: GrammarKind, source: str | None) -> Grammar | None:
    if source is None:
        return None
    if not source.strip():
        raise ValueError(f"the {kind} grammar is empty")
    return Grammar(kind, source)


def _schema_grammar(schema: str | dict[str, Any] | None) -> Grammar | None:
    """A JSON schema given as JSON text (SGLang) or as an object (vLLM)."""
    if isinstance(schema, dict):
        return Grammar("json_schema", json.dumps(schema))
    if schema is not None:
        try:
            json.loads(schema)
        except ValueError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    return _grammar_of("json_schema", schema)


def _one_grammar(given: Mapping[str, Grammar | None]) -> Grammar | None:
    named = [k for k, g in given.items() if g is not None]
    if len(named) > 1:
        raise ValueError(f"give at most one structured-output constraint, got {', '.join(named)}")
    return given[named[0]] if named else None


class StreamOptions(_Body):
    NEUTRAL: ClassVar[Mapping[str, Neutral]] = {
        "include_obfuscation": off(False),  # OpenAI
        "continuous_usage_stats": off(False),  # vLLM, SGLang
    }

    include_usage: bool = False


class _OpenAICommon(PDFields):
    """Fields shared by `/v1/completions` and `/v1/chat/completions`.

    `top_k`, `min_p`, `ignore_eos`, `stop_token_ids` and `skip_special_tokens` are
    extensions (as in vLLM / SGLang); `frequency_penalty` / `presence_penalty` are
    OpenAI's, over the output so far, `repetition_penalty` vLLM's, over the prompt and the
    output. vLLM's `include_stop_str_in_output` and SGLang's `no_stop_trim` are one switch
    (either keeps the stop string or token in the text). The PD fields come from the
    router, which forwards OpenAI bodies as they are.
    """

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = SamplingParams.skip_special_tokens
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False
    min_tokens: int = 0  # vLLM's name for SGLang's min_new_tokens
    n: int = 1
    # Structured output, at most one (`serving.grammar`): OpenAI's, SGLang's, vLLM's.
    response_format: ResponseFormat | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_common(self) -> _OpenAICommon:
        _logit_bias(self.logit_bias)  # keys must be token ids
        self.grammar()
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
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
            min_p=0.0 if self.min_p is None else self.min_p,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            logit_bias=_logit_bias(self.logit_bias),
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=_stop_tuple(self.stop),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim or self.include_stop_str_in_output,
            min_new_tokens=self.min_tokens,
            grammar=self.grammar(),
        )

    def grammar(self) -> Grammar | None:
        """The one grammar the body asks for (`ValueError` naming them when several)."""
        choice = None
        if self.guided_choice is not None:
            if not self.guided_choice:
                raise ValueError("guided_choice must list at least one string")
            choice = Grammar("choice", json.dumps(self.guided_choice))
        return _one_grammar(
            {
                "response_format": None
                if self.response_format is None
                else self.response_format.grammar(),
                "json_schema": _schema_grammar(self.json_schema),
                "regex": _grammar_of("regex", self.regex),
                "ebnf": _grammar_of("ebnf", self.ebnf),
                "guided_json": _schema_grammar(self.guided_json),
                "guided_regex": _grammar_of("regex", self.guided_regex),
                "guided_choice": choice,
                "guided_grammar": _grammar_of("ebnf", self.guided_grammar),
            }
        )


class CompletionBody(_OpenAICommon):
    """`POST /v1/completions`. `prompt` is OpenAI's: a string, a list of token ids, or a
    batch of either (a list of strings, a list of token-id lists); each prompt gets `n`
    choices (`prompts`).

    `logprobs: N` returns each token's log-prob and its N most likely alternatives
    (0..`TOP_LOGPROBS_LIMIT`). `echo` puts each prompt's text before its choices' text;
    with `logprobs`, the prompt's tokens and their log-probs come first in `logprobs`
    (computed by a unified server's prefill), and `max_tokens: 0` returns only those
    (lm-evaluation-harness's log-likelihood requests).
    """

    NEUTRAL: ClassVar[Mapping[str, Neutral]] = COMPLETIONS_NEUTRAL

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False

    @model_validator(mode="after")
    def _check(self) -> CompletionBody:
        prompts = self.prompts()
        if not prompts:
            raise ValueError("prompt must not be empty")
        empty = [i for i, p in enumerate(prompts) if len(p) == 0]
        if empty:
            where = "" if not self.batched() else f" (prompt[{empty[0]}] is empty)"
            raise ValueError(f"prompt must not be empty{where}")
        if len(prompts) * self.n > MAX_CHOICES:
            raise ValueError(
                f"{len(prompts)} prompts times n={self.n} is {len(prompts) * self.n} choices, "
                f"over this server's limit of {MAX_CHOICES}: send fewer prompts per request"
            )
        if self.logprobs is not None:
            _check_top_logprobs("logprobs", self.logprobs)
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 is only allowed with echo=true (it generates nothing)")
        return self

    def batched(self) -> bool:
        """Whether `prompt` is a list of prompts (strings or token-id lists)."""
        return isinstance(self.prompt, list) and any(not isinstance(p, int) for p in self.prompt)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids (one for an unbatched body)."""
        if isinstance(self.prompt, str) or not self.batched():
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    def max_new_tokens(self) -> int:
        if self.max_tokens is None:
            return OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS
        return self.max_tokens


class TextContentPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallItem(_Body):
    """An assistant message's tool call (`message.tool_calls[i]` of an earlier answer)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Body):
    """One of a chat request's `tools` (OpenAI's function tools)."""

    type: Literal["function"]
    function: FunctionDefinition


class ChatMessage(_Body):
    """One chat message; `content` is text or a list of text parts (joined for the template).

    The `NEUTRAL` rows are what the `openai` client's message objects carry when a caller
    sends an answer back as the next turn's assistant message. An assistant turn may carry
    `tool_calls` (then `content` may be omitted), a `tool` turn answers one by
    `tool_call_id`; both reach the chat template (`for_template`)."""

    NEUTRAL: ClassVar[Mapping[str, Neutral]] = {
        "function_call": off(),
        "refusal": off(),
        "audio": off(),
        "annotations": off([]),
    }

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _needs_content(self) -> ChatMessage:
        # OpenAI answers 400 here too: only an assistant turn carrying tool calls may omit
        # content.
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message cannot carry tool_calls (assistant only)")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                f"a {self.role} message needs `content` (text or text parts); a message "
                "without content is valid only for an assistant turn with tool_calls"
            )
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (HF's convention: a tool call's
        `function.arguments` is a dict when it is a JSON object)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [_template_tool_call(tc) for tc in self.tool_calls]
        return out


def _template_tool_call(tc: ToolCallItem) -> dict[str, Any]:
    try:
        args: Any = json.loads(tc.function.arguments)
    except ValueError:
        args = tc.function.arguments
    if not isinstance(args, dict):
        args = tc.function.arguments
    return {
        "id": tc.id,
        "type": "function",
        "function": {"name": tc.function.name, "arguments": args},
    }


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: dict[str, Any]


class ChatCompletionBody(_OpenAICommon):
    """`POST /v1/chat/completions`. `logprobs=true` returns the chosen tokens' log-probs,
    and with `top_logprobs: N` each one's N most likely alternatives."""

    NEUTRAL: ClassVar[Mapping[str, Neutral]] = CHAT_NEUTRAL

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Tools and reasoning (`serving.http.chat_output` checks them against the server's
    # parsers: without `--tool-call-parser`, `tools` must be empty).
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True  # SGLang: false gives the reasoning inside `content`

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionBody:
        if self.top_logprobs is not None:
            _check_top_logprobs("top_logprobs", self.top_logprobs)
            if self.top_logprobs > 0 and not self.logprobs:
                raise ValueError("top_logprobs needs logprobs=true")
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


class AbortBody(_Body):
    """`POST /abort_request` (SGLang's): abort request `rid` (and its choices `rid-k`), or
    with `abort_all` every request this server is running or queueing."""

    rid: str | None = Field(default=None, min_length=1, max_length=256)
    abort_all: bool = False

    @model_validator(mode="after")
    def _one(self) -> AbortBody:
        if (self.rid is None) == (not self.abort_all):
            raise ValueError("give either rid or abort_all=true")
        return self


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
