"""Basic layers with Hugging Face parameter layouts.

`Linear.weight` is stored `[out, in]` exactly as in HF checkpoints, so loading is a
name lookup with no transposes, and the norms hold `weight` (and `bias`) under HF names.
Norm statistics are computed in float32 whatever the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from cpkv_jax.model.fp8 import FP8_DTYPE, dequantize, scale_shape
from cpkv_jax.model.numerics import rowwise


class Linear(nnx.Module):
    """`y = x @ weight.T`, no bias (none of the served models use one).

    After `to_fp8(block)` the weight is FP8 with a per-block `weight_scale_inv` (HF names
    `*.weight`, `*.weight_scale_inv`) and is dequantized inside the traced call.
    """

    def __init__(
        self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype: DTypeLike, param_dtype
    ):
        std = in_features**-0.5
        self.weight = nnx.Param(
            (jax.random.normal(rngs.params(), (out_features, in_features)) * std).astype(
                param_dtype
            )
        )
        self.dtype = dtype
        self.weight_scale_inv: nnx.Param | None = nnx.data(None)
        self.block: tuple[int, int] | None = None

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Make this an FP8 block-quantized layer (abstract leaves; the loader fills them)."""
        self.weight, self.weight_scale_inv = fp8_params(self.weight.shape, block)
        self.block = tuple(block)

    def dense_weight(self, dtype: DTypeLike | None = None, after: Array | None = None) -> Array:
        """The weight in `dtype` (default: the compute dtype), dequantized here when FP8,
        not before `after` (the activations it meets: `fp8.dequantize`)."""
        dtype = self.dtype if dtype is None else dtype
        if self.weight_scale_inv is None:
            return self.weight[...].astype(dtype)
        return dequantize(self.weight[...], self.weight_scale_inv[...], self.block, dtype, after)

    def __call__(self, x: Float[Array, "... in"]) -> Float[Array, "... out"]:
        w = self.dense_weight(after=x)
        return rowwise(lambda rows: jnp.einsum("...i,oi->...o", rows, w), x.astype(self.dtype))


def fp8_params(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[nnx.Param, nnx.Param]:
    """Abstract `(weight, scale_inv)` Params of an FP8 weight of `shape` (`[..., out, in]`)."""
    return (
        nnx.Param(jax.ShapeDtypeStruct(tuple(shape), FP8_DTYPE)),
        nnx.Param(jax.ShapeDtypeStruct(scale_shape(tuple(shape), block), jnp.float32)),
    )


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "... dim"]) -> Float[Array, "... dim"]:
        return rowwise(self._norm, x)

    def _norm(self, x: Float[Array, "... dim"]) -> Float[Array, "... dim"]:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias (the indexer's `k_norm`)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "... dim"]) -> Float[Array, "... dim"]:
        return rowwise(self._norm, x)

    def _norm(self, x: Float[Array, "... dim"]) -> Float[Array, "... dim"]:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, dtype: DTypeLike, param_dtype):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim)).astype(param_dtype))
        self.dtype = dtype

    def __call__(self, ids):
        return jnp.take(self.weight[...], ids, axis=0).astype(self.dtype)
