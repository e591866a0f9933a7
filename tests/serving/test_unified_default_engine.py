"""The unified server's default engine (issue 35): `cpkv-serve --model-path DIR` keeps the
radix prefix cache and prefills through the prefill scheduler (`CachedUnifiedEngine`), so
a repeated prompt's whole pages come from the cache; `--disable-radix-cache` is the plain
whole-prompt `DecodeEngine` with no cache. The flag is refused where it means nothing.
Also: a request's `min_p` reaches the device sampler through this engine."""

from __future__ import annotations

import time

import jax
import pytest
from support.prefill_server import P
from support.server_args_cases import make_args
from support.unified_server import unified_args

from serving import server as server_mod
from serving.decode.cached import CachedUnifiedEngine
from serving.decode.engine import DecodeEngine
from serving.engine.api import GenerateRequest, SamplingParams
from serving.server_args import ServerArgsError

PROMPT = 2 * P + 5  # two whole pages and a partial one
NEW = 3


def run(engine, rid: str, prompt: tuple[int, ...], **sampling):
    """The request's tokens and final chunk, stepping the engine until it finishes."""
    params = SamplingParams(**{"max_new_tokens": NEW, "temperature": 0.0, **sampling})
    engine.add(GenerateRequest(rid, prompt, params))
    tokens, deadline = [], time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, f"{rid} did not finish"
        for c in engine.step():
            assert c.rid == rid and c.finish_reason in (None, "length"), c
            tokens += c.token_ids
            if c.finished:
                return tokens, c


@pytest.mark.parametrize("disable", [False, True], ids=["default", "disable_radix_cache"])
def test_a_repeated_prompt_hits_the_default_prefix_cache(tiny_checkpoint, disable):
    path, cfg, model = tiny_checkpoint
    extra = ("--disable-radix-cache",) if disable else ()
    args = unified_args(path, cfg, 24, *extra)
    engine, _, closers = server_mod._build_decode_side(args, cfg, model, None, jax.devices())
    try:
        assert type(engine) is (DecodeEngine if disable else CachedUnifiedEngine)
        prompt = tuple(range(7, 7 + PROMPT))
        first, c1 = run(engine, "a", prompt)
        again, c2 = run(engine, "b", prompt)
        assert again == first and len(first) == NEW
        assert c1.meta["cached_tokens"] == 0
        # The cache holds whole pages; the partial tail page is recomputed.
        assert c2.meta["cached_tokens"] == (0 if disable else 2 * P)
        assert engine.stats().prefix_cache_hit_tokens == (0 if disable else 2 * P)
    finally:
        for close in closers:
            close()


def test_disable_radix_cache_is_refused_where_it_means_nothing():
    make_args(disable_radix_cache=True).validate()  # unified: fine
    for mode in ("prefill", "decode"):
        with pytest.raises(ServerArgsError, match="applies to the unified server"):
            make_args(disable_radix_cache=True, disaggregation_mode=mode).validate()
    with pytest.raises(ServerArgsError, match="extends the radix prefix cache"):
        make_args(disable_radix_cache=True, enable_hierarchical_cache=True).validate()


def test_min_p_reaches_the_device_sampler(tiny_checkpoint):
    """`min_p` 1 keeps only the most likely token, so a hot (temperature 1.5) request
    gives the greedy tokens; without it the same seeds draw others (the check can fail)."""
    path, cfg, model = tiny_checkpoint
    args = unified_args(path, cfg, 24)
    engine, _, closers = server_mod._build_decode_side(args, cfg, model, None, jax.devices())
    try:
        prompt = tuple(range(11, 11 + P + 3))
        new = {"max_new_tokens": 8, "ignore_eos": True}
        greedy, _ = run(engine, "g", prompt, **new)
        hot = {"temperature": 1.5, "seed": 5, **new}
        assert run(engine, "m", prompt, min_p=1.0, **hot)[0] == greedy
        assert run(engine, "h", prompt, **hot)[0] != greedy
    finally:
        for close in closers:
            close()
