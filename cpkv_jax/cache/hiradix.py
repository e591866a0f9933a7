"""Hierarchical (device + host) radix prefix cache over owner-lane pages (host-side numpy).

A `RadixCache` whose nodes may also, or only, hold a host (L2) copy of their pages, after
SGLang's `HiRadixCache`. Host pages come from one `HostPageAllocator` per owner lane: the
host copy of logical page `p` lives in the host pool of lane `p mod cp_size`, the lane
that owns its device page (SPEC S4.5). Every node is in one of these states:

- device only (`on_device`, `host_pages is None`);
- device + host (`on_device`, `host_pages` set): device eviction keeps it as host only;
- host only (`not on_device`, `host_pages` set): matched as a host hit, loadable back;
- in transit: a write-back backup of an evicted node is in flight (`backup_job` set,
  neither copy usable yet). A request that recomputed its pages and finishes puts it
  back on the device with its own pages (`insert`); the job still owns and frees the
  old ones.

Device-resident nodes are prefix-closed (a device node's parent is the root or on device),
so a match is a device prefix followed by a host-only continuation.

**The cache never copies data.** It records jobs the caller executes, then acknowledges:
- `BackupJob` (device -> host) from `take_backups()`; `backup_done(job)` or
  `backup_failed(job)` (frees the host pages);
- `LoadBackJob` (host -> device) from `load_back(plan)`; `load_back_done(job)` or
  `load_back_failed(job)` (frees the device pages: the caller recomputes).
A job locks its nodes' path (`lock_ref`) while in flight, so nothing it reads or writes is
evicted. A backup that cannot get host pages (even after host eviction) is dropped and
counted in `dropped_backups`; it never blocks.

Write policies (SGLang's names): `write_through` backs up every inserted node right away;
`write_through_selective` backs up a node once its hit count (1 on insert, +1 each later
insert of a request that reuses it) reaches `write_through_threshold` (default 2);
`write_back` backs up only on device eviction. Under `write_back` the evicted pages belong
to the backup job until it is acknowledged, so `evict` does not count them as freed.

Host-hit load-back (SPEC S10): `plan_load_back` loads a host hit only if, for every owner
lane its pages land in, free **plus evictable** device pages cover the lane's share;
`load_back` then allocates in the owner lanes, evicting as needed, and returns `None`
(skip, recompute) if that fails. `LoadBackPlan.cached_tokens` is the request's cached
tokens after planning (device hits + host hits that will be loaded back, SPEC S7).

Request lifecycle:
1. `match = cache.match_prefix(tokens)`; lock `match.node` at once (`inc_lock_ref`);
2. `plan = cache.plan_load_back(match)`; count `plan.cached_tokens` (S7);
3. `used, outcome = load_host_hit(cache, plan, copy)`: `load_back`, the caller's copy of
   `job.per_lane()` host -> device, `load_back_done` with the lock moved onto the longer
   match (or `load_back_failed`: `match` stays used and locked); build the table from
   `used` (`table_from_prefix`);
4. grow with `alloc_with_evict`, finish with `cache_finished_request` (both from
   `cache.radix`, which work unchanged on this cache); run `take_backups()` after
   inserts and evictions.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import numpy as np
from jaxtyping import Int

from cpkv_jax.cache.radix import PrefixMatch, RadixCache, RadixNode, _require
from cpkv_jax.errors import ConfigError
from cpkv_jax.host_cache.pool import HOST_TRASH_PAGE, HostPageAllocator, token_indices_of_pages
from cpkv_jax.lane_allocator import OwnerLaneAllocator
from cpkv_jax.paging import TRASH_PAGE, owner_of_page, pages_for_tokens

logger = logging.getLogger(__name__)

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_through_selective", "write_back")


class HiRadixNode(RadixNode):
    """A `RadixNode` with a device / host residency (see the module docstring).

    `pages` are the device local pages while `on_device`, placeholders (trash page)
    otherwise; `host_pages` (`[num_pages]` int64, lane of page `i` is
    `(start_page + i) mod cp_size`) is the completed host copy or `None`.
    """

    __slots__ = ("backup_job", "hit_count", "host_pages", "load_job", "on_device")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_device = True
        self.host_pages: np.ndarray | None = None
        self.hit_count = 0
        self.backup_job: BackupJob | None = None
        self.load_job: LoadBackJob | None = None

    @property
    def state(self) -> str:
        if self.backup_job is not None and not self.on_device:
            return "in_transit"
        if self.on_device:
            return "device+host" if self.host_pages is not None else "device"
        return "host"


@dataclasses.dataclass(frozen=True, eq=False)
class _CopyJob:
    """Pages `[start_page, start_page + n)` of the path ending at `node` (deepest)."""

    job_id: int
    node: HiRadixNode
    start_page: int
    device_pages: Int[np.ndarray, " n"]  # int32 device local pages, by logical page
    host_pages: Int[np.ndarray, " n"]  # int64 host pages, by logical page
    cp_size: int

    @property
    def num_pages(self) -> int:
        return int(self.device_pages.size)

    @property
    def lanes(self) -> Int[np.ndarray, " n"]:
        return owner_of_page(
            np.arange(self.start_page, self.start_page + self.num_pages, dtype=np.int64),
            self.cp_size,
        )

    def per_lane(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """`(lane, device local pages, host pages)` for every lane involved, page-paired."""
        lanes = self.lanes
        return [
            (int(lane), self.device_pages[lanes == lane], self.host_pages[lanes == lane])
            for lane in np.unique(lanes)
        ]

    def token_indices(self, page_size: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """`(lane, device token indices, host token indices)` for `host_cache.copy`."""
        return [
            (lane, token_indices_of_pages(d, page_size), token_indices_of_pages(h, page_size))
            for lane, d, h in self.per_lane()
        ]


@dataclasses.dataclass(frozen=True, eq=False)
class BackupJob(_CopyJob):
    """Copy device -> host. `frees_device`: a write-back of an evicted node; the job owns
    `device_pages` and frees them on acknowledgement."""

    frees_device: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class LoadBackJob(_CopyJob):
    """Copy host -> device into freshly allocated `device_pages` (owned by the job)."""


@dataclasses.dataclass(frozen=True, eq=False)
class HiPrefixMatch(PrefixMatch):
    """A `PrefixMatch` (the device part) plus the host-only continuation beyond it.

    `host_node` is the deepest host node (`None` without a host hit); `host_pages[i]` is
    the host page of logical page `num_pages + i`; `host_pages_per_lane` counts them.
    """

    host_node: HiRadixNode | None = None
    host_num_tokens: int = 0
    host_pages: Int[np.ndarray, " h"] = dataclasses.field(
        default_factory=lambda: np.zeros((0,), dtype=np.int64)
    )
    host_pages_per_lane: Int[np.ndarray, " cp"] = dataclasses.field(
        default_factory=lambda: np.zeros((0,), dtype=np.int64)
    )


@dataclasses.dataclass(frozen=True, eq=False)
class LoadBackPlan:
    """Whether `match`'s host hit is loaded back (SPEC S10); `reason` says why not."""

    match: HiPrefixMatch
    load: bool
    pages_per_lane: Int[np.ndarray, " cp"]  # device pages each lane must supply
    capacity_per_lane: Int[np.ndarray, " cp"]  # free + evictable (excl. the match's path)
    reason: str | None = None

    @property
    def load_tokens(self) -> int:
        return self.match.host_num_tokens if self.load else 0

    @property
    def cached_tokens(self) -> int:
        """Device hits + host hits that will be loaded back (the prefix length, S7)."""
        return self.match.num_tokens + self.load_tokens


