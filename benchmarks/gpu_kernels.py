"""GPU check of the Pallas kernels: compiled lowering vs the pure-jnp reference, and timings.

    python -m benchmarks.gpu_kernels [--json PATH] [--quick]

Run on a machine with an NVIDIA GPU (CPU runs go through interpret mode and are only a
smoke test of this script; pass `--allow-cpu`). What it does, in one process:

1. Correctness. `paged_gather_pallas` compiled for the GPU (interpret=False) against
   `paged_gather_reference` (XLA gather) on fresh random pools of every KV layout the
   pools use (MLA latent bf16/fp32 [page, 576], fp8 / bf16 index K [page, 128], fp32
   index-K scale [page]), page counts that are and are not a multiple of the kernel
   block, and out-of-range ids (redirected to the trash page by both): bitwise equality
   is required (the kernel moves bits). Outputs are poisoned first by using fresh
   buffers; a kernel that skipped a row would not reproduce the reference's bits.
2. In the model. A CP=1 prefill of the tiny model with `gather_impl="pallas"` against
   `gather_impl="xla"` on the same GPU: last-token logits and the materialized full view
   must be bitwise equal (the gather is the only difference between the two runs).
3. Timing. GLM-5 sized gathers (page 64; latent 576 bf16 = 73,728 B/page; index K 128
   fp8 = 8,192 B/page): median of repeats of the Pallas kernel per `pages_per_block`
   against XLA's gather and a device-to-device copy of the same bytes (the ceiling),
   reported as GB/s counting bytes read plus bytes written.
4. Indexer scores (`paged_index_scores`, issue 35). The compiled kernel against its XLA
   reference (the float32 view path) at GLM-5's indexer dims (32 heads x 128, fp8 index
   K with fp32 scales, page 64), rows at 2K / 32K / 128K context (32K and 128K one
   token past a power of two of pages, so the step's table is twice as wide), decode
   (1 query token) and a speculative verify (3): scores within 1e-4 of the reference's
   scale with the same -inf slots, and the same top-2048 sets; median times of the kernel
   and of the path the servers run without it (`index_scores` over the dequantized view,
   at XLA's default matmul precision: the reference's full float32 would time slower
   than what it replaces), and GB/s of the index K and scales the rows' contexts hold
   (what the indexer must read).

Prints one JSON object (also written to `--json`), then a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cpkv_jax.pallas.paged_gather import paged_gather_pallas, paged_gather_reference
from cpkv_jax.pallas.paged_index_scores import paged_index_scores, paged_index_scores_reference

LAYOUTS = [
    ("latent_bf16", jnp.bfloat16, (576,)),
    ("latent_f32", jnp.float32, (576,)),
    ("index_k_fp8", jnp.float8_e4m3fn, (128,)),
    ("index_k_bf16", jnp.bfloat16, (128,)),
    ("index_k_scale_f32", jnp.float32, ()),
]


def _pool(key: jax.Array, n_pages: int, page: int, dtype, feature) -> jax.Array:
    x = jax.random.normal(key, (n_pages, page, *feature), jnp.float32) * 4
    return x.astype(dtype)


def _bits(x: jax.Array) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


def check_correctness(quick: bool) -> list[dict[str, Any]]:
    rows = []
    key = jax.random.key(0)
    for name, dtype, feature in LAYOUTS:
        for n_pages, n_ids, block in [(40, 37, 8), (300, 256, 8), (300, 129, 16), (64, 5, 4)]:
            if quick and n_pages > 64:
                continue
            key, k1, k2 = jax.random.split(key, 3)
            pool = _pool(k1, n_pages, 64, dtype, feature)
            ids = jax.random.randint(k2, (n_ids,), 0, n_pages, jnp.int32)
            # Traced ids (inside jit) cannot be host-validated: a few out-of-range entries
            # must land on the trash page in both implementations.
            ids = ids.at[0].set(-3).at[n_ids - 1].set(n_pages + 7)
            got = jax.jit(lambda p, i, b=block: paged_gather_pallas(p, i, pages_per_block=b))(
                pool, ids
            )
            ref = jax.jit(paged_gather_reference)(pool, ids)
            ok = got.shape == ref.shape and np.array_equal(_bits(got), _bits(ref))
            rows.append(
                {
                    "layout": name,
                    "pool_pages": n_pages,
                    "ids": n_ids,
                    "pages_per_block": block,
                    "bitwise_equal": bool(ok),
                }
            )
    return rows


def check_in_model(noise_floor: bool = True) -> dict[str, Any]:
    from flax import nnx

    from cpkv_jax.config import CPConfig, ModelConfig
    from cpkv_jax.cp_prefill import CPPrefillRunner
    from cpkv_jax.mesh import make_cp_mesh
    from cpkv_jax.model.transformer import CausalLM
    from cpkv_jax.tools.tiny_config import tiny_config_dict

    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    model = CausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, cfg.vocab_size, 7 * 16 + 3).astype(np.int32)
    cp = CPConfig(cp_size=1, shared_kv=False, page_size=16)
    out = {}
    # Two XLA builds as well as the Pallas one: on a GPU, two compilations of the same
    # program may pick different GEMM kernels (autotuning), so "xla vs xla" is the noise
    # floor that "pallas vs xla" is judged against (`noise_floor=False`, the CPU smoke
    # run: XLA:CPU compiles one program one way, the floor is 0).
    builds = (("xla", "xla"), ("xla_again", "xla"), ("pallas", "pallas"))
    for name, impl in builds if noise_floor else (builds[0], builds[2]):
        runner = CPPrefillRunner(
            cfg, model, make_cp_mesh(1, jax.devices()[:1]), cp, pages_per_rank=16, gather_impl=impl
        )
        result = runner.prefill([prompt])
        view = runner.full_view(result.tables[0])
        out[name] = (np.asarray(result.last_logits), jax.tree_util.tree_leaves(view))

    def compare(a: str, b: str) -> dict[str, Any]:
        (la, va), (lb, vb) = out[a], out[b]
        equal_leaves = sum(np.array_equal(_bits(x), _bits(y)) for x, y in zip(va, vb, strict=True))
        view_diff = max(
            float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
            for x, y in zip(va, vb, strict=True)
        )
        return {
            "logits_bitwise_equal": bool(np.array_equal(la, lb)),
            "logits_max_abs_diff": float(np.max(np.abs(la.astype(np.float64) - lb))),
            "full_view_leaves_bitwise_equal": f"{equal_leaves}/{len(va)}",
            "full_view_max_abs_diff": view_diff,
        }

    noise = compare("xla", "xla_again" if noise_floor else "xla")
    pallas = compare("xla", "pallas")
    logits_scale = float(np.max(np.abs(out["xla"][0])))
    # Pass: the Pallas run is bitwise equal to XLA, or no further from it than XLA is
    # from itself (plus 1e-5 of the logits' scale: float32 reassociation noise).
    tol = noise["logits_max_abs_diff"] + 1e-5 * logits_scale
    return {
        "prompt_tokens": int(prompt.size),
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "xla_vs_xla": noise,
        "pallas_vs_xla": pallas,
        "logits_scale": logits_scale,
        "ok": bool(pallas["logits_bitwise_equal"] or pallas["logits_max_abs_diff"] <= tol),
    }


def _median_seconds(fn, args_list, repeats: int) -> float:
    for args in args_list[:2]:
        jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for i in range(repeats):
        args = args_list[i % len(args_list)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_gathers(quick: bool) -> list[dict[str, Any]]:
    rows = []
    page = 64
    cases = [
        ("latent_bf16", jnp.bfloat16, (576,), 32768, 16384),
        ("index_k_fp8", jnp.float8_e4m3fn, (128,), 65536, 32768),
        ("latent_bf16_small", jnp.bfloat16, (576,), 16384, 256),
    ]
    if quick:
        cases = [(n, d, f, 256, 64) for n, d, f, _, _ in cases]
    repeats = 3 if quick else 50  # quick: a smoke test of the script, not a timing
    for name, dtype, feature, n_pages, n_ids in cases:
        pool = _pool(jax.random.key(1), n_pages, page, dtype, feature)
        # Several id sets (random permutations) so repeats do not re-read one cached set.
        id_sets = [
            jnp.asarray(np.random.default_rng(s).permutation(n_pages)[:n_ids], jnp.int32)
            for s in range(4)
        ]
        page_bytes = page * int(np.prod(feature or (1,))) * jnp.dtype(dtype).itemsize
        moved = 2 * n_ids * page_bytes  # read + write
        xla = jax.jit(paged_gather_reference)
        copy = jax.jit(lambda p, i, n=n_ids: jnp.copy(p[:n]) + jnp.zeros((), p.dtype))
        t_xla = _median_seconds(xla, [(pool, i) for i in id_sets], repeats)
        t_copy = _median_seconds(copy, [(pool, i) for i in id_sets], repeats)
        row = {
            "layout": name,
            "pool_pages": n_pages,
            "gathered_pages": n_ids,
            "bytes_moved": moved,
            "xla_gather_ms": t_xla * 1e3,
            "xla_gather_gbps": moved / t_xla / 1e9,
            "copy_ms": t_copy * 1e3,
            "copy_gbps": moved / t_copy / 1e9,
            "pallas": {},
        }
        for block in (8,) if quick else (4, 8, 16):
            fn = jax.jit(lambda p, i, b=block: paged_gather_pallas(p, i, pages_per_block=b))
            t = _median_seconds(fn, [(pool, i) for i in id_sets], repeats)
            row["pallas"][str(block)] = {
                "ms": t * 1e3,
                "gbps": moved / t / 1e9,
                "ratio_to_xla": t_xla / t,
            }
        rows.append(row)
    return rows


def index_scores_cases(quick: bool) -> list[dict[str, Any]]:
    """Section 4 of the module docstring."""
    from cpkv_jax.model.indexer import index_scores, select_topk
    from cpkv_jax.model.kv_cache import SINGLE_DEVICE_KV_IO, dequantize_index_k, quantize_index_k

    def served(q, w, index_k, scale, table, positions, kv_lens):
        io = SINGLE_DEVICE_KV_IO
        view = dequantize_index_k(io.view(index_k, table), io.view(scale, table))
        return index_scores(q, w, view, positions, kv_lens)

    page, heads, dim, topk = 64, 32, 128, 2048
    cases = [(8, 1, 2048), (8, 1, 32769), (8, 3, 32769), (1, 1, 131073)]
    repeats = 20
    if quick:  # a smoke test of the script: tiny, and interpret mode on CPU
        cases, repeats, topk = [(2, 1, 257), (2, 3, 129)], 2, 16
    rows = []
    for b, t, context in cases:
        used = -(-context // page)  # pages the context holds
        width = 1 << (used - 1).bit_length()  # the step's power-of-two table width
        n_pages = 1 + b * used
        key = jax.random.key(context + t)
        k1, k2, k3 = jax.random.split(key, 3)
        keys = jax.random.normal(k1, (n_pages, page, dim), jnp.float32)
        index_k, scale = quantize_index_k(keys, "fp8_e4m3")
        del keys
        table = np.zeros((b, width), np.int32)
        table[:, :used] = 1 + np.arange(b * used, dtype=np.int32).reshape(b, used)
        positions = np.full((b, t), context - t, np.int32) + np.arange(t, dtype=np.int32)
        args = (
            jax.random.normal(k2, (b, t, heads, dim), jnp.float32),
            jax.random.normal(k3, (b, t, heads), jnp.float32) / heads,
            index_k,
            scale,
            jnp.asarray(table),
            jnp.asarray(positions),
            jnp.full((b,), context, jnp.int32),
        )
        kernel = jax.jit(paged_index_scores)
        reference = jax.jit(paged_index_scores_reference)
        got, want = np.asarray(kernel(*args)), np.asarray(reference(*args))
        finite = np.isfinite(want)
        scale_ref = float(np.max(np.abs(want[finite]))) if finite.any() else 1.0
        diff = float(np.max(np.abs(got[finite] - want[finite]))) if finite.any() else 0.0
        k = min(topk, want.shape[-1])
        pos = jnp.asarray(positions)
        same_sets = float(
            np.mean(
                [
                    set(a[a >= 0].tolist()) == set(c[c >= 0].tolist())
                    for a, c in zip(
                        np.asarray(select_topk(jnp.asarray(got), pos, k)).reshape(b * t, -1),
                        np.asarray(select_topk(jnp.asarray(want), pos, k)).reshape(b * t, -1),
                        strict=True,
                    )
                ]
            )
        )
        t_kernel = _median_seconds(kernel, [args], repeats)
        t_served = _median_seconds(jax.jit(served), [args], repeats)
        must_read = b * context * (dim + 4)  # fp8 codes and fp32 scales of every token
        rows.append(
            {
                "rows": b,
                "query_tokens": t,
                "context": context,
                "table_pages": width,
                "pages_used": used,
                "same_masks": bool(np.array_equal(np.isfinite(got), finite)),
                "max_abs_diff_over_scale": diff / max(scale_ref, 1e-30),
                "same_topk_sets": same_sets,
                "kernel_ms": t_kernel * 1e3,
                "xla_view_ms": t_served * 1e3,
                "xla_over_kernel": t_served / t_kernel,
                "kernel_gbps_of_index_k": must_read / t_kernel / 1e9,
            }
        )
    return rows


def _index_scores_ok(rows: list[dict[str, Any]]) -> bool:
    # Tolerance: the kernel sums the dot over d and the heads in its own order (and a
    # GPU GEMM may too), so the scores agree to float32 rounding, not bits; a top-k set
    # can differ only by a near-tie at its edge, so the sets must agree for most rows.
    return all(
        r["same_masks"] and r["max_abs_diff_over_scale"] < 1e-4 and r["same_topk_sets"] >= 0.75
        for r in rows
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the JSON result here")
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--allow-cpu", action="store_true", help="run without a GPU (interpret mode)")
    args = ap.parse_args(argv)
    backend = jax.default_backend()
    if backend != "gpu" and not args.allow_cpu:
        print(f"error: no GPU (default backend {backend!r}); pass --allow-cpu", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "backend": backend,
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    result["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    result["correctness"] = check_correctness(args.quick)
    result["in_model"] = check_in_model(noise_floor=backend != "cpu")
    result["timing"] = time_gathers(args.quick)
    result["index_scores"] = index_scores_cases(args.quick)
    result["index_scores_ok"] = _index_scores_ok(result["index_scores"])
    result["all_correct"] = (
        all(r["bitwise_equal"] for r in result["correctness"])
        and result["in_model"]["ok"]
        and result["index_scores_ok"]
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(
        f"\n{'layout':<14} {'xla GB/s':>9} {'copy GB/s':>10} "
        + " ".join(f"{'ppb' + b:>10}" for b in ("4", "8", "16"))
    )
    for r in result["timing"]:
        print(
            f"{r['layout']:<14} {r['xla_gather_gbps']:>9.1f} {r['copy_gbps']:>10.1f} "
            + " ".join(
                f"{r['pallas'][b]['gbps']:>10.1f}" if b in r["pallas"] else f"{'-':>10}"
                for b in ("4", "8", "16")
            )
        )
    for r in result["index_scores"]:
        print(
            f"index scores b{r['rows']} t{r['query_tokens']} {r['context']} tokens "
            f"({r['pages_used']} of {r['table_pages']} pages): kernel {r['kernel_ms']:.3f} ms, "
            f"XLA view {r['xla_view_ms']:.3f} ms ({r['xla_over_kernel']:.2f}x)"
        )
    print(f"all correct: {result['all_correct']}")
    return 0 if result["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
