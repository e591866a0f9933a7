"""Decode on the CP mesh over page-owned pools: a request's KV striped over the ranks by
owner, attention where the pages live (issue 40 item 3).

A CP prefill leaves each request's logical page `p` on rank `p % cp` (SPEC S1.1).
`CPDecoder` decodes from those same pools, so a request is never gathered onto one
device: a CP8 group holds a request eight times as long as one rank's pool can, and a
unified CP mesh prefills and decodes with no transfer at all.

One decode step runs every request's next token inside `shard_map` over `"cp"`: the
batch rows are split over the ranks (`rows / cp` each: projections, the MoE with its
experts split over the same ranks as in the prefill, the LM head input), and MLA goes
through `OwnerCPKVIO(query_axis=0)`: the new tokens' KV rows are all-gathered and each
owner writes its own (`CPKVIO.write`), the indexer scores every rank's queries against
the index K each rank owns and merges the candidates exactly (`owner_topk`), and sparse
MLA attends over the owned rows of the selection and merges the partials by log-sum-exp
(`owner_attention`). Only queries, scores, candidates and partial outputs cross ranks;
no rank ever reads another's latent KV. Under batch-invariant numerics (opt-in, exact)
MLA goes through `CPKVIO(query_axis=0)` instead: each row's full view is put together
on its rank and the single-device indexer and attention run on it, so the step's bits
are one device's (`tests/core/test_cp_decode.py`).

Speculative decoding on the group (`serving.decode.speculative.SpeculativeSteps` with a
`CPDecoder`) runs `cpkv_jax.speculative`'s programs per rank the same way
(`row_placement`, `decode_mesh.dp_slab_program`): each rank verifies and drafts the rows
of its draft-state slots, the trunk and the MTP layer through this decoder's `kv_io`,
whose `slots` puts each token's KV on its owner lane (`lane_pages`); a drafting runner's
pool holds the MTP layer's KV striped like the trunk's.

DP groups of CP ranks (`("dp", "cp")`, a PD decode server with `--dp-size G --cp-size N`):
`DecodeGroups` holds the weights on the 2-D mesh (routed experts over all `G x N`
devices) and every group's page-owned pool (lane `g * N + l` is group `g`'s lane `l`);
a `CPDecoder` over it splits each step's rows over both axes, group `g`'s rows on its
ranks (`plan_groups`), and owner attention's collectives name `"cp"` alone, so a group
attends over its own lanes.

Host planning (`plan`) is numpy: each row's next position extends its
`RequestPageTable` on the owner lanes (all-or-nothing), and the step's shapes are
bucketed - rows to `cp` times a power of two, the page table to
`page_table_width` - so compiles are bounded by the bucket count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cpkv_jax.aot import ShapeCache, abstract
from cpkv_jax.buckets import page_table_width, pow2_at_least
from cpkv_jax.config import CPConfig, ModelConfig
from cpkv_jax.cp_prefill import CPPrefillRunner, global_array
from cpkv_jax.decode_mesh import DPPlacement
from cpkv_jax.errors import InputError
from cpkv_jax.kv_layout import KVLayout
from cpkv_jax.kv_pool import PoolLayout, cp_pool_shapes, zeros_in
from cpkv_jax.kv_store import DevicePool
from cpkv_jax.lane_allocator import RequestPageTable
from cpkv_jax.materialize import CPKVIO
from cpkv_jax.mesh import CP_AXIS, DP_AXIS, GROUP_AXES
from cpkv_jax.model.expert_parallel import EPSpec, check_ep_spec, param_shardings, param_specs
from cpkv_jax.model.expert_parallel import expert_parallel as ep_context
from cpkv_jax.model.forward_batch import ForwardBatch, feed_ids
from cpkv_jax.model.kv_cache import DTYPES, IndexKDtype
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.model.numerics import batch_invariant, token_block_bytes
from cpkv_jax.model.transformer import log_probs
from cpkv_jax.owner_attention import OwnerCPKVIO
from cpkv_jax.paging import padded_page_table
from cpkv_jax.sampling import rows_log_probs

# (rows, page-table width): one compiled decode step per bucket.
DecodeShape = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Host-built inputs of one CP decode step (numpy): `[rows, 1]` token fields (padding
    rows: valid False, written to lane 0's trash page), `[rows, width]` page-table rows
    (local page of logical page `p` on lane `p % cp`), `[rows]` KV lengths after the
    step. `n` rows are real."""

    input_ids: np.ndarray
    positions: np.ndarray
    valid: np.ndarray
    write_slots: np.ndarray
    page_table: np.ndarray
    kv_lens: np.ndarray
    n: int

    @property
    def shape(self) -> DecodeShape:
        return self.input_ids.shape[0], self.page_table.shape[1]


