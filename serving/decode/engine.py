"""The single-device decode engine: paged KV, continuous batching, streaming chunks.

One `DecodeEngine` serves two server modes behind the `StepEngine` contract
(`serving.engine_api`):

- `"null"` (unified): a request waits in the FIFO wait queue until its pages and a batch
  slot are free (`serving.wait_queue`: bounded by `max_queued_requests`, a full queue
  refuses with `QueueFullError`, HTTP 503 + Retry-After); each `step`
  prefills at most one newly admitted request (absorbed MLA over the whole prompt,
  length bucketed as `ReferenceGenerator` does, first token sampled at step 0), then
  runs one batched decode step (one token per row, attention reading only each row's
  top-k latent rows from the pool) for every running request. With
  `batch_invariant=True` (`cpkv-serve --enable-batch-invariant`) every step uses
  batch-invariant numerics, so a request's tokens and log-probs do not depend on the
  rows it is batched with;
  `block_bytes` (`--transient-block-size`) bounds the prefill's indexer and sparse-
  attention token blocks;
- `"decode"` (PD): a request waits in the same bounded FIFO queue until its pages and a
  batch slot are free, then its pages are allocated and its transfer room registered
  with the receiver (at once in `add` when it fits; else by a later `step`, in arrival
  order). The prefill side's handshake waits for the room (the receiver's gRPC
  servicer holds a handshake for an unknown room), and the prefill server prefills a
  request only once every
  rank's handshake is accepted, so a request queued here holds no prefill pages. Each
  `step` polls the rooms without blocking. On
  SUCCESS the room's aux data is the first token (emitted as the first chunk) and the
  request joins the decode batch; on FAILED the request ends with "error" and the
  receiver's reason (the receiver has already freed the pages of a failed room).

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

Shapes (bounded compiles): decode batch rows are padded to a power of two (padding rows
have `valid=False` and write into the trash page), and the page-table width to a power
of two of the longest reservation in the batch; prefill pads the prompt to
`buckets.prefill_bucket(len)` and the table to a power of two of the reservation. The KV pool
is donated to every forward step, through `KVStore.update_pool`.

Overlap (default; `overlap=False` is `--disable-overlap-schedule`): each `step`
dispatches the next decode step before it fetches the previous one's tokens, the ids of
rows that continue fed from that draw on the device (`_decode_step`), so a finished
request's final chunk comes one step after its last token was drawn. A step with a
structured-output row (`serving.grammar`) fetches first: its mask needs the tokens.

All methods run on the engine thread (`serving.engine_loop.EngineLoop`); only `stats`
may be called from another thread (it reads a snapshot).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np
from jax.sharding import Mesh

from cpkv_jax.aot import CompileJob
from cpkv_jax.buckets import pow2_at_least
from cpkv_jax.config import ModelConfig
from cpkv_jax.decode_mesh import choose_rank
from cpkv_jax.errors import ConfigError, CpkvError, InputError
from cpkv_jax.kv_store import KVStore
from cpkv_jax.model.expert_parallel import EPDispatch
from cpkv_jax.model.kv_cache import INDEX_K_DTYPES, SINGLE_DEVICE_KV_IO, IndexKDtype, PagedKVIO
from cpkv_jax.model.transformer import CausalLM, log_probs
from cpkv_jax.paging import (
    pages_for_tokens,
)
from cpkv_jax.sampling import (
    PenaltyCounts,
    PendingSample,
    RowSampling,
    Sampled,
    TopLogprobs,
    sample,
    sample_async,
)
from cpkv_jax.sampling import warm as sampling_warm
from serving.decode.sampling import Detokenize, StopChecker, StopResult, request_seed
from serving.decode.steps import DecodeSteps, MeshDecodeSteps, reachable_shapes
from serving.engine.api import (
    EngineStateLostError,
    EngineStats,
    GenerateRequest,
    OutputChunk,
    SamplingParams,
    ServerMode,
    stop_token_bias,
)
from serving.engine.step_failures import check_pool_after, step_failure
from serving.engine.wait_queue import WaitQueue
from serving.grammar import GrammarBackend, RowGrammar, row_grammar_for, token_mask

# The unified-mode store is the transfer receiver's KV sink: one object for both.

logger = logging.getLogger(__name__)

# Penalty slots at most (`cpkv_jax.sampling.PenaltyCounts`: GLM-5's vocabulary at 256
# slots is 198 MB on each device); penalized requests beyond them wait to be admitted.
PENALTY_SLOTS_MAX = 256

# Room states as `transfer.protocol.RoomState` names them: compared by name so this
# module needs neither the transfer receiver nor its generated protobuf code.
# Decode mode with only transfers in flight: `step` waits this long for a room to change.
DEFAULT_IDLE_WAIT_S = 0.005
_ROOM_SUCCESS = "SUCCESS"
_ROOM_FAILED = "FAILED"


@runtime_checkable
class TransferRooms(Protocol):
    """The receiver side of PD transfer the decode mode needs (`Receiver` has it)."""

    def register_room(
        self, room: str, dst_pages: np.ndarray, num_tokens: int, cp_size: int
    ) -> Any: ...

    def status(self, room: str) -> Any: ...

    def abort(self, room: str, reason: str, sender_rank: int | None = None) -> Any: ...

    def staging_refusal(self, n_pages: int) -> str | None: ...

    def wait_for_change(self, timeout: float) -> None: ...


@dataclasses.dataclass(eq=False)
class _Request:
    req: GenerateRequest
    prompt: np.ndarray  # int32 [n]
    seed: int
    n_pages: int  # reserved for prompt + max_new_tokens
    width: int  # page-table width of its prefill (pow2 of n_pages)
    stop: StopChecker
    pages: np.ndarray | None = None  # held pages; None once freed (or owned by a room)
    rank: int = 0  # the DP rank whose pool shard holds its pages and runs its rows
    out_ids: list[int] = dataclasses.field(default_factory=list)
    out_lps: list[float] = dataclasses.field(default_factory=list)
    out_tops: list[TopLogprobs] = dataclasses.field(default_factory=list)
    emitted: int = 0  # output tokens already sent in a chunk
    first_token_at: float | None = None
    # Decode mode: the prefill server's prefix-cache hit (from the transfer's aux data).
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    finish: StopResult | None = None
    error: str | None = None
    # Tokens drawn on the device and not recorded yet (0 or 1: a decode step in flight).
    pending: int = 0
    grammar: RowGrammar | None = None  # structured output: its place in the grammar
    # `prompt_logprobs_from`: the prompt's scores, sent with the next chunk (then None).
    prompt_scores: tuple[tuple, tuple] | None = None

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is in the pool: the prompt and every output token but the last."""
        return len(self.prompt) + max(len(self.out_ids) - 1, 0)


