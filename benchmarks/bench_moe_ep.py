"""MoE layer: expert parallel (all-gather / all-to-all dispatch) vs replicated experts.

    python -m benchmarks.bench_moe_ep [--tokens 512 2048] [--cp 8] [--hidden 256]
        [--moe-intermediate 128] [--experts 16] [--topk 4] [--shared 1]
        [--dtype bfloat16] [--repeats 10] [--warmup 2] [--fp8] [--json PATH]
    python -m benchmarks.bench_moe_ep --gpu [--tokens 4096 16384] [--repeats 20] [--json PATH]

Mesh mode (default): ONE MoE layer (`MoE.__call__`: router + routed experts + shared
expert) on `[1, tokens, hidden]`, its tokens split over the `"cp"` mesh axis inside
`jax.shard_map` (each rank its own `tokens / cp` rows), as `cp_prefill._build_step` runs
the model, in three variants timed side by side in one process:
- `replicated`: every rank holds all routed experts (`param_specs(state, None)`), no EP
  context;
- `ep_allgather`, `ep_all_to_all`: routed experts split over `"cp"` (`param_specs(state,
  "cp")`), traced inside `expert_parallel(EPSpec("cp", cp, dispatch))` (default capacity:
  exact).
The module is really initialized (`MoE(cfg, rngs=nnx.Rngs(0), ...)`, dims from the flags
over `tiny_config_dict`). Each variant: median ms, ratio to `replicated`, and the max
|diff| of its output against `replicated`'s (and whether the bits are equal); per case
`ep_vs_replicated` says `bitwise`, `float-rounding` (within 4 eps x max |output|) or
`mismatch`. On CPU, `lax.ragged_dot` has no kernel: JAX lowers it to a dense dot over
masked `[groups, rows, hidden]` operands that contracts over groups x hidden, so its
rounding (and its cost, groups x rows) depends on the number of local experts and rows:
EP (E/S experts, S times the rows) does the same FLOPs as replicated there, and its
outputs can differ from replicated's by float rounding at sizes where the dot blocks.

`--fp8`: the same three variants again with FP8 block-quantized routed experts
(`fp8.quantize_np` of the bf16 module's weights, set as the `<proj>` fp8 and
`<proj>_scale_inv` leaves `RoutedExperts.to_fp8` declares; dequantized inside the step),
each timed against its unquantized twin (`ratio_vs_unquantized`: the dequant cost), plus the
quantization error against bf16 and a bitwise check against dequantize-at-load weights.

`--gpu` (needs a GPU; refuses with exit code 2 otherwise): ONE GLM-5-size MoE layer on
ONE device holding EP8's per-device share: 32 local routed experts (hidden 6144,
moe_intermediate 2048, 1 shared expert; GLM-5 routes top-8 of 256, and here each token's
8 pairs go to 8 distinct experts of the local 0..31, uniformly at random, so the router
is not run), FP8 dequant-in-step vs bf16 weights, tokens 4096 and 16384 by default.

Timing: every function is compiled and called `--warmup` times, then the variants are
called in turn (rotating the order each round) `--repeats` rounds; medians reported.
Prints one JSON object (`--json` also writes it, indented).
"""

from __future__ import annotations

import os

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    # Must precede the first jax import: the mesh mode wants 8 CPU devices.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.report import emit, environment
from cpkv_jax.config import ModelConfig
from cpkv_jax.mesh import CP_AXIS, make_cp_mesh
from cpkv_jax.model import fp8
from cpkv_jax.model.expert_parallel import (
    EPSpec,
    bytes_per_device,
    expert_parallel,
    param_shardings,
    param_specs,
)
from cpkv_jax.model.moe import EXPERT_PROJS, MoE
from cpkv_jax.model_configs import config_dir
from cpkv_jax.tools.tiny_config import tiny_config_dict

MESH_TOKENS = (512, 2048)
GPU_TOKENS = (4096, 16384)
GPU_LOCAL_EXPERTS = 32  # GLM-5's 256 routed experts over EP8
DISPATCHES = ("allgather", "all_to_all")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


# ---- module construction ----------------------------------------------------------------


def mesh_config(args: argparse.Namespace) -> ModelConfig:
    raw = tiny_config_dict("glm_moe_dsa")
    raw.update(
        hidden_size=args.hidden,
        moe_intermediate_size=args.moe_intermediate,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.topk,
        n_shared_experts=args.shared,
        n_group=1,
        topk_group=1,
    )
    return ModelConfig.from_dict(raw)


