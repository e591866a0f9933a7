"""LF<->LPF direct copy kernels: one layer's page spans between a device pool and staging.

The device KV pool is layer-first (LF): one array per layer, `[num_pages, page_size,
*feature]`. The host layer-page-first (LPF) buffer holds the same layer as
`[host_pages, page_size, *feature]` rows (SPEC S4.2), so a per-layer transfer is a span of
whole pages. On device it goes through a contiguous staging buffer `[n, page_size,
*feature]`, which the host moves in one piece:

- `lf_to_lpf` (backup): gather pages `page_ids` of one layer into staging, `pool[ids]`;
- `lpf_to_lf` (load): scatter staging into those pages, `pool.at[ids].set(staging)`,
  the pool buffer aliased (and donated under `jit`), so the update is in place.

Both entries take CPU int64 *token* indices and call
`paging.validate_page_aligned_token_indices` before anything moves (SPEC S3.2); page ids
are the groups' starts over `page_size`, in caller order. Each sits beside a pure-jnp
reference (`impl="xla"`) that is its bitwise test oracle.

Kernels. The gather is `paged_gather_pallas` (the same page-row gather). The scatter
mirrors it: pool and staging are viewed as `[rows, page_size * prod(feature)]` of
same-width unsigned ints (bits, never values), the grid is `(n_pad // pages_per_block,
row // chunk)` with power-of-two column chunks (a Triton requirement), and each program
stores its block's staging rows at `pool[id, pl.ds(col, chunk)]`. The pool is a
whole-array block aliased to the output (a base pointer on Triton). The id list is padded
with copies of its last entry (and the staging with copies of its last row), so padding
rewrites the same bits to the same page: harmless, and no other page is touched.
Page-id counts are padded to a power of two so few shapes compile.

Page ids must be in range and, for `lpf_to_lf`, distinct (two writes to one page race);
both are checked on the host and raise `LPFIndexError` before any data moves.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Int, Shaped

from cpkv_jax.buckets import pow2_at_least
from cpkv_jax.errors import ConfigError, CpkvError, quote
from cpkv_jax.paging import page_ids_of_token_indices
from cpkv_jax.pallas.paged_gather import paged_gather_pallas

LpfImpl = Literal["pallas", "xla"]

_MAX_CHUNK_BYTES = 8192
_NUM_WARPS = 4
_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


class LPFIndexError(CpkvError, IndexError):
    """Page ids of an LF<->LPF copy are out of the pool's range or repeat a load target."""


def _to_bits(x: Array, rows: int, row: int) -> Array:
    flat = x.reshape(rows, row)
    if x.dtype == jnp.bool_:
        return flat.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(flat, _UINT_OF_WIDTH[x.dtype.itemsize])


def _from_bits(bits: Array, dtype, shape: tuple[int, ...]) -> Array:
    out = (
        bits.astype(jnp.bool_) if dtype == jnp.bool_ else jax.lax.bitcast_convert_type(bits, dtype)
    )
    return out.reshape(shape)


