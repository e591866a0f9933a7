"""Norms, rope/YaRN, dense MLP, MoE router, routed experts and the MoE block against the
float64 NumPy oracle in `numpy_reference.py`, on fresh random inputs.

Tolerances: the library computes in float32 and the oracle in float64 from the same
float32 inputs, so the gap is float32 rounding of short reductions (~1e-6 relative);
rtol/atol 1e-5 leaves ~10x headroom and is still far below any wiring error (O(1)).

Each check runs jitted (`chex.variants(with_jit=True)`), as every served path runs the
model; the eager (op by op) variants took 310 s of the suite's worker time on 2026-12-06
and cover no path that runs eagerly.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import support.numpy_reference as ref
from absl.testing import parameterized
from flax import nnx
from jax.extend.core import jaxprs_in_params
from support.numpy_reference import normal, pure, randomize_norms

from cpkv_jax.config import ModelConfig, RopeConfig
from cpkv_jax.model.layers import LayerNorm, RMSNorm
from cpkv_jax.model.moe import DenseMLP, MoE, RoutedExperts, route
from cpkv_jax.model.rope import apply_rope, rope_cos_sin
from cpkv_jax.tools.tiny_config import tiny_config_dict

TOL = {"rtol": 1e-5, "atol": 1e-5}

ROPES = {
    "default": RopeConfig(theta=10000.0),
    # The tiny DeepSeek config: factor 4, ramp over frequencies [0, 3) of 4.
    "yarn_tiny": ModelConfig.from_dict(tiny_config_dict("deepseek_v32")).rope,
    # DeepSeek-V3 sizes with mscale != mscale_all_dim, so the cos/sin magnitude is not 1.
    "yarn_mscale": RopeConfig(
        theta=10000.0,
        rope_type="yarn",
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=0.707,
    ),
}


class NormTest(chex.TestCase):
    @chex.variants(with_jit=True)
    def test_rms_norm(self):
        rng = np.random.default_rng(1)
        norm = RMSNorm(48, 1e-6)
        randomize_norms(norm, rng)
        x = normal(rng, (3, 5, 48), 2.0)
        fn, state = pure(norm)
        got = self.variant(fn)(state, x)
        chex.assert_shape(got, (3, 5, 48))
        want = ref.rms_norm(ref.f64(x), ref.f64(norm.weight[...]), 1e-6)
        chex.assert_trees_all_close(ref.f64(got), want, **TOL)

    @chex.variants(with_jit=True)
    def test_layer_norm(self):
        rng = np.random.default_rng(2)
        norm = LayerNorm(32, 1e-6)
        randomize_norms(norm, rng)
        # A mean offset checks that the mean is really subtracted.
        x = normal(rng, (7, 32), 2.0) + 3.0
        fn, state = pure(norm)
        got = self.variant(fn)(state, x)
        want = ref.layer_norm(ref.f64(x), ref.f64(norm.weight[...]), ref.f64(norm.bias[...]))
        chex.assert_trees_all_close(ref.f64(got), want, **TOL)


class RopeTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @parameterized.product(rope_name=list(ROPES), dim=[8, 64], interleaved=[True, False])
    def test_rope_matches_reference(self, rope_name, dim, interleaved):
        rope = ROPES[rope_name]
        rng = np.random.default_rng(dim + 3 * interleaved)
        positions = jnp.asarray(rng.integers(0, 1024, (3, 5)), jnp.int32)
        x = normal(rng, (3, 5, 2, dim))
        cos, sin = self.variant(rope_cos_sin, static_argnames=("dim", "rope"))(
            positions, dim=dim, rope=rope
        )
        chex.assert_shape((cos, sin), (3, 5, dim // 2))
        rope_fn = self.variant(functools.partial(apply_rope, interleaved=interleaved))
        got = rope_fn(x, cos[:, :, None], sin[:, :, None])
        chex.assert_shape(got, x.shape)

        want_cos, want_sin = ref.rope_cos_sin(np.asarray(positions), dim, rope)
        want = ref.rotate(
            ref.f64(x), want_cos[:, :, None], want_sin[:, :, None], interleaved=interleaved
        )
        # Angles are pos * inv_freq in float32: for pos < 1024 the angle is off by up to
        # ~1024 * 2^-24 ~ 6e-5 rad (measured max cos/sin error 3.9e-5), hence atol 1e-4, and
        # 4e-4 for the rotated x (|x| up to ~4).
        chex.assert_trees_all_close((ref.f64(cos), ref.f64(sin)), (want_cos, want_sin), atol=1e-4)
        chex.assert_trees_all_close(ref.f64(got), want, rtol=1e-4, atol=4e-4)

    def test_yarn_blends_frequencies(self):
        # Guard that the YaRN cases above are not vacuous: some frequencies are
        # interpolated, some kept, and the magnitude differs from 1 where mscales differ.
        inv_default, _ = ref.rope_inv_freq(64, ROPES["default"])
        inv_yarn, mscale = ref.rope_inv_freq(64, ROPES["yarn_mscale"])
        self.assertTrue(np.isclose(inv_yarn[0], inv_default[0]))
        self.assertTrue(np.isclose(inv_yarn[-1], inv_default[-1] / 40.0))
        self.assertGreater(abs(mscale - 1.0), 0.05)
        cos, sin = rope_cos_sin(jnp.asarray([7]), 64, ROPES["yarn_mscale"])
        chex.assert_trees_all_close(
            ref.f64(cos**2 + sin**2), np.full((1, 32), mscale**2), rtol=1e-5
        )


class MlpTest(chex.TestCase):
    @chex.variants(with_jit=True)
    def test_dense_mlp(self):
        rng = np.random.default_rng(4)
        mlp = DenseMLP(64, 128, rngs=nnx.Rngs(4), dtype=jnp.float32, param_dtype=jnp.float32)
        x = normal(rng, (2, 9, 64))
        fn, state = pure(mlp)
        got = self.variant(fn)(state, x)
        chex.assert_shape(got, (2, 9, 64))
        want = ref.mlp(ref.params_f64(mlp), ref.f64(x))
        chex.assert_trees_all_close(ref.f64(got), want, **TOL)


ROUTE_CASES = {
    # name: (n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
    "ungrouped": (1, 1, 2, True, 2.5),
    "grouped": (4, 2, 3, True, 2.5),
    "ungrouped_unnormalized": (1, 1, 4, False, 1.0),
}


class MoETest(chex.TestCase):
    @chex.variants(with_jit=True)
    @parameterized.named_parameters(*[(k, *v) for k, v in ROUTE_CASES.items()])
    def test_route(self, n_group, topk_group, top_k, norm, scale):
        rng = np.random.default_rng(5)
        logits = normal(rng, (64, 16), 1.5)
        bias = normal(rng, (16,), 0.3)
        kw = dict(
            top_k=top_k,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=norm,
            routed_scaling_factor=scale,
        )
        experts, weights = self.variant(functools.partial(route, **kw))(logits, bias)
        chex.assert_shape((experts, weights), (64, top_k))
        want_e, want_w = ref.route(ref.f64(logits), ref.f64(bias), **kw)
        # Experts are chosen by comparisons, so they must agree exactly (the seed has no
        # float32-vs-float64 near-ties); weights are sigmoids and a ratio: float32 rounding.
        chex.assert_trees_all_equal(np.asarray(experts), want_e.astype(np.int32))
        chex.assert_trees_all_close(ref.f64(weights), want_w, **TOL)
        if n_group > 1:
            # The group restriction must actually bite on this data, or the case is vacuous.
            free_e, _ = ref.route(
                ref.f64(logits), ref.f64(bias), **{**kw, "n_group": 1, "topk_group": 1}
            )
            self.assertGreater(int((np.sort(free_e, 1) != np.sort(want_e, 1)).any(1).sum()), 5)

    @chex.variants(with_jit=True)
    def test_routed_experts(self):
        cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
        rng = np.random.default_rng(6)
        experts_mod = RoutedExperts(
            cfg, rngs=nnx.Rngs(6), dtype=jnp.float32, param_dtype=jnp.float32
        )
        n, k = 24, 3
        # Distinct experts per token, drawn from 0..6 only: expert 7 gets no tokens (empty
        # ragged group) and the others get uneven counts.
        experts = jnp.asarray(
            np.stack([rng.choice(cfg.n_routed_experts - 1, k, replace=False) for _ in range(n)]),
            jnp.int32,
        )
        weights = jnp.asarray(rng.uniform(0.1, 1.0, (n, k)), jnp.float32)
        x = normal(rng, (n, cfg.hidden_size))
        fn, state = pure(experts_mod)
        got = self.variant(fn)(state, x, experts, weights)
        chex.assert_shape(got, (n, cfg.hidden_size))
        p = ref.params_f64(experts_mod)
        want = ref.routed_experts(p, ref.f64(x), np.asarray(experts), ref.f64(weights))
        chex.assert_trees_all_close(ref.f64(got), want, **TOL)

    def test_routed_experts_combine_has_no_scatter_add(self):
        """The expert outputs are combined per token in a fixed order, not by a scatter-add:
        on GPU a scatter-add is atomics whose order changes the output bits run to run
        (benchmarks/results/row_invariance_h200_default_before_moe_fix.json)."""
        cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
        experts_mod = RoutedExperts(
            cfg, rngs=nnx.Rngs(6), dtype=jnp.float32, param_dtype=jnp.float32
        )
        n, k = 6, cfg.num_experts_per_tok
        fn, state = pure(experts_mod)
        jaxpr = jax.make_jaxpr(fn)(
            state,
            jnp.ones((n, cfg.hidden_size)),
            jnp.zeros((n, k), jnp.int32),
            jnp.ones((n, k)),
        )

        def primitives(jx):
            for eqn in jx.eqns:
                yield eqn.primitive.name, eqn.outvars[0].aval.dtype
                for sub in jaxprs_in_params(eqn.params):
                    yield from primitives(sub)

        found = set(primitives(jaxpr.jaxpr))
        self.assertIn("ragged_dot_general", {name for name, _ in found})  # the experts' code
        # Integer scatter-adds (the per-expert token counts) are exact in any order.
        float_scatter_adds = {
            (name, str(dtype))
            for name, dtype in found
            if name == "scatter-add" and jnp.issubdtype(dtype, jnp.floating)
        }
        self.assertEqual(float_scatter_adds, set())

    @chex.variants(with_jit=True)
    @parameterized.parameters("glm_moe_dsa", "deepseek_v32")
    def test_moe_block(self, arch):
        # glm: ungrouped routing; deepseek: n_group 4 / topk_group 2. Both with a shared expert.
        cfg = ModelConfig.from_dict(tiny_config_dict(arch))
        rng = np.random.default_rng(7)
        moe = MoE(cfg, rngs=nnx.Rngs(7), dtype=jnp.float32, param_dtype=jnp.float32)
        x = normal(rng, (2, 12, cfg.hidden_size))
        fn, state = pure(moe)
        got = self.variant(fn)(state, x)
        chex.assert_shape(got, x.shape)
        want = ref.moe(ref.params_f64(moe), cfg, ref.f64(x).reshape(24, -1)).reshape(x.shape)
        chex.assert_trees_all_close(ref.f64(got), want, **TOL)
