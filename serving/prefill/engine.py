"""The PD prefill-mode engine: CP shared-KV prefill whose KV goes to a decode server.

`PrefillModeEngine` is the `StepEngine` (`serving.engine_api`) of a server started with
`--disaggregation-mode prefill`. Each request names its decode side: the transfer room
the decode server registered (`GenerateRequest.bootstrap_room`) and that server's
transfer receiver (`decode_transfer_target`, "host:port"). A request's life here:

1. `add`: validated and put in the bounded wait queue (`serving.wait_queue`; a full
   queue refuses with `QueueFullError`, HTTP 503 + Retry-After; nothing allocated). Its
   transfer is bootstrapped (`transfer.sender.bootstrap_request`) once it is among the
   **bootstrap window**: the first `bootstrap_window` requests of the queue, in arrival
   order, run senders (at once in `add` when there is room, else by a later `step` as
   earlier ones start their prefill or leave); the rest wait with no threads, so the
   sender threads (one per CP rank, plus one heartbeat thread each after its
   handshake) are bounded by the window and the transfers in flight, not by the queue.
   The window is `2 x` the scheduler's batch-row bound within
   [`MIN_BOOTSTRAP_WINDOW`, `MAX_BOOTSTRAP_WINDOW`] (32 requests): enough ready
   requests to fill two batches. The decode side registers rooms in its own arrival
   order, so a window request whose room is still unregistered after `PARK_AFTER_S`
   gives its slot to a waiting one (its senders stop without aborting the room, and
   start again later; parked requests go round robin): the window always reaches the
   requests whose decode pages are waiting for them.
   A sender handshakes with the decode side (layout, token count, cp size checked; on
   Mooncake the decode side carves the staging region) and heartbeats while the
   request waits and prefills. A decode side that refuses the room, or is unreachable
   for the bootstrap timeout, fails the request before it prefills; one that answers
   that the room is not registered yet (its request waits in the decode server's
   queue) is waited for with no fixed deadline:
   until the request's own timeout (`--request-timeout`, from its arrival) or its
   client leaving (`abort`). Only once **every rank's handshake is accepted** - the
   decode side has registered the room, i.e. holds its pages - is the request
   submitted to the `PrefillScheduler`: a request whose decode side is not ready holds
   no prefill pages (which could otherwise fill the pool with KV nobody can receive,
   and deadlock);
2. a `step` prefills it on the `cp` mesh (with other requests when bs > 1 is on), samples
   its first token from the last position's log-probs, and hands the senders its page
   table and first token (`TransferHold.provide`): each rank sends only the pages it
   owns, tagged with their logical positions (SPEC S2.1-S2.2); rank 0 commits the
   first token and its log-prob as the room's aux data;
3. while the room is in flight the request's pages are held: its whole pages sit in the
   radix cache, locked (other requests may reuse the prefix, nothing may evict it), its
   partial tail page stays allocated to it (`PrefillScheduler(hold_finished=True)`);
4. once every rank's sender stopped and the room's outcome is known (`TransferHold`), a
   later `step` releases the hold - the pages become what a prefill without transfer
   leaves: cached whole pages, evictable, and a freed tail page - and emits the
   request's only chunk: its first token, `finish_reason` "length" when the decode side
   accepted the KV, "error" with the reason when the room failed, "abort" when the
   client cancelled it.

Sender threads never touch the scheduler or the cache: they only signal; every page
release happens on the engine thread, in `step`. A prefill step donates the pool:
senders run their page gathers under `CPPrefillRunner.kv.lock`, which a step holds
only while it swaps the pool, so a read never meets a donated pool; a step waits at
most for one gather, a read at most for the step on the device (`CPPoolPageSource`;
figures in docs/results.md, "Transfer reads beside prefill steps").

The seed rule (`request_seed`) must be the decode server's too: token `i` of a request
is drawn by `cpkv_jax.sampling.sample` with `RowSampling(..., seed=request_seed(req),
step=i)`, so a prefill server sampling token 0 and a decode server sampling the rest give
the stream a unified server would.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from cpkv_jax.aot import CompileJob
from cpkv_jax.buckets import StepShape
from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import ConfigError, InputError
from cpkv_jax.model.kv_cache import DTYPES
from cpkv_jax.model.transformer import CausalLM, log_probs
from cpkv_jax.paging import pages_for_tokens
from cpkv_jax.sampling import RowSampling, TopLogprobs, first_token_penalties, sample
from serving.engine.api import (
    EngineStateLostError,
    EngineStats,
    GenerateRequest,
    OutputChunk,
    ServerMode,
    stop_token_bias,
)
from serving.engine.step_failures import check_pool_after, step_failure
from serving.engine.stopping import request_seed
from serving.engine.wait_queue import WaitQueue
from serving.grammar import GrammarBackend, RowGrammar, row_grammar_for, token_mask
from serving.prefill.build import (
    PrefillEngine,
    build_prefill_engine,
    pool_pages_per_rank,
)
from serving.prefill.scheduler import (
    PrefillOutcome,
    PrefillScheduler,
    PrefillStepError,
    ScoringExecutor,
)
from serving.server_args import ServerArgs
from transfer.backends import make_backend
from transfer.hold import TransferHold
from transfer.page_plan import LayoutDescriptor
from transfer.page_source import CPPoolPageSource
from transfer.protocol import (
    MAX_PROMPT_SCORE_BYTES,
    Aux,
    RoomSnapshot,
    RoomState,
    prompt_score_bytes,
    transfer_scores,
)
from transfer.sender import TransferBackend, bootstrap_request, rank_jobs

logger = logging.getLogger(__name__)

# With nothing to prefill and transfers in flight, `step` waits at most this long for a
# hold to be released (woken at once by a release), so the engine loop does not spin.
DEFAULT_IDLE_WAIT_S = 0.005
# The prefill side declares the decode side lost after this many missed heartbeats.
HEARTBEAT_TIMEOUT_INTERVALS = 3
MIN_HEARTBEAT_TIMEOUT_S = 15.0
# The Mooncake sender's registered host copy buffer is never smaller than this.
MOONCAKE_HOST_BUFFER_MIN_BYTES = 64 << 20
# Requests whose senders run before their prefill starts (`bootstrap_window`): twice the
# scheduler's batch rows, within these bounds (x cp_size sender threads each). With a
# floor of 8 and no parking the PD load test stalled in about 1 of 3 runs (2026-12-04):
# the decode side had given its pages to rooms of requests outside the window while the
# window's requests waited for pages there. Parking (`PARK_AFTER_S`) is the fix.
MIN_BOOTSTRAP_WINDOW = 32
MAX_BOOTSTRAP_WINDOW = 32
# A window request whose decode room is still unregistered after this long gives its slot
# to a request outside the window (`_park_stale`): the decode side registers rooms in its
# own arrival order, which may hold its pages for requests outside our window. Longer
# than one held handshake (`transfer.protocol.HANDSHAKE_HOLD_S`), so it asked at least once.
PARK_AFTER_S = 2.0


def parse_target(target: str) -> tuple[str, int]:
    """`"host:port"` -> (host, port); `InputError` naming the value otherwise."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(
            f"decode_transfer_target must be 'host:port' of the decode server's transfer "
            f"receiver, got {target!r}"
        )
    return host, int(port)