def _chunk_elems(row: int, itemsize: int) -> int:
    """Largest power of two dividing `row`, capped at `_MAX_CHUNK_BYTES` of elements."""
    cap = 1 << max(0, (_MAX_CHUNK_BYTES // itemsize).bit_length() - 1)
    return min(row & -row, cap)


def _scatter_kernel(ids_ref, staging_ref, pool_ref, out_ref, *, pages_per_block: int, chunk: int):
    # ids_ref: [pages_per_block]; staging_ref: [pages_per_block, chunk] block; pool_ref is
    # aliased to out_ref (the whole [num_pages, row] pool), which is only written.
    del pool_ref
    col = pl.multiple_of(pl.program_id(1) * chunk, chunk)
    for k in range(pages_per_block):
        out_ref[ids_ref[k], pl.ds(col, chunk)] = staging_ref[k, :]


def lpf_to_lf_pallas(
    pool: Shaped[Array, "pages page_size *feature"],
    staging: Shaped[Array, "n page_size *feature"],
    page_ids: Int[Array, " n"],
    *,
    pages_per_block: int = 8,
    interpret: bool = False,
) -> Shaped[Array, "pages page_size *feature"]:
    """`pool.at[page_ids].set(staging)` with the Pallas scatter kernel, bitwise exact.

    `page_ids` must be distinct and in range (callers validate on the host); `n` is
    padded to the block with copies of the last id and staging row.
    """
    if pages_per_block < 1:
        raise ConfigError(f"pages_per_block must be >= 1, got {pages_per_block}")
    num_pages, page_size, *feature = pool.shape
    n = page_ids.shape[0]
    if n == 0:
        return pool
    row = page_size * math.prod(feature)
    width = 1 if pool.dtype == jnp.bool_ else pool.dtype.itemsize
    chunk = _chunk_elems(row, width)
    num_blocks = pl.cdiv(n, pages_per_block)
    pad = num_blocks * pages_per_block - n
    ids = jnp.pad(page_ids.astype(jnp.int32), (0, pad), mode="edge")
    bits = _to_bits(pool, num_pages, row)
    staged = jnp.pad(_to_bits(staging.astype(pool.dtype), n, row), ((0, pad), (0, 0)), mode="edge")
    out = pl.pallas_call(
        functools.partial(_scatter_kernel, pages_per_block=pages_per_block, chunk=chunk),
        out_shape=jax.ShapeDtypeStruct(bits.shape, bits.dtype),
        grid=(num_blocks, row // chunk),
        in_specs=[
            pl.BlockSpec((pages_per_block,), lambda i, j: (i,)),
            pl.BlockSpec((pages_per_block, chunk), lambda i, j: (i, j)),
            pl.BlockSpec((num_pages, row), lambda i, j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((num_pages, row), lambda i, j: (0, 0)),
        input_output_aliases={2: 0},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=_NUM_WARPS),
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=2 * (n + pad) * row * width
        ),
        name="lpf_to_lf",
    )(ids, staged, bits)
    return _from_bits(out, pool.dtype, pool.shape)


def lpf_to_lf_reference(
    pool: Shaped[Array, "pages page_size *feature"],
    staging: Shaped[Array, "n page_size *feature"],
    page_ids: Int[Array, " n"],
) -> Shaped[Array, "pages page_size *feature"]:
    """`pool.at[page_ids].set(staging)` with XLA's scatter: the test oracle."""
    return pool.at[page_ids].set(staging.astype(pool.dtype))


def lf_to_lpf_pallas(
    pool: Shaped[Array, "pages page_size *feature"],
    page_ids: Int[Array, " n"],
    *,
    pages_per_block: int = 8,
    interpret: bool = False,
) -> Shaped[Array, "n page_size *feature"]:
    """`pool[page_ids]` with the Pallas gather kernel (`paged_gather_pallas`), bitwise."""
    return paged_gather_pallas(pool, page_ids, pages_per_block=pages_per_block, interpret=interpret)


def lf_to_lpf_reference(
    pool: Shaped[Array, "pages page_size *feature"], page_ids: Int[Array, " n"]
) -> Shaped[Array, "n page_size *feature"]:
    """`pool[page_ids]` with XLA's gather: the test oracle."""
    return jnp.take(pool, page_ids, axis=0)


@functools.partial(jax.jit, static_argnames=("impl", "pages_per_block", "interpret"))
def _gather(pool, ids, *, impl, pages_per_block, interpret):
    if impl == "xla":
        return lf_to_lpf_reference(pool, ids)
    return lf_to_lpf_pallas(pool, ids, pages_per_block=pages_per_block, interpret=interpret)


@functools.partial(
    jax.jit, static_argnames=("impl", "pages_per_block", "interpret"), donate_argnums=(0,)
)
def _scatter(pool, staging, ids, *, impl, pages_per_block, interpret):
    if impl == "xla":
        return lpf_to_lf_reference(pool, staging, ids)
    return lpf_to_lf_pallas(
        pool, staging, ids, pages_per_block=pages_per_block, interpret=interpret
    )


def copy_bucket(n: int) -> int:
    """Padded page count of an `n`-page copy: the next power of two, so few shapes
    compile (`copy_buckets` enumerates them)."""
    return pow2_at_least(n)


def copy_buckets(max_pages: int) -> list[int]:
    """Every padded page count a copy of 1..`max_pages` pages reaches (issue 25)."""
    if max_pages < 1:
        return []
    return [1 << k for k in range(copy_bucket(max_pages).bit_length())]


def warm_copy_programs(
    pool: Shaped[Array, "pages page_size *feature"],
    buckets: Sequence[int],
    *,
    impl: LpfImpl = "pallas",
    pages_per_block: int = 8,
    interpret: bool | None = None,
) -> tuple[Shaped[Array, "pages page_size *feature"], int]:
    """Compile the gather and the scatter `lf_to_lpf` / `lpf_to_lf` dispatch for each
    padded page count in `buckets` on this pool's device, by running them on page 0: a
    gather of page 0 repeated, scattered back to page 0 (the same bits, so no page
    changes). Returns the new pool (`pool` is donated) and the programs run.
    """
    _check_impl(impl)
    interpret = _interpret(pool, interpret)
    for b in buckets:
        ids = jax.device_put(np.zeros(b, np.int32), pool.sharding)
        staging = _gather(
            pool, ids, impl=impl, pages_per_block=pages_per_block, interpret=interpret
        )
        pool = _scatter(
            pool, staging, ids, impl=impl, pages_per_block=pages_per_block, interpret=interpret
        )
    return pool, 2 * len(buckets)


def _check_impl(impl: str) -> None:
    if impl not in ("pallas", "xla"):
        raise ConfigError(f"unknown LF<->LPF copy impl {impl!r}; use 'pallas' or 'xla'")


def _interpret(pool: Array, interpret: bool | None) -> bool:
    if interpret is not None:
        return interpret
    return all(d.platform == "cpu" for d in pool.devices())


def page_ids_for_copy(
    token_indices: Int[np.ndarray, " tokens"], page_size: int, num_pages: int, *, distinct: bool
) -> Int[np.ndarray, " pages"]:
    """Validated page ids (int64, caller order) of whole-page token indices.

    Raises `PageAlignmentError` (S3) for partial, misaligned or non-contiguous groups,
    `LPFIndexError` for pages outside `[0, num_pages)` or, with `distinct`, repeated.
    """
    pages = page_ids_of_token_indices(token_indices, page_size)
    bad = np.flatnonzero((pages < 0) | (pages >= num_pages))
    if bad.size:
        raise LPFIndexError(
            f"{bad.size} of {pages.size} pages are outside the pool's [0, {num_pages}): "
            f"{quote(pages[bad])}; pass token indices of this pool's pages"
        )
    if distinct:
        uniq, counts = np.unique(pages, return_counts=True)
        if (counts > 1).any():
            raise LPFIndexError(
                f"load target page(s) {quote(uniq[counts > 1])} appear more than once; "
                "each device page can receive one staged page per copy"
            )
    return pages


def lf_to_lpf(
    pool: Shaped[Array, "pages page_size *feature"],
    token_indices: Int[np.ndarray, " tokens"],
    *,
    impl: LpfImpl = "pallas",
    pages_per_block: int = 8,
    interpret: bool | None = None,
    padded: bool = False,
) -> Shaped[Array, "n page_size *feature"]:
    """Backup kernel entry: the pages of `token_indices` (CPU int64, whole pages, any
    order) of one layer's pool, as staging `[n, page_size, *feature]` on the pool's device.

    Validates the indices first (SPEC S3.2). `interpret=None`: on when the pool is on CPU.
    `padded`: return the staging at its power-of-two bucket (`copy_bucket(n)` rows, the
    tail repeating the last page) and let the caller drop the tail on the host; slicing
    here would compile one more program per page count.
    """
    _check_impl(impl)
    num_pages, page_size = pool.shape[:2]
    pages = page_ids_for_copy(token_indices, page_size, num_pages, distinct=False)
    n = pages.size
    if n == 0:
        return jnp.zeros((0, *pool.shape[1:]), pool.dtype, device=pool.sharding)
    ids = np.pad(pages, (0, copy_bucket(n) - n), mode="edge").astype(np.int32)
    ids = jax.device_put(ids, pool.sharding)
    out = _gather(
        pool,
        ids,
        impl=impl,
        pages_per_block=pages_per_block,
        interpret=_interpret(pool, interpret),
    )
    return out if padded or out.shape[0] == n else out[:n]


def lpf_to_lf(
    pool: Shaped[Array, "pages page_size *feature"],
    staging: Shaped[Array | np.ndarray, "n page_size *feature"],
    token_indices: Int[np.ndarray, " tokens"],
    *,
    impl: LpfImpl = "pallas",
    pages_per_block: int = 8,
    interpret: bool | None = None,
) -> Shaped[Array, "pages page_size *feature"]:
    """Load kernel entry: `pool` with the pages of `token_indices` set to `staging` rows.

    `pool` is donated (do not use it afterwards); the new pool is returned. Validates the
    indices (SPEC S3.2) and that target pages are distinct before anything moves.
    """
    _check_impl(impl)
    num_pages, page_size = pool.shape[:2]
    pages = page_ids_for_copy(token_indices, page_size, num_pages, distinct=True)
    n = pages.size
    if tuple(staging.shape) != (n, *pool.shape[1:]):
        raise ConfigError(
            f"staging has shape {tuple(staging.shape)} but {n} pages of this pool need "
            f"{(n, *pool.shape[1:])}"
        )
    if n == 0:
        return pool
    pad = copy_bucket(n) - n
    ids = jax.device_put(np.pad(pages, (0, pad), mode="edge").astype(np.int32), pool.sharding)
    if isinstance(staging, np.ndarray):
        if pad:  # np.pad copies even with nothing to add: only when the bucket needs it
            staging = np.pad(staging, ((0, pad),) + ((0, 0),) * (staging.ndim - 1), mode="edge")
        staging = jax.device_put(staging, pool.sharding)
    elif pad:
        staging = jnp.pad(staging, ((0, pad),) + ((0, 0),) * (staging.ndim - 1), mode="edge")
    return _scatter(
        pool,
        staging,
        ids,
        impl=impl,
        pages_per_block=pages_per_block,
        interpret=_interpret(pool, interpret),
    )
