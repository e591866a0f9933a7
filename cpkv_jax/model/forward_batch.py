"""What one jitted model step needs to know about its tokens (a pytree of arrays).

Layout is padded `[B, T]`: row `b` holds the new tokens of one request; padding tokens
have `valid == False`, write into the trash page and their outputs are ignored.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from cpkv_jax.buckets import prefill_bucket
from cpkv_jax.paging import slots_for_positions


@dataclasses.dataclass
class ForwardBatch:
    input_ids: Int[Array, "b t"]
    positions: Int[Array, "b t"]  # logical token position within its request
    valid: Bool[Array, "b t"]
    write_slots: Int[Array, "b t"]  # flat pool slot (page * page_size + offset)
    page_table: Int[Array, "b pages"]  # logical page -> physical page (trash-padded)
    kv_lens: Int[Array, " b"]  # tokens of KV each request has after this step


_FIELDS = tuple(f.name for f in dataclasses.fields(ForwardBatch))


def _unflatten(_, children) -> ForwardBatch:
    # Without `__init__`: JAX unflattens the tree around non-array leaves too
    # (`ShapeDtypeStruct`s of an ahead-of-time lowering, its `ArgInfo`s).
    batch = object.__new__(ForwardBatch)
    batch.__dict__.update(zip(_FIELDS, children, strict=True))
    return batch


jax.tree_util.register_pytree_node(
    ForwardBatch, lambda b: ([getattr(b, f) for f in _FIELDS], None), _unflatten
)


def batch_from_host(
    input_ids: np.ndarray,
    positions: np.ndarray,
    valid: np.ndarray,
    write_slots: np.ndarray,
    page_table: np.ndarray,
    kv_lens: np.ndarray,
) -> ForwardBatch:
    """A `ForwardBatch` of NumPy arrays, placed by one uncommitted `device_put`: no
    program compiles (`jnp.asarray` of a NumPy array compiles a `stage` program per shape
    in JAX 0.10, one more compile per batch shape on the request path)."""
    i32 = np.int32
    host = [
        np.asarray(input_ids, i32),
        np.asarray(positions, i32),
        np.asarray(valid, np.bool_),
        np.asarray(write_slots, i32),
        np.asarray(page_table, i32),
        np.asarray(kv_lens, i32),
    ]
    return ForwardBatch(*jax.device_put(host))


def feed_ids(prev: jax.Array, src: jax.Array, host_ids: jax.Array) -> jax.Array:
    """A decode step's `[rows, 1]` input ids: row `i` feeds `prev[src[i]]` (a token the
    last draw left on the device) where `src[i] >= 0`, `host_ids[i]` otherwise. Jitted by
    the steps that use it (the DP steps with their rows' sharding)."""
    return jnp.where(src[:, None] >= 0, prev[jnp.maximum(src, 0)][:, None], host_ids)


def abstract_batch(rows: int, tokens: int, width: int, sharding=None) -> ForwardBatch:
    """A `ForwardBatch` of `ShapeDtypeStruct`s, for lowering a step ahead of time without
    allocating one. No `sharding` for the single-device steps (their batches are
    uncommitted arrays); the DP steps pass their rows' sharding."""
    i32, dims = np.int32, (rows, tokens)

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return _unflatten(
        None,
        [
            spec(dims, i32),  # input_ids
            spec(dims, i32),  # positions
            spec(dims, np.bool_),  # valid
            spec(dims, i32),  # write_slots
            spec((rows, width), i32),  # page_table
            spec((rows,), i32),  # kv_lens
        ],
    )


def prefill_batch(prompt: np.ndarray, table: np.ndarray, page_size: int) -> ForwardBatch:
    """One request's whole-prompt prefill batch, padded to `prefill_bucket(len(prompt))`.

    `table` is the request's page-table row (logical page -> pool page); padding tokens
    write to slot 0 (the trash page)."""
    return span_batch(prompt, 0, table, page_size, prefill_bucket(len(prompt)))


def span_batch(
    ids: np.ndarray, start: int, table: np.ndarray, page_size: int, length: int | None = None
) -> ForwardBatch:
    """One request's tokens `ids` at positions `start, start + 1, ..`, padded to `length`
    tokens (padding writes slot 0, the trash page); its KV then ends after the last of
    them (`kv_lens = start + len(ids)`)."""
    n = len(ids)
    t_len = n if length is None else length
    tokens = np.zeros((1, t_len), np.int32)
    tokens[0, :n] = ids
    positions = np.zeros((1, t_len), np.int32)
    positions[0, :n] = np.arange(start, start + n)
    valid = np.arange(t_len)[None] < n
    slots = np.where(valid, slots_for_positions(table, positions[0], page_size)[None], 0)
    return batch_from_host(
        tokens, positions, valid, slots, np.asarray(table, np.int32)[None], np.asarray([start + n])
    )
