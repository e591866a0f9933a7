"""The GLM-5 / DeepSeek-V3.2 causal LM (`GlmMoeDsaForCausalLM`, `DeepseekV32ForCausalLM`).

Parameter paths mirror HF tensor names (`model.layers.3.self_attn.q_a_proj.weight` is
`model.layers[3].self_attn.q_a_proj.weight`), which `weights.py` relies on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from cpkv_jax.config import ModelConfig
from cpkv_jax.model.forward_batch import ForwardBatch
from cpkv_jax.model.kv_cache import KVIO, SINGLE_DEVICE_KV_IO, KVPool
from cpkv_jax.model.layers import Embedding, Linear, RMSNorm
from cpkv_jax.model.mla import AttnForm, MLAttention
from cpkv_jax.model.moe import DenseMLP, MoE
from cpkv_jax.model.numerics import (
    batch_invariant,
    is_batch_invariant,
    rowwise,
    token_block_bytes,
    tokenwise,
)
from cpkv_jax.model.rope import rope_cos_sin
from cpkv_jax.scores import TOP_SCORES


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, *, rngs: nnx.Rngs, dtype, param_dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_id, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.mlp_layer_types[layer_id] == "dense":
            self.mlp = DenseMLP(
                cfg.hidden_size,
                cfg.intermediate_size,
                rngs=rngs,
                dtype=dtype,
                param_dtype=param_dtype,
            )
        else:
            self.mlp = MoE(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x, batch, pool, cos, sin, topk, *, kv_io, index_k_dtype, form):
        attn_out, pool, topk = self.self_attn(
            self.input_layernorm(x),
            batch,
            pool,
            cos,
            sin,
            topk,
            kv_io=kv_io,
            index_k_dtype=index_k_dtype,
            form=form,
        )
        h = x + attn_out
        with jax.named_scope("ffn"):
            out = h + self.mlp(self.post_attention_layernorm(h))
        return out, pool, topk


class Backbone(nnx.Module):
    """HF `model.*`: embeddings, decoder layers, final norm; with `mtp`, the MTP layer
    after the trunk's layers (`model.layers.{num_hidden_layers}`, as checkpoints store it)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype, mtp: bool):
        from cpkv_jax.model.mtp import MTPLayer  # it builds on DecoderLayer, defined here

        self.embed_tokens = Embedding(
            cfg.vocab_size, cfg.hidden_size, rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )
        layers = [
            DecoderLayer(cfg, i, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
            for i in range(cfg.num_hidden_layers)
        ]
        if mtp:
            layers.append(MTPLayer(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype))
        self.layers = nnx.List(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        mtp: bool = False,
    ):
        """`mtp`: also build the checkpoint's MTP layer (`cpkv_jax.model.mtp`, which
        needs `cfg.num_nextn_predict_layers >= 1`); its KV needs a pool of
        `mtp_config(cfg)`'s layout."""
        self.cfg = cfg
        self.dtype = dtype
        self.model = Backbone(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype, mtp=mtp)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(
                cfg.hidden_size, cfg.vocab_size, rngs=rngs, dtype=dtype, param_dtype=param_dtype
            )
        )

    def __call__(
        self,
        batch: ForwardBatch,
        pool: KVPool,
        *,
        kv_io: KVIO = SINGLE_DEVICE_KV_IO,
        index_k_dtype: str = "fp8_e4m3",
        form: AttnForm = "absorbed",
    ) -> tuple[Float[Array, "b t h"], KVPool]:
        """Run every layer on the new tokens, writing their KV; returns normed hidden."""
        cfg = self.cfg
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = rope_cos_sin(batch.positions, cfg.qk_rope_head_dim, cfg.rope)
        topk = None
        for i in range(cfg.num_hidden_layers):  # the trunk: an MTP layer runs on its own
            x, pool, topk = self.model.layers[i](
                x, batch, pool, cos, sin, topk, kv_io=kv_io, index_k_dtype=index_k_dtype, form=form
            )
        return self.model.norm(x), pool

    @property
    def mtp(self):
        """The MTP layer (`cpkv_jax.model.mtp.MTPLayer`), or None when not built."""
        layers = self.model.layers
        return (
            layers[self.cfg.num_hidden_layers] if len(layers) > self.cfg.num_hidden_layers else None
        )

    def logits(self, hidden: Float[Array, "... h"]) -> Float[Array, "... v"]:
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        wf = w[...].astype(jnp.float32)
        return rowwise(
            lambda rows: jnp.einsum("...h,vh->...v", rows, wf), hidden.astype(jnp.float32)
        )


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "kv_io",
        "index_k_dtype",
        "form",
        "all_logits",
        "invariant",
        "block_bytes",
    ),
    donate_argnames=("pool",),
)
def forward_step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    batch: ForwardBatch,
    pool: KVPool,
    *,
    kv_io: KVIO = SINGLE_DEVICE_KV_IO,
    index_k_dtype: str = "fp8_e4m3",
    form: AttnForm = "absorbed",
    all_logits: bool = False,
    invariant: bool = False,
    block_bytes: int | None = None,
) -> tuple[Float[Array, "b ... v"], KVPool]:
    """One jitted model step: logits (last valid token per row, or every token) + pool.

    The pool is donated: callers must use the returned pool and drop the old one.
    `invariant` selects batch-invariant numerics (`cpkv_jax.model.numerics`);
    `block_bytes` the indexer's and sparse attention's token-block budget (None: the
    default, `cpkv_jax.buckets.TRANSIENT_BLOCK_BYTES`).
    """
    with batch_invariant(invariant), token_block_bytes(block_bytes):
        model = nnx.merge(graphdef, state)
        hidden, pool = model(batch, pool, kv_io=kv_io, index_k_dtype=index_k_dtype, form=form)
        if not all_logits:
            return last_token_logits(model, hidden, batch.valid), pool
        return model.logits(hidden), pool


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "kv_io", "index_k_dtype", "form", "invariant", "block_bytes"),
    donate_argnames=("pool",),
)
def forward_score_step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    batch: ForwardBatch,
    pool: KVPool,
    targets: jax.Array,
    *,
    kv_io: KVIO = SINGLE_DEVICE_KV_IO,
    index_k_dtype: str = "fp8_e4m3",
    form: AttnForm = "absorbed",
    invariant: bool = False,
    block_bytes: int | None = None,
):
    """`forward_step` (last-token logits) that also scores every fed token: the log-prob
    of `targets[b, t]` (`[B, T]`, the next prompt token; any id where none) after token
    `t` of row `b`, and the `TOP_SCORES` most likely tokens there (`score_tokens`).
    Returns `(logits, chosen, top_ids, top_logprobs), pool`."""
    with batch_invariant(invariant), token_block_bytes(block_bytes):
        model = nnx.merge(graphdef, state)
        hidden, pool = model(batch, pool, kv_io=kv_io, index_k_dtype=index_k_dtype, form=form)
        logits = last_token_logits(model, hidden, batch.valid)
        return (logits, *score_tokens(model, hidden, targets)), pool


