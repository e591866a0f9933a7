"""What batch-invariant numerics cost, and what they buy, measured side by side.

    python -m benchmarks.batch_invariant [--tokens 128 1024] [--chunk 0] [--repeats 5]
        [--json PATH]

For each prompt length, on the tiny model (float32, float32 index K, page 16): a CP=8
shared-KV prefill and a single-device prefill, each in the default numerics and in
batch-invariant numerics (`cpkv_jax.model.numerics`), every one compiled first and then
timed `--repeats` times (median reported). In the same run it checks what the mode is
for: whether the CP full view and last-token logits equal the single-device ones bit
for bit (`bitwise_kv`, `bitwise_logits`), and the largest KV difference when they do not.

The single-device prefill uses the CP runner's attention form (absorbed) in both modes,
so the only difference between the columns is the numerics. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from flax import nnx

from benchmarks.report import emit, environment
from cpkv_jax.config import CPConfig, ModelConfig
from cpkv_jax.cp_prefill import CPPrefillRunner, pages_per_rank_for
from cpkv_jax.mesh import make_cp_mesh
from cpkv_jax.model.forward_batch import prefill_batch
from cpkv_jax.model.kv_cache import SINGLE_DEVICE_KV_IO, init_pool
from cpkv_jax.model.transformer import CausalLM, forward_step
from cpkv_jax.tools.tiny_config import tiny_config_dict

PAGE = 16
CP = 8
INDEX_K = "float32"


def _median_seconds(fn, repeats: int) -> float:
    fn()  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _single_device(cfg, model, ids: np.ndarray, invariant: bool):
    """A prefill function for `ids` on one device; returns (last logits, full view)."""
    n = ids.size
    pages = -(-n // PAGE)
    batch = prefill_batch(ids, np.arange(1, pages + 1, dtype=np.int32), PAGE)
    graphdef, state = nnx.split(model)

    def run():
        pool = init_pool(cfg, pages + 1, PAGE, index_k_dtype=INDEX_K)
        logits, pool = forward_step(
            graphdef,
            state,
            batch,
            pool,
            index_k_dtype=INDEX_K,
            form="absorbed",
            invariant=invariant,
        )
        jax.block_until_ready(logits)
        return logits, pool

    def result():
        logits, pool = run()
        view = jax.tree_util.tree_map(
            lambda leaf: SINGLE_DEVICE_KV_IO.view(leaf, batch.page_table)[0, :n], pool
        )
        return np.asarray(logits[0]), view

    return run, result


def measure(cfg, model, n: int, chunk: int | None, repeats: int) -> dict:
    ids = np.random.default_rng(n).integers(3, cfg.vocab_size, n).astype(np.int32)
    cp = CPConfig(cp_size=CP, shared_kv=True, page_size=PAGE)
    row: dict = {"tokens": n, "chunk": chunk}
    for mode, invariant in (("default", False), ("invariant", True)):
        runner = CPPrefillRunner(
            cfg,
            model,
            make_cp_mesh(CP),
            cp,
            pages_per_rank=pages_per_rank_for(n, PAGE, cp),
            index_k_dtype=INDEX_K,
            batch_invariant=invariant,
        )

        def cp_prefill(runner=runner):
            result = runner.prefill([ids], chunk)
            runner.release(result.tables[0])

        run_single, single_result = _single_device(cfg, model, ids, invariant)
        row[f"cp_{mode}_s"] = _median_seconds(cp_prefill, repeats)
        row[f"single_{mode}_s"] = _median_seconds(run_single, repeats)
        result = runner.prefill([ids], chunk)
        view = runner.full_view(result.tables[0])
        runner.release(result.tables[0])
        ref_logits, ref_view = single_result()
        kv_pairs = list(
            zip(jax.tree_util.tree_leaves(view), jax.tree_util.tree_leaves(ref_view), strict=True)
        )
        row[f"{mode}_bitwise_kv"] = all(np.array_equal(a, b) for a, b in kv_pairs)
        row[f"{mode}_bitwise_logits"] = bool(np.array_equal(result.last_logits[0], ref_logits))
        row[f"{mode}_max_kv_diff"] = max(
            float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
            for a, b in kv_pairs
        )
    row["cp_cost_ratio"] = row["cp_invariant_s"] / row["cp_default_s"]
    row["single_cost_ratio"] = row["single_invariant_s"] / row["single_default_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--chunk", type=int, default=0, help="chunked prefill size (0 = unchunked)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=str, default=None, help="also write the result here")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    model = CausalLM(cfg, rngs=nnx.Rngs(11))
    chunk = args.chunk or None
    cases = [measure(cfg, model, n, chunk, args.repeats) for n in args.tokens]
    emit({**environment(), "cp_size": CP, "page_size": PAGE, "cases": cases}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
