"""Prefill side of the PD transfer: the backend interface and a request's rank jobs.

One request is sent by its `cp_size` prefill ranks, each running one `RankJob` on a
`TransferBackend`: handshake (layout checked before any data moves) -> plan its owned
pages against the decode page table (`transfer.page_plan.plan_rank`) -> send them
tagged with their logical positions -> commit (rank 0 adds the aux data) -> heartbeat
until the decode side reports the room finished.

**Bootstrap ahead** (`bootstrap_request`): a prefill server starts a request's senders
while the request waits, before its prefill has run - the request's page table and
first token do not exist yet (`serving.prefill.engine` does so for a bounded window of
its queue, so the threads do not grow with the queue). Each rank handshakes (and, on
the Mooncake data plane, gets its staging region; a room the decode side has not
registered yet is waited for, `transfer.session`), starts heartbeating and then waits;
the prefill provides the `RequestInputs` (`TransferHold.provide`) when it is done, and
only the plan, the data, the commit and the outcome remain on the request's time to
first token. A room the decode side refuses, or a decode side that is gone, fails the
request before its prefill runs. This is SGLang's bootstrap-then-send shape
(`KVSender.init` at request arrival, `send` after the forward pass). `send_request`
does both at once.

The request's prefill pages are held for the whole transfer (a retry re-reads them) and
released exactly once, when every rank's sender has stopped and the room's outcome is
known - Success or Failed, including "the decode side is gone" - by `TransferHold`
(`transfer.hold`). Ranks read their pages from a `PageSource` (`transfer.page_source`);
both backends' rank senders run their control plane (handshake, heartbeats, commit,
outcome, abort) through one `transfer.session.SenderSession`.

A backend declares `BackendCapabilities` (`transfer.capabilities`); CP shared-KV prefill
needs owner filtering and position-addressed destinations (SPEC S2.3), which
`serving.server_args` checks at startup through a `TransferBackendRegistry`.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from transfer.capabilities import BackendCapabilities
from transfer.hold import RequestInputs, TransferHold
from transfer.page_plan import LayoutDescriptor
from transfer.page_source import PageSource
from transfer.protocol import Aux, RoomSnapshot, RoomState

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class RankJob:
    """What one prefill CP rank sends for one room. `src_local_pages` (and rank 0's
    `aux`) are None for a job started by `bootstrap_request` until the hold's inputs
    are provided (`with_inputs`)."""

    room: str
    target: str  # the decode receiver, "host:port"
    rank: int
    cp_size: int
    num_tokens: int
    layout: LayoutDescriptor
    src_local_pages: np.ndarray | None  # the request's `RequestPageTable.local_pages()`
    source: PageSource
    aux: Aux | None = None  # rank 0 only: first output token and its log-prob
    attempt: int = 0  # the sender's incarnation; retries of a write reuse it

    @property
    def has_inputs(self) -> bool:
        return self.src_local_pages is not None

    def with_inputs(self, inputs: RequestInputs) -> RankJob:
        """This job with the request's page table and (rank 0) aux data."""
        if self.rank == 0 and inputs.aux is None:
            raise ValueError(f"room {self.room!r}: rank 0 needs the aux data (first token)")
        return dataclasses.replace(
            self,
            src_local_pages=inputs.src_local_pages,
            aux=inputs.aux if self.rank == 0 else None,
        )


def rank_jobs(
    room: str,
    target: str,
    layout: LayoutDescriptor,
    num_tokens: int,
    src_local_pages: np.ndarray | None,
    sources: Sequence[PageSource],
    aux: Aux | None,
    attempt: int = 0,
) -> list[RankJob]:
    """One `RankJob` per rank (`len(sources)` ranks); rank 0 carries `aux`. Without
    `src_local_pages` and `aux` (both None) the jobs are for `bootstrap_request`."""
    if (src_local_pages is None) != (aux is None):
        raise ValueError(
            "rank_jobs: give both src_local_pages and aux (send now) or neither (bootstrap "
            "ahead, provide them later)"
        )
    inputs = None if aux is None else RequestInputs(src_local_pages, aux)
    jobs = [
        RankJob(
            room=room,
            target=target,
            rank=r,
            cp_size=len(sources),
            num_tokens=num_tokens,
            layout=layout,
            src_local_pages=None,
            source=source,
            attempt=attempt,
        )
        for r, source in enumerate(sources)
    ]
    return jobs if inputs is None else [j.with_inputs(inputs) for j in jobs]


