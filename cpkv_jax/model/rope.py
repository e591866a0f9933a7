"""Rotary position embedding on the rope slice, with optional YaRN.

Two pairings are used by the served models:
- interleaved: pairs `(x[2i], x[2i+1])` rotate by frequency `i` (MLA in both models, and
  the GLM-5 indexer);
- half-split: pairs `(x[i], x[i + d/2])` (the DeepSeek-V3.2 indexer).
Only dot products between rotated q and k matter, so we rotate in place instead of
permuting to HF's de-interleaved layout.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from cpkv_jax.config import RopeConfig, yarn_get_mscale


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def inv_freq_and_mscale(dim: int, rope: RopeConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies `[dim/2]` (float64 numpy, static) and the cos/sin magnitude."""
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    freq_extra = 1.0 / (rope.theta**exponents)
    if rope.rope_type != "yarn":
        return freq_extra, 1.0
    freq_inter = freq_extra / rope.factor
    assert rope.original_max_position_embeddings is not None
    low = math.floor(
        _correction_dim(rope.beta_fast, dim, rope.theta, rope.original_max_position_embeddings)
    )
    high = math.ceil(
        _correction_dim(rope.beta_slow, dim, rope.theta, rope.original_max_position_embeddings)
    )
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp  # 1 -> keep the original (high) frequency
    inv_freq = freq_inter * (1.0 - extrapolate) + freq_extra * extrapolate
    mscale = yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(
        rope.factor, rope.mscale_all_dim
    )
    return inv_freq, mscale


def rope_cos_sin(
    positions: Int[Array, "*batch"], dim: int, rope: RopeConfig
) -> tuple[Float[Array, "*batch half"], Float[Array, "*batch half"]]:
    inv_freq, mscale = inv_freq_and_mscale(dim, rope)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * mscale, jnp.sin(angles) * mscale


def apply_rope(
    x: Float[Array, "*batch dim"],
    cos: Float[Array, "*cb half"],
    sin: Float[Array, "*cb half"],
    *,
    interleaved: bool,
) -> Float[Array, "*batch dim"]:
    """Rotate the last axis of `x`; cos/sin broadcast against `x[..., :dim/2]`."""
    xf = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if interleaved:
        out = jnp.stack([o1, o2], axis=-1).reshape(xf.shape)
    else:
        out = jnp.concatenate([o1, o2], axis=-1)
    return out.astype(x.dtype)
