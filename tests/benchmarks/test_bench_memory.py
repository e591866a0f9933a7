"""benchmarks/bench_memory: per-rank KV bytes of shared vs replicated pools (SPEC S1.3).

GLM-5 figures are checked against bytes written out here from the SPEC's vocabulary
(latent 512 + 64 values in bf16, index K 128 B fp8 + 4 B fp32 scale), so the benchmark's
`pool_shapes` route and this independent arithmetic have to agree. The weights section
is checked against the released models' parameter counts and closed forms of the FP8
block format, and its measured part against real sharded arrays.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import bench_memory as bm
from cpkv_jax.config import ModelConfig
from cpkv_jax.kv_pool import PoolLayout
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
    "weights",
    "measured_weights",
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
# Released parameter counts (B, MTP layers excluded): total, routed experts.
RELEASED_PARAMS = {"GLM-5-FP8": (743.9e9, 724.8e9), "DeepSeek-V3.2-FP8": (671.9e9, 653.9e9)}
# Routed experts: n weights of 1 B (fp8) + one 4 B scale per 128 x 128 block, vs 2n B (bf16).
FP8_OVER_BF16 = (128 * 128 + 4, 2 * 128 * 128)


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
    # Tiny model, float32 latent (32 + 8 values) x 3 layers, fp8 index K (32 B + 4 B) x 1.
    per_page = 64 * (3 * 40 * 4 + 1 * (32 + 4))
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
    assert bm.main([*argv, "--no-weights"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report.keys() >= REPORT_KEYS
    assert report["measured"].keys() >= MEASURED_KEYS
    assert report["cp_size"] == 4 and report["config"] == str(path)
    assert report["weights"] is None and report["measured_weights"] is None


def test_main_default_json_has_all_keys(capsys, tiny_fp8):
    argv = ["--json", "--measured-tokens", "4096", "--measured-weights-checkpoint", str(tiny_fp8)]
    assert bm.main(argv) == 0
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
    assert report["weights"]["models"].keys() == set(RELEASED_PARAMS)
    for model in report["weights"]["models"].values():
        assert model["ep"].keys() == {"1", "8", "16"}
        assert model["kv_tokens_per_rank_on_device"]["fits"] is True
        # A DP8 decode rank: the EP 8 weights, its own pool (issue 36).
        decode = model["decode_dp_rank_on_device"]
        assert decode["weights_bytes"] == model["ep"]["8"]["weights_bytes_per_device"]["total"]
        assert decode["fits"] is True and decode["longest_request_tokens"] > 0
        assert decode["kv_tokens_per_server"] == 8 * decode["kv_tokens_per_rank"]
        # Beside its pool, the largest decode step its 512 running requests can dispatch
        # (issue 36 item 6, the server's own term): fewer tokens than the pool alone.
        assert decode["decode_step_bytes"] > 0 and "64 row(s) per DP rank" in decode["decode_step"]
        assert 0 < decode["kv_tokens_per_rank"] < decode["kv_tokens_per_rank_pool_only"]
        # A CP8 decode group (issue 40): one request stripes over the 8 ranks' pools.
        group = model["decode_cp_group_on_device"]
        cp_kv = model["kv_tokens_per_rank_on_device"]
        assert group["single_request_pool_tokens"] == 8 * cp_kv["tokens_per_rank"]
        assert group["pool_over_dp_rank"] >= 7
        assert group["longest_request_tokens"] == min(
            group["single_request_pool_tokens"], group["max_position_embeddings"]
        )
        traffic = group["bytes_per_row_step_by_context"][str(131072)]
        dp, cp = traffic["dp_rank"], traffic["cp_rank"]
        assert dp["sent"] == 0 and cp["sent"] > 0
        assert cp["index_k_read"] * 8 == dp["index_k_read"]  # 128K splits evenly
        assert cp["latent_read"] * 4 == dp["latent_read"]  # 2 x k / 8 rows of k
    assert report["measured_weights"]["measured_equals_predicted"] is True


def test_decode_bytes_per_rank_by_hand():
    """`cp_decode.decode_bytes_per_rank` against a hand count for the tiny config: float32
    latent (24 floats), fp8 index K (32 B + a 4-B scale) on its full layers."""
    from cpkv_jax.config import ModelConfig
    from cpkv_jax.cp_decode import decode_bytes_per_rank

    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    full, layers = len(cfg.full_indexer_layers), cfg.num_hidden_layers
    row, idx = cfg.kv_cache_dim * 4, cfg.index_head_dim + 4
    k = cfg.index_topk
    one = decode_bytes_per_rank(cfg, 1000, 1, dtype="float32")
    assert one == {
        "index_k_read": full * 1000 * idx,
        "latent_read": layers * k * row,
        "sent": 0,
        "total": full * 1000 * idx + layers * k * row,
    }
    four = decode_bytes_per_rank(cfg, 1000, 4, dtype="float32")
    h = cfg.num_attention_heads
    # q_nope + q_pe in float32 out, partials through w_uv (v_head_dim) + max + sum back,
    # the new KV row; on the full layer the indexer query and weights, 16 candidates
    # (of 256 owned in the padded width), the 16 selected positions, the index K row;
    # the page table (16 pages of 64 tokens, width 16) and three int32 per step.
    attn = h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim + 2) * 4 + row
    indexer = cfg.index_n_heads * (cfg.index_head_dim + 1) * 4 + k * 8 + k * 4 + idx
    assert four["index_k_read"] == full * 250 * idx
    assert four["latent_read"] == layers * 8 * row  # ceil(2 * 16 / 4) rows
    assert four["sent"] == 3 * (layers * attn + full * indexer + (16 + 3) * 4)


def test_main_no_measured_and_bad_flags(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config_dict("deepseek_v32")))
    assert bm.main(["--json", "--no-measured", "--config", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["measured"] is None and report["measured_weights"] is None
    assert report["weights"]["models"].keys() == set(RELEASED_PARAMS)

    assert bm.main(["--config", str(tmp_path / "missing")]) == 2
    assert "--config" in capsys.readouterr().err
    assert bm.main(["--config", str(path), "--budget-gib", "0"]) == 2
    assert "--budget-gib" in capsys.readouterr().err
    assert bm.main(["--config", str(path), "--cp-size", "0"]) == 2
    assert "--cp-size" in capsys.readouterr().err
    assert bm.main(["--config", str(path), "--device-gb", "0"]) == 2
    assert "--device-gb" in capsys.readouterr().err
    assert bm.main(["--config", str(path), "--mem-fraction-static", "1.5"]) == 2
    assert "--mem-fraction-static" in capsys.readouterr().err
    assert (
        bm.main(["--config", str(path), "--measured-weights-checkpoint", str(tmp_path / "no")]) == 2
    )
    assert "--measured-weights-checkpoint" in capsys.readouterr().err


def test_default_config_is_the_vendored_glm5():
    """The default resolves inside the package (a clone anywhere has it)."""
    assert config_dir("glm-5") == bm.DEFAULT_CONFIG
    assert (bm.DEFAULT_CONFIG / "config.json").is_file()


# ---- weights per device ------------------------------------------------------------------
@pytest.fixture(scope="module")
def weights():
    """The weights section at the defaults (cp 8, page 64, 141 GB, fraction 0.88)."""
    return bm.weights_report(bm.parse_args([]))


@pytest.fixture(scope="module")
def tiny_fp8(tiny_checkpoints):
    return tiny_checkpoints("glm_moe_dsa", fp8=True, n_routed_experts=16)


@pytest.mark.parametrize("name", sorted(RELEASED_PARAMS))
def test_param_counts_match_the_releases(weights, name):
    m = weights["models"][name]
    total, routed = RELEASED_PARAMS[name]
    assert m["params"] == pytest.approx(total, rel=0.005)
    assert m["routed_expert_params"] == pytest.approx(routed, rel=0.005)
    # The bf16 model has the same parameters (FP8 scales are not counted).
    _, bf16 = bm.real_abstract_state(config_dir(bm.WEIGHT_MODELS[name]), None)
    assert bm.param_counts(bf16) == {
        "params": m["params"],
        "routed_expert_params": m["routed_expert_params"],
    }


@pytest.mark.parametrize("name", sorted(RELEASED_PARAMS))
def test_ep_splits_the_routed_experts_only(weights, name):
    ep = weights["models"][name]["ep"]
    w1 = ep["1"]["weights_bytes_per_device"]
    for n in (8, 16):
        wn = ep[str(n)]["weights_bytes_per_device"]
        assert wn["routed_experts"] * n == w1["routed_experts"]
        assert wn["other"] == w1["other"]
        assert wn["total"] == wn["routed_experts"] + wn["other"]
        d1, dn = (ep[k]["dequant_transient_bytes_per_device"] for k in ("1", str(n)))
        assert dn * n == d1
        assert dn < ep[str(n)]["dequant_transient_bytes_per_device_layer_all_fp8"]
    # One MoE layer's routed experts in bf16: 3 projections x 256 experts x i x h x 2 B.
    cfg = ModelConfig.from_pretrained(config_dir(bm.WEIGHT_MODELS[name]))
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    assert ep["1"]["dequant_transient_bytes_per_device"] == 3 * 256 * i * h * 2


@pytest.mark.parametrize("name", sorted(RELEASED_PARAMS))
def test_fp8_weights_are_about_half_of_bf16(weights, name):
    m = weights["models"][name]
    fp8, bf16 = m["ep"]["8"]["weights_bytes_per_device"], m["bf16_weights_bytes_per_device"]
    assert m["bf16_ep"] == 8
    assert fp8["total"] < bf16["total"]
    num, den = FP8_OVER_BF16  # every expert dim is a multiple of 128: no cropped block
    assert fp8["routed_experts"] * den == bf16["routed_experts"] * num
    # What our model holds: FP8 + float32 scales, bf16, and float32 norms + router.
    held = m["bytes_by_dtype"]
    assert held.keys() == {"bfloat16", "float32", "float32_scale_inv", "float8_e4m3fn"}
    assert sum(held.values()) == m["ep"]["1"]["weights_bytes_per_device"]["total"]


def test_glm5_fp8_fits_a_cp8_ep8_h200_node(weights):
    m = weights["models"]["GLM-5-FP8"]
    kv = m["kv_tokens_per_rank_on_device"]
    assert (kv["cp_size"], kv["ep_size"], kv["page_size"]) == (8, 8, 64)
    assert (kv["device_bytes"], kv["mem_fraction_static"]) == (141 * 10**9, 0.88)
    ep8 = m["ep"]["8"]
    assert kv["weights_bytes"] == ep8["weights_bytes_per_device"]["total"]
    assert kv["dequant_transient_bytes"] == ep8["dequant_transient_bytes_per_device"]
    left = kv["static_bytes"] - kv["weights_bytes"] - kv["dequant_transient_bytes"]
    assert kv["kv_budget_bytes"] == left
    assert kv["fits"] is True and kv["holds_max_position_embeddings"] is True
    # The pool: usable pages + the trash page, each 64 tokens x 78 x (latent + index K).
    pages = kv["tokens_per_rank"] // 64
    per_page = 64 * 78 * (GLM5_LATENT + GLM5_INDEX)
    assert kv["pool_bytes_per_rank"] == (pages + 1) * per_page
    assert kv["pool_bytes_per_rank"] <= kv["kv_budget_bytes"] < (pages + 2) * per_page
    assert kv["context_tokens_per_node"] == 8 * kv["tokens_per_rank"]
    assert kv["transient_full_view_bytes_at_node_context"] < kv["headroom_bytes"]


def test_weights_that_do_not_fit_leave_no_kv(weights):
    kv = weights["models"]["GLM-5-FP8"]["kv_tokens_per_rank_on_device"]
    cfg = ModelConfig.from_pretrained(config_dir("glm-5"))
    args = bm.parse_args(["--device-gb", "100"])  # 88 GB static < 112 GB of weights
    small = bm.kv_on_device(cfg, kv["weights_bytes"], kv["dequant_transient_bytes"], args)
    assert small["kv_budget_bytes"] < 0
    assert (small["tokens_per_rank"], small["pool_bytes_per_rank"]) == (0, 0)
    assert small["fits"] is False
    # The 141 GB pool is the one PoolLayout / per_rank_pool_bytes build.
    layout = PoolLayout(8, True, kv["tokens_per_rank"] // 64 + 1, 64)
    pool = bm.per_rank_pool_bytes(cfg, layout, jnp.bfloat16, "fp8_e4m3")
    assert pool == kv["pool_bytes_per_rank"]


def test_measured_weights_equal_predicted(tiny_fp8):
    """The tiny FP8 checkpoint loaded over 8 devices holds what bytes_per_device says."""
    m = bm.measure_tiny_weights(tiny_fp8)
    assert (m["measured"], m["ep_size"], m["n_routed_experts"]) == (True, 8, 16)
    assert m["leaves_mismatched"] == [] and m["leaves_missing"] == []
    per_device, predicted = m["per_device_weights_bytes"], m["predicted_weights_bytes_per_device"]
    for kind in ("routed_experts", "other", "total"):
        assert per_device[kind] == [predicted[kind]] * 8
    assert predicted["routed_experts"] * 8 == m["total_routed_expert_bytes"]
    assert m["measured_equals_predicted"] is True
