"""Paged gather: copy the pages a batch needs out of one rank's pool into a contiguous buffer.

`paged_gather(pool, page_ids)` returns `pool[page_ids]`: `pool` is one rank's paged pool
`[num_pages, page_size, *feature]` (MLA latent `[..., 576]`, index K `[..., 128]`, or
the per-token fp32 index-K scale with no feature dims), `page_ids` are rank-local
physical page ids `int32[n]`, and the result is `[n, page_size, *feature]` in the pool's
dtype, bit for bit. Materialization runs it inside `jax.shard_map` over `"cp"` (each rank
gathers from its own shard, then one all-gather builds the full view) and inside `jit`.

Kernel. A page is one contiguous row of `row = page_size * prod(feature)` elements, so
the pool is viewed as `[num_pages, row]` (a free reshape) and the elements are bitcast to
an unsigned integer of the same width, bool as uint8 (the kernel moves bits, never values:
no fp8 or NaN handling in the kernel, and bitwise equality with the reference).
The grid is `(n_pad // pages_per_block, row // chunk)`:
- axis 0 walks blocks of `pages_per_block` output pages; the id list is padded with the
  trash page to a multiple of the block and the padding rows are sliced off after;
- axis 1 walks power-of-two column chunks of a page row. Triton requires every load and
  store to have a power-of-two size and the MLA latent row is not one (576 = 9 * 64), so
  `chunk` is the largest power of two dividing `row` (a power-of-two `page_size`, as in
  every config, makes it at least `page_size`), capped at `_MAX_CHUNK_BYTES` so one
  program keeps `pages_per_block` row chunks in registers without spilling.
Each program reads its ids block, then for each id issues one dynamic-start load
`pool[id, pl.ds(col, chunk)]` from global memory and one store into its output block.
The pool keeps a whole-array block spec, which on the Triton backend is only a base
pointer (the pool stays in HBM; nothing is staged), the same pattern as JAX's own GPU
`paged_attention`. No scalar prefetch or other TPU-only feature is used, and
`compiler_params` pins the Triton backend on GPU; offsets switch to 64 bits by themselves
when a pool exceeds 4 GiB. The tests cross-lower it for CUDA from CPU, which runs the
whole Triton lowering (not PTX compilation or execution). On CPU it runs in interpret
mode; inside `shard_map(check_vma=True)` the interpreter needs the small nested
`shard_map` explained in `paged_gather_pallas`.

Out-of-range ids never read garbage. Concrete ids (not tracers) are validated on the
host and raise `PageIndexError`. Traced ids (inside `jit` / `shard_map`) cannot be
inspected, so out-of-range entries are redirected to the trash page (page 0, whose
contents are padding) before any read; `check_bounds=True` adds a `checkify` check for
callers that wrap their step with `jax.experimental.checkify.checkify`. In serving, the
host planner validates page plans before dispatch, so the traced path is a safety net.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int, Shaped

from cpkv_jax.errors import ConfigError, CpkvError
from cpkv_jax.paging import TRASH_PAGE

logger = logging.getLogger(__name__)

GatherImpl = Literal["pallas", "xla"]

# One load per (page, chunk) moves at most this many bytes, so a program of 8 pages has
# 64 KiB in flight over num_warps=4 (a starting point to tune with GPU benchmarks).
_MAX_CHUNK_BYTES = 8192
_NUM_WARPS = 4
# Offending ids quoted in an error message (the count is always given).
_MAX_IDS_IN_MESSAGE = 8
_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


class PageIndexError(CpkvError, IndexError):
    """A page id is outside its rank's pool `[0, num_pages)`."""


def validate_page_ids(page_ids: Int[Array | np.ndarray, " n"], num_pages: int) -> None:
    """Raise `PageIndexError` if a concrete id is outside `[0, num_pages)`.

    Host planners can call it on their numpy page plans. A no-op on tracers (inside
    `jit` / `shard_map`): their values are unknown here. A concrete device array is
    copied to the host to be checked.
    """
    try:
        ids = np.asarray(page_ids)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    bad = np.flatnonzero((ids < 0) | (ids >= num_pages))
    if bad.size == 0:
        return
    shown = ", ".join(f"page_ids[{i}]={int(ids[i])}" for i in bad[:_MAX_IDS_IN_MESSAGE])
    more = f" (and {bad.size - _MAX_IDS_IN_MESSAGE} more)" if bad.size > _MAX_IDS_IN_MESSAGE else ""
    raise PageIndexError(
        f"{bad.size} of {ids.size} page ids are outside the pool's valid range "
        f"[0, {num_pages}): {shown}{more}. Page ids are rank-local physical pages of this "
        "rank's pool shard; fix the page plan (or page table) that produced them."
    )


