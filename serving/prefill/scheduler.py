"""The prefill scheduler: waiting queue -> admitted batch -> one CP prefill step.

Host side, and free of device syncs until the step itself: prefix matching (radix
cache), admission (`PrefillAdder`: generic budgets + CP shared-KV gates), evict-then-
allocate of the admitted requests' pages in their owner lanes, and the step's host plan
are numpy/Python. The only device work is the executor's jitted step.

Policies: `fcfs` (arrival order) and `lpm` (longest cached prefix first, then arrival).
An in-flight chunked request always goes first in the next batch. Abort, per-request
timeouts and a failed step (`PrefillStepError`: the batch's requests are dropped, the
scheduler goes on) release a request's own pages and unlock its cached prefix; a finished
request's whole pages go to the prefix cache (so a later request with the same prefix
reuses them, on the same owner lanes) and its partial tail page is freed.

With `hold_finished` (a PD prefill server, `serving.prefill.engine`), a finished
request's pages must outlive its step: they are read by the KV transfer to the decode
server. Its whole pages still go to the prefix cache at once (so later requests reuse
the prefix while the transfer runs) but stay locked, and its tail page stays its own,
until `release_held(rid)`, which then does what a non-holding scheduler did at finish.

With a host (L2) cache (`host_io`, a `serving.prefill.host_cache.HostCacheIO`, and a
`HiRadixCache` as `cache`), prefix matching also plans the load-back of host hits (SPEC
S10) and admission counts the planned cached tokens (S7). An admitted request's host
hit is loaded back before its step allocates; if the load is skipped or its copy fails,
the admission is redone with the device hit only and the request recomputes the rest.
The copy is dispatched right there (asynchronous `device_put` and scatters, nothing read
back), not by the executor before the step: a later request of the same batch then
matches the loaded pages as device pages (a burst sharing an evicted system prompt
loads it once, not once per request), and a failed copy is settled inside the one
admission that planned it. SGLang's HiCache does the same (`init_load_back` allocates
at admission, the copy starts when the batch is formed).
The cache's backup jobs go to the IO's background worker after every batch and finish;
their acknowledgements are applied at the start of the next batch (`sync_host_cache`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from cpkv_jax.cache.hiradix import load_host_hit
from cpkv_jax.cache.radix import (
    PrefixMatch,
    RadixCache,
    RadixNode,
    alloc_with_evict,
    cache_and_relock,
    cache_finished_request,
    table_from_prefix,
)
from cpkv_jax.errors import CacheCapacityError, CpkvError, InputError
from cpkv_jax.lane_allocator import RequestPageTable
from cpkv_jax.paging import owner_of_page, pages_for_tokens
from cpkv_jax.scores import PromptLogprobs, PromptScores, TokenScores, match_end
from serving.prefill.adder import (
    AddResult,
    Admitted,
    BatchEstimator,
    Candidate,
    CPSharedKVLimits,
    PrefillAdder,
)

logger = logging.getLogger(__name__)

Policy = Literal["fcfs", "lpm"]


@dataclasses.dataclass(frozen=True)
class StepRow:
    """One request's slice of a prefill step: tokens `[start, start + length)`."""

    prompt: np.ndarray
    table: RequestPageTable
    start: int
    length: int


@runtime_checkable
class PrefillExecutor(Protocol):
    """Runs one prefill step; returns each row's logits after its last new token."""

    def execute(self, rows: Sequence[StepRow]) -> np.ndarray: ...


@runtime_checkable
class ScoringExecutor(PrefillExecutor, Protocol):
    """A `PrefillExecutor` that also scores prompt tokens (prompt log-probs)."""

    def score(self, rows: Sequence[StepRow]) -> tuple[np.ndarray, list[TokenScores]]:
        """`execute` that also scores each row's prompt tokens of the step
        (`CPPrefillRunner.run_score_step`)."""
        ...


