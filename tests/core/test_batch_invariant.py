"""Batch-invariant numerics (`cpkv_jax.model.numerics`): a row's result is independent of
the rows computed with it, and the mode changes no value beyond float32 rounding."""

from __future__ import annotations

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpkv_jax.config import ModelConfig
from cpkv_jax.model.layers import Linear
from cpkv_jax.model.numerics import TILE, batch_invariant, is_batch_invariant, tokenwise
from cpkv_jax.model.transformer import CausalLM, log_probs
from cpkv_jax.tools.tiny_config import tiny_config_dict

# Among the longer files of the suite: scheduled early, longest first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=45)  # on 2 workers, 2026-12-05

# Row counts (and offsets into a 600-row batch) a CP rank or a chunk can present.
ROWS = [1, 2, 3, 8, 15, 16, 17, 33, 100, 128, 533]
OFFSETS = [0, 5, 37]


def _row_mismatches(fn, x: np.ndarray, rows: list[int] = ROWS) -> list[tuple[int, int]]:
    """(rows, offset) pairs where `fn` on a slice differs from the same rows of `fn(x)`."""
    full = np.asarray(fn(x))
    return [
        (m, off)
        for m in rows
        for off in OFFSETS
        if not np.array_equal(np.asarray(fn(x[off : off + m])), full[off : off + m])
    ]


def test_projection_is_row_count_invariant_only_in_the_mode():
    """A 64 -> 40 projection: XLA:CPU's plain dot rounds a row differently depending on how
    many rows share it (the control - this shape was picked because it does); the
    batch-invariant projection gives every row the same bits for any row count/offset."""
    lin = Linear(64, 40, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    x = np.random.default_rng(1).standard_normal((600, 64)).astype(np.float32)

    def run(invariant):
        @jax.jit
        def f(rows):
            with batch_invariant(invariant):
                return lin(rows)

        return f

    assert _row_mismatches(run(False), x), "control: plain dot was row invariant here"
    assert _row_mismatches(run(True), x) == []
    chex.assert_trees_all_close(run(True)(x), run(False)(x), rtol=1e-6, atol=1e-6)


def test_log_probs_are_row_count_invariant_in_the_mode():
    """XLA:CPU reduces 16 or more rows of one program in another order than fewer, so
    the default log-softmax of a row can change with the batch; the invariant one (what
    every path passes under `--enable-batch-invariant`, the engine's draws included)
    must not, whatever the leading axes."""
    x = np.random.default_rng(0).normal(size=(600, 320)).astype(np.float32) * 3
    assert _row_mismatches(lambda rows: log_probs(rows, True), x) == []
    full = np.asarray(log_probs(x, True))
    np.testing.assert_array_equal(
        np.asarray(log_probs(x.reshape(40, 15, 320), True)), full.reshape(40, 15, 320)
    )


def test_decoder_layers_are_row_count_invariant():
    """Every token-wise block of the tiny model (norms, MLA projections, dense MLP and
    MoE) on row subsets equals the same rows of a whole-batch run, bitwise; the default
    numerics do not (the control)."""
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    model = CausalLM(cfg, rngs=nnx.Rngs(2))
    layer = model.model.layers[2]  # MoE layer with shared experts
    x = np.random.default_rng(3).standard_normal((600, cfg.hidden_size)).astype(np.float32)

    def run(invariant):
        @jax.jit
        def block(rows):
            with batch_invariant(invariant):
                h = layer.input_layernorm(rows[None])
                q = layer.self_attn.q_b_proj(layer.self_attn.q_a_proj(h))
                return jnp.concatenate([q[0], layer.mlp(h)[0]], axis=-1)

        return block

    rows = [1, 3, 17, 100]
    assert _row_mismatches(run(False), x, rows), "control: the default layer was row invariant"
    assert _row_mismatches(run(True), x, rows) == []


def test_tokenwise_pads_tiles_and_keeps_other_axes():
    """Output order, padding removal and a token axis that is not the first."""
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 2 * TILE + 5, 7)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(5).standard_normal((3, 2 * TILE + 5)), jnp.float32)

    def fn(a, b):
        return {"sum": a.sum(-1) + b, "scaled": a * 2.0}

    with batch_invariant(True):
        assert is_batch_invariant()
        got = jax.jit(lambda a, b: tokenwise(fn, a, b, axis=1))(x, y)
    assert not is_batch_invariant()
    want = fn(x, y)
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    chex.assert_shape(got["scaled"], x.shape)


@pytest.mark.parametrize("rows", [1, TILE, TILE + 1])
def test_single_tile_in_context_equals_loop(rows):
    """One tile is still a loop XLA cannot inline: the router's sigmoid inside a one-tile
    MoE fused into its consumer rounded differently than in a multi-tile loop (this is
    the case the hidden trip count fixes)."""
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    model = CausalLM(cfg, rngs=nnx.Rngs(6))
    moe, norm = model.model.layers[2].mlp, model.model.norm
    x = np.random.default_rng(7).standard_normal((4 * TILE, cfg.hidden_size)).astype(np.float32)

    @jax.jit
    def last(rows_in):  # a last layer's MoE + residual, then the model's final norm
        with batch_invariant(True):
            return norm(rows_in + moe(rows_in[None])[0])

    full = np.asarray(last(x))
    np.testing.assert_array_equal(np.asarray(last(x[:rows])), full[:rows])


def test_batch_invariant_benchmark_reports_both_modes(tmp_path, capsys):
    """`benchmarks.batch_invariant` runs, prints what it writes, and measures the mode's
    effect: CP vs single-device bitwise in batch-invariant numerics."""
    from benchmarks import batch_invariant as bench

    out = tmp_path / "bi.json"
    assert bench.main(["--tokens", "20", "--repeats", "1", "--json", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    (case,) = printed["cases"]
    assert case["tokens"] == 20 and case["chunk"] is None
    assert case["invariant_bitwise_kv"] and case["invariant_bitwise_logits"]
    assert case["invariant_max_kv_diff"] == 0.0
    assert 0 <= case["default_max_kv_diff"] < 1e-5
    for key in ("cp_default_s", "cp_invariant_s", "single_default_s", "single_invariant_s"):
        assert case[key] > 0
    assert case["cp_cost_ratio"] == case["cp_invariant_s"] / case["cp_default_s"]


def test_bitwise_invariance_also_holds_under_xla_default_flags():
    """The suite compiles with fast XLA:CPU flags (tests/conftest.py), under which LLVM does
    not vectorize; vectorized loops could round a row by its batch's shape. So the
    decoder-layer test above and the CP prefill's bitwise check at its longest prompt
    (chunked) run again here, in a child pytest under XLA's defaults (LLVM -O2,
    the fusion emitters), as the demo and the servers compile."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from support.xla_flags import FAST_COMPILE_FLAGS

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.pop("CPKV_TEST_FAST_COMPILE", None)
    env["CPKV_TEST_XLA_DEFAULT"] = "1"
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(FAST_COMPILE_FLAGS, "").strip()
    cp = Path(__file__).with_name("test_cp_prefill.py")
    bitwise = "test_batch_invariant_cp_prefill_is_bitwise_equal_to_reference"
    tests = [
        f"{__file__}::test_decoder_layers_are_row_count_invariant",
        f"{cp}::{bitwise}[40-533]",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout, done.stdout[-2000:]
