"""Prefill side of the PD transfer: the backend interface, page sources, the page hold.

One request is sent by its `cp_size` prefill ranks, each running one `RankJob` on a
`TransferBackend`: handshake (layout checked before any data moves) -> plan its owned
pages against the decode page table (`transfer.page_plan.plan_rank`) -> send them
tagged with their logical positions -> commit (rank 0 adds the aux data) -> heartbeat
until the decode side reports the room finished.

**Bootstrap ahead** (`bootstrap_request`): a prefill server starts a request's senders
when it admits the request, before its prefill has run - the request's page table and
first token do not exist yet. Each rank handshakes (and, on the Mooncake data plane,
gets its staging region), starts heartbeating and then waits; the prefill provides
the `RequestInputs` (`TransferHold.provide`) when it is done, and only the plan, the
data, the commit and the outcome remain on the request's time to first token. A room
the decode side refuses, or a decode side that is gone, fails the request before its
prefill runs. This is SGLang's bootstrap-then-send shape (`KVSender.init` at request
arrival, `send` after the forward pass). `send_request` does both at once.

The request's prefill pages are held for the whole transfer (a retry re-reads them) and
released exactly once, when every rank's sender has stopped and the room's outcome is
known - Success or Failed, including "the decode side is gone" - by `TransferHold`.

A backend declares `BackendCapabilities` (`transfer.capabilities`); CP shared-KV prefill
needs owner filtering and position-addressed destinations (SPEC S2.3), which
`serving.server_args` checks at startup through a `TransferBackendRegistry`.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from cpkv_jax.buckets import pow2_at_least
from cpkv_jax.model.kv_cache import KVPool
from transfer.capabilities import BackendCapabilities
from transfer.page_plan import BufferKind, LayoutDescriptor, row_digests
from transfer.protocol import Aux, RoomSnapshot, RoomState

logger = logging.getLogger(__name__)


@runtime_checkable
class PageSource(Protocol):
    """Reads one prefill rank's pages of one (kind, layer) pool leaf to host memory."""

    def read(self, kind: BufferKind, layer: int, src_pages: np.ndarray) -> np.ndarray:
        """Host copy `[len(src_pages), page_size, ...]` of the rank's local pages."""
        ...


