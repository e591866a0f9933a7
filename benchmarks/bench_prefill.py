"""TTFT of CP prefill: CP=1 vs CP=8 replicated KV vs CP=8 shared (page-owned) KV.

    python -m benchmarks.bench_prefill [--lengths 4096 8192] [--chunk 4096] [--layers 2]
        [--dense-layers 0] [--scale 8] [--topk 256] [--experts 4] [--experts-per-tok 1]
        [--vocab 4096] [--page-size 64] [--cp 8] [--dtype float32] [--index-k-dtype fp8_e4m3]
        [--batch-invariant] [--rtol R] [--atol A] [--repeats 5] [--warmup 1] [--json PATH]
    python -m benchmarks.bench_prefill --gpu [--lengths 4096 16384 65536] [--chunk 16384]
        [--ffn moe|dense] [--repeats 5] [--json PATH]

The real library path, in ONE process: three `cpkv_jax.cp_prefill.CPPrefillRunner`s over
the same model (same parameters), each `runner.prefill([prompt], chunk)` then
`runner.release(table)`:
- `cp1`: `CPConfig(1, shared_kv=False)` on a one-device mesh;
- `cp8_replicated`: `CPConfig(8, shared_kv=False)` on the 8-device `("cp",)` mesh (every
  rank keeps the whole pool: the baseline);
- `cp8_shared`: `CPConfig(8, shared_kv=True)`: each page only on its owner rank.
TTFT = wall time of `prefill` (host planning, every chunk's step, and the last-token
logits copied to the host: `prefill` returns numpy, so the call blocks). Per length: the
same prompt (random ids, fixed seed) for every variant; `--warmup` untimed calls per
variant (the first compiles every step shape of that length), then `--repeats` rounds,
the variants interleaved round by round with the order rotated each round; medians,
every repeat time, and the ratios `shared_over_replicated`, `replicated_over_cp1`,
`shared_over_cp1`. `--cp N` changes 8 (the variant names follow: `cpN_...`).
`--owner` adds `cp8_owner`: shared KV with owner attention (`--cp-attention owner`,
`cpkv_jax.owner_attention`), its ratio `owner_over_shared`, and its check against CP1
at the CP tolerance. Per length,
`step_temp_bytes_per_device` is XLA's own transient (temp) figure of each variant's
widest compiled step so far (`memory_analysis()`; give the lengths in ascending order),
and `owner_temp_over_shared` its ratio.

Correctness guard (before timing, on the first warm-up call's last-token logits): shared
vs replicated must be bitwise equal (they run identical per-rank computations;
tests/core/test_cp_prefill.py asserts bitwise), and each CP8 variant vs CP1 within
`|a - b| <= atol + rtol * |b|` elementwise, `b` = CP1: float32 rtol = atol = 1e-5, the
project's CP-vs-single-device tolerance (test_cp_prefill.py); bfloat16 3e-2 / 3e-2 (a
few bf16 ulps at the logits' scale; not yet checked on a GPU); `--rtol` / `--atol`
override. The JSON records max |diff|, bitwise equality and the verdict per pair; exit
status 1 when any check fails (the report is still printed). `--batch-invariant` runs
the batch-invariant numerics (CP8 vs CP1 then bitwise too).

Model (CPU mode): GLM-5's own `config.json` (cpkv_jax/model_configs/glm-5) with the
attention, indexer and FFN *widths* and the *head counts* all divided by `--scale`
(default 8, a power of two <= 32):
  hidden_size 6144/s, q_lora_rank 2048/s, kv_lora_rank 512/s, qk_nope_head_dim 192/s,
  qk_rope_head_dim 64/s, v_head_dim 256/s, index_head_dim 128/s, intermediate_size
  12288/s, moe_intermediate_size 2048/s, num_attention_heads (= num_key_value_heads)
  64/s, index_n_heads 32/s
(s=8: 768, 256, 64, 24, 8, 32, 16, 1536, 256, 8, 4), so every ratio between the
attention / indexer dims is GLM-5's. Not scaled by s: `index_topk` is `--topk` (default
2048/s = 256, below every default prompt length, so the indexer selects a real subset
and attention is sparse); `--layers` layers (default 2), the first `--dense-layers`
(default 0) with a dense FFN, the rest MoE (GLM-5: 3 dense of 78), every indexer layer
`full` as in GLM-5; MoE: `--experts` routed experts (default 4; GLM-5 256) top
`--experts-per-tok` (default 1; GLM-5 8), 1 shared expert, since on CPU
`lax.ragged_dot` lowers to a dense dot over all experts (cost experts x top-k x tokens,
see bench_moe_ep) and would otherwise dominate; vocab `--vocab` (default 4096; GLM-5
154880: only the embedding gather and the last token's lm_head see it); page 64; rope,
norms and routing as GLM-5. The JSON's `config.dims` lists each field: GLM-5's value,
the value used and how. Random weights (`CausalLM(cfg, rngs=nnx.Rngs(seed))`), float32
by default, fp8 index K (the serving default).

`--gpu` (exit status 2 when there is no GPU): GLM-5's *real* dims (hidden 6144, 64
heads, q_lora 2048, kv_lora 512, nope/rope/v 192/64/256, index 32 x 128, top-k 2048,
vocab 154880), ONE layer, bfloat16: with `--ffn moe` (default) a real MoE layer (256
routed experts x 2048, top-8, 1 shared: ~19 GB bf16), `--ffn dense` GLM-5's dense 12288
FFN (its first 3 layers). The CP8 variants need 8 GPUs; with fewer, only `cp1` is timed
and the CP8 variants are listed in `skipped` with the reason, their times and ratios
absent / null (never faked). `per_layer_ms` (TTFT / layers: an upper bound, it includes
the embedding, the lm_head and host planning) compares with `reference_sglang`: SGLang
#31435, GLM-5.2-FP8 CP8 on 8xH20, 128K prompt, 78 layers, 12.33 s shared vs 12.20 s
base (+1.07%; the design quotes +0.75..+1.86%); `--lengths 131072` for that length.

On this repository's 2-core CPU the 8 "devices" are virtual (`XLA_FLAGS=
--xla_force_host_platform_device_count=8`, set before the jax import when run as
__main__) sharing two cores: CP8's 8 ranks run one after another, so CP8/CP1 measures
the split's overhead, not a speed-up, and shared/replicated what the page-owned pool
costs in this program against the replicated one (both all-gather each layer's new KV;
shared writes only its own pages and then gathers the request's full view from every
rank per layer, replicated reads its local copy). The host is shared with other jobs
(`host_load_avg_1m` in the JSON): read the CPU ratios as +-10% at best; `min_s` next to
the medians. Prints one JSON object (`--json` also writes it, indented).
"""

