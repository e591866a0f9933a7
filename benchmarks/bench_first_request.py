"""First request vs repeat: TTFT of a prompt of each length, then of another prompt of
the same length (other tokens, so no prefix hit), through a router or any server with
SGLang's streaming `/generate` (issue 25: a first request should not pay compiles).

    python -m benchmarks.bench_first_request --base-url http://127.0.0.1:ROUTER \
        [--server-info URL ...] [--lengths 1 60 300 700 1500 3000] [--json PATH]

`--server-info` URLs (the prefill and decode servers behind a router) are read before and
after: `serving_compiles` is how many XLA programs each compiled while serving these.
Prints JSON (one row per length: first / repeat TTFT and their ratio).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
import numpy as np


def ttft(base_url: str, ids: list[int], timeout: float) -> float:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    t0 = time.perf_counter()
    with httpx.stream("POST", base_url + "/generate", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data:") and "output_ids" in line:
                return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


def serving_compiles(urls: list[str]) -> dict[str, int]:
    return {
        u: httpx.get(u + "/server_info", timeout=30).json()["xla_compiles"]["serving"]["compiles"]
        for u in urls
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_first_request")
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--server-info", nargs="*", default=[], metavar="URL")
    ap.add_argument("--lengths", nargs="+", type=int, default=[1, 60, 300, 700, 1500, 3000])
    ap.add_argument("--vocab", type=int, default=300, help="token ids drawn from [3, vocab)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    before = serving_compiles(args.server_info)
    rows = []
    for n in args.lengths:
        first = ttft(args.base_url, rng.integers(3, args.vocab, n).tolist(), args.timeout)
        repeat = ttft(args.base_url, rng.integers(3, args.vocab, n).tolist(), args.timeout)
        rows.append(
            {"tokens": n, "first_ttft_s": first, "repeat_ttft_s": repeat, "ratio": first / repeat}
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    after = serving_compiles(args.server_info)
    out = {"rows": rows, "serving_compiles": {u: after[u] - before[u] for u in after}}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
