"""benchmarks/bench_memory: per-rank KV bytes of shared vs replicated pools (SPEC S1.3).

GLM-5 figures are checked against bytes written out here from the SPEC's vocabulary
(latent 512 + 64 values in bf16, index K 128 B fp8 + 4 B fp32 scale), so the benchmark's
`pool_shapes` route and this independent arithmetic have to agree.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import bench_memory as bm
from cpkv_jax.config import ModelConfig
from cpkv_jax.model_configs import config_dir
from cpkv_jax.tools.tiny_config import tiny_config_dict

GLM5 = bm.DEFAULT_CONFIG / "config.json"

FREQ4 = '{"index_topk_freq": 4, "index_skip_topk_offset": 3}'
GLM5_LATENT = 1152  # (512 + 64) bf16 values per token per layer
GLM5_INDEX = 132  # 128 fp8 + one fp32 scale per token per full layer
GIB = 1 << 30
REPORT_KEYS = {
    "cp_size",
    "page_size",
    "context_tokens",
    "per_rank_pool_bytes_shared",
    "per_rank_pool_bytes_replicated",
    "ratio",
    "transient_full_view_bytes",
    "max_context_shared",
    "max_context_replicated",
    "max_context_ratio",
    "measured",
}
MEASURED_KEYS = {
    "measured",
    "cp_size",
    "per_rank_pool_bytes_shared",
    "per_rank_pool_bytes_replicated",
    "predicted_per_rank_pool_bytes_shared",
    "predicted_per_rank_pool_bytes_replicated",
    "ratio",
    "measured_equals_predicted",
}


def _glm5_report(*argv: str) -> dict:
    args = bm.parse_args(["--no-measured", *argv])
    return bm.model_report(bm.load_config(args.config, args.json_model_override_args), args)


def test_glm5_shared_is_one_over_cp_of_replicated_at_128k():
    r = _glm5_report()  # defaults: cp 8, page 64, 131072 tokens, bf16, fp8 index K
    assert (r["cp_size"], r["page_size"], r["context_tokens"]) == (8, 64, 131072)
    assert r["latent_bytes_per_token_layer"] == GLM5_LATENT
    assert r["index_k_bytes_per_token_full_layer"] == GLM5_INDEX
    per_page = 64 * 78 * (GLM5_LATENT + GLM5_INDEX)
    assert r["per_rank_pool_bytes_replicated"] == (2048 + 1) * per_page
    assert r["per_rank_pool_bytes_shared"] == (2048 // 8 + 1) * per_page
    assert r["ratio"] == pytest.approx(1 / 8, rel=0.01)
    # One layer's full view (latent + index K + scale), not 78 of them.
    assert r["transient_full_view_bytes"] == 131072 * (GLM5_LATENT + GLM5_INDEX)


def test_glm5_max_context_at_64gib_grows_at_least_7x():
    r = _glm5_report("--budget-gib", "64")
    assert r["budget_bytes"] == 64 * GIB
    assert r["max_context_shared"] / r["max_context_replicated"] >= 7.0
    assert r["max_context_ratio"] == r["max_context_shared"] / r["max_context_replicated"]


@pytest.mark.parametrize("shared", [True, False])
def test_glm5_max_context_is_the_largest_that_fits(shared):
    """max_context fits the budget (pool + transient view); one more page does not."""
    r = _glm5_report()
    cfg = bm.load_config(None)
    pages = r["max_context_shared" if shared else "max_context_replicated"] // 64
    dt, kdt = bm.DTYPES["bfloat16"], "fp8_e4m3"
    fits = bm.footprint_bytes(cfg, pages, 8, 64, dt, kdt, shared=shared)
    over = bm.footprint_bytes(cfg, pages + 1, 8, 64, dt, kdt, shared=shared)
    assert fits <= r["budget_bytes"] < over
    # Closed form: per-rank pool pages + one layer's view of `pages` pages.
    rank_pages = -(-pages // 8) + 1 if shared else pages + 1
    assert fits == 64 * (
        rank_pages * 78 * (GLM5_LATENT + GLM5_INDEX) + pages * (GLM5_LATENT + GLM5_INDEX)
    )


def test_glm5_index_share_override_drops_shared_layers_index_k():
    r = _glm5_report("--json-model-override-args", FREQ4)
    assert r["full_indexer_layers"] == 21
    per_page = 64 * (78 * GLM5_LATENT + 21 * GLM5_INDEX)
    assert r["per_rank_pool_bytes_replicated"] == 2049 * per_page
    assert r["ratio"] == pytest.approx(1 / 8, rel=0.01)
    # The largest view is still a full layer's.
    assert r["transient_full_view_bytes"] == 131072 * (GLM5_LATENT + GLM5_INDEX)


def test_measured_pools_equal_predicted_bytes():
    """Real tiny pools on the 8-device mesh hold exactly what per_rank_pool_bytes predicts."""
    m = bm.measure_tiny_pools(page_size=64, tokens=16384)
    n = m["context_pages"]
    assert (m["measured"], m["cp_size"], n) == (True, 8, 256)
    for name in ("shared", "replicated"):
        per_device = m[f"per_device_pool_bytes_{name}"]
        assert len(per_device) == 8
        assert per_device == [m[f"predicted_per_rank_pool_bytes_{name}"]] * 8
    assert m["measured_equals_predicted"] is True
    # Tiny model, float32 latent (32 + 8 values) x 6 layers, fp8 index K (32 B + 4 B) x 3.
    per_page = 64 * (6 * 40 * 4 + 3 * (32 + 4))
    assert m["per_rank_pool_bytes_replicated"] == (n + 1) * per_page
    assert m["per_rank_pool_bytes_shared"] == (n // 8 + 1) * per_page
    # 1/8 up to page rounding: ceil(n/8) + 1 trash page of n + 1.
    assert m["ratio"] == (-(-n // 8) + 1) / (n + 1)
    assert abs(m["ratio"] - 1 / 8) <= 2 / (n + 1)


@settings(max_examples=25, deadline=None)
@given(
    cp=st.sampled_from([1, 2, 4, 8]),
    page=st.sampled_from([1, 16, 64]),
    budget=st.integers(min_value=1, max_value=1 << 28),
    shared=st.booleans(),
)
def test_max_context_definition_on_tiny_config(cp, page, budget, shared):
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    dt, kdt = bm.DTYPES["float32"], "fp8_e4m3"
    tokens = bm.max_context_tokens(
        budget, page, lambda n: bm.footprint_bytes(cfg, n, cp, page, dt, kdt, shared=shared)
    )
    assert tokens % page == 0
    pages = tokens // page
    if pages:
        assert bm.footprint_bytes(cfg, pages, cp, page, dt, kdt, shared=shared) <= budget
    assert bm.footprint_bytes(cfg, pages + 1, cp, page, dt, kdt, shared=shared) > budget


def test_main_json_with_config_file(tmp_path, capsys):
    """`--config` takes a config.json path; stdout is exactly one JSON object."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config_dict("glm_moe_dsa")))
    argv = ["--json", "--config", str(path), "--cp-size", "4", "--measured-tokens", "1024"]
    assert bm.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report.keys() >= REPORT_KEYS
    assert report["measured"].keys() >= MEASURED_KEYS
    assert report["cp_size"] == 4 and report["config"] == str(path)


