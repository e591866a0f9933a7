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


def next_tokens(prompt: np.ndarray, start: int, count: int) -> np.ndarray:
    """The targets of a row fed `prompt[start:start + count]`: each fed token's next
    prompt token, `[count]` int32, 0 for the prompt's last token (it predicts the
    output, not a prompt token)."""
    at = np.arange(start + 1, start + count + 1)
    return np.where(at < len(prompt), prompt[np.minimum(at, len(prompt) - 1)], 0).astype(np.int32)


def span_scores(
    prompt: np.ndarray,
    start: int,
    count: int,
    chosen: np.ndarray,
    top_ids: np.ndarray,
    top_logprobs: np.ndarray,
) -> TokenScores:
    """The `TokenScores` of a row fed `prompt[start:start + count]` in order (its first
    `count` columns of a scoring step's outputs): prompt tokens `start + 1` on, up to
    the prompt's last."""
    n = max(min(start + count, len(prompt) - 1) - start, 0)
    return TokenScores(start + 1, chosen[:n], top_ids[:n], top_logprobs[:n])


class PromptScores:
    """One prompt's token scores, gathered step by step (a chunk each): `record` each
    step's `TokenScores`, then `result(score_from)` the asked-for part."""

    def __init__(self, n: int):
        self.logprobs = np.full(n, np.nan, np.float32)
        self.top_ids = np.zeros((n, TOP_SCORES), np.int32)
        self.top_logprobs = np.full((n, TOP_SCORES), np.nan, np.float32)

    def record(self, scores: TokenScores) -> None:
        at = slice(scores.first, scores.first + len(scores.logprobs))
        k = scores.top_ids.shape[-1]
        self.logprobs[at] = scores.logprobs
        self.top_ids[at, :k] = scores.top_ids
        self.top_logprobs[at, :k] = scores.top_logprobs

    def result(self, start: int) -> PromptLogprobs:
        """Tokens `[start, n)`: NaN where no step scored them (token 0 has no context)."""
        at = slice(start, None)
        return PromptLogprobs(start, self.logprobs[at], self.top_ids[at], self.top_logprobs[at])


def match_end(prompt_len: int, score_from: int | None) -> int:
    """How many leading prompt tokens a prefix cache may serve: all but the last (at
    least one token is computed), and, for a prompt scored from `score_from`, none at
    or past the token before it (a cached token's hidden state, which predicts the
    next, is gone)."""
    end = prompt_len - 1
    if score_from is not None:
        end = min(end, max(score_from - 1, 0))
    return end
