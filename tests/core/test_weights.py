"""HF safetensors and orbax checkpoint I/O: exact round trips, FP8 dequant, error paths."""

import json
import logging
import math
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import CheckpointError
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.model.weights import (
    INDEX_FILE,
    abstract_model,
    hf_state_dict,
    hf_tensor_names,
    load_hf_weights,
    load_model,
    restore_state,
    save_hf_weights,
    save_state,
)
from cpkv_jax.tools.make_tiny_checkpoint import main as make_tiny_main
from cpkv_jax.tools.make_tiny_checkpoint import random_tiny_model
from cpkv_jax.tools.tiny_config import tiny_config_dict

# glm in bfloat16 exercises the bf16 read path; deepseek in float32 the plain one.
PARAM_DTYPES = {"glm_moe_dsa": jnp.bfloat16, "deepseek_v32": jnp.float32}


def _cfg(arch: str, **extra) -> ModelConfig:
    return ModelConfig.from_dict({**tiny_config_dict(arch), **extra})


@pytest.fixture(scope="module", params=list(PARAM_DTYPES))
def arch_model(request) -> tuple[str, CausalLM]:
    arch = request.param
    return arch, random_tiny_model(_cfg(arch), seed=7, param_dtype=PARAM_DTYPES[arch])


@pytest.fixture(scope="module")
def glm_model() -> CausalLM:
    return random_tiny_model(_cfg("glm_moe_dsa"), seed=11)


def _flat(model: CausalLM) -> dict:
    return {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(nnx.state(model))}


def assert_models_identical(a: CausalLM, b: CausalLM) -> None:
    """Every leaf of `nnx.state` equal bit for bit, with the same dtype and shape."""
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for path, x in fa.items():
        y = fb[path]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), path
        assert x.tobytes() == y.tobytes(), f"{path} differs"


