"""The unified server's prefix cache on a DP mesh (issue 36 item 5): one radix cache per
rank (`DPPrefixStore`), requests sent to the rank caching their longest prefix
(`choose_rank_for_prefix`), prompts prefilled from the end of the hit
(`serving.decode.dp_prefix.DPPrefixPrefill`).

The engine runs the two-layer decode model on a 2-rank `("dp",)` mesh. Oracle: the
single-device `ReferenceGenerator`; greedy tokens must be equal exactly, log-probs
within 1e-5 (a row prefilled from a cached prefix, or batched with others, may round
differently in the last float32 bits on XLA:CPU; far below log-probs of order 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.decode_model import INDEX_K, P, two_layer_model

from cpkv_jax.cache.radix import RadixCache
from cpkv_jax.decode_mesh import (
    DPPoolLayout,
    choose_rank,
    choose_rank_for_prefix,
    init_dp_pool,
)
from cpkv_jax.errors import CacheCapacityError
from cpkv_jax.host_cache.pool import HostPools
from cpkv_jax.kv_pool import PoolLayout
from cpkv_jax.kv_store import DevicePool, DPPrefixStore
from cpkv_jax.lane_allocator import OwnerLaneAllocator
from cpkv_jax.mesh import make_dp_mesh
from serving.decode.dp_prefix import DPPrefixPrefill
from serving.decode.engine import DecodeEngine
from serving.engine.api import GenerateRequest, SamplingParams
from serving.prefill.host_cache import HostCacheIO, PoolTarget

DP = 2
LP_TOL = 1e-5  # see the module docstring


# ---- the rank policy and the cache's read-only peek (pure host code) -----------------
def test_choose_rank_for_prefix_prefers_the_cached_prefix_within_the_row_slack():
    # Rank 1 caches 3 pages of the prompt: it wins although rank 0 has more free pages.
    assert choose_rank_for_prefix([9, 5], [0, 3], [0, 0], 6, 4) == 1
    # Its cached pages count toward the need: 3 free + 3 cached cover 6, 3 + 0 would not.
    assert choose_rank_for_prefix([2, 3], [0, 3], [0, 0], 6, 4) == 1
    assert choose_rank_for_prefix([3, 2], [0, 3], [0, 0], 6, 4) is None
    # More than PREFIX_ROW_SLACK (2) rows beyond the least busy rank: its cache no longer
    # draws requests; the most free pages decide.
    assert choose_rank_for_prefix([9, 9], [0, 3], [0, 3], 4, 8) == 0
    assert choose_rank_for_prefix([9, 9], [0, 3], [0, 2], 4, 8) == 1
    assert choose_rank_for_prefix([9, 9], [0, 3], [0, 3], 4, 8, row_slack=3) == 1
    # A full rank (rows) is no candidate, and the slack counts from the least busy
    # rank that could take it.
    assert choose_rank_for_prefix([9, 9, 9], [3, 0, 0], [4, 0, 1], 2, 4) == 1
    assert choose_rank_for_prefix([9, 9, 9], [3, 0, 0], [3, 4, 4], 2, 4) == 0
    # Host copies (a host cache per rank) draw a request after device hits, within the
    # same slack, and do not count toward the fit (they need device pages back).
    assert choose_rank_for_prefix([9, 9], [0, 0], [0, 0], 4, 4, host_pages=[0, 3]) == 1
    assert choose_rank_for_prefix([9, 9], [1, 0], [0, 0], 4, 4, host_pages=[0, 3]) == 0
    assert choose_rank_for_prefix([9, 9], [0, 0], [0, 3], 4, 8, host_pages=[0, 3]) == 0
    assert choose_rank_for_prefix([9, 3], [0, 0], [0, 0], 4, 4, host_pages=[0, 3]) == 0
    # Nothing cached: exactly `choose_rank`, ties round robin from `first`.
    rng = np.random.default_rng(0)
    for _ in range(200):
        free = rng.integers(0, 6, 4).tolist()
        rows = rng.integers(0, 3, 4).tolist()
        need, first = int(rng.integers(1, 5)), int(rng.integers(0, 4))
        assert choose_rank_for_prefix(free, [0] * 4, rows, need, 2, first) == choose_rank(
            free, rows, need, 2, first
        )


def test_peek_prefix_is_read_only_and_counts_unlocked_pages():
    cache = RadixCache(OwnerLaneAllocator(1, 12), 4)
    rng = np.random.default_rng(1)
    a = rng.integers(3, 99, 18)
    pages = cache.allocator.allocate(np.arange(4))
    cache.insert(a[:16], pages)
    b = np.concatenate([a[:8], rng.integers(100, 199, 9)])  # shares 2 pages with a
    match = cache.match_prefix(b)
    cache.inc_lock_ref(match.node)  # splits a's edge after 2 pages and locks them
    before = cache.pretty()
    assert cache.peek_prefix(a) == (4, 2, 0)  # 4 cached, the 2 past the split unlocked
    assert cache.peek_prefix(b) == (2, 0, 0)
    assert cache.peek_prefix(a[:7]) == (1, 0, 0)  # only whole pages of the query
    assert cache.peek_prefix(rng.integers(200, 299, 9)) == (0, 0, 0)
    assert cache.pretty() == before  # no split, no access time
    cache.check_invariants()


def test_dp_prefix_store_admits_holds_releases_and_evicts():
    store = DPPrefixStore(None, DPPoolLayout(DP, 6, 4))  # host-only: 5 usable pages per rank
    rng = np.random.default_rng(2)
    a = rng.integers(3, 99, 10)  # 2 whole pages + 2 tokens
    pages, hold = store.admit(1, a, 4)
    assert hold.own_from == 0 and (pages // 6 == 1).all()  # all on rank 1, global ids
    pages = store.hold_prompt(hold, a, pages)
    assert store.cached_pages_per_rank() == (0, 2) and hold.own_from == 2
    # A second request with the same first page: a 1-page hit, locked while it runs.
    b = np.concatenate([a[:5], rng.integers(100, 199, 4)])
    assert store.peek(1, b) == (1, 1, 0)  # 1 free page; rank 1's cache is locked
    store.release(hold, pages)
    assert store.num_free_pages_per_rank == (5, 3)
    assert store.peek(1, b) == (1, 3 + 2 - 1, 0)  # 2 cached pages evictable, 1 is its hit
    pages_b, hold_b = store.admit(1, b, 5)  # needs 4 pages beyond its hit: evicts 1
    assert hold_b.own_from == 1 and pages_b[0] == pages[0]
    assert store.num_free_pages_per_rank == (5, 0)
    with pytest.raises(CacheCapacityError):  # all or nothing: rank 1 is full
        store.admit(1, a, 2)
    assert store.caches[1].protected_size() == 4  # the failed admission unlocked its hit
    store.release(hold_b, pages_b)  # ended before its prefill: nothing more cached
    assert store.cached_pages_per_rank() == (0, 1)
    # Pages without the cache (the warm-up probe's), from either rank.
    extra = store.allocate_pages(5, 1)  # evicts the last cached page
    store.free_pages(np.concatenate([extra, store.allocate_pages(2, 0)]))
    store.reset_caches()
    assert store.num_free_pages_per_rank == (5, 5)
    for cache in store.caches:
        cache.check_invariants()


# ---- the engine on a DP2 mesh --------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return two_layer_model()


def make_engine(
    tiny, pages_per_rank: int, max_running: int = 4, chunk: int | None = None
) -> DecodeEngine:
    cfg, model, _ = tiny
    mesh = make_dp_mesh(DP, jax.devices())
    layout = DPPoolLayout(DP, pages_per_rank, P)
    store = DPPrefixStore(init_dp_pool(cfg, layout, mesh, jnp.float32, INDEX_K), layout)
    return DecodeEngine(
        cfg=cfg, model=model, kv=store, page_size=P, index_k_dtype=INDEX_K, mode="null",
        intake=DPPrefixPrefill(store, chunk), max_running_requests=max_running, mesh=mesh,
    )  # fmt: skip


def run(engine: DecodeEngine, waves: list[list[GenerateRequest]], max_steps: int = 300):
    """Each wave added at once after the last one finished; tokens, log-probs and the
    final chunks by request."""
    toks: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    final = {}
    for wave in waves:
        for r in wave:
            engine.add(r)
        for _ in range(max_steps):
            if not engine.has_work():
                break
            for c in engine.step():
                toks.setdefault(c.rid, []).extend(c.token_ids)
                lps.setdefault(c.rid, []).extend(c.logprobs or ())
                if c.finished:
                    final[c.rid] = c
        else:
            raise AssertionError("the engine did not finish the wave")
    return toks, lps, final


def req(rid: str, ids, new: int) -> GenerateRequest:
    return GenerateRequest(
        rid, tuple(int(t) for t in ids), SamplingParams(max_new_tokens=new), return_logprob=True
    )


def check(tiny, reqs, toks, lps, final) -> None:
    _, _, ref = tiny
    for r in reqs:
        assert final[r.rid].error is None, final[r.rid].error
        want = ref.generate(r.input_ids, r.sampling.max_new_tokens)
        assert toks[r.rid] == want.output_ids, r.rid
        np.testing.assert_allclose(lps[r.rid], want.output_logprobs, atol=LP_TOL, rtol=0)


def test_shared_prefixes_hit_their_rank_and_equal_the_reference(tiny):
    """A system prompt of 2 pages computed once per rank, then reused: each later
    request goes to a rank caching it and prefills only its own part; the outputs are
    the reference's. Then a cache fills its rank and evicts."""
    cfg = tiny[0]
    engine = make_engine(tiny, pages_per_rank=8)
    store = engine.kv
    rng = np.random.default_rng(3)
    system = rng.integers(3, cfg.vocab_size, 2 * P)

    def user(i: int, n: int) -> GenerateRequest:
        return req(f"u{i}", np.concatenate([system, rng.integers(3, cfg.vocab_size, n)]), 4)

    first = [user(0, 5), user(1, 9)]  # one per rank, both compute the system prompt
    later = [user(2, 3), user(3, 12), user(4, 7)]
    toks, lps, final = run(engine, [first, later])
    check(tiny, first + later, toks, lps, final)
    assert engine.admitted_per_rank == [3, 2] or engine.admitted_per_rank == [2, 3]
    assert [final[r.rid].meta["cached_tokens"] for r in first] == [0, 0]
    assert [final[r.rid].meta["cached_tokens"] for r in later] == [2 * P] * 3
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == 3 * 2 * P
    assert stats.kv_pages_cached == (2, 2)  # the system prompt on each rank
    assert stats.kv_pages_free == tuple(  # nothing locked once every request ended
        7 - c for c in stats.kv_pages_cached
    )
    # Fresh prompts of 5 pages each evict the least recently used pages.
    fresh = [req(f"f{i}", rng.integers(3, cfg.vocab_size, 4 * P + 3), 6) for i in range(3)]
    toks, lps, final = run(engine, [fresh[:2], fresh[2:]])
    check(tiny, fresh, toks, lps, final)
    for cache in store.caches:
        cache.check_invariants()
        assert cache.protected_size() == 0
    store.reset_caches()
    assert engine.stats().kv_pages_free == (7, 7)


