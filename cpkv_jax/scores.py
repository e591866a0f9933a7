"""Prompt token scores (prompt log-probs) as plain data: no JAX, so the host-side
scheduler that carries them stays free of it. The CP prefill's scoring step
(`cpkv_jax.cp_prefill.CPPrefillRunner.run_score_step`) produces them."""

from __future__ import annotations

import dataclasses

import numpy as np

# Alternatives kept per scored prompt token: the API's top log-probs limit, equal to
# `cpkv_jax.sampling.TOP_LOGPROBS_MAX` (tests/core/test_device_sampling.py checks); a
# request slices what it asked for.
TOP_SCORES = 20


@dataclasses.dataclass(frozen=True)
class TokenScores:
    """Prompt tokens `[first, first + len(logprobs))` of one row, scored by one step:
    `logprobs[i]` is log p(token first + i | the tokens before it), `top_ids` /
    `top_logprobs` (`[n, k]`, k <= TOP_SCORES) the most likely tokens there, most likely
    first."""

    first: int
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Log-probs of prompt tokens `[start, n)`, each given the tokens before it;
    `logprobs[i]` is NaN for token 0, which has no context. `top_ids` / `top_logprobs`
    (`[n - start, TOP_SCORES]`): the most likely tokens at each position, most likely
    first (zeros / NaN at token 0)."""

    start: int
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
