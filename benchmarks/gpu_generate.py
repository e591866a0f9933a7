"""GPU check of the whole generation path: prefill + paged decode on the GPU vs on the CPU.

    python -m benchmarks.gpu_generate [--prompt-tokens 100] [--new-tokens 24] [--json PATH]

Run on a machine with an NVIDIA GPU (`--allow-cpu` runs it on CPU only, as a smoke test
of this script). The tiny GLM-5-style model (float32, fixed seed) generates greedily,
`ignore_eos`, through `cpkv_jax.generate.ReferenceGenerator` four ways in one process:

- `cpu`: single-device prefill and decode on the host CPU backend (the oracle);
- `accelerator`: the same on the GPU;
- `accelerator_cp1_xla` / `accelerator_cp1_pallas`: prefill through the CP runner on a one-GPU mesh
  with the XLA gather / the compiled Pallas gather, then decode from its full view.

Reported: whether every run's tokens equal the CPU's, the largest log-prob difference
to the CPU (float32 on two backends: not bitwise, expected far below 1e-3), whether the
Pallas and XLA gathers give bitwise-equal log-probs (they must: the gather moves bits and
the model is deterministic on the GPU), and decode tokens/s (a tiny model: launch-bound,
a smoke figure, not a throughput claim). All runs use the highest matmul precision, so
a float32 dot is not silently TF32 on the GPU.

Prints one JSON object (also written to `--json`); exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
import numpy as np
from flax import nnx

from benchmarks.report import emit
from cpkv_jax.config import ModelConfig
from cpkv_jax.generate import CPPrefillOptions, GenerationResult, ReferenceGenerator
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.tools.tiny_config import tiny_config_dict


def _run(cfg, model, prompt, new_tokens, device, cp: CPPrefillOptions | None) -> GenerationResult:
    with jax.default_device(device):
        gen = ReferenceGenerator(cfg, model, page_size=16, index_k_dtype="fp8_e4m3")
        gen.generate(prompt, 2, ignore_eos=True, cp_prefill=cp)  # compile + warm up
        return gen.generate(prompt, new_tokens, ignore_eos=True, cp_prefill=cp)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--json", default=None)
    ap.add_argument("--allow-cpu", action="store_true", help="run without a GPU (smoke test)")
    args = ap.parse_args(argv)
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus and not args.allow_cpu:
        print("no GPU found (pass --allow-cpu to smoke-test on CPU)", file=sys.stderr)
        return 2
    accel = gpus[0] if gpus else jax.devices("cpu")[0]
    cpu = jax.devices("cpu")[0]

    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, args.prompt_tokens).tolist()
    runs: dict[str, GenerationResult] = {}
    with jax.default_matmul_precision("highest"):
        runs["cpu"] = _run(cfg, model, prompt, args.new_tokens, cpu, None)
        runs["accelerator"] = _run(cfg, model, prompt, args.new_tokens, accel, None)
        if gpus:  # the CP runner builds its mesh from jax.devices(): the GPU
            for impl in ("xla", "pallas"):
                runs[f"accelerator_cp1_{impl}"] = _run(
                    cfg,
                    model,
                    prompt,
                    args.new_tokens,
                    accel,
                    CPPrefillOptions(cp_size=1, gather_impl=impl),
                )

    ref = runs["cpu"]
    report: dict[str, Any] = {
        "backend": accel.platform,
        "device": accel.device_kind,
        "jax": jax.__version__,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "cpu_tokens": ref.output_ids,
        "runs": {},
    }
    ok = True
    for name, r in runs.items():
        same = r.output_ids == ref.output_ids
        diff = float(np.max(np.abs(np.asarray(r.output_logprobs) - ref.output_logprobs)))
        ok &= same and diff < 1e-3
        report["runs"][name] = {
            "tokens_equal_cpu": same,
            "max_logprob_diff_vs_cpu": diff,
            "decode_tokens_per_s": len(r.output_ids) / max(r.decode_seconds, 1e-9),
            "prefill_seconds": r.prefill_seconds,
        }
    if gpus:
        bitwise = (
            runs["accelerator_cp1_pallas"].output_logprobs
            == runs["accelerator_cp1_xla"].output_logprobs
        )
        report["pallas_vs_xla_logprobs_bitwise"] = bitwise
        ok &= bitwise
    report["ok"] = bool(ok)
    emit(report, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
