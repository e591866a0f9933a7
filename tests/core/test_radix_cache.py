"""Radix prefix cache over owner-lane pages: whole-page matching, edge splits, duplicate
freeing in owner lanes, locking, LRU eviction per lane, evict-then-allocate, and a
stateful property test over many requests with cp in {1, 2, 4, 8}."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from cpkv_jax.cache.radix import (
    RadixCache,
    alloc_with_evict,
    cache_and_relock,
    cache_finished_request,
    table_from_prefix,
)
from cpkv_jax.errors import CacheCapacityError
from cpkv_jax.lane_allocator import OwnerLaneAllocator, RequestPageTable


def _cache(cp_size: int, pages_per_lane: int, page_size: int) -> RadixCache:
    return RadixCache(OwnerLaneAllocator(cp_size, pages_per_lane), page_size)


def _tokens(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _own(cache: RadixCache, tokens: np.ndarray) -> RequestPageTable:
    """A request that computed all of `tokens` itself (no prefix hit)."""
    table = RequestPageTable(cache.cp_size)
    table.extend(cache.allocator, tokens.size, cache.page_size)
    return table


def _cached_page_map(cache: RadixCache) -> dict[bytes, int]:
    """Cached pages keyed by the whole token prefix ending with them (bytes of int64)."""
    out: dict[bytes, int] = {}
    stack = [(cache.root, np.zeros((0,), dtype=np.int64))]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            full = np.concatenate([prefix, child.tokens])
            for i, page in enumerate(child.pages.tolist()):
                p = child.start_page + i
                out[full[: (p + 1) * cache.page_size].tobytes()] = page
            stack.append((child, full))
    return out


# --- match and insert -----------------------------------------------------------------


def test_insert_then_match_returns_the_inserted_pages():
    cache = _cache(cp_size=2, pages_per_lane=8, page_size=4)
    tokens = np.arange(100, 116, dtype=np.int64)  # 4 whole pages
    table = _own(cache, tokens)
    assert cache.insert(tokens, table.local_pages()) == 0
    cache.check_invariants()

    match = cache.match_prefix(tokens)
    assert match.num_tokens == 16 and match.num_pages == 4
    np.testing.assert_array_equal(match.local_pages, table.local_pages())
    assert match.local_pages.dtype == np.int32
    # A longer query matches the cached pages only; a different first page nothing.
    longer = np.concatenate([tokens, _tokens(1, 2, 3, 4, 5)])
    assert cache.match_prefix(longer).num_tokens == 16
    miss = cache.match_prefix(_tokens(7, 7, 7, 7))
    assert miss.num_tokens == 0 and miss.node is cache.root and miss.num_pages == 0
    assert cache.match_prefix(_tokens()).num_tokens == 0


def test_match_ending_mid_edge_splits_at_a_page_boundary():
    cache = _cache(cp_size=4, pages_per_lane=8, page_size=4)
    tokens = np.arange(16, dtype=np.int64)
    table = _own(cache, tokens)
    cache.insert(tokens, table.local_pages())
    (edge,) = cache.root.children.values()
    assert (edge.start_page, edge.num_pages) == (0, 4)

    query = tokens.copy()
    query[9] = -1  # inside logical page 2: pages 0 and 1 still match
    match = cache.match_prefix(query)
    assert match.num_tokens == 8
    np.testing.assert_array_equal(match.local_pages, table.local_pages()[:2])

    # The edge is now [0, 2) -> [2, 4); the match ends exactly at the upper node, and
    # the lower part keeps its logical start (so its owner lanes).
    (upper,) = cache.root.children.values()
    (lower,) = upper.children.values()
    assert match.node is upper
    assert (upper.start_page, upper.num_pages, lower.start_page, lower.num_pages) == (0, 2, 2, 2)
    assert lower is edge  # the deeper node keeps its identity
    cache.check_invariants()
    # The whole query still matches through the split.
    np.testing.assert_array_equal(cache.match_prefix(tokens).local_pages, table.local_pages())


def test_partial_tail_page_is_never_cached_or_matched():
    cache = _cache(cp_size=2, pages_per_lane=8, page_size=4)
    tokens = np.arange(10, dtype=np.int64)  # 2 whole pages + 2 tokens
    table = _own(cache, tokens)
    assert table.num_pages == 3
    cache.insert(tokens, table.local_pages())  # the tail page is ignored
    assert cache.total_size() == 8
    assert cache.match_prefix(tokens).num_tokens == 8
    assert cache.match_prefix(tokens[:7]).num_tokens == 4
    assert cache.match_prefix(tokens[:3]).num_tokens == 0
    # The caller still owns the tail page (logical page 2, lane 0).
    assert cache.allocator.allocated_mask()[0, table.local_pages()[2]]
    cache.check_invariants()


def test_insert_rejects_a_page_count_that_does_not_fit_the_tokens():
    cache = _cache(cp_size=2, pages_per_lane=8, page_size=4)
    with pytest.raises(ValueError, match="insert got 1 local pages for 2 whole pages"):
        cache.insert(np.arange(8), np.asarray([1], dtype=np.int32))
    with pytest.raises(ValueError, match="trash page"):
        cache.insert(np.arange(4), np.asarray([0], dtype=np.int32))
    assert cache.total_size() == 0


def test_duplicate_insert_frees_duplicates_into_their_owner_lanes():
    cp = 4
    cache = _cache(cp_size=cp, pages_per_lane=8, page_size=2)
    alloc = cache.allocator
    tokens = np.arange(12, dtype=np.int64)  # 6 pages: lanes 0 1 2 3 0 1
    first, second = _own(cache, tokens), _own(cache, tokens)
    assert cache.insert(tokens, first.local_pages()) == 0
    before = alloc.num_free_per_lane()

    assert cache.insert(tokens, second.local_pages()) == 12
    # Every page of the second copy went back to lane p mod cp.
    np.testing.assert_array_equal(alloc.num_free_per_lane() - before, [2, 2, 1, 1])
    mask = alloc.allocated_mask()
    for p, (mine, theirs) in enumerate(zip(first.local_pages(), second.local_pages(), strict=True)):
        assert mask[p % cp, mine] and not mask[p % cp, theirs]
    np.testing.assert_array_equal(cache.match_prefix(tokens).local_pages, first.local_pages())
    cache.check_invariants()

    # A partial overlap: 3 shared pages are duplicates, the 2 new ones are cached.
    branch = np.concatenate([tokens[:6], _tokens(50, 51, 52, 53)])
    third = _own(cache, branch)
    before = alloc.num_free_per_lane()
    assert cache.insert(branch, third.local_pages()) == 6
    np.testing.assert_array_equal(alloc.num_free_per_lane() - before, [1, 1, 1, 0])
    np.testing.assert_array_equal(
        cache.match_prefix(branch).local_pages,
        np.concatenate([first.local_pages()[:3], third.local_pages()[3:]]),
    )
    cache.check_invariants()


def test_reinserting_the_matched_pages_frees_nothing():
    cache = _cache(cp_size=2, pages_per_lane=8, page_size=2)
    prompt = np.arange(8, dtype=np.int64)
    cache.insert(prompt, _own(cache, prompt).local_pages())
    longer = np.concatenate([prompt, _tokens(9, 9, 9)])
    match = cache.match_prefix(longer)
    cache.inc_lock_ref(match.node)
    table = table_from_prefix(cache, match)
    alloc_with_evict(cache, table, longer.size)
    free_before = cache.allocator.num_free_per_lane()
    # 4 cached pages are the cache's own (not freed), page 4 is new, page 5 is the tail.
    assert cache_finished_request(cache, table, longer, match.node) == 8
    np.testing.assert_array_equal(cache.allocator.num_free_per_lane() - free_before, [0, 1])
    assert table.num_pages == 0 and cache.total_size() == 10 and cache.protected_size() == 0
    cache.check_invariants()


def test_cache_and_relock_moves_the_lock_onto_the_cached_pages_and_keeps_the_tail():
    """A running request's whole pages are cached at once and locked by it (the prefill
    scheduler's `hold_finished`, the DP prefix store's `hold_prompt`): where another
    request cached the same tokens first, its pages become the cache's, its duplicates
    are freed, and its partial tail page stays its own."""
    cache = _cache(cp_size=2, pages_per_lane=8, page_size=2)
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 99, 4)
    cache.insert(shared, _own(cache, shared).local_pages())  # another request, finished
    prompt = np.concatenate([shared, rng.integers(3, 99, 5)])  # 4 whole pages + 1 token
    miss = cache.match_prefix(prompt[:0])
    cache.inc_lock_ref(miss.node)
    table = _own(cache, prompt)  # computed all of it itself: 2 duplicate pages
    own = table.local_pages()
    free_before = cache.allocator.num_free_per_lane()

    node, pages = cache_and_relock(cache, prompt, own, miss.node)
    np.testing.assert_array_equal(cache.allocator.num_free_per_lane() - free_before, [1, 1])
    np.testing.assert_array_equal(pages[:2], cache.match_prefix(shared).local_pages)
    np.testing.assert_array_equal(pages[2:], own[2:])  # its new whole pages, then its tail
    assert cache.match_prefix(prompt).num_tokens == 8
    assert cache.protected_size() == 8 and cache.evictable_size() == 0  # all locked by it
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0
    cache.check_invariants()


# --- locking and eviction -------------------------------------------------------------


def test_lock_protects_from_eviction_and_unlock_makes_it_evictable():
    cache = _cache(cp_size=2, pages_per_lane=8, page_size=2)
    tokens = np.arange(8, dtype=np.int64)
    cache.insert(tokens, _own(cache, tokens).local_pages())
    match = cache.match_prefix(tokens[:4])  # splits: lock only [0, 2)
    cache.inc_lock_ref(match.node)
    cache.inc_lock_ref(match.node)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 4)
    np.testing.assert_array_equal(cache.evictable_pages_per_lane(), [1, 1])
    np.testing.assert_array_equal(cache.protected_pages_per_lane(), [1, 1])

    freed = cache.evict(np.asarray([5, 5]))
    np.testing.assert_array_equal(freed, [1, 1])  # only the unlocked suffix went
    assert cache.match_prefix(tokens).num_tokens == 4
    np.testing.assert_array_equal(cache.evict(np.asarray([1, 1])), [0, 0])

    cache.dec_lock_ref(match.node)
    assert cache.protected_size() == 4  # still locked once
    cache.dec_lock_ref(match.node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 4)
    with pytest.raises(ValueError, match="dec_lock_ref on unlocked"):
        cache.dec_lock_ref(match.node)
    np.testing.assert_array_equal(cache.evict(np.asarray([1, 1])), [1, 1])
    assert cache.total_size() == 0
    np.testing.assert_array_equal(cache.allocator.num_free_per_lane(), [7, 7])
    with pytest.raises(ValueError, match="no longer in the cache"):
        cache.inc_lock_ref(match.node)
    cache.check_invariants()


def test_root_locks_are_no_ops():
    cache = _cache(cp_size=1, pages_per_lane=4, page_size=1)
    miss = cache.match_prefix(_tokens(1, 2))
    cache.inc_lock_ref(miss.node)
    cache.dec_lock_ref(miss.node)
    cache.dec_lock_ref(miss.node)
    assert cache.protected_size() == 0


def test_eviction_is_least_recently_used_first():
    cache = _cache(cp_size=1, pages_per_lane=16, page_size=2)
    branches = [_tokens(k, k, 1, 1) for k in (1, 2, 3)]  # 2 pages each, in insert order
    tables = [_own(cache, b) for b in branches]
    for b, t in zip(branches, tables, strict=True):
        cache.insert(b, t.local_pages())
    cache.match_prefix(branches[0])  # refresh branch 0: branch 1 is now the oldest

    np.testing.assert_array_equal(cache.evict(np.asarray([2])), [2])
    hits = [cache.match_prefix(b).num_tokens for b in branches]
    assert hits == [4, 0, 4]
    np.testing.assert_array_equal(cache.evict(np.asarray([1])), [1])
    # The matches above touched branch 0 before branch 2: branch 0 is now the oldest and
    # loses one page, from its tail.
    assert [cache.match_prefix(b).num_tokens for b in (branches[0], branches[2])] == [2, 4]
    cache.check_invariants()


def test_a_parent_becomes_evictable_after_its_children_go():
    cache = _cache(cp_size=1, pages_per_lane=16, page_size=1)
    trunk = _tokens(1, 2, 3)
    a = np.concatenate([trunk, _tokens(4)])
    b = np.concatenate([trunk, _tokens(5)])
    cache.insert(a, _own(cache, a).local_pages())
    cache.insert(b, _own(cache, b).local_pages())
    cache.match_prefix(a)  # the trunk is now newer than leaf b, as new as leaf a
    # Needing everything: leaves first (b, then a), then the trunk once it is a leaf.
    np.testing.assert_array_equal(cache.evict(np.asarray([5])), [5])
    assert cache.total_size() == 0 and not cache.root.children
    cache.check_invariants()


def test_evict_takes_only_the_needed_tail_pages_per_lane():
    cp = 4
    cache = _cache(cp_size=cp, pages_per_lane=8, page_size=1)
    tokens = np.arange(8, dtype=np.int64)  # lanes 0 1 2 3 0 1 2 3
    cache.insert(tokens, _own(cache, tokens).local_pages())
    # Lane 2 needs one page: the tail pages 7 (lane 3) and 6 (lane 2) go.
    np.testing.assert_array_equal(cache.evict(np.asarray([0, 0, 1, 0])), [0, 0, 1, 1])
    assert cache.match_prefix(tokens).num_tokens == 6
    np.testing.assert_array_equal(cache.evictable_pages_per_lane(), [2, 2, 1, 1])
    # Asking for more than there is frees everything evictable and reports it.
    np.testing.assert_array_equal(cache.evict(np.asarray([9, 0, 0, 0])), [2, 2, 1, 1])
    assert cache.total_size() == 0
    np.testing.assert_array_equal(cache.evict(np.zeros(cp, dtype=np.int64)), np.zeros(cp))
    with pytest.raises(ValueError, match="one page count per lane"):
        cache.evict(np.asarray([1]))
    cache.check_invariants()


def test_sizes_count_evictable_and_protected_tokens_per_lane():
    cp = 2
    cache = _cache(cp_size=cp, pages_per_lane=16, page_size=2)
    a = np.arange(10, dtype=np.int64)  # 5 pages: lanes 0 1 0 1 0
    b = np.concatenate([a[:4], _tokens(70, 71)])  # shares pages 0, 1; page 2 differs
    cache.insert(a, _own(cache, a).local_pages())
    cache.insert(b, _own(cache, b).local_pages())
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (12, 12, 0)
    np.testing.assert_array_equal(cache.evictable_pages_per_lane(), [4, 2])

    match = cache.match_prefix(b)
    cache.inc_lock_ref(match.node)  # locks pages 0, 1 and b's page 2
    assert (cache.evictable_size(), cache.protected_size()) == (6, 6)
    np.testing.assert_array_equal(cache.protected_pages_per_lane(), [2, 1])
    np.testing.assert_array_equal(cache.evictable_pages_per_lane(), [2, 1])
    np.testing.assert_array_equal(cache.total_pages_per_lane(), [4, 2])
    # Splitting a locked edge keeps the sums (both parts keep the lock count).
    cache.match_prefix(b[:2])
    assert (cache.evictable_size(), cache.protected_size()) == (6, 6)
    cache.check_invariants()
    cache.dec_lock_ref(match.node)
    assert (cache.evictable_size(), cache.protected_size()) == (12, 0)
    cache.check_invariants()


# --- evict-then-allocate --------------------------------------------------------------


def test_alloc_with_evict_evicts_just_enough_per_lane():
    cp = 2
    cache = _cache(cp_size=cp, pages_per_lane=5, page_size=1)  # 4 usable pages a lane
    old = np.arange(6, dtype=np.int64)  # lanes 0 1 0 1 0 1
    cache.insert(old, _own(cache, old).local_pages())
    np.testing.assert_array_equal(cache.allocator.num_free_per_lane(), [1, 1])

    table = RequestPageTable(cp)
    # 3 new pages: lanes 0 1 0 -> lane 0 is short 1, lane 1 is not short.
    new = alloc_with_evict(cache, table, 3)
    np.testing.assert_array_equal(new, [0, 1, 2])
    # The LRU tail pages 5 (lane 1) and 4 (lane 0) went: only what covers lane 0's need.
    assert cache.match_prefix(old).num_tokens == 4
    np.testing.assert_array_equal(cache.allocator.num_free_per_lane(), [0, 1])
    np.testing.assert_array_equal(table.owners(), [0, 1, 0])
    cache.check_invariants()

    # Enough free room: nothing is evicted.
    alloc_with_evict(cache, table, 4)
    assert cache.total_size() == 4


def test_alloc_with_evict_is_all_or_nothing():
    cp = 2
    cache = _cache(cp_size=cp, pages_per_lane=4, page_size=2)  # 3 usable pages a lane
    prompt = np.arange(8, dtype=np.int64)  # 4 pages: lanes 0 1 0 1
    cache.insert(prompt, _own(cache, prompt).local_pages())
    match = cache.match_prefix(prompt[:4])
    cache.inc_lock_ref(match.node)  # pages 0, 1 locked; 2, 3 evictable
    table = table_from_prefix(cache, match)
    sizes = (cache.evictable_size(), cache.protected_size())
    free = cache.allocator.num_free_per_lane()
    # Pages 2..7: 3 per lane, only 1 free + 1 evictable each.
    with pytest.raises(CacheCapacityError, match="lane 0 is short 2 pages with 1 evictable"):
        alloc_with_evict(cache, table, 16)
    assert (cache.evictable_size(), cache.protected_size()) == sizes
    np.testing.assert_array_equal(cache.allocator.num_free_per_lane(), free)
    assert table.num_tokens == 4
    with pytest.raises(ValueError, match="cannot shrink"):
        alloc_with_evict(cache, table, 2)
    # What fits does: pages 2..5 evict the two unlocked pages.
    np.testing.assert_array_equal(alloc_with_evict(cache, table, 12), [2, 3, 4, 5])
    assert cache.evictable_size() == 0
    cache.check_invariants()


def test_reset_frees_everything_but_not_while_locked():
    cache = _cache(cp_size=4, pages_per_lane=4, page_size=1)
    tokens = np.arange(8, dtype=np.int64)
    cache.insert(tokens, _own(cache, tokens).local_pages())
    match = cache.match_prefix(tokens)
    cache.inc_lock_ref(match.node)
    text = cache.pretty()
    assert "pages [0, 8)" in text and "lanes=[0, 1, 2, 3, 0, 1, 2, 3]" in text
    with pytest.raises(ValueError, match="locked by running requests"):
        cache.reset()
    cache.dec_lock_ref(match.node)
    cache.reset()
    assert cache.total_size() == 0 and not cache.root.children
    np.testing.assert_array_equal(cache.allocator.num_free_per_lane(), [3, 3, 3, 3])
    with pytest.raises(ValueError, match="no longer in the cache"):
        cache.inc_lock_ref(match.node)


# --- property test: random request lifecycles ----------------------------------------


class RadixCacheMachine(RuleBasedStateMachine):
    """Requests start (match, lock, allocate), grow, finish (insert, unlock); plain
    matches and evictions interleave. `ref` models the cached pages by token prefix."""

    @initialize(
        cp=st.sampled_from([1, 2, 4, 8]),
        page_size=st.sampled_from([1, 2, 3]),
        pages_per_lane=st.integers(2, 12),
    )
    def setup(self, cp, page_size, pages_per_lane):
        self.cache = _cache(cp, pages_per_lane, page_size)
        self.alloc = self.cache.allocator
        self.cp, self.page_size = cp, page_size
        self.ref: dict[bytes, int] = {}
        self.running: list[dict] = []
        self.seen: list[np.ndarray] = []

    def _key(self, tokens: np.ndarray, p: int) -> bytes:
        return tokens[: (p + 1) * self.page_size].tobytes()

    def _check_match(self, tokens: np.ndarray):
        match = self.cache.match_prefix(tokens)
        n = match.num_pages
        assert match.num_tokens == n * self.page_size <= tokens.size
        expected = [self.ref[self._key(tokens, p)] for p in range(n)]
        assert match.local_pages.tolist() == expected
        if (n + 1) * self.page_size <= tokens.size:  # the longest cached prefix
            assert self._key(tokens, n) not in self.ref
        return match

    def _sync_ref_after_eviction(self):
        cached = _cached_page_map(self.cache)
        assert cached.keys() <= self.ref.keys()
        self.ref = {k: v for k, v in self.ref.items() if k in cached}

    def _tokens(self, data, max_len=14):
        """Fresh tokens, or (mostly) a prefix of an earlier sequence plus a fresh tail,
        so that requests share prefixes and edges get split."""
        tail = data.draw(st.lists(st.integers(0, 2), max_size=max_len), label="tail")
        if self.seen and data.draw(st.integers(0, 3), label="reuse") > 0:
            base = self.seen[data.draw(st.integers(0, len(self.seen) - 1), label="base")]
            cut = data.draw(st.integers(0, base.size), label="cut")
            tail = base[:cut].tolist() + tail[: max(0, max_len - cut)]
        tokens = np.asarray(tail, dtype=np.int64)
        self.seen.append(tokens)
        return tokens

    @rule(data=st.data())
    def start_request(self, data):
        tokens = self._tokens(data)
        match = self._check_match(tokens)
        self.cache.inc_lock_ref(match.node)
        table = table_from_prefix(self.cache, match)
        free, sizes = self.alloc.num_free_per_lane(), self.cache.total_pages_per_lane()
        try:
            alloc_with_evict(self.cache, table, tokens.size)
        except CacheCapacityError:
            np.testing.assert_array_equal(self.alloc.num_free_per_lane(), free)
            np.testing.assert_array_equal(self.cache.total_pages_per_lane(), sizes)
            self.cache.dec_lock_ref(match.node)
            return
        self._sync_ref_after_eviction()
        self.running.append(
            {"tokens": tokens, "table": table, "node": match.node, "hit": match.num_pages}
        )

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def grow_request(self, data):
        req = self.running[data.draw(st.integers(0, len(self.running) - 1), label="req")]
        more = self._tokens(data, max_len=5)
        try:
            alloc_with_evict(self.cache, req["table"], req["tokens"].size + more.size)
        except CacheCapacityError:
            return
        req["tokens"] = np.concatenate([req["tokens"], more])
        self._sync_ref_after_eviction()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_request(self, data):
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1), label="req"))
        tokens, table = req["tokens"], req["table"]
        local = table.local_pages()
        cached = cache_finished_request(self.cache, table, tokens, req["node"])
        assert cached % self.page_size == 0 and cached >= req["hit"] * self.page_size
        for p in range(cached // self.page_size):
            assert self._key(tokens, p) in self.ref
        for p in range(cached // self.page_size, tokens.size // self.page_size):
            assert self._key(tokens, p) not in self.ref
            self.ref[self._key(tokens, p)] = int(local[p])

    @rule(data=st.data())
    def match_only(self, data):
        self._check_match(self._tokens(data, max_len=20))

    @rule(need=st.lists(st.integers(0, 4), min_size=8, max_size=8))
    def evict(self, need):
        freed = self.cache.evict(np.asarray(need[: self.cp]))
        assert (freed >= 0).all()
        self._sync_ref_after_eviction()

    @invariant()
    def pages_are_conserved_and_in_their_owner_lanes(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        assert _cached_page_map(self.cache) == self.ref
        # (a) free + cached + held only by requests == capacity, per lane; (b) every
        # page's lane is p mod cp and no (lane, page) is counted twice.
        lanes, pages = [], []
        for key, page in self.ref.items():
            p = len(key) // 8 // self.page_size - 1
            lanes.append(p % self.cp)
            pages.append(page)
        held = np.zeros(self.cp, dtype=np.int64)
        for req in self.running:
            local = req["table"].local_pages()
            for p in range(req["hit"], local.size):
                lanes.append(p % self.cp)
                pages.append(int(local[p]))
                held[p % self.cp] += 1
        np.testing.assert_array_equal(
            self.alloc.num_free_per_lane() + self.cache.total_pages_per_lane() + held,
            np.full(self.cp, self.alloc.capacity_per_lane),
        )
        allocated = np.zeros((self.cp, self.alloc.pages_per_lane), dtype=bool)
        allocated[np.asarray(lanes, dtype=np.int64), np.asarray(pages, dtype=np.int64)] = True
        assert allocated.sum() == len(pages)  # distinct
        np.testing.assert_array_equal(allocated, self.alloc.allocated_mask())
        # (d) a running request's locked prefix is still cached, with its pages.
        for req in self.running:
            local = req["table"].local_pages()
            for p in range(req["hit"]):
                assert self.ref[self._key(req["tokens"], p)] == int(local[p])
            assert req["node"] is self.cache.root or req["node"].lock_ref > 0
        assert self.cache.protected_size() >= max(
            (r["hit"] * self.page_size for r in self.running), default=0
        )


TestRadixCacheMachine = RadixCacheMachine.TestCase
TestRadixCacheMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