def test_main_default_json_has_all_keys(capsys):
    assert bm.main(["--json", "--measured-tokens", "4096"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report.keys() >= REPORT_KEYS
    assert report["model_type"] == "glm_moe_dsa" and report["num_layers"] == 78
    assert report["ratio"] == pytest.approx(1 / 8, rel=0.01)
    assert report["max_context_ratio"] >= 7.0
    m = report["measured"]
    assert m.keys() >= MEASURED_KEYS
    assert m["measured"] is True and m["measured_equals_predicted"] is True
    assert m["per_rank_pool_bytes_shared"] == m["predicted_per_rank_pool_bytes_shared"]
    assert m["per_rank_pool_bytes_replicated"] == m["predicted_per_rank_pool_bytes_replicated"]


def test_main_no_measured_and_bad_flags(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config_dict("deepseek_v32")))
    assert bm.main(["--json", "--no-measured", "--config", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["measured"] is None

    assert bm.main(["--config", str(tmp_path / "missing")]) == 2
    assert "--config" in capsys.readouterr().err
    assert bm.main(["--config", str(path), "--budget-gib", "0"]) == 2
    assert "--budget-gib" in capsys.readouterr().err
    assert bm.main(["--config", str(path), "--cp-size", "0"]) == 2
    assert "--cp-size" in capsys.readouterr().err


def test_default_config_is_the_vendored_glm5():
    """The default resolves inside the package (a clone anywhere has it)."""
    assert config_dir("glm-5") == bm.DEFAULT_CONFIG
    assert (bm.DEFAULT_CONFIG / "config.json").is_file()
