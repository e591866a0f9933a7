"""benchmarks/bench_decode: the decode step's cost against context, sparse paged decode
beside the dense-view path (issue 35) - the report of a small CPU run at GLM-5's real
attention and indexer dims (one layer, hidden 128, contexts below top-k: a smoke run;
`docs/results.md` has the measured figures)."""

from __future__ import annotations

import json

from benchmarks import bench_decode as bd


def test_report_has_both_paths_their_ratios_and_equal_logits(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--contexts", "64", "192", "--batches", "2", "--layers", "1", "--hidden", "128"]
    assert bd.main([*argv, "--repeats", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "decode_step" and r["model"]["layers"] == 1
    assert {(x["path"], x["context"]) for x in r["rows"]} == {
        (p, c) for p in ("sparse", "dense") for c in (64, 192)
    }
    assert all(x["step_ms"] > 0 and x["batch"] == 2 and x["gbps"] > 0 for x in r["rows"])
    need = {x["context"]: x["min_bytes"] for x in r["rows"]}
    # 128 more cached tokens x 2 rows x 1 layer: index K (128 fp8 + a float32 scale) and,
    # below top-k (2048), 128 more float32 latent rows of 576.
    assert need[192] - need[64] == 2 * 128 * (132 + 576 * 4)
    assert set(r["ratios"]) == {
        "sparse_b2_192_over_64",
        "dense_b2_192_over_64",
        "dense_over_sparse_b2_64",
        "dense_over_sparse_b2_192",
    }
    # bf16 logits of order 1: the two paths read the same rows.
    assert set(r["checks"]) == {"max_logit_diff_b2_64", "max_logit_diff_b2_192"}
    assert max(r["checks"].values()) < 0.05, r["checks"]


def test_the_kernels_path_reports_its_ratio_to_sparse_and_its_logits(tmp_path):
    """`--paths sparse kernels` (the device check's third path; interpret mode here): a
    row per context, the ratio to the served sparse path, and logits that agree with it
    (the Pallas indexer's scores sum in another order: float32 rounding only)."""
    out = tmp_path / "k.json"
    argv = ["--contexts", "64", "192", "--batches", "1", "--layers", "1", "--hidden", "128"]
    assert (
        bd.main([*argv, "--paths", "sparse", "kernels", "--repeats", "1", "--json", str(out)]) == 0
    )
    r = json.loads(out.read_text())
    assert {(x["path"], x["context"]) for x in r["rows"]} == {
        (p, c) for p in ("sparse", "kernels") for c in (64, 192)
    }
    assert {"kernels_over_sparse_b1_64", "kernels_over_sparse_b1_192"} <= set(r["ratios"])
    assert set(r["checks"]) == {"max_logit_diff_kernels_b1_64", "max_logit_diff_kernels_b1_192"}
    assert max(r["checks"].values()) < 1e-3, r["checks"]
