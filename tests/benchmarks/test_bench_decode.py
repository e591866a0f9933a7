"""benchmarks/bench_decode: the decode step's cost against context, sparse paged decode
beside the dense-view path (issue 35) - the report of a small CPU run at GLM-5's real
attention and indexer dims (one layer, hidden 128, contexts below top-k: a smoke run;
`docs/results.md` has the measured figures)."""

from __future__ import annotations

import json

from benchmarks import bench_decode as bd


def test_report_has_every_path_its_ratios_and_equal_logits(tmp_path):
    """The sparse and dense paths and the Pallas kernels' path (`--kernel-impl pallas`,
    the device check's third path; interpret mode here) in one run."""
    out = tmp_path / "r.json"
    argv = ["--contexts", "64", "192", "--batches", "2", "--layers", "1", "--hidden", "128"]
    paths = ["--paths", "sparse", "dense", "kernels"]
    assert bd.main([*argv, *paths, "--repeats", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "decode_step" and r["model"]["layers"] == 1
    assert {(x["path"], x["context"]) for x in r["rows"]} == {
        (p, c) for p in ("sparse", "dense", "kernels") for c in (64, 192)
    }
    assert all(x["step_ms"] > 0 and x["batch"] == 2 and x["gbps"] > 0 for x in r["rows"])
    need = {x["context"]: x["min_bytes"] for x in r["rows"]}
    # 128 more cached tokens x 2 rows x 1 layer: index K (128 fp8 + a float32 scale) and,
    # below top-k (2048), 128 more float32 latent rows of 576.
    assert need[192] - need[64] == 2 * 128 * (132 + 576 * 4)
    assert set(r["ratios"]) == {f"{p}_b2_192_over_64" for p in ("sparse", "dense", "kernels")} | {
        f"{p}_over_sparse_b2_{c}" for p in ("dense", "kernels") for c in (64, 192)
    }
    # float32 logits of order 1: the dense path reads the same rows; the kernels' indexer
    # sums its scores in another order (float32 rounding only).
    assert set(r["checks"]) == {
        f"max_logit_diff{k}_b2_{c}" for k in ("", "_kernels") for c in (64, 192)
    }
    assert max(r["checks"].values()) < 1e-3, r["checks"]