from __future__ import annotations

import os

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    # Must precede the first jax import: the CP8 variants want 8 CPU devices.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.report import emit, environment
from cpkv_jax.config import CPConfig, ModelConfig
from cpkv_jax.cp_prefill import CPPrefillRunner, pages_per_rank_for
from cpkv_jax.mesh import make_cp_mesh
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.model_configs import config_dir

CPU_LENGTHS = (4096, 8192)
GPU_LENGTHS = (4096, 16384, 65536)
CPU_CHUNK, GPU_CHUNK = 4096, 16384
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# (rtol, atol) of CP8 vs CP1 logits, elementwise |a - b| <= atol + rtol * |b|. float32:
# the project's CP-vs-single-device tolerance (tests/core/test_cp_prefill.py). bfloat16:
# ~8 bf16 ulps (2^-8 relative each) of the logit, since the two runs round in different
# places (row counts per rank); not yet measured on a GPU.
DEFAULT_TOL = {"float32": (1e-5, 1e-5), "bfloat16": (3e-2, 3e-2)}

# GLM-5 fields divided by --scale (widths, then head counts).
SCALED_WIDTHS = (
    "hidden_size",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_head_dim",
    "intermediate_size",
    "moe_intermediate_size",
)
SCALED_HEADS = ("num_attention_heads", "num_key_value_heads", "index_n_heads")
REPORTED = (
    *SCALED_WIDTHS,
    *SCALED_HEADS,
    "index_topk",
    "num_hidden_layers",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "vocab_size",
)
REFERENCE_SGLANG = {
    "source": "SGLang #31435: GLM-5.2-FP8, CP8 on 8xH20, 128K prompt",
    "prompt_tokens": 131072,
    "layers": 78,
    "shared_s": 12.33,
    "base_s": 12.20,
    "shared_over_base": 12.33 / 12.20,
    "per_layer_ms_shared": 12.33 / 78 * 1e3,
    "per_layer_ms_base": 12.20 / 78 * 1e3,
}


