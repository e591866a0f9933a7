"""The device sampler's variants side by side, at GLM-5's vocabulary.

    python -m benchmarks.bench_sampler --json [--rows 1 8 64] [--vocab 154880] [--repeats 20]

One decode step's draw (`cpkv_jax.sampling.sample`) on `[rows, vocab]` log-probs that
live on the device, as the decode engine calls it, timed to the host's tokens (the
step's one fetch). Variants, each on the same rows in the same run:

- `plain`: temperature 0.8, top-p 0.95 (the sort-based filters), no penalties;
- `greedy`: temperature 0 on every row (the sort skipped: `lax.cond`);
- `top_logprobs`: the same, every row asking for 5 alternatives (the `[rows, 20]` top-k
  arrays fetched as well);
- `penalized`: every row with a frequency and a presence penalty (its slot's counts
  gathered, shifted, and the drawn token counted, in the sampler's own program);
- `repetition`: every row with a repetition penalty and a logit bias too (the raw
  logits read as well, and a log-softmax recomputed).

Printed: per variant and row count, the median milliseconds over `--repeats` calls after
one warm-up call (the compile), and its ratio to `plain`. The penalty slots are
`PenaltyCounts(rows, vocab)` (the engine's are `min(max running, 256)`): the extra work
is per row, not per slot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np

from cpkv_jax.sampling import PenaltyCounts, RowSampling, sample

GLM5_VOCAB = 154880

VARIANTS = {
    "plain": lambda i: RowSampling(0.8, top_p=0.95, seed=i, step=3),
    "greedy": lambda i: RowSampling(seed=i, step=3),
    "top_logprobs": lambda i: RowSampling(0.8, top_p=0.95, seed=i, step=3, top_n=5),
    "penalized": lambda i: RowSampling(
        0.8, top_p=0.95, seed=i, step=3, frequency_penalty=0.5, presence_penalty=0.3, slot=i
    ),
    "repetition": lambda i: RowSampling(
        0.8, top_p=0.95, seed=i, step=3, repetition_penalty=1.2, logit_bias=True, slot=i
    ),
}


def time_variant(name: str, rows: int, vocab: int, repeats: int, rng: np.random.Generator) -> float:
    """Median ms of one draw of `rows` rows of variant `name` (after a warm-up call)."""
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    logits = jax.device_put(rng.normal(size=(rows, vocab)).astype(np.float32) * 3, sharding)
    lp = jax.nn.log_softmax(logits, axis=-1)
    counts = PenaltyCounts(rows, vocab, sharding)
    for i in range(rows):
        out = rng.integers(0, vocab, 64)
        counts.reset(i, out, rng.integers(0, vocab, 256), [(int(out[0]), -1.0)])
    params = [VARIANTS[name](i) for i in range(rows)]
    sample(lp, params, counts, logits=logits)  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sample(lp, params, counts, logits=logits)  # ends with the tokens on the host
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(rows_list: Sequence[int], vocab: int, repeats: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out: dict = {"vocab": vocab, "repeats": repeats, "device": str(jax.devices()[0]), "rows": {}}
    for rows in rows_list:
        ms = {name: time_variant(name, rows, vocab, repeats, rng) for name in VARIANTS}
        out["rows"][str(rows)] = {
            name: {"median_ms": round(v, 3), "vs_plain": round(v / ms["plain"], 3)}
            for name, v in ms.items()
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--vocab", type=int, default=GLM5_VOCAB)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object (the default)")
    args = ap.parse_args(argv)
    if min(args.rows) < 1 or args.vocab < 2 or args.repeats < 1:
        ap.error("--rows, --vocab and --repeats must be positive (vocab >= 2)")
    print(json.dumps(run(args.rows, args.vocab, args.repeats, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
