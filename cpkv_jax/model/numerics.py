"""Batch-invariant numerics: a token's result independent of the rows computed with it.

Off by default. A matmul backend picks its kernel, blocking and reduction order from the
operand shapes, so the same token computed among a CP rank's rows (its two zigzag blocks)
and among the whole prompt's rows on one device can come out a few ulps apart. That is
harmless for serving but makes "CP prefill equals the single-device run" a tolerance
rather than bits. In batch-invariant mode every token-wise computation of the model
(projections, norms, the indexer, sparse attention, the MoE block, the LM head) runs over
the token axis in fixed tiles of `TILE` rows, one tile after another, and the indexer and
sparse attention run one sequence (batch row, with its own KV view) at a time, so every
matmul and reduction a token goes through has the same shapes whatever the batch, the
chunking or the CP size. Per-token results are then bitwise equal between CP and
single-device prefill, and between a request served alone and in a batch, on XLA:CPU
(SPEC S1.5; `tests/core/test_cp_prefill.py`, `tests/core/test_batch_invariant.py`,
`tests/serving/test_decode_engine.py`), at the cost of running the tiles sequentially - a
correctness and reproducibility mode, like SGLang's deterministic inference or vLLM's
batch-invariant kernels, not a fast path (measured: `benchmarks/batch_invariant.py`).

The mode is read while a function is *traced*: wrap the traced call in
`batch_invariant(True)` and make the flag part of the jit's static arguments (as
`forward_step` and `CPPrefillRunner` do), so the two modes never share a compiled program.

With the default numerics, `tokenwise(..., block=)` instead bounds memory: the indexer
and sparse attention run over the query tokens in blocks sized by
`cpkv_jax.buckets.block_rows` for the budget `token_block_bytes` sets at trace time
(`cpkv-serve --transient-block-size`; default `TRANSIENT_BLOCK_BYTES`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from cpkv_jax.buckets import TRANSIENT_BLOCK_BYTES

TILE = 16
"""Token rows per tile in batch-invariant mode (a multiple of the CPU GEMM micro-panel)."""

_ENABLED = contextvars.ContextVar("cpkv_batch_invariant", default=False)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Trace the model inside this context to get batch-invariant numerics."""
    token = _ENABLED.set(bool(enabled))
    try:
        yield
    finally:
        _ENABLED.reset(token)


def is_batch_invariant() -> bool:
    return _ENABLED.get()


_BLOCK_BYTES: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "cpkv_token_block_bytes", default=None
)


@contextlib.contextmanager
def token_block_bytes(nbytes: int | None) -> Iterator[None]:
    """Trace inside this context to give the indexer's and sparse attention's token
    blocks a budget of `nbytes` (`cpkv_jax.buckets.block_rows`); None: the default,
    `TRANSIENT_BLOCK_BYTES`. Read at trace time, like `batch_invariant`: make the budget
    part of the jit's static arguments (`forward_step`) or build one program per budget
    (`CPPrefillRunner`)."""
    if nbytes is not None and nbytes <= 0:
        raise ValueError(f"token block budget must be > 0 bytes, got {nbytes}")
    token = _BLOCK_BYTES.set(nbytes)
    try:
        yield
    finally:
        _BLOCK_BYTES.reset(token)


def block_budget(nbytes: int | None = None) -> int:
    """`nbytes` if given, else the traced `token_block_bytes` budget, else the default."""
    if nbytes is not None:
        return nbytes
    traced = _BLOCK_BYTES.get()
    return TRANSIENT_BLOCK_BYTES if traced is None else traced


