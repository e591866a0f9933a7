"""`CPPoolPageSource`'s kept rows (one gather serves every buffer of a page set): they are
copies of held pages, keyed by page ids, so the pages' owner discards them before freeing
the pages (`PrefillModeEngine` does, as each transfer's hold ends)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from support.transfer import INDEX_K, P

from cpkv_jax.model.kv_cache import init_pool
from cpkv_jax.model.mtp import mtp_config
from transfer.page_source import CPPoolPageSource


def _random_pool(cfg, pages: int, seed: int):
    leaves, treedef = jax.tree_util.tree_flatten(
        init_pool(mtp_config(cfg), pages, P, jnp.float32, INDEX_K)
    )
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef,
        [jax.random.normal(k, x.shape).astype(x.dtype) for k, x in zip(keys, leaves, strict=True)],
    )


def test_kept_rows_are_discarded_before_the_pages_are_reused(cfg, layout):
    pools = [_random_pool(cfg, 8, 0)]
    source = CPPoolPageSource(lambda: pools[-1], layout, 0)
    pages = np.array([3, 5], np.int32)
    first, second = layout.buffers()[:2]

    def truth(pool, buffer):
        kind, layer = buffer
        return np.asarray(getattr(pool, kind)[layout.leaf_index(kind, layer)])[pages]

    # A sender reads one buffer and stops: the group's other rows stay kept.
    np.testing.assert_array_equal(source.read(*first, pages), truth(pools[-1], first))
    pools.append(_random_pool(cfg, 8, 1))  # the pages freed, reused and rewritten
    # Without a discard the kept (stale) rows would be served: the hazard discard removes.
    stale = source.read(*second, pages)
    np.testing.assert_array_equal(stale, truth(pools[0], second))
    assert not np.array_equal(stale, truth(pools[-1], second))
    source.read(*first, pages)  # kept rows again, of the current pool
    pools.append(_random_pool(cfg, 8, 2))
    assert source.discard(np.array([5, 6])) == 1  # any overlap drops the page set
    assert source.discard(pages) == 0
    np.testing.assert_array_equal(source.read(*second, pages), truth(pools[-1], second))
