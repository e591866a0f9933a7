"""Paged KV storage for the model, and the I/O seam the CP pools plug into.

The model never indexes a pool itself. It hands new per-token rows to a `KVIO`
strategy (`write`), asks it for the *full view* of each request (`view`: the request's
pages in logical order, `[B, max_pages * page_size, D]`; the indexer reads every token's
index K this way), and for sparse attention's selected latent rows (`rows`). The
single-device `PagedKVIO` gathers only the top-k rows from the pool by (page, offset),
so the latent read of a step costs top-k, not the context; `DENSE_VIEW_KV_IO` keeps the
old full-view gather as the reference it is tested against. The CP strategy
(`cpkv_jax.materialize.CPKVIO`) keeps only owned pages on `write` and materializes
across the `cp` axis, so the model code does not change (SPEC S1.5).

Pools (one pytree, donated through `jit`):
- `latent[l]`: `[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]` for every layer;
- `index_k[j]`: `[num_pages, page_size, index_head_dim]` for the j-th *full* indexer
  layer only, in `index_k_dtype`; `index_scale[j]`: `[num_pages, page_size]` float32 when
  that dtype is fp8 (one scale per token over the 128-dim block, as DeepGEMM stores it).
Page 0 is the trash page: padding tokens write there and unused page-table slots point
there, so shapes stay static.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from cpkv_jax.config import ModelConfig
from cpkv_jax.kv_layout import BUFFER_KINDS, KVLayout
from cpkv_jax.model.indexer import index_scores as view_index_scores
from cpkv_jax.model.numerics import is_batch_invariant
from cpkv_jax.pallas.paged_gather import GatherImpl, paged_gather
from cpkv_jax.pallas.paged_index_scores import MAX_KERNEL_TOKENS, paged_index_scores

IndexKDtype = Literal["fp8_e4m3", "bfloat16", "float32"]
# Activation / weight / MLA latent KV dtypes by their flag names (`--dtype`).
DTYPES: dict[str, DTypeLike] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
INDEX_K_DTYPES: dict[str, DTypeLike] = {
    "fp8_e4m3": jnp.float8_e4m3fn,
    "bfloat16": jnp.bfloat16,
    "float32": jnp.float32,
}
FP8_E4M3_MAX = 448.0
TRASH_PAGE = 0
# Keys per block of the XLA decode indexer's page loop (`blocked_index_scores`): at GLM-5's
# index dims and page 64 the fastest on XLA:CPU of 512-4,096 (bench_decode, 2026-12-07).
INDEX_BLOCK_TOKENS = 2048


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPool:
    # Leaves are arrays; the same container also carries `ShapeDtypeStruct`s
    # (`pool_shapes`), shardings and partition specs, hence `Any`.
    latent: tuple[Any, ...]
    index_k: tuple[Any, ...]
    index_scale: tuple[Any, ...]

    @property
    def num_pages(self) -> int:
        return self.latent[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.latent[0].shape[1]

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))


def pool_shapes(
    cfg: ModelConfig, num_pages: int, page_size: int, dtype: DTypeLike, index_k_dtype: IndexKDtype
) -> KVPool:
    """`jax.ShapeDtypeStruct`s of a pool, from the model's `KVLayout` (the one place what
    the pool stores is defined)."""
    return layout_shapes(KVLayout.from_model(cfg, page_size, dtype, index_k_dtype), num_pages)


def layout_shapes(layout: KVLayout, num_pages: int) -> KVPool:
    """`jax.ShapeDtypeStruct`s of a `num_pages`-page pool of `layout`."""
    leaves = layout.leaf_shapes(num_pages)
    return KVPool(
        **{
            kind: tuple(jax.ShapeDtypeStruct(shape, dt) for shape, dt in leaves[kind])
            for kind in BUFFER_KINDS
        }
    )


def init_pool(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: DTypeLike = jnp.float32,
    index_k_dtype: IndexKDtype = "fp8_e4m3",
) -> KVPool:
    shapes = pool_shapes(cfg, num_pages, page_size, dtype, index_k_dtype)
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def quantize_index_k(
    k: Float[Array, "*t d"], index_k_dtype: IndexKDtype
) -> tuple[Array, Float[Array, "*t"] | None]:
    """Cast (or fp8-quantize with a per-token fp32 scale) index keys for storage."""
    if index_k_dtype != "fp8_e4m3":
        return k.astype(INDEX_K_DTYPES[index_k_dtype]), None
    kf = k.astype(jnp.float32)
    amax = jnp.max(jnp.abs(kf), axis=-1)
    scale = jnp.maximum(amax, 1e-6) / FP8_E4M3_MAX
    q = jnp.clip(kf / scale[..., None], -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q, scale


def dequantize_index_k(k: Array, scale: Array | None) -> Float[Array, "*t d"]:
    kf = k.astype(jnp.float32)
    return kf if scale is None else kf * scale[..., None]


RowGather = Callable[[Array, Int[Array, "b t k"]], Array]
"""`take(source, positions)`: the rows at logical `positions` (>= 0) of each batch row of
`source` -> `[b, t, k, D]`; `source`'s leading axis is the batch (see `KVIO.rows`)."""


