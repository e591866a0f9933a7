"""The prefill scheduler with a host (L2) KV cache (`HiRadixCache` + `HostCacheIO`).

A CP=8 shared-KV runner with a small device pool and LPF host pools (Pallas kernels,
interpreted on CPU): a long prompt evicted from the device comes back as a host hit,
is loaded back and gives the first run's logits (and the single-device reference's); a
host hit that cannot be loaded back (no free + evictable room in an owner lane, SPEC
S10) or whose copy fails is recomputed, with the same logits; a full backup queue drops
and counts jobs without blocking. Every device and host lane returns to its initial free
count at the end, and the cache's invariants hold throughout.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import types
from collections import Counter

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.cp_reference import reference

from cpkv_jax.cache.hiradix import HiRadixCache
from cpkv_jax.cache.radix import cache_finished_request
from cpkv_jax.config import CPConfig, ModelConfig
from cpkv_jax.cp_prefill import CPPrefillRunner
from cpkv_jax.host_cache import DevicePoolLostError, HostPool, HostPools
from cpkv_jax.kv_pool import PoolLayout, cp_pool_shapes, init_cp_pool
from cpkv_jax.kv_store import DevicePool
from cpkv_jax.lane_allocator import OwnerLaneAllocator, RequestPageTable
from cpkv_jax.mesh import make_cp_mesh
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.pallas import lpf_copy
from cpkv_jax.tools.tiny_config import tiny_config_dict
from serving.prefill.adder import CPSharedKVLimits
from serving.prefill.host_cache import HostCacheIO
from serving.prefill.scheduler import CPRunnerExecutor, PrefillScheduler

# Among the longer files of the suite: scheduled early, longest first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=22)  # on 2 workers, 2026-12-05

PAGE = 16
CP = 8
PAGES_PER_RANK = 4  # 3 usable device pages per lane: 24 pages, 384 tokens in all
CHUNK = 64


@functools.cache
def _model():
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    return cfg, CausalLM(cfg, rngs=nnx.Rngs(5))


@pytest.fixture(scope="module")
def runner():
    """One runner for the module (its compiled steps are reused); each test leaves every
    lane as it found it."""
    cfg, model = _model()
    cp = CPConfig(cp_size=CP, shared_kv=True, page_size=PAGE)
    return CPPrefillRunner(
        cfg, model, make_cp_mesh(CP), cp, pages_per_rank=PAGES_PER_RANK, index_k_dtype="float32"
    )


def _prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 300, n).astype(np.int32)


def _hicache(runner, policy="write_through", layout="layer_page_first", hold=False, **io_kw):
    io = HostCacheIO.create(runner, layout, ratio=4.0, **io_kw)
    cache = HiRadixCache(runner.allocator, PAGE, io.host_allocators, write_policy=policy)
    sched = PrefillScheduler(
        cache=cache,
        executor=CPRunnerExecutor(runner),
        max_prefill_tokens=4096,
        chunked_prefill_size=CHUNK,
        cp_limits=CPSharedKVLimits(shared_kv=True),
        host_io=io,
        hold_finished=hold,
    )
    return sched, cache, io


def _run(sched: PrefillScheduler, rid: str, ids: np.ndarray):
    sched.submit(rid, ids)
    (out,) = sched.run_until_idle()
    assert out.status == "finished"
    sched.sync_host_cache(wait=True)
    sched.cache.check_invariants(request_pages=[])
    return out


def _long_prompt_on_host(sched: PrefillScheduler, seed: int):
    """Prefill a long prompt (seed `seed`) on a write-through scheduler and evict every
    device page to host. Returns the device and host free counts from before, the
    prompt and its reference logits."""
    cfg, model = _model()
    cache = sched.cache
    dev0 = cache.allocator.num_free_per_lane().tolist()
    host0 = cache.host_free_per_lane().tolist()
    long = _prompt(8 * PAGE + 3, seed)
    want, _ = reference(cfg, model, long)
    _run(sched, "a", long)
    cache.evict(np.full((CP,), PAGES_PER_RANK))
    assert cache.match_prefix(long[:-1]).host_num_tokens == 8 * PAGE
    return dev0, host0, long, want


def _close_and_check_no_leaks(sched, cache, io, dev0, host0):
    sched.sync_host_cache(wait=True)
    sched.close()
    assert not cache.in_flight_jobs()
    cache.check_invariants(request_pages=[])
    cache.reset()
    cache.check_invariants(request_pages=[])
    assert cache.allocator.num_free_per_lane().tolist() == dev0
    assert cache.host_free_per_lane().tolist() == host0
    assert io.pages_used_per_lane() == [0] * CP


def test_evicted_prompt_comes_back_from_host(runner):
    cfg, model = _model()
    sched, cache, io = _hicache(runner)
    dev0 = runner.allocator.num_free_per_lane().tolist()
    host0 = cache.host_free_per_lane().tolist()
    long = _prompt(8 * PAGE + 3, 1)
    first = _run(sched, "a", long)
    assert io.stats.backups_done >= 1 and io.stats.backup_bytes > 0
    for i in range(2):  # enough other prompts to push `long` off the device
        _run(sched, f"other{i}", _prompt(20 * PAGE + 5, 10 + i))
    m = cache.match_prefix(long[:-1])
    assert m.host_num_tokens > 0, cache.pretty()
    again = _run(sched, "a", long)
    assert io.stats.host_hit_tokens >= m.host_num_tokens
    assert io.stats.load_backs >= 1 and io.stats.load_back_bytes > 0
    assert again.cached_tokens == 8 * PAGE  # device + loaded-back host hits (S7)
    assert again.host_cached_tokens == m.host_num_tokens
    chex.assert_trees_all_close(again.last_logits, first.last_logits, rtol=1e-5, atol=1e-5)
    want, _ = reference(cfg, model, long)
    chex.assert_trees_all_close(again.last_logits, want, rtol=1e-5, atol=1e-5)
    snap = io.snapshot(cache)
    assert snap["host_pages_total_per_lane"] == [a.capacity for a in io.host_allocators]
    assert sum(snap["host_pages_used_per_lane"]) > 0
    _close_and_check_no_leaks(sched, cache, io, dev0, host0)


def test_host_hit_without_room_or_with_a_failed_copy_is_recomputed(runner, monkeypatch):
    sched, cache, io = _hicache(runner)
    alloc = runner.allocator
    dev0, host0, long, want = _long_prompt_on_host(sched, 2)

    # S10: lanes 4..7 have no free or evictable page, so the host hit is not loaded
    # back; the request's first chunk (pages 0-3, lanes 0-3) still fits: it recomputes.
    free = alloc.num_free_per_lane()
    logical = np.concatenate([np.arange(lane, lane + CP * free[lane], CP) for lane in range(4, 8)])
    blocker = alloc.allocate(logical)
    sched.submit("skip", long)
    sched.step()
    assert io.stats.skipped_load_backs == 1 and io.stats.load_backs == 0
    assert sched.chunked is not None and sched.chunked.cached_tokens == 0
    alloc.free(logical % CP, blocker)
    (out,) = sched.run_until_idle()
    assert out.cached_tokens == 0
    chex.assert_trees_all_close(out.last_logits, want, rtol=1e-5, atol=1e-5)
    sched.sync_host_cache(wait=True)
    cache.check_invariants(request_pages=[])

    # A load-back whose copy fails: the job is abandoned and the request recomputes.
    cache.evict(np.full((CP,), PAGES_PER_RANK))
    monkeypatch.setattr(
        "serving.prefill.host_cache.load_all_layers",
        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected copy failure")),
    )
    out = _run(sched, "fail", long)
    assert io.stats.load_back_failures == 1 and out.cached_tokens == 0
    chex.assert_trees_all_close(out.last_logits, want, rtol=1e-5, atol=1e-5)
    _close_and_check_no_leaks(sched, cache, io, dev0, host0)


def _run_held(sched: PrefillScheduler, rid: str, ids: np.ndarray):
    """`_run` on a `hold_finished` scheduler: the hold ends at once."""
    sched.submit(rid, ids)
    (out,) = sched.run_until_idle()
    assert out.status == "finished"
    sched.release_held(rid)
    sched.sync_host_cache(wait=True)
    sched.cache.check_invariants(request_pages=[])
    return out


def _deleted_buffers(pool) -> list[int]:
    # Shard by shard too: `jax.Array.is_deleted` misses one donated shard of a sharded leaf.
    return [
        i
        for i, leaf in enumerate(jax.tree.leaves(pool))
        if leaf.is_deleted() or any(s.data.is_deleted() for s in leaf.addressable_shards)
    ]


def test_held_request_crossing_a_write_back_in_flight_keeps_its_pages(runner):
    """Write-back with the real backup worker (XLA copies): A's prefix is evicted and
    its backup is still in flight (the worker waits at a gate before it takes the pool
    lock, so steps run meanwhile) when B, which shares the prefix and so recomputed it,
    finishes held. B's whole pages go back into the cache's node (`insert` adopts it),
    its table points at them, nothing asserts; the backup then lands A's KV on host."""
    cfg, model = _model()
    sched, cache, io = _hicache(runner, "write_back", "layer_first", hold=True)
    gate = threading.Event()
    copy = io._backup

    def gated(job):
        gate.wait(timeout=120)
        return copy(job)

    io._backup = gated
    dev0 = runner.allocator.num_free_per_lane().tolist()
    host0 = cache.host_free_per_lane().tolist()
    prefix = _prompt(8 * PAGE, 30)
    a, b, c = (np.concatenate([prefix, _prompt(3, seed)]) for seed in (31, 32, 33))
    try:
        _run_held(sched, "a", a)
        cache.evict(np.full((CP,), PAGES_PER_RANK))  # write-back: a job owns A's pages
        sched.sync_host_cache()  # the worker takes the job and waits at the gate
        (job,) = cache.in_flight_jobs()
        assert job.frees_device and job.num_pages == 8
        m = cache.match_prefix(b[:-1])
        assert (m.num_tokens, m.host_num_tokens) == (0, 0)  # in transit: B recomputes
        sched.submit("b", b)
        (out,) = sched.run_until_idle()  # B finishes held
        assert cache.in_flight_jobs() == [job]  # the backup was in flight throughout
        assert out.status == "finished" and out.cached_tokens == 0
        want, _ = reference(cfg, model, b)
        chex.assert_trees_all_close(out.last_logits, want, rtol=1e-5, atol=1e-5)
        held = out.table.local_pages()
        cached = cache.match_prefix(b[: 8 * PAGE])
        assert cached.num_tokens == 8 * PAGE and np.array_equal(cached.local_pages, held[:8])
        assert not np.isin(held, job.device_pages).any()  # the job's pages stay its own
        cache.check_invariants(request_pages=[(np.asarray([8 % CP]), held[8:])])
    finally:
        gate.set()
    sched.sync_host_cache(wait=True)
    assert io.stats.backups_done == 1 and not cache.in_flight_jobs()
    assert cache.match_prefix(b[: 8 * PAGE]).node.state == "device+host"
    sched.release_held("b")
    cache.check_invariants(request_pages=[])
    # B's pages serve the prefix from the device; A's backup serves it from host.
    want, _ = reference(cfg, model, c)
    out = _run_held(sched, "c", c)
    assert out.cached_tokens == 8 * PAGE and out.host_cached_tokens == 0
    chex.assert_trees_all_close(out.last_logits, want, rtol=1e-5, atol=1e-5)
    cache.evict(np.full((CP,), PAGES_PER_RANK))
    out = _run_held(sched, "c2", c)
    assert out.host_cached_tokens == 8 * PAGE
    chex.assert_trees_all_close(out.last_logits, want, rtol=1e-5, atol=1e-5)
    _close_and_check_no_leaks(sched, cache, io, dev0, host0)


