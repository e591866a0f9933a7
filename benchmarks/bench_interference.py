"""A long prompt arriving while requests decode: how much it delays their tokens (issue 35).

    python -m benchmarks.bench_interference --work-dir /tmp/interf \
        [--running 8] [--prompt 4096] [--layers 2] [--hidden 1024] [--json PATH]

The unified server with default flags (radix cache, chunked prefill batched with the
running decode rows, `--chunked-prefill-size 2048`; `--chunk 0` for whole prompts,
`--server-arg` for more flags, e.g. a DP mesh) on `bench_long_prompt`'s GLM-5-shaped
checkpoint. `--running` streamed greedy requests (short prompts, many new tokens) decode;
once each has streamed `--settle` tokens, one `--prompt`-token request arrives. The
running requests' inter-token gaps are split by time: `before` (up to the long request's
arrival), `during` (until its first token), `after`. Prints JSON: each window's p50 / p99
gap, the long request's TTFT and its chunk count (`ceil(prompt / chunk)`), and the
`chunk_step_ms` estimate = (its TTFT - one decode gap) / chunks: the cost of one step
that carries a chunk. Issue 35's rule: p99 during <= p99 before + one chunk step (a long
prompt delays running requests by at most one chunk's step per token, not its whole
prefill).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.bench_long_prompt import VOCAB, glm5_shaped_config, server, write_checkpoint
from benchmarks.report import emit


def _stream(url: str, ids: list[int], new: int, out: list[float], timeout: float) -> None:
    """Stream a greedy `/generate`, appending each token's arrival time to `out` as it
    comes (another thread watches `out` grow)."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
    }
    with httpx.stream("POST", url + "/generate", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"the stream failed: {event['error']}")
            now = time.perf_counter()  # events carry the cumulative output_ids
            out.extend([now] * (len(event.get("output_ids", [])) - len(out)))


def _gaps(times: list[list[float]], lo: float, hi: float) -> np.ndarray:
    """Inter-token gaps (ms) of every running request whose later token fell in [lo, hi)."""
    out = []
    for ts in times:
        a = np.asarray(ts)
        d = np.diff(a)
        out.append(d[(a[1:] >= lo) & (a[1:] < hi)])
    return np.concatenate(out) * 1e3 if out else np.zeros(0)


def _pct(g: np.ndarray) -> dict[str, Any]:
    if g.size == 0:
        return {"n": 0}
    return {
        "n": int(g.size),
        "p50_ms": round(float(np.percentile(g, 50)), 1),
        "p99_ms": round(float(np.percentile(g, 99)), 1),
        "max_ms": round(float(g.max()), 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_interference")
    ap.add_argument("--work-dir", type=Path, required=True)
    ap.add_argument("--running", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=400, help="tokens each running request asks")
    ap.add_argument("--settle", type=int, default=20, help="tokens before the long prompt")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument(
        "--chunk", type=int, default=2048, help="--chunked-prefill-size (0: whole prompts)"
    )
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra cpkv-serve flag, e.g. --server-arg=--dp-size --server-arg=2 (with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=2 on CPU)",
    )
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    ckpt = write_checkpoint(args.work_dir / "ckpt", glm5_shaped_config(args.layers, args.hidden))
    flags = ["--dtype", "bfloat16", "--page-size", "64", "--kv-pool-size", "56MiB"]
    flags += ["--chunked-prefill-size", str(args.chunk)] if args.chunk else []
    flags += args.server_arg
    rng = np.random.default_rng(0)
    with server(ckpt, args.work_dir / "server.log", flags, args.timeout) as url:
        # Warm the long prompt's chunk shapes and the batch buckets once (other ids: no
        # prefix hit later), so the measured run pays no compile.
        warm = [threading.Thread(target=_stream, args=(
            url, rng.integers(3, VOCAB - 96, 24).tolist(), 8, [], args.timeout))
            for _ in range(args.running)]  # fmt: skip
        for t in warm:
            t.start()
        _stream(url, rng.integers(3, VOCAB - 96, args.prompt).tolist(), 2, [], args.timeout)
        for t in warm:
            t.join()
        times: list[list[float]] = [[] for _ in range(args.running)]
        threads = [
            threading.Thread(
                target=_stream,
                args=(
                    url,
                    rng.integers(3, VOCAB - 96, 24).tolist(),
                    args.new,
                    times[i],
                    args.timeout,
                ),
            )
            for i in range(args.running)
        ]
        for t in threads:
            t.start()
        while min(len(ts) for ts in times) < args.settle:
            time.sleep(0.01)
        long_times: list[float] = []
        arrive = time.perf_counter()
        _stream(url, rng.integers(3, VOCAB - 96, args.prompt).tolist(), 2, long_times,
                args.timeout)  # fmt: skip
        first = long_times[0]
        for t in threads:
            t.join()
    before, during = _gaps(times, 0, arrive), _gaps(times, arrive, first)
    after = _gaps(times, first, math.inf)
    chunks = math.ceil(args.prompt / args.chunk) if args.chunk else 1
    decode_gap = float(np.percentile(before, 50)) if before.size else 0.0
    chunk_step = ((first - arrive) * 1e3 - decode_gap) / chunks
    result = {
        "what": f"unified cpkv-serve, default engine, GLM-5-shaped {args.layers} layers, "
        f"hidden {args.hidden}, bf16; {args.running} streams decoding, one "
        f"{args.prompt}-token prompt arriving; flags {flags}",
        "long_ttft_s": round(first - arrive, 2),
        "chunks": chunks,
        "chunk_step_ms": round(chunk_step, 1),
        "before": _pct(before),
        "during": _pct(during),
        "after": _pct(after),
    }
    if before.size and during.size:
        result["p99_rise_ms"] = round(result["during"]["p99_ms"] - result["before"]["p99_ms"], 1)
        result["p99_rise_in_chunk_steps"] = round(result["p99_rise_ms"] / chunk_step, 2)
    emit(result, str(args.json) if args.json else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