# ---- model configs ----------------------------------------------------------------------


def glm5_raw() -> dict[str, Any]:
    return json.loads((config_dir("glm-5") / "config.json").read_text())


def _layer_lists(layers: int, dense_layers: int) -> dict[str, Any]:
    return {
        "num_hidden_layers": layers,
        "first_k_dense_replace": dense_layers,
        "indexer_types": ["full"] * layers,
        "mlp_layer_types": ["dense"] * dense_layers + ["sparse"] * (layers - dense_layers),
        "layer_types": ["indexed_attention"] * layers,
    }


def _dims(raw: dict[str, Any], used: dict[str, Any], how: dict[str, str]) -> dict[str, Any]:
    return {
        k: {"glm5": raw.get(k), "used": used[k], "how": how.get(k, "as GLM-5")} for k in REPORTED
    }


def scaled_config(args: argparse.Namespace) -> tuple[ModelConfig, dict[str, Any]]:
    """GLM-5 with widths and head counts / `args.scale` (module docstring)."""
    raw = glm5_raw()
    s = args.scale
    if s < 1 or s & (s - 1) or s > 32:
        raise SystemExit(f"--scale must be a power of two in [1, 32], got {s}")
    used = dict(raw)
    how: dict[str, str] = {}
    for k in (*SCALED_WIDTHS, *SCALED_HEADS):
        used[k] = raw[k] // s
        how[k] = f"/{s}"
    topk = args.topk if args.topk is not None else raw["index_topk"] // s
    dense = args.dense_layers
    if not 0 <= dense <= args.layers:
        raise SystemExit(f"--dense-layers must be in [0, --layers={args.layers}], got {dense}")
    used.update(
        index_topk=topk,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.experts_per_tok,
        n_shared_experts=1,
        vocab_size=args.vocab,
        head_dim=used["qk_rope_head_dim"],
        qk_head_dim=used["qk_nope_head_dim"] + used["qk_rope_head_dim"],
        **_layer_lists(args.layers, dense),
    )
    how.update(
        index_topk="--topk" if args.topk is not None else f"/{s} (--topk)",
        num_hidden_layers=f"--layers ({dense} dense FFN (--dense-layers), the rest MoE)",
        n_routed_experts="--experts",
        num_experts_per_tok="--experts-per-tok",
        vocab_size="--vocab",
    )
    if used["num_experts_per_tok"] > used["n_routed_experts"]:
        raise SystemExit("--experts-per-tok must be <= --experts")
    return ModelConfig.from_dict(used), _dims(raw, used, how)


def real_config(ffn: str) -> tuple[ModelConfig, dict[str, Any]]:
    """GLM-5's real dims, one layer: a MoE layer (`ffn="moe"`) or a dense FFN one."""
    raw = glm5_raw()
    used = {**raw, **_layer_lists(1, 1 if ffn == "dense" else 0)}
    how = {"num_hidden_layers": f"1 layer ({'dense FFN' if ffn == 'dense' else 'MoE'})"}
    return ModelConfig.from_dict(used), _dims(raw, used, how)


# ---- runs -------------------------------------------------------------------------------


def variant_names(cp: int) -> tuple[str, str, str]:
    return "cp1", f"cp{cp}_replicated", f"cp{cp}_shared"


def owner_name(cp: int) -> str:
    """`--owner`'s variant: shared KV with owner attention (`--cp-attention owner`)."""
    return f"cp{cp}_owner"


def build_model(cfg: ModelConfig, args: argparse.Namespace, device: jax.Device) -> CausalLM:
    """The random-weight model every variant runs (built on `device`)."""
    dtype = DTYPES[args.dtype or "float32"]
    with jax.default_device(device):
        return CausalLM(cfg, rngs=nnx.Rngs(args.seed), dtype=dtype, param_dtype=dtype)


