"""Staging by position: a room's host staging buffers and the pages written into them.

A room's pages land in one host buffer per (kind, layer) at the row of their logical
position (SPEC S2.1), so nothing depends on the order pages arrive in. With a staging
arena a room stages in one region carved from it, rows in owner-major order
(`page_plan.owner_major_order`), so each rank's positions are one contiguous row range
per buffer; without one, in arrays of its own, row = position. `Staging` checks a
chunk against the layout, splits it over its sections, and copies the new pages in,
keeping every held page's (rank, attempt, digest) so a retry is recognised.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from transfer.page_plan import BufferKind, LayoutDescriptor, owner_major_order
from transfer.protocol import BadRequestError, ChunkTooLargeError, PageSection
from transfer.receiver.rooms import RoomTable, _Room
from transfer.staging_arena import StagingArena, StagingFullError

logger = logging.getLogger(__name__)


def staging_buffer_sizes(page_bytes: Sequence[int], n_pages: int, alignment: int) -> list[int]:
    """Bytes each buffer of a room's staging region takes in an arena (buffer after
    buffer, `n_pages` rows of `page_bytes[b]`, each rounded up to `alignment`)."""
    return [-(-n_pages * nb // alignment) * alignment for nb in page_bytes]


def staging_region_bytes(layout: LayoutDescriptor, n_pages: int, alignment: int) -> int:
    """Bytes of one room's staging region in an arena (`staging_buffer_sizes` summed)."""
    page_bytes = [layout.page_bytes(kind, layer) for kind, layer in layout.buffers()]
    return sum(staging_buffer_sizes(page_bytes, n_pages, alignment))


def two_ranks(kind: BufferKind, layer: int, position: int, first: int, second: int) -> str:
    """The failure reason for a position written by two ranks."""
    return (
        f"position {position} of {kind} layer {layer} was sent by prefill ranks "
        f"{first} and {second}; each position must come from exactly one rank"
    )


@dataclasses.dataclass(frozen=True)
class _ChunkPart:
    """A checked section of a chunk: buffer index, its pages (a view of the chunk's
    bytes, `[k, page_bytes]` uint8), their positions and the sender's digests."""

    buffer: int
    kind: BufferKind
    layer: int
    pages: np.ndarray
    positions: np.ndarray
    digests: np.ndarray