@runtime_checkable
class DraftingExecutor(PrefillExecutor, Protocol):
    """A `PrefillExecutor` whose steps also run the MTP layer (speculative decoding):
    after each step, `last_hidden` holds its rows' final hidden states at their last new
    token (None when its runner does not draft)."""

    last_hidden: np.ndarray | None


@dataclasses.dataclass
class PrefillRequest:
    rid: str
    input_ids: np.ndarray
    max_new_tokens: int
    deadline: float | None
    seq: int
    table: RequestPageTable | None = None
    lock_node: RadixNode | None = None
    cached_tokens: int = 0  # prefix reused from the cache at admission
    host_cached_tokens: int = 0  # of which loaded back from the host cache
    done: int = 0  # tokens whose KV is written (cached prefix included)
    # Prompt log-probs from this token on (None: not asked). Its prefix match stops
    # before it: a cached token's hidden state, which predicts the next, is gone.
    score_from: int | None = None
    scores: PromptScores | None = None  # filled chunk by chunk

    def match_key(self) -> np.ndarray:
        """The tokens the prefix cache may serve (`scores.match_end`)."""
        return self.input_ids[: match_end(self.input_ids.size, self.score_from)]

    def record(self, scores: TokenScores) -> None:
        if self.scores is None:
            self.scores = PromptScores(self.input_ids.size)
        self.scores.record(scores)

    def prompt_logprobs(self) -> PromptLogprobs | None:
        if self.score_from is None or self.scores is None:
            return None
        return self.scores.result(self.score_from)


@dataclasses.dataclass(frozen=True)
class PrefillOutcome:
    rid: str
    status: Literal["finished", "aborted", "timeout", "failed"]
    last_logits: np.ndarray | None = None
    cached_tokens: int = 0
    reason: str = ""
    host_cached_tokens: int = 0  # of `cached_tokens`, loaded back from the host cache
    # `hold_finished` only: the finished request's page table, valid (pages allocated,
    # KV intact) until `PrefillScheduler.release_held(rid)`.
    table: RequestPageTable | None = None
    prompt_logprobs: PromptLogprobs | None = None  # a request submitted with `score_from`
    # A drafting runner's (speculative decoding): the trunk's final hidden state at the
    # prompt's last position, the MTP layer's input there with the first output token.
    last_hidden: np.ndarray | None = None


class PrefillStepError(CpkvError):
    """A batch's step raised (a compile, a SPEC S1.7 debug check, the device): its
    requests were dropped as an abort drops them (own pages freed, cached prefixes
    unlocked). `outcomes` are theirs (status "failed", the reason) and the step's
    timeouts; the cause is `__cause__`. The scheduler itself goes on."""

    def __init__(self, message: str, outcomes: list[PrefillOutcome]):
        super().__init__(message)
        self.outcomes = outcomes


@dataclasses.dataclass(frozen=True)
class ScheduledBatch:
    rows: list[StepRow]
    requests: list[PrefillRequest]
    admitted: list[Admitted]