@jax.jit
def _gather_rows(leaves: tuple[jax.Array, ...], idx: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(jnp.take(leaf, idx, axis=0) for leaf in leaves)


# A read gathers the pages of several buffers in one dispatch, up to this many bytes.
READ_GROUP_BYTES = 256 << 20
# Page sets whose gathered rows a source keeps for later reads (oldest dropped first).
MAX_PENDING_READS = 16


class CPPoolPageSource:
    """`PageSource` over a CP pool (`CPPrefillRunner.pool`) for rank `rank`.

    Pool leaves are global arrays `[cp * pages_per_rank, P, ...]` sharded `P("cp")` on
    the page axis, so the rank's pages are its addressable shard, indexed by rank-local
    page ids. The owned pages are gathered on the rank's device (index padded to a power
    of two with the trash page, bounding compiles) and copied to host.

    `pool` may be a callable returning the current pool, since a runner replaces its
    pool (donation) on every step. Then pass the lock the runner swaps the pool under
    (`CPPrefillRunner.pool_lock`) as `lock`: a read looks the pool up, dispatches its
    gather and waits for it to run under the lock, so a step never donates a pool that
    a read still reads (whatever the runtime does with pending reads of a donated
    buffer); the gather's result is a new array, copied to host outside the lock. A
    step waits at most for one gather; a read waits at most for the step already on
    the device. The pages themselves must not change meanwhile: the caller holds them
    (`TransferHold`).

    A gather dispatched while the engine runs steps executes after the steps already
    queued on the device, so each dispatch may wait for one step. Hence one read
    gathers the same pages of a run of buffers that fits in `group_bytes` (every
    buffer, for all but very long requests) in one dispatch and keeps the run's other
    rows until each is read once (a sender reads every buffer of its plan's pages); a
    later read of the same pages and buffer (a retry) gathers again. Rows of at most
    `MAX_PENDING_READS` page sets are kept (a sender that stopped early leaves some).
    """

    def __init__(
        self,
        pool: KVPool | Callable[[], KVPool],
        layout: LayoutDescriptor,
        rank: int,
        lock: threading.Lock | None = None,
        *,
        group_bytes: int = READ_GROUP_BYTES,
    ):
        self._pool = pool
        self.layout = layout
        self.rank = rank
        self._lock = lock
        self.group_bytes = group_bytes
        self._buffers = layout.buffers()
        # pages -> buffer -> host rows gathered with another buffer, not read yet.
        self._pending: collections.OrderedDict[bytes, dict[tuple[BufferKind, int], np.ndarray]] = (
            collections.OrderedDict()
        )
        self._pending_lock = threading.Lock()
        self.dispatches = 0  # gathers dispatched (tests check one per read of all buffers)

    def read(self, kind: BufferKind, layer: int, src_pages: np.ndarray) -> np.ndarray:
        pages = np.ascontiguousarray(src_pages, dtype=np.int32)
        key, buffer = pages.tobytes(), (kind, layer)
        with self._pending_lock:
            rows = self._pending.get(key, {}).pop(buffer, None)
        if rows is not None:
            return rows
        k = len(pages)
        padded = pow2_at_least(k)
        idx = np.zeros(padded, np.int32)  # padding reads the trash page
        idx[:k] = pages
        group = next(g for g in self._groups(padded) if buffer in g)
        with self._lock if self._lock is not None else contextlib.nullcontext():
            pool = self._pool() if callable(self._pool) else self._pool
            leaves = tuple(
                self._shard(getattr(pool, b[0])[self.layout.leaf_index(*b)]) for b in group
            )
            # Held until the gather ran: a step never donates a pool a read still reads.
            gathered = jax.block_until_ready(_gather_rows(leaves, idx))
            self.dispatches += 1
        host = {b: np.asarray(x)[:k] for b, x in zip(group, jax.device_get(gathered), strict=True)}
        rows = host.pop(buffer)
        with self._pending_lock:
            self._pending.setdefault(key, {}).update(host)
            self._pending.move_to_end(key)
            while len(self._pending) > MAX_PENDING_READS:  # a sender that stopped early
                self._pending.popitem(last=False)
            if not self._pending[key]:
                del self._pending[key]
        return rows

    def _groups(self, rows: int) -> list[tuple[tuple[BufferKind, int], ...]]:
        """The buffers in layout order, cut into runs whose `rows` rows fit `group_bytes`
        (a run of one buffer if that alone is larger): one gather each. Fixed for a row
        count, so the compiles stay one per run and power-of-two row count."""
        groups: list[tuple[tuple[BufferKind, int], ...]] = []
        run: list[tuple[BufferKind, int]] = []
        total = 0
        for b in self._buffers:
            nbytes = rows * self.layout.page_bytes(*b)
            if run and total + nbytes > self.group_bytes:
                groups.append(tuple(run))
                run, total = [], 0
            run.append(b)
            total += nbytes
        groups.append(tuple(run))
        return groups

    def _shard(self, leaf: jax.Array) -> jax.Array:
        for s in leaf.addressable_shards:
            rows = s.data.shape[0]
            if rows == leaf.shape[0]:  # replicated pool: every copy holds everything
                return s.data
            if (s.index[0].start or 0) == self.rank * rows:
                return s.data
        raise ValueError(
            f"rank {self.rank}'s shard of a {leaf.shape} pool leaf is not addressable in this "
            "process; run the rank's sender on the host that holds it"
        )


@runtime_checkable
class SealedPageSource(Protocol):
    """A `PageSource` that keeps the digests of pages it holds unchanged ("sealed").

    `sealed_digests(kind, layer, src_pages)` is the xxh3 digest (`page_plan.row_digests`)
    of each page taken when it was sealed, `[len(src_pages)]` uint64, or None when any
    of those pages is not sealed. Senders send these instead of hashing the pages again
    at send time; the decode side still hashes every page on arrival, so a page that
    changed after its seal fails its room with a digest mismatch - never silently."""

    def read(self, kind: BufferKind, layer: int, src_pages: np.ndarray) -> np.ndarray: ...

    def sealed_digests(
        self, kind: BufferKind, layer: int, src_pages: np.ndarray
    ) -> np.ndarray | None: ...


def sealed_digests(
    source: PageSource, kind: BufferKind, layer: int, src_pages: np.ndarray
) -> np.ndarray | None:
    """The source's sealed digests of `src_pages` (`SealedPageSource`), else None: the
    sender hashes the bytes it sends."""
    if isinstance(source, SealedPageSource):
        return source.sealed_digests(kind, layer, src_pages)
    return None


class HostPoolPageSource:
    """`PageSource` over one rank's pool held in host memory: per (kind, layer) buffer a
    C-contiguous array `[pages, ...]` indexed by the rank's local page id.

    `read` gathers pages (a copy, as every `PageSource`; `read_into` into a given
    buffer); `host_buffer` returns the leaf itself, which the Mooncake backend registers
    once and writes from without a copy (`mooncake_backend.HostPageSource`). Used by
    `benchmarks.bench_transfer`.

    **Sealed pages** (`SealedPageSource`): a host pool's pages are written once and then
    sent, possibly many times (a host cache keeps a prefix for every request that reuses
    it). `seal(pages)` takes their digests once, after they are written - where the
    writer's bytes are still warm - and every later transfer sends those digests instead
    of hashing the pages again on its critical path: stored checksums, as block stores
    keep them. The decode side checks every page on arrival either way, so the digests
    now also cover the time the page spent in the pool. Contract: `unseal(pages)` before
    rewriting sealed pages (then `seal` them again); a page rewritten while sealed fails
    the transfers that send it with a digest mismatch (SPEC S2.4), it is never sent as
    good. Pages not sealed are hashed at send time, as for every other source."""

    def __init__(self, layout: LayoutDescriptor, leaves: dict[tuple[BufferKind, int], np.ndarray]):
        missing = [b for b in layout.buffers() if b not in leaves]
        if missing:
            raise ValueError(f"host pool lacks buffers {missing}")
        for (kind, layer), leaf in leaves.items():
            nb = layout.page_bytes(kind, layer)
            if not leaf.flags.c_contiguous or leaf.nbytes != leaf.shape[0] * nb:
                raise ValueError(
                    f"{kind} layer {layer}: {leaf.shape} {leaf.dtype} is not a C-contiguous "
                    f"pool leaf of {nb} B pages"
                )
        self.layout = layout
        self._leaves = dict(leaves)
        self._seal_lock = threading.Lock()
        self._digests = {b: np.zeros(leaf.shape[0], np.uint64) for b, leaf in leaves.items()}
        self._sealed = {b: np.zeros(leaf.shape[0], bool) for b, leaf in leaves.items()}

    def read(self, kind: BufferKind, layer: int, src_pages: np.ndarray) -> np.ndarray:
        return self._leaves[(kind, layer)][np.asarray(src_pages, np.int64)]

    def _pages(self, src_pages: np.ndarray | Sequence[int] | None) -> np.ndarray:
        n = min(leaf.shape[0] for leaf in self._leaves.values())
        if src_pages is None:
            return np.arange(n, dtype=np.int64)
        pages = np.asarray(src_pages, np.int64).reshape(-1)
        if pages.size and (pages.min() < 0 or pages.max() >= n):
            raise ValueError(f"pages {pages.min()}..{pages.max()} outside the pool [0, {n})")
        return pages

    def seal(self, src_pages: np.ndarray | Sequence[int] | None = None) -> None:
        """Take the digests of `src_pages` (default: every page) in every buffer, now that
        they are written; transfers send them from now on (see the class docstring)."""
        pages = self._pages(src_pages)
        for key, leaf in self._leaves.items():
            flat = leaf.reshape(leaf.shape[0], -1).view(np.uint8)
            digests = row_digests(flat, pages)
            with self._seal_lock:
                self._digests[key][pages] = digests
                self._sealed[key][pages] = True

    def unseal(self, src_pages: np.ndarray | Sequence[int] | None = None) -> None:
        """Forget the digests of `src_pages` (default: every page) before rewriting them."""
        pages = self._pages(src_pages)
        with self._seal_lock:
            for sealed in self._sealed.values():
                sealed[pages] = False

    def sealed_digests(
        self, kind: BufferKind, layer: int, src_pages: np.ndarray
    ) -> np.ndarray | None:
        """The sealed digests of `src_pages` in buffer (kind, layer), None unless every
        one of them is sealed."""
        pages = np.asarray(src_pages, np.int64)
        with self._seal_lock:
            if not self._sealed[(kind, layer)][pages].all():
                return None
            return self._digests[(kind, layer)][pages]

    def host_buffer(self, kind: BufferKind, layer: int) -> np.ndarray:
        return self._leaves[(kind, layer)]

    def read_into(
        self, kind: BufferKind, layer: int, src_pages: np.ndarray, out: np.ndarray
    ) -> None:
        """`read` straight into `out` (uint8 `[len(src_pages), page_bytes]`): one copy."""
        leaf = self._leaves[(kind, layer)]
        flat = leaf.reshape(leaf.shape[0], -1).view(np.uint8)
        np.take(flat, np.asarray(src_pages, np.int64), axis=0, out=out)


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
            now = self._inputs is not None or self._cancelled.is_set()
        if now:
            event.set()

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

    for job in jobs:
        threading.Thread(
            target=run, args=(job,), name=f"kv-send-{job.room}-r{job.rank}", daemon=True
        ).start()
    return hold