def _fail_scatter_at_layer(monkeypatch, layer: int, *, consume: bool = False) -> None:
    """Every load's scatter into `layer` raises (the host read of each leaf comes right
    before its scatter and names the layer); `consume`: after the kernel donated its
    input and produced a result nobody gets back."""
    current = {}
    read, scatter = HostPool.read_pages, lpf_copy.lpf_to_lf

    def reading(self, kind, at, pages):
        current["layer"] = at
        return read(self, kind, at, pages)

    def scatter_or_fail(*args, **kwargs):
        if current.get("layer") != layer:
            return scatter(*args, **kwargs)
        if consume:
            scatter(*args, **kwargs)
        raise RuntimeError(f"injected scatter failure at layer {layer}")

    monkeypatch.setattr(HostPool, "read_pages", reading)
    monkeypatch.setattr(lpf_copy, "lpf_to_lf", scatter_or_fail)


def test_load_back_failing_after_the_first_layer_leaves_a_valid_pool(runner, monkeypatch):
    """A load-back whose scatter raises at layer 1, after layer 0's shards were donated
    and replaced: every pool leaf is still a live array, the request recomputes with
    the reference logits, and later steps and load-backs run on that pool."""
    sched, cache, io = _hicache(runner, layout="layer_first")
    dev0, host0, long, want = _long_prompt_on_host(sched, 3)
    _fail_scatter_at_layer(monkeypatch, 1)
    sched.submit("fail", long)
    batch = sched.schedule_batch()
    assert io.stats.load_back_failures == 1 and io.stats.load_backs == 0
    assert _deleted_buffers(runner.pool) == []
    monkeypatch.undo()
    outs = sched.finish_batch(batch, sched.executor.execute(batch.rows))
    (out,) = outs + sched.run_until_idle()
    assert out.cached_tokens == 0
    chex.assert_trees_all_close(out.last_logits, want, rtol=1e-5, atol=1e-5)
    sched.sync_host_cache(wait=True)
    cache.check_invariants(request_pages=[])
    cache.evict(np.full((CP,), PAGES_PER_RANK))
    out = _run(sched, "again", long)  # a load-back that works, on the same pool
    assert out.host_cached_tokens == 8 * PAGE
    chex.assert_trees_all_close(out.last_logits, want, rtol=1e-5, atol=1e-5)
    _close_and_check_no_leaks(sched, cache, io, dev0, host0)


