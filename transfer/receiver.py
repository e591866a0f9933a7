"""Decode side of the PD transfer: rooms, staging by position, exact-coverage commit.

`Receiver` is the pure-Python core (no gRPC): the decode server registers a room per
request with its decode page table, and the prefill senders' messages - decoded by the
gRPC servicer below, or called directly in tests - drive the room's status machine
(`transfer.protocol.RoomState`). Invariants:

- **Status**: BOOTSTRAPPING (registered) -> WAITING_FOR_INPUT (every sender's handshake
  accepted) -> TRANSFERRING (first page) -> SUCCESS | FAILED. Forward only; FAILED is
  sticky; a finished room is kept as a tombstone and never revived (its id cannot be
  registered again while the tombstone is kept).
- **Handshake first**: a sender's layout descriptor is compared with the decode pool's
  before it may write; a mismatch (or another protocol version, cp size or token count)
  fails the room before any data moves.
- **Position addressing** (SPEC S2.1): page bytes land in a host staging buffer per
  (kind, layer) at row `position`; at commit, row `p` is scattered to decode page
  `dst_pages[p]`. Nothing depends on the order pages arrive in.
- **Integrity** (SPEC S2.4): every page's xxh3 digest is checked on arrival; a mismatch
  fails the room with the position and both digests in the reason.
- **Idempotence**: a write is keyed by (room, sender rank, position, attempt) per
  (kind, layer). A retry of a held page (same rank and attempt, same digest) is accepted
  and ignored; a later attempt of the same rank replaces it; an older one is ignored;
  the same position from a different rank fails the room.
- **Late writes**: a write, commit or handshake for a finished room is rejected
  (`RoomClosedError`) before anything is read into memory.
- **Exact coverage** (SPEC S2.4): each sender commits the positions it sent, which must
  equal what it wrote in every buffer; when all `cp_size` senders committed, the
  positions must cover `[0, n_pages)` exactly once and rank 0 must have sent the aux
  data. Then a jitted scatter writes every (kind, layer) leaf of the decode pool (pool
  donated; one call per power-of-two piece of the room's rows, so compiles stay bounded
  and staging holds exactly the room's pages) and the room succeeds. Otherwise it fails
  with the reason, and on every failure the room's decode pages go back to the
  allocator.
- **Staging arena** (optional, `staging_arena=` or a Mooncake endpoint's arena): one
  pre-allocated (pre-faulted) host arena; each room stages in a region carved from it,
  rows in owner-major order (`page_plan.owner_major_order`: rank 0's positions, then rank
  1's, ...), so each rank's positions are one contiguous row range per buffer. Without
  an arena, a room stages in arrays of its own, row = position.
- **Mooncake data plane** (`mooncake=` endpoint, `transfer.backends.mooncake_backend`):
  a sender whose handshake asks for it gets the engine session id and its room's
  region addresses, writes its pages there one-sided, then commits over gRPC with every
  page's digest; the receiver checks the digests against the staged bytes at that
  commit (the data never passes through this process otherwise). The decode pool is
  never registered with the engine. One-sided writes cannot be refused, so a failed
  room's region is **quarantined** (not reused) until every Mooncake sender of the room
  said its writes are done (commit, or a final heartbeat with `writes_done`) or the
  endpoint's quarantine timeout passed; a Mooncake sender's handshake with a new
  attempt id is refused (an earlier incarnation's writes could not be fenced).
- **Host-only receiver** (`pool=None`, for benchmarks): no decode pool and no device
  scatter; at commit the verified staging rows are handed to `host_sink` (if given)
  and the room succeeds.
- **Timeouts** (`TransferTimeouts`): bootstrap (not every sender handshaken in time),
  waiting (no page in time after the handshakes), heartbeat (a handshaken sender that
  has not committed went silent). `poll_timeouts` checks them; `start()` runs it on a
  background thread.

Locking: each room has its own lock (concurrent streams of one room serialize on it);
the registry lock guards the room table, the tombstones and the page allocator and is
only ever taken *inside* a room lock or alone, never the other way round.

`KVTransferServicer` / `serve` expose a `Receiver` over gRPC (service
`cpkv.transfer.v1.KVTransfer`, plus `grpc.health.v1`). Requests are parsed by the
handlers, so malformed bytes, unknown rooms, another protocol version or an oversized
chunk come back as a gRPC status with the reason, and the server keeps serving.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import grpc
import jax
import numpy as np
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cpkv_jax.model.kv_cache import KVPool
from cpkv_jax.paging import TRASH_PAGE, PageAllocator, pages_for_tokens
from transfer.page_plan import (
    PROTOCOL_VERSION,
    BufferKind,
    LayoutDescriptor,
    PagePlanError,
    owner_major_order,
    row_digests,
)
from transfer.proto import kv_transfer_pb2 as pb
from transfer.protocol import (
    HANDSHAKE_HOLD_S,
    MAX_CHUNK_BYTES,
    MESSAGE_SLACK_BYTES,
    SERVICE_NAME,
    Aux,
    BadRequestError,
    ChunkTooLargeError,
    DataPlane,
    DigestMismatchError,
    NotHandshakenError,
    PageSection,
    ProtocolVersionError,
    RoomClosedError,
    RoomExistsError,
    RoomSnapshot,
    RoomState,
    TransferError,
    TransferTimeouts,
    UnknownRoomError,
    data_plane_from_pb,
    layout_from_pb,
    layout_to_pb,
    section_from_pb,
    snapshot_to_pb,
)
from transfer.staging_arena import Region, StagingArena, StagingFullError

logger = logging.getLogger(__name__)

T = TypeVar("T")
M = TypeVar("M", bound=Message)

# Positions quoted in a failure reason.
_QUOTED = 8
# How long a Commit reply waits for its room to finish (see `KVTransferServicer.Commit`).
COMMIT_WAIT_S = 1.0


def _quote(values: np.ndarray | Sequence[int]) -> str:
    v = [int(x) for x in values]
    return "[" + ", ".join(map(str, v[:_QUOTED])) + (", ...]" if len(v) > _QUOTED else "]")


def staging_buffer_sizes(page_bytes: Sequence[int], n_pages: int, alignment: int) -> list[int]:
    """Bytes each buffer of a room's staging region takes in an arena (buffer after
    buffer, `n_pages` rows of `page_bytes[b]`, each rounded up to `alignment`)."""
    return [-(-n_pages * nb // alignment) * alignment for nb in page_bytes]


def staging_region_bytes(layout: LayoutDescriptor, n_pages: int, alignment: int) -> int:
    """Bytes of one room's staging region in an arena (`staging_buffer_sizes` summed)."""
    page_bytes = [layout.page_bytes(kind, layer) for kind, layer in layout.buffers()]
    return sum(staging_buffer_sizes(page_bytes, n_pages, alignment))


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


