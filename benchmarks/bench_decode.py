"""Decode step cost against context: sparse paged decode beside the dense-view path.

    python -m benchmarks.bench_decode [--contexts 2048 32768] [--batches 1 8]
        [--repeats 5] [--json PATH]

A GLM-5-shaped model with GLM-5's real attention and indexer dims (64 heads, q LoRA
2048, KV LoRA 512, rope 64, nope 192, v 256; indexer 32 heads x 128, top-k 2048), hidden
1024, 2 layers with dense FFNs, float32 (`--dtype`; see its note), fp8 index K, page
size 64, on one device. The
jitted `forward_step` is timed directly (one token per row, every row at the same
context, pool filled with random rows; the pool is donated and threaded through) for
each path:
- `sparse` (`PagedKVIO`, what the servers run): the indexer scores every token's index K
  (132 B per token per layer: unavoidable), attention gathers only the top-k latent rows
  from the pool;
- `dense` (`DENSE_VIEW_KV_IO`): the whole context's latent rows are gathered into a view
  first, as every decode step did before issue 35;
- `kernels` (`--kernel-impl pallas`): the sparse path with the Pallas kernels, the top-k
  row gather and the indexer scores read from the paged fp8 index K (no float32 view;
  pages past a row's length are not read, so a 513-page context no longer costs its
  1,024-page bucket). For a GPU: on CPU the kernels run in interpret mode, which times
  the interpreter, not the kernel.
Prints JSON: median step milliseconds per (path, batch, context), the bytes a step must
read at least (`min_bytes`: the weights once, and per row and layer every cached token's
index K and scale - 132 B at GLM-5 dims - plus the top-k latent rows; the roofline a GPU
run is held against, with `gbps` = min_bytes / step time) and, per path and batch,
the ratio of the longest context's step to the shortest's (issue 35's targets: at most
1.5x at batch 1 and 2.5x at batch 8 between 32K and 2K; the dense path measured 2.06x /
5.84x on the dev machine). Medians of `--repeats` after one untimed (compiling) step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpkv_jax.config import ModelConfig
from cpkv_jax.model.forward_batch import batch_from_host
from cpkv_jax.model.kv_cache import (
    DENSE_VIEW_KV_IO,
    DTYPES,
    SINGLE_DEVICE_KV_IO,
    PagedKVIO,
    pool_shapes,
)
from cpkv_jax.model.transformer import CausalLM, forward_step
from cpkv_jax.model_configs import config_dir

PAGE = 64
INDEX_K = "fp8_e4m3"
PATHS = {
    "sparse": SINGLE_DEVICE_KV_IO,
    "dense": DENSE_VIEW_KV_IO,
    "kernels": PagedKVIO(gather_impl="pallas", index_impl="pallas"),
}


def glm5_shaped(layers: int, hidden: int) -> ModelConfig:
    return ModelConfig.from_dict(glm5_shaped_raw(layers, hidden))


def glm5_shaped_raw(layers: int, hidden: int) -> dict:
    """GLM-5's config.json with its attention and indexer dims kept, `hidden` wide and
    `layers` deep, every layer a full indexer layer with a dense FFN, vocab 4096."""
    raw = json.loads((config_dir("glm-5") / "config.json").read_text())
    raw.update(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        first_k_dense_replace=layers,
        indexer_types=["full"] * layers,
        mlp_layer_types=["dense"] * layers,
        layer_types=["indexed_attention"] * layers,
        vocab_size=4096,
    )
    return raw


def random_pool(cfg: ModelConfig, num_pages: int, seed: int, dtype):
    """A pool of random rows (fp8 index K with positive scales): the step's cost does
    not depend on the values, but zeros could take shortcuts a real cache never does."""
    shapes = pool_shapes(cfg, num_pages, PAGE, dtype, INDEX_K)
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for k, s in zip(keys, leaves, strict=True):
        x = jax.random.uniform(k, s.shape, jnp.float32, 0.01, 1.0)
        out.append(x.astype(s.dtype))
    return jax.tree.unflatten(tree, out)


def min_bytes(cfg: ModelConfig, state, batch: int, context: int) -> int:
    """What one decode step must read: weights once; per row and layer, every cached
    token's fp8 index K + float32 scale (the indexer scores them all) and the top-k
    latent rows attention reads (in the pool's dtype)."""
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    latent_row = cfg.kv_cache_dim * graphdef_dtype(state).itemsize
    per_layer = context * (cfg.index_head_dim + 4) + min(cfg.index_topk, context) * latent_row
    return int(weights + batch * cfg.num_hidden_layers * per_layer)


def graphdef_dtype(state) -> Any:
    """The model's parameter dtype: the pool is stored in it, as the servers do."""
    return jax.tree.leaves(state)[0].dtype


def time_steps(
    graphdef, state, cfg, kv_io, batch: int, context: int, repeats: int
) -> tuple[float, np.ndarray]:
    """Median step milliseconds, and the first step's logits (the same pool and batch
    for every path: the paths' logits are compared)."""
    pages_per_row = -(-(context + 1) // PAGE)
    num_pages = 1 + batch * pages_per_row  # page 0: the trash page
    pool = random_pool(cfg, num_pages, context + batch, graphdef_dtype(state))
    tables = 1 + np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row)
    width = 1 << (pages_per_row - 1).bit_length()
    tables = np.pad(tables, ((0, 0), (0, width - pages_per_row)))
    pos = np.full((batch, 1), context, np.int32)  # the new token, after `context` cached
    slots = (tables[:, context // PAGE] * PAGE + context % PAGE)[:, None].astype(np.int32)
    ids = np.random.default_rng(context).integers(3, cfg.vocab_size, (batch, 1), np.int32)
    step = batch_from_host(
        ids, pos, np.ones((batch, 1), bool), slots, tables, np.full((batch,), context + 1, np.int32)
    )

    def run(pool):
        logits, pool = forward_step(
            graphdef, state, step, pool, kv_io=kv_io, index_k_dtype=INDEX_K, form="absorbed"
        )
        jax.block_until_ready(logits)
        return logits, pool

    first, pool = run(pool)  # compiles
    first = np.asarray(first, np.float32)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _, pool = run(pool)
        times.append(time.perf_counter() - t0)
    del pool
    return float(np.median(times)) * 1e3, first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_decode")
    ap.add_argument("--contexts", nargs="+", type=int, default=[2048, 32768])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=["sparse", "dense"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    # float32 by default: XLA:CPU runs a bf16 pool's KV write (a scatter into the donated
    # pool) as a copy of the whole pool, so on CPU a bf16 step costs O(pool size) per
    # layer whatever the attention reads (measured: 220 ms for a 300 MB layer pool, vs
    # 0.03 ms in place in float32). GPUs update bf16 in place.
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    cfg = glm5_shaped(args.layers, args.hidden)
    dtype = DTYPES[args.dtype]
    model = CausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    graphdef, state = nnx.split(model)
    rows: list[dict[str, Any]] = []
    logits: dict[tuple[str, int, int], np.ndarray] = {}
    for path in args.paths:
        for b in args.batches:
            for c in args.contexts:
                ms, logits[path, b, c] = time_steps(
                    graphdef, state, cfg, PATHS[path], b, c, args.repeats
                )
                need = min_bytes(cfg, state, b, c)
                rows.append(
                    {
                        "path": path,
                        "batch": b,
                        "context": c,
                        "step_ms": round(ms, 2),
                        "min_bytes": need,
                        "gbps": round(need / (ms * 1e-3) / 1e9, 2),
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    # Every path must agree with the served sparse one (bf16 model: the same rows,
    # possibly fused or summed differently); `max_logit_diff_*` is the dense path's.
    others = [p for p in args.paths if p != "sparse"] if "sparse" in args.paths else []
    checks = {
        f"max_logit_diff{'' if p == 'dense' else '_' + p}_b{b}_{c}": float(
            np.abs(logits["sparse", b, c] - logits[p, b, c]).max()
        )
        for p in others
        for b in args.batches
        for c in args.contexts
    }
    lo, hi = min(args.contexts), max(args.contexts)
    ms = {(r["path"], r["batch"], r["context"]): r["step_ms"] for r in rows}
    ratios = {
        f"{p}_b{b}_{hi}_over_{lo}": round(ms[p, b, hi] / ms[p, b, lo], 3)
        for p in args.paths
        for b in args.batches
    }
    ratios |= {
        f"{p}_over_sparse_b{b}_{c}": round(ms[p, b, c] / ms["sparse", b, c], 3)
        for p in others
        for b in args.batches
        for c in args.contexts
    }
    report = {
        "bench": "decode_step",
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "attention": "GLM-5 (64 heads, kv_lora 512, rope 64, index 32x128, top-k 2048)",
            "dtype": args.dtype,
            "index_k": INDEX_K,
            "page_size": PAGE,
        },
        "device": str(jax.devices()[0]),
        "repeats": args.repeats,
        "rows": rows,
        "ratios": ratios,
        "checks": checks,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