@dataclasses.dataclass
class _InFlight:
    """A dispatched decode step whose tokens are not fetched yet: its rows, in the step's
    row order, and its draw (the tokens stay on the device for the next step's ids)."""

    rows: list[_Request]
    drawn: PendingSample
    row_of: dict[str, int]  # rid -> its row in `rows` and the draw


class DecodeEngine:
    """Continuous-batching decode on one device (see the module docstring)."""

    def __init__(
        self,
        *,
        cfg: ModelConfig,
        model: CausalLM,
        kv: KVStore,
        page_size: int,
        index_k_dtype: IndexKDtype,
        mode: ServerMode,
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
    ):
        if mode not in ("null", "decode"):
            raise ConfigError(
                f"DecodeEngine serves modes 'null' and 'decode', got {mode!r}; the prefill "
                "mode runs the CP prefill scheduler"
            )
        if index_k_dtype not in INDEX_K_DTYPES:
            raise ConfigError(
                f"index K dtype {index_k_dtype!r} is not one of {sorted(INDEX_K_DTYPES)}"
            )
        if max_running_requests < 1:
            raise ConfigError(f"max_running_requests must be >= 1, got {max_running_requests}")
        if mode == "decode" and not isinstance(kv, TransferRooms):
            raise ConfigError(
                f"decode mode needs a KV store that registers transfer rooms (a "
                f"transfer.receiver.Receiver), got {type(kv).__name__}"
            )
        pool = kv.pool
        if pool.page_size != page_size:
            raise ConfigError(f"the KV pool has page size {pool.page_size}, not {page_size}")
        self.cfg = cfg
        self.mode: ServerMode = mode
        self.kv = kv
        # Decode mode: the same object (a Receiver) also holds the transfer rooms.
        self._rooms = cast(TransferRooms, kv) if mode == "decode" else None
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
        self.idle_wait_s = idle_wait_s
        # Dispatch step n+1 before fetching step n's tokens (`_decode_step`); False: fetch
        # each step's tokens before the next is built (`--disable-overlap-schedule`).
        self.overlap = overlap
        self._in_step: _InFlight | None = None
        self.grammar = grammar  # None: a request with a grammar is refused
        self._clock = clock
        # Data-parallel decode (`--dp-size`): the pool splits into one shard per rank,
        # each with its trash page; a request's pages and rows stay on one rank.
        self.mesh = mesh
        self.dp_size = 1 if mesh is None else mesh.size
        self._steps: DecodeSteps | MeshDecodeSteps
        if self.dp_size > 1:
            assert mesh is not None
            self._steps = MeshDecodeSteps(
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
            self._steps = DecodeSteps(
                model, kv, page_size, index_k_dtype, batch_invariant, block_bytes, kv_io
            )
        self._num_pages = pool.num_pages
        self._usable_pages = pool.num_pages // self.dp_size - 1  # per rank, less its trash page
        self._max_rows_per_rank = -(-max_running_requests // self.dp_size)
        self.admitted_per_rank = [0] * self.dp_size  # requests each rank has taken
        self._next_rank = 0  # ties between ranks go round robin from here
        self._bytes_per_page = pool.nbytes() // pool.num_pages
        # Waiting for pages and a batch slot (null: to prefill; decode: to register its room).
        self._queue: WaitQueue[_Request] = WaitQueue(
            max_queued_requests, what="unified" if mode == "null" else "decode", clock=clock
        )
        self._transferring: dict[str, _Request] = {}  # decode mode, waiting for KV
        self._running: dict[str, _Request] = {}
        self._finals: list[OutputChunk] = []  # abort chunks due on the next step
        self._rejections: collections.Counter[str] = collections.Counter()
        self._transfer_failures = 0
        self._transfer_bytes = 0  # KV pages received in successful rooms
        self._snapshot: tuple[Any, ...] = (0, 0, 0, 0, (), self._queue.stats(), ())
        # The history of requests with a penalty or a logit bias, on the device
        # (`cpkv_jax.sampling.PenaltyCounts`): a slot per such request, reserved when it
        # is admitted (one waits in the queue while none is free), set at its first draw,
        # given back once it is no longer in flight. At most PENALTY_SLOTS_MAX slots: the
        # arrays are [slots, vocab], and `max_running_requests` may be the pool's pages.
        slots = min(max_running_requests, PENALTY_SLOTS_MAX)
        self._penalties = PenaltyCounts(
            slots if penalty_slots is None else penalty_slots,
            cfg.vocab_size,
            self._steps.logits_sharding,
        )
        self._penalty_slots: dict[str, int] = {}  # rid -> slot, reserved at admission
        # Of those, the slots already set: rid -> whether the set bias bans the stop tokens
        # (`min_new_tokens`; the slot is set again once the request is past it).
        self._penalty_ready: dict[str, bool] = {}
        logger.info(
            "penalty slots: %d x %d tokens, %.1f MiB on each device",
            self._penalties.slots,
            cfg.vocab_size,
            self._penalties.nbytes / 2**20,
        )

    # ---- StepEngine ----------------------------------------------------------------------
    def add(self, req: GenerateRequest) -> None:
        """Validate and queue the request (decode mode: register its room at once when
        its pages and a slot are free and nobody waits before it).

        Raises `InputError` for a request this engine can never serve and
        `QueueFullError` when the wait queue is full; nothing is held then.
        """
        try:
            r = self._validate(req)
            if self.mode == "decode" and not self._queue and self._fits_now(r):
                self._register_room(r)  # its errors are the caller's (400)
                self._transferring[r.rid] = r
            else:
                self._queue.push(r.rid, r)
        finally:
            self._update_snapshot()

    def abort(self, rid: str) -> None:
        """Cancel `rid` and free what it holds; its "abort" chunk comes with the next
        step. Unknown (or already finished) ids are ignored."""
        r = self._lookup(rid)
        if r is None:
            logger.debug("abort of unknown or finished request %s ignored", rid)
            return
        self._discard(r, "the request was aborted")
        r.finish = StopResult("abort")
        self._finals.append(self._chunk(r))
        self._update_snapshot()

    def has_work(self) -> bool:
        return bool(
            self._finals
            or self._queue
            or self._transferring
            or self._running
            or self._in_step is not None
        )

    def step(self) -> Sequence[OutputChunk]:
        """One unit of work: pending abort chunks, then (null) admit and prefill one
        request, or (decode) poll the transfers, then one batched decode step.

        A failed model step fails the requests it served, one request's failed token
        fails that request (`StepEngine`); `EngineStateLostError` when the pool is lost.
        """
        finals, self._finals = self._finals, []
        touched: dict[str, _Request] = {}
        try:
            if self.mode == "null":
                self._admit_and_prefill(touched)
            else:
                self._register_queued(touched)
                self._poll_transfers(touched)
                if not touched and not finals and not self._running and not self._in_step:
                    # Only transfers in flight: sleep until a room changes, not spin.
                    assert self._rooms is not None
                    self._rooms.wait_for_change(self.idle_wait_s)
                    self._poll_transfers(touched)
            self._decode_step(touched)
        except EngineStateLostError:
            raise
        except Exception as e:  # a bug past the guarded steps: fail what this step served
            self._step_failed("the engine step", e, self._in_flight(), touched)
        finally:
            self._update_snapshot()
        return [*finals, *(self._chunk(r) for r in touched.values())]

    def stats(self) -> EngineStats:
        """A snapshot; safe from any thread."""
        waiting, running, failures, received, rejections, queue, per_rank = self._snapshot
        return EngineStats(
            mode=self.mode,
            waiting=waiting,
            running=running,
            kv_pages_total=(self._usable_pages,) * self.dp_size,
            kv_pages_free=tuple(self.kv.num_free_pages_per_rank),
            kv_bytes_per_page=self._bytes_per_page,
            transfer_bytes=received,
            transfer_failures=failures,
            admission_rejections=dict(rejections),
            queue=queue,
            running_per_rank=per_rank,
        )

    # ---- admission -----------------------------------------------------------------------
    def _reject(self, kind: str, message: str) -> InputError:
        self._rejections[kind] += 1
        return InputError(message)

    def _check_prompt_logprobs(self, req: GenerateRequest) -> None:
        """Prompt log-probs come from the unified server's prefill with its prefix cache
        (`CachedUnifiedEngine`); this engine's prefill (or the PD prefill server's)
        keeps only the last position's logits."""
        raise self._reject(
            "prompt_logprobs",
            "prompt log-probs (echo with logprobs, logprob_start_len) are computed by a "
            "unified server with its radix cache (the default; not with "
            "--disable-radix-cache, nor in PD mode): send them there",
        )

    def _validate(self, req: GenerateRequest) -> _Request:
        cfg = self.cfg
        rid = req.rid
        if rid in self._running or rid in self._transferring or rid in self._queue:
            raise self._reject("duplicate_rid", f"request id {rid!r} is already in flight")
        n = len(req.input_ids)
        if n == 0:
            raise self._reject("empty_prompt", "the prompt is empty: give at least one token")
        prompt = np.asarray(req.input_ids, dtype=np.int64)
        bad = prompt[(prompt < 0) | (prompt >= cfg.vocab_size)]
        if bad.size:
            raise self._reject(
                "bad_token",
                f"token id(s) {bad[:5].tolist()} outside the vocabulary [0, {cfg.vocab_size})",
            )
        try:
            req.sampling.validate(cfg.vocab_size)
        except InputError as e:
            raise self._reject("bad_sampling", str(e)) from e
        if req.prompt_logprobs_from is not None:
            self._check_prompt_logprobs(req)
        max_new = req.sampling.max_new_tokens
        total = n + max_new
        if total > self.context_length:
            raise self._reject(
                "too_long",
                f"prompt ({n} tokens) + max_new_tokens ({max_new}) = {total} exceeds the "
                f"context length {self.context_length}; shorten the prompt or ask for fewer "
                "tokens",
            )
        n_pages = pages_for_tokens(total, self.page_size)
        if n_pages > self._usable_pages:
            raise self._reject(
                "pool_capacity",
                f"prompt + max_new_tokens = {total} tokens need {n_pages} KV pages of "
                f"{self.page_size} but the whole pool has {self._usable_pages}; ask for fewer "
                "tokens or start the server with a larger KV pool",
            )
        try:
            stop = StopChecker(req.sampling, cfg.eos_token_ids, self.detokenize)
        except InputError as e:
            raise self._reject("stop_strings", str(e)) from e
        row_grammar = None
        if req.sampling.grammar is not None:
            try:
                row_grammar = row_grammar_for(self.grammar, req.sampling.grammar)
            except InputError as e:
                raise self._reject("bad_grammar", str(e)) from e
        # The same rule as the prefill server's (PD: it samples token 0, we the rest).
        seed = request_seed(req)
        if self.mode == "decode" and (
            not req.bootstrap_room or req.bootstrap_cp_size is None or req.bootstrap_cp_size < 1
        ):
            raise self._reject(
                "no_room",
                f"request {rid!r}: a decode server needs bootstrap_room and bootstrap_cp_size "
                f">= 1 (got {req.bootstrap_room!r}, {req.bootstrap_cp_size!r}); send it "
                "through the router",
            )
        if self._rooms is not None:  # the prompt's pages stage whole on the way in
            why = self._rooms.staging_refusal(pages_for_tokens(n, self.page_size))
            if why is not None:
                raise self._reject("staging_capacity", f"request {rid!r}: {why}")
        return _Request(
            req=req,
            prompt=prompt.astype(np.int32),
            seed=seed,
            n_pages=n_pages,
            width=pow2_at_least(n_pages),
            stop=stop,
            grammar=row_grammar,
        )

    def _fits_now(self, r: _Request) -> bool:
        """A batch slot and the request's pages are free (decode: transfers count), and a
        penalty slot if it needs one."""
        return self._rank_for(r) is not None and self._penalty_slot_free(r)

    def _rank_for(self, r: _Request) -> int | None:
        """The rank `r` would be admitted to now (`decode_mesh.choose_rank`), or None:
        the total batch is full, or no rank has a row and `r`'s pages free."""
        if len(self._transferring) + len(self._running) >= self.max_running_requests:
            return None
        rows = self._rows_per_rank()
        free = self.kv.num_free_pages_per_rank
        return choose_rank(free, rows, r.n_pages, self._max_rows_per_rank, self._next_rank)

    def _allocate(self, r: _Request, rank: int | None = None) -> None:
        rank = self._rank_for(r) if rank is None else rank
        assert rank is not None, "allocate only what fits now"
        r.pages = self.kv.allocate_pages(r.n_pages, rank)
        self._reserve_penalty_slot(r)
        r.rank = rank
        self.admitted_per_rank[rank] += 1
        self._next_rank = (rank + 1) % self.dp_size

    def _register_queued(self, touched: dict[str, _Request]) -> None:
        """Register the rooms of queued requests, in arrival order, while they fit."""
        while (r := self._queue.head()) is not None and self._fits_now(r):
            self._queue.pop(r.rid)
            try:
                self._register_room(r)
            except CpkvError as e:  # e.g. the room id is taken: this request fails alone
                self._fail(r, str(e), touched)
                continue
            except Exception as e:  # a bug: still this request's alone (its pages are back)
                logger.exception(
                    "request %s: registering room %s failed", r.rid, r.req.bootstrap_room
                )
                self._end(r, step_failure("registering its transfer room", e), touched)
                continue
            self._transferring[r.rid] = r

    def _register_room(self, r: _Request) -> None:
        assert self._rooms is not None
        self._allocate(r)
        try:
            self._rooms.register_room(
                r.req.bootstrap_room, r.pages, len(r.prompt), r.req.bootstrap_cp_size
            )
        except CpkvError as e:
            self._release(r)
            raise self._reject("bad_room", f"request {r.rid!r}: {e}") from e
        except BaseException:
            self._release(r)
            raise

    def _admit_and_prefill(self, touched: dict[str, _Request]) -> None:
        """Admit the head of the queue and prefill it; on a DP mesh, keep admitting in
        order while the next one fits on a rank not prefilling yet, and prefill them
        all in one step (each rank its own request)."""
        batch: list[_Request] = []
        while (r := self._queue.head()) is not None and len(batch) < self.dp_size:
            rank = self._rank_for(r)
            if rank is None or any(q.rank == rank for q in batch):
                break  # FIFO: nobody overtakes the head (nor shares a rank's prefill)
            if not self._penalty_slot_free(r):
                break
            self._allocate(r, rank)
            self._queue.pop(r.rid)
            self._running[r.rid] = r
            batch.append(r)
        if not batch:
            return
        try:
            if len(batch) == 1:
                logits = self._steps.prefill(batch[0].prompt, batch[0].pages, batch[0].width)
            else:
                assert isinstance(self._steps, MeshDecodeSteps)
                logits = self._steps.prefill_many([(q.prompt, q.pages, q.width) for q in batch])
            drawn = self._draw(batch, logits)
        except Exception as e:
            self._step_failed("the prefill step", e, batch, touched)
            return
        for i, q in enumerate(batch):  # a failed draw fails that request alone
            self._produce(q, touched, functools.partial(drawn.pick, i))

    def _poll_transfers(self, touched: dict[str, _Request]) -> None:
        assert self._rooms is not None
        for rid, r in list(self._transferring.items()):
            room = r.req.bootstrap_room
            try:
                snap = self._rooms.status(room)
            except CpkvError as e:  # the room is gone: nobody can say who owns its pages
                self._transferring.pop(rid)
                logger.error("request %s: room %s status failed: %s", rid, room, e)
                r.pages = None
                self._transfer_failures += 1
                self._fail(r, f"KV transfer state lost: {e}", touched)
                continue
            state = _state_name(snap)
            if state == _ROOM_FAILED:
                self._transferring.pop(rid)
                r.pages = None  # the receiver freed the failed room's pages (`_retire`)
                self._transfer_failures += 1
                self._fail(r, f"KV transfer failed: {snap.reason}", touched)
            elif state == _ROOM_SUCCESS:
                self._transferring.pop(rid)
                aux = snap.aux
                if aux is None:
                    self._release(r)
                    self._fail(r, "KV transfer succeeded without the first token", touched)
                    continue
                self._running[rid] = r
                r.cached_tokens, r.host_cached_tokens = aux.cached_tokens, aux.host_cached_tokens
                n_prompt_pages = pages_for_tokens(len(r.prompt), self.page_size)
                self._transfer_bytes += n_prompt_pages * self._bytes_per_page
                self._produce(
                    r, touched, lambda aux=aux: (int(aux.first_token), aux.logprob, aux.top)
                )

    def _decode_step(self, touched: dict[str, _Request]) -> None:
        """Dispatch one decode step for every running row, then record the tokens of the
        step before it (overlap: the device computes this step meanwhile), or (without
        overlap) this step's own.

        A row that finished in the previous step was in this one too (the host did not
        know yet): its extra token is dropped, and its KV write landed inside its own
        reservation (`prompt + max_new_tokens` tokens) before its pages were reused
        (every later pool use is dispatched after this step)."""
        prev, self._in_step = self._in_step, None
        if prev is not None and any(r.grammar for r in self._running.values()):
            # A grammar row's mask needs the token before it: this step waits for them.
            self._collect(prev, touched)
            prev = None
        rows = [r for r in self._running.values() if r.finish is None]
        if rows:
            try:
                self._in_step = self._launch(rows, prev)
            except Exception as e:
                self._step_failed("the decode step", e, rows, touched)
        if prev is not None:
            self._collect(prev, touched)
        if not self.overlap and self._in_step is not None:
            step, self._in_step = self._in_step, None
            self._collect(step, touched)

    def _launch(self, rows: list[_Request], prev: _InFlight | None) -> _InFlight:
        """Dispatch the step and its draw, fetching nothing. Each row feeds its last
        output token at position `kv_len`; a row of `prev` feeds the token `prev` drew
        for it, still on the device, one position further."""
        src = [-1] * len(rows)
        for i, r in enumerate(rows):
            if prev is not None and r.rid in prev.row_of:
                src[i] = prev.row_of[r.rid]
            assert r.pending == (src[i] >= 0), (r.rid, r.pending)
        self._take_penalty_slots(rows)
        sampled = [self._row_sampling(r) for r in rows]
        logits = self._steps.decode(
            [(r.out_ids[-1], r.kv_len + r.pending, r.pages, r.n_pages) for r in rows],
            (prev.drawn.tokens, src) if prev is not None and max(src) >= 0 else None,
        )
        drawn = sample_async(
            log_probs(logits),
            sampled,
            self._penalties,
            logits=logits,
            token_mask=token_mask([r.grammar for r in rows], logits.shape[0], self.cfg.vocab_size),
        )
        for r in rows:
            r.pending += 1
        return _InFlight(rows, drawn, {r.rid: i for i, r in enumerate(rows)})

    def _collect(self, step: _InFlight, touched: dict[str, _Request]) -> None:
        """Fetch `step`'s tokens and record those of rows still running (a row that
        finished or left since keeps nothing of it)."""
        for r in step.rows:
            r.pending -= 1
        live = [
            i for i, r in enumerate(step.rows) if r.finish is None and self._running.get(r.rid) is r
        ]
        if not live:
            return
        try:
            drawn = step.drawn.fetch()
        except Exception as e:
            self._step_failed("the decode step", e, [step.rows[i] for i in live], touched)
            return
        for i in live:
            self._produce(step.rows[i], touched, functools.partial(drawn.pick, i))

    @property
    def step_shapes(self) -> set[tuple[str, int, int, int]]:
        """Shapes dispatched to the model so far: (form, rows, tokens, width)."""
        return self._steps.shapes

    @property
    def compiled_step_shapes(self) -> set[tuple[str, int, int, int]]:
        """Step shapes whose executable is ready (shared by the engines of one model)."""
        return self._steps.compiled_shapes

    @property
    def step_compile_count(self) -> int:
        """Step compiles run so far (`DecodeSteps.compile_count`)."""
        return self._steps.compile_count

    def compile_estimate(self) -> tuple[int, float]:
        """Reachable step shapes not compiled yet and their estimated compile seconds."""
        return self._steps.compile_estimate(self.reachable_shapes())

    def compile_jobs(self) -> list[CompileJob]:
        """A background compile of every reachable step shape not compiled yet (smallest
        first), after the small programs around the steps ran here (`warm_log_probs`).
        A request that needs a shape meanwhile waits for its compile."""
        todo = self.reachable_shapes() - self._steps.compiled_shapes
        self._steps.warm_log_probs({rows for _, rows, _, _ in self.reachable_shapes()})
        self._warm_penalties(self.reachable_shapes())
        self.warm_feeds(self.reachable_shapes())
        return [
            CompileJob(f"decode step {s}", functools.partial(self._steps.compiled, s))
            for s in sorted(todo, key=lambda s: (s[3], s[1], s[2], s[0]))
        ]

    def reachable_shapes(self) -> set[tuple[str, int, int, int]]:
        """Every shape this engine's requests can reach (`steps.reachable_shapes`); its own
        prefills only in null mode (a decode server's prompts arrive as KV)."""
        return reachable_shapes(
            prefill_form=self._steps.prefill_form,
            page_size=self.page_size,
            context_length=self.context_length,
            usable_pages=self._usable_pages,
            max_running_requests=self._max_rows_per_rank,  # rows per rank
            prefill=self._prefills_itself,
        )

    def warm_shapes(self, shapes: set[tuple[str, int, int, int]]) -> int:
        """Compile (run once, on the trash page) those of `shapes` this engine can reach
        and has not run; returns how many. Before serving only: it donates the pool."""
        todo = sorted((shapes & self.reachable_shapes()) - self._steps.shapes)
        self._steps.warm(todo)
        self._warm_penalties(set(todo))
        self.warm_feeds(set(todo))
        return len(todo)

    def warm_all_shapes(self, already: set[tuple[str, int, int, int]] = frozenset()) -> int:
        """Compile (run once, on the trash page) every reachable shape not run yet here
        nor in `already` (another engine's on the same model: the compiled programs are
        shared); returns how many. Before serving only: it donates the pool."""
        todo = sorted(self.reachable_shapes() - self._steps.shapes - already)
        self._steps.warm(todo)
        self._warm_penalties(self.reachable_shapes())
        self.warm_feeds(self.reachable_shapes())
        return len(todo)

    def warm_feeds(self, shapes: set[tuple[str, int, int, int]]) -> None:
        """With overlap, compile the feed of drawn tokens into the next step's ids between
        every two decode row buckets among `shapes` and the steps run so far (rows join
        and leave, so a draw of any bucket feeds a step of any other)."""
        if self.overlap:
            self._steps.warm_feeds(
                {rows for _, rows, tokens, _ in (*shapes, *self._steps.shapes) if tokens == 1}
            )

    @property
    def _prefills_itself(self) -> bool:
        return self.mode == "null"

    # ---- sampling ------------------------------------------------------------------------
    def _row_sampling(self, r: _Request) -> RowSampling:
        s = r.req.sampling
        top_n = r.req.top_logprobs if r.req.return_logprob else 0
        slot = self._penalty_slots.get(r.rid, -1)  # set by `_take_penalty_slots`
        return RowSampling(
            s.temperature,
            s.top_k,
            s.top_p,
            r.seed,
            len(r.out_ids) + r.pending,  # the output position this draw's token takes
            s.min_p,
            top_n,
            s.frequency_penalty if slot >= 0 else 0.0,
            s.presence_penalty if slot >= 0 else 0.0,
            s.repetition_penalty if slot >= 0 else 1.0,
            bool(s.logit_bias or s.min_new_tokens) and slot >= 0,
            slot,
        )

    def _draw(self, rows: Sequence[_Request], logits: Any) -> Sampled:
        """The next token of each of `rows` from a step's logit rows (on the device, or
        one host row), penalties read from and counted on the device."""
        self._take_penalty_slots(rows)
        sampled = [self._row_sampling(r) for r in rows]
        mask = token_mask([r.grammar for r in rows], logits.shape[0], self.cfg.vocab_size)
        return sample(log_probs(logits), sampled, self._penalties, logits=logits, token_mask=mask)

    def _penalty_slot_free(self, r: _Request) -> bool:
        """Whether `r` can be admitted as far as penalty slots go: it needs none, or one is
        free (slots of requests no longer in flight are given back first)."""
        if not _penalized(r.req.sampling):
            return True
        live = {q.rid for q in self._in_flight()}
        for rid in [rid for rid in self._penalty_slots if rid not in live]:
            del self._penalty_slots[rid]
            self._penalty_ready.pop(rid, None)
        return len(self._penalty_slots) < self._penalties.slots

    def _reserve_penalty_slot(self, r: _Request) -> None:
        """Reserve a slot for an admitted request that needs one (`_penalty_slot_free` said
        one is free)."""
        if not _penalized(r.req.sampling) or r.rid in self._penalty_slots:
            return
        taken = set(self._penalty_slots.values())
        self._penalty_slots[r.rid] = next(i for i in range(self._penalties.slots) if i not in taken)

    def _take_penalty_slots(self, rows: Sequence[_Request]) -> None:
        """Set the reserved slots of rows drawing for the first time from their prompt,
        logit bias and output so far (the first token, when the prefill server drew it);
        its bias again once a row's output reaches `min_new_tokens` (its stop tokens
        allowed; the counts stay: they may hold a token still in flight)."""
        for r in rows:
            slot = self._penalty_slots.get(r.rid)
            if slot is None:
                continue
            s = r.req.sampling
            n_out = len(r.out_ids) + r.pending
            banning = n_out < s.min_new_tokens
            ready = self._penalty_ready.get(r.rid)
            if ready == banning:
                continue
            bias = stop_token_bias(s, self.cfg.eos_token_ids, n_out)
            if ready is None:
                assert r.pending == 0, "a row's first draw has nothing in flight"
                self._penalties.reset(slot, r.out_ids, r.prompt, bias)
            else:
                self._penalties.set_bias(slot, bias)
            self._penalty_ready[r.rid] = banning

    def _warm_penalties(self, shapes: set[tuple[str, int, int, int]]) -> None:
        """Compile the penalized sampler for the steps' row counts (and, on a unified
        server, a first token's host row: the prefix-cache engine's prefill hands its
        logits over on the host), and the slot reset: what a request with a penalty runs,
        before serving; with a grammar backend, the masked draws too."""
        self._penalties.warm(
            {self._steps.logit_rows(n) for _, n, _, _ in shapes},
            {1} if self.mode == "null" else set(),
        )
        if self.grammar is not None:  # the token mask of a step with a grammar row
            rows = {self._steps.logit_rows(n) for _, n, _, _ in shapes}
            sampling_warm(
                self.cfg.vocab_size, sorted(rows), self._steps.logits_sharding, masked=True
            )
            if self.mode == "null":  # a first token's host row
                sampling_warm(self.cfg.vocab_size, [1], None, masked=True)

    # ---- failures ------------------------------------------------------------------------
    def _sample(self, r: _Request, logits: Any, touched: dict[str, _Request]) -> None:
        """Draw `r`'s next token from its logit row (`[1, vocab]`, on the device or the
        host) and record it."""
        self._produce(r, touched, lambda: self._draw([r], logits).pick(0))

    def _produce(
        self,
        r: _Request,
        touched: dict[str, _Request],
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
            self._discard(r, message)
            self._end(r, message, touched)
            return
        touched[r.rid] = r

    def _step_failed(
        self, what: str, exc: Exception, served: Sequence[_Request], touched: dict[str, _Request]
    ) -> None:
        """A model step (or the step's bookkeeping) raised: fail the requests it served
        and free what they hold, once the pool is known to be intact; logged once, with
        the traceback. `EngineStateLostError` when the pool is lost (the loop logs it)."""
        message = step_failure(what, exc)
        check_pool_after(exc, message, self.kv.pool, [r.rid for r in served])
        for r in served:
            self._discard(r, message)
            self._end(r, message, touched)

    def _in_flight(self) -> list[_Request]:
        """The requests a step serves: running, and (decode) waiting for their KV."""
        return [*self._running.values(), *self._transferring.values()]

    def _lookup(self, rid: str) -> _Request | None:
        """The unfinished request `rid`, wherever it is."""
        r = self._transferring.get(rid) or self._running.get(rid)
        if r is None and rid in self._queue:
            r = next(q for q in self._queue if q.rid == rid)
        return r

    def _discard(self, r: _Request, why: str) -> None:
        """Stop serving `r` and free what it holds (decode: abort its room, whose pages
        the receiver frees unless its KV already arrived)."""
        if self._transferring.pop(r.rid, None) is not None:
            assert r.pages is not None and self._rooms is not None
            try:
                snap = self._rooms.abort(r.req.bootstrap_room, why)
            except CpkvError as e:  # the room is gone: who owns its pages is unknown
                logger.error(
                    "request %s: abort of room %s failed: %s", r.rid, r.req.bootstrap_room, e
                )
            else:
                if _state_name(snap) == _ROOM_SUCCESS:
                    self.kv.free_pages(r.pages)  # KV arrived before the abort: ours to free
            r.pages = None  # a failed room's pages went back with the room
            return
        self._running.pop(r.rid, None)
        self._queue.remove(r.rid)  # a queued request never held pages
        self._release(r)

    # ---- bookkeeping ---------------------------------------------------------------------
    def _record(self, r: _Request, tok: int, logprob: float, top: TopLogprobs) -> None:
        """Append one output token; finish the request if it stops here."""
        if r.first_token_at is None:
            r.first_token_at = self._clock()
        if r.grammar is not None:
            r.grammar.accept(tok)  # a token it did not allow fails this request (`_produce`)
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
            self._running.pop(r.rid, None)
            self._release(r)

    def _fail(self, r: _Request, message: str, touched: dict[str, _Request]) -> None:
        logger.warning("request %s failed: %s", r.rid, message)
        self._end(r, message, touched)

    @staticmethod
    def _end(r: _Request, message: str, touched: dict[str, _Request]) -> None:
        """`r` ends with "error" saying `message` (its chunk comes from this step)."""
        r.finish = StopResult("error")
        r.error = message
        touched[r.rid] = r

    def _release(self, r: _Request) -> None:
        if r.pages is not None:
            self.kv.free_pages(r.pages)
            r.pages = None

    def _chunk(self, r: _Request) -> OutputChunk:
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
        self._snapshot = (
            len(self._queue) + len(self._transferring),
            len(self._running),
            self._transfer_failures,
            self._transfer_bytes,
            tuple(self._rejections.items()),
            self._queue.stats(),
            self._rows_per_rank() if self.dp_size > 1 else (),
        )

    def _rows_per_rank(self) -> tuple[int, ...]:
        rows = [0] * self.dp_size
        for q in (*self._transferring.values(), *self._running.values()):
            rows[q.rank] += 1
        return tuple(rows)


def _penalized(s: SamplingParams) -> bool:
    """Whether `s` needs a `PenaltyCounts` slot (a penalty, a logit bias, or stop tokens
    banned by `min_new_tokens`)."""
    return bool(
        s.frequency_penalty != 0
        or s.presence_penalty != 0
        or s.repetition_penalty != 1
        or s.logit_bias
        or s.min_new_tokens
    )


def _state_name(snapshot: Any) -> str:
    """`RoomSnapshot.state` as its enum name ("SUCCESS", "FAILED", ...)."""
    return snapshot.state.name
