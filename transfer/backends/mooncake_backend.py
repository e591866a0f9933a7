"""The Mooncake transfer backend: page bytes by Mooncake Transfer Engine, control over gRPC.

Page bytes move with one-sided Mooncake engine writes (TCP on one machine, RDMA in a
cluster) straight into a staging region the decode receiver carved for the room from
its registered arena; the control plane - handshake with the layout descriptor, heartbeats,
the commit with every page's digest and rank 0's aux data, aborts - is the gRPC service
of `transfer.receiver`, exactly as for the `grpc` backend. Capabilities: owner filtering
and position-addressed destinations (SPEC S2.3).

**Decode side** - `MooncakeReceiverEndpoint`: one engine (P2P-handshake mode) and ONE
`StagingArena` of `arena_bytes`, registered once at startup; pass it to
`Receiver(..., mooncake=endpoint)`. A room's region is carved at its first Mooncake
handshake, one block per (kind, layer) buffer with rows in owner-major order (rank 0's
positions, then rank 1's, ...), so each rank's owned positions are ONE contiguous row
range per buffer. The handshake reply (`MooncakeRegion`) gives the engine session id,
every buffer's base address and the row of each position. At a rank's commit the
receiver hashes the rank's staged rows and compares them with the digests in the commit
(mismatch: Failed, with the position and both digests); when every rank committed and
coverage is exact, it does one device scatter per buffer into the decode pool (the pool
is never registered, so the engine cannot write it) and frees the region. A failed
room's region is quarantined until every writer says it is done, or
`quarantine_timeout_s` passes (see `transfer.receiver`).

**Prefill side** - `MooncakeBackend`: one engine per process, shared by the ranks this
process runs (`engine` may also be passed in). Per rank, after the handshake (and, with
bootstrap ahead, once the request's pages are provided; the ranks writing to one decode
engine go through steps 1-3 up to their first engine call one at a time):

1. source bytes: when the rank's `PageSource` has `host_buffer(kind, layer)` (a host
   pool leaf `[pages, ...]` that stays at its address - a host-memory KV pool) and its
   local pages form long runs (descriptors of `zero_copy_min_descriptor_bytes` on
   average), that array is registered with the engine once and pages are written from
   it directly (zero copy, one descriptor per run of consecutive local pages);
   otherwise (device pools, scattered pages) the rank's owned pages are read once
   (`PageSource.read`, or `read_into` when the source has it) into a region of the
   backend's registered host buffer (`host_buffer_bytes`), laid out buffer by buffer,
   so each buffer is one contiguous source range. The region goes back as soon as
   the rank's writes are over (a write that failed with an engine error: after
   `uncertain_hold_s`), so a room larger than the host buffer goes through as long as
   one rank's pages fit: its ranks take turns, waiting up to `host_buffer_wait_s` for
   space;
2. digests: xxh3 of every page (`page_plan.row_digests`): the source's sealed digests
   when it keeps them for every page sent (`transfer.sender.SealedPageSource`, e.g. a
   host pool whose pages were sealed once written); otherwise from the bytes that are
   sent, by the rank itself before its write when it has at most
   `inline_digest_max_bytes`, else by a helper thread while its pages are written;
3. writes: descriptors coalesced where source and destination rows both advance by
   one (owner-major staging: one descriptor per buffer when the source is contiguous),
   batched by `write_group_bytes` (the engine wrapper splits calls at `max_batch`
   descriptors); the rank stops between groups when the room failed. A batch write
   the engine fails fast (refused, reset) is retried up to `write_retries` times (same
   attempt, same source and destination ranges: idempotent by construction) before
   the room fails; a stalled one (transfer timeout) is not retried;
4. commit over gRPC with the positions and digests (rank 0 adds the aux data), then
   heartbeats until the room is finished, as the gRPC sender does;
5. on the way out (not when killed) a final heartbeat with `writes_done` tells the
   receiver this rank writes no more, which ends a failed room's quarantine early. A
   rank whose write failed with an engine error does not say so (the engine may still
   move its bytes); the quarantine timeout covers it.

The prefill pages are held until the room succeeds or fails (`transfer.sender.
TransferHold`, as for every backend). `MooncakeSenderFaults` are the tests' hooks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import ClassVar, Protocol, runtime_checkable

import grpc
import numpy as np

from transfer.backends.grpc_backend import (
    KEPT_CHANNEL_OPTIONS,
    RETRYABLE,
    GrpcBackendConfig,
    GrpcRankSender,
    _Killed,
)
from transfer.backends.mooncake_engine import (
    DEFAULT_MAX_BATCH,
    DEFAULT_TRANSFER_TIMEOUT_S,
    MooncakeEngine,
    MooncakeError,
    MooncakeTransferError,
    RegisteredBuffer,
)
from transfer.capabilities import BackendCapabilities, default_backend_registry
from transfer.page_plan import BufferKind, RankPlan, row_digests
from transfer.proto import kv_transfer_pb2 as pb
from transfer.proto import kv_transfer_pb2_grpc as pb_grpc
from transfer.protocol import MAX_MESSAGE_BYTES, MiB, RoomSnapshot
from transfer.sender import (
    RankJob,
    RunningSenders,
    TransferBackend,
    TransferHold,
    sealed_digests,
)
from transfer.staging_arena import Region, StagingArena, StagingFullError

logger = logging.getLogger(__name__)

DEFAULT_QUARANTINE_TIMEOUT_S = 60.0  # > the engine's default 30 s transfer timeout


# ---- decode side -------------------------------------------------------------------------


class MooncakeReceiverEndpoint:
    """The decode receiver's Mooncake side: one engine and one registered staging arena.

    `arena_bytes` bounds the pages of all rooms in flight (plus quarantined ones); a
    room that does not fit waits (its senders retry the handshake). `quarantine_timeout_s`
    should exceed the senders' engine transfer timeout. Close it after the receiver.
    """

    def __init__(
        self,
        arena_bytes: int,
        *,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        quarantine_timeout_s: float = DEFAULT_QUARANTINE_TIMEOUT_S,
        transfer_timeout_s: float | None = None,
        prefault: bool = True,
        engine: MooncakeEngine | None = None,
    ):
        if not quarantine_timeout_s > 0:
            raise ValueError(f"quarantine_timeout_s must be > 0, got {quarantine_timeout_s}")
        self.quarantine_timeout_s = float(quarantine_timeout_s)
        self._owns_engine = engine is None
        self.engine = (
            engine
            if engine is not None
            else MooncakeEngine(
                hostname, protocol, device_name=device_name, transfer_timeout_s=transfer_timeout_s
            )
        )
        try:
            self.arena = StagingArena(arena_bytes, prefault=prefault)
            self._registered = self.engine.register(self.arena.memory)
        except BaseException:
            if self._owns_engine:
                self.engine.close()
            raise
        self.session_id = self.engine.session_id
        self.protocol = self.engine.protocol
        logger.info(
            "Mooncake receive endpoint %s (%s): %d B staging arena registered",
            self.session_id,
            self.protocol,
            self.arena.nbytes,
        )

    def close(self) -> None:
        """Unregister the arena; close the engine if this endpoint made it (~1 s)."""
        if self._owns_engine:
            self.engine.close()
        elif not self.engine.closed:
            self.engine.unregister(self._registered)

    def __enter__(self) -> MooncakeReceiverEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- prefill side ------------------------------------------------------------------------


@runtime_checkable
class HostPageSource(Protocol):
    """A `PageSource` whose pool lives in host memory: the backend registers each leaf
    with its engine once and writes pages from it directly (no copy).

    `host_buffer(kind, layer)` is the rank's whole (kind, layer) pool leaf, first axis
    = the rank's local page id, C-contiguous; the same array (same address) on every
    call, alive for as long as the backend."""

    def read(self, kind: BufferKind, layer: int, src_pages: np.ndarray) -> np.ndarray: ...

    def host_buffer(self, kind: BufferKind, layer: int) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class MooncakeBackendConfig:
    """Prefill-side settings of the Mooncake backend (seconds, bytes)."""

    hostname: str = "127.0.0.1"  # what the decode engine's handshake reaches this engine at
    protocol: str = "tcp"  # "tcp" or "rdma"
    device_name: str = ""  # RDMA NICs ("" = auto)
    transfer_timeout_s: float | None = 30.0  # a write to a stalled peer fails after this
    max_batch: int = DEFAULT_MAX_BATCH  # descriptors per engine call
    host_buffer_bytes: int = 256 * MiB  # registered copy buffer for device-pool sources
    host_buffer_wait_s: float = 30.0  # wait this long for space in it, then fail the room
    write_group_bytes: int = 256 * MiB  # bytes per batch write (stop checks in between)
    # A rank with at most this many bytes hashes them itself, before its write; more:
    # on a helper thread while its pages are written (off the critical path).
    inline_digest_max_bytes: int = 8 * MiB
    zero_copy_host_sources: bool = True  # write straight from HostPageSource buffers...
    # ...when its descriptors average at least this many bytes; scattered pages are
    # gathered into the host buffer instead (small descriptors are slow on the engine).
    zero_copy_min_descriptor_bytes: int = 1 * MiB
    # A batch write the engine failed fast (MooncakeTransferError within half the
    # transfer timeout: peer refused or reset) is retried this many times - same
    # attempt, same source and destination ranges, so a write that partly landed is
    # simply written again (idempotent by construction) - with exponential backoff from
    # `write_retry_backoff_s`, before the room is failed. A stalled write (a failure
    # after half the transfer timeout or more) is not retried. The stop conditions
    # (killed, room finished, another rank failed, decode side lost) are checked before
    # every retry.
    write_retries: int = 2
    write_retry_backoff_s: float = 0.05
    # After a failed engine write the engine may still read the rank's host copy region:
    # it is handed back this long after the rank ends (None: 2 x transfer_timeout_s, or
    # 60 s without one).
    uncertain_hold_s: float | None = None
    # Control plane (gRPC), as GrpcBackendConfig:
    rpc_timeout_s: float = 30.0
    max_retries: int = 3
    retry_backoff_s: float = 0.05
    heartbeat_interval_s: float | None = None
    heartbeat_timeout_s: float = 15.0
    bootstrap_timeout_s: float = 300.0
    outcome_timeout_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("host_buffer_bytes", "write_group_bytes", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.write_retries < 0 or self.write_retry_backoff_s < 0:
            raise ValueError(
                f"write_retries ({self.write_retries}) and write_retry_backoff_s "
                f"({self.write_retry_backoff_s}) must be >= 0"
            )
        if self.uncertain_hold_s is not None and not self.uncertain_hold_s > 0:
            raise ValueError(f"uncertain_hold_s must be > 0 or None, got {self.uncertain_hold_s}")
        self.control()  # validates the control-plane fields

    def control(self) -> GrpcBackendConfig:
        """The control-plane settings, for the gRPC sender machinery."""
        return GrpcBackendConfig(
            channels_per_rank=1,
            max_retries=self.max_retries,
            retry_backoff_s=self.retry_backoff_s,
            rpc_timeout_s=self.rpc_timeout_s,
            heartbeat_interval_s=self.heartbeat_interval_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            bootstrap_timeout_s=self.bootstrap_timeout_s,
            outcome_timeout_s=self.outcome_timeout_s,
        )


@dataclasses.dataclass(frozen=True)
class MooncakeSenderFaults:
    """Fault-injection hooks (tests only).

    - `plan(plan) -> plan`: alter the rank's page plan (drop or add positions);
    - `before_write(sender, group)`: before batch write `group` (`sender.kill()`, abort
      the room, ...);
    - `after_write(sender, group)`: after batch write `group` returned (corrupt the
      staged bytes on the decode side, check the decode pool, ...);
    - `before_commit(sender)`: just before the commit is sent;
    - `write(sender, group, attempt)`: just before try `attempt` (0 = first) of batch
      write `group` reaches the engine; raising `MooncakeTransferError` simulates the
      engine failing that try (a transient fault, retried like a real one).
    """

    plan: Callable[[RankPlan], RankPlan] | None = None
    before_write: Callable[[MooncakeRankSender, int], None] | None = None
    after_write: Callable[[MooncakeRankSender, int], None] | None = None
    before_commit: Callable[[MooncakeRankSender], None] | None = None
    write: Callable[[MooncakeRankSender, int, int], None] | None = None


@dataclasses.dataclass(frozen=True)
class RankWriteStats:
    """What one rank wrote for one room (for benchmarks and logs)."""

    pages: int
    bytes: int
    descriptors: int
    batch_writes: int
    zero_copy: bool
    copy_s: float
    digest_s: float
    write_s: float
    sealed_digests: bool = False  # the source's digests were sent: no hashing at send


class MooncakeBackend(TransferBackend):
    """Owner-filtered, position-addressed Mooncake writes (see the module docstring).

    The engine (and the registered host copy buffer) are made on first use and shared
    by every rank this backend runs; `close()` releases them (~1 s)."""

    capabilities: ClassVar[BackendCapabilities] = default_backend_registry().get("mooncake")

    def __init__(
        self,
        config: MooncakeBackendConfig | None = None,
        faults: MooncakeSenderFaults | None = None,
        *,
        engine: MooncakeEngine | None = None,
    ):
        self.config = config if config is not None else MooncakeBackendConfig()
        self.faults = faults
        self._control = self.config.control()
        self._engine = engine
        self._owns_engine = engine is None
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        # Per decode engine: its ranks prepare their writes one at a time (see
        # `MooncakeRankSender._plan`).
        self._prep_gates: dict[str, threading.Lock] = {}
        self._host: StagingArena | None = None
        self._registered: dict[int, tuple[int, RegisteredBuffer, np.ndarray]] = {}
        self._running: RunningSenders[MooncakeRankSender] = RunningSenders()
        self._stats: dict[tuple[str, int], RankWriteStats] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._closed = False

    # ---- shared resources -----------------------------------------------------------------
    @property
    def engine(self) -> MooncakeEngine:
        with self._lock:
            if self._closed:
                raise MooncakeError("the Mooncake backend is closed")
            if self._engine is None:
                c = self.config
                self._engine = MooncakeEngine(
                    c.hostname,
                    c.protocol,
                    device_name=c.device_name,
                    transfer_timeout_s=c.transfer_timeout_s,
                    max_batch=c.max_batch,
                )
            return self._engine

    def prepare(self) -> None:
        """Start the engine and register the host copy buffer (allocated and pre-faulted)
        now, not during the first device-pool request: for a GLM-5 prefill server that is
        ~1.66 GB to touch and register."""
        self._host_arena()

    def control_channel(self, target: str) -> grpc.Channel:
        """The control-plane channel to a decode receiver, shared by every rank and room
        (gRPC multiplexes calls; no connection setup per rank)."""
        with self._lock:
            if self._closed:
                raise MooncakeError("the Mooncake backend is closed")
            ch = self._channels.get(target)
            if ch is None:
                ch = grpc.insecure_channel(
                    target,
                    options=[
                        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                        *KEPT_CHANNEL_OPTIONS,
                    ],
                    compression=grpc.Compression.NoCompression,
                )
                self._channels[target] = ch
            return ch

    def prep_gate(self, session_id: str) -> threading.Lock:
        """The lock under which ranks writing to `session_id` prepare their writes."""
        with self._lock:
            return self._prep_gates.setdefault(session_id, threading.Lock())

    def _host_arena(self) -> StagingArena:
        engine = self.engine
        with self._lock:
            if self._host is None:
                self._host = StagingArena(self.config.host_buffer_bytes)
                engine.register(self._host.memory)
            return self._host

    def alloc_host(self, nbytes: int, tag: str, stop: Callable[[], bool]) -> Region:
        """A region of the registered host buffer, waiting up to `host_buffer_wait_s`."""
        arena = self._host_arena()
        if nbytes > arena.nbytes:
            raise StagingFullError(
                f"{tag}: the rank's pages need {nbytes} B, more than the whole registered "
                f"host buffer ({arena.nbytes} B); raise MooncakeBackendConfig.host_buffer_bytes "
                "(cpkv-serve --transfer-host-buffer-size)"
            )
        wait_s = self.config.host_buffer_wait_s
        deadline = time.monotonic() + wait_s
        with self._space:
            while True:
                try:
                    return arena.alloc(nbytes, tag)
                except StagingFullError:
                    left = deadline - time.monotonic()
                    if stop():
                        raise
                    if left <= 0:
                        stats = arena.stats()
                        raise StagingFullError(
                            f"{tag}: no {nbytes} B free in the registered host copy buffer "
                            f"({arena.nbytes} B) after {wait_s:g}s: {stats.live_regions} other "
                            f"rank copies hold {stats.live_bytes} B (largest free range "
                            f"{stats.largest_free_bytes} B); raise "
                            "MooncakeBackendConfig.host_buffer_bytes (cpkv-serve "
                            "--transfer-host-buffer-size) or host_buffer_wait_s"
                        ) from None
                    self._space.wait(min(left, 0.05))

    def free_host(self, region: Region) -> None:
        assert self._host is not None
        with self._space:
            self._host.free(region)
            self._space.notify_all()

    def register_source(self, array: np.ndarray) -> None:
        """Register a host pool leaf with the engine once (kept until `close`)."""
        engine = self.engine
        ptr, n = int(array.ctypes.data), int(array.nbytes)
        with self._lock:
            known = self._registered.get(ptr)
            if known is not None and known[0] >= n:
                return
            if known is not None:  # the same address grew: register the larger range
                engine.unregister(known[1])
            self._registered[ptr] = (n, engine.register(array), array)

    def close(self) -> None:
        """Release the engine this backend made (and its registrations); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            engine, self._engine = self._engine, None
            regs, self._registered = list(self._registered.values()), {}
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()
        if engine is None:
            return
        if self._owns_engine:
            engine.close()
        else:
            for _, handle, _ in regs:
                engine.unregister(handle)
            if self._host is not None:
                engine.unregister(self._host.memory)

    def __enter__(self) -> MooncakeBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- ranks ------------------------------------------------------------------------------
    def send_rank(self, job: RankJob, hold: TransferHold) -> RoomSnapshot | None:
        sender = MooncakeRankSender(job, hold, self, self.faults)
        try:
            with self._running.running(job, sender):
                return sender.run()
        finally:
            if sender.stats is not None:
                with self._lock:
                    self._stats[(job.room, job.rank)] = sender.stats

    def sender(self, room: str, rank: int) -> MooncakeRankSender | None:
        """The running sender of (room, rank), e.g. to `kill()` it."""
        return self._running.get(room, rank)

    def stats(self, room: str) -> dict[int, RankWriteStats]:
        """Per rank, what it wrote for `room` (ranks that got to write)."""
        with self._lock:
            return {rank: s for (r, rank), s in self._stats.items() if r == room}