def test_a_failed_prefill_or_an_abort_loses_nothing(tiny, monkeypatch):
    """A prefill step that raises fails its requests alone: their own pages come back and
    their cached prefix stays cached, unlocked; an abort while decoding does the same;
    the next requests still equal the reference."""
    cfg = tiny[0]
    engine = make_engine(tiny, pages_per_rank=8)
    store = engine.kv
    rng = np.random.default_rng(4)
    prefix = rng.integers(3, cfg.vocab_size, P)
    a = req("a", np.concatenate([prefix, rng.integers(3, cfg.vocab_size, 6)]), 3)
    run(engine, [[a]])
    real = engine.steps.prefill_many
    calls = []

    def failing(*args, **kw):
        calls.append(kw or args[1:])
        raise RuntimeError("injected prefill failure")

    monkeypatch.setattr(engine.steps, "prefill_many", failing)
    b = req("b", np.concatenate([prefix, rng.integers(3, cfg.vocab_size, 9)]), 3)
    _, _, final = run(engine, [[b]])
    assert final["b"].finish_reason == "error" and "injected" in final["b"].error
    assert calls and list(calls[0][0]) == [P]  # it would have prefilled from its hit
    monkeypatch.setattr(engine.steps, "prefill_many", real)
    assert sum(store.cached_pages_per_rank()) == 1  # a's whole page; none of b's
    assert all(c.protected_size() == 0 for c in store.caches)
    c = req("c", np.concatenate([prefix, rng.integers(3, cfg.vocab_size, 4)]), 40)
    engine.add(c)
    for _ in range(3):
        engine.step()
    engine.abort("c")
    engine.step()
    assert all(cache.protected_size() == 0 for cache in store.caches)
    d = req("d", np.concatenate([prefix, rng.integers(3, cfg.vocab_size, 2)]), 4)
    toks, lps, final = run(engine, [[d]])
    check(tiny, [d], toks, lps, final)
    assert final["d"].meta["cached_tokens"] == P
    store.reset_caches()
    assert engine.stats().kv_pages_free == (7, 7)


