"""NSA/DSA lightning indexer: per-token scores over the KV and the top-k selection.

score[t, s] = sum_h  w[t, h] * relu(q[t, h] . k[s]) * index_head_dim^-0.5
with w = weights_proj(x) * index_n_heads^-0.5. Keys get a LayerNorm, rope on their first
`qk_rope_head_dim` dims, and (like q) a normalized Hadamard rotation before storage; the
rotation is orthogonal, so it changes no score in exact arithmetic but spreads outliers
before fp8 quantization, as the reference implementation does.

Top-k is causal, `min(index_topk, position + 1)` per token, `-1` in unused slots. ReLU
makes exact ties common (all heads negative -> score 0); `lax.top_k` returns the lower
index first on ties, and indices are logical token positions, so the selection never
depends on how KV pages are laid out or padded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from cpkv_jax.buckets import block_rows
from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import ConfigError
from cpkv_jax.model.layers import LayerNorm, Linear
from cpkv_jax.model.numerics import (
    block_budget,
    is_batch_invariant,
    per_sequence,
    rowwise,
    tokenwise,
)
from cpkv_jax.model.rope import apply_rope


@functools.lru_cache(maxsize=8)
def hadamard_matrix(dim: int) -> np.ndarray:
    """Normalized Sylvester Hadamard matrix `[dim, dim]` (orthogonal, symmetric)."""
    if dim < 1 or dim & (dim - 1):
        raise ConfigError(f"index_head_dim={dim} must be a power of two (Hadamard rotation)")
    h = np.ones((1, 1))
    while h.shape[0] < dim:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(dim)).astype(np.float32)


def hadamard_rotate(x: Float[Array, "... d"]) -> Float[Array, "... d"]:
    h = jnp.asarray(hadamard_matrix(x.shape[-1]))
    return rowwise(lambda rows: rows @ h, x)


class Indexer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.interleave = cfg.indexer_rope_interleave
        lin = functools.partial(Linear, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.wq_b = lin(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = lin(cfg.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, 1e-6)
        # Head weights are projected in float32, as in the reference model.
        self.weights_proj = Linear(
            cfg.hidden_size, self.n_heads, rngs=rngs, dtype=jnp.float32, param_dtype=param_dtype
        )

    def _rope(self, x, cos, sin):
        pe = apply_rope(x[..., : self.rope_dim], cos, sin, interleaved=self.interleave)
        return jnp.concatenate([pe, x[..., self.rope_dim :]], axis=-1)

    def keys(self, x: Float[Array, "b t h"], cos, sin) -> Float[Array, "b t d"]:
        k = self.k_norm(self.wk(x)).astype(jnp.float32)
        return hadamard_rotate(self._rope(k, cos, sin))

    def queries(
        self, x: Float[Array, "b t h"], qr: Float[Array, "b t r"], cos, sin
    ) -> tuple[Float[Array, "b t nh d"], Float[Array, "b t nh"]]:
        b, t = x.shape[:2]
        q = self.wq_b(qr).reshape(b, t, self.n_heads, self.head_dim).astype(jnp.float32)
        q = hadamard_rotate(self._rope(q, cos[:, :, None], sin[:, :, None]))
        w = self.weights_proj(x.astype(jnp.float32)) * (self.n_heads**-0.5)
        return q, w * (self.head_dim**-0.5)


def _block(q: Array, k_view: Array, block_bytes: int | None) -> int:
    """Query tokens per indexer block; one token's logits are `[b, heads, s]` float32."""
    row_bytes = q.shape[0] * q.shape[2] * k_view.shape[1] * 4
    return block_rows(q.shape[1], row_bytes, block_budget(block_bytes))


def index_scores(
    q: Float[Array, "b t nh d"],
    w: Float[Array, "b t nh"],
    k_view: Float[Array, "b s d"],
    positions: Int[Array, "b t"],
    kv_lens: Int[Array, " b"],
    *,
    block_bytes: int | None = None,
    key_positions: Int[Array, " s"] | None = None,
) -> Float[Array, "b t s"]:
    """Causal indexer logits; -inf where `s > position` or `s >= kv_len`.

    `key_positions`: the logical position of each key of `k_view` (default `0..s-1`, a
    full view); a rank's owned pages are a strided subset (`cpkv_jax.owner_attention`).

    The per-head logits `[b, t, heads, s]` float32 are the largest transient of a prefill
    step at long context; the query tokens go in blocks whose logits fit `block_bytes`
    (`cpkv_jax.buckets.block_rows`; one block when they all fit), which the buffer
    estimator sizes the same way. None: the traced `numerics.token_block_bytes` budget,
    else `TRANSIENT_BLOCK_BYTES`.
    """
    s = jnp.arange(k_view.shape[1]) if key_positions is None else key_positions

    def sequence(q, w, positions, k_view, kv_lens):
        keys = k_view.astype(jnp.float32)

        def tokens(q, w, positions):
            logits = jnp.einsum("bthd,bsd->bths", q, keys)
            scores = jnp.einsum("bths,bth->bts", jax.nn.relu(logits), w)
            allowed = (s[None, None, :] <= positions[:, :, None]) & (
                s[None, None, :] < kv_lens[:, None, None]
            )
            return jnp.where(allowed, scores, -jnp.inf)

        return tokenwise(tokens, q, w, positions, axis=1, block=_block(q, keys, block_bytes))

    return per_sequence(sequence, q, w, positions, k_view, kv_lens)


def indexer_topk(
    q: Float[Array, "b t nh d"],
    w: Float[Array, "b t nh"],
    k_view: Float[Array, "b s d"],
    positions: Int[Array, "b t"],
    kv_lens: Int[Array, " b"],
    index_topk: int,
    *,
    block_bytes: int | None = None,
) -> Int[Array, "b t k"]:
    """`select_topk(index_scores(...), positions, index_topk)`, block by block.

    When the logits need more than one token block (`index_scores`), each block selects
    its own tokens' top-k from its own scores, so the step's `[b, t, s]` float32 scores
    never exist - only one block's. A token's selection depends on its own row alone, so
    the result is the same as selecting from the whole step's scores. Batch-invariant
    numerics keep the unfused form (their 16-row tiles are already small).
    """
    block = _block(q, k_view, block_bytes)
    if is_batch_invariant() or block >= q.shape[1]:
        scores = index_scores(q, w, k_view, positions, kv_lens, block_bytes=block_bytes)
        return select_topk(scores, positions, index_topk)

    def rows(q, w, positions):  # one block: its logits fit, so index_scores is one call
        scores = index_scores(q, w, k_view, positions, kv_lens, block_bytes=block_bytes)
        return select_topk(scores, positions, index_topk)

    return tokenwise(rows, q, w, positions, axis=1, block=block)


def select_topk(
    scores: Float[Array, "b t s"], positions: Int[Array, "b t"], index_topk: int
) -> Int[Array, "b t k"]:
    """Top `min(index_topk, position + 1)` logical positions per token, -1 padded."""
    k = min(index_topk, scores.shape[-1])
    # top_k ranks +0.0 above -0.0; fold signed zeros so ties stay lowest-position-first
    # even when scores are combined from different computations (e.g. across CP shards).
    scores = jnp.where(scores == 0, 0.0, scores)
    _, idx = jax.lax.top_k(scores, k)
    n_valid = jnp.minimum(positions + 1, index_topk)
    keep = jnp.arange(k)[None, None, :] < n_valid[:, :, None]
    return jnp.where(keep, idx, -1).astype(jnp.int32)
