"""The prefill side's hold on a request's pages while its room is in flight.

`TransferHold`: the request's prefill pages are held for the whole transfer (a retry
re-reads them) and released exactly once, when every rank's sender has stopped and the
room's outcome is known - Success or Failed, including "the decode side is gone". A
hold made by `transfer.sender.bootstrap_request` also hands the request's
`RequestInputs` (page table, aux data) to senders that started before its prefill ran.
`RunningSenders`: a backend's rank senders in flight, by (room, rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np

from transfer.protocol import Aux, RoomSnapshot, RoomState

if TYPE_CHECKING:  # sender.py imports this module
    from transfer.sender import RankJob

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class RequestInputs:
    """What a request's prefill produces for its transfer: the page table and rank 0's
    aux data. `bootstrap_request`'s senders wait for them (`TransferHold.provide`)."""

    src_local_pages: np.ndarray  # the request's `RequestPageTable.local_pages()`, [n_pages]
    aux: Aux | None  # first output token and its log-prob; rank 0 commits it (needed there)

    def __post_init__(self) -> None:
        pages = np.asarray(self.src_local_pages)
        if pages.ndim != 1 or not np.issubdtype(pages.dtype, np.integer):
            raise ValueError(
                f"src_local_pages must be a 1-D integer array, got {pages.shape} {pages.dtype}"
            )
        object.__setattr__(self, "src_local_pages", pages)


