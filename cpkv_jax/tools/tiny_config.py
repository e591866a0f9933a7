"""The tiny model config the tests and the demo run on.

Small enough to run on 2 CPU cores, but it exercises every feature of the real models:
full and shared indexer layers (layer 0 full, then shared runs), dense then MoE layers,
grouped routing (DeepSeek variant), shared experts, and `index_topk` far below typical
test prompt lengths so attention really is sparse.

Three layers are the fewest that hold every kind of layer: GLM-5 style `full, shared,
shared` (a shared layer after a full one and after a shared one) over `dense, moe, moe`;
DeepSeek style `full, full, shared` from its freq/offset rule. Each layer adds about
0.15 s to every XLA:CPU compile of a step (the suite compiles hundreds), so config tests
that need a longer schedule ask for `num_layers=6` instead.
"""

from __future__ import annotations

from typing import Any

ARCHS = ("glm_moe_dsa", "deepseek_v32")


# Schedules by layer count: (indexer types, MLP types). GLM style configs list both;
# DeepSeek style ones take `first_k_dense_replace` from the MLP types.
_GLM_SCHEDULES = {
    3: (["full", "shared", "shared"], ["dense", "sparse", "sparse"]),
    6: (
        ["full", "full", "shared", "full", "shared", "shared"],
        ["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
    ),
}


def tiny_config_dict(arch: str = "glm_moe_dsa", *, num_layers: int = 3) -> dict[str, Any]:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if num_layers not in _GLM_SCHEDULES:
        raise ValueError(f"num_layers must be one of {sorted(_GLM_SCHEDULES)}, got {num_layers}")
    indexer_types, mlp_types = _GLM_SCHEDULES[num_layers]
    base: dict[str, Any] = {
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "first_k_dense_replace": mlp_types.count("dense"),
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "vocab_size": 320,
        "initializer_range": 0.02,
        # One MTP layer after the trunk, as GLM-5 and DeepSeek-V3.2 ship
        # (`make_tiny_checkpoint` writes it; servers load it only to draft with it).
        "num_nextn_predict_layers": 1,
    }
    if arch == "glm_moe_dsa":
        # Newer config style: rope_parameters and explicit per-layer lists.
        base.update(
            {
                "architectures": ["GlmMoeDsaForCausalLM"],
                "model_type": "glm_moe_dsa",
                "n_group": 1,
                "topk_group": 1,
                "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
                "indexer_types": list(indexer_types),
                "mlp_layer_types": list(mlp_types),
            }
        )
    else:
        # Older style: top-level rope_theta + YaRN rope_scaling, schedule from freq/offset
        # (freq 2, offset 2 -> full at 0, 1, 3, 5; shared at 2, 4; 3 layers: F F S).
        base.update(
            {
                "architectures": ["DeepseekV32ForCausalLM"],
                "model_type": "deepseek_v32",
                "n_group": 4,
                "topk_group": 2,
                "rope_theta": 10000.0,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 1024,
                    "beta_fast": 32,
                    "beta_slow": 1,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                },
                "index_topk_freq": 2,
                "index_skip_topk_offset": 2,
            }
        )
    return base
