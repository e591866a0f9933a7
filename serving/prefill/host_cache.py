"""Host (L2) KV cache copies for the prefill scheduler (`HiRadixCache` jobs, executed).

`HostCacheIO` owns the per-lane `HostPools` and runs the copies a `HiRadixCache` records:

- load-back (host -> device) runs on the scheduler thread, before the request's step
  allocates: `load(job)` copies every lane of a `LoadBackJob` into `runner.pool` with
  `load_all_layers` under the runner's pool lock `runner.kv.lock` (the copy donates the
  pool, so it is replaced leaf by leaf as each scatter lands) and says whether it worked;
  the
  scheduler then acknowledges the job. A copy that raised part-way leaves valid
  arrays in `runner.pool` (the request recomputes); one that lost a donated buffer
  raises `DevicePoolLostError` (fatal: the pool cannot be used again);
- backups (device -> host) run off the critical path, in one background worker thread
  fed by a bounded queue. `submit_backups(cache, jobs)` never blocks: a job the queue
  cannot take is dropped, acknowledged as failed at once (`backup_failed`) and counted.
  The worker gathers one lane at a time under `runner.kv.lock` (no step donates the
  pool mid-read), and posts its result to a completion queue; `drain(cache)` applies
  the acknowledgements (`backup_done` / `backup_failed`) on the scheduler thread (the
  cache is not thread-safe), which the scheduler does at the start of every batch.

Host pages a backup writes are locked in the cache until it is acknowledged and a load
reads only completed host copies, so the worker and a load never touch the same pages.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

from cpkv_jax.cache.hiradix import BackupJob, HiRadixCache, LoadBackJob
from cpkv_jax.host_cache.copy import (
    CopyImpl,
    DevicePoolLostError,
    backup_all_layers,
    deleted_leaves,
    load_all_layers,
    warm_copies,
)
from cpkv_jax.host_cache.pool import HostPageAllocator, HostPools
from cpkv_jax.kv_pool import PoolLayout
from cpkv_jax.kv_store import DevicePool

logger = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE = 64


@dataclasses.dataclass
class HostCacheStats:
    """Counters of the host cache (scheduler thread only)."""

    host_hit_tokens: int = 0  # tokens loaded back from host and reused
    load_backs: int = 0
    load_back_failures: int = 0  # copies that raised (the request recomputes)
    load_back_bytes: int = 0
    load_back_seconds: float = 0.0
    skipped_load_backs: int = 0  # host hits not loaded (plan said no, or allocation failed)
    backups_done: int = 0
    backups_failed: int = 0  # copies that raised
    backup_bytes: int = 0
    backup_seconds: float = 0.0
    dropped_backups: int = 0  # the backup queue was full


@dataclasses.dataclass(frozen=True)
class PoolTarget:
    """What the copies need of a pool's owner (a `CPPrefillRunner` has both): its
    `DevicePool` and the `PoolLayout` of its lanes (a DP pool's ranks are its lanes:
    `PoolLayout(dp, True, pages_per_rank, page_size)`)."""

    kv: DevicePool
    layout: PoolLayout


class HostCacheIO:
    """Executes a `HiRadixCache`'s copy jobs against a `CPPrefillRunner`'s pool.

    `pools`: one host pool per owner lane of `runner.layout`; give the cache their
    allocators (`host_allocators`). `queue_size` bounds the backup queue. `impl` /
    `interpret` go to the copy functions (LPF: the Pallas kernels, interpreted on CPU).
    `rank`: the IO of one DP rank's one-lane cache, whose jobs (all lane 0) copy to and
    from pool lane `rank` and its host pool (`runner` then a `PoolTarget` of the DP pool).
    """

    def __init__(
        self,
        runner,
        pools: HostPools,
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        impl: CopyImpl | None = None,
        interpret: bool | None = None,
        start: bool = True,
        rank: int | None = None,
    ):
        if queue_size < 1:
            raise ValueError(f"backup queue size must be >= 1, got {queue_size}")
        if rank is not None and not 0 <= rank < len(pools.lanes):
            raise ValueError(f"rank {rank} is outside the {len(pools.lanes)} host pools")
        self.runner = runner
        self.pools = pools
        self.rank = rank
        self.page_size = runner.layout.page_size
        self.page_bytes = pools[0].kv.bytes_per_page
        self.impl = impl
        self.interpret = interpret
        self.stats = HostCacheStats()
        self._jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._worker: threading.Thread | None = None
        if start:
            self.start()

    @classmethod
    def create(
        cls,
        runner,
        layout: str = "layer_page_first",
        *,
        size_bytes: int = 0,
        ratio: float = 2.0,
        **kwargs,
    ) -> HostCacheIO:
        """Host pools for every lane of `runner`'s pool (`HostPools.create`), and the IO."""
        pools = HostPools.create(
            runner.kv.current,
            runner.pool_cfg.full_indexer_layers,  # with a drafting runner's MTP layer
            runner.layout,
            layout,
            size_bytes=size_bytes,
            ratio=ratio,
        )
        return cls(runner, pools, **kwargs)

    @property
    def host_allocators(self) -> list[HostPageAllocator]:
        """The allocators of the cache's lanes' host pools (one rank's: its own)."""
        return [pool.allocator for pool in self._lane_pools()]

    def _lane_pools(self) -> list:
        return list(self.pools.lanes) if self.rank is None else [self.pools[self.rank]]

    def _pool_lane(self, lane: int) -> int:
        """The pool (and host pool) lane of the cache's lane `lane`."""
        return lane if self.rank is None else self.rank

    def pages_used_per_lane(self) -> list[int]:
        return [a.capacity - a.num_free for a in self.host_allocators]

    def pages_total_per_lane(self) -> list[int]:
        return [a.capacity for a in self.host_allocators]

    def snapshot(self, cache: HiRadixCache | None = None) -> dict:
        """Counters plus host pool pages used / total per lane (and the cache's own drop
        and skip counts when given)."""
        out = dataclasses.asdict(self.stats)
        out["host_pages_used_per_lane"] = self.pages_used_per_lane()
        out["host_pages_total_per_lane"] = self.pages_total_per_lane()
        out["backup_queue_depth"] = self._jobs.qsize()
        if cache is not None:
            out["cache_dropped_backups"] = cache.dropped_backups  # host pool full
            out["cache_skipped_load_backs"] = cache.skipped_load_backs
        return out

    def warm(self) -> int:
        """Compile every copy program a backup or load-back can dispatch (`warm_copies`,
        on page 0 of each lane's device, under the pool lock); returns how many ran."""
        kv = self.runner.kv

        def warm(pool):
            pool, count = warm_copies(
                pool,
                self.pools[0],
                pool_layout=self.runner.layout,
                impl=self.impl,
                interpret=self.interpret,
            )
            return count, pool

        return kv.update(warm)

    # ---- load-back (scheduler thread) ------------------------------------------------
    def load(self, job: LoadBackJob) -> bool:
        """Copy every lane of `job` host -> device (replacing `runner.pool`); False if a
        copy raised (the caller acknowledges with `load_back_failed` and recomputes).

        Each leaf's scatter result goes into `runner.pool` as it is produced (`commit`),
        so after a failure part-way the pool holds valid arrays: the leaves written hold
        the loaded pages in the job's pages, which nothing reads once it is acknowledged
        failed, the others their undonated arrays. `DevicePoolLostError` if a leaf lost
        its buffer anyway (the failing kernel consumed it): that is not recoverable."""
        t0 = time.perf_counter()
        kv = self.runner.kv

        def commit(pool) -> None:
            kv.replace_locked(pool)  # under the pool's lock, held by the caller below

        try:
            for lane, dev, host in job.token_indices(self.page_size):
                lane = self._pool_lane(lane)
                with kv.lock:
                    pool = load_all_layers(
                        kv.current,
                        self.pools[lane],
                        host_indices=host,
                        device_indices=dev,
                        pool_layout=self.runner.layout,
                        lane=lane,
                        impl=self.impl,
                        interpret=self.interpret,
                        commit=commit,
                    )
                    kv.replace_locked(pool)
        except Exception as e:
            lost = deleted_leaves(kv.current)
            if lost:
                raise DevicePoolLostError(
                    f"host cache load-back of {job.num_pages} pages failed ({type(e).__name__}: "
                    f"{e}) after the device pool gave up leaf buffer(s) {', '.join(lost)}: "
                    "the pool cannot be used again; restart the server"
                ) from e
            logger.exception("host cache load-back of %d pages failed", job.num_pages)
            self.stats.load_back_failures += 1
            return False
        self.stats.load_backs += 1
        self.stats.load_back_bytes += job.num_pages * self.page_bytes
        self.stats.load_back_seconds += time.perf_counter() - t0
        return True

    # ---- backups ---------------------------------------------------------------------
    def submit_backups(self, cache: HiRadixCache, jobs: list[BackupJob]) -> None:
        """Queue `jobs` for the worker without blocking; a job that does not fit (or
        arrives after `close`) is acknowledged as failed now and counted as dropped."""
        for job in jobs:
            if not self._closed:
                try:
                    self._jobs.put_nowait(job)
                    continue
                except queue.Full:
                    pass
            cache.backup_failed(job)
            self.stats.dropped_backups += 1

    def drain(self, cache: HiRadixCache) -> int:
        """Apply the worker's finished backups to `cache` (scheduler thread); returns how
        many were acknowledged."""
        n = 0
        while True:
            try:
                job, ok, seconds = self._done.get_nowait()
            except queue.Empty:
                return n
            n += 1
            if ok:
                cache.backup_done(job)
                self.stats.backups_done += 1
                self.stats.backup_bytes += job.num_pages * self.page_bytes
                self.stats.backup_seconds += seconds
            else:
                cache.backup_failed(job)
                self.stats.backups_failed += 1

    def wait_backups(self) -> None:
        """Block until every queued backup has been copied (then `drain`)."""
        self._jobs.join()

    def start(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="host-cache-backup", daemon=True)
            self._worker.start()

    def close(self) -> None:
        """Stop the worker after the queued backups; `drain` once more afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._jobs.put(None)  # the worker is consuming: this waits for a free slot only
            self._worker.join()
            self._worker = None
        while True:  # never started: nothing copied them
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._done.put((job, False, 0.0))

    # ---- worker thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._done.put((job, *self._backup(job)))
            finally:
                self._jobs.task_done()

    def _backup(self, job: BackupJob) -> tuple[bool, float]:
        t0 = time.perf_counter()
        try:
            for lane, dev, host in job.token_indices(self.page_size):
                lane = self._pool_lane(lane)
                with self.runner.kv.lock:  # a step must not donate the pool mid-read
                    backup_all_layers(
                        self.runner.kv.current,
                        self.pools[lane],
                        device_indices=dev,
                        host_indices=host,
                        pool_layout=self.runner.layout,
                        lane=lane,
                        impl=self.impl,
                        interpret=self.interpret,
                    )
        except Exception:
            logger.exception("host cache backup of %d pages failed", job.num_pages)
            return False, 0.0
        return True, time.perf_counter() - t0
