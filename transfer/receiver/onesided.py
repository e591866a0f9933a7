"""The one-sided (Mooncake) data plane, receive side: refusals, digest-at-commit, quarantine.

A sender whose handshake asks for the plane (`transfer.backends.mooncake_backend`) gets
the engine session id and its room's region addresses (`RegionInfo`), writes its pages
there one-sided, then commits over gRPC with every page's digest; the digests are
checked against the staged bytes at that commit (`begin_commit` / `end_commit`: the
data never passes through this process otherwise). The decode pool is never registered
with the engine. One-sided writes cannot be refused, so a failed room's region is
quarantined (not reused) until every Mooncake sender of the room said its writes are
done (commit, or a final heartbeat with `writes_done`) or the endpoint's quarantine
timeout passed; and a Mooncake sender's handshake with a new attempt id is refused (an
earlier incarnation's writes could not be fenced).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

from transfer.page_plan import row_digests
from transfer.protocol import DataPlane, RoomSnapshot, RoomState
from transfer.receiver.rooms import RoomTable, _Room, _SenderState
from transfer.receiver.staging import Staging, two_ranks
from transfer.staging_arena import Region, StagingArena

logger = logging.getLogger(__name__)


@runtime_checkable
class StagingEndpoint(Protocol):
    """A one-sided data plane's receive side (`mooncake_backend.MooncakeReceiverEndpoint`):
    the arena its engine registered, and what a sender needs to reach it."""

    arena: StagingArena
    session_id: str
    protocol: str
    quarantine_timeout_s: float


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    """Where a Mooncake sender writes a room's pages (the handshake reply's MooncakeRegion)."""

    session_id: str
    protocol: str
    buffer_addrs: tuple[int, ...]  # row 0 of each buffer, layout.buffers() order
    rows: np.ndarray  # [n_pages] staging row of each logical position
    row_count: int  # rows per buffer


@dataclasses.dataclass
class _Quarantine:
    """A failed room's region, kept out of use while Mooncake writers may be alive."""

    region: Region
    pending: set[int]  # ranks that got the region's address and have not said done
    deadline: float


@dataclasses.dataclass(frozen=True)
class _PendingCommit:
    """A Mooncake commit between its checks and its digest comparison: the positions,
    the sender's digests (flat, buffer-major) and the staged rows to hash."""

    pos: np.ndarray
    sent: np.ndarray
    staging: list[np.ndarray]
    rows: np.ndarray

    def hash(self) -> np.ndarray | None:
        """The staged rows' digests `[n_buffers, len(pos)]` (None for no positions)."""
        if not self.pos.size:
            return None
        return np.stack([row_digests(st, self.rows) for st in self.staging])


