"""Expert parallelism over a mesh axis (the `"cp"` axis: EP size = CP size, same devices).

Routed experts are sharded on their expert axis: rank `r` of `S` holds experts
`[r * E / S, (r + 1) * E / S)`. Attention, the indexer, the router, shared experts and
dense layers stay replicated. The model code runs per rank inside `shard_map`; traced
inside `expert_parallel(...)`, `RoutedExperts` sends each token-expert pair to the rank
holding the expert, runs the local experts there, and brings every pair's output back to
the token's rank, where the `k` outputs are summed in slot order exactly as on one
device (no float scatter-add, so the result is deterministic).

Dispatches (`EPDispatch`), both exact:
- `allgather`: every rank all-gathers the tokens and their routing (`[S * n]` rows), runs
  its experts on the pairs routed to them and `psum_scatter`s the per-slot outputs back;
  each slot is non-zero on exactly one rank, so the sum adds zeros only and is exact.
  Runs on every backend (XLA:CPU has all-gather and reduce-scatter).
- `all_to_all`: pairs are packed per destination rank into a padded `[S, C, h]` buffer
  and exchanged with `all_to_all`, computed, and exchanged back. `C = capacity_factor *
  n * k / S` rows per destination; with the default factor (`S`, the worst case: every
  pair to one rank) nothing can overflow. A smaller factor cuts the buffers, but a pair
  over its destination's capacity is dropped (GShard's rule) and the result is no longer
  exact; servers warn about it at startup. XLA:CPU has `all_to_all`, so this runs here
  too; `ragged_all_to_all` (which XLA:CPU lacks) would avoid the padding on GPUs.

"Exact" is about the exchange: no row is lost, and no float is added but zeros. The
local expert matmul itself may still round differently from one device's: XLA:CPU
lowers `ragged_dot` as a dense contraction over every group, so its reduction length,
and with it the rounding, depends on how many experts the rank holds (measured:
`benchmarks/bench_moe_ep.py`, bf16 at hidden 256 differs in the last bits; the tiny
model's CP8/EP8 prefill is bitwise equal to one device under batch-invariant numerics).

The setting is read while the step is traced, like `numerics.batch_invariant`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from cpkv_jax.errors import ConfigError, InputError

EPDispatch = Literal["allgather", "all_to_all"]
EP_DISPATCHES: tuple[str, ...] = get_args(EPDispatch)

# rows `[m, h]` sorted by local expert, group sizes `[E_local]` -> expert outputs `[m, h]`
GroupedFFN = Callable[[Array, Array], Array]


@dataclasses.dataclass(frozen=True)
class EPSpec:
    axis: str | tuple[str, ...]
    size: int
    dispatch: EPDispatch = "allgather"
    capacity_factor: float | None = None  # all_to_all only; None = size (never drops)

    def __post_init__(self) -> None:
        if self.dispatch not in EP_DISPATCHES:
            raise ValueError(f"`ep_dispatch` must be one of {EP_DISPATCHES}, got {self.dispatch!r}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"`ep_capacity_factor` must be > 0, got {self.capacity_factor}")

    @property
    def exact(self) -> bool:
        return self.dispatch == "allgather" or (
            self.capacity_factor is None or self.capacity_factor >= self.size
        )

    def capacity(self, pairs: int) -> int:
        """Rows per destination rank in the all_to_all buffer for `pairs` local pairs."""
        factor = self.size if self.capacity_factor is None else self.capacity_factor
        return max(1, min(pairs, -(-int(factor * pairs) // self.size)))


_CURRENT: contextvars.ContextVar[EPSpec | None] = contextvars.ContextVar(
    "cpkv_expert_parallel", default=None
)


@contextlib.contextmanager
def expert_parallel(spec: EPSpec | None) -> Iterator[None]:
    """Trace the per-rank model inside this context to shard routed experts over
    `spec.axis` (None: every rank holds all experts)."""
    token = _CURRENT.set(spec)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> EPSpec | None:
    return _CURRENT.get()


def sort_pairs(keys: Int[Array, " m"], groups: int) -> tuple[Array, Array]:
    """Stable order grouping pair keys `0..groups-1` (key `groups` = not here, sorted last)
    and the size of each group."""
    order = jnp.argsort(keys, stable=True)
    sizes = jnp.bincount(keys, length=groups + 1)[:groups].astype(jnp.int32)
    return order, sizes


def _run_local(
    rows: Float[Array, "m h"], local_expert: Int[Array, " m"], n_local: int, ffn: GroupedFFN
) -> Float[Array, "m h"]:
    """Outputs of rows whose `local_expert` is in `[0, n_local)`; other rows give zeros."""
    mine = (local_expert >= 0) & (local_expert < n_local)
    key = jnp.where(mine, local_expert, n_local)
    order, sizes = sort_pairs(key, n_local)
    ys = ffn(rows[order], sizes)
    inverse = jnp.argsort(order)  # a permutation: its inverse by sort is exact
    return jnp.where(mine[:, None], ys[inverse], jnp.zeros((), ys.dtype))


def ep_expert_outputs(
    spec: EPSpec,
    x: Float[Array, "n h"],
    experts: Int[Array, "n k"],
    n_local: int,
    ffn: GroupedFFN,
) -> Float[Array, "n k h"]:
    """Each local token-slot's expert output (before the routing weight), computed on
    the rank that holds the expert."""
    if spec.dispatch == "allgather":
        return _allgather(spec, x, experts, n_local, ffn)
    return _all_to_all(spec, x, experts, n_local, ffn)


def _allgather(spec, x, experts, n_local, ffn):
    n, k = experts.shape
    rank = jax.lax.axis_index(spec.axis)
    xg = jax.lax.all_gather(x, spec.axis, tiled=True)  # [S*n, h]
    eg = jax.lax.all_gather(experts, spec.axis, tiled=True).reshape(-1)  # [S*n*k]
    rows = jnp.repeat(xg, k, axis=0)
    ys = _run_local(rows, eg - rank * n_local, n_local, ffn)
    ys = ys.reshape(spec.size * n, k, -1)
    # Each slot is non-zero on exactly one rank: the reduce adds zeros only (exact).
    return jax.lax.psum_scatter(ys, spec.axis, scatter_dimension=0, tiled=True)


def _all_to_all(spec, x, experts, n_local, ffn):
    n, k = experts.shape
    size, h = spec.size, x.shape[-1]
    pairs = n * k
    cap = spec.capacity(pairs)
    flat = experts.reshape(-1)
    dest = flat // n_local
    order = jnp.argsort(dest, stable=True)
    sorted_dest = dest[order]
    counts = jnp.bincount(dest, length=size)
    starts = jnp.cumsum(counts) - counts
    within = jnp.arange(pairs) - starts[sorted_dest]
    kept = within < cap
    # Buffer row of each sorted pair; dropped pairs aim past the end and are discarded.
    slot = jnp.where(kept, sorted_dest * cap + within, size * cap)
    token = (jnp.arange(pairs) // k)[order]
    send_x = jnp.zeros((size * cap, h), x.dtype).at[slot].set(x[token], mode="drop")
    send_e = (
        jnp.full((size * cap,), n_local, jnp.int32)
        .at[slot]
        .set((flat - dest * n_local)[order].astype(jnp.int32), mode="drop")
    )
    recv_x = jax.lax.all_to_all(send_x.reshape(size, cap, h), spec.axis, 0, 0, tiled=True)
    recv_e = jax.lax.all_to_all(send_e.reshape(size, cap), spec.axis, 0, 0, tiled=True)
    ys = _run_local(recv_x.reshape(size * cap, h), recv_e.reshape(-1), n_local, ffn)
    back = jax.lax.all_to_all(ys.reshape(size, cap, -1), spec.axis, 0, 0, tiled=True)
    back = back.reshape(size * cap, -1)
    got = jnp.where(kept[:, None], back[jnp.minimum(slot, size * cap - 1)], 0)
    inverse = jnp.argsort(order)
    return got[inverse].reshape(n, k, -1)


# ---- placement -----------------------------------------------------------------------


def is_expert_leaf(path: tuple) -> bool:
    """A stacked routed-expert weight or scale (`...mlp.experts.gate_proj[_scale_inv]`)."""
    return len(path) >= 2 and path[-2] == "experts" and str(path[-1]).endswith(_PROJ_NAMES)


_PROJ_NAMES = (
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_proj_scale_inv",
    "up_proj_scale_inv",
    "down_proj_scale_inv",
)


def param_specs(state: nnx.State, axis: str | tuple[str, ...] | None) -> nnx.State:
    """PartitionSpecs for a model state: routed-expert leaves split on their expert axis
    over `axis` (None: no expert parallelism), everything else replicated."""
    return nnx.map_state(
        lambda path, _: P(axis) if axis is not None and is_expert_leaf(path) else P(), state
    )


def param_shardings(
    state: nnx.State, mesh: Mesh | AbstractMesh, axis: str | tuple[str, ...] | None
) -> nnx.State:
    """`param_specs` as NamedShardings on `mesh` (an AbstractMesh sizes real meshes)."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        param_specs(state, axis),
        is_leaf=lambda x: isinstance(x, P),
    )