def build_runners(
    cfg: ModelConfig,
    model: CausalLM,
    devices: Sequence[jax.Device],
    args: argparse.Namespace,
    max_tokens: int,
) -> tuple[dict[str, CPPrefillRunner], dict[str, str]]:
    """The runners that fit on `devices` and, for the others, why they were skipped."""
    cp1, rep, shared = variant_names(args.cp)
    runners: dict[str, CPPrefillRunner] = {}
    skipped: dict[str, str] = {}
    kw = dict(
        index_k_dtype=args.index_k_dtype,
        batch_invariant=args.batch_invariant,
        block_bytes=args.block_bytes,
    )
    wanted = {cp1: CPConfig(1, False, page_size=args.page_size)}
    for name, sh in ((rep, False), (shared, True)):
        wanted[name] = CPConfig(args.cp, sh, page_size=args.page_size)
    if args.owner:
        wanted[owner_name(args.cp)] = CPConfig(
            args.cp, True, page_size=args.page_size, attention="owner"
        )
    for name, cp in wanted.items():
        if cp.cp_size > len(devices):
            skipped[name] = (
                f"needs {cp.cp_size} {devices[0].platform} devices, found {len(devices)} "
                f"(not run; no number is reported for it)"
            )
            continue
        mesh = make_cp_mesh(cp.cp_size, list(devices[: cp.cp_size]))
        pages = pages_per_rank_for(max_tokens, args.page_size, cp)
        runners[name] = CPPrefillRunner(cfg, model, mesh, cp, pages_per_rank=pages, **kw)
    return runners, skipped


def prefill_once(runner: CPPrefillRunner, prompt: np.ndarray, chunk: int | None):
    """(TTFT seconds, last-token logits): `prefill` returns host numpy, so it blocks."""
    t0 = time.perf_counter()
    result = runner.prefill([prompt], chunk)
    elapsed = time.perf_counter() - t0
    for table in result.tables:
        runner.release(table)
    return elapsed, result.last_logits[0]