@runtime_checkable
class StagingEndpoint(Protocol):
    """A one-sided data plane's receive side (`mooncake_backend.MooncakeReceiverEndpoint`):
    the arena its engine registered, and what a sender needs to reach it."""

    arena: StagingArena
    session_id: str
    protocol: str
    quarantine_timeout_s: float


# host_sink(room, positions [n], dst_pages [n], staging per buffer [n, page_bytes]):
# row i of every buffer is logical position positions[i], bound for decode page dst_pages[i].
HostSink = Callable[[str, np.ndarray, np.ndarray, tuple[np.ndarray, ...]], None]


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    """Where a Mooncake sender writes a room's pages (the handshake reply's MooncakeRegion)."""

    session_id: str
    protocol: str
    buffer_addrs: tuple[int, ...]  # row 0 of each buffer, layout.buffers() order
    rows: np.ndarray  # [n_pages] staging row of each logical position
    row_count: int  # rows per buffer


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


@dataclasses.dataclass
class _SenderState:
    handshaken: bool = False
    attempt: int = 0
    last_seen: float = 0.0
    committed: tuple[int, ...] | None = None  # positions claimed at commit
    plane: DataPlane = "grpc"
    writes_done: bool = False  # Mooncake: its last one-sided write has returned


@dataclasses.dataclass
class _Quarantine:
    """A failed room's region, kept out of use while Mooncake writers may be alive."""

    region: Region
    pending: set[int]  # ranks that got the region's address and have not said done
    deadline: float


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


