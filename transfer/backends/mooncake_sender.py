"""The Mooncake backend's rank sender: page bytes by Mooncake Transfer Engine writes.

`MooncakeRankSender` is one prefill rank's transfer of one room: its control plane
(handshake, heartbeats, commit with every page's digest, outcome, abort) is a
`transfer.session.SenderSession` over the backend's shared gRPC control channel; its
data plane is the engine writes described in `transfer.backends.mooncake_backend`
(steps 1-3 and 5 there): source bytes (zero copy or a registered host copy), digests,
coalesced batch writes with bounded retries, and a final `writes_done` heartbeat.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import numpy as np

from transfer.backends.mooncake_engine import (
    DEFAULT_TRANSFER_TIMEOUT_S,
    MooncakeEngine,
    MooncakeError,
    MooncakeTransferError,
)
from transfer.hold import TransferHold
from transfer.page_plan import RankPlan, row_digests
from transfer.page_source import HostPageSource, sealed_digests
from transfer.proto import kv_transfer_pb2 as pb
from transfer.proto import kv_transfer_pb2_grpc as pb_grpc
from transfer.sender import RankJob
from transfer.session import (
    HANDSHAKE_WAITABLE,
    RankSender,
    SenderKilled,
    SenderSession,
    SessionFaults,
)
from transfer.staging_arena import Region

if TYPE_CHECKING:  # the backend module imports this one
    from transfer.backends.mooncake_backend import MooncakeBackend

logger = logging.getLogger(__name__)

# The decode side's staging arena may be full for now: wait like for a late room.
MOONCAKE_HANDSHAKE_WAITABLE = HANDSHAKE_WAITABLE | {grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclasses.dataclass(frozen=True)
class MooncakeSenderFaults(SessionFaults["MooncakeRankSender"]):
    """Fault-injection hooks (tests only): `plan` and `before_commit` (`SessionFaults`),
    and

    - `before_write(sender, group)`: before batch write `group` (`sender.kill()`, abort
      the room, ...);
    - `after_write(sender, group)`: after batch write `group` returned (corrupt the
      staged bytes on the decode side, check the decode pool, ...);
    - `write(sender, group, attempt)`: just before try `attempt` (0 = first) of batch
      write `group` reaches the engine; raising `MooncakeTransferError` simulates the
      engine failing that try (a transient fault, retried like a real one).
    """

    before_write: Callable[[MooncakeRankSender, int], None] | None = None
    after_write: Callable[[MooncakeRankSender, int], None] | None = None
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


class MooncakeRankSender(RankSender):
    """One prefill rank's Mooncake transfer of one room (see the module docstring)."""

    def __init__(
        self,
        job: RankJob,
        hold: TransferHold,
        backend: MooncakeBackend,
        faults: MooncakeSenderFaults | None = None,
    ):
        self.backend = backend
        self.faults = faults if faults is not None else MooncakeSenderFaults()
        self.session = SenderSession(
            job,
            hold,
            backend.config,
            self.faults,
            self,
            data_plane=pb.DATA_PLANE_MOONCAKE,
            waitable=MOONCAKE_HANDSHAKE_WAITABLE,
        )
        self.stats: RankWriteStats | None = None
        self._region: pb.MooncakeRegion | None = None  # set by an accepted handshake
        self._digests: np.ndarray | None = None  # [n_buffers, k]
        self._sources: list[np.ndarray] = []  # per buffer, uint8 [rows, page_bytes]
        self._host_region: Region | None = None
        self._write_uncertain = False  # an engine write failed: bytes may still move
        self._gate: _Gate | None = None  # held from the plan to the first engine call

    def source_rows(self, buffer: int) -> np.ndarray:
        """The bytes this rank writes for buffer `buffer` (uint8 `[rows, page_bytes]`):
        its registered host copy, or the registered host pool leaf (tests, debugging)."""
        return self._sources[buffer]

    # ---- data plane (`transfer.session.DataPlane`) -------------------------------------------
    def open(self) -> pb_grpc.KVTransferStub:
        # The backend's shared channel: close() leaves it open.
        return pb_grpc.KVTransferStub(self.backend.control_channel(self.job.target))

    def accepted(self, reply: pb.HandshakeReply) -> None:
        if reply.HasField("mooncake"):
            self._region = reply.mooncake

    def send(self, reply: pb.HandshakeReply) -> RankPlan:
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
            plan = self.session.plan(reply)
        except BaseException:
            self._gate.release()
            raise
        try:
            self._send_prepared(plan)
        finally:
            self._prepared()
            # The writes are over (or failed: then a delayed return) and the digests
            # taken: the host copy goes back now, not when the room ends, so the ranks of
            # a room larger than the host buffer take turns in it. (Held to the room's
            # end, the ranks holding it waited for that end and the others for space:
            # the room failed after host_buffer_wait_s.)
            self._release_host_region()
        return plan

    def commit_digests(self) -> np.ndarray | None:
        return self._digests

    def close(self) -> None:
        """Tell the decode side this rank writes no more (ends a quarantine early), then
        give the host copy region back."""
        try:
            s = self.session
            if self._region is not None and not s.killed and not s.committed:
                if self._write_uncertain:
                    logger.warning(
                        "room %s: rank %d had a failed engine write; not claiming its writes "
                        "are done (the decode side's quarantine timeout covers it)",
                        self.job.room,
                        self.rank,
                    )
                else:
                    s.say_writes_done()
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
    def _prepared(self) -> None:
        """Let the next rank prepare (idempotent)."""
        if self._gate is not None:
            self._gate.release()

    def _send_prepared(self, plan: RankPlan) -> None:
        job, cfg = self.job, self.backend.config
        region = self._region
        if region is None or not region.session_id:
            self.session.fail("the decode side accepted the handshake without a Mooncake region")
        assert region is not None
        buffers = job.layout.buffers()
        page_bytes = np.array([job.layout.page_bytes(k, layer) for k, layer in buffers], np.int64)
        n_pages = len(region.rows)
        if len(region.buffer_addrs) != len(buffers) or (
            plan.num_pages and int(plan.positions.max()) >= n_pages
        ):
            self.session.fail(
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
            self.session.fail(
                f"Mooncake region rows reach {int(dst_rows.max())} >= {region.row_count}"
            )
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
                self.session.must_stop,
            )
            off = 0
            for b, (kind, layer) in enumerate(buffers):
                self.session.check()
                view = self.backend.host_view(self._host_region, off, sizes[b]).reshape(k, -1)
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
        sealed = _sealed_digests(job, plan)
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
            writes, descriptors, self._digests, digest_s = _write_hashing_alongside(
                write,
                functools.partial(self._page_digests, src_rows),
                f"kv-digest-{job.room}-r{job.rank}",
            )
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

    def _page_digests(self, src_rows: np.ndarray) -> np.ndarray:
        """xxh3 of each page this rank sends, `[buffers, pages]` (the commit's digests)."""
        return np.stack([row_digests(src, src_rows) for src in self._sources])

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
            self.session.check()
            if self.faults.before_write is not None:
                self.faults.before_write(self, g)
                if self.session.killed:
                    raise SenderKilled
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
                self.session.check()  # killed, room finished, decode side lost: stop here
                took = time.monotonic() - t0
                if took >= stall_s:
                    self.session.fail(
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
                    self.session.sleep(cfg.write_retry_backoff_s * 2**attempt)
                    continue
                self.session.fail(
                    f"Mooncake write to {session_id}: {e} (after {attempt + 1} tries)"
                )
            except MooncakeError as e:
                self.session.check()
                self.session.fail(f"Mooncake write to {session_id}: {e}")


def _sealed_digests(job: RankJob, plan: RankPlan) -> np.ndarray | None:
    """`[buffers, pages]` sealed digests of the plan's pages from the job's source, or
    None unless it has them for every (buffer, page)."""
    got = []
    for kind, layer in job.layout.buffers():
        d = sealed_digests(job.source, kind, layer, plan.src_pages)
        if d is None:
            return None
        got.append(d)
    return np.stack(got)


def _write_hashing_alongside(
    write: Callable[..., tuple[int, int]], digests: Callable[[], np.ndarray], name: str
) -> tuple[int, int, np.ndarray, float]:
    """`write(on_start=)` while a helper thread (`name`) takes `digests()`; returns
    (batch writes, descriptors, digests, seconds hashing).

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
            digest["value"] = digests()
        except BaseException as e:  # re-raised by the rank thread
            digest["error"] = e
        digest["seconds"] = time.perf_counter() - t

    digester = threading.Thread(target=take_digests, name=name, daemon=True)
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
    value: np.ndarray = digest["value"]  # type: ignore[assignment]
    return writes, descriptors, value, float(digest["seconds"])  # type: ignore[arg-type]


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
    "MooncakeRankSender",
    "MooncakeSenderFaults",
    "RankWriteStats",
    "coalesce",
]
