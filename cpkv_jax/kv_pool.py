"""Device KV pools on the CP mesh: page-owned (shared) or replicated (baseline).

Shared mode (SPEC S1.3): every pool leaf is `[cp * pages_per_rank, page_size, ...]` with
its page axis sharded `P("cp")`, so rank `r` physically holds lane `r`: pages
`[r * pages_per_rank, (r + 1) * pages_per_rank)`. Page ids inside a lane are rank-local;
local page 0 of every lane is that lane's trash page. Replicated mode (SPEC S1.4): every
rank holds the whole `[pages_per_rank, page_size, ...]` pool (`P()`).

A *global slot* addresses one token row of the whole pool:
`(lane * pages_per_rank + local_page) * page_size + offset`, with `lane = 0` in
replicated mode. Host planners build global slots; the CP `write` turns them into
rank-local slots (`materialize.py`).

What a pool stores comes from the model's `kv_layout.KVLayout`, as for the single-device
pool, the transfer and the host cache.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import ConfigError
from cpkv_jax.kv_layout import KVLayout
from cpkv_jax.mesh import CP_AXIS
from cpkv_jax.model.kv_cache import IndexKDtype, KVPool, pool_shapes


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    cp_size: int
    shared: bool
    pages_per_rank: int  # physical pages each rank holds, its trash page included
    page_size: int

    def __post_init__(self):
        if self.pages_per_rank < 2:
            raise ConfigError(
                f"pages_per_rank must be >= 2 (one trash page + one usable), got "
                f"{self.pages_per_rank}; raise the KV pool size"
            )

    @property
    def lanes(self) -> int:
        """Owner lanes: `cp_size` in shared mode, one (everyone holds it) when replicated."""
        return self.cp_size if self.shared else 1

    @property
    def global_pages(self) -> int:
        return self.lanes * self.pages_per_rank

    @property
    def spec(self) -> P:
        return P(CP_AXIS) if self.shared else P()

    def global_slots(
        self, lanes: np.ndarray, local_pages: np.ndarray, offsets: np.ndarray
    ) -> np.ndarray:
        """Global slot ids (see module docstring) for token rows."""
        pages = np.asarray(lanes, np.int64) * self.pages_per_rank + np.asarray(local_pages)
        return (pages * self.page_size + np.asarray(offsets)).astype(np.int32)


def cp_pool_shapes(
    cfg: ModelConfig, layout: PoolLayout, dtype: DTypeLike, index_k_dtype: IndexKDtype
) -> KVPool:
    """Global (whole-mesh) shapes of every pool leaf."""
    return pool_shapes(cfg, layout.global_pages, layout.page_size, dtype, index_k_dtype)


def per_rank_pool_bytes(
    cfg: ModelConfig, layout: PoolLayout, dtype: DTypeLike, index_k_dtype: IndexKDtype
) -> int:
    """Persistent KV bytes one rank holds (both modes hold `pages_per_rank` pages)."""
    kv = KVLayout.from_model(cfg, layout.page_size, dtype, index_k_dtype)
    return kv.pool_bytes(layout.pages_per_rank)


def pool_shardings(mesh: Mesh, layout: PoolLayout, pool: KVPool) -> KVPool:
    sharding = NamedSharding(mesh, layout.spec)
    return jax.tree_util.tree_map(lambda _: sharding, pool)


def init_cp_pool(
    cfg: ModelConfig,
    layout: PoolLayout,
    mesh: Mesh,
    dtype: DTypeLike = jnp.float32,
    index_k_dtype: IndexKDtype = "fp8_e4m3",
) -> KVPool:
    """Zero pools created directly in their sharding (no host copy, no replication)."""
    shapes = cp_pool_shapes(cfg, layout, dtype, index_k_dtype)
    return zeros_in(shapes, pool_shardings(mesh, layout, shapes))


def zeros_in(shapes: KVPool, shardings: KVPool) -> KVPool:
    """Zero pool leaves of `shapes` created directly in `shardings` (each device
    allocates only its shard; no host copy)."""

    @functools.partial(jax.jit, out_shardings=shardings)
    def zeros():
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    return zeros()