class Receiver:
    """Decode-side room registry and page receiver (see the module docstring).

    `pool` is the decode `KVPool` (single device, `init_pool` layout) described by
    `layout`; `allocator` hands out its pages. The receiver owns both from here on:
    allocate decode pages through `allocate_pages` / `free_pages` (they take the lock
    the receiver frees failed rooms' pages under), and read the pool through `pool`
    once a room succeeded.

    `pool=None` makes a host-only receiver (benchmarks): nothing is scattered to a
    device; a successful room's verified staging rows go to `host_sink` (if any).
    `mooncake` attaches a one-sided data plane endpoint (its arena becomes the staging
    arena); `staging_arena` alone gives gRPC rooms pre-faulted, reused staging.
    """

    def __init__(
        self,
        layout: LayoutDescriptor,
        pool: KVPool | None,
        allocator: PageAllocator,
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
        if host_sink is not None and pool is not None:
            raise ValueError("host_sink is for a host-only receiver (pool=None)")
        self._mooncake = mooncake
        self._arena = mooncake.arena if mooncake is not None else staging_arena
        self._host_sink = host_sink
        self.layout = layout
        self.timeouts = timeouts if timeouts is not None else TransferTimeouts()
        self.max_chunk_bytes = max_chunk_bytes
        self._clock = clock
        self._finished_kept = finished_rooms_kept
        self._buffers: tuple[tuple[BufferKind, int], ...] = layout.buffers()
        self._buffer_index = {b: i for i, b in enumerate(self._buffers)}
        self._page_bytes = [layout.page_bytes(k, layer) for k, layer in self._buffers]
        if pool is not None:
            self._check_pool(pool, allocator)
        self._pool = pool
        self._allocator = allocator
        self._rooms: dict[str, _Room] = {}
        self._finished: collections.OrderedDict[str, RoomSnapshot] = collections.OrderedDict()
        self._quarantine: dict[str, _Quarantine] = {}  # guarded by self._lock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pool_lock = threading.Lock()
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()

    def _check_pool(self, pool: KVPool, allocator: PageAllocator) -> None:
        lay = self.layout
        want = (lay.num_layers, len(lay.full_indexer_layers), len(lay.full_indexer_layers))
        have = (len(pool.latent), len(pool.index_k), len(pool.index_scale))
        if not lay.has_index_scale:
            want = (*want[:2], 0)
        if have != want:
            raise ValueError(
                f"decode pool has (latent, index_k, index_scale) leaves {have} but the layout "
                f"describes {want}"
            )
        for (kind, layer), nbytes in zip(self._buffers, self._page_bytes, strict=True):
            leaf = self._leaf(pool, kind, layer)
            got = int(np.prod(leaf.shape[1:])) * leaf.dtype.itemsize
            if got != nbytes or leaf.shape[1] != lay.page_size:
                raise ValueError(
                    f"decode pool leaf {kind}[{layer}] {leaf.shape} {leaf.dtype} has "
                    f"{got} B pages; the layout says {nbytes} B of page_size {lay.page_size}"
                )
        if allocator.num_pages != pool.num_pages:
            raise ValueError(
                f"allocator manages {allocator.num_pages} pages but the pool has {pool.num_pages}"
            )

    def _leaf(self, pool: KVPool, kind: BufferKind, layer: int) -> jax.Array:
        return getattr(pool, kind)[self.layout.leaf_index(kind, layer)]

    # ---- decode-side API ------------------------------------------------------------------
    @property
    def pool(self) -> KVPool:
        """The decode pool (replaced by every successful commit: read it after Success)."""
        with self._pool_lock:
            if self._pool is None:
                raise ValueError("this is a host-only receiver (pool=None): it has no decode pool")
            return self._pool

    @property
    def staging_arena(self) -> StagingArena | None:
        """The arena rooms stage in (the Mooncake endpoint's), or None."""
        return self._arena

    def quarantined_rooms(self) -> dict[str, tuple[int, ...]]:
        """Failed rooms whose staging region is quarantined -> ranks not known done."""
        with self._lock:
            return {room: tuple(sorted(q.pending)) for room, q in self._quarantine.items()}

    def update_pool(self, step: Callable[[KVPool], tuple[T, KVPool]]) -> T:
        """Run `step(pool) -> (result, new_pool)` under the pool lock and keep `new_pool`.

        For decode steps that donate the pool: no commit scatter can run in between, and
        the receiver never holds a donated (deleted) pool.
        """
        with self._pool_lock:
            if self._pool is None:
                raise ValueError("this is a host-only receiver (pool=None): it has no decode pool")
            result, self._pool = step(self._pool)
            return result

    def allocate_pages(self, n: int) -> np.ndarray:
        """`n` decode pages from the receiver's allocator (under its lock)."""
        with self._lock:
            return self._allocator.alloc(n)

    def free_pages(self, pages: np.ndarray) -> None:
        """Give decode pages back (e.g. a successful room's, once its request is done)."""
        with self._lock:
            self._allocator.free(pages)

    @property
    def num_free_pages(self) -> int:
        with self._lock:
            return self._allocator.num_free

    def register_room(
        self, room: str, dst_pages: np.ndarray, num_tokens: int, cp_size: int
    ) -> RoomSnapshot:
        """Open a room for a request of `num_tokens` tokens sent by `cp_size` ranks.

        `dst_pages` are the request's decode pages (allocated from this receiver's
        allocator): logical page `p < pages_for_tokens(num_tokens)` lands on
        `dst_pages[p]`; extra trailing pages (room for decoded tokens) belong to the room
        too and are freed with it on failure.
        """
        if not isinstance(room, str) or not room:
            raise BadRequestError(f"a room id must be a non-empty string, got {room!r}")
        if num_tokens < 1 or cp_size < 1:
            raise BadRequestError(
                f"room {room!r}: num_tokens ({num_tokens}) and cp_size ({cp_size}) must be >= 1"
            )
        n_pages = pages_for_tokens(num_tokens, self.layout.page_size)
        dst = np.asarray(dst_pages)
        if dst.ndim != 1 or not np.issubdtype(dst.dtype, np.integer) or dst.size < n_pages:
            raise BadRequestError(
                f"room {room!r}: dst_pages must be 1-D integers with at least {n_pages} pages "
                f"for {num_tokens} tokens, got shape {dst.shape} dtype {dst.dtype}"
            )
        dst = dst.astype(np.int32)
        num_pages = self._allocator.num_pages
        bad = (dst <= TRASH_PAGE) | (dst >= num_pages)
        if bad.any() or np.unique(dst).size != dst.size:
            raise BadRequestError(
                f"room {room!r}: dst_pages {_quote(dst)} must be distinct real pages in "
                f"[1, {num_pages})"
            )
        with self._lock:
            if room in self._rooms or room in self._finished:
                raise RoomExistsError(
                    f"room {room!r} already exists; room ids are never reused (a finished room "
                    "is not revived)"
                )
            r = _Room(room, dst, num_tokens, n_pages, cp_size, len(self._buffers), self._clock())
            self._rooms[room] = r
            self._changed.notify_all()  # a handshake may be waiting for it
        logger.debug(
            "room %s registered: %d tokens, %d pages, cp %d", room, num_tokens, n_pages, cp_size
        )
        return r.snapshot()

    def status(self, room: str) -> RoomSnapshot:
        with self._lock:
            live = self._rooms.get(room)
            if live is None:
                if room in self._finished:
                    return self._finished[room]
                raise UnknownRoomError(f"unknown room {room!r}")
        with live.lock:
            return live.snapshot()

    def wait_for_change(self, timeout: float) -> None:
        """Block until a room is registered or finishes, or `timeout` s pass."""
        with self._changed:
            self._changed.wait(timeout)

    def wait_registered(self, room: str, timeout: float) -> bool:
        """Block until `room` is registered (or was, and finished), or `timeout` s pass."""
        deadline = self._clock() + timeout
        with self._changed:
            while room not in self._rooms and room not in self._finished:
                left = deadline - self._clock()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def wait(self, room: str, timeout: float | None = None) -> RoomSnapshot:
        """Block until the room is finished (or `timeout`); returns its status."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._changed:
            while room in self._rooms:
                left = None if deadline is None else deadline - self._clock()
                if left is not None and left <= 0:
                    break
                self._changed.wait(left)
        return self.status(room)

    def staging(self, room: str) -> tuple[np.ndarray, ...] | None:
        """The live room's staging buffers (`[rows, page_bytes]` uint8 per buffer, in
        `layout.buffers()` order), or None before the first page / after the end.
        Row `staging_rows(room)[p]` holds position `p` (row p without an arena).
        For tests and debugging: the arrays are the receiver's own."""
        with self._lock:
            live = self._rooms.get(room)
        if live is None:
            return None
        with live.lock:
            return None if live.staging is None else tuple(live.staging)

    def staging_rows(self, room: str) -> np.ndarray | None:
        """Staging row of each position of a live room (`[n_pages]`), or None when it
        has no staging yet / any more. Without an arena, row = position."""
        with self._lock:
            live = self._rooms.get(room)
        if live is None:
            return None
        with live.lock:
            if live.staging is None:
                return None
            if live.pos_row is None:
                return np.arange(live.n_pages, dtype=np.int64)
            return live.pos_row.copy()

    def abort(self, room: str, reason: str, sender_rank: int | None = None) -> RoomSnapshot:
        """Fail a live room (decode side, or prefill via the Abort RPC); a finished room
        is returned unchanged."""
        r = self._live_or_snapshot(room)
        if isinstance(r, RoomSnapshot):
            return r
        who = "decode side" if sender_rank is None else f"prefill rank {sender_rank}"
        with r.lock:
            if not r.state.terminal:
                self._fail(r, f"aborted by {who}: {reason or 'no reason given'}")
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
        r = self._live(room, "handshake")
        with r.lock:
            self._check_open(r, "handshake")
            self._check_rank(r, sender_rank)
            if layout.protocol_version != PROTOCOL_VERSION:
                msg = (
                    f"prefill rank {sender_rank} speaks transfer protocol version "
                    f"{layout.protocol_version}, decode {PROTOCOL_VERSION}; run the same "
                    "cpkv-jax version on prefill and decode"
                )
                self._fail(r, msg)
                raise ProtocolVersionError(f"room {room!r}: {msg}")
            mismatches = [f"layout {m} (decode != prefill)" for m in self.layout.mismatches(layout)]
            if cp_size != r.cp_size:
                mismatches.append(f"cp_size: {r.cp_size} != {cp_size}")
            if num_tokens != r.num_tokens:
                mismatches.append(f"num_tokens: {r.num_tokens} != {num_tokens}")
            s = r.senders[sender_rank]
            mismatches.extend(self._plane_refusals(r, s, sender_rank, attempt, data_plane))
            if mismatches:
                self._fail(
                    r,
                    f"handshake of prefill rank {sender_rank} refused before any data moved: "
                    + "; ".join(mismatches),
                )
                return HandshakeResult(False, tuple(mismatches), r.snapshot(), r.dst_pages[:0])
            if data_plane == "mooncake" and r.region_info is None:
                if r.staging is None:
                    self._ensure_staging(r, required=True)  # StagingFullError: retry later
                r.region_info = self._region_info(r)
            s.handshaken, s.attempt, s.last_seen = True, max(s.attempt, attempt), self._clock()
            s.plane = data_plane
            if data_plane == "mooncake":
                # The rank writes as soon as it has the reply: pages may be arriving.
                if r.state < RoomState.TRANSFERRING:
                    self._advance(r, RoomState.TRANSFERRING)
            elif r.state is RoomState.BOOTSTRAPPING and all(x.handshaken for x in r.senders):
                self._advance(r, RoomState.WAITING_FOR_INPUT)
            return HandshakeResult(
                True,
                (),
                r.snapshot(),
                r.dst_pages[: r.n_pages].copy(),
                r.region_info if data_plane == "mooncake" else None,
            )

    def _plane_refusals(
        self, r: _Room, s: _SenderState, rank: int, attempt: int, plane: DataPlane
    ) -> list[str]:
        out = []
        if s.handshaken and s.plane != plane:
            out.append(f"data plane: prefill rank {rank} handshook for {s.plane}, now {plane}")
        if plane != "mooncake":
            return out
        if self._mooncake is None:
            out.append(
                "data plane: mooncake asked for, but this decode receiver has no Mooncake "
                "endpoint (start it with one, or use --transfer-backend grpc)"
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
        than the whole staging arena - or None (it fits, or there is no Mooncake
        endpoint). A decode server asks at admission, before the room exists."""
        if self._mooncake is None or self._arena is None:
            return None
        need = self.staging_bytes(n_pages)
        if need <= self._arena.nbytes:
            return None
        return (
            f"the room's {n_pages} pages need {need} B of staging, more than this decode "
            f"server's whole Mooncake staging arena ({self._arena.nbytes} B); start it with "
            "a larger one (cpkv-serve --transfer-staging-size) or send the request to "
            "another decode server"
        )

    def staging_bytes(self, n_pages: int) -> int:
        """Arena bytes a room of `n_pages` pages stages in (0 without an arena)."""
        if self._arena is None:
            return 0
        return sum(staging_buffer_sizes(self._page_bytes, n_pages, self._arena.alignment))

    def _ensure_staging(self, r: _Room, required: bool) -> None:
        """Give `r` its staging buffers (room lock held).

        With an arena: one region, buffer after buffer, rows in owner-major order
        (`StagingFullError` if `required` and the arena is full; otherwise a full arena
        falls back to private arrays). Exactly `n_pages` rows: the commit scatters them
        in power-of-two pieces (`pow2_pieces`), which bounds the compiles."""
        rows = r.n_pages
        if self._arena is not None:
            sizes = staging_buffer_sizes(self._page_bytes, rows, self._arena.alignment)
            try:
                region = self._arena.alloc(sum(sizes), r.room)
            except StagingFullError:
                if required:
                    raise
                logger.warning("room %s: staging arena full, staging in private arrays", r.room)
            else:
                offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
                r.region = region
                r.staging = [
                    self._arena.view(region, off, rows * nb).reshape(rows, nb)
                    for off, nb in zip(offsets, self._page_bytes, strict=True)
                ]
                order = owner_major_order(r.n_pages, r.cp_size)
                r.row_pos = order
                r.pos_row = np.empty(r.n_pages, np.int64)
                r.pos_row[order] = np.arange(r.n_pages, dtype=np.int64)
                return
        r.staging = [np.zeros((rows, nb), np.uint8) for nb in self._page_bytes]

    def _region_info(self, r: _Room) -> RegionInfo:
        assert self._mooncake is not None and r.staging is not None and r.pos_row is not None
        return RegionInfo(
            session_id=self._mooncake.session_id,
            protocol=self._mooncake.protocol,
            buffer_addrs=tuple(int(st.ctypes.data) for st in r.staging),
            rows=r.pos_row.copy(),
            row_count=int(r.staging[0].shape[0]),
        )

    def heartbeat(self, room: str, sender_rank: int, writes_done: bool = False) -> RoomSnapshot:
        """A sender is alive. `writes_done`: its last one-sided write has returned and it
        writes no more (a quarantined region is freed once every such writer said so)."""
        r = self._live_or_snapshot(room)
        if isinstance(r, RoomSnapshot):
            if writes_done:
                self._sender_done(room, sender_rank)
            return r
        with r.lock:
            self._check_rank(r, sender_rank)
            if writes_done:
                r.senders[sender_rank].writes_done = True
            if r.state.terminal:  # retired meanwhile: its quarantine (if any) is listed
                if writes_done:
                    self._sender_done(room, sender_rank)
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
        r = self._live(room, "write")
        with r.lock:  # reject late writes before reading anything
            self._check_open(r, "write")
            self._check_rank(r, sender_rank)
            if not r.senders[sender_rank].handshaken:
                raise NotHandshakenError(
                    f"room {room!r}: prefill rank {sender_rank} wrote pages before its handshake"
                )
        parts = self._parse_chunk(r, sections, data)
        got = [row_digests(p.pages, np.arange(p.positions.size)) for p in parts]
        with r.lock:
            self._check_open(r, "write")
            r.senders[sender_rank].last_seen = self._clock()
            for p, g in zip(parts, got, strict=True):
                bad = np.flatnonzero(g != p.digests)
                if bad.size:
                    i = int(bad[0])
                    msg = (
                        f"digest mismatch on {p.kind} layer {p.layer} position "
                        f"{int(p.positions[i])} from prefill rank {sender_rank}: page bytes hash "
                        f"to {int(g[i]):#018x}, the sender's digest is {int(p.digests[i]):#018x} "
                        f"({bad.size} bad page(s) in the section)"
                    )
                    self._fail(r, msg)
                    raise DigestMismatchError(f"room {room!r}: {msg}")
            if r.staging is None:
                self._ensure_staging(r, required=False)
            written = duplicate = 0
            for p, g in zip(parts, got, strict=True):
                n_new = self._stage_locked(r, sender_rank, attempt, p, g)
                if n_new is None:  # the room failed
                    return WriteResult(0, 0, r.snapshot())
                written += n_new
                duplicate += int(p.positions.size) - n_new
            if r.state < RoomState.TRANSFERRING:
                self._advance(r, RoomState.TRANSFERRING)
            return WriteResult(written, duplicate, r.snapshot())

    def _stage_locked(
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
            self._fail(
                r, self._two_ranks(p.kind, p.layer, int(pos[i]), int(writer[i]), sender_rank)
            )
            return None
        mine = writer == sender_rank
        same = mine & (prev_attempt == attempt)
        conflict = np.flatnonzero(same & (r.digest[b, pos] != got))
        if conflict.size:
            i = int(conflict[0])
            self._fail(
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

    @staticmethod
    def _two_ranks(kind: BufferKind, layer: int, position: int, first: int, second: int) -> str:
        return (
            f"position {position} of {kind} layer {layer} was sent by prefill ranks "
            f"{first} and {second}; each position must come from exactly one rank"
        )

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
            r = self._live(room, "commit")
        except RoomClosedError:
            self._sender_done(room, sender_rank)  # a sender commits after its last write
            raise
        with r.lock:
            self._check_open(r, "commit")
            self._check_rank(r, sender_rank)
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
                return self._commit_locked(r, sender_rank, positions, aux)
            s.writes_done = True  # a Mooncake sender commits after its last write returned
            pos = self._positions(r, positions)
            n_buf = len(self._buffers)
            sent = np.asarray(digests if digests is not None else [], np.uint64).reshape(-1)
            if sent.size != n_buf * pos.size:
                self._fail(
                    r,
                    f"prefill rank {sender_rank} committed {pos.size} positions with "
                    f"{sent.size} page digests; the Mooncake data plane needs one per (buffer, "
                    f"position): {n_buf * pos.size}",
                )
                return r.snapshot()
            assert r.staging is not None and r.pos_row is not None
            staging, rows = list(r.staging), r.pos_row[pos]
        # Hash outside the room lock (heartbeats keep flowing). A live room keeps its
        # region until this rank commits; should the room fail meanwhile (and its region
        # be freed, every writer done), what was hashed is discarded below.
        got = np.stack([row_digests(st, rows) for st in staging]) if pos.size else None
        with r.lock:
            self._check_open(r, "commit")
            if s.committed is not None:  # a concurrent retry of this commit won
                return self._commit_locked(r, sender_rank, positions, aux)
            if got is not None:
                sent2 = sent.reshape(n_buf, pos.size)
                writer = r.writer[:, pos]
                foreign = np.argwhere((writer >= 0) & (writer != sender_rank))
                if foreign.size:
                    b, i = (int(x) for x in foreign[0])
                    kind, layer = self._buffers[b]
                    msg = self._two_ranks(kind, layer, int(pos[i]), int(writer[b, i]), sender_rank)
                    self._fail(r, msg)
                    return r.snapshot()
                bad = np.argwhere(got != sent2)
                if bad.size:
                    b, i = (int(x) for x in bad[0])
                    kind, layer = self._buffers[b]
                    self._fail(
                        r,
                        f"digest mismatch on {kind} layer {layer} position {int(pos[i])} from "
                        f"prefill rank {sender_rank}: staged page bytes hash to "
                        f"{int(got[b, i]):#018x}, the sender's digest is {int(sent2[b, i]):#018x} "
                        f"({len(bad)} bad page(s) of {got.size})",
                    )
                    return r.snapshot()
                r.writer[:, pos] = sender_rank
                r.attempt[:, pos] = s.attempt
                r.digest[:, pos] = got
            return self._commit_locked(r, sender_rank, positions, aux)

    def _commit_locked(
        self, r: _Room, sender_rank: int, positions: np.ndarray, aux: Aux | None
    ) -> RoomSnapshot:
        """The commit proper (room lock held): claimed positions == written ones, aux."""
        s = r.senders[sender_rank]
        pos = self._positions(r, positions)
        claimed = tuple(int(p) for p in np.sort(pos))
        if s.committed is not None:
            if s.committed != claimed:
                self._fail(
                    r,
                    f"prefill rank {sender_rank} committed twice with different positions "
                    f"{_quote(list(s.committed))} and {_quote(list(claimed))}",
                )
            return r.snapshot()
        s.last_seen = self._clock()
        if (aux is not None) != (sender_rank == 0):
            self._fail(
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
                self._fail(
                    r,
                    f"prefill rank {sender_rank} committed positions {_quote(claimed)} but "
                    f"its {kind} layer {layer} pages lack {_quote(missing)} and add "
                    f"{_quote(extra)}",
                )
                return r.snapshot()
        s.committed = claimed
        if sender_rank == 0:
            r.aux = aux
        if all(x.committed is not None for x in r.senders):
            self._finish_commit(r)
        return r.snapshot()

    def _finish_commit(self, r: _Room) -> None:
        """Every sender committed: exact coverage, then one scatter per leaf -> Success."""
        count = np.zeros(r.n_pages, np.int64)
        for s in r.senders:
            assert s.committed is not None
            np.add.at(count, np.asarray(s.committed, np.int64), 1)
        missing, dup = np.flatnonzero(count == 0), np.flatnonzero(count > 1)
        if missing.size or dup.size:
            parts = []
            if missing.size:
                parts.append(f"positions {_quote(missing)} were sent by no rank")
            if dup.size:
                parts.append(f"positions {_quote(dup)} were committed by more than one rank")
            self._fail(r, f"coverage of [0, {r.n_pages}) is not exact: " + "; ".join(parts))
            return
        if (r.writer < 0).any():  # implied by the per-rank checks; kept as a guard
            self._fail(r, "coverage is exact but some (kind, layer) pages were never written")
            return
        assert r.staging is not None or r.n_pages == 0
        row_pos = r.row_pos if r.row_pos is not None else np.arange(r.n_pages, dtype=np.int64)
        dst_rows = r.dst_pages[row_pos]  # decode page of each staging row
        try:
            if self._pool is None:  # host-only receiver: no device, hand the rows over
                if self._host_sink is not None and r.staging:
                    n = r.n_pages
                    self._host_sink(
                        r.room, row_pos.copy(), dst_rows.copy(), tuple(st[:n] for st in r.staging)
                    )
            else:
                with self._pool_lock:
                    pages, lo = dst_rows.astype(np.int32), 0
                    for size in pow2_pieces(r.n_pages):
                        part = [st[lo : lo + size] for st in r.staging or []]
                        staged = self._staged_pool(self._pool, part, size)
                        self._pool = _scatter_pages(self._pool, pages[lo : lo + size], staged)
                        lo += size
                    if r.region is not None:  # the region is reused once the room is over
                        jax.block_until_ready(self._pool)
        except Exception as e:  # device failure: fail the room, keep serving others
            logger.exception("room %s: decode pool scatter failed", r.room)
            self._fail(r, f"decode pool scatter failed: {type(e).__name__}: {e}")
            return
        self._advance(r, RoomState.SUCCESS)

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

    # ---- timeouts ---------------------------------------------------------------------------
    def poll_timeouts(self) -> list[str]:
        """Fail every room past a timeout (see `TransferTimeouts`); returns their ids."""
        with self._lock:
            rooms = list(self._rooms.values())
        now, t = self._clock(), self.timeouts
        failed = []
        for r in rooms:
            with r.lock:
                if r.state.terminal:
                    continue
                reason = ""
                waiting_for = [i for i, s in enumerate(r.senders) if not s.handshaken]
                silent = [
                    i
                    for i, s in enumerate(r.senders)
                    if s.handshaken and s.committed is None and now - s.last_seen > t.heartbeat
                ]
                if waiting_for and now - r.registered_at > t.bootstrap:
                    reason = (
                        f"bootstrap timeout: prefill rank(s) {_quote(waiting_for)} did not "
                        f"handshake within {t.bootstrap:g}s"
                    )
                elif silent:
                    reason = (
                        f"heartbeat timeout: prefill rank(s) {_quote(silent)} silent for more "
                        f"than {t.heartbeat:g}s"
                    )
                elif r.state is RoomState.WAITING_FOR_INPUT and now - r.state_since > t.waiting:
                    reason = f"waiting timeout: no page arrived within {t.waiting:g}s"
                if reason:
                    self._fail(r, reason)
                    failed.append(r.room)
        self._expire_quarantine(now)
        return failed

    def _expire_quarantine(self, now: float) -> None:
        with self._lock:
            expired = [room for room, q in self._quarantine.items() if now >= q.deadline]
            for room in expired:
                q = self._quarantine.pop(room)
                assert self._arena is not None
                self._arena.free(q.region)
                logger.warning(
                    "room %s: staging region leaves quarantine after the %gs timeout; prefill "
                    "rank(s) %s never said their Mooncake writes ended",
                    room,
                    self._mooncake.quarantine_timeout_s if self._mooncake else 0.0,
                    sorted(q.pending),
                )

    def start(self, interval: float | None = None) -> Receiver:
        """Run `poll_timeouts` on a daemon thread every `interval` seconds (default: a
        quarter of the shortest timeout, at most 1 s)."""
        if self._reaper is not None:
            return self
        t = self.timeouts
        every = (
            interval
            if interval is not None
            else min(1.0, min(t.bootstrap, t.waiting, t.heartbeat) / 4)
        )
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(every):
                try:
                    self.poll_timeouts()
                except Exception:  # keep reaping: one bad room must not stop the rest
                    logger.exception("transfer receiver: timeout poll failed")

        self._reaper = threading.Thread(target=loop, name="transfer-receiver-reaper", daemon=True)
        self._reaper.start()
        return self

    def close(self) -> None:
        """Stop the timeout thread (rooms stay as they are)."""
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join()
            self._reaper = None

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------
    def _sender_done(self, room: str, rank: int) -> None:
        """A Mooncake sender of a finished room will write no more: maybe unquarantine."""
        with self._lock:
            q = self._quarantine.get(room)
            if q is None:
                return
            q.pending.discard(rank)
            if q.pending:
                return
            del self._quarantine[room]
            assert self._arena is not None
            self._arena.free(q.region)
        logger.info("room %s: staging region leaves quarantine (every writer done)", room)

    def _live(self, room: str, what: str) -> _Room:
        r = self._live_or_snapshot(room)
        if isinstance(r, RoomSnapshot):
            raise RoomClosedError(
                f"room {room!r} is {r.state.label}"
                + (f" ({r.reason})" if r.reason else "")
                + f"; late {what} rejected, nothing was written"
            )
        return r

    def _live_or_snapshot(self, room: str) -> _Room | RoomSnapshot:
        with self._lock:
            live = self._rooms.get(room)
            if live is not None:
                return live
            if room in self._finished:
                return self._finished[room]
        raise UnknownRoomError(f"unknown room {room!r}: the decode side never registered it")

    @staticmethod
    def _check_open(r: _Room, what: str) -> None:
        if r.state.terminal:
            raise RoomClosedError(
                f"room {r.room!r} is {r.state.label}"
                + (f" ({r.reason})" if r.reason else "")
                + f"; late {what} rejected, nothing was written"
            )

    @staticmethod
    def _check_rank(r: _Room, rank: int) -> None:
        if not 0 <= rank < r.cp_size:
            raise BadRequestError(
                f"room {r.room!r}: sender rank {rank} is outside [0, cp_size={r.cp_size})"
            )

    @staticmethod
    def _positions(r: _Room, positions: np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, np.int64).reshape(-1)
        if pos.size and (pos.min() < 0 or pos.max() >= r.n_pages):
            raise BadRequestError(
                f"room {r.room!r}: positions {_quote(pos)} outside [0, n_pages={r.n_pages})"
            )
        if np.unique(pos).size != pos.size:
            raise BadRequestError(f"room {r.room!r}: positions {_quote(pos)} repeat a position")
        return pos

    def _parse_chunk(
        self, r: _Room, sections: Sequence[PageSection], data: bytes | memoryview
    ) -> list[_ChunkPart]:
        """Validate a chunk against the layout and split `data` over its sections."""
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        if size > self.max_chunk_bytes:
            raise ChunkTooLargeError(
                f"room {r.room!r}: chunk carries {size} page bytes, over the "
                f"{self.max_chunk_bytes} B limit; send smaller chunks"
            )
        parts, need, shapes = [], 0, []
        for s in sections:
            b = self._buffer_index.get((s.kind, s.layer))
            if b is None:
                raise BadRequestError(
                    f"room {r.room!r}: no {s.kind} buffer for layer {s.layer} in the decode "
                    f"layout (full indexer layers: {list(self.layout.full_indexer_layers)})"
                )
            pos = self._positions(r, s.positions)
            sent = np.asarray(s.digests, np.uint64).reshape(-1)
            if sent.size != pos.size:
                raise BadRequestError(
                    f"room {r.room!r}: {s.kind} layer {s.layer} section has {pos.size} "
                    f"positions and {sent.size} digests; expected one digest per position"
                )
            nb = self._page_bytes[b]
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

    def _advance(self, r: _Room, new: RoomState) -> None:
        """Move `r` forward (room lock held); terminal states retire the room."""
        if not r.state.can_become(new):
            raise AssertionError(
                f"room {r.room!r}: illegal transition {r.state.label} -> {new.label}"
            )
        logger.debug("room %s: %s -> %s", r.room, r.state.label, new.label)
        r.state, r.state_since = new, self._clock()
        if new.terminal:
            self._retire(r)

    def _fail(self, r: _Room, reason: str) -> None:
        if r.state.terminal:
            return
        r.reason = reason
        logger.warning("room %s failed: %s", r.room, reason)
        self._advance(r, RoomState.FAILED)

    def _retire(self, r: _Room) -> None:
        """Free staging (an arena region at once, or quarantined when Mooncake writers
        may still be alive); on failure free the decode pages; keep a tombstone; wake
        waiters."""
        r.staging = None
        region, r.region = r.region, None
        snap = r.snapshot()
        with self._changed:
            if region is not None:
                assert self._arena is not None
                pending = {
                    i
                    for i, s in enumerate(r.senders)
                    if s.handshaken and s.plane == "mooncake" and not s.writes_done
                }
                if r.state is RoomState.FAILED and pending:
                    assert self._mooncake is not None
                    self._arena.quarantine(region)
                    self._quarantine[r.room] = _Quarantine(
                        region, pending, self._clock() + self._mooncake.quarantine_timeout_s
                    )
                    logger.info(
                        "room %s: staging region quarantined until prefill rank(s) %s say "
                        "their writes ended (or %gs pass)",
                        r.room,
                        sorted(pending),
                        self._mooncake.quarantine_timeout_s,
                    )
                else:
                    self._arena.free(region)
            if r.state is RoomState.FAILED:
                self._allocator.free(r.dst_pages)
            self._rooms.pop(r.room, None)
            self._finished[r.room] = snap
            while len(self._finished) > self._finished_kept:
                self._finished.popitem(last=False)
            self._changed.notify_all()


# ---- gRPC ---------------------------------------------------------------------------------


def _status_code(e: TransferError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, e.code, grpc.StatusCode.INTERNAL)


class KVTransferServicer:
    """gRPC face of a `Receiver`. Handlers take raw bytes and parse them here, so a
    malformed message is an INVALID_ARGUMENT status naming the message, not a generic
    deserialization error; receiver errors keep their reason text and map to their
    `code`. Nothing a client sends can stop the server."""

    def __init__(
        self,
        receiver: Receiver,
        commit_wait_s: float = COMMIT_WAIT_S,
        *,
        handshake_hold_s: float = HANDSHAKE_HOLD_S,
        max_held_handshakes: int = 16,
    ):
        self.receiver = receiver
        self.commit_wait_s = commit_wait_s
        self.handshake_hold_s = handshake_hold_s
        # Held handshakes occupy server threads: at most this many at once (the rest get
        # NOT_FOUND at once and back off), so page streams always find a thread.
        self._holds = threading.BoundedSemaphore(max_held_handshakes)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        ser = pb.RoomStatus.SerializeToString
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Handshake": grpc.unary_unary_rpc_method_handler(
                    self.Handshake, response_serializer=pb.HandshakeReply.SerializeToString
                ),
                "GetRoom": grpc.unary_unary_rpc_method_handler(
                    self.GetRoom, response_serializer=ser
                ),
                "WritePages": grpc.stream_unary_rpc_method_handler(
                    self.WritePages, response_serializer=pb.WriteAck.SerializeToString
                ),
                "Commit": grpc.unary_unary_rpc_method_handler(self.Commit, response_serializer=ser),
                "Heartbeat": grpc.unary_unary_rpc_method_handler(
                    self.Heartbeat, response_serializer=ser
                ),
                "Abort": grpc.unary_unary_rpc_method_handler(self.Abort, response_serializer=ser),
            },
        )

    # Each handler: parse, call the receiver, map errors to a status (abort raises).
    def Handshake(self, raw: bytes, context: grpc.ServicerContext) -> pb.HandshakeReply:
        msg = _parse(pb.HandshakeRequest, raw, context)
        with _status_on_error(context):
            if not msg.HasField("layout"):
                raise BadRequestError("Handshake has no layout descriptor")
            args = (
                msg.room,
                msg.sender_rank,
                msg.cp_size,
                msg.num_tokens,
                layout_from_pb(msg.layout),
                msg.attempt,
                data_plane_from_pb(msg.data_plane),
            )
            try:
                res = self.receiver.handshake(*args)
            except UnknownRoomError:
                # Its request may be queued here: hold the call until the room appears.
                if not self._holds.acquire(blocking=False):
                    raise
                try:
                    registered = self.receiver.wait_registered(msg.room, self.handshake_hold_s)
                finally:
                    self._holds.release()
                if not registered:
                    raise
                res = self.receiver.handshake(*args)
            reply = pb.HandshakeReply(
                accepted=res.accepted,
                mismatches=list(res.mismatches),
                status=snapshot_to_pb(res.status),
                dst_pages=res.dst_pages.tolist(),
                layout=layout_to_pb(self.receiver.layout),
                max_chunk_bytes=self.receiver.max_chunk_bytes,
                heartbeat_interval_s=self.receiver.timeouts.heartbeat_interval,
            )
            if res.region is not None:
                reply.mooncake.CopyFrom(
                    pb.MooncakeRegion(
                        session_id=res.region.session_id,
                        buffer_addrs=list(res.region.buffer_addrs),
                        rows=res.region.rows.tolist(),
                        row_count=res.region.row_count,
                        protocol=res.region.protocol,
                    )
                )
            return reply

    def GetRoom(self, raw: bytes, context: grpc.ServicerContext) -> pb.RoomStatus:
        msg = _parse(pb.RoomRef, raw, context)
        with _status_on_error(context):
            return snapshot_to_pb(self.receiver.status(msg.room))

    def WritePages(self, raw_iter: Iterator[bytes], context: grpc.ServicerContext) -> pb.WriteAck:
        written = duplicate = 0
        status: RoomSnapshot | None = None
        for raw in raw_iter:
            # The page bytes stay in `raw` (a view): protobuf would copy them twice.
            split = _split_len_field(raw, _PAGE_CHUNK_DATA)
            if split is None:  # no data field, or malformed: protobuf parses (and says why)
                msg = _parse(pb.PageChunk, raw, context)
                data: bytes | memoryview = msg.data
            else:
                msg = _parse(pb.PageChunk, split[0], context)
                data = split[1]
            with _status_on_error(context):
                res = self.receiver.write_chunk(
                    msg.room,
                    msg.sender_rank,
                    msg.attempt,
                    [section_from_pb(sec) for sec in msg.sections],
                    data,
                )
            written, duplicate, status = (
                written + res.written,
                duplicate + res.duplicate,
                res.status,
            )
            if status.state is RoomState.FAILED:
                break  # the rest of the stream is moot; the ack says why
        if status is None:
            return pb.WriteAck(state=pb.ROOM_STATE_UNSPECIFIED)
        return pb.WriteAck(
            state=int(status.state),
            pages_written=written,
            pages_duplicate=duplicate,
            reason=status.reason,
        )

    def Commit(self, raw: bytes, context: grpc.ServicerContext) -> pb.RoomStatus:
        msg = _parse(pb.CommitRequest, raw, context)
        with _status_on_error(context):
            aux = Aux(msg.aux.first_token, msg.aux.logprob) if msg.HasField("aux") else None
            snap = self.receiver.commit(
                msg.room,
                msg.sender_rank,
                msg.attempt,
                np.asarray(msg.positions, np.int64),
                aux,
                np.asarray(msg.digests, np.uint64) if len(msg.digests) else None,
            )
            if not snap.state.terminal:
                # Hold the reply until the room finishes (the last rank's commit ends it),
                # briefly: every rank then learns the outcome from its commit reply and
                # the prefill side releases its page hold at once, instead of at its next
                # heartbeat. Bounded, so a slow room only costs a worker thread this long.
                snap = self.receiver.wait(msg.room, timeout=self.commit_wait_s)
            return snapshot_to_pb(snap)

    def Heartbeat(self, raw: bytes, context: grpc.ServicerContext) -> pb.RoomStatus:
        msg = _parse(pb.HeartbeatRequest, raw, context)
        with _status_on_error(context):
            return snapshot_to_pb(
                self.receiver.heartbeat(msg.room, msg.sender_rank, msg.writes_done)
            )

    def Abort(self, raw: bytes, context: grpc.ServicerContext) -> pb.RoomStatus:
        msg = _parse(pb.AbortRequest, raw, context)
        with _status_on_error(context):
            return snapshot_to_pb(self.receiver.abort(msg.room, msg.reason, msg.sender_rank))


_PAGE_CHUNK_DATA = pb.PageChunk.DESCRIPTOR.fields_by_name["data"].number


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]  # IndexError when truncated
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift >= 64:
            raise ValueError("varint too long")


def _split_len_field(raw: bytes, field: int) -> tuple[bytes, memoryview] | None:
    """Split one length-delimited `field` out of a serialized message without copying
    it: (the message's other fields, serialized; a view of the field's bytes). None when
    the field is absent or repeated, or the message is malformed - the caller then
    parses `raw` whole, and protobuf reports what is wrong."""
    i, n, spans = 0, len(raw), []
    try:
        while i < n:
            start = i
            key, i = _varint(raw, i)
            wire = key & 7
            if wire == 0:
                _, i = _varint(raw, i)
            elif wire == 1:
                i += 8
            elif wire == 2:
                size, i = _varint(raw, i)
                if key >> 3 == field:
                    spans.append((start, i, i + size))
                i += size
            elif wire == 5:
                i += 4
            else:
                return None
            if i > n:
                return None
    except (IndexError, ValueError):
        return None
    if len(spans) != 1:
        return None
    start, lo, hi = spans[0]
    return raw[:start] + raw[hi:], memoryview(raw)[lo:hi]


def _parse(cls: type[M], raw: bytes, context: grpc.ServicerContext) -> M:
    """Parse `raw` as `cls`, or end the RPC with INVALID_ARGUMENT naming the message."""
    msg = cls()
    try:
        msg.ParseFromString(raw)
    except DecodeError as e:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"malformed {cls.DESCRIPTOR.full_name} ({len(raw)} bytes): {e}; the message is "
            "truncated or not a cpkv.transfer.v1 message",
        )
    return msg


class _status_on_error:
    """Context manager: receiver errors -> `context.abort` with their code and reason."""

    def __init__(self, context: grpc.ServicerContext):
        self.context = context

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            return False
        if isinstance(exc, TransferError):
            self.context.abort(_status_code(exc), str(exc))
        if isinstance(exc, PagePlanError | ValueError):
            self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if isinstance(exc, Exception):
            logger.exception("transfer receiver: unexpected error")
            self.context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        return False


def serve(
    receiver: Receiver,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    max_workers: int = 64,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server for `receiver` on `host:port` (0 = any free port).

    Messages up to `receiver.max_chunk_bytes` plus header slack are accepted (larger
    ones get RESOURCE_EXHAUSTED from gRPC itself), compression is off, and
    `grpc.health.v1.Health` reports SERVING for "" and the KVTransfer service until
    `server.stop`. Returns `(server, bound_port)`; the receiver's timeout thread is the
    caller's (`receiver.start()`).
    """
    limit = receiver.max_chunk_bytes + MESSAGE_SLACK_BYTES
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="kv-transfer"),
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ],
        compression=grpc.Compression.NoCompression,
    )
    server.add_generic_rpc_handlers((KVTransferServicer(receiver).generic_handler(),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"transfer receiver could not bind {host}:{port}")
    server.start()
    logger.info(
        "KV transfer receiver serving on %s:%d (protocol v%d)", host, bound, PROTOCOL_VERSION
    )
    return server, bound