class TransferHold:
    """The prefill side's hold on one request's pages while its room is in flight.

    Each rank's sender calls `finish(rank, outcome)` once it has stopped touching the
    pages; `outcome` is the room's final status as that rank learned it, or None when
    the sender died without learning it. After the last rank, `release(outcome)` runs
    exactly once with the room's outcome: Success if any rank saw Success (the decode
    side only succeeds a room when every rank committed), else Failed with the first
    reason. `cancel` lets one rank that saw the room fail stop the others early.

    A hold made by `bootstrap_request` starts without the request's `RequestInputs`:
    its senders handshake, say they are ready (`mark_ready`; `wait_ready` waits for all)
    and wait until `provide` hands the inputs over, or the hold is cancelled.

    Registration: the lowest rank (`prober`) handshakes first; once the decode side
    accepted it (`note_registered`, the room is registered there) the other ranks
    handshake. `park()` asks the prober to stop instead of asking again while the room
    is still unregistered: the prober alone decides (`settle_park`, before each of its
    handshake attempts), so a park never races an accepted handshake. A parked hold's
    ranks finish with no outcome and nothing is sent to the decode side (no abort): the
    room stays where it is, and a later `bootstrap_request` for it starts over.
    """

    def __init__(
        self,
        room: str,
        ranks: Sequence[int],
        release: Callable[[RoomSnapshot], None],
        inputs: RequestInputs | None = None,
        on_ready: Callable[[], None] | None = None,
    ):
        if not ranks:
            raise ValueError(f"room {room!r}: a hold needs at least one rank")
        self.room = room
        self._ranks = frozenset(ranks)
        self._pending = set(ranks)
        self._outcomes: dict[int, RoomSnapshot | None] = {}
        self._release = release
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._cancelled = threading.Event()
        self._cancel_reason = ""
        self._outcome: RoomSnapshot | None = None
        self._inputs = inputs
        self._wakers: list[threading.Event] = []  # senders waiting for inputs or a cancel
        self._ready: set[int] = set()
        self._all_ready = threading.Event()
        self._on_ready = on_ready
        self.prober = min(ranks)
        self._registered = threading.Event()
        self._park_requested = threading.Event()
        self._parked = threading.Event()

    # ---- inputs (bootstrap ahead) ---------------------------------------------------------
    @property
    def inputs(self) -> RequestInputs | None:
        """The request's inputs once provided (at once for `send_request`), else None."""
        return self._inputs

    def provide(self, src_local_pages: np.ndarray, aux: Aux | None) -> bool:
        """Hand the prefill's page table and aux data to the waiting senders. Returns
        False (nothing sent) when the hold is already released - the room failed while
        the prefill ran; its outcome says why. Providing twice is a bug (ValueError).
        `aux` may be None only where this process runs no rank 0."""
        inputs = RequestInputs(src_local_pages, aux)
        with self._lock:
            if self._inputs is not None:
                raise ValueError(f"room {self.room!r}: the request's inputs were provided twice")
            if self._done.is_set():
                return False
            self._inputs = inputs
            self._wake_all()
        return True

    def _wake_all(self) -> None:
        """Set every waiting sender's event (lock held; `Event.set` never blocks)."""
        for w in self._wakers:
            w.set()

    def add_waker(self, event: threading.Event) -> None:
        """`event` is set on `provide` and `cancel` (a sender waiting for its inputs)."""
        with self._lock:
            self._wakers.append(event)
            now = (
                self._inputs is not None
                or self._cancelled.is_set()
                or self._registered.is_set()
                or self._parked.is_set()
            )
        if now:
            event.set()

    # ---- registration and parking ----------------------------------------------------------
    @property
    def registered(self) -> bool:
        """The prober's handshake was accepted: the decode side holds the room's pages."""
        return self._registered.is_set()

    def note_registered(self) -> None:
        """The prober's handshake was accepted: the other ranks may handshake."""
        with self._lock:
            self._registered.set()
            self._wake_all()

    def park(self) -> None:
        """Ask the prober to give up if the room is still unregistered (see the class
        docstring); an accepted handshake wins and the hold goes on as if not asked."""
        with self._lock:
            self._park_requested.set()
            self._wake_all()

    @property
    def park_requested(self) -> bool:
        return self._park_requested.is_set()

    def settle_park(self) -> bool:
        """The prober, before a handshake attempt: True (the hold is now parked, the
        other ranks are woken to stop) when a park was asked and the room is not
        registered."""
        with self._lock:
            if self._park_requested.is_set() and not self._registered.is_set():
                self._parked.set()
                self._wake_all()
            return self._parked.is_set()

    @property
    def parked(self) -> bool:
        """The prober stopped at a park: the room was never registered by these senders."""
        return self._parked.is_set()

    def mark_ready(self, rank: int) -> None:
        """Rank `rank` handshook and is heartbeating: it can send once it has inputs.
        After the last rank, `on_ready` runs (on this sender's thread; it must not block)."""
        with self._lock:
            self._ready.add(rank)
            now_all = self._ready >= self._ranks and not self._all_ready.is_set()
            if now_all:
                self._all_ready.set()
        if now_all and self._on_ready is not None:
            try:
                self._on_ready()
            except Exception:
                logger.exception("room %s: the on_ready callback failed", self.room)

    @property
    def ready(self) -> bool:
        """Every rank handshook: the decode side holds the room's pages (non-blocking)."""
        return self._all_ready.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every rank is ready, or the hold is released (then False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._all_ready.is_set():
            if self._done.is_set():
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._all_ready.wait(0.01 if left is None else min(left, 0.01))
        return True

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def cancel_reason(self) -> str:
        return self._cancel_reason

    def cancel(self, reason: str = "") -> None:
        """The room failed (as one rank learned): the other ranks should stop early."""
        with self._lock:
            if not self._cancel_reason:
                self._cancel_reason = reason
            self._cancelled.set()
            self._wake_all()

    @property
    def released(self) -> bool:
        return self._done.is_set()

    @property
    def outcome(self) -> RoomSnapshot | None:
        """The aggregate outcome once released, else None."""
        return self._outcome

    def outcomes(self) -> dict[int, RoomSnapshot | None]:
        with self._lock:
            return dict(self._outcomes)

    def finish(self, rank: int, outcome: RoomSnapshot | None) -> None:
        with self._lock:
            if rank not in self._pending:
                raise ValueError(f"room {self.room!r}: rank {rank} finished twice or is unknown")
            self._pending.discard(rank)
            self._outcomes[rank] = outcome
            if rank == self.prober and not self._registered.is_set() and not self._parked.is_set():
                # The prober stopped before the room registered (refused, failed, killed):
                # the ranks waiting for its handshake must not wait forever.
                self._cancel_reason = self._cancel_reason or (
                    f"prefill rank {rank} stopped before its handshake was accepted"
                )
                self._cancelled.set()
                self._wake_all()
            if outcome is not None and outcome.state is RoomState.FAILED:
                self._cancel_reason = self._cancel_reason or outcome.reason
                self._cancelled.set()
                self._wake_all()
            if self._pending:
                return
            self._outcome = self._aggregate()
        logger.debug("room %s: releasing prefill pages (%s)", self.room, self._outcome.state.label)
        try:
            self._release(self._outcome)
        except Exception:  # the hold is over either way; a release bug must be seen
            logger.exception("room %s: releasing the prefill pages failed", self.room)
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> RoomSnapshot | None:
        """Block until released (or `timeout`); returns the aggregate outcome."""
        self._done.wait(timeout)
        return self._outcome

    def _aggregate(self) -> RoomSnapshot:
        if self._parked.is_set():
            return RoomSnapshot(
                room=self.room,
                state=RoomState.BOOTSTRAPPING,
                reason="parked: the room was not registered yet; nothing was sent",
            )
        known = [o for o in self._outcomes.values() if o is not None]
        for o in known:
            if o.state is RoomState.SUCCESS:
                return o
        for o in known:
            if o.state is RoomState.FAILED:
                return o
        silent = sorted(r for r, o in self._outcomes.items() if o is None)
        return RoomSnapshot(
            room=self.room,
            state=RoomState.FAILED,
            reason=f"prefill rank(s) {silent} stopped without learning the room's outcome",
        )


S = TypeVar("S")


class RunningSenders(Generic[S]):
    """The rank senders a backend is running, by (room, rank), e.g. for tests to `kill()`."""

    def __init__(self) -> None:
        self._senders: dict[tuple[str, int], S] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def running(self, job: RankJob, sender: S) -> Iterator[S]:
        with self._lock:
            self._senders[(job.room, job.rank)] = sender
        try:
            yield sender
        finally:
            with self._lock:
                self._senders.pop((job.room, job.rank), None)

    def get(self, room: str, rank: int) -> S | None:
        with self._lock:
            return self._senders.get((room, rank))