def test_load_back_that_loses_a_donated_buffer_is_fatal(monkeypatch):
    """Host side and a bare CP=2 pool: a scatter that consumed its shard and then raised
    leaves a leaf with no buffer; `load` says so (`DevicePoolLostError`, naming it)
    instead of "recompute"."""
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    cp = 2
    layout = PoolLayout(cp, True, 4, PAGE)
    pool = init_cp_pool(cfg, layout, make_cp_mesh(cp), jnp.float32, "float32")
    fake_runner = types.SimpleNamespace(pool_cfg=cfg, layout=layout, kv=DevicePool(pool))
    io = HostCacheIO.create(fake_runner, "layer_first", ratio=2.0)
    cache = HiRadixCache(
        OwnerLaneAllocator(cp, 4), PAGE, io.host_allocators, write_policy="write_through"
    )
    tokens = _prompt(2 * PAGE, 7)
    table = RequestPageTable(cp)
    table.extend(cache.allocator, tokens.size, PAGE)
    cache_finished_request(cache, table, tokens, cache.root)
    cache.backup_done(*cache.take_backups())  # the host copy's bits do not matter here
    cache.evict(np.full((cp,), 4))
    job = cache.load_back(cache.plan_load_back(cache.match_prefix(tokens)))
    assert job is not None
    _fail_scatter_at_layer(monkeypatch, 1, consume=True)
    with pytest.raises(DevicePoolLostError, match=r"latent\[1\].*restart"):
        io.load(job)
    assert io.stats.load_back_failures == 0
    io.close()


