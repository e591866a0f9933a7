"""`benchmarks.bench_hicache_ttft` runs end to end (tiny lengths, one device): every timed
repeat is a real host hit, and the report has the medians and both ratios."""

from __future__ import annotations

import json
import math

from benchmarks import bench_hicache_ttft


def test_small_run_reports_host_hits_and_ratios(tmp_path, capsys):
    out = tmp_path / "ttft.json"
    rc = bench_hicache_ttft.main(
        ["--cp", "1", "--lengths", "80", "--repeats", "1", "--chunk", "64", "--json", str(out)]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report == json.loads(out.read_text())
    (row,) = report["lengths"]
    assert row["length"] == 80 and row["host_hit_tokens_per_round"] == [64]  # 4 whole pages
    assert set(row["median_s"]) == {"recompute", "device_hit", "host_hit"}
    assert all(v > 0 for v in row["median_s"].values())
    for key in ("ratio_host_hit_over_recompute", "ratio_host_hit_over_device_hit"):
        assert math.isfinite(row[key]) and row[key] > 0


def test_too_few_devices_is_refused(capsys):
    assert bench_hicache_ttft.main(["--cp", "4096"]) == 2
    assert "needs 4096 devices" in capsys.readouterr().err


def test_dp_run_reports_host_hits_through_the_unified_dp_engine(capsys):
    """`--dp 2`: the unified DP engine with a host cache per rank; every timed repeat is
    a host hit loaded back into its rank's shard."""
    rc = bench_hicache_ttft.main(["--dp", "2", "--lengths", "80", "--repeats", "1"])
    report = json.loads(capsys.readouterr().out)
    (row,) = report["lengths"]
    assert rc == 0 and report["dp_size"] == 2
    assert row["host_hit_tokens_per_round"] == [64] and row["load_backs"] >= 1
    assert all(v > 0 for v in row["median_s"].values())
