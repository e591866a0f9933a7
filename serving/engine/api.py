"""The contract between the HTTP layer and the engines behind it.

Every server mode puts one engine behind the same `EngineClient`:

- `null` (unified): `serving.decode.engine.DecodeEngine` prefills on one device and
  decodes with continuous batching;
- `decode`: the same engine, whose requests arrive as KV transferred by a prefill
  server (`GenerateRequest.bootstrap_room`), then decode;
- `prefill`: the CP prefill scheduler; a request's only output is its first token, and
  its KV goes to the decode server named in `GenerateRequest.decode_transfer_target`.

Engines run their steps on one background thread (JAX dispatch and host planning stay
off the event loop); `serving.engine.loop.EngineLoop` bridges a `StepEngine` to the
asyncio `EngineClient` the HTTP layer awaits. Everything here is plain data: no JAX.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Literal, Protocol, runtime_checkable

from cpkv_jax.errors import CpkvError, InputError
from cpkv_jax.scores import PromptLogprobs
from serving.engine.wait_queue import QueueStats

FinishReason = Literal["stop", "length", "abort", "error"]
ServerMode = Literal["null", "prefill", "decode"]

# A request asking for more new tokens than this is refused outright, whatever the
# context length (a typo such as 10**9 must not reserve pages).
MAX_NEW_TOKENS_LIMIT = 1 << 20
# The most top log-probs a request may ask for per token (OpenAI's chat limit, vLLM's
# default cap); equal to `cpkv_jax.sampling.TOP_LOGPROBS_MAX`, the sampler's (this module
# stays free of JAX).
TOP_LOGPROBS_LIMIT = 20
# The most tokens a `logit_bias` may name (OpenAI's); `cpkv_jax.sampling.LOGIT_BIAS_MAX`.
LOGIT_BIAS_LIMIT = 300


GrammarKind = Literal["json_schema", "regex", "ebnf", "choice"]


@dataclasses.dataclass(frozen=True)
class Grammar:
    """Structured output (`serving.grammar`): the output (after `after`, when set) must
    match `source`, a JSON schema, a regular expression, an EBNF / GBNF or Lark grammar,
    or a JSON list of the strings to choose from."""

    kind: GrammarKind
    source: str
    # Constrain only after the output has produced these tokens (a reasoning model's
    # `</think>`: the reasoning stays free, the answer follows the grammar).
    after: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. `temperature == 0` is greedy (argmax of the log-probs).

    `top_k <= 0`, `top_p == 1` and `min_p == 0` disable those filters. With `seed`, token `i` of the
    output is drawn on the device with a key of `(seed, i)` (`cpkv_jax.sampling`), so the
    same request gives the same tokens whichever server (unified, or prefill then decode)
    samples which token, whatever it is batched with. Without `seed`, the engine derives
    one from the request id.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    # OpenAI's: subtracted from a token's logit per occurrence in the output so far /
    # once if it occurs there (`cpkv_jax.sampling.PenaltyCounts`); in [-2, 2].
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # HF's / vLLM's, over the prompt and the output: a positive logit of a token seen
    # there is divided by it, another multiplied; in (0, 2], 1 = off.
    repetition_penalty: float = 1.0
    # OpenAI's: (token id, value in [-100, 100]) added to that token's logit, at most
    # `LOGIT_BIAS_LIMIT` tokens.
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # SGLang's `min_new_tokens` (vLLM's `min_tokens`): the stop tokens (EOS unless
    # `ignore_eos`, and `stop_token_ids`) cannot be drawn before this many output tokens
    # (`stop_token_bias`); stop strings still stop.
    min_new_tokens: int = 0
    # The client-visible text only (serving/http/text.py), not the tokens: special tokens
    # in the text (SGLang's / vLLM's `skip_special_tokens`, default on), and the stop
    # string or stop token kept at the text's end (SGLang's `no_stop_trim`, vLLM's
    # `include_stop_str_in_output`).
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    # Structured output: every token is drawn from those the grammar allows next
    # (`serving.grammar`); the request stops with "stop" when the grammar ends.
    grammar: Grammar | None = None

    def validate(self, vocab_size: int) -> None:
        """Raise `InputError` naming the bad field, its value and the accepted range."""
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise InputError(
                f"max_new_tokens must be in [1, {MAX_NEW_TOKENS_LIMIT}], got {self.max_new_tokens}"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise InputError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InputError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InputError(f"{name} must be in [-2, 2], got {value}")
        if len(self.logit_bias) > LOGIT_BIAS_LIMIT:
            raise InputError(
                f"logit_bias names {len(self.logit_bias)} tokens, over the limit of "
                f"{LOGIT_BIAS_LIMIT}"
            )
        bad_bias = [(t, v) for t, v in self.logit_bias if not 0 <= t < vocab_size]
        if bad_bias:
            raise InputError(
                f"logit_bias token {bad_bias[0][0]} is outside the vocabulary [0, {vocab_size})"
            )
        bad_bias = [(t, v) for t, v in self.logit_bias if not -100.0 <= v <= 100.0]
        if bad_bias:
            raise InputError(
                f"logit_bias value {bad_bias[0][1]} for token {bad_bias[0][0]} is outside "
                "[-100, 100]"
            )
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InputError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.top_k > vocab_size:
            raise InputError(f"top_k must be <= the vocabulary size {vocab_size}, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InputError(f"seed must be in [0, 2**63), got {self.seed}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InputError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
            )
        if any(not s for s in self.stop):
            raise InputError("stop strings must be non-empty")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InputError(
                f"min_new_tokens must be in [0, max_new_tokens = {self.max_new_tokens}], got "
                f"{self.min_new_tokens}"
            )
        if self.min_new_tokens and len(self.logit_bias) + len(self.stop_token_ids) > (
            LOGIT_BIAS_LIMIT - MAX_EOS_TOKENS
        ):
            raise InputError(
                f"min_new_tokens bans the stop tokens through the logit bias: logit_bias and "
                f"stop_token_ids name {len(self.logit_bias) + len(self.stop_token_ids)} "
                f"tokens together, over {LOGIT_BIAS_LIMIT - MAX_EOS_TOKENS} with min_new_tokens"
            )


# EOS ids a model config may list (GLM-5 lists 3); room kept for them in the logit bias.
MAX_EOS_TOKENS = 8
BANNED = float("-inf")


def stop_token_bias(
    s: SamplingParams, eos_token_ids: Sequence[int], n_output: int
) -> tuple[tuple[int, float], ...]:
    """The logit bias to draw output token `n_output` with: the request's own, and while
    `n_output < s.min_new_tokens` every stop token banned (-inf: never drawn, as vLLM's
    min_tokens)."""
    if n_output >= s.min_new_tokens:
        return s.logit_bias
    eos = () if s.ignore_eos else tuple(eos_token_ids)[:MAX_EOS_TOKENS]
    banned = sorted(set(s.stop_token_ids) | set(eos))
    return (*s.logit_bias, *((int(t), BANNED) for t in banned))


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One generation request, already tokenized and validated by the HTTP layer."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    return_logprob: bool = False
    # With `return_logprob`: each output token's `top_logprobs` most likely alternatives
    # (0..`cpkv_jax.sampling.TOP_LOGPROBS_MAX`), computed on the device with the token.
    top_logprobs: int = 0
    # The log-probs of the prompt's tokens from this index on (SGLang's
    # `logprob_start_len`; OpenAI's `echo` with `logprobs`), each with `top_logprobs`
    # alternatives; None: none. Computed by the unified server's prefill (its prefix
    # cache then serves only the tokens before it).
    prompt_logprobs_from: int | None = None
    # PD only. Decode mode: the transfer room this request's KV arrives in. Prefill mode:
    # the room to send to, at the decode server's transfer receiver `host:port`.
    bootstrap_room: str | None = None
    decode_transfer_target: str | None = None
    # Decode mode: how many prefill CP ranks send this room's pages.
    bootstrap_cp_size: int | None = None
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass(frozen=True)
class OutputChunk:
    """What a request produced since its previous chunk; the last one has `finished`.

    `logprobs[i]` is the log-probability of `token_ids[i]` under the model's untempered
    next-token distribution (present when the request asked for them); `top_logprobs[i]`
    its position's `GenerateRequest.top_logprobs` most likely (token, log-prob) pairs under
    the same distribution, most likely first (present when the request asked for them).
    `prompt_logprobs` (the first chunk of a request with `prompt_logprobs_from`) are the
    log-probs of prompt tokens from that index on, None for token 0 (no context), and
    `prompt_top_logprobs` their alternatives as `top_logprobs` (empty for token 0).
    `meta` on the final chunk holds `prompt_tokens`, `completion_tokens`, `cached_tokens`,
    `ttft_s`, `e2e_s`. A finished chunk with `finish_reason == "error"` carries `error` (a
    sentence for the client); "abort" means the client or the server (shutdown) cancelled it.
    """

    rid: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    prompt_logprobs: tuple[float | None, ...] | None = None
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    meta: dict[str, float | int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot for `/metrics`, `/server_info` and the router's load balancing."""

    mode: ServerMode
    waiting: int  # queued, not yet started (includes requests waiting for their KV)
    running: int  # in the decode batch, or in a prefill step / transfer
    kv_pages_total: tuple[int, ...]  # per rank (one entry for a single-device engine)
    kv_pages_free: tuple[int, ...]  # per rank, same order
    kv_bytes_per_page: int
    transfer_bytes: int = 0  # bytes this server sent or received over PD transfer
    transfer_seconds: float = 0.0  # summed wall time of those transfers (start to outcome)
    transfer_failures: int = 0
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    admission_rejections: dict[str, int] = dataclasses.field(default_factory=dict)
    # Per rank, same order as kv_pages_free: pages the prefix cache holds (a server
    # without one: empty). Free + cached == total when no request holds pages.
    kv_pages_cached: tuple[int, ...] = ()
    # Per data-parallel rank (`--dp-size`): requests holding its pages (running, or
    # waiting for their KV); empty for an engine without ranks.
    running_per_rank: tuple[int, ...] = ()
    # Decode steps whose tokens reached the host, by kind ("decode": plain; "verify_draft":
    # speculative, the trunk's verify and the MTP layer's drafts in one program), as
    # (count, seconds); see `DecodeEngine._timed`.
    decode_step_seconds: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    queue: QueueStats = QueueStats()  # noqa: RUF009 - frozen; the wait queue (`serving.engine.wait_queue`)


