"""The gRPC transfer backend: raw page bytes streamed to `transfer.receiver` (the default).

One `GrpcRankSender` per (room, prefill rank):

1. **Handshake** - its layout descriptor, cp size and token count; retried while the
   decode side is unreachable or has not registered the room yet, up to
   `bootstrap_timeout_s`. A refused handshake ends the rank before any data moves.
   The heartbeat (5.) starts here. A rank started by `transfer.sender.bootstrap_request`
   (a prefill server, at admission) then waits for the request's page table and aux
   data (`TransferHold.provide`, when its prefill ends), or for a cancel or the room's
   failure, whichever comes first.
2. **Plan** - `plan_rank` (`plan_request`'s checks of the whole tables, this rank's plan
   only) against the decode page table from the handshake reply; the rank sends only
   the positions it owns (owner filtering), and every page carries its logical position
   (position-addressed destinations), so the decode side needs no ordering assumption.
3. **Pages** - one `WritePages` client stream per channel (`channels_per_rank`
   channels, each its own TCP connection; fewer streams when the rank's pages fill
   fewer chunks than that), each carrying a share of the (kind, layer)
   buffers balanced by bytes, packed into chunks of at most `chunk_bytes` page bytes:
   one `PageSection` (positions, per-page xxh3 digests - the source's sealed ones when
   it keeps them, `transfer.sender.SealedPageSource`) per buffer run in a chunk, so
   small buffers (index scales, short requests) share chunks instead of costing one
   message each. Compression off. A buffer is read to host once (`PageSource.read`),
   or used in place when the source is a host pool (`host_buffer`, as
   `HostPoolPageSource`); each chunk is serialized by hand (`serialize_page_chunk`: the
   protobuf header, then the page bytes copied once straight from the rows - protobuf
   would copy them twice). A failed stream
   (UNAVAILABLE, DEADLINE, ABORTED) is retried with the *same attempt id*, which the
   receiver treats as idempotent, up to `max_retries` times with exponential backoff.
4. **Commit** - the positions sent; rank 0 adds the aux data (first token, log-prob).
5. **Heartbeat** - from the handshake until the room is finished, every
   `heartbeat_interval_s`; the replies carry the room status. No reply for
   `heartbeat_timeout_s` means the decode side is gone: the rank fails the room.

A rank that fails locally aborts the room on the decode side (best effort) and cancels
the request's other ranks through the `TransferHold`. `kill()` simulates the sender's
process dying: it stops every RPC at once, heartbeats included, without aborting.
`SenderFaults` holds the fault-injection hooks the tests use; production leaves it None.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import grpc
import numpy as np

from transfer.capabilities import BackendCapabilities, default_backend_registry
from transfer.page_plan import (
    BufferKind,
    LayoutDescriptor,
    PagePlanError,
    RankPlan,
    plan_rank,
    row_digests,
)
from transfer.proto import kv_transfer_pb2 as pb
from transfer.proto import kv_transfer_pb2_grpc as pb_grpc
from transfer.protocol import (
    DEFAULT_CHUNK_BYTES,
    HANDSHAKE_HOLD_S,
    MAX_CHUNK_BYTES,
    MAX_CHUNK_PAGES,
    MAX_MESSAGE_BYTES,
    SERVICE_NAME,
    RoomSnapshot,
    RoomState,
    aux_to_pb,
    kind_to_pb,
    layout_to_pb,
    snapshot_from_pb,
)
from transfer.sender import (
    RankJob,
    RunningSenders,
    TransferBackend,
    TransferHold,
    sealed_digests,
)

logger = logging.getLogger(__name__)

RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
)
# The room is finished or the data was refused for good: ask for the room's status.
FINAL = frozenset(
    {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND}
)


@dataclasses.dataclass(frozen=True)
class GrpcBackendConfig:
    """Prefill-side settings of the gRPC backend (seconds, bytes)."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # page bytes per message: 1-4 MiB in production
    channels_per_rank: int = 2
    max_retries: int = 3  # per stream / commit, after the first try
    retry_backoff_s: float = 0.05  # doubled per retry
    rpc_timeout_s: float = 30.0
    heartbeat_interval_s: float | None = None  # None: what the decode side asks for
    heartbeat_timeout_s: float = 15.0  # no heartbeat reply this long -> decode side gone
    bootstrap_timeout_s: float = 300.0  # handshake retries (decode down / room unknown)
    outcome_timeout_s: float | None = None  # after commit; None: heartbeats decide

    def __post_init__(self) -> None:
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(
                f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {self.chunk_bytes}"
            )
        if self.channels_per_rank < 1 or self.max_retries < 0:
            raise ValueError(
                f"channels_per_rank ({self.channels_per_rank}) must be >= 1 and max_retries "
                f"({self.max_retries}) >= 0"
            )
        for name in ("rpc_timeout_s", "heartbeat_timeout_s", "bootstrap_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class SenderFaults:
    """Fault-injection hooks (tests only).

    - `plan(plan) -> plan`: alter the rank's page plan (drop or add positions);
    - `chunk(sender, msg) -> msg | None`: alter a chunk after its digests were taken
      (corrupt bytes), drop it (None), or act (`sender.kill()`, stop the server);
    - `before_commit(sender)`: run just before the commit is sent.
    """

    plan: Callable[[RankPlan], RankPlan] | None = None
    chunk: Callable[[GrpcRankSender, pb.PageChunk], pb.PageChunk | None] | None = None
    before_commit: Callable[[GrpcRankSender], None] | None = None


_WRITE_PAGES = f"/{SERVICE_NAME}/WritePages"
_DATA_FIELD = pb.PageChunk.DESCRIPTOR.fields_by_name["data"].number


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


_DATA_TAG = _varint_bytes(_DATA_FIELD << 3 | 2)  # field `data`, wire type LEN


def serialize_page_chunk(header: pb.PageChunk, parts: Sequence[memoryview | bytes]) -> bytes:
    """The wire bytes of `header` (a `PageChunk` without `data`) with the concatenated
    `parts` as its `data` field, copying the page bytes once (protobuf would copy them
    twice: into the message and again when serializing). Protobuf parsers accept fields
    in any order, so this equals `PageChunk(..., data=b"".join(parts)).SerializeToString()`
    as a message (`test_transfer_grpc.test_fast_chunk_serialization_equals_protobuf`)."""
    if header.data:
        raise ValueError("serialize_page_chunk: the header must not carry data")
    n = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
    return b"".join((header.SerializeToString(), _DATA_TAG, _varint_bytes(n), *parts))


# Channels are kept across rooms: after the decode server was unreachable for a while,
# gRPC's default reconnect backoff (up to 120 s) would keep failing new rooms' calls long
# after it is back. Retry the connection at least every second instead.
KEPT_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _data_channel(target: str) -> grpc.Channel:
    """A channel to a decode receiver with its own subchannel pool, hence its own TCP
    connection; big messages allowed, compression off, reconnecting within a second."""
    return grpc.insecure_channel(
        target,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.use_local_subchannel_pool", 1),
            *KEPT_CHANNEL_OPTIONS,
        ],
        compression=grpc.Compression.NoCompression,
    )


