"""The control plane of one prefill rank's transfer of one room, shared by every backend.

A rank sender is a `SenderSession` and a data plane (`DataPlane`): the session talks
to the decode side's `KVTransfer` gRPC service (`transfer.receiver`) for every backend;
the data plane moves the pages - `WritePages` streams (`transfer.backends.grpc_backend`)
or Mooncake engine writes (`transfer.backends.mooncake_sender`). `SenderSession.run`:

1. **Handshake** - the layout descriptor, cp size, token count and data plane; retried
   while the decode side is unreachable (up to `bootstrap_timeout_s` without an answer)
   or answers "not yet": the room is not registered (its request waits in the decode
   server's queue) or, for a data plane that asks, has no staging space yet. A "not
   yet" has no deadline here - a decode queue may be long - so the request's own
   timeout, its client leaving or another rank's failure end the wait (a cancelled
   hold). Retries back off to one a second; a handshake the decode side held for the
   room is asked again at once. A refused handshake ends the rank before any data
   moves. Heartbeats (5.) start here. Only the hold's lowest rank (its prober) asks while
   the room is unregistered; the others wait, with no RPC, for its accepted handshake.
   A parked hold (`TransferHold.park`) stops the prober before its next attempt, and
   the others with it, without aborting the room (`Parked`).
   A rank started by `transfer.sender.bootstrap_request` then waits for the request's
   page table and aux data (`TransferHold.provide`), a cancel or the room's failure.
2. **Plan and pages** - the data plane plans the rank's pages (`SenderSession.plan`:
   `plan_rank` against the decode page table from the handshake reply; owner filtering,
   every page addressed by its logical position) and moves them.
3. **Commit** - the positions sent (and the data plane's digests, if it has them); rank
   0 adds the aux data. Failures are retried `max_retries` times with backoff.
4. **Outcome** - the rank waits until the room is finished (Success or Failed).
5. **Heartbeats** - from the handshake until the room is finished, every
   `heartbeat_interval_s`, on a thread of their own; the replies carry the room status.
   No reply for `heartbeat_timeout_s` means the decode side is gone: the rank fails the
   room. Each beat is its own asynchronous call on a fixed schedule, so nothing the
   rank's thread does (reads, compiles, writes) and no slow reply delays the next beat.

A rank that fails locally aborts the room on the decode side (best effort) and cancels
the request's other ranks through the `TransferHold`. `kill()` simulates the sender's
process dying: it stops every RPC at once, heartbeats included, without aborting.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import grpc
import numpy as np

from transfer.hold import TransferHold
from transfer.page_plan import PagePlanError, RankPlan, plan_rank
from transfer.proto import kv_transfer_pb2 as pb
from transfer.proto import kv_transfer_pb2_grpc as pb_grpc
from transfer.protocol import (
    HANDSHAKE_HOLD_S,
    MAX_MESSAGE_BYTES,
    RoomSnapshot,
    RoomState,
    aux_to_pb,
    layout_to_pb,
    snapshot_from_pb,
)
from transfer.sender import RankJob

logger = logging.getLogger(__name__)

RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
)
# The room is finished or the data was refused for good: ask for the room's status.
FINAL = frozenset(
    {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND}
)
# Handshake failures retried (decode not up / room unknown).
HANDSHAKE_WAITABLE = RETRYABLE | {grpc.StatusCode.NOT_FOUND}
# Of those, the decode side's own "not yet" (room unknown, staging full): it is alive,
# so these restart the bootstrap timeout, which bounds only time without an answer.
HANDSHAKE_NOT_YET = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED})
# The longest pause between handshake retries.
HANDSHAKE_MAX_BACKOFF_S = 1.0
# Heartbeats awaiting their reply at once; a decode side this slow gets no more.
MAX_BEATS_IN_FLIGHT = 4

# Channels are kept across rooms: after the decode server was unreachable for a while,
# gRPC's default reconnect backoff (up to 120 s) would keep failing new rooms' calls long
# after it is back. Retry the connection at least every second instead.
KEPT_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def kept_channel(target: str, *, own_connection: bool = False) -> grpc.Channel:
    """A channel to a decode receiver: big messages allowed, compression off,
    reconnecting within a second. `own_connection`: its own subchannel pool, hence its
    own TCP connection (data channels), instead of sharing one with same-target ones."""
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        *([("grpc.use_local_subchannel_pool", 1)] if own_connection else []),
        *KEPT_CHANNEL_OPTIONS,
    ]
    return grpc.insecure_channel(
        target, options=options, compression=grpc.Compression.NoCompression
    )


class SenderKilled(Exception):
    """The sender was killed: stop without another RPC."""


class Parked(Exception):
    """The hold was parked before the room registered: stop without another RPC."""


class RankDone(Exception):
    """The rank is finished with `outcome`."""

    def __init__(self, outcome: RoomSnapshot):
        super().__init__(outcome.reason)
        self.outcome = outcome


@dataclasses.dataclass(frozen=True)
class ControlConfig:
    """Control-plane settings every backend's config has (seconds)."""

    max_retries: int = 3  # per stream / commit, after the first try
    retry_backoff_s: float = 0.05  # doubled per retry
    rpc_timeout_s: float = 30.0
    heartbeat_interval_s: float | None = None  # None: what the decode side asks for
    heartbeat_timeout_s: float = 15.0  # no heartbeat reply this long -> decode side gone
    bootstrap_timeout_s: float = 300.0  # handshake retries without an answer (decode down)
    outcome_timeout_s: float | None = None  # after commit; None: heartbeats decide

    def __post_init__(self) -> None:
        self._require(("max_retries",), lambda v: v >= 0, ">= 0")
        self._require(
            ("rpc_timeout_s", "heartbeat_timeout_s", "bootstrap_timeout_s"), lambda v: v > 0, "> 0"
        )

    def _require(self, names: Sequence[str], ok: Callable[[Any], bool], rule: str) -> None:
        """ValueError for the first field of `names` whose value fails `ok`."""
        for name in names:
            value = getattr(self, name)
            if not ok(value):
                raise ValueError(f"{name} must be {rule}, got {value}")


