"""Data-parallel decode on a `("dp",)` mesh with expert-parallel MoE (issue 36).

MLA keeps one latent KV head, so tensor parallelism would hold every request's KV on
every rank. Data-parallel attention keeps a request on one rank instead: its pages live
in that rank's shard of the pool and its rows run there. Routed experts are sharded over
the same devices (`expert_parallel` on the `"dp"` axis); attention, indexer, dense
layers, shared experts and the LM head are replicated.

Pool (`DPPoolLayout`): every leaf is `[dp * pages_per_rank, page_size, ...]` with its
page axis split over `"dp"`, so rank `r` holds pages `[r * ppr, (r + 1) * ppr)`. The
host speaks *global* page ids (`r * ppr + local`): the allocator, the transfer
receiver's scatter (a jitted scatter on the sharded pool is partitioned by XLA) and the
engine. Batches carry *rank-local* ids, built on the host by `DPBatch`, so inside
`shard_map` each rank runs the unchanged single-device model on its shard; local page 0
of every rank is that rank's trash page.

One step runs every rank's rows, padded to a common row bucket and page-table width:
an idle rank runs padding rows (valid False, written to its trash page) and still joins
the MoE collectives. Logits stay `[dp * rows, vocab]`, rank-major, each rank's rows on
that rank (`order` says whose each is), and the sampler draws there
(`cpkv_jax.sampling.StepLogits`): no rank receives another's vocabulary-wide rows (at
GLM-5's vocabulary and 32 rows per rank, DP8 would move 139 MB into every device per
step) or sorts them.

`choose_rank` is the admission policy, pure host-side: the rank with the most free
pages that can take the request, then the fewest running rows, then round robin. With a
prefix cache per rank (a unified server, `choose_rank_for_prefix`) the rank caching the
longest prefix of the prompt wins first, unless it runs more than `PREFIX_ROW_SLACK`
rows beyond the least busy rank that could take the request.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from cpkv_jax.aot import ShapeCache, abstract
from cpkv_jax.buckets import pow2_at_least, prefill_bucket
from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import ConfigError
from cpkv_jax.kv_pool import zeros_in
from cpkv_jax.mesh import DP_AXIS
from cpkv_jax.model.expert_parallel import EPDispatch, EPSpec, check_divisible, param_shardings
from cpkv_jax.model.expert_parallel import expert_parallel as ep_context
from cpkv_jax.model.forward_batch import ForwardBatch, abstract_batch, feed_ids
from cpkv_jax.model.kv_cache import (
    SINGLE_DEVICE_KV_IO,
    TRASH_PAGE,
    IndexKDtype,
    KVPool,
    PagedKVIO,
    pool_shapes,
)
from cpkv_jax.model.mla import AttnForm
from cpkv_jax.model.numerics import batch_invariant, token_block_bytes
from cpkv_jax.model.transformer import CausalLM, last_token_logits, score_tokens
from cpkv_jax.paging import padded_page_table, slots_for_positions

# A compiled DP step: (form, rows per rank, tokens per row, page-table width).
DPShape = tuple[str, int, int, int]
# Prefill and decode rows alike run the absorbed MLA form (the servers' only one).
FORM: AttnForm = "absorbed"


@dataclasses.dataclass(frozen=True)
class DPPoolLayout:
    dp_size: int
    pages_per_rank: int  # physical pages each rank holds, its trash page included
    page_size: int

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ConfigError(f"`dp_size` must be >= 1, got {self.dp_size}")
        if self.pages_per_rank < 2:
            raise ConfigError(
                f"each DP rank needs >= 2 pages (its trash page + one usable), got "
                f"{self.pages_per_rank}; raise the KV pool size"
            )

    @property
    def global_pages(self) -> int:
        return self.dp_size * self.pages_per_rank

    def rank_of(self, page: int | np.integer) -> int:
        """The rank holding global page `page`."""
        return int(page) // self.pages_per_rank

    def local(self, pages: np.ndarray, rank: int) -> np.ndarray:
        """Rank-local ids of global `pages`, which must all be rank `rank`'s."""
        pages = np.asarray(pages)
        local = pages - rank * self.pages_per_rank
        if local.size and (local.min() < 0 or local.max() >= self.pages_per_rank):
            raise ValueError(f"pages {pages.tolist()} are not all on DP rank {rank}")
        return local

    def trash_page(self, rank: int) -> int:
        """Global id of rank `rank`'s trash page (its local page 0)."""
        return rank * self.pages_per_rank + TRASH_PAGE


