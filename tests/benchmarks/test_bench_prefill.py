"""benchmarks/bench_prefill: TTFT of CP1 / CP8 replicated / CP8 shared prefill through
`CPPrefillRunner` - the report of a tiny CPU run, the logits guard, the GLM-5 configs
(scaled and real), the CP8 variants skipped (not faked) with too few devices, and the
`--gpu` mode's refusal without a GPU."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from benchmarks import bench_prefill as bp

VARIANTS = ("cp1", "cp8_replicated", "cp8_shared", "cp8_owner")
RATIOS = (
    "shared_over_replicated",
    "replicated_over_cp1",
    "shared_over_cp1",
    "owner_over_shared",
    "owner_temp_over_shared",
)
LENGTHS = (256, 512)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_prefill") / "r.json"
    argv = ["--lengths", *map(str, LENGTHS), "--chunk", "256", "--layers", "1", "--scale", "32"]
    argv += ["--repeats", "1", "--owner", "--json", str(out)]
    assert bp.main(argv) == 0
    return json.loads(out.read_text())


def test_report_shape(tiny_report):
    r = tiny_report
    assert (r["mode"], r["cp"], r["backend"]) == ("cpu", 8, "cpu")
    assert r["variants"] == r["timed"] == list(VARIANTS) and r["skipped"] == {}
    assert len(r["devices"]) == 8 and r["checks_ok"] is True
    assert (r["timing"]["repeats"], r["timing"]["warmup"]) == (1, 1)
    cfg = r["config"]
    assert (cfg["page_size"], cfg["chunk"], cfg["dtype"]) == (64, 256, "float32")
    assert [c["tokens"] for c in r["cases"]] == list(LENGTHS)
    for case in r["cases"]:
        for key in ("median_s", "min_s", "first_call_s", "per_layer_ms", "tokens_per_s"):
            assert set(case[key]) == set(VARIANTS), key
            assert all(v > 0 for v in case[key].values()), key
        assert all(len(t) == 1 and t[0] > 0 for t in case["times_s"].values())
        assert set(case["ratios"]) == set(RATIOS)
        assert all(math.isfinite(v) and v > 0 for v in case["ratios"].values())
        med = case["median_s"]
        assert case["ratios"]["shared_over_replicated"] == med["cp8_shared"] / med["cp8_replicated"]
        assert case["ratios"]["owner_over_shared"] == med["cp8_owner"] / med["cp8_shared"]
        temp = case["step_temp_bytes_per_device"]  # XLA's own figure, per variant
        assert set(temp) == set(VARIANTS) and all(v > 0 for v in temp.values())
        assert case["checks"]["cp8_owner_vs_cp1"]["ok"] is True
    assert r["cases"][1]["steps"] == 2  # 512 tokens in 256-token chunks


def test_logits_checks(tiny_report):
    """Shared vs replicated bitwise; CP8 vs CP1 within the project's float32 tolerance."""
    for case in tiny_report["cases"]:
        checks = case["checks"]
        vs_cp1 = ("cp8_replicated_vs_cp1", "cp8_shared_vs_cp1", "cp8_owner_vs_cp1")
        assert set(checks) == {"shared_vs_replicated", *vs_cp1}
        assert checks["shared_vs_replicated"]["bitwise_equal"] is True
        assert checks["shared_vs_replicated"]["max_abs_diff"] == 0.0
        for name in vs_cp1:
            assert checks[name]["ok"] and checks[name]["max_abs_diff"] <= 1e-4, name
        assert case["checks_ok"] is True


def test_scaled_dims_are_glm5_over_scale(tiny_report):
    dims = tiny_report["config"]["dims"]
    for name in (*bp.SCALED_WIDTHS, *bp.SCALED_HEADS):
        assert dims[name]["used"] * 32 == dims[name]["glm5"], name
        assert dims[name]["how"] == "/32"
    assert dims["hidden_size"]["used"] == 192 and dims["kv_lora_rank"]["used"] == 16
    # Top-k 2048/32 = 64: below both prompt lengths, so attention is really sparse.
    assert dims["index_topk"]["used"] == 64 < min(LENGTHS)
    assert dims["num_hidden_layers"]["used"] == 1


def test_real_config_is_glm5_one_layer():
    cfg, dims = bp.real_config("moe")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank) == (6144, 64, 512)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (32, 128, 2048)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.vocab_size) == (256, 8, 154880)
    assert cfg.num_hidden_layers == 1 and cfg.mlp_layer_types == ("sparse",)
    assert all(d["used"] == d["glm5"] for k, d in dims.items() if k != "num_hidden_layers")
    dense, _ = bp.real_config("dense")
    assert dense.mlp_layer_types == ("dense",) and dense.intermediate_size == 12288


def test_cp8_skipped_on_one_device():
    """With one device (one GPU) only CP1 runs; the CP8 variants are skipped with a reason."""
    args = bp.build_parser().parse_args(["--layers", "1", "--scale", "32"])
    cfg, _ = bp.scaled_config(args)
    one = jax.devices("cpu")[:1]
    runners, skipped = bp.build_runners(cfg, bp.build_model(cfg, args, one[0]), one, args, 256)
    assert list(runners) == ["cp1"]
    assert set(skipped) == {"cp8_replicated", "cp8_shared"}
    assert all("needs 8 cpu devices, found 1" in why for why in skipped.values())


def test_check_logits_flags_a_mismatch():
    a = np.linspace(-3, 3, 16, dtype=np.float32)
    ok = bp.check_logits({"cp1": a, "cp8_replicated": a, "cp8_shared": a.copy()}, 8, 1e-5, 1e-5)
    assert all(row["ok"] for row in ok.values())
    b = a.copy()
    b[3] += 1e-3
    bad = bp.check_logits({"cp1": a, "cp8_replicated": a, "cp8_shared": b}, 8, 1e-5, 1e-5)
    assert not bad["shared_vs_replicated"]["ok"] and not bad["cp8_shared_vs_cp1"]["ok"]
    assert bad["cp8_replicated_vs_cp1"]["ok"]
    assert bad["shared_vs_replicated"]["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)


def test_failed_check_exits_1(monkeypatch, capsys):
    failing = {"tokens": 8, "checks": {"shared_vs_replicated": {"ok": False, "max_abs_diff": 1.0}}}
    monkeypatch.setattr(bp, "run", lambda *a, **k: {"checks_ok": False, "cases": [failing]})
    assert bp.main(["--layers", "1", "--scale", "32"]) == 1
    assert "logits check failed" in capsys.readouterr().err


def test_gpu_mode_refuses_on_cpu(capsys):
    assert bp.main(["--gpu"]) == 2
    err = capsys.readouterr().err
    assert "--gpu needs a GPU" in err and "no GPU found" in err
