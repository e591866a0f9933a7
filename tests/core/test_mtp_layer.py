"""The MTP layer (issue 39 item 1, `cpkv_jax.model.mtp`) against a float64 NumPy forward
written from its definition (`numpy_reference.decoder_layer` for the block).

The trunk prefills a prompt into a pool of `mtp_config`'s layout; the MTP layer then
runs over positions `0 .. T-2`, fed the embeddings of tokens `1 .. T-1` and the trunk's
final hidden states at `0 .. T-2`, and writes its own KV into the same pages. Checked:
its logits (the trunk's LM head on `shared_head.norm`), its latent KV rows in the shared
pages, and that the trunk's own results are untouched by the larger pool.

Tolerance: float32 vs float64 through the trunk (3 layers) and the MTP block; the same
rtol / atol 1e-4 as the whole-model reference test (measured error ~1e-6 here). A
wrong wiring (hidden states one position off) moves the logits by O(0.1), checked below.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import support.numpy_reference as ref
from flax import nnx
from support.numpy_reference import f64, randomize_norms

from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import ConfigError
from cpkv_jax.kv_layout import KVLayout
from cpkv_jax.model.forward_batch import ForwardBatch
from cpkv_jax.model.kv_cache import SINGLE_DEVICE_KV_IO, init_pool
from cpkv_jax.model.mtp import MTPLayer, mtp_config
from cpkv_jax.model.rope import rope_cos_sin
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.model.weights import load_model
from cpkv_jax.model_configs import config_dir
from cpkv_jax.tools.make_tiny_checkpoint import random_tiny_model
from cpkv_jax.tools.tiny_config import tiny_config_dict

PAGE = 16
LENGTH = 40  # > index_topk (16): the MTP block's own indexer really selects
TOL = {"rtol": 1e-4, "atol": 1e-4}
MARGIN = 1e-4  # top-k boundaries this far apart in float64 (see test_model_reference)
ARCHS = ("glm_moe_dsa", "deepseek_v32")


def _batch(ids: np.ndarray, positions: np.ndarray, table: np.ndarray) -> ForwardBatch:
    slots = table[positions // PAGE] * PAGE + positions % PAGE
    return ForwardBatch(
        jnp.asarray(ids)[None],
        jnp.asarray(positions)[None],
        jnp.ones((1, len(ids)), bool),
        jnp.asarray(slots)[None],
        jnp.asarray(table)[None],
        jnp.asarray([len(ids)]),
    )


def _run(cfg: ModelConfig, model: CausalLM, mtp: MTPLayer, ids: np.ndarray, shift: int = 0):
    """Trunk prefill of `ids`, then the MTP layer over positions 0..T-2 (with the trunk's
    hidden states `shift` positions off, for the sensitivity check). Returns the trunk's
    logits, the MTP logits and the pool."""
    t = len(ids)
    table = np.arange(1, -(-t // PAGE) + 1)
    pool = init_pool(mtp_config(cfg), len(table) + 1, PAGE, jnp.float32, "float32")
    (gd_t, st_t), (gd_m, st_m) = nnx.split(model), nnx.split(mtp)
    trunk_batch = _batch(ids, np.arange(t), table)
    mtp_batch = _batch(ids[1:], np.arange(t - 1), table)

    @jax.jit
    def step(st_t, st_m, pool):
        trunk, layer = nnx.merge(gd_t, st_t), nnx.merge(gd_m, st_m)
        kw = {"kv_io": SINGLE_DEVICE_KV_IO, "index_k_dtype": "float32"}
        hidden, pool = trunk(trunk_batch, pool, **kw)
        cos, sin = rope_cos_sin(mtp_batch.positions, cfg.qk_rope_head_dim, cfg.rope)
        prev = jnp.roll(hidden, -shift, axis=1)[:, : t - 1]
        embeds = trunk.model.embed_tokens(mtp_batch.input_ids)
        out, pool = layer.predict(embeds, prev, mtp_batch, pool, cos, sin, **kw)
        return trunk.logits(hidden), trunk.logits(out), pool

    return step(st_t, st_m, pool), table


def _reference(cfg: ModelConfig, model: CausalLM, mtp: MTPLayer, ids: np.ndarray) -> dict:
    p, pm = ref.params_f64(model), ref.params_f64(mtp)
    trunk = ref.causal_lm(p, cfg, ids, dense=False)
    eps = cfg.rms_norm_eps
    pos = np.arange(len(ids) - 1)
    cos, sin = ref.rope_cos_sin(pos, cfg.qk_rope_head_dim, cfg.rope)
    e = p["model"]["embed_tokens"]["weight"][ids[1:]]
    x = ref.linear(
        np.concatenate(
            [
                ref.rms_norm(e, pm["enorm"]["weight"], eps),
                ref.rms_norm(trunk["hidden"][:-1], pm["hnorm"]["weight"], eps),
            ],
            axis=-1,
        ),
        pm["eh_proj"]["weight"],
    )
    out: dict = {"latent": [], "index": {}}
    x = ref.decoder_layer(
        pm, mtp_config(cfg), cfg.num_hidden_layers, x, pos, cos, sin, out, dense=False
    )
    x = ref.rms_norm(x, pm["shared_head"]["norm"]["weight"], eps)
    return {
        "trunk": trunk,
        "logits": ref.linear(x, ref.lm_head(p, cfg)),
        "latent": out["latent"][0],
        "index": out["index"][cfg.num_hidden_layers],
        "pos": pos,
    }


@pytest.fixture(scope="module", params=ARCHS)
def setup(request):
    cfg = ModelConfig.from_dict(tiny_config_dict(request.param), {"num_nextn_predict_layers": 1})
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    mtp = MTPLayer(cfg, rngs=nnx.Rngs(1), dtype=jnp.float32, param_dtype=jnp.float32)
    randomize_norms(model, np.random.default_rng(1))
    randomize_norms(mtp, np.random.default_rng(2))
    # Seed 6: no top-k boundary within MARGIN in any full layer (test_model_reference).
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, LENGTH)
    return cfg, model, mtp, ids, _reference(cfg, model, mtp, ids)


def test_mtp_logits_and_kv_match_the_reference(setup):
    cfg, model, mtp, ids, want = setup
    idx = want["index"]
    # The comparison is exact about selection only where float32 cannot flip it.
    assert ref.topk_margin(idx["scores"], idx["logits"], want["pos"], cfg.index_topk, MARGIN) == []
    assert cfg.index_topk < LENGTH - 1
    (trunk_logits, logits, pool), table = _run(cfg, model, mtp, ids)
    chex.assert_trees_all_close(f64(trunk_logits[0]), want["trunk"]["logits"], **TOL)
    chex.assert_trees_all_close(f64(logits[0]), want["logits"], **TOL)
    # The MTP block's latent went into its own leaf of the shared pages (layer N).
    n = cfg.num_hidden_layers
    assert len(pool.latent) == n + 1
    pos = want["pos"]
    rows = f64(pool.latent[n])[table[pos // PAGE], pos % PAGE]
    chex.assert_trees_all_close(rows, want["latent"], **TOL)
    # ... and its index K into the last index leaf (the trunk's stay where they were).
    assert len(pool.index_k) == len(cfg.full_indexer_layers) + 1
    # The library stores Hadamard-rotated keys: compare Gram matrices (rotation-free), as
    # test_model_reference does.
    keys = f64(pool.index_k[-1])[table[pos // PAGE], pos % PAGE]
    chex.assert_trees_all_close(keys @ keys.T, idx["k"] @ idx["k"].T, rtol=1e-4, atol=1e-3)


def test_hidden_states_one_position_off_are_caught(setup):
    cfg, model, mtp, ids, want = setup
    (_, logits, _), _ = _run(cfg, model, mtp, ids, shift=1)
    assert np.abs(f64(logits[0]) - want["logits"]).max() > 100 * TOL["atol"]


def test_mtp_config_appends_a_full_moe_layer_and_its_kv():
    cfg = ModelConfig.from_pretrained(config_dir("glm-5"), {"num_nextn_predict_layers": 1})
    mcfg = mtp_config(cfg)
    assert mcfg.num_hidden_layers == 79 and mcfg.indexer_types[-1] == "full"
    assert mcfg.mlp_layer_types[-1] == "sparse" and mcfg.indexer_types[:-1] == cfg.indexer_types
    # GLM-5's KV page with the MTP layer's rows: one more layer of latent + index K + scale.
    kv = KVLayout.from_model(mcfg, 64, jnp.bfloat16, "fp8_e4m3")
    assert kv.bytes_per_page == 64 * 79 * (1152 + 128 + 4)
    trunk = KVLayout.from_model(cfg, 64, jnp.bfloat16, "fp8_e4m3")
    assert kv.bytes_per_page - trunk.bytes_per_page == 64 * (1152 + 128 + 4)
    with pytest.raises(ConfigError, match="ships no MTP layer"):
        mtp_config(ModelConfig.from_pretrained(config_dir("glm-5")))
    with pytest.raises(ConfigError, match="only one MTP layer"):
        mtp_config(ModelConfig.from_dict(tiny_config_dict(), {"num_nextn_predict_layers": 2}))
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        ModelConfig.from_dict(tiny_config_dict(), {"num_nextn_predict_layers": -1})


def test_the_tiny_checkpoint_ships_an_mtp_layer_the_loader_reads_on_request(tiny_checkpoints):
    """Item 1: the tiny checkpoints carry an MTP layer (with the embedding and LM head
    copies the released checkpoints repeat in it); a load skips it unless asked, and
    `mtp=True` loads exactly the weights written, leaving the trunk's unchanged."""
    from safetensors import safe_open

    path = tiny_checkpoints()
    with safe_open(str(path / "model.safetensors"), "numpy") as f:
        names = set(f.keys())
    cfg, trunk = load_model(path)
    n = cfg.num_hidden_layers
    assert cfg.num_nextn_predict_layers == 1 and trunk.mtp is None
    assert {
        f"model.layers.{n}.{x}" for x in ("eh_proj.weight", "enorm.weight", "hnorm.weight")
    } <= names
    assert f"model.layers.{n}.shared_head.head.weight" in names
    assert f"model.layers.{n}.embed_tokens.weight" in names
    _, model = load_model(path, mtp=True)
    want = random_tiny_model(cfg, seed=0, mtp=True)  # what make_tiny_checkpoint wrote
    chex.assert_trees_all_equal(
        nnx.to_pure_dict(nnx.state(model.mtp)), nnx.to_pure_dict(nnx.state(want.mtp))
    )
    # The trunk is the same with or without the MTP layer.
    chex.assert_trees_all_equal(
        nnx.to_pure_dict(nnx.state(model.model.layers[0])),
        nnx.to_pure_dict(nnx.state(trunk.model.layers[0])),
    )
    chex.assert_trees_all_equal(model.lm_head.weight[...], trunk.lm_head.weight[...])


