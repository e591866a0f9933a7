"""CP prefill on the `("cp",)` mesh with page-owned (shared) or replicated KV pools.

Host side (numpy, no device syncs): each step takes the next chunk of every request in
the batch, splits its tokens in-sequence zigzag over the ranks (2*cp blocks; rank r
computes blocks r and 2cp-1-r, which balances causal attention work), allocates the
chunk's new pages in their owners' lanes, and builds global write slots and page-table
rows. Device side: one jitted step runs the unchanged model inside `shard_map` with
`CPKVIO` (all-gather the new KV -> owners write their pages -> materialize the full view
-> indexer / sparse attention), pools donated with identical in/out shardings.

Shapes are bucketed - zigzag block length, page-table width, batch rows - to powers of
two, so the number of compiles is bounded by the number of buckets.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from cpkv_jax.aot import CompileJob, ShapeCache, abstract
from cpkv_jax.buckets import StepShape, page_table_width, step_shape
from cpkv_jax.config import CPConfig, ModelConfig
from cpkv_jax.errors import InputError
from cpkv_jax.kv_pool import PoolLayout, init_cp_pool
from cpkv_jax.kv_store import DevicePool
from cpkv_jax.lane_allocator import OwnerLaneAllocator, RequestPageTable
from cpkv_jax.materialize import CPKVIO, GatherImpl
from cpkv_jax.mesh import CP_AXIS
from cpkv_jax.model.expert_parallel import (
    EPSpec,
    check_ep_spec,
    param_shardings,
    param_specs,
)
from cpkv_jax.model.expert_parallel import (
    expert_parallel as ep_context,
)
from cpkv_jax.model.forward_batch import ForwardBatch
from cpkv_jax.model.kv_cache import IndexKDtype, KVPool
from cpkv_jax.model.mla import AttnForm
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.model.numerics import batch_invariant, token_block_bytes
from cpkv_jax.model.rope import rope_cos_sin
from cpkv_jax.model.transformer import CausalLM, score_tokens
from cpkv_jax.owner_attention import OwnerCPKVIO
from cpkv_jax.paging import pages_for_tokens
from cpkv_jax.scores import TokenScores
from cpkv_jax.shared_kv_debug import (
    DEBUG_ENV,
    check_step,
    shadow_pages_per_rank,
)

logger = logging.getLogger(__name__)


def zigzag_order(n_tokens: int, cp_size: int, block: int) -> np.ndarray:
    """Chunk-token index at each slot of the rank-major layout `[cp * 2 * block]`, -1 = pad.

    Rank `r` holds slots `[r * 2 * block, (r + 1) * 2 * block)`: block `r` then block
    `2 * cp - 1 - r` of the chunk.
    """
    order = np.full(cp_size * 2 * block, -1, np.int64)
    for r in range(cp_size):
        for half, blk in enumerate((r, 2 * cp_size - 1 - r)):
            src = np.arange(blk * block, (blk + 1) * block)
            dst = r * 2 * block + half * block + np.arange(block)
            order[dst] = np.where(src < n_tokens, src, -1)
    return order


def chunk_tokens(chunked_prefill_size: int | None, page_size: int) -> int | None:
    """Chunk length floored to whole pages, as the scheduler does (None = unchunked)."""
    if chunked_prefill_size is None:
        return None
    chunk = (chunked_prefill_size // page_size) * page_size
    if chunk < page_size:
        raise InputError(
            f"chunked prefill size {chunked_prefill_size} is below one page ({page_size})"
        )
    return chunk


@dataclasses.dataclass
class PrefillResult:
    last_logits: np.ndarray  # [num_requests, vocab] float32, logits after each prompt
    tables: list[RequestPageTable]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Host-built inputs of one CP step (numpy); fields as in `ForwardBatch`.

    Token fields are `[B, cp * 2 * block]` in rank-major zigzag layout (see `zigzag_order`).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    valid: np.ndarray
    write_slots: np.ndarray  # global slots (see kv_pool.py)
    page_table: np.ndarray  # [B, width]: local page of logical page p on lane p % lanes
    kv_lens: np.ndarray  # [B]
    last_index: np.ndarray  # [B] slot of each row's last new token in the zigzag layout
    # A drafting runner's (`mtp=True`): each slot's next prompt token, -1 where there is
    # none (padding, the prompt's last position), for the MTP layer's pass.
    next_ids: np.ndarray | None = None


class CPPrefillRunner:
    """Owns the CP pools and allocator; runs chunked, batched CP prefill.

    `batch_invariant` selects batch-invariant numerics (`cpkv_jax.model.numerics`);
    `block_bytes` the token-block budget of the indexer and sparse attention
    (`cpkv_jax.buckets.block_rows`; None: `TRANSIENT_BLOCK_BYTES`); `expert_parallel`
    shards the routed experts over the cp ranks (`cpkv_jax.model.expert_parallel`).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        model: CausalLM,
        mesh: Mesh,
        cp: CPConfig,
        *,
        pages_per_rank: int,
        index_k_dtype: IndexKDtype = "fp8_e4m3",
        gather_impl: GatherImpl = "xla",
        debug: bool | None = None,
        attn_form: AttnForm = "absorbed",
        batch_invariant: bool = False,
        block_bytes: int | None = None,
        expert_parallel: EPSpec | None = None,
        mtp: bool = False,
    ):
        cp.validate(cfg, device_count=len(mesh.devices.reshape(-1)))
        if mtp and model.mtp is None:
            raise InputError("a drafting runner (mtp=True) needs the model's MTP layer")
        if expert_parallel is not None:
            check_ep_spec(expert_parallel, CP_AXIS, cp.cp_size, cfg.n_routed_experts)
        if block_bytes is not None and block_bytes <= 0:
            raise InputError(f"token block budget must be > 0 bytes, got {block_bytes}")
        if mesh.shape[CP_AXIS] != cp.cp_size:
            raise InputError(
                f"mesh has {mesh.shape[CP_AXIS]} cp ranks but `cp_size` is {cp.cp_size}"
            )
        self.cfg, self.cp, self.mesh = cfg, cp, mesh
        self.index_k_dtype = index_k_dtype
        self.layout = PoolLayout(cp.cp_size, cp.shared_kv, pages_per_rank, cp.page_size)
        self.allocator = OwnerLaneAllocator(self.layout.lanes, pages_per_rank)
        if cp.attention == "owner":
            if debug or (debug is None and os.environ.get(DEBUG_ENV) == "1"):
                # The replicated shadow attends through full views: its logits equal the
                # owner path's to rounding only, and the check is bitwise.
                raise InputError(f"{DEBUG_ENV}=1 checks full-view attention; unset it")
            self.kv_io: CPKVIO = OwnerCPKVIO(cp.cp_size, cp.shared_kv, gather_impl)
        else:
            self.kv_io = CPKVIO(cp.cp_size, cp.shared_kv, gather_impl)
        graphdef, state = nnx.split(model)
        self.graphdef = graphdef
        self.expert_parallel = expert_parallel
        ep_axis = None if expert_parallel is None else CP_AXIS
        # Routed experts split over the ranks under EP, the rest replicated; a model the
        # loader placed this way already moves nothing here.
        self.state = jax.device_put(state, param_shardings(state, mesh, ep_axis))
        # Its lock is held while a step swaps the pool (it donates the old one). A reader
        # on another thread (a KV transfer, a host-cache backup) holds it while its gather
        # runs, so a step never donates a pool being read; the step's compute and the
        # reads' host copies run outside.
        # `mtp`: each step also runs the MTP layer over its tokens (speculative decoding
        # drafts from its KV, issue 39), its KV one more layer of the same pages.
        self.mtp = mtp
        self.last_hidden: np.ndarray | None = None  # `mtp`: see `run_step`
        # The config the pools are laid out for: a drafting runner's has the MTP layer.
        self.pool_cfg = pool_cfg = mtp_config(cfg) if mtp else cfg
        self.kv = DevicePool(init_cp_pool(pool_cfg, self.layout, mesh, model.dtype, index_k_dtype))
        self._shardings = (NamedSharding(mesh, P(None, CP_AXIS)), NamedSharding(mesh, P()))
        self.batch_invariant = batch_invariant
        self.block_bytes = block_bytes
        build = functools.partial(
            _build_step,
            graphdef,
            mesh,
            self.layout,
            self.kv_io,
            index_k_dtype,
            attn_form,
            batch_invariant,
            block_bytes,
            param_specs(state, ep_axis),
            expert_parallel,
            mtp=mtp,
        )
        self._step = build()
        # The same step that also scores every prompt token (prompt log-probs, `score`):
        # compiled only for the shapes such requests reach.
        self._score_step = build(score=True)
        self._score_steps: ShapeCache[StepShape] = ShapeCache("CP prefill scoring step")
        self._view = _build_view(mesh, self.layout, self.kv_io)
        # Steps dispatch through ahead-of-time executables, one per shape, compiled on
        # abstract inputs: a background compile never touches the live pool (issue 25).
        self._steps: ShapeCache[StepShape] = ShapeCache("CP prefill step")
        self._abstract_state = abstract(self.state)
        self._abstract_pool = abstract(self.pool)
        self.step_shapes: set[StepShape] = set()  # every shape run or warmed
        self.debug = os.environ.get(DEBUG_ENV) == "1" if debug is None else debug
        self._shadow: CPPrefillRunner | None = None
        if self.debug and cp.shared_kv:
            logger.warning(
                "%s=1: invariant checks on (device syncs; not for measurements)", DEBUG_ENV
            )
            self._shadow = CPPrefillRunner(
                cfg,
                model,
                mesh,
                dataclasses.replace(cp, shared_kv=False),
                pages_per_rank=shadow_pages_per_rank(self.layout),
                index_k_dtype=index_k_dtype,
                gather_impl=gather_impl,
                debug=False,
                attn_form=attn_form,
                batch_invariant=batch_invariant,
                block_bytes=block_bytes,
                expert_parallel=expert_parallel,
                mtp=mtp,
            )

    @property
    def compiled_step_shapes(self) -> int:
        """Distinct compiled step shapes so far (the bucket count actually used)."""
        return len(self._steps.compiled_keys())

    @property
    def step_compile_waits(self) -> int:
        """Steps that waited for another thread's compile of their shape."""
        return self._steps.waits

    def compiled_step(self, shape: StepShape) -> jax.stages.Compiled:
        """The step's executable for `shape`, compiled on abstract inputs the first time
        (a caller that needs a shape another thread is compiling waits for it)."""
        if (shape.cp_size, shape.page_size) != (self.cp.cp_size, self.cp.page_size):
            raise ValueError(f"{shape} is not a step shape of this runner")
        return self._steps.get(shape, lambda: self._step.lower(*self._abstract_step_args(shape)))

    def compiled_score_step(self, shape: StepShape) -> jax.stages.Compiled:
        """`compiled_step`'s scoring twin (`run_score_step`)."""
        if (shape.cp_size, shape.page_size) != (self.cp.cp_size, self.cp.page_size):
            raise ValueError(f"{shape} is not a step shape of this runner")
        split = self._shardings[0]
        targets = jax.ShapeDtypeStruct(
            (shape.rows, shape.tokens_per_step), np.int32, sharding=split
        )
        return self._score_steps.get(
            shape, lambda: self._score_step.lower(*self._abstract_step_args(shape), targets)
        )

    def _abstract_step_args(self, shape: StepShape) -> tuple:
        """`_step_args` + pool as `ShapeDtypeStruct`s of `shape` (same dtypes, shardings)."""
        split, rep = self._shardings
        rows, tokens = shape.rows, shape.tokens_per_step

        def spec(dims: tuple[int, ...], dtype, sharding) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(dims, dtype, sharding=sharding)

        dtypes = (np.int32, np.int32, bool, np.int32) + ((np.int32,) if self.mtp else ())
        token_fields = tuple(spec((rows, tokens), dtype, split) for dtype in dtypes)
        return (
            self._abstract_state,
            token_fields,
            spec((rows, shape.width), np.int32, rep),
            spec((rows,), np.int32, rep),
            self._abstract_pool,
            spec((rows,), np.int32, rep),
        )

    # ---- host planning ----------------------------------------------------------------
    def plan_step(
        self,
        prompts: Sequence[np.ndarray],
        tables: Sequence[RequestPageTable],
        starts: Sequence[int],
        lengths: Sequence[int],
    ) -> StepPlan:
        """Allocate the chunk's pages and lay out one step's batch (pure numpy)."""
        cp, page = self.cp.cp_size, self.cp.page_size
        lanes = self.layout.lanes
        for table, start, n in zip(tables, starts, lengths, strict=True):
            table.extend(self.allocator, start + n, page)  # no-op when already allocated
        kv_after = [s + n for s, n in zip(starts, lengths, strict=True)]
        shape = step_shape(len(prompts), max(lengths), max(kv_after), cp, page)
        block, width, rows = shape.block, shape.width, shape.rows
        t_total = shape.tokens_per_step

        ids = np.zeros((rows, t_total), np.int32)
        positions = np.zeros((rows, t_total), np.int32)
        valid = np.zeros((rows, t_total), bool)
        slots = np.zeros((rows, t_total), np.int32)
        page_table = np.zeros((rows, width), np.int32)
        kv_lens = np.zeros((rows,), np.int32)
        last_index = np.zeros((rows,), np.int32)
        for b, (prompt, table, start, n) in enumerate(
            zip(prompts, tables, starts, lengths, strict=True)
        ):
            order = zigzag_order(n, cp, block)
            ok = order >= 0
            pos = start + np.where(ok, order, 0)
            ids[b] = np.where(ok, prompt[pos], 0)
            positions[b] = np.where(ok, pos, 0)
            valid[b] = ok
            logical = pos // page
            local = table.local_pages()[logical]
            glob = self.layout.global_slots(logical % lanes, local, pos % page)
            slots[b] = np.where(ok, glob, 0)  # padding -> lane 0's trash page
            page_table[b] = table.as_row(width)
            kv_lens[b] = start + n
            last_index[b] = int(np.flatnonzero(order == n - 1)[0])
        plan = StepPlan(ids, positions, valid, slots, page_table, kv_lens, last_index)
        if self.mtp:
            nxt = np.where(_has_next(plan, prompts), plan_targets(plan, prompts), -1)
            plan = dataclasses.replace(plan, next_ids=nxt)
        return plan

    # ---- device steps -----------------------------------------------------------------
    def prefill(
        self, prompts: Sequence[Sequence[int] | np.ndarray], chunked_prefill_size: int | None = None
    ) -> PrefillResult:
        """Prefill every prompt (one ragged batch, chunk by chunk); returns last logits.

        The requests' pages stay allocated in the pools (see `release`).
        """
        arrays = [np.asarray(p, np.int32) for p in prompts]
        if not arrays or any(a.size == 0 for a in arrays):
            raise InputError("every prompt needs at least one token")
        for i, a in enumerate(arrays):
            bad = a[(a < 0) | (a >= self.cfg.vocab_size)]
            if bad.size:
                raise InputError(
                    f"prompt {i}: token id(s) {bad[:5].tolist()} outside the vocabulary "
                    f"[0, {self.cfg.vocab_size})"
                )
            if a.size > self.cfg.max_position_embeddings:
                raise InputError(
                    f"prompt {i} has {a.size} tokens, over max_position_embeddings="
                    f"{self.cfg.max_position_embeddings}"
                )
        chunk = chunk_tokens(chunked_prefill_size, self.cp.page_size)
        tables = [RequestPageTable(self.layout.lanes) for _ in arrays]
        done = [0] * len(arrays)
        last_logits: list[np.ndarray | None] = [None] * len(arrays)
        while any(d < a.size for d, a in zip(done, arrays, strict=True)):
            active = [i for i, a in enumerate(arrays) if done[i] < a.size]
            lengths = [
                arrays[i].size - done[i] if chunk is None else min(chunk, arrays[i].size - done[i])
                for i in active
            ]
            plan = self.plan_step(
                [arrays[i] for i in active],
                [tables[i] for i in active],
                [done[i] for i in active],
                lengths,
            )
            logits = self.run_step(plan)
            for row, i in enumerate(active):
                done[i] += lengths[row]
                if done[i] == arrays[i].size:
                    last_logits[i] = logits[row]
        return PrefillResult(np.stack(last_logits), tables)  # type: ignore[arg-type]

    def _step_args(self, plan: StepPlan) -> tuple:
        """The step's arguments but the pool (the caller reads that under the lock)."""
        split, rep = self._shardings
        fields = [plan.input_ids, plan.positions, plan.valid, plan.write_slots]
        if self.mtp:
            assert plan.next_ids is not None, "a drafting runner's plans carry next_ids"
            fields.append(plan.next_ids)
        tokens = tuple(global_array(x, split) for x in fields)
        return (
            self.state,
            tokens,
            global_array(plan.page_table, rep),
            global_array(plan.kv_lens, rep),
            global_array(plan.last_index, rep),
        )

    @property
    def pool(self) -> KVPool:
        """The current pool (`kv.current`); from another thread than the scheduler's,
        read it under `kv.lock`."""
        return self.kv.current

    def run_step(self, plan: StepPlan) -> np.ndarray:
        """Dispatch one step (the pool swap under the pool's lock) and wait for its
        logits. A drafting runner (`mtp`) also keeps each row's final hidden state at its
        last new token in `last_hidden` (the MTP layer's input at the prompt's last
        position, which needs the first output token)."""
        state, tokens, table, kv_lens, last = self._step_args(plan)
        shape = self.shape_of(plan)
        step = self.compiled_step(shape)  # outside the pool lock: it may compile or wait
        self.step_shapes.add(shape)

        def run(pool):
            logits, pool, *hidden = step(state, tokens, table, kv_lens, pool, last)
            return (logits, *hidden), pool

        logits, *hidden = self.kv.update(run)
        self.last_hidden = np.asarray(hidden[0]) if hidden else None
        out = np.asarray(logits)
        if self._shadow is not None:  # SPEC S1.7: every step, served requests included
            check_step(self, self._shadow, plan, out)
        return out

    def run_score_step(
        self, plan: StepPlan, prompts: Sequence[np.ndarray]
    ) -> tuple[np.ndarray, list[TokenScores]]:
        """`run_step` that also scores the step's tokens: for row `b` (prompt
        `prompts[b]`), the log-prob of each next prompt token at the chunk's positions
        and the `TOP_SCORES` most likely tokens there (`TokenScores`, in position order;
        the prompt's last position, which predicts the output, is not scored)."""
        state, tokens, table, kv_lens, last = self._step_args(plan)
        targets = global_array(plan_targets(plan, prompts), self._shardings[0])
        shape = self.shape_of(plan)
        step = self.compiled_score_step(shape)
        self.step_shapes.add(shape)

        def scored(pool: KVPool):
            logits, pool, *scores = step(state, tokens, table, kv_lens, pool, last, targets)
            return (logits, *scores), pool

        logits, chosen, top_ids, top_lps, *hidden = self.kv.update(scored)
        self.last_hidden = np.asarray(hidden[0]) if hidden else None
        out = np.asarray(logits)
        if self._shadow is not None:  # the shadow's pool follows every step (SPEC S1.7)
            check_step(self, self._shadow, plan, out)
        chosen, top_ids, top_lps = (np.asarray(x) for x in (chosen, top_ids, top_lps))
        scores = []
        for b, prompt in enumerate(prompts):
            pos = plan.positions[b]
            keep = plan.valid[b] & (pos + 1 < len(prompt))
            order = np.argsort(pos[keep], kind="stable")
            slots = np.flatnonzero(keep)[order]
            scores.append(
                TokenScores(
                    int(pos[slots[0]]) + 1 if slots.size else 0,
                    chosen[b, slots],
                    top_ids[b, slots],
                    top_lps[b, slots],
                )
            )
        return out, scores

    def shape_of(self, plan: StepPlan) -> StepShape:
        rows, tokens = plan.input_ids.shape
        block = tokens // (2 * self.cp.cp_size)
        return StepShape(self.cp.cp_size, self.cp.page_size, rows, block, plan.page_table.shape[1])

    def compile_estimate(self, shapes: Iterable[StepShape]) -> tuple[int, float]:
        """Shapes of `shapes` not compiled yet and their estimated compile seconds."""
        return self._steps.estimate(set(shapes))

    def compile_jobs(self, shapes: Iterable[StepShape]) -> list[CompileJob]:
        """A background compile of each shape not compiled yet, narrowest page table
        first (short contexts are the common ones); see `aot.BackgroundCompiler`."""
        todo = set(shapes) - self._steps.compiled_keys()
        return [
            CompileJob(f"CP prefill step {s}", functools.partial(self.compiled_step, s))
            for s in sorted(todo, key=lambda s: (s.width, s.block, s.rows))
        ]

    def score_compile_jobs(self, shapes: Iterable[StepShape]) -> list[CompileJob]:
        """`compile_jobs` for the steps' scoring twins (`compiled_score_step`), which
        only prompt log-prob requests run (`--warmup-prompt-scoring`)."""
        todo = set(shapes) - self._score_steps.compiled_keys()
        return [
            CompileJob(
                f"CP prefill scoring step {s}", functools.partial(self.compiled_score_step, s)
            )
            for s in sorted(todo, key=lambda s: (s.width, s.block, s.rows))
        ]

    @property
    def compiled_score_shapes(self) -> set[StepShape]:
        """The scoring twins' shapes compiled so far."""
        return self._score_steps.compiled_keys()

    def warm(self, shapes: Iterable[StepShape]) -> int:
        """Compile each shape not compiled yet (on abstract inputs: no step runs and the
        pool is untouched); returns how many compiled."""
        todo = sorted(set(shapes) - self._steps.compiled_keys(), key=dataclasses.astuple)
        # A bar on a terminal only (tqdm's disable=None); each compile also logs its time.
        for shape in tqdm(todo, desc="compiling CP prefill steps", unit="shape", disable=None):
            self.compiled_step(shape)
            self.step_shapes.add(shape)
        return len(todo)

    def step_hlo_text(self, plan: StepPlan) -> str:
        """The optimized HLO of the step compiled for `plan`'s shape (for profilers:
        maps the instruction names in a trace back to their `named_scope`s)."""
        state, tokens, table, kv_lens, last = self._step_args(plan)
        lowered = self._step.lower(state, tokens, table, kv_lens, self.pool, last)
        return lowered.compile().as_text()

    def full_view(self, table: RequestPageTable) -> KVPool:
        """The request's materialized full view: leaves `[num_tokens, ...]` (device sync)."""
        width = page_table_width(table.num_pages, self.cp.cp_size)
        row = global_array(table.as_row(width)[None], self._shardings[1])
        views = self._view(self.pool, row)
        return jax.tree_util.tree_map(lambda v: v[0, : table.num_tokens], views)

    def views(self, page_table: np.ndarray) -> KVPool:
        """Materialized full views of page-table rows `[B, width]`: leaves `[B, tokens,
        ...]` (device sync; rows past a request's length are padding)."""
        return self._view(self.pool, global_array(page_table, self._shardings[1]))

    def release(self, table: RequestPageTable) -> None:
        table.release(self.allocator)