def _write(tensors: dict[str, np.ndarray], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ---- names ---------------------------------------------------------------------------


def test_hf_tensor_names_cover_model_with_per_expert_names():
    cfg = _cfg("glm_moe_dsa")
    names = hf_tensor_names(cfg)
    assert names["model.layers.2.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert names["model.layers.1.mlp.experts.0.gate_proj.weight"] == (32, 64)
    assert names["model.layers.0.self_attn.indexer.k_norm.bias"] == (32,)
    assert names["model.layers.1.mlp.gate.e_score_correction_bias"] == (8,)
    assert "model.layers.2.self_attn.indexer.wk.weight" not in names  # shared layer
    assert "model.layers.2.mlp.experts.gate_proj" not in names  # stacked leaf name
    assert not any(n.startswith("model.layers.3.") for n in names)  # 3 layers
    # Element count: the per-expert names add up to the model's parameter count.
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    model_params = sum(math.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(abstract)))
    assert sum(math.prod(s) for s in names.values()) == model_params


# ---- safetensors round trips ---------------------------------------------------------


def test_single_file_round_trip_exact(arch_model, tmp_path):
    arch, model = arch_model
    (path,) = save_hf_weights(model, tmp_path)
    assert path.name == "model.safetensors" and not (tmp_path / INDEX_FILE).exists()
    loaded = load_hf_weights(model.cfg, tmp_path, param_dtype=PARAM_DTYPES[arch], progress=False)
    assert_models_identical(model, loaded)


def test_sharded_round_trip_into_existing_model(glm_model, tmp_path):
    paths = save_hf_weights(glm_model, tmp_path, max_shard_bytes=60_000)
    assert len(paths) > 3
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(hf_tensor_names(glm_model.cfg))
    assert {p.name for p in paths} == set(index["weight_map"].values())
    target = random_tiny_model(glm_model.cfg, seed=99)  # different weights, overwritten
    out = load_hf_weights(target, tmp_path, progress=False)
    assert out is target
    assert_models_identical(glm_model, target)
    # Re-saving as one file removes the shards and the index.
    save_hf_weights(glm_model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


# ---- orbax ---------------------------------------------------------------------------


def test_orbax_round_trip_exact(arch_model, tmp_path):
    arch, model = arch_model
    ckpt = save_state(model, tmp_path / "state")
    restored = restore_state(model.cfg, ckpt, param_dtype=PARAM_DTYPES[arch])
    assert_models_identical(model, restored)
    with pytest.raises(CheckpointError, match="already exists"):
        save_state(model, ckpt)
    save_state(model, ckpt, force=True)
    abstract = nnx.eval_shape(
        lambda: CausalLM(model.cfg, rngs=nnx.Rngs(0), param_dtype=PARAM_DTYPES[arch])
    )
    assert_models_identical(model, restore_state(abstract, ckpt))


def test_orbax_restore_missing_dir(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        restore_state(_cfg("glm_moe_dsa"), tmp_path / "nope")


# ---- FP8 block dequantization --------------------------------------------------------


def _quantize_blocks(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-style per-block fp8: `q = w / s`, `s = amax / 448` per `[B0, B1]` block."""
    (o, i), (b0, b1) = w.shape, block
    no, ni = -(-o // b0), -(-i // b1)
    padded = np.zeros((no * b0, ni * b1), np.float32)
    padded[:o, :i] = w
    amax = np.abs(padded.reshape(no, b0, ni, b1)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    expanded = np.repeat(np.repeat(scale, b0, 0), b1, 1)[:o, :i]
    return (w / expanded).astype(ml_dtypes.float8_e4m3fn), scale


def test_fp8_block_dequant_matches_float64(glm_model, tmp_path):
    block = (16, 32)  # kv_a_proj [40, 64] and q_b_proj [96, 48] are not multiples
    cfg = _cfg(
        "glm_moe_dsa", quantization_config={"quant_method": "fp8", "weight_block_size": list(block)}
    )
    assert cfg.weight_block_size == block
    tensors = hf_state_dict(glm_model)
    expected = dict(tensors)
    quantized = [
        n
        for n in tensors
        if n.endswith(("proj.weight", "_mqa.weight", ".wk.weight", ".wq_b.weight"))
    ]
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in quantized
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in quantized
    for name in quantized:
        q, scale = _quantize_blocks(tensors[name], block)
        tensors[name], tensors[name + "_scale_inv"] = q, scale
        rows, cols = q.shape
        ref = (
            q.astype(np.float64)
            * np.repeat(np.repeat(scale.astype(np.float64), block[0], 0), block[1], 1)[:rows, :cols]
        )
        expected[name] = ref.astype(np.float32)
        assert not np.array_equal(expected[name], hf_state_dict(glm_model)[name])  # really lossy
    path = _write(tensors, tmp_path)
    loaded = load_hf_weights(cfg, path, progress=False, strict=True, fp8="dequantize")
    got = hf_state_dict(loaded)
    assert got.keys() == expected.keys()
    for name, ref in expected.items():
        np.testing.assert_array_equal(got[name], ref, err_msg=name)

    # Kept FP8 (the default): the same bytes and scales on device, and the in-step
    # dequantization gives the same float32 weights bit for bit.
    kept = load_hf_weights(cfg, path, progress=False, strict=True)
    raw = hf_state_dict(kept)
    assert raw.keys() == tensors.keys()
    for name in quantized:
        assert raw[name].dtype == ml_dtypes.float8_e4m3fn, name
        np.testing.assert_array_equal(raw[name].view(np.uint8), tensors[name].view(np.uint8))
        np.testing.assert_array_equal(raw[name + "_scale_inv"], tensors[name + "_scale_inv"])
    layer = kept.model.layers[0].self_attn.kv_a_proj_with_mqa
    np.testing.assert_array_equal(
        np.asarray(layer.dense_weight(jnp.float32)),
        expected["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"],
    )
    experts = kept.model.layers[2].mlp.experts
    np.testing.assert_array_equal(
        np.asarray(experts._weight("down_proj"))[3].T,
        expected["model.layers.2.mlp.experts.3.down_proj.weight"],
    )


def test_fp8_without_scale_or_with_bad_scale_shape(glm_model, tmp_path):
    cfg = _cfg("glm_moe_dsa", quantization_config={"weight_block_size": [16, 32]})
    name = "model.layers.1.self_attn.q_b_proj.weight"  # [96, 48] -> scale [6, 2]
    tensors = hf_state_dict(glm_model)
    q, scale = _quantize_blocks(tensors[name], (16, 32))
    tensors[name] = q
    with pytest.raises(CheckpointError, match=rf"{name} is F8_E4M3 but .* no {name}_scale_inv"):
        load_hf_weights(cfg, _write(tensors, tmp_path / "a"), progress=False)
    tensors[name + "_scale_inv"] = scale[:, :1]
    with pytest.raises(
        CheckpointError, match=r"q_b_proj.weight_scale_inv: expected shape \(6, 2\)"
    ):
        load_hf_weights(cfg, _write(tensors, tmp_path / "b"), progress=False)


# ---- errors and extra tensors --------------------------------------------------------


def test_missing_tensor_is_named(glm_model, tmp_path):
    tensors = hf_state_dict(glm_model)
    gone = ["model.layers.2.mlp.experts.5.up_proj.weight", "model.norm.weight"]
    for name in gone:
        del tensors[name]
    with pytest.raises(CheckpointError, match="missing 2 of the") as err:
        load_hf_weights(glm_model.cfg, _write(tensors, tmp_path), progress=False)
    assert all(name in str(err.value) for name in gone)


def test_wrong_shape_names_tensor_expected_and_got(glm_model, tmp_path):
    tensors = hf_state_dict(glm_model)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    tensors[name] = tensors[name][:, :31]
    with pytest.raises(CheckpointError, match=rf"{name}: expected \(128, 32\), got \(128, 31\)"):
        load_hf_weights(glm_model.cfg, _write(tensors, tmp_path), progress=False)


def test_mtp_layers_skipped_with_one_log_line(glm_model, tmp_path, caplog):
    tensors = hf_state_dict(glm_model)
    mtp = np.ones((64, 128), np.float32)
    m = f"model.layers.{glm_model.cfg.num_hidden_layers}"  # the MTP layer follows the last
    tensors[f"{m}.eh_proj.weight"] = mtp
    tensors[f"{m}.enorm.weight"] = np.ones(64, np.float32)
    tensors[f"{m}.mlp.experts.0.up_proj.weight"] = mtp.astype(ml_dtypes.float8_e4m3fn)
    tensors[f"{m}.mlp.experts.0.up_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)
    with caplog.at_level(logging.INFO, logger="cpkv_jax.model.weights"):
        loaded = load_hf_weights(
            glm_model.cfg, _write(tensors, tmp_path), progress=False, strict=True
        )
    skip_lines = [r for r in caplog.records if "MTP" in r.getMessage()]
    assert len(skip_lines) == 1 and "4 tensors" in skip_lines[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert_models_identical(glm_model, loaded)


def test_unexpected_tensor_warns_or_fails_when_strict(glm_model, tmp_path, caplog):
    tensors = hf_state_dict(glm_model)
    tensors["model.layers.0.self_attn.mystery.weight"] = np.ones(3, np.float32)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # harmless
    path = _write(tensors, tmp_path)
    with caplog.at_level(logging.WARNING, logger="cpkv_jax.model.weights"):
        load_hf_weights(glm_model.cfg, path, progress=False)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "mystery" in warning and "inv_freq" not in warning
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\).*mystery.*strict"):
        load_hf_weights(glm_model.cfg, path, progress=False, strict=True)


def test_file_level_errors(glm_model, tmp_path):
    cfg = glm_model.cfg
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_weights(cfg, tmp_path / "absent", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_weights(cfg, tmp_path / "empty", progress=False)

    sharded = tmp_path / "sharded"
    paths = save_hf_weights(glm_model, sharded, max_shard_bytes=200_000)
    paths[1].unlink()
    with pytest.raises(CheckpointError, match=rf"missing shard file.*{paths[1].name}"):
        load_hf_weights(cfg, sharded, progress=False)
    (sharded / INDEX_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_hf_weights(cfg, sharded, progress=False)
    (sharded / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        load_hf_weights(cfg, sharded, progress=False)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_hf_weights(cfg, broken, progress=False)


# ---- the tiny-checkpoint tool --------------------------------------------------------


def test_make_tiny_checkpoint_cli_loads_and_is_deterministic(tmp_path, capsys):
    args = ["--arch", "deepseek_v32", "--dtype", "bfloat16"]
    for name, seed in [("a", "3"), ("b", "3"), ("c", "4")]:
        assert make_tiny_main([str(tmp_path / name), *args, "--seed", seed]) == 0
    assert "deepseek_v32" in capsys.readouterr().out
    files = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    a_bytes = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a_bytes != (tmp_path / "c" / "model.safetensors").read_bytes()

    cfg, model = load_model(tmp_path / "a", dtype=jnp.bfloat16, progress=False, strict=True)
    assert cfg.model_type == "deepseek_v32" and model.cfg is cfg
    tensors = hf_state_dict(model)
    assert tensors["model.layers.0.self_attn.q_a_proj.weight"].dtype == ml_dtypes.bfloat16
    for name in ["model.norm.weight", "model.layers.1.self_attn.indexer.k_norm.weight"]:
        w = tensors[name]
        assert not np.allclose(w, 1.0) and abs(float(w.mean()) - 1.0) < 0.1, name
    assert np.abs(tensors["model.layers.1.self_attn.indexer.k_norm.bias"]).max() > 0
    tok_cfg = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"]) == (
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
    )


def test_fast_tracer_probes_change_no_leaf():
    """The abstract-model speed-up (`fast_tracer_probes`: flax probes `tracer.sharding`
    per parameter, and JAX 0.10 builds each swallowed error's message by walking the whole
    trace) leaves every shape and dtype as a plain `nnx.eval_shape`, and is undone."""
    from jax._src.interpreters import partial_eval as pe

    cfg = _cfg("deepseek_v32")
    original = pe.DynamicJaxprTracer._origin_msg
    plain = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    fast = abstract_model(cfg)

    def leaves(model):
        return [(p, v.shape, v.dtype) for p, v in nnx.to_flat_state(nnx.state(model))]

    assert leaves(fast) == leaves(plain)
    assert pe.DynamicJaxprTracer._origin_msg is original