class TransferBackend(abc.ABC):
    """A way to move one rank's owned pages to the decode side.

    `capabilities` is what startup checks (SPEC S2.3). `send_rank` runs one rank's whole
    transfer and blocks until the room is finished as far as this rank can tell; it
    returns the room's final status, or None when the sender was killed. It must not
    call `hold.finish` (`send_request` does), and should `hold.cancel(reason)` when it learns
    the room failed.
    """

    capabilities: ClassVar[BackendCapabilities]

    @abc.abstractmethod
    def send_rank(self, job: RankJob, hold: TransferHold) -> RoomSnapshot | None: ...

    def prepare(self) -> None:
        """Set up what the first transfer would otherwise set up on its critical path
        (a server calls this at startup). Nothing by default."""
        return None


def send_request(
    backend: TransferBackend,
    jobs: Sequence[RankJob],
    release: Callable[[RoomSnapshot], None],
) -> TransferHold:
    """Start one thread per rank job (each with its inputs); returns the hold, released
    after the last rank.

    In a multi-process deployment each process runs the jobs of its own ranks; the
    decode side's exact-coverage commit ties them together.
    """
    return _start(backend, jobs, release, bootstrap=False)


def bootstrap_request(
    backend: TransferBackend,
    jobs: Sequence[RankJob],
    release: Callable[[RoomSnapshot], None],
    on_ready: Callable[[], None] | None = None,
) -> TransferHold:
    """Start one thread per rank job before the request's prefill has run (jobs without
    inputs, `rank_jobs(..., None, sources, None)`): each rank handshakes, heartbeats and
    waits for `TransferHold.provide`; see the module docstring. `on_ready` runs once
    every rank's handshake was accepted (`TransferHold.ready`)."""
    return _start(backend, jobs, release, bootstrap=True, on_ready=on_ready)


_WRONG_ENTRY = {
    False: "send_request: rank job(s) {} have no page table; use bootstrap_request and "
    "provide the inputs later",
    True: "bootstrap_request: rank job(s) {} already have a page table; the inputs come "
    "through TransferHold.provide (or use send_request)",
}


def _start(
    backend: TransferBackend,
    jobs: Sequence[RankJob],
    release: Callable[[RoomSnapshot], None],
    bootstrap: bool,
    on_ready: Callable[[], None] | None = None,
) -> TransferHold:
    wrong = [j.rank for j in jobs if j.has_inputs == bootstrap]
    if wrong:
        raise ValueError(_WRONG_ENTRY[bootstrap].format(wrong))
    if not jobs:
        raise ValueError("a request needs at least one rank job")
    rooms = {j.room for j in jobs}
    if len(rooms) != 1:
        raise ValueError(f"rank jobs of one request must share a room, got {sorted(rooms)}")
    job0 = jobs[0]
    inputs = None
    if not bootstrap:  # the jobs carry them; the hold records them too
        assert job0.src_local_pages is not None
        aux = next((j.aux for j in jobs if j.rank == 0), None)
        inputs = RequestInputs(job0.src_local_pages, aux)
    hold = TransferHold(job0.room, [j.rank for j in jobs], release, inputs, on_ready)

    def run(job: RankJob) -> None:
        outcome: RoomSnapshot | None
        try:
            outcome = backend.send_rank(job, hold)
        except Exception as e:
            logger.exception("room %s: rank %d sender crashed", job.room, job.rank)
            outcome = RoomSnapshot(
                job.room, RoomState.FAILED, f"prefill rank {job.rank} sender crashed: {e}"
            )
            hold.cancel(outcome.reason)
        hold.finish(job.rank, outcome)

    for i, job in enumerate(jobs):
        try:
            threading.Thread(
                target=run, args=(job,), name=f"kv-send-{job.room}-r{job.rank}", daemon=True
            ).start()
        except RuntimeError as e:  # "can't start new thread": as if these ranks crashed
            logger.error("room %s: starting the rank %d sender failed: %s", job.room, job.rank, e)
            reason = f"prefill rank {job.rank} sender could not start: {e}"
            hold.cancel(reason)  # the ranks already started stop and abort the room
            for late in jobs[i:]:
                hold.finish(late.rank, RoomSnapshot(late.room, RoomState.FAILED, reason))
            break
    return hold