def coalesce(src_rows: np.ndarray, dst_rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """Runs where source and destination rows both advance by one: (src, dst, count)."""
    k = src_rows.size
    if k == 0:
        z = np.zeros(0, np.int64)
        return z, z, z
    breaks = np.flatnonzero((np.diff(src_rows) != 1) | (np.diff(dst_rows) != 1)) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    counts = np.diff(np.concatenate((starts, [k]))).astype(np.int64)
    return src_rows[starts], dst_rows[starts], counts


class MooncakeRankSender(GrpcRankSender):
    """One prefill rank's Mooncake transfer of one room (see the module docstring).

    The control plane (handshake retries, heartbeats, commit, abort, `kill`) is the gRPC
    sender's; the pages go by engine writes instead of `WritePages` streams."""

    # The decode side's staging arena may be full for now: wait like for a late room.
    HANDSHAKE_WAITABLE = RETRYABLE | {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }

    def __init__(
        self,
        job: RankJob,
        hold: TransferHold,
        backend: MooncakeBackend,
        faults: MooncakeSenderFaults | None = None,
    ):
        super().__init__(job, hold, backend._control)
        self.faults = faults if faults is not None else MooncakeSenderFaults()  # type: ignore[assignment]
        self.backend = backend
        self.stats: RankWriteStats | None = None
        self._region: pb.MooncakeRegion | None = None  # set by an accepted handshake
        self._digests: np.ndarray | None = None  # [n_buffers, k]
        self._sources: list[np.ndarray] = []  # per buffer, uint8 [rows, page_bytes]
        self._host_region: Region | None = None
        self._write_uncertain = False  # an engine write failed: bytes may still move
        self._gate: _Gate | None = None  # held from the plan to the first engine call
        self._committed = False

    def source_rows(self, buffer: int) -> np.ndarray:
        """The bytes this rank writes for buffer `buffer` (uint8 `[rows, page_bytes]`):
        its registered host copy, or the registered host pool leaf (tests, debugging)."""
        return self._sources[buffer]

    # ---- protocol hooks -----------------------------------------------------------------------
    def _open(self) -> None:
        # The backend's shared channel: not in self._channels, so run() leaves it open.
        self._stubs.append(pb_grpc.KVTransferStub(self.backend.control_channel(self.job.target)))

    def _handshake_request(self) -> pb.HandshakeRequest:
        req = super()._handshake_request()
        req.data_plane = pb.DATA_PLANE_MOONCAKE
        return req

    def _handshake(self) -> pb.HandshakeReply:
        reply = super()._handshake()
        if reply.HasField("mooncake"):
            self._region = reply.mooncake
        return reply

    def _commit(self, plan: RankPlan) -> None:
        super()._commit(plan)
        self._committed = True  # the decode side knows this rank's writes are over

    def _commit_request(self, plan: RankPlan) -> pb.CommitRequest:
        req = super()._commit_request(plan)
        if self._digests is not None and self._digests.size:
            req.digests.extend(self._digests.reshape(-1).tolist())
        return req

    def _before_close(self) -> None:
        """Tell the decode side this rank writes no more (ends a quarantine early), then
        give the host copy region back."""
        try:
            if self._region is not None and not self._killed.is_set() and not self._committed:
                if self._write_uncertain:
                    logger.warning(
                        "room %s: rank %d had a failed engine write; not claiming its writes "
                        "are done (the decode side's quarantine timeout covers it)",
                        self.job.room,
                        self.rank,
                    )
                else:
                    try:
                        self._stubs[0].Heartbeat(
                            pb.HeartbeatRequest(
                                room=self.job.room, sender_rank=self.rank, writes_done=True
                            ),
                            timeout=min(self.config.rpc_timeout_s, 2.0),
                        )
                    except grpc.RpcError as e:
                        logger.info(
                            "room %s: rank %d final heartbeat not delivered: %s",
                            self.job.room,
                            self.rank,
                            e.code().name,
                        )
        finally:
            self._release_host_region()

    def _release_host_region(self) -> None:
        region, self._host_region = self._host_region, None
        self._sources = []
        if region is None:
            return
        if self._write_uncertain:
            # A failed engine write may still read it: hand it back after the transfer
            # timeout. (Otherwise every write of this thread has returned, killed or not.)
            cfg = self.backend.config
            delay = cfg.uncertain_hold_s
            if delay is None:
                delay = 2 * cfg.transfer_timeout_s if cfg.transfer_timeout_s else 60.0
            t = threading.Timer(delay, self.backend.free_host, args=(region,))
            t.daemon = True
            t.start()
        else:
            self.backend.free_host(region)

    # ---- pages ------------------------------------------------------------------------------
    def _plan(self, reply: pb.HandshakeReply) -> RankPlan:
        # The ranks writing to one decode engine prepare one at a time, from their plan
        # to their first engine call: when a request's pages are provided every rank
        # wakes at once, and their Python work interleaving under the interpreter lock
        # put the first write 2-5 ms after `provide`; gated, the first rank writes
        # sooner and the others prepare while it writes (512-token rooms: about 0.7 ms
        # faster). Their writes go one at a time anyway (the engine's per-peer lock).
        session = self._region.session_id if self._region is not None else ""
        self._gate = _Gate(self.backend.prep_gate(session))
        self._gate.acquire()
        try:
            return super()._plan(reply)
        except BaseException:
            self._gate.release()
            raise

    def _send_pages(self, plan: RankPlan, chunk_bytes: int) -> None:
        try:
            self._send_prepared(plan, chunk_bytes)
        finally:
            self._prepared()
            # The writes are over (or failed: then a delayed return) and the digests
            # taken: the host copy goes back now, not when the room ends, so the ranks of
            # a room larger than the host buffer take turns in it. (Held to the room's
            # end, the ranks holding it waited for that end and the others for space:
            # the room failed after host_buffer_wait_s.)
            self._release_host_region()

    def _prepared(self) -> None:
        """Let the next rank prepare (idempotent)."""
        if self._gate is not None:
            self._gate.release()

    def _send_prepared(self, plan: RankPlan, chunk_bytes: int) -> None:
        del chunk_bytes  # gRPC chunking does not apply
        job, cfg = self.job, self.backend.config
        region = self._region
        if region is None or not region.session_id:
            self._fail("the decode side accepted the handshake without a Mooncake region")
        assert region is not None
        buffers = job.layout.buffers()
        page_bytes = np.array([job.layout.page_bytes(k, layer) for k, layer in buffers], np.int64)
        n_pages = len(region.rows)
        if len(region.buffer_addrs) != len(buffers) or (
            plan.num_pages and int(plan.positions.max()) >= n_pages
        ):
            self._fail(
                f"Mooncake region has {len(region.buffer_addrs)} buffers and {n_pages} rows "
                f"of positions; the layout has {len(buffers)} buffers and the plan positions "
                f"up to {int(plan.positions.max()) if plan.num_pages else -1}"
            )
        k = plan.num_pages
        if k == 0:
            self._digests = np.zeros((len(buffers), 0), np.uint64)
            return
        dst_rows = np.asarray(region.rows, np.int64)[plan.positions]
        if int(dst_rows.max()) >= region.row_count:
            self._fail(f"Mooncake region rows reach {int(dst_rows.max())} >= {region.row_count}")
        engine = self.backend.engine

        t0 = time.perf_counter()
        zero_copy = cfg.zero_copy_host_sources and isinstance(job.source, HostPageSource)
        if zero_copy:  # worth it only when the local pages form long runs
            runs = int(coalesce(plan.src_pages.astype(np.int64), dst_rows)[2].size)
            mean = k * int(page_bytes.sum()) // (runs * page_bytes.size)
            zero_copy = mean >= cfg.zero_copy_min_descriptor_bytes
        if zero_copy:
            src_rows = plan.src_pages.astype(np.int64)
            for b, (kind, layer) in enumerate(buffers):
                leaf = job.source.host_buffer(kind, layer)  # type: ignore[attr-defined]
                if not leaf.flags.c_contiguous or leaf.nbytes != leaf.shape[0] * page_bytes[b]:
                    raise ValueError(
                        f"{kind} layer {layer}: host_buffer {leaf.shape} {leaf.dtype} is not a "
                        f"C-contiguous pool leaf of {int(page_bytes[b])} B pages"
                    )
                self.backend.register_source(leaf)
                self._sources.append(leaf.reshape(leaf.shape[0], -1).view(np.uint8))
        else:
            # The rank copies while it holds the preparation gate: the ranks' copies go
            # one at a time, each beside an earlier rank's write, instead of all at once
            # while the first rank waits for its own (64K-token rooms: 280-294 against
            # 302-311 ms; 512-token rooms 14.3-14.8 against 17.5-20.9 ms; medians of
            # three interleaved rounds). Waiting for host-buffer space with the gate held
            # is safe: ranks past the gate hold that space and give it back once their
            # writes are over, without needing the gate.
            src_rows = np.arange(k, dtype=np.int64)
            sizes = [k * int(nb) for nb in page_bytes]
            self._host_region = self.backend.alloc_host(
                sum(-(-s // 4096) * 4096 for s in sizes),
                f"{job.room}/r{job.rank}",
                lambda: self._must_stop(),
            )
            arena = self.backend._host
            assert arena is not None
            off = 0
            for b, (kind, layer) in enumerate(buffers):
                self._check()
                view = arena.view(self._host_region, off, sizes[b]).reshape(k, -1)
                read_into = getattr(job.source, "read_into", None)
                if read_into is not None:  # one copy, into the registered buffer
                    read_into(kind, layer, plan.src_pages, view)
                else:
                    rows = np.ascontiguousarray(job.source.read(kind, layer, plan.src_pages))
                    got = rows.reshape(rows.shape[0], -1).view(np.uint8)
                    if got.shape != view.shape:
                        raise ValueError(
                            f"{kind} layer {layer}: the page source gave {got.shape} bytes, "
                            f"the layout needs {view.shape}"
                        )
                    view[...] = got
                self._sources.append(view)
                off += -(-sizes[b] // 4096) * 4096
        t1 = time.perf_counter()
        write = functools.partial(
            self._write, engine, region.session_id, src_rows, dst_rows, page_bytes
        )
        sealed = self._sealed_digests(plan)
        if sealed is not None:  # taken once when the pages were written: nothing to hash
            self._digests, digest_s = sealed, 0.0
            writes, descriptors = write()
        elif k * int(page_bytes.sum()) <= cfg.inline_digest_max_bytes:
            # A small rank hashes its pages itself, then writes (usually while it waits
            # for its turn on the peer): a helper thread would cost more than the
            # hashing. 512-token rooms (0.66 MB a rank) took 17.7-21.9 ms against
            # 20.3-24.7 ms with helpers (faster in 67 of 90 interleaved pairs), 4096-token
            # rooms (5.3 MB) 43.3-43.7 against 45.6-45.9 ms (32 of 40).
            t = time.perf_counter()
            self._digests = self._page_digests(src_rows)
            digest_s = time.perf_counter() - t
            writes, descriptors = write()
        else:
            writes, descriptors, digest_s = self._write_hashing_alongside(write, src_rows)
        self.stats = RankWriteStats(
            pages=k,
            bytes=k * int(page_bytes.sum()),
            descriptors=descriptors,
            batch_writes=writes,
            zero_copy=zero_copy,
            copy_s=t1 - t0,
            digest_s=digest_s,
            write_s=time.perf_counter() - t1,
            sealed_digests=sealed is not None,
        )
        logger.debug("room %s: rank %d wrote %s", job.room, self.rank, self.stats)

    def _sealed_digests(self, plan: RankPlan) -> np.ndarray | None:
        """`[buffers, pages]` sealed digests of the plan's pages from the source, or None
        unless it has them for every (buffer, page)."""
        got = []
        for kind, layer in self.job.layout.buffers():
            d = sealed_digests(self.job.source, kind, layer, plan.src_pages)
            if d is None:
                return None
            got.append(d)
        return np.stack(got)

    def _page_digests(self, src_rows: np.ndarray) -> np.ndarray:
        """xxh3 of each page this rank sends, `[buffers, pages]` (the commit's digests)."""
        return np.stack([row_digests(src, src_rows) for src in self._sources])

    def _write_hashing_alongside(
        self, write: Callable[..., tuple[int, int]], src_rows: np.ndarray
    ) -> tuple[int, int, float]:
        """`write(on_start=)` while a helper thread takes the digests; returns
        (batch writes, descriptors, seconds hashing).

        The digests stay off the critical path this way. Ranks' writes to one peer go one
        at a time (the engine's per-peer lock), and the helper starts when this rank's
        turn comes: hashing every rank's pages at once while the first rank writes took
        the CPU that write needed (2 cores: the first rank's write ran at half speed)."""
        digest: dict[str, object] = {}
        turn = threading.Event()

        def take_digests() -> None:
            turn.wait()
            if "skip" in digest:  # nothing will be committed
                return
            t = time.perf_counter()
            try:
                digest["value"] = self._page_digests(src_rows)
            except BaseException as e:  # re-raised by the rank thread
                digest["error"] = e
            digest["seconds"] = time.perf_counter() - t

        digester = threading.Thread(
            target=take_digests, name=f"kv-digest-{self.job.room}-r{self.rank}", daemon=True
        )
        digester.start()
        try:
            writes, descriptors = write(on_start=turn.set)
        except BaseException:
            if not turn.is_set():  # failed before its turn: the helper need not hash
                digest["skip"] = True
            raise
        finally:
            turn.set()
            digester.join()
        if "error" in digest:
            raise digest["error"]  # type: ignore[misc]
        self._digests = digest["value"]  # type: ignore[assignment]
        return writes, descriptors, float(digest["seconds"])  # type: ignore[arg-type]

    def _write(
        self,
        engine: MooncakeEngine,
        session_id: str,
        src_rows: np.ndarray,
        dst_rows: np.ndarray,
        page_bytes: np.ndarray,
        on_start: Callable[[], None] | None = None,
    ) -> tuple[int, int]:
        """The coalesced batch writes; returns (batch writes, descriptors). `on_start`:
        see `MooncakeEngine.batch_write` (called at each batch write's turn)."""
        assert self._region is not None
        addrs = self._region.buffer_addrs
        s, d, c = coalesce(src_rows, dst_rows)  # the same runs in every buffer
        local, remote, lengths = [], [], []
        for b in range(page_bytes.size):
            nb = int(page_bytes[b])
            local.append(int(self._sources[b].ctypes.data) + s * nb)
            remote.append(int(addrs[b]) + d * nb)
            lengths.append(c * nb)
        local_a, remote_a, len_a = (np.concatenate(x) for x in (local, remote, lengths))
        # Batch writes of about write_group_bytes each (at least one descriptor).
        groups = _groups(len_a, self.backend.config.write_group_bytes)
        self._prepared()
        for g, (lo, hi) in enumerate(groups):
            self._check()
            if self.faults.before_write is not None:
                self.faults.before_write(self, g)
                if self._killed.is_set():
                    raise _Killed
            self._batch_write(
                engine, session_id, g, local_a[lo:hi], remote_a[lo:hi], len_a[lo:hi], on_start
            )
            if self.faults.after_write is not None:
                self.faults.after_write(self, g)
        return len(groups), int(len_a.size)

    def _batch_write(
        self,
        engine: MooncakeEngine,
        session_id: str,
        group: int,
        local: np.ndarray,
        remote: np.ndarray,
        lengths: np.ndarray,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        """One batch write with bounded retries (`MooncakeBackendConfig.write_retries`).

        Retrying is safe: the retry writes the same source ranges to the same
        destination rows of the room's staging region, under the same attempt, so bytes
        that landed the first time are overwritten with themselves, and the decode side
        checks every page's digest at the commit anyway.

        Only engine failures (`MooncakeTransferError`) that came back fast - under half
        the transfer timeout: the peer refused or reset the connection, so none of the
        call's bytes are still moving - are retried. A failure that took that long is a
        stalled peer: the engine may still be moving the timed-out slices, so the room
        fails (and its staging region waits out the decode side's quarantine) instead of
        succeeding with a late slice still in flight. A local range outside the
        registered buffers or a closed engine fails the room at once (nothing was sent).
        """
        cfg = self.backend.config
        stall_s = 0.5 * (cfg.transfer_timeout_s or DEFAULT_TRANSFER_TIMEOUT_S)
        for attempt in range(cfg.write_retries + 1):
            t0 = time.monotonic()
            try:
                if self.faults.write is not None:
                    self.faults.write(self, group, attempt)
                engine.batch_write(session_id, local, remote, lengths, on_start)
                return
            except MooncakeTransferError as e:
                self._write_uncertain = True  # the engine may still move bytes of it
                self._check()  # killed, room finished, decode side lost: stop here
                took = time.monotonic() - t0
                if took >= stall_s:
                    self._fail(
                        f"Mooncake write to {session_id}: {e} (after {took:.1f}s: a stalled "
                        "peer, not retried)"
                    )
                if attempt < cfg.write_retries:
                    logger.info(
                        "room %s: rank %d batch write %d to %s failed (%s); retry %d of %d",
                        self.job.room,
                        self.rank,
                        group,
                        session_id,
                        e,
                        attempt + 1,
                        cfg.write_retries,
                    )
                    self._sleep(cfg.write_retry_backoff_s * 2**attempt)
                    continue
                self._fail(f"Mooncake write to {session_id}: {e} (after {attempt + 1} tries)")
            except MooncakeError as e:
                self._check()
                self._fail(f"Mooncake write to {session_id}: {e}")


class _Gate:
    """One holder's use of a shared lock: `release()` lets go if held, else does nothing."""

    def __init__(self, lock: threading.Lock):
        self._lock = lock
        self._held = False

    def acquire(self) -> None:
        self._lock.acquire()
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._lock.release()


def _groups(lengths: np.ndarray, group_bytes: int) -> list[tuple[int, int]]:
    """[lo, hi) descriptor ranges of about `group_bytes` each (>= 1 descriptor)."""
    out, lo, acc = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        if acc and acc + n > group_bytes:
            out.append((lo, i))
            lo, acc = i, 0
        acc += n
    if lo < lengths.size:
        out.append((lo, int(lengths.size)))
    return out


__all__ = [
    "HostPageSource",
    "MooncakeBackend",
    "MooncakeBackendConfig",
    "MooncakeRankSender",
    "MooncakeReceiverEndpoint",
    "MooncakeSenderFaults",
    "RankWriteStats",
    "coalesce",
]
