"""The GPU check scripts run end to end on CPU (`--allow-cpu`), so a GPU session finds
them working: `benchmarks.gpu_generate` and `benchmarks.gpu_kernels`."""

from __future__ import annotations

import json

from benchmarks import gpu_generate, gpu_kernels


def test_gpu_generate_refuses_to_run_without_a_gpu_unless_asked(capsys):
    assert gpu_generate.main([]) == 2
    assert "no GPU found" in capsys.readouterr().err


def test_gpu_generate_smoke_on_cpu(tmp_path, capsys):
    out = tmp_path / "gen.json"
    rc = gpu_generate.main(
        ["--allow-cpu", "--prompt-tokens", "21", "--new-tokens", "5", "--json", str(out)]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["ok"] and report == json.loads(out.read_text())
    assert set(report["runs"]) == {"cpu", "accelerator"}  # no CP runs without a GPU
    assert len(report["cpu_tokens"]) == 5
    # On CPU the "accelerator" run is the same backend: identical tokens and log-probs.
    assert report["runs"]["accelerator"]["max_logprob_diff_vs_cpu"] == 0.0


def test_gpu_kernels_quick_smoke_on_cpu(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert gpu_kernels.main(["--allow-cpu", "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["all_correct"]
    assert report["correctness"] and all(r["bitwise_equal"] for r in report["correctness"])
    assert report["in_model"]["ok"]
    # The indexer-scores section (interpret mode here): both cases, masks and sets equal.
    cases = report["index_scores"]
    assert report["index_scores_ok"] and [c["query_tokens"] for c in cases] == [1, 3]
    assert all(c["same_masks"] and c["same_topk_sets"] == 1.0 for c in cases)
    assert all(c["pages_used"] < c["table_pages"] for c in cases)