def test_chunked_prefill_lets_running_requests_decode_between_chunks(tiny):
    """`--chunked-prefill-size 16`: a 83-token prompt is prefilled over 6 steps, and the
    request already decoding gets a token in every one of them; a later request sharing
    its first 3 pages prefills only the rest, in chunks from its hit; an abort between
    two chunks gives everything back. Outputs equal the reference; every step shape is
    one `reachable_shapes` enumerates (prefill buckets of one chunk at most)."""
    cfg = tiny[0]
    engine = make_engine(tiny, pages_per_rank=10, chunk=P)
    store = engine.kv
    rng = np.random.default_rng(5)
    a = req("a", rng.integers(3, cfg.vocab_size, 8), 12)
    long_prompt = rng.integers(3, cfg.vocab_size, 5 * P + 3)
    b = req("b", long_prompt, 4)
    engine.add(a)
    toks: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    final = {}

    def step() -> None:
        for c in engine.step():
            toks.setdefault(c.rid, []).extend(c.token_ids)
            lps.setdefault(c.rid, []).extend(c.logprobs or ())
            if c.finished:
                final[c.rid] = c

    while not toks.get("a"):
        step()
    engine.add(b)
    while not toks.get("b"):  # b's chunks: a decodes between every two
        before = len(toks["a"])
        step()
        assert len(toks["a"]) == before + 1, "a running request waited for a whole prompt"
    while engine.has_work():
        step()
    assert engine.intake.prefill_chunk == P
    c = req("c", np.concatenate([long_prompt[: 3 * P], rng.integers(3, cfg.vocab_size, 20)]), 3)
    more = run(engine, [[c]])
    for got, new in zip((toks, lps, final), more, strict=True):
        got.update(new)
    check(tiny, [a, b, c], toks, lps, final)
    assert final["c"].meta["cached_tokens"] == 3 * P
    assert max(s[2] for s in engine.step_shapes if s[2] > 1) == P  # one chunk's bucket
    assert engine.step_shapes <= engine.reachable_shapes()
    d = req("d", rng.integers(3, cfg.vocab_size, 4 * P), 3)
    engine.add(d)
    engine.step()
    engine.step()
    held = engine.intake.lookup("d")  # two chunks in
    assert held is not None and held.prefill_from == 2 * P
    engine.abort("d")
    engine.step()
    assert not engine.has_work()
    assert all(cache.protected_size() == 0 for cache in store.caches)
    store.reset_caches()
    assert engine.stats().kv_pages_free == (9, 9)


