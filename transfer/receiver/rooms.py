"""Rooms and their status machine: one request's transfer state, and the room table.

`_Room` is a request's state on the decode side (its senders, staging, who wrote which
page), guarded by its own lock. `RoomTable` holds the live rooms and the tombstones of
finished ones, moves a room forward (`advance`, `fail`; a terminal state retires it:
staging released, a tombstone kept, waiters woken) and lets callers wait for a room to
appear or finish. Lock order: a room's lock, then the table's lock, never the other way.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from cpkv_jax.errors import quote
from cpkv_jax.paging import TRASH_PAGE, pages_for_tokens
from transfer.protocol import (
    Aux,
    BadRequestError,
    DataPlane,
    RoomClosedError,
    RoomExistsError,
    RoomSnapshot,
    RoomState,
    UnknownRoomError,
)
from transfer.staging_arena import Region

if TYPE_CHECKING:
    from transfer.receiver.onesided import RegionInfo

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _SenderState:
    handshaken: bool = False
    attempt: int = 0
    last_seen: float = 0.0
    committed: tuple[int, ...] | None = None  # positions claimed at commit
    plane: DataPlane = "grpc"
    writes_done: bool = False  # Mooncake: its last one-sided write has returned


def _late(room: str, state: RoomState, reason: str, what: str) -> RoomClosedError:
    return RoomClosedError(
        f"room {room!r} is {state.label}"
        + (f" ({reason})" if reason else "")
        + f"; late {what} rejected, nothing was written"
    )


class _Room:
    """One request's transfer state (guarded by `lock`)."""

    def __init__(
        self,
        room: str,
        dst_pages: np.ndarray,
        num_tokens: int,
        n_pages: int,
        cp_size: int,
        n_buffers: int,
        now: float,
    ):
        self.room = room
        self.dst_pages = dst_pages  # every page of the room (freed on failure)
        self.num_tokens = num_tokens
        self.n_pages = n_pages
        self.cp_size = cp_size
        self.state = RoomState.BOOTSTRAPPING
        self.reason = ""
        self.aux: Aux | None = None
        self.registered_at = now
        self.state_since = now
        self.senders = [_SenderState() for _ in range(cp_size)]
        self.lock = threading.Lock()
        self.staging: list[np.ndarray] | None = None  # per buffer [rows, page_bytes]
        # Staging row of each position / position of each row (None: row = position).
        self.pos_row: np.ndarray | None = None
        self.row_pos: np.ndarray | None = None
        self.region: Region | None = None  # arena region holding `staging`
        self.region_info: RegionInfo | None = None  # set once a Mooncake sender asked
        self.writer = np.full((n_buffers, n_pages), -1, np.int32)  # rank, -1 = not written
        self.attempt = np.zeros((n_buffers, n_pages), np.int64)
        self.digest = np.zeros((n_buffers, n_pages), np.uint64)

    def snapshot(self) -> RoomSnapshot:
        return RoomSnapshot(
            room=self.room,
            state=self.state,
            reason=self.reason,
            aux=self.aux if self.state is RoomState.SUCCESS else None,
            num_pages=self.n_pages,
            committed_ranks=tuple(r for r, s in enumerate(self.senders) if s.committed is not None),
        )

    # Checks of a sender message against the room (room lock held).
    def check_open(self, what: str) -> None:
        if self.state.terminal:
            raise _late(self.room, self.state, self.reason, what)

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp_size:
            raise BadRequestError(
                f"room {self.room!r}: sender rank {rank} is outside [0, cp_size={self.cp_size})"
            )

    def positions(self, positions: np.ndarray) -> np.ndarray:
        """`positions` as distinct int64 positions of this room, or `BadRequestError`."""
        pos = np.asarray(positions, np.int64).reshape(-1)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n_pages):
            raise BadRequestError(
                f"room {self.room!r}: positions {quote(pos)} outside [0, n_pages={self.n_pages})"
            )
        if np.unique(pos).size != pos.size:
            raise BadRequestError(f"room {self.room!r}: positions {quote(pos)} repeat a position")
        return pos


def checked_dst_pages(
    room: str,
    dst_pages: np.ndarray,
    num_tokens: int,
    cp_size: int,
    page_size: int,
    num_pages: int,
) -> tuple[np.ndarray, int]:
    """A new room's decode pages as int32, and its page count (`BadRequestError` for a
    bad room id, size, or pages that are not distinct real pages of a `num_pages` pool)."""
    if not isinstance(room, str) or not room:
        raise BadRequestError(f"a room id must be a non-empty string, got {room!r}")
    if num_tokens < 1 or cp_size < 1:
        raise BadRequestError(
            f"room {room!r}: num_tokens ({num_tokens}) and cp_size ({cp_size}) must be >= 1"
        )
    n_pages = pages_for_tokens(num_tokens, page_size)
    dst = np.asarray(dst_pages)
    if dst.ndim != 1 or not np.issubdtype(dst.dtype, np.integer) or dst.size < n_pages:
        raise BadRequestError(
            f"room {room!r}: dst_pages must be 1-D integers with at least {n_pages} pages "
            f"for {num_tokens} tokens, got shape {dst.shape} dtype {dst.dtype}"
        )
    dst = dst.astype(np.int32)
    bad = (dst <= TRASH_PAGE) | (dst >= num_pages)
    if bad.any() or np.unique(dst).size != dst.size:
        raise BadRequestError(
            f"room {room!r}: dst_pages {quote(dst)} must be distinct real pages in [1, {num_pages})"
        )
    return dst, n_pages


