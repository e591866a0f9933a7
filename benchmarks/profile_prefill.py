"""Profile one CP shared-KV prefill: write a JAX profiler trace and print the top ops.

    python -m benchmarks.profile_prefill [--cp-size 8] [--tokens 1024] [--page-size 16]
        [--trace-dir DIR] [--top 15] [--json]

Builds the tiny model (or `--model-path DIR`), runs one CP=N shared-KV prefill to compile,
then traces a second one with `jax.profiler` into `--trace-dir` (open it with XProf /
TensorBoard's profile plugin, or Perfetto). The trace is read back with
`jax.profiler.ProfileData`; device-op events (those carrying an `hlo_op`) are summed per
HLO instruction and per `jax.named_scope` (materialize, kv_write, indexer, sparse_mla,
moe, ffn), which come from the compiled step's HLO metadata. On CPU the "device" is the
host's XLA runtime; the split between scopes is still what a GPU run shows first.

Prints one JSON object with `--json`, else a table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

# Scopes set by the model and the CP KV I/O, most specific first.
SCOPES = ("materialize", "kv_write", "indexer", "sparse_mla", "moe", "ffn")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name=\"([^\"]*)\"")


def scope_of(op_name: str) -> str:
    """The innermost known named scope in an HLO `op_name` path ("other" if none)."""
    parts = op_name.split("/")
    for part in reversed(parts):
        if part in SCOPES:
            return part
    return "other"


def instruction_scopes(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> named scope, from `metadata={op_name=...}`."""
    out: dict[str, str] = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m:
            out[m.group(1)] = scope_of(m.group(2))
    return out


def device_op_times(trace_dir: Path) -> dict[str, list[float]]:
    """hlo_op -> durations (seconds) of every traced event that names one."""
    from jax.profiler import ProfileData

    files = sorted(trace_dir.glob("**/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no .xplane.pb trace under {trace_dir}")
    data = ProfileData.from_file(str(files[-1]))
    times: dict[str, list[float]] = collections.defaultdict(list)
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                op = stats.get("hlo_op")
                if op:
                    times[str(op)].append(event.duration_ns * 1e-9)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--model-path", help="checkpoint dir (default: the tiny test model)")
    ap.add_argument("--gather-impl", choices=("xla", "pallas"), default="xla")
    ap.add_argument("--trace-dir", default="/tmp/cpkv-profile-prefill")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if "jax" not in sys.modules:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (
                f"{flags} --xla_force_host_platform_device_count={args.cp_size}"
            ).strip()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from cpkv_jax.config import CPConfig, ModelConfig
    from cpkv_jax.cp_prefill import CPPrefillRunner, pages_per_rank_for
    from cpkv_jax.lane_allocator import RequestPageTable
    from cpkv_jax.mesh import make_cp_mesh
    from cpkv_jax.model.transformer import CausalLM
    from cpkv_jax.model.weights import load_model
    from cpkv_jax.tools.tiny_config import tiny_config_dict

    if args.model_path:
        cfg, model = load_model(args.model_path, dtype=jnp.float32)
    else:
        cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
        model = CausalLM(cfg, rngs=nnx.Rngs(0))
    cp = CPConfig(cp_size=args.cp_size, shared_kv=args.cp_size > 1, page_size=args.page_size)
    runner = CPPrefillRunner(
        cfg,
        model,
        make_cp_mesh(args.cp_size),
        cp,
        pages_per_rank=pages_per_rank_for(args.tokens, args.page_size, cp),
        gather_impl=args.gather_impl,
    )
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, args.tokens).astype(np.int32)

    def one_prefill() -> float:
        t0 = time.perf_counter()
        result = runner.prefill([prompt])
        elapsed = time.perf_counter() - t0
        runner.release(result.tables[0])
        return elapsed

    compile_s = one_prefill()
    trace_dir = Path(args.trace_dir)
    jax.profiler.start_trace(str(trace_dir))
    try:
        traced_s = one_prefill()
    finally:
        jax.profiler.stop_trace()

    table = RequestPageTable(runner.layout.lanes)
    plan = runner.plan_step([prompt], [table], [0], [prompt.size])
    scopes = instruction_scopes(runner.step_hlo_text(plan))
    runner.release(table)

    times = device_op_times(trace_dir)
    total = sum(sum(v) for v in times.values())
    per_scope: dict[str, float] = collections.defaultdict(float)
    for op, ts in times.items():
        per_scope[scopes.get(op, "other")] += sum(ts)
    top = sorted(times.items(), key=lambda kv: -sum(kv[1]))[: args.top]
    result: dict[str, Any] = {
        "backend": jax.default_backend(),
        "cp_size": args.cp_size,
        "tokens": args.tokens,
        "page_size": args.page_size,
        "gather_impl": args.gather_impl,
        "first_prefill_s": compile_s,
        "traced_prefill_s": traced_s,
        "trace_dir": str(trace_dir),
        "device_op_seconds": total,
        "by_scope": {
            k: {"seconds": v, "share": v / total if total else 0.0}
            for k, v in sorted(per_scope.items(), key=lambda kv: -kv[1])
        },
        "top_ops": [
            {
                "hlo_op": op,
                "scope": scopes.get(op, "other"),
                "calls": len(ts),
                "seconds": sum(ts),
                "share": sum(ts) / total if total else 0.0,
            }
            for op, ts in top
        ],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"CP={args.cp_size} prefill of {args.tokens} tokens: {traced_s * 1e3:.1f} ms traced "
        f"(first run with compile {compile_s:.1f} s); trace in {trace_dir}"
    )
    print(f"\n{'scope':<14}{'ms':>10}{'share':>8}   (device-op time summed over ranks)")
    for k, v in result["by_scope"].items():
        print(f"{k:<14}{v['seconds'] * 1e3:>10.2f}{v['share']:>8.1%}")
    print(f"\n{'hlo op':<40}{'scope':<14}{'calls':>6}{'ms':>10}{'share':>8}")
    for row in result["top_ops"]:
        print(
            f"{row['hlo_op'][:39]:<40}{row['scope']:<14}{row['calls']:>6}"
            f"{row['seconds'] * 1e3:>10.2f}{row['share']:>8.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
