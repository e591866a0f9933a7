"""The device KV store: a donated pool behind its lock, and the page allocators over it.

Every server path holds its KV through these, so the rule "a step that donates the pool
runs under its lock, and nobody keeps a donated pool" is written once:

- `DevicePool`: one pool (a `KVPool` of device arrays) and the lock its swaps run under.
  `update(step)` runs `step(pool) -> (result, new_pool)` under the lock and keeps the
  new pool. The CP prefill runner's pool is one (`CPPrefillRunner.kv`); its transfer
  reads and host-cache copies take the same lock.
- `KVStore`: what a decode engine needs (the pool, `update_pool`, pages to allocate and
  free, free counts per DP rank). Three implementations:
  - `PagedKVStore`: a `DevicePool` and a `PageAllocator` (one shard per DP rank), the
    decode and plain unified servers'; the transfer receiver commits into it too;
  - `transfer.receiver.Receiver`, which delegates to its `PagedKVStore`;
  - `CachedLaneStore`: a CP runner's pool and owner-lane allocator with its radix cache
    (the unified server's default engine, on one device or a CP mesh), evicting cached
    pages when free ones run out;
  - `DPPrefixStore`: a DP pool with one radix prefix cache per rank over that rank's
    shard (the unified server's default on a `("dp",)` mesh).

The pool and the allocator have a lock each, so a commit scatter (under the pool lock)
never holds up page allocation or a failed room's page release.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np
from jax.typing import DTypeLike

from cpkv_jax.cache.hiradix import (
    BackupJob,
    HiPrefixMatch,
    HiRadixCache,
    LoadBackJob,
    load_host_hit,
)
from cpkv_jax.cache.radix import (
    PrefixMatch,
    RadixCache,
    RadixNode,
    alloc_with_evict,
    cache_and_relock,
    table_from_prefix,
)
from cpkv_jax.config import ModelConfig
from cpkv_jax.decode_mesh import DPPoolLayout
from cpkv_jax.errors import ConfigError
from cpkv_jax.kv_layout import KVLayout
from cpkv_jax.lane_allocator import OwnerLaneAllocator, RequestPageTable
from cpkv_jax.model.kv_cache import IndexKDtype, KVPool, init_pool
from cpkv_jax.paging import TRASH_PAGE, PageAllocator
from cpkv_jax.scores import match_end

T = TypeVar("T")

_HOST_ONLY = "this is a host-only store (pool=None): it has no device pool"


class DevicePool:
    """A device KV pool and the lock its swaps run under (see the module docstring).

    `pool=None` is a host-only holder (a benchmark receiver's): `pool` and `update`
    raise `ValueError`."""

    def __init__(self, pool: KVPool | None):
        self._pool = pool
        self.lock = threading.Lock()

    @property
    def host_only(self) -> bool:
        return self._pool is None

    @property
    def pool(self) -> KVPool:
        """The current pool, read under the lock (so never one an `update` is donating);
        replaced by every `update`: read it again after one."""
        with self.lock:
            return self._locked_pool()

    @property
    def current(self) -> KVPool:
        """The current pool without taking the lock: for a caller that holds `lock`, or
        one on the thread that runs every `update` (the CP runner's scheduler thread)."""
        return self._locked_pool()

    def update(self, step: Callable[[KVPool], tuple[T, KVPool]]) -> T:
        """Run `step(pool) -> (result, new_pool)` under the lock and keep `new_pool`: for
        steps that donate the pool, so no other update runs in between and this holder
        never keeps a donated (deleted) pool."""
        with self.lock:
            result, self._pool = step(self._locked_pool())
            return result

    def replace_locked(self, pool: KVPool) -> None:
        """Keep `pool` as the current one; the caller holds `lock` (a copy that hands
        each leaf over as it lands, `host_cache.copy`)."""
        self._pool = pool

    def _locked_pool(self) -> KVPool:
        if self._pool is None:
            raise ValueError(_HOST_ONLY)
        return self._pool


class _OnDevice:
    """The pool half of a `KVStore`: reads and donating updates through a `DevicePool`."""

    device: DevicePool

    @property
    def pool(self) -> KVPool:
        return self.device.pool

    def update_pool(self, step: Callable[[KVPool], tuple[T, KVPool]]) -> T:
        """`DevicePool.update`: decode steps and commit scatters that donate the pool."""
        return self.device.update(step)


@runtime_checkable
class KVStore(Protocol):
    """The pool and the page allocator a decode engine uses, shared with whoever else
    writes the pool (the transfer receiver, the prefill scheduler). The total page count
    is `pool.num_pages`; page 0, the trash page, is never handed out."""

    @property
    def pool(self) -> KVPool: ...

    @property
    def num_free_pages(self) -> int: ...

    def update_pool(self, step: Callable[[KVPool], tuple[T, KVPool]]) -> T: ...

    @property
    def num_free_pages_per_rank(self) -> tuple[int, ...]: ...

    def allocate_pages(self, n: int, rank: int = 0) -> np.ndarray: ...

    def free_pages(self, pages: np.ndarray) -> None: ...


class PagedKVStore(_OnDevice):
    """A `KVStore` over one `DevicePool` and one `PageAllocator` (one free list per DP
    rank's shard). `pool=None`: host-only (it hands out pages, holds no pool)."""

    def __init__(self, pool: KVPool | DevicePool | None, allocator: PageAllocator):
        # A `DevicePool` is shared with its other holder (a CP decode group's runner).
        device = pool if isinstance(pool, DevicePool) else DevicePool(pool)
        if not device.host_only and allocator.num_pages != device.pool.num_pages:
            raise ConfigError(
                f"allocator manages {allocator.num_pages} pages but the pool has "
                f"{device.pool.num_pages}; build both with the same page count"
            )
        self.device = device
        self._allocator = allocator
        self._alloc_lock = threading.Lock()

    @classmethod
    def create(
        cls,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: DTypeLike,
        index_k_dtype: IndexKDtype,
    ) -> PagedKVStore:
        """A zeroed pool of `num_pages` pages (page 0 = trash) and its allocator."""
        allocator = PageAllocator(num_pages)  # validates num_pages >= 2
        return cls(init_pool(cfg, num_pages, page_size, dtype, index_k_dtype), allocator)

    @property
    def host_only(self) -> bool:
        """True without a pool (`pool=None`)."""
        return self.device.host_only

    @property
    def num_pages(self) -> int:
        """Pages the allocator manages, the trash page included."""
        return self._allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        with self._alloc_lock:
            return self._allocator.num_free

    @property
    def num_free_pages_per_rank(self) -> tuple[int, ...]:
        """Free pages of each DP rank's shard (one entry for a single-device pool)."""
        with self._alloc_lock:
            return self._allocator.num_free_per_rank

    def allocate_pages(self, n: int, rank: int = 0) -> np.ndarray:
        """`n` pages from the allocator (under its lock), all from DP rank `rank`'s shard."""
        with self._alloc_lock:
            return self._allocator.alloc(n, rank)

    def free_pages(self, pages: np.ndarray) -> None:
        """Give pages back (a finished request's, or a failed room's)."""
        with self._alloc_lock:
            self._allocator.free(pages)

    def check_layout(self, want: KVLayout) -> None:
        """Raise `ValueError` unless the pool stores what `want` describes (every kind,
        layer, feature and dtype, and the page size). A host-only store has nothing to
        check."""
        if self.host_only:
            return
        index = want.buffer("index_k")
        try:
            have = KVLayout.of_pool(self.pool, () if index is None else index.layers)
        except ConfigError as e:
            raise ValueError(f"the pool does not match the KV layout: {e}") from e
        diff = have.mismatches(want)
        if diff:
            raise ValueError(
                "the pool differs from the KV layout (pool != layout): " + "; ".join(diff)
            )


class CachedLaneStore(_OnDevice):
    """A `KVStore` over a CP runner's pool (its `DevicePool`: the pool swap under the
    runner's lock, which the host-cache backup worker takes too) and its owner-lane
    allocator, with the radix cache on it: pages come from the free lists, evicting
    unlocked cached pages when the free ones run short.

    One lane (the unified server on one device) or `cp` of them (a unified server on a CP
    mesh, `--cp-size N --enable-cp-shared-kv`): a request's logical page `p` lives on lane
    `p % cp`, so its decode pages are allocated by logical position
    (`allocate_logical`) and the counts are summed over lanes, with `*_per_lane` for
    admission by lane."""

    def __init__(
        self,
        device: DevicePool,
        allocator: OwnerLaneAllocator,
        cache: RadixCache,
        page_size: int,
        pages_per_rank: int,
    ):
        if cache.cp_size != allocator.cp_size:
            raise ValueError(
                f"the cache has {cache.cp_size} lanes but the allocator {allocator.cp_size}"
            )
        self.device = device
        self._allocator = allocator
        self._cache = cache
        self.page_size = page_size
        self.cp_size = allocator.cp_size
        self.pages_per_rank = pages_per_rank  # each lane's shard of the pool, its trash page too

    @property
    def num_free_pages(self) -> int:
        return int(self._allocator.num_free_per_lane().sum())

    @property
    def num_free_pages_per_rank(self) -> tuple[int, ...]:
        return (self.num_free_pages,)  # one DP rank: every lane serves each request

    def available_pages_per_lane(self) -> np.ndarray:
        """Free plus evictable (cached, unlocked) pages of each lane, `[cp]`."""
        return self._allocator.num_free_per_lane() + self._cache.evictable_pages_per_lane()

    @property
    def num_available_pages(self) -> int:
        """Free plus evictable pages over every lane."""
        return int(self.available_pages_per_lane().sum())

    def pages_per_lane(self, first: int, count: int) -> np.ndarray:
        """Pages each lane gives logical pages `[first, first + count)`, `[cp]`."""
        return self._allocator.pages_needed_per_lane(np.arange(first, first + count))

    def allocate_logical(self, first: int, count: int) -> np.ndarray:
        """Local pages for logical pages `[first, first + count)` of one request, page `p`
        on lane `p % cp` (`alloc_with_evict`: all-or-nothing, `CacheCapacityError` with
        nothing evicted when a lane's free plus evictable pages cannot cover it)."""
        table = RequestPageTable.from_prefix(
            self.cp_size, np.zeros(first, np.int32), first * self.page_size, self.page_size
        )
        new = alloc_with_evict(self._cache, table, (first + count) * self.page_size)
        return table.local_pages()[new].astype(np.int64)

    def free_logical(self, first: int, pages: np.ndarray) -> None:
        """Free what `allocate_logical(first, len(pages))` gave."""
        pages = np.asarray(pages, dtype=np.int64)
        if pages.size:
            logical = np.arange(first, first + pages.size)
            self._allocator.free(logical % self.cp_size, pages)

    def global_ids(self, local: np.ndarray) -> np.ndarray:
        """A request's local pages by logical page as global page ids: logical page `p`
        on lane `p % cp` (the pool's global layout, `PoolLayout.global_slots`)."""
        local = np.asarray(local, np.int64)
        return local + (np.arange(local.size) % self.cp_size) * self.pages_per_rank

    def allocate_pages(self, n: int, rank: int = 0) -> np.ndarray:
        """`n` pages of a one-lane store (`allocate_logical` from page 0)."""
        if rank != 0 or self.cp_size != 1:
            raise ValueError(
                f"allocate_pages takes pages of a one-lane store's rank 0 (this store has "
                f"{self.cp_size} lanes, asked for rank {rank}); use allocate_logical"
            )
        return self.allocate_logical(0, n)

    def free_pages(self, pages: np.ndarray) -> None:
        self.free_logical(0, pages)


@dataclasses.dataclass(eq=False)
class PrefixHold:
    """What one request holds of its rank's prefix cache (`DPPrefixStore`): the path to
    `node` locked (its cached leading pages), and its own pages from logical page
    `own_from` on."""

    rank: int
    node: RadixNode
    own_from: int
    host_pages: int = 0  # of the cached pages, loaded back from the rank's host cache


@runtime_checkable
class HostCopies(Protocol):
    """The copies behind one rank's host cache (`serving.prefill.host_cache.HostCacheIO`
    with its `rank`): a cache records jobs, this runs them (see `cache.hiradix`)."""

    @property
    def host_allocators(self) -> list: ...

    def load(self, job: LoadBackJob) -> bool: ...

    def warm(self) -> int: ...

    def snapshot(self, cache: HiRadixCache | None = None) -> dict: ...

    def submit_backups(self, cache: HiRadixCache, jobs: list[BackupJob]) -> None: ...

    def drain(self, cache: HiRadixCache) -> int: ...


class DPPrefixStore(_OnDevice):
    """A `KVStore` over a DP pool with one radix prefix cache per rank (issue 36 item 5).

    Rank `r` holds global pages `[r * pages_per_rank, (r + 1) * pages_per_rank)`, its
    first one its trash page (`decode_mesh.DPPoolLayout`); its free list and radix cache
    speak rank-local ids (a one-lane `OwnerLaneAllocator` and `RadixCache` each), the
    engine global ones. A request's pages are all on one rank, as on a plain DP pool:

    1. `admit(rank, prompt, n_pages)`: the rank's longest cached prefix of
       `prompt[:-1]` (at least one token is computed) is locked and the rest of the
       `n_pages` allocated, evicting that rank's unlocked cached pages when its free ones
       run short (all or nothing);
    2. `hold_prompt` after its prefill: the prompt's whole pages go into the cache at
       once, locked (a request arriving meanwhile matches them), as the prefill
       scheduler's `hold_finished` does;
    3. `release` when it ends: its own pages are freed, the prefix unlocked (cached,
       evictable).

    With `host` (one `HostCopies` per rank, `--enable-hierarchical-cache`) each rank's
    cache is a `HiRadixCache` over its own host pool: pages are backed up by
    `write_policy`, and `admit` loads the prompt's host continuation back into the
    rank's shard first when the rank's free and evictable pages cover it and the rest
    of the request (SPEC S10), else the request recomputes it; `sync_host` (once a step)
    applies finished backups and queues new ones.

    The lock keeps the counters consistent for stats readers on other threads; only the
    engine's thread changes the caches."""

    def __init__(
        self,
        pool: KVPool | DevicePool | None,
        layout: DPPoolLayout,
        host: Sequence[HostCopies] | None = None,
        write_policy: str = "write_through_selective",
    ):
        device = pool if isinstance(pool, DevicePool) else DevicePool(pool)
        if not device.host_only and device.pool.num_pages != layout.global_pages:
            raise ConfigError(
                f"the pool has {device.pool.num_pages} pages, not {layout.dp_size} ranks x "
                f"{layout.pages_per_rank}; build both from the same layout"
            )
        self.device = device
        self.layout = layout
        self.ranks = layout.dp_size
        self.page_size = layout.page_size
        self._allocators = [
            OwnerLaneAllocator(1, layout.pages_per_rank) for _ in range(layout.dp_size)
        ]
        if host is not None and len(host) != layout.dp_size:
            raise ConfigError(f"{len(host)} host caches for {layout.dp_size} DP ranks")
        # With a host cache per rank (`--enable-hierarchical-cache`), each rank's cache
        # keeps copies of its pages in its own host pool and loads hits back.
        self.host = None if host is None else list(host)
        self.caches: list[RadixCache] = [
            RadixCache(a, layout.page_size)
            if host is None
            else HiRadixCache(
                a, layout.page_size, host[r].host_allocators, write_policy=write_policy
            )
            for r, a in enumerate(self._allocators)
        ]
        self.host_hit_tokens = 0  # prompt tokens loaded back from the host caches
        self.skipped_load_backs = 0  # host hits not loaded back (no room): recomputed
        self._lock = threading.RLock()

    # ---- counts ----------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return sum(self.num_free_pages_per_rank)

    @property
    def num_free_pages_per_rank(self) -> tuple[int, ...]:
        """Free pages of each rank (cached ones not counted: `cached_pages_per_rank`)."""
        with self._lock:
            return tuple(a.num_free(0) for a in self._allocators)

    def cached_pages_per_rank(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(int(c.total_pages_per_lane()[0]) for c in self.caches)

    def peek(
        self, rank: int, prompt: np.ndarray, score_from: int | None = None
    ) -> tuple[int, int, int]:
        """`(cached, capacity, host)` for a request whose prompt is `prompt` on `rank`:
        the leading pages of it the rank caches (`scores.match_end`: at least the last
        token is computed, and every token a prompt scored from `score_from` needs), the
        pages the rank can give it beyond them (free, plus evictable pages other than
        that prefix), and the pages after the cached ones its host cache holds (0
        without one). One read-only walk of the rank's tree."""
        with self._lock:
            cache = self.caches[rank]
            peek = cache.peek_prefix(prompt[: match_end(len(prompt), score_from)])
            free = self._allocators[rank].num_free(0)
            evictable = int(cache.evictable_pages_per_lane()[0])
            return peek.pages, free + evictable - peek.unlocked, peek.host_pages

    # ---- one request's pages ---------------------------------------------------------
    def admit(
        self, rank: int, prompt: np.ndarray, n_pages: int, score_from: int | None = None
    ) -> tuple[np.ndarray, PrefixHold]:
        """Global pages `[n_pages]` for a request on `rank`: its cached prefix first
        (locked; as `peek` counts it), then its own (see the class docstring);
        `CacheCapacityError` with nothing held when the rank cannot give them. The hold's
        `own_from * page_size` prompt tokens need no prefill."""
        with self._lock:
            cache = self.caches[rank]
            match = cache.match_prefix(prompt[: match_end(len(prompt), score_from)])
            cache.inc_lock_ref(match.node)  # before anything can evict it
            used = match if self.host is None else self._load_back(rank, match, n_pages)
            table = table_from_prefix(cache, used)
            try:
                alloc_with_evict(cache, table, n_pages * self.page_size)
            except BaseException:
                cache.dec_lock_ref(used.node)
                raise
            finally:
                self._submit_backups(rank)  # evictions may write back
            local = table.detach()
            host_pages = used.num_pages - match.num_pages
            self.host_hit_tokens += host_pages * self.page_size
        return self._global(rank, local), PrefixHold(rank, used.node, used.num_pages, host_pages)

    def _load_back(self, rank: int, match: PrefixMatch, n_pages: int) -> PrefixMatch:
        """The rank's host hit beyond `match` (locked) loaded back when the rank's free
        and evictable pages cover it and the rest of the request's `n_pages` (SPEC
        S10); the longer match, locked in its place, or `match` (the request recomputes:
        no room, or the copy failed)."""
        cache = self.caches[rank]
        assert isinstance(cache, HiRadixCache) and isinstance(match, HiPrefixMatch)
        assert self.host is not None
        rest = n_pages - match.num_pages - match.host_pages.size
        plan = cache.plan_load_back(match, reserve_per_lane=np.asarray([max(rest, 0)]))
        used, outcome = load_host_hit(cache, plan, self.host[rank].load)
        self.skipped_load_backs += outcome == "skipped" and match.host_node is not None
        return used

    def _submit_backups(self, rank: int) -> None:
        cache = self.caches[rank]
        if self.host is not None and isinstance(cache, HiRadixCache):
            self.host[rank].submit_backups(cache, cache.take_backups())

    def sync_host(self) -> None:
        """Apply the ranks' finished backups, then queue their new ones (the engine's
        thread, once a step; no-op without a host cache)."""
        if self.host is None:
            return
        with self._lock:
            for rank, io in enumerate(self.host):
                cache = self.caches[rank]
                assert isinstance(cache, HiRadixCache)
                io.drain(cache)
                self._submit_backups(rank)

    def hold_prompt(self, hold: PrefixHold, prompt: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """After the request's prefill: cache its prompt's whole pages, locked by it; its
        pages from then on (the cache's where another request cached the same tokens
        first: `insert` freed the duplicates, and the KV is the same)."""
        with self._lock:
            hold.node, local = cache_and_relock(
                self.caches[hold.rank], prompt, self._local(hold.rank, pages), hold.node
            )
            hold.own_from = len(prompt) // self.page_size
            self._submit_backups(hold.rank)  # a write-through policy backs up new pages
        return self._global(hold.rank, local)

    def release(self, hold: PrefixHold, pages: np.ndarray) -> None:
        """The request ended: its own pages freed, its cached prefix unlocked."""
        with self._lock:
            own = self._local(hold.rank, pages)[hold.own_from :]
            self._allocators[hold.rank].free(np.zeros(own.size, np.int64), own)
            self.caches[hold.rank].dec_lock_ref(hold.node)

    def reset_caches(self) -> None:
        """Drop every rank's cache (a server that stopped: free == total unless leaked;
        with a host cache, once its copies were closed: their jobs are acknowledged
        here first)."""
        self.sync_host()
        with self._lock:
            for cache in self.caches:
                cache.reset()

    # ---- KVStore: pages without the cache (the warm-up probe's) ---------------------
    def allocate_pages(self, n: int, rank: int = 0) -> np.ndarray:
        """`n` pages of `rank` for a request that caches nothing, evicting when needed."""
        with self._lock:
            table = RequestPageTable.from_prefix(1, np.zeros(0, np.int32), 0, self.page_size)
            try:
                alloc_with_evict(self.caches[rank], table, n * self.page_size)
            finally:
                self._submit_backups(rank)
            return self._global(rank, table.detach())

    def free_pages(self, pages: np.ndarray) -> None:
        """Give back pages `allocate_pages` gave (any ranks')."""
        pages = np.asarray(pages, np.int64).reshape(-1)
        with self._lock:
            ranks = pages // self.layout.pages_per_rank
            for rank in np.unique(ranks):
                local = self._local(int(rank), pages[ranks == rank])
                self._allocators[int(rank)].free(np.zeros(local.size, np.int64), local)

    def _global(self, rank: int, local: np.ndarray) -> np.ndarray:
        return np.asarray(local, np.int64) + rank * self.layout.pages_per_rank

    def _local(self, rank: int, pages: np.ndarray) -> np.ndarray:
        local = self.layout.local(np.asarray(pages, np.int64), rank)
        if (local == TRASH_PAGE).any():
            raise ValueError(f"pages {np.asarray(pages).tolist()} include rank {rank}'s trash page")
        return local
