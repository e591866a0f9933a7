"""Host (L2) KV pools: numpy mirrors of one owner lane's device pool, in the S4.1 layouts.

A `HostPool` holds host pages of one lane (SPEC S4.5: with CP shared KV each rank backs
up and loads only its owned pages, into its own lane; replicated pools have one lane).
It mirrors `KVPool`'s leaves as the model's `kv_layout.KVLayout` defines them: one
buffer per kind, its layer axis over the layers that have the leaf (every layer for the
MLA latent; the full indexer layers for index K and, with fp8 index K, its per-token
scale). Per kind, with `Lk` layers, `H` host pages, page size `P` and per-token feature
shape `F` (`(D,)`, or `()` for the scale):

- `layer_first`        `[Lk, H * P, *F]`   (token-major per layer)
- `page_first`         `[H, Lk, P, *F]`
- `page_first_direct`  `[H, Lk, P, *F]`    (page-first, copied page by page)
- `layer_page_first`   `[Lk, H, P, *F]`    (LPF: a layer's pages are whole spans)

Host page 0 is reserved like the device trash page; `HostPageAllocator` hands out pages
`1 .. H-1` all-or-nothing. Sizing follows SGLang's `--hicache-size` (bytes per rank here)
and `--hicache-ratio` (host pages = ratio x device pages per rank): `host_pages_for`.
Pure numpy; no device work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np
from jaxtyping import Int

from cpkv_jax.errors import CacheCapacityError, ConfigError, CpkvError, quote
from cpkv_jax.kv_layout import KVLayout
from cpkv_jax.kv_pool import PoolLayout
from cpkv_jax.model.kv_cache import KVPool
from cpkv_jax.paging import TRASH_PAGE

HostLayout = Literal["layer_first", "page_first", "page_first_direct", "layer_page_first"]
HOST_LAYOUTS: tuple[str, ...] = get_args(HostLayout)
HOST_TRASH_PAGE = TRASH_PAGE


class HostPageError(CpkvError, ValueError):
    """A host page handed back or addressed is reserved, foreign, or not allocated."""


def token_indices_of_pages(pages: Int[np.ndarray, " n"], page_size: int) -> Int[np.ndarray, " t"]:
    """Whole-page token indices (int64, caller order) of page ids: `p*P .. p*P+P-1` each."""
    pages = np.asarray(pages, dtype=np.int64).reshape(-1)
    return (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1)


class HostPageAllocator:
    """Free list of one host pool's pages; page 0 is reserved and never handed out.

    `alloc` is all-or-nothing (`CacheCapacityError`, nothing taken); `free` refuses the
    reserved page, foreign pages, repeats and pages not allocated (`HostPageError`,
    nothing freed). Pages come out lowest first; int64 (SPEC S4.2).
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ConfigError(
                f"a host pool needs at least 2 pages (1 reserved + 1 usable), got {num_pages}; "
                "raise the host cache size or ratio"
            )
        self.num_pages = num_pages
        self._stack = np.arange(num_pages - 1, HOST_TRASH_PAGE, -1, dtype=np.int64)
        self._top = num_pages - 1
        self._allocated = np.zeros((num_pages,), dtype=bool)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return self._top

    def allocated_mask(self) -> np.ndarray:
        return self._allocated.copy()

    def alloc(self, n: int) -> Int[np.ndarray, " n"]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} host pages")
        if n > self._top:
            raise CacheCapacityError(
                f"need {n} host KV pages but only {self._top} of {self.capacity} are free; "
                "raise the host cache size (--hicache-size / --hicache-ratio) or evict "
                "host-cached pages"
            )
        pages = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._allocated[pages] = True
        return pages

    def free(self, pages: Int[np.ndarray, " n"]) -> None:
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        if pages.size == 0:
            return
        if (pages == HOST_TRASH_PAGE).any():
            raise HostPageError(
                f"host page {HOST_TRASH_PAGE} is reserved: it is never allocated and cannot "
                "be freed"
            )
        foreign = (pages < 0) | (pages >= self.num_pages)
        if foreign.any():
            raise HostPageError(
                f"foreign host page(s) {quote(pages[foreign])}: outside [1, {self.num_pages})"
            )
        uniq, counts = np.unique(pages, return_counts=True)
        if (counts > 1).any():
            raise HostPageError(f"double free: host page(s) {quote(uniq[counts > 1])} repeat")
        not_held = ~self._allocated[pages]
        if not_held.any():
            raise HostPageError(
                f"double free or foreign page: host page(s) {quote(pages[not_held])} are "
                "not allocated"
            )
        self._allocated[pages] = False
        self._stack[self._top : self._top + pages.size] = np.sort(pages)[::-1]
        self._top += pages.size


def host_pages_for(
    page_bytes: int, device_pages_per_rank: int, *, size_bytes: int = 0, ratio: float = 2.0
) -> int:
    """Host pages of one lane (reserved page 0 included).

    `size_bytes > 0` (SGLang `--hicache-size`, here in bytes per rank) wins; otherwise
    `ratio` x the device pages per rank (SGLang `--hicache-ratio`).
    """
    if page_bytes < 1:
        raise ConfigError(f"page_bytes must be >= 1, got {page_bytes}")
    if size_bytes < 0:
        raise ConfigError(f"host cache size must be >= 0 bytes, got {size_bytes}")
    if size_bytes > 0:
        pages = size_bytes // page_bytes
        how = f"size {size_bytes} B / {page_bytes} B per page"
    else:
        if not ratio > 0:
            raise ConfigError(f"host cache ratio must be > 0, got {ratio}")
        pages = int(ratio * device_pages_per_rank)
        how = f"ratio {ratio} x {device_pages_per_rank} device pages"
    if pages < 2:
        raise ConfigError(
            f"host cache of {pages} page(s) ({how}) is too small: it needs 1 reserved + 1 "
            "usable page; raise the host cache size or ratio"
        )
    return pages