class PrefillScheduler:
    def __init__(
        self,
        *,
        cache: RadixCache,
        executor: PrefillExecutor,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None = None,
        cp_limits: CPSharedKVLimits = CPSharedKVLimits(),
        estimator: BatchEstimator | None = None,
        policy: Policy = "fcfs",
        request_timeout: float | None = None,
        reserve_clip: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        hold_finished: bool = False,
        host_io=None,
    ):
        if host_io is not None and not hasattr(cache, "plan_load_back"):
            raise InputError("a host cache (host_io) needs a HiRadixCache as the prefix cache")
        if policy not in ("fcfs", "lpm"):
            raise InputError(f"schedule policy must be 'fcfs' or 'lpm', got {policy!r}")
        self.cache = cache
        self.allocator = cache.allocator
        self.page_size = cache.page_size
        self.executor = executor
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.cp_limits = cp_limits
        self.estimator = estimator
        self.policy = policy
        self.request_timeout = request_timeout
        self.reserve_clip = reserve_clip
        self.clock = clock
        self.waiting: list[PrefillRequest] = []
        self.chunked: PrefillRequest | None = None
        self.rejections: Counter[str] = Counter()
        self.batch_sizes: list[int] = []
        self._seq = itertools.count()
        # Benchmarks swap in an instrumented subclass; production uses PrefillAdder.
        self.adder_cls: type[PrefillAdder] = PrefillAdder
        self._ids: set[str] = set()
        self.hold_finished = hold_finished
        self.held: dict[str, PrefillRequest] = {}
        self.host_io = host_io  # serving.prefill.host_cache.HostCacheIO, or None

    # ---- requests ----------------------------------------------------------------------
    def submit(
        self,
        rid: str,
        input_ids: Sequence[int] | np.ndarray,
        max_new_tokens: int = 1,
        timeout: float | None = None,
        score_from: int | None = None,
    ) -> None:
        """Queue a prompt; with `score_from`, its prompt tokens from there on are scored
        (`PrefillOutcome.prompt_logprobs`)."""
        ids = np.asarray(input_ids, dtype=np.int32).reshape(-1)
        self.check_submit(rid, ids.size, max_new_tokens)
        if score_from is not None and not isinstance(self.executor, ScoringExecutor):
            raise InputError("this prefill executor does not score prompt tokens")
        if score_from is not None and not 0 <= score_from < ids.size:
            raise InputError(f"score_from {score_from} is outside the prompt [0, {ids.size})")
        timeout = self.request_timeout if timeout is None else timeout
        deadline = None if timeout is None else self.clock() + timeout
        req = PrefillRequest(rid, ids, max_new_tokens, deadline, next(self._seq))
        req.score_from = score_from
        self.waiting.append(req)
        self._ids.add(rid)

    def max_batch_rows(self, max_waiting: int | None = None) -> int:
        """The most requests one batch can hold (bounds the step shapes' row buckets).

        One with CP shared KV unless bs>1 is on (S5.1); else the fewest of: the S5.2
        request limit, one token each within the chunk or the input budget (its first
        request may exceed it, S6 may lift it), one page each within the pool, and
        `max_waiting` queued requests plus the in-flight chunked one."""
        lim = self.cp_limits
        if lim.shared_kv and not lim.bs_gt1:
            return 1
        budget = max(self.max_prefill_tokens, lim.max_total_extend_tokens or 0) + 1
        bounds = [budget, self.allocator.capacity_per_lane * self.allocator.cp_size]
        if self.chunked_prefill_size is not None:
            bounds.append(self.chunked_prefill_size)
        if lim.shared_kv and lim.max_batch_requests is not None:
            bounds.append(lim.max_batch_requests)
        if max_waiting is not None:
            bounds.append(max_waiting + 1)
        return max(1, min(bounds))

    def longest_prompt(self, max_new_tokens: int = 1) -> int:
        """The longest prompt admission can ever take: an empty pool's tokens less the
        output reserved beside it (`PrefillAdder` needs prompt + reserve tokens free)."""
        capacity = self.allocator.capacity_per_lane * self.allocator.cp_size * self.page_size
        return max(0, capacity - min(max_new_tokens, self.reserve_clip))

    def check_submit(self, rid: str, num_tokens: int, max_new_tokens: int = 1) -> None:
        """`InputError` if `submit(rid, <num_tokens tokens>, max_new_tokens)` would refuse
        the request: a prompt over `longest_prompt` would wait forever."""
        if num_tokens == 0:
            raise InputError(f"request {rid!r}: empty prompt")
        if rid in self._ids:
            raise InputError(f"request id {rid!r} is already queued or running")
        longest = self.longest_prompt(max_new_tokens)
        if num_tokens > longest:
            capacity = self.allocator.capacity_per_lane * self.allocator.cp_size * self.page_size
            raise InputError(
                f"request {rid!r} has {num_tokens} prompt tokens but the longest prompt this "
                f"server takes is {longest} (its KV pool holds {capacity} tokens, "
                f"{capacity - longest} kept for output); raise the KV pool size or shorten "
                "the prompt"
            )

    def abort(self, rid: str) -> PrefillOutcome | None:
        """Drop a waiting or in-flight request, releasing its pages; None if unknown."""
        return self._drop(rid, "aborted", "aborted by the client")

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + (self.chunked is not None)

    @property
    def num_held(self) -> int:
        """Finished requests whose pages are held (`hold_finished`) until released."""
        return len(self.held)

    def release_held(self, rid: str) -> None:
        """End the hold on a finished request's pages (its transfer is over).

        Exactly what a non-holding scheduler does at finish (`cache_finished_request`):
        the whole pages, already cached, become evictable once no one else locks them,
        the tail page is freed. The request id may be used again afterwards.
        """
        req = self.held.pop(rid, None)
        if req is None:
            raise KeyError(f"request {rid!r} holds no pages (never finished, or released)")
        assert req.table is not None and req.lock_node is not None
        cache_finished_request(self.cache, req.table, req.input_ids, req.lock_node)
        req.table, req.lock_node = None, None
        self._ids.discard(rid)
        self._submit_backups()

    # ---- scheduling (host only) ---------------------------------------------------------
    def schedule_batch(self) -> ScheduledBatch | None:
        """Form the next batch and allocate its pages; no device work (but host-hit
        load-backs, with a host cache)."""
        if self.host_io is not None:
            self.sync_host_cache()
        reserved = 0 if self.chunked is None else self._reserve(self.chunked)
        free_pages = int(self.allocator.num_free_per_lane().sum())
        evictable = int(self.cache.evictable_pages_per_lane().sum())
        adder = self.adder_cls(
            page_size=self.page_size,
            rem_total_tokens=(free_pages + evictable) * self.page_size - reserved,
            max_prefill_tokens=self.max_prefill_tokens,
            chunked_prefill_size=self.chunked_prefill_size,
            cp=self.cp_limits,
            estimator=self.estimator,
        )
        requests: list[PrefillRequest] = []
        if self.chunked is not None:
            req = self.chunked
            admitted = adder.add_chunked(self._candidate(req, req.cached_tokens))
            if admitted is not None and not self._allocate(req, admitted):
                adder.batch.pop()
            elif admitted is not None:
                requests.append(req)
                self.chunked = None
        for req in self._ordered_waiting():
            if requests and adder.new_chunked is not None:
                break
            if self.host_io is not None:
                if not self._admit_with_host_cache(req, adder):
                    break
                requests.append(req)
                self.waiting.remove(req)
                continue
            match = self.cache.match_prefix(req.match_key())
            result = adder.add(self._candidate(req, match.num_tokens))
            if result is not AddResult.CONTINUE:
                self.rejections[result.value] += 1
                break
            self.cache.inc_lock_ref(match.node)
            req.lock_node, req.cached_tokens = match.node, match.num_tokens
            req.table = table_from_prefix(self.cache, match)
            req.done = match.num_tokens
            if not self._allocate(req, adder.batch[-1]):
                adder.batch.pop()
                self._unlock(req)
                # Matched afresh next time: its prefix may be evicted before the retry.
                req.table, req.done, req.cached_tokens = None, 0, 0
                self.rejections["lane_capacity"] += 1
                break
            requests.append(req)
            self.waiting.remove(req)
        if self.host_io is not None:
            self._submit_backups()  # write-back evictions of this batch's allocations
        if not requests:
            return None
        rows = [
            StepRow(r.input_ids, r.table, r.done, a.extend_tokens)  # type: ignore[arg-type]
            for r, a in zip(requests, adder.batch, strict=True)
        ]
        self.batch_sizes.append(len(rows))
        return ScheduledBatch(rows, requests, list(adder.batch))

    def step(self) -> list[PrefillOutcome]:
        """Expire timeouts, run one batch, finish what completed.

        `PrefillStepError` when the batch's step raised (its requests dropped)."""
        outcomes = self._expire()
        batch = self.schedule_batch()
        if batch is None:
            return outcomes
        try:
            if any(r.score_from is not None for r in batch.requests):
                assert isinstance(self.executor, ScoringExecutor)  # checked by `submit`
                logits, scores = self.executor.score(batch.rows)
                for req, row_scores in zip(batch.requests, scores, strict=True):
                    if req.score_from is not None:
                        req.record(row_scores)
            else:
                logits = self.executor.execute(batch.rows)
        except Exception as e:
            reason = f"the prefill step failed: {type(e).__name__}: {e}"
            failed = self._drop_batch(batch, reason)
            raise PrefillStepError(reason, outcomes + failed) from e
        drafting = isinstance(self.executor, DraftingExecutor)
        hidden = self.executor.last_hidden if drafting else None
        return outcomes + self.finish_batch(batch, logits, hidden)

    def _drop_batch(self, batch: ScheduledBatch, reason: str) -> list[PrefillOutcome]:
        """Drop every request of a batch whose step raised, as `abort` would (a chunked
        one's earlier chunks too: its pages go)."""
        for req in batch.requests:
            self._release_own_pages(req)
            self._ids.discard(req.rid)
        self._submit_backups()
        return [PrefillOutcome(req.rid, "failed", reason=reason) for req in batch.requests]

    def finish_batch(
        self, batch: ScheduledBatch, logits: np.ndarray, hidden: np.ndarray | None = None
    ) -> list[PrefillOutcome]:
        """Record a step's results: chunked requests continue, finished ones are cached
        (`hidden`: a drafting runner's last hidden states, by row)."""
        outcomes: list[PrefillOutcome] = []
        for i, (row, req, out) in enumerate(zip(batch.rows, batch.requests, logits, strict=True)):
            req.done = row.start + row.length
            if req.done < req.input_ids.size:
                self.chunked = req
                continue
            assert req.table is not None and req.lock_node is not None
            if self.hold_finished:
                self._hold(req)
                outcomes.append(
                    PrefillOutcome(
                        req.rid,
                        "finished",
                        np.asarray(out),
                        req.cached_tokens,
                        table=req.table,
                        host_cached_tokens=req.host_cached_tokens,
                        prompt_logprobs=req.prompt_logprobs(),
                        last_hidden=None if hidden is None else hidden[i],
                    )
                )
                continue
            cache_finished_request(self.cache, req.table, req.input_ids, req.lock_node)
            self._ids.discard(req.rid)
            outcomes.append(
                PrefillOutcome(
                    req.rid,
                    "finished",
                    np.asarray(out),
                    req.cached_tokens,
                    host_cached_tokens=req.host_cached_tokens,
                    prompt_logprobs=req.prompt_logprobs(),
                )
            )
        self._submit_backups()
        return outcomes

    def _hold(self, req: PrefillRequest) -> None:
        """Cache a finished request's whole pages now, locked, and keep its tail page
        (`cache_and_relock`: a later request can match them while this one's KV is in
        transfer; what the transfer reads is always allocated and locked). Path nodes off
        the device (a host copy, or a write-back backup still in flight) take this
        request's pages (`HiRadixCache.insert`), so the whole pages always match.
        """
        assert req.table is not None and req.lock_node is not None
        n = req.table.num_tokens
        req.lock_node, pages = cache_and_relock(
            self.cache, req.input_ids[:n], req.table.local_pages(), req.lock_node
        )
        assert pages.size == pages_for_tokens(n, self.page_size)
        req.table.detach()  # whole pages: the cache's; the tail page moves to the new table
        req.table = RequestPageTable.from_prefix(req.table.cp_size, pages, n, self.page_size)
        self.held[req.rid] = req

    def run_until_idle(self, max_steps: int = 100_000) -> list[PrefillOutcome]:
        outcomes: list[PrefillOutcome] = []
        for _ in range(max_steps):
            if not self.num_waiting:
                return outcomes
            outcomes += self.step()
        raise RuntimeError(
            f"scheduler still has {self.num_waiting} requests after {max_steps} steps"
        )

    # ---- host (L2) cache --------------------------------------------------------------------
    def sync_host_cache(self, wait: bool = False) -> None:
        """Apply finished backups to the cache (`wait`: first let the worker finish every
        queued one), then hand it the cache's new backup jobs. No-op without a host cache."""
        if self.host_io is None:
            return
        if wait:
            self._submit_backups()
            self.host_io.wait_backups()
        self.host_io.drain(self.cache)
        self._submit_backups()

    def close(self) -> None:
        """Stop the host cache's backup worker and apply what it finished."""
        if self.host_io is not None:
            self.host_io.close()
            self.host_io.drain(self.cache)

    def _submit_backups(self) -> None:
        if self.host_io is not None:
            self.host_io.submit_backups(self.cache, self.cache.take_backups())

    def _admit_with_host_cache(self, req: PrefillRequest, adder: PrefillAdder) -> bool:
        """Match, plan the host-hit load-back (S10), admit counting the planned cached
        tokens (S7), load back, allocate. False (request untouched, still waiting): stop
        adding to this batch."""
        io = self.host_io
        assert io is not None
        match = self.cache.match_prefix(req.match_key())
        self.cache.inc_lock_ref(match.node)
        plan = self.cache.plan_load_back(match)
        skipped = match.host_node is not None and not plan.load
        saved = (
            len(adder.batch),
            adder.rem_total_tokens,
            adder.rem_input_tokens,
            adder.rem_chunk_tokens,
            adder.new_chunked,
        )
        result = adder.add(self._candidate(req, plan.cached_tokens))
        used: PrefixMatch = match
        if result is AddResult.CONTINUE and plan.load:
            loaded, outcome = load_host_hit(self.cache, plan, io.load)
            if outcome == "loaded":
                used = loaded
                io.stats.host_hit_tokens += used.num_tokens - match.num_tokens
                adder.rem_total_tokens -= used.num_tokens - match.num_tokens  # pages it took
            else:  # a failed copy is counted in `load_back_failures`
                skipped = outcome == "skipped"
                # Redo the admission with the device hit only: the request recomputes.
                del adder.batch[saved[0] :]
                (_, adder.rem_total_tokens, adder.rem_input_tokens) = saved[:3]
                adder.rem_chunk_tokens, adder.new_chunked = saved[3], saved[4]
                result = adder.add(self._candidate(req, match.num_tokens))
        req.lock_node = used.node
        if result is not AddResult.CONTINUE:
            self.rejections[result.value] += 1
            self._unlock(req)
            return False
        req.cached_tokens = used.num_tokens
        req.host_cached_tokens = used.num_tokens - match.num_tokens
        req.table = table_from_prefix(self.cache, used)
        req.done = used.num_tokens
        if not self._allocate(req, adder.batch[-1]):
            adder.batch.pop()
            self._unlock(req)
            req.table, req.done, req.cached_tokens = None, 0, 0  # matched afresh next time
            req.host_cached_tokens = 0
            self.rejections["lane_capacity"] += 1
            return False
        if skipped:
            io.stats.skipped_load_backs += 1
            logger.info("request %s: host hit not loaded back: %s", req.rid, plan.reason)
        return True

    # ---- internals -----------------------------------------------------------------------
    def _reserve(self, req: PrefillRequest) -> int:
        return min(req.max_new_tokens, self.reserve_clip)

    def _candidate(self, req: PrefillRequest, cached: int) -> Candidate:
        # Tokens whose KV already exists: the cached prefix, or for an in-flight chunked
        # request everything its earlier chunks wrote. Counted after the host load-back
        # plan (SPEC S7): device hits, plus with a host cache the host hits planned for
        # load-back (`_admit_with_host_cache`).
        done = max(req.done, cached)
        return Candidate(req.rid, req.input_ids.size - done, done, self._reserve(req))

    def _ordered_waiting(self) -> list[PrefillRequest]:
        if self.policy == "fcfs":
            return sorted(self.waiting, key=lambda r: r.seq)
        matched = {r.rid: self._matched_tokens(r) for r in self.waiting}
        return sorted(self.waiting, key=lambda r: (-matched[r.rid], r.seq))

    def _matched_tokens(self, req: PrefillRequest) -> int:
        match = self.cache.match_prefix(req.match_key())
        if self.host_io is None:
            return match.num_tokens
        return match.num_tokens + match.host_num_tokens

    def _allocate(self, req: PrefillRequest, admitted: Admitted) -> bool:
        assert req.table is not None
        try:
            alloc_with_evict(self.cache, req.table, req.done + admitted.extend_tokens)
        except CacheCapacityError as e:
            logger.info("request %s waits: %s", req.rid, e)
            return False
        return True

    def _release_own_pages(self, req: PrefillRequest) -> None:
        """Free pages the request allocated (not its cached prefix) and unlock the prefix."""
        if req.table is not None:
            first_own = req.cached_tokens // self.page_size
            pages = req.table.detach()
            own = np.arange(first_own, pages.size, dtype=np.int64)
            if own.size:
                self.allocator.free(owner_of_page(own, self.allocator.cp_size), pages[first_own:])
            req.table = None
        self._unlock(req)

    def _unlock(self, req: PrefillRequest) -> None:
        if req.lock_node is not None:
            self.cache.dec_lock_ref(req.lock_node)
            req.lock_node = None

    def _drop(self, rid: str, status, reason: str) -> PrefillOutcome | None:
        if self.chunked is not None and self.chunked.rid == rid:
            req = self.chunked
            self.chunked = None
        else:
            found = [r for r in self.waiting if r.rid == rid]
            if not found:
                return None
            req = found[0]
            self.waiting.remove(req)
        self._release_own_pages(req)
        self._ids.discard(rid)
        self._submit_backups()
        logger.info("request %s %s: %s", rid, status, reason)
        return PrefillOutcome(rid, status, reason=reason)

    def _expire(self) -> list[PrefillOutcome]:
        now = self.clock()
        late = [
            r.rid
            for r in [*self.waiting, *([self.chunked] if self.chunked else [])]
            if r.deadline is not None and now > r.deadline
        ]
        outcomes = [self._drop(rid, "timeout", "request timeout expired") for rid in late]
        return [o for o in outcomes if o is not None]


