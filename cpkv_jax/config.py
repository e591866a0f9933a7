"""Model configuration read from a Hugging Face `config.json`.

Two `config.json` styles exist in the wild and both are read (see cpkv_jax/model_configs):
- newer: `rope_parameters` (theta + scaling type), explicit `indexer_types` and
  `mlp_layer_types` lists;
- older: top-level `rope_theta` / `rope_scaling`, and the indexer schedule given only by
  `index_topk_pattern` or `index_topk_freq` / `index_skip_topk_offset`.

`json_model_override_args` are merged into the raw dict *before* the config is built
(SPEC S11.1), so every derived field sees the overrides.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from cpkv_jax.errors import ConfigError, UnknownModelTypeError

IndexerType = Literal["full", "shared"]
MlpType = Literal["dense", "sparse"]

# model_type -> (architecture name, indexer rope is interleaved)
# GLM-5 rotates interleaved pairs in both MLA and the indexer; DeepSeek-V3.2 rotates
# interleaved pairs in MLA but the two halves of the rope slice in the indexer.
SUPPORTED_MODEL_TYPES: dict[str, tuple[str, bool]] = {
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", True),
    "deepseek_v32": ("DeepseekV32ForCausalLM", False),
}

# Keys that drive the indexer schedule. When an override sets one of them, an explicit
# `indexer_types` list from the file is recomputed rather than trusted.
INDEXER_SCHEDULE_KEYS = ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")

_REQUIRED_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "n_routed_experts",
    "num_experts_per_tok",
    "max_position_embeddings",
)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (`rope_type` "default" or "yarn")."""

    theta: float
    rope_type: Literal["default", "yarn"] = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the model needs, validated. Build with `from_dict` / `from_pretrained`."""

    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    indexer_types: tuple[IndexerType, ...]
    mlp_layer_types: tuple[MlpType, ...]
    indexer_rope_interleave: bool
    # FP8 block-quantized checkpoints (`quantization_config.weight_block_size`).
    weight_block_size: tuple[int, int] | None = None
    # Multi-token-prediction layers stored after the trunk (`model.layers.{N}`): GLM-5
    # and DeepSeek-V3.2 ship one (`cpkv_jax.model.mtp`).
    num_nextn_predict_layers: int = 0

    # ---- derived sizes -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values per token in the MLA latent cache: latent + rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    def indexer_source_layer(self, layer: int) -> int:
        """The full layer whose top-k `layer` uses (itself when it is full)."""
        for src in range(layer, -1, -1):
            if self.indexer_types[src] == "full":
                return src
        raise ConfigError(f"layer {layer} is 'shared' but no full indexer layer precedes it")

    @property
    def softmax_scale(self) -> float:
        """MLA attention scale, with the YaRN mscale correction when YaRN is on."""
        scale = self.qk_head_dim**-0.5
        if self.rope.rope_type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    # ---- construction --------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, model_path: str | Path, json_model_override_args: str | Mapping[str, Any] | None = None
    ) -> ModelConfig:
        """Read `model_path/config.json`, merge overrides, validate."""
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"no config.json in {model_path!s}: point `model_path` at a HF model dir"
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(raw, json_model_override_args)

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any], json_model_override_args: str | Mapping[str, Any] | None = None
    ) -> ModelConfig:
        merged = merge_model_overrides(raw, json_model_override_args)
        return _build(merged)


def parse_override_args(json_model_override_args: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """`json_model_override_args` (a JSON object, as text) as a dict ('' / None -> {})."""
    if json_model_override_args is None or json_model_override_args == "":
        return {}
    if isinstance(json_model_override_args, Mapping):
        return dict(json_model_override_args)
    try:
        value = json.loads(json_model_override_args)
    except json.JSONDecodeError as e:
        raise ConfigError(f"`json_model_override_args` is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ConfigError(
            f"`json_model_override_args` must be a JSON object, got {type(value).__name__}"
        )
    return value


def merge_model_overrides(
    raw: Mapping[str, Any], json_model_override_args: str | Mapping[str, Any] | None
) -> dict[str, Any]:
    """Shallow-merge overrides into the raw config dict (SPEC S11.1)."""
    overrides = parse_override_args(json_model_override_args)
    merged = dict(raw)
    merged.update(overrides)
    if any(k in overrides for k in INDEXER_SCHEDULE_KEYS) and "indexer_types" not in overrides:
        # The override asks for a new schedule: the file's explicit list described the old one.
        merged.pop("indexer_types", None)
    return merged


def yarn_get_mscale(scale: float, mscale: float) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def derive_indexer_types(
    num_layers: int,
    pattern: str | None = None,
    freq: int | None = None,
    offset: int | None = None,
    explicit: list[str] | tuple[str, ...] | None = None,
) -> tuple[IndexerType, ...]:
    """Per-layer indexer type (SPEC S11.4).

    A pattern (`F`/`S` letters) wins; otherwise, when freq or offset is set, layer `i` is
    full iff `max(i - offset + 1, 0) % freq == 0` (freq default 1, offset default 2);
    otherwise an explicit `indexer_types` list; otherwise every layer is full.
    """
    if pattern:
        if len(pattern) != num_layers or set(pattern) - {"F", "S"}:
            raise ConfigError(
                f"index_topk_pattern {pattern!r} must be {num_layers} letters of 'F' "
                "(full indexer) or 'S' (shared top-k)"
            )
        types = tuple("full" if c == "F" else "shared" for c in pattern)
    elif freq is not None or offset is not None:
        freq = 1 if freq is None else int(freq)
        offset = 2 if offset is None or offset == 0 else int(offset)
        if freq < 1:
            raise ConfigError(f"index_topk_freq must be >= 1, got {freq}")
        types = tuple(
            "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)
        )
    elif explicit is not None:
        if len(explicit) != num_layers or set(explicit) - {"full", "shared"}:
            raise ConfigError(
                f"indexer_types must list 'full'/'shared' for each of the {num_layers} layers, "
                f"got {len(explicit)} entries {sorted(set(explicit))}"
            )
        types = tuple(explicit)  # type: ignore[arg-type]
    else:
        types = ("full",) * num_layers
    if num_layers and types[0] != "full":
        raise ConfigError(
            "layer 0 must be a 'full' indexer layer: shared layers reuse a preceding one"
        )
    return types  # type: ignore[return-value]


def _rope_from(raw: Mapping[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling: Mapping[str, Any] = params
        rope_type = params.get("rope_type", params.get("type", "default"))
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling") or {}
        rope_type = (
            scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        )
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"rope type {rope_type!r} is not supported (use 'default' or 'yarn')")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if "factor" not in scaling or "original_max_position_embeddings" not in scaling:
        raise ConfigError("yarn rope scaling needs 'factor' and 'original_max_position_embeddings'")
    return RopeConfig(
        theta=float(theta),
        rope_type="yarn",
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast", 32.0)),
        beta_slow=float(scaling.get("beta_slow", 1.0)),
        mscale=float(scaling.get("mscale", 1.0)),
        mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)),
    )


def _build(raw: Mapping[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnknownModelTypeError(
            f"model_type {model_type!r} is not supported; supported: "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    architecture, indexer_interleave = SUPPORTED_MODEL_TYPES[model_type]
    missing = [k for k in _REQUIRED_INT_FIELDS if raw.get(k) is None]
    if missing:
        raise ConfigError(
            f"config.json ({model_type}) is missing required field(s): {', '.join(missing)}"
        )
    ints = {}
    for k in _REQUIRED_INT_FIELDS:
        v = raw[k]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"config field {k} must be a positive integer, got {v!r}")
        ints[k] = v
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    num_layers = ints["num_hidden_layers"]

    indexer_types = derive_indexer_types(
        num_layers,
        pattern=raw.get("index_topk_pattern"),
        freq=raw.get("index_topk_freq"),
        offset=raw.get("index_skip_topk_offset"),
        explicit=raw.get("indexer_types"),
    )
    explicit = raw.get("indexer_types")
    if explicit is not None and tuple(explicit) != indexer_types:
        raise ConfigError(
            "config.json's indexer_types list disagrees with its index_topk_pattern / "
            "index_topk_freq / index_skip_topk_offset; remove one of them"
        )

    first_k_dense = int(raw.get("first_k_dense_replace", 0))
    mlp_types_raw = raw.get("mlp_layer_types")
    if mlp_types_raw is not None:
        if len(mlp_types_raw) != num_layers or set(mlp_types_raw) - {"dense", "sparse"}:
            raise ConfigError(
                f"mlp_layer_types must list 'dense'/'sparse' for each of the {num_layers} layers"
            )
        mlp_types = tuple(mlp_types_raw)
    else:
        mlp_types = tuple("dense" if i < first_k_dense else "sparse" for i in range(num_layers))

    n_group = int(raw.get("n_group") or 1)
    topk_group = int(raw.get("topk_group") or 1)
    e = ints["n_routed_experts"]
    if e % n_group:
        raise ConfigError(f"n_routed_experts={e} is not divisible by n_group={n_group}")
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    if ints["num_experts_per_tok"] > (e // n_group) * topk_group:
        raise ConfigError(
            f"num_experts_per_tok={ints['num_experts_per_tok']} exceeds the experts in "
            f"topk_group={topk_group} groups of {e // n_group}"
        )
    if ints["qk_rope_head_dim"] % 2 or ints["qk_rope_head_dim"] > ints["index_head_dim"]:
        raise ConfigError(
            f"qk_rope_head_dim={ints['qk_rope_head_dim']} must be even and <= "
            f"index_head_dim={ints['index_head_dim']}"
        )
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

    nextn = raw.get("num_nextn_predict_layers") or 0
    if isinstance(nextn, bool) or not isinstance(nextn, int) or nextn < 0:
        raise ConfigError(f"num_nextn_predict_layers must be an integer >= 0, got {nextn!r}")

    block = None
    quant = raw.get("quantization_config")
    if isinstance(quant, Mapping) and quant.get("weight_block_size"):
        bs = quant["weight_block_size"]
        block = (int(bs[0]), int(bs[1]))

    return ModelConfig(
        model_type=model_type,
        architecture=architecture,
        **ints,
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=first_k_dense,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope_from(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        indexer_types=indexer_types,
        mlp_layer_types=mlp_types,  # type: ignore[arg-type]
        indexer_rope_interleave=indexer_interleave,
        weight_block_size=block,
        num_nextn_predict_layers=nextn,
    )


CPSplitMode = Literal["in_seq", "round_robin"]
# How a CP step's attention reads the KV: every rank through the request's full view, or
# each rank over the pages it owns (`cpkv_jax.owner_attention`, shared KV only).
CPAttention = Literal["full-view", "owner"]


@dataclasses.dataclass(frozen=True)
class CPConfig:
    """Context-parallel prefill settings (SPEC S1).

    `shared_kv` stores each KV page only on its owner rank (`p % cp_size`); off, every
    rank keeps the whole (replicated) pool - the baseline (SPEC S1.4). `attention`:
    `full-view` materializes each request's whole KV on every rank for the indexer and
    sparse attention; `owner` (shared KV only) scores and attends where the pages live
    (`cpkv_jax.owner_attention`).
    """

    cp_size: int = 1
    shared_kv: bool = False
    split_mode: CPSplitMode = "in_seq"
    page_size: int = 64
    chunked_prefill_size: int | None = None
    attention: CPAttention = "full-view"

    def validate(self, model: ModelConfig | None = None, device_count: int | None = None) -> None:
        """Startup checks (SPEC S1.6); raise `ConfigError` naming the option and the fix."""
        check_cp_config(self, model, device_count)


def check_cp_config(
    cp: CPConfig, model: ModelConfig | None = None, device_count: int | None = None
) -> None:
    if cp.cp_size < 1:
        raise ConfigError(f"`cp_size` must be >= 1, got {cp.cp_size}")
    if cp.page_size < 1:
        raise ConfigError(f"`page_size` must be >= 1, got {cp.page_size}")
    if cp.split_mode not in ("in_seq", "round_robin"):
        raise ConfigError(f"`split_mode` must be 'in_seq' or 'round_robin', got {cp.split_mode!r}")
    if cp.chunked_prefill_size is not None and cp.chunked_prefill_size < cp.page_size:
        raise ConfigError(
            f"`chunked_prefill_size` {cp.chunked_prefill_size} is smaller than one page "
            f"({cp.page_size} tokens): chunks are floored to whole pages; use >= {cp.page_size}"
        )
    if device_count is not None and (cp.cp_size > device_count or device_count % cp.cp_size):
        raise ConfigError(
            f"`cp_size` {cp.cp_size} must divide the {device_count} available devices"
        )
    if cp.attention not in ("full-view", "owner"):
        raise ConfigError(f"`attention` must be 'full-view' or 'owner', got {cp.attention!r}")
    if cp.attention == "owner" and not cp.shared_kv:
        raise ConfigError(
            "owner attention needs page-owned KV (`shared_kv`): with replicated pools every "
            "rank already holds every page; enable shared KV or use full-view attention"
        )
    if cp.shared_kv:
        _check_shared_kv(cp, model)
    if cp.split_mode == "round_robin" and cp.cp_size > 1:
        raise ConfigError(
            "`split_mode` round_robin is not implemented yet; use in_seq (zigzag) split"
        )


def _check_shared_kv(cp: CPConfig, model: ModelConfig | None) -> None:
    if cp.cp_size == 1:
        raise ConfigError(
            "`shared_kv` needs `cp_size` > 1 (with one rank there is nothing to share)"
        )
    if cp.split_mode != "in_seq":
        raise ConfigError(
            f"`shared_kv` requires `split_mode` in_seq, got {cp.split_mode!r} "
            "(round-robin / interleave split is not wired for shared KV)"
        )
    if model is not None and model.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"`shared_kv` needs an NSA model ({', '.join(SUPPORTED_MODEL_TYPES)}), "
            f"got model_type {model.model_type!r}"
        )
