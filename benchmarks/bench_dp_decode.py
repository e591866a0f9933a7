"""Data-parallel decode step vs one device, and the two expert dispatches (issue 36).

    python -m benchmarks.bench_dp_decode [--dp 8] [--batches 8 32] [--context 512]
        [--repeats 5] [--json PATH]

One run, side by side, for each total batch `B` (every row at `--context` tokens):
- `single`: the single-device decode step (`forward_step`, what `--dp-size 1` runs)
  over all `B` rows, every routed expert on the one device;
- `dp_allgather` / `dp_all_to_all`: the `("dp",)` mesh step (`DPDecodeSteps`) with
  `B / dp` rows per rank and the routed experts split over the ranks, tokens reaching
  their experts by all-gather + reduce-scatter or by padded all-to-all;
- `sampler_replicated` / `sampler_split`: the draw after a DP step (log-softmax, then
  temperature 0.8 and top-p 0.95, so the whole-vocabulary sort runs) over `B` rows of
  `--sampler-vocab` logits (default GLM-5's 154,880) on the mesh, as the step used to
  leave them (every row on every device) and as it leaves them now (each rank its own
  rows, `cpkv_jax.sampling.StepLogits`); the tokens must be equal.

The model is the tiny architecture widened (`--hidden`, `--experts`, 2 layers: one dense,
one MoE), float32, page size 64, zero pools (timing only). Prints JSON: median step
milliseconds per (path, batch) after one untimed (compiling) step, and the ratios
`dp_*` / `single`. On CPU the "devices" are virtual and share the host's cores, so the
ratio measures the mesh step's overhead, not a speedup; on a GPU host each rank is a
real device.
"""

from __future__ import annotations

import os

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    # Must precede the first jax import: on CPU the dp mesh wants 8 virtual devices.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cpkv_jax.config import ModelConfig
from cpkv_jax.decode_mesh import DPDecodeSteps, DPPoolLayout, DPRow, build_batch, init_dp_pool
from cpkv_jax.mesh import DP_AXIS, make_dp_mesh
from cpkv_jax.model.forward_batch import batch_from_host
from cpkv_jax.model.kv_cache import init_pool
from cpkv_jax.model.transformer import CausalLM, forward_step
from cpkv_jax.paging import pages_for_tokens
from cpkv_jax.sampling import RowSampling, rows_log_probs, sample
from cpkv_jax.tools.tiny_config import tiny_config_dict

PAGE = 64
INDEX_K = "float32"


def model_config(hidden: int, experts: int) -> ModelConfig:
    d = tiny_config_dict("glm_moe_dsa")
    d.update(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        n_routed_experts=experts,
        num_experts_per_tok=8 if experts >= 8 else 2,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        indexer_types=["full", "shared"],
        mlp_layer_types=["dense", "sparse"],
    )
    return ModelConfig.from_dict(d)


def _median_ms(fn, repeats: int) -> tuple[float, np.ndarray]:
    """Median milliseconds of `fn()` after one untimed (compiling) call, and the logits
    of the first call."""
    first = np.asarray(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times)), first


def time_single(
    model: CausalLM, batch: int, context: int, repeats: int
) -> tuple[float, np.ndarray]:
    cfg = model.cfg
    pages = pages_for_tokens(context + 1, PAGE)
    pool = init_pool(cfg, batch * pages + 1, PAGE, jnp.float32, INDEX_K)
    tables = 1 + np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    pos = np.full((batch, 1), context, np.int32)
    slots = tables[:, context // PAGE : context // PAGE + 1] * PAGE + context % PAGE
    host = batch_from_host(
        np.full((batch, 1), 3, np.int32),
        pos,
        np.ones((batch, 1), bool),
        slots,
        tables,
        np.full((batch,), context + 1, np.int32),
    )
    graphdef, state = nnx.split(model)
    box = [pool]

    def step():
        logits, box[0] = forward_step(graphdef, state, host, box[0], index_k_dtype=INDEX_K)
        return jax.block_until_ready(logits)

    return _median_ms(step, repeats)


def time_dp(
    model: CausalLM, dp: int, batch: int, context: int, repeats: int, dispatch: str
) -> tuple[float, np.ndarray]:
    cfg = model.cfg
    per_rank = batch // dp
    pages = pages_for_tokens(context + 1, PAGE)
    layout = DPPoolLayout(dp, per_rank * pages + 1, PAGE)
    mesh = make_dp_mesh(dp)
    pool = init_dp_pool(cfg, layout, mesh, jnp.float32, INDEX_K)
    steps = DPDecodeSteps(model, mesh, layout, pool, index_k_dtype=INDEX_K, ep_dispatch=dispatch)
    rows = []
    for rank in range(dp):
        for i in range(per_rank):
            local = 1 + i * pages + np.arange(pages)
            rows.append(
                DPRow(
                    rank,
                    np.asarray([3], np.int32),
                    context,
                    rank * layout.pages_per_rank + local,
                    pages,
                )
            )
    shape, order, host = build_batch(layout, rows, prefill=False)
    box = [pool]

    def step():
        logits, box[0] = steps.run(shape, host, box[0])
        return jax.block_until_ready(logits)  # left on the ranks, as the server's

    ms, first = _median_ms(step, repeats)
    return ms, first[order[:batch]]


def time_sampler(
    dp: int, batch: int, vocab: int, repeats: int
) -> dict[str, tuple[float, np.ndarray]]:
    """The draw over `batch` rows of logits on the `dp` mesh, replicated vs split."""
    mesh = make_dp_mesh(dp)
    logits = np.random.default_rng(0).standard_normal((batch, vocab), dtype=np.float32) * 3
    rows = [RowSampling(temperature=0.8, top_p=0.95, seed=i, step=1) for i in range(batch)]
    out = {}
    for name, spec in (("replicated", P()), ("split", P(DP_AXIS))):
        placed = jax.device_put(logits, NamedSharding(mesh, spec))
        out[name] = _median_ms(lambda x=placed: sample(rows_log_probs(x), rows).tokens, repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_dp_decode")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--batches", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sampler-vocab", type=int, default=154_880)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if any(b % args.dp for b in args.batches):
        ap.error(f"every batch must divide by --dp {args.dp}")
    cfg = model_config(args.hidden, args.experts)
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    results = []
    for batch in args.batches:
        row = {"batch": batch, "rows_per_rank": batch // args.dp}
        row["single_ms"], want = time_single(model, batch, args.context, args.repeats)
        for dispatch in ("allgather", "all_to_all"):
            ms, got = time_dp(model, args.dp, batch, args.context, args.repeats, dispatch)
            row[f"dp_{dispatch}_ms"] = ms
            row[f"dp_{dispatch}_vs_single"] = ms / row["single_ms"]
            # Same rows, same model: the DP step's logits are the single step's.
            row[f"dp_{dispatch}_max_logit_diff"] = float(np.abs(got - want).max())
        drawn = time_sampler(args.dp, batch, args.sampler_vocab, args.repeats)
        for name, (ms, _) in drawn.items():
            row[f"sampler_{name}_ms"] = ms
        row["sampler_split_vs_replicated"] = row["sampler_split_ms"] / row["sampler_replicated_ms"]
        row["sampler_tokens_equal"] = bool(
            np.array_equal(drawn["split"][1], drawn["replicated"][1])
        )
        results.append(row)
    out = {
        "benchmark": "bench_dp_decode",
        "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind,
        "dp": args.dp,
        "context": args.context,
        "hidden": args.hidden,
        "experts": args.experts,
        "repeats": args.repeats,
        "sampler_vocab": args.sampler_vocab,
        "results": results,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
