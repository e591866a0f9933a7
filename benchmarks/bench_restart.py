"""Time to healthy of `cpkv-serve`, first start vs a restart with the compilation cache warm.

    python -m benchmarks.bench_restart [--model-path DIR] [--mode prefill|null] [--json PATH]
        [-- extra cpkv-serve flags]

Without `--model-path` the tiny GLM-5-architecture checkpoint is written to a temporary
directory first (what `benchmarks.device_check` does on a GPU machine).

Starts `cpkv-serve` twice on 127.0.0.1 with the same flags and a fresh
`--compilation-cache-dir` (a temporary directory), each time measuring the wall time from
the process start to `/health` answering 200 (weights loaded, warm-up compiled), then
stops it with SIGTERM. The first start fills the cache, the second reads it (issue 25:
the goal is >= 3x faster). Prefill mode gets `--cp-size 8 --enable-cp-shared-kv` on 8
virtual CPU devices unless the extra flags say otherwise. Prints one JSON object with both
times, their ratio and the cache's entries and bytes after the first start.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from benchmarks.report import emit, environment
from serving.compilation_cache import cache_summary

STARTUP_TIMEOUT_S = 900.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(argv: list[str], env: dict[str, str], log: Path) -> Iterator[tuple[str, float]]:
    """Start the server, wait for /health 200, yield (base URL, seconds to healthy), then
    stop it with SIGTERM."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*argv, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env
        )
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}; log: {log}")
                if time.monotonic() - t0 > STARTUP_TIMEOUT_S:
                    raise RuntimeError(f"not healthy after {STARTUP_TIMEOUT_S:.0f}s; log: {log}")
                try:
                    if httpx.get(base + "/health", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
            yield base, time.monotonic() - t0
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def time_to_healthy(argv: list[str], env: dict[str, str], log: Path) -> float:
    """Start the server, wait for /health 200, stop it; seconds to healthy."""
    with running_server(argv, env, log) as (_, seconds):
        return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None, help="none: a fresh tiny checkpoint")
    ap.add_argument("--mode", choices=("prefill", "null"), default="prefill")
    ap.add_argument("--json", default=None)
    ap.add_argument("extra", nargs="*", help="more cpkv-serve flags (after --)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cpkv-restart-") as tmp:
        args.model_path = model_path_or_tiny(args.model_path, Path(tmp))
        return _run(args)


def model_path_or_tiny(model_path: str | None, tmp: Path) -> str:
    """`model_path`, or the tiny GLM-5-architecture checkpoint written under `tmp`."""
    if model_path is not None:
        return model_path
    from cpkv_jax.tools.make_tiny_checkpoint import make_tiny_checkpoint

    return str(make_tiny_checkpoint(tmp / "tiny", "glm_moe_dsa"))


def _run(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    serve = [sys.executable, "-m", "serving.launch", "--model-path", args.model_path]
    serve += ["--disaggregation-mode", args.mode, "--host", "127.0.0.1"]
    if args.mode == "prefill" and "--cp-size" not in args.extra:
        serve += ["--cp-size", "8", "--enable-cp-shared-kv"]
        flags = env.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    serve += args.extra
    with tempfile.TemporaryDirectory(prefix="cpkv-jcc-") as cache:
        argv_ = [*serve, "--compilation-cache-dir", cache]
        logs = Path(cache).parent
        first = time_to_healthy(argv_, env, logs / "bench_restart_first.log")
        entries, size = cache_summary(Path(cache))
        second = time_to_healthy(argv_, env, logs / "bench_restart_second.log")
    emit(
        {
            **environment(),
            "mode": args.mode,
            "argv": serve[2:],
            "first_start_s": first,
            "second_start_s": second,
            "speedup": first / second,
            "cache_entries": entries,
            "cache_bytes": size,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
