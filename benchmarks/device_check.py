"""Every GPU figure the project keeps, in one go: one command for a GPU session.

    python -m benchmarks.device_check [--out-dir benchmarks/results] [--budget-s 450]
        [--only NAME ...] [--quick] [--list] [--allow-cpu]
    benchmarks/device_check.sh [same flags]     (the same under a hard `timeout`)

Each step is one subprocess (`python -m <module> <flags>`) with its own time limit,
steps in order of value (correctness first; `--list` prints them with their limits):

- `gpu_kernels`: Pallas paged gather compiled for the GPU vs the XLA reference
  (bitwise), in the model, and timed at GLM-5 sizes (`--quick` when the budget is short);
- `gpu_generate`: prefill + paged decode on the GPU vs on the CPU (tokens, log-probs);
- `bench_decode`: the decode step at GLM-5 attention dims against context, sparse paged
  decode beside the dense view (logits compared), each step's time against the bytes it
  must read (`gbps`: the HBM roofline);
- `gpu_moe_gmm`: the MoE expert matmul, `jax.lax.ragged_dot` (which XLA:GPU expands into
  a dense matmul over every local expert) against JAX's Mosaic GPU grouped matmul;
- `decode_memory`: XLA's temporaries of the decode step at GLM-5 dims, and how they grow
  with one more MoE layer (issue 36: the decode step's buffers the memory plan lacks);
- `buffer_estimator`: the admission gate's `XLA_GPU` profile vs XLA's compiled memory on
  the GPU (this module, `--estimator-check`; see `estimator_check`);
- `bench_host_copy`: host-cache LF <-> LPF copy kernels compiled on the GPU vs memcpy;
- `bench_moe_ep`: one GLM-5-size MoE layer, FP8 dequant-in-step vs bf16;
- `bench_prefill`: CP1 prefill TTFT at GLM-5 dims (one layer with a dense FFN, 4K and
  16K; the CP8 variants need 8 GPUs and are reported skipped by the script itself);
- `bench_prefill_moe`: the same at 4K with the MoE FFN (256 experts, which `ragged_dot`
  could not compile; now tiled past `moe.DENSE_EXPANSION_BYTES`);
- `bench_hicache_ttft`: TTFT of a repeated prompt from the host cache vs recomputed,
  `--cp 1` (the script has no `--gpu` flag: it runs on JAX's default backend);
- `bench_restart`: a unified server's time to healthy, cold vs with the compilation cache.

First run: H200, 2026-12-04 (`docs/results.md`, "GPU check").

A step that fails or times out is recorded (exit status, the tail of its stderr) and the
run goes on. The budget (`--budget-s`, counted from the start) is shared: a step runs
with `min(its limit, what is left)` and is skipped (reason "budget") when less than its
minimum is left; a step with a quick variant (`gpu_kernels --quick`) runs it with
`--quick` or when the full limit would not leave every later step its minimum. A
module that does not exist is recorded as "missing".

Output, in `--out-dir`: each step's JSON as `<name>_<device>_<date>.json` (the step's
own `--json`; device from `jax.devices()[0].device_kind`, e.g. `h200`), and the summary
`device_check_<date>.json` (every step: status ok / failed / timeout / skipped / missing,
seconds, output file, a one-line headline figure, the stderr tail of a failure),
rewritten after every step so a killed run leaves what it did. An existing file is never
overwritten (`_run2`, `_run3`, ... are appended). Exit status: 2 without a GPU (before
anything runs; `--allow-cpu` runs the steps' CPU smoke modes instead, for tests), 1 when a
step failed or timed out, else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_OUT_DIR = "benchmarks/results"
DEFAULT_BUDGET_S = 450.0
STATUSES = ("ok", "failed", "timeout", "skipped", "missing")
TAIL_CHARS = 3000
KILL_GRACE_S = 5.0


# ---- headline figures (one line from a step's JSON) ------------------------------------
def _hl_gpu_kernels(r: dict[str, Any]) -> str:
    parts = [f"all_correct={r['all_correct']}"]
    for row in r.get("timing", []):
        block, best = max(row["pallas"].items(), key=lambda kv: kv[1]["ratio_to_xla"])
        parts.append(
            f"{row['layout']} Pallas {best['ratio_to_xla']:.2f}x XLA speed "
            f"({best['gbps']:.0f} GB/s, ppb {block})"
        )
    for row in r.get("index_scores", []):
        parts.append(
            f"index scores b{row['rows']} t{row['query_tokens']} {row['context']}: "
            f"{row['xla_over_kernel']:.2f}x XLA view speed"
        )
    return "; ".join(parts)


def _hl_moe_gmm(r: dict[str, Any]) -> str:
    parts = [f"mosaic_ok={r['mosaic_ok']}"]
    for c in r["cases"]:
        ratio = c.get("xla_over_mosaic")
        xla = f"{ratio:.1f}x mosaic" if ratio else f"xla {c.get('xla_ms') or 'not run'}"
        parts.append(f"{c['matmul']} t{c['tokens']} e{c['experts']}: {xla}")
    return "; ".join(parts)


def _hl_gpu_generate(r: dict[str, Any]) -> str:
    runs = r["runs"]
    same = sum(bool(v["tokens_equal_cpu"]) for v in runs.values())
    diff = max(v["max_logprob_diff_vs_cpu"] for v in runs.values())
    text = f"ok={r['ok']}; tokens equal CPU in {same}/{len(runs)} runs; max log-prob diff"
    text += f" {diff:.1e}"
    if "pallas_vs_xla_logprobs_bitwise" in r:
        text += f"; Pallas vs XLA bitwise {r['pallas_vs_xla_logprobs_bitwise']}"
    return text


def _hl_decode(r: dict[str, Any]) -> str:
    parts = [f"max logit diff {max(r['checks'].values(), default=0.0):.1e}"]
    parts += [f"{k} {v:.2f}x" for k, v in r["ratios"].items() if k.startswith("sparse_")]
    kernels = [v for k, v in r["ratios"].items() if k.startswith("kernels_over_sparse")]
    if kernels:
        parts.append(f"kernels/sparse {min(kernels):.2f}-{max(kernels):.2f}x")
    best = max((x for x in r["rows"] if x["path"] == "sparse"), key=lambda x: x["gbps"])
    parts.append(
        f"sparse {best['gbps']:.0f} GB/s of min bytes at b{best['batch']} {best['context']}"
    )
    return "; ".join(parts)


def _hl_host_copy(r: dict[str, Any]) -> str:
    parts = [f"bitwise={r['bitwise_round_trip_all']}"]
    for case in r["cases"]:
        for direction in ("backup", "load"):
            for name, row in case[direction].items():
                if name.startswith("layer_page_first_pallas"):
                    ratio = row["ratio_vs_memcpy"]
                    parts.append(f"{case['pages']} pages LPF {direction} {ratio:.2f}x memcpy")
    return "; ".join(parts)


def _hl_moe_ep(r: dict[str, Any]) -> str:
    parts = []
    for case in r["cases"]:
        if "fp8_over_bf16" in case:
            parts.append(f"{case['tokens']} tokens FP8/bf16 {case['fp8_over_bf16']:.2f}x time")
        elif "variants" in case:  # the CPU mesh mode
            ep = case["variants"].get("ep_all_to_all", {}).get("ratio_vs_replicated")
            text = f"{case['tokens']} tokens EP a2a/replicated"
            parts.append(f"{text} {ep:.2f}x time" if ep is not None else text)
    return "; ".join(parts) or "no cases"


def _hl_prefill(r: dict[str, Any]) -> str:
    parts = [f"checks_ok={r['checks_ok']}"]
    for case in r["cases"]:
        per_layer = case.get("per_layer_ms", {})
        figures = ", ".join(f"{n} {ms:.1f}" for n, ms in per_layer.items())
        parts.append(f"{case['tokens']} tokens: ms/layer {figures}")
    return "; ".join(parts)


def _hl_hicache(r: dict[str, Any]) -> str:
    return "; ".join(
        f"{row['length']} tokens host hit {row['ratio_host_hit_over_recompute']:.2f}x recompute"
        for row in r["lengths"]
    )


def _hl_estimator(r: dict[str, Any]) -> str:
    probes = r["probes"]
    bound = sum(p["upper_bound"] for p in probes)
    ratios = [p["ratio"] for p in probes]
    text = (
        f"{r['profile']}: estimate >= XLA in {bound}/{len(probes)} CP-buffer probes, "
        f"estimate/XLA {min(ratios):.2f}-{max(ratios):.2f}x"
    )
    steps = r.get("real_steps", [])
    if steps:
        step_ratios = [s["ratio_to_temp"] for s in steps]
        text += f"; real tiny step: estimate/temp {min(step_ratios):.2f}-{max(step_ratios):.2f}x"
    return text


def _hl_decode_memory(r: dict[str, Any]) -> str:
    worst = max(r["growth"], key=lambda g: g["temp_per_moe_layer"])
    return (
        f"temp +{worst['temp_per_moe_layer'] / 2**30:.2f} GiB per MoE layer "
        f"({worst['temp_over_weights']:.2f}x its weights) at {worst['rows']} rows, "
        f"{worst['context']} tokens; bytes accessed "
        f"{worst.get('accessed_over_weights', float('nan')):.2f}x its weights (1.0: read once)"
    )


def _hl_speculative(r: dict[str, Any]) -> str:
    rows = r["runs"]["fitting"]
    text = ", ".join(
        f"{k} acceptance {v['acceptance_length']:.2f} {v['speedup']:.2f}x"
        for k, v in rows.items()
        if k != "k=0"
    )
    engine = r.get("engine", {})  # the serving engine against the plain engine
    speedups = [f"{k} {v['speedup']:.2f}x" for k, v in engine.items() if k != "k=0"]
    return text + (f"; serving engine {', '.join(speedups)}" if speedups else "")


# ---- steps ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Step:
    """One subprocess of the check: `python -m module *args [json_arg PATH]`.

    `gpu_args` None: the script has no GPU mode (skipped on a GPU); `cpu_args` None: no CPU
    smoke mode (skipped under `--allow-cpu`). `quick_args` (with `quick_limit_s`) replace
    `gpu_args` when the budget is short or with `--quick`. `min_s`: the least time the
    step is started with. `argv` replaces the whole command but the JSON flag (tests).
    """

    name: str
    module: str
    limit_s: float
    min_s: float
    gpu_args: tuple[str, ...] | None = ()
    cpu_args: tuple[str, ...] | None = None
    quick_args: tuple[str, ...] | None = None
    quick_limit_s: float | None = None
    json_arg: str | None = "--json"
    what: str = ""
    headline: Callable[[dict[str, Any]], str] | None = None
    argv: tuple[str, ...] | None = None


STEPS: tuple[Step, ...] = (
    Step(
        "gpu_kernels",
        "benchmarks.gpu_kernels",
        limit_s=150,
        min_s=45,
        gpu_args=(),
        quick_args=("--quick",),
        quick_limit_s=60,
        cpu_args=("--allow-cpu", "--quick"),
        what="Pallas paged gather vs XLA reference (bitwise), in the model, GLM-5-size "
        "timings; the paged indexer-scores kernel vs the XLA view path at GLM-5 dims",
        headline=_hl_gpu_kernels,
    ),
    Step(
        "gpu_generate",
        "benchmarks.gpu_generate",
        limit_s=120,
        min_s=45,
        gpu_args=(),
        cpu_args=("--allow-cpu", "--prompt-tokens", "21", "--new-tokens", "5"),
        what="generation on the GPU (single device, CP1 xla/pallas) vs the CPU",
        headline=_hl_gpu_generate,
    ),
    Step(
        "bench_decode",
        "benchmarks.bench_decode",
        limit_s=150,
        min_s=45,
        gpu_args=(
            "--dtype",
            "bfloat16",
            "--contexts",
            "2048",
            "32768",
            "131072",
            "--batches",
            "1",
            "8",
            "32",
            "--paths",
            "sparse",
            "dense",
            "kernels",
        ),
        cpu_args=("--contexts", "64", "192", "--batches", "2", "--layers", "1", "--hidden", "128"),
        what="decode step vs context at GLM-5 attention dims, sparse vs dense view vs the "
        "Pallas kernels (paged indexer scores), vs min bytes",
        headline=_hl_decode,
    ),
    Step(
        "gpu_moe_gmm",
        "benchmarks.gpu_moe_gmm",
        limit_s=150,
        min_s=45,
        gpu_args=(),
        cpu_args=("--allow-cpu",),
        what="MoE expert matmul: lax.ragged_dot (XLA expands it densely) vs Mosaic GPU grouped",
        headline=_hl_moe_gmm,
    ),
    Step(
        "buffer_estimator",
        "benchmarks.device_check",
        limit_s=150,
        min_s=30,
        gpu_args=("--estimator-check",),
        cpu_args=("--estimator-check",),
        what="buffer estimator's GPU profile vs XLA compiled memory (CP=1, tiny + GLM-5 dims)",
        headline=_hl_estimator,
    ),
    Step(
        "decode_memory",
        "benchmarks.decode_memory",
        limit_s=150,
        min_s=40,
        gpu_args=("--layers", "4", "5", "--rows", "1", "32", "--contexts", "4096", "131072"),
        cpu_args=(
            *("--layers", "4", "5", "--rows", "2", "--contexts", "256"),
            *("--hidden", "256", "--experts", "16", "--intermediate", "128"),
        ),
        what="XLA's temporaries of the decode step at GLM-5 dims, growth per MoE layer",
        headline=_hl_decode_memory,
    ),
    Step(
        "bench_host_copy",
        "benchmarks.bench_host_copy",
        limit_s=90,
        min_s=30,
        gpu_args=("--gpu", "--index"),
        cpu_args=("--index", "--pages", "8", "--layers", "1", "--repeats", "1", "--warmup", "0"),
        what="host-cache LF<->LPF copy kernels compiled on the GPU vs memcpy (bitwise)",
        headline=_hl_host_copy,
    ),
    Step(
        "bench_moe_ep",
        "benchmarks.bench_moe_ep",
        limit_s=120,
        min_s=40,
        gpu_args=("--gpu",),
        cpu_args=("--tokens", "64", "--repeats", "1", "--warmup", "0"),
        what="GLM-5-size MoE layer (32 local experts), FP8 dequant-in-step vs bf16",
        headline=_hl_moe_ep,
    ),
    Step(
        "bench_prefill",
        "benchmarks.bench_prefill",
        limit_s=150,
        min_s=45,
        # Dense FFN: with the MoE FFN the 4K step's compile asks for 96 GiB on an H200
        # (XLA:GPU's dense `ragged_dot`, see gpu_moe_gmm); the attention is what it times.
        gpu_args=("--gpu", "--ffn", "dense", "--lengths", "4096", "16384", "--repeats", "3"),
        cpu_args=("--lengths", "256", "--chunk", "256", "--layers", "1", "--repeats", "1"),
        what="CP1 prefill TTFT at GLM-5 real dims, one layer, dense FFN (CP8 needs 8 GPUs)",
        headline=_hl_prefill,
    ),
    Step(
        "bench_prefill_moe",
        "benchmarks.bench_prefill",
        limit_s=120,
        min_s=45,
        # The MoE FFN whose `ragged_dot` compile asked for 96 GiB (2026-12-04): its 256
        # experts now run tile by tile past `moe.DENSE_EXPANSION_BYTES`. Does it compile,
        # and at what time per layer?
        gpu_args=("--gpu", "--ffn", "moe", "--lengths", "4096", "--repeats", "3"),
        cpu_args=None,
        what="CP1 prefill at GLM-5 real dims, one MoE layer (256 experts, tiled)",
        headline=_hl_prefill,
    ),
    Step(
        "bench_hicache_ttft",
        "benchmarks.bench_hicache_ttft",
        limit_s=150,
        min_s=45,
        gpu_args=("--cp", "1", "--lengths", "4096", "16384", "--repeats", "3"),
        cpu_args=("--cp", "1", "--lengths", "256", "--repeats", "1"),
        what=(
            "TTFT host-cache hit vs recompute vs device hit, CP1 (no --gpu flag: default backend)"
        ),
        headline=_hl_hicache,
    ),
    Step(
        "bench_speculative",
        "benchmarks.bench_speculative",
        limit_s=200,
        min_s=90,
        gpu_args=("--repeats", "5"),
        cpu_args=None,  # the fit takes minutes on CPU; its CPU figures are committed
        what="MTP draft-and-verify vs plain decoding on the fitted tiny checkpoint, k = 1..3",
        headline=_hl_speculative,
    ),
    Step(
        "bench_restart",
        "benchmarks.bench_restart",
        limit_s=240,
        min_s=90,
        gpu_args=("--mode", "null"),
        cpu_args=None,  # two server starts: minutes on CPU, measured there separately
        what="unified server time to healthy, cold vs with the compilation cache warm",
        headline=lambda r: (
            f"{r['first_start_s']:.0f} s cold, {r['second_start_s']:.0f} s warm "
            f"({r['speedup']:.1f}x)"
        ),
    ),
)


def module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def device_slug(device_kind: str) -> str:
    """`NVIDIA H200` -> `h200`, `cpu` -> `cpu`."""
    kind = re.sub(r"^nvidia\s+", "", device_kind.strip().lower())
    return re.sub(r"[^a-z0-9]+", "_", kind).strip("_") or "unknown"


def unique_path(path: Path) -> Path:
    """`path`, or `<stem>_runN<suffix>` for the first N >= 2 that does not exist yet."""
    if not path.exists():
        return path
    n = 2
    while (candidate := path.with_name(f"{path.stem}_run{n}{path.suffix}")).exists():
        n += 1
    return candidate


_PROBE = (
    "import json, jax; d = jax.devices()[0]; print(json.dumps({'platform': d.platform, "
    "'device_kind': str(d.device_kind), 'device_count': jax.device_count(), "
    "'backend': jax.default_backend(), 'jax': jax.__version__}))"
)


def probe_device(timeout_s: float = 120.0) -> dict[str, Any]:
    """JAX's first device, asked in a subprocess: this process never opens the GPU (a
    JAX client here would preallocate most of its memory under every step)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s
    )
    if proc.returncode != 0:
        raise RuntimeError(f"could not query JAX devices: {proc.stderr[-TAIL_CHARS:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class _Terminated(Exception):
    """SIGTERM (e.g. the wrapper's `timeout`): stop the running step, write the summary."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def _kill_group(proc: subprocess.Popen) -> None:
    """End the step's process group (it was started in its own session): TERM, then KILL."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(f, chars: int = TAIL_CHARS) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - 4 * chars))  # utf-8: at most 4 bytes a character
    return f.read().decode("utf-8", "replace")[-chars:]


def run_command(argv: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """Run `argv` in its own session with a time limit; returncode None = timed out."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = None
        except BaseException:
            _kill_group(proc)
            raise
        seconds = time.monotonic() - t0
        return {
            "returncode": rc,
            "seconds": seconds,
            "stdout": _tail(out, 1 << 22),
            "stderr": _tail(err),
        }


def _last_json_line(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        return value if isinstance(value, dict) else None
    return None


@dataclasses.dataclass
class Plan:
    out_dir: Path
    budget_s: float
    slug: str
    date: str
    cpu: bool
    quick: bool


def run_step(step: Step, plan: Plan, remaining_s: float, later_min_s: float) -> dict[str, Any]:
    """One step's record (never raises for the step's own failure)."""
    rec: dict[str, Any] = {"name": step.name, "module": step.module, "limit_s": step.limit_s}
    args = step.cpu_args if plan.cpu else step.gpu_args
    limit = step.limit_s
    if args is None:
        mode = "CPU smoke" if plan.cpu else "GPU"
        return {**rec, "status": "skipped", "reason": f"no {mode} mode", "seconds": 0.0}
    if step.argv is None and not module_exists(step.module):
        return {**rec, "status": "missing", "reason": f"no module {step.module}", "seconds": 0.0}
    short = remaining_s < step.limit_s + later_min_s
    if not plan.cpu and step.quick_args is not None and (plan.quick or short):
        args, limit = step.quick_args, step.quick_limit_s or step.limit_s
        rec["quick"] = True
    if remaining_s < step.min_s:
        return {
            **rec,
            "status": "skipped",
            "reason": "budget",
            "detail": f"{remaining_s:.0f} s left, needs {step.min_s:.0f} s",
            "seconds": 0.0,
        }
    timeout = min(limit, remaining_s)
    out: Path | None = None
    argv = list(step.argv) if step.argv is not None else [sys.executable, "-m", step.module]
    argv += list(args)
    if step.json_arg:
        out = unique_path(plan.out_dir / f"{step.name}_{plan.slug}_{plan.date}.json")
        argv += [step.json_arg, str(out)]
    rec.update(command=argv, timeout_s=round(timeout, 1))
    res = run_command(argv, timeout)
    rec["seconds"] = round(res["seconds"], 2)
    rec["returncode"] = res["returncode"]
    if res["returncode"] is None:
        rec["status"] = "timeout"
        rec["reason"] = "budget" if timeout < limit else "limit"
    else:
        rec["status"] = "ok" if res["returncode"] == 0 else "failed"
    report = None
    if out is not None and out.is_file():
        try:
            report = json.loads(out.read_text())
        except ValueError:
            report = None
    elif out is not None and res["returncode"] == 0:
        report = _last_json_line(res["stdout"])  # a script that printed but did not write
        if report is not None:
            out.write_text(json.dumps(report, indent=1))
    rec["output"] = str(out) if out is not None and out.is_file() else None
    rec["headline"] = None
    if report is not None and step.headline is not None:
        try:
            rec["headline"] = step.headline(report)
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
            rec["headline"] = f"(no headline: {type(e).__name__}: {e})"
    if rec["status"] != "ok":
        rec["stderr_tail"] = res["stderr"]
        rec["stdout_tail"] = res["stdout"][-TAIL_CHARS // 3 :]
    return rec


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(path)


def run_all(
    steps: Sequence[Step], plan: Plan, device: dict[str, Any], start: float, argv: Sequence[str]
) -> tuple[dict[str, Any], Path]:
    """Run `steps` in order under the budget; returns the summary and its path."""
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    path = unique_path(plan.out_dir / f"device_check_{plan.date}.json")
    summary: dict[str, Any] = {
        "tool": "benchmarks.device_check",
        "argv": list(argv),
        "date": plan.date,
        "device": device,
        "device_slug": plan.slug,
        "allow_cpu": plan.cpu,
        "quick": plan.quick,
        "budget_s": plan.budget_s,
        "complete": False,
        "steps": [],
    }
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    done = 0
    try:
        for i, step in enumerate(steps):
            remaining = plan.budget_s - (time.monotonic() - start)
            later = sum(s.min_s for s in steps[i + 1 :])
            step_start = time.monotonic()
            try:
                rec = run_step(step, plan, remaining, later)
            except _Terminated:
                seconds = round(time.monotonic() - step_start, 2)
                summary["steps"].append(
                    {
                        "name": step.name,
                        "module": step.module,
                        "status": "timeout",
                        "reason": "terminated",
                        "seconds": seconds,
                    }
                )
                done = i + 1
                raise
            summary["steps"].append(rec)
            done = i + 1
            summary["elapsed_s"] = round(time.monotonic() - start, 1)
            write_summary(path, summary)
            print(_line(rec), flush=True)
        summary["complete"] = True
    except _Terminated:
        summary["terminated"] = True
        summary["steps"] = summary["steps"][:done]
        summary["steps"] += [
            {"name": s.name, "module": s.module, "status": "skipped", "reason": "terminated"}
            for s in steps[done:]
        ]
    finally:
        signal.signal(signal.SIGTERM, previous)
    summary["elapsed_s"] = round(time.monotonic() - start, 1)
    summary["counts"] = {s: sum(r["status"] == s for r in summary["steps"]) for s in STATUSES}
    summary["ok"] = summary["counts"]["failed"] == summary["counts"]["timeout"] == 0
    write_summary(path, summary)
    return summary, path


def _line(rec: dict[str, Any]) -> str:
    text = f"[{rec['status']:>7}] {rec['name']:<20} {rec.get('seconds', 0.0):7.1f} s"
    if rec.get("reason"):
        text += f"  ({rec['reason']})"
    if rec.get("headline"):
        text += f"  {rec['headline']}"
    return text


def list_steps(steps: Sequence[Step]) -> str:
    lines = [
        f"{'step':<20} {'limit':>6} {'min':>5}  command on a GPU (+ --json "
        "<out-dir>/<step>_<device>_<date>.json)"
    ]
    for s in steps:
        if s.gpu_args is None:
            cmd = "(no GPU mode)"
        else:
            cmd = " ".join(["python -m", s.module, *s.gpu_args])
        lines.append(f"{s.name:<20} {s.limit_s:>5.0f}s {s.min_s:>4.0f}s  {cmd}")
        if s.quick_args is not None:
            lines.append(f"{'':<35}quick: {' '.join(s.quick_args)} ({s.quick_limit_s:.0f}s)")
        cpu = "(none)" if s.cpu_args is None else " ".join(s.cpu_args) or "(no flags)"
        lines.append(f"{'':<35}--allow-cpu: {cpu}")
        if s.what:
            lines.append(f"{'':<35}{s.what}")
    return "\n".join(lines)


# ---- the buffer estimator against XLA on this device -------------------------------------
# Candidate batches, (extend tokens, cached prefix tokens) per request.
TINY_BATCHES = {
    "two_prompts": [(200, 0), (50, 0)],
    "long_prefix": [(16, 1000)],
    "long_extend": [(533, 0)],
    "ragged_3": [(300, 100), (20, 500), (5, 0)],
}
GLM5_BATCHES = {
    "chunk_4k": [(4096, 0)],
    "chunk_16k": [(16384, 0)],
    "chunk_16k_after_48k": [(16384, 49152)],
    "tail_512_after_128k": [(512, 131072)],
    "four_2k": [(2048, 0)] * 4,
}
TINY_PAGE, GLM5_PAGE = 16, 64
XLA_SCALARS = 64  # XLA's own scalars / tuple tables, not modelled (as the CPU calibration)


def _two_layer_cfg(cfg, types: tuple[str, ...]):
    return dataclasses.replace(
        cfg,
        num_hidden_layers=len(types),
        indexer_types=types,
        mlp_layer_types=cfg.mlp_layer_types[: len(types)],
    )


def probe_cp_buffers(
    mesh, cfg, shape, types: tuple[str, ...], *, pages_per_rank: int, dtype, block_bytes: int
) -> dict[str, int]:
    """XLA's bytes for the CP-specific ops of a layer sequence on `mesh` (compiled only).

    The same program as `tests/serving/test_buffer_estimator.py::probe_layers`, for any cp:
    per layer `CPKVIO.write` of the new latent rows (full layers: fp8 index K and its scale
    too), `CPKVIO.view` of the index K -> `dequantize_index_k` -> `indexer_topk` (the
    model's blocked indexer), `CPKVIO.view` of the latent and the float32 rows sparse
    attention gathers for the top-k, per token block as `sparse_attention` runs
    (`block_rows`), a dot standing in for attention; each layer's new rows depend on the
    previous layer's output, so XLA runs them in order. Pools are donated. XLA's CP
    bytes = temp + outputs - aliased - the attention stand-in's output + the metadata
    arguments (the page table and token maps the estimator counts).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from cpkv_jax.buckets import block_rows
    from cpkv_jax.materialize import CPKVIO
    from cpkv_jax.mesh import CP_AXIS
    from cpkv_jax.model.indexer import indexer_topk
    from cpkv_jax.model.kv_cache import dequantize_index_k, take_view_rows
    from cpkv_jax.model.numerics import tokenwise

    cp, page = shape.cp_size, shape.page_size
    f32, i32, f8 = jnp.float32, jnp.int32, jnp.float8_e4m3fn
    sds = jax.ShapeDtypeStruct
    b, t, w = shape.rows, shape.tokens_per_rank, shape.width
    s = shape.view_tokens
    k = min(cfg.index_topk, s)
    d, di, hi = cfg.kv_cache_dim, cfg.index_head_dim, cfg.index_n_heads
    io = CPKVIO(cp, True)
    pool_spec, split, rep = P(CP_AXIS), P(None, CP_AXIS), P()
    sparse_block = block_rows(t, b * k * d * 4, block_bytes)
    n_full = types.count("full")

    def smap(fn, in_specs, out_specs, **kw):
        shardings = jax.tree.map(
            lambda sp: NamedSharding(mesh, sp), in_specs, is_leaf=lambda x: isinstance(x, P)
        )
        return jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False),
            in_shardings=shardings,
            **kw,
        )

    def descriptors(page_table, kv_lens):
        rank = jax.lax.axis_index(CP_AXIS)
        logical = jnp.arange(w // cp, dtype=i32)[None, :] * cp + rank
        local = jnp.take(page_table.reshape(b, w // cp, cp), rank, axis=2)
        tokens = jnp.clip(kv_lens[:, None] - logical * page, 0, page)
        row = jnp.broadcast_to(jnp.arange(b, dtype=i32)[:, None], local.shape)
        return jnp.stack([row, jnp.broadcast_to(logical, local.shape), local, tokens], axis=-1)

    def layers(pools, tokens, page_table, kv_lens, last_index, new, q, wts, q_lat):
        _, positions, _, slots = tokens
        latent, index_k, index_scale = (list(p) for p in pools)
        lat_rows, k8, k_scale = new
        desc = descriptors(page_table, kv_lens)
        dep, topk, j, out = None, None, 0, None
        for i, kind in enumerate(types):
            latent[i] = io.write(latent[i], slots, lat_rows if dep is None else lat_rows + dep)
            if kind == "full":
                if dep is not None:
                    k8 = (k8.astype(f32) + dep).astype(f8)
                    k_scale = k_scale + dep[..., 0]
                index_k[j] = io.write(index_k[j], slots, k8)
                index_scale[j] = io.write(index_scale[j], slots, k_scale)
                k_view = dequantize_index_k(
                    io.view(index_k[j], page_table), io.view(index_scale[j], page_table)
                )
                topk = indexer_topk(q, wts, k_view, positions, kv_lens, k, block_bytes=block_bytes)
                j += 1
            view = io.view(latent[i], page_table)

            def attend(idx, ql, view=view):
                sel = take_view_rows(view.astype(f32), jnp.maximum(idx, 0))
                return jnp.einsum("btkc,btc->btk", sel, ql)

            out = tokenwise(attend, topk, q_lat, axis=1, block=sparse_block)
            dep = out.sum(-1, keepdims=True).astype(lat_rows.dtype)
        return out, desc, (tuple(latent), tuple(index_k), tuple(index_scale))

    tok = (b, cp * t)
    lat_pool = sds((cp * pages_per_rank, page, d), dtype)
    pools = (
        (lat_pool,) * len(types),
        (sds((cp * pages_per_rank, page, di), f8),) * n_full,
        (sds((cp * pages_per_rank, page), f32),) * n_full,
    )
    metadata = (
        (sds(tok, i32), sds(tok, i32), sds(tok, bool), sds(tok, i32)),
        sds((b, w), i32),
        sds((b,), i32),
        sds((b,), i32),
    )
    metadata_specs = ((split,) * 4, rep, rep, rep)
    new = (sds((*tok, d), dtype), sds((*tok, di), f8), sds(tok, f32))
    acts = (sds((*tok, hi, di), f32), sds((*tok, hi), f32), sds((*tok, d), f32))
    pool_specs = ((pool_spec,) * len(types), (pool_spec,) * n_full, (pool_spec,) * n_full)
    specs = (pool_specs, *metadata_specs, (split,) * 3, split, split, split)
    f = smap(layers, specs, (split, split, pool_specs), donate_argnums=0)
    m = f.lower(pools, *metadata, new, *acts).compile().memory_analysis()
    meta = smap(lambda *a: a[1], metadata_specs, rep, keep_unused=True)
    meta_args = meta.lower(*metadata).compile().memory_analysis().argument_size_in_bytes
    attention_out = b * t * k * 4
    temp = int(m.temp_size_in_bytes)
    cp_bytes = (
        temp + int(m.output_size_in_bytes) - int(m.alias_size_in_bytes) - attention_out
    ) + int(meta_args)
    return {
        "temp_size_in_bytes": temp,
        "output_size_in_bytes": int(m.output_size_in_bytes),
        "alias_size_in_bytes": int(m.alias_size_in_bytes),
        "metadata_argument_bytes": int(meta_args),
        "xla_cp_bytes": int(cp_bytes),
    }


def real_step_memory(runner, batch, page: int):
    """`memory_analysis()` of the runner's compiled step for `batch` (its real arguments)."""
    from cpkv_jax.cp_prefill import global_array
    from cpkv_jax.lane_allocator import RequestPageTable

    tables = [RequestPageTable(runner.layout.lanes) for _ in batch]
    try:
        for table, (_, cached) in zip(tables, batch, strict=True):
            if cached:
                table.extend(runner.allocator, cached, page)
        prompts = [_zeros(e + c) for e, c in batch]
        step = runner.plan_step(prompts, tables, [c for _, c in batch], [e for e, _ in batch])
        split, rep = runner._shardings
        tokens = tuple(
            global_array(a, split)
            for a in (step.input_ids, step.positions, step.valid, step.write_slots)
        )
        lowered = runner._step.lower(
            runner.state,
            tokens,
            global_array(step.page_table, rep),
            global_array(step.kv_lens, rep),
            runner.pool,
            global_array(step.last_index, rep),
        )
        return lowered.compile().memory_analysis()
    finally:
        for t in tables:
            runner.release(t)


def _zeros(n: int):
    import numpy as np

    return np.zeros(n, np.int32)


def estimator_check(
    *,
    glm5: bool | None = None,
    real_step: bool = True,
    tiny_batches: dict[str, list[tuple[int, int]]] | None = None,
    glm5_batches: dict[str, list[tuple[int, int]]] | None = None,
    sequences: Sequence[tuple[str, ...]] = (("full", "shared"), ("full", "full")),
    dtypes: Sequence[str] = ("float32", "bfloat16"),
) -> dict[str, Any]:
    """The buffer estimator's profile for this device (`profile_for_platform`) against
    XLA's compiled memory on it, CP=1 on one device.

    1. CP buffers (`probe_cp_buffers`): the stream-aware `Estimate.total_bytes` of a
       two-layer model (full + shared, full + full) vs XLA's bytes of those ops, per
       batch: the tiny model's dims (float32 and bf16 latent, fp8 index K: the CPU
       calibration's cases) and, on a GPU (or `glm5=True`), GLM-5's (bf16 latent, fp8
       index K, page 64, 1 GiB token blocks). `upper_bound`: estimate >= XLA - 64 B
       (the gate's claim); `within_1_25`: also <= 1.25 x XLA (the CPU calibration's
       tightness).
    2. The real step (`CPPrefillRunner._step`, tiny model, CP=1, fp8 index K):
       the estimate vs the whole step's `temp_size_in_bytes`, which also holds what the
       estimator leaves out on purpose (MoE, projections, per-head K/V, LM head), so
       `estimate_le_temp` is expected, not an upper bound (reference figure).

    One device means CP=1: the all-gathers are over one rank (XLA may drop them and their
    relayout copies, which the estimate still counts), so this checks how XLA on this
    platform lowers everything else - dtypes moved as stored and no pool upcasts (the
    `XLA_GPU` profile's assumptions), the paged gathers, the indexer window, the blocked
    row gathers - not the CP8 collectives' buffers, which need 8 devices.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.report import environment
    from cpkv_jax.buckets import TRANSIENT_BLOCK_BYTES
    from cpkv_jax.config import CPConfig, ModelConfig
    from cpkv_jax.cp_prefill import CPPrefillRunner
    from cpkv_jax.mesh import make_cp_mesh
    from cpkv_jax.model.transformer import CausalLM
    from cpkv_jax.model_configs import config_dir
    from cpkv_jax.paging import pages_for_tokens
    from cpkv_jax.tools.tiny_config import tiny_config_dict
    from serving.prefill.buffer_estimator import BufferEstimator, RequestShape, profile_for_platform

    device = jax.devices()[0]
    platform = device.platform
    profile = profile_for_platform(platform)
    mesh = make_cp_mesh(1, [device])
    glm5 = platform == "gpu" if glm5 is None else glm5
    tiny = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    cases: list[tuple[str, Any, int, dict, Sequence[str]]] = [
        ("tiny", tiny, TINY_PAGE, TINY_BATCHES if tiny_batches is None else tiny_batches, dtypes)
    ]
    if glm5:
        real = ModelConfig.from_pretrained(config_dir("glm-5"))
        batches = GLM5_BATCHES if glm5_batches is None else glm5_batches
        cases.append(("glm5", real, GLM5_PAGE, batches, ("bfloat16",)))
    probes = []
    for model_name, cfg, page, batches, model_dtypes in cases:
        if not batches:
            continue
        # Pool pages: the largest view of any batch, plus the trash page.
        pages_per_rank = 1 + max(
            pages_for_tokens(max(e + c for e, c in batch), page) for batch in batches.values()
        )
        for types in sequences:
            two = _two_layer_cfg(cfg, tuple(types))
            for dtype in model_dtypes:
                est = BufferEstimator(
                    two,
                    cp_size=1,
                    page_size=page,
                    dtype=dtype,
                    index_k_dtype="fp8_e4m3",
                    profile=profile,
                    block_bytes=TRANSIENT_BLOCK_BYTES,
                )
                for name, batch in batches.items():
                    e = est.estimate([RequestShape(x, c) for x, c in batch])
                    t0 = time.perf_counter()
                    xla = probe_cp_buffers(
                        mesh,
                        two,
                        e.shape,
                        tuple(types),
                        pages_per_rank=pages_per_rank,
                        dtype=jnp.dtype(dtype),
                        block_bytes=TRANSIENT_BLOCK_BYTES,
                    )
                    measured = xla["xla_cp_bytes"]
                    probes.append(
                        {
                            "model": model_name,
                            "layers": "+".join(types),
                            "latent_dtype": dtype,
                            "batch": name,
                            "requests": batch,
                            "shape": dataclasses.asdict(e.shape),
                            "estimate_bytes": e.total_bytes,
                            "peak": f"{e.peak_layer}/{e.peak_phase}",
                            **xla,
                            "ratio": e.total_bytes / measured if measured else None,
                            "upper_bound": e.total_bytes >= measured - XLA_SCALARS,
                            "within_1_25": measured - XLA_SCALARS
                            <= e.total_bytes
                            <= 1.25 * measured,
                            "compile_s": round(time.perf_counter() - t0, 2),
                        }
                    )
    real_steps = []
    if real_step:
        page, pages_per_rank = TINY_PAGE, 96
        model = CausalLM(tiny, rngs=nnx.Rngs(0))
        # One device: replicated KV (shared KV needs cp > 1; at cp=1 the two are one layout).
        cp = CPConfig(cp_size=1, shared_kv=False, page_size=page)
        runner = CPPrefillRunner(
            tiny, model, mesh, cp, pages_per_rank=pages_per_rank, index_k_dtype="fp8_e4m3"
        )
        est = BufferEstimator(
            tiny,
            cp_size=1,
            page_size=page,
            dtype=model.dtype,
            index_k_dtype="fp8_e4m3",
            profile=profile,
        )
        for name in ("two_prompts", "long_prefix"):
            batch = TINY_BATCHES[name]
            m = real_step_memory(runner, batch, page)
            total = est.estimate([RequestShape(x, c) for x, c in batch]).total_bytes
            temp = int(m.temp_size_in_bytes)
            real_steps.append(
                {
                    "batch": name,
                    "requests": batch,
                    "estimate_bytes": total,
                    "temp_size_in_bytes": temp,
                    "output_minus_alias_bytes": int(m.output_size_in_bytes - m.alias_size_in_bytes),
                    "ratio_to_temp": total / temp if temp else None,
                    "estimate_le_temp": total <= temp,
                }
            )
    return {
        **environment(),
        "platform": platform,
        "profile": profile.name,
        "cp_size": 1,
        "index_k_dtype": "fp8_e4m3",
        "block_bytes": TRANSIENT_BLOCK_BYTES,
        "what": (
            "probes: estimate (Estimate.total_bytes of a 2-layer model) vs XLA's bytes of "
            "the CP-specific ops (temp + non-aliased outputs - attention stand-in + "
            "metadata args); real_steps: estimate vs the whole tiny-model step's temp "
            "(MoE etc. included: a reference, not a bound)"
        ),
        "probes": probes,
        "all_upper_bound": all(p["upper_bound"] for p in probes),
        "all_within_1_25": all(p["within_1_25"] for p in probes),
        "real_steps": real_steps,
    }


# ---- CLI --------------------------------------------------------------------------------
def build_parser(steps: Sequence[Step] = STEPS) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.device_check", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where every JSON goes")
    ap.add_argument(
        "--budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole run"
    )
    ap.add_argument("--only", nargs="+", metavar="NAME", choices=[s.name for s in steps])
    ap.add_argument("--quick", action="store_true", help="quick variants where a step has one")
    ap.add_argument("--list", action="store_true", help="print the steps and their limits")
    ap.add_argument(
        "--allow-cpu", action="store_true", help="no GPU: run the steps' CPU smoke modes"
    )
    ap.add_argument(
        "--estimator-check",
        action="store_true",
        help="(the buffer_estimator step) only the estimator vs XLA comparison, in-process",
    )
    ap.add_argument("--json", default=None, help="with --estimator-check: write it here")
    return ap


def main(
    argv: Sequence[str] | None = None,
    *,
    steps: Sequence[Step] = STEPS,
    probe: Callable[[], dict[str, Any]] = probe_device,
) -> int:
    start = time.monotonic()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(steps).parse_args(argv)
    if args.list:
        print(list_steps(steps))
        return 0
    if args.estimator_check:
        from benchmarks.report import emit

        report = estimator_check()
        emit(report, args.json)
        return 0 if report["all_upper_bound"] else 1
    try:
        device = probe()
    except (RuntimeError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        print(f"device_check: {e}", file=sys.stderr)
        return 2
    if device["platform"] != "gpu" and not args.allow_cpu:
        print(
            f"device_check: no GPU found (JAX backend {device.get('backend')!r}, device "
            f"{device.get('device_kind')!r}); nothing was run. Run it on a GPU machine, or "
            "pass --allow-cpu for the steps' CPU smoke modes.",
            file=sys.stderr,
        )
        return 2
    selected = [s for s in steps if args.only is None or s.name in args.only]
    plan = Plan(
        out_dir=Path(args.out_dir),
        budget_s=args.budget_s,
        slug=device_slug(device["device_kind"]),
        date=time.strftime("%Y-%m-%d"),
        cpu=device["platform"] != "gpu",
        quick=args.quick,
    )
    print(
        f"device_check: {device['device_kind']} ({device['platform']}, JAX {device.get('jax')}), "
        f"{len(selected)} step(s), budget {plan.budget_s:.0f} s",
        flush=True,
    )
    summary, path = run_all(selected, plan, device, start, argv)
    counts = ", ".join(f"{n} {s}" for s, n in summary["counts"].items() if n)
    print(f"device_check: {counts} in {summary['elapsed_s']:.0f} s; summary {path}")
    if summary.get("terminated"):
        return 124
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
