"""Stop conditions (`serving.engine.stopping.StopChecker`); the
token draws themselves are `cpkv_jax.sampling` (tests/core/test_device_sampling.py)."""

from __future__ import annotations

import numpy as np
import pytest

from cpkv_jax.errors import InputError
from serving.engine.api import SamplingParams, stop_token_bias
from serving.engine.stopping import StopChecker

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
    assert (at, res.reason, res.matched_token) == (2, "stop", 1)
    ignore = SamplingParams(max_new_tokens=10, ignore_eos=True, stop_token_ids=(7,))
    at, res = feed(StopChecker(ignore, eos), [5, 1, 6, 7, 8])
    # eos ignored, explicit stop id honoured
    assert (at, res.reason, res.matched_token) == (3, "stop", 7)
    at, res = feed(StopChecker(SamplingParams(max_new_tokens=3), eos), [5, 6, 8, 9])
    assert (at, res.reason, res.matched_token) == (2, "length", None)
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


def test_stop_token_bias_bans_stop_tokens_before_min_new_tokens():
    s = SamplingParams(8, stop_token_ids=(7, 5), logit_bias=((9, 1.5),), min_new_tokens=2)
    banned = ((9, 1.5), (1, float("-inf")), (5, float("-inf")), (7, float("-inf")))
    assert stop_token_bias(s, (1,), 0) == stop_token_bias(s, (1,), 1) == banned
    assert stop_token_bias(s, (1,), 2) == ((9, 1.5),)  # reached: the request's own bias
    ignoring = SamplingParams(8, ignore_eos=True, min_new_tokens=1)
    assert stop_token_bias(ignoring, (1,), 0) == ()  # no stop token to ban
    assert stop_token_bias(SamplingParams(8), (1,), 0) == ()