def plan_targets(plan: StepPlan, prompts: Sequence[np.ndarray]) -> np.ndarray:
    """Each slot's next prompt token (0 where there is none: padding, or the prompt's
    last token), in the plan's zigzag layout."""
    targets = np.zeros_like(plan.input_ids)
    for b, prompt in enumerate(prompts):
        pos = plan.positions[b]
        has_next = plan.valid[b] & (pos + 1 < len(prompt))
        targets[b] = np.where(has_next, prompt[np.minimum(pos + 1, len(prompt) - 1)], 0)
    return targets


def global_array(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from host data every process holds (works single- and multi-host)."""
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _build_step(
    graphdef,
    mesh: Mesh,
    layout: PoolLayout,
    kv_io: CPKVIO,
    index_k_dtype: str,
    form: AttnForm,
    invariant: bool,
    block_bytes: int | None,
    state_specs,
    ep: EPSpec | None,
    *,
    score: bool = False,
    mtp: bool = False,
):
    """The jitted CP step; with `score`, it also takes each slot's next prompt token and
    returns their scores (`score_tokens`) after the logits and the pool. With `mtp` the
    token fields end with each slot's next prompt token (-1: none) and, after the trunk,
    the MTP layer runs over the slots that have one, writing its KV; the step then also
    returns the trunk's final hidden state at each row's last new token (last)."""

    def per_rank(state, tokens, page_table, kv_lens, pool):
        input_ids, positions, valid, write_slots = tokens[:4]
        batch = ForwardBatch(input_ids, positions, valid, write_slots, page_table, kv_lens)
        model = nnx.merge(graphdef, state)
        with batch_invariant(invariant), token_block_bytes(block_bytes), ep_context(ep):
            hidden, pool = model(batch, pool, kv_io=kv_io, index_k_dtype=index_k_dtype, form=form)
            if mtp:
                pool = _mtp_pass(model, batch, tokens[4], hidden, pool, kv_io, index_k_dtype)
        return hidden, pool

    # Token fields split over cp (each rank: its two zigzag blocks); tables replicated;
    # routed experts split over cp under expert parallelism (`state_specs`).
    sharded = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(state_specs, P(None, CP_AXIS), P(), P(), layout.spec),
        out_specs=(P(None, CP_AXIS), layout.spec),
        # Replicated pools come out of all-gathered rows every rank writes identically;
        # the varying-manual-axes checker cannot prove that, so it is off.
        check_vma=False,
    )

    replicated = NamedSharding(mesh, P())

    extra = (replicated,) if mtp else ()

    @functools.partial(jax.jit, donate_argnums=(4,), out_shardings=(replicated, None, *extra))
    def step(state, tokens, page_table, kv_lens, pool, last_index):
        hidden, pool = sharded(state, tokens, page_table, kv_lens, pool)
        last = jnp.take_along_axis(hidden, last_index[:, None, None], axis=1)[:, 0]
        with batch_invariant(invariant):
            return nnx.merge(graphdef, state).logits(last), pool, *((last,) if mtp else ())

    @functools.partial(
        jax.jit,
        donate_argnums=(4,),
        out_shardings=(replicated, None) + (replicated,) * 3 + extra,
    )
    def score_step(state, tokens, page_table, kv_lens, pool, last_index, targets):
        hidden, pool = sharded(state, tokens, page_table, kv_lens, pool)
        last = jnp.take_along_axis(hidden, last_index[:, None, None], axis=1)[:, 0]
        model = nnx.merge(graphdef, state)
        with batch_invariant(invariant):
            scores = score_tokens(model, hidden, targets)
            return (model.logits(last), pool, *scores, *((last,) if mtp else ()))

    return score_step if score else step


def _mtp_pass(model: CausalLM, batch: ForwardBatch, next_ids, hidden, pool, kv_io, index_k_dtype):
    """The MTP layer over a step's tokens: position p sees the prompt's token at p + 1
    (`next_ids`) and the trunk's final hidden state at p, and writes its KV there; slots
    without a next token (padding, the prompt's last position: its next token is the
    first output token, drawn after the prefill) write nothing."""
    has = batch.valid & (next_ids >= 0)
    ids = jnp.maximum(next_ids, 0)
    mbatch = dataclasses.replace(
        batch, input_ids=ids, valid=has, write_slots=jnp.where(has, batch.write_slots, 0)
    )
    cfg = model.cfg
    cos, sin = rope_cos_sin(batch.positions, cfg.qk_rope_head_dim, cfg.rope)
    embeds = model.model.embed_tokens(ids)
    _, pool = model.mtp.predict(
        embeds, hidden, mbatch, pool, cos, sin, kv_io=kv_io, index_k_dtype=index_k_dtype
    )
    return pool


def _has_next(plan: StepPlan, prompts: Sequence[np.ndarray]) -> np.ndarray:
    """Slots whose position has a next prompt token (`plan_targets` writes 0 for both a
    token 0 and none)."""
    out = np.zeros_like(plan.valid)
    for b, prompt in enumerate(prompts):
        out[b] = plan.valid[b] & (plan.positions[b] + 1 < len(prompt))
    return out


def _build_view(mesh: Mesh, layout: PoolLayout, kv_io: CPKVIO):
    def per_rank(pool, page_table):
        return jax.tree_util.tree_map(lambda leaf: kv_io.view(leaf, page_table), pool)

    # Every rank ends with the same all-gathered view (see _build_step on check_vma).
    return jax.jit(
        jax.shard_map(
            per_rank, mesh=mesh, in_specs=(layout.spec, P()), out_specs=P(), check_vma=False
        )
    )


def pages_per_rank_for(total_tokens: int, page_size: int, cp: CPConfig, requests: int = 1) -> int:
    """Pages each rank needs to hold `requests` requests of `total_tokens` tokens in all,
    plus its trash page.

    Every request may end in a partial page, and each request's pages split over the
    lanes with at most one extra page on a lane: `sum_i ceil(n_i / lanes) <=
    ceil(sum_i n_i / lanes) + requests`.
    """
    pages = pages_for_tokens(total_tokens, page_size) + requests
    lanes = cp.cp_size if cp.shared_kv else 1
    extra = requests if lanes > 1 else 0
    return -(-pages // lanes) + extra + 1
