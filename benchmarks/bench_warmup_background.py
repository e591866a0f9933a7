"""`--warmup all` alone vs with `--warmup-background` (issue 25): time to healthy,
then at once the first request of each length vs another of the same length, and how
long the background compile runs on.

    python -m benchmarks.bench_warmup_background [--model-path DIR] [--json PATH]
        [--lengths 1 60 300 900] [-- extra cpkv-serve flags]

Starts a unified `cpkv-serve` on 127.0.0.1 twice with the same flags, the compilation
cache off (each start compiles everything), once per variant. After `/health` turns 200
it sends the prompts right away (streaming TTFT, client side), then polls `/server_info`
until `background_compile` finished. Reports per variant the seconds to healthy, the
TTFT rows, seconds until every enumerated shape was compiled, and the compiles counted
while serving (by requests) and in the background. Without `--model-path` the tiny
checkpoint is written to a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.bench_first_request import ttft
from benchmarks.bench_restart import model_path_or_tiny, running_server
from benchmarks.report import emit, environment

VARIANTS = {
    "all_shapes": ["--warmup", "all"],
    "background": ["--warmup", "all", "--warmup-background"],
}


def _variant(argv: list[str], env: dict[str, str], log: Path, lengths: list[int]) -> dict:
    rng = np.random.default_rng(0)
    with running_server(argv, env, log) as (base, healthy_s):
        t_healthy = time.monotonic()
        rows = []
        for n in lengths:
            first = ttft(base, rng.integers(3, 300, n).tolist(), 600.0)
            repeat = ttft(base, rng.integers(3, 300, n).tolist(), 600.0)
            rows.append(
                {"tokens": n, "first_s": first, "repeat_s": repeat, "ratio": first / repeat}
            )
        while True:
            info = httpx.get(base + "/server_info", timeout=30).json()
            progress = info.get("background_compile")
            if progress is None or progress["finished"]:
                break
            time.sleep(0.5)
        compiles = info["xla_compiles"]
        return {
            "healthy_s": healthy_s,
            "all_compiled_s": healthy_s + (time.monotonic() - t_healthy if progress else 0.0),
            "first_vs_repeat": rows,
            "background_compile": progress,
            "serving_compiles": compiles["serving"]["compiles"],
            "background_compiles": compiles.get("background", {}).get("compiles", 0),
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None, help="none: a fresh tiny checkpoint")
    ap.add_argument("--lengths", nargs="+", type=int, default=[1, 60, 300, 900])
    ap.add_argument("--json", default=None)
    ap.add_argument("extra", nargs="*", help="more cpkv-serve flags (after --)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cpkv-bgwarm-") as tmp:
        args.model_path = model_path_or_tiny(args.model_path, Path(tmp))
        serve = [sys.executable, "-m", "serving.launch", "--model-path", args.model_path]
        serve += ["--disaggregation-mode", "null", "--host", "127.0.0.1"]
        serve += ["--compilation-cache-dir", "none", *args.extra]
        out = {
            name: _variant(
                [*serve, *flags], dict(os.environ), Path(tmp) / f"{name}.log", args.lengths
            )
            for name, flags in VARIANTS.items()
        }
    emit(
        {
            **environment(),
            "argv": serve[2:],
            **out,
            "healthy_speedup": out["all_shapes"]["healthy_s"] / out["background"]["healthy_s"],
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
