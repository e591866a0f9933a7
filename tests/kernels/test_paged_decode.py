"""Prefill logits equal token-by-token decode logits through the paged cache.

Prefill runs the expanded MLA form over all prompt tokens at once; decode runs the
absorbed form one token at a time, reading earlier tokens from the paged pool. Both go
through the indexer, shared-layer top-k reuse, MoE and the page table, so agreement
(float32, rtol 1e-4: only summation order differs) checks the whole paged path.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpkv_jax.config import ModelConfig
from cpkv_jax.model.forward_batch import ForwardBatch
from cpkv_jax.model.kv_cache import init_pool
from cpkv_jax.model.transformer import CausalLM, forward_step
from cpkv_jax.paging import PageAllocator, padded_page_table, pages_for_tokens, slots_for_positions
from cpkv_jax.tools.tiny_config import tiny_config_dict

PAGE = 16


def _batch(ids, positions, table, kv_len, width=None):
    """One row; with `width`, padded to that many tokens as the server pads a prefill
    bucket (padding invalid, written to the trash page's slot 0)."""
    n = len(ids)
    width = width or n
    padded = np.zeros((1, width), np.int32)
    padded[0, :n] = ids
    pos = np.zeros((1, width), np.int32)
    pos[0, :n] = positions
    valid = np.arange(width)[None] < n
    slots = np.where(valid, slots_for_positions(table, pos[0], PAGE)[None], 0)
    return ForwardBatch(
        input_ids=jnp.asarray(padded),
        positions=jnp.asarray(pos),
        valid=jnp.asarray(valid),
        write_slots=jnp.asarray(slots, jnp.int32),
        page_table=jnp.asarray(table[None]),
        kv_lens=jnp.asarray([kv_len], jnp.int32),
    )


@pytest.fixture(scope="module", params=["glm_moe_dsa", "deepseek_v32"])
def model(request):
    cfg = ModelConfig.from_dict(tiny_config_dict(request.param))
    return cfg, nnx.split(CausalLM(cfg, rngs=nnx.Rngs(7)))


LENGTHS = [PAGE - 1, PAGE, PAGE + 1, 2 * PAGE + 3]
# One pool, page-table width and padded prefill width for every length: the prefill and
# the token-by-token decode steps each compile once per model and index-K dtype (the
# suite's time); the padding is the server's (`prefill_batch`).
MAX_PAGES = pages_for_tokens(max(LENGTHS), PAGE)
PREFILL_WIDTH = MAX_PAGES * PAGE


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("index_k_dtype", ["float32", "fp8_e4m3"])
def test_prefill_logits_equal_decode_logits(model, length, index_k_dtype):
    cfg, (graphdef, state) = model
    rng = np.random.default_rng(length)
    ids = rng.integers(3, cfg.vocab_size, length)
    # Scattered, non-monotone physical pages: the page table must be honoured.
    n_pages = pages_for_tokens(length, PAGE)
    alloc = PageAllocator(2 * MAX_PAGES + 2)
    alloc.alloc(1)
    pages = alloc.alloc(2 * n_pages)[::-2][:n_pages]
    table = padded_page_table(pages, MAX_PAGES + 1)
    num_pages = alloc.num_pages

    pool = init_pool(cfg, num_pages, PAGE, index_k_dtype=index_k_dtype)
    prefill, _ = forward_step(
        graphdef,
        state,
        _batch(ids, np.arange(length), table, length, width=PREFILL_WIDTH),
        pool,
        index_k_dtype=index_k_dtype,
        all_logits=True,
    )

    pool = init_pool(cfg, num_pages, PAGE, index_k_dtype=index_k_dtype)
    decoded = []
    for i in range(length):
        logits, pool = forward_step(
            graphdef,
            state,
            _batch(ids[i : i + 1], [i], table, i + 1),
            pool,
            index_k_dtype=index_k_dtype,
            form="absorbed",
        )
        decoded.append(logits[0])
    chex.assert_trees_all_close(prefill[0, :length], jnp.stack(decoded), rtol=1e-4, atol=1e-4)
    # index_topk (16) < length for the longer prompts: the sparse path really ran.
    assert cfg.index_topk < 2 * PAGE + 3
