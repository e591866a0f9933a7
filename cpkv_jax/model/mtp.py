"""The multi-token-prediction (MTP) layer GLM-5 and DeepSeek-V3.2 ship after the trunk.

Stored as `model.layers.{N}` with `N = num_hidden_layers` (78 for GLM-5, 61 for
DeepSeek-V3.2; `num_nextn_predict_layers: 1`), it predicts the token after next:

    x   = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])      (2H -> H)
    x   = decoder block(x) at position i                      (MLA + its own indexer + MoE)
    out = shared_head.norm(x)   -> the trunk's LM head -> logits of t_{i+2}

`h_i` is the trunk's final hidden state at position `i`, after its final norm: the state
its LM head reads, which is what SGLang's and vLLM's MTP drafters are fed. The embedding
and the LM head are the trunk's (the checkpoint's `embed_tokens` / `shared_head.head`
copies inside the layer are not loaded). The block is a `DecoderLayer` of
`mtp_config(cfg)`, the trunk's config with the MTP block appended as layer `N` (a full
indexer layer with an MoE FFN), so its KV - latent and index K - lives in the same pages
as the trunk's: `KVLayout.from_model(mtp_config(cfg), ...)` is the trunk's layout plus
that layer's leaves, and every pool, transfer and host-cache copy follows from it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import ConfigError
from cpkv_jax.model.forward_batch import ForwardBatch
from cpkv_jax.model.kv_cache import KVIO, KVPool
from cpkv_jax.model.layers import Linear, RMSNorm
from cpkv_jax.model.mla import AttnForm
from cpkv_jax.model.transformer import DecoderLayer


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with its MTP block as one more layer (index `cfg.num_hidden_layers`): a full
    indexer layer with a routed-expert FFN. The trunk keeps reading `cfg`; pools and the
    MTP block use this one."""
    if cfg.num_nextn_predict_layers < 1:
        raise ConfigError(
            f"{cfg.model_type} config has num_nextn_predict_layers="
            f"{cfg.num_nextn_predict_layers}: the checkpoint ships no MTP layer"
        )
    if cfg.num_nextn_predict_layers > 1:
        raise ConfigError(
            f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}: only one MTP layer "
            "is supported (GLM-5 and DeepSeek-V3.2 ship one)"
        )
    return dataclasses.replace(
        cfg,
        num_hidden_layers=cfg.num_hidden_layers + 1,
        indexer_types=(*cfg.indexer_types, "full"),
        mlp_layer_types=(*cfg.mlp_layer_types, "sparse"),
    )


class SharedHead(nnx.Module):
    """HF `shared_head`: the norm before the (trunk's) LM head."""

    def __init__(self, cfg: ModelConfig):
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """The MTP layer (see the module docstring); parameter paths are the checkpoint's
    names under `model.layers.{N}` (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and
    the decoder block's `self_attn`, `mlp`, `input_layernorm`,
    `post_attention_layernorm`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        mcfg = mtp_config(cfg)
        self.layer_id = cfg.num_hidden_layers
        super().__init__(mcfg, self.layer_id, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(
            2 * cfg.hidden_size, cfg.hidden_size, rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )
        self.shared_head = SharedHead(cfg)

    def predict(
        self,
        embeds: Float[Array, "b t h"],
        hidden: Float[Array, "b t h"],
        batch: ForwardBatch,
        pool: KVPool,
        cos: Array,
        sin: Array,
        *,
        kv_io: KVIO,
        index_k_dtype: str,
        form: AttnForm = "absorbed",
    ) -> tuple[Float[Array, "b t h"], KVPool]:
        """The normed hidden states whose logits (the trunk's LM head) predict the token
        after `batch.input_ids`, writing this layer's KV at `batch.write_slots`.

        `embeds` are the trunk's embeddings of `batch.input_ids` (the tokens at
        `positions + 1`), `hidden` the trunk's final (normed) hidden states at
        `batch.positions`; `cos` / `sin` the rope tables of `batch.positions`; `pool`
        a pool of `mtp_config`'s layout."""
        x = jnp.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1)
        x = self.eh_proj(x)
        x, pool, _ = self(
            x, batch, pool, cos, sin, None, kv_io=kv_io, index_k_dtype=index_k_dtype, form=form
        )
        return self.shared_head.norm(x), pool
