"""The decode engine: paged KV, continuous batching, streaming chunks.

One `DecodeEngine` runs the batch for every server mode behind the `StepEngine` contract
(`serving.engine.api`), built from parts that each do one job:

- the wait queue and admission (`serving.engine.wait_queue.WaitQueue`, bounded by
  `max_queued_requests`: a full queue refuses with `QueueFullError`, HTTP 503 +
  Retry-After): a request leaves it, in arrival order, once a batch slot and its pages
  are free (on a DP mesh, on the rank `decode_mesh.choose_rank` picks);
- the intake (`serving.decode.intake`): how an admitted request's prompt KV and first
  token arrive - a prefill by the engine's own steps (`LocalPrefill`, unified with
  `--disable-radix-cache`: whole prompts or chunks), a PD transfer room (`TransferIntake`, decode
  mode), the CP prefill scheduler with the prefix cache (`cached.CachedPrefill`, the
  unified default on one device or a CP mesh), or the engine's own prefill from a
  prefix cache per DP rank (`dp_prefix.DPPrefixPrefill`, the unified default on a DP
  mesh);
- the KV store (`cpkv_jax.kv_store.KVStore`): the pool, donated to every step through
  `update_pool`, and its page allocator;
- the step executor (`serving.decode.steps.DecodeSteps`, `MeshDecodeSteps` on a DP
  mesh): one compiled program per bucketed shape, attention reading only each row's
  top-k latent rows from the pool;
- the placement (`serving.decode.placement`): which rank a request is admitted to and
  where its pages go (one rank's shard, or striped over a CP group's lanes);
- the sampler (`serving.decode.sampler.RowSampler`): draws on the device with the rows'
  penalties and grammar masks;
- the batch itself (here): one decode step per engine step for every running row, stop
  checks, chunks, failures.

With `batch_invariant=True` (`cpkv-serve --enable-batch-invariant`) every step uses
batch-invariant numerics, so a request's tokens and log-probs do not depend on the rows
it is batched with; `block_bytes` (`--transient-block-size`) bounds the prefill's
indexer and sparse-attention token blocks.

Pages: a request reserves pages for `prompt + max_new_tokens` when it is admitted and
keeps them until it finishes, so a running request never needs more and no preemption
exists. A request that could never fit (past `context_length`, or larger than the whole
pool) is refused in `add` with `InputError`, before anything is allocated.

Data-parallel decode (`mesh=`, `cpkv-serve --dp-size N`, issue 36): the pool is split
into one shard per rank (`PageAllocator(ranks=N)`), a request is admitted to one rank
(`decode_mesh.choose_rank`: most free pages, then fewest rows, then round robin) and its
pages and rows stay there; a unified server prefills up to one admitted request per rank
in one step; every step runs all ranks' rows (`MeshDecodeSteps`), rows per rank bounded
by `ceil(max_running_requests / N)`.

On a CP mesh (`cp_decoder=`, `--cp-size N --enable-cp-shared-kv` on a unified or decode
server, issue 40) the step executor is `CPMeshDecodeSteps` (with speculative decoding,
`SpeculativeSteps` over the group's runner) and the mesh is one group: a
request's pages are global page ids with logical page `p` on rank `p % N` (the unified
server's `cached.CachedPrefill` allocates them so on the CP runner's pool; a decode
server's `admit` takes each lane's share from that lane's shard, where the transfer
receiver then scatters each page by position), and the decode attends where they live.

Shapes (bounded compiles): decode batch rows are padded to a power of two (padding rows
have `valid=False` and write into the trash page), and the page-table width to a power
of two of the longest reservation in the batch; prefill pads the prompt to
`buckets.prefill_bucket(len)` and the table to a power of two of the reservation.

Overlap (default; `overlap=False` is `--disable-overlap-schedule`): each `step`
dispatches the next decode step before it fetches the previous one's tokens, the ids of
rows that continue fed from that draw on the device (`_decode_step`), so a finished
request's final chunk comes one step after its last token was drawn. A step with a
structured-output row (`serving.grammar`) fetches first: its mask needs the tokens.

All methods run on the engine thread (`serving.engine.loop.EngineLoop`); only `stats`
may be called from another thread (it reads a snapshot).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from cpkv_jax.aot import CompileJob
from cpkv_jax.buckets import pow2_at_least
from cpkv_jax.config import ModelConfig
from cpkv_jax.cp_decode import CPDecoder
from cpkv_jax.errors import ConfigError, InputError
from cpkv_jax.kv_store import KVStore, PagedKVStore
from cpkv_jax.model.expert_parallel import EPDispatch
from cpkv_jax.model.kv_cache import (
    INDEX_K_DTYPES,
    SINGLE_DEVICE_KV_IO,
    IndexKDtype,
    PagedKVIO,
    init_pool,
)
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.paging import PageAllocator, pages_for_tokens
from cpkv_jax.sampling import PendingSample, StepLogits, TopLogprobs, top_pairs
from cpkv_jax.scores import span_scores
from serving.decode.intake import Intake, LocalPrefill, TransferIntake, TransferRooms
from serving.decode.placement import RankPlacement, StripedPlacement
from serving.decode.request import DecodeRequest
from serving.decode.sampler import PENALTY_SLOTS_MAX, RowSampler
from serving.decode.speculative import (
    SPEC_PREFILL_FORMS,
    SPEC_SLOTS_MAX,
    RowPenalty,
    SpecInFlight,
    SpeculativeSteps,
    refusal,
    speculative_room,
)
from serving.decode.steps import (
    CPMeshDecodeSteps,
    DecodeSteps,
    MeshDecodeSteps,
    reachable_shapes,
)
from serving.engine.api import (
    EngineStateLostError,
    EngineStats,
    GenerateRequest,
    OutputChunk,
    SamplingParams,
    ServerMode,
    stop_token_bias,
)
from serving.engine.step_failures import check_pool_after, pool_damage, step_failure
from serving.engine.stopping import Detokenize, StopChecker, StopResult, request_seed
from serving.engine.wait_queue import WaitQueue
from serving.grammar import GrammarBackend, row_grammar_for

logger = logging.getLogger(__name__)

# Decode mode with only transfers in flight: `step` waits this long for a room to change.
DEFAULT_IDLE_WAIT_S = 0.005

# The requests a step produced for, by rid: their chunks come back from this step.
Touched = dict[str, DecodeRequest]


@dataclasses.dataclass
class _InFlight:
    """A dispatched decode step whose tokens are not fetched yet: its rows, in the step's
    row order, and its draw (the tokens stay on the device for the next step's ids)."""

    rows: list[DecodeRequest]
    drawn: PendingSample
    row_of: dict[str, int]  # rid -> its row in `rows` and the draw
    dispatched_at: float = 0.0  # the engine's clock when it was dispatched


class DecodeEngine:
    """Continuous-batching decode (see the module docstring). `mode` picks the intake
    ("null": `LocalPrefill`; "decode": `TransferIntake` over `kv`, which must be a
    transfer receiver) unless `intake` is given."""

    def __init__(
        self,
        *,
        cfg: ModelConfig,
        model: CausalLM,
        kv: KVStore,
        page_size: int,
        index_k_dtype: IndexKDtype,
        mode: ServerMode | None = None,
        intake: Intake | None = None,
        max_running_requests: int,
        context_length: int | None = None,
        detokenize: Detokenize | None = None,
        clock: Callable[[], float] = time.monotonic,
        batch_invariant: bool = False,
        block_bytes: int | None = None,
        max_queued_requests: int | None = None,
        idle_wait_s: float = DEFAULT_IDLE_WAIT_S,
        kv_io: PagedKVIO = SINGLE_DEVICE_KV_IO,
        mesh: Mesh | None = None,
        ep_dispatch: EPDispatch = "allgather",
        ep_capacity_factor: float | None = None,
        penalty_slots: int | None = None,
        overlap: bool = True,
        grammar: GrammarBackend | None = None,
        speculative_num_steps: int = 0,
        speculative_slots: int | None = None,
        cp_decoder: CPDecoder | None = None,
        prefill_chunk: int | None = None,
    ):
        intake = self._intake_for(mode, intake, kv, idle_wait_s, prefill_chunk)
        if speculative_num_steps and intake.prefill_chunk is not None:
            raise ConfigError(
                "a speculative engine prefills whole prompts (its admission drafts from the "
                "prompt's last position in the same program): no prefill chunk"
            )
        if cp_decoder is not None and mesh is not None:
            raise ConfigError("decode on a CP mesh is one group: no DP mesh beside it")
        if index_k_dtype not in INDEX_K_DTYPES:
            raise ConfigError(
                f"index K dtype {index_k_dtype!r} is not one of {sorted(INDEX_K_DTYPES)}"
            )
        if max_running_requests < 1:
            raise ConfigError(f"max_running_requests must be >= 1, got {max_running_requests}")
        pool = kv.pool
        if pool.page_size != page_size:
            raise ConfigError(f"the KV pool has page size {pool.page_size}, not {page_size}")
        self.cfg = cfg
        self.kv = kv
        self.intake = intake
        self.mode: ServerMode = intake.mode
        self.page_size = page_size
        self.max_running_requests = max_running_requests
        self.context_length = (
            cfg.max_position_embeddings if context_length is None else context_length
        )
        if not 1 <= self.context_length <= cfg.max_position_embeddings:
            raise ConfigError(
                f"context_length {self.context_length} must be in [1, "
                f"max_position_embeddings={cfg.max_position_embeddings}]"
            )
        self.detokenize = detokenize
        # Dispatch step n+1 before fetching step n's tokens (`_decode_step`); False: fetch
        # each step's tokens before the next is built (`--disable-overlap-schedule`).
        self.overlap = overlap
        self._in_step: _InFlight | SpecInFlight | None = None
        self.grammar = grammar  # None: a request with a grammar is refused
        self._clock = clock
        # Data-parallel decode (`--dp-size`): the pool splits into one shard per rank,
        # each with its trash page; a request's pages and rows stay on one rank.
        self.mesh = mesh
        # Admission ranks: DP ranks, or a CP decoder's groups (one CP group: one rank).
        self.dp_size = mesh.size if mesh is not None else 1
        if cp_decoder is not None:
            self.dp_size = cp_decoder.groups
        self.steps: DecodeSteps | MeshDecodeSteps | CPMeshDecodeSteps | SpeculativeSteps
        # Speculative decoding (`--speculative-num-steps`): drafts from the MTP layer,
        # verified by the trunk, in one step executor (`serving.decode.speculative`).
        self.spec: SpeculativeSteps | None = None
        self.room = 0  # tokens of pages a request reserves beyond prompt + max_new_tokens
        # Where a request's pages go and what admission counts (`serving.decode.placement`):
        # on one rank, or striped over a CP group's lanes.
        self.placement: RankPlacement | StripedPlacement = RankPlacement(
            self.dp_size, pool.num_pages
        )
        if speculative_num_steps:
            # At most SPEC_SLOTS_MAX slots (`max_running_requests` may be the pool's
            # pages), split evenly over the DP ranks (a CP group's ranks); requests beyond
            # them wait to be admitted, as for penalty slots.
            slots = speculative_slots or min(max_running_requests, SPEC_SLOTS_MAX)
            slot_ranks = self.dp_size
            if cp_decoder is not None:  # every CP rank of every group
                slot_ranks = cp_decoder.groups * cp_decoder.runner.cp.cp_size
            self.spec = self.steps = SpeculativeSteps(
                model,
                kv,
                num_steps=speculative_num_steps,
                slots=-(-slots // slot_ranks),
                page_size=page_size,
                index_k_dtype=index_k_dtype,
                batch_invariant=batch_invariant,
                block_bytes=block_bytes,
                kv_io=kv_io,
                mesh=mesh if self.dp_size > 1 else None,
                ep_dispatch=ep_dispatch,
                ep_capacity_factor=ep_capacity_factor,
                cp_decoder=cp_decoder,
            )
            self.room = speculative_room(speculative_num_steps, overlap)
            if cp_decoder is not None:  # pages striped over the group's lanes
                self.placement = StripedPlacement.of(cp_decoder, bucketed=False)
        elif cp_decoder is not None:  # a unified server on a CP mesh (issue 40)
            self.steps = CPMeshDecodeSteps(cp_decoder)
            self.placement = StripedPlacement.of(cp_decoder)
        elif self.dp_size > 1:
            assert mesh is not None
            self.steps = MeshDecodeSteps(
                model,
                kv,
                mesh,
                page_size,
                index_k_dtype,
                batch_invariant,
                block_bytes,
                kv_io,
                ep_dispatch,
                ep_capacity_factor,
            )
        else:
            self.steps = DecodeSteps(
                model, kv, page_size, index_k_dtype, batch_invariant, block_bytes, kv_io
            )
        self._usable_pages = self.placement.usable_pages  # per rank
        self._max_rows_per_rank = -(-max_running_requests // self.dp_size)
        self.admitted_per_rank = [0] * self.dp_size  # requests each rank has taken
        self._next_rank = 0  # ties between ranks go round robin from here
        self.bytes_per_page = pool.nbytes() // pool.num_pages
        # Waiting for pages and a batch slot (null: to prefill; decode: to register its room).
        self.queue: WaitQueue[DecodeRequest] = WaitQueue(
            max_queued_requests, what="unified" if self.mode == "null" else "decode", clock=clock
        )
        self.running: dict[str, DecodeRequest] = {}
        self.finals: list[OutputChunk] = []  # chunks due on the next step (aborts, refusals)
        self._rejections: collections.Counter[str] = collections.Counter()
        # Decode steps fetched and their seconds, by kind (`_timed`): `/metrics`.
        self._step_seconds: dict[str, tuple[int, float]] = {}
        self._last_fetch: float | None = None
        self._snapshot: tuple[Any, ...] = (0, 0, 0, 0, (), self.queue.stats(), (), {})
        # At most PENALTY_SLOTS_MAX slots: `max_running_requests` may be the pool's pages
        # (a speculative engine keeps its rows' penalties in their draft state: one slot).
        slots = 1 if self.spec else min(max_running_requests, PENALTY_SLOTS_MAX)
        self.sampler = RowSampler(
            cfg,
            slots if penalty_slots is None else penalty_slots,
            self.steps.logits_sharding,
            grammar,
            batch_invariant,
            state_sharding=self.steps.state_sharding,
        )
        intake.bind(self)

    @staticmethod
    def _intake_for(
        mode: ServerMode | None,
        intake: Intake | None,
        kv: KVStore,
        idle_wait_s: float,
        prefill_chunk: int | None,
    ) -> Intake:
        if intake is not None:
            if mode not in (None, intake.mode):
                raise ConfigError(f"mode {mode!r} does not match the {intake.mode!r} intake")
            if prefill_chunk is not None:
                raise ConfigError("give the prefill chunk to the intake, not the engine")
            return intake
        if mode == "null":
            return LocalPrefill(prefill_chunk)
        if prefill_chunk is not None:
            raise ConfigError(f"a {mode!r} engine does not prefill: no prefill chunk")
        if mode == "decode":
            if not isinstance(kv, TransferRooms):
                raise ConfigError(
                    f"decode mode needs a KV store that registers transfer rooms (a "
                    f"transfer.receiver.Receiver), got {type(kv).__name__}"
                )
            return TransferIntake(kv, idle_wait_s)
        raise ConfigError(
            f"DecodeEngine serves modes 'null' and 'decode', got {mode!r}; the prefill "
            "mode runs the CP prefill scheduler"
        )

    # ---- StepEngine ----------------------------------------------------------------------
    def add(self, req: GenerateRequest) -> None:
        """Validate and queue the request (an intake may take it at once when it fits and
        nobody waits before it: a decode server registers its room).

        Raises `InputError` for a request this engine can never serve and
        `QueueFullError` when the wait queue is full; nothing is held then.
        """
        try:
            r = self._validate(req)
            if not self.intake.add(r):
                self.queue.push(r.rid, r)
        finally:
            self._update_snapshot()

    def abort(self, rid: str) -> None:
        """Cancel `rid` and free what it holds; its "abort" chunk comes with the next
        step. Unknown (or already finished) ids are ignored."""
        r = self._lookup(rid)
        if r is None:
            logger.debug("abort of unknown or finished request %s ignored", rid)
            return
        self.discard(r, "the request was aborted")
        r.finish = StopResult("abort")
        self.finals.append(self.chunk(r))
        self._update_snapshot()

    def has_work(self) -> bool:
        return bool(
            self.finals
            or self.queue
            or any(True for _ in self.intake.in_flight())
            or self.running
            or self._in_step is not None
        )

    def step(self) -> Sequence[OutputChunk]:
        """One unit of work: pending final chunks, the intake's turn (admit, prefill or
        poll transfers), then one batched decode step.

        A failed model step fails the requests it served, one request's failed token
        fails that request (`StepEngine`); `EngineStateLostError` when the pool is lost.
        """
        finals, self.finals = self.finals, []
        touched: Touched = {}
        try:
            idle = not finals and not self.running and not self._in_step
            self.intake.advance(touched, idle)
            self._decode_step(touched)
        except EngineStateLostError:
            raise
        except Exception as e:  # a bug past the guarded steps: fail what this step served
            self.step_failed("the engine step", e, self._in_flight(), touched)
        finally:
            self._update_snapshot()
        return [*finals, *(self.chunk(r) for r in touched.values())]

    def stats(self) -> EngineStats:
        """A snapshot; safe from any thread."""
        waiting, running, failures, received, rejections, queue, per_rank, steps = self._snapshot
        base = EngineStats(
            mode=self.mode,
            waiting=waiting,
            running=running,
            kv_pages_total=(self._usable_pages,) * self.dp_size,
            kv_pages_free=self._free_pages(),
            kv_bytes_per_page=self.bytes_per_page,
            transfer_bytes=received,
            transfer_failures=failures,
            admission_rejections=dict(rejections),
            queue=queue,
            running_per_rank=per_rank,
            decode_step_seconds=steps,
        )
        return self.intake.stats(base)

    # ---- admission -----------------------------------------------------------------------
    def _free_pages(self) -> tuple[int, ...]:
        """Free pages per DP rank (a CP group is one: its lanes summed)."""
        return self.placement.free_pages(self.kv.num_free_pages_per_rank)

    def reject(self, kind: str, message: str) -> InputError:
        """An `InputError` refusing a request, counted by `kind`."""
        self._rejections[kind] += 1
        return InputError(message)

    def _validate(self, req: GenerateRequest) -> DecodeRequest:
        cfg = self.cfg
        rid = req.rid
        if self._lookup(rid) is not None:
            raise self.reject("duplicate_rid", f"request id {rid!r} is already in flight")
        n = len(req.input_ids)
        if n == 0:
            raise self.reject("empty_prompt", "the prompt is empty: give at least one token")
        prompt = np.asarray(req.input_ids, dtype=np.int64)
        bad = prompt[(prompt < 0) | (prompt >= cfg.vocab_size)]
        if bad.size:
            raise self.reject(
                "bad_token",
                f"token id(s) {bad[:5].tolist()} outside the vocabulary [0, {cfg.vocab_size})",
            )
        try:
            req.sampling.validate(cfg.vocab_size)
        except InputError as e:
            raise self.reject("bad_sampling", str(e)) from e
        if self.spec is not None and (why := refusal(req)) is not None:
            raise self.reject("speculative_sampling", why)
        max_new = req.sampling.max_new_tokens
        total = n + max_new
        if total > self.context_length:
            raise self.reject(
                "too_long",
                f"prompt ({n} tokens) + max_new_tokens ({max_new}) = {total} exceeds the "
                f"context length {self.context_length}; shorten the prompt or ask for fewer "
                "tokens",
            )
        n_pages = pages_for_tokens(total + self.room, self.page_size)
        if n_pages > self._usable_pages:
            room = f" (+ {self.room} of speculative room)" if self.room else ""
            raise self.reject(
                "pool_capacity",
                f"prompt + max_new_tokens = {total} tokens{room} need {n_pages} KV pages of "
                f"{self.page_size} but the whole pool has {self._usable_pages}; ask for fewer "
                "tokens or start the server with a larger KV pool",
            )
        try:
            stop = StopChecker(req.sampling, cfg.eos_token_ids, self.detokenize)
        except InputError as e:
            raise self.reject("stop_strings", str(e)) from e
        row_grammar = None
        if req.sampling.grammar is not None:
            try:
                row_grammar = row_grammar_for(self.grammar, req.sampling.grammar)
            except InputError as e:
                raise self.reject("bad_grammar", str(e)) from e
        self.intake.validate(req)
        return DecodeRequest(
            req=req,
            prompt=prompt.astype(np.int32),
            # The same rule as the prefill server's (PD: it samples token 0, we the rest).
            seed=request_seed(req),
            n_pages=n_pages,
            width=pow2_at_least(n_pages),
            stop=stop,
            grammar=row_grammar,
        )

    def fits_now(self, r: DecodeRequest) -> bool:
        """A batch slot and the request's pages are free (requests the intake holds
        count), and a penalty slot if it needs one (a draft-state slot when speculative)."""
        return self.rank_for(r) is not None and self.penalty_slot_free(r)

    def rank_for(
        self,
        r: DecodeRequest,
        free: Sequence[int] | None = None,
        cached: Sequence[int] | None = None,
        host: Sequence[int] | None = None,
    ) -> int | None:
        """The rank `r` would be admitted to now (`decode_mesh.choose_rank`), or None:
        the total batch is full, or no rank has a row and `r`'s pages free. An intake
        with a prefix cache per rank gives `cached` (leading pages of `r` each rank
        caches), `free` (pages each rank can give beyond them) and, with host caches,
        `host` (the pages after `cached` each rank's host cache holds)."""
        held = sum(1 for _ in self.intake.in_flight())
        if held + len(self.running) >= self.max_running_requests:
            return None
        free = tuple(self.kv.num_free_pages_per_rank if free is None else free)
        if self.spec is not None:  # a rank without a free draft-state slot takes no one
            per = len(free) // self.dp_size  # shards of one admission rank (a group's lanes)
            free = tuple(f if self.spec.free_slots_on(k // per) else 0 for k, f in enumerate(free))
        return self.placement.choose(
            free,
            self._rows_per_rank(),
            r.n_pages,
            self._max_rows_per_rank,
            self._next_rank,
            cached,
            host,
        )

    def penalty_slot_free(self, r: DecodeRequest) -> bool:
        if self.spec is not None:  # its penalties live in its draft-state slot
            return self.spec.free_slots > 0
        return self.sampler.slot_free(r, {q.rid for q in self._in_flight()})

    def admit(self, r: DecodeRequest, rank: int, pages: np.ndarray | None = None) -> None:
        """Allocate `r`'s pages on `rank` (a CP group: logical page `p` on lane `p % cp`),
        or take `pages` its intake allocated there, and reserve its penalty slot
        (`fits_now`)."""
        r.pages = self.placement.allocate(self.kv, r.n_pages, rank) if pages is None else pages
        r.rank = rank
        self.take_slots(r)
        self.admitted_per_rank[rank] += 1
        self._next_rank = (rank + 1) % self.dp_size

    def take_slots(self, r: DecodeRequest) -> None:
        """Reserve `r`'s penalty slot (if it needs one) and its draft-state slot on its
        rank (a speculative engine); `fits_now` / `penalty_slot_free` said they are free."""
        if self.spec is not None:  # its penalties live in its draft-state slot
            r.slot = self.spec.take_slot(r.rank)
        else:
            self.sampler.reserve(r)

    def give_back_slot(self, r: DecodeRequest) -> None:
        """`r`'s draft-state slot back (once)."""
        if r.slot is not None:
            assert self.spec is not None
            self.spec.give_back(r.slot)
            r.slot = None

    def start(self, r: DecodeRequest) -> None:
        """`r` joins the decode batch (its first token comes from its intake)."""
        self.running[r.rid] = r

    # ---- the decode batch ----------------------------------------------------------------
    def _decode_step(self, touched: Touched) -> None:
        """Dispatch one decode step for every running row, then record the tokens of the
        step before it (overlap: the device computes this step meanwhile), or (without
        overlap) this step's own.

        A row that finished in the previous step was in this one too (the host did not
        know yet): its extra token is dropped, and its KV write landed inside its own
        reservation (`prompt + max_new_tokens` tokens) before its pages were reused
        (every later pool use is dispatched after this step)."""
        if self.spec is not None:
            self._spec_decode_step(self.spec, touched)
            return
        prev, self._in_step = self._in_step, None
        assert not isinstance(prev, SpecInFlight)
        if prev is not None and any(r.grammar for r in self.running.values()):
            # A grammar row's mask needs the token before it: this step waits for them.
            self._collect(prev, touched)
            prev = None
        rows = [r for r in self.running.values() if r.finish is None]
        if rows:
            try:
                self._in_step = self._launch(rows, prev)
            except Exception as e:
                self.step_failed("the decode step", e, rows, touched)
        if prev is not None:
            self._collect(prev, touched)
        if not self.overlap and self._in_step is not None:
            step, self._in_step = self._in_step, None
            self._collect(step, touched)

    def _launch(self, rows: list[DecodeRequest], prev: _InFlight | None) -> _InFlight:
        """Dispatch the step and its draw, fetching nothing. Each row feeds its last
        output token at position `kv_len`; a row of `prev` feeds the token `prev` drew
        for it, still on the device, one position further."""
        src = [-1] * len(rows)
        for i, r in enumerate(rows):
            if prev is not None and r.rid in prev.row_of:
                src[i] = prev.row_of[r.rid]
            assert r.pending == (src[i] >= 0), (r.rid, r.pending)
        logits = self.steps.decode(
            [(r.out_ids[-1], r.kv_len + r.pending, r.pages, r.n_pages) for r in rows],
            (prev.drawn.tokens, src) if prev is not None and max(src) >= 0 else None,
        )
        drawn = self.sampler.draw_async(rows, logits)
        for r in rows:
            r.pending += 1
        row_of = {r.rid: i for i, r in enumerate(rows)}
        return _InFlight(rows, drawn, row_of, self._clock())

    def _collect(self, step: _InFlight, touched: Touched) -> None:
        """Fetch `step`'s tokens and record those of rows still running (a row that
        finished or left since keeps nothing of it)."""
        for r in step.rows:
            r.pending -= 1
        live = [
            i for i, r in enumerate(step.rows) if r.finish is None and self.running.get(r.rid) is r
        ]
        if not live:
            return
        try:
            drawn = step.drawn.fetch()
        except Exception as e:
            self.step_failed("the decode step", e, [step.rows[i] for i in live], touched)
            return
        self._timed("decode", step.dispatched_at)
        for i in live:
            self.produce(step.rows[i], touched, functools.partial(drawn.pick, i))

    def _spec_decode_step(self, spec: SpeculativeSteps, touched: Touched) -> None:
        """`_decode_step` with draft and verify: each row emits 1..K+1 tokens per step;
        the overlap and a finished row's extra step as there (its writes land in the
        `speculative_room` its pages keep)."""
        prev, self._in_step = self._in_step, None
        rows = [r for r in self.running.values() if r.finish is None]
        if rows:
            greedy = all(r.req.sampling.temperature == 0 for r in rows)
            try:
                assert all(r.slot is not None and r.pages is not None for r in rows)
                out = spec.step([(r.slot, r.pages, r.n_pages) for r in rows], greedy)
                self._in_step = SpecInFlight(rows, out, self._clock())
            except Exception as e:
                self.step_failed("the speculative decode step", e, rows, touched)
        if prev is not None:
            self._spec_collect(prev, touched)
        if not self.overlap and self._in_step is not None:
            step, self._in_step = self._in_step, None
            self._spec_collect(step, touched)

    def _spec_collect(self, step: _InFlight | SpecInFlight, touched: Touched) -> None:
        """Fetch a speculative step's tokens and record, for each row still running, its
        accepted drafts and the token after them, up to where the row stops."""
        assert isinstance(step, SpecInFlight)  # a speculative engine dispatches no other
        live = [
            i for i, r in enumerate(step.rows) if r.finish is None and self.running.get(r.rid) is r
        ]
        if not live:
            return
        out = step.out
        # The top log-probs come to the host only when a row of the step asked for them.
        tops = (out.top_ids, out.top_logprobs) if any(_top_n(r) for r in step.rows) else ()
        try:
            tokens, accepted, lps, *top = jax.device_get(
                (out.tokens, out.accepted, out.logprobs, *tops)
            )
        except Exception as e:
            self.step_failed(
                "the speculative decode step", e, [step.rows[i] for i in live], touched
            )
            return
        self._timed("verify_draft", step.dispatched_at)
        for i in live:
            r = step.rows[i]
            a = int(accepted[i])
            r.spec_verify_ct += 1
            r.spec_emitted += a + 1
            for j in range(a + 1):
                at = (i, j)
                emitted = functools.partial(_emitted, tokens[at], lps[at], _pairs(r, top, at))
                self.produce(r, touched, emitted)
                if r.finish is not None:
                    break

    def _timed(self, kind: str, dispatched_at: float) -> None:
        """Count a decode step of `kind` whose tokens just reached the host, and its time:
        from its dispatch, or from when the step before it was fetched if that was later
        (with overlap a step is dispatched while the one before still runs, so this is
        the device's time on it in a busy batch, not the wait behind the other)."""
        now = self._clock()
        start = dispatched_at if self._last_fetch is None else max(dispatched_at, self._last_fetch)
        n, seconds = self._step_seconds.get(kind, (0, 0.0))
        self._step_seconds[kind] = (n + 1, seconds + (now - start))
        self._last_fetch = now

    # ---- compiles ------------------------------------------------------------------------
    @property
    def step_shapes(self) -> set[tuple[str, int, int, int]]:
        """Shapes dispatched to the model so far: (form, rows, tokens, width)."""
        return self.steps.shapes

    @property
    def compiled_step_shapes(self) -> set[tuple[str, int, int, int]]:
        """Step shapes whose executable is ready (shared by the engines of one model)."""
        return self.steps.compiled_shapes

    @property
    def step_compile_count(self) -> int:
        """Step compiles run so far (`DecodeSteps.compile_count`)."""
        return self.steps.compile_count

    def compile_estimate(self) -> tuple[int, float]:
        """Reachable step shapes not compiled yet and their estimated compile seconds."""
        return self.steps.compile_estimate(self.reachable_shapes())

    def compile_jobs(self) -> list[CompileJob]:
        """A background compile of every reachable step shape not compiled yet (smallest
        first), after the small programs around the steps ran here (`warm_log_probs`).
        A request that needs a shape meanwhile waits for its compile."""
        todo = self.reachable_shapes() - self.steps.compiled_shapes
        self.steps.warm_log_probs({rows for _, rows, _, _ in self.reachable_shapes()})
        self._warm_sampler(self.reachable_shapes())
        self.warm_feeds(self.reachable_shapes())
        return [
            CompileJob(f"decode step {s}", functools.partial(self.steps.compiled, s))
            for s in sorted(todo, key=lambda s: (s[3], s[1], s[2], s[0]))
        ]

    def score_compile_jobs(self) -> list[CompileJob]:
        """A background compile of the scoring twin (prompt log-probs) of every reachable
        prefill shape not compiled yet, narrowest first (`--warmup-prompt-scoring`);
        none where this engine's steps do not prefill (prompts prefilled elsewhere)."""
        if not self.intake.prefills_with_engine_steps:
            return []
        steps = self.steps
        # (a CP mesh never prefills with its steps; a speculative engine's prefill shapes
        # have scoring twins of their own)
        assert isinstance(steps, DecodeSteps | MeshDecodeSteps | SpeculativeSteps)
        reachable = self.reachable_shapes()
        if self.spec is not None:  # (its verify steps feed K + 1 tokens too)
            prefills = {s for s in reachable if s[0] in SPEC_PREFILL_FORMS}
        else:
            prefills = {s for s in reachable if s[2] > 1}
        prefills -= steps.compiled_score_shapes
        return [
            CompileJob(f"prompt-scoring step {s}", functools.partial(steps.compiled_score, s))
            for s in sorted(prefills, key=lambda s: (s[3], s[1], s[2], s[0]))
        ]

    def reachable_shapes(self) -> set[tuple[str, int, int, int]]:
        """Every shape this engine's requests can reach (`steps.reachable_shapes`); its own
        prefills only when its intake prefills with them (a decode server's prompts arrive
        as KV, the cached unified engine's through the CP runner)."""
        plain = reachable_shapes(
            prefill_form=self.steps.prefill_form,
            page_size=self.page_size,
            context_length=self.context_length,
            usable_pages=self._usable_pages,
            max_running_requests=self._max_rows_per_rank,  # rows per rank
            prefill=self.intake.prefills_with_engine_steps,
            room=self.room,
            prefill_chunk=self.intake.prefill_chunk,
        )
        if self.spec is None:
            return self.as_run(plain)
        return self.spec.shapes_for(plain, self.spec_admission)

    @property
    def spec_admission(self) -> str | None:
        """How a speculative engine's requests get their first drafts
        (`speculative.ADMISSION_FORMS`): None when it prefills them itself, else from
        the logits or the token of the prefill that ran elsewhere."""
        if self.intake.prefills_with_engine_steps:
            return None
        return "logits" if self.intake.first_token_on_host else "token"

    def as_run(self, shapes: set[tuple[str, int, int, int]]) -> set[tuple[str, int, int, int]]:
        """The step shapes `shapes` (rows and width powers of two) run as: themselves,
        or on a CP mesh raised to its rows and width (`CPMeshDecodeSteps.bucket`)."""
        return self.placement.as_run(shapes)

    def warm_shapes(self, shapes: set[tuple[str, int, int, int]]) -> int:
        """Compile (run once, on the trash page) those of `shapes` this engine can reach
        and has not run; returns how many. Before serving only: it donates the pool."""
        todo = sorted((self.as_run(shapes) & self.reachable_shapes()) - self.steps.shapes)
        self.steps.warm(todo)
        self._warm_sampler(set(todo))
        self.warm_feeds(set(todo))
        return len(todo)

    def warm_all_shapes(self, already: set[tuple[str, int, int, int]] = frozenset()) -> int:
        """Compile (run once, on the trash page) every reachable shape not run yet here
        nor in `already` (another engine's on the same model: the compiled programs are
        shared); returns how many. Before serving only: it donates the pool."""
        todo = sorted(self.reachable_shapes() - self.steps.shapes - already)
        self.steps.warm(todo)
        self._warm_sampler(self.reachable_shapes())
        self.warm_feeds(self.reachable_shapes())
        return len(todo)

    def warm_feeds(self, shapes: set[tuple[str, int, int, int]]) -> None:
        """With overlap, compile the feed of drawn tokens into the next step's ids between
        every two decode row buckets among `shapes` and the steps run so far (rows join
        and leave, so a draw of any bucket feeds a step of any other)."""
        if self.overlap:
            self.steps.warm_feeds(
                {rows for _, rows, tokens, _ in (*shapes, *self.steps.shapes) if tokens == 1}
            )

    def _warm_sampler(self, shapes: set[tuple[str, int, int, int]]) -> None:
        if self.spec is not None:
            return  # the speculative steps draw inside their own programs
        self.sampler.warm(
            {self.steps.logit_rows(n) for _, n, _, _ in shapes}, self.intake.first_token_on_host
        )

    # ---- producing tokens ----------------------------------------------------------------
    def sample(self, r: DecodeRequest, logits: Any, touched: Touched) -> None:
        """Draw `r`'s next token from its logit row (`[1, vocab]`, on the device or the
        host) and record it."""
        self.produce(r, touched, lambda: self.sampler.draw([r], StepLogits(logits)).pick(0))

    def produce(
        self,
        r: DecodeRequest,
        touched: Touched,
        pick: Callable[[], tuple[int, float, TopLogprobs]],
    ) -> None:
        """Record the token `pick` gives; if that raises (a broken log-prob row, the
        request's detokenizer in its stop check) only `r` fails: the other rows of the
        step go on."""
        n = len(r.out_ids)
        try:
            tok, logprob, top = pick()
            self._record(r, tok, float(logprob), top)
        except Exception as e:
            logger.exception("request %s: output token %d could not be produced", r.rid, n)
            del r.out_ids[n:], r.out_lps[n:], r.out_tops[n:]  # no half-made token in the error
            message = step_failure(f"output token {n} of this request", e)
            self.discard(r, message)
            self.end(r, message, touched)
            return
        touched[r.rid] = r

    def _record(self, r: DecodeRequest, tok: int, logprob: float, top: TopLogprobs) -> None:
        """Append one output token; finish the request if it stops here."""
        if r.first_token_at is None:
            r.first_token_at = self._clock()
        if r.grammar is not None:
            r.grammar.accept(tok)  # a token it did not allow fails this request (`produce`)
        r.out_ids.append(tok)
        r.out_lps.append(logprob)
        r.out_tops.append(top)
        done = r.stop.append(tok)
        if done is None and r.grammar is not None and r.grammar.done:
            # The grammar ended (with EOS, which it alone allows at its end, ignore_eos
            # or not): "stop", the EOS left out of the text as a stop token.
            eos = tok in self.cfg.eos_token_ids
            done = StopResult("stop", matched_token=tok if eos else None)
        if done is not None:
            r.finish = done
            self.running.pop(r.rid, None)
            self.intake.release(r)

    # ---- failures and endings --------------------------------------------------------------
    def step_failed(
        self, what: str, exc: Exception, served: Sequence[DecodeRequest], touched: Touched
    ) -> None:
        """A model step (or the step's bookkeeping) raised: fail the requests it served
        and free what they hold, once the pool is known to be intact; logged once, with
        the traceback. `EngineStateLostError` when the pool is lost (the loop logs it)."""
        message = step_failure(what, exc)
        check_pool_after(exc, message, self.kv.pool, [r.rid for r in served])
        # The speculative draft state is donated to each step as the pool is.
        if self.spec is not None and (damage := pool_damage(self.spec.slab)) is not None:
            raise EngineStateLostError(f"{message}; the draft state: {damage}") from exc
        for r in served:
            self.discard(r, message)
            self.end(r, message, touched)

    def _in_flight(self) -> list[DecodeRequest]:
        """The requests a step serves: running, and those the intake is bringing in."""
        return [*self.intake.in_flight(), *self.running.values()]

    def _lookup(self, rid: str) -> DecodeRequest | None:
        """The unfinished request `rid`, wherever it is."""
        r = self.intake.lookup(rid) or self.running.get(rid)
        if r is None and rid in self.queue:
            r = next(q for q in self.queue if q.rid == rid)
        return r

    def discard(self, r: DecodeRequest, why: str) -> None:
        """Stop serving `r` and free what it holds (its intake's part first: a decode
        server aborts its room, whose pages the receiver frees unless its KV arrived)."""
        if self.intake.discard(r, why):
            return
        self.running.pop(r.rid, None)
        self.queue.remove(r.rid)  # a queued request never held pages
        self.intake.release(r)

    def fail(self, r: DecodeRequest, message: str, touched: Touched) -> None:
        logger.warning("request %s failed: %s", r.rid, message)
        self.end(r, message, touched)

    @staticmethod
    def end(r: DecodeRequest, message: str, touched: Touched) -> None:
        """`r` ends with "error" saying `message` (its chunk comes from this step)."""
        r.finish = StopResult("error")
        r.error = message
        touched[r.rid] = r

    def free_pages(self, r: DecodeRequest) -> None:
        """Give `r`'s pages (and its draft-state slot) back (once)."""
        if r.pages is not None:
            self.kv.free_pages(r.pages)
            r.pages = None
        self.give_back_slot(r)

    # ---- chunks and stats ----------------------------------------------------------------
    def chunk(self, r: DecodeRequest) -> OutputChunk:
        """The request's tokens since its last chunk (final if it finished)."""
        new = slice(r.emitted, len(r.out_ids))
        r.emitted = len(r.out_ids)
        lps = tuple(r.out_lps[new]) if r.req.return_logprob else None
        tops = tuple(r.out_tops[new]) if r.req.return_logprob and r.req.top_logprobs else None
        prompt_lps = prompt_tops = None
        if r.prompt_scores is not None:
            (prompt_lps, prompt_tops), r.prompt_scores = r.prompt_scores, None
        if r.finish is None:
            return OutputChunk(r.rid, tuple(r.out_ids[new]), lps, tops, prompt_lps, prompt_tops)
        now = self._clock()
        meta: dict[str, float | int] = {
            "prompt_tokens": len(r.prompt),
            "completion_tokens": len(r.out_ids),
            "cached_tokens": r.cached_tokens,
            "cached_tokens_host": r.host_cached_tokens,
            "e2e_s": now - r.req.arrival_time,
        }
        if r.first_token_at is not None:
            meta["ttft_s"] = r.first_token_at - r.req.arrival_time
        if r.finish.matched_stop_index is not None:
            meta["matched_stop_index"] = r.finish.matched_stop_index
            meta["stop_text_end"] = int(r.finish.text_end or 0)
        if r.finish.matched_token is not None:
            meta["matched_stop_token"] = r.finish.matched_token
        if r.spec_verify_ct:  # SGLang's name; tokens per verify step beside it
            meta["spec_verify_ct"] = r.spec_verify_ct
            meta["spec_accept_length"] = r.spec_emitted / r.spec_verify_ct
        return OutputChunk(
            r.rid,
            tuple(r.out_ids[new]),
            lps,
            tops,
            prompt_lps,
            prompt_tops,
            finished=True,
            finish_reason=r.finish.reason,
            error=r.error,
            meta=meta,
        )

    def _update_snapshot(self) -> None:
        """Publish the counters `stats` reads (one tuple assignment: atomic for readers
        on other threads)."""
        waiting, running = self.intake.counts()
        self._snapshot = (
            len(self.queue) + waiting,
            len(self.running) + running,
            self.intake.failures,
            self.intake.bytes_received,
            tuple(self._rejections.items()),
            self.queue.stats(),
            self._rows_per_rank() if self.dp_size > 1 else (),
            dict(self._step_seconds),
        )

    def start_drafting(
        self, r: DecodeRequest, logits: np.ndarray, hidden: np.ndarray, touched: Touched
    ) -> None:
        """A speculative engine's request prefilled elsewhere (the prefix-cache intake's
        CP runner, which ran the MTP layer over all but the prompt's last position):
        its first token from the prefill's last logits, then its first drafts
        (`SpeculativeSteps.admit_after_prefill`); the token is recorded as `sample`
        records one."""
        assert self.spec is not None and r.slot is not None and r.pages is not None
        sp = r.req.sampling
        first = self.spec.admit_after_prefill(
            logits, hidden, len(r.prompt), r.pages, r.width, r.slot, sp.temperature, r.seed,
            _filters(sp), _top_n(r) > 0, _penalty(r, self.cfg.eos_token_ids),
        )  # fmt: skip

        def pick() -> tuple[int, float, TopLogprobs]:
            token, lp, *top = jax.device_get(first if _top_n(r) else first[:2])
            return _emitted(token[0], lp[0], _pairs(r, top, 0))

        self.produce(r, touched, pick)

    def draft_from_token(
        self,
        r: DecodeRequest,
        first: tuple[int, float, TopLogprobs],
        hidden: np.ndarray,
        touched: Touched,
    ) -> None:
        """A speculative engine's request prefilled by a PD prefill server, which drew its
        first token and ran the MTP layer over all but the prompt's last position: its
        first drafts from that token and the trunk's hidden state there
        (`SpeculativeSteps.admit_given`); `first` is recorded as `produce` records a
        token. A failed admission program fails the request alone (its pages and slot
        come back)."""
        assert self.spec is not None and r.slot is not None and r.pages is not None
        sp = r.req.sampling
        try:
            self.spec.admit_given(
                first[0], hidden, len(r.prompt), r.pages, r.width, r.slot, sp.temperature, r.seed,
                _filters(sp), _top_n(r) > 0, _penalty(r, self.cfg.eos_token_ids),
            )  # fmt: skip
        except Exception as exc:
            self.step_failed("the drafting of its first tokens", exc, [r], touched)
            return
        self.produce(r, touched, lambda: first)

    def first_tokens(
        self, batch: list[DecodeRequest], ends: Sequence[int] | None = None
    ) -> list[Callable[[], tuple[int, float, TopLogprobs]]]:
        """One prefill step of the admitted requests of `batch` (one per DP rank): each
        fed its prompt from `prefill_from` to `ends[i]` (default: the prompt's end); the
        first tokens drawn of those it ends the prompt of, which lead `batch`: one
        `produce` pick each, in order."""
        ends = [len(r.prompt) for r in batch] if ends is None else list(ends)
        final = sum(end == len(r.prompt) for r, end in zip(batch, ends, strict=True))
        if any(end != len(r.prompt) for r, end in zip(batch[:final], ends[:final], strict=True)):
            raise ValueError("the requests whose prompt a prefill step ends must lead it")
        if self.spec is not None:
            assert final == len(batch), "a speculative engine prefills whole prompts"
            admissions = []
            for r in batch:
                assert r.slot is not None and r.pages is not None
                sp = r.req.sampling
                args = (r.prompt, r.pages, r.width, r.slot, sp.temperature, r.seed, _filters(sp))
                penalty = _penalty(r, self.cfg.eos_token_ids)
                admissions.append((*args, _top_n(r) > 0, penalty))
            starts = [r.prefill_from for r in batch]
            scored = [r.scoring is not None for r in batch]
            out = self.spec.prefill_many(admissions, starts, scored)
            asked = any(_top_n(r) for r in batch)
            # One fetch: the first tokens (their top log-probs if asked) and, when the
            # prefill's scoring twin ran, the fed tokens' prompt scores.
            want = [*out[:2], *(out[2:4] if asked else ()), *(out[4:7] if any(scored) else ())]
            got = jax.device_get(want)
            token, lp, top = got[0], got[1], got[2 : 4 if asked else 2]
            if any(scored):  # prompt log-probs: the prefill's scoring twin ran
                chosen, top_ids, top_lps = got[-3:]
                for i, (r, start) in enumerate(zip(batch, starts, strict=True)):
                    if r.scoring is not None:
                        n = len(r.prompt) - start
                        r.scoring.record(
                            span_scores(r.prompt, start, n, chosen[i], top_ids[i], top_lps[i])
                        )
            return [
                functools.partial(_emitted, token[i], lp[i], _pairs(r, top, i))
                for i, r in enumerate(batch)
            ]
        if any(r.scoring is not None for r in batch):  # prompt log-probs: a scoring step
            logits, scores = self.steps.score_many(
                [(q.prompt, q.pages, q.width) for q in batch],
                [q.prefill_from for q in batch],
                ends,
                [q.scoring is not None for q in batch],
            )
            for q, s in zip(batch, scores, strict=True):
                if q.scoring is not None:
                    q.scoring.record(s)
        elif isinstance(self.steps, MeshDecodeSteps):  # one per DP rank
            logits = self.steps.prefill_many(
                [(q.prompt[:end], q.pages, q.width) for q, end in zip(batch, ends, strict=True)],
                [q.prefill_from for q in batch],
            )
        else:
            ((r, end),) = zip(batch, ends, strict=True)
            logits = self.steps.prefill(r.prompt[:end], r.pages, r.width, r.prefill_from)
        if not final:
            return []
        drawn = self.sampler.draw(batch[:final], logits)  # later rows: chunks, not drawn
        return [functools.partial(drawn.pick, i) for i in range(final)]

    def _rows_per_rank(self) -> tuple[int, ...]:
        rows = [0] * self.dp_size
        for q in (*self.intake.in_flight(), *self.running.values()):
            rows[q.rank] += 1
        return tuple(rows)


def whole_prompt_engine(
    cfg: ModelConfig,
    model: CausalLM,
    *,
    pages: int,
    page_size: int,
    index_k_dtype: IndexKDtype,
    speculative_num_steps: int = 0,
    **kw: Any,
) -> DecodeEngine:
    """A unified engine that prefills whole prompts (`--disable-radix-cache`) over a fresh
    pool of `pages` pages in the model's dtype, with the MTP layer's KV when it drafts
    (`speculative_num_steps`); `kw` as for `DecodeEngine` (benchmarks and tests)."""
    pool_cfg = mtp_config(cfg) if speculative_num_steps else cfg
    pool = init_pool(pool_cfg, pages, page_size, model.dtype, index_k_dtype)
    return DecodeEngine(
        cfg=cfg,
        model=model,
        kv=PagedKVStore(pool, PageAllocator(pages)),
        page_size=page_size,
        index_k_dtype=index_k_dtype,
        mode="null",
        speculative_num_steps=speculative_num_steps,
        **kw,
    )


def _filters(sp: SamplingParams) -> tuple[int, float, float]:
    """A speculative row's target filters (`serving.decode.speculative.RowFilters`)."""
    return sp.top_k, sp.top_p, sp.min_p


def _penalty(r: DecodeRequest, eos_token_ids: Sequence[int]) -> RowPenalty:
    """A speculative row's penalties (`serving.decode.speculative.RowPenalty`): with
    `min_new_tokens`, its stop tokens banned up to the position of output token
    `min_new_tokens` (the plain sampler's bias from output 0 on, `stop_token_bias`)."""
    sp = r.req.sampling
    pen = (sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty)
    ban_until = len(r.prompt) + sp.min_new_tokens if sp.min_new_tokens else 0
    return (r.prompt, stop_token_bias(sp, eos_token_ids, 0), *pen, ban_until)


def _top_n(r: DecodeRequest) -> int:
    """The top log-probs `r` reports per token (0: none)."""
    return r.req.top_logprobs if r.req.return_logprob else 0


def _pairs(r: DecodeRequest, top: list[np.ndarray], at: Any) -> TopLogprobs:
    """`r`'s top log-probs at index `at` of a speculative program's fetched `(top ids,
    top log-probs)` (`top` empty: not fetched), as `Sampled.top` gives them."""
    n = _top_n(r)
    return top_pairs(top[0][at], top[1][at], n) if n and top else ()


def _emitted(token: Any, logprob: Any, top: TopLogprobs = ()) -> tuple[int, float, TopLogprobs]:
    """A speculative step's token as `produce` records it; `ValueError` for a broken
    log-prob (the engines fail that request alone, as `Sampled.pick` does)."""
    if not np.isfinite(logprob):
        raise ValueError("the token's log-prob is not finite; the logits are broken")
    return int(token), float(logprob), top
