"""`benchmarks.device_check`: the one GPU check entry point, without a GPU.

The refusal path, `--list`, and the step runner's bookkeeping (budget, time limits,
failures, missing modules, the summary JSON) with fake fast steps injected in place of
the GPU scripts; the headline figures from committed H200 results; one small buffer
estimator probe on CPU (the comparison the `buffer_estimator` step runs on the GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import device_check as dc

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
GPU = {"platform": "gpu", "device_kind": "NVIDIA H200", "backend": "gpu", "jax": "test"}
CPU = {"platform": "cpu", "device_kind": "cpu", "backend": "cpu", "jax": "test"}

WRITE_JSON = (
    "import json, sys; p = sys.argv[sys.argv.index('--json') + 1]; "
    "open(p, 'w').write(json.dumps({'value': 42}))"
)


def fake(name: str, code: str, *, limit_s: float = 20, min_s: float = 0, **kw) -> dc.Step:
    return dc.Step(
        name,
        f"fake.{name}",
        limit_s=limit_s,
        min_s=min_s,
        argv=(sys.executable, "-c", code),
        **kw,
    )


def run(tmp_path, steps, *extra, device=GPU):
    rc = dc.main(["--out-dir", str(tmp_path), *extra], steps=steps, probe=lambda: dict(device))
    (summary_path,) = tmp_path.glob("device_check_*.json")
    return rc, json.loads(summary_path.read_text()), summary_path


def by_name(summary):
    return {r["name"]: r for r in summary["steps"]}


def test_refuses_without_a_gpu_before_running_anything(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.device_check", "--out-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "no GPU found" in proc.stderr and "--allow-cpu" in proc.stderr
    assert "nothing was run" in proc.stderr
    assert not out.exists()  # no summary, no step output, not even the folder


def test_refusal_runs_no_step(tmp_path, capsys):
    marker = tmp_path / "ran"
    step = fake("would_run", f"open({str(marker)!r}, 'w')")
    rc = dc.main(["--out-dir", str(tmp_path / "o")], steps=[step], probe=lambda: dict(CPU))
    assert rc == 2
    assert "no GPU found" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "o").exists()


def test_list_prints_every_step_and_its_limit(capsys):
    assert dc.main(["--list"], probe=lambda: pytest.fail("--list must not probe")) == 0
    text = capsys.readouterr().out
    names = [
        "gpu_kernels",
        "gpu_generate",
        "bench_decode",
        "gpu_moe_gmm",
        "buffer_estimator",
        "decode_memory",
        "bench_host_copy",
        "bench_moe_ep",
        "bench_prefill",
        "bench_prefill_moe",
        "bench_hicache_ttft",
        "bench_speculative",
        "bench_restart",
    ]
    assert [s.name for s in dc.STEPS] == names  # correctness first
    for step in dc.STEPS:
        assert step.name in text and f"{step.limit_s:.0f}s" in text
    assert "bench_host_copy --gpu" in text and "--cp 1" in text
    assert "no --gpu flag" in text  # bench_hicache_ttft says how it reaches the GPU


def test_steps_run_in_order_with_limits_failures_and_missing_modules(tmp_path, capsys):
    steps = [
        fake("first", WRITE_JSON, headline=lambda r: f"value {r['value']}"),
        fake("sleeper", "import time; time.sleep(5)", limit_s=1),
        fake("broken", "import sys; print('boom at line 7', file=sys.stderr); sys.exit(3)"),
        dc.Step("absent", "benchmarks.no_such_module_here", limit_s=5, min_s=0),
        fake("after", WRITE_JSON),
    ]
    t0 = time.monotonic()
    rc, summary, path = run(tmp_path, steps, "--budget-s", "60")
    assert time.monotonic() - t0 < 20
    assert rc == 1  # a step failed / timed out
    steps_out = by_name(summary)
    assert list(steps_out) == ["first", "sleeper", "broken", "absent", "after"]
    first = steps_out["first"]
    assert first["status"] == "ok" and first["returncode"] == 0
    assert first["headline"] == "value 42"
    assert first["output"] == str(tmp_path / f"first_h200_{summary['date']}.json")
    assert json.loads(Path(first["output"]).read_text()) == {"value": 42}
    sleeper = steps_out["sleeper"]
    assert sleeper["status"] == "timeout" and sleeper["reason"] == "limit"
    assert sleeper["returncode"] is None and 0.9 < sleeper["seconds"] < 4
    broken = steps_out["broken"]
    assert broken["status"] == "failed" and broken["returncode"] == 3
    assert "boom at line 7" in broken["stderr_tail"]
    assert steps_out["absent"]["status"] == "missing"
    assert steps_out["after"]["status"] == "ok"  # the run went on
    assert summary["counts"] == {"ok": 2, "failed": 1, "timeout": 1, "skipped": 0, "missing": 1}
    assert summary["complete"] and not summary["ok"]
    assert "[timeout] sleeper" in capsys.readouterr().out


def test_budget_skips_later_steps_and_caps_the_running_one(tmp_path):
    steps = [
        fake("capped", "import time; time.sleep(30)", limit_s=60, min_s=1),
        fake("too_late", WRITE_JSON, min_s=10),
    ]
    t0 = time.monotonic()
    rc, summary, _ = run(tmp_path, steps, "--budget-s", "2")
    assert time.monotonic() - t0 < 12
    out = by_name(summary)
    assert out["capped"]["status"] == "timeout" and out["capped"]["reason"] == "budget"
    assert out["capped"]["timeout_s"] <= 2
    assert out["too_late"]["status"] == "skipped" and out["too_late"]["reason"] == "budget"
    assert "command" not in out["too_late"]  # never started
    assert rc == 1


def test_quick_variant_when_the_budget_is_short_or_asked(tmp_path):
    def step(name):
        return fake(
            name,
            WRITE_JSON,
            limit_s=100,
            min_s=1,
            gpu_args=("--full",),
            quick_args=("--quick",),
            quick_limit_s=10,
        )

    # 30 s left < 100 s full limit: quick.
    _, summary, _ = run(tmp_path / "a", [step("short")], "--budget-s", "30")
    rec = by_name(summary)["short"]
    assert rec["quick"] and "--quick" in rec["command"] and rec["timeout_s"] == 10
    # Plenty of budget: the full variant, unless --quick.
    _, summary, _ = run(tmp_path / "b", [step("full")], "--budget-s", "500")
    rec = by_name(summary)["full"]
    assert "--full" in rec["command"] and "quick" not in rec
    _, summary, _ = run(tmp_path / "c", [step("asked")], "--budget-s", "500", "--quick")
    assert by_name(summary)["asked"]["quick"]


def test_allow_cpu_runs_cpu_smoke_modes_and_skips_steps_without_one(tmp_path):
    steps = [
        fake("smoke", WRITE_JSON, cpu_args=("--smoke",)),
        fake("gpu_only", WRITE_JSON, cpu_args=None),
    ]
    rc, summary, _ = run(tmp_path, steps, "--allow-cpu", device=CPU)
    out = by_name(summary)
    assert rc == 0 and summary["allow_cpu"]
    assert out["smoke"]["status"] == "ok" and "--smoke" in out["smoke"]["command"]
    assert out["smoke"]["output"].endswith(f"smoke_cpu_{summary['date']}.json")
    assert out["gpu_only"]["status"] == "skipped"
    assert out["gpu_only"]["reason"] == "no CPU smoke mode"


def test_only_selects_steps_and_nothing_is_overwritten(tmp_path):
    steps = [fake("a", WRITE_JSON), fake("b", WRITE_JSON)]
    rc = dc.main(["--out-dir", str(tmp_path), "--only", "b"], steps=steps, probe=lambda: GPU)
    assert rc == 0
    assert dc.main(["--out-dir", str(tmp_path), "--only", "b"], steps=steps, probe=lambda: GPU) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    date = time.strftime("%Y-%m-%d")
    assert names == sorted(
        [
            f"b_h200_{date}.json",
            f"b_h200_{date}_run2.json",
            f"device_check_{date}.json",
            f"device_check_{date}_run2.json",
        ]
    )
    second = json.loads((tmp_path / f"device_check_{date}_run2.json").read_text())
    assert [r["name"] for r in second["steps"]] == ["b"]
    assert second["steps"][0]["output"].endswith("_run2.json")


def test_summary_schema(tmp_path):
    rc, summary, path = run(tmp_path, [fake("one", WRITE_JSON)], "--budget-s", "60")
    assert rc == 0 and path.name == f"device_check_{summary['date']}.json"
    assert {
        "tool",
        "argv",
        "date",
        "device",
        "device_slug",
        "allow_cpu",
        "quick",
        "budget_s",
        "complete",
        "elapsed_s",
        "steps",
        "counts",
        "ok",
    } <= set(summary)
    assert summary["device"]["device_kind"] == "NVIDIA H200" and summary["device_slug"] == "h200"
    assert set(summary["counts"]) == set(dc.STATUSES)
    (rec,) = summary["steps"]
    assert {"name", "module", "status", "seconds", "limit_s", "timeout_s", "command"} <= set(rec)
    assert {"returncode", "output", "headline"} <= set(rec)
    assert rec["status"] in dc.STATUSES and "stderr_tail" not in rec  # tails for failures only


def test_device_slug():
    assert dc.device_slug("NVIDIA H200") == "h200"
    assert dc.device_slug("cpu") == "cpu"
    assert dc.device_slug("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"


@pytest.mark.parametrize(
    "name, path, expect",
    [
        ("gpu_kernels", "gpu_kernels_h200_2026-11-30_run1.json", "all_correct=True"),
        ("gpu_generate", "gpu_generate_h200_2026-11-30_b885578.json", "tokens equal CPU in 4/4"),
        ("bench_host_copy", "bench_host_copy_cpu_2026-12-02.json", "LPF backup"),
        ("bench_moe_ep", "bench_moe_ep_cpu_2026-12-02.json", "tokens"),
        ("bench_hicache_ttft", "bench_hicache_ttft_cpu_2026-12-02.json", "x recompute"),
        ("bench_decode", "bench_decode_cpu_2026-12-04.json", "sparse_b8_32768_over_2048 3.94x"),
        ("decode_memory", "decode_memory_cpu_2026-12-05.json", "+37.10 GiB per MoE layer (3.96x"),
        ("decode_memory", "decode_memory_cpu_2026-12-07.json", "bytes accessed 3.06x"),
        (
            "bench_speculative",
            "speculative_cpu_2026-12-05.json",
            "k=3 acceptance 2.30 1.23x; serving engine k=1 1.99x",
        ),
    ],
)
def test_headlines_of_committed_results(name, path, expect):
    step = {s.name: s for s in dc.STEPS}[name]
    text = step.headline(json.loads((RESULTS / path).read_text()))
    assert expect in text, text


def test_prefill_headline():
    report = {
        "checks_ok": True,
        "cases": [{"tokens": 4096, "per_layer_ms": {"cp1": 12.5}}],
    }
    step = {s.name: s for s in dc.STEPS}["bench_prefill"]
    assert step.headline(report) == "checks_ok=True; 4096 tokens: ms/layer cp1 12.5"


def test_estimator_check_on_cpu_is_an_upper_bound():
    """One probe of the comparison the `buffer_estimator` step runs on the GPU, here with
    the CPU profile on CPU (one device, CP=1), so the probe program is known to lower."""
    report = dc.estimator_check(
        real_step=False,
        tiny_batches={"two_prompts": [(200, 0), (50, 0)]},
        sequences=[("full", "shared")],
        dtypes=["float32"],
    )
    assert report["profile"] == "xla_cpu" and report["platform"] == "cpu"
    (probe,) = report["probes"]
    assert probe["upper_bound"], probe
    assert probe["xla_cp_bytes"] > 0 and probe["temp_size_in_bytes"] > 0
    assert "estimate >= XLA in 1/1" in dc._hl_estimator(report)


def test_sigterm_stops_the_running_step_and_writes_the_summary(tmp_path):
    """The wrapper's `timeout` sends SIGTERM: the step's process group goes too (no step
    left running on the GPU) and the summary says what happened."""
    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    script = (
        "import sys; from benchmarks import device_check as dc\n"
        f"steps = [dc.Step('sleeper', 'fake', limit_s=60, min_s=0, argv=(sys.executable, '-c', "
        f"{child!r})), dc.Step('next', 'fake', limit_s=60, min_s=0, argv=(sys.executable, '-c', "
        "'pass'))]\n"
        f"sys.exit(dc.main(['--out-dir', {str(tmp_path)!r}], steps=steps, "
        "probe=lambda: {'platform': 'gpu', 'device_kind': 'NVIDIA H200'}))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.terminate()
    assert proc.wait(timeout=20) == 124
    child_pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)
    (path,) = tmp_path.glob("device_check_*.json")
    summary = json.loads(path.read_text())
    assert summary["terminated"] and not summary["complete"]
    assert [(r["name"], r["status"]) for r in summary["steps"]] == [
        ("sleeper", "timeout"),
        ("next", "skipped"),
    ]