def _quantize_stacked(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """`fp8.quantize_np` of `[E, out, in]`, one expert at a time (bounded host memory;
    blocks never span experts, so the result equals one call on the stack)."""
    parts = [fp8.quantize_np(w[e], block) for e in range(w.shape[0])]
    return np.stack([q for q, _ in parts]), np.stack([s for _, s in parts])


def fp8_twins(cfg: ModelConfig, moe: MoE, block: tuple[int, int], **kw) -> tuple[MoE, MoE]:
    """Copies of `moe` (built again from the same seed) whose routed experts are
    (FP8 + `_scale_inv`, dequantized in the step) and (the same values dequantized at
    load, in the param dtype): same weight values, so their outputs should be bitwise."""
    fp8_moe, load_moe = (MoE(cfg, rngs=nnx.Rngs(0), **kw) for _ in range(2))
    for proj in EXPERT_PROJS:
        w = np.asarray(getattr(moe.experts, proj)[...].astype(jnp.float32))
        q, scale = _quantize_stacked(w, block)
        setattr(fp8_moe.experts, proj, nnx.Param(jnp.asarray(q)))
        setattr(fp8_moe.experts, proj + fp8.SCALE_SUFFIX, nnx.Param(jnp.asarray(scale)))
        deq = fp8.dequantize_np(q, scale, block)
        setattr(load_moe.experts, proj, nnx.Param(jnp.asarray(deq).astype(kw["param_dtype"])))
    fp8_moe.experts.block = tuple(block)
    return fp8_moe, load_moe


def _block(cfg: ModelConfig, flag: Sequence[int] | None) -> tuple[int, int]:
    if flag:
        return (int(flag[0]), int(flag[1]))
    return tuple(cfg.weight_block_size or fp8.DEFAULT_BLOCK)  # type: ignore[return-value]


# ---- timing -----------------------------------------------------------------------------


def time_side_by_side(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int
) -> dict[str, float]:
    """Median ms of each zero-arg call, the variants interleaved round by round (rotated
    start) so slow phases of a noisy host hit every variant alike."""
    for fn in fns.values():
        for _ in range(max(1, warmup)):
            jax.block_until_ready(fn())
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[name]())
            times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}


def _compare(out: np.ndarray, ref: np.ndarray) -> dict[str, Any]:
    return {
        "max_abs_diff": float(np.abs(out.astype(np.float64) - ref.astype(np.float64)).max()),
        "bitwise_equal": bool(np.array_equal(out.view(np.uint8), ref.view(np.uint8))),
    }


def _diff_kind(rows: list[dict[str, Any]], scale: float, dtype) -> str:
    """`bitwise`, `float-rounding` (every max |diff| within 4 eps of `dtype` times the
    largest |output|), else `mismatch`."""
    if all(r["bitwise_equal"] for r in rows):
        return "bitwise"
    tol = 4 * float(jnp.finfo(dtype).eps) * scale
    return "float-rounding" if all(r["max_abs_diff"] <= tol for r in rows) else "mismatch"


# ---- mesh mode: EP vs replicated on cp devices -------------------------------------------


def _mesh_step(graphdef, state, mesh, ep: EPSpec | None):
    """jit(shard_map(MoE)) with the state placed as `cp_prefill` places it."""
    axis = None if ep is None else ep.axis

    def per_rank(state, x):
        moe = nnx.merge(graphdef, state)
        with expert_parallel(ep):  # read while tracing
            return moe(x)

    step = jax.jit(
        jax.shard_map(
            per_rank,
            mesh=mesh,
            in_specs=(param_specs(state, axis), P(None, CP_AXIS)),
            out_specs=P(None, CP_AXIS),
            check_vma=False,
        )
    )
    shardings = param_shardings(state, mesh, axis)
    return step, jax.device_put(state, shardings), bytes_per_device(state, shardings)


