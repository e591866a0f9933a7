"""What XLA allocates for the decode step at GLM-5 dims: issue 36's missing decode term.

    python -m benchmarks.decode_memory [--layers 4 5] [--rows 1 32] [--contexts 4096 131072]
        [--hidden H --experts E --intermediate I] [--no-fp8] [--tokens N | --cp N]
        [--json PATH]

The servers' memory plan counts weights, the KV pool, one layer's FP8 dequantization and
the decode step's own buffers (`serving.decode.step_memory`) per device, not a copy of
every layer's weights kept through the step. This compiles the step the decode engine
runs (`forward_step` with the sparse paged KV I/O, as `serving.decode.steps.DecodeSteps`
lowers it: one token per row, `rows` rows, page tables of `context / 64` pages) on
abstract weights and pool, on JAX's default backend, at GLM-5's real dims (its
config.json; the first `layers` layers, so 3 dense then MoE ones; FP8 weights in 128 x 128
blocks unless `--no-fp8`; bf16), and reports XLA's `memory_analysis()` for each (layers,
rows, context): argument, output and temporary bytes. Nothing is allocated but the
compiler's own memory.

The figure that matters is `growth`: per (rows, context), how the temporaries grow with
one more MoE layer (`temp_per_moe_layer`) against how its stored weights do
(`weights_per_moe_layer`, the growth of the step's arguments) and their ratio. A step
whose buffers are reused layer to layer adds ~0; a compiler that keeps a per-layer copy
of the weights alive (converted or transposed) adds that copy's bytes for every layer,
and then no per-device plan of a 78-layer model holds. `--hidden`, `--experts` and
`--intermediate` shrink the model for a smoke run (tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cpkv_jax.buckets import TRANSIENT_BLOCK_BYTES, page_table_width
from cpkv_jax.config import ModelConfig
from cpkv_jax.cp_decode import build_decode_step
from cpkv_jax.kv_pool import PoolLayout, cp_pool_shapes
from cpkv_jax.mesh import CP_AXIS, make_cp_mesh
from cpkv_jax.model.expert_parallel import EPSpec, param_shardings, param_specs
from cpkv_jax.model.forward_batch import abstract_batch
from cpkv_jax.model.kv_cache import SINGLE_DEVICE_KV_IO, pool_shapes
from cpkv_jax.model.transformer import forward_step
from cpkv_jax.model.weights import abstract_model
from cpkv_jax.model_configs import config_dir
from cpkv_jax.owner_attention import OwnerCPKVIO

PAGE = 64
INDEX_K = "fp8_e4m3"
FP8_BLOCK = (128, 128)


def glm5_layers(
    layers: int,
    hidden: int | None = None,
    experts: int | None = None,
    intermediate: int | None = None,
) -> ModelConfig:
    """GLM-5's config cut to its first `layers` layers (optionally narrower: tests)."""
    cfg = ModelConfig.from_pretrained(config_dir("glm-5"))
    changes: dict[str, Any] = {
        "num_hidden_layers": layers,
        "indexer_types": cfg.indexer_types[:layers],
        "mlp_layer_types": cfg.mlp_layer_types[:layers],
    }
    if hidden is not None:
        changes["hidden_size"] = hidden
    if experts is not None:
        changes["n_routed_experts"] = experts
        changes["n_group"] = min(cfg.n_group, experts)
        changes["topk_group"] = min(cfg.topk_group, changes["n_group"])
    if intermediate is not None:
        changes["intermediate_size"] = intermediate
        changes["moe_intermediate_size"] = intermediate
    return dataclasses.replace(cfg, **changes)


def step_memory(
    cfg: ModelConfig, rows: int, context: int, fp8: bool, tokens: int = 1
) -> dict[str, Any]:
    """XLA's memory analysis of the decode step of `rows` rows at `context` tokens; with
    `tokens` > 1, of a prefill chunk of that many new tokens per row (in the servers'
    token blocks, `--transient-block-size`'s default)."""
    width = -(-context // PAGE)
    bf16 = jnp.bfloat16
    model = abstract_model(cfg, bf16, bf16, fp8_block=FP8_BLOCK if fp8 else None)
    graphdef, state = nnx.split(model)
    pool = pool_shapes(cfg, width + 1, PAGE, bf16, INDEX_K)
    t0 = time.perf_counter()
    compiled = forward_step.lower(
        graphdef,
        state,
        abstract_batch(rows, tokens, width),
        pool,
        kv_io=SINGLE_DEVICE_KV_IO,
        index_k_dtype=INDEX_K,
        form="absorbed",
        invariant=False,
        block_bytes=TRANSIENT_BLOCK_BYTES if tokens > 1 else None,
    ).compile()
    return {**_figures(cfg, rows, context, compiled, t0), "tokens": tokens}


def _figures(cfg: ModelConfig, rows: int, context: int, compiled, t0: float) -> dict[str, Any]:
    """One run's record: the shapes and XLA's memory analysis of `compiled`."""
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older JAX: one per program
    return {
        "layers": cfg.num_hidden_layers,
        "moe_layers": sum(t == "sparse" for t in cfg.mlp_layer_types),
        "rows": rows,
        "context": context,
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        # XLA's cost model: bytes read and written by the step's ops (per device)
        "bytes_accessed": int((cost or {}).get("bytes accessed", 0)),
        "compile_s": round(time.perf_counter() - t0, 2),
    }


def abstract_placed_state(state: nnx.State, mesh) -> nnx.State:
    """`state`'s `ShapeDtypeStruct`s with the shardings the CP/EP runner places them with
    (routed experts split over `"cp"`, the rest replicated)."""
    shardings = dict(nnx.to_flat_state(param_shardings(state, mesh, CP_AXIS)))
    flat = []
    for path, var in nnx.to_flat_state(state):
        sharding = shardings[path]
        sharding = sharding.get_value() if hasattr(sharding, "get_value") else sharding
        value = var.get_value()
        flat.append(
            (path, var.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)))
        )
    return nnx.from_flat_state(flat)


