"""The long PD transfer fault soak: the suite's randomized fault tests with more rounds.

`make test` runs `tests/transfer/test_{grpc,mooncake}_fault_soak.py` with a short
schedule (`SUITE_ROUNDS`, every fault kind at least once); this runs the same tests with
`--rounds` faults per backend (100 is the transfer issue's acceptance count) and other
seeds, and prints one JSON object: per backend, the rounds, seed, pass/fail and seconds.

    python -m benchmarks.fault_soak [--rounds 100] [--seeds 1234 7] [--backend grpc mooncake]

The tests are the single source of the soak's checks (pages back, rooms finished with the
expected state, data equal to the prefill view); this only sets their schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = {
    "grpc": "tests/transfer/test_grpc_fault_soak.py",
    "mooncake": "tests/transfer/test_mooncake_fault_soak.py",
}


def run_soak(backend: str, rounds: int, seed: int | None, timeout_s: float) -> dict:
    env = dict(os.environ, CPKV_TRANSFER_FAULTS=str(rounds))
    if seed is not None:
        env["CPKV_TRANSFER_FAULT_SEED"] = str(seed)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TESTS[backend]]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        rc, tail = proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        rc, tail = -1, [f"timed out after {timeout_s:.0f} s"]
    summary = tail[0] if tail else ""
    if rc != 0:
        status = "failed"
    elif "passed" not in summary:  # skipped with its reason (the Mooncake engine cannot load)
        status = "skipped"
    else:
        status = "passed"
    return {
        "backend": backend,
        "rounds": rounds,
        "seed": seed,
        "status": status,
        "seconds": round(time.perf_counter() - t0, 1),
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fault_soak")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="*", default=[], help="default: the tests' own")
    ap.add_argument("--backend", nargs="+", choices=sorted(TESTS), default=sorted(TESTS))
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per soak")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    runs = [
        run_soak(b, args.rounds, seed, args.timeout_s)
        for b in args.backend
        for seed in (args.seeds or [None])
    ]
    print(json.dumps({"bench": "fault_soak", "runs": runs}, indent=2))
    return 0 if all(r["status"] != "failed" for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