class _ZeroExecutor:
    def execute(self, rows):
        return np.zeros((len(rows), 7), np.float32)


def test_full_backup_queue_drops_and_counts_without_blocking():
    """Host only: a worker that never runs, a queue of one; every further backup is
    dropped (acknowledged failed at once) and the scheduler keeps going."""
    cfg, _ = _model()
    page, cp, pages = 4, 2, 32
    layout = PoolLayout(cp, True, pages, page)
    pools = HostPools.create(
        cp_pool_shapes(cfg, layout, jnp.float32, "float32"),
        cfg.full_indexer_layers,
        layout,
        "layer_page_first",
    )
    fake_runner = types.SimpleNamespace(layout=layout, kv=DevicePool(None))
    io = HostCacheIO(fake_runner, pools, queue_size=1, start=False)
    alloc = OwnerLaneAllocator(cp, pages)
    cache = HiRadixCache(alloc, page, io.host_allocators, write_policy="write_through")
    sched = PrefillScheduler(
        cache=cache, executor=_ZeroExecutor(), max_prefill_tokens=10_000, host_io=io
    )
    dev0, host0 = alloc.num_free_per_lane().tolist(), cache.host_free_per_lane().tolist()
    for i in range(4):
        sched.submit(f"r{i}", _prompt(3 * page + 1, 20 + i))
        sched.run_until_idle()
        cache.check_invariants(request_pages=[])
    assert io.stats.dropped_backups == 3
    assert len(cache.in_flight_jobs()) == 1  # the one in the queue
    assert io.snapshot(cache)["backup_queue_depth"] == 1
    sched.close()  # never copied: acknowledged as failed
    assert io.stats.backups_failed == 1 and io.stats.backups_done == 0
    assert not cache.in_flight_jobs()
    cache.check_invariants(request_pages=[])
    cache.reset()
    assert alloc.num_free_per_lane().tolist() == dev0
    assert cache.host_free_per_lane().tolist() == host0
    # After close, new backups are dropped too (never block, never leak).
    sched.submit("late", _prompt(3 * page + 1, 99))
    sched.run_until_idle()
    assert io.stats.dropped_backups == 4 and not cache.in_flight_jobs()