def init_dp_pool(
    cfg: ModelConfig,
    layout: DPPoolLayout,
    mesh: Mesh,
    dtype: DTypeLike = jnp.float32,
    index_k_dtype: IndexKDtype = "fp8_e4m3",
) -> KVPool:
    """A zero pool created in its sharding (page axis over `"dp"`, no host copy)."""
    shapes = pool_shapes(cfg, layout.global_pages, layout.page_size, dtype, index_k_dtype)
    sharding = NamedSharding(mesh, P(DP_AXIS))
    return zeros_in(shapes, jax.tree_util.tree_map(lambda _: sharding, shapes))


def choose_rank(
    free_pages: Sequence[int],
    running: Sequence[int],
    need_pages: int,
    max_running_per_rank: int,
    first: int = 0,
) -> int | None:
    """The DP rank a request needing `need_pages` pages goes to, or None when no rank
    can take it now: most free pages, then fewest running rows, then the first in
    cyclic order from `first` (the engine passes the rank after its last admission, so
    ties rotate over the ranks as round robin does)."""
    n = len(free_pages)
    best: tuple[int, int, int] | None = None
    for rank, (free, rows) in enumerate(zip(free_pages, running, strict=True)):
        if free < need_pages or rows >= max_running_per_rank:
            continue
        key = (-free, rows, (rank - first) % n)
        if best is None or key < best:
            best = key
    return None if best is None else (best[2] + first) % n


# How many more running rows than the least busy rank that could take a request a rank
# may have and still win it for the prefix it caches: every step pads all ranks to the
# busiest one's rows, so a shared prefix must not pile its requests onto one rank.
PREFIX_ROW_SLACK = 2


def choose_rank_for_prefix(
    free_pages: Sequence[int],
    cached_pages: Sequence[int],
    running: Sequence[int],
    need_pages: int,
    max_running_per_rank: int,
    first: int = 0,
    row_slack: int = PREFIX_ROW_SLACK,
    host_pages: Sequence[int] | None = None,
) -> int | None:
    """`choose_rank` on a server with a prefix cache per rank (issue 36 item 5), or None.

    `cached_pages[r]`: leading pages of the request's prompt rank `r` caches;
    `free_pages[r]`: pages rank `r` can give it beyond them (free, plus cached pages it
    may evict other than that prefix). A rank takes it when the two cover `need_pages`
    and it has a row free. Among those, a rank within `row_slack` rows of the least busy
    one competes with its cached prefix (longest first), then with the pages after it
    its host cache holds (`host_pages`: a copy back instead of a prefill; they need
    device pages, so they do not count toward the fit); then most free pages, fewest
    rows and round robin, as `choose_rank` (which this is when nothing is cached)."""
    n = len(free_pages)
    fits = [
        free + cached >= need_pages and rows < max_running_per_rank
        for free, cached, rows in zip(free_pages, cached_pages, running, strict=True)
    ]
    if not any(fits):
        return None
    least = min(rows for rows, ok in zip(running, fits, strict=True) if ok)
    host = [0] * n if host_pages is None else host_pages
    best: tuple[int, int, int, int, int] | None = None
    for rank in range(n):
        if not fits[rank]:
            continue
        rows = running[rank]
        near = rows <= least + row_slack
        hit, host_hit = (cached_pages[rank], host[rank]) if near else (0, 0)
        key = (-hit, -host_hit, -free_pages[rank], rows, (rank - first) % n)
        if best is None or key < best:
            best = key
    return None if best is None else (best[4] + first) % n


@dataclasses.dataclass(frozen=True)
class DPRow:
    """One row of a DP step: `tokens` fed at positions `start..start+len-1` of a request
    whose KV lives in global `pages` (all on `rank`), `n_pages` its reservation."""

    rank: int
    tokens: np.ndarray  # int32 [t]
    start: int
    pages: np.ndarray  # global page ids, logical order
    n_pages: int


