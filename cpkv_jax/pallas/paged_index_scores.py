"""Paged indexer scores: the NSA / DSA lightning indexer's logits read straight from the
paged index-K pool, for the few query tokens of a decode step.

`paged_index_scores(q, w, index_k, index_scale, page_table, positions, kv_lens)` is

    index_scores(q, w, dequantize_index_k(view(index_k), view(index_scale)), positions, kv_lens)

(`cpkv_jax.model.indexer`): for each row `b`, query token `t` and key slot `s` of the
row's page-table width, `sum_h w[b,t,h] * relu(q[b,t,h] . k[b,s])`, or -inf where the
slot's logical position is past `positions[b,t]` or `kv_lens[b] - 1`. The table's
column `j` holds logical page `j` (a request's table), or `page_starts[j] / page_size`
(owner attention's table of a rank's owned pages `r, r + cp, ...`,
`cpkv_jax.owner_attention.owner_topk`). The XLA path builds the float32 view of every
key the page table names: `[b, width * page_size, d]` float32, four times the fp8 pool's
bytes, over the whole power-of-two width the step was bucketed to (a 513-page context
pads to 1,024 pages). The kernel never builds it:

- the grid is `(b, width / pages_per_block)`; a program reads its row's page ids and, one
  page at a time, loads the page's fp8 codes and fp32 scales by page id (the pool stays
  in HBM: on the Triton backend a whole-array block is a base pointer, as in
  `paged_gather`), dequantizes in registers, and for each query token runs one
  `[heads, d] x [d, page_size]` dot, the ReLU and the head-weighted sum;
- a page whose first slot is past every query token's limit (`min(position, kv_len - 1)`)
  is not read at all: its scores are -inf. So the work follows each row's own context
  length, not the bucketed width (DeepGEMM's `fp8_paged_mqa_logits` skips the same way).

fp8 codes are decoded with integer arithmetic from their bits (the pool is bitcast to
uint8 outside the kernel, as `paged_gather` moves bits): sign, 4 exponent bits (bias 7)
and 3 mantissa bits give exactly the value XLA's `float8_e4m3fn -> float32` convert gives,
for every code but the two NaN codes (`0x7f`, `0xff`), which `quantize_index_k` never
writes (it clips to +-448). bfloat16 and float32 index K load as they are.

The scores equal the XLA path's up to float32 summation order (the dot over `d` and the
sum over heads): a tolerance, not bits. The kernel's dot asks for full float32
(`Precision.HIGHEST`); on a GPU, XLA's default precision may run the view path's
float32 einsum in TF32, so there the kernel is the more exact of the two.
Batch-invariant numerics keep the XLA path (`cpkv_jax.model.mla`), whose bits the
single-device prefill matches. Interpret mode on CPU runs the kernel's logic in the
tests; `tests/kernels/test_paged_index_scores.py` cross-lowers it to Triton at GLM-5's
dims.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, Shaped

from cpkv_jax.errors import ConfigError
from cpkv_jax.paging import TRASH_PAGE
from cpkv_jax.pallas.paged_gather import _out_struct, _varying_axes

__all__ = ["MAX_KERNEL_TOKENS", "paged_index_scores", "paged_index_scores_reference"]

# Query tokens per row the kernel takes: a decode step's 1, a speculative verify's k + 1.
# Prefill chunks keep the XLA path (their token blocks amortize the view).
MAX_KERNEL_TOKENS = 8
_NUM_WARPS = 4
_FP8_DTYPES = (jnp.float8_e4m3fn,)


def paged_index_scores_reference(
    q: Float[Array, "b t nh d"],
    w: Float[Array, "b t nh"],
    index_k: Shaped[Array, "pages page_size d"],
    index_scale: Float[Array, "pages page_size"] | None,
    page_table: Int[Array, "b width"],
    positions: Int[Array, "b t"],
    kv_lens: Int[Array, " b"],
    *,
    page_starts: Int[Array, " width"] | None = None,
) -> Float[Array, "b t s"]:
    """The same scores through the float32 view of every key the page table names (XLA
    gathers and einsums): the kernel's oracle. Its own einsum rather than the served
    `index_scores` (which the tests compare too) so that it asks for full float32 on a
    GPU, where XLA's default precision may be TF32."""
    b, width = page_table.shape
    page = index_k.shape[1]
    keys = jnp.take(index_k, page_table, axis=0).astype(jnp.float32)
    if index_scale is not None:
        keys = keys * jnp.take(index_scale, page_table, axis=0)[..., None]
    keys = keys.reshape(b, width * page, -1)
    logits = jnp.einsum("bthd,bsd->bths", q, keys, precision=jax.lax.Precision.HIGHEST)
    scores = jnp.einsum("bths,bth->bts", jax.nn.relu(logits), w)
    starts = jnp.arange(width) * page if page_starts is None else page_starts
    s = (starts[:, None] + jnp.arange(page)).reshape(-1)
    allowed = (s[None, None] <= positions[:, :, None]) & (s[None, None] < kv_lens[:, None, None])
    return jnp.where(allowed, scores, -jnp.inf)