class HiRadixCache(RadixCache):
    """Device radix cache plus per-lane host copies (see the module docstring).

    `host` is the host pages per lane (one `HostPageAllocator(host)` per owner lane) or
    the lanes' allocators (e.g. `[pool.allocator for pool in host_pools.lanes]`).
    """

    def __init__(
        self,
        allocator: OwnerLaneAllocator,
        page_size: int,
        host: int | Sequence[HostPageAllocator],
        *,
        write_policy: str = "write_through_selective",
        write_through_threshold: int = 2,
    ):
        if write_policy not in WRITE_POLICIES:
            raise ConfigError(f"unknown write policy {write_policy!r}; use one of {WRITE_POLICIES}")
        if write_through_threshold < 1:
            raise ConfigError(
                f"write_through_threshold must be >= 1, got {write_through_threshold}"
            )
        super().__init__(allocator, page_size)
        if isinstance(host, int):
            self.host_allocators = tuple(HostPageAllocator(host) for _ in range(self.cp_size))
        else:
            self.host_allocators = tuple(host)
        if len(self.host_allocators) != self.cp_size:
            raise ConfigError(
                f"{len(self.host_allocators)} host allocators for {self.cp_size} owner lanes; "
                "pass one per lane (SPEC S4.5)"
            )
        self.write_policy = write_policy
        self.threshold = 1 if write_policy == "write_through" else write_through_threshold
        self.dropped_backups = 0
        self.skipped_load_backs = 0
        self._job_ids = itertools.count()
        self._jobs: dict[int, BackupJob | LoadBackJob] = {}
        self._queue: list[BackupJob] = []

    # --- queries -------------------------------------------------------------------

    def host_free_per_lane(self) -> Int[np.ndarray, " cp"]:
        return np.asarray([a.num_free for a in self.host_allocators], dtype=np.int64)

    def in_flight_jobs(self) -> list[BackupJob | LoadBackJob]:
        return list(self._jobs.values())

    def take_backups(self) -> list[BackupJob]:
        """Backups recorded since the last call (in order); the caller copies each and
        acknowledges it with `backup_done` or `backup_failed`."""
        out, self._queue = self._queue, []
        return out

    def host_size(self) -> int:
        """Tokens with a completed host copy."""
        return (
            sum(int(n.host_pages.size) for n in self._nodes() if n.host_pages is not None)
            * self.page_size
        )

    # --- match and insert ----------------------------------------------------------

    def match_prefix(self, token_ids: Int[np.ndarray, " n"]) -> HiPrefixMatch:
        """Device-resident prefix (as `RadixCache.match_prefix`) and, beyond it, the
        host-only continuation (nodes whose completed copy is on host only and that no
        load-back is filling). Touches (LRU) and splits like the device cache."""
        key = self._whole_pages(token_ids)
        self._clock += 1
        node, pos = self._root, 0
        host_node, host_end = None, 0
        dev: list[np.ndarray] = []
        host: list[np.ndarray] = []
        for child, start, m in self._walk(key, key.size // self.page_size):
            if host_node is None and child.on_device:
                dev.append(child.pages)
                node, pos = child, start + m
                continue
            if not self._host_hit(child):
                break
            host.append(child.host_pages)
            host_node, host_end = child, start + m
        lanes = owner_of_page(np.arange(pos, max(pos, host_end), dtype=np.int64), self.cp_size)
        return HiPrefixMatch(
            num_tokens=pos * self.page_size,
            local_pages=np.concatenate(dev) if dev else np.zeros((0,), dtype=np.int32),
            node=node,
            host_node=host_node,
            host_num_tokens=max(host_end - pos, 0) * self.page_size,
            host_pages=np.concatenate(host) if host else np.zeros((0,), dtype=np.int64),
            host_pages_per_lane=np.bincount(lanes, minlength=self.cp_size).astype(np.int64),
        )

    def insert(self, token_ids: Int[np.ndarray, " n"], local_pages: Int[np.ndarray, " p"]) -> int:
        """`RadixCache.insert`, plus: nodes on the path that are off the device adopt the
        request's pages (it recomputed them) and go back on the device: host-only nodes
        become device + host; a node a write-back backup or a load-back is filling keeps
        its job, which frees its own device pages on acknowledgement. Reused device nodes
        count a hit (write policies); the new leaf is backed up per the policy.

        So every whole page of the request ends up cached: a request held after its
        step (`PrefillScheduler._hold`) finds all of them on the device.
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
        reused: list[HiRadixNode] = []
        adopt: list[tuple[HiRadixNode, np.ndarray]] = []
        for child, start, m in self._walk(key, n):
            if child.on_device:
                differ = np.flatnonzero(pages[start : start + m] != child.pages)
                if differ.size:
                    dup_lanes.append(owner_of_page(start + differ, self.cp_size))
                    dup_pages.append(pages[start + differ])
                reused.append(child)
            else:
                # Off the device (device residency is prefix-closed, so so is the rest
                # of the path): host only, or in a job's hands. Freeing the request's
                # pages here instead would leave a held request without its KV.
                adopt.append((child, pages[start : start + m].copy()))
            node, pos = child, start + m
        cached = pos
        if dup_pages:
            self.allocator.free(np.concatenate(dup_lanes), np.concatenate(dup_pages))
        for child, own in adopt:
            self._put_on_device(child, own)
        for child in reused:
            self._hit(child)
        if pos < n:
            leaf = self._new_node(key[pos * self.page_size :].copy(), pages[pos:].copy(), pos, node)
            node.children[self._child_key(leaf.tokens, 0)] = leaf
            self._evictable += self._lane_counts(leaf)
            self._hit(leaf)
        return cached * self.page_size

    # --- eviction ------------------------------------------------------------------

    def evict(self, pages_needed_per_lane: Int[np.ndarray, " cp"]) -> Int[np.ndarray, " cp"]:
        """Free device pages until lane `l` has freed `pages_needed_per_lane[l]` (LRU over
        unlocked device leaves, page by page from the tail as `RadixCache.evict`).

        An evicted node with a host copy stays as host only. One without: under
        `write_back` it is backed up first (its pages go to the job, freed on
        acknowledgement and not counted here), else, or when no host pages are free, it
        is removed (with its host-only subtree) and, under `write_back`, counted in
        `dropped_backups`. Returns the device pages freed now per lane.
        """
        need = self._need(pages_needed_per_lane)
        freed = np.zeros((self.cp_size,), dtype=np.int64)
        if not need.any():
            return freed
        heap = [(n.last_access, n.node_id, n) for n in self._nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        gone_lanes: list[np.ndarray] = []
        gone_pages: list[np.ndarray] = []
        while heap and (freed < need).any():
            _, _, leaf = heapq.heappop(heap)
            if leaf.parent is None or not self._device_leaf(leaf):
                continue
            lanes = self._lanes(leaf)
            taken = np.cumsum(np.eye(self.cp_size, dtype=np.int64)[lanes[::-1]], axis=0)
            enough = np.flatnonzero((taken >= (need - freed)).all(axis=1))
            k = int(enough[0]) + 1 if enough.size else leaf.num_pages
            if k < leaf.num_pages:
                self._split(leaf, leaf.num_pages - k)  # `leaf` keeps the last k pages
            counts = self._lane_counts(leaf)
            self._evictable -= counts
            pages = leaf.pages
            parent = leaf.parent
            assert parent is not None
            leaf.on_device = False
            leaf.pages = np.zeros_like(pages)
            if leaf.host_pages is not None:
                gone_lanes.append(self._lanes(leaf))
                gone_pages.append(pages)
                freed += counts
            elif self.write_policy == "write_back" and self._start_backup(leaf, pages, True):
                pass
            else:
                if self.write_policy == "write_back":
                    self.dropped_backups += 1
                gone_lanes.append(self._lanes(leaf))
                gone_pages.append(pages)
                freed += counts
                self._remove_subtree(leaf)
            if self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        if gone_pages:
            self.allocator.free(np.concatenate(gone_lanes), np.concatenate(gone_pages))
        logger.debug("evicted %s device pages per lane for %s", freed.tolist(), need.tolist())
        return freed

    def evict_host(self, pages_needed_per_lane: Int[np.ndarray, " cp"]) -> Int[np.ndarray, " cp"]:
        """Free host pages until lane `l` has freed `pages_needed_per_lane[l]`: LRU over
        unlocked host-only leaves, whole nodes. Returns the host pages freed per lane."""
        need = self._need(pages_needed_per_lane)
        freed = np.zeros((self.cp_size,), dtype=np.int64)
        if not need.any():
            return freed
        heap = [(n.last_access, n.node_id, n) for n in self._nodes() if self._host_leaf(n)]
        heapq.heapify(heap)
        while heap and (freed < need).any():
            _, _, leaf = heapq.heappop(heap)
            if leaf.parent is None or not self._host_leaf(leaf):
                continue
            parent = leaf.parent
            freed += self._lane_counts_all(leaf)
            self._remove_subtree(leaf)
            if self._host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    # --- backups -------------------------------------------------------------------

    def backup_done(self, job: BackupJob) -> None:
        """The caller copied `job`: its nodes now hold the host copy (a write-back frees
        its device pages)."""
        self._finish(job, BackupJob)
        for node, sl in self._chain(job):
            node.backup_job = None
            node.host_pages = job.host_pages[sl].copy()
        if job.frees_device:
            self.allocator.free(job.lanes, job.device_pages)
        self.dec_lock_ref(job.node)

    def backup_failed(self, job: BackupJob) -> None:
        """The copy of `job` failed or was abandoned: its host pages are freed; a
        write-back's nodes with no copy left anywhere (not put back on the device by a
        request's `insert` meanwhile) leave the tree."""
        self._finish(job, BackupJob)
        chain = self._chain(job)
        for node, _ in chain:
            node.backup_job = None
        self._free_host(job.lanes, job.host_pages)
        self.dec_lock_ref(job.node)
        if job.frees_device:
            self.allocator.free(job.lanes, job.device_pages)
            # Adopted nodes are a top part of the chain (device residency is prefix-closed).
            gone = [node for node, _ in chain if not node.on_device]
            if gone:
                self._remove_subtree(gone[0])

    # --- load-back (SPEC S10) ------------------------------------------------------

    def plan_load_back(
        self,
        match: HiPrefixMatch,
        device_free_per_lane: Int[np.ndarray, " cp"] | None = None,
        *,
        reserve_per_lane: Int[np.ndarray, " cp"] | None = None,
    ) -> LoadBackPlan:
        """Decide whether `match`'s host hit is loaded back (SPEC S10).

        Loaded only if, in every owner lane, `device_free_per_lane` (default: the
        allocator's) plus evictable device pages (minus the unlocked pages of the match's
        own path, which the load locks) cover the host pages landing there plus
        `reserve_per_lane` (e.g. pages the caller keeps for the rest of the request).
        """
        need = match.host_pages_per_lane.copy()
        if need.size == 0:
            need = np.zeros((self.cp_size,), dtype=np.int64)
        free = (
            self.allocator.num_free_per_lane()
            if device_free_per_lane is None
            else np.asarray(device_free_per_lane, dtype=np.int64).reshape(self.cp_size)
        )
        own = np.zeros((self.cp_size,), dtype=np.int64)
        n = match.node
        while n is not self._root and n.parent is not None:
            if n.lock_ref == 0:
                own += self._lane_counts(n)
            n = n.parent
        capacity = free + np.maximum(self._evictable - own, 0)
        want = need + (0 if reserve_per_lane is None else np.asarray(reserve_per_lane))
        if match.host_node is None or not need.any():
            return LoadBackPlan(match, False, need, capacity, "no host hit")
        short = np.flatnonzero(want > capacity)
        if short.size:
            reason = ", ".join(
                f"lane {int(lane)} needs {int(want[lane])} pages but has {int(free[lane])} "
                f"free + {int(capacity[lane] - free[lane])} evictable"
                for lane in short
            )
            return LoadBackPlan(match, False, need, capacity, reason)
        return LoadBackPlan(match, True, need, capacity)

    def load_back(self, plan: LoadBackPlan) -> LoadBackJob | None:
        """Allocate device pages for a planned load-back in the owner lanes, evicting as
        needed; returns the job (copy `job.per_lane()` host -> device, then
        `load_back_done`), or `None` (skip: recompute) when the plan said no, the match
        went stale, or allocation fails even after eviction (nothing changed then)."""
        if not plan.load:
            return None
        match = plan.match
        host_node = match.host_node
        assert host_node is not None
        start = match.num_pages
        chain = self._path_between(match.node, host_node, start)
        if chain is None:
            self.skipped_load_backs += 1
            return None
        self.inc_lock_ref(host_node)
        logical = np.arange(start, host_node.end_page, dtype=np.int64)
        need = self.allocator.pages_needed_per_lane(logical)
        short = np.maximum(need - self.allocator.num_free_per_lane(), 0)
        if (short > self._evictable).any():
            self.dec_lock_ref(host_node)
            self.skipped_load_backs += 1
            return None
        if short.any():
            self.evict(short)
        if not self.allocator.can_allocate(logical):
            self.dec_lock_ref(host_node)
            self.skipped_load_backs += 1
            return None
        device = self.allocator.allocate(logical)
        host = np.concatenate([n.host_pages for n in chain])
        job = LoadBackJob(next(self._job_ids), host_node, start, device, host, self.cp_size)
        self._jobs[job.job_id] = job
        for n in chain:
            n.load_job = job
        return job

    def load_back_done(self, job: LoadBackJob) -> PrefixMatch:
        """The caller copied `job`: its nodes are device + host (a node a request's
        `insert` already put back on the device keeps those pages; the job's are freed).
        Returns the device match of the whole path (lock its `node` at once, as after
        `match_prefix`)."""
        self._finish(job, LoadBackJob)
        spare: list[np.ndarray] = []
        for node, sl in self._chain(job):
            node.load_job = None
            if node.on_device:
                spare.append(np.arange(job.start_page + sl.start, job.start_page + sl.stop))
            else:
                self._put_on_device(node, job.device_pages[sl].copy())
        if spare:
            logical = np.concatenate(spare)
            self.allocator.free(
                owner_of_page(logical, self.cp_size),
                job.device_pages[logical - job.start_page],
            )
        self.dec_lock_ref(job.node)
        path = []
        n = job.node
        while n is not self._root:
            path.append(n.pages)
            n = n.parent
        pages = np.concatenate(path[::-1]) if path else np.zeros((0,), dtype=np.int32)
        return PrefixMatch(num_tokens=pages.size * self.page_size, local_pages=pages, node=job.node)

    def load_back_failed(self, job: LoadBackJob) -> None:
        """The copy of `job` failed or was abandoned: its device pages are freed and its
        nodes stay host only (the caller recomputes)."""
        self._finish(job, LoadBackJob)
        for node, _ in self._chain(job):
            node.load_job = None
        self.allocator.free(job.lanes, job.device_pages)
        self.dec_lock_ref(job.node)

    # --- maintenance ---------------------------------------------------------------

    def reset(self) -> None:
        """Free every device and host page the tree holds and empty it. Refused while
        any node is locked or any job is in flight."""
        if self._jobs or any(n.lock_ref for n in self._nodes() if n is not self._root):
            raise ValueError(
                f"reset with {len(self._jobs)} copy job(s) in flight or locked nodes; "
                "acknowledge the jobs and finish or abort the requests first"
            )
        nodes = [n for n in self._nodes() if n is not self._root]
        dev = [n for n in nodes if n.on_device]
        if dev:
            self.allocator.free(
                np.concatenate([self._lanes(n) for n in dev]),
                np.concatenate([n.pages for n in dev]),
            )
        backed = [n for n in nodes if n.host_pages is not None]
        if backed:
            self._free_host(
                np.concatenate([self._lanes(n) for n in backed]),
                np.concatenate([n.host_pages for n in backed]),
            )
        for n in nodes:
            n.parent = None
        self._queue = []
        self._new_tree()

    def pretty(self) -> str:
        lines = [
            f"HiRadixCache(cp_size={self.cp_size}, page_size={self.page_size}, "
            f"policy={self.write_policy}, evictable={self._evictable.tolist()}, "
            f"protected={self._protected.tolist()}, host_free={self.host_free_per_lane().tolist()})"
        ]

        def walk(node: HiRadixNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.node_id):
                host = None if child.host_pages is None else child.host_pages.tolist()
                lines.append(
                    f"{'  ' * depth}#{child.node_id} {child.state} pages [{child.start_page}, "
                    f"{child.end_page}) dev={child.pages.tolist()} host={host} "
                    f"lock={child.lock_ref} hits={child.hit_count} t={child.last_access}"
                    + (" +backup" if child.backup_job else "")
                    + (" +load" if child.load_job else "")
                )
                walk(child, depth + 1)

        walk(self._root, 1)
        return "\n".join(lines)

    def check_invariants(
        self, request_pages: Iterable[tuple[np.ndarray, np.ndarray]] | None = None
    ) -> None:
        """Raise `AssertionError` naming the first broken invariant (debug, tests).

        Tree structure as `RadixCache.check_invariants`; device residency is
        prefix-closed; per-lane counters match the device pages of the tree; every host
        page is free xor held by exactly one node or in-flight backup job, and every
        device page held by the tree or a job is allocated and held once. With
        `request_pages` (`(lanes, local pages)` of pages requests own, not the cache's),
        every allocated device page is held by exactly one node, job or request.
        """
        try:
            self._check(request_pages)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.pretty()}") from None

    def _check(self, request_pages) -> None:
        cp = self.cp_size
        evictable = np.zeros((cp,), dtype=np.int64)
        protected = np.zeros((cp,), dtype=np.int64)
        dev_l: list[np.ndarray] = []
        dev_p: list[np.ndarray] = []
        host_l: list[np.ndarray] = []
        host_p: list[np.ndarray] = []
        jobs_seen: set[int] = set()
        for node in self._nodes():
            for key, child in node.children.items():
                where = f"{child!r} under {node!r}"
                self._check_edge(node, key, child, where)
                lanes = self._lanes(child)
                if child.on_device:
                    _require(node.on_device, f"device node under a host-only node: {where}")
                    counts = self._lane_counts(child)
                    if child.lock_ref:
                        protected += counts
                    else:
                        evictable += counts
                    dev_l.append(lanes)
                    dev_p.append(child.pages)
                else:
                    _require(
                        (child.pages == TRASH_PAGE).all(), f"host-only node keeps pages: {where}"
                    )
                    _require(
                        child.host_pages is not None
                        or (child.backup_job is not None and child.backup_job.frees_device),
                        f"node with no copy anywhere: {where}",
                    )
                if child.host_pages is not None:
                    _require(child.host_pages.size == child.num_pages, f"host pages size: {where}")
                    _require(child.backup_job is None, f"backed-up node backing up: {where}")
                    host_l.append(lanes)
                    host_p.append(child.host_pages)
                for job in (child.backup_job, child.load_job):
                    if job is None:
                        continue
                    _require(self._jobs.get(job.job_id) is job, f"stale job on {where}")
                    _require(child.lock_ref > 0, f"node of an in-flight job unlocked: {where}")
                    _require(
                        job.start_page <= child.start_page and child.end_page <= job.node.end_page,
                        f"node outside its job's range: {where}",
                    )
                    jobs_seen.add(job.job_id)
        _require(
            jobs_seen == set(self._jobs),
            f"in-flight jobs {sorted(set(self._jobs) - jobs_seen)} have no node",
        )
        for job in self._jobs.values():
            _require(job.node.parent is not None, f"job {job.job_id} lost its node")
            if isinstance(job, BackupJob):
                host_l.append(job.lanes)
                host_p.append(job.host_pages)
                if job.frees_device:
                    dev_l.append(job.lanes)
                    dev_p.append(job.device_pages)
            else:
                dev_l.append(job.lanes)
                dev_p.append(job.device_pages)
        _require(
            np.array_equal(evictable, self._evictable)
            and np.array_equal(protected, self._protected),
            f"per-lane sizes drifted: tree has evictable={evictable.tolist()} "
            f"protected={protected.tolist()}, counters say {self._evictable.tolist()} "
            f"{self._protected.tolist()}",
        )
        # Device pages.
        mask = self.allocator.allocated_mask()
        _require(
            np.array_equal(
                self.allocator.num_free_per_lane() + mask.sum(axis=1),
                np.full((cp,), self.allocator.capacity_per_lane),
            ),
            "device lane counts: free + allocated != capacity",
        )
        if request_pages is not None:
            for lanes, pages in request_pages:
                dev_l.append(np.asarray(lanes, dtype=np.int64))
                dev_p.append(np.asarray(pages))
        if dev_p:
            lane_arr = np.concatenate(dev_l).astype(np.int64)
            page_arr = np.concatenate(dev_p).astype(np.int64)
        else:
            lane_arr = page_arr = np.zeros((0,), dtype=np.int64)
        _require(not (page_arr == TRASH_PAGE).any(), "a trash page is held")
        flat = lane_arr * self.allocator.pages_per_lane + page_arr
        _require(np.unique(flat).size == flat.size, "a device (lane, page) is held twice")
        _require(mask[lane_arr, page_arr].all(), "a held device page is free in its lane")
        if request_pages is not None:
            _require(
                int(mask.sum()) == flat.size,
                f"{int(mask.sum()) - flat.size} allocated device page(s) held by nobody",
            )
        # Host pages, lane by lane.
        lane_arr = np.concatenate(host_l) if host_l else np.zeros((0,), dtype=np.int64)
        page_arr = np.concatenate(host_p) if host_p else np.zeros((0,), dtype=np.int64)
        for lane, alloc in enumerate(self.host_allocators):
            mine = page_arr[lane_arr == lane].astype(np.int64)
            hmask = alloc.allocated_mask()
            _require(
                alloc.num_free + int(hmask.sum()) == alloc.capacity,
                f"host lane {lane}: free + allocated != capacity",
            )
            _require(not (mine == HOST_TRASH_PAGE).any(), f"host lane {lane}: reserved page held")
            _require(np.unique(mine).size == mine.size, f"host lane {lane}: a page held twice")
            _require(hmask[mine].all(), f"host lane {lane}: a held page is free")
            _require(
                int(hmask.sum()) == mine.size,
                f"host lane {lane}: {int(hmask.sum()) - mine.size} allocated page(s) unheld",
            )

    # --- internals (overrides) -----------------------------------------------------

    def _new_node(
        self, tokens: np.ndarray, pages: np.ndarray, start_page: int, parent: RadixNode | None
    ) -> HiRadixNode:
        node = HiRadixNode(self._next_id, tokens, pages, start_page, parent, self._clock)
        self._next_id += 1
        return node

    def _split(self, child: HiRadixNode, m: int) -> HiRadixNode:
        upper = super()._split(child, m)
        assert isinstance(upper, HiRadixNode)
        upper.on_device = child.on_device
        upper.hit_count = child.hit_count
        upper.backup_job = child.backup_job
        upper.load_job = child.load_job
        if child.host_pages is not None:
            upper.host_pages = child.host_pages[:m].copy()
            child.host_pages = child.host_pages[m:].copy()
        return upper

    def _lane_counts(self, node: HiRadixNode) -> np.ndarray:
        """Device pages per lane (none for a node off the device)."""
        if not node.on_device:
            return np.zeros((self.cp_size,), dtype=np.int64)
        return self._lane_counts_all(node)

    # --- internals -----------------------------------------------------------------

    def _lane_counts_all(self, node: RadixNode) -> np.ndarray:
        return np.bincount(self._lanes(node), minlength=self.cp_size).astype(np.int64)

    def _need(self, pages_needed_per_lane) -> np.ndarray:
        need = np.asarray(pages_needed_per_lane, dtype=np.int64).reshape(-1)
        if need.shape != (self.cp_size,):
            raise ValueError(
                f"eviction needs one page count per lane ({self.cp_size}), got shape {need.shape}"
            )
        return np.maximum(need, 0)

    @staticmethod
    def _on_device(node: RadixNode) -> bool:
        return isinstance(node, HiRadixNode) and node.on_device

    @staticmethod
    def _host_hit(node: HiRadixNode) -> bool:
        """Host-only with a completed copy and no job filling it."""
        return (
            not node.on_device
            and node.host_pages is not None
            and node.load_job is None
            and node.backup_job is None
        )

    def _device_leaf(self, node: HiRadixNode) -> bool:
        return (
            node is not self._root
            and node.on_device
            and node.lock_ref == 0
            and not any(c.on_device for c in node.children.values())
        )

    def _host_leaf(self, node: HiRadixNode) -> bool:
        return (
            node is not self._root
            and self._host_hit(node)
            and node.lock_ref == 0
            and not node.children
        )

    def _put_on_device(self, node: HiRadixNode, pages: np.ndarray) -> None:
        node.pages = np.asarray(pages, dtype=np.int32)
        node.on_device = True
        counts = self._lane_counts(node)
        if node.lock_ref:
            self._protected += counts
        else:
            self._evictable += counts

    def _hit(self, node: HiRadixNode) -> None:
        """Count a reuse of a device node; back it up once it reaches the threshold."""
        if self.write_policy == "write_back":
            return
        if node.host_pages is not None or node.backup_job is not None:
            return
        node.hit_count += 1
        if node.hit_count >= self.threshold:
            self._start_backup(node, node.pages, False)

    def _start_backup(self, node: HiRadixNode, device: np.ndarray, frees_device: bool) -> bool:
        """Take host pages for `node` (evicting host-only leaves if short) and queue a
        backup job; `False` (counted as dropped unless write-back eviction counts it)
        when the host pool cannot supply them."""
        lanes = self._lanes(node)
        need = np.bincount(lanes, minlength=self.cp_size).astype(np.int64)
        short = np.maximum(need - self.host_free_per_lane(), 0)
        if short.any():
            self.evict_host(short)
        if (need > self.host_free_per_lane()).any():
            if not frees_device:
                self.dropped_backups += 1
            logger.debug("dropped a backup of %r: host lanes short", node)
            return False
        host = np.empty((node.num_pages,), dtype=np.int64)
        for lane in np.flatnonzero(need):
            host[lanes == lane] = self.host_allocators[lane].alloc(int(need[lane]))
        job = BackupJob(
            next(self._job_ids),
            node,
            node.start_page,
            np.asarray(device, dtype=np.int32).copy(),
            host,
            self.cp_size,
            frees_device,
        )
        self._jobs[job.job_id] = job
        node.backup_job = job
        self.inc_lock_ref(node)
        self._queue.append(job)
        return True

    def _finish(self, job: BackupJob | LoadBackJob, kind: type) -> None:
        if not isinstance(job, kind) or self._jobs.get(job.job_id) is not job:
            raise ValueError(
                f"{type(job).__name__} {job.job_id} is not an in-flight {kind.__name__} of this "
                "cache (acknowledged twice, or after reset?)"
            )
        del self._jobs[job.job_id]
        if isinstance(job, BackupJob) and job in self._queue:
            self._queue.remove(job)

    def _chain(self, job: BackupJob | LoadBackJob) -> list[tuple[HiRadixNode, slice]]:
        """Nodes covering `job`'s pages, top down, each with its slice of the job's
        pages (splits since the job began cut its range into several nodes)."""
        out = []
        n = job.node
        while True:
            out.append((n, slice(n.start_page - job.start_page, n.end_page - job.start_page)))
            if n.start_page <= job.start_page:
                break
            n = n.parent
            assert n is not None
        assert n.start_page == job.start_page, "a job's range no longer starts at a node"
        return out[::-1]

    def _path_between(
        self, top: RadixNode, bottom: HiRadixNode, start: int
    ) -> list[HiRadixNode] | None:
        """Host-hit nodes from just below `top` down to `bottom`, or `None` when the match
        went stale (evicted, loaded, or no longer host only)."""
        if bottom.parent is None or (top is not self._root and top.parent is None):
            return None
        if not (top is self._root or top.on_device):
            return None
        out = []
        n = bottom
        while n is not top:
            if n is None or n is self._root or not self._host_hit(n):
                return None
            out.append(n)
            n = n.parent
        out.reverse()
        if not out or out[0].start_page != start:
            return None
        return out

    def _free_host(self, lanes: np.ndarray, pages: np.ndarray) -> None:
        lanes = np.asarray(lanes)
        for lane in np.unique(lanes):
            self.host_allocators[int(lane)].free(pages[lanes == lane])

    def _remove_subtree(self, node: HiRadixNode) -> None:
        """Unlink `node` and everything below it, freeing their host copies (none of them
        may be locked, in flight, or hold device pages other than `node`'s, which the
        caller has taken care of)."""
        stack, nodes = [node], []
        while stack:
            n = stack.pop()
            nodes.append(n)
            stack.extend(n.children.values())
        for n in nodes:
            assert n.lock_ref == 0 and n.load_job is None, f"removing a locked {n!r}"
            assert n is node or not n.on_device, f"removing a device node {n!r}"
        backed = [n for n in nodes if n.host_pages is not None]
        if backed:
            self._free_host(
                np.concatenate([self._lanes(n) for n in backed]),
                np.concatenate([n.host_pages for n in backed]),
            )
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.tokens, 0)]
        for n in nodes:
            n.parent = None
            n.host_pages = None


LoadOutcome = Literal["loaded", "skipped", "failed"]


def load_host_hit(
    cache: HiRadixCache, plan: LoadBackPlan, copy: Callable[[LoadBackJob], bool]
) -> tuple[PrefixMatch, LoadOutcome]:
    """Step 3 of the lifecycle for a request whose `plan.match` the caller has locked:
    allocate the planned load-back, `copy` it (host -> device; False when it failed),
    acknowledge it. Returns the match the request uses, locked in place of the caller's:

    - `"loaded"`: the longer device match (`load_back_done`), the lock moved onto it;
    - `"skipped"`: `plan.match` (the plan said no, or no device pages even after
      eviction): nothing changed;
    - `"failed"`: `plan.match` (the copy failed: its pages are freed, the request
      recomputes them)."""
    job = cache.load_back(plan)
    if job is None:
        return plan.match, "skipped"
    if not copy(job):
        cache.load_back_failed(job)
        return plan.match, "failed"
    full = cache.load_back_done(job)
    cache.inc_lock_ref(full.node)
    cache.dec_lock_ref(plan.match.node)
    return full, "loaded"
