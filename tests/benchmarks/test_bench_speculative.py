"""benchmarks/bench_speculative: MTP draft-and-verify beside plain decoding in one run
(issue 39) - a smoke run on the tiny checkpoint's unfitted MTP layer; the figures (on the
fitted one) live in `docs/results.md`."""

from __future__ import annotations

import json

from benchmarks import bench_speculative as bs


def test_report_has_every_k_its_ratio_and_step_time(tiny_checkpoints, tmp_path):
    out = tmp_path / "r.json"
    argv = ["--model-dir", str(tiny_checkpoints()), "--num-steps", "1", "--repeats", "1"]
    assert bs.main([*argv, "--new-tokens", "3", "--step-repeats", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for name in ("fitting", "held_out"):
        rows = r["runs"][name]
        assert set(rows) == {"k=0", "k=1"}
        assert rows["k=0"]["speedup"] == 1.0 and rows["k=0"]["acceptance_length"] == 1.0
        assert rows["k=1"]["tokens_per_s"] > 0 and 1.0 <= rows["k=1"]["acceptance_length"] <= 2.0
    engine = r["engine"]  # through the serving engine
    assert set(engine) == {"k=0", "k=1"} and engine["k=0"]["speedup"] == 1.0
    assert engine["k=1"]["tokens_per_s"] > 0 and 1.0 <= engine["k=1"]["acceptance_length"] <= 2.0
    assert set(r["step_ms_one_row"]) == {"k=0", "k=1"}
    assert all(ms > 0 for ms in r["step_ms_one_row"].values())