# One decode row: (token fed, its position, the request's local page by logical page,
# the pages its table must show: at least those, as many as it reserved).
CPRow = tuple[int, int, np.ndarray, int]


def plan_rows(layout: PoolLayout, rows: Sequence[CPRow]) -> DecodePlan:
    """The host inputs of one CP decode step (numpy, no device work): row `i` feeds its
    token at its position, writing it into logical page `pos // page_size` on lane
    `page % cp` (`PoolLayout.global_slots`). Rows are padded to `cp` times a power of two
    (`rows / cp` per rank), the page table to `page_table_width` of the widest row."""
    if not rows:
        raise InputError("a decode step needs at least one row")
    cp, page = layout.cp_size, layout.page_size
    n = len(rows)
    rows_p = cp * pow2_at_least(-(-n // cp))
    width = page_table_width(max(r[3] for r in rows), cp)
    ids = np.zeros((rows_p, 1), np.int32)
    positions = np.zeros((rows_p, 1), np.int32)
    valid = np.zeros((rows_p, 1), bool)
    slots = np.zeros((rows_p, 1), np.int32)  # padding rows: lane 0's trash page
    table = np.zeros((rows_p, width), np.int32)
    kv_lens = np.zeros((rows_p,), np.int32)
    pos = np.asarray([r[1] for r in rows], np.int64)
    logical = pos // page
    local = np.asarray([r[2][p] for r, p in zip(rows, logical, strict=True)], np.int64)
    ids[:n, 0] = [r[0] for r in rows]
    positions[:n, 0], valid[:n, 0] = pos, True
    slots[:n, 0] = layout.global_slots(logical % cp, local, pos % page)
    for i, r in enumerate(rows):
        table[i] = padded_page_table(r[2], width)
    kv_lens[:n] = pos + 1
    return DecodePlan(ids, positions, valid, slots, table, kv_lens, n)


def plan_groups(
    layout: PoolLayout, groups: Sequence[Sequence[CPRow]]
) -> tuple[DecodePlan, list[list[int]]]:
    """One decode step's host inputs for DP groups of CP ranks (`build_decode_step` with
    `row_axes=("dp", "cp")`; `layout` is one group's lanes): group `g`'s rows planned as
    `plan_rows` plans them (its lanes' global slots and local pages), padded to the
    busiest group's row bucket and the widest table, and stacked group-major, so the
    rows split over `("dp", "cp")` put each group's on its own ranks. An idle group runs
    padding rows (valid False, lane 0's trash page). Returns the plan (`n`: all its
    rows) and, per group, the plan row of each of its rows."""
    planned = [plan_rows(layout, rows) if rows else None for rows in groups]
    shapes = [p.shape for p in planned if p is not None]
    if not shapes:
        raise InputError("a decode step needs at least one row")
    rows_p, width = max(r for r, _ in shapes), max(w for _, w in shapes)
    fields: list[list[np.ndarray]] = [[] for _ in range(6)]
    for p in planned:
        padded = (
            np.zeros((rows_p, 1), np.int32),
            np.zeros((rows_p, 1), np.int32),
            np.zeros((rows_p, 1), bool),
            np.zeros((rows_p, 1), np.int32),
            np.zeros((rows_p, width), np.int32),
            np.zeros((rows_p,), np.int32),
        )
        if p is not None:
            mine = (p.input_ids, p.positions, p.valid, p.write_slots, p.page_table, p.kv_lens)
            for a, b in zip(padded, mine, strict=True):
                a[tuple(slice(0, n) for n in b.shape)] = b
        for f, a in zip(fields, padded, strict=True):
            f.append(a)
    plan = DecodePlan(*(np.concatenate(f) for f in fields), n=rows_p * len(groups))
    return plan, [[g * rows_p + j for j in range(len(rows))] for g, rows in enumerate(groups)]


class DecodeGroups:
    """DP groups of CP ranks for decode (issue 40 item 3): the model's weights placed on a
    `("dp", "cp")` mesh (routed experts split over both axes under `expert_parallel`, the
    rest replicated) and every group's page-owned pool, lane `g * cp + l` holding group
    `g`'s lane `l`, so global page ids (`lane * pages_per_rank + local`) number the pool
    as a DP pool's shards and a request's pages stripe over its group's lanes. It holds
    what a `CPDecoder` reads of a `CPPrefillRunner`, and runs no prefill: a PD decode
    server's prompts arrive as KV. `mtp`: the pool keeps the MTP layer's KV too."""

    def __init__(
        self,
        cfg: ModelConfig,
        model,
        mesh,
        cp: CPConfig,
        *,
        pages_per_rank: int,
        index_k_dtype: IndexKDtype = "fp8_e4m3",
        gather_impl: str = "xla",
        batch_invariant: bool = False,
        block_bytes: int | None = None,
        expert_parallel: EPSpec | None = None,
        mtp: bool = False,
    ):
        if tuple(mesh.axis_names) != GROUP_AXES:
            raise InputError(f"decode groups run on a {GROUP_AXES} mesh, got {mesh.axis_names}")
        if mesh.shape[CP_AXIS] != cp.cp_size or not cp.shared_kv:
            raise InputError(
                f"decode groups need page-owned KV over the mesh's {mesh.shape[CP_AXIS]} cp "
                f"ranks, got cp_size {cp.cp_size} shared_kv {cp.shared_kv}"
            )
        self.groups = mesh.shape[DP_AXIS]
        if mtp and model.mtp is None:
            raise InputError("drafting decode groups (mtp=True) need the model's MTP layer")
        if expert_parallel is not None:
            check_ep_spec(expert_parallel, GROUP_AXES, mesh.size, cfg.n_routed_experts)
        self.cfg, self.cp, self.mesh = cfg, cp, mesh
        self.index_k_dtype = index_k_dtype
        self.batch_invariant = batch_invariant
        self.block_bytes = block_bytes
        self.layout = PoolLayout(cp.cp_size, True, pages_per_rank, cp.page_size)  # one group
        self.kv_io = OwnerCPKVIO(cp.cp_size, True, gather_impl)
        self.graphdef, state = nnx.split(model)
        self.expert_parallel = expert_parallel
        ep_axis = None if expert_parallel is None else GROUP_AXES
        self.state = jax.device_put(state, param_shardings(state, mesh, ep_axis))
        self.pool_cfg = pool_cfg = mtp_config(cfg) if mtp else cfg
        lanes = PoolLayout(mesh.size, True, pages_per_rank, cp.page_size)
        shapes = cp_pool_shapes(pool_cfg, lanes, model.dtype, index_k_dtype)
        split = NamedSharding(mesh, P(GROUP_AXES))  # pages over every group's lanes
        self.kv = DevicePool(zeros_in(shapes, jax.tree.map(lambda _: split, shapes)))

    @property
    def pool(self):
        return self.kv.current


class CPDecoder:
    """Decode steps over a shared-KV `CPPrefillRunner`'s pools, allocator and placed
    weights (its mesh, EP and numerics settings too), or over `DecodeGroups` (rows split
    over both axes, group by group). The pool lock is held while a step swaps the pool,
    as for the runner's own steps."""

    def __init__(self, runner: CPPrefillRunner | DecodeGroups):
        if not runner.cp.shared_kv:
            raise InputError(
                "CP decode needs page-owned KV (`shared_kv`): with replicated pools one rank "
                "already holds every page"
            )
        self.runner = runner
        # DP groups of CP ranks: the rows split over both axes, one group's on its ranks.
        grouped = isinstance(runner, DecodeGroups)
        self.groups = runner.groups if grouped else 1
        self.row_axes: str | tuple[str, ...] = GROUP_AXES if grouped else CP_AXIS
        cp = runner.cp.cp_size
        # `lane_pages`: the speculative programs compute their write slots on the device
        # (a drafting runner's pool holds the MTP layer's KV too; these steps read and
        # write the trunk's layers only). Batch-invariant numerics: each row's full view
        # is put together on its rank (`CPKVIO`, rows split), so the single-device
        # indexer and attention run on the same bits - an opt-in exact mode whose step
        # transient grows with the context, as the full-view CP prefill's does; else
        # owner attention, whose log-sum-exp merge depends on how the keys split.
        io = CPKVIO if runner.batch_invariant else OwnerCPKVIO
        self.kv_io = io(
            cp,
            True,
            runner.kv_io.gather_impl,
            query_axis=0,
            lane_pages=runner.layout.pages_per_rank,
        )
        self._step = _build_decode_step(runner, self.kv_io, self.row_axes)
        self.steps: ShapeCache[DecodeShape] = ShapeCache("CP decode step")
        # Every input and the logits: rows split (a rank's rows' logits stay on it).
        self._split = NamedSharding(runner.mesh, P(self.row_axes))
        self.replicated = NamedSharding(runner.mesh, P())
        self._feed = jax.jit(feed_ids, out_shardings=self._split)
        # `step`'s log-probs, each rank its rows', then on every device: every process
        # reads them whole.
        self._whole = jax.jit(lambda a: a, out_shardings=self.replicated)

    @property
    def usable_pages_per_lane(self) -> int:
        """Pages a lane gives requests (its trash page excluded)."""
        return self.runner.layout.pages_per_rank - 1

    # ---- host planning ----------------------------------------------------------------
    def plan(self, tables: Sequence[RequestPageTable], tokens: Sequence[int]) -> DecodePlan:
        """One step: row `i` feeds `tokens[i]` at position `tables[i].num_tokens` and
        grows its table by that token (pages on the owner lanes). All or nothing: on
        `CacheCapacityError` every table is as it was and no page is taken."""
        runner = self.runner
        if not isinstance(runner, CPPrefillRunner):
            raise InputError("decode groups plan from the engine's pages (`plan_groups`)")
        if not tables or len(tables) != len(tokens):
            raise InputError(f"{len(tables)} tables for {len(tokens)} tokens")
        positions = [t.num_tokens for t in tables]
        grown: list[RequestPageTable] = []
        try:
            for table, pos in zip(tables, positions, strict=True):
                table.extend(runner.allocator, pos + 1, runner.cp.page_size)
                grown.append(table)
        except Exception:
            for table, pos in zip(grown, positions, strict=False):
                table.truncate(runner.allocator, pos)
            raise
        rows = [
            (tok, pos, t.local_pages(), t.num_pages)
            for t, tok, pos in zip(tables, tokens, positions, strict=True)
        ]
        return plan_rows(runner.layout, rows)

    # ---- device step ------------------------------------------------------------------
    def compiled_step(self, shape: DecodeShape) -> jax.stages.Compiled:
        """The step's executable for `(rows, width)`, compiled on abstract inputs once."""
        split = self._split
        rows, width = shape

        def spec(dims, dtype, sharding):
            return jax.ShapeDtypeStruct(dims, dtype, sharding=sharding)

        tokens = tuple(spec((rows, 1), d, split) for d in (np.int32, np.int32, bool, np.int32))
        args = (
            abstract(self.runner.state),
            tokens,
            spec((rows, width), np.int32, split),
            spec((rows,), np.int32, split),
            abstract(self.runner.pool),
        )
        return self.steps.get(shape, lambda: self._step.lower(*args))

    @property
    def rows_sharding(self) -> NamedSharding:
        """Where a step's rows and their logits live: split over the row axes."""
        return self._split

    def launch(self, plan: DecodePlan, input_ids: jax.Array | None = None) -> jax.Array:
        """Dispatch one step, fetching nothing: the logits `[rows, vocab]` of every row
        (`plan_rows`: real rows first; `plan_groups`: group-major), each on the rank that
        ran it. `input_ids`: the step's ids already on the device (`feed`), instead of
        the plan's."""
        split = self._split
        host = (plan.input_ids, plan.positions, plan.valid, plan.write_slots)
        tokens = tuple(global_array(x, split) for x in host)
        if input_ids is not None:
            tokens = (input_ids, *tokens[1:])
        table, kv_lens = global_array(plan.page_table, split), global_array(plan.kv_lens, split)
        step = self.compiled_step(plan.shape)  # before the pool lock: it may compile
        state = self.runner.state
        return self.runner.kv.update(lambda pool: step(state, tokens, table, kv_lens, pool))

    def feed(self, prev: jax.Array, src: np.ndarray, host_ids: np.ndarray) -> jax.Array:
        """A step's `[rows, 1]` input ids on the device, split as its rows: row `i` feeds
        `prev[src[i]]` (a token the last draw left on the device) where `src[i] >= 0`,
        `host_ids[i]` otherwise (`forward_batch.feed_ids`)."""
        return self._feed(prev, src, host_ids)

    def step(self, plan: DecodePlan) -> np.ndarray:
        """Run one step; the log-probs `[n, vocab]` of each real row's next token."""
        lp = self._whole(rows_log_probs(self.launch(plan), self.runner.batch_invariant))
        return np.asarray(lp)[: plan.n]

    def generate(
        self,
        prompts: Sequence[Sequence[int] | np.ndarray],
        max_new_tokens: int,
        chunked_prefill_size: int | None = None,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Greedy generation of every prompt together: CP prefill, then CP decode steps
        over the same pools (no transfer). Returns each prompt's tokens and their
        log-probs; the requests' pages are released at the end."""
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        runner = self.runner
        if not isinstance(runner, CPPrefillRunner):
            raise InputError("decode groups do not prefill: their prompts arrive as KV")
        result = runner.prefill(prompts, chunked_prefill_size)
        tables = result.tables
        try:
            lp = np.asarray(log_probs(jnp.asarray(result.last_logits), runner.batch_invariant))
            tokens = [[int(np.argmax(row))] for row in lp]
            scores = [[float(row[t[0]])] for row, t in zip(lp, tokens, strict=True)]
            for _ in range(max_new_tokens - 1):
                lp = self.step(self.plan(tables, [t[-1] for t in tokens]))
                for i, row in enumerate(lp):
                    tokens[i].append(int(np.argmax(row)))
                    scores[i].append(float(row[tokens[i][-1]]))
        finally:
            for table in tables:
                runner.release(table)
        return tokens, scores


def row_placement(
    runner: CPPrefillRunner | DecodeGroups, row_axes: str | tuple[str, ...] = CP_AXIS
) -> DPPlacement:
    """The runner's placed weights as the rows-split programs of a decode mesh take them
    (`decode_mesh.dp_slab_program`): a CP group's speculative steps, each rank running
    its share of the rows (and of the draft-state slab) over the group's pool, rows
    split over `row_axes` (`("dp", "cp")` for DP groups), experts exchanged over the
    runner's EP axis."""
    mesh, ep = runner.mesh, runner.expert_parallel
    return DPPlacement(
        mesh,
        runner.graphdef,
        runner.state,
        param_specs(runner.state, None if ep is None else ep.axis),
        ep,
        NamedSharding(mesh, P(row_axes)),
        NamedSharding(mesh, P()),
    )


def _build_decode_step(
    runner: CPPrefillRunner | DecodeGroups, kv_io: CPKVIO, row_axes: str | tuple[str, ...]
):
    """The runner's decode step (`build_decode_step` with its settings); the pool's pages
    and the rows split over `row_axes`, the experts over the runner's EP axis."""
    ep = runner.expert_parallel
    return build_decode_step(
        runner.graphdef,
        runner.mesh,
        P(row_axes),
        kv_io,
        param_specs(runner.state, None if ep is None else ep.axis),
        ep=ep,
        invariant=runner.batch_invariant,
        block_bytes=runner.block_bytes,
        index_k_dtype=runner.index_k_dtype,
        row_axes=row_axes,
    )


def build_decode_step(
    graphdef,
    mesh,
    pool_spec,
    kv_io: CPKVIO,
    state_specs,
    *,
    ep=None,
    invariant: bool = False,
    block_bytes: int | None = None,
    index_k_dtype: str = "fp8_e4m3",
    row_axes: str | tuple[str, ...] = CP_AXIS,
):
    """The jitted decode step: `(state, tokens, page_table, kv_lens, pool) -> (logits
    [rows, vocab] split as the rows, pool)`, the pool donated. Explicit settings, so it lowers on
    abstract weights too (`benchmarks/decode_memory.py --cp`). `row_axes`: the mesh axes
    the rows split over (`("dp", "cp")`: DP groups of CP ranks, each group's rows on its
    ranks; owner attention's collectives name `"cp"` alone, so they stay in a group)."""

    def per_rank(state, tokens, page_table, kv_lens, pool):
        batch = ForwardBatch(*tokens, page_table, kv_lens)
        model = nnx.merge(graphdef, state)
        with batch_invariant(invariant), token_block_bytes(block_bytes), ep_context(ep):
            hidden, pool = model(batch, pool, kv_io=kv_io, index_k_dtype=index_k_dtype)
            return model.logits(hidden[:, 0]), pool

    # Rows split over cp, their tables and lengths too (owner attention all-gathers
    # them); routed experts split over cp under EP, as in the prefill step.
    sharded = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(state_specs, P(row_axes), P(row_axes), P(row_axes), pool_spec),
        out_specs=(P(row_axes), pool_spec),
        check_vma=False,
    )
    return jax.jit(sharded, donate_argnums=(4,))


def decode_bytes_per_rank(
    cfg: ModelConfig,
    context_tokens: int,
    cp_size: int,
    *,
    page_size: int = 64,
    dtype: str = "bfloat16",
    index_k_dtype: str = "fp8_e4m3",
) -> dict[str, int]:
    """KV bytes one rank reads, and bytes it sends, per decode row per step (every layer),
    for a request of `context_tokens`: `cp_size` 1 is a data-parallel rank (the whole
    request on it); above 1 a CP decode group with owner attention (this module). From the
    model's `KVLayout`, as the pools are sized.

    - `index_k_read`: every full indexer layer scores the whole owned index K (and its
      fp8 scales): `ceil(context / cp)` tokens per rank;
    - `latent_read`: the selected rows each rank gathers: on one rank the top-k; on a CP
      rank its compact pass (`ceil(2 * k / cp)` rows, twice the even share, which the
      exact fall-back to `k` exceeds only for a query whose selection piles onto one rank);
    - `sent` (CP only; what leaves the rank for its row, the exchanges of
      `owner_attention` and `CPKVIO.write`): on every layer its query `q_nope, q_pe` (in
      `dtype`) to every other rank, back from each its partial output through `w_uv`
      (float32, heads x v_head_dim) with max and sum, and the new token's KV row to its
      owner; on full indexer layers the indexer query (float32) and head weights, the
      `k_local` candidates (score, position) back, the selected top-k positions, and the
      new token's index K; once per step the row's page table (at the step's bucketed
      width), position, length and write slot. XLA merges a shared layer's repeat of an
      identical exchange (`tests/core/test_cp_decode.py` counts the compiled step's
      collectives against this). 0 for a DP rank.
    """
    layout = KVLayout.from_model(cfg, page_size, dtype, index_k_dtype)
    kinds = layout.by_kind()
    latent = kinds["latent"].token_bytes
    index = kinds["index_k"].token_bytes if "index_k" in kinds else 0
    scale = kinds["index_scale"].token_bytes if "index_scale" in kinds else 0
    full = len(cfg.full_indexer_layers)
    layers = cfg.num_hidden_layers
    k = min(cfg.index_topk, context_tokens)
    owned = -(-context_tokens // cp_size)
    rows = k if cp_size == 1 else min(k, -(-2 * k // cp_size))
    out = {
        "index_k_read": full * owned * (index + scale),
        "latent_read": layers * rows * latent,
    }
    if cp_size == 1:
        out["sent"] = 0
    else:
        peers = cp_size - 1
        width = page_table_width(-(-context_tokens // page_size), cp_size)
        h, itemsize = cfg.num_attention_heads, np.dtype(DTYPES[dtype]).itemsize
        attn = h * (cfg.qk_head_dim * itemsize + (cfg.v_head_dim + 2) * 4) + latent
        k_local = min(cfg.index_topk, width // cp_size * page_size)  # the padded owned width
        index_q = cfg.index_n_heads * (cfg.index_head_dim + 1) * 4
        indexer = index_q + k_local * 8 + k * 4 + index + scale
        step = (width + 3) * 4  # page table, position, length, write slot (int32)
        out["sent"] = peers * (layers * attn + full * indexer + step)
    out["total"] = sum(out.values())
    return out
