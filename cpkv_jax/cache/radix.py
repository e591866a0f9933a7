"""Device radix prefix cache over owner-lane KV pages (host-side Python/numpy, no device).

The third of the four KV-cache layers (device pools, `OwnerLaneAllocator`, this cache,
`alloc_with_evict`), after sglang-jax's `RadixCache`. Keys are token ids; values are the
local physical page ids of whole pages, so a match is always a multiple of `page_size`
tokens and a request's partially filled tail page is never cached.

**A shared prefix keeps its owners.** With CP shared KV (SPEC S1.1) logical page `p` is
stored by owner lane `p mod cp_size`. A cached page is found only at the logical position
it was inserted at (a node's `start_page` is its depth in pages), so every request that
matches it uses it at the same `p`, hence in the same lane. Lanes are therefore implied by
position and never stored; `check_invariants` checks `start_page` against the tree.
`cp_size=1` (a single lane) serves the replicated and single-device layouts.

Lifecycle of a request (see `table_from_prefix`, `alloc_with_evict`,
`cache_finished_request`):
1. `match = cache.match_prefix(tokens)` then at once `cache.inc_lock_ref(match.node)`
   (nothing may evict between the two);
2. `table = table_from_prefix(cache, match)`; grow it with `alloc_with_evict`;
3. after prefill, `cache_finished_request(cache, table, tokens, match.node)` inserts the
   whole pages (freeing pages another request cached first), frees the tail page and
   unlocks.

Eviction is LRU over unlocked leaves at page granularity: the least recently used leaf
loses pages from its tail, a whole leaf goes when more is needed, and a parent becomes a
leaf once its children are gone. Locked paths (running requests' prefixes) are never
evicted. Access times are a per-cache counter, not wall time, so orders are exact.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
from jaxtyping import Int

from cpkv_jax.errors import CacheCapacityError, ConfigError, quote
from cpkv_jax.lane_allocator import OwnerLaneAllocator, RequestPageTable
from cpkv_jax.paging import TRASH_PAGE, owner_of_page, pages_for_tokens

logger = logging.getLogger(__name__)

# Token ids are stored in one dtype so that a page's bytes are its child key.
_TOKEN_DTYPE = np.int64
# Tokens quoted per node by `RadixCache.pretty`.


class RadixNode:
    """One tree edge: a run of whole pages starting at logical page `start_page`.

    `tokens` is `[num_pages * page_size]` int64, `pages` is `[num_pages]` int32 local page
    ids; page `i` of the edge is logical page `start_page + i`, owned by lane
    `(start_page + i) mod cp_size`. `lock_ref` counts running requests whose prefix ends
    at or below this node. A node removed by eviction has `parent is None`.
    """

    __slots__ = (
        "children",
        "last_access",
        "lock_ref",
        "node_id",
        "pages",
        "parent",
        "start_page",
        "tokens",
    )

    def __init__(
        self,
        node_id: int,
        tokens: np.ndarray,
        pages: np.ndarray,
        start_page: int,
        parent: RadixNode | None,
        last_access: int,
        lock_ref: int = 0,
    ):
        self.node_id = node_id
        self.tokens = tokens
        self.pages = pages
        self.start_page = start_page
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.lock_ref = lock_ref
        self.last_access = last_access

    @property
    def num_pages(self) -> int:
        return int(self.pages.size)

    @property
    def end_page(self) -> int:
        """Logical page just past this edge (= the `start_page` of every child)."""
        return self.start_page + self.num_pages

    def __repr__(self) -> str:
        return (
            f"RadixNode(id={self.node_id}, pages=[{self.start_page}, {self.end_page}), "
            f"lock_ref={self.lock_ref}, last_access={self.last_access})"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class PrefixMatch:
    """Longest cached whole-page prefix of a query.

    `num_tokens` is a multiple of `page_size`; `local_pages[p]` (int32,
    `[num_tokens // page_size]`) is the local page of logical page `p`, in lane
    `p mod cp_size`. `node` is the deepest node of the match (the root when nothing
    matched); pass it to `inc_lock_ref` / `dec_lock_ref`.
    """

    num_tokens: int
    local_pages: Int[np.ndarray, " pages"]
    node: RadixNode

    @property
    def num_pages(self) -> int:
        return int(self.local_pages.size)


class PrefixPeek(NamedTuple):
    """`RadixCache.peek_prefix`: what a cache holds of a prompt, without touching it."""

    pages: int  # whole device pages of the longest cached prefix
    unlocked: int  # of them, in unlocked (evictable) nodes
    host_pages: int  # whole pages after them on the host only (`HiRadixCache`)


class RadixCache:
    """Radix tree of cached whole pages over an `OwnerLaneAllocator` (see module doc).

    The cache owns the pages in its tree: it frees them to their owner lanes when they
    are evicted, when `insert` finds them duplicated, and on `reset`. Sizes are kept per
    lane: evictable (in unlocked nodes) and protected (in locked nodes).
    """

    def __init__(self, allocator: OwnerLaneAllocator, page_size: int):
        if page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.cp_size = allocator.cp_size
        self._next_id = 0
        self._clock = 0
        self._new_tree()

    # --- queries -------------------------------------------------------------------

    @property
    def root(self) -> RadixNode:
        return self._root

    def evictable_pages_per_lane(self) -> Int[np.ndarray, " cp"]:
        """Pages in unlocked nodes per owner lane, `[cp_size]` int64 (a copy).

        Every one of them can be evicted (an unlocked node's subtree is unlocked), so
        free + evictable is a lane's real capacity for new pages (SPEC S10).
        """
        return self._evictable.copy()

    def protected_pages_per_lane(self) -> Int[np.ndarray, " cp"]:
        """Pages in locked nodes per owner lane, `[cp_size]` int64 (a copy)."""
        return self._protected.copy()

    def total_pages_per_lane(self) -> Int[np.ndarray, " cp"]:
        """Pages the cache holds per owner lane, `[cp_size]` int64."""
        return self._evictable + self._protected

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes."""
        return int(self._evictable.sum()) * self.page_size

    def protected_size(self) -> int:
        """Tokens in locked nodes (prefixes of running requests)."""
        return int(self._protected.sum()) * self.page_size

    def total_size(self) -> int:
        """Tokens the cache holds."""
        return self.evictable_size() + self.protected_size()

    # --- match and insert ----------------------------------------------------------

    def match_prefix(self, token_ids: Int[np.ndarray, " n"]) -> PrefixMatch:
        """Longest cached prefix of `token_ids` made of whole pages.

        Only the `len // page_size` whole pages of the query are looked up. A match that
        ends inside an edge splits it at that page boundary, so `node` covers exactly the
        match. Every node on the path gets a fresh access time. The caller that needs at
        least one token to compute passes `token_ids[:-1]`.
        """
        key = self._whole_pages(token_ids)
        self._clock += 1
        node, pos = self._root, 0
        matched: list[np.ndarray] = []
        for child, start, m in self._walk(key, key.size // self.page_size):
            matched.append(child.pages)
            node, pos = child, start + m
        pages = np.concatenate(matched) if matched else np.zeros((0,), dtype=np.int32)
        return PrefixMatch(num_tokens=pos * self.page_size, local_pages=pages, node=node)

    def peek_prefix(self, token_ids: Int[np.ndarray, " n"]) -> PrefixPeek:
        """The whole pages of the longest cached prefix of `token_ids` on the device,
        how many of them sit in unlocked (evictable) nodes, and the whole pages after
        them held on the host only (`HiRadixCache`'s copies, as its `match_prefix` would
        report them; 0 here).

        Read-only (no split, no access time), so a caller can compare caches before it
        picks one (a DP server's ranks): locking that match takes `unlocked` pages out of
        what eviction could free, and host pages need device pages back to be used."""
        key = self._whole_pages(token_ids)
        n_pages = key.size // self.page_size
        node, pos, device, unlocked = self._root, 0, 0, 0
        while pos < n_pages:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            on_device = self._on_device(child) and device == pos  # device pages lead
            if not (on_device or self._host_hit(child)):
                break
            m = self._matching_pages(child, key, pos)
            if on_device:
                device += m
                unlocked += m if child.lock_ref == 0 else 0
            pos += m
            if m < child.num_pages:
                break
            node = child
        return PrefixPeek(device, unlocked, pos - device)

    @staticmethod
    def _host_hit(node: RadixNode) -> bool:
        """Whether `node` is a usable host-only copy (never here: see `HiRadixCache`)."""
        return False

    @staticmethod
    def _on_device(node: RadixNode) -> bool:
        """Whether `node`'s pages are device pages (always here; `HiRadixCache` keeps
        nodes whose copy is on the host only)."""
        return True

    def _walk(self, key: np.ndarray, n_pages: int) -> Iterator[tuple[RadixNode, int, int]]:
        """Descend the cached prefix of `key` (whole pages, up to `n_pages`): yields each
        node on the path as (node, its start page, pages of it that match), splitting a
        node the match ends inside and touching every one (LRU)."""
        node, pos = self._root, 0
        while pos < n_pages:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                return
            m = self._matching_pages(child, key, pos)
            if m < child.num_pages:
                child = self._split(child, m)
            child.last_access = self._clock
            yield child, pos, m
            node, pos = child, pos + m

    def insert(self, token_ids: Int[np.ndarray, " n"], local_pages: Int[np.ndarray, " p"]) -> int:
        """Cache the whole pages of a request; returns how many leading tokens were cached.

        `local_pages[p]` is the request's local page of logical page `p` (lane
        `p mod cp_size`); it may include the partially filled tail page, which is ignored
        (the caller still owns and frees it). Afterwards the cache owns every whole page.
        For the already cached leading pages: a page equal to the cached one is the
        cache's own page (the request matched it) and is left alone; a different page is
        a duplicate (another request cached that prefix first) and is freed here, into
        its owner lane. The return value is page-aligned.
        """
        key = self._whole_pages(token_ids)
        n = key.size // self.page_size
        pages = self._check_pages(
            local_pages, n, pages_for_tokens(np.size(token_ids), self.page_size)
        )
        self._clock += 1
        node, pos = self._root, 0
        dup_lanes: list[np.ndarray] = []
        dup_pages: list[np.ndarray] = []
        for child, start, m in self._walk(key, n):
            differ = np.flatnonzero(pages[start : start + m] != child.pages)
            if differ.size:
                dup_lanes.append(owner_of_page(start + differ, self.cp_size))
                dup_pages.append(pages[start + differ])
            node, pos = child, start + m
        cached = pos
        if dup_pages:
            # Before the new leaf is linked: a bad page raises with the tree unchanged
            # (splits only re-cut edges).
            self.allocator.free(np.concatenate(dup_lanes), np.concatenate(dup_pages))
        if pos < n:
            leaf = self._new_node(key[pos * self.page_size :].copy(), pages[pos:].copy(), pos, node)
            node.children[self._child_key(leaf.tokens, 0)] = leaf
            self._evictable += self._lane_counts(leaf)
        return cached * self.page_size

    # --- locking -------------------------------------------------------------------

    def inc_lock_ref(self, node: RadixNode) -> None:
        """Lock the path root -> `node` against eviction (once per running request)."""
        self._check_live(node)
        while node is not self._root:
            if node.lock_ref == 0:
                counts = self._lane_counts(node)
                self._evictable -= counts
                self._protected += counts
            node.lock_ref += 1
            node = node.parent
            assert node is not None

    def dec_lock_ref(self, node: RadixNode) -> None:
        """Undo one `inc_lock_ref(node)`; nodes whose count reaches 0 become evictable."""
        self._check_live(node)
        if node is not self._root and node.lock_ref <= 0:
            raise ValueError(
                f"dec_lock_ref on unlocked {node!r}: every dec_lock_ref must follow an "
                "inc_lock_ref of the same node"
            )
        while node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                counts = self._lane_counts(node)
                self._protected -= counts
                self._evictable += counts
            node = node.parent
            assert node is not None

    # --- eviction ------------------------------------------------------------------

    def evict(self, pages_needed_per_lane: Int[np.ndarray, " cp"]) -> Int[np.ndarray, " cp"]:
        """Free cached pages until lane `l` has freed `pages_needed_per_lane[l]` pages.

        Least recently used unlocked leaves go first, page by page from their tail, so a
        cached prefix stays a prefix; it stops as soon as every lane's need is met, or
        when nothing evictable is left. Pages of lanes that needed nothing can go too
        when they sit between the tail and a needed page. Returns the pages freed per
        lane, `[cp_size]` int64 (may exceed the need, or fall short of it).
        """
        need = np.asarray(pages_needed_per_lane, dtype=np.int64).reshape(-1)
        if need.shape != (self.cp_size,):
            raise ValueError(
                f"evict needs one page count per lane ({self.cp_size}), got shape {need.shape}"
            )
        need = np.maximum(need, 0)
        freed = np.zeros((self.cp_size,), dtype=np.int64)
        if not need.any():
            return freed
        heap = [(n.last_access, n.node_id, n) for n in self._nodes() if self._is_evictable(n)]
        heapq.heapify(heap)
        gone_lanes: list[np.ndarray] = []
        gone_pages: list[np.ndarray] = []
        while heap and (freed < need).any():
            _, _, leaf = heapq.heappop(heap)
            lanes = self._lanes(leaf)
            # Lane counts after dropping the last k pages, k = 1..n.
            taken = np.cumsum(np.eye(self.cp_size, dtype=np.int64)[lanes[::-1]], axis=0)
            enough = np.flatnonzero((taken >= (need - freed)).all(axis=1))
            k = int(enough[0]) + 1 if enough.size else leaf.num_pages
            keep = leaf.num_pages - k
            gone_lanes.append(lanes[keep:])
            gone_pages.append(leaf.pages[keep:])
            counts = taken[k - 1]
            freed += counts
            self._evictable -= counts
            if keep:
                leaf.tokens = leaf.tokens[: keep * self.page_size].copy()
                leaf.pages = leaf.pages[:keep].copy()
                continue
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.tokens, 0)]
            leaf.parent = None
            if self._is_evictable(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        if gone_pages:
            self.allocator.free(np.concatenate(gone_lanes), np.concatenate(gone_pages))
        logger.debug("evicted %s pages per lane for a need of %s", freed.tolist(), need.tolist())
        return freed

    # --- maintenance ---------------------------------------------------------------

    def reset(self) -> None:
        """Free every cached page to its owner lane and empty the tree.

        Refused while any node is locked: running requests still read those pages.
        """
        if self._protected.any():
            raise ValueError(
                f"reset with {self.protected_size()} tokens locked by running requests; "
                "finish or abort them (dec_lock_ref) first"
            )
        nodes = [n for n in self._nodes() if n is not self._root]
        if nodes:
            self.allocator.free(
                np.concatenate([self._lanes(n) for n in nodes]),
                np.concatenate([n.pages for n in nodes]),
            )
        for n in nodes:
            n.parent = None
        self._new_tree()

    def pretty(self) -> str:
        """The tree as indented text, one node a line (for debugging and test failures)."""
        lines = [
            f"RadixCache(cp_size={self.cp_size}, page_size={self.page_size}, "
            f"evictable={self._evictable.tolist()}, protected={self._protected.tolist()})"
        ]

        def walk(node: RadixNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.node_id):
                lines.append(
                    f"{'  ' * depth}#{child.node_id} pages [{child.start_page}, "
                    f"{child.end_page}) local={child.pages.tolist()} "
                    f"lanes={self._lanes(child).tolist()} tokens={quote(child.tokens)} "
                    f"lock={child.lock_ref} t={child.last_access}"
                )
                walk(child, depth + 1)

        walk(self._root, 1)
        return "\n".join(lines)

    def check_invariants(self) -> None:
        """Raise `AssertionError` naming the first broken tree invariant (debug, tests).

        Checks: each child starts where its parent ends (a shared prefix keeps its
        owners); edges are whole non-empty pages keyed by their first page; lock counts
        are nonnegative and never larger below than above; the per-lane sizes match the
        tree; cached (lane, page) pairs are distinct, not the trash page, and allocated.
        """
        evictable = np.zeros((self.cp_size,), dtype=np.int64)
        protected = np.zeros((self.cp_size,), dtype=np.int64)
        lanes, pages = [], []
        for node in self._nodes():
            for key, child in node.children.items():
                where = f"{child!r} under {node!r}\n{self.pretty()}"
                self._check_edge(node, key, child, where)
                counts = self._lane_counts(child)
                if child.lock_ref:
                    protected += counts
                else:
                    evictable += counts
                lanes.append(self._lanes(child))
                pages.append(child.pages)
        _require(
            np.array_equal(evictable, self._evictable)
            and np.array_equal(protected, self._protected),
            f"per-lane sizes drifted: tree has evictable={evictable.tolist()} "
            f"protected={protected.tolist()}, counters say {self._evictable.tolist()} "
            f"{self._protected.tolist()}",
        )
        if pages:
            lane_arr, page_arr = np.concatenate(lanes), np.concatenate(pages).astype(np.int64)
            _require(not (page_arr == TRASH_PAGE).any(), "the trash page is cached")
            flat = lane_arr * self.allocator.pages_per_lane + page_arr
            _require(np.unique(flat).size == flat.size, "a (lane, page) is cached twice")
            _require(
                self.allocator.allocated_mask()[lane_arr, page_arr].all(),
                "a cached page is free in its owner lane's allocator",
            )

    # --- internals -----------------------------------------------------------------

    def _check_edge(self, node: RadixNode, key: bytes, child: RadixNode, where: str) -> None:
        """The structural invariants of one edge `node -> child` (`check_invariants`)."""
        _require(child.parent is node, f"parent link broken at {where}")
        _require(child.start_page == node.end_page, f"start page != parent end: {where}")
        _require(child.num_pages > 0, f"empty edge {where}")
        _require(
            child.tokens.size == child.num_pages * self.page_size,
            f"edge tokens are not whole pages: {where}",
        )
        _require(key == self._child_key(child.tokens, 0), f"stale child key: {where}")
        _require(child.lock_ref >= 0, f"negative lock count: {where}")
        if node is not self._root:
            _require(child.lock_ref <= node.lock_ref, f"child locked more: {where}")

    def _new_tree(self) -> None:
        self._root = self._new_node(
            np.zeros((0,), dtype=_TOKEN_DTYPE), np.zeros((0,), dtype=np.int32), 0, None
        )
        self._evictable = np.zeros((self.cp_size,), dtype=np.int64)
        self._protected = np.zeros((self.cp_size,), dtype=np.int64)

    def _new_node(
        self, tokens: np.ndarray, pages: np.ndarray, start_page: int, parent: RadixNode | None
    ) -> RadixNode:
        node = RadixNode(self._next_id, tokens, pages, start_page, parent, self._clock)
        self._next_id += 1
        return node

    def _whole_pages(self, token_ids: np.ndarray) -> np.ndarray:
        arr = np.asarray(token_ids)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(
                f"token ids must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}"
            )
        whole = arr.size // self.page_size * self.page_size
        return np.ascontiguousarray(arr[:whole], dtype=_TOKEN_DTYPE)

    def _check_pages(self, local_pages: np.ndarray, whole: int, with_tail: int) -> np.ndarray:
        pages = np.asarray(local_pages)
        if pages.ndim != 1 or (pages.size and not np.issubdtype(pages.dtype, np.integer)):
            raise ValueError(
                f"local pages must be a 1-D integer array, got shape {pages.shape} "
                f"dtype {pages.dtype}"
            )
        if pages.size not in (whole, with_tail):
            raise ValueError(
                f"insert got {pages.size} local pages for {whole} whole pages of tokens "
                f"(page_size={self.page_size}); pass one page per logical page, the partial "
                "tail page optional"
            )
        pages = pages[:whole].astype(np.int32)
        if (pages == TRASH_PAGE).any():
            raise ValueError(
                f"insert got the trash page {TRASH_PAGE} at logical page "
                f"{int(np.flatnonzero(pages == TRASH_PAGE)[0])}; only allocated pages can be cached"
            )
        return pages

    def _child_key(self, tokens: np.ndarray, page: int) -> bytes:
        return tokens[page * self.page_size : (page + 1) * self.page_size].tobytes()

    def _matching_pages(self, child: RadixNode, key: np.ndarray, pos: int) -> int:
        """Leading whole pages of `child`'s edge equal to `key` from logical page `pos`."""
        rest = key[pos * self.page_size :]
        n = min(child.tokens.size, rest.size)
        same = (child.tokens[:n] == rest[:n]).reshape(-1, self.page_size).all(axis=1)
        return int(same.size if same.all() else np.argmin(same))

    def _split(self, child: RadixNode, m: int) -> RadixNode:
        """Cut `child`'s edge after `m` pages; returns the new upper node.

        `child` keeps its identity as the lower part, so a request holding it still
        locks the same path; the upper part inherits the lock count and access time.
        """
        parent = child.parent
        assert parent is not None and 0 < m < child.num_pages
        cut = m * self.page_size
        upper = self._new_node(
            child.tokens[:cut].copy(), child.pages[:m].copy(), child.start_page, parent
        )
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[self._child_key(upper.tokens, 0)] = upper
        child.tokens = child.tokens[cut:].copy()
        child.pages = child.pages[m:].copy()
        child.start_page += m
        child.parent = upper
        upper.children[self._child_key(child.tokens, 0)] = child
        return upper

    def _lanes(self, node: RadixNode) -> np.ndarray:
        """Owner lane of every page of `node`'s edge, `[num_pages]` int64."""
        return owner_of_page(
            np.arange(node.start_page, node.end_page, dtype=np.int64), self.cp_size
        )

    def _lane_counts(self, node: RadixNode) -> np.ndarray:
        return np.bincount(self._lanes(node), minlength=self.cp_size).astype(np.int64)

    def _is_evictable(self, node: RadixNode) -> bool:
        return node is not self._root and node.lock_ref == 0 and not node.children

    def _nodes(self) -> Iterator[RadixNode]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _check_live(self, node: RadixNode) -> None:
        if node is not self._root and node.parent is None:
            raise ValueError(
                f"{node!r} is no longer in the cache (evicted or reset); lock a prefix "
                "right after match_prefix, before anything can evict"
            )


def _require(ok: bool | np.bool_, message: str) -> None:
    if not ok:
        raise AssertionError(message)


# --- request helpers (evict-then-allocate) ------------------------------------------


def table_from_prefix(cache: RadixCache, match: PrefixMatch) -> RequestPageTable:
    """A request page table that starts with the matched prefix's cached pages.

    The pages stay the cache's (lock `match.node` first); `alloc_with_evict` then adds
    the request's own pages from logical page `match.num_pages` on.
    """
    return RequestPageTable.from_prefix(
        cache.cp_size, match.local_pages, match.num_tokens, cache.page_size
    )


def alloc_with_evict(
    cache: RadixCache, table: RequestPageTable, new_num_tokens: int
) -> Int[np.ndarray, " new"]:
    """Grow `table` to `new_num_tokens` tokens, evicting just enough per lane first.

    Each owner lane evicts only its shortfall (pages needed minus free). All-or-nothing:
    when a lane's free plus evictable pages cannot cover its need, raises
    `CacheCapacityError` before evicting anything. Returns the newly allocated logical
    page positions, as `RequestPageTable.extend`.
    """
    allocator = cache.allocator
    if table.cp_size != cache.cp_size:
        raise ValueError(f"table has cp_size={table.cp_size} but the cache {cache.cp_size}")
    if new_num_tokens < table.num_tokens:
        raise ValueError(
            f"alloc_with_evict cannot shrink a request: it holds {table.num_tokens} tokens, "
            f"asked for {new_num_tokens}"
        )
    new_pages = np.arange(
        table.num_pages, pages_for_tokens(new_num_tokens, cache.page_size), dtype=np.int64
    )
    short = np.maximum(
        allocator.pages_needed_per_lane(new_pages) - allocator.num_free_per_lane(), 0
    )
    if short.any():
        evictable = cache.evictable_pages_per_lane()
        over = np.flatnonzero(short > evictable)
        if over.size:
            detail = ", ".join(
                f"lane {int(lane)} is short {int(short[lane])} pages with "
                f"{int(evictable[lane])} evictable"
                for lane in over
            )
            raise CacheCapacityError(
                f"cannot grow a request to {new_num_tokens} tokens even after eviction: "
                f"{detail} (of {allocator.capacity_per_lane} per lane, the rest locked by "
                "running requests); raise the KV pool size or admit fewer requests"
            )
        cache.evict(short)
    return table.extend(allocator, new_num_tokens, cache.page_size)


def cache_finished_request(
    cache: RadixCache, table: RequestPageTable, token_ids: Int[np.ndarray, " n"], node: RadixNode
) -> int:
    """Hand a finished request's KV to the cache and empty its table.

    `token_ids` are the `table.num_tokens` tokens whose KV the table holds; `node` is the
    node locked at admission. Inserts the whole pages (duplicates freed by `insert`),
    frees the partial tail page to its owner lane, unlocks `node`. Returns the tokens
    that were already cached.
    """
    token_ids = np.asarray(token_ids)
    if token_ids.shape != (table.num_tokens,):
        raise ValueError(
            f"the table holds KV of {table.num_tokens} tokens but {token_ids.shape} token "
            "ids were given; pass exactly the tokens whose KV was written"
        )
    local = table.local_pages()
    whole = table.num_tokens // cache.page_size
    cached = cache.insert(token_ids[: whole * cache.page_size], local[:whole])
    tail = np.arange(whole, local.size, dtype=np.int64)
    if tail.size:
        cache.allocator.free(owner_of_page(tail, cache.cp_size), local[whole:])
    cache.dec_lock_ref(node)
    table.detach()  # whole pages now belong to the cache, the tail page was freed
    return cached


def cache_and_relock(
    cache: RadixCache,
    token_ids: Int[np.ndarray, " n"],
    local_pages: Int[np.ndarray, " pages"],
    node: RadixNode,
) -> tuple[RadixNode, Int[np.ndarray, " pages"]]:
    """Cache a running request's whole pages now and move its lock onto them.

    As sglang's `cache_unfinished_req`: `local_pages` hold the KV of `token_ids` (the
    tail page may be partial); its whole pages are inserted, so a later request can match
    them while this one still runs, and the request re-locks the longer cached path
    instead of `node` (locked at admission). Where another request cached the same tokens
    first, `insert` frees this request's duplicate pages; the returned pages are rebuilt
    on the cache's (the KV of the same tokens at the same positions), then its own tail.
    Returns the new locked node and the request's pages from now on.
    """
    whole = len(token_ids) // cache.page_size
    cache.insert(token_ids[: whole * cache.page_size], local_pages[:whole])
    match = cache.match_prefix(token_ids[: whole * cache.page_size])
    assert match.num_pages == whole, "pages inserted a moment ago must match"
    cache.inc_lock_ref(match.node)  # before the old lock goes: nothing can evict between
    cache.dec_lock_ref(node)
    return match.node, np.concatenate([match.local_pages, local_pages[whole:]])
