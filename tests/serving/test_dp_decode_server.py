"""A unified server decoding on a ("dp",) mesh (`--dp-size 4`, issue 36): the tiny
model's routed experts split over 4 virtual CPU devices (reached by the padded
all-to-all dispatch here), each request's pages in one rank's shard of the pool, with
the default prefix cache, one per rank (item 5, `serving.decode.dp_prefix`), each with
a host cache (`--enable-hierarchical-cache`, write-through).

Concurrent requests of mixed lengths give the single-device reference's greedy tokens
(compared exactly: the reference and the DP step run the same model code; rows batched
with others may differ in the last bits of a log-prob, which never flips an argmax
here), land on more than one rank, and every rank's pages come back (free or cached);
a second wave sharing a prompt's pages reuses them, and still equals the reference;
`/server_info` reports the ranks. Flag checks refuse what DP decode does not do.
"""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import numpy as np
import pytest
from support.prefill_server import float32_args
from support.unified_server import (
    client_wave,
    greedy_ids,
    serving,
    settled_held_pages,
    unified_args,
)

from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.model.weights import load_model
from serving.server_args import ServerArgsError

P = 16
DP = 4
NEW = 5
WAIT_S = 120.0


@pytest.fixture(scope="module")
def dp_server(tiny_checkpoints):
    path = tiny_checkpoints("glm_moe_dsa")
    cfg, model = load_model(path, progress=False)
    args = unified_args(
        path,
        cfg,
        12,  # pages per rank
        "--dp-size",
        str(DP),
        "--max-running-requests",
        "8",
        # The padded all-to-all expert dispatch (exact at its default capacity); the PD
        # tests and `make demo` run the default all-gather.
        "--ep-dispatch",
        "all_to_all",
        # A host cache per rank, every cached page copied there at once: the load test
        # below runs with its backups in flight.
        "--enable-hierarchical-cache",
        "--hicache-write-policy",
        "write_through",
        "--hicache-mem-layout",
        "layer_first",
    )
    with serving(args) as (server, served):
        yield cfg, model, server, served


def test_dp_unified_server_equals_the_reference(dp_server):
    cfg, model, server, served = dp_server
    engine = server.engine
    assert engine.dp_size == DP
    rng = np.random.default_rng(7)
    prompts = [
        rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 2 * P, 3 * P + 3, 9, 40, 17)
    ]
    # A second wave shares the 2-page prompt's pages, cached on the rank that ran it.
    shared = [prompts[1] + rng.integers(3, cfg.vocab_size, n).tolist() for n in (3, 11, 6)]
    ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32")
    for wave in (prompts, shared):
        with concurrent.futures.ThreadPoolExecutor(len(wave)) as pool:
            got = list(pool.map(lambda ids: greedy_ids(served.url, ids, NEW, WAIT_S), wave))
        for ids, out in zip(wave, got, strict=True):
            assert out == ref.generate(ids, NEW, ignore_eos=True).output_ids
    assert sum(n > 0 for n in engine.admitted_per_rank) > 1  # spread over the ranks
    stats = engine.stats()
    assert len(stats.kv_pages_total) == DP
    assert stats.prefix_cache_hit_tokens >= 2 * P  # the first of the wave, at least
    # Every rank's pages back: free, or cached and unlocked.
    assert [f + c for f, c in zip(stats.kv_pages_free, stats.kv_pages_cached, strict=True)] == [
        *stats.kv_pages_total
    ]
    assert all(cache.protected_size() == 0 for cache in engine.kv.caches)
    ranks = {shape[1] for shape in engine.step_shapes}  # rows per rank ran in buckets
    assert ranks and all(r & (r - 1) == 0 for r in ranks)
    info = httpx.get(served.url + "/server_info", timeout=10).json()
    assert info["dp_size"] == DP and info["running_per_rank"] == [0] * DP
    assert len(info["kv_pages_free"]) == DP
    # The host caches (one pool per rank): the prompts' whole pages copied there.
    for io in engine.kv.host:
        io.wait_backups()
    hicache = httpx.get(served.url + "/server_info", timeout=10).json()["hicache"]
    assert hicache["write_policy"] == "write_through" and hicache["layout"] == "layer_first"
    assert len(hicache["host_pages_used_per_lane"]) == DP and hicache["backups_failed"] == 0
    assert sum(hicache["host_pages_used_per_lane"]) >= sum(stats.kv_pages_cached)
    metrics = httpx.get(served.url + "/metrics", timeout=10).text
    assert 'cpkv_rank_running_requests{rank="3"} 0.0' in metrics
    assert "cpkv_hicache_backups_total" in metrics
    steps = re.search(r'^cpkv_decode_step_seconds_count{kind="decode"} (\S+)$', metrics, re.M)
    assert steps is not None and float(steps[1]) >= NEW - 1  # each request's decode steps


