"""Raw Mooncake Transfer Engine throughput: one contiguous write of N bytes over loopback.

    python -m benchmarks.bench_mooncake_raw [--bytes 67108864] [--repeats 5] [--json]

The baseline `bench_transfer` compares each PD transfer backend against
(`raw_mooncake_gbps`): two engines in THIS process (the engine allows several per
process), both on 127.0.0.1 over TCP in P2P-handshake mode; the source buffer holds
random bytes, the destination is pre-faulted, both are registered once; one untimed
warm-up write opens the connection; then each repeat is ONE `batch_write` of a single
descriptor of `total_bytes`, timed with `perf_counter`. The figure is the median over
repeats, in GB/s (1e9 bytes per second). The last write is checked byte for byte.

JSON goes to stdout (one object with `--json`, `key: value` lines otherwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from transfer.backends.mooncake_engine import MooncakeEngine, MooncakeUnavailable


def raw_write_times(total_bytes: int, repeats: int, *, seed: int = 0) -> list[float]:
    """Seconds of each of `repeats` contiguous writes of `total_bytes` between two engines."""
    if total_bytes <= 0 or repeats <= 0:
        raise ValueError(f"need total_bytes > 0 and repeats > 0, got {total_bytes}, {repeats}")
    src = np.random.default_rng(seed).integers(0, 256, total_bytes, dtype=np.uint8)
    dst = np.ones(total_bytes, np.uint8)  # written, so its pages exist before timing
    with MooncakeEngine() as sender, MooncakeEngine() as receiver:
        s = sender.register(src)
        d = receiver.register(dst)
        sender.write(receiver.session_id, s.ptr, d.ptr, total_bytes)  # warm-up + handshake
        times = []
        for _ in range(repeats):
            dst[:: 1 << 20] = 0  # the final check then shows the last write really landed
            t0 = time.perf_counter()
            sender.batch_write(receiver.session_id, [s.ptr], [d.ptr], [total_bytes])
            times.append(time.perf_counter() - t0)
        if not np.array_equal(src, dst):
            raise RuntimeError("raw Mooncake write: destination differs from the source")
    return times


def raw_write_gbps(total_bytes: int, repeats: int = 5) -> float:
    """Median GB/s (1e9 B/s) of one contiguous loopback write of `total_bytes`."""
    return total_bytes / statistics.median(raw_write_times(total_bytes, repeats)) / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=64 << 20, help="bytes per write")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        times = raw_write_times(args.bytes, args.repeats)
    except MooncakeUnavailable as e:
        print(f"bench_mooncake_raw: {e.reason}", file=sys.stderr)
        return 2
    med = statistics.median(times)
    report = {
        "bytes": args.bytes,
        "repeats": args.repeats,
        "median_s": med,
        "raw_mooncake_gbps": args.bytes / med / 1e9,
        "gbps_each": [args.bytes / t / 1e9 for t in times],
        "protocol": "tcp",
        "host": "127.0.0.1",
    }
    if args.json:
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
    else:
        for k, v in report.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