def scored(rid: str, ids, new: int, start: int, top: int = 3) -> GenerateRequest:
    return GenerateRequest(
        rid,
        tuple(int(t) for t in ids),
        SamplingParams(max_new_tokens=new),
        return_logprob=True,
        top_logprobs=top,
        prompt_logprobs_from=start,
    )


def test_prompt_log_probs_on_the_dp_mesh_are_the_teacher_forced_reference(tiny):
    """Prompt log-probs (`echo` + `logprobs`, `logprob_start_len`) on the DP2 engine,
    prefilled in chunks of one page by the scoring twins of its prefill steps: every
    scored prompt token's log-prob and best alternatives equal the single-device
    reference's teacher-forced float64 log-softmax within 1e-4 (float32 logits of
    another program), and its greedy tokens the reference's. The prompt is cached on its
    rank by an earlier request: a request scored from token 0 takes none of it (the
    cached tokens' hidden states are gone); one scored from `3 * P + 1` takes the whole
    pages before the token ahead of its start. A scored and a plain request share one
    step (one per rank), so the scores must land on the scored one's row."""
    cfg, _, ref = tiny
    engine = make_engine(tiny, pages_per_rank=10, chunk=P)
    store = engine.kv
    rng = np.random.default_rng(11)
    prompt = rng.integers(3, cfg.vocab_size, 4 * P + 5)
    want, want_top = ref.prompt_logprobs(prompt.tolist(), top_n=3)
    start = 3 * P + 1
    plain = req("plain", prompt, 3)
    whole = scored("whole", prompt, 3, 0)
    tail = scored("tail", prompt, 2, start)
    other = req("other", rng.integers(3, cfg.vocab_size, 3 * P + 2), 3)
    chunks: dict[str, list] = {}
    for wave in ([plain], [whole, other], [tail]):
        for r in wave:
            engine.add(r)
        while engine.has_work():
            for c in engine.step():
                chunks.setdefault(c.rid, []).append(c)
    for r in (plain, whole, tail, other):
        final = chunks[r.rid][-1]
        assert final.finished and final.error is None, final.error
        got = [t for c in chunks[r.rid] for t in c.token_ids]
        assert got == ref.generate(r.input_ids, r.sampling.max_new_tokens).output_ids, r.rid
        prompt_lps = [c.prompt_logprobs for c in chunks[r.rid] if c.prompt_logprobs is not None]
        assert len(prompt_lps) == (r.prompt_logprobs_from is not None), r.rid
    assert chunks["whole"][-1].meta["cached_tokens"] == 0
    assert chunks["tail"][-1].meta["cached_tokens"] == 3 * P
    for rid, first in (("whole", 0), ("tail", start)):
        (head,) = [c for c in chunks[rid] if c.prompt_logprobs is not None]
        lps, tops = head.prompt_logprobs, head.prompt_top_logprobs
        assert len(lps) == len(prompt) - first and len(tops) == len(lps)
        if first == 0:
            assert lps[0] is None and tops[0] == ()
            lps, tops = lps[1:], tops[1:]
        from_ = max(first - 1, 0)
        np.testing.assert_allclose(lps, want[from_:], rtol=0, atol=1e-4)
        for p, (alts, ref_alts) in enumerate(zip(tops, want_top[from_:], strict=True)):
            assert [t for t, _ in alts] == [t for t, _ in ref_alts], (rid, p)
            np.testing.assert_allclose(
                [v for _, v in alts], [v for _, v in ref_alts], rtol=0, atol=1e-4
            )
    assert all(cache.protected_size() == 0 for cache in store.caches)
    store.reset_caches()
    assert engine.stats().kv_pages_free == (9, 9)
    # `--warmup-prompt-scoring` on the mesh: a job for each reachable prefill shape whose
    # scoring twin did not compile above (not run here: the DP step's compiles are slow).
    prefills = {s for s in engine.reachable_shapes() if s[2] > 1}
    done = engine.steps.compiled_score_shapes & prefills
    assert done  # the scoring steps above ran reachable shapes
    assert sorted(j.label for j in engine.score_compile_jobs()) == sorted(
        f"prompt-scoring step {s}" for s in prefills - done
    )