def compare(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> dict[str, Any]:
    """`a` against reference `b`: max |diff|, bitwise, within `atol + rtol * |b|`."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    diff = np.abs(a64 - b64)
    return {
        "max_abs_diff": float(diff.max()),
        "max_abs_ref": float(np.abs(b64).max()),
        "bitwise_equal": bool(np.array_equal(a.view(np.uint8), b.view(np.uint8))),
        "within_tolerance": bool(np.all(diff <= atol + rtol * np.abs(b64))),
    }


def check_logits(logits: dict[str, np.ndarray], cp: int, rtol: float, atol: float) -> dict:
    cp1, rep, shared = variant_names(cp)
    checks: dict[str, Any] = {}
    if rep in logits and shared in logits:
        row = compare(logits[shared], logits[rep], 0.0, 0.0)
        row["required"] = "bitwise"
        row["ok"] = row["bitwise_equal"]
        checks["shared_vs_replicated"] = row
    for name in (rep, shared, owner_name(cp)):
        if name in logits and cp1 in logits:
            row = compare(logits[name], logits[cp1], rtol, atol)
            row["required"] = f"|a-b| <= {atol:g} + {rtol:g}*|cp1|"
            row["ok"] = row["within_tolerance"]
            checks[f"{name}_vs_cp1"] = row
    for name, lg in logits.items():
        if not np.all(np.isfinite(lg)):
            checks[f"{name}_finite"] = {"ok": False}
    return checks


def time_length(
    runners: dict[str, CPPrefillRunner],
    prompt: np.ndarray,
    chunk: int | None,
    args: argparse.Namespace,
    layers: int,
    rtol: float,
    atol: float,
) -> dict[str, Any]:
    names = list(runners)
    first_call_s: dict[str, float] = {}
    logits: dict[str, np.ndarray] = {}
    for name in names:
        for i in range(max(1, args.warmup)):
            dt, lg = prefill_once(runners[name], prompt, chunk)
            if i == 0:
                first_call_s[name], logits[name] = dt, lg
    checks = check_logits(logits, args.cp, rtol, atol)
    # XLA's own figure for each variant's step program(s) at this length: the transient
    # (temp) bytes per device of the largest, from the compiled executable.
    temp_bytes = {
        name: max(
            runner.compiled_step(shape).memory_analysis().temp_size_in_bytes
            for shape in runner.step_shapes
            if shape.width == max(s.width for s in runner.step_shapes)
        )
        for name, runner in runners.items()
    }
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(prefill_once(runners[name], prompt, chunk)[0])
    med = {n: statistics.median(t) for n, t in times.items()}
    cp1, rep, shared = variant_names(args.cp)

    def ratio(a: str, b: str) -> float | None:
        return med[a] / med[b] if a in med and b in med else None

    return {
        "tokens": int(prompt.size),
        "steps": 1 if chunk is None else -(-prompt.size // chunk),
        "median_s": med,
        "min_s": {n: min(t) for n, t in times.items()},
        "times_s": times,
        "first_call_s": first_call_s,
        "step_temp_bytes_per_device": temp_bytes,
        "per_layer_ms": {n: m / layers * 1e3 for n, m in med.items()},
        "tokens_per_s": {n: prompt.size / m for n, m in med.items()},
        "ratios": {
            "shared_over_replicated": ratio(shared, rep),
            "replicated_over_cp1": ratio(rep, cp1),
            "shared_over_cp1": ratio(shared, cp1),
            "owner_over_shared": ratio(owner_name(args.cp), shared),
            "owner_temp_over_shared": (
                temp_bytes[owner_name(args.cp)] / temp_bytes[shared]
                if owner_name(args.cp) in temp_bytes and shared in temp_bytes
                else None
            ),
        },
        "checks": checks,
        "checks_ok": all(c["ok"] for c in checks.values()),
    }


def run(
    args: argparse.Namespace,
    cfg: ModelConfig,
    dims: dict[str, Any],
    devices: Sequence[jax.Device],
    mode: str,
) -> dict[str, Any]:
    """The comparison on `devices` (all three variants when there are `--cp` of them)."""
    rtol = args.rtol if args.rtol is not None else DEFAULT_TOL[args.dtype][0]
    atol = args.atol if args.atol is not None else DEFAULT_TOL[args.dtype][1]
    chunk = None if args.chunk == 0 else args.chunk
    if chunk is not None and chunk % args.page_size:
        raise SystemExit(f"--chunk {chunk} must be a multiple of --page-size {args.page_size}")
    load_before = os.getloadavg()
    t_build = time.perf_counter()
    model = build_model(cfg, args, devices[0])
    runners, skipped = build_runners(cfg, model, devices, args, max(args.lengths))
    del model
    build_s = time.perf_counter() - t_build
    cases = []
    for i, n in enumerate(args.lengths):
        rng = np.random.default_rng(args.seed + i)
        prompt = rng.integers(3, cfg.vocab_size, n).astype(np.int32)
        cases.append(time_length(runners, prompt, chunk, args, cfg.num_hidden_layers, rtol, atol))
    return {
        **environment(),
        "mode": mode,
        "cp": args.cp,
        "variants": list(variant_names(args.cp)) + ([owner_name(args.cp)] if args.owner else []),
        "timed": list(runners),
        "skipped": skipped,
        "devices": [str(d) for d in devices[: args.cp]],
        "config": {
            "model": "GLM-5 (cpkv_jax/model_configs/glm-5)"
            + (f", widths and head counts / {args.scale}" if mode == "cpu" else ", real dims"),
            "dims": dims,
            "dense_layers": sum(t == "dense" for t in cfg.mlp_layer_types),
            "indexer_types": list(cfg.indexer_types),
            "dtype": args.dtype,
            "index_k_dtype": args.index_k_dtype,
            "page_size": args.page_size,
            "chunk": chunk,
            "batch_invariant": args.batch_invariant,
            "block_bytes": args.block_bytes,
            "weights": f"random, nnx.Rngs({args.seed})",
            "prompts": "random ids in [3, vocab), seed + length index",
        },
        "timing": {
            "ttft": "wall time of runner.prefill([prompt], chunk) incl. host logits (blocking)",
            "warmup": args.warmup,
            "repeats": args.repeats,
            "order": "variants interleaved per round, rotated start",
            "statistic": "median",
        },
        "tolerance": {
            "shared_vs_replicated": "bitwise",
            "cp_vs_cp1": {"rtol": rtol, "atol": atol, "elementwise": "|a-b| <= atol + rtol*|cp1|"},
        },
        "build_s": build_s,
        "host_load_avg_1m": {"start": load_before[0], "end": os.getloadavg()[0]},
        "reference_sglang": REFERENCE_SGLANG if mode == "gpu" else None,
        "cases": cases,
        "checks_ok": all(c["checks_ok"] for c in cases),
    }


# ---- CLI --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_prefill", description=__doc__.splitlines()[0]
    )
    ap.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=None,
        help=f"prompt lengths (default {CPU_LENGTHS}; --gpu {GPU_LENGTHS})",
    )
    ap.add_argument(
        "--chunk",
        type=int,
        default=None,
        help=f"chunked prefill tokens, 0 = unchunked (default {CPU_CHUNK}; --gpu {GPU_CHUNK})",
    )
    ap.add_argument("--cp", type=int, default=8, help="CP size of the two CP variants")
    ap.add_argument("--layers", type=int, default=2, help="CPU mode (--gpu: 1 layer)")
    ap.add_argument("--scale", type=int, default=8, help="CPU mode: GLM-5 widths/heads / this")
    ap.add_argument("--topk", type=int, default=None, help="CPU mode: index_topk (2048/scale)")
    ap.add_argument("--dense-layers", type=int, default=0, help="CPU mode: first N dense FFN")
    ap.add_argument("--experts", type=int, default=4, help="CPU mode: routed experts")
    ap.add_argument("--experts-per-tok", type=int, default=1, help="CPU mode")
    ap.add_argument("--vocab", type=int, default=4096, help="CPU mode: vocab size")
    ap.add_argument("--ffn", choices=("moe", "dense"), default="moe", help="--gpu: the layer's FFN")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="float32; --gpu bf16")
    ap.add_argument(
        "--index-k-dtype", choices=("fp8_e4m3", "bfloat16", "float32"), default="fp8_e4m3"
    )
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument(
        "--owner",
        action="store_true",
        help="also time shared KV with owner attention (--cp-attention owner)",
    )
    ap.add_argument("--block-bytes", type=int, default=None, help="token-block budget")
    ap.add_argument("--rtol", type=float, default=None, help="CP vs CP1 (see DEFAULT_TOL)")
    ap.add_argument("--atol", type=float, default=None)
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per variant (>= 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", action="store_true", help="GLM-5 real dims, 1 layer, on GPUs")
    ap.add_argument("--json", default=None, help="also write the result here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = build_parser().parse_args(argv)
    if args.cp < 2:
        print(f"--cp must be >= 2 (shared KV needs several ranks), got {args.cp}", file=sys.stderr)
        return 2
    if args.gpu:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if not gpus:
            print(
                f"--gpu needs a GPU: no GPU found (JAX backend {jax.default_backend()!r}); "
                "run without --gpu for the scaled-down CPU comparison",
                file=sys.stderr,
            )
            return 2
        args.lengths = args.lengths or list(GPU_LENGTHS)
        args.chunk = GPU_CHUNK if args.chunk is None else args.chunk
        args.dtype = args.dtype or "bfloat16"
        cfg, dims = real_config(args.ffn)
        report = run(args, cfg, dims, gpus, "gpu")
    else:
        cpus = jax.devices("cpu")
        if len(cpus) < args.cp:
            print(
                f"--cp {args.cp} needs {args.cp} devices, found {len(cpus)} (CPU: "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={args.cp})",
                file=sys.stderr,
            )
            return 2
        args.lengths = args.lengths or list(CPU_LENGTHS)
        args.chunk = CPU_CHUNK if args.chunk is None else args.chunk
        args.dtype = args.dtype or "float32"
        cfg, dims = scaled_config(args)
        report = run(args, cfg, dims, cpus, "cpu")
    report["wall_s"] = time.perf_counter() - t_start  # from main(), jax import excluded
    emit(report, args.json)
    if not report["checks_ok"]:
        bad = [
            (c["tokens"], name, {k: v for k, v in row.items() if k != "ok"})
            for c in report["cases"]
            for name, row in c["checks"].items()
            if not row["ok"]
        ]
        print(f"logits check failed: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
