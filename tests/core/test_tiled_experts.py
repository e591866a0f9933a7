"""The routed experts' tiled path (`RoutedExperts._tiled_ffn`): what `ragged_dot` gives,
without its dense expansion (every row against every local expert, which at GLM-5 dims
took 206 GB for a 4K-token chunk on one device). Random rows and group sizes with empty
experts, padding rows past the groups, tiles smaller than a group and partial tiles;
float32 and FP8 weights; and a whole model run on the tiled path against the default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpkv_jax.config import ModelConfig
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.model import moe
from cpkv_jax.model.fp8 import SCALE_SUFFIX, quantize_np
from cpkv_jax.model.weights import load_model
from cpkv_jax.tools.tiny_config import tiny_config_dict

BLOCK = (16, 16)  # several FP8 blocks per tiny expert matrix (64 x 32)


def make_experts(fp8: bool) -> moe.RoutedExperts:
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    experts = moe.RoutedExperts(cfg, rngs=nnx.Rngs(7), dtype=jnp.float32, param_dtype=jnp.float32)
    if fp8:
        dense = {p: np.asarray(getattr(experts, p)[...]) for p in moe.EXPERT_PROJS}
        experts.to_fp8(BLOCK)
        for proj, w in dense.items():
            q, scale = quantize_np(w, BLOCK)
            setattr(experts, proj, nnx.Param(jnp.asarray(q)))
            setattr(experts, proj + SCALE_SUFFIX, nnx.Param(jnp.asarray(scale)))
    return experts


# Sizes per expert (8 local experts): empty experts, one expert with most rows, and rows
# past the groups (padding, which `ragged_dot` leaves at 0).
SIZES = [(0, 7, 13, 0, 1, 9, 0, 5), (40, 0, 0, 0, 0, 0, 0, 0), (0,) * 7 + (3,)]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tile", [4, 256])  # groups over several tiles; one tile for all
def test_tiled_experts_give_ragged_dots_rows(monkeypatch, fp8, tile):
    monkeypatch.setattr(moe, "TILE_ROWS", tile)
    experts = make_experts(fp8)
    rng = np.random.default_rng(11)
    for sizes in SIZES:
        m = 40
        rows = jnp.asarray(rng.standard_normal((m, 64)), jnp.float32)
        group = jnp.asarray(sizes, jnp.int32)
        want = np.asarray(experts._ffn(rows, rows, group))  # small: ragged_dot
        got = np.asarray(jax.jit(experts._tiled_ffn)(rows, rows, group))
        used = sum(sizes)
        # float32 dots of the same products in another blocking: a few ulps apart
        np.testing.assert_allclose(got[:used], want[:used], rtol=2e-5, atol=2e-6)
        np.testing.assert_array_equal(got[used:], 0.0)
        np.testing.assert_array_equal(want[used:], 0.0)


def test_the_dense_expansion_bound_picks_the_path(monkeypatch):
    """Past `DENSE_EXPANSION_BYTES` (rows x experts x max(hidden, intermediate) x 4 B) the
    experts run tiled; at or under it, `ragged_dot`."""
    experts = make_experts(False)
    taken = []
    real = experts._tiled_ffn
    monkeypatch.setattr(experts, "_tiled_ffn", lambda *a: taken.append(1) or real(*a))
    rows = jnp.ones((10, 64), jnp.float32)
    sizes = jnp.asarray([10] + [0] * 7, jnp.int32)
    monkeypatch.setattr(moe, "DENSE_EXPANSION_BYTES", 10 * 8 * 64 * 4)
    experts._ffn(rows, rows, sizes)
    assert not taken
    monkeypatch.setattr(moe, "DENSE_EXPANSION_BYTES", 10 * 8 * 64 * 4 - 1)
    experts._ffn(rows, rows, sizes)
    assert taken


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32"])
def test_a_model_on_the_tiled_path_generates_the_default_paths_tokens(
    monkeypatch, tiny_checkpoints, arch
):
    """The tiny FP8 checkpoint, prefill and decode, every MoE layer tiled (bound 0, tiles
    of 8 rows) vs `ragged_dot`: the same greedy tokens, log-probs within 1e-5 (float32,
    the blocking of the experts' dots differs)."""
    cfg, model = load_model(tiny_checkpoints(arch, fp8=True), progress=False)
    prompt = np.random.default_rng(5).integers(3, cfg.vocab_size, 45).tolist()

    def run():
        jax.clear_caches()  # the bound is read while tracing: no step traced before
        return ReferenceGenerator(cfg, model, page_size=16).generate(prompt, 12, ignore_eos=True)

    want = run()
    tiled = []
    real = moe.RoutedExperts._tiled_ffn
    monkeypatch.setattr(moe, "DENSE_EXPANSION_BYTES", 0)
    monkeypatch.setattr(moe, "TILE_ROWS", 8)
    monkeypatch.setattr(
        moe.RoutedExperts, "_tiled_ffn", lambda self, *a: tiled.append(1) or real(self, *a)
    )
    got = run()
    jax.clear_caches()  # nothing traced on the tiled path outlives the test
    assert tiled, "the tiled path never ran"
    assert got.output_ids == want.output_ids
    np.testing.assert_allclose(got.output_logprobs, want.output_logprobs, atol=1e-5)