def _traced_once(fn: Callable[..., Any], *args: Any) -> tuple[Callable[..., Any], Any]:
    """(`apply`, output shapes): `fn` traced once on `args`' shapes, and a function that
    applies that trace to other arguments of the same shapes by re-emitting its recorded
    operations, without running `fn`'s Python again.

    The loops below need `fn`'s output shapes before they trace their body. Tracing `fn`
    twice (`jax.eval_shape`, then the body) doubled the trace time of every loop, and
    loops nest (the MoE's tiles inside a sequence's), so a model step traced its inner
    bodies 2^depth times: that was most of a batch-invariant step's compile on a warm
    compilation cache. The same operations are emitted either way (same program)."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    out_tree = jax.tree_util.tree_structure(shapes)

    def apply(*xs: Any) -> Any:
        flat = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree_util.tree_leaves(xs))
        return jax.tree_util.tree_unflatten(out_tree, flat)

    return apply, shapes


def _opaque_map(fn: Callable[..., Any], xs: tuple[Array, ...]) -> Any:
    """`fn` on each leading-axis slice of `xs`, one per loop iteration, stacked.

    The trip count goes through a barrier so XLA cannot see it: with a known count of one
    it would inline the body and fuse it with its neighbours, and element-wise ops in it
    (the router's sigmoid) can then round differently than inside a loop.
    """
    count = xs[0].shape[0]
    apply, shapes = _traced_once(fn, *(x[0] for x in xs))
    init = jax.tree_util.tree_map(lambda s: jnp.zeros((count, *s.shape), s.dtype), shapes)

    def body(i: Array, acc: Any) -> Any:
        y = apply(*(jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in xs))
        return jax.tree_util.tree_map(
            lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, i, 0), acc, y
        )

    trips = jax.lax.optimization_barrier(jnp.int32(count))
    return jax.lax.fori_loop(0, trips, body, init)


def tokenwise(
    fn: Callable[..., Any], *arrays: Array, axis: int = 0, block: int | None = None
) -> Any:
    """`fn(*arrays)` for a function that treats each index of `axis` independently.

    Every array carries the token axis at `axis`; so does every leaf `fn` returns. Whatever
    `fn` closes over (weights, the KV view) is shared by all tokens. Off: one call, or -
    with `block` smaller than the token count - a loop over blocks of `block` tokens that
    bounds `fn`'s transient memory (`_blocked`). On: the token axis is zero-padded to a
    multiple of `TILE` and `fn` runs on one tile at a time, in a loop XLA can neither
    inline nor merge across tiles (`block` is then moot: a tile is never larger).
    """
    if not _ENABLED.get():
        n = arrays[0].shape[axis]
        if block is None or block >= n:
            return fn(*arrays)
        return _blocked(fn, arrays, axis, block)
    n = arrays[0].shape[axis]
    tiles = -(-n // TILE)

    def split(x: Array) -> Array:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, tiles * TILE - n)
        x = jnp.pad(x, pad)
        x = x.reshape(*x.shape[:axis], tiles, TILE, *x.shape[axis + 1 :])
        return jnp.moveaxis(x, axis, 0)

    def join(y: Array) -> Array:
        y = jnp.moveaxis(y, 0, axis)
        y = y.reshape(*y.shape[:axis], tiles * TILE, *y.shape[axis + 2 :])
        return jax.lax.slice_in_dim(y, 0, n, axis=axis)

    out = _opaque_map(fn, tuple(split(x) for x in arrays))
    return jax.tree_util.tree_map(join, out)


def _blocked(fn: Callable[..., Any], arrays: tuple[Array, ...], axis: int, block: int) -> Any:
    """`fn` over `axis` in blocks of `block` (< n) tokens, written into full-size outputs.

    No padding: the last block starts at `n - block` and recomputes the rows it shares
    with the one before (same inputs, same program, same values), so the outputs are
    allocated once at their final size and updated in place by the loop.
    """
    n = arrays[0].shape[axis]
    count = -(-n // block)

    def take(x: Array, start: Array | int) -> Array:
        return jax.lax.dynamic_slice_in_dim(x, start, block, axis=axis)

    apply, shapes = _traced_once(fn, *(take(x, 0) for x in arrays))
    init = jax.tree_util.tree_map(
        lambda s: jnp.zeros((*s.shape[:axis], n, *s.shape[axis + 1 :]), s.dtype), shapes
    )

    def body(i: Array, acc: Any) -> Any:
        start = jnp.minimum(i * block, n - block)
        y = apply(*(take(x, start) for x in arrays))
        return jax.tree_util.tree_map(
            lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v, start, axis=axis), acc, y
        )

    return jax.lax.fori_loop(0, count, body, init)


def per_sequence(fn: Callable[..., Any], *arrays: Array) -> Any:
    """`fn(*arrays)` for a function whose batch rows (axis 0: sequences, each with its own
    KV view) are independent. On: one row at a time (leading axis kept, size 1), so what
    one sequence computes has the same shapes whatever else shares its batch."""
    if not _ENABLED.get():
        return fn(*arrays)
    out = _opaque_map(lambda *row: fn(*(r[None] for r in row)), arrays)
    return jax.tree_util.tree_map(lambda y: y[:, 0], out)


def rowwise(fn: Callable[[Array], Array], x: Array) -> Array:
    """`fn(x)` for `fn` acting on the last axis of each row of `x` (all leading axes are
    tokens); batch-invariant when the mode is on (see `tokenwise`)."""
    if not _ENABLED.get():
        return fn(x)
    lead = x.shape[:-1]
    y = tokenwise(fn, x.reshape(-1, x.shape[-1]))
    return y.reshape(*lead, *y.shape[1:])
