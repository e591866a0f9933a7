"""What the token blocks of the indexer and sparse attention cost, and what they save.

    python -m benchmarks.token_blocks [--tokens 256] [--view 16384] [--heads 16]
        [--budgets-mib 64 256] [--repeats 5] [--json PATH]

One rank's share of a long-context prefill step at GLM-5 head sizes (indexer: 32 heads of
128, top-k 2048; MLA latent 512 + rope 64, absorbed form; `--heads` query heads, fewer
than GLM-5's 64 so a CPU run stays short): `--tokens` query tokens over a `--view`-token
KV view, fresh random inputs. The indexer (`indexer_topk`: scores and top-k) and
`sparse_attention` are compiled once in one piece (`block_bytes` unlimited, the program
before token blocks) and once per `--budgets-mib` budget, all in this process; each is
timed `--repeats` times after a warm-up (median). Reported per budget: rows per block,
XLA's temporary bytes (`memory_analysis().temp_size_in_bytes`), the median time and its
ratio to the one-piece program, and how the results agree with it (indexer: the same
top-k, and the mean fraction of each token's selected positions the two share, which
sits below 1 where a different reduction order flips near-ties, as on a GPU; attention:
max |diff|). Run with `JAX_DEFAULT_MATMUL_PRECISION=highest` to tell such rounding from
a real difference. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import emit, environment
from cpkv_jax.buckets import block_rows
from cpkv_jax.model.indexer import indexer_topk
from cpkv_jax.model.mla import sparse_attention
from cpkv_jax.units import MiB

INDEX_HEADS, INDEX_DIM, TOPK = 32, 128, 2048
LORA, ROPE, NOPE, V = 512, 64, 128, 128
UNLIMITED = 1 << 62


def _timed(fn, args, repeats: int) -> tuple[float, object]:
    out = jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _inputs(tokens: int, view: int, heads: int, seed: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)

    positions = np.arange(view - tokens, view)[None]  # the chunk at the end of the view
    topk = np.full((1, tokens, TOPK), -1)  # -1: fewer than TOPK positions to choose from
    for i, p in enumerate(positions[0]):
        n = min(TOPK, p + 1)
        topk[0, i, :n] = rng.choice(p + 1, n, replace=False)
    return {
        "q": normal(1, tokens, INDEX_HEADS, INDEX_DIM),
        "w": normal(1, tokens, INDEX_HEADS, scale=0.1),
        "k": normal(1, view, INDEX_DIM),
        "positions": jnp.asarray(positions, jnp.int32),
        "kv_lens": jnp.asarray([view], jnp.int32),
        "q_nope": normal(1, tokens, heads, NOPE),
        "q_pe": normal(1, tokens, heads, ROPE),
        "latent": normal(1, view, LORA + ROPE),
        "topk": jnp.asarray(topk, jnp.int32),
        "w_kv_b": normal(heads * (NOPE + V), LORA, scale=LORA**-0.5),
    }


def topk_overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over query tokens of the fraction of `a`'s selected positions (-1 = none) that
    `b` selects too; order within a token's top-k does not matter."""
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    shared = chosen = 0
    for ra, rb in zip(a, b, strict=True):
        ra = ra[ra >= 0]
        shared += np.intersect1d(ra, rb[rb >= 0], assume_unique=True).size
        chosen += ra.size
    return shared / chosen if chosen else 1.0


def measure(tokens: int, view: int, heads: int, budgets_mib, repeats: int, seed: int = 0):
    if tokens < 1 or view < TOPK or tokens > view:
        raise SystemExit(f"need 1 <= --tokens <= --view and --view >= {TOPK}")
    x = _inputs(tokens, view, heads, seed)
    index_args = (x["q"], x["w"], x["k"], x["positions"], x["kv_lens"])
    attn_args = (x["q_nope"], x["q_pe"], x["latent"], x["topk"], x["w_kv_b"])

    def indexer(budget):
        return jax.jit(functools.partial(indexer_topk, index_topk=TOPK, block_bytes=budget))

    def attention(budget):
        return jax.jit(
            functools.partial(
                sparse_attention,
                kv_lora_rank=LORA,
                v_head_dim=V,
                scale=(NOPE + ROPE) ** -0.5,
                form="absorbed",
                block_bytes=budget,
            )
        )

    parts = {
        "indexer": (indexer, index_args, INDEX_HEADS * view * 4),
        "sparse_attention": (attention, attn_args, TOPK * (LORA + ROPE) * 4),
    }
    report = {}
    for name, (build, args, row_bytes) in parts.items():
        rows = []
        base_s = base_out = None
        for budget in (UNLIMITED, *(b * MiB for b in budgets_mib)):
            fn = build(budget)
            temp = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
            seconds, out = _timed(fn, args, repeats)
            out = np.asarray(out)
            row = {
                "budget_mib": None if budget == UNLIMITED else budget // MiB,
                "rows_per_block": block_rows(tokens, row_bytes, budget),
                "temp_bytes": int(temp),
                "seconds": seconds,
            }
            if base_out is None:
                base_s, base_out = seconds, out
            else:
                row["time_ratio"] = seconds / base_s
                if name == "indexer":
                    row["same_topk"] = bool(np.array_equal(out, base_out))
                    row["topk_overlap"] = topk_overlap(out, base_out)
                else:
                    row["max_abs_diff"] = float(np.max(np.abs(out - base_out)))
            rows.append(row)
        report[name] = rows
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.token_blocks", description=__doc__)
    ap.add_argument("--tokens", type=int, default=256, help="query tokens (one rank's chunk)")
    ap.add_argument("--view", type=int, default=16384, help="KV view tokens")
    ap.add_argument("--heads", type=int, default=16, help="MLA query heads (GLM-5: 64)")
    ap.add_argument("--budgets-mib", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if any(b <= 0 for b in args.budgets_mib) or args.repeats < 1:
        raise SystemExit("--budgets-mib must be positive and --repeats >= 1")
    report = {
        "tokens": args.tokens,
        "view": args.view,
        "heads": args.heads,
        "index_heads": INDEX_HEADS,
        "index_topk": TOPK,
        "repeats": args.repeats,
        **measure(args.tokens, args.view, args.heads, args.budgets_mib, args.repeats),
        "environment": environment(),
    }
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