class OneSidedPlane:
    """The receiver's one-sided data plane, over `endpoint` (None: none attached, and
    every Mooncake handshake is refused). Quarantined regions are guarded by the room
    table's lock."""

    def __init__(
        self,
        endpoint: StagingEndpoint | None,
        staging: Staging,
        rooms: RoomTable,
        clock: Callable[[], float],
    ):
        self._endpoint = endpoint
        self._staging = staging
        self._rooms = rooms
        self._clock = clock
        self._quarantine: dict[str, _Quarantine] = {}  # guarded by rooms.lock

    # ---- handshake --------------------------------------------------------------------------
    def refusals(
        self, r: _Room, s: _SenderState, rank: int, attempt: int, plane: DataPlane
    ) -> list[str]:
        """Why sender `rank` of `r` (state `s`) cannot have data plane `plane` now."""
        out = []
        if s.handshaken and s.plane != plane:
            out.append(f"data plane: prefill rank {rank} handshook for {s.plane}, now {plane}")
        if plane != "mooncake":
            return out
        if self._endpoint is None:
            out.append(
                "data plane: mooncake asked for, but this decode receiver has no Mooncake "
                "endpoint (start it with one, or send with `transfer_backend` grpc)"
            )
        elif r.staging is not None and r.region is None:
            out.append(
                "data plane: the room already stages gRPC pages outside the staging arena, "
                "where a Mooncake engine cannot write"
            )
        elif r.staging is None:
            why = self.staging_refusal(r.n_pages)
            if why is not None:  # would never fit: retrying cannot help
                out.append(f"staging: {why}")
        if s.handshaken and s.plane == "mooncake" and s.attempt != attempt:
            out.append(
                f"attempt: prefill rank {rank} handshook on the Mooncake data plane with "
                f"attempt {s.attempt}, now {attempt}; the earlier incarnation's one-sided "
                "writes cannot be fenced"
            )
        return out

    def staging_refusal(self, n_pages: int) -> str | None:
        """Why a Mooncake room of `n_pages` pages can never stage here - it needs more
        than the whole staging arena - or None (it fits, or there is no endpoint)."""
        arena = self._staging.arena
        if self._endpoint is None or arena is None:
            return None
        need = self._staging.staging_bytes(n_pages)
        if need <= arena.nbytes:
            return None
        return (
            f"the room's {n_pages} pages need {need} B of staging, more than this decode "
            f"server's whole Mooncake staging arena ({arena.nbytes} B); start it with "
            "a larger one (`staging_bytes`) or send the request to "
            "another decode server"
        )

    def region_info(self, r: _Room) -> RegionInfo:
        """Where `r`'s Mooncake senders write (its staging is in the arena)."""
        assert self._endpoint is not None and r.staging is not None and r.pos_row is not None
        return RegionInfo(
            session_id=self._endpoint.session_id,
            protocol=self._endpoint.protocol,
            buffer_addrs=tuple(int(st.ctypes.data) for st in r.staging),
            rows=r.pos_row.copy(),
            row_count=int(r.staging[0].shape[0]),
        )

    # ---- digest-at-commit -----------------------------------------------------------------
    def begin_commit(
        self, r: _Room, rank: int, positions: np.ndarray, digests: np.ndarray | None
    ) -> RoomSnapshot | _PendingCommit:
        """First half of a Mooncake sender's first commit (room lock held): it writes
        no more; check its digest count. Returns what to hash outside the lock, or the
        snapshot after failing the room."""
        r.senders[rank].writes_done = True  # it commits after its last write returned
        pos = r.positions(positions)
        n_buf = len(self._staging.buffers)
        sent = np.asarray(digests if digests is not None else [], np.uint64).reshape(-1)
        if sent.size != n_buf * pos.size:
            self._rooms.fail(
                r,
                f"prefill rank {rank} committed {pos.size} positions with "
                f"{sent.size} page digests; the Mooncake data plane needs one per (buffer, "
                f"position): {n_buf * pos.size}",
            )
            return r.snapshot()
        assert r.staging is not None and r.pos_row is not None
        return _PendingCommit(pos, sent, list(r.staging), r.pos_row[pos])

    def end_commit(
        self, r: _Room, rank: int, pending: _PendingCommit, got: np.ndarray | None
    ) -> bool:
        """Second half (room lock held again, room still open): compare the staged
        digests `got` with the sender's and count its pages as written by it. False
        after failing the room."""
        if got is None:
            return True
        pos, buffers = pending.pos, self._staging.buffers
        sent = pending.sent.reshape(len(buffers), pos.size)
        writer = r.writer[:, pos]
        foreign = np.argwhere((writer >= 0) & (writer != rank))
        if foreign.size:
            b, i = (int(x) for x in foreign[0])
            kind, layer = buffers[b]
            self._rooms.fail(r, two_ranks(kind, layer, int(pos[i]), int(writer[b, i]), rank))
            return False
        bad = np.argwhere(got != sent)
        if bad.size:
            b, i = (int(x) for x in bad[0])
            kind, layer = buffers[b]
            self._rooms.fail(
                r,
                f"digest mismatch on {kind} layer {layer} position {int(pos[i])} from "
                f"prefill rank {rank}: staged page bytes hash to "
                f"{int(got[b, i]):#018x}, the sender's digest is {int(sent[b, i]):#018x} "
                f"({len(bad)} bad page(s) of {got.size})",
            )
            return False
        r.writer[:, pos] = rank
        r.attempt[:, pos] = r.senders[rank].attempt
        r.digest[:, pos] = got
        return True

    # ---- quarantine ---------------------------------------------------------------------------
    def quarantined_rooms(self) -> dict[str, tuple[int, ...]]:
        """Failed rooms whose staging region is quarantined -> ranks not known done."""
        with self._rooms.lock:
            return {room: tuple(sorted(q.pending)) for room, q in self._quarantine.items()}

    def release_region(self, r: _Room, region: Region) -> None:
        """A retiring room's region (table lock held): back to the arena, or quarantined
        when the room failed while Mooncake writers may still be alive."""
        arena = self._staging.arena
        assert arena is not None
        pending = {
            i
            for i, s in enumerate(r.senders)
            if s.handshaken and s.plane == "mooncake" and not s.writes_done
        }
        if r.state is RoomState.FAILED and pending:
            assert self._endpoint is not None
            arena.quarantine(region)
            timeout = self._endpoint.quarantine_timeout_s
            self._quarantine[r.room] = _Quarantine(region, pending, self._clock() + timeout)
            logger.info(
                "room %s: staging region quarantined until prefill rank(s) %s say "
                "their writes ended (or %gs pass)",
                r.room,
                sorted(pending),
                timeout,
            )
        else:
            arena.free(region)

    def sender_done(self, room: str, rank: int) -> None:
        """A Mooncake sender of a finished room will write no more: maybe unquarantine."""
        with self._rooms.lock:
            q = self._quarantine.get(room)
            if q is None:
                return
            q.pending.discard(rank)
            if q.pending:
                return
            del self._quarantine[room]
            assert self._staging.arena is not None
            self._staging.arena.free(q.region)
        logger.info("room %s: staging region leaves quarantine (every writer done)", room)

    def expire_quarantine(self, now: float) -> None:
        """Free the regions whose quarantine timeout passed by `now`."""
        with self._rooms.lock:
            expired = [room for room, q in self._quarantine.items() if now >= q.deadline]
            for room in expired:
                q = self._quarantine.pop(room)
                assert self._staging.arena is not None
                self._staging.arena.free(q.region)
                logger.warning(
                    "room %s: staging region leaves quarantine after the %gs timeout; prefill "
                    "rank(s) %s never said their Mooncake writes ended",
                    room,
                    self._endpoint.quarantine_timeout_s if self._endpoint else 0.0,
                    sorted(q.pending),
                )
