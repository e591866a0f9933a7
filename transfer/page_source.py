"""Prefill-side page sources: where a rank sender reads the pages it sends.

A `PageSource` copies one rank's pages of one (kind, layer) pool leaf to host memory:
`CPPoolPageSource` over a CP device pool (the prefill server's), `HostPoolPageSource`
over a pool held in host memory (benchmarks; a host KV cache). Optional extras a
backend looks for: `host_buffer` (`HostPageSource`: the leaf itself, written from in
place) and `sealed_digests` (`SealedPageSource`: digests taken once, when the pages
were written, sent instead of hashing at send time).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from cpkv_jax.buckets import pow2_at_least
from cpkv_jax.model.kv_cache import KVPool
from transfer.page_plan import BufferKind, LayoutDescriptor, row_digests


@runtime_checkable
class PageSource(Protocol):
    """Reads one prefill rank's pages of one (kind, layer) pool leaf to host memory."""

    def read(self, kind: BufferKind, layer: int, src_pages: np.ndarray) -> np.ndarray:
        """Host copy `[len(src_pages), page_size, ...]` of the rank's local pages."""
        ...


@jax.jit
def _gather_rows(leaves: tuple[jax.Array, ...], idx: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(jnp.take(leaf, idx, axis=0) for leaf in leaves)


# A read gathers the pages of several buffers in one dispatch, up to this many bytes.
READ_GROUP_BYTES = 256 << 20
# Page sets whose gathered rows a source keeps for later reads (oldest dropped first).
MAX_PENDING_READS = 16


class CPPoolPageSource:
    """`PageSource` over a CP pool (`CPPrefillRunner.pool`) for rank `rank`.

    Pool leaves are global arrays `[cp * pages_per_rank, P, ...]` sharded `P("cp")` on
    the page axis, so the rank's pages are its addressable shard, indexed by rank-local
    page ids. The owned pages are gathered on the rank's device (index padded to a power
    of two with the trash page, bounding compiles) and copied to host.

    `pool` may be a callable returning the current pool, since a runner replaces its
    pool (donation) on every step. Then pass the lock the runner swaps the pool under
    (`CPPrefillRunner.kv.lock`) as `lock`: a read looks the pool up, dispatches its
    gather and waits for it to run under the lock, so a step never donates a pool that
    a read still reads (whatever the runtime does with pending reads of a donated
    buffer); the gather's result is a new array, copied to host outside the lock. A
    step waits at most for one gather; a read waits at most for the step already on
    the device. The pages themselves must not change meanwhile: the caller holds them
    (`TransferHold`).

    A gather dispatched while the engine runs steps executes after the steps already
    queued on the device, so each dispatch may wait for one step. Hence one read
    gathers the same pages of a run of buffers that fits in `group_bytes` (every
    buffer, for all but very long requests) in one dispatch and keeps the run's other
    rows until each is read once (a sender reads every buffer of its plan's pages); a
    later read of the same pages and buffer (a retry) gathers again. Rows of at most
    `MAX_PENDING_READS` page sets are kept (a sender that stopped early leaves some);
    the owner of the pages calls `discard` before it frees them, since the rows are
    keyed by page ids and a later request may get the same pages.
    """

    def __init__(
        self,
        pool: KVPool | Callable[[], KVPool],
        layout: LayoutDescriptor,
        rank: int,
        lock: threading.Lock | None = None,
        *,
        group_bytes: int = READ_GROUP_BYTES,
    ):
        self._pool = pool
        self.layout = layout
        self.rank = rank
        self._lock = lock
        self.group_bytes = group_bytes
        self._buffers = layout.buffers()
        # pages -> buffer -> host rows gathered with another buffer, not read yet.
        self._pending: collections.OrderedDict[bytes, dict[tuple[BufferKind, int], np.ndarray]] = (
            collections.OrderedDict()
        )
        self._pending_lock = threading.Lock()
        self.dispatches = 0  # gathers dispatched (tests check one per read of all buffers)

    def read(self, kind: BufferKind, layer: int, src_pages: np.ndarray) -> np.ndarray:
        pages = np.ascontiguousarray(src_pages, dtype=np.int32)
        key, buffer = pages.tobytes(), (kind, layer)
        with self._pending_lock:
            rows = self._pending.get(key, {}).pop(buffer, None)
        if rows is not None:
            return rows
        k = len(pages)
        padded = pow2_at_least(k)
        idx = np.zeros(padded, np.int32)  # padding reads the trash page
        idx[:k] = pages
        group = next(g for g in self._groups(padded) if buffer in g)
        gathered = self._gather(group, idx)
        self.dispatches += 1
        host = {b: np.asarray(x)[:k] for b, x in zip(group, jax.device_get(gathered), strict=True)}
        rows = host.pop(buffer)
        with self._pending_lock:
            self._pending.setdefault(key, {}).update(host)
            self._pending.move_to_end(key)
            while len(self._pending) > MAX_PENDING_READS:  # a sender that stopped early
                self._pending.popitem(last=False)
            if not self._pending[key]:
                del self._pending[key]
        return rows

    def discard(self, src_pages: np.ndarray) -> int:
        """Forget the kept rows of every read that touched any of `src_pages`; returns how
        many page sets went. Call before the pages are freed: the kept rows are copies of
        held pages, and a later request given the same pages must not read them."""
        pages = np.asarray(src_pages, np.int32)
        with self._pending_lock:
            stale = [k for k in self._pending if np.isin(np.frombuffer(k, np.int32), pages).any()]
            for k in stale:
                del self._pending[k]
        return len(stale)

    def warm(self, max_pages: int) -> int:
        """Compile the gathers of every read of up to `max_pages` pages (one per group
        and power-of-two row count) by gathering the trash page; returns how many ran."""
        ran = 0
        rows = 1
        while rows <= pow2_at_least(max_pages):
            idx = np.zeros(rows, np.int32)
            for group in self._groups(rows):
                self._gather(group, idx)
                ran += 1
            rows *= 2
        return ran

    def _gather(
        self, group: tuple[tuple[BufferKind, int], ...], idx: np.ndarray
    ) -> tuple[jax.Array, ...]:
        """The rows `idx` of the group's leaves on this rank's device, gathered (and
        waited for) under the pool lock: a step never donates a pool a read still reads."""
        with self._lock if self._lock is not None else contextlib.nullcontext():
            pool = self._pool() if callable(self._pool) else self._pool
            leaves = tuple(
                self._shard(getattr(pool, b[0])[self.layout.leaf_index(*b)]) for b in group
            )
            return jax.block_until_ready(_gather_rows(leaves, idx))

    def _groups(self, rows: int) -> list[tuple[tuple[BufferKind, int], ...]]:
        """The buffers in layout order, cut into runs whose `rows` rows fit `group_bytes`
        (a run of one buffer if that alone is larger): one gather each. Fixed for a row
        count, so the compiles stay one per run and power-of-two row count."""
        groups: list[tuple[tuple[BufferKind, int], ...]] = []
        run: list[tuple[BufferKind, int]] = []
        total = 0
        for b in self._buffers:
            nbytes = rows * self.layout.page_bytes(*b)
            if run and total + nbytes > self.group_bytes:
                groups.append(tuple(run))
                run, total = [], 0
            run.append(b)
            total += nbytes
        groups.append(tuple(run))
        return groups

    def _shard(self, leaf: jax.Array) -> jax.Array:
        for s in leaf.addressable_shards:
            rows = s.data.shape[0]
            if rows == leaf.shape[0]:  # replicated pool: every copy holds everything
                return s.data
            if (s.index[0].start or 0) == self.rank * rows:
                return s.data
        raise ValueError(
            f"rank {self.rank}'s shard of a {leaf.shape} pool leaf is not addressable in this "
            "process; run the rank's sender on the host that holds it"
        )


@runtime_checkable
class SealedPageSource(Protocol):
    """A `PageSource` that keeps the digests of pages it holds unchanged ("sealed").

    `sealed_digests(kind, layer, src_pages)` is the xxh3 digest (`page_plan.row_digests`)
    of each page taken when it was sealed, `[len(src_pages)]` uint64, or None when any
    of those pages is not sealed. Senders send these instead of hashing the pages again
    at send time; the decode side still hashes every page on arrival, so a page that
    changed after its seal fails its room with a digest mismatch - never silently."""

    def read(self, kind: BufferKind, layer: int, src_pages: np.ndarray) -> np.ndarray: ...

    def sealed_digests(
        self, kind: BufferKind, layer: int, src_pages: np.ndarray
    ) -> np.ndarray | None: ...


def sealed_digests(
    source: PageSource, kind: BufferKind, layer: int, src_pages: np.ndarray
) -> np.ndarray | None:
    """The source's sealed digests of `src_pages` (`SealedPageSource`), else None: the
    sender hashes the bytes it sends."""
    if isinstance(source, SealedPageSource):
        return source.sealed_digests(kind, layer, src_pages)
    return None


@runtime_checkable
class HostPageSource(Protocol):
    """A `PageSource` whose pool lives in host memory: a backend may send straight from
    it (gRPC: chunks sliced from it; Mooncake: each leaf registered with the engine once
    and written from without a copy).

    `host_buffer(kind, layer)` is the rank's whole (kind, layer) pool leaf, first axis
    = the rank's local page id, C-contiguous; the same array (same address) on every
    call, alive for as long as the backend."""

    def read(self, kind: BufferKind, layer: int, src_pages: np.ndarray) -> np.ndarray: ...

    def host_buffer(self, kind: BufferKind, layer: int) -> np.ndarray: ...


class HostPoolPageSource:
    """`PageSource` over one rank's pool held in host memory: per (kind, layer) buffer a
    C-contiguous array `[pages, ...]` indexed by the rank's local page id.

    `read` gathers pages (a copy, as every `PageSource`; `read_into` into a given
    buffer); `host_buffer` returns the leaf itself, which the Mooncake backend registers
    once and writes from without a copy (it is a `HostPageSource`). Used by
    `benchmarks.bench_transfer`.

    **Sealed pages** (`SealedPageSource`): a host pool's pages are written once and then
    sent, possibly many times (a host cache keeps a prefix for every request that reuses
    it). `seal(pages)` takes their digests once, after they are written - where the
    writer's bytes are still warm - and every later transfer sends those digests instead
    of hashing the pages again on its critical path: stored checksums, as block stores
    keep them. The decode side checks every page on arrival either way, so the digests
    now also cover the time the page spent in the pool. Contract: `unseal(pages)` before
    rewriting sealed pages (then `seal` them again); a page rewritten while sealed fails
    the transfers that send it with a digest mismatch (SPEC S2.4), it is never sent as
    good. Pages not sealed are hashed at send time, as for every other source."""

    def __init__(self, layout: LayoutDescriptor, leaves: dict[tuple[BufferKind, int], np.ndarray]):
        missing = [b for b in layout.buffers() if b not in leaves]
        if missing:
            raise ValueError(f"host pool lacks buffers {missing}")
        for (kind, layer), leaf in leaves.items():
            nb = layout.page_bytes(kind, layer)
            if not leaf.flags.c_contiguous or leaf.nbytes != leaf.shape[0] * nb:
                raise ValueError(
                    f"{kind} layer {layer}: {leaf.shape} {leaf.dtype} is not a C-contiguous "
                    f"pool leaf of {nb} B pages"
                )
        self.layout = layout
        self._leaves = dict(leaves)
        self._seal_lock = threading.Lock()
        self._digests = {b: np.zeros(leaf.shape[0], np.uint64) for b, leaf in leaves.items()}
        self._sealed = {b: np.zeros(leaf.shape[0], bool) for b, leaf in leaves.items()}

    def read(self, kind: BufferKind, layer: int, src_pages: np.ndarray) -> np.ndarray:
        return self._leaves[(kind, layer)][np.asarray(src_pages, np.int64)]

    def _pages(self, src_pages: np.ndarray | Sequence[int] | None) -> np.ndarray:
        n = min(leaf.shape[0] for leaf in self._leaves.values())
        if src_pages is None:
            return np.arange(n, dtype=np.int64)
        pages = np.asarray(src_pages, np.int64).reshape(-1)
        if pages.size and (pages.min() < 0 or pages.max() >= n):
            raise ValueError(f"pages {pages.min()}..{pages.max()} outside the pool [0, {n})")
        return pages

    def seal(self, src_pages: np.ndarray | Sequence[int] | None = None) -> None:
        """Take the digests of `src_pages` (default: every page) in every buffer, now that
        they are written; transfers send them from now on (see the class docstring)."""
        pages = self._pages(src_pages)
        for key, leaf in self._leaves.items():
            flat = leaf.reshape(leaf.shape[0], -1).view(np.uint8)
            digests = row_digests(flat, pages)
            with self._seal_lock:
                self._digests[key][pages] = digests
                self._sealed[key][pages] = True

    def unseal(self, src_pages: np.ndarray | Sequence[int] | None = None) -> None:
        """Forget the digests of `src_pages` (default: every page) before rewriting them."""
        pages = self._pages(src_pages)
        with self._seal_lock:
            for sealed in self._sealed.values():
                sealed[pages] = False

    def sealed_digests(
        self, kind: BufferKind, layer: int, src_pages: np.ndarray
    ) -> np.ndarray | None:
        """The sealed digests of `src_pages` in buffer (kind, layer), None unless every
        one of them is sealed."""
        pages = np.asarray(src_pages, np.int64)
        with self._seal_lock:
            if not self._sealed[(kind, layer)][pages].all():
                return None
            return self._digests[(kind, layer)][pages]

    def host_buffer(self, kind: BufferKind, layer: int) -> np.ndarray:
        return self._leaves[(kind, layer)]

    def read_into(
        self, kind: BufferKind, layer: int, src_pages: np.ndarray, out: np.ndarray
    ) -> None:
        """`read` straight into `out` (uint8 `[len(src_pages), page_bytes]`): one copy."""
        leaf = self._leaves[(kind, layer)]
        flat = leaf.reshape(leaf.shape[0], -1).view(np.uint8)
        np.take(flat, np.asarray(src_pages, np.int64), axis=0, out=out)
