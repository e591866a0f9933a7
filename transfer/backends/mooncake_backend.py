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
   when it keeps them for every page sent (`transfer.page_source.SealedPageSource`,
   e.g. a host pool whose pages were sealed once written); otherwise from the bytes that are
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

The prefill pages are held until the room succeeds or fails (`transfer.hold.
TransferHold`, as for every backend). The rank sender (`mooncake_sender.
MooncakeRankSender`) runs its control plane through the same `transfer.session.
SenderSession` as the gRPC backend's; `mooncake_sender.MooncakeSenderFaults` are the
tests' hooks.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import ClassVar

import grpc
import numpy as np

from transfer.backends.mooncake_engine import (
    DEFAULT_MAX_BATCH,
    MooncakeEngine,
    MooncakeError,
    RegisteredBuffer,
)
from transfer.backends.mooncake_sender import (
    MooncakeRankSender,
    MooncakeSenderFaults,
    RankWriteStats,
)
from transfer.capabilities import BackendCapabilities, default_backend_registry
from transfer.hold import RunningSenders, TransferHold
from transfer.protocol import MiB, RoomSnapshot
from transfer.sender import RankJob, TransferBackend
from transfer.session import ControlConfig, kept_channel
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


@dataclasses.dataclass(frozen=True)
class MooncakeBackendConfig(ControlConfig):
    """Prefill-side settings of the Mooncake backend (seconds, bytes); the control-plane
    ones (retries, timeouts, heartbeats) are `ControlConfig`'s, as for the gRPC backend."""

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

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(
            ("host_buffer_bytes", "write_group_bytes", "max_batch"), lambda v: v >= 1, ">= 1"
        )
        self._require(("write_retries", "write_retry_backoff_s"), lambda v: v >= 0, ">= 0")
        self._require(("uncertain_hold_s",), lambda v: v is None or v > 0, "> 0 or None")


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
        self._engine = engine
        self._owns_engine = engine is None
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        # Per decode engine: its ranks prepare their writes one at a time (see
        # `MooncakeRankSender.send`).
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
                ch = kept_channel(target)
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
                f"host buffer ({arena.nbytes} B); raise `host_buffer_bytes`"
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
                            f"{stats.largest_free_bytes} B); raise `host_buffer_bytes` or "
                            "`host_buffer_wait_s`"
                        ) from None
                    self._space.wait(min(left, 0.05))

    def host_view(self, region: Region, offset: int, nbytes: int) -> np.ndarray:
        """`nbytes` of `region` of the registered host buffer from `offset` (uint8)."""
        assert self._host is not None
        return self._host.view(region, offset, nbytes)

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


__all__ = [
    "MooncakeBackend",
    "MooncakeBackendConfig",
    "MooncakeReceiverEndpoint",
]