def test_the_fp8_checkpoints_mtp_layer_stays_fp8(tiny_checkpoints):
    """The FP8 checkpoint's MTP layer loads as FP8 + block scales like the trunk's layers
    (`fp8="keep"`), the routed experts included."""
    _, model = load_model(tiny_checkpoints(fp8=True), mtp=True)
    experts = model.mtp.mlp.experts
    assert experts.gate_proj.dtype == jnp.float8_e4m3fn
    assert model.mtp.self_attn.q_a_proj.weight.dtype == jnp.float8_e4m3fn


def test_glm5_fp8_mtp_layer_splits_its_experts_like_the_trunk():
    """At real size: GLM-5-FP8's MTP layer adds one MoE layer's weights, its routed experts
    split over an EP8 mesh like the trunk's (1/8 per device), the rest replicated."""
    from jax.sharding import AbstractMesh

    from cpkv_jax.mesh import CP_AXIS
    from cpkv_jax.model.expert_parallel import bytes_per_device, param_shardings
    from cpkv_jax.model.weights import abstract_model

    cfg = ModelConfig.from_pretrained(config_dir("glm-5"), {"num_nextn_predict_layers": 1})
    mesh = AbstractMesh((8,), (CP_AXIS,))
    per_device = {}
    for mtp in (False, True):
        state = nnx.state(
            abstract_model(cfg, jnp.bfloat16, jnp.bfloat16, fp8_block=(128, 128), mtp=mtp)
        )
        per_device[mtp] = bytes_per_device(state, param_shardings(state, mesh, CP_AXIS))
    extra = {k: per_device[True][k] - per_device[False][k] for k in per_device[True]}
    # One MoE layer of the trunk's 75: its experts' share per device.
    moe_layers = cfg.mlp_layer_types.count("sparse")
    assert extra["routed_experts"] * moe_layers == per_device[False]["routed_experts"]
    # The rest (attention, indexer, shared expert, norms, eh_proj) is replicated: under 2 GB.
    assert 0 < extra["other"] < 2e9
