"""FP8 block-quantized weights (the official DeepSeek-V3 / GLM-5 FP8 format).

A quantized `[out, in]` weight is stored as `float8_e4m3fn` plus `weight_scale_inv`, one
float32 multiplier per `B0 x B1` block (`quantization_config.weight_block_size`, default
128x128): `w[o, i] = q[o, i] * scale_inv[o // B0, i // B1]`; the last block row/column is
cropped when `B` does not divide. Stacked routed experts carry a leading expert axis on
both. The model keeps them like this on the device and dequantizes inside the jitted step
(`dequantize`, computed from the layer's activations so that no scheduler runs it before
its layer), one layer's weights at a time, so HBM holds 1 byte per weight instead of
2 (bf16); the float32 multiply is the same one `dequantize_np` does at load, so the two
paths give the same weight values bit for bit.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """`scale_inv` shape for a weight of `shape` (`[..., out, in]`)."""
    *lead, out_dim, in_dim = shape
    return (*lead, -(-out_dim // block[0]), -(-in_dim // block[1]))


def _expand(scale, block: tuple[int, int], out_dim: int, in_dim: int, repeat):
    scale = repeat(repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return scale[..., :out_dim, :in_dim]


def dequantize(
    q: Array,
    scale_inv: Array,
    block: tuple[int, int],
    dtype: DTypeLike,
    after: Array | None = None,
) -> Array:
    """Device dequantization (inside a jitted step): float32 multiply, then `dtype`.

    `after`: the activations the weight is applied to (the layer's rows). The
    dequantization is then computed from them (`zero_from`), so it cannot run before
    the layer does. A weight-only computation has no such edge and XLA may schedule it
    anywhere: XLA:CPU put every layer's dequantization at the start of the step and kept
    all of them alive, a float32 copy of every layer (39.5 GB per GLM-5 MoE layer,
    `benchmarks/decode_memory`), where one layer's at a time is what the memory plan
    counts."""
    out_dim, in_dim = q.shape[-2:]
    scale_inv = scale_inv.astype(jnp.float32)
    if after is not None:
        scale_inv = scale_inv + zero_from(after)  # + 0.0: the same scales bit for bit
    scale = _expand(scale_inv, block, out_dim, in_dim, jnp.repeat)
    return (q.astype(jnp.float32) * scale).astype(dtype)


def zero_from(x: Array) -> Array:
    """A float32 0.0 computed from `x`'s first element whatever its value: a predicate's
    0 or 1, clipped at 0 (a NaN or an infinity in one row cannot reach the weights that
    every row uses). XLA folds neither step, so the data edge stays."""
    if x.size == 0:  # nothing to wait for
        return jnp.zeros((), jnp.float32)
    flag = (jnp.ravel(x)[0] > 0).astype(jnp.int32)
    return jnp.minimum(flag, 0).astype(jnp.float32)


def dequantize_np(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Host dequantization to float32 (the dequantize-at-load path)."""
    out_dim, in_dim = q.shape[-2:]
    scale = _expand(scale_inv.astype(np.float32), block, out_dim, in_dim, np.repeat)
    return q.astype(np.float32) * scale


def quantize_np(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Block-quantize float weights `[..., out, in]` to (fp8, float32 scale_inv).

    Each block's scale maps its absolute maximum to the fp8 maximum (448), as the official
    checkpoints were made; an all-zero block gets scale 1.
    """
    w = np.asarray(w, np.float32)
    out_dim, in_dim = w.shape[-2:]
    b0, b1 = block
    rows, cols = -(-out_dim // b0), -(-in_dim // b1)
    pad = [(0, 0)] * (w.ndim - 2) + [(0, rows * b0 - out_dim), (0, cols * b1 - in_dim)]
    blocks = np.pad(np.abs(w), pad).reshape(*w.shape[:-2], rows, b0, cols, b1)
    amax = blocks.max(axis=(-3, -1))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    full = _expand(scale, block, out_dim, in_dim, np.repeat)
    q = (w / full).astype(ml_dtypes.float8_e4m3fn)
    return q, scale