def _check_page_ids(page_ids: Int[Array, " n"], num_pages: int, *, check_bounds: bool) -> None:
    """Host validation of concrete ids, plus the optional `checkify` check of traced ones."""
    if num_pages < 1:
        raise ConfigError(f"cannot gather from an empty pool (num_pages={num_pages})")
    validate_page_ids(page_ids, num_pages)
    if check_bounds:
        in_range = (page_ids >= 0) & (page_ids < num_pages)
        first_bad = jnp.argmin(in_range)
        checkify.check(
            jnp.all(in_range),
            "page id {bad} at position {pos} is outside the pool's valid range [0, {num_pages})",
            bad=page_ids[first_bad],
            pos=first_bad,
            num_pages=jnp.int32(num_pages),
        )


def _clamp_page_ids(page_ids: Int[Array, " n"], num_pages: int) -> Int[Array, " n"]:
    """int32 ids with every out-of-range entry redirected to the trash page."""
    in_range = (page_ids >= 0) & (page_ids < num_pages)
    return jnp.where(in_range, page_ids, TRASH_PAGE).astype(jnp.int32)


def paged_gather_reference(
    pool: Shaped[Array, "pages page_size *feature"],
    page_ids: Int[Array, " n"],
    *,
    check_bounds: bool = False,
) -> Shaped[Array, "n page_size *feature"]:
    """`pool[page_ids]` with XLA's gather: `[n, page_size, *feature]`, the test oracle.

    Same out-of-range contract as the kernel (see the module docstring).
    """
    _check_page_ids(page_ids, pool.shape[0], check_bounds=check_bounds)
    return jnp.take(pool, _clamp_page_ids(page_ids, pool.shape[0]), axis=0)


def _chunk_elems(row: int, itemsize: int) -> int:
    """Largest power of two dividing `row`, capped at `_MAX_CHUNK_BYTES` of elements."""
    cap = 1 << max(0, (_MAX_CHUNK_BYTES // itemsize).bit_length() - 1)
    return min(row & -row, cap)


def _gather_kernel(ids_ref, pool_ref, out_ref, *, pages_per_block: int, chunk: int):
    # ids_ref: [pages_per_block] ids of this block; pool_ref: the whole [num_pages, row]
    # pool (a base pointer on GPU); out_ref: [pages_per_block, chunk] output block.
    col = pl.multiple_of(pl.program_id(1) * chunk, chunk)
    # Unrolled: independent loads the GPU can keep in flight together.
    for k in range(pages_per_block):
        out_ref[k, :] = pool_ref[ids_ref[k], pl.ds(col, chunk)]


def _varying_axes(*inputs: Array) -> frozenset[str]:
    """Manual mesh axes (inside `shard_map(check_vma=True)`) that any input varies over."""
    axes: frozenset[str] = frozenset()
    for x in inputs:
        aval = jax.typeof(x)
        # JAX 0.10 keeps them in `aval.mat.varying`; earlier versions in `aval.vma`.
        mat = getattr(aval, "mat", None)
        axes |= frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))
    return axes


def _out_struct(shape: tuple[int, ...], dtype, varying: frozenset[str]) -> jax.ShapeDtypeStruct:
    """`pallas_call` output struct; under `check_vma` it must name its varying axes."""
    if not varying:
        return jax.ShapeDtypeStruct(shape, dtype)
    params = inspect.signature(jax.ShapeDtypeStruct).parameters
    if "manual_axis_type" in params:
        mat = jax.sharding.ManualAxisType(varying=varying)
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
    return jax.ShapeDtypeStruct(shape, dtype, vma=varying)


