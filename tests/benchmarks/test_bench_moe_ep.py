"""benchmarks/bench_moe_ep: one MoE layer, expert parallel (both dispatches) vs replicated
experts on the 8-device mesh, and the `--gpu` mode's refusal without a GPU."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import bench_moe_ep

VARIANTS = ("replicated", "ep_allgather", "ep_all_to_all")
ROW_KEYS = {"ms", "ratio_vs_replicated", "max_abs_diff", "bitwise_equal"}


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_ep") / "r.json"
    argv = ["--tokens", "64", "--hidden", "64", "--moe-intermediate", "32", "--experts", "16"]
    argv += ["--topk", "4", "--dtype", "float32", "--repeats", "2", "--warmup", "1", "--fp8"]
    argv += ["--json", str(out)]
    assert bench_moe_ep.main(argv) == 0
    return json.loads(out.read_text())


def test_report_shape(tiny_report):
    r = tiny_report
    assert (r["mode"], r["cp"], r["dtype"], len(r["devices"])) == ("mesh", 8, "float32", 8)
    assert r["dims"] == {
        "hidden": 64,
        "moe_intermediate": 32,
        "routed_experts": 16,
        "topk": 4,
        "shared_experts": 1,
    }
    [case] = r["cases"]
    assert (case["tokens"], case["tokens_per_rank"]) == (64, 8)
    names = set(VARIANTS) | {f"{v}_fp8" for v in VARIANTS}
    assert set(case["variants"]) == names == set(r["bytes_per_device"])
    for name, row in case["variants"].items():
        keys = ROW_KEYS | ({"ratio_vs_unquantized"} if name.endswith("_fp8") else set())
        assert set(row) == keys and row["ms"] > 0
    assert case["variants"]["replicated"]["ratio_vs_replicated"] == 1.0
    # EP holds 1/8 of the routed experts per device.
    mem = r["bytes_per_device"]
    assert mem["ep_allgather"]["routed_experts"] * 8 == mem["replicated"]["routed_experts"]


def test_ep_equals_replicated(tiny_report):
    """allclose 1e-5 (float32); the bits may differ by rounding only: on CPU
    `ragged_dot` is a dense dot whose contraction length is local experts x hidden."""
    [case] = tiny_report["cases"]
    for name, row in case["variants"].items():
        assert row["max_abs_diff"] <= 1e-5, name
        assert isinstance(row["bitwise_equal"], bool)
    assert case["ep_vs_replicated"] in ("bitwise", "float-rounding")
    bits = {n: r["bitwise_equal"] for n, r in case["variants"].items()}
    print(f"EP vs replicated bitwise: {bits}")


def test_fp8_in_step_equals_dequant_at_load(tiny_report):
    fp8 = tiny_report["cases"][0]["fp8"]
    assert fp8["in_step_vs_dequant_at_load"] == {"max_abs_diff": 0.0, "bitwise_equal": True}
    # Quantization error is real but small next to the outputs.
    max_out = tiny_report["cases"][0]["max_abs_output"]
    assert 0 < fp8["max_abs_diff_vs_unquantized"] < 0.2 * max_out


def test_compare_reports_bits_and_diff():
    a = np.array([1.0, 2.0], np.float32)
    assert bench_moe_ep._compare(a, a.copy()) == {"max_abs_diff": 0.0, "bitwise_equal": True}
    b = np.array([1.0, 2.0 + 2**-20], np.float32)
    got = bench_moe_ep._compare(b, a)
    assert not got["bitwise_equal"] and 0 < got["max_abs_diff"] < 1e-5
    assert bench_moe_ep._diff_kind([got], 2.0, np.float32) == "float-rounding"
    assert bench_moe_ep._diff_kind([{**got, "max_abs_diff": 1e-3}], 2.0, np.float32) == "mismatch"


def test_gpu_mode_refuses_on_cpu(capsys):
    assert bench_moe_ep.main(["--gpu"]) == 2
    err = capsys.readouterr().err
    assert "--gpu needs a GPU" in err and "no GPU found" in err