def _stream_groups(layout: LayoutDescriptor, streams: int) -> list[list[tuple[BufferKind, int]]]:
    """The layout's buffers in at most `streams` groups of about equal bytes (largest
    first, each to the lightest group), each group in layout order: one stream each.
    One stream per buffer would open 3 x layers streams per rank and room, whose setup
    dominates small transfers."""
    buffers = layout.buffers()
    n = max(1, min(streams, len(buffers)))
    load = [0] * n
    members: list[list[int]] = [[] for _ in range(n)]
    for b in sorted(range(len(buffers)), key=lambda b: -layout.page_bytes(*buffers[b])):
        g = load.index(min(load))
        members[g].append(b)
        load[g] += layout.page_bytes(*buffers[b])
    return [[buffers[b] for b in sorted(m)] for m in members if m]


def _page_rows(pages: np.ndarray, lo: int, hi: int) -> memoryview:
    """Rows [lo, hi) of a C-contiguous uint8 `[n, page_bytes]` array, as a flat view."""
    return memoryview(pages[lo:hi].reshape(-1))


class _Killed(Exception):
    """The sender was killed: stop without another RPC."""


class _Done(Exception):
    """The rank is finished with `outcome`."""

    def __init__(self, outcome: RoomSnapshot):
        super().__init__(outcome.reason)
        self.outcome = outcome


