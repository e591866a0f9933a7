"""bench_sampler runs end to end on a small vocabulary and reports every variant."""

from __future__ import annotations

import json

from benchmarks.bench_sampler import VARIANTS, main


def test_bench_sampler_reports_each_variant_against_plain(capsys):
    assert main(["--rows", "1", "4", "--vocab", "512", "--repeats", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["vocab"] == 512 and set(out["rows"]) == {"1", "4"}
    for by_variant in out["rows"].values():
        assert set(by_variant) == set(VARIANTS)
        assert by_variant["plain"]["vs_plain"] == 1.0
        assert all(v["median_ms"] > 0 for v in by_variant.values())