def make_host_engine(tiny, pages_per_rank: int) -> tuple[DecodeEngine, list[HostCacheIO]]:
    """`make_engine` with a host cache per rank (`--enable-hierarchical-cache`,
    write-through: every cached page is copied to its rank's host pool at once)."""
    cfg, model, _ = tiny
    mesh = make_dp_mesh(DP, jax.devices())
    layout = DPPoolLayout(DP, pages_per_rank, P)
    device = DevicePool(init_dp_pool(cfg, layout, mesh, jnp.float32, INDEX_K))
    lanes = PoolLayout(DP, True, pages_per_rank, P)
    pools = HostPools.create(device.pool, cfg.full_indexer_layers, lanes, "layer_first")
    ios = [HostCacheIO(PoolTarget(device, lanes), pools, rank=r) for r in range(DP)]
    store = DPPrefixStore(device, layout, ios, "write_through")
    engine = DecodeEngine(
        cfg=cfg, model=model, kv=store, page_size=P, index_k_dtype=INDEX_K, mode="null",
        intake=DPPrefixPrefill(store, None, {"layout": "layer_first"}),
        max_running_requests=4, mesh=mesh,
    )  # fmt: skip
    return engine, ios


def test_a_host_cache_per_rank_brings_evicted_prefixes_back(tiny, monkeypatch):
    """`--enable-hierarchical-cache` on the DP2 engine: a prompt's pages are copied to
    its rank's host pool, evicted from the device by two prompts that fill both ranks,
    and a later request sharing them goes to that rank (its host copies draw it: no
    device hit anywhere) and loads them back into the rank's shard instead of
    prefilling them. Outputs equal the reference; a load-back whose copy fails makes
    the request recompute, nothing lost; after the copies close every device and host
    page is free."""
    cfg = tiny[0]
    engine, ios = make_host_engine(tiny, pages_per_rank=10)  # 9 usable pages per rank
    store = engine.kv
    rng = np.random.default_rng(13)
    shared = rng.integers(3, cfg.vocab_size, 3 * P)

    def settle() -> None:  # the backups copied and acknowledged
        for io in ios:
            io.wait_backups()
        store.sync_host()

    a = req("a", np.concatenate([shared, rng.integers(3, cfg.vocab_size, 2)]), 3)
    reqs = [a]
    toks, lps, final = run(engine, [[a]])
    rank_a = int(np.argmax(store.cached_pages_per_rank()))
    assert store.cached_pages_per_rank()[rank_a] == 3
    settle()
    fill = [req(f"f{i}", rng.integers(3, cfg.vocab_size, 8 * P + 5), 3) for i in range(2)]
    more = run(engine, [fill])  # 9 pages each: every rank evicts what it caches
    settle()
    b = req("b", np.concatenate([shared, rng.integers(3, cfg.vocab_size, 7)]), 3)
    more2 = run(engine, [[b]])
    for got, new in zip((toks, lps, final), more, strict=True):
        got.update(new)
    for got, new in zip((toks, lps, final), more2, strict=True):
        got.update(new)
    reqs += [*fill, b]
    check(tiny, reqs, toks, lps, final)
    assert final["b"].meta["cached_tokens"] == 3 * P
    assert final["b"].meta["cached_tokens_host"] == 3 * P
    info = engine.intake.hicache_info()
    assert info["load_backs"] == 1 and info["host_hit_tokens"] == 3 * P
    assert info["backups_done"] >= 3 and len(info["host_pages_used_per_lane"]) == DP
    # A failed copy: the request recomputes its prompt (nothing cached is lost).
    settle()
    fill2 = [req(f"g{i}", rng.integers(3, cfg.vocab_size, 8 * P + 5), 3) for i in range(2)]
    run(engine, [fill2])
    settle()
    for io in ios:
        monkeypatch.setattr(io, "load", lambda job: False)
    c = req("c", np.concatenate([shared, rng.integers(3, cfg.vocab_size, 4)]), 3)
    toks, lps, final = run(engine, [[c]])
    check(tiny, [c], toks, lps, final)
    assert final["c"].meta["cached_tokens"] == 0
    assert all(cache.protected_size() == 0 for cache in store.caches)
    for io in ios:
        io.close()
    store.reset_caches()
    assert engine.stats().kv_pages_free == (9, 9)
    assert all(a.num_free == a.capacity for io in ios for a in io.host_allocators)
