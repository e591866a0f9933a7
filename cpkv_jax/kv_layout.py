"""The one definition of what the KV cache stores: which arrays, for which layers, in which
dtypes, and what a page of them costs.

Every pool and every copy of one derives from a `KVLayout`: the device pools
(`kv_cache.pool_shapes`, the CP and DP pools), the transfer's wire descriptor and page
plans (`transfer.page_plan.LayoutDescriptor`), the host cache's pools
(`host_cache.HostPool`), the memory plan (`kv_pool.per_rank_pool_bytes`) and the
benchmarks' sizing. A new kind of KV (an fp8 latent, the MTP layer's KV) is added here
once and reaches all of them.

Per buffer kind, one leaf per layer that stores it, each `[pages, page_size, *feature]`:
- `latent`: the MLA latent (`kv_lora_rank + qk_rope_head_dim`) of every layer;
- `index_k`: the indexer's keys of the *full* indexer layers only (shared layers reuse the
  previous full layer's top-k), in the index-K dtype;
- `index_scale`: one float32 per token beside fp8 index K (the 128-dim block's scale).

Pure numpy (ml_dtypes for bfloat16 / fp8), no JAX: the transfer's host-side planning and
the CPU-only estimator use it too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal, get_args

import ml_dtypes
import numpy as np

from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import ConfigError

BufferKind = Literal["latent", "index_k", "index_scale"]
BUFFER_KINDS: tuple[BufferKind, ...] = get_args(BufferKind)
# `--index-k-dtype` names (`kv_cache.IndexKDtype`) -> numpy dtypes.
INDEX_K_NUMPY: dict[str, np.dtype] = {
    "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
}
INDEX_SCALE_DTYPE = np.dtype(np.float32)


def numpy_dtype(dtype: Any) -> np.dtype:
    """A dtype given by name ("bfloat16"), numpy / ml_dtypes / jnp type, or an index-K flag
    name ("fp8_e4m3"), as a numpy dtype."""
    if isinstance(dtype, str) and dtype in INDEX_K_NUMPY:
        return INDEX_K_NUMPY[dtype]
    if isinstance(dtype, str) and hasattr(ml_dtypes, dtype):  # "float8_e4m3fn" by name
        return np.dtype(getattr(ml_dtypes, dtype))
    try:
        return np.dtype(dtype)
    except TypeError as e:
        raise ConfigError(
            f"{dtype!r} is not a numpy / ml_dtypes dtype; use e.g. 'float32', 'bfloat16' "
            "or 'float8_e4m3fn'"
        ) from e


@dataclasses.dataclass(frozen=True)
class KVBuffer:
    """One buffer kind: the model layers that store it (in leaf order) and each token's
    feature shape and dtype."""

    kind: BufferKind
    layers: tuple[int, ...]
    feature: tuple[int, ...]
    dtype: np.dtype

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one layer."""
        return math.prod(self.feature) * self.dtype.itemsize

    def page_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        """One leaf's shape in a pool of `num_pages` pages."""
        return (num_pages, page_size, *self.feature)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What a KV pool stores (see the module docstring). `buffers` are in `KVPool` field
    order (latent, index_k, index_scale), the kinds a model stores only."""

    page_size: int
    num_layers: int
    buffers: tuple[KVBuffer, ...]

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        kinds = [b.kind for b in self.buffers]
        if not kinds or kinds[0] != "latent" or kinds != sorted(kinds, key=BUFFER_KINDS.index):
            raise ConfigError(
                f"KV buffers must start with latent, in {BUFFER_KINDS} order: {kinds}"
            )
        for b in self.buffers:
            if list(b.layers) != sorted(set(b.layers)) or not all(
                0 <= x < self.num_layers for x in b.layers
            ):
                raise ConfigError(
                    f"{b.kind} layers must be ascending, unique and in [0, {self.num_layers}): "
                    f"{b.layers}"
                )

    @classmethod
    def from_model(
        cls, cfg: ModelConfig, page_size: int, latent_dtype: Any, index_k_dtype: str
    ) -> KVLayout:
        """The layout a model's pools have: the latent of every layer in `latent_dtype`
        (the model's `--dtype`), index K of the full indexer layers in `index_k_dtype`
        (an `IndexKDtype` flag name or a dtype), and its scale when that is fp8."""
        kdt = numpy_dtype(index_k_dtype)
        return cls.mla(
            page_size,
            cfg.num_hidden_layers,
            cfg.full_indexer_layers,
            latent=(cfg.kv_cache_dim, latent_dtype),
            index_k=(cfg.index_head_dim, kdt),
            index_scale=kdt == INDEX_K_NUMPY["fp8_e4m3"],
        )

    @classmethod
    def mla(
        cls,
        page_size: int,
        num_layers: int,
        full_indexer_layers: Sequence[int],
        *,
        latent: tuple[int, Any],
        index_k: tuple[int, Any],
        index_scale: bool,
    ) -> KVLayout:
        """An MLA + indexer layout from its dims: `latent` and `index_k` are (width,
        dtype); index K and its scale only on `full_indexer_layers`."""
        full = tuple(int(x) for x in full_indexer_layers)
        buffers = [
            KVBuffer("latent", tuple(range(num_layers)), (latent[0],), numpy_dtype(latent[1])),
            KVBuffer("index_k", full, (index_k[0],), numpy_dtype(index_k[1])),
        ]
        if index_scale:
            buffers.append(KVBuffer("index_scale", full, (), INDEX_SCALE_DTYPE))
        return cls(page_size, num_layers, tuple(b for b in buffers if b.layers))

    @classmethod
    def of_pool(cls, pool: Any, index_layers: Sequence[int]) -> KVLayout:
        """The layout of an existing pool (a `KVPool` of arrays, `ShapeDtypeStruct`s or
        anything with `.shape` / `.dtype` leaves); `index_layers` are the model layers of
        its `index_k` / `index_scale` leaves, in order (the full indexer layers)."""
        index_layers = tuple(int(i) for i in index_layers)
        buffers = []
        for kind, layers in (
            ("latent", tuple(range(len(pool.latent)))),
            ("index_k", index_layers),
            ("index_scale", index_layers),
        ):
            leaves = getattr(pool, kind)
            if not leaves:
                continue
            if len(leaves) != len(layers):
                raise ConfigError(
                    f"the pool has {len(leaves)} {kind} leaves but {len(layers)} layers "
                    f"{list(layers)} were named for them; pass the full indexer layers"
                )
            first = leaves[0]
            buffers.append(KVBuffer(kind, layers, tuple(first.shape[2:]), numpy_dtype(first.dtype)))
        return cls(int(pool.latent[0].shape[1]), len(pool.latent), tuple(buffers))

    def by_kind(self) -> dict[str, KVBuffer]:
        return {b.kind: b for b in self.buffers}

    def buffer(self, kind: str) -> KVBuffer | None:
        """The `kind` buffer, None when the layout stores none (no `index_scale` without
        fp8 index K)."""
        return self.by_kind().get(kind)

    def layer_buffers(self) -> tuple[tuple[BufferKind, int], ...]:
        """Every (kind, layer) leaf, layer-major (the order a layer-wise sender streams)."""
        return tuple(
            (b.kind, layer)
            for layer in range(self.num_layers)
            for b in self.buffers
            if layer in b.layers
        )

    def kinds_at(self, layer: int) -> tuple[BufferKind, ...]:
        return tuple(b.kind for b in self.buffers if layer in b.layers)

    def leaf_index(self, kind: str, layer: int) -> int:
        """Position of `layer`'s leaf in the pool's `kind` tuple (`index_k[j]`: j-th full)."""
        b = self.buffer(kind)
        if b is None or layer not in b.layers:
            raise ConfigError(f"layer {layer} stores no {kind}")
        return b.layers.index(layer)

    def page_bytes(self, kind: str, layer: int) -> int:
        """Bytes of one page of one (kind, layer) leaf."""
        b = self.buffer(kind)
        if b is None or layer not in b.layers:
            raise ConfigError(f"layer {layer} stores no {kind}")
        return self.page_size * b.token_bytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token position costs over every layer and kind."""
        return sum(len(b.layers) * b.token_bytes for b in self.buffers)

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page over every layer and kind (what a position costs to store,
        copy to the host or send)."""
        return self.page_size * self.bytes_per_token

    def pool_bytes(self, num_pages: int) -> int:
        return num_pages * self.bytes_per_page

    def leaf_shapes(
        self, num_pages: int
    ) -> dict[str, tuple[tuple[tuple[int, ...], np.dtype], ...]]:
        """Per kind, each leaf's (shape, dtype) in a pool of `num_pages` pages (every kind
        of `BUFFER_KINDS`, empty when not stored)."""
        out: dict[str, tuple[tuple[tuple[int, ...], np.dtype], ...]] = {k: () for k in BUFFER_KINDS}
        for b in self.buffers:
            leaf = (b.page_shape(num_pages, self.page_size), b.dtype)
            out[b.kind] = (leaf,) * len(b.layers)
        return out

    def mismatches(self, other: KVLayout) -> list[str]:
        """One line per difference, ours first; empty when equal."""
        if self == other:
            return []
        out = [
            f"{name}: {getattr(self, name)} != {getattr(other, name)}"
            for name in ("page_size", "num_layers")
            if getattr(self, name) != getattr(other, name)
        ]
        mine, theirs = self.by_kind(), other.by_kind()
        for kind in BUFFER_KINDS:
            a, b = mine.get(kind), theirs.get(kind)
            if a != b:
                out.append(f"{kind}: {_describe(a)} != {_describe(b)}")
        return out


def _describe(b: KVBuffer | None) -> str:
    if b is None:
        return "not stored"
    return f"layers {list(b.layers)} x {b.feature} {b.dtype.name}"
