"""`make demo`: CP shared-KV prefill on 8 virtual CPU devices vs the single-device reference.

    python -m cpkv_jax.tools.demo [--model-dir .demo/tiny-glm5] [--prompt-tokens 300]
        [--chunked-prefill-size 128] [--page-size 16] [--max-new-tokens 16] [--kernel-impl xla]

Builds the tiny checkpoint if missing, then generates the same prompt three ways -
single device (the reference), CP=8 with page-owned (shared) KV, CP=8 with replicated
KV - prints each run's tokens and timings and the per-rank KV pool bytes of both CP
layouts, and exits 1 unless both CP runs reproduce the reference's greedy tokens.
"""

from __future__ import annotations

import os

# 8 virtual CPU devices for the cp mesh; must precede the first JAX import.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from cpkv_jax.cli_logging import configure_logging
from cpkv_jax.config import CPConfig
from cpkv_jax.cp_prefill import pages_per_rank_for
from cpkv_jax.generate import CPPrefillOptions, ReferenceGenerator
from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.model.weights import load_model
from cpkv_jax.tokenizer import load_tokenizer
from cpkv_jax.tools.make_tiny_checkpoint import make_tiny_checkpoint

CP = 8
TEXT = (
    "Context-parallel prefill with shared KV stores every page of the cache once, on "
    "the rank that owns it, and rebuilds the full view only while attention runs. "
)


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cpkv_jax.tools.demo", description=__doc__)
    ap.add_argument("--model-dir", type=Path, default=Path(".demo/tiny-glm5"))
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--chunked-prefill-size", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--kernel-impl", choices=["xla", "pallas"], default="xla")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    configure_logging(args.log_level)
    if jax.device_count() < CP:
        print(f"error: the demo needs {CP} devices, found {jax.device_count()}", file=sys.stderr)
        return 2

    if not (args.model_dir / "config.json").is_file():
        make_tiny_checkpoint(args.model_dir, "glm_moe_dsa")
        print(f"wrote tiny GLM-5-architecture checkpoint to {args.model_dir}")
    cfg, model = load_model(args.model_dir, progress=False)
    tokenizer = load_tokenizer(args.model_dir)
    assert tokenizer is not None
    prompt = (tokenizer.encode(TEXT * (1 + args.prompt_tokens // len(TEXT))))[: args.prompt_tokens]
    gen = ReferenceGenerator(cfg, model, page_size=args.page_size)
    print(
        f"model {cfg.architecture}: {cfg.num_hidden_layers} layers "
        f"(indexer {''.join('F' if t == 'full' else 'S' for t in cfg.indexer_types)}, "
        f"index_topk {cfg.index_topk}); prompt {len(prompt)} tokens = "
        f"{-(-len(prompt) // args.page_size)} pages of {args.page_size}"
    )

    runs = {
        "single device (reference)": None,
        f"CP={CP} shared KV": CPPrefillOptions(
            CP, True, args.chunked_prefill_size, args.kernel_impl
        ),
        f"CP={CP} replicated KV": CPPrefillOptions(
            CP, False, args.chunked_prefill_size, args.kernel_impl
        ),
    }
    outputs = {}
    for name, opts in runs.items():
        r = gen.generate(prompt, args.max_new_tokens, ignore_eos=True, cp_prefill=opts)
        outputs[name] = r
        chunk = "" if opts is None else f", chunks of {opts.chunked_prefill_size}"
        print(
            f"\n[{name}{chunk}]\n  prefill {r.prefill_seconds:.2f}s, decode "
            f"{r.decode_seconds:.2f}s (wall, compiles included)\n  output ids {r.output_ids}"
        )

    print(f"\nper-rank persistent KV pool bytes for this prompt (cp={CP}):")
    for shared in (True, False):
        cp = CPConfig(cp_size=CP, shared_kv=shared, page_size=args.page_size)
        layout = PoolLayout(
            CP, shared, pages_per_rank_for(len(prompt), args.page_size, cp), args.page_size
        )
        nbytes = per_rank_pool_bytes(cfg, layout, gen.dtype, gen.index_k_dtype)
        print(
            f"  {'shared    ' if shared else 'replicated'}: {_kib(nbytes)} "
            f"({layout.pages_per_rank} pages per rank, 1 trash)"
        )

    ref = outputs["single device (reference)"]
    ok = True
    for name, r in outputs.items():
        if r is ref:
            continue
        same = r.output_ids == ref.output_ids
        dlp = float(np.max(np.abs(np.subtract(r.output_logprobs, ref.output_logprobs))))
        ok &= same
        print(f"{name}: tokens equal reference: {same}; max |logprob diff| {dlp:.2e}")
    print("RESULT:", "outputs equal the single-device reference" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
