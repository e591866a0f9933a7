"""The unified (`null` mode) engine with a prefix cache and, optionally, the host (L2) cache.

`CachedUnifiedEngine` is a `DecodeEngine` whose prompts are prefilled by the prefill
server's machinery on one device instead of its own whole-prompt prefill: a
`serving.prefill.build.PrefillEngine` with `cp_size 1` (a `CPPrefillRunner` on a
one-device mesh, its radix or `HiRadixCache`, the `PrefillScheduler` with chunked
prefill, the admission gates and, with `--enable-hierarchical-cache`, the
`HostCacheIO` load-backs and backups). The decode batch reads and donates the runner's
pool (`cpkv_jax.kv_store.CachedLaneStore`), so prefill and decode share one pool, one
page allocator and one lock, and the backup worker reads the pool between steps as it
does on a prefill server.

One request:
1. `add` validates it (as every unified request) and queues it (bounded FIFO);
2. it leaves the queue for the scheduler once a batch slot is free and the pool's free
   plus evictable pages cover `prompt + max_new_tokens` beyond what the requests
   already handed to the scheduler may still take (their whole need is counted until
   their prefill finishes, so the decode pages they take afterwards always exist);
3. the scheduler prefills it (prefix hits from the device and, with a host cache, host
   hits loaded back, SPEC S10); it finishes *held* (`hold_finished`): its whole prompt
   pages are in the cache and locked, the tail page its own;
4. the engine allocates its decode pages (evicting unlocked cached pages if needed),
   samples the first token from the prefill's logits and the request joins the decode
   batch;
5. when it finishes (or is aborted) its decode pages are freed and the hold released:
   the prompt's whole pages stay cached (evictable), the tail page is freed.

The final chunk's `meta` has `cached_tokens` (device + host hits) and
`cached_tokens_host` (loaded back from the host cache). Prefill runs one scheduler batch
per engine step, then one decode step for every running request. A failed prefill step
fails its batch's requests alone (`PrefillStepError`: their pages freed); the decode
batch goes on (`StepEngine`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from cpkv_jax.aot import CompileJob
from cpkv_jax.cache.radix import CacheCapacityError
from cpkv_jax.cp_decode import CPDecoder
from cpkv_jax.errors import CpkvError
from cpkv_jax.kv_store import CachedLaneStore
from serving.decode.engine import DecodeEngine, Touched
from serving.decode.intake import check_prompt_logprobs_from
from serving.decode.request import DecodeRequest
from serving.engine.api import EngineStats, GenerateRequest, ServerMode, prompt_scores
from serving.engine.step_failures import check_pool_after, step_failure
from serving.engine.stopping import StopResult
from serving.prefill.build import PrefillEngine
from serving.prefill.scheduler import PrefillOutcome, PrefillStepError

logger = logging.getLogger(__name__)


class CachedPrefill:
    """The `Intake` of a unified server with a prefix cache (see the module docstring):
    queued requests go to the CP prefill scheduler at cp 1, and a finished (held)
    prefill joins the decode batch with its decode pages and first token."""

    mode: ServerMode = "null"
    prefills_with_engine_steps = False  # the runner prefills: its shapes are the CP step's
    first_token_on_host = True  # the scheduler hands the last position's logits over
    prefill_chunk = None  # the scheduler chunks its own steps
    failures = 0
    bytes_received = 0

    def __init__(self, prefill: PrefillEngine):
        if not prefill.scheduler.hold_finished:
            raise ValueError("the unified cached engine needs a scheduler with hold_finished")
        self.prefill = prefill
        self.scheduler = prefill.scheduler
        runner = prefill.runner
        self.store = CachedLaneStore(
            runner.kv, runner.allocator, prefill.cache, runner.layout.page_size,
            runner.layout.pages_per_rank,
        )  # fmt: skip
        self.prefilling: dict[str, DecodeRequest] = {}  # handed to the scheduler, not done
        # Pages of each lane the prefilling requests may still take (a request's logical
        # page p is on lane p % cp, so a CP mesh's admission counts by lane).
        self.reserved = np.zeros(self.store.cp_size, np.int64)
        # By request: its first decode page's logical index and the decode pages.
        self.decode_pages: dict[str, tuple[int, np.ndarray]] = {}
        self.prefix_cache_hit_tokens = 0

    def bind(self, engine: DecodeEngine) -> None:
        self.engine = engine

    def counts(self) -> tuple[int, int]:
        return 0, len(self.prefilling)  # prefilling requests count as running

    def validate(self, req: GenerateRequest) -> None:
        check_prompt_logprobs_from(self.engine, req)

    def add(self, r: DecodeRequest) -> bool:
        return False

    def lookup(self, rid: str) -> DecodeRequest | None:
        return self.prefilling.get(rid)

    def in_flight(self) -> Iterable[DecodeRequest]:
        return self.prefilling.values()

    def discard(self, r: DecodeRequest, why: str) -> bool:
        if self.prefilling.pop(r.rid, None) is None:
            return False
        self.reserved -= self._need(r)
        self.engine.give_back_slot(r)
        # Frees what its prefill allocated and unlocks its prefix.
        if self.scheduler.abort(r.rid) is None:
            logger.error("request %s: the scheduler no longer has it to abort", r.rid)
        return True

    def release(self, r: DecodeRequest) -> None:
        self.engine.give_back_slot(r)
        if r.pages is None:
            return
        self.store.free_logical(*self.decode_pages.pop(r.rid))
        self.scheduler.release_held(r.rid)  # whole prompt pages stay cached, tail freed
        r.pages = None

    def stats(self, base: EngineStats) -> EngineStats:
        cache = self.prefill.cache
        return dataclasses.replace(
            base,
            kv_pages_free=(self.store.num_free_pages,),
            kv_pages_cached=(int(cache.total_pages_per_lane().sum()),),
            prefix_cache_hit_tokens=self.prefix_cache_hit_tokens,
            admission_rejections={**base.admission_rejections, **self.scheduler.rejections},
        )

    # ---- prefill through the scheduler -------------------------------------------------
    def advance(self, touched: Touched, idle: bool) -> None:
        e = self.engine
        # Pages a backup is reading stay protected until its acknowledgement is applied.
        self.scheduler.sync_host_cache()
        if not self._hand_over() and not e.running and not self.prefilling:
            # The head waits for pages only in-flight backups hold: wait for them (the
            # worker is bounded by its queue), not spin.
            self.scheduler.sync_host_cache(wait=True)
            self._hand_over()
        if not self.scheduler.num_waiting:
            return
        try:
            outcomes = self.scheduler.step()
        except PrefillStepError as exc:  # its requests were dropped: they fail, the rest go on
            outcomes = exc.outcomes
            failed = [o.rid for o in outcomes if o.status == "failed"]
            check_pool_after(exc, str(exc), self.store.pool, failed)
        for outcome in outcomes:
            r = self.prefilling.pop(outcome.rid)
            self.reserved -= self._need(r)
            if outcome.status == "failed":
                e.end(r, outcome.reason, touched)  # logged with the step's traceback
            elif outcome.status != "finished":
                e.fail(r, f"prefill {outcome.status}: {outcome.reason}", touched)
            else:
                self._start_decoding_safely(r, outcome, touched)

    def _start_decoding_safely(
        self, r: DecodeRequest, outcome: PrefillOutcome, touched: Touched
    ) -> None:
        """`_start_decoding`, but a failure there fails this request alone."""
        try:
            self._start_decoding(r, outcome, touched)
        except Exception as exc:
            logger.exception("request %s: starting its decode failed", r.rid)
            if r.pages is None:  # its decode pages were never added: only the hold to end
                self.scheduler.release_held(r.rid)
            self.engine.discard(r, "its decode could not start")
            self.engine.end(r, step_failure("starting this request's decode", exc), touched)

    def _hand_over(self) -> bool:
        """Queue heads to the scheduler while a slot and their worst-case pages are free;
        False when the head must wait for pages."""
        e = self.engine
        while (r := e.queue.head()) is not None:
            active = len(e.running) + len(self.prefilling)
            if active >= e.max_running_requests:
                return True
            if (self.store.available_pages_per_lane() - self.reserved < self._need(r)).any():
                return False  # FIFO: nobody overtakes the head of the queue
            if not e.penalty_slot_free(r):
                return True  # waits for a penalized request to finish, as for a batch slot
            e.queue.pop(r.rid)
            try:
                self.scheduler.submit(
                    r.rid,
                    r.prompt,
                    max_new_tokens=r.req.sampling.max_new_tokens,
                    score_from=r.req.prompt_logprobs_from,
                )
            except CpkvError as exc:  # validated in `add`: only a bug gets here; fail it alone
                logger.error("request %s: the scheduler refused it: %s", r.rid, exc)
                r.finish, r.error = StopResult("error"), str(exc)
                e.finals.append(e.chunk(r))
                continue
            self.prefilling[r.rid] = r
            e.take_slots(r)
            self.reserved += self._need(r)
        return True

    def _need(self, r: DecodeRequest) -> np.ndarray:
        """The most pages of each lane `r` can take: all of its `n_pages` (prefix hits
        are locked, not free, so this is its worst case)."""
        return self.store.pages_per_lane(0, r.n_pages)

    def _start_decoding(self, r: DecodeRequest, outcome, touched: Touched) -> None:
        e = self.engine
        assert outcome.table is not None and outcome.last_logits is not None
        prompt_pages = outcome.table.local_pages().astype(np.int64)
        extra = r.n_pages - prompt_pages.size
        try:
            decode_pages = self.store.allocate_logical(prompt_pages.size, extra)
        except CacheCapacityError as exc:  # the reservation rules this out: a bug, not load
            logger.error("request %s: reserved decode pages missing: %s", r.rid, exc)
            self.scheduler.release_held(r.rid)
            e.fail(r, f"internal error: no KV pages for the output ({exc})", touched)
            return
        self.decode_pages[r.rid] = (prompt_pages.size, decode_pages)
        # Global page ids, logical page p on lane p % cp (one lane: the local ids).
        r.pages = self.store.global_ids(np.concatenate([prompt_pages, decode_pages]))
        r.cached_tokens = outcome.cached_tokens
        r.host_cached_tokens = outcome.host_cached_tokens
        self.prefix_cache_hit_tokens += outcome.cached_tokens
        if outcome.prompt_logprobs is not None:
            r.prompt_scores = prompt_scores(outcome.prompt_logprobs, r.req.top_logprobs)
        e.start(r)
        if e.spec is not None:  # its drafts start from the prefill's last hidden state
            assert outcome.last_hidden is not None, "a speculative engine's runner drafts"
            e.start_drafting(r, outcome.last_logits, outcome.last_hidden, touched)
            return
        # A failed token fails this request alone; the logits are one host row.
        e.sample(r, np.asarray(outcome.last_logits)[None], touched)


class CachedUnifiedEngine(DecodeEngine):
    """A `DecodeEngine` whose intake is `CachedPrefill` over `prefill` (the unified
    server's default), with the prefill engine's cache, host-cache info and close. On a
    CP mesh (`prefill`'s runner has `cp_size > 1`, page-owned KV) its decode steps are
    `CPMeshDecodeSteps` over the runner's pools: no request's KV leaves its owners."""

    def __init__(self, *, prefill: PrefillEngine, **kw: Any):
        intake = CachedPrefill(prefill)
        if prefill.runner.cp.cp_size > 1:  # a CP mesh: decode where the pages live too
            kw["cp_decoder"] = CPDecoder(prefill.runner)
        super().__init__(kv=intake.store, intake=intake, **kw)
        self.prefill = prefill
        self.cached = intake

    @property
    def scheduler(self):
        return self.prefill.scheduler

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self.cached.prefix_cache_hit_tokens

    def hicache_info(self) -> dict[str, Any] | None:
        return self.prefill.hicache_info()

    def score_compile_jobs(self) -> list[CompileJob]:
        """The CP runner's scoring twins (its scheduler holds at most
        `max_running_requests`: the waiting ones and the chunked one)."""
        return self.prefill.score_compile_jobs(self.max_running_requests - 1)

    def close(self) -> None:
        self.prefill.close()
