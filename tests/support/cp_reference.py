"""The single-device prefill reference of the CP prefill tests (tests/core/test_cp_prefill.py),
also the PD prefill server's batch-invariant oracle (tests/serving/test_prefill_server_e2e.py)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from cpkv_jax.generate import prefill_batch
from cpkv_jax.model.kv_cache import SINGLE_DEVICE_KV_IO, init_pool
from cpkv_jax.model.transformer import forward_step

P = 16
INDEX_K = "float32"  # fp8 index K: see test_fp8_index_k_cp_prefill


def reference(cfg, model, ids, index_k=INDEX_K, *, invariant=False, block_bytes=None):
    """Single-device prefill (padded to the generator's bucket): last logits, full view.

    `invariant`: batch-invariant numerics and the CP runner's absorbed attention form;
    `block_bytes`: the indexer's and sparse attention's token-block budget."""
    n = len(ids)
    pages = -(-n // P)
    table = np.arange(1, pages + 1, dtype=np.int32)
    batch = prefill_batch(np.asarray(ids), table, P)
    graphdef, state = nnx.split(model)
    pool = init_pool(cfg, pages + 1, P, index_k_dtype=index_k)
    logits, pool = forward_step(
        graphdef,
        state,
        batch,
        pool,
        index_k_dtype=index_k,
        form="absorbed" if invariant else "expanded",
        invariant=invariant,
        block_bytes=block_bytes,
    )
    view = jax.tree_util.tree_map(
        lambda leaf: SINGLE_DEVICE_KV_IO.view(leaf, batch.page_table)[0, :n], pool
    )
    return np.asarray(logits[0]), view
