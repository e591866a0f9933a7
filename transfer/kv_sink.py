"""The decode KV pool and its page allocator behind one small interface.

`KVSink` holds the decode server's `KVPool` and the `PageAllocator` of its pages: the
transfer receiver commits received pages into it (`transfer.receiver.Receiver`), and
decode steps read and donate the pool through it (`serving.decode.engine`, which in
unified mode uses it alone). `KVStore` is the part a decode engine needs; a
`Receiver` has it too, delegating to its sink.

Imports neither `serving` nor the receiver's gRPC and protobuf code, so the decode
engine can use it without them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

import numpy as np
from jax.typing import DTypeLike

from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import ConfigError
from cpkv_jax.kv_layout import KVLayout
from cpkv_jax.model.kv_cache import IndexKDtype, KVPool, init_pool
from cpkv_jax.paging import PageAllocator

if TYPE_CHECKING:
    from transfer.page_plan import LayoutDescriptor

T = TypeVar("T")

_HOST_ONLY = "this is a host-only receiver (pool=None): it has no decode pool"


@runtime_checkable
class KVStore(Protocol):
    """The decode pool and its page allocator, shared with whoever else writes it.

    `KVSink` is one; so is `transfer.receiver.Receiver` (decode mode: transfers commit
    into the same pool). The total page count is `pool.num_pages` (page 0, the trash
    page, is never handed out).
    """

    @property
    def pool(self) -> KVPool: ...

    @property
    def num_free_pages(self) -> int: ...

    def update_pool(self, step: Callable[[KVPool], tuple[T, KVPool]]) -> T: ...

    @property
    def num_free_pages_per_rank(self) -> tuple[int, ...]: ...

    def allocate_pages(self, n: int, rank: int = 0) -> np.ndarray: ...

    def free_pages(self, pages: np.ndarray) -> None: ...


class KVSink:
    """A `KVStore` over one pool and one `PageAllocator`.

    `pool=None` is a host-only sink (a benchmark receiver's): it hands out pages but has
    no pool to read or update. The pool and the allocator have a lock each, so a commit
    scatter (under the pool lock) never holds up page allocation or a failed room's
    page release.
    """

    def __init__(self, pool: KVPool | None, allocator: PageAllocator):
        if pool is not None and allocator.num_pages != pool.num_pages:
            raise ConfigError(
                f"allocator manages {allocator.num_pages} pages but the pool has "
                f"{pool.num_pages}; build both with the same page count"
            )
        self._pool = pool
        self._allocator = allocator
        self._pool_lock = threading.Lock()
        self._alloc_lock = threading.Lock()

    @classmethod
    def create(
        cls,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: DTypeLike,
        index_k_dtype: IndexKDtype,
    ) -> KVSink:
        """A zeroed pool of `num_pages` pages (page 0 = trash) and its allocator."""
        allocator = PageAllocator(num_pages)  # validates num_pages >= 2
        return cls(init_pool(cfg, num_pages, page_size, dtype, index_k_dtype), allocator)

    @property
    def host_only(self) -> bool:
        """True without a pool (`pool=None`)."""
        return self._pool is None

    @property
    def num_pages(self) -> int:
        """Pages the allocator manages, the trash page included."""
        return self._allocator.num_pages

    @property
    def pool(self) -> KVPool:
        """The pool (replaced by every `update_pool`: read it again after one)."""
        with self._pool_lock:
            if self._pool is None:
                raise ValueError(_HOST_ONLY)
            return self._pool

    @property
    def num_free_pages(self) -> int:
        with self._alloc_lock:
            return self._allocator.num_free

    def update_pool(self, step: Callable[[KVPool], tuple[T, KVPool]]) -> T:
        """Run `step(pool) -> (result, new_pool)` under the pool lock and keep `new_pool`.

        For steps that donate the pool (decode steps, the commit scatter): no other
        update runs in between, and the sink never holds a donated (deleted) pool.
        """
        with self._pool_lock:
            if self._pool is None:
                raise ValueError(_HOST_ONLY)
            result, self._pool = step(self._pool)
            return result

    @property
    def num_free_pages_per_rank(self) -> tuple[int, ...]:
        """Free pages of each DP rank's shard (one entry for a single-device pool)."""
        with self._alloc_lock:
            return self._allocator.num_free_per_rank

    def allocate_pages(self, n: int, rank: int = 0) -> np.ndarray:
        """`n` pages from the allocator (under its lock), all from DP rank `rank`'s shard."""
        with self._alloc_lock:
            return self._allocator.alloc(n, rank)

    def free_pages(self, pages: np.ndarray) -> None:
        """Give pages back (a finished request's, or a failed room's)."""
        with self._alloc_lock:
            self._allocator.free(pages)

    def check_layout(self, layout: LayoutDescriptor) -> None:
        """Raise `ValueError` unless the pool's leaves are what the transfer `layout`
        describes: leaf counts, and page bytes and page size of every (kind, layer)
        buffer. A host-only sink has nothing to check."""
        pool = self._pool
        if pool is None:
            return
        try:
            have = KVLayout.of_pool(pool, layout.full_indexer_layers)
        except ConfigError as e:
            raise ValueError(f"decode pool does not match the transfer layout: {e}") from e
        diff = have.mismatches(layout.kv_layout)
        if diff:
            raise ValueError(
                "decode pool differs from the transfer layout (pool != layout): " + "; ".join(diff)
            )