def build_batch(
    layout: DPPoolLayout, rows: Sequence[DPRow], *, prefill: bool
) -> tuple[DPShape, np.ndarray, tuple[np.ndarray, ...]]:
    """Host arrays of one DP step, its shape, and `order`: the step's row of each of
    `rows` (`rank * rows_per_rank + slot`; zeros after), where row `i`'s logits are.

    Decode rows feed one token each; prefill rows a whole prompt, padded to the bucket
    of the longest (`buckets.prefill_bucket`). Rows per rank pad to a power of two of the
    busiest rank's, page tables to a power of two of the widest reservation."""
    per_rank = [0] * layout.dp_size
    where: list[tuple[int, int]] = []
    for r in rows:
        where.append((r.rank, per_rank[r.rank]))
        per_rank[r.rank] += 1
    rows_p = pow2_at_least(max(per_rank))
    width = pow2_at_least(max(r.n_pages for r in rows))
    t_len = prefill_bucket(max(len(r.tokens) for r in rows)) if prefill else 1
    n = layout.dp_size * rows_p
    ids = np.zeros((n, t_len), np.int32)
    positions = np.zeros((n, t_len), np.int32)
    valid = np.zeros((n, t_len), bool)
    slots = np.zeros((n, t_len), np.int32)  # local slot 0: each rank's trash page
    tables = np.full((n, width), TRASH_PAGE, np.int32)
    kv_lens = np.zeros((n,), np.int32)
    for r, (rank, slot) in zip(rows, where, strict=True):
        i = rank * rows_p + slot
        t = len(r.tokens)
        table = padded_page_table(layout.local(r.pages, rank), width)
        tables[i] = table
        ids[i, :t] = r.tokens
        positions[i, :t] = np.arange(r.start, r.start + t)
        valid[i, :t] = True
        slots[i, :t] = slots_for_positions(table, positions[i, :t], layout.page_size)
        kv_lens[i] = r.start + t
    order = np.zeros((n,), np.int32)
    order[: len(rows)] = [rank * rows_p + slot for rank, slot in where]
    return (FORM, rows_p, t_len, width), order, (ids, positions, valid, slots, tables, kv_lens)