class CPRunnerExecutor:
    """`PrefillExecutor` over a `CPPrefillRunner` (the real CP prefill step). After each
    step `last_hidden` holds a drafting runner's last hidden states of the step's rows
    (None otherwise), which the scheduler hands to the finished requests' outcomes."""

    def __init__(self, runner):
        self.runner = runner
        self.last_hidden: np.ndarray | None = None

    def execute(self, rows: Sequence[StepRow]) -> np.ndarray:
        plan = self.runner.plan_step(
            [r.prompt for r in rows],
            [r.table for r in rows],
            [r.start for r in rows],
            [r.length for r in rows],
        )
        logits = self.runner.run_step(plan)[: len(rows)]
        self._keep_hidden(len(rows))
        return logits

    def _keep_hidden(self, rows: int) -> None:
        hidden = self.runner.last_hidden
        self.last_hidden = None if hidden is None else hidden[:rows]

    def score(self, rows: Sequence[StepRow]) -> tuple[np.ndarray, list[TokenScores]]:
        prompts = [r.prompt for r in rows]
        plan = self.runner.plan_step(
            prompts, [r.table for r in rows], [r.start for r in rows], [r.length for r in rows]
        )
        logits, scores = self.runner.run_score_step(plan, prompts)
        self._keep_hidden(len(rows))
        return logits[: len(rows)], scores
