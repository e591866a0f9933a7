"""benchmarks/bench_dp_decode: the DP decode step beside the single-device one, both
expert dispatches, in one run (issue 36) - a smoke run on the tiny widths; the figures
live in `docs/results.md`."""

from __future__ import annotations

import json

from benchmarks import bench_dp_decode as bd


def test_report_has_every_path_its_ratio_and_equal_logits(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--dp", "4", "--batches", "4", "--context", "40", "--hidden", "64"]
    argv += ["--experts", "8", "--repeats", "1", "--sampler-vocab", "1000"]
    assert bd.main([*argv, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "bench_dp_decode" and r["dp"] == 4
    (row,) = r["results"]
    assert row["batch"] == 4 and row["rows_per_rank"] == 1 and row["single_ms"] > 0
    for dispatch in ("allgather", "all_to_all"):
        assert row[f"dp_{dispatch}_vs_single"] > 0
        # float32, same rows: only the matmuls' row blocking may round differently.
        assert row[f"dp_{dispatch}_max_logit_diff"] < 1e-5, row
    # The draw where the rows are gives the tokens it gave with every row everywhere.
    assert row["sampler_tokens_equal"] and row["sampler_split_vs_replicated"] > 0