class GrpcBackend(TransferBackend):
    """Owner-filtered, position-addressed page streams over gRPC (see module docstring)."""

    capabilities: ClassVar[BackendCapabilities] = default_backend_registry().get("grpc")

    def __init__(self, config: GrpcBackendConfig | None = None, faults: SenderFaults | None = None):
        self.config = config if config is not None else GrpcBackendConfig()
        self.faults = faults
        self._running: RunningSenders[GrpcRankSender] = RunningSenders()
        self._lock = threading.Lock()
        self._channels: dict[tuple[str, int, int], grpc.Channel] = {}
        self._closed = False

    def send_rank(self, job: RankJob, hold: TransferHold) -> RoomSnapshot | None:
        sender = GrpcRankSender(job, hold, self.config, self.faults, channels=self.channels)
        with self._running.running(job, sender) as s:
            return s.run()

    def channels(self, target: str, rank: int) -> list[grpc.Channel]:
        """Rank `rank`'s `channels_per_rank` channels to a decode receiver, each its own
        TCP connection, made on first use and kept for later rooms (connection setup per
        room and rank cost more than the pages of a small room)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the gRPC transfer backend is closed")
            out = []
            for i in range(self.config.channels_per_rank):
                ch = self._channels.get((target, rank, i))
                if ch is None:
                    ch = _data_channel(target)
                    self._channels[(target, rank, i)] = ch
                out.append(ch)
            return out

    def close(self) -> None:
        """Close the kept channels (server shutdown); later sends are refused."""
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()

    def sender(self, room: str, rank: int) -> GrpcRankSender | None:
        """The running sender of (room, rank), e.g. to `kill()` it."""
        return self._running.get(room, rank)


class GrpcRankSender:
    """One prefill rank's transfer of one room (see the module docstring)."""

    def __init__(
        self,
        job: RankJob,
        hold: TransferHold,
        config: GrpcBackendConfig,
        faults: SenderFaults | None = None,
        channels: Callable[[str, int], list[grpc.Channel]] | None = None,
    ):
        self.job, self.hold, self.config = job, hold, config
        self.faults = faults if faults is not None else SenderFaults()
        # Kept channels (GrpcBackend.channels) or, without them, channels of its own.
        self._channel_source = channels
        self.chunks_sent = 0
        self._killed = threading.Event()
        self._stop_heartbeat = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._status: RoomSnapshot | None = None
        self._lost = ""  # why the decode side is considered gone
        self._channels: list[grpc.Channel] = []
        self._stubs: list[pb_grpc.KVTransferStub] = []
        # Per channel, `WritePages` taking pre-serialized chunks (`serialize_page_chunk`).
        self._raw_writes: list[grpc.StreamUnaryMultiCallable] = []
        self._heartbeat: threading.Thread | None = None

    @property
    def rank(self) -> int:
        return self.job.rank

    def kill(self) -> None:
        """Simulate this sender's process dying: no further RPC of any kind."""
        logger.info("room %s: rank %d sender killed", self.job.room, self.rank)
        self._killed.set()
        self._wake.set()

    # ---- lifecycle --------------------------------------------------------------------------
    def run(self) -> RoomSnapshot | None:
        """The whole transfer; returns the room's final status (None when killed)."""
        try:
            self._open()
            reply = self._handshake()
            interval = self.config.heartbeat_interval_s or reply.heartbeat_interval_s or 1.0
            self._start_heartbeat(interval)
            self._await_inputs()
            plan = self._plan(reply)
            chunk = min(self.config.chunk_bytes, reply.max_chunk_bytes or MAX_CHUNK_BYTES)
            self._send_pages(plan, chunk)
            self._commit(plan)
            return self._await_outcome(interval)
        except _Killed:
            return None
        except _Done as d:
            return d.outcome
        except Exception as e:  # a local bug or a source read failure: fail the room
            logger.exception("room %s: rank %d sender failed", self.job.room, self.rank)
            try:
                self._fail(f"{type(e).__name__}: {e}")
            except _Done as d:
                return d.outcome
            except _Killed:
                return None
            raise AssertionError("unreachable") from None
        finally:
            self._stop_heartbeat.set()
            if self._heartbeat is not None:
                self._heartbeat.join()
            try:
                self._before_close()
            finally:
                for ch in self._channels:
                    ch.close()

    def _before_close(self) -> None:
        """Hook for subclasses: the rank is finished, its channels still open."""

    def _open(self) -> None:
        if self._channel_source is not None:  # kept by the backend: run() leaves them open
            channels = self._channel_source(self.job.target, self.job.rank)
        else:
            channels = [
                _data_channel(self.job.target) for _ in range(self.config.channels_per_rank)
            ]
            self._channels.extend(channels)  # closed when the rank ends
        for ch in channels:
            self._stubs.append(pb_grpc.KVTransferStub(ch))
            self._raw_writes.append(
                ch.stream_unary(
                    _WRITE_PAGES,
                    request_serializer=None,  # the chunks are bytes already
                    response_deserializer=pb.WriteAck.FromString,
                )
            )

    # Handshake failures retried until the bootstrap timeout (decode not up / room unknown).
    HANDSHAKE_WAITABLE: ClassVar[frozenset[grpc.StatusCode]] = RETRYABLE | {
        grpc.StatusCode.NOT_FOUND
    }

    def _handshake_request(self) -> pb.HandshakeRequest:
        job = self.job
        return pb.HandshakeRequest(
            room=job.room,
            sender_rank=job.rank,
            cp_size=job.cp_size,
            num_tokens=job.num_tokens,
            layout=layout_to_pb(job.layout),
            attempt=job.attempt,
            data_plane=pb.DATA_PLANE_GRPC,
        )

    def _handshake(self) -> pb.HandshakeReply:
        cfg = self.config
        req = self._handshake_request()
        deadline = time.monotonic() + cfg.bootstrap_timeout_s
        tries = 0
        while True:
            self._check()
            sent = time.monotonic()
            try:
                reply = self._stubs[0].Handshake(req, timeout=cfg.rpc_timeout_s)
                break
            except grpc.RpcError as e:
                self._check()
                code = e.code()
                waitable = code in self.HANDSHAKE_WAITABLE
                if waitable and time.monotonic() < deadline:
                    held = time.monotonic() - sent >= HANDSHAKE_HOLD_S / 2
                    if code is grpc.StatusCode.NOT_FOUND and held:
                        tries = 0  # the receiver held the call for the room: ask again now
                        continue
                    tries += 1
                    self._sleep(min(cfg.retry_backoff_s * 2 ** min(tries, 6), 1.0))
                    continue
                if code is grpc.StatusCode.FAILED_PRECONDITION:  # version or room finished
                    self._finish_with_status(f"handshake refused: {e.details()}")
                self._fail(f"handshake failed: {code.name}: {e.details()}")
        self._observe(snapshot_from_pb(reply.status))
        if not reply.accepted:
            self._finish_with_status(f"handshake refused: {'; '.join(reply.mismatches)}")
        return reply

    def _await_inputs(self) -> None:
        """Bootstrap ahead (`transfer.sender.bootstrap_request`): handshaken and
        heartbeating, wait until the prefill provides the request's page table and aux
        data (or the room fails, the hold is cancelled, the sender is killed)."""
        self.hold.add_waker(self._wake)
        self.hold.mark_ready(self.rank)
        if self.job.has_inputs:
            return
        while True:
            self._check()
            inputs = self.hold.inputs
            if inputs is not None:
                try:
                    self.job = self.job.with_inputs(inputs)
                except ValueError as e:
                    self._fail(str(e))
                return
            self._wake.wait(1.0)
            self._wake.clear()

    def _plan(self, reply: pb.HandshakeReply) -> RankPlan:
        job = self.job
        try:
            plan = plan_rank(
                job.rank,
                job.num_tokens,
                job.layout.page_size,
                job.cp_size,
                job.src_local_pages,
                np.asarray(reply.dst_pages, np.int64),
            )
        except PagePlanError as e:
            self._fail(f"page plan: {e}")
        return self.faults.plan(plan) if self.faults.plan is not None else plan

    # ---- pages ------------------------------------------------------------------------------
    def _send_pages(self, plan: RankPlan, chunk_bytes: int) -> None:
        """Every buffer of the layout over the rank's channels: one stream per channel,
        each carrying the chunks of a share of the buffers (balanced by bytes). A rank
        whose pages fill fewer chunks than it has channels opens one stream per chunk
        (each stream costs a call and threads on both sides; a 512-token GLM-5 room went
        from ~36 to ~29 ms), a single one on this thread."""
        if plan.num_pages == 0:
            return
        rank_bytes = plan.num_pages * self.job.layout.bytes_per_page()
        streams = min(len(self._stubs), -(-rank_bytes // chunk_bytes))
        groups = _stream_groups(self.job.layout, streams)
        if len(groups) == 1:
            self._send_stream(plan, groups[0], 0, chunk_bytes)
            return
        with concurrent.futures.ThreadPoolExecutor(
            len(groups), thread_name_prefix="kv-send-ch"
        ) as pool:
            futures = [
                pool.submit(self._send_stream, plan, group, channel, chunk_bytes)
                for channel, group in enumerate(groups)
            ]
            errors: list[BaseException] = []
            for f in concurrent.futures.as_completed(futures):
                e = f.exception()
                if e is not None:
                    errors.append(e)
                    self._wake.set()  # the other streams stop at their next chunk
        if errors:
            for kind in (_Killed, _Done):
                for e in errors:
                    if isinstance(e, kind):
                        raise e
            raise errors[0]

    def _stream_chunks(
        self, plan: RankPlan, group: list[tuple[BufferKind, int]], chunk_bytes: int
    ) -> Iterator[bytes]:
        """The serialized chunks of one stream: the pages of `group`'s buffers, buffer
        after buffer, packed into chunks of at most `chunk_bytes` page bytes and
        `MAX_CHUNK_PAGES` pages (at least one page), one `PageSection` per buffer run in
        a chunk - so a chunk may end one buffer and begin the next. A buffer's digests
        are taken when the stream reaches it."""
        job = self.job
        positions = plan.positions
        sections: list[pb.PageSection] = []
        parts: list[memoryview] = []
        room_bytes, room_pages = chunk_bytes, MAX_CHUNK_PAGES
        for kind, layer in group:
            nbytes = job.layout.page_bytes(kind, layer)
            pages, rows = self._source_pages(kind, layer, plan.src_pages, nbytes)
            digests = sealed_digests(job.source, kind, layer, plan.src_pages)
            if digests is None:  # not sealed: hash what is sent (xxh3 releases the GIL)
                digests = row_digests(pages, rows)
            # Consecutive source rows: a run of pages is a slice of `pages`, no gather.
            contiguous = rows.size < 2 or bool((np.diff(rows) == 1).all())
            i = 0
            while i < plan.num_pages:
                n = min(plan.num_pages - i, room_bytes // nbytes, room_pages)
                if n <= 0 and sections:  # this chunk is full
                    chunk = self._chunk(sections, parts)
                    if chunk is not None:
                        yield chunk
                    if self._must_stop():
                        return  # half-close; the caller's _check() says why
                    sections, parts = [], []
                    room_bytes, room_pages = chunk_bytes, MAX_CHUNK_PAGES
                    continue
                n = max(n, 1)  # a page larger than the chunk size travels alone
                sections.append(
                    pb.PageSection(
                        kind=kind_to_pb(kind),
                        layer=layer,
                        positions=positions[i : i + n].tolist(),
                        digests=digests[i : i + n].tolist(),
                    )
                )
                if contiguous:
                    lo = int(rows[0]) + i
                    parts.append(_page_rows(pages, lo, lo + n))
                else:
                    parts.append(memoryview(pages[rows[i : i + n]].reshape(-1)))
                room_bytes -= n * nbytes
                room_pages -= n
                i += n
        if sections and not self._must_stop():
            chunk = self._chunk(sections, parts)
            if chunk is not None:
                yield chunk

    def _chunk(self, sections: list[pb.PageSection], parts: list[memoryview]) -> bytes | None:
        """One chunk's wire bytes (None: a test hook dropped it)."""
        job = self.job
        header = pb.PageChunk(
            room=job.room, sender_rank=job.rank, attempt=job.attempt, sections=sections
        )
        if self.faults.chunk is None:
            raw = serialize_page_chunk(header, parts)
        else:  # tests: the hook sees (and may alter) the protobuf message
            header.data = b"".join(parts)
            msg = self.faults.chunk(self, header)
            if msg is None or self._must_stop():
                return None
            raw = msg.SerializeToString()
        with self._lock:
            self.chunks_sent += 1
        return raw

    def _send_stream(
        self,
        plan: RankPlan,
        group: list[tuple[BufferKind, int]],
        channel: int,
        chunk_bytes: int,
    ) -> None:
        """One `WritePages` stream with the chunks of `group`'s buffers, one buffer after
        another. A failed stream is sent again whole with the same attempt id (the
        receiver counts pages it already has as duplicates), up to `max_retries` times."""
        job, cfg = self.job, self.config
        names = [f"{kind} layer {layer}" for kind, layer in group]
        what = names[0] if len(names) == 1 else f"{len(names)} buffers ({names[0]} .. {names[-1]})"

        for attempt in range(cfg.max_retries + 1):
            self._check()
            write = self._raw_writes[(channel + attempt) % len(self._raw_writes)]
            try:
                ack = write(
                    self._stream_chunks(plan, group, chunk_bytes), timeout=cfg.rpc_timeout_s
                )
            except grpc.RpcError as e:
                self._check()  # killed, room finished, or another rank failed meanwhile
                code = e.code()
                if code in RETRYABLE and attempt < cfg.max_retries:
                    logger.info(
                        "room %s: rank %d stream of %s (%s: %s); retry %d",
                        job.room,
                        job.rank,
                        what,
                        code.name,
                        e.details(),
                        attempt + 1,
                    )
                    self._sleep(cfg.retry_backoff_s * 2**attempt)
                    continue
                if code in FINAL:
                    self._finish_with_status(f"pages refused: {e.details()}")
                self._fail(
                    f"stream of {what}: {code.name} after {attempt + 1} tries: {e.details()}"
                )
            self._check()  # a stream cut short by a stop condition ends here
            if ack.state == pb.ROOM_STATE_FAILED:
                self._finish_with_status(ack.reason)
            return

    def _source_pages(
        self, kind: BufferKind, layer: int, src_pages: np.ndarray, nbytes: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(uint8 `[R, nbytes]` C-contiguous array, `[k]` rows of it to send, in plan
        order). A host-memory pool (`host_buffer`, e.g. `HostPoolPageSource`) is used in
        place - no copy; other sources (device pools) are read to host once."""
        host_buffer = getattr(self.job.source, "host_buffer", None)
        if host_buffer is not None:
            leaf = host_buffer(kind, layer)
            if leaf.flags.c_contiguous and leaf.nbytes == leaf.shape[0] * nbytes:
                flat = leaf.reshape(leaf.shape[0], -1).view(np.uint8)
                rows = np.asarray(src_pages, np.int64)
                if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= flat.shape[0]):
                    raise ValueError(
                        f"{kind} layer {layer}: source pages span [{int(rows.min())}, "
                        f"{int(rows.max())}], the host pool leaf has pages [0, {flat.shape[0]})"
                    )
                return flat, rows
        host = np.ascontiguousarray(self.job.source.read(kind, layer, src_pages))
        pages = host.reshape(host.shape[0], -1).view(np.uint8)
        if pages.shape != (len(src_pages), nbytes):
            raise ValueError(
                f"{kind} layer {layer}: the page source gave {pages.shape} bytes, the layout "
                f"needs ({len(src_pages)}, {nbytes})"
            )
        return pages, np.arange(len(src_pages), dtype=np.int64)

    # ---- commit and outcome -------------------------------------------------------------------
    def _commit_request(self, plan: RankPlan) -> pb.CommitRequest:
        job = self.job
        req = pb.CommitRequest(
            room=job.room,
            sender_rank=job.rank,
            attempt=job.attempt,
            positions=plan.positions.tolist(),
        )
        if job.aux is not None:
            req.aux.CopyFrom(aux_to_pb(job.aux))
        return req

    def _commit(self, plan: RankPlan) -> None:
        cfg = self.config
        if self.faults.before_commit is not None:
            self.faults.before_commit(self)
        req = self._commit_request(plan)
        for attempt in range(cfg.max_retries + 1):
            self._check()
            try:
                status = self._stubs[0].Commit(req, timeout=cfg.rpc_timeout_s)
            except grpc.RpcError as e:
                self._check()
                code = e.code()
                if code in RETRYABLE and attempt < cfg.max_retries:
                    self._sleep(cfg.retry_backoff_s * 2**attempt)
                    continue
                if code in FINAL:
                    self._finish_with_status(f"commit refused: {e.details()}")
                lost = "decode side lost: " if code is grpc.StatusCode.UNAVAILABLE else ""
                self._fail(f"{lost}commit: {code.name} after {attempt + 1} tries: {e.details()}")
            self._observe(snapshot_from_pb(status))
            return

    def _await_outcome(self, interval: float) -> RoomSnapshot:
        """Wait (heartbeating) until the room is finished; returns its status."""
        timeout = self.config.outcome_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check()  # raises _Done once the room is finished
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"no outcome within {timeout:g}s of the commit")
            self._wake.wait(interval)
            self._wake.clear()

    # ---- heartbeats -----------------------------------------------------------------------------
    def _start_heartbeat(self, interval: float) -> None:
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop,
            args=(interval,),
            name=f"kv-heartbeat-{self.job.room}-r{self.rank}",
            daemon=True,
        )
        self._heartbeat.start()

    def _heartbeat_loop(self, interval: float) -> None:
        job, limit = self.job, self.config.heartbeat_timeout_s
        req = pb.HeartbeatRequest(room=job.room, sender_rank=job.rank)
        last_ok = time.monotonic()
        while not self._stop_heartbeat.wait(interval):
            if self._killed.is_set():
                return
            try:
                status = self._stubs[0].Heartbeat(req, timeout=max(interval, limit / 2))
            except grpc.RpcError as e:
                if self._killed.is_set():
                    return
                silent = time.monotonic() - last_ok
                if e.code() is grpc.StatusCode.NOT_FOUND or silent > limit:
                    with self._lock:
                        self._lost = (
                            f"decode side lost: no heartbeat reply for {silent:.1f}s (limit "
                            f"{limit:g}s; last error {e.code().name}: {e.details()})"
                        )
                    self._wake.set()
                    return
                continue
            last_ok = time.monotonic()
            self._observe(snapshot_from_pb(status))
            if self._status is not None and self._status.state.terminal:
                self._wake.set()
                return

    # ---- state --------------------------------------------------------------------------------
    def _observe(self, status: RoomSnapshot) -> None:
        with self._lock:
            if self._status is None or not self._status.state.terminal:
                self._status = status
        if status.state is RoomState.FAILED:
            self.hold.cancel(status.reason)
        if status.state.terminal:
            self._wake.set()

    def _must_stop(self) -> bool:
        """Whether `_check` would stop the rank (no RPC: safe inside a request stream)."""
        st = self._status
        return bool(
            self._killed.is_set()
            or self._lost
            or self.hold.cancelled
            or (st is not None and st.state.terminal)
        )

    def _check(self) -> None:
        """Raise `_Killed` / `_Done` when the rank must stop, else return."""
        if self._killed.is_set():
            raise _Killed
        st = self._status
        if st is not None and st.state.terminal:
            raise _Done(st)
        if self._lost:
            self._fail(self._lost)
        if self.hold.cancelled:
            st = self._query_status()
            if st is not None and st.state.terminal:
                raise _Done(st)
            self._fail(f"another rank of the request failed: {self.hold.cancel_reason}")

    def _query_status(self) -> RoomSnapshot | None:
        try:
            reply = self._stubs[0].GetRoom(
                pb.RoomRef(room=self.job.room), timeout=min(self.config.rpc_timeout_s, 2.0)
            )
        except grpc.RpcError:
            return None
        status = snapshot_from_pb(reply)
        self._observe(status)
        return status

    def _finish_with_status(self, fallback: str) -> None:
        """The decode side refused us for good: finish with its status (or `fallback`)."""
        self._check()
        st = self._query_status()
        if st is not None and st.state.terminal:
            raise _Done(st)
        self._fail(fallback)

    def _fail(self, reason: str) -> None:
        """Fail the room from this side: abort it on the decode side (best effort),
        cancel the request's other ranks, finish with the decode side's status when it
        has one, else with `reason`."""
        if self._killed.is_set():
            raise _Killed
        reason = f"prefill rank {self.rank}: {reason}"
        self.hold.cancel(reason)
        outcome = RoomSnapshot(self.job.room, RoomState.FAILED, reason)
        if not self._lost:
            try:
                reply = self._stubs[0].Abort(
                    pb.AbortRequest(room=self.job.room, reason=reason, sender_rank=self.rank),
                    timeout=min(self.config.rpc_timeout_s, 2.0),
                )
                st = snapshot_from_pb(reply)
                if st.state.terminal:  # the decode side's word is final (even Success)
                    outcome = st
            except grpc.RpcError as e:
                logger.info(
                    "room %s: abort from rank %d not delivered: %s",
                    self.job.room,
                    self.rank,
                    e.code().name,
                )
        logger.warning("room %s: rank %d failed: %s", self.job.room, self.rank, outcome.reason)
        raise _Done(outcome)

    def _sleep(self, seconds: float) -> None:
        if self._killed.wait(seconds):
            raise _Killed
