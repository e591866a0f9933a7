"""FP8 weights on device and expert parallelism on the CP mesh (issue 22).

The checkpoint is the FP8 tiny one (block-quantized `float8_e4m3fn` + `weight_scale_inv`,
16 routed experts, sharded files + index json), loaded straight into the 8-rank mesh
with the experts split 2 per rank. References are the single-device prefill of the same
checkpoint (`support.cp_reference.reference`).

Tolerances:
- FP8 kept vs dequantized at load: bitwise. Both dequantize with the same float32
  multiply (`fp8.dequantize` in the step, `fp8.dequantize_np` at load), so the weights the
  matmuls see are the same bits.
- CP8 + EP8 vs one device, batch-invariant numerics: bitwise (every token-wise matmul has
  the same shapes wherever the token is computed; the EP dispatch only moves rows and its
  reduce adds zeros). Default numerics: logits within 1e-5 (XLA:CPU blocks its matmuls by
  row count, so rank-sized and prompt-sized row sets round differently in the last bits;
  see test_cp_prefill.py), greedy tokens equal.
"""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest
from support.cp_reference import P, reference

from cpkv_jax.config import CPConfig, ModelConfig
from cpkv_jax.cp_prefill import CPPrefillRunner, pages_per_rank_for
from cpkv_jax.errors import ConfigError
from cpkv_jax.mesh import CP_AXIS, make_cp_mesh
from cpkv_jax.model import expert_parallel as ep
from cpkv_jax.model import moe
from cpkv_jax.model.moe import EXPERT_PROJS
from cpkv_jax.model.weights import LoadStats, _checkpoint_tensors, load_model
from cpkv_jax.tools.tiny_config import tiny_config_dict

# Among the longest files of the suite: scheduled first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=50)  # on 2 workers, 2026-12-05

CP = 8
EXPERTS = 16
CHUNK = 2 * P  # several chunks: the KV of earlier chunks is read back through EP layers
PROMPT = 4 * P + 3


def _load(arch: str, tiny_checkpoints):
    """(path, cfg, model kept FP8 on one device, model placed on the mesh with EP, stats)."""
    path = tiny_checkpoints(arch, fp8=True, n_routed_experts=EXPERTS)
    cfg, single = load_model(path, progress=False)
    stats = LoadStats()
    _, placed = load_model(
        path, progress=False, mesh=make_cp_mesh(CP), expert_axis=CP_AXIS, stats=stats
    )
    return path, cfg, single, placed, stats


@pytest.fixture(scope="module", params=["glm_moe_dsa", "deepseek_v32"])
def fp8_models(request, tiny_checkpoints):
    return _load(request.param, tiny_checkpoints)


@pytest.fixture(scope="module")
def glm_fp8(tiny_checkpoints):
    return _load("glm_moe_dsa", tiny_checkpoints)


def _prompt(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 300, PROMPT).astype(np.int32)


def _runner(cfg, model, *, shared=True, dispatch="allgather", invariant=True, factor=None):
    cp = CPConfig(cp_size=CP, shared_kv=shared, page_size=P)
    return CPPrefillRunner(
        cfg,
        model,
        make_cp_mesh(CP),
        cp,
        pages_per_rank=pages_per_rank_for(PROMPT, P, cp),
        index_k_dtype="float32",
        attn_form="absorbed" if invariant else "expanded",
        batch_invariant=invariant,
        expert_parallel=ep.EPSpec(CP_AXIS, CP, dispatch, factor),
    )


def test_fp8_kept_equals_dequantized_at_load(fp8_models):
    path, cfg, single, _, _ = fp8_models
    layer = single.model.layers[cfg.first_k_dense_replace]
    assert str(layer.self_attn.q_b_proj.weight.dtype) == "float8_e4m3fn"
    assert str(layer.mlp.experts.down_proj.dtype) == "float8_e4m3fn"
    assert str(single.model.embed_tokens.weight.dtype) == "float32"  # not quantized
    _, dequantized = load_model(path, progress=False, fp8="dequantize")
    assert str(dequantized.model.layers[2].mlp.experts.down_proj.dtype) == "float32"
    ids = _prompt(1)
    a, _ = reference(cfg, single, ids)
    b, _ = reference(cfg, dequantized, ids)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "replicated"])
