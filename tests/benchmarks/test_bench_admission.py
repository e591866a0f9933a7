"""bench_admission runs end to end and reports what SPEC S9.5 asks for."""

from __future__ import annotations

import json

from benchmarks.bench_admission import main


def test_s9_5_admission_benchmark_reports_latency_batches_rejections_and_estimate(capsys):
    assert main(["--json", "--requests", "400", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    for side in ("gates", "baseline"):
        stats = out["decision_us"][side]
        assert 0 < stats["p50"] <= stats["p99"] <= stats["max"] and stats["count"] > 0
    assert out["decision_us"]["p99_ratio"] > 0
    assert out["batches"]["formed"] > 0
    assert sum(out["batches"]["size_histogram"].values()) == out["batches"]["formed"]
    assert set(out["rejections"]) <= {
        "total_tokens",
        "max_prefill_tokens",
        "chunk_tokens",
        "cp_shared_kv_bs1",
        "cp_max_batch_requests",
        "cp_max_total_extend_tokens",
        "cp_max_cached_tokens",
        "cp_max_buffer_size",
        "lane_capacity",
    }
    est = out["estimate_bytes"]
    assert est["limit"] > 0 and 0 < est["p50"] <= est["p90"] <= est["max"]