# release(room, its staging region or None), table lock held: free (or quarantine) the
# region, and on failure the room's decode pages.
Release = Callable[[_Room, Region | None], None]


class RoomTable:
    """Live rooms, finished rooms' tombstones, and the room status machine.

    `lock` guards the table (and whatever the receiver's helpers keep per finished room,
    such as quarantined regions); `changed` is notified whenever a room is registered
    or finishes.
    """

    def __init__(self, clock: Callable[[], float], finished_kept: int, release: Release):
        self._clock = clock
        self._finished_kept = finished_kept
        self._release = release
        self._rooms: dict[str, _Room] = {}
        self._finished: collections.OrderedDict[str, RoomSnapshot] = collections.OrderedDict()
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)

    def register(
        self, room: str, dst: np.ndarray, num_tokens: int, n_pages: int, cp_size: int, n_buf: int
    ) -> _Room:
        """Add a new room (`RoomExistsError` if the id is live or has a tombstone)."""
        with self.lock:
            if room in self._rooms or room in self._finished:
                raise RoomExistsError(
                    f"room {room!r} already exists; room ids are never reused (a finished room "
                    "is not revived)"
                )
            r = _Room(room, dst, num_tokens, n_pages, cp_size, n_buf, self._clock())
            self._rooms[room] = r
            self.changed.notify_all()  # a handshake may be waiting for it
        logger.debug(
            "room %s registered: %d tokens, %d pages, cp %d", room, num_tokens, n_pages, cp_size
        )
        return r

    def get(self, room: str) -> _Room | None:
        """The live room, or None."""
        with self.lock:
            return self._rooms.get(room)

    def live_rooms(self) -> list[_Room]:
        with self.lock:
            return list(self._rooms.values())

    def live(self, room: str, what: str) -> _Room:
        """The live room; a finished one raises `RoomClosedError` (a late `what`)."""
        r = self.live_or_snapshot(room)
        if isinstance(r, RoomSnapshot):
            raise _late(room, r.state, r.reason, what)
        return r

    def live_or_snapshot(self, room: str) -> _Room | RoomSnapshot:
        with self.lock:
            live = self._rooms.get(room)
            if live is not None:
                return live
            if room in self._finished:
                return self._finished[room]
        raise UnknownRoomError(f"unknown room {room!r}: the decode side never registered it")

    def status(self, room: str) -> RoomSnapshot:
        with self.lock:
            live = self._rooms.get(room)
            if live is None:
                if room in self._finished:
                    return self._finished[room]
                raise UnknownRoomError(f"unknown room {room!r}")
        with live.lock:
            return live.snapshot()

    # ---- waiting --------------------------------------------------------------------------
    def wait_for_change(self, timeout: float) -> None:
        with self.changed:
            self.changed.wait(timeout)

    def wait_registered(self, room: str, timeout: float) -> bool:
        deadline = self._clock() + timeout
        with self.changed:
            while room not in self._rooms and room not in self._finished:
                left = deadline - self._clock()
                if left <= 0:
                    return False
                self.changed.wait(left)
        return True

    def wait(self, room: str, timeout: float | None = None) -> RoomSnapshot:
        deadline = None if timeout is None else self._clock() + timeout
        with self.changed:
            while room in self._rooms:
                left = None if deadline is None else deadline - self._clock()
                if left is not None and left <= 0:
                    break
                self.changed.wait(left)
        return self.status(room)

    # ---- the status machine (room lock held) ------------------------------------------------
    def advance(self, r: _Room, new: RoomState) -> None:
        """Move `r` forward; terminal states retire the room."""
        if not r.state.can_become(new):
            raise AssertionError(
                f"room {r.room!r}: illegal transition {r.state.label} -> {new.label}"
            )
        logger.debug("room %s: %s -> %s", r.room, r.state.label, new.label)
        r.state, r.state_since = new, self._clock()
        if new.terminal:
            self._retire(r)

    def fail(self, r: _Room, reason: str) -> None:
        if r.state.terminal:
            return
        r.reason = reason
        logger.warning("room %s failed: %s", r.room, reason)
        self.advance(r, RoomState.FAILED)

    def _retire(self, r: _Room) -> None:
        """Drop the staging, release what the room holds (`release`), keep a tombstone,
        wake waiters."""
        r.staging = None
        region, r.region = r.region, None
        snap = r.snapshot()
        with self.changed:
            self._release(r, region)
            self._rooms.pop(r.room, None)
            self._finished[r.room] = snap
            while len(self._finished) > self._finished_kept:
                self._finished.popitem(last=False)
            self.changed.notify_all()