class DPDecodeSteps:
    """The jitted DP steps of one model on one mesh and pool layout, one executable per
    `DPShape` (compiled ahead of time on abstract inputs, as `DecodeSteps`)."""

    def __init__(
        self,
        model: CausalLM,
        mesh: Mesh,
        layout: DPPoolLayout,
        pool: KVPool,
        *,
        index_k_dtype: IndexKDtype,
        batch_invariant: bool = False,
        block_bytes: int | None = None,
        kv_io: PagedKVIO = SINGLE_DEVICE_KV_IO,
        ep_dispatch: EPDispatch = "allgather",
        ep_capacity_factor: float | None = None,
    ):
        if tuple(mesh.axis_names) != (DP_AXIS,) or mesh.size != layout.dp_size:
            raise ConfigError(f"DP steps need a ('dp',) mesh of {layout.dp_size} devices")
        cfg = model.cfg
        self.mesh = mesh
        self.layout = layout
        self.index_k_dtype = index_k_dtype
        self.vocab_size = cfg.vocab_size
        placed = DPPlacement.of(model, mesh, ep_dispatch, ep_capacity_factor)
        self.state = placed.state
        self._row_sharding = placed.rows
        self.replicated = placed.replicated
        self._abstract = (abstract(self.state), abstract(pool))
        step_args = (
            placed.graphdef,
            mesh,
            placed.state_specs,
            placed.ep,
            kv_io,
            index_k_dtype,
            batch_invariant,
            block_bytes,
        )
        self._step = _build_step(*step_args)
        self._compiled: ShapeCache[DPShape] = ShapeCache("DP decode step")
        # The prompt-scoring twin of the prefill steps (prompt log-probs): compiled on a
        # scoring request's first use of a shape, or in the background
        # (`--warmup-prompt-scoring`).
        self._score_step = _build_step(*step_args, score=True)
        self._score_compiled: ShapeCache[DPShape] = ShapeCache("DP prompt-scoring step")
        self._feed = jax.jit(feed_ids, out_shardings=self._row_sharding)

    def batch(self, host: tuple[np.ndarray, ...]) -> ForwardBatch:
        """The step's batch on the mesh, rows split over `"dp"` (each process fills its
        own shards from the same host arrays)."""
        sharding = self._row_sharding
        return ForwardBatch(
            *(jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i]) for a in host)
        )

    def compiled(self, shape: DPShape) -> jax.stages.Compiled:
        return self._compiled.get(shape, lambda: self._lower(shape))

    @property
    def rows_sharding(self) -> NamedSharding:
        """Where a step leaves its per-row outputs: each rank's rows on that rank."""
        return self._row_sharding

    @property
    def compiled_shapes(self) -> set[DPShape]:
        return self._compiled.compiled_keys()

    @property
    def compile_count(self) -> int:
        return self._compiled.compiles

    def compile_estimate(self, shapes: set[DPShape]) -> tuple[int, float]:
        return self._compiled.estimate(shapes)

    def compiled_score(self, shape: DPShape) -> jax.stages.Compiled:
        return self._score_compiled.get(shape, lambda: self._lower(shape, score=True))

    @property
    def compiled_score_shapes(self) -> set[DPShape]:
        return self._score_compiled.compiled_keys()

    def run(
        self,
        shape: DPShape,
        host: tuple[np.ndarray, ...],
        pool: KVPool,
        input_ids: jax.Array | None = None,
        targets: np.ndarray | None = None,
    ) -> tuple[Any, KVPool]:
        """Logits `[dp * rows, vocab]` in the step's layout (`build_batch`'s `order` says
        whose each row is), each rank's rows on that rank, and the new pool (`pool` is
        donated). `input_ids` (on the mesh, `feed_ids`) replace the host ones. With
        `targets` (`[dp * rows, tokens]` in the step's layout, as the host ids) the
        scoring step: `(logits, chosen, top_ids, top_logprobs)`, laid out the same."""
        batch = self.batch(host)
        if input_ids is not None:
            batch = dataclasses.replace(batch, input_ids=input_ids)
        if targets is None:
            return self.compiled(shape)(self.state, batch, pool)
        tgt = jax.make_array_from_callback(targets.shape, self._row_sharding, lambda i: targets[i])
        return self.compiled_score(shape)(self.state, batch, pool, tgt)

    def feed_ids(self, prev: jax.Array, src: np.ndarray, host_ids: np.ndarray) -> jax.Array:
        """A step's `[dp * rows, 1]` input ids on the mesh: row `i` (in the step's layout)
        feeds `prev[src[i]]` (the last draw's replicated tokens) where `src[i] >= 0`, its
        host id otherwise; no host round trip for the drawn tokens."""
        src_a, ids_a = (
            jax.make_array_from_callback(a.shape, self._row_sharding, lambda i, a=a: a[i])
            for a in (src, host_ids)
        )
        return self._feed(prev, src_a, ids_a)

    def _lower(self, shape: DPShape, score: bool = False) -> jax.stages.Lowered:
        form, rows, tokens, width = shape
        n = self.layout.dp_size * rows
        batch = abstract_batch(n, tokens, width, self._row_sharding)
        state, pool = self._abstract
        if form != FORM:
            raise ValueError(f"DP steps run the {FORM!r} form, not {form!r}")
        if not score:
            return self._step.lower(state, batch, pool)
        targets = jax.ShapeDtypeStruct((n, tokens), np.int32, sharding=self._row_sharding)
        return self._score_step.lower(state, batch, pool, targets)


