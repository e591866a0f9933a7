"""Feed-forward blocks: dense SwiGLU MLP and the DeepSeek-style MoE.

Router (DeepSeek-V3 family): sigmoid scores; `scores + e_score_correction_bias` chooses
experts (the bias never weights them); with `n_group > 1` only the `topk_group` groups
with the highest top-2 sums are eligible; the chosen experts' unbiased scores are
optionally normalized to sum 1 and scaled by `routed_scaling_factor`. Shared experts
are a dense MLP added to every token.

Routed experts run grouped: token-expert pairs are sorted by expert and fed to
`lax.ragged_dot` (or, where XLA's dense lowering of it would be large, to a loop over
tiles of each expert's rows), so compute scales with `num_experts_per_tok`, not
`n_routed_experts`; the outputs are un-sorted and summed per token in a fixed order (no
scatter-add), so the result is deterministic on GPU too. With expert parallelism the
pairs travel to the rank holding their expert and back (`expert_parallel`), and the same
per-token sum follows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from cpkv_jax.config import ModelConfig
from cpkv_jax.model import expert_parallel
from cpkv_jax.model.fp8 import SCALE_SUFFIX, dequantize, zero_from
from cpkv_jax.model.layers import Linear, fp8_params
from cpkv_jax.model.numerics import rowwise

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
# The most bytes `ragged_dot`'s dense expansion may take (`RoutedExperts._ffn`); past it the
# experts run tile by tile. 256 MiB keeps an EP8 GLM-5 decode step (256 token-expert rows
# per rank x 32 experts x 6,144 x 4 B = 201 MB) on `ragged_dot`; a 4K-token prefill chunk
# (206 GB on one device) goes tiled.
DENSE_EXPANSION_BYTES = 256 << 20
TILE_ROWS = 256  # rows per tiled item: one expert's matmuls at a time


class DenseMLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, *, rngs: nnx.Rngs, dtype, param_dtype):
        lin = functools.partial(Linear, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = lin(hidden, intermediate)
        self.up_proj = lin(hidden, intermediate)
        self.down_proj = lin(intermediate, hidden)

    def __call__(self, x: Float[Array, "... h"]) -> Float[Array, "... h"]:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def route(
    logits: Float[Array, "n e"],
    bias: Float[Array, " e"],
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[Int[Array, "n k"], Float[Array, "n k"]]:
    """Chosen experts and their combine weights for each token."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)
    n, e = choice.shape
    if n_group > 1:
        grouped = choice.reshape(n, n_group, e // n_group)
        group_scores = jax.lax.top_k(grouped, min(2, e // n_group))[0].sum(-1)  # [n, g]
        _, top_groups = jax.lax.top_k(group_scores, topk_group)
        group_ok = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(group_ok, e // n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * routed_scaling_factor


class RoutedExperts(nnx.Module):
    """`n_routed_experts` SwiGLU experts, weights stacked in HF `[out, in]` layout.

    FP8 (`to_fp8`): each projection is `[E, out, in]` fp8 plus `<proj>_scale_inv`
    `[E, ceil(out / B0), ceil(in / B1)]`, dequantized inside the traced call. Under
    expert parallelism (`expert_parallel`) the leaves hold this rank's `E / S` experts.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size

        def init(shape, fan_in):
            return nnx.Param(
                (jax.random.normal(rngs.params(), shape) * fan_in**-0.5).astype(param_dtype)
            )

        self.gate_proj = init((e, i, h), h)
        self.up_proj = init((e, i, h), h)
        self.down_proj = init((e, h, i), i)
        self.gate_proj_scale_inv: nnx.Param | None = nnx.data(None)
        self.up_proj_scale_inv: nnx.Param | None = nnx.data(None)
        self.down_proj_scale_inv: nnx.Param | None = nnx.data(None)
        self.block: tuple[int, int] | None = None
        self.dtype = dtype

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Make the experts FP8 block-quantized (abstract leaves; the loader fills them)."""
        for proj in EXPERT_PROJS:
            weight, scale = fp8_params(getattr(self, proj).shape, block)
            setattr(self, proj, weight)
            setattr(self, proj + SCALE_SUFFIX, scale)
        self.block = tuple(block)

    def _weight(self, proj: str, after: Array | None = None) -> Array:
        """`[E_local, in, out]` in the compute dtype, as `ragged_dot` wants it; FP8 is
        dequantized once `after` exists (the layer's tokens: `fp8.dequantize`)."""
        w, scale = getattr(self, proj)[...], getattr(self, proj + SCALE_SUFFIX)
        w = (
            w.astype(self.dtype)
            if scale is None
            else dequantize(w, scale[...], self.block, self.dtype, after)
        )
        return jnp.swapaxes(w, 1, 2)

    def _ffn(
        self, after: Array, rows: Float[Array, "m h"], sizes: Int[Array, " e"]
    ) -> Float[Array, "m h"]:
        """SwiGLU of rows sorted by (local) expert, `sizes[e]` rows per expert; the FP8
        weights are dequantized once `after` (the layer's tokens) exists.

        `ragged_dot` while its dense expansion stays small: XLA (CPU, and GPU as of JAX
        0.11) lowers it to every row against every local expert, masked, holding
        `rows x experts x max(hidden, intermediate)` floats (206 GB for a 4K-token GLM-5
        chunk on one device; an H200 compile asked for 96 GiB). Past
        `DENSE_EXPANSION_BYTES` the experts run one row tile at a time (`_tiled_ffn`)."""
        m, h = rows.shape
        e, i = self.gate_proj.shape[0], self.gate_proj.shape[1]
        if m * e * max(h, i) * 4 > DENSE_EXPANSION_BYTES:
            return self._tiled_ffn(after, rows, sizes)
        gate, up, down = (self._weight(p, after) for p in EXPERT_PROJS)
        hid = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(
            rows, up, sizes
        )
        return jax.lax.ragged_dot(hid, down, sizes)

    def _stacks(self, after: Array) -> tuple[Array, Array, Array]:
        """The stacked `(gate, up, down)` to index per expert, built once before the loop.
        FP8 as raw bytes computed from the layer's tokens: XLA:CPU computes on no 8-bit
        float and converted each whole stacked FP8 weight first, for every layer at the
        step's start; the data edge keeps that to this layer."""
        out = []
        for proj in EXPERT_PROJS:
            stacked = getattr(self, proj)[...]
            if stacked.dtype.itemsize == 1:
                raw = jax.lax.bitcast_convert_type(stacked, jnp.uint8)
                stacked = raw + zero_from(after).astype(jnp.uint8)
            out.append(stacked)
        return tuple(out)

    def _expert(self, stacks, e: Array, after: Array) -> tuple[Array, Array, Array]:
        """Expert `e`'s `(gate, up, down)` from `_stacks`, `[in, out]` in the compute
        dtype (FP8: dequantized here, that expert only)."""
        out = []
        for proj, stacked in zip(EXPERT_PROJS, stacks, strict=True):
            w = jax.lax.dynamic_index_in_dim(stacked, e, keepdims=False)
            stored = getattr(self, proj).dtype
            if stacked.dtype != stored:  # raw bytes of FP8
                w = jax.lax.bitcast_convert_type(w, stored)
            scale = getattr(self, proj + SCALE_SUFFIX)
            if scale is None:
                w = w.astype(self.dtype)
            else:
                s = jax.lax.dynamic_index_in_dim(scale[...], e, keepdims=False)
                w = dequantize(w, s, self.block, self.dtype, after)
            out.append(w.T)
        return tuple(out)

    def _tiled_ffn(
        self, after: Array, rows: Float[Array, "m h"], sizes: Int[Array, " e"]
    ) -> Float[Array, "m h"]:
        """`_ffn` without the dense expansion: a loop over (expert, tile of its rows)
        items, each one SwiGLU of up to `TILE_ROWS` rows with that expert's weights
        (dequantized in the item: no copy of the layer). At most `m / tile + experts`
        items run, so the work is the rows' own plus at most one partial tile per expert;
        an expert's tiles start at its first row, and rows past `sizes.sum()` stay 0 as
        `ragged_dot` leaves them."""
        m, h = rows.shape
        tile = min(TILE_ROWS, m)
        tiles = (sizes + tile - 1) // tile  # items per expert
        ends = jnp.cumsum(tiles)  # one past each expert's last item
        starts = jnp.cumsum(sizes) - sizes  # each expert's first row
        padded = jnp.concatenate([rows, jnp.zeros((tile, h), rows.dtype)])  # slices fit
        lane = jnp.arange(tile)[:, None]
        stacks = self._stacks(after)

        def item(state):
            n, out = state
            e = jnp.minimum(jnp.sum(ends <= n), sizes.shape[0] - 1)  # the expert of item n
            j = n - (ends[e] - tiles[e])  # its tile within the expert
            first = starts[e] + j * tile
            x = jax.lax.dynamic_slice_in_dim(padded, first, tile)
            gate, up, down = self._expert(stacks, e, after)
            y = (jax.nn.silu(x @ gate) * (x @ up)) @ down
            keep = lane < sizes[e] - j * tile  # the expert's rows in this tile
            old = jax.lax.dynamic_slice_in_dim(out, first, tile)
            return n + 1, jax.lax.dynamic_update_slice_in_dim(
                out, jnp.where(keep, y.astype(out.dtype), old), first, 0
            )

        out = jnp.zeros((m + tile, h), rows.dtype)
        _, out = jax.lax.while_loop(lambda st: st[0] < ends[-1], item, (jnp.int32(0), out))
        return out[:m]

    def __call__(
        self, x: Float[Array, "n h"], experts: Int[Array, "n k"], weights: Float[Array, "n k"]
    ) -> Float[Array, "n h"]:
        n, k = experts.shape
        xs = x.astype(self.dtype)
        n_local = self.gate_proj.shape[0]
        # Dequantized from the layer's tokens on (not at the step's start: `fp8.dequantize`).
        ffn = functools.partial(self._ffn, xs)
        spec = expert_parallel.current()
        if spec is None:
            order, sizes = expert_parallel.sort_pairs(experts.reshape(-1), n_local)
            ys = ffn(jnp.repeat(xs, k, axis=0)[order], sizes)
            per_slot = ys[invert_permutation(order)].reshape(n, k, -1)  # token-slot major
        else:
            per_slot = expert_parallel.ep_expert_outputs(spec, xs, experts, n_local, ffn)
        return sum_slots(per_slot * weights[..., None].astype(self.dtype)).astype(x.dtype)


def invert_permutation(order: Int[Array, " m"]) -> Int[Array, " m"]:
    """`inverse[order[i]] = i` by a unique-index scatter (a set, not an add: exact)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]), unique_indices=True)


def combine_expert_outputs(
    ys: Float[Array, "nk h"], order: Int[Array, " nk"], k: int
) -> Float[Array, "n h"]:
    """Sum each token's `k` expert outputs; `ys[i]` belongs to token-slot `order[i]`
    (rows as `ragged_dot` returns them, sorted by expert)."""
    per_slot = ys[invert_permutation(order)]
    return sum_slots(per_slot.reshape(order.shape[0] // k, k, -1))


def sum_slots(per_slot: Float[Array, "n k h"]) -> Float[Array, "n h"]:
    """Sum each token's `k` expert outputs in slot order, in float32.

    No scatter-add: a float scatter-add lowers to atomics on GPU, whose order (and so the
    output bits) changes run to run; the explicit adds give the same bits for every run,
    token, batch shape and expert placement.
    """
    per_slot = per_slot.astype(jnp.float32)
    out = per_slot[:, 0]
    for slot in range(1, per_slot.shape[1]):
        out = out + per_slot[:, slot]
    return out


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        self.cfg = cfg
        self.gate = MoEGate(cfg, rngs=rngs)
        self.experts = RoutedExperts(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.shared_experts = (
            DenseMLP(
                cfg.hidden_size,
                cfg.moe_intermediate_size * cfg.n_shared_experts,
                rngs=rngs,
                dtype=dtype,
                param_dtype=param_dtype,
            )
            if cfg.n_shared_experts
            else None
        )

    def __call__(self, x: Float[Array, "b t h"]) -> Float[Array, "b t h"]:
        with jax.named_scope("moe"):
            return self._moe(x)

    def _moe(self, x: Float[Array, "b t h"]) -> Float[Array, "b t h"]:
        return rowwise(self._tokens, x.reshape(-1, x.shape[-1])).reshape(x.shape)

    def _tokens(self, flat: Float[Array, "n h"]) -> Float[Array, "n h"]:
        cfg = self.cfg
        logits = jnp.einsum(
            "nh,eh->ne", flat.astype(jnp.float32), self.gate.weight[...].astype(jnp.float32)
        )
        experts, weights = route(
            logits,
            self.gate.e_score_correction_bias[...],
            top_k=cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )
        out = self.experts(flat, experts, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out


class MoEGate(nnx.Module):
    """Router parameters, kept float32.

    HF names: `mlp.gate.weight`, `mlp.gate.e_score_correction_bias`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, h = cfg.n_routed_experts, cfg.hidden_size
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (e, h), jnp.float32) * h**-0.5)
        self.e_score_correction_bias = nnx.Param(
            jax.random.normal(rngs.params(), (e,), jnp.float32) * 0.1
        )
