"""Raw Mooncake Transfer Engine throughput: one contiguous write of N bytes over loopback.

    python -m benchmarks.bench_mooncake_raw [--bytes 67108864] [--repeats 5] [--json]

The baseline `bench_transfer` compares each PD transfer backend against
(`raw_mooncake_gbps`): two engines in THIS process (the engine allows several per
process), both on 127.0.0.1 over TCP in P2P-handshake mode; the source buffer holds
random bytes, the destination is pre-faulted, both are registered once; one untimed
warm-up write opens the connection; then each repeat is ONE write of a single descriptor
of `total_bytes`, timed with `perf_counter`, through `MooncakeEngine.write` (submitted and
polled with short sleeps, as every write of this project goes). Each repeat also times
the same write through the binding's own blocking call (`MooncakeEngine.blocking_write`,
`batch_transfer_sync_write`, which spins on the transfer status), reported as
`raw_sync_call_*`: on a 2-core host its spinning thread takes CPU from the engine's socket
threads. Figures are medians over repeats, in GB/s (1e9 bytes per second). The
destination is checked byte for byte after the last write.

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


class RawWriter:
    """Two engines and a registered source / destination of `total_bytes` each, warmed
    up, for timing single contiguous writes (also between other work: `bench_transfer`
    interleaves them with its backend runs so both see the same machine load)."""

    def __init__(self, total_bytes: int, *, seed: int = 0) -> None:
        if total_bytes <= 0:
            raise ValueError(f"need total_bytes > 0, got {total_bytes}")
        self.total_bytes = total_bytes
        self._src = np.random.default_rng(seed).integers(0, 256, total_bytes, dtype=np.uint8)
        self._dst = np.ones(total_bytes, np.uint8)  # written, so its pages exist before timing
        self._sender = MooncakeEngine()
        try:
            self._receiver = MooncakeEngine()
        except BaseException:
            self._sender.close()
            raise
        self._s = self._sender.register(self._src)
        self._d = self._receiver.register(self._dst)
        self._sender.write(self._receiver.session_id, self._s.ptr, self._d.ptr, total_bytes)

    def _timed(self, write) -> float:
        self._dst[:: 1 << 20] = 0  # the final check then shows the last write really landed
        t0 = time.perf_counter()
        write(self._receiver.session_id, self._s.ptr, self._d.ptr, self.total_bytes)
        return time.perf_counter() - t0

    def write_seconds(self) -> float:
        """Seconds of one `MooncakeEngine.write` of all the bytes."""
        return self._timed(self._sender.write)

    def sync_call_seconds(self) -> float:
        """Seconds of the same write through the binding's blocking call."""
        return self._timed(self._sender.blocking_write)

    def check(self) -> None:
        if not np.array_equal(self._src, self._dst):
            raise RuntimeError("raw Mooncake write: destination differs from the source")

    def close(self) -> None:
        self._sender.close()
        self._receiver.close()

    def __enter__(self) -> RawWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raw_write_times(
    total_bytes: int, repeats: int, *, seed: int = 0
) -> tuple[list[float], list[float]]:
    """(seconds of each polled write, seconds of each blocking-call write) of
    `total_bytes`, `repeats` of each, alternating."""
    if repeats <= 0:
        raise ValueError(f"need repeats > 0, got {repeats}")
    with RawWriter(total_bytes, seed=seed) as raw:
        times, sync_times = [], []
        for _ in range(repeats):
            times.append(raw.write_seconds())
            sync_times.append(raw.sync_call_seconds())
        raw.write_seconds()
        raw.check()
    return times, sync_times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=64 << 20, help="bytes per write")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        times, sync_times = raw_write_times(args.bytes, args.repeats)
    except MooncakeUnavailable as e:
        print(f"bench_mooncake_raw: {e.reason}", file=sys.stderr)
        return 2
    med, sync_med = statistics.median(times), statistics.median(sync_times)
    report = {
        "bytes": args.bytes,
        "repeats": args.repeats,
        "median_s": med,
        "raw_mooncake_gbps": args.bytes / med / 1e9,
        "gbps_each": [args.bytes / t / 1e9 for t in times],
        "raw_sync_call_gbps": args.bytes / sync_med / 1e9,
        "sync_call_gbps_each": [args.bytes / t / 1e9 for t in sync_times],
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