class EngineStateLostError(CpkvError):
    """A failed step left the engine's device state untrustworthy (a KV pool it donated
    to the step is gone): the engine can serve no more. Only `StepEngine.step` raises it;
    `EngineLoop` then fails every request and the server exits for a restart."""


@runtime_checkable
class StepEngine(Protocol):
    """A synchronous engine driven by one thread (`EngineLoop`): nothing here blocks long.

    `add` validates and queues (raising `InputError` for a request it cannot serve, with
    nothing allocated); `step` does one unit of work (a prefill step, a decode step, a
    poll of transfers) and returns the chunks produced; `abort` cancels a request and frees
    what it holds (its final chunk, reason "abort", comes from the next `step`).

    A failure while serving is the requests' own, never the engine's: when a step's
    device work raises (a compile, a SPEC S1.7 debug check), the requests of that step
    end with an "error" chunk saying why and their pages are freed; when one request's
    token cannot be produced (a broken log-prob row, its detokenizer raising), only that
    request ends so. `step` then returns normally and later requests are served. It
    raises only when the engine can serve no more (`EngineStateLostError`).

    `stats` runs on the engine's thread (`EngineLoop` publishes what it returns).
    """

    mode: ServerMode

    def add(self, req: GenerateRequest) -> None: ...

    def abort(self, rid: str) -> None: ...

    def step(self) -> Sequence[OutputChunk]: ...

    def has_work(self) -> bool: ...

    def stats(self) -> EngineStats: ...


@runtime_checkable
class EngineClient(Protocol):
    """What the HTTP layer awaits. `generate` yields chunks until one is `finished`;
    closing the iterator early (client disconnect) aborts the request."""

    mode: ServerMode

    def generate(self, req: GenerateRequest) -> AsyncIterator[OutputChunk]: ...

    def abort(self, rid: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def healthy(self) -> bool: ...

    def fatal_reason(self) -> str | None:
        """Why this client can serve no more (its engine failed or died), else None."""
        ...

    async def shutdown(self, drain_timeout: float) -> None: ...


def prompt_scores(scores: PromptLogprobs, top_n: int) -> tuple[tuple, tuple]:
    """A prefill's prompt scores as `OutputChunk.prompt_logprobs` / `prompt_top_logprobs`
    (token 0, without context: None and no alternatives)."""
    lps, tops = [], []
    for i, lp in enumerate(scores.logprobs.tolist()):
        if scores.start + i == 0:
            lps.append(None)
            tops.append(())
            continue
        lps.append(lp)
        ids = scores.top_ids[i, :top_n].tolist()
        tops.append(tuple(zip(ids, scores.top_logprobs[i, :top_n].tolist(), strict=True)))
    return tuple(lps), tuple(tops)
