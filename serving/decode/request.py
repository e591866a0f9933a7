"""One request as the decode engine and its parts (intake, sampler, batch) see it."""

from __future__ import annotations

import dataclasses

import numpy as np

from cpkv_jax.sampling import TopLogprobs
from cpkv_jax.scores import PromptScores
from serving.engine.api import GenerateRequest
from serving.engine.stopping import StopChecker, StopResult
from serving.grammar import RowGrammar


@dataclasses.dataclass(eq=False)
class DecodeRequest:
    req: GenerateRequest
    prompt: np.ndarray  # int32 [n]
    seed: int
    n_pages: int  # reserved for prompt + max_new_tokens
    width: int  # page-table width of its prefill (pow2 of n_pages)
    stop: StopChecker
    pages: np.ndarray | None = None  # held pages; None once freed (or owned by a room)
    rank: int = 0  # the DP rank whose pool shard holds its pages and runs its rows
    out_ids: list[int] = dataclasses.field(default_factory=list)
    out_lps: list[float] = dataclasses.field(default_factory=list)
    out_tops: list[TopLogprobs] = dataclasses.field(default_factory=list)
    emitted: int = 0  # output tokens already sent in a chunk
    first_token_at: float | None = None
    # The prefix-cache hit of its prefill (a PD decode server: from the transfer's aux).
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    # The first prompt position the engine's own prefill computes: a prefix cache per DP
    # rank had the KV before it in the request's pages (`serving.decode.dp_prefix`).
    prefill_from: int = 0
    finish: StopResult | None = None
    error: str | None = None
    # Tokens drawn on the device and not recorded yet (0 or 1: a decode step in flight).
    pending: int = 0
    grammar: RowGrammar | None = None  # structured output: its place in the grammar
    # `prompt_logprobs_from`: the prompt's scores, sent with the next chunk (then None).
    prompt_scores: tuple[tuple, tuple] | None = None
    # Its scores as the engine's own prefill steps compute them, chunk by chunk.
    scoring: PromptScores | None = None
    # Speculative decoding: its draft-state slot while admitted, its verify steps and the
    # tokens they emitted (accepted drafts + one each).
    slot: int | None = None
    spec_verify_ct: int = 0
    spec_emitted: int = 0

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is in the pool: the prompt and every output token but the last."""
        return len(self.prompt) + max(len(self.out_ids) - 1, 0)