@dataclasses.dataclass(frozen=True)
class DPPlacement:
    """A model's weights on a `("dp",)` mesh: routed experts split over `"dp"`
    (`expert_parallel` over it when `dp > 1`), everything else replicated; with the
    shardings a step's rows take (`rows`: split over `"dp"`) and its replicated outputs.
    A CP decode group's speculative programs run the same way, rows split over `"cp"`
    (`cp_decode.row_placement`)."""

    mesh: Mesh
    graphdef: nnx.GraphDef
    state: nnx.State
    state_specs: nnx.State  # the state's PartitionSpecs, shard_map's in_specs for it
    ep: EPSpec | None
    rows: NamedSharding
    replicated: NamedSharding

    @classmethod
    def of(
        cls,
        model: CausalLM,
        mesh: Mesh,
        ep_dispatch: EPDispatch = "allgather",
        ep_capacity_factor: float | None = None,
    ) -> DPPlacement:
        dp = mesh.size
        check_divisible(model.cfg.n_routed_experts, dp, "dp_size")
        graphdef, state = nnx.split(model)
        shardings = param_shardings(state, mesh, DP_AXIS)
        specs = jax.tree.map(
            lambda s: s.spec, shardings, is_leaf=lambda x: isinstance(x, NamedSharding)
        )
        ep = EPSpec(DP_AXIS, dp, ep_dispatch, ep_capacity_factor) if dp > 1 else None
        return cls(
            mesh,
            graphdef,
            jax.device_put(state, shardings),
            specs,
            ep,
            NamedSharding(mesh, P(DP_AXIS)),
            NamedSharding(mesh, P()),
        )

    def put_rows(self, tree):
        """Host arrays (a pytree of them, leading axis the step's rows) split over `"dp"`
        (each process fills its own shards from the same host arrays)."""
        sharding = self.rows

        def put(a):
            a = np.asarray(a)
            return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])

        return jax.tree.map(put, tree)

    def put_replicated(self, a: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(a.shape, self.replicated, lambda i: a[i])


def dp_slab_program(placed: DPPlacement, fn: Callable, n_rows: int) -> Callable:
    """`fn(state, slab, *rows, pool) -> (out, slab, pool)` (a speculative program of
    `cpkv_jax.speculative`, its static arguments bound; `n_rows` row arguments) run on
    every rank of the rows' axis (`placed.rows`: `"dp"`, or a CP group's `"cp"`) over its
    shards of the draft-state slab, the rows and the pool, with routed experts exchanged
    over that axis. Jitted as `(state, slab, order, rows, pool) -> (out[order]
    replicated, slab, pool)`, the slab and the pool donated: the host gets `out`'s row
    `i` for the `i`-th row it placed (`order`, as in `build_batch`)."""
    rows = placed.rows.spec

    def per_rank(state, slab, *rest):
        with ep_context(placed.ep):
            return fn(state, slab, *rest)

    sharded = jax.shard_map(
        per_rank,
        mesh=placed.mesh,
        in_specs=(placed.state_specs, rows, *([rows] * n_rows), rows),
        out_specs=(rows, rows, rows),
        check_vma=False,  # as `_build_step`
    )

    @functools.partial(
        jax.jit, donate_argnums=(1, 4), out_shardings=(placed.replicated, None, None)
    )
    def program(state, slab, order, row_args, pool):
        out, slab, pool = sharded(state, slab, *row_args, pool)
        return jax.tree.map(lambda a: a[order], out), slab, pool

    return program


def _build_step(
    graphdef,
    mesh: Mesh,
    state_specs,
    ep: EPSpec | None,
    kv_io: PagedKVIO,
    index_k_dtype: str,
    invariant: bool,
    block_bytes: int | None,
    *,
    score: bool = False,
) -> Callable:
    """The jitted DP step `(state, batch, pool[, targets]) -> (out, pool)`: `out` the
    last-token logits, or with `score` those and the fed tokens' scores
    (`transformer.score_tokens` of `targets`, each rank its own rows), left on the ranks
    that ran the rows (the sampler draws there)."""

    def per_rank(state, batch: ForwardBatch, pool: KVPool, *targets):
        model = nnx.merge(graphdef, state)
        with batch_invariant(invariant), token_block_bytes(block_bytes), ep_context(ep):
            hidden, pool = model(batch, pool, kv_io=kv_io, index_k_dtype=index_k_dtype, form=FORM)
            logits = last_token_logits(model, hidden, batch.valid)
            if not score:
                return logits, pool
            return (logits, *score_tokens(model, hidden, targets[0])), pool

    rows = P(DP_AXIS)
    outs = (rows, rows, rows, rows) if score else rows
    sharded = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(state_specs, rows, rows, *([rows] if score else [])),
        out_specs=(outs, rows),
        # Replicated weights meet per-rank rows in every layer (and the EP exchange
        # builds buffers from constants); the varying-axes checker is not needed.
        check_vma=False,
    )
    return jax.jit(sharded, donate_argnums=(2,))