def as_bits(x: Array) -> Array:
    """`x` as unsigned integers of its width (identity for 4-byte and wider dtypes).
    XLA:CPU moves an fp8 array across ranks as f16, moved a bf16 -> float32 convert from
    after a gather to before it, and writes a narrow pool through float32 (`write_rows`);
    integers it leaves alone. `from_bits` undoes it."""
    if x.dtype.itemsize >= 4:
        return x
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def from_bits(x: Array, dtype) -> Array:
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def write_rows(pool: Array, slots: Int[Array, " n"], rows: Array) -> Array:
    """`pool` `[pages, page_size, ...]` with `rows` `[n, ...]` written at flat `slots`
    (`page * page_size + offset`, in bounds: padding writes to the trash page).

    Indexed by (page, offset), not through a flat reshape: with the reshape XLA:CPU kept
    two written copies of the donated pool (the flat one the step's row gathers read, the
    paged one it returns), two whole-pool copies per layer and step. On CPU a pool
    narrower than 4 bytes (bf16 latent, fp8 index K) is written through its integer view:
    XLA:CPU runs a bf16 / fp8 write as a convert of the whole pool to a wider float and
    back; the integer write is a plain copy at worst. GPUs write them in place as they are.
    (`benchmarks/bench_decode`, docs/results.md: the 32K step 258 -> 133 ms at batch 1.)"""
    p = pool.shape[1]
    at = (slots // p, slots % p)
    rows = rows.astype(pool.dtype)
    if pool.dtype.itemsize >= 4 or jax.default_backend() != "cpu":
        return pool.at[at].set(rows)
    return from_bits(as_bits(pool).at[at].set(as_bits(rows)), pool.dtype)


def take_view_rows(view: Array, positions: Int[Array, "b t k"]) -> Array:
    """`view[b, positions[b, t, k]]` -> `[b, t, k, ...]`: rows of a full view."""
    return jax.vmap(lambda v, i: jnp.take(v, i, axis=0))(view, positions)


def take_paged_rows(
    pool: Array, page_table: Int[Array, "b pages"], positions: Array, impl: GatherImpl = "xla"
) -> Array:
    """The rows at logical `positions` `[b, t, k]` (>= 0) of each request, read from the
    pool by (page, offset) through its page-table row: `[b, t, k, ...]`. Only these rows
    are read - no view of the request's other tokens. `impl="pallas"`: the paged-gather
    kernel over the pool seen as one-row pages (`[pages * page_size, 1, ...]`, a free
    reshape) gathers the rows by flat slot, bit for bit the XLA gather."""
    p = pool.shape[1]
    pages = jax.vmap(lambda row, i: jnp.take(row, i // p, axis=0))(page_table, positions)
    if impl == "xla":
        return pool[pages, positions % p]
    rows = pool.reshape((pool.shape[0] * p, 1, *pool.shape[2:]))
    slots = (pages * p + positions % p).reshape(-1)
    out = paged_gather(rows, slots.astype(jnp.int32), impl=impl)
    return out.reshape((*positions.shape, *pool.shape[2:]))


def page_view(pool: Array, page_table: Int[Array, "b pages"]) -> Array:
    """Each row's pages in table order: `[b, pages * page_size, ...]`."""
    b, mp = page_table.shape
    gathered = jnp.take(pool, page_table, axis=0)  # [b, mp, P, ...]
    return gathered.reshape((b, mp * pool.shape[1], *pool.shape[2:]))


def blocked_index_scores(
    q: Float[Array, "b t nh d"],
    w: Float[Array, "b t nh"],
    index_k: Array,
    index_scale: Array | None,
    page_table: Int[Array, "b pages"],
    positions: Int[Array, "b t"],
    kv_lens: Int[Array, " b"],
    *,
    block_tokens: int = INDEX_BLOCK_TOKENS,
) -> Float[Array, "b t s"]:
    """The indexer's scores of a decode step (`index_scores` over the float32 view of the
    index K), computed in blocks of `block_tokens` keys by a loop that stops after the
    block holding the batch's longest context; later blocks stay -inf, as the view path
    masks them. The view path converts and scores the whole bucketed width (a 513-page
    context in a 1,024-page bucket: twice its keys); this reads the context rounded up to
    one block, and each block's float32 keys stay small. The scores equal the view
    path's up to the dot's summation order (XLA picks its kernel by shape)."""
    b, width = page_table.shape
    p = index_k.shape[1]
    per_block = max(1, min(width, block_tokens // p))
    blocks = -(-width // per_block)
    table = jnp.pad(page_table, ((0, 0), (0, blocks * per_block - width)))  # trash pages
    keys = per_block * p
    # Keys that can score: positions up to min(position, kv_len - 1) of some row.
    longest = jnp.max(jnp.minimum(jnp.max(positions, axis=1) + 1, kv_lens))
    n = jnp.clip((longest + keys - 1) // keys, 0, blocks)

    bits = as_bits(index_k)  # XLA:CPU would convert a whole fp8 pool to f16 to gather it

    def block(i, out):
        cols = jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1)
        k = dequantize_index_k(
            from_bits(page_view(bits, cols), index_k.dtype),
            None if index_scale is None else page_view(index_scale, cols),
        )
        scores = view_index_scores(
            q, w, k, positions, kv_lens, key_positions=i * keys + jnp.arange(keys)
        )
        return jax.lax.dynamic_update_slice_in_dim(out, scores, i * keys, axis=2)

    out = jnp.full((b, q.shape[1], blocks * keys), -jnp.inf, jnp.float32)
    return jax.lax.fori_loop(0, n, block, out)[:, :, : width * p]


@runtime_checkable
class KVIO(Protocol):
    """How the model reads and writes paged KV (single-device or CP-sharded)."""

    def write(self, pool: Array, slots: Int[Array, "b t"], values: Array) -> Array: ...

    def slots(
        self, page_table: Int[Array, "b pages"], positions: Int[Array, "b t"], page_size: int
    ) -> Int[Array, "b t"]:
        """The slots `write` takes for tokens at `positions` of rows whose pages are
        `page_table` (a position past the table's width: its last column)."""
        ...

    def view(self, pool: Array, page_table: Int[Array, "b pages"]) -> Array: ...

    def rows(self, pool: Array, page_table: Int[Array, "b pages"]) -> tuple[Array, RowGather]:
        """What sparse attention gathers its selected rows from: `(source, take)`, where
        `take(source[i:j], positions[i:j])` gives those rows' `[b, t, k, D]` (the caller
        may split the batch, as batch-invariant numerics do)."""
        ...


@runtime_checkable
class OwnerAttentionIO(KVIO, Protocol):
    """A `KVIO` that selects the top-k and attends where the pages live instead of
    through a full view (`cpkv_jax.owner_attention.OwnerCPKVIO`); MLA calls these in place
    of `view` / `rows` when its `kv_io` has them."""

    def select_topk(
        self,
        q: Array,
        w: Array,
        index_k: Array,
        index_scale: Array | None,
        batch: Any,
        index_topk: int,
    ) -> Int[Array, "b t k"]: ...

    def attend(
        self,
        q_nope: Array,
        q_pe: Array,
        latent: Array,
        batch: Any,
        topk: Array,
        w_kv_b: Array,
        **dims: Any,
    ) -> Array: ...


@dataclasses.dataclass(frozen=True)
class PagedKVIO:
    """Single-device paged I/O: flat-slot scatter, page-table gather.

    `sparse` (default): `rows` reads only the selected rows from the pool by (page,
    offset). False: through the request's full view (`view`), the dense path the sparse
    one is checked against (`tests/core/test_sparse_decode.py`) and benchmarked beside
    (`benchmarks/bench_decode.py`). `gather_impl` (`--kernel-impl`): the sparse row
    gather's XLA gather or the Pallas paged-gather kernel (`take_paged_rows`).
    `index_impl` (`--kernel-impl` too): the indexer's scores of a decode step through the
    float32 view of the index K (XLA) or read from the pool by the Pallas kernel
    (`index_scores`), which skips the pages past each row's length. On CPU the XLA path
    scores in blocks of `index_block_tokens` keys up to the longest row
    (`blocked_index_scores`); elsewhere a loop's per-block launches would cost more
    than the padding it skips, and the kernel skips it.
    """

    sparse: bool = True
    gather_impl: GatherImpl = "xla"
    index_impl: GatherImpl = "xla"
    index_block_tokens: int = INDEX_BLOCK_TOKENS

    def write(self, pool: Array, slots: Int[Array, "b t"], values: Array) -> Array:
        return write_rows(pool, slots.reshape(-1), values.reshape((-1, *pool.shape[2:])))

    def slots(
        self, page_table: Int[Array, "b pages"], positions: Int[Array, "b t"], page_size: int
    ) -> Int[Array, "b t"]:
        page = jnp.minimum(positions // page_size, page_table.shape[1] - 1)
        return jnp.take_along_axis(page_table, page, axis=1) * page_size + positions % page_size

    def view(self, pool: Array, page_table: Int[Array, "b pages"]) -> Array:
        return page_view(pool, page_table)

    def index_scores(
        self,
        q: Float[Array, "b t nh d"],
        w: Float[Array, "b t nh"],
        index_k: Array,
        index_scale: Array | None,
        batch: Any,
    ) -> Float[Array, "b t s"] | None:
        """The indexer's scores of a decode or verify step read from the paged pool by
        the kernel (`cpkv_jax.pallas.paged_index_scores`) or, with the XLA impl on CPU,
        in page blocks up to the longest row (`blocked_index_scores`); None where the
        view path runs: the XLA impl on other backends, the dense reference, more query
        tokens than a decode or verify step has (prefill), and batch-invariant numerics
        (whose bits the view path defines)."""
        if not self.sparse or q.shape[1] > MAX_KERNEL_TOKENS or is_batch_invariant():
            return None
        args = (q, w, index_k, index_scale, batch.page_table, batch.positions, batch.kv_lens)
        if self.index_impl == "pallas":
            return paged_index_scores(*args)
        if jax.default_backend() == "cpu":
            return blocked_index_scores(*args, block_tokens=self.index_block_tokens)
        return None

    def rows(self, pool: Array, page_table: Int[Array, "b pages"]) -> tuple[Array, RowGather]:
        if not self.sparse:
            return self.view(pool, page_table), take_view_rows
        impl = self.gather_impl
        return page_table, lambda table, positions: take_paged_rows(pool, table, positions, impl)


# Stateless and hashable: the default `kv_io` static argument of the model step.
SINGLE_DEVICE_KV_IO = PagedKVIO()
DENSE_VIEW_KV_IO = PagedKVIO(sparse=False)