def cp_step_memory(cfg: ModelConfig, rows: int, context: int, fp8: bool, cp: int) -> dict[str, Any]:
    """XLA's memory analysis, per device, of the CP decode step (`cpkv_jax.cp_decode`:
    rows split over `cp` ranks, owner attention over page-owned pools, EP over the same
    ranks) lowered by `build_decode_step` on abstract weights placed as the runner places
    them: `rows` rows at `context` tokens, each rank's pool holding its share."""
    bf16 = jnp.bfloat16
    mesh = make_cp_mesh(cp)
    model = abstract_model(cfg, bf16, bf16, fp8_block=FP8_BLOCK if fp8 else None)
    graphdef, state = nnx.split(model)
    width = page_table_width(-(-context // PAGE), cp)
    layout = PoolLayout(cp, True, width // cp + 1, PAGE)
    pool_sharding = NamedSharding(mesh, layout.spec)
    pool = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=pool_sharding),
        cp_pool_shapes(cfg, layout, bf16, INDEX_K),
    )
    split = NamedSharding(mesh, P(CP_AXIS))

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=split)

    tokens = tuple(arg((rows, 1), d) for d in (jnp.int32, jnp.int32, jnp.bool_, jnp.int32))
    step = build_decode_step(
        graphdef,
        mesh,
        layout.spec,
        OwnerCPKVIO(cp, True, query_axis=0),
        param_specs(state, CP_AXIS),
        ep=EPSpec(CP_AXIS, cp),
        index_k_dtype=INDEX_K,
    )
    t0 = time.perf_counter()
    args = (abstract_placed_state(state, mesh), tokens, arg((rows, width), jnp.int32))
    compiled = step.lower(*args, arg((rows,), jnp.int32), pool).compile()
    return {"cp": cp, **_figures(cfg, rows, context, compiled, t0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 5])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 131072])
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--no-fp8", action="store_true", help="bf16 weights instead of FP8")
    p.add_argument(
        "--tokens",
        type=int,
        default=1,
        help="new tokens per row: 1 is a decode step, more a prefill chunk (one device; "
        "the layer-by-layer dequantization holds there too)",
    )
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="N > 1: the CP decode step (cpkv_jax.cp_decode, owner attention, EP N) per "
        "device of an N-device cp mesh (needs N devices: virtual CPU devices on CPU)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if len(args.layers) < 2:
        p.error("--layers needs two counts at least (the growth per layer)")
    fp8 = not args.no_fp8
    shrink = (args.hidden, args.experts, args.intermediate)
    if args.cp > len(jax.devices()):
        p.error(f"--cp {args.cp} needs {args.cp} devices, found {len(jax.devices())}")
    if args.cp > 1 and args.tokens != 1:
        p.error("--tokens applies to the one-device step; --cp lowers the CP decode step")
    if args.cp > 1 and any(r % args.cp for r in args.rows):
        p.error(f"--cp {args.cp} splits the rows over its ranks: --rows must be multiples of it")

    def measure(cfg, rows, ctx):
        if args.cp > 1:
            return cp_step_memory(cfg, rows, ctx, fp8, args.cp)
        return step_memory(cfg, rows, ctx, fp8, args.tokens)

    runs = [
        measure(glm5_layers(n, *shrink), rows, ctx)
        for rows in args.rows
        for ctx in args.contexts
        for n in sorted(args.layers)
    ]
    growth = []
    for rows in args.rows:
        for ctx in args.contexts:
            pts = [r for r in runs if r["rows"] == rows and r["context"] == ctx]
            lo, hi = pts[0], pts[-1]
            n = max(1, hi["moe_layers"] - lo["moe_layers"])
            temp = (hi["temp_bytes"] - lo["temp_bytes"]) // n
            weights = (hi["argument_bytes"] - lo["argument_bytes"]) // n
            moved = (hi["bytes_accessed"] - lo["bytes_accessed"]) // n
            growth.append(
                {
                    "rows": rows,
                    "context": ctx,
                    "temp_per_moe_layer": temp,
                    "weights_per_moe_layer": weights,
                    "temp_over_weights": round(temp / max(1, weights), 3),
                    # 1.0 is the floor (each stored weight byte read once); a dequantized
                    # copy written and read again adds 2 x its itemsize per FP8 byte
                    "accessed_per_moe_layer": moved,
                    "accessed_over_weights": round(moved / max(1, weights), 3),
                }
            )
    cfg = glm5_layers(max(args.layers), *shrink)
    report = {
        "bench": "decode_memory",
        "cp": args.cp,
        "tokens": args.tokens,
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "model": {
            "config": "glm-5",
            "hidden": cfg.hidden_size,
            "n_routed_experts": cfg.n_routed_experts,
            "moe_intermediate": cfg.moe_intermediate_size,
            "fp8_weights": fp8,
            "page_size": PAGE,
            "index_k_dtype": INDEX_K,
        },
        "runs": runs,
        "growth": growth,
    }
    text = json.dumps(report, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    if "--cp" in sys.argv and "XLA_FLAGS" not in os.environ:  # before JAX starts
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.exit(main())
