"""Multi-head latent attention (MLA) with NSA sparse top-k selection.

Per token the cache keeps the normalized latent `c` (`kv_lora_rank`) and the roped key
`k_pe` (`qk_rope_head_dim`). Attention over the selected tokens can run in two forms that
give the same result:
- `absorbed` (every serving path, prefill and decode): fold `W_uk` into the query and
  `W_uv` into the output, attending directly over the latent rows (as FlashMLA does);
- `expanded` (a test reference only): up-project the latent with `kv_b_proj` into
  per-head `k_nope` and `v` for every (query token, selected position) pair, then
  ordinary attention - tokens x top-k x heads x head dims of work and memory.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from cpkv_jax.buckets import block_rows
from cpkv_jax.config import ModelConfig
from cpkv_jax.model.forward_batch import ForwardBatch
from cpkv_jax.model.indexer import Indexer, indexer_topk, select_topk
from cpkv_jax.model.kv_cache import (
    KVIO,
    KVPool,
    OwnerAttentionIO,
    PagedKVIO,
    RowGather,
    dequantize_index_k,
    quantize_index_k,
    take_view_rows,
)
from cpkv_jax.model.layers import Linear, RMSNorm
from cpkv_jax.model.numerics import block_budget, per_sequence, tokenwise
from cpkv_jax.model.rope import apply_rope

AttnForm = Literal["expanded", "absorbed"]


def sparse_attention(
    q_nope: Float[Array, "b t h n"],
    q_pe: Float[Array, "b t h r"],
    latent_view: Array,
    topk: Int[Array, "b t k"],
    w_kv_b: Float[Array, "hx lora"],
    *,
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
    form: AttnForm,
    block_bytes: int | None = None,
    take: RowGather = take_view_rows,
    row_dim: int | None = None,
) -> Float[Array, "b t h v"]:
    """Attention of each query over its selected positions (`-1` = not selected).

    The selected rows are `take(latent_view, topk)`: by default `latent_view` is each
    request's full view `[b, s, c]`; `KVIO.rows` gives a paged source instead (the page
    table, with a `take` that reads only the selected rows from the pool), then
    `row_dim` is the stored row's width.

    The query tokens go in blocks whose largest float32 array fits `block_bytes`
    (`cpkv_jax.buckets.block_rows`; one block when they all fit): the gathered rows
    `[b, tokens, k, c]`, or in the expanded form the per-head keys `[b, tokens, k, h,
    nope]` when they are larger. None: the traced `numerics.token_block_bytes` budget,
    else `TRANSIENT_BLOCK_BYTES`.
    """

    def sequence(q_nope, q_pe, topk, latent_view):
        tokens = functools.partial(
            _sparse_attention_tokens,
            latent_view=latent_view,
            w_kv_b=w_kv_b,
            kv_lora_rank=kv_lora_rank,
            v_head_dim=v_head_dim,
            scale=scale,
            form=form,
            take=take,
        )
        per_selected = row_dim or latent_view.shape[2]  # a gathered row
        if form == "expanded":  # per-head keys and values built from it
            per_selected = max(per_selected, q_nope.shape[2] * max(q_nope.shape[3], v_head_dim))
        row_bytes = topk.shape[0] * topk.shape[2] * per_selected * 4
        block = block_rows(topk.shape[1], row_bytes, block_budget(block_bytes))
        return tokenwise(tokens, q_nope, q_pe, topk, axis=1, block=block)

    return per_sequence(sequence, q_nope, q_pe, topk, latent_view)


def _sparse_attention_tokens(
    q_nope, q_pe, topk, *, latent_view, w_kv_b, kv_lora_rank, v_head_dim, scale, form, take
):
    n_heads, nope = q_nope.shape[2], q_nope.shape[3]
    w = w_kv_b.astype(jnp.float32).reshape(n_heads, nope + v_head_dim, kv_lora_rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    valid = topk >= 0
    sel = take(latent_view, jnp.maximum(topk, 0)).astype(jnp.float32)  # [b,t,k,c+r]
    qn, qp = q_nope.astype(jnp.float32), q_pe.astype(jnp.float32)

    def softmax(scores):
        scores = jnp.where(valid[:, :, None, :], scores * scale, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        # A token with no selected position (padding only) would be all -inf -> NaN.
        return jnp.where(valid.any(-1)[:, :, None, None], probs, 0.0)

    if form == "absorbed":
        # As FlashMLA does: [q_lat, q_pe] . [c, k_pe] is one dot over the stored row, and
        # the output reads whole rows too (its rope columns dropped after), so the
        # gathered rows are used as they are - never sliced into a second copy.
        q_lat = jnp.einsum("bthn,hnc->bthc", qn, w_uk)
        scores = jnp.einsum("bthc,btkc->bthk", jnp.concatenate([q_lat, qp], axis=-1), sel)
        o_row = jnp.einsum("bthk,btkc->bthc", softmax(scores), sel)
        return jnp.einsum("bthc,hvc->bthv", o_row[..., :kv_lora_rank], w_uv)
    c_sel, kpe_sel = sel[..., :kv_lora_rank], sel[..., kv_lora_rank:]
    k_nope = jnp.einsum("btkc,hnc->btkhn", c_sel, w_uk)
    scores = jnp.einsum("bthn,btkhn->bthk", qn, k_nope) + jnp.einsum("bthr,btkr->bthk", qp, kpe_sel)
    v = jnp.einsum("btkc,hvc->btkhv", c_sel, w_uv)
    return jnp.einsum("bthk,btkhv->bthv", softmax(scores), v)


class MLAttention(nnx.Module):
    """MLA + (on `full` layers) the lightning indexer; `shared` layers reuse a top-k."""

    def __init__(self, cfg: ModelConfig, layer_id: int, *, rngs: nnx.Rngs, dtype, param_dtype):
        self.cfg = cfg
        self.layer_id = layer_id
        self.is_full = cfg.indexer_types[layer_id] == "full"
        self.index_slot = cfg.full_indexer_layers.index(layer_id) if self.is_full else -1
        self.dtype = dtype
        lin = functools.partial(Linear, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        h = cfg.num_attention_heads
        self.q_a_proj = lin(cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = lin(cfg.q_lora_rank, h * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = lin(cfg.hidden_size, cfg.kv_cache_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = lin(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = lin(h * cfg.v_head_dim, cfg.hidden_size)
        self.indexer = (
            Indexer(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype) if self.is_full else None
        )

    def project_latent(self, x: Float[Array, "b t hid"], cos, sin) -> Float[Array, "b t c"]:
        """What the cache stores for these tokens: `[norm(c), rope(k_pe)]`."""
        cfg = self.cfg
        kva = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(kva[..., : cfg.kv_lora_rank])
        k_pe = apply_rope(kva[..., cfg.kv_lora_rank :], cos, sin, interleaved=True)
        return jnp.concatenate([c, k_pe], axis=-1)

    def __call__(
        self,
        x: Float[Array, "b t hid"],
        batch: ForwardBatch,
        pool: KVPool,
        cos: Array,
        sin: Array,
        topk_in: Int[Array, "b t k"] | None,
        *,
        kv_io: KVIO,
        index_k_dtype: str,
        form: AttnForm,
    ) -> tuple[Array, KVPool, Int[Array, "b t k"]]:
        cfg = self.cfg
        b, t = x.shape[:2]
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(qr).reshape(b, t, cfg.num_attention_heads, cfg.qk_head_dim)
        q_nope = q[..., : cfg.qk_nope_head_dim]
        q_pe = apply_rope(
            q[..., cfg.qk_nope_head_dim :], cos[:, :, None], sin[:, :, None], interleaved=True
        )

        latent = list(pool.latent)
        latent[self.layer_id] = kv_io.write(
            latent[self.layer_id], batch.write_slots, self.project_latent(x, cos, sin)
        )
        pool = KVPool(tuple(latent), pool.index_k, pool.index_scale)

        if self.indexer is not None:
            with jax.named_scope("indexer"):
                pool = self._write_index_k(x, batch, pool, cos, sin, kv_io, index_k_dtype)
                j = self.index_slot
                scale = pool.index_scale[j] if pool.index_scale else None
                iq, iw = self.indexer.queries(x, qr, cos, sin)
                if isinstance(kv_io, OwnerAttentionIO):
                    topk = kv_io.select_topk(iq, iw, pool.index_k[j], scale, batch, cfg.index_topk)
                elif isinstance(kv_io, PagedKVIO) and (
                    (scores := kv_io.index_scores(iq, iw, pool.index_k[j], scale, batch))
                    is not None
                ):
                    topk = select_topk(scores, batch.positions, cfg.index_topk)
                else:
                    k_view = dequantize_index_k(
                        kv_io.view(pool.index_k[j], batch.page_table),
                        None if scale is None else kv_io.view(scale, batch.page_table),
                    )
                    topk = indexer_topk(
                        iq, iw, k_view, batch.positions, batch.kv_lens, cfg.index_topk
                    )
        else:
            assert topk_in is not None, (
                "shared indexer layer needs the preceding full layer's top-k"
            )
            topk = topk_in

        with jax.named_scope("sparse_mla"):
            layer_pool = pool.latent[self.layer_id]
            w_kv_b = self.kv_b_proj.dense_weight(jnp.float32, after=q_nope)
            dims = dict(
                kv_lora_rank=cfg.kv_lora_rank, v_head_dim=cfg.v_head_dim, scale=cfg.softmax_scale
            )
            if isinstance(kv_io, OwnerAttentionIO):
                if form != "absorbed":
                    raise ValueError("owner attention runs the absorbed MLA form only")
                o = kv_io.attend(q_nope, q_pe, layer_pool, batch, topk, w_kv_b, **dims)
            else:
                source, take = kv_io.rows(layer_pool, batch.page_table)
                o = sparse_attention(
                    q_nope,
                    q_pe,
                    source,
                    topk,
                    w_kv_b,
                    form=form,
                    take=take,
                    row_dim=layer_pool.shape[-1],
                    **dims,
                )
        out = self.o_proj(o.reshape(b, t, -1).astype(self.dtype))
        return out, pool, topk

    def _write_index_k(self, x, batch, pool, cos, sin, kv_io, index_k_dtype) -> KVPool:
        assert self.indexer is not None
        k_q, k_scale = quantize_index_k(self.indexer.keys(x, cos, sin), index_k_dtype)
        j = self.index_slot
        index_k = list(pool.index_k)
        index_k[j] = kv_io.write(index_k[j], batch.write_slots, k_q)
        index_scale = list(pool.index_scale)
        if k_scale is not None:
            index_scale[j] = kv_io.write(index_scale[j], batch.write_slots, k_scale)
        return KVPool(pool.latent, tuple(index_k), tuple(index_scale))