def run_mesh(args: argparse.Namespace) -> dict[str, Any]:
    cfg = mesh_config(args)
    cp = args.cp
    mesh = make_cp_mesh(cp)
    dtype = DTYPES[args.dtype]
    kw = {"dtype": dtype, "param_dtype": dtype}
    moe = MoE(cfg, rngs=nnx.Rngs(0), **kw)
    modules = {"bf16" if args.dtype == "bfloat16" else args.dtype: moe}
    block = _block(cfg, args.block)
    if args.fp8:
        modules["fp8"], modules["dequant_at_load"] = fp8_twins(cfg, moe, block, **kw)
    modes: dict[str, EPSpec | None] = {"replicated": None}
    modes.update({f"ep_{d}": EPSpec(CP_AXIS, cp, d) for d in DISPATCHES})  # type: ignore[arg-type]

    steps: dict[str, tuple] = {}  # name -> (step, placed state)
    memory: dict[str, dict[str, int]] = {}
    base = next(iter(modules))
    for weights, module in modules.items():
        graphdef, state = nnx.split(module)
        for mode, ep in modes.items():
            if weights == "dequant_at_load" and mode != "replicated":
                continue  # a numerics reference only
            name = mode if weights == base else f"{mode}_{weights}"
            step, placed, mem = _mesh_step(graphdef, state, mesh, ep)
            steps[name] = (step, placed)
            memory[name] = mem
    timed = [n for n in steps if not n.endswith("dequant_at_load")]

    cases = []
    x_sharding = NamedSharding(mesh, P(None, CP_AXIS))
    for n_tokens in args.tokens:
        if n_tokens % cp:
            raise SystemExit(f"--tokens {n_tokens} must be a multiple of --cp {cp}")
        x_host = np.asarray(
            jax.random.normal(jax.random.key(n_tokens), (1, n_tokens, cfg.hidden_size)).astype(
                dtype
            )
        )
        x = jax.device_put(x_host, x_sharding)
        outs = {n: np.asarray(step(placed, x)) for n, (step, placed) in steps.items()}
        ms = time_side_by_side(
            {n: (lambda s=steps[n], x=x: s[0](s[1], x)) for n in timed}, args.repeats, args.warmup
        )
        scale = float(np.abs(outs["replicated"].astype(np.float32)).max())
        variants: dict[str, dict[str, Any]] = {}
        for name in timed:
            ref = "replicated_fp8" if name.endswith("_fp8") else "replicated"
            row = {"ms": ms[name], "ratio_vs_replicated": ms[name] / ms[ref]}
            row.update(_compare(outs[name], outs[ref]))
            if name.endswith("_fp8"):
                twin = name.removesuffix("_fp8")
                row["ratio_vs_unquantized"] = ms[name] / ms[twin]
            variants[name] = row
        case: dict[str, Any] = {
            "tokens": n_tokens,
            "tokens_per_rank": n_tokens // cp,
            "variants": variants,
            "max_abs_output": scale,
            "ep_vs_replicated": _diff_kind(
                [r for n, r in variants.items() if n.startswith("ep_")], scale, dtype
            ),
        }
        if args.fp8:
            case["fp8"] = {
                "max_abs_diff_vs_unquantized": _compare(outs["replicated_fp8"], outs["replicated"])[
                    "max_abs_diff"
                ],
                "in_step_vs_dequant_at_load": _compare(
                    outs["replicated_fp8"], outs["replicated_dequant_at_load"]
                ),
            }
        cases.append(case)
    return {
        **environment(),
        "mode": "mesh",
        "cp": cp,
        "devices": [str(d) for d in mesh.devices.reshape(-1)],
        "dims": _dims(cfg),
        "dtype": args.dtype,
        "fp8_block": list(block) if args.fp8 else None,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "bytes_per_device": {n: memory[n] for n in timed},
        "cases": cases,
    }


def _dims(cfg: ModelConfig) -> dict[str, int]:
    return {
        "hidden": cfg.hidden_size,
        "moe_intermediate": cfg.moe_intermediate_size,
        "routed_experts": cfg.n_routed_experts,
        "topk": cfg.num_experts_per_tok,
        "shared_experts": cfg.n_shared_experts,
    }


# ---- GPU mode: one device, EP8's share of GLM-5 ------------------------------------------


