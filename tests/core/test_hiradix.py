"""Hierarchical radix cache: device/host residency, write policies, device and host
eviction, host hits, SPEC S10 load-back planning (free + evictable), the S7 cached-token
count, copy-job acknowledgement and abortion, and a seeded randomized run that checks
every invariant after every step and that every lane returns to its initial free count."""

from __future__ import annotations

import numpy as np
import pytest

from cpkv_jax.cache.hiradix import BackupJob, HiRadixCache, LoadBackJob, load_host_hit
from cpkv_jax.cache.radix import alloc_with_evict, cache_finished_request, table_from_prefix
from cpkv_jax.errors import CacheCapacityError, ConfigError
from cpkv_jax.lane_allocator import OwnerLaneAllocator, RequestPageTable
from cpkv_jax.paging import owner_of_page


def _cache(cp=2, pages_per_lane=5, page_size=2, host=9, policy="write_through", **kw):
    return HiRadixCache(
        OwnerLaneAllocator(cp, pages_per_lane), page_size, host, write_policy=policy, **kw
    )


def _toks(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


def _cache_request(cache: HiRadixCache, tokens: np.ndarray) -> None:
    """A request that computed all of `tokens` itself, then finished."""
    table = RequestPageTable(cache.cp_size)
    table.extend(cache.allocator, tokens.size, cache.page_size)
    cache_finished_request(cache, table, tokens, cache.root)


def _ack_all(cache: HiRadixCache) -> None:
    for job in cache.take_backups():
        cache.backup_done(job)


# --- write policies ------------------------------------------------------------------


def test_write_through_backs_up_on_insert():
    cache = _cache()
    _cache_request(cache, _toks(0, 8))
    jobs = cache.take_backups()
    assert len(jobs) == 1 and not jobs[0].frees_device
    job = jobs[0]
    assert job.num_pages == 4 and job.lanes.tolist() == [0, 1, 0, 1]
    # Host pages come from the lane of each logical page (S4.5).
    assert cache.host_free_per_lane().tolist() == [6, 6]
    # The node is locked while the copy is in flight.
    assert cache.evictable_pages_per_lane().tolist() == [0, 0]
    cache.check_invariants()
    cache.backup_done(job)
    assert cache.evictable_pages_per_lane().tolist() == [2, 2]
    assert cache.host_size() == 8
    cache.check_invariants()
    with pytest.raises(ValueError, match="not an in-flight"):
        cache.backup_done(job)


def test_write_through_selective_waits_for_threshold():
    cache = _cache(policy="write_through_selective")
    tokens = _toks(0, 8)
    _cache_request(cache, tokens)
    assert cache.take_backups() == []
    # A second request reusing the prefix: hit count 2 reaches the default threshold.
    m = cache.match_prefix(tokens)
    cache.inc_lock_ref(m.node)
    cache_finished_request(cache, table_from_prefix(cache, m), tokens, m.node)
    jobs = cache.take_backups()
    assert len(jobs) == 1 and jobs[0].num_pages == 4
    cache.backup_done(jobs[0])
    cache.check_invariants()
    cache3 = _cache(policy="write_through_selective", write_through_threshold=3)
    _cache_request(cache3, tokens)
    _cache_request(cache3, tokens)  # a recomputed duplicate counts as a reuse too
    assert cache3.take_backups() == []
    _cache_request(cache3, tokens)
    assert len(cache3.take_backups()) == 1


def test_write_back_backs_up_only_on_eviction():
    cache = _cache(policy="write_back")
    _cache_request(cache, _toks(0, 8))
    _cache_request(cache, _toks(0, 8))
    assert cache.take_backups() == []
    free = cache.allocator.num_free_per_lane()
    freed = cache.evict(np.array([2, 2]))
    # The pages belong to the backup job until it is acknowledged.
    assert freed.tolist() == [0, 0]
    assert cache.allocator.num_free_per_lane().tolist() == free.tolist()
    (job,) = cache.take_backups()
    assert job.frees_device and job.num_pages == 4
    cache.check_invariants()
    assert cache.match_prefix(_toks(0, 8)).host_num_tokens == 0  # in transit: no hit
    cache.backup_done(job)
    assert cache.allocator.num_free_per_lane().tolist() == [4, 4]
    m = cache.match_prefix(_toks(0, 8))
    assert (m.num_tokens, m.host_num_tokens) == (0, 8)
    cache.check_invariants()


def test_write_back_failed_backup_drops_the_node():
    cache = _cache(policy="write_back")
    _cache_request(cache, _toks(0, 8))
    cache.evict(np.array([1, 1]))
    (job,) = cache.take_backups()
    assert job.num_pages == 2  # only the tail pages were needed
    cache.backup_failed(job)
    assert cache.allocator.num_free_per_lane().tolist() == [3, 3]
    assert cache.host_free_per_lane().tolist() == [8, 8]
    m = cache.match_prefix(_toks(0, 8))
    assert (m.num_tokens, m.host_num_tokens) == (4, 0)
    cache.check_invariants()


def test_bad_config():
    with pytest.raises(ConfigError, match="write policy"):
        _cache(policy="write_around")
    with pytest.raises(ConfigError, match="host allocators"):
        HiRadixCache(OwnerLaneAllocator(2, 4), 2, [])


# --- device eviction keeps host copies; host eviction; dropped backups ---------------


def test_device_eviction_keeps_host_copies():
    cache = _cache()
    _cache_request(cache, _toks(0, 8))
    _ack_all(cache)
    host = cache.match_prefix(_toks(0, 8))
    assert cache.evict(np.array([2, 2])).tolist() == [2, 2]
    assert cache.allocator.num_free_per_lane().tolist() == [4, 4]
    m = cache.match_prefix(_toks(0, 9))
    assert (m.num_tokens, m.host_num_tokens) == (0, 8)
    assert m.host_pages_per_lane.tolist() == [2, 2]
    assert m.host_node is not None and m.host_node.state == "host"
    assert cache.host_size() == 8
    assert cache.evictable_pages_per_lane().tolist() == [0, 0]
    cache.check_invariants()
    # Partial eviction splits: the head stays on device, the tail is host only.
    cache2 = _cache()
    _cache_request(cache2, _toks(0, 8))
    _ack_all(cache2)
    cache2.evict(np.array([1, 0]))  # tail page 3 (lane 1) goes, then page 2 (lane 0)
    m = cache2.match_prefix(_toks(0, 8))
    assert (m.num_tokens, m.host_num_tokens) == (4, 4)
    assert m.host_pages_per_lane.tolist() == [1, 1]
    assert host.num_tokens == 8
    cache2.check_invariants()


def test_peeks_count_device_pages_and_the_host_continuation_apart():
    """`peek_prefix` (a DP server comparing ranks) counts device pages apart from the
    host-only pages after them, as `match_prefix` splits them; it neither splits a node
    nor touches an access time."""
    cache = _cache()
    _cache_request(cache, _toks(0, 8))
    _ack_all(cache)
    cache.evict(np.array([1, 0]))  # pages 2 and 3 go to host only (no split yet)
    before = cache.pretty()
    assert cache.peek_prefix(_toks(0, 9)) == (2, 2, 2)  # 2 device pages, unlocked; 2 host
    assert cache.peek_prefix(_toks(0, 7)) == (2, 2, 1)  # whole pages of the query only
    assert cache.peek_prefix(_toks(1, 8)) == (0, 0, 0)
    assert cache.pretty() == before
    m = cache.match_prefix(_toks(0, 9))
    assert (m.num_pages, m.host_pages.size) == (2, 2)
    cache.check_invariants()


def test_eviction_without_host_copy_removes_node():
    cache = _cache(policy="write_through_selective")
    _cache_request(cache, _toks(0, 8))
    cache.evict(np.array([2, 2]))
    m = cache.match_prefix(_toks(0, 8))
    assert (m.num_tokens, m.host_num_tokens) == (0, 0)
    assert cache.dropped_backups == 0
    cache.check_invariants()


def test_dropped_backup_when_host_full():
    cache = _cache(host=2)  # one usable host page per lane
    _cache_request(cache, _toks(0, 8))  # needs 2 host pages per lane
    assert cache.take_backups() == []
    assert cache.dropped_backups == 1
    assert cache.host_free_per_lane().tolist() == [1, 1]
    cache.check_invariants()
    wb = _cache(policy="write_back", host=2)
    _cache_request(wb, _toks(0, 8))
    wb.evict(np.array([2, 2]))
    assert wb.dropped_backups == 1 and wb.take_backups() == []
    assert wb.allocator.num_free_per_lane().tolist() == [4, 4]
    wb.check_invariants()


def test_host_eviction_lru_makes_room():
    cache = _cache(pages_per_lane=5, host=3)  # two usable host pages per lane
    a, b, c = _toks(0, 4), _toks(100, 4), _toks(200, 4)
    _cache_request(cache, a)
    _ack_all(cache)
    _cache_request(cache, b)
    _ack_all(cache)
    cache.evict(np.array([2, 2]))  # a and b now host only
    assert cache.match_prefix(a).host_num_tokens == 4  # touch a: b is LRU now
    _cache_request(cache, c)  # its backup evicts the LRU host-only leaf (b)
    (job,) = cache.take_backups()
    cache.backup_done(job)
    assert cache.match_prefix(b).host_num_tokens == 0
    assert cache.match_prefix(a).host_num_tokens == 4
    cache.check_invariants()
    assert cache.evict_host(np.array([1, 1])).tolist() == [1, 1]
    assert cache.match_prefix(a).host_num_tokens == 0
    cache.check_invariants()


# --- load-back (SPEC S10) and the cached-token count (S7) ----------------------------


def _pressure_setup(lock_other: bool):
    """Seed S10 case: A is host only; a running request holds pages so free is short;
    B is evictable (or locked by a running request when `lock_other`)."""
    cache = _cache(pages_per_lane=5)  # 4 usable pages per lane
    a, b = _toks(0, 8), _toks(100, 8)
    _cache_request(cache, a)
    _ack_all(cache)
    cache.evict(np.array([2, 2]))
    _cache_request(cache, b)
    _ack_all(cache)
    running = RequestPageTable(cache.cp_size)
    running.extend(cache.allocator, 4, cache.page_size)  # one page per lane
    if lock_other:
        cache.inc_lock_ref(cache.match_prefix(b).node)
    assert cache.allocator.num_free_per_lane().tolist() == [1, 1]
    return cache, a, running


def test_s10_host_hit_loads_back_with_evictable_capacity():
    cache, a, running = _pressure_setup(lock_other=False)
    m = cache.match_prefix(np.concatenate([a, [7]])[:-1])
    cache.inc_lock_ref(m.node)
    assert (m.num_tokens, m.host_num_tokens) == (0, 8)
    plan = cache.plan_load_back(m)
    free = cache.allocator.num_free_per_lane()
    assert (plan.pages_per_lane > free).all()  # free alone would skip it
    assert plan.load and plan.reason is None
    assert plan.capacity_per_lane.tolist() == [3, 3]
    assert plan.cached_tokens == 8  # S7: host hits that will be loaded back count
    job = cache.load_back(plan)
    assert isinstance(job, LoadBackJob)
    cache.check_invariants(request_pages=[(running.owners(), running.local_pages())])
    lanes = [lane for lane, _, _ in job.per_lane()]
    assert lanes == [0, 1]
    for _lane, dev, host in job.per_lane():
        assert dev.size == host.size == 2
    for _lane, dti, hti in job.token_indices(cache.page_size):
        assert dti.size == hti.size == 4
    full = cache.load_back_done(job)
    cache.inc_lock_ref(full.node)
    cache.dec_lock_ref(m.node)
    assert full.num_tokens == 8
    assert np.array_equal(full.local_pages, job.device_pages)
    m2 = cache.match_prefix(a)
    assert (m2.num_tokens, m2.host_num_tokens) == (8, 0)
    assert m2.node.state == "device+host"
    cache.check_invariants(request_pages=[(running.owners(), running.local_pages())])
    cache.dec_lock_ref(full.node)


def test_s10_host_hit_skipped_without_evictable_capacity():
    cache, a, running = _pressure_setup(lock_other=True)
    m = cache.match_prefix(a)
    plan = cache.plan_load_back(m)
    assert not plan.load and "lane 0 needs 2 pages but has 1 free + 0 evictable" in plan.reason
    assert plan.cached_tokens == 0  # S7: a skipped host hit is not counted
    assert cache.load_back(plan) is None
    # The request recomputes: it needs its own pages, which are not there either.
    table = table_from_prefix(cache, m)
    with pytest.raises(CacheCapacityError):
        alloc_with_evict(cache, table, a.size + 1)
    assert cache.match_prefix(a).host_num_tokens == 8  # host copy kept
    cache.check_invariants(request_pages=[(running.owners(), running.local_pages())])


def test_s7_counts_device_plus_planned_host_hits():
    cache = _cache(pages_per_lane=5)
    a = _toks(0, 8)
    _cache_request(cache, a)
    _ack_all(cache)
    cache.evict(np.array([1, 1]))  # tail half to host
    m = cache.match_prefix(a)
    cache.inc_lock_ref(m.node)
    assert (m.num_tokens, m.host_num_tokens) == (4, 4)
    assert cache.plan_load_back(m).cached_tokens == 8
    skipped = cache.plan_load_back(m, np.array([0, 0]))
    assert not skipped.load and skipped.cached_tokens == 4
    reserve = cache.plan_load_back(m, reserve_per_lane=np.array([3, 0]))
    assert not reserve.load and reserve.cached_tokens == 4
    nohit = cache.plan_load_back(cache.match_prefix(_toks(50, 4)))
    assert not nohit.load and nohit.reason == "no host hit" and nohit.cached_tokens == 0
    cache.dec_lock_ref(m.node)


def test_load_back_stale_or_short_at_allocation_is_skipped():
    cache, a, running = _pressure_setup(lock_other=False)
    m = cache.match_prefix(a)
    plan = cache.plan_load_back(m)
    assert plan.load
    # Between planning and loading, a running request locks the evictable prefix.
    other = cache.match_prefix(_toks(100, 8))
    cache.inc_lock_ref(other.node)
    assert cache.load_back(plan) is None
    assert cache.skipped_load_backs == 1
    cache.check_invariants(request_pages=[(running.owners(), running.local_pages())])
    cache.dec_lock_ref(other.node)
    # Host eviction makes a plan stale.
    plan = cache.plan_load_back(cache.match_prefix(a))
    cache.evict_host(np.array([2, 2]))
    assert cache.load_back(plan) is None
    cache.check_invariants(request_pages=[(running.owners(), running.local_pages())])


def test_load_back_failed_keeps_host_copy():
    cache = _cache()
    a = _toks(0, 8)
    _cache_request(cache, a)
    _ack_all(cache)
    cache.evict(np.array([2, 2]))
    m = cache.match_prefix(a)
    job = cache.load_back(cache.plan_load_back(m))
    assert job is not None
    assert cache.allocator.num_free_per_lane().tolist() == [2, 2]
    # A second match does not see the node being loaded as a host hit.
    assert cache.match_prefix(a).host_num_tokens == 0
    cache.check_invariants()
    cache.load_back_failed(job)
    assert cache.allocator.num_free_per_lane().tolist() == [4, 4]
    assert cache.match_prefix(a).host_num_tokens == 8
    cache.check_invariants()


def test_load_host_hit_moves_the_lock_or_leaves_the_match():
    """`load_host_hit` (the scheduler's and the DP store's one load-back sequence): loaded,
    the lock is on the longer match and off the old one; skipped or a failed copy, the
    caller's match stays used and locked and the job's device pages are free again."""
    cache = _cache()
    a = _toks(0, 8)
    _cache_request(cache, a)
    _ack_all(cache)
    cache.evict(np.array([1, 1]))  # the tail half to host only
    free = cache.allocator.num_free_per_lane().tolist()
    m = cache.match_prefix(a)
    cache.inc_lock_ref(m.node)
    assert (m.num_tokens, m.host_num_tokens) == (4, 4)
    copied: list[LoadBackJob] = []
    used, outcome = load_host_hit(
        cache, cache.plan_load_back(m), lambda j: copied.append(j) or False
    )
    assert outcome == "failed" and used is m and len(copied) == 1
    assert cache.allocator.num_free_per_lane().tolist() == free
    no_room = cache.plan_load_back(m, np.array([0, 0]))
    used, outcome = load_host_hit(cache, no_room, lambda j: pytest.fail("copied"))
    assert outcome == "skipped" and used is m and m.node.lock_ref == 1
    used, outcome = load_host_hit(cache, cache.plan_load_back(m), lambda j: True)
    assert outcome == "loaded" and used.num_tokens == 8
    assert used.node.lock_ref == 1 and m.node.lock_ref == 1  # held once, through `used`
    cache.dec_lock_ref(used.node)
    assert m.node.lock_ref == 0
    cache.check_invariants()


def test_split_during_in_flight_jobs():
    cache = _cache(pages_per_lane=9)
    a = _toks(0, 8)
    _cache_request(cache, a)
    (bjob,) = cache.take_backups()
    cache.match_prefix(a[:4])  # splits the node being backed up
    cache.check_invariants()
    cache.backup_done(bjob)
    cache.check_invariants()
    cache.evict(np.array([2, 2]))
    job = cache.load_back(cache.plan_load_back(cache.match_prefix(a)))
    assert job is not None
    cache.match_prefix(a[:2])  # splits a node being loaded
    cache.check_invariants()
    full = cache.load_back_done(job)
    assert full.num_tokens == 8
    cache.check_invariants()


def test_insert_adopts_recomputed_host_nodes():
    cache = _cache()
    a = _toks(0, 8)
    _cache_request(cache, a)
    _ack_all(cache)
    cache.evict(np.array([2, 2]))
    _cache_request(cache, np.concatenate([a, _toks(50, 4)]))  # recomputed A (load skipped)
    m = cache.match_prefix(a)
    assert (m.num_tokens, m.host_num_tokens) == (8, 0)
    assert m.node.state == "device+host"
    cache.check_invariants()
    _ack_all(cache)
    cache.check_invariants()


def _finish_recomputed(cache: HiRadixCache, tokens: np.ndarray) -> RequestPageTable:
    """A request that computed all of `tokens` itself (its prefix matched nothing on the
    device) finishes held: its whole pages are inserted, then its prefix re-matched."""
    table = RequestPageTable(cache.cp_size)
    table.extend(cache.allocator, tokens.size, cache.page_size)
    own = table.local_pages()
    cache.insert(tokens, own)
    m = cache.match_prefix(tokens)
    assert m.num_tokens == tokens.size, cache.pretty()  # nothing freed under the request
    assert np.array_equal(m.local_pages, own)
    cache.inc_lock_ref(m.node)
    table.detach()
    return m


def test_insert_adopts_a_node_whose_write_back_is_in_flight():
    """Write-back evicts A (backup in flight); B recomputed A and finishes: its pages
    go back on the device (the job keeps and frees the old ones), and the node is
    device + host once the copy lands. A failed copy keeps the adopted part only."""
    for ok in (True, False):
        cache = _cache(policy="write_back")
        dev0, host0 = cache.allocator.num_free_per_lane(), cache.host_free_per_lane()
        a = _toks(0, 8)
        _cache_request(cache, a)
        cache.evict(np.array([2, 2]))
        (job,) = cache.take_backups()
        assert cache.match_prefix(a).node is cache.root  # in transit: no hit of any kind
        m = _finish_recomputed(cache, a[:4])  # B shares A's first two pages only
        assert m.node.state == "device" and m.node.backup_job is job
        cache.check_invariants(request_pages=[])
        free = cache.allocator.num_free_per_lane().tolist()
        if ok:
            cache.backup_done(job)
            assert m.node.state == "device+host"
            tail = cache.match_prefix(a)
            assert (tail.num_tokens, tail.host_num_tokens) == (4, 4)
        else:
            cache.backup_failed(job)
            assert m.node.state == "device" and m.node.parent is not None
            assert cache.match_prefix(a).host_num_tokens == 0  # the tail left the tree
        assert cache.allocator.num_free_per_lane().tolist() == [f + 2 for f in free]
        cache.check_invariants(request_pages=[])
        cache.dec_lock_ref(m.node)
        cache.reset()
        assert cache.allocator.num_free_per_lane().tolist() == dev0.tolist()
        assert cache.host_free_per_lane().tolist() == host0.tolist()


def test_insert_adopts_a_node_being_loaded_back():
    cache = _cache(pages_per_lane=9)
    a = _toks(0, 8)
    _cache_request(cache, a)
    _ack_all(cache)
    cache.evict(np.array([2, 2]))
    job = cache.load_back(cache.plan_load_back(cache.match_prefix(a)))
    assert job is not None
    m = _finish_recomputed(cache, a)
    cache.check_invariants(request_pages=[])
    free = cache.allocator.num_free_per_lane().tolist()
    full = cache.load_back_done(job)  # the job's pages are the spare copy now
    assert np.array_equal(full.local_pages, m.local_pages)
    assert cache.allocator.num_free_per_lane().tolist() == [f + 2 for f in free]
    cache.dec_lock_ref(m.node)
    cache.check_invariants(request_pages=[])


def test_backup_failed_frees_host_pages():
    cache = _cache()
    _cache_request(cache, _toks(0, 8))
    (job,) = cache.take_backups()
    cache.backup_failed(job)
    assert cache.host_free_per_lane().tolist() == [8, 8]
    assert cache.evictable_pages_per_lane().tolist() == [2, 2]
    assert cache.match_prefix(_toks(0, 8)).node.state == "device"
    cache.check_invariants()


# --- randomized run --------------------------------------------------------------------


def _drop(reqs: list[dict], r: dict) -> None:
    reqs[:] = [x for x in reqs if x is not r]


def _random_run(seed: int, cp: int, policy: str, steps: int) -> None:
    rng = np.random.default_rng(seed)
    page = 2
    cache = HiRadixCache(OwnerLaneAllocator(cp, 9), page, 10, write_policy=policy)
    dev0, host0 = cache.allocator.num_free_per_lane(), cache.host_free_per_lane()
    bases = [rng.integers(0, 3, size=12) for _ in range(3)]
    reqs: list[dict] = []
    backups: list[BackupJob] = []

    def own_pages():
        out = []
        for r in reqs:
            if r["table"] is not None:
                local = r["table"].local_pages()
                pos = np.arange(r["own_from"], local.size, dtype=np.int64)
                out.append((owner_of_page(pos, cp), local[r["own_from"] :]))
        return out

    def make_ready(r, match):
        r["table"] = table_from_prefix(cache, match)
        r["own_from"] = match.num_pages
        try:
            alloc_with_evict(cache, r["table"], r["tokens"].size)
        except CacheCapacityError:
            cache.dec_lock_ref(r["lock"])
            _drop(reqs, r)

    def finish(r, abort):
        if r["job"] is not None:
            cache.load_back_failed(r["job"])
            cache.dec_lock_ref(r["lock"])
        elif abort:
            table = r["table"]
            pages = table.detach()
            pos = np.arange(r["own_from"], pages.size, dtype=np.int64)
            cache.allocator.free(owner_of_page(pos, cp), pages[r["own_from"] :])
            cache.dec_lock_ref(r["lock"])
        else:
            cache_finished_request(cache, r["table"], r["tokens"], r["lock"])
            # Every whole page is cached on the device, whatever jobs the path crossed.
            whole = r["tokens"].size // page * page
            assert cache.match_prefix(r["tokens"]).num_tokens == whole, cache.pretty()
        _drop(reqs, r)

    for _ in range(steps):
        op = rng.integers(0, 9)
        if op <= 1 and len(reqs) < 4:
            base = bases[int(rng.integers(len(bases)))][: int(rng.integers(0, 13))]
            tail = rng.integers(0, 2, size=int(rng.integers(1, 4)))
            tokens = np.concatenate([base, tail]).astype(np.int64)
            m = cache.match_prefix(tokens[:-1])
            cache.inc_lock_ref(m.node)
            r = {"tokens": tokens, "lock": m.node, "job": None, "table": None, "own_from": 0}
            reqs.append(r)
            plan = cache.plan_load_back(m)
            job = cache.load_back(plan) if rng.random() < 0.8 else None
            if job is None:
                make_ready(r, m)
            else:
                r["job"], r["match"] = job, m
        elif op == 2 and reqs:
            r = reqs[int(rng.integers(len(reqs)))]
            if r["job"] is not None:
                job, r["job"] = r["job"], None
                if rng.random() < 0.7:
                    full = cache.load_back_done(job)
                    cache.inc_lock_ref(full.node)
                    cache.dec_lock_ref(r["lock"])
                    r["lock"] = full.node
                    make_ready(r, full)
                else:  # copy abandoned: recompute from the device match
                    cache.load_back_failed(job)
                    make_ready(r, r["match"])
            else:
                finish(r, abort=rng.random() < 0.2)
        elif op == 3 and reqs:
            finish(reqs[int(rng.integers(len(reqs)))], abort=True)
        elif op == 4:
            cache.evict(rng.integers(0, 4, size=cp))
        elif op == 5:
            cache.evict_host(rng.integers(0, 2, size=cp))
        elif op in (6, 7):
            backups.extend(cache.take_backups())
            if backups:
                job = backups.pop(int(rng.integers(len(backups))))
                if rng.random() < 0.8:
                    cache.backup_done(job)
                else:
                    cache.backup_failed(job)
        else:
            m = cache.match_prefix(rng.integers(0, 2, size=int(rng.integers(0, 15))))
            cache.plan_load_back(m)
        backups.extend(cache.take_backups())
        cache.check_invariants(request_pages=own_pages())
    while reqs:
        finish(reqs[0], abort=reqs[0]["job"] is not None or reqs[0]["table"] is None)
        backups.extend(cache.take_backups())
        cache.check_invariants(request_pages=own_pages())
    for job in backups:
        cache.backup_done(job)
    cache.check_invariants(request_pages=[])
    cache.reset()
    cache.check_invariants(request_pages=[])
    assert cache.allocator.num_free_per_lane().tolist() == dev0.tolist()
    assert cache.host_free_per_lane().tolist() == host0.tolist()


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_randomized_run(cp, policy):
    for seed in range(3):
        _random_run(seed * 31 + cp, cp, policy, steps=300)
