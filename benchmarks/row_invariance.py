"""Does a layer give the same bits for a token whatever rows it is computed with?

    python -m benchmarks.row_invariance [--tokens 115 533] [--modes default invariant]
        [--json PATH]

CP prefill computes each token on the rank that holds it, with that rank's rows only
(two zigzag blocks), while the single-device reference computes the whole prompt at
once. Their KV can agree bit for bit only if every layer is *row-count invariant* on the
backend: a token's outputs must not depend on how many other rows share the matmuls.
This script measures that property directly, on one device, for the tiny model in float32:

1. reference: every decoder layer on the whole prompt (padded to a power of two), one
   jitted function per layer, recording each layer's input hidden state, top-k and pool;
2. control: the same layer function on the same whole-prompt batch again (must give 0
   differences, or the backend is not even run-to-run deterministic);
3. per CP=8 rank: the layer on that rank's rows (the zigzag order and block size the CP
   step uses), fed the reference input rows and the reference pool, comparing the rows'
   layer outputs and the KV they (re)write (page 0, the trash page, excluded) bitwise.

Both numerics modes are measured side by side: `default` (the plain model) and
`invariant` (batch-invariant numerics, `cpkv_jax.model.numerics`: fixed-shape tiles).
Prints one JSON object per prompt length and mode and a summary; `--json` writes all of
it. In the default mode the tests compare CP and single-device KV at atol 1e-5 because of
what this measures; in batch-invariant mode they compare bitwise (tests/core/test_cp_prefill.py).
Results from each backend are kept in `benchmarks/results/row_invariance_*.json`.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.report import emit, environment
from cpkv_jax.buckets import step_shape
from cpkv_jax.config import ModelConfig
from cpkv_jax.cp_prefill import zigzag_order
from cpkv_jax.model.forward_batch import ForwardBatch
from cpkv_jax.model.kv_cache import SINGLE_DEVICE_KV_IO, init_pool
from cpkv_jax.model.numerics import batch_invariant
from cpkv_jax.model.rope import rope_cos_sin
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.tools.tiny_config import tiny_config_dict

PAGE = 16
CP = 8
MODES = ["default", "invariant"]


def _batch(ids: np.ndarray, order: np.ndarray, width: int) -> ForwardBatch:
    """One row of tokens `order` (-1 = padding) of a prompt whose pages are 1..pages."""
    n = ids.size
    ok = order >= 0
    pos = np.where(ok, order, 0)
    table = np.zeros(width, np.int32)
    table[: -(-n // PAGE)] = np.arange(1, -(-n // PAGE) + 1)
    slots = np.where(ok, table[pos // PAGE] * PAGE + pos % PAGE, 0)
    return ForwardBatch(
        jnp.asarray(np.where(ok, ids[pos], 0)[None].astype(np.int32)),
        jnp.asarray(pos[None].astype(np.int32)),
        jnp.asarray(ok[None]),
        jnp.asarray(slots[None].astype(np.int32)),
        jnp.asarray(table[None]),
        jnp.asarray([n], jnp.int32),
    )


def _layer_step(model: CausalLM, cfg: ModelConfig, index: int, invariant: bool):
    layer = model.model.layers[index]

    @jax.jit
    def step(x, batch, pool, topk_in):
        with batch_invariant(invariant):
            return _layer(x, batch, pool, topk_in)

    def _layer(x, batch, pool, topk_in):
        cos, sin = rope_cos_sin(batch.positions, cfg.qk_rope_head_dim, cfg.rope)
        attn, pool, topk = layer.self_attn(
            layer.input_layernorm(x),
            batch,
            pool,
            cos,
            sin,
            topk_in,
            kv_io=SINGLE_DEVICE_KV_IO,
            index_k_dtype="float32",
            form="absorbed",
        )
        h = x + attn
        return h + layer.mlp(layer.post_attention_layernorm(h)), pool, topk

    return step


def _kv_diff(a, b) -> int:
    """Elements that differ between two pools, the trash page (page 0) excluded."""
    return sum(
        int((np.asarray(x)[1:] != np.asarray(y)[1:]).sum())
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


def measure(n: int, model: CausalLM, cfg: ModelConfig, mode: str = "default") -> dict:
    ids = np.random.default_rng(n).integers(3, cfg.vocab_size, n).astype(np.int32)
    shape = step_shape(1, n, n, CP, PAGE)
    padded = 1 << max(0, (n - 1).bit_length())
    ref_order = np.full(padded, -1)
    ref_order[:n] = np.arange(n)
    ref_batch = _batch(ids, ref_order, shape.width)
    invariant = mode == "invariant"
    steps = [_layer_step(model, cfg, i, invariant) for i in range(cfg.num_hidden_layers)]

    x = jax.jit(lambda b: model.model.embed_tokens(b.input_ids))(ref_batch)
    pool = init_pool(cfg, shape.width + 1, PAGE, index_k_dtype="float32")
    inputs, pools, topks, topk = [], [], [], None
    for step in steps:
        inputs.append(np.asarray(x))
        x, pool, topk = step(x, ref_batch, pool, topk)
        pools.append(pool)
        topks.append(np.asarray(topk))
    inputs.append(np.asarray(x))

    order = zigzag_order(n, CP, shape.block)
    layers = []
    for i, step in enumerate(steps):
        prev_topk = None if i == 0 else jnp.asarray(topks[i - 1])
        y, again, _ = step(jnp.asarray(inputs[i]), ref_batch, pools[i], prev_topk)
        control = int((np.asarray(y)[0, :n] != inputs[i + 1][0, :n]).any(-1).sum())
        control += _kv_diff(again, pools[i])
        rows_differ = kv_differ = 0
        for r in range(CP):
            mine = order[r * 2 * shape.block : (r + 1) * 2 * shape.block]
            ok = mine >= 0
            if not ok.any():
                continue
            src = np.where(ok, mine, 0)
            y, rewritten, _ = step(
                jnp.asarray(inputs[i][:, src]),
                _batch(ids, mine, shape.width),
                pools[i],
                None if i == 0 else jnp.asarray(topks[i - 1][:, src]),
            )
            rows_differ += int((np.asarray(y)[0][ok] != inputs[i + 1][0][mine[ok]]).any(-1).sum())
            kv_differ += _kv_diff(rewritten, pools[i])
        layers.append(
            {
                "layer": i,
                "control_differences": control,
                "rows_with_different_output": rows_differ,
                "kv_elements_different": kv_differ,
            }
        )
    return {
        "tokens": n,
        "numerics": mode,
        "rows_per_rank": 2 * shape.block,
        "reference_rows": padded,
        "layers": layers,
        "row_count_invariant": all(
            x["rows_with_different_output"] == 0 and x["kv_elements_different"] == 0 for x in layers
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[115, 533])
    ap.add_argument("--modes", nargs="+", choices=["default", "invariant"], default=MODES)
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    model = CausalLM(cfg, rngs=nnx.Rngs(11))
    out = {**environment(), "cases": []}
    for n in args.tokens:
        for mode in args.modes:
            case = measure(n, model, cfg, mode)
            out["cases"].append(case)
            print(json.dumps(case), file=sys.stderr, flush=True)
    emit(out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
