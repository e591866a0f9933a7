"""Sampling (`serving.decode.sampling.sample_token`) and stop conditions (`StopChecker`).

The filters are checked against an independent float64 reference written with plain
Python sorting and accumulation; the draws against that distribution by frequency over
many seeds (binomial tolerance stated at the check).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cpkv_jax.errors import InputError
from serving.decode.sampling import StopChecker, sample_token, sampling_probs
from serving.engine.api import SamplingParams


def random_logprobs(rng: np.random.Generator, vocab: int, scale: float = 2.0) -> np.ndarray:
    """One row of log-softmax (float32, as the engine hands it over)."""
    z = rng.normal(size=vocab) * scale
    return (z - np.log(np.exp(z - z.max()).sum()) - z.max()).astype(np.float32)


def reference_probs(logprobs: np.ndarray, temperature: float, top_k: int, top_p: float):
    """Float64 reference: sort by (prob desc, id asc), keep k, then the smallest prefix
    of the renormalized rest with mass >= top_p; renormalize."""
    z = [float(x) / temperature for x in logprobs]
    m = max(z)
    p = [math.exp(v - m) for v in z]
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    if top_k > 0:
        order = order[:top_k]
    total = sum(p[i] for i in order)
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += p[i] / total
        if mass >= top_p:
            break
    out = np.zeros(len(p))
    for i in kept:
        out[i] = p[i]
    return out / out.sum(), set(kept)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.8), (0.5, 12, 0.6), (2.0, 3, 0.3), (1.0, 40, 0.95)],
)
def test_filters_match_float64_reference(temperature, top_k, top_p):
    rng = np.random.default_rng(11)
    for _ in range(20):
        lp = random_logprobs(rng, 40)
        got = sampling_probs(lp, temperature, top_k, top_p)
        want, kept = reference_probs(lp, temperature, top_k, top_p)
        # The kept set is exact; the values agree to float64 rounding of exp/sum.
        assert set(np.flatnonzero(got).tolist()) == kept
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_top_p_keeps_at_least_one_token_and_ties_go_to_lower_ids():
    lp = np.log(np.asarray([0.1, 0.6, 0.1, 0.2], np.float32))
    assert np.flatnonzero(sampling_probs(lp, 1.0, -1, 1e-6)).tolist() == [1]
    flat = np.full(6, -math.log(6), np.float32)
    assert np.flatnonzero(sampling_probs(flat, 1.0, 2, 1.0)).tolist() == [0, 1]


def test_greedy_and_top_k_one_are_argmax():
    rng = np.random.default_rng(5)
    for i in range(30):
        lp = random_logprobs(rng, 64)
        want = int(np.argmax(lp))
        assert sample_token(lp, SamplingParams(temperature=0.0), i, 123) == want
        assert sample_token(lp, SamplingParams(temperature=1.5, top_k=1), i, i) == want
    tie = np.asarray([-2.0, -0.5, -0.5, -3.0], np.float32)
    assert sample_token(tie, SamplingParams(), 0, 0) == 1
    assert sample_token(tie, SamplingParams(temperature=1.0, top_k=1), 0, 0) == 1


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_row_without_a_finite_maximum_is_refused_greedy_or_not(temperature):
    """Broken logits (a NaN anywhere, or nothing finite) raise instead of giving a
    token: greedy argmax would stop at the NaN and report a NaN log-prob. The engines
    fail that request alone."""
    params = SamplingParams(temperature=temperature)
    for row in ([-1.0, np.nan, -0.5], [-np.inf] * 3, [np.nan] * 3):
        with pytest.raises(ValueError, match="no finite maximum"):
            sample_token(np.asarray(row, np.float32), params, 0, 0)
    masked = np.asarray([-np.inf, -0.1, -np.inf], np.float32)  # -inf rows are fine
    assert sample_token(masked, params, 0, 0) == 1


def test_empirical_frequencies_follow_the_filtered_distribution():
    rng = np.random.default_rng(21)
    lp = random_logprobs(rng, 12, scale=1.0)
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9)
    want, kept = reference_probs(lp, 0.8, 8, 0.9)
    n = 6000
    draws = np.asarray([sample_token(lp, params, 7, seed) for seed in range(n)])
    counts = np.bincount(draws, minlength=12)
    assert set(np.flatnonzero(counts).tolist()) <= kept  # filtered tokens never drawn
    # Each count is Binomial(n, p): within 5 standard deviations (the seeds are fixed,
    # so this is deterministic; 5 sigma leaves margin for any one of 12 tokens).
    sigma = np.sqrt(n * want * (1 - want))
    assert np.all(np.abs(counts - n * want) <= 5 * sigma + 1), (counts, n * want)


def test_draws_are_seeded_and_stateless_per_step():
    rng = np.random.default_rng(3)
    lp = random_logprobs(rng, 32, scale=0.5)
    params = SamplingParams(temperature=1.0)
    forward = [sample_token(lp, params, s, 99) for s in range(40)]
    backward = [sample_token(lp, params, s, 99) for s in reversed(range(40))][::-1]
    assert forward == backward  # no hidden state: a decode server may start at step 1
    assert len(set(forward)) > 5  # steps are different draws, not one repeated token
    other_seed = [sample_token(lp, params, s, 100) for s in range(40)]
    assert other_seed != forward


# ---- stop conditions ---------------------------------------------------------------------


def byte_detokenize(ids: list[int]) -> str:
    """Byte-level detokenizer: token t is byte t (t < 256), decoded with replacement, so
    a multi-byte character split over tokens shows as U+FFFD until complete."""
    return bytes(ids).decode("utf-8", errors="replace")


def feed(checker: StopChecker, ids: list[int]):
    for i, t in enumerate(ids):
        res = checker.append(t)
        if res is not None:
            return i, res
    return None, None


def test_eos_stop_ids_and_length():
    eos = (1,)
    at, res = feed(StopChecker(SamplingParams(max_new_tokens=10), eos), [5, 6, 1, 7])
    assert (at, res.reason) == (2, "stop")
    ignore = SamplingParams(max_new_tokens=10, ignore_eos=True, stop_token_ids=(7,))
    at, res = feed(StopChecker(ignore, eos), [5, 1, 6, 7, 8])
    assert (at, res.reason) == (3, "stop")  # eos ignored, explicit stop id honoured
    at, res = feed(StopChecker(SamplingParams(max_new_tokens=3), eos), [5, 6, 8, 9])
    assert (at, res.reason) == (2, "length")
    # A stop token that is also the last allowed token finishes as "stop" (as the
    # reference generator reports eos).
    at, res = feed(StopChecker(SamplingParams(max_new_tokens=2), eos), [5, 1])
    assert (at, res.reason) == (1, "stop")


def test_stop_string_spanning_tokens_and_multibyte_characters():
    text = "ab é!xyz"
    ids = list(text.encode())  # "é" is two tokens (0xC3 0xA9)
    params = SamplingParams(max_new_tokens=50, stop=("zz", "é!"))
    checker = StopChecker(params, (), byte_detokenize)
    at, res = feed(checker, ids)
    # Finished on the token completing "é!" (the '!'), ids include that token.
    assert at == ids.index(ord("!"))
    assert res.reason == "stop" and res.matched_stop == "é!" and res.matched_stop_index == 1
    assert checker.text == byte_detokenize(ids[: at + 1])
    assert checker.text[: res.text_end] == "ab "


def test_earliest_stop_string_wins_and_text_matches_full_decode():
    rng = np.random.default_rng(8)
    ids = [int(t) for t in rng.integers(97, 123, 60)]  # lowercase letters
    full = byte_detokenize(ids)
    target = full[30:33]
    params = SamplingParams(max_new_tokens=100, stop=("not-there", target))
    checker = StopChecker(params, (), byte_detokenize)
    at, res = feed(checker, ids)
    first = full.find(target)
    assert res.text_end == first and at == first + 2 and res.matched_stop == target
    assert checker.text == full[: at + 1]


def test_stop_strings_without_detokenizer_are_refused():
    with pytest.raises(InputError, match="need a tokenizer"):
        StopChecker(SamplingParams(stop=("x",)), (1,), None)