def last_token_logits(model: CausalLM, hidden: jax.Array, valid: jax.Array) -> jax.Array:
    """Logits `[B, vocab]` after each row's last valid token (`hidden` `[B, T, H]`)."""
    last = jnp.maximum(valid.sum(-1) - 1, 0)
    return model.logits(jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])


@functools.partial(jax.jit, static_argnames=("invariant",))
def log_probs(logits: Float[Array, "... v"], invariant: bool = False) -> Float[Array, "... v"]:
    """Log-probabilities from logits: the one log-softmax every path uses (reference
    generator, decode engine, the prefill server's first token), so equal logits give
    equal log-probs wherever they are computed.

    `invariant` (batch-invariant numerics): the rows go through in tiles of `TILE`, one
    tile after another, so a row's log-probs do not depend on how many rows came with it
    (XLA:CPU reduces 16 or more rows of one program in another order than fewer)."""
    if not invariant:
        return jax.nn.log_softmax(logits, axis=-1)
    rows = logits.reshape(-1, logits.shape[-1])
    with batch_invariant(True):
        out = tokenwise(lambda x: jax.nn.log_softmax(x, axis=-1), rows)
    return out.reshape(logits.shape)


# Tokens whose full-vocabulary log-probs a scoring step holds at once: GLM-5's 154,880
# entries x 512 tokens x 4 B = 317 MB, not a whole 16K chunk's 10 GB.
SCORE_BLOCK_TOKENS = 512


def score_tokens(model: CausalLM, hidden: jax.Array, targets: jax.Array):
    """Log-prob of `targets` and the `TOP_SCORES` best tokens after each `hidden` row
    (`[B, T, H]`), in token blocks of `SCORE_BLOCK_TOKENS` so the full-vocabulary
    log-probs are never all in memory. Ties in the top: lower id first (`lax.top_k`).
    A negative target marks a token nobody asked to score (another request's row, or
    padding): a block of only those skips the LM head and gives zeros, so a step that
    scores one request does not pay the vocabulary projection for every row beside it."""
    b, t, h = hidden.shape
    n = b * t
    block = min(SCORE_BLOCK_TOKENS, n)
    pad = -n % block
    flat_h = jnp.pad(hidden.reshape(n, h), ((0, pad), (0, 0)))
    flat_t = jnp.pad(targets.reshape(n), (0, pad), constant_values=-1)
    k = min(TOP_SCORES, model.cfg.vocab_size)

    def scored(args):
        rows, tgt = args
        lp = log_probs(model.logits(rows), is_batch_invariant())
        top_lps, top_ids = jax.lax.top_k(lp, k)
        chosen = jnp.take_along_axis(lp, jnp.maximum(tgt, 0)[:, None], axis=1)[:, 0]
        return chosen, top_ids.astype(jnp.int32), top_lps

    def skipped(args):
        return (
            jnp.zeros((block,), jnp.float32),
            jnp.zeros((block, k), jnp.int32),
            jnp.zeros((block, k), jnp.float32),
        )

    def one(args):
        return jax.lax.cond(jnp.any(args[1] >= 0), scored, skipped, args)

    blocks = (flat_h.reshape(-1, block, h), flat_t.reshape(-1, block))
    chosen, top_ids, top_lps = jax.lax.map(one, blocks)
    return (
        chosen.reshape(-1)[:n].reshape(b, t),
        top_ids.reshape(-1, k)[:n].reshape(b, t, k),
        top_lps.reshape(-1, k)[:n].reshape(b, t, k),
    )