class _FakeIO:
    """`HostCacheIO`'s scheduler interface without data: every third load fails,
    backups are acknowledged (done or failed) at random later drains."""

    def __init__(self, rng: np.random.Generator):
        from serving.prefill.host_cache import HostCacheStats

        self.rng = rng
        self.stats = HostCacheStats()
        self.pending: list = []

    def load(self, job) -> bool:
        ok = (self.stats.load_backs + self.stats.load_back_failures) % 3 != 1
        if ok:
            self.stats.load_backs += 1
        else:
            self.stats.load_back_failures += 1
        return ok

    def submit_backups(self, cache, jobs) -> None:
        self.pending.extend(jobs)

    def drain(self, cache) -> int:
        keep, n = [], 0
        for job in self.pending:
            if self.rng.random() < 0.5:
                keep.append(job)
                continue
            n += 1
            if self.rng.random() < 0.8:
                cache.backup_done(job)
            else:
                cache.backup_failed(job)
        self.pending = keep
        return n

    def wait_backups(self) -> None:
        pass

    def close(self) -> None:
        pass


class _SumExecutor:
    def __init__(self, cp: int):
        self.cp = cp

    def execute(self, rows):
        out = np.zeros((len(rows), 97), np.float32)
        for i, r in enumerate(rows):
            assert r.table.num_tokens == r.start + r.length
            assert np.array_equal(r.table.owners(), np.arange(r.table.num_pages) % self.cp)
            out[i, int(r.prompt.astype(np.int64).sum()) % 97] = 1.0
        return out


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_randomized_host_cache_scheduling_never_leaks(policy):
    """Host only: random prompts over shared prefixes, a small pool, random load and
    backup failures. Every request finishes with its own logits, the invariants hold
    after every step, and every device and host lane ends at its initial free count."""
    page, cp = 4, 2
    totals = Counter()
    for seed in range(4):
        rng = np.random.default_rng(seed)
        alloc = OwnerLaneAllocator(cp, 10)
        cache = HiRadixCache(alloc, page, 12, write_policy=policy)
        io = _FakeIO(rng)
        sched = PrefillScheduler(
            cache=cache,
            executor=_SumExecutor(cp),
            max_prefill_tokens=10_000,
            chunked_prefill_size=8,
            cp_limits=CPSharedKVLimits(shared_kv=True, bs_gt1=True),
            policy="lpm" if seed % 2 else "fcfs",
            host_io=io,
        )
        dev0, host0 = alloc.num_free_per_lane().tolist(), cache.host_free_per_lane().tolist()
        bases = [rng.integers(3, 90, 24) for _ in range(3)]
        prompts = {}
        for i in range(30):
            base = bases[int(rng.integers(3))][: int(rng.integers(0, 25))]
            p = np.concatenate([base, rng.integers(3, 90, int(rng.integers(1, 6)))])
            prompts[f"r{i}"] = p.astype(np.int32)
        done = {}
        queue = list(prompts)
        for _ in range(2000):
            while queue and len(sched.waiting) < 3:
                rid = queue.pop(0)
                sched.submit(rid, prompts[rid])
            if not sched.num_waiting and not queue:
                break
            for o in sched.step():
                done[o.rid] = o
            if rng.random() < 0.05 and sched.waiting:
                rid = sched.waiting[0].rid
                sched.abort(rid)
                queue.append(rid)
            own = []
            if sched.chunked is not None and sched.chunked.table is not None:
                r = sched.chunked
                local = r.table.local_pages()
                first = r.cached_tokens // page
                pos = np.arange(first, local.size, dtype=np.int64)
                own.append((pos % cp, local[first:]))
            cache.check_invariants(request_pages=own)
        assert set(done) == set(prompts)
        for rid, o in done.items():
            assert o.status == "finished"
            assert o.last_logits.argmax() == int(prompts[rid].astype(np.int64).sum()) % 97
        while io.pending:
            io.drain(cache)
        cache.check_invariants(request_pages=[])
        cache.reset()
        assert alloc.num_free_per_lane().tolist() == dev0
        assert cache.host_free_per_lane().tolist() == host0
        totals.update(dataclasses.asdict(io.stats))
    assert totals["load_backs"] and totals["load_back_failures"] and totals["host_hit_tokens"]
