"""Exact-coverage commit (SPEC S2.4) and the scatter of staged pages into the decode pool.

`Committer` checks one sender's commit against what it wrote (the claimed positions are
the written ones in every buffer; aux data from rank 0 only) and, once every sender
committed, that the positions cover `[0, n_pages)` exactly once. Then a jitted scatter
writes every (kind, layer) leaf of the KV sink's pool (pool donated; one call per
power-of-two piece of the room's rows, so compiles stay bounded and staging holds
exactly the room's pages), or, for a host-only receiver, the verified staging rows go
to `host_sink`; and the room succeeds.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
import numpy as np

from cpkv_jax.errors import quote
from cpkv_jax.kv_store import PagedKVStore
from cpkv_jax.model.kv_cache import KVPool
from transfer.page_plan import BufferKind, LayoutDescriptor
from transfer.protocol import Aux, RoomSnapshot, RoomState
from transfer.receiver.rooms import RoomTable, _Room

logger = logging.getLogger(__name__)

# host_sink(room, positions [n], dst_pages [n], staging per buffer [n, page_bytes]):
# row i of every buffer is logical position positions[i], bound for decode page dst_pages[i].
HostSink = Callable[[str, np.ndarray, np.ndarray, tuple[np.ndarray, ...]], None]


def pow2_pieces(n: int) -> list[int]:
    """`n` as a sum of distinct powers of two, largest first (2049 -> [2048, 1]): the
    commit scatters a room's rows in these pieces, so compiles stay bounded (one per
    power of two) without padding the staging to a power of two."""
    return [1 << b for b in reversed(range(n.bit_length())) if n >> b & 1]


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_pages(pool: KVPool, pages: jax.Array, staged: KVPool) -> KVPool:
    """`pool.leaf.at[pages].set(staged.leaf)` for every leaf (one scatter per leaf)."""
    return jax.tree_util.tree_map(
        lambda leaf, rows: leaf.at[pages].set(rows, mode="drop"), pool, staged
    )


class Committer:
    """Commits of `layout`-shaped rooms into `kv` (or to `host_sink` when host-only)."""

    def __init__(
        self,
        layout: LayoutDescriptor,
        kv: PagedKVStore,
        rooms: RoomTable,
        clock: Callable[[], float],
        host_sink: HostSink | None,
    ):
        self.layout = layout
        self._kv = kv
        self._rooms = rooms
        self._clock = clock
        self._host_sink = host_sink
        self._buffers = layout.buffers()
        self._buffer_index = {b: i for i, b in enumerate(self._buffers)}

    def commit_locked(
        self, r: _Room, sender_rank: int, positions: np.ndarray, aux: Aux | None
    ) -> RoomSnapshot:
        """The commit proper (room lock held): claimed positions == written ones, aux.
        A repeated commit with the same positions is a retry and changes nothing."""
        s = r.senders[sender_rank]
        pos = r.positions(positions)
        claimed = tuple(int(p) for p in np.sort(pos))
        if s.committed is not None:
            if s.committed != claimed:
                self._rooms.fail(
                    r,
                    f"prefill rank {sender_rank} committed twice with different positions "
                    f"{quote(list(s.committed))} and {quote(list(claimed))}",
                )
            return r.snapshot()
        s.last_seen = self._clock()
        if (aux is not None) != (sender_rank == 0):
            self._rooms.fail(
                r,
                "rank 0 committed without the aux data (first token, log-prob)"
                if sender_rank == 0
                else f"prefill rank {sender_rank} sent aux data; only rank 0 does",
            )
            return r.snapshot()
        claim = np.zeros(r.n_pages, bool)
        claim[pos] = True
        for b, (kind, layer) in enumerate(self._buffers):
            wrote = r.writer[b] == sender_rank
            if not np.array_equal(wrote, claim):
                missing = np.flatnonzero(claim & ~wrote)
                extra = np.flatnonzero(wrote & ~claim)
                self._rooms.fail(
                    r,
                    f"prefill rank {sender_rank} committed positions {quote(claimed)} but "
                    f"its {kind} layer {layer} pages lack {quote(missing)} and add "
                    f"{quote(extra)}",
                )
                return r.snapshot()
        s.committed = claimed
        if sender_rank == 0:
            r.aux = aux
        if all(x.committed is not None for x in r.senders):
            self._finish(r)
        return r.snapshot()

    def _finish(self, r: _Room) -> None:
        """Every sender committed: exact coverage, then one scatter per leaf -> Success."""
        count = np.zeros(r.n_pages, np.int64)
        for s in r.senders:
            assert s.committed is not None
            np.add.at(count, np.asarray(s.committed, np.int64), 1)
        missing, dup = np.flatnonzero(count == 0), np.flatnonzero(count > 1)
        if missing.size or dup.size:
            parts = []
            if missing.size:
                parts.append(f"positions {quote(missing)} were sent by no rank")
            if dup.size:
                parts.append(f"positions {quote(dup)} were committed by more than one rank")
            self._rooms.fail(r, f"coverage of [0, {r.n_pages}) is not exact: " + "; ".join(parts))
            return
        if (r.writer < 0).any():  # implied by the per-rank checks; kept as a guard
            self._rooms.fail(r, "coverage is exact but some (kind, layer) pages were never written")
            return
        assert r.staging is not None or r.n_pages == 0
        row_pos = r.row_pos if r.row_pos is not None else np.arange(r.n_pages, dtype=np.int64)
        dst_rows = r.dst_pages[row_pos]  # decode page of each staging row
        try:
            if self._kv.host_only:  # no device: hand the rows over
                if self._host_sink is not None and r.staging:
                    n = r.n_pages
                    self._host_sink(
                        r.room, row_pos.copy(), dst_rows.copy(), tuple(st[:n] for st in r.staging)
                    )
            else:
                err = self._kv.update_pool(functools.partial(self._scatter, r, dst_rows))
                if err is not None:
                    raise err
        except Exception as e:  # device failure: fail the room, keep serving others
            logger.exception("room %s: decode pool scatter failed", r.room)
            self._rooms.fail(r, f"decode pool scatter failed: {type(e).__name__}: {e}")
            return
        self._rooms.advance(r, RoomState.SUCCESS)

    def _scatter(
        self, r: _Room, dst_rows: np.ndarray, pool: KVPool
    ) -> tuple[Exception | None, KVPool]:
        """Scatter `r`'s staging rows to decode pages `dst_rows` (a `PagedKVStore.update_pool`
        step). A failed piece is returned, not raised, with the pool the pieces before it
        made: each piece donated its input, so the sink must keep the newest pool."""
        pages, lo = dst_rows.astype(np.int32), 0
        try:
            for size in pow2_pieces(r.n_pages):
                part = [st[lo : lo + size] for st in r.staging or []]
                staged = self._staged_pool(pool, part, size)
                pool = _scatter_pages(pool, pages[lo : lo + size], staged)
                lo += size
            if r.region is not None:  # the region is reused once the room is over
                jax.block_until_ready(pool)
        except Exception as e:
            return e, pool
        return None, pool

    def warm(self, max_pages: int) -> int:
        """Compile the scatter of every piece a room of up to `max_pages` pages commits
        (one per power of two) by scattering zeros into the trash page; returns how many.
        A host-only receiver scatters nothing."""
        if self._kv.host_only:
            return 0
        sizes = []
        while (size := 1 << len(sizes)) <= max_pages:
            sizes.append(size)

        def step(pool: KVPool) -> tuple[None, KVPool]:
            for size in sizes:
                part = [
                    np.zeros((size, self.layout.page_bytes(*b)), np.uint8) for b in self._buffers
                ]
                pool = _scatter_pages(
                    pool, np.zeros(size, np.int32), self._staged_pool(pool, part, size)
                )
            return None, jax.block_until_ready(pool)

        self._kv.update_pool(step)
        return len(sizes)

    def _staged_pool(self, pool: KVPool, staging: list[np.ndarray], rows: int) -> KVPool:
        """Staging bytes viewed as the pool leaves' dtype and page shape, as a `KVPool`."""

        def rows_of(kind: BufferKind, j: int, leaf: jax.Array) -> np.ndarray:
            layer = j if kind == "latent" else self.layout.full_indexer_layers[j]
            raw = staging[self._buffer_index[(kind, layer)]]
            return raw.view(leaf.dtype).reshape((rows, *leaf.shape[1:]))

        return KVPool(
            latent=tuple(rows_of("latent", j, x) for j, x in enumerate(pool.latent)),
            index_k=tuple(rows_of("index_k", j, x) for j, x in enumerate(pool.index_k)),
            index_scale=tuple(rows_of("index_scale", j, x) for j, x in enumerate(pool.index_scale)),
        )
