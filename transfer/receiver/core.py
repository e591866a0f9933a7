"""`Receiver`: the decode side's pure-Python transfer core (no gRPC), a facade.

It checks each sender message against its room and sequences the work under the
room's lock; the work itself is done by its helpers: the room table and status machine
(`rooms.RoomTable`), staging by position (`staging.Staging`), the exact-coverage commit
and scatter into the KV sink (`commit.Committer`), the one-sided data plane
(`onesided.OneSidedPlane`) and the timeout thread (`timeouts.Reaper`). The invariants
it keeps are listed in `transfer.receiver`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from cpkv_jax.kv_store import PagedKVStore
from cpkv_jax.model.kv_cache import KVPool
from cpkv_jax.paging import PageAllocator
from transfer.page_plan import PROTOCOL_VERSION, BufferKind, LayoutDescriptor, row_digests
from transfer.protocol import (
    MAX_CHUNK_BYTES,
    Aux,
    BadRequestError,
    DataPlane,
    DigestMismatchError,
    NotHandshakenError,
    PageSection,
    ProtocolVersionError,
    RoomClosedError,
    RoomSnapshot,
    RoomState,
    TransferTimeouts,
)
from transfer.receiver.commit import Committer, HostSink
from transfer.receiver.onesided import OneSidedPlane, RegionInfo, StagingEndpoint
from transfer.receiver.rooms import RoomTable, _Room, checked_dst_pages
from transfer.receiver.staging import Staging
from transfer.receiver.timeouts import Reaper, fail_timed_out
from transfer.staging_arena import Region, StagingArena

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class HandshakeResult:
    accepted: bool
    mismatches: tuple[str, ...]
    status: RoomSnapshot
    dst_pages: np.ndarray  # [n_pages] decode page of each logical position
    region: RegionInfo | None = None  # accepted Mooncake handshakes only


@dataclasses.dataclass(frozen=True)
class WriteResult:
    written: int  # pages copied into staging
    duplicate: int  # retried or stale pages ignored
    status: RoomSnapshot


def _shape_mismatches(
    ours: LayoutDescriptor, theirs: LayoutDescriptor, r: _Room, cp_size: int, num_tokens: int
) -> list[str]:
    """How a sender's handshake (its layout, cp size, token count) differs from `r`."""
    out = [f"layout {m} (decode != prefill)" for m in ours.mismatches(theirs)]
    if cp_size != r.cp_size:
        out.append(f"cp_size: {r.cp_size} != {cp_size}")
    if num_tokens != r.num_tokens:
        out.append(f"num_tokens: {r.num_tokens} != {num_tokens}")
    return out


