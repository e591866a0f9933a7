"""Decode on the CP mesh over page-owned pools: a request's KV striped over the ranks by
owner, attention where the pages live (issue 40 item 3, the library step).

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
no rank ever reads another's latent KV.

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
from cpkv_jax.config import ModelConfig
from cpkv_jax.cp_prefill import CPPrefillRunner, global_array
from cpkv_jax.errors import InputError
from cpkv_jax.kv_layout import KVLayout
from cpkv_jax.lane_allocator import RequestPageTable
from cpkv_jax.mesh import CP_AXIS
from cpkv_jax.model.expert_parallel import expert_parallel as ep_context
from cpkv_jax.model.expert_parallel import param_specs
from cpkv_jax.model.forward_batch import ForwardBatch
from cpkv_jax.model.numerics import batch_invariant, token_block_bytes
from cpkv_jax.model.transformer import log_probs
from cpkv_jax.owner_attention import OwnerCPKVIO

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


class CPDecoder:
    """Decode steps over a shared-KV `CPPrefillRunner`'s pools, allocator and placed
    weights (its mesh, EP and numerics settings too). The runner's pool lock is held
    while a step swaps the pool, as for its own steps."""

    def __init__(self, runner: CPPrefillRunner):
        if not runner.cp.shared_kv:
            raise InputError(
                "CP decode needs page-owned KV (`shared_kv`): with replicated pools one rank "
                "already holds every page"
            )
        if runner.mtp:
            raise InputError("CP decode does not run the MTP layer (no speculative decoding)")
        self.runner = runner
        cp = runner.cp.cp_size
        self.kv_io = OwnerCPKVIO(cp, True, runner.kv_io.gather_impl, query_axis=0)
        self._step = _build_decode_step(runner, self.kv_io)
        self._steps: ShapeCache[DecodeShape] = ShapeCache("CP decode step")
        self._split = NamedSharding(runner.mesh, P(CP_AXIS))  # every input: rows over cp

    # ---- host planning ----------------------------------------------------------------
    def plan(self, tables: Sequence[RequestPageTable], tokens: Sequence[int]) -> DecodePlan:
        """One step: row `i` feeds `tokens[i]` at position `tables[i].num_tokens` and
        grows its table by that token (pages on the owner lanes; all-or-nothing per row:
        `CacheCapacityError` leaves that row's table unchanged)."""
        runner = self.runner
        cp, page = runner.cp.cp_size, runner.cp.page_size
        if not tables or len(tables) != len(tokens):
            raise InputError(f"{len(tables)} tables for {len(tokens)} tokens")
        positions = [t.num_tokens for t in tables]
        for table, pos in zip(tables, positions, strict=True):
            table.extend(runner.allocator, pos + 1, page)
        rows = cp * pow2_at_least(-(-len(tables) // cp))  # a multiple of cp, then pow2
        width = page_table_width(max(t.num_pages for t in tables), cp)
        ids = np.zeros((rows, 1), np.int32)
        pos_arr = np.zeros((rows, 1), np.int32)
        valid = np.zeros((rows, 1), bool)
        slots = np.zeros((rows, 1), np.int32)
        table_rows = np.zeros((rows, width), np.int32)
        kv_lens = np.zeros((rows,), np.int32)
        n = len(tables)
        pos = np.asarray(positions, np.int64)
        logical = pos // page
        local = np.asarray([t.local_pages()[p] for t, p in zip(tables, logical, strict=True)])
        ids[:n, 0], pos_arr[:n, 0], valid[:n, 0] = tokens, pos, True
        slots[:n, 0] = runner.layout.global_slots(logical % cp, local, pos % page)
        for i, table in enumerate(tables):
            table_rows[i] = table.as_row(width)
        kv_lens[:n] = pos + 1
        return DecodePlan(ids, pos_arr, valid, slots, table_rows, kv_lens, n)

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
        return self._steps.get(shape, lambda: self._step.lower(*args))

    def step(self, plan: DecodePlan) -> np.ndarray:
        """Run one step; the log-probs `[n, vocab]` of each real row's next token."""
        split = self._split
        fields = (plan.input_ids, plan.positions, plan.valid, plan.write_slots)
        tokens = tuple(global_array(x, split) for x in fields)
        table, kv_lens = global_array(plan.page_table, split), global_array(plan.kv_lens, split)
        step = self.compiled_step(plan.shape)
        state = self.runner.state

        def run(pool):
            lp, pool = step(state, tokens, table, kv_lens, pool)
            return lp, pool

        return np.asarray(self.runner.kv.update(run))[: plan.n]

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


def _build_decode_step(runner: CPPrefillRunner, kv_io: OwnerCPKVIO):
    """The runner's decode step (`build_decode_step` with its settings)."""
    return build_decode_step(
        runner.graphdef,
        runner.mesh,
        runner.layout.spec,
        kv_io,
        param_specs(runner.state, None if runner.expert_parallel is None else CP_AXIS),
        ep=runner.expert_parallel,
        invariant=runner.batch_invariant,
        block_bytes=runner.block_bytes,
        index_k_dtype=runner.index_k_dtype,
    )


def build_decode_step(
    graphdef,
    mesh,
    pool_spec,
    kv_io: OwnerCPKVIO,
    state_specs,
    *,
    ep=None,
    invariant: bool = False,
    block_bytes: int | None = None,
    index_k_dtype: str = "fp8_e4m3",
):
    """The jitted decode step: `(state, tokens, page_table, kv_lens, pool) -> (log-probs
    [rows, vocab] replicated, pool)`, the pool donated. Explicit settings, so it lowers on
    abstract weights too (`benchmarks/decode_memory.py --cp`)."""

    def per_rank(state, tokens, page_table, kv_lens, pool):
        batch = ForwardBatch(*tokens, page_table, kv_lens)
        model = nnx.merge(graphdef, state)
        with batch_invariant(invariant), token_block_bytes(block_bytes), ep_context(ep):
            hidden, pool = model(batch, pool, kv_io=kv_io, index_k_dtype=index_k_dtype)
            return log_probs(model.logits(hidden[:, 0]), invariant), pool

    # Rows split over cp, their tables and lengths too (owner attention all-gathers
    # them); routed experts split over cp under EP, as in the prefill step.
    sharded = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(state_specs, P(CP_AXIS), P(CP_AXIS), P(CP_AXIS), pool_spec),
        out_specs=(P(CP_AXIS), pool_spec),
        check_vma=False,
    )
    replicated = NamedSharding(mesh, P())
    return jax.jit(sharded, donate_argnums=(4,), out_shardings=(replicated, None))


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
    - `sent` (CP only; what leaves the rank for each query, once per layer): its
      absorbed query `[q_lat, q_pe]` (float32, heads x (kv_lora + rope)) to every other
      rank, and back from each its partial output (heads x kv_lora) with max and sum;
      on full layers the indexer query and head weights, `k_local` candidates (score and
      position) back, the new token's KV row; 0 for a DP rank.
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
        h, row = cfg.num_attention_heads, cfg.kv_cache_dim
        attn = peers * h * (row + cfg.kv_lora_rank + 2) * 4
        k_local = min(cfg.index_topk, owned)
        index_q = cfg.index_n_heads * (cfg.index_head_dim + 1) * 4
        indexer = peers * (index_q + k_local * 8)
        out["sent"] = layers * (attn + peers * latent) + full * (indexer + peers * (index + scale))
    out["total"] = sum(out.values())
    return out