def _decode_e4m3(bits: Array) -> Array:
    """float32 values of float8_e4m3fn codes given as uint8 bits (see the module
    docstring): `(8 + m) * 2^(e - 10)` for exponent `e > 0`, `m * 2^-9` below, signed."""
    code = bits.astype(jnp.int32)
    e = (code >> 3) & 0xF
    m = code & 0x7
    normal = e > 0
    mantissa = jnp.where(normal, m + 8, m)
    scale = jnp.where(normal, jnp.left_shift(1, e), 2)  # exact powers of two, e <= 15
    magnitude = (mantissa * scale).astype(jnp.float32) * (1.0 / 1024.0)
    return jnp.where(code >= 128, -magnitude, magnitude)


def _scores_kernel(
    table_ref,
    starts_ref,
    limit_ref,
    q_ref,
    w_ref,
    k_ref,
    *rest,
    pages_per_block: int,
    page_size: int,
    tokens: int,
    fp8: bool,
    scaled: bool,
):
    # table_ref: [1, ppb] page ids; starts_ref: [ppb] their first logical positions;
    # limit_ref: [1, T] last allowed logical position per token (-1: none); q_ref:
    # [1, T, nh, d]; w_ref: [1, T, nh]; k_ref: the whole [pages, P, d] pool (uint8 bits
    # when fp8); rest: (scale pool [pages, P],)? + out_ref [1, T, ppb * P].
    s_ref = rest[0] if scaled else None
    out_ref = rest[-1]
    limits = [limit_ref[0, t] for t in range(tokens)]
    top = functools.reduce(jnp.maximum, limits)
    slot = jax.lax.broadcasted_iota(jnp.int32, (page_size,), 0)
    for i in range(pages_per_block):
        start = starts_ref[i]
        cols = pl.ds(i * page_size, page_size)

        @pl.when(start <= top)
        def _score(i=i, start=start, cols=cols):
            page = table_ref[0, i]
            raw = k_ref[page]
            keys = _decode_e4m3(raw) if fp8 else raw.astype(jnp.float32)
            if s_ref is not None:
                keys = keys * s_ref[page][:, None]
            for t in range(tokens):
                logits = jax.lax.dot_general(
                    q_ref[0, t],
                    keys,
                    (((1,), (1,)), ((), ())),
                    precision=jax.lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32,
                )  # [nh, P]
                weighted = jnp.maximum(logits, 0.0) * w_ref[0, t][:, None]
                scores = jnp.sum(weighted, axis=0)
                out_ref[0, t, cols] = jnp.where(start + slot <= limits[t], scores, -jnp.inf)

        @pl.when(start > top)
        def _skip(cols=cols):
            for t in range(tokens):
                out_ref[0, t, cols] = jnp.full((page_size,), -jnp.inf, jnp.float32)


def _launch(
    q: Array,
    w: Array,
    index_k: Array,
    index_scale: Array | None,
    page_table: Array,
    positions: Array,
    kv_lens: Array,
    page_starts: Array,
    *,
    pages_per_block: int,
    interpret: bool,
) -> Array:
    b, t, nh, d = q.shape
    num_pages, page_size = index_k.shape[:2]
    width = page_table.shape[1]
    # A power of two (Triton's blocks), at most the table's width.
    ppb = 1 << (min(pages_per_block, width).bit_length() - 1)
    blocks = pl.cdiv(width, ppb)
    table = jnp.pad(
        page_table.astype(jnp.int32), ((0, 0), (0, blocks * ppb - width)),
        constant_values=TRASH_PAGE,
    )  # fmt: skip
    # Padding columns start past every limit: never read.
    starts = jnp.pad(
        page_starts.astype(jnp.int32), (0, blocks * ppb - width),
        constant_values=jnp.iinfo(jnp.int32).max,
    )  # fmt: skip
    # Triton blocks are powers of two: pad the query tokens (padding tokens allow nothing).
    tokens = 1 << max(0, (t - 1).bit_length())
    limit = jnp.minimum(positions, kv_lens[:, None] - 1).astype(jnp.int32)
    limit = jnp.pad(limit, ((0, 0), (0, tokens - t)), constant_values=-1)
    q = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, tokens - t), (0, 0), (0, 0)))
    w = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, tokens - t), (0, 0)))
    fp8 = index_k.dtype in _FP8_DTYPES
    keys = jax.lax.bitcast_convert_type(index_k, jnp.uint8) if fp8 else index_k
    operands = [table, starts, limit, q, w, keys]
    in_specs = [
        pl.BlockSpec((1, ppb), lambda r, j: (r, j)),
        pl.BlockSpec((ppb,), lambda r, j: (j,)),
        pl.BlockSpec((1, tokens), lambda r, j: (r, 0)),
        pl.BlockSpec((1, tokens, nh, d), lambda r, j: (r, 0, 0, 0)),
        pl.BlockSpec((1, tokens, nh), lambda r, j: (r, 0, 0)),
        pl.BlockSpec((num_pages, page_size, d), lambda r, j: (0, 0, 0)),
    ]
    if index_scale is not None:
        operands.append(index_scale.astype(jnp.float32))
        in_specs.append(pl.BlockSpec((num_pages, page_size), lambda r, j: (0, 0)))
    kernel = functools.partial(
        _scores_kernel, pages_per_block=ppb, page_size=page_size, tokens=tokens, fp8=fp8,
        scaled=index_scale is not None,
    )  # fmt: skip
    read = b * width * page_size * (d * index_k.dtype.itemsize + 4 * (index_scale is not None))
    out = pl.pallas_call(
        kernel,
        out_shape=_out_struct(
            (b, tokens, blocks * ppb * page_size), jnp.float32, _varying_axes(*operands)
        ),
        grid=(b, blocks),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((1, tokens, ppb * page_size), lambda r, j: (r, 0, j)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=_NUM_WARPS),
        cost_estimate=pl.CostEstimate(
            flops=2 * b * tokens * nh * d * width * page_size,
            transcendentals=0,
            bytes_accessed=read + 4 * b * tokens * width * page_size,
        ),
        name="paged_index_scores",
    )(*operands)
    return out[:, :t, : width * page_size]


