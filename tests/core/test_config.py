"""ModelConfig from real HF config.json files, overrides, indexer schedule (SPEC S11.4)."""

from __future__ import annotations

import json

import pytest

from cpkv_jax.config import ModelConfig, derive_indexer_types, merge_model_overrides
from cpkv_jax.errors import ConfigError, UnknownModelTypeError
from cpkv_jax.model_configs import config_dir
from cpkv_jax.tools.tiny_config import tiny_config_dict


def _real(name: str) -> dict:
    return json.loads((config_dir(name) / "config.json").read_text())


def test_glm5_config_reads_dims_and_lists():
    cfg = ModelConfig.from_dict(_real("glm-5"))
    assert cfg.architecture == "GlmMoeDsaForCausalLM"
    assert cfg.num_hidden_layers == 78
    assert cfg.kv_cache_dim == 512 + 64
    assert cfg.qk_head_dim == 256
    assert cfg.indexer_types == ("full",) * 78
    assert cfg.mlp_layer_types[:3] == ("dense",) * 3
    assert set(cfg.mlp_layer_types[3:]) == {"sparse"}
    assert cfg.indexer_rope_interleave is True
    assert cfg.rope.rope_type == "default" and cfg.rope.theta == 10000.0


def test_deepseek_v32_config_uses_half_split_indexer_rope():
    cfg = ModelConfig.from_dict(_real("deepseek-v3.2"))
    assert cfg.architecture == "DeepseekV32ForCausalLM"
    assert cfg.num_hidden_layers == 61
    assert cfg.indexer_rope_interleave is False
    assert (cfg.n_group, cfg.topk_group) == (8, 4)
    # No indexer_types list in this file: every layer defaults to full.
    assert cfg.indexer_types == ("full",) * 61


def test_s11_4_freq4_offset3_schedule_on_78_layers():
    cfg = ModelConfig.from_dict(_real("glm-5-indexshare-freq4"))
    full = [l for l in range(78) if cfg.indexer_types[l] == "full"]
    assert full == [l for l in range(78) if l < 3 or (l - 2) % 4 == 0]
    assert len(full) == 21
    # Same schedule derived from the flags alone.
    assert derive_indexer_types(78, freq=4, offset=3) == cfg.indexer_types


def test_s11_4_override_recomputes_explicit_list():
    """A freq/offset override on a config with an all-full list gives the shared schedule."""
    cfg = ModelConfig.from_dict(
        _real("glm-5"), '{"index_topk_freq": 4, "index_skip_topk_offset": 3}'
    )
    assert cfg.indexer_types == derive_indexer_types(78, freq=4, offset=3)


def test_s11_4_pattern_wins_over_freq():
    pattern = "FFSFSS"
    types = derive_indexer_types(6, pattern=pattern, freq=1, offset=2)
    assert types == ("full", "full", "shared", "full", "shared", "shared")


def test_s11_4_defaults_freq1_offset2():
    assert derive_indexer_types(5, freq=None, offset=2) == ("full",) * 5
    assert derive_indexer_types(6, freq=2) == ("full", "full", "shared", "full", "shared", "full")


def test_overrides_are_merged_before_build_and_keep_other_keys():
    raw = tiny_config_dict("glm_moe_dsa")
    merged = merge_model_overrides(raw, '{"index_topk": 7}')
    assert merged["index_topk"] == 7 and merged["hidden_size"] == raw["hidden_size"]
    assert ModelConfig.from_dict(raw, {"index_topk": 7}).index_topk == 7


def test_old_style_yarn_rope_is_read():
    cfg = ModelConfig.from_dict(tiny_config_dict("deepseek_v32"))
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 4.0
    # YaRN mscale_all_dim folds into the softmax scale.
    assert cfg.softmax_scale > cfg.qk_head_dim**-0.5


def test_shared_layers_source_is_nearest_full_layer():
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa", num_layers=6))  # FFSFSS
    assert [cfg.indexer_source_layer(l) for l in range(6)] == [0, 1, 1, 3, 3, 3]
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))  # FSS
    assert [cfg.indexer_source_layer(l) for l in range(3)] == [0, 0, 0]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.pop("kv_lora_rank"), "missing required field.*kv_lora_rank"),
        (lambda d: d.update(hidden_size=-4), "hidden_size must be a positive integer"),
        (lambda d: d.update(n_routed_experts=6, n_group=4), "not divisible by n_group"),
        (lambda d: d.update(qk_rope_head_dim=64), "qk_rope_head_dim=64 must be even and <="),
        (lambda d: d.update(indexer_types=["full"] * 5), "indexer_types must list"),
        (lambda d: d.update(indexer_types=["shared"] + ["full"] * 2), "layer 0 must be a 'full'"),
        (lambda d: d.update(index_topk_pattern="FFX"), "index_topk_pattern"),
        (lambda d: d.update(num_experts_per_tok=9), "num_experts_per_tok=9 exceeds"),
        (lambda d: d.update(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_bad_config_raises_config_error_naming_the_field(mutate, match):
    raw = tiny_config_dict("glm_moe_dsa")
    mutate(raw)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_unknown_model_type_is_named():
    raw = tiny_config_dict("glm_moe_dsa") | {"model_type": "llama"}
    with pytest.raises(UnknownModelTypeError, match="'llama'"):
        ModelConfig.from_dict(raw)


def test_explicit_list_contradicting_file_freq_is_an_error():
    raw = tiny_config_dict("glm_moe_dsa") | {"index_topk_freq": 1}
    # The file's list has shared layers but freq=1 says all full.
    with pytest.raises(ConfigError, match="disagrees"):
        ModelConfig.from_dict(raw)


def test_missing_config_json_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        ModelConfig.from_dict(tiny_config_dict(), "[1, 2]")
