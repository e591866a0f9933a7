"""Speculative decoding on the DP mesh (issue 39 with issue 36's data-parallel decode):
every program of `SpeculativeSteps` runs on the rank holding the request's pages, in a
draft-state slot of that rank (`decode_mesh.dp_slab_program`). Compared with the plain
single-device engine: bitwise under batch-invariant numerics for the FP8 checkpoint,
within 1e-5 under the default numerics for the other (`support.speculative_engine.EXACT`).
(Its own module: with the engine tests' programs in one process, XLA:CPU ran out of
memory maps.)"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from support import speculative_engine as se
from support.speculative_engine import (
    EXACT,
    LENGTHS,
    PAGES,
    ROWS,
    P,
    assert_same,
    install_oracle,
    make_engine,
    record_first_drafts,
    requests,
    run,
    with_stop_tokens,
)

from cpkv_jax.decode_mesh import DPPoolLayout, init_dp_pool
from cpkv_jax.kv_store import DPPrefixStore, PagedKVStore
from cpkv_jax.mesh import make_dp_mesh
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.paging import PageAllocator
from serving.decode.dp_prefix import DPPrefixPrefill
from serving.decode.engine import DecodeEngine
from serving.decode.speculative import SPEC_FORMS
from serving.engine.api import SamplingParams

pytestmark = pytest.mark.slow(seconds=80)  # one worker, 2026-12-06

loaded, plain = se.loaded, se.plain  # the module-scoped fixtures


def dp_engine(cfg, model, k: int, dp: int, *, exact: bool) -> DecodeEngine:
    """`make_engine` on a `("dp",)` mesh of `dp` devices (issue 36): the pool and the draft
    state split over the ranks, routed experts too (the tiny checkpoints' 8: 4 per rank)."""
    mesh = make_dp_mesh(dp, jax.devices())
    layout = DPPoolLayout(dp, PAGES // dp, P)
    pool = init_dp_pool(mtp_config(cfg), layout, mesh, np.float32, "fp8_e4m3")
    return DecodeEngine(
        cfg=cfg, model=model, kv=PagedKVStore(pool, PageAllocator(PAGES, ranks=dp)),
        page_size=P, index_k_dtype="fp8_e4m3", mode="null", max_running_requests=ROWS,
        batch_invariant=exact, speculative_num_steps=k, mesh=mesh,
    )  # fmt: skip


@pytest.mark.parametrize(("ckpt", "k"), [("glm-fp8", 2), ("dsv32", 3)])
def test_speculative_decoding_on_a_dp_mesh_equals_one_device(loaded, plain, ckpt, k):
    """Issue 39 on issue 36's DP mesh (2 ranks): every speculative program runs on the
    rank holding the request's pages, in a draft-state slot of that rank. Greedy tokens
    and log-probs are the plain single-device engine's (log-probs bitwise for the FP8
    checkpoint under batch-invariant numerics, within 1e-5 for DeepSeek's), with random
    and oracle drafts (every accepted count, stops inside accepted drafts); requests land
    on both ranks, prefills of two ranks share one program; sampled rows with top-p (one
    with penalties) draw what they draw on one device (same seeds); every page and slot
    comes back."""
    exact = ckpt in EXACT
    cfg, model = loaded(ckpt)
    engine = dp_engine(cfg, model, k, 2, exact=exact)
    free0 = engine.kv.num_free_pages
    prefills = []
    prefill_many = engine.spec.prefill_many
    engine.spec.prefill_many = lambda reqs, *rest: (
        prefills.append(len(reqs)) or prefill_many(reqs, *rest)
    )
    assert_same(run(engine, requests(cfg)), plain(ckpt), exact=exact)
    assert all(n > 0 for n in engine.admitted_per_rank) and max(prefills) == 2
    accepted = install_oracle(engine, {rid: o[0] for rid, o in plain(ckpt).items()}, k)
    got = run(engine, with_stop_tokens(requests(cfg), plain(ckpt)))
    assert_same(got, plain(ckpt, True), exact=exact)
    assert set(accepted) == set(range(k + 1)), accepted
    assert engine.kv.num_free_pages == free0 and engine.spec.free_slots == ROWS
    assert engine.step_shapes <= engine.reachable_shapes()
    assert {s[1] for s in engine.step_shapes if s[0] in SPEC_FORMS} == {1, 2}  # rows per rank
    if ckpt != "dsv32":
        return
    reqs = requests(cfg, seed=4)[:3]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.8, seed=5)
    reqs[1] = dataclasses.replace(reqs[1], sampling=sp)
    penalized = dataclasses.replace(sp, seed=6, frequency_penalty=0.8, logit_bias=((11, 3.0),))
    reqs[2] = dataclasses.replace(reqs[2], sampling=penalized)
    want = run(make_engine(cfg, model, k, exact=exact), reqs)
    del engine.spec.step  # the oracle's wrapper: random drafts again
    got = run(engine, reqs)
    assert_same(got, want, exact=exact)
    assert got["r1"][0] != plain(ckpt)["r1"][0][:12]  # it did sample


def test_speculative_decoding_with_a_prefix_cache_per_rank(loaded, plain):
    """Issue 39 on a unified DP server's default engine (issue 36 item 5: a radix cache
    per rank): the admission program prefills a prompt from the end of its cached prefix,
    whose trunk and MTP KV an earlier request wrote. The requests run twice (r1 sampled),
    the second time hitting their own cached pages: the same tokens, log-probs and first
    drafts bitwise (the first token is drawn at its position, the MTP pass starts where
    the trunk did); the greedy ones are the plain single-device engine's (batch-invariant
    numerics); every page (free or cached, none locked) and draft slot comes back."""
    cfg, model = loaded("glm-fp8")
    mesh = make_dp_mesh(2, jax.devices())
    layout = DPPoolLayout(2, PAGES // 2, P)
    pool = init_dp_pool(mtp_config(cfg), layout, mesh, np.float32, "fp8_e4m3")
    store = DPPrefixStore(pool, layout)
    engine = DecodeEngine(
        cfg=cfg, model=model, kv=store, page_size=P, index_k_dtype="fp8_e4m3", mode="null",
        intake=DPPrefixPrefill(store), max_running_requests=ROWS, batch_invariant=True,
        speculative_num_steps=2, mesh=mesh,
    )  # fmt: skip
    reqs = requests(cfg)
    sampled = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=5)
    reqs[1] = dataclasses.replace(reqs[1], sampling=sampled)
    first_drafts = record_first_drafts(engine, "prefill_many")
    cold = run(engine, reqs)
    cold_drafts = dict(first_drafts)
    first_drafts.clear()
    warm = run(engine, reqs)
    assert_same(warm, cold, exact=True)
    assert first_drafts == cold_drafts and len(cold_drafts) == len(reqs)
    assert sum(o[3]["cached_tokens"] for o in warm.values()) >= 3 * P
    want = plain("glm-fp8")
    assert_same(cold, {rid: o for rid, o in want.items() if rid != "r1"}, exact=True)
    stats = engine.stats()
    assert [f + c for f, c in zip(stats.kv_pages_free, stats.kv_pages_cached, strict=True)] == [
        PAGES // 2 - 1
    ] * 2
    assert all(cache.protected_size() == 0 for cache in store.caches)
    assert engine.spec.free_slots == engine.spec.num_slots
    assert engine.step_shapes <= engine.reachable_shapes()
    # Prompt log-probs from token 2P + 1 on: the prompt's first two pages come from the
    # cache (those before the token ahead of the start), the rest is fed to the admission
    # program's scoring twin; bitwise the one-device plain engine's whole-prompt scores.
    echo = dataclasses.replace(reqs[0], rid="echo", prompt_logprobs_from=2 * P + 1)
    got = _prompt_scores(engine, echo)
    assert got[2] == 2 * P
    assert got[:2] == _prompt_scores(make_engine(cfg, model, 0, exact=True), echo)[:2]
    assert got[0][0] is not None and len(got[0]) == LENGTHS[0] - 2 * P - 1


def _prompt_scores(engine: DecodeEngine, r) -> tuple:
    """`r` served alone: (prompt log-probs, prompt top log-probs, cached tokens)."""
    engine.add(r)
    scores: tuple = (None, None)
    for _ in range(100):
        for c in engine.step():
            if c.prompt_logprobs is not None:
                scores = (c.prompt_logprobs, c.prompt_top_logprobs)
            if c.finished:
                return (*scores, c.meta["cached_tokens"])
    raise AssertionError("the request did not finish")
