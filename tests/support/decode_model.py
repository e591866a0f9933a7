"""The two-layer model the decode-engine and engine-loop tests share (one full indexer
layer + one shared, one dense + one MoE FFN), with its pool geometry: the page count,
prompt bucket and table width are part of the compiled shapes, so both use the same."""

from __future__ import annotations

from flax import nnx

from cpkv_jax.config import ModelConfig
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.tools.tiny_config import tiny_config_dict

P = 16
INDEX_K = "fp8_e4m3"
POOL_PAGES = 40


def two_layer_config() -> ModelConfig:
    d = tiny_config_dict("glm_moe_dsa")
    d.update(
        num_hidden_layers=2,
        first_k_dense_replace=1,
        indexer_types=["full", "shared"],
        mlp_layer_types=["dense", "sparse"],
    )
    return ModelConfig.from_dict(d)


def two_layer_model() -> tuple[ModelConfig, CausalLM, ReferenceGenerator]:
    """Config, model (seed 0) and its reference generator at page size `P`."""
    cfg = two_layer_config()
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    return cfg, model, ReferenceGenerator(cfg, model, page_size=P, index_k_dtype=INDEX_K)