class Receiver:
    """Decode-side room registry and page receiver (see `transfer.receiver`).

    `kv` is the `PagedKVStore` rooms commit into: the decode `KVPool` (single device,
    `init_pool` layout) described by `layout`, and the allocator of its pages. Passing
    `(pool, allocator)` instead wraps them in a new sink (`receiver.kv`). Allocate decode
    pages through the sink or `allocate_pages` / `free_pages`, and read the pool through
    `pool` once a room succeeded.

    A host-only sink (`pool=None`) makes a host-only receiver (benchmarks): nothing is
    scattered to a device; a successful room's verified staging rows go to `host_sink`
    (if any). `mooncake` attaches a one-sided data plane endpoint (its arena becomes the
    staging arena); `staging_arena` alone gives gRPC rooms pre-faulted, reused staging.
    """

    def __init__(
        self,
        layout: LayoutDescriptor,
        kv: PagedKVStore | KVPool | None,
        allocator: PageAllocator | None = None,
        *,
        timeouts: TransferTimeouts | None = None,
        max_chunk_bytes: int = MAX_CHUNK_BYTES,
        clock: Callable[[], float] = time.monotonic,
        finished_rooms_kept: int = 4096,
        mooncake: StagingEndpoint | None = None,
        staging_arena: StagingArena | None = None,
        host_sink: HostSink | None = None,
    ):
        if mooncake is not None and staging_arena not in (None, mooncake.arena):
            raise ValueError("a Mooncake endpoint brings its own staging arena; pass one, not two")
        if isinstance(kv, PagedKVStore):
            if allocator is not None:
                raise TypeError("pass a PagedKVStore, or a pool and its allocator, not both")
        elif allocator is None:
            raise TypeError(
                "a Receiver needs a PagedKVStore, or a pool (None: host-only) and allocator"
            )
        else:
            kv = PagedKVStore(kv, allocator)
        if host_sink is not None and not kv.host_only:
            raise ValueError("host_sink is for a host-only receiver (pool=None)")
        kv.check_layout(layout.kv_layout)
        self.kv = kv
        self.layout = layout
        self.timeouts = timeouts if timeouts is not None else TransferTimeouts()
        self.max_chunk_bytes = max_chunk_bytes
        self._clock = clock
        arena = mooncake.arena if mooncake is not None else staging_arena
        self._rooms = RoomTable(clock, finished_rooms_kept, self._release)
        self._staging = Staging(layout, arena, self._rooms)
        self._committer = Committer(layout, kv, self._rooms, clock, host_sink)
        self._plane = OneSidedPlane(mooncake, self._staging, self._rooms, clock)
        self._reaper = Reaper(self.poll_timeouts)

    def _release(self, r: _Room, region: Region | None) -> None:
        """What a retiring room holds (table lock held): its staging region, and on
        failure its decode pages."""
        if region is not None:
            self._plane.release_region(r, region)
        if r.state is RoomState.FAILED:
            self.kv.free_pages(r.dst_pages)

    # ---- the KV sink, for the decode side (`KVStore`) -----------------------------------------
    @property
    def pool(self) -> KVPool:
        """The decode pool (replaced by every successful commit: read it after Success)."""
        return self.kv.pool

    def update_pool(self, step: Callable[[KVPool], tuple[T, KVPool]]) -> T:
        """`PagedKVStore.update_pool`: decode steps that donate the pool run here, so no commit
        scatter runs in between and the receiver never holds a donated pool."""
        return self.kv.update_pool(step)

    def allocate_pages(self, n: int, rank: int = 0) -> np.ndarray:
        """`n` decode pages from the sink's allocator, all on DP rank `rank`."""
        return self.kv.allocate_pages(n, rank)

    def free_pages(self, pages: np.ndarray) -> None:
        """Give decode pages back (e.g. a successful room's, once its request is done)."""
        self.kv.free_pages(pages)

    @property
    def num_free_pages(self) -> int:
        return self.kv.num_free_pages

    @property
    def num_free_pages_per_rank(self) -> tuple[int, ...]:
        return self.kv.num_free_pages_per_rank

    # ---- decode-side API ------------------------------------------------------------------
    @property
    def staging_arena(self) -> StagingArena | None:
        """The arena rooms stage in (the Mooncake endpoint's), or None."""
        return self._staging.arena

    def quarantined_rooms(self) -> dict[str, tuple[int, ...]]:
        """Failed rooms whose staging region is quarantined -> ranks not known done."""
        return self._plane.quarantined_rooms()

    def staging_refusal(self, n_pages: int) -> str | None:
        """Why a Mooncake room of `n_pages` pages can never stage here - it needs more
        than the whole staging arena - or None (it fits, or there is no Mooncake
        endpoint). A decode server asks at admission, before the room exists."""
        return self._plane.staging_refusal(n_pages)

    def staging_bytes(self, n_pages: int) -> int:
        """Arena bytes a room of `n_pages` pages stages in (0 without an arena)."""
        return self._staging.staging_bytes(n_pages)

    def register_room(
        self, room: str, dst_pages: np.ndarray, num_tokens: int, cp_size: int
    ) -> RoomSnapshot:
        """Open a room for a request of `num_tokens` tokens sent by `cp_size` ranks.

        `dst_pages` are the request's decode pages (allocated from this receiver's
        allocator): logical page `p < pages_for_tokens(num_tokens)` lands on
        `dst_pages[p]`; extra trailing pages (room for decoded tokens) belong to the room
        too and are freed with it on failure.
        """
        dst, n_pages = checked_dst_pages(
            room, dst_pages, num_tokens, cp_size, self.layout.page_size, self.kv.num_pages
        )
        n_buf = len(self._staging.buffers)
        r = self._rooms.register(room, dst, num_tokens, n_pages, cp_size, n_buf)
        return r.snapshot()

    def status(self, room: str) -> RoomSnapshot:
        return self._rooms.status(room)

    def wait_for_change(self, timeout: float) -> None:
        """Block until a room is registered or finishes, or `timeout` s pass."""
        self._rooms.wait_for_change(timeout)

    def wait_registered(self, room: str, timeout: float) -> bool:
        """Block until `room` is registered (or was, and finished), or `timeout` s pass."""
        return self._rooms.wait_registered(room, timeout)

    def wait(self, room: str, timeout: float | None = None) -> RoomSnapshot:
        """Block until the room is finished (or `timeout`); returns its status."""
        return self._rooms.wait(room, timeout)

    def staging(self, room: str) -> tuple[np.ndarray, ...] | None:
        """The live room's staging buffers (`[rows, page_bytes]` uint8 per buffer, in
        `layout.buffers()` order), or None before the first page / after the end.
        Row `staging_rows(room)[p]` holds position `p` (row p without an arena).
        For tests and debugging: the arrays are the receiver's own."""
        r = self._rooms.get(room)
        return None if r is None else self._staging.buffers_of(r)

    def staging_rows(self, room: str) -> np.ndarray | None:
        """Staging row of each position of a live room (`[n_pages]`), or None when it
        has no staging yet / any more. Without an arena, row = position."""
        r = self._rooms.get(room)
        return None if r is None else self._staging.rows_of(r)

    def abort(self, room: str, reason: str, sender_rank: int | None = None) -> RoomSnapshot:
        """Fail a live room (decode side, or prefill via the Abort RPC); a finished room
        is returned unchanged."""
        r = self._rooms.live_or_snapshot(room)
        if isinstance(r, RoomSnapshot):
            return r
        who = "decode side" if sender_rank is None else f"prefill rank {sender_rank}"
        with r.lock:
            if not r.state.terminal:
                self._rooms.fail(r, f"aborted by {who}: {reason or 'no reason given'}")
            return r.snapshot()

    # ---- sender messages ------------------------------------------------------------------
    def handshake(
        self,
        room: str,
        sender_rank: int,
        cp_size: int,
        num_tokens: int,
        layout: LayoutDescriptor,
        attempt: int = 0,
        data_plane: DataPlane = "grpc",
    ) -> HandshakeResult:
        """Check a sender's layout and request shape before any data moves.

        Another protocol version raises `ProtocolVersionError`; any other difference
        (layout fields, cp size, token count, a data plane this receiver cannot serve)
        is refused with `accepted=False` and the list of mismatches. Both fail the room,
        since its sender cannot serve it.

        `data_plane="mooncake"` also gets the room's staging region (`HandshakeResult.
        region`), carved from the Mooncake endpoint's arena at the room's first such
        handshake; when the arena has no space for it now, `StagingFullError` (retryable)
        is raised and the room is left as it was. A repeated handshake of the same rank
        and attempt is accepted again (a lost reply); a Mooncake rank's handshake with
        another attempt is refused (its earlier incarnation's writes cannot be fenced).
        """
        r = self._rooms.live(room, "handshake")
        with r.lock:
            r.check_open("handshake")
            r.check_rank(sender_rank)
            if layout.protocol_version != PROTOCOL_VERSION:
                msg = (
                    f"prefill rank {sender_rank} speaks transfer protocol version "
                    f"{layout.protocol_version}, decode {PROTOCOL_VERSION}; run the same "
                    "cpkv-jax version on prefill and decode"
                )
                self._rooms.fail(r, msg)
                raise ProtocolVersionError(f"room {room!r}: {msg}")
            mismatches = _shape_mismatches(self.layout, layout, r, cp_size, num_tokens)
            s = r.senders[sender_rank]
            mismatches.extend(self._plane.refusals(r, s, sender_rank, attempt, data_plane))
            if mismatches:
                self._rooms.fail(
                    r,
                    f"handshake of prefill rank {sender_rank} refused before any data moved: "
                    + "; ".join(mismatches),
                )
                return HandshakeResult(False, tuple(mismatches), r.snapshot(), r.dst_pages[:0])
            if data_plane == "mooncake" and r.region_info is None:
                if r.staging is None:
                    self._staging.ensure(r, required=True)  # StagingFullError: retry later
                r.region_info = self._plane.region_info(r)
            s.handshaken, s.attempt, s.last_seen = True, max(s.attempt, attempt), self._clock()
            s.plane = data_plane
            if data_plane == "mooncake":
                # The rank writes as soon as it has the reply: pages may be arriving.
                if r.state < RoomState.TRANSFERRING:
                    self._rooms.advance(r, RoomState.TRANSFERRING)
            elif r.state is RoomState.BOOTSTRAPPING and all(x.handshaken for x in r.senders):
                self._rooms.advance(r, RoomState.WAITING_FOR_INPUT)
            return HandshakeResult(
                True,
                (),
                r.snapshot(),
                r.dst_pages[: r.n_pages].copy(),
                r.region_info if data_plane == "mooncake" else None,
            )

    def heartbeat(self, room: str, sender_rank: int, writes_done: bool = False) -> RoomSnapshot:
        """A sender is alive. `writes_done`: its last one-sided write has returned and it
        writes no more (a quarantined region is freed once every such writer said so)."""
        r = self._rooms.live_or_snapshot(room)
        if isinstance(r, RoomSnapshot):
            if writes_done:
                self._plane.sender_done(room, sender_rank)
            return r
        with r.lock:
            r.check_rank(sender_rank)
            if writes_done:
                r.senders[sender_rank].writes_done = True
            if r.state.terminal:  # retired meanwhile: its quarantine (if any) is listed
                if writes_done:
                    self._plane.sender_done(room, sender_rank)
            else:
                r.senders[sender_rank].last_seen = self._clock()
            return r.snapshot()

    def write_pages(
        self,
        room: str,
        sender_rank: int,
        attempt: int,
        kind: BufferKind,
        layer: int,
        positions: np.ndarray,
        digests: np.ndarray,
        data: bytes | memoryview,
    ) -> WriteResult:
        """Stage `len(positions)` pages of one (kind, layer) buffer: `write_chunk` with
        one section."""
        return self.write_chunk(
            room, sender_rank, attempt, (PageSection(kind, layer, positions, digests),), data
        )

    def write_chunk(
        self,
        room: str,
        sender_rank: int,
        attempt: int,
        sections: Sequence[PageSection],
        data: bytes | memoryview,
    ) -> WriteResult:
        """Stage one chunk's pages at their positions: `sections` (one per run of pages
        of a (kind, layer) buffer) lie back to back in `data`.

        Raises `RoomClosedError` for a finished room before reading `data`,
        `BadRequestError` for an inconsistent chunk (the room is untouched), and
        `DigestMismatchError` after failing the room when a page's digest is wrong
        (nothing of the chunk is staged then).
        """
        r = self._rooms.live(room, "write")
        with r.lock:  # reject late writes before reading anything
            r.check_open("write")
            r.check_rank(sender_rank)
            if not r.senders[sender_rank].handshaken:
                raise NotHandshakenError(
                    f"room {room!r}: prefill rank {sender_rank} wrote pages before its handshake"
                )
        parts = self._staging.parse_chunk(r, sections, data, self.max_chunk_bytes)
        got = [row_digests(p.pages, np.arange(p.positions.size)) for p in parts]
        with r.lock:
            r.check_open("write")
            r.senders[sender_rank].last_seen = self._clock()
            msg = self._staging.digest_mismatch(parts, got, sender_rank)
            if msg is not None:
                self._rooms.fail(r, msg)
                raise DigestMismatchError(f"room {room!r}: {msg}")
            counts = self._staging.write(r, sender_rank, attempt, parts, got)
            if counts is None:  # the room failed
                return WriteResult(0, 0, r.snapshot())
            if r.state < RoomState.TRANSFERRING:
                self._rooms.advance(r, RoomState.TRANSFERRING)
            return WriteResult(*counts, r.snapshot())

    def warm_commits(self, max_pages: int) -> int:
        """Compile the commit scatters of rooms of up to `max_pages` pages (before serving:
        writes only the trash page); returns how many programs ran."""
        return self._committer.warm(max_pages)

    def commit(
        self,
        room: str,
        sender_rank: int,
        attempt: int,
        positions: np.ndarray,
        aux: Aux | None = None,
        digests: np.ndarray | None = None,
    ) -> RoomSnapshot:
        """A sender is done; when every sender is, check coverage and scatter (or fail).

        A repeated commit with the same positions is a retry and changes nothing.

        A Mooncake sender wrote its pages into the room's staging region itself; its
        `digests` (`[n_buffers * len(positions)]`: buffer-major in `layout.buffers()`
        order, `positions` order within a buffer) are checked against the staged bytes
        here - a mismatch fails the room with the position and both digests - and from
        then on the pages count as written by this rank.
        """
        try:
            r = self._rooms.live(room, "commit")
        except RoomClosedError:
            self._plane.sender_done(room, sender_rank)  # a sender commits after its last write
            raise
        with r.lock:
            r.check_open("commit")
            r.check_rank(sender_rank)
            s = r.senders[sender_rank]
            if not s.handshaken:
                raise NotHandshakenError(
                    f"room {room!r}: prefill rank {sender_rank} committed before its handshake"
                )
            if s.plane != "mooncake" and digests is not None and len(digests):
                raise BadRequestError(
                    f"room {room!r}: prefill rank {sender_rank} sent page digests with its "
                    "commit, but handshook for gRPC streams (digests travel with the pages)"
                )
            if s.plane != "mooncake" or s.committed is not None:
                return self._committer.commit_locked(r, sender_rank, positions, aux)
            pending = self._plane.begin_commit(r, sender_rank, positions, digests)
            if isinstance(pending, RoomSnapshot):
                return pending
        # Hash outside the room lock (heartbeats keep flowing). A live room keeps its
        # region until this rank commits; should the room fail meanwhile (and its region
        # be freed, every writer done), what was hashed is discarded below.
        got = pending.hash()
        with r.lock:
            r.check_open("commit")
            # s.committed set: a concurrent retry of this commit won.
            if s.committed is None and not self._plane.end_commit(r, sender_rank, pending, got):
                return r.snapshot()
            return self._committer.commit_locked(r, sender_rank, positions, aux)

    # ---- timeouts ---------------------------------------------------------------------------
    def poll_timeouts(self) -> list[str]:
        """Fail every room past a timeout (see `TransferTimeouts`); returns their ids."""
        failed, now = fail_timed_out(self._rooms, self.timeouts, self._clock)
        self._plane.expire_quarantine(now)
        return failed

    def start(self, interval: float | None = None) -> Receiver:
        """Run `poll_timeouts` on a daemon thread every `interval` seconds (default: a
        quarter of the shortest timeout, at most 1 s)."""
        t = self.timeouts
        every = (
            interval
            if interval is not None
            else min(1.0, min(t.bootstrap, t.waiting, t.heartbeat) / 4)
        )
        self._reaper.start(every)
        return self

    def close(self) -> None:
        """Stop the timeout thread (rooms stay as they are)."""
        self._reaper.stop()

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