class Staging:
    """Rooms' staging buffers, laid out by `layout`, in `arena` when there is one."""

    def __init__(self, layout: LayoutDescriptor, arena: StagingArena | None, rooms: RoomTable):
        self.layout = layout
        self.arena = arena
        self._rooms = rooms
        self.buffers: tuple[tuple[BufferKind, int], ...] = layout.buffers()
        self.buffer_index = {b: i for i, b in enumerate(self.buffers)}
        self.page_bytes = [layout.page_bytes(k, layer) for k, layer in self.buffers]

    def staging_bytes(self, n_pages: int) -> int:
        """Arena bytes a room of `n_pages` pages stages in (0 without an arena)."""
        if self.arena is None:
            return 0
        return sum(staging_buffer_sizes(self.page_bytes, n_pages, self.arena.alignment))

    def ensure(self, r: _Room, required: bool) -> None:
        """Give `r` its staging buffers (room lock held).

        With an arena: one region, buffer after buffer, rows in owner-major order
        (`StagingFullError` if `required` and the arena is full; otherwise a full arena
        falls back to private arrays). Exactly `n_pages` rows: the commit scatters them
        in power-of-two pieces (`pow2_pieces`), which bounds the compiles."""
        rows = r.n_pages
        if self.arena is not None:
            sizes = staging_buffer_sizes(self.page_bytes, rows, self.arena.alignment)
            try:
                region = self.arena.alloc(sum(sizes), r.room)
            except StagingFullError:
                if required:
                    raise
                logger.warning("room %s: staging arena full, staging in private arrays", r.room)
            else:
                offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
                r.region = region
                r.staging = [
                    self.arena.view(region, off, rows * nb).reshape(rows, nb)
                    for off, nb in zip(offsets, self.page_bytes, strict=True)
                ]
                order = owner_major_order(r.n_pages, r.cp_size)
                r.row_pos = order
                r.pos_row = np.empty(r.n_pages, np.int64)
                r.pos_row[order] = np.arange(r.n_pages, dtype=np.int64)
                return
        r.staging = [np.zeros((rows, nb), np.uint8) for nb in self.page_bytes]

    @staticmethod
    def buffers_of(r: _Room) -> tuple[np.ndarray, ...] | None:
        """`r`'s staging buffers, or None (no staging yet / any more)."""
        with r.lock:
            return None if r.staging is None else tuple(r.staging)

    @staticmethod
    def rows_of(r: _Room) -> np.ndarray | None:
        """Staging row of each position of `r` (a copy), or None without staging."""
        with r.lock:
            if r.staging is None:
                return None
            if r.pos_row is None:
                return np.arange(r.n_pages, dtype=np.int64)
            return r.pos_row.copy()

    # ---- writing a chunk --------------------------------------------------------------------
    def parse_chunk(
        self,
        r: _Room,
        sections: Sequence[PageSection],
        data: bytes | memoryview,
        max_chunk_bytes: int,
    ) -> list[_ChunkPart]:
        """Validate a chunk against the layout and split `data` over its sections."""
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        if size > max_chunk_bytes:
            raise ChunkTooLargeError(
                f"room {r.room!r}: chunk carries {size} page bytes, over the "
                f"{max_chunk_bytes} B limit; send smaller chunks"
            )
        parts, need, shapes = [], 0, []
        for s in sections:
            b = self.buffer_index.get((s.kind, s.layer))
            if b is None:
                raise BadRequestError(
                    f"room {r.room!r}: no {s.kind} buffer for layer {s.layer} in the decode "
                    f"layout (full indexer layers: {list(self.layout.full_indexer_layers)})"
                )
            pos = r.positions(s.positions)
            sent = np.asarray(s.digests, np.uint64).reshape(-1)
            if sent.size != pos.size:
                raise BadRequestError(
                    f"room {r.room!r}: {s.kind} layer {s.layer} section has {pos.size} "
                    f"positions and {sent.size} digests; expected one digest per position"
                )
            nb = self.page_bytes[b]
            n = pos.size * nb
            if need + n <= size:
                pages = np.frombuffer(data, np.uint8, n, need).reshape(pos.size, nb)
                parts.append(_ChunkPart(b, s.kind, s.layer, pages, pos, sent))
            need += n
            shapes.append(f"{s.kind} layer {s.layer}: {pos.size} x {nb} B")
        if need != size:
            listed = "; ".join(shapes[:4]) + ("; ..." if len(shapes) > 4 else "")
            raise BadRequestError(
                f"room {r.room!r}: chunk has {size} page bytes, its {len(sections)} section(s) "
                f"need {need} ({listed}); expected one digest and one page of bytes per position"
            )
        return parts

    @staticmethod
    def digest_mismatch(parts: list[_ChunkPart], got: list[np.ndarray], rank: int) -> str | None:
        """Why the chunk's pages do not hash to the sender's digests, or None."""
        for p, g in zip(parts, got, strict=True):
            bad = np.flatnonzero(g != p.digests)
            if bad.size:
                i = int(bad[0])
                return (
                    f"digest mismatch on {p.kind} layer {p.layer} position "
                    f"{int(p.positions[i])} from prefill rank {rank}: page bytes hash "
                    f"to {int(g[i]):#018x}, the sender's digest is {int(p.digests[i]):#018x} "
                    f"({bad.size} bad page(s) in the section)"
                )
        return None

    def write(
        self, r: _Room, rank: int, attempt: int, parts: list[_ChunkPart], got: list[np.ndarray]
    ) -> tuple[int, int] | None:
        """Stage a checked chunk (room lock held, digests verified): (pages new, pages
        retried or stale), or None after failing the room."""
        if r.staging is None:
            self.ensure(r, required=False)
        written = duplicate = 0
        for p, g in zip(parts, got, strict=True):
            n_new = self._stage(r, rank, attempt, p, g)
            if n_new is None:  # the room failed
                return None
            written += n_new
            duplicate += int(p.positions.size) - n_new
        return written, duplicate

    def _stage(
        self, r: _Room, sender_rank: int, attempt: int, p: _ChunkPart, got: np.ndarray
    ) -> int | None:
        """Copy a section's new pages into staging (room lock held, digests checked);
        returns how many were new, or None after failing the room (a position held by
        another rank, or resent in the same attempt with other bytes)."""
        b, pos = p.buffer, p.positions
        writer, prev_attempt = r.writer[b, pos], r.attempt[b, pos]
        foreign = np.flatnonzero((writer >= 0) & (writer != sender_rank))
        if foreign.size:
            i = int(foreign[0])
            self._rooms.fail(
                r, two_ranks(p.kind, p.layer, int(pos[i]), int(writer[i]), sender_rank)
            )
            return None
        mine = writer == sender_rank
        same = mine & (prev_attempt == attempt)
        conflict = np.flatnonzero(same & (r.digest[b, pos] != got))
        if conflict.size:
            i = int(conflict[0])
            self._rooms.fail(
                r,
                f"prefill rank {sender_rank} resent position {int(pos[i])} of {p.kind} layer "
                f"{p.layer} in the same attempt {attempt} with different bytes",
            )
            return None
        new = ~mine | (prev_attempt < attempt)  # unwritten, or a newer attempt of mine
        assert r.staging is not None
        if not new.any():
            return 0
        where = pos[new]
        rows = where if r.pos_row is None else r.pos_row[where]
        src = p.pages if new.all() else p.pages[new]
        if rows.size > 1 and rows[-1] - rows[0] == rows.size - 1 and (np.diff(rows) == 1).all():
            r.staging[b][rows[0] : rows[0] + rows.size] = src  # one memcpy
        else:
            r.staging[b][rows] = src
        r.writer[b, where] = sender_rank
        r.attempt[b, where] = attempt
        r.digest[b, where] = got[new]
        return int(where.size)
