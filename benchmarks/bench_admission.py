"""Admission benchmark: a synthetic queue through the prefill scheduler's host path.

    python -m benchmarks.bench_admission --json [--requests 10000] [--seed 0]

A long-tailed workload (lengths log-normal, clipped to [16, 128K] tokens; a share of the
requests start with one of a few long shared system prompts, so the radix cache hits)
goes through the real `PrefillScheduler` - radix prefix matching, `PrefillAdder` with
the CP shared-KV gates, the CPU-only `BufferEstimator` (GLM-5 dimensions), evict-then-
allocate in owner lanes - with an executor that does no device work, so what is timed is
admission alone. Printed (one JSON object):

- `decision_us`: per-decision latency (one candidate offered to the adder: generic
  budgets, CP gates, buffer estimate) p50 / p99 / max in microseconds, for the CP
  shared-KV gates and, measured in the same run on the same workload, for the generic
  budgets alone (`baseline`), with the ratio of the two p99s;
- `schedule_batch_us`: the whole host decision per batch (prefix matching, admission,
  evict-then-allocate, step rows), same statistics;
- `batches`: batches formed and their size distribution;
- `rejections`: stops counted per gate;
- `estimate_bytes`: the distribution of the buffer estimate over formed batches
  (SPEC S9.5) and the configured limit.
Timings are medians over `--repeats` runs of the whole workload (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cpkv_jax.cache.radix import RadixCache
from cpkv_jax.config import ModelConfig
from cpkv_jax.lane_allocator import OwnerLaneAllocator
from cpkv_jax.model_configs import config_dir
from cpkv_jax.tools.tiny_config import tiny_config_dict
from cpkv_jax.units import GiB
from serving.prefill.adder import AddResult, Candidate, CPSharedKVLimits, PrefillAdder
from serving.prefill.buffer_estimator import BufferEstimator
from serving.prefill.scheduler import PrefillScheduler, StepRow

logger = logging.getLogger("bench_admission")

SHARED_CONFIG = config_dir("glm-5") / "config.json"


class NoDeviceExecutor:
    """Returns empty logits instantly: the benchmark times admission, not the model."""

    def execute(self, rows: Sequence[StepRow]) -> np.ndarray:
        return np.zeros((len(rows), 1), np.float32)


def timed_adder(samples: list[float]) -> type[PrefillAdder]:
    """A `PrefillAdder` that records how long each admission decision takes."""

    class TimedAdder(PrefillAdder):
        def add(self, cand: Candidate) -> AddResult:
            t0 = time.perf_counter_ns()
            result = super().add(cand)
            samples.append((time.perf_counter_ns() - t0) / 1e3)
            return result

    return TimedAdder


def workload(n: int, seed: int, page_size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 150_000, int(k)).astype(np.int32) for k in (1024, 4096, 16384)]
    lengths = np.clip(rng.lognormal(mean=8.0, sigma=1.3, size=n), 16, 131_072).astype(int)
    out = []
    for i, length in enumerate(lengths):
        if rng.random() < 0.4:  # prefix-cache hit candidates
            pre = prefixes[i % len(prefixes)]
            tail = rng.integers(3, 150_000, max(int(length) - pre.size, page_size))
            out.append(np.concatenate([pre, tail.astype(np.int32)]))
        else:
            out.append(rng.integers(3, 150_000, int(length)).astype(np.int32))
    return out


def run_once(prompts, cfg, args, *, gates: bool) -> dict:
    alloc = OwnerLaneAllocator(args.cp_size, args.pages_per_rank)
    cache = RadixCache(alloc, args.page_size)
    estimator = BufferEstimator(
        cfg, cp_size=args.cp_size, page_size=args.page_size, dtype="bfloat16"
    )
    limits = (
        CPSharedKVLimits(
            shared_kv=True,
            bs_gt1=True,
            max_batch_requests=args.max_batch_requests,
            max_total_extend_tokens=args.max_total_extend_tokens,
            max_cached_tokens=args.max_cached_tokens,
            max_buffer_bytes=int(args.max_buffer_gib * GiB),
        )
        if gates
        else CPSharedKVLimits()
    )
    sched = PrefillScheduler(
        cache=cache,
        executor=NoDeviceExecutor(),
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        cp_limits=limits,
        estimator=estimator if gates else None,
    )
    samples: list[float] = []
    batch_us: list[float] = []
    estimates: list[int] = []
    sched.adder_cls = timed_adder(samples)
    for i, p in enumerate(prompts):
        sched.submit(f"r{i}", p)
    steps = 0
    with tqdm(
        total=len(prompts), desc="gates" if gates else "baseline", disable=not args.progress
    ) as bar:
        while sched.num_waiting:
            before = sched.num_waiting
            t0 = time.perf_counter_ns()
            batch = sched.schedule_batch()
            batch_us.append((time.perf_counter_ns() - t0) / 1e3)
            assert batch is not None, "admission stalled with requests waiting"
            estimates.append(estimator.estimate_bytes(batch.admitted))
            sched.finish_batch(batch, sched.executor.execute(batch.rows))
            steps += 1
            bar.update(before - sched.num_waiting)
    return {
        "samples": samples,
        "batch_us": batch_us,
        "batch_sizes": sched.batch_sizes,
        "rejections": dict(sched.rejections),
        "estimates": estimates,
        "steps": steps,
    }


def pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_admission", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print one JSON object (default: also)")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cp-size", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--pages-per-rank", type=int, default=16_384)
    ap.add_argument("--max-prefill-tokens", type=int, default=16_384)
    ap.add_argument("--chunked-prefill-size", type=int, default=16_384)
    ap.add_argument("--max-batch-requests", type=int, default=8)
    ap.add_argument("--max-total-extend-tokens", type=int, default=32_768)
    ap.add_argument("--max-cached-tokens", type=int, default=65_536)
    ap.add_argument("--max-buffer-gib", type=float, default=4.0)
    ap.add_argument("--config", type=Path, default=SHARED_CONFIG)
    ap.add_argument("--progress", action="store_true", help="show progress bars")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)

    if args.config.is_file():
        cfg = ModelConfig.from_pretrained(args.config.parent)
        model = f"GLM-5 dims ({args.config})"
    else:
        cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
        model = f"tiny model ({args.config} not found)"
        logger.warning("%s missing: estimator runs on the tiny model's dims", args.config)
    prompts = workload(args.requests, args.seed, args.page_size)
    runs = {"gates": [], "baseline": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(run_once(prompts, cfg, args, gates=name == "gates"))

    def summary(name: str, key: str = "samples") -> dict:
        reps = runs[name]
        return {
            "p50": statistics.median(pct(r[key], 50) for r in reps),
            "p99": statistics.median(pct(r[key], 99) for r in reps),
            "max": statistics.median(max(r[key]) for r in reps),
            "count": len(reps[0][key]),
        }

    gates, base = summary("gates"), summary("baseline")
    first = runs["gates"][0]
    sizes = Counter(first["batch_sizes"])
    est = first["estimates"]
    result = {
        "requests": args.requests,
        "model": model,
        "cp_size": args.cp_size,
        "page_size": args.page_size,
        "repeats": args.repeats,
        "lengths": {
            "p50": pct([p.size for p in prompts], 50),
            "p99": pct([p.size for p in prompts], 99),
            "max": int(max(p.size for p in prompts)),
        },
        "decision_us": {"gates": gates, "baseline": base, "p99_ratio": gates["p99"] / base["p99"]},
        "schedule_batch_us": {
            "gates": summary("gates", "batch_us"),
            "baseline": summary("baseline", "batch_us"),
        },
        "batches": {
            "formed": len(first["batch_sizes"]),
            "mean_size": float(np.mean(first["batch_sizes"])),
            "size_histogram": {str(k): v for k, v in sorted(sizes.items())},
        },
        "rejections": first["rejections"],
        "estimate_bytes": {
            "limit": int(args.max_buffer_gib * GiB),
            "p50": pct(est, 50),
            "p90": pct(est, 90),
            "max": int(max(est)),
        },
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