@dataclasses.dataclass
class _Request:
    """One request's state on this server (engine thread only)."""

    req: GenerateRequest
    # bootstrapping: waiting for the decode side (not in the scheduler; `hold` None until
    # it enters the bootstrap window); queued: in the scheduler (waiting or prefilling);
    # transferring: prefilled, its KV in flight.
    state: Literal["bootstrapping", "queued", "transferring"] = "bootstrapping"
    hold: TransferHold | None = None
    first_token: int = -1
    logprob: float = 0.0
    top: TopLogprobs = ()  # the first token's alternatives, when the request asked
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of `cached_tokens`, loaded back from the host cache
    num_pages: int = 0
    ttft_s: float = 0.0
    abort_reason: str | None = None
    error: str | None = None  # serving this request failed here (its chunk says why)
    grammar: RowGrammar | None = None  # structured output: token 0's mask
    transfer_started: float = 0.0
    bootstrapped_at: float = 0.0  # when its senders last started (`_bootstrap`)
    parks: int = 0  # times its senders gave their window slot back (`_park_stale`)


class PrefillModeEngine:
    """`StepEngine` of a PD prefill server (see the module docstring).

    `engine` must be built with `hold_finished=True` (`build_prefill_engine`), so its
    scheduler keeps finished requests' pages until their transfer ends. `backend` sends
    the pages (`transfer.backends.make_backend`). `clock` must be the clock of
    `GenerateRequest.arrival_time` (time.monotonic) for the latencies in `meta` and the
    request timeout. `bootstrap_window`: how many queued requests run senders at once
    (None: `default_bootstrap_window`); `park_after_s`: how long one of them waits for
    its decode room before giving its slot to a waiting request (`_park_stale`).
    """

    mode: ServerMode = "prefill"

    def __init__(
        self,
        engine: PrefillEngine,
        backend: TransferBackend,
        *,
        clock: Callable[[], float] = time.monotonic,
        idle_wait_s: float = DEFAULT_IDLE_WAIT_S,
        max_queued_requests: int | None = None,
        bootstrap_window: int | None = None,
        park_after_s: float = PARK_AFTER_S,
        grammar: GrammarBackend | None = None,
    ):
        if not engine.scheduler.hold_finished:
            raise ConfigError(
                "the prefill engine's scheduler frees a request's pages when its prefill "
                "ends, but a PD prefill server must hold them until the KV transfer ends; "
                "build it with build_prefill_engine(..., hold_finished=True)"
            )
        self.engine = engine
        self.backend = backend
        self.grammar = grammar  # structured output: the first token drawn under its mask
        self.clock = clock
        self.idle_wait_s = idle_wait_s
        self.scheduler = engine.scheduler
        self.runner = engine.runner
        self.cfg = engine.cfg
        # The first token's repetition penalty (over the prompt) draws on the device too.
        self._penalties = first_token_penalties(self.cfg.vocab_size)
        self.cp_size = engine.args.cp_size
        self.page_size = engine.args.page_size
        pool = self.runner.pool
        # A drafting runner's pool holds the MTP layer's KV too: one more layer to send.
        self.layout = LayoutDescriptor.from_model(
            self.runner.pool_cfg, self.page_size, pool.latent[0].dtype, self.runner.index_k_dtype
        )
        # A prefill step donates the pool: senders gather under the lock the runner swaps
        # the pool under (`CPPoolPageSource`), so a read never meets a donated pool; the
        # pages it reads are held until the transfer ends.
        runner = self.runner
        self._sources = [
            CPPoolPageSource(lambda: runner.pool, self.layout, r, lock=runner.kv.lock)
            for r in range(self.cp_size)
        ]
        self._requests: dict[str, _Request] = {}
        # Bootstrapping and queued requests, in arrival order (left when prefill starts).
        self._queue: WaitQueue[_Request] = WaitQueue(
            max_queued_requests, what="prefill", clock=clock
        )
        if bootstrap_window is None:
            bootstrap_window = default_bootstrap_window(self.scheduler, max_queued_requests)
        if bootstrap_window < 1:
            raise ConfigError(f"the bootstrap window must be >= 1, got {bootstrap_window}")
        self.bootstrap_window = bootstrap_window
        self.park_after_s = park_after_s
        # Requests whose senders were started and still count against the window: not
        # yet prefilling, or dropped while their senders still stop (`_window_used`).
        self._window: list[_Request] = []
        self._rooms: dict[str, str] = {}  # room -> rid, for requests on this server
        self._pending: list[OutputChunk] = []
        self._wake = threading.Event()
        self.transfer_bytes = 0
        self.transfer_seconds = 0.0
        self.prefix_cache_hit_tokens = 0
        self.transfer_failures = 0
        self.bootstrap_parks = 0  # window slots given back by unregistered rooms (`_park_stale`)

    # ---- ahead-of-time compiles (issue 25) ----------------------------------------------
    def reachable_shapes(self) -> set[StepShape]:
        """Every CP step shape this server's requests can reach (its queue bounds the
        batch rows; `PrefillEngine.reachable_shapes`)."""
        return self.engine.reachable_shapes(self._queue.limit)

    def warm_all_shapes(self, *, steps: bool = True) -> dict[str, int]:
        """Compile every reachable step shape not compiled yet (unless not `steps`: then
        `compile_jobs` has them), every transfer gather a rank's sender can dispatch (up
        to a longest request's owned pages) and the host cache's copies; returns the
        programs compiled per family. Before serving only."""
        shapes = self.reachable_shapes()
        compiled = self.engine.warm_all_shapes(self._queue.limit) if steps else 0
        widest = max(s.width for s in shapes)
        gathers = sum(source.warm(widest // self.cp_size) for source in self._sources)
        copies = self.engine.warm_host_copies()
        return {"steps": compiled, "transfer gathers": gathers, "host cache copies": copies}

    def compile_jobs(self) -> list[CompileJob]:
        """The reachable step shapes not compiled yet, for a background compiler."""
        return self.engine.compile_jobs(self._queue.limit)

    def score_compile_jobs(self) -> list[CompileJob]:
        """The reachable step shapes' scoring twins not compiled yet (prompt log-probs),
        for a background compiler (`--warmup-prompt-scoring`)."""
        return self.engine.score_compile_jobs(self._queue.limit)

    def _check_prompt_scores(self, req: GenerateRequest) -> None:
        """Refuse prompt log-probs this server cannot score or send (400, nothing
        queued): the scores travel to the decode server in the transfer's commit."""
        start, n = req.prompt_logprobs_from, len(req.input_ids)
        assert start is not None
        if not 0 <= start < n:
            raise InputError(
                f"request {req.rid!r}: logprob_start_len {start} is outside the prompt's "
                f"{n} tokens [0, {n})"
            )
        if not isinstance(self.scheduler.executor, ScoringExecutor):
            raise InputError(
                f"request {req.rid!r}: this prefill server's steps do not score prompts "
                "(prompt log-probs); send the request to a unified server"
            )
        size = prompt_score_bytes(n - start, req.top_logprobs)
        if size > MAX_PROMPT_SCORE_BYTES:
            raise InputError(
                f"request {req.rid!r}: the log-probs of {n - start} prompt tokens with "
                f"{req.top_logprobs} alternatives each take {size} bytes in the KV "
                f"transfer's commit, over its {MAX_PROMPT_SCORE_BYTES}; start them later "
                "(logprob_start_len), ask for fewer top log-probs, or send the request to "
                "a unified server"
            )

    # ---- StepEngine -------------------------------------------------------------------
    def add(self, req: GenerateRequest) -> None:
        """Validate and queue `req`; `InputError` (nothing queued) when it cannot be served."""
        missing = [
            name for name in ("bootstrap_room", "decode_transfer_target") if not getattr(req, name)
        ]
        if missing:
            raise InputError(
                f"request {req.rid!r}: a prefill server needs {' and '.join(missing)} (the "
                "decode server's transfer room and its receiver's host:port); send the "
                "request through the PD router, or to a unified server"
            )
        assert req.bootstrap_room is not None and req.decode_transfer_target is not None
        if req.prompt_logprobs_from is not None:
            self._check_prompt_scores(req)
        parse_target(req.decode_transfer_target)
        if req.bootstrap_cp_size is not None and req.bootstrap_cp_size != self.cp_size:
            raise InputError(
                f"request {req.rid!r}: bootstrap_cp_size {req.bootstrap_cp_size} but this "
                f"prefill server sends from {self.cp_size} CP ranks; register the room with "
                f"cp_size {self.cp_size}"
            )
        if req.rid in self._requests:
            raise InputError(f"request id {req.rid!r} is already queued or transferring here")
        if req.bootstrap_room in self._rooms:
            raise InputError(
                f"request {req.rid!r}: room {req.bootstrap_room!r} is in use by request "
                f"{self._rooms[req.bootstrap_room]!r}; every request needs its own room"
            )
        req.sampling.validate(self.cfg.vocab_size)
        ids = np.asarray(req.input_ids, dtype=np.int64)
        if ids.size == 0:
            raise InputError(f"request {req.rid!r}: the prompt is empty; give at least one token")
        bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)]
        if bad.size:
            raise InputError(
                f"request {req.rid!r}: token id(s) {bad[:5].tolist()} outside the vocabulary "
                f"[0, {self.cfg.vocab_size})"
            )
        total = ids.size + req.sampling.max_new_tokens
        if total > self.cfg.max_position_embeddings:
            raise InputError(
                f"request {req.rid!r}: prompt ({ids.size} tokens) + max_new_tokens "
                f"({req.sampling.max_new_tokens}) = {total} exceeds the context length "
                f"{self.cfg.max_position_embeddings}; shorten the prompt or ask for fewer tokens"
            )
        self.scheduler.check_submit(req.rid, int(ids.size))
        entry = _Request(req)
        if req.sampling.grammar is not None:
            entry.grammar = row_grammar_for(self.grammar, req.sampling.grammar)
        self._queue.push(req.rid, entry)  # QueueFullError: nothing started
        self._requests[req.rid] = entry
        self._rooms[req.bootstrap_room] = req.rid
        # Handshake now when the window has room and nobody waits for it before this
        # one, while the request waits and prefills; else `_fill_window` starts it.
        earlier = any(e.hold is None for e in self._queue if e is not entry)
        if earlier or self._window_used() >= self.bootstrap_window:
            return
        try:
            self._bootstrap(entry)
        except BaseException:
            self._queue.remove(req.rid)
            self._forget(req.rid)
            raise

    def abort(self, rid: str) -> None:
        """Cancel `rid`: drop it if queued or prefilling, else stop its transfer. Its
        final chunk ("abort") comes from the step after its pages are released."""
        entry = self._requests.get(rid)
        if entry is None:
            logger.debug("abort of unknown or finished request %s ignored", rid)
            return
        if entry.state in ("bootstrapping", "queued"):
            if entry.state == "queued" and self.scheduler.abort(rid) is None:
                # finished in the scheduler but not yet seen: cannot be
                raise AssertionError(f"request {rid} is queued here but not in the scheduler")
            self._queue.remove(rid)
            self._forget(rid)
            if entry.hold is not None:  # its bootstrapped senders abort the room
                entry.hold.cancel(f"request {rid} aborted by the client")
            self._pending.append(self._final(entry, "abort", error="aborted by the client"))
            return
        assert entry.hold is not None
        if entry.abort_reason is None:
            entry.abort_reason = "aborted by the client"
            entry.hold.cancel(f"request {rid} aborted by the client")

    def step(self) -> Sequence[OutputChunk]:
        """Prefill one batch (if any is waiting), start its transfers, and emit the final
        chunk of every request whose transfer hold was released.

        A failed prefill step fails its batch's requests (their pages freed, their rooms
        aborted) and the others go on; `EngineStateLostError` when the pool is lost."""
        out, self._pending = self._pending, []
        try:
            self._step(out)
        except EngineStateLostError:
            raise
        except Exception as e:  # a bug past the guarded prefill step
            out += self._fail_in_flight(e)
        return out

    def _step(self, out: list[OutputChunk]) -> None:
        """`step`'s work; its chunks are appended to `out` as they come, so a failure
        half way keeps those already produced."""
        # First the released holds: a waiting request whose room already failed (refused
        # at its handshake, decode side gone) leaves the queue without a prefill.
        out += self._poll_holds()
        self._submit_ready()
        batches = len(self.scheduler.batch_sizes)
        if self.scheduler.num_waiting:
            try:
                outcomes = self.scheduler.step()
            except PrefillStepError as e:  # its requests were dropped: they fail below
                outcomes = e.outcomes
                failed = [o.rid for o in outcomes if o.status == "failed"]
                check_pool_after(e, str(e), self.runner.pool, failed)
            self._note_started()
            for outcome in outcomes:
                chunk = self._on_outcome_safely(outcome)
                if chunk is not None:
                    out.append(chunk)
        prefilled = len(self.scheduler.batch_sizes) > batches
        self._wake.clear()
        out += self._poll_holds()
        # Nothing prefilled (queue empty, waiting for pages that transfers hold, or for
        # decode sides) and nothing finished: wait briefly for a release or a ready
        # handshake (both set `_wake`) instead of spinning.
        if not out and not prefilled and (self._num_transferring() or self._num_bootstrapping()):
            self._wake.wait(self.idle_wait_s)
            out += self._poll_holds()

    def _fail_in_flight(self, exc: Exception) -> list[OutputChunk]:
        """A step raised outside its guarded prefill (a bug): which requests it touched
        is unknown, so every request here fails. Their pages are freed (a transferring
        one's when its senders stopped, by a later `_poll_holds`) and their rooms
        aborted; `EngineStateLostError` when the pool is lost."""
        message = step_failure("the prefill server's step", exc)
        check_pool_after(exc, message, self.runner.pool, list(self._requests))
        out = []
        for rid, entry in list(self._requests.items()):
            if entry.state == "transferring":
                assert entry.hold is not None
                entry.error = entry.error or message
                entry.hold.cancel(message)
                continue
            if entry.state == "queued" and self.scheduler.abort(rid) is None:
                logger.error("request %s: the scheduler no longer has it to abort", rid)
            self._queue.remove(rid)
            self._forget(rid)
            if entry.hold is not None:
                entry.hold.cancel(message)
            out.append(self._final(entry, "error", error=message))
        return out

    def has_work(self) -> bool:
        return bool(self.scheduler.num_waiting or self._requests or self._pending)

    def stats(self) -> EngineStats:
        alloc = self.runner.allocator
        free = tuple(int(x) for x in alloc.num_free_per_lane())
        total = (int(alloc.capacity_per_lane),) * len(free)
        cached = tuple(int(x) for x in self.scheduler.cache.total_pages_per_lane())
        if len(free) == 1 and self.cp_size > 1:  # replicated: every rank holds the same
            free, total, cached = (x * self.cp_size for x in (free, total, cached))
        return EngineStats(
            mode="prefill",
            waiting=len(self._queue),
            running=int(self.scheduler.chunked is not None) + self._num_transferring(),
            kv_pages_total=total,
            kv_pages_free=free,
            kv_pages_cached=cached,
            queue=self._queue.stats(),
            kv_bytes_per_page=self.layout.bytes_per_page(),
            transfer_bytes=self.transfer_bytes,
            transfer_seconds=self.transfer_seconds,
            prefix_cache_hit_tokens=self.prefix_cache_hit_tokens,
            transfer_failures=self.transfer_failures,
            admission_rejections=dict(self.scheduler.rejections),
        )

    # ---- internals --------------------------------------------------------------------
    def _num_transferring(self) -> int:
        return sum(e.state == "transferring" for e in self._requests.values())

    def _num_bootstrapping(self) -> int:
        return sum(e.state == "bootstrapping" for e in self._requests.values())

    def _submit_ready(self) -> None:
        """Requests past their timeout while waiting for the decode side fail; those
        whose every rank handshook go to the scheduler, in arrival order; the freed
        window slots start the next requests' senders."""
        self._expire_bootstrapping()
        timeout = self.scheduler.request_timeout
        for entry in self._queue:
            if entry.state != "bootstrapping" or entry.hold is None or not entry.hold.ready:
                continue
            if entry.hold.released:
                continue  # failed meanwhile: `_poll_holds` reports it
            ids = np.asarray(entry.req.input_ids, dtype=np.int32)
            # The request timeout counts from arrival, the decode wait included.
            left = None if timeout is None else timeout - self._waited(entry)
            # Reserve one new token: decoded tokens' KV lives on the decode server.
            self.scheduler.submit(
                entry.req.rid,
                ids,
                max_new_tokens=1,
                timeout=left,
                score_from=entry.req.prompt_logprobs_from,
            )
            entry.state = "queued"
        self._park_stale()
        self._fill_window()

    def _waited(self, entry: _Request) -> float:
        return self.clock() - entry.req.arrival_time

    def _expire_bootstrapping(self) -> None:
        """Fail requests still waiting for their decode side (or a window slot) past the
        request timeout; their senders stop (cancelled hold) and abort the room."""
        timeout = self.scheduler.request_timeout
        if timeout is None:
            return
        for entry in self._queue:
            if entry.state != "bootstrapping" or self._waited(entry) <= timeout:
                continue
            rid = entry.req.rid
            why = (
                f"timeout: request timeout expired ({timeout:g}s) while waiting for the "
                f"decode side {entry.req.decode_transfer_target} to register room "
                f"{entry.req.bootstrap_room}"
            )
            logger.info("request %s %s", rid, why)
            self._queue.remove(rid)
            self._forget(rid)
            if entry.hold is not None:
                entry.hold.cancel(f"request {rid}: {why}")
            self._pending.append(self._final(entry, "error", error=why))

    def _bootstrap(self, entry: _Request) -> None:
        """Start `entry`'s senders (one per CP rank): it enters the bootstrap window."""
        req = entry.req
        assert req.bootstrap_room is not None and req.decode_transfer_target is not None
        jobs = rank_jobs(
            req.bootstrap_room,
            req.decode_transfer_target,
            self.layout,
            len(req.input_ids),
            None,
            self._sources,
            None,
        )
        entry.hold = bootstrap_request(self.backend, jobs, self._on_release, self._wake.set)
        entry.bootstrapped_at = self.clock()
        self._window.append(entry)

    def _window_used(self) -> int:
        """Requests counting against the bootstrap window: senders started, hold not
        released, and either still in the wait queue (not prefilling yet) or dropped
        (aborted, timed out) while their senders still stop."""

        def counts(e: _Request) -> bool:
            if e.hold is None or e.hold.released:  # (None: parked, waiting again)
                return False
            live = self._requests.get(e.req.rid) is e
            return not live or e.req.rid in self._queue

        self._window = [e for e in self._window if counts(e)]
        return len(self._window)

    def _park_stale(self) -> None:
        """Window requests whose decode room is still unregistered after `park_after_s`
        give their slots back (`TransferHold.park`: their senders stop without aborting
        the room) while requests outside the window wait, at most one per waiting
        request, longest-waiting first. The decode side registers rooms in its own
        arrival order: without this, its pages could all be held by rooms of requests
        outside our window while the window's requests wait for pages there, both
        servers idle until the requests time out."""
        outside = sum(e.hold is None for e in self._queue)
        if not outside or self._window_used() < self.bootstrap_window:
            return
        now = self.clock()
        stale = sorted(
            (
                e
                for e in self._window
                if e.state == "bootstrapping"
                and e.hold is not None
                and not e.hold.registered
                and not e.hold.park_requested
                and now - e.bootstrapped_at >= self.park_after_s
            ),
            key=lambda e: e.bootstrapped_at,
        )[:outside]
        for e in stale:
            assert e.hold is not None
            e.hold.park()
        if stale:
            self.bootstrap_parks += len(stale)
            logger.info(
                "parking %d request(s) whose decode rooms are not registered after %gs, "
                "to try %d of the %d waiting outside the bootstrap window",
                len(stale),
                self.park_after_s,
                len(stale),
                outside,
            )

    def _fill_window(self) -> None:
        """Start the senders of waiting requests while the window has room: those parked
        fewest times first, then in arrival order (a round robin over requests whose
        rooms are not registered). A request whose senders cannot start fails alone."""
        free = self.bootstrap_window - self._window_used()
        waiting = sorted((e for e in self._queue if e.hold is None), key=lambda e: e.parks)
        for entry in waiting:
            if free <= 0:
                return
            try:
                self._bootstrap(entry)
            except Exception as e:
                logger.exception("request %s: starting its senders failed", entry.req.rid)
                self._queue.remove(entry.req.rid)
                self._forget(entry.req.rid)
                error = (
                    f"the prefill server could not start the KV transfer: {type(e).__name__}: {e}"
                )
                self._pending.append(self._final(entry, "error", error=error))
                continue
            free -= 1

    def _note_started(self) -> None:
        """Queued requests the scheduler took into a step leave the wait queue."""
        waiting = {r.rid for r in self.scheduler.waiting}
        for entry in self._queue:
            if entry.state == "queued" and entry.req.rid not in waiting:
                self._queue.pop(entry.req.rid)

    def _on_outcome_safely(self, outcome: PrefillOutcome) -> OutputChunk | None:
        """`_on_outcome`, but a failure there fails this request alone."""
        try:
            return self._on_outcome(outcome)
        except Exception as e:
            logger.exception("request %s: handling its prefill outcome failed", outcome.rid)
            entry = self._requests.get(outcome.rid)
            if entry is None:
                return None
            entry.error = f"the prefill server failed this request: {type(e).__name__}: {e}"
            if outcome.rid in self.scheduler.held:
                # Its pages stay held until every sender stopped (`_poll_holds` frees them).
                entry.state = "transferring"
                assert entry.hold is not None
                entry.hold.cancel(entry.error)
                return None
            self._queue.remove(outcome.rid)
            self._forget(outcome.rid)
            if entry.hold is not None:
                entry.hold.cancel(entry.error)
            return self._final(entry, "error", error=entry.error)

    def _forget(self, rid: str) -> _Request:
        entry = self._requests.pop(rid)
        self._rooms.pop(entry.req.bootstrap_room or "", None)
        return entry

    def _on_outcome(self, outcome: PrefillOutcome) -> OutputChunk | None:
        entry = self._requests[outcome.rid]
        if outcome.status != "finished":  # a timeout in the queue (aborts are ours)
            self._queue.remove(outcome.rid)
            self._forget(outcome.rid)
            if entry.hold is not None:
                entry.hold.cancel(f"request {outcome.rid}: {outcome.status}: {outcome.reason}")
            reason = "abort" if outcome.status == "aborted" else "error"
            # A failed step's reason says so itself (its traceback was logged once).
            why = outcome.reason if outcome.status == "failed" else None
            return self._final(entry, reason, error=why or f"{outcome.status}: {outcome.reason}")
        assert outcome.last_logits is not None and outcome.table is not None
        req = entry.req
        logits = np.asarray(outcome.last_logits)[None]  # host: one row
        s = req.sampling
        top_n = req.top_logprobs if req.return_logprob else 0
        # Frequency and presence penalties count output tokens (none yet: no effect); the
        # repetition penalty reads the prompt, the logit bias its slot (with the stop
        # tokens banned when `min_new_tokens` > 0).
        bias = stop_token_bias(s, self.cfg.eos_token_ids, 0)
        slot = 0 if s.repetition_penalty != 1.0 or bias else -1
        if slot == 0:
            self._penalties.reset(0, (), req.input_ids, bias)
        row = RowSampling(
            s.temperature,
            s.top_k,
            s.top_p,
            request_seed(req),
            0,
            s.min_p,
            top_n,
            repetition_penalty=s.repetition_penalty,
            logit_bias=bool(bias),
            slot=slot,
        )
        mask = token_mask([entry.grammar], 1, self.cfg.vocab_size)
        lps = log_probs(logits, self.runner.batch_invariant)
        drawn = sample(lps, [row], self._penalties, logits=logits, token_mask=mask)
        token, entry.logprob, entry.top = drawn.pick(0)
        entry.first_token = token
        entry.cached_tokens = outcome.cached_tokens
        entry.host_cached_tokens = outcome.host_cached_tokens
        self.prefix_cache_hit_tokens += outcome.cached_tokens
        entry.ttft_s = self.clock() - req.arrival_time
        table = outcome.table
        entry.num_pages = table.num_pages
        assert entry.hold is not None
        if table.num_tokens != len(req.input_ids):  # the handshake promised the prompt's
            raise AssertionError(
                f"request {req.rid}: prefilled {table.num_tokens} tokens of a "
                f"{len(req.input_ids)}-token prompt"
            )
        entry.transfer_started = self.clock()
        entry.state = "transferring"
        if not entry.hold.provide(
            table.local_pages(),
            Aux.with_hidden(
                outcome.last_hidden,  # a drafting runner's: the decode server's MTP layer
                first_token=token,
                logprob=entry.logprob,
                cached_tokens=entry.cached_tokens,
                host_cached_tokens=entry.host_cached_tokens,
                top=entry.top,
                prompt_scores=transfer_scores(outcome.prompt_logprobs, req.top_logprobs),
            ),
        ):
            # The room failed while the prefill ran: the next poll frees the pages and
            # reports the hold's outcome.
            logger.info("request %s: room failed during the prefill; nothing sent", req.rid)
        logger.debug(
            "request %s: first token %d, sending %d pages to %s room %s",
            req.rid,
            token,
            table.num_pages,
            req.decode_transfer_target,
            req.bootstrap_room,
        )
        return None

    def _on_release(self, _outcome: RoomSnapshot) -> None:
        """Sender thread: the hold is over. Only wakes the engine, which frees the pages."""
        self._wake.set()

    def _poll_holds(self) -> list[OutputChunk]:
        out = []
        for rid, entry in list(self._requests.items()):
            if entry.hold is None or not entry.hold.released:
                continue
            outcome = entry.hold.outcome
            if entry.state == "bootstrapping" and entry.hold.parked:
                entry.hold = None  # waits again; `_fill_window` restarts its senders
                entry.parks += 1
                continue
            if entry.state in ("bootstrapping", "queued"):  # failed before the prefill
                if entry.state == "queued" and self.scheduler.abort(rid) is None:
                    raise AssertionError(f"request {rid} is queued here but not in the scheduler")
                self._queue.remove(rid)
                self._forget(rid)
                out.append(self._transfer_failed(entry, outcome, " before the prefill"))
                continue
            inputs = entry.hold.inputs
            if inputs is not None:  # rows a stopped sender left must not outlive the pages
                pages = np.asarray(inputs.src_local_pages)
                for r, source in enumerate(self._sources):
                    source.discard(pages[r :: self.cp_size])
            self.scheduler.release_held(rid)
            self._forget(rid)
            delivered = outcome is not None and outcome.state is RoomState.SUCCESS
            if delivered:  # counted even when the caller left after the room succeeded
                self.transfer_bytes += entry.num_pages * self.layout.bytes_per_page()
                # Start of the send to the outcome seen here (polled within idle_wait_s).
                self.transfer_seconds += self.clock() - entry.transfer_started
            if entry.error is not None:
                out.append(self._final(entry, "error", error=entry.error))
            elif entry.abort_reason is not None:
                out.append(self._final(entry, "abort", error=entry.abort_reason))
            elif delivered:
                out.append(self._final(entry, "length"))
            else:
                out.append(self._transfer_failed(entry, outcome))
        return out

    def _transfer_failed(
        self, entry: _Request, outcome: RoomSnapshot | None, when: str = ""
    ) -> OutputChunk:
        """Count a failed transfer and give the request's error chunk."""
        self.transfer_failures += 1
        req = entry.req
        why = outcome.reason if outcome is not None else "no outcome"
        return self._final(
            entry,
            "error",
            error=f"KV transfer to {req.decode_transfer_target} (room {req.bootstrap_room}) "
            f"failed{when}: {why}",
        )

    def _final(
        self,
        entry: _Request,
        reason: Literal["length", "abort", "error"],
        error: str | None = None,
    ) -> OutputChunk:
        """The request's only chunk; the first token only when the decode side has it."""
        req = entry.req
        ok = reason == "length"
        meta: dict[str, float | int] = {
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": int(ok),
            "cached_tokens": entry.cached_tokens,
            "cached_tokens_host": entry.host_cached_tokens,
            "e2e_s": self.clock() - req.arrival_time,
        }
        if entry.first_token >= 0:
            meta["ttft_s"] = entry.ttft_s
        return OutputChunk(
            rid=req.rid,
            token_ids=(entry.first_token,) if ok else (),
            logprobs=(entry.logprob,) if ok and req.return_logprob else None,
            top_logprobs=(entry.top,) if ok and req.return_logprob and req.top_logprobs else None,
            finished=True,
            finish_reason=reason,
            error=None if ok else error,
            meta=meta,
        )


