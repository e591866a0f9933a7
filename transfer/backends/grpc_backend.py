"""The gRPC transfer backend: raw page bytes streamed to `transfer.receiver` (the default).

One `GrpcRankSender` per (room, prefill rank): the control plane - handshake (its
layout descriptor, cp size and token count), heartbeats, commit, outcome, abort - is the
rank's `transfer.session.SenderSession`, over the rank's first channel; this module is
its data plane:

- **Pages** - one `WritePages` client stream per channel (`channels_per_rank`
  channels, each its own TCP connection; fewer streams when the rank's pages fill
  fewer chunks than that), each carrying a share of the (kind, layer)
  buffers balanced by bytes, packed into chunks of at most `chunk_bytes` page bytes:
  one `PageSection` (positions, per-page xxh3 digests - the source's sealed ones when
  it keeps them, `transfer.page_source.SealedPageSource`) per buffer run in a chunk, so
  small buffers (index scales, short requests) share chunks instead of costing one
  message each. Compression off. A buffer is read to host once (`PageSource.read`),
  or used in place when the source is a host pool (`host_buffer`, as
  `HostPoolPageSource`); each chunk is serialized by hand (`serialize_page_chunk`: the
  protobuf header, then the page bytes copied once straight from the rows - protobuf
  would copy them twice). A failed stream
  (UNAVAILABLE, DEADLINE, ABORTED) is retried with the *same attempt id*, which the
  receiver treats as idempotent, up to `max_retries` times with exponential backoff.
- The rank sends only the positions it owns (owner filtering), and every page carries
  its logical position (position-addressed destinations), so the decode side needs no
  ordering assumption.

`SenderFaults` holds the fault-injection hooks the tests use; production leaves it None.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from typing import ClassVar

import grpc
import numpy as np

from transfer.capabilities import BackendCapabilities, default_backend_registry
from transfer.hold import RunningSenders, TransferHold
from transfer.page_plan import BufferKind, LayoutDescriptor, RankPlan, row_digests
from transfer.page_source import sealed_digests
from transfer.proto import kv_transfer_pb2 as pb
from transfer.proto import kv_transfer_pb2_grpc as pb_grpc
from transfer.protocol import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MAX_CHUNK_PAGES,
    SERVICE_NAME,
    RoomSnapshot,
    kind_to_pb,
)
from transfer.sender import RankJob, TransferBackend
from transfer.session import (
    FINAL,
    RETRYABLE,
    ControlConfig,
    RankDone,
    RankSender,
    SenderKilled,
    SenderSession,
    SessionFaults,
    kept_channel,
)
from transfer.wire import serialize_page_chunk

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GrpcBackendConfig(ControlConfig):
    """Prefill-side settings of the gRPC backend (seconds, bytes); the control-plane
    ones (retries, timeouts, heartbeats) are `ControlConfig`'s."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # page bytes per message: 1-4 MiB in production
    channels_per_rank: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(
                f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {self.chunk_bytes}"
            )
        self._require(("channels_per_rank",), lambda v: v >= 1, ">= 1")


@dataclasses.dataclass(frozen=True)
class SenderFaults(SessionFaults["GrpcRankSender"]):
    """Fault-injection hooks (tests only): `plan` and `before_commit` (`SessionFaults`),
    and `chunk(sender, msg) -> msg | None`: alter a chunk after its digests were taken
    (corrupt bytes), drop it (None), or act (`sender.kill()`, stop the server)."""

    chunk: Callable[[GrpcRankSender, pb.PageChunk], pb.PageChunk | None] | None = None


_WRITE_PAGES = f"/{SERVICE_NAME}/WritePages"


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
                    ch = kept_channel(target, own_connection=True)
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


class GrpcRankSender(RankSender):
    """One prefill rank's transfer of one room: its `SenderSession` (the control plane)
    and the `WritePages` streams that carry its pages (see the module docstring)."""

    def __init__(
        self,
        job: RankJob,
        hold: TransferHold,
        config: GrpcBackendConfig,
        faults: SenderFaults | None = None,
        channels: Callable[[str, int], list[grpc.Channel]] | None = None,
    ):
        self.config = config
        self.faults = faults if faults is not None else SenderFaults()
        self.session = SenderSession(
            job, hold, config, self.faults, self, data_plane=pb.DATA_PLANE_GRPC
        )
        # Kept channels (GrpcBackend.channels) or, without them, channels of its own.
        self._channel_source = channels
        self.chunks_sent = 0
        self._lock = threading.Lock()
        self._channels: list[grpc.Channel] = []  # its own: closed when the rank ends
        # Per channel; the first one's stub also carries the session's control calls.
        self._stubs: list[pb_grpc.KVTransferStub] = []
        # Per channel, `WritePages` taking pre-serialized chunks (`serialize_page_chunk`).
        self._raw_writes: list[grpc.StreamUnaryMultiCallable] = []

    # ---- data plane (`transfer.session.DataPlane`) -------------------------------------------
    def open(self) -> pb_grpc.KVTransferStub:
        if self._channel_source is not None:  # kept by the backend: close() leaves them open
            channels = self._channel_source(self.job.target, self.job.rank)
        else:
            channels = [
                kept_channel(self.job.target, own_connection=True)
                for _ in range(self.config.channels_per_rank)
            ]
            self._channels.extend(channels)
        for ch in channels:
            self._stubs.append(pb_grpc.KVTransferStub(ch))
            self._raw_writes.append(
                ch.stream_unary(
                    _WRITE_PAGES,
                    request_serializer=None,  # the chunks are bytes already
                    response_deserializer=pb.WriteAck.FromString,
                )
            )
        return self._stubs[0]

    def accepted(self, reply: pb.HandshakeReply) -> None:
        return None

    def send(self, reply: pb.HandshakeReply) -> RankPlan:
        plan = self.session.plan(reply)
        self._send_pages(
            plan, min(self.config.chunk_bytes, reply.max_chunk_bytes or MAX_CHUNK_BYTES)
        )
        return plan

    def commit_digests(self) -> np.ndarray | None:
        return None  # every chunk carried its pages' digests

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

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
        if errors:
            for kind in (SenderKilled, RankDone):
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
                    if self.session.must_stop():
                        return  # half-close; the caller's check() says why
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
        if sections and not self.session.must_stop():
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
            if msg is None or self.session.must_stop():
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
            self.session.check()
            write = self._raw_writes[(channel + attempt) % len(self._raw_writes)]
            try:
                ack = write(
                    self._stream_chunks(plan, group, chunk_bytes), timeout=cfg.rpc_timeout_s
                )
            except grpc.RpcError as e:
                self.session.check()  # killed, room finished, or another rank failed meanwhile
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
                    self.session.sleep(cfg.retry_backoff_s * 2**attempt)
                    continue
                if code in FINAL:
                    self.session.finish_with_status(f"pages refused: {e.details()}")
                self.session.fail(
                    f"stream of {what}: {code.name} after {attempt + 1} tries: {e.details()}"
                )
            self.session.check()  # a stream cut short by a stop condition ends here
            if ack.state == pb.ROOM_STATE_FAILED:
                self.session.finish_with_status(ack.reason)
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
