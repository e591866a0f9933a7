"""bench_host_overhead runs end to end (one small batch, both modes) and reports ratios."""

from __future__ import annotations

import json

from benchmarks.bench_host_overhead import main


def test_bench_host_overhead_reports_both_modes(capsys):
    assert main(["--batches", "2", "--steps", "3", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["overlap"]: r for r in out["rows"]}
    assert set(rows) == {False, True} and all(r["batch"] == 2 for r in rows.values())
    for r in rows.values():
        assert r["engine_ms"] > 0 and r["device_ms"] > 0
        assert abs(r["ratio"] - r["engine_ms"] / r["device_ms"]) < 0.01