def default_bootstrap_window(scheduler: PrefillScheduler, max_queued: int | None) -> int:
    """Twice the most requests one batch can hold (`max_batch_rows`), within
    [`MIN_BOOTSTRAP_WINDOW`, `MAX_BOOTSTRAP_WINDOW`]: enough handshaken requests to fill
    the next batches, few enough that the senders stay bounded."""
    rows = scheduler.max_batch_rows(max_queued)
    return min(MAX_BOOTSTRAP_WINDOW, max(MIN_BOOTSTRAP_WINDOW, 2 * rows))


def mooncake_host_buffer_bytes(args: ServerArgs, cfg: ModelConfig) -> int:
    """`--transfer-host-buffer-size`, else the largest share of one request a rank can
    send: its pages of a request as long as the model's context, capped by the rank's
    pool (`pool_pages_per_rank`), at least `MOONCAKE_HOST_BUFFER_MIN_BYTES`.

    The Mooncake sender copies a rank's device pages into this registered buffer
    before writing them and gives the region back once its writes are over, so one
    rank's share is what it must hold (the ranks take turns)."""
    if args.transfer_host_buffer_size is not None:
        return args.transfer_host_buffer_size
    layout = LayoutDescriptor.from_model(
        args.kv_model_config(cfg), args.page_size, DTYPES[args.dtype], args.index_k_dtype
    )
    context_pages = pages_for_tokens(cfg.max_position_embeddings, args.page_size)
    share = min(-(-context_pages // args.cp_size), pool_pages_per_rank(args, cfg))
    return max(MOONCAKE_HOST_BUFFER_MIN_BYTES, share * layout.bytes_per_page())


def backend_from_args(args: ServerArgs, cfg: ModelConfig) -> TransferBackend:
    """The `--transfer-backend` sender, with the `--transfer-*` timeouts applied (and,
    for Mooncake, its host buffer sized by `mooncake_host_buffer_bytes`).

    The bootstrap timeout bounds how long a sender retries its handshake while the
    decode server does not answer (not up, gone); a room not registered yet (queued
    there) is waited for until the request's timeout (`transfer.session`); the
    heartbeat interval is the decode side's;
    the decode side counts as lost after `HEARTBEAT_TIMEOUT_INTERVALS` missed beats
    (at least `MIN_HEARTBEAT_TIMEOUT_S`).
    """
    name = args.transfer_backend
    if name is None:
        raise ConfigError(
            "a prefill server needs --transfer-backend (e.g. grpc) to send KV to decode servers"
        )
    timing: dict[str, Any] = {
        "bootstrap_timeout_s": args.transfer_bootstrap_timeout,
        "heartbeat_interval_s": args.transfer_heartbeat_interval,
        "heartbeat_timeout_s": max(
            MIN_HEARTBEAT_TIMEOUT_S, HEARTBEAT_TIMEOUT_INTERVALS * args.transfer_heartbeat_interval
        ),
    }
    if name == "grpc":
        from transfer.backends.grpc_backend import GrpcBackendConfig

        return make_backend(name, config=GrpcBackendConfig(**timing))
    if name == "mooncake":
        from transfer.backends.mooncake_backend import MooncakeBackendConfig

        host = mooncake_host_buffer_bytes(args, cfg)
        logger.info("Mooncake sender: %d MiB registered host copy buffer", host >> 20)
        return make_backend(name, config=MooncakeBackendConfig(host_buffer_bytes=host, **timing))
    return make_backend(name)


def build_prefill_mode_engine(
    args: ServerArgs, *, model: CausalLM | None = None, devices: list | None = None
) -> PrefillModeEngine:
    """A ready PD prefill engine from the server flags (`--disaggregation-mode prefill`)."""
    if args.disaggregation_mode != "prefill":
        raise ConfigError(
            f"the prefill-mode engine serves --disaggregation-mode prefill, got "
            f"{args.disaggregation_mode!r}"
        )
    cfg = args.model_config() if model is None else model.cfg
    backend = backend_from_args(args, cfg)
    engine = build_prefill_engine(args, model=model, devices=devices, hold_finished=True)
    return PrefillModeEngine(engine, backend, max_queued_requests=args.max_queued_requests)