def paged_index_scores(
    q: Float[Array, "b t nh d"],
    w: Float[Array, "b t nh"],
    index_k: Shaped[Array, "pages page_size d"],
    index_scale: Float[Array, "pages page_size"] | None,
    page_table: Int[Array, "b width"],
    positions: Int[Array, "b t"],
    kv_lens: Int[Array, " b"],
    *,
    page_starts: Int[Array, " width"] | None = None,
    pages_per_block: int = 4,
    interpret: bool | None = None,
) -> Float[Array, "b t s"]:
    """Indexer scores `[b, t, width * page_size]` from the paged pool (module docstring).

    Args:
        q, w: the indexer's queries `[b, t, heads, d]` and head weights `[b, t, heads]`.
        index_k: one rank's index-K pool `[pages, page_size, d]` (fp8 e4m3, bf16 or f32).
        index_scale: its per-slot fp32 scales `[pages, page_size]` (fp8), else None.
        page_table: each row's pages `[b, width]` (ids past a row's length are not read).
        positions, kv_lens: each token's position and each row's context length.
        page_starts: the logical position of each table column's first slot (default
            `j * page_size`: column `j` is logical page `j`).
        pages_per_block: pages per program (grid axis 1).
        interpret: interpret mode; `None` means on when the default backend is CPU.
    """
    if q.shape[1] > MAX_KERNEL_TOKENS:
        raise ConfigError(
            f"paged_index_scores takes at most {MAX_KERNEL_TOKENS} query tokens per row "
            f"(decode and speculative verify steps), got {q.shape[1]}"
        )
    if pages_per_block < 1:
        raise ConfigError(f"pages_per_block must be >= 1, got {pages_per_block}")
    if page_table.shape[1] == 0:
        return jnp.zeros((*q.shape[:2], 0), jnp.float32)
    page_size, d = index_k.shape[1], index_k.shape[-1]
    if page_size & (page_size - 1) or d & (d - 1):
        # Triton's loads are powers of two (every config's page and index head sizes are).
        raise ConfigError(f"page size and index head dim must be powers of two: {index_k.shape}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    scaled = index_scale is not None

    if page_starts is None:
        page_starts = jnp.arange(page_table.shape[1], dtype=jnp.int32) * page_size

    def launch(q, w, index_k, page_table, positions, kv_lens, page_starts, *scale):
        return _launch(
            q, w, index_k, scale[0] if scaled else None, page_table, positions, kv_lens,
            page_starts, pages_per_block=pages_per_block, interpret=interpret,
        )  # fmt: skip

    args = (q, w, index_k, page_table, positions, kv_lens, page_starts)
    args += (index_scale,) if scaled else ()
    if interpret and _varying_axes(*args):
        # As in `paged_gather_pallas`: the HLO interpreter re-binds the kernel's ops with
        # invariant indices against varying blocks inside shard_map(check_vma=True), so
        # the launch runs in a nested unchecked shard_map. Every input is first re-bound
        # there (an exact `* 1`): one passed through untouched keeps its varying type and
        # the interpreter's loop carry would mix both.
        unchecked = jax.shard_map(
            lambda *a: launch(*(x * jnp.ones((), x.dtype) for x in a)),
            in_specs=tuple(P() for _ in args), out_specs=P(),
            axis_names=frozenset(), check_vma=False,
        )  # fmt: skip
        return unchecked(*args)
    return launch(*args)