def _buffer_shape(layout: str, layers: int, pages: int, page_size: int, feature) -> tuple:
    if layout == "layer_first":
        return (layers, pages * page_size, *feature)
    if layout in ("page_first", "page_first_direct"):
        return (pages, layers, page_size, *feature)
    return (layers, pages, page_size, *feature)


class HostPool:
    """Host pages of one owner lane, in one layout (see the module docstring).

    `buffers[kind]` is the numpy buffer of a leaf kind; `read_pages` / `write_pages` move
    whole pages of one layer in caller order. Index checks live in `host_cache.copy`.
    """

    def __init__(self, kv: KVLayout, layout: str, num_pages: int):
        if layout not in HOST_LAYOUTS:
            raise ConfigError(f"unknown host layout {layout!r}; use one of {HOST_LAYOUTS}")
        self.layout: HostLayout = layout
        self.kv = kv
        self.num_pages = num_pages
        self.page_size = kv.page_size
        self.specs = kv.by_kind()
        self.allocator = HostPageAllocator(num_pages)
        self.buffers: dict[str, np.ndarray] = {
            kind: np.zeros(
                _buffer_shape(layout, len(s.layers), num_pages, kv.page_size, s.feature), s.dtype
            )
            for kind, s in self.specs.items()
        }

    @classmethod
    def for_device_pool(
        cls,
        template: KVPool,
        index_layers: Sequence[int],
        layout: str,
        *,
        device_pages_per_rank: int,
        size_bytes: int = 0,
        ratio: float = 2.0,
    ) -> HostPool:
        """A host pool for one lane of `template` (a device pool or its shapes), sized by
        `size_bytes` per rank or `ratio` x `device_pages_per_rank` (`host_pages_for`)."""
        kv = KVLayout.of_pool(template, index_layers)
        pages = host_pages_for(
            kv.bytes_per_page, device_pages_per_rank, size_bytes=size_bytes, ratio=ratio
        )
        return cls(kv, layout, pages)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.specs)

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def kinds_at(self, layer: int) -> tuple[str, ...]:
        """Leaf kinds layer `layer` has (latent always; index K on full indexer layers)."""
        return tuple(k for k, s in self.specs.items() if layer in s.layers)

    def slot(self, kind: str, layer: int) -> int:
        """Position of model layer `layer` on `kind`'s layer axis."""
        layers = self.specs[kind].layers
        if layer not in layers:
            raise ConfigError(f"layer {layer} has no {kind}; its layers are {list(layers)}")
        return layers.index(layer)

    def layer_pages(self, kind: str, layer: int) -> np.ndarray:
        """`[num_pages, P, *F]` view of one layer (layer-first layouts only)."""
        j = self.slot(kind, layer)
        buf = self.buffers[kind]
        if self.layout == "layer_first":
            return buf[j].reshape(self.num_pages, self.page_size, *buf.shape[2:])
        if self.layout == "layer_page_first":
            return buf[j]
        raise ConfigError(f"layout {self.layout} is page-first: a layer is not one array")

    def read_pages(self, kind: str, layer: int, pages: Int[np.ndarray, " n"]) -> np.ndarray:
        """Copy of `[n, P, *F]`: host pages `pages` (caller order) of one layer."""
        if self.layout in ("page_first", "page_first_direct"):
            return self.buffers[kind][pages, self.slot(kind, layer)]
        return self.layer_pages(kind, layer)[pages]

    def write_pages(
        self, kind: str, layer: int, pages: Int[np.ndarray, " n"], data: np.ndarray
    ) -> None:
        """Store `data` `[n, P, *F]` into host pages `pages` (caller order) of one layer.

        `page_first_direct` stores page by page (its copy contract); the others in one
        fancy-indexed assignment.
        """
        buf = self.buffers[kind]
        if self.layout == "page_first_direct":
            j = self.slot(kind, layer)
            for i, p in enumerate(pages):
                buf[p, j] = data[i]
        elif self.layout == "page_first":
            buf[pages, self.slot(kind, layer)] = data
        else:
            self.layer_pages(kind, layer)[pages] = data


@dataclasses.dataclass(frozen=True)
class HostPools:
    """One `HostPool` per owner lane of a device pool layout (SPEC S4.5)."""

    pool_layout: PoolLayout
    lanes: tuple[HostPool, ...]

    def __post_init__(self):
        if len(self.lanes) != self.pool_layout.lanes:
            raise ConfigError(
                f"{len(self.lanes)} host pools for a device layout of "
                f"{self.pool_layout.lanes} lane(s)"
            )

    @classmethod
    def create(
        cls,
        template: KVPool,
        index_layers: Sequence[int],
        pool_layout: PoolLayout,
        layout: str,
        *,
        size_bytes: int = 0,
        ratio: float = 2.0,
    ) -> HostPools:
        """Host pools for every lane; `size_bytes` is per rank (per lane)."""
        lanes = tuple(
            HostPool.for_device_pool(
                template,
                index_layers,
                layout,
                device_pages_per_rank=pool_layout.pages_per_rank,
                size_bytes=size_bytes,
                ratio=ratio,
            )
            for _ in range(pool_layout.lanes)
        )
        return cls(pool_layout, lanes)

    def __getitem__(self, lane: int) -> HostPool:
        return self.lanes[lane]

    def __len__(self) -> int:
        return len(self.lanes)