S = TypeVar("S")


@dataclasses.dataclass(frozen=True)
class SessionFaults(Generic[S]):
    """Fault-injection hooks every backend's sender has (tests only); `S` is its rank
    sender, which the hooks get.

    - `plan(plan) -> plan`: alter the rank's page plan (drop or add positions);
    - `before_commit(sender)`: run just before the commit is sent.
    """

    plan: Callable[[RankPlan], RankPlan] | None = None
    before_commit: Callable[[S], None] | None = None


class DataPlane(Protocol):
    """A backend's part of one rank's transfer, driven by `SenderSession.run`."""

    def open(self) -> pb_grpc.KVTransferStub:
        """Connect; returns the stub the session's control calls go through."""
        ...

    def accepted(self, reply: pb.HandshakeReply) -> None:
        """The decode side accepted the handshake (its reply may carry a data region)."""
        ...

    def send(self, reply: pb.HandshakeReply) -> RankPlan:
        """Plan the rank's pages (`SenderSession.plan`) and move them; the plan sent."""
        ...

    def commit_digests(self) -> np.ndarray | None:
        """The sent pages' digests for the commit; None when the pages carried them."""
        ...

    def close(self) -> None:
        """The rank is finished: heartbeats stopped, the control stub still open."""
        ...


class RankSender:
    """What both backends' rank senders share: a `SenderSession` they drive as its
    `DataPlane`, and the job, hold and rank it knows. Subclasses set `self.session`."""

    session: SenderSession

    @property
    def job(self) -> RankJob:
        return self.session.job

    @property
    def hold(self) -> TransferHold:
        return self.session.hold

    @property
    def rank(self) -> int:
        return self.session.rank

    def kill(self) -> None:
        """Simulate this sender's process dying: no further RPC or write of any kind."""
        self.session.kill()

    def run(self) -> RoomSnapshot | None:
        """The whole transfer; returns the room's final status (None when killed)."""
        return self.session.run(self)  # type: ignore[arg-type]  # subclasses are DataPlanes