def bytes_per_device(state: nnx.State, shardings: nnx.State) -> dict[str, int]:
    """Bytes one device holds of `state` (abstract or concrete) under `shardings`:
    `{"routed_experts": ..., "other": ..., "total": ...}`, from the shardings' shard shapes."""
    out = {"routed_experts": 0, "other": 0}
    flat_sh = dict(nnx.to_flat_state(shardings))
    for path, var in nnx.to_flat_state(state):
        value = var.get_value() if hasattr(var, "get_value") else var
        shard = flat_sh[path]
        sharding = shard.get_value() if hasattr(shard, "get_value") else shard
        nbytes = (
            math.prod(sharding.shard_shape(tuple(value.shape))) * np.dtype(value.dtype).itemsize
        )
        out["routed_experts" if is_expert_leaf(path) else "other"] += nbytes
    out["total"] = out["routed_experts"] + out["other"]
    return out


def check_ep_spec(
    ep: EPSpec, axis: str | tuple[str, ...], size: int, n_routed_experts: int
) -> None:
    """`ep` must run over mesh `axis` of `size` devices (a CP runner's `"cp"`, decode
    groups' `("dp", "cp")`), and the routed experts split evenly over them."""
    if (ep.axis, ep.size) != (axis, size):
        raise InputError(
            f"expert parallelism runs over {axis!r} ({size} devices) here: got axis "
            f"{ep.axis!r} size {ep.size}"
        )
    check_divisible(n_routed_experts, size)


def check_divisible(n_routed_experts: int, size: int, flag: str = "cp_size") -> None:
    if n_routed_experts % size:
        raise ConfigError(
            f"expert parallelism over {size} ranks needs `n_routed_experts` "
            f"({n_routed_experts}) divisible by `{flag}` ({size}); pick a size that "
            f"divides {n_routed_experts} or turn expert parallelism off"
        )