def _local_routing(n: int, k: int, n_local: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each token's `k` distinct experts drawn uniformly from `0..n_local-1` and
    normalized positive weights (x 2.5, GLM-5's routed scaling)."""
    rng = np.random.default_rng(seed)
    experts = np.argsort(rng.random((n, n_local)), axis=1)[:, :k].astype(np.int32)
    w = rng.random((n, k)).astype(np.float32) + 0.1
    return experts, (w / w.sum(-1, keepdims=True) * 2.5).astype(np.float32)


def run_gpu(
    args: argparse.Namespace, device: jax.Device | None = None, cfg: ModelConfig | None = None
) -> dict[str, Any]:
    """The `--gpu` report; `device` / `cfg` (default: the first GPU, GLM-5 with
    `--local-experts` routed experts) only so a CPU smoke run can shrink it."""
    glm5 = ModelConfig.from_pretrained(config_dir("glm-5"))
    if cfg is None:
        overrides = {"n_routed_experts": args.local_experts}
        cfg = ModelConfig.from_pretrained(config_dir("glm-5"), overrides)
    dtype = jnp.bfloat16
    kw = {"dtype": dtype, "param_dtype": dtype}
    if device is None:
        device = next(d for d in jax.devices() if d.platform == "gpu")
    block = _block(cfg, args.block)
    with jax.default_device(device):
        moe = MoE(cfg, rngs=nnx.Rngs(0), **kw)
        fp8_moe, load_moe = fp8_twins(cfg, moe, block, **kw)

    def build(module: MoE):
        graphdef, state = nnx.split(module)

        @jax.jit
        def layer(state, x, experts, weights):
            m = nnx.merge(graphdef, state)
            out = m.experts(x, experts, weights)
            return out + m.shared_experts(x) if m.shared_experts is not None else out

        state = jax.device_put(state, device)
        return layer, state, sum(leaf.nbytes for leaf in jax.tree.leaves(state["experts"]))

    layers = {"bf16": build(moe), "fp8": build(fp8_moe), "dequant_at_load": build(load_moe)}
    cases = []
    for n_tokens in args.tokens:
        experts, weights = _local_routing(
            n_tokens, cfg.num_experts_per_tok, args.local_experts, n_tokens
        )
        x = jax.random.normal(jax.random.key(n_tokens), (n_tokens, cfg.hidden_size)).astype(dtype)
        call = [jax.device_put(a, device) for a in (x, experts, weights)]
        outs = {n: np.asarray(f(s, *call)) for n, (f, s, _) in layers.items()}
        ms = time_side_by_side(
            {n: (lambda f=layers[n][0], s=layers[n][1], c=call: f(s, *c)) for n in ("bf16", "fp8")},
            args.repeats,
            args.warmup,
        )
        cases.append(
            {
                "tokens": n_tokens,
                "pairs": n_tokens * cfg.num_experts_per_tok,
                "bf16_ms": ms["bf16"],
                "fp8_ms": ms["fp8"],
                "fp8_over_bf16": ms["fp8"] / ms["bf16"],
                "fp8_max_abs_diff_vs_bf16": _compare(outs["fp8"], outs["bf16"])["max_abs_diff"],
                "bf16_max_abs_output": float(np.abs(outs["bf16"].astype(np.float32)).max()),
                "fp8_in_step_vs_dequant_at_load": _compare(outs["fp8"], outs["dequant_at_load"]),
            }
        )
    return {
        **environment(),
        "mode": "gpu",
        "dims": {**_dims(cfg), "glm5_routed_experts": glm5.n_routed_experts},
        "local_experts": args.local_experts,
        "routing": "each token: top-k distinct local experts, uniform (router not run)",
        "fp8_block": list(block),
        "routed_expert_bytes": {n: layers[n][2] for n in ("bf16", "fp8")},
        "repeats": args.repeats,
        "warmup": args.warmup,
        "cases": cases,
    }


# ---- CLI --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_moe_ep", description=__doc__.splitlines()[0]
    )
    ap.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=None,
        help=f"total tokens per case (default {MESH_TOKENS}; --gpu: {GPU_TOKENS})",
    )
    ap.add_argument("--cp", type=int, default=8, help="mesh size (EP size = cp)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--moe-intermediate", type=int, default=128)
    ap.add_argument("--experts", type=int, default=16, help="routed experts")
    ap.add_argument("--topk", type=int, default=4, help="experts per token")
    ap.add_argument("--shared", type=int, default=1, help="shared experts")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--fp8", action="store_true", help="also time FP8 routed experts")
    ap.add_argument("--block", type=int, nargs=2, default=None, help="FP8 block (default 128 128)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds (default 10; --gpu 20)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--gpu", action="store_true", help="GLM-5-size layer on one GPU")
    ap.add_argument("--local-experts", type=int, default=GPU_LOCAL_EXPERTS, help="--gpu only")
    ap.add_argument("--json", default=None, help="also write the result here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.gpu:
        if not any(d.platform == "gpu" for d in jax.devices()):
            print(
                f"--gpu needs a GPU: no GPU found (JAX backend {jax.default_backend()!r}); "
                "run without --gpu for the CPU mesh comparison",
                file=sys.stderr,
            )
            return 2
        args.tokens = args.tokens or list(GPU_TOKENS)
        args.repeats = args.repeats or 20
        report = run_gpu(args)
    else:
        if jax.device_count() < args.cp:
            print(
                f"--cp {args.cp} needs {args.cp} devices, found {jax.device_count()} (CPU: "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={args.cp})",
                file=sys.stderr,
            )
            return 2
        args.tokens = args.tokens or list(MESH_TOKENS)
        args.repeats = args.repeats or 10
        report = run_mesh(args)
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