def test_cp8_ep8_bitwise_with_batch_invariant(fp8_models, shared):
    _, cfg, single, placed, _ = fp8_models
    ids = _prompt()
    want, _ = reference(cfg, single, ids, invariant=True)
    runner = _runner(cfg, placed, shared=shared)
    got = runner.prefill([ids], CHUNK).last_logits[0]
    np.testing.assert_array_equal(got, want)


def test_cp8_ep8_all_to_all_dispatch_and_default_numerics(glm_fp8):
    _, cfg, single, placed, _ = glm_fp8
    ids = _prompt(2)
    want_inv, _ = reference(cfg, single, ids, invariant=True)
    got = _runner(cfg, placed, dispatch="all_to_all").prefill([ids], CHUNK).last_logits[0]
    np.testing.assert_array_equal(got, want_inv)

    want, _ = reference(cfg, single, ids)
    got = _runner(cfg, placed, invariant=False).prefill([ids], CHUNK).last_logits[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got.argmax() == want.argmax()


@pytest.mark.parametrize("dispatch", ["allgather", "all_to_all"])
def test_cp8_ep8_on_the_tiled_expert_path(glm_fp8, monkeypatch, dispatch):
    """Each rank's experts run tile by tile (`moe.RoutedExperts._tiled_ffn`, forced with a
    dense-expansion bound of 0 and 8-row tiles) on the rows the dispatch brought it: the
    one-device `ragged_dot` reference's logits within 1e-5 (float32: the experts' dots
    are blocked differently) and its argmax."""
    _, cfg, single, placed, _ = glm_fp8
    ids = _prompt(3)
    want, _ = reference(cfg, single, ids)
    jax.clear_caches()  # the bound is read while tracing
    monkeypatch.setattr(moe, "DENSE_EXPANSION_BYTES", 0)
    monkeypatch.setattr(moe, "TILE_ROWS", 8)
    got = _runner(cfg, placed, dispatch=dispatch, invariant=False).prefill([ids], CHUNK)
    jax.clear_caches()
    np.testing.assert_allclose(got.last_logits[0], want, rtol=1e-5, atol=1e-5)
    assert got.last_logits[0].argmax() == want.argmax()


def test_each_device_holds_one_eighth_of_the_experts(fp8_models):
    path, cfg, _, placed, stats = fp8_models
    for layer in placed.model.layers[cfg.first_k_dense_replace :]:
        experts = layer.mlp.experts
        for name in (*EXPERT_PROJS, *(p + "_scale_inv" for p in EXPERT_PROJS)):
            leaf = getattr(experts, name)[...]
            shards = leaf.addressable_shards
            assert len(shards) == CP
            assert {s.data.shape[0] for s in shards} == {EXPERTS // CP}
            assert all(s.data.nbytes * CP == leaf.nbytes for s in shards), name
            # Shard r holds experts [2r, 2r + 2): the slices tile the expert axis.
            assert sorted(s.index[0].start for s in shards) == list(range(0, EXPERTS, 2))
        # Attention stays replicated: every device holds all of it.
        q = layer.self_attn.q_b_proj.weight[...]
        assert all(s.data.nbytes == q.nbytes for s in q.addressable_shards)
    # One process, all 8 devices: every trunk tensor read exactly once, nothing twice,
    # and nothing of the MTP layer (`model.layers.{N}`), which this load does not build.
    mtp = f"model.layers.{cfg.num_hidden_layers}."
    tensors = {n: t for n, t in _checkpoint_tensors(path).items() if not n.startswith(mtp)}
    assert len(tensors) < len(_checkpoint_tensors(path))
    assert stats.bytes_read == stats.planned_bytes == sum(t.end - t.begin for t in tensors.values())
    assert stats.tensors_read == len(tensors)


def test_ep_needs_experts_divisible_by_cp():
    cfg = ModelConfig.from_dict({**tiny_config_dict("glm_moe_dsa"), "n_routed_experts": 12})
    with pytest.raises(ConfigError, match=r"`n_routed_experts` \(12\) divisible by `cp_size`"):
        ep.check_divisible(cfg.n_routed_experts, CP)


def test_capacity_below_worst_case_is_not_exact():
    assert ep.EPSpec(CP_AXIS, CP, "all_to_all").exact
    assert ep.EPSpec(CP_AXIS, CP, "all_to_all", capacity_factor=CP).exact
    small = ep.EPSpec(CP_AXIS, CP, "all_to_all", capacity_factor=2.0)
    assert not small.exact and small.capacity(64) == 16
    assert ep.EPSpec(CP_AXIS, CP).capacity(64) == 64
    with pytest.raises(ValueError, match="ep_capacity_factor"):
        ep.EPSpec(CP_AXIS, CP, "all_to_all", capacity_factor=0.0)


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32"])
def test_a_drafting_cp8_ep8_runner_writes_the_mtp_kv_of_one_device(tiny_checkpoints, arch):
    """Issue 39 item 3: a PD prefill server for speculative decoding runs the MTP layer
    over each chunk it prefills (`CPPrefillRunner(mtp=True)`). On CP8 shared KV with EP8,
    FP8 kept and chunked, batch-invariant, for both architectures: the MTP layer's KV
    (latent and index K, one more layer of the pool) at every prompt position but the
    last, the trunk's KV, the
    last logits and the last hidden state sent to the decode server are bitwise those of
    a one-device runner (cp 1, which the unified server uses and the speculative engine
    tests check against the whole-prompt engine's drafts). The last position's MTP KV is
    left unwritten: it needs the first output token."""
    path = tiny_checkpoints(arch, fp8=True, n_routed_experts=EXPERTS)
    cfg, single = load_model(path, progress=False, mtp=True)
    _, placed = load_model(
        path, progress=False, mesh=make_cp_mesh(CP), expert_axis=CP_AXIS, mtp=True
    )
    ids = _prompt(3)
    n = ids.size
    got, want = {}, {}
    for cp, model, out in ((CP, placed, got), (1, single, want)):
        config = CPConfig(cp_size=cp, shared_kv=cp > 1, page_size=P)
        runner = CPPrefillRunner(
            cfg,
            model,
            make_cp_mesh(cp),
            config,
            pages_per_rank=pages_per_rank_for(PROMPT, P, config),
            index_k_dtype="fp8_e4m3",
            batch_invariant=True,
            expert_parallel=ep.EPSpec(CP_AXIS, cp) if cp > 1 else None,
            mtp=True,
        )
        result = runner.prefill([ids], CHUNK)
        out["view"] = jax.tree.map(np.asarray, runner.full_view(result.tables[0]))
        out["logits"], out["hidden"] = result.last_logits[0], runner.last_hidden[0]
    trunk = cfg.num_hidden_layers
    assert len(got["view"].latent) == trunk + 1  # the MTP layer's KV: one more layer
    mtp_latent = got["view"].latent[trunk]
    assert mtp_latent[: n - 1].any(axis=-1).all()  # written at every position...
    assert not mtp_latent[n - 1].any()  # ...but the last
    chex.assert_trees_all_equal(got["view"], want["view"])
    np.testing.assert_array_equal(got["logits"], want["logits"])
    np.testing.assert_array_equal(got["hidden"], want["hidden"])
    assert got["hidden"].shape == (cfg.hidden_size,)