class SenderSession:
    """The control plane of one rank's transfer of one room (see the module docstring).

    `owner` is the rank sender, handed to the fault hooks; `data_plane` the handshake's
    `DataPlane` enum value; `waitable` the handshake errors retried until the bootstrap
    timeout. The data plane stops through `check()` (raises `SenderKilled` / `RankDone`)
    and `must_stop()`, and fails the room with `fail(reason)`."""

    def __init__(
        self,
        job: RankJob,
        hold: TransferHold,
        config: ControlConfig,
        faults: SessionFaults[Any],
        owner: object,
        *,
        data_plane: int,
        waitable: frozenset[grpc.StatusCode] = HANDSHAKE_WAITABLE,
    ):
        self.job, self.hold, self.config, self.faults = job, hold, config, faults
        self._owner = owner
        self._data_plane = data_plane
        self._waitable = waitable
        self._stub: pb_grpc.KVTransferStub | None = None  # set by the data plane's open()
        self._killed = threading.Event()
        self._stop_heartbeat = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._status: RoomSnapshot | None = None
        self._lost = ""  # why the decode side is considered gone
        self._committed = False
        self._heartbeat: threading.Thread | None = None
        self._beats: set[grpc.Future] = set()  # heartbeats awaiting their reply
        self._last_beat_ok = 0.0

    @property
    def rank(self) -> int:
        return self.job.rank

    @property
    def killed(self) -> bool:
        return self._killed.is_set()

    @property
    def committed(self) -> bool:
        """The commit was accepted: the decode side knows this rank's writes are over."""
        return self._committed

    def kill(self) -> None:
        """Simulate this sender's process dying: no further RPC of any kind."""
        logger.info("room %s: rank %d sender killed", self.job.room, self.rank)
        self._killed.set()
        self._wake.set()

    def wake(self) -> None:
        """Wake the rank's thread if it waits (for inputs or the outcome)."""
        self._wake.set()

    # ---- lifecycle --------------------------------------------------------------------------
    def run(self, plane: DataPlane) -> RoomSnapshot | None:
        """The whole transfer; returns the room's final status (None when killed)."""
        try:
            self._stub = plane.open()
            self.hold.add_waker(self._wake)  # provide, cancel, registered, parked
            if self.rank != self.hold.prober:
                self._await_registered()
            reply = self._handshake()
            plane.accepted(reply)
            interval = self.config.heartbeat_interval_s or reply.heartbeat_interval_s or 1.0
            self._start_heartbeat(interval)
            self._await_inputs()
            plan = plane.send(reply)
            self._commit(plan, plane.commit_digests())
            return self._await_outcome(interval)
        except (SenderKilled, Parked):
            return None
        except RankDone as d:
            return d.outcome
        except Exception as e:  # a local bug or a source read failure: fail the room
            logger.exception("room %s: rank %d sender failed", self.job.room, self.rank)
            try:
                self.fail(f"{type(e).__name__}: {e}")
            except RankDone as d:
                return d.outcome
            except SenderKilled:
                return None
            raise AssertionError("unreachable") from None
        finally:
            self._stop_heartbeats()
            plane.close()

    def _handshake(self) -> pb.HandshakeReply:
        cfg, job = self.config, self.job
        req = pb.HandshakeRequest(
            room=job.room,
            sender_rank=job.rank,
            cp_size=job.cp_size,
            num_tokens=job.num_tokens,
            layout=layout_to_pb(job.layout),
            attempt=job.attempt,
            data_plane=self._data_plane,
        )
        # A cancel (the request timed out or left, another rank failed) or a park ends a
        # backoff (the waker was added in `run`).
        prober = self.rank == self.hold.prober
        deadline = time.monotonic() + cfg.bootstrap_timeout_s
        tries = 0
        while True:
            self.check()
            if prober and self.hold.settle_park():
                logger.debug("room %s: parked before its room registered", job.room)
                raise Parked
            sent = time.monotonic()
            try:
                reply = self._control().Handshake(req, timeout=cfg.rpc_timeout_s)
                break
            except grpc.RpcError as e:
                self.check()
                code = e.code()
                now = time.monotonic()
                if code in self._waitable and code in HANDSHAKE_NOT_YET:
                    deadline = now + cfg.bootstrap_timeout_s  # an answer: no time limit
                if code in self._waitable and now < deadline:
                    if code is grpc.StatusCode.NOT_FOUND and now - sent >= HANDSHAKE_HOLD_S / 2:
                        tries = 0  # the receiver held the call for the room: ask again now
                        continue
                    tries += 1
                    self._backoff(
                        min(cfg.retry_backoff_s * 2 ** min(tries, 6), HANDSHAKE_MAX_BACKOFF_S)
                    )
                    continue
                if code is grpc.StatusCode.FAILED_PRECONDITION:  # version or room finished
                    self.finish_with_status(f"handshake refused: {e.details()}")
                self.fail(f"handshake failed: {code.name}: {e.details()}")
        self.observe(snapshot_from_pb(reply.status))
        if not reply.accepted:
            self.finish_with_status(f"handshake refused: {'; '.join(reply.mismatches)}")
        if prober:
            self.hold.note_registered()
        return reply

    def _await_registered(self) -> None:
        """A rank other than the prober: wait (no RPC) until the prober's handshake was
        accepted, so only one handshake per request polls an unregistered room."""
        while not self.hold.registered:
            self.check()
            if self.hold.parked:
                raise Parked
            self._wake.wait(1.0)
            self._wake.clear()

    def _await_inputs(self) -> None:
        """Bootstrap ahead (`transfer.sender.bootstrap_request`): handshaken and
        heartbeating, wait until the prefill provides the request's page table and aux
        data (or the room fails, the hold is cancelled, the sender is killed)."""
        self.hold.mark_ready(self.rank)  # (its waker was added in `run`)
        if self.job.has_inputs:
            return
        while True:
            self.check()
            inputs = self.hold.inputs
            if inputs is not None:
                try:
                    self.job = self.job.with_inputs(inputs)
                except ValueError as e:
                    self.fail(str(e))
                return
            self._wake.wait(1.0)
            self._wake.clear()

    def plan(self, reply: pb.HandshakeReply) -> RankPlan:
        """This rank's pages against the decode page table of the handshake reply."""
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
            self.fail(f"page plan: {e}")
        return self.faults.plan(plan) if self.faults.plan is not None else plan

    # ---- commit and outcome -------------------------------------------------------------------
    def _commit(self, plan: RankPlan, digests: np.ndarray | None) -> None:
        cfg, job = self.config, self.job
        if self.faults.before_commit is not None:
            self.faults.before_commit(self._owner)
        req = pb.CommitRequest(
            room=job.room,
            sender_rank=job.rank,
            attempt=job.attempt,
            positions=plan.positions.tolist(),
        )
        if job.aux is not None:
            req.aux.CopyFrom(aux_to_pb(job.aux))
        if digests is not None and digests.size:
            req.digests.extend(digests.reshape(-1).tolist())
        for attempt in range(cfg.max_retries + 1):
            self.check()
            try:
                status = self._control().Commit(req, timeout=cfg.rpc_timeout_s)
            except grpc.RpcError as e:
                self.check()
                code = e.code()
                if code in RETRYABLE and attempt < cfg.max_retries:
                    self.sleep(cfg.retry_backoff_s * 2**attempt)
                    continue
                if code in FINAL:
                    self.finish_with_status(f"commit refused: {e.details()}")
                lost = "decode side lost: " if code is grpc.StatusCode.UNAVAILABLE else ""
                self.fail(f"{lost}commit: {code.name} after {attempt + 1} tries: {e.details()}")
            self._committed = True
            self.observe(snapshot_from_pb(status))
            return

    def _await_outcome(self, interval: float) -> RoomSnapshot:
        """Wait (heartbeating) until the room is finished; returns its status."""
        timeout = self.config.outcome_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.check()  # raises RankDone once the room is finished
            if deadline is not None and time.monotonic() > deadline:
                self.fail(f"no outcome within {timeout:g}s of the commit")
            self._wake.wait(interval)
            self._wake.clear()

    # ---- heartbeats -----------------------------------------------------------------------------
    def _start_heartbeat(self, interval: float) -> None:
        self._last_beat_ok = time.monotonic()
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop,
            args=(interval,),
            name=f"kv-heartbeat-{self.job.room}-r{self.rank}",
            daemon=True,
        )
        self._heartbeat.start()

    def _heartbeat_loop(self, interval: float) -> None:
        """A heartbeat every `interval` until stopped, on a fixed schedule.

        Each beat is its own asynchronous call, its reply handled by `_beat_done`: this
        thread waits neither for replies nor for anything of the data plane (reads,
        compiles and writes run on other threads, and the only lock it shares with them
        guards field updates), so neither a slow reply from a busy decode side nor a
        stalled read delays the next beat. (Beats that each waited for the previous
        reply went silent for as long as one reply took: a decode side that answered one
        beat late failed a live rank on its heartbeat timeout.)"""
        control = self._control()
        req = pb.HeartbeatRequest(room=self.job.room, sender_rank=self.rank)
        timeout = max(interval, self.config.heartbeat_timeout_s / 2)
        due = time.monotonic() + interval
        while not self._stop_heartbeat.wait(max(0.0, due - time.monotonic())):
            now = time.monotonic()
            # After a late wake-up (a starved process), one beat now, not one per slot missed.
            due = due + interval if due + interval > now else now + interval
            st = self._status
            if self._killed.is_set() or self._lost or (st is not None and st.state.terminal):
                break
            with self._lock:  # only this thread adds beats: the count cannot grow meanwhile
                full = len(self._beats) >= MAX_BEATS_IN_FLIGHT
            if full:
                continue
            beat = control.Heartbeat.future(req, timeout=timeout)
            with self._lock:
                self._beats.add(beat)
            beat.add_done_callback(self._beat_done)  # at once if it is done already
        with self._lock:  # killed, stopped or finished: no reply matters any more
            beats, self._beats = list(self._beats), set()
        for beat in beats:
            beat.cancel()

    def _beat_done(self, beat: grpc.Future) -> None:
        """A heartbeat's reply (on a gRPC thread: must not block)."""
        with self._lock:
            self._beats.discard(beat)
        if beat.cancelled() or self._killed.is_set() or self._stop_heartbeat.is_set():
            return
        e = beat.exception()
        if e is None:
            self._last_beat_ok = time.monotonic()
            self.observe(snapshot_from_pb(beat.result()))
            return
        code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.UNKNOWN
        details = e.details() if isinstance(e, grpc.RpcError) else str(e)
        silent, limit = time.monotonic() - self._last_beat_ok, self.config.heartbeat_timeout_s
        if code is grpc.StatusCode.NOT_FOUND or silent > limit:
            with self._lock:
                self._lost = self._lost or (
                    f"decode side lost: no heartbeat reply for {silent:.1f}s (limit "
                    f"{limit:g}s; last error {code.name}: {details})"
                )
            self._wake.set()

    def _stop_heartbeats(self) -> None:
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join()

    def say_writes_done(self) -> None:
        """A last heartbeat with `writes_done`: this rank writes no more, which ends a
        failed room's quarantine of one-sided writes early (best effort)."""
        if self._killed.is_set() or self._stub is None:
            return
        try:
            self._stub.Heartbeat(
                pb.HeartbeatRequest(room=self.job.room, sender_rank=self.rank, writes_done=True),
                timeout=min(self.config.rpc_timeout_s, 2.0),
            )
        except grpc.RpcError as e:
            logger.info(
                "room %s: rank %d final heartbeat not delivered: %s",
                self.job.room,
                self.rank,
                e.code().name,
            )

    # ---- state --------------------------------------------------------------------------------
    def _control(self) -> pb_grpc.KVTransferStub:
        if self._stub is None:
            raise RuntimeError("the sender session has no control stub (data plane not open)")
        return self._stub

    def observe(self, status: RoomSnapshot) -> None:
        """The decode side's view of the room, from any reply."""
        with self._lock:
            if self._status is None or not self._status.state.terminal:
                self._status = status
        if status.state is RoomState.FAILED:
            self.hold.cancel(status.reason)
        if status.state.terminal:
            self._wake.set()

    def must_stop(self) -> bool:
        """Whether `check` would stop the rank (no RPC: safe inside a request stream)."""
        st = self._status
        return bool(
            self._killed.is_set()
            or self._lost
            or self.hold.cancelled
            or (st is not None and st.state.terminal)
        )

    def check(self) -> None:
        """Raise `SenderKilled` / `RankDone` when the rank must stop, else return."""
        if self._killed.is_set():
            raise SenderKilled
        st = self._status
        if st is not None and st.state.terminal:
            raise RankDone(st)
        if self._lost:
            self.fail(self._lost)
        if self.hold.cancelled:
            st = self._query_status()
            if st is not None and st.state.terminal:
                raise RankDone(st)
            # Not this rank's failure (often a client that left): one warning is enough.
            self.fail(
                f"another rank of the request failed: {self.hold.cancel_reason}",
                level=logging.INFO,
            )

    def _query_status(self) -> RoomSnapshot | None:
        if self._stub is None:
            return None
        try:
            reply = self._stub.GetRoom(
                pb.RoomRef(room=self.job.room), timeout=min(self.config.rpc_timeout_s, 2.0)
            )
        except grpc.RpcError:
            return None
        status = snapshot_from_pb(reply)
        self.observe(status)
        return status

    def finish_with_status(self, fallback: str) -> None:
        """The decode side refused us for good: finish with its status (or `fallback`)."""
        self.check()
        st = self._query_status()
        if st is not None and st.state.terminal:
            raise RankDone(st)
        self.fail(fallback)

    def fail(self, reason: str, *, level: int = logging.WARNING) -> None:
        """Fail the room from this side: abort it on the decode side (best effort),
        cancel the request's other ranks, finish with the decode side's status when it
        has one, else with `reason`. Always raises (`RankDone`, or `SenderKilled`)."""
        if self._killed.is_set():
            raise SenderKilled
        reason = f"prefill rank {self.rank}: {reason}"
        self.hold.cancel(reason)
        outcome = RoomSnapshot(self.job.room, RoomState.FAILED, reason)
        if not self._lost and self._stub is not None:
            try:
                reply = self._stub.Abort(
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
        logger.log(level, "room %s: rank %d failed: %s", self.job.room, self.rank, outcome.reason)
        raise RankDone(outcome)

    def _backoff(self, seconds: float) -> None:
        """Wait `seconds` unless woken (kill, cancel); `check()` then says what to do."""
        self._wake.wait(seconds)
        self._wake.clear()

    def sleep(self, seconds: float) -> None:
        """Back off `seconds`; raises `SenderKilled` at once when killed meanwhile."""
        if self._killed.wait(seconds):
            raise SenderKilled
