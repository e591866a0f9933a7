"""`benchmarks.moe_combine` and the fixed-order combine it times (`moe.combine_expert_outputs`)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from benchmarks import moe_combine
from cpkv_jax.model.moe import combine_expert_outputs


def test_combine_sums_each_tokens_rows_in_slot_order():
    rng = np.random.default_rng(3)
    n, k, h = 7, 3, 5
    experts = rng.integers(0, 4, (n, k))
    order = np.argsort(experts.reshape(-1), stable=True)
    per_slot = rng.standard_normal((n * k, h)).astype(np.float32)  # token-slot major
    ys = per_slot[order]  # what ragged_dot returns: rows sorted by expert
    got = np.asarray(combine_expert_outputs(jnp.asarray(ys), jnp.asarray(order, jnp.int32), k))
    want = per_slot.reshape(n, k, h).astype(np.float64).sum(1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # float32 adds of 3 terms
    # Slot order exactly: ((s0 + s1) + s2) in float32.
    s = per_slot.reshape(n, k, h)
    np.testing.assert_array_equal(got, (s[:, 0] + s[:, 1]) + s[:, 2])


def test_bench_reports_both_combines(capsys):
    assert moe_combine.main(["--tokens", "64", "--hidden", "32", "--repeats", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    (case,) = out["cases"]
    assert case["tokens"] == 64 and case["topk"] == 8 and case["dtype"] == "bfloat16"
    assert case["fixed_order_ms"] > 0 and case["scatter_add_ms"] > 0
    assert case["fixed_order_repeats_bitwise"]
    # Same float32 terms, different add order: close, not necessarily equal.
    assert case["max_abs_diff"] < 1e-4
