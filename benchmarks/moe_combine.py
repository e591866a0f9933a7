"""MoE combine: the fixed-order un-sort + add (`moe.combine_expert_outputs`) vs a scatter-add.

    python -m benchmarks.moe_combine [--tokens 4096 16384] [--hidden 6144] [--topk 8]
                                     [--dtype bfloat16] [--repeats 30] [--json PATH]

The routed experts' outputs come out of `ragged_dot` sorted by expert; each token's
`topk` rows must be summed back. The model does it with an inverse permutation and
explicit adds in slot order (deterministic on every backend); the common alternative,
`zeros.at[token].add(ys)`, is a float scatter-add (atomics on GPU, not repeatable run to
run). Both are timed here, in the same process, on random routings at GLM-5 dims
(hidden 6144, 8 experts per token), as the median of `--repeats` calls after warm-up,
and each is run twice to report whether its output bits repeat.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import emit, environment
from cpkv_jax.model.moe import combine_expert_outputs


def _scatter_add(ys, order, k: int):
    n = ys.shape[0] // k
    token = order // k
    return jnp.zeros((n, ys.shape[1]), jnp.float32).at[token].add(ys.astype(jnp.float32))


def _median_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(tokens: int, hidden: int, topk: int, dtype, repeats: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    experts = rng.integers(0, 256, (tokens, topk))
    order = jnp.asarray(np.argsort(experts.reshape(-1), stable=True).astype(np.int32))
    ys = jax.random.normal(jax.random.key(seed), (tokens * topk, hidden), jnp.float32).astype(dtype)
    fixed = jax.jit(lambda y, o: combine_expert_outputs(y, o, topk))
    scatter = jax.jit(lambda y, o: _scatter_add(y, o, topk))
    a, b = fixed(ys, order), scatter(ys, order)
    # Both sum the same float32 values; only the order of the adds differs.
    max_diff = float(jnp.max(jnp.abs(a - b)))
    repeat_fixed = bool(jnp.array_equal(a, fixed(ys, order)))
    repeat_scatter = bool(jnp.array_equal(b, scatter(ys, order)))
    fixed_ms = _median_ms(fixed, (ys, order), repeats)
    scatter_ms = _median_ms(scatter, (ys, order), repeats)
    return {
        "tokens": tokens,
        "hidden": hidden,
        "topk": topk,
        "dtype": str(jnp.dtype(dtype)),
        "fixed_order_ms": fixed_ms,
        "scatter_add_ms": scatter_ms,
        "fixed_over_scatter": fixed_ms / scatter_ms,
        "max_abs_diff": max_diff,
        "fixed_order_repeats_bitwise": repeat_fixed,
        "scatter_add_repeats_bitwise": repeat_scatter,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    out = {
        **environment(),
        "cases": [
            measure(n, args.hidden, args.topk, jnp.dtype(args.dtype), args.repeats)
            for n in args.tokens
        ],
    }
    emit(out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