def _gather_pages(
    pool: Shaped[Array, "pages page_size *feature"],
    page_ids: Int[Array, " n"],
    *,
    pages_per_block: int,
    interpret: bool,
) -> Shaped[Array, "n page_size *feature"]:
    """The kernel launch: clamp and pad the ids, view the pool as bits, gather, view back."""
    num_pages, page_size, *feature = pool.shape
    n = page_ids.shape[0]
    row = page_size * math.prod(feature)
    width = pool.dtype.itemsize
    # The kernel moves bits: same-width unsigned ints (a free bitcast), bool as uint8.
    if pool.dtype == jnp.bool_:
        flat = pool.reshape(num_pages, row).astype(jnp.uint8)
    else:
        flat = jax.lax.bitcast_convert_type(pool.reshape(num_pages, row), _UINT_OF_WIDTH[width])
    chunk = _chunk_elems(row, width)
    num_blocks = pl.cdiv(n, pages_per_block)
    padded = num_blocks * pages_per_block
    ids = jnp.pad(_clamp_page_ids(page_ids, num_pages), (0, padded - n), constant_values=TRASH_PAGE)
    grid = (num_blocks, row // chunk)
    logger.debug(
        "paged_gather: %d pages of %d x %s, grid=%s, chunk=%d, interpret=%s",
        n,
        row,
        pool.dtype,
        grid,
        chunk,
        interpret,
    )
    out = pl.pallas_call(
        functools.partial(_gather_kernel, pages_per_block=pages_per_block, chunk=chunk),
        out_shape=_out_struct((padded, row), flat.dtype, _varying_axes(ids, flat)),
        grid=grid,
        in_specs=[
            pl.BlockSpec((pages_per_block,), lambda i, j: (i,)),
            pl.BlockSpec((num_pages, row), lambda i, j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((pages_per_block, chunk), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=_NUM_WARPS),
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=2 * padded * row * width
        ),
        name="paged_gather",
    )(ids, flat)[:n]
    if pool.dtype == jnp.bool_:
        out = out.astype(jnp.bool_)
    else:
        out = jax.lax.bitcast_convert_type(out, pool.dtype)
    return out.reshape(n, page_size, *feature)


def paged_gather_pallas(
    pool: Shaped[Array, "pages page_size *feature"],
    page_ids: Int[Array, " n"],
    *,
    pages_per_block: int = 8,
    interpret: bool | None = None,
    check_bounds: bool = False,
) -> Shaped[Array, "n page_size *feature"]:
    """`pool[page_ids]` with the Pallas kernel: `[n, page_size, *feature]`, bitwise exact.

    Args:
        pool: one rank's pool `[num_pages, page_size, *feature]`, any dtype.
        page_ids: rank-local page ids `[n]`; `n` need not divide `pages_per_block`.
        pages_per_block: output pages per program (grid axis 0).
        interpret: interpret mode; `None` means on when the default backend is CPU.
        check_bounds: add a `checkify` range check (the caller must `checkify` it).
    """
    if pages_per_block < 1:
        raise ConfigError(f"pages_per_block must be >= 1, got {pages_per_block}")
    num_pages, page_size, *feature = pool.shape
    _check_page_ids(page_ids, num_pages, check_bounds=check_bounds)
    if page_ids.shape[0] == 0:
        return jnp.zeros((0, page_size, *feature), pool.dtype)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    gather = functools.partial(_gather_pages, pages_per_block=pages_per_block, interpret=interpret)
    if interpret and _varying_axes(pool, page_ids):
        # Inside shard_map(check_vma=True), JAX's HLO interpreter re-binds the kernel's
        # ops with invariant grid/literal indices against varying blocks, which the vma
        # check rejects. A nested shard_map over no axes with check_vma=False runs the
        # launch (whose first ops re-type its inputs) unchecked. Compiled lowerings
        # (Triton) do not re-bind the kernel and take the direct path.
        gather = jax.shard_map(
            gather, in_specs=(P(), P()), out_specs=P(), axis_names=frozenset(), check_vma=False
        )
    return gather(pool, page_ids)


def paged_gather(
    pool: Shaped[Array, "pages page_size *feature"],
    page_ids: Int[Array, " n"],
    *,
    impl: GatherImpl = "xla",
    pages_per_block: int = 8,
    interpret: bool | None = None,
    check_bounds: bool = False,
) -> Shaped[Array, "n page_size *feature"]:
    """`pool[page_ids]`: `[n, page_size, *feature]`; `impl` picks the kernel or XLA gather.

    `pages_per_block` and `interpret` apply to `impl="pallas"` only. Both implementations
    share the out-of-range contract of the module docstring.
    """
    if impl == "xla":
        return paged_gather_reference(pool, page_ids, check_bounds=check_bounds)
    if impl == "pallas":
        return paged_gather_pallas(
            pool,
            page_ids,
            pages_per_block=pages_per_block,
            interpret=interpret,
            check_bounds=check_bounds,
        )
    raise ConfigError(f"unknown paged_gather impl {impl!r}; use 'pallas' or 'xla'")