def test_prompt_log_probs_on_the_dp_server_are_the_reference(dp_server):
    """lm-evaluation-harness's log-likelihood request (`echo` + `logprobs: 3`,
    `max_tokens: 0`) on the DP4 server, four at once with greedy requests beside them:
    each prompt token's log-prob (token 0: None) is the single-device reference's
    teacher-forced float64 log-softmax within 1e-4 (float32 logits of another program),
    with its best alternative's value first; every rank's pages come back."""
    cfg, model, server, served = dp_server
    rng = np.random.default_rng(21)
    scored = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (P + 3, 2 * P, 7, 3 * P + 1)]
    ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32")

    def echo(ids: list[int]) -> dict:
        body = {"model": "tiny", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 3}
        r = httpx.post(served.url + "/v1/completions", json=body, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]

    plain = [rng.integers(3, cfg.vocab_size, 9).tolist() for _ in range(3)]
    with concurrent.futures.ThreadPoolExecutor(len(scored) + len(plain)) as pool:
        outs = [pool.submit(greedy_ids, served.url, ids, NEW, WAIT_S) for ids in plain]
        got = list(pool.map(echo, scored))
        assert [o.result() for o in outs] == [
            ref.generate(ids, NEW, ignore_eos=True).output_ids for ids in plain
        ]
    for ids, lp in zip(scored, got, strict=True):
        want, want_top = ref.prompt_logprobs(ids, top_n=3)
        assert len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1:], want, rtol=0, atol=1e-4)
        for alts, ref_alts in zip(lp["top_logprobs"][1:], want_top, strict=True):
            assert max(alts.values()) == pytest.approx(ref_alts[0][1], abs=1e-4)
    held = settled_held_pages(server.engine)
    assert held == 0, f"{held} pages still held once idle"


def test_many_clients_with_disconnects_leave_every_rank_s_pages(dp_server):
    """20 clients over 4 shared prefixes (the ranks' caches locked and evicted under
    load), sampled and greedy, a third of them streaming and leaving after their first
    event: every finished answer has its length, and once idle no rank holds a page
    beyond its cache, nothing locked."""
    cfg, _, server, served = dp_server
    engine = server.engine
    rng = np.random.default_rng(12)
    heads = [rng.integers(3, cfg.vocab_size, P).tolist() for _ in range(4)]
    jobs = [
        (heads[i % 4] + rng.integers(3, cfg.vocab_size, int(rng.integers(2, 30))).tolist(), i)
        for i in range(20)
    ]
    hits = engine.stats().prefix_cache_hit_tokens
    problems = client_wave(served.url, jobs)
    assert not problems, problems
    assert engine.stats().prefix_cache_hit_tokens > hits
    assert settled_held_pages(engine) == 0
    assert all(cache.protected_size() == 0 for cache in engine.kv.caches)
    for cache in engine.kv.caches:
        cache.check_invariants()


def test_dp_flags_refuse_what_dp_decode_does_not_do(tiny_checkpoints):
    path = tiny_checkpoints("glm_moe_dsa")
    warned = float32_args(path, "--dp-size", "2").validate()  # a prefix cache per rank
    assert any("without --chunked-prefill-size" in w for w in warned)
    float32_args(path, "--dp-size", "2", "--enable-hierarchical-cache").validate()
    whole = float32_args(  # speculative: with the caches per rank, whole prompts
        path, "--dp-size", "2", "--speculative-algorithm", "EAGLE", "--chunked-prefill-size",
        "32",
    )  # fmt: skip
    assert any("prefills a whole prompt" in w for w in whole.validate())
    assert whole.own_prefill_chunk() is None
    chunked = float32_args(path, "--dp-size", "2", "--chunked-prefill-size", "40")
    assert chunked.own_prefill_chunk() == 32  # whole pages of 16
    assert not any("--chunked-prefill-size" in w for w in chunked.validate())
    with pytest.raises(ServerArgsError, match="--cp-size ranks instead"):
        float32_args(path, "--dp-size", "2", "--disaggregation-mode", "prefill").validate()
    with pytest.raises(ServerArgsError, match="divide the 8 available devices"):
        float32_args(path, "--dp-size", "3", "--disable-radix-cache").validate(device_count=8)
    capped = float32_args(
        path, "--dp-size", "4", "--disable-radix-cache", "--ep-dispatch", "all_to_all",
        "--ep-capacity-factor", "1",
    )  # fmt: skip
    assert any("not exact" in w for w in capped.validate())
    with pytest.raises(ServerArgsError, match="--ep-dispatch"):  # nothing to dispatch
        float32_args(path, "--ep-dispatch", "all_to_all").validate()
    with pytest.raises(ServerArgsError, match="--dp-size must be >= 1"):
        float32_args(path, "--dp-size", "0", "--disable-radix-cache").validate()
