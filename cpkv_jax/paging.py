"""Host-side page arithmetic and the single-lane page allocator (pure numpy, no device).

A request's logical page `p` holds tokens `[p * page_size, (p + 1) * page_size)`. A page
table maps logical pages to physical pages of a pool; unused entries point at the
trash page (physical page 0), which is never handed out.
"""

from __future__ import annotations

import numpy as np

from cpkv_jax.errors import CacheCapacityError, ConfigError

TRASH_PAGE = 0


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` (a partial tail page counts as a page)."""
    return -(-num_tokens // page_size)


def slots_for_positions(
    page_table_row: np.ndarray, positions: np.ndarray, page_size: int
) -> np.ndarray:
    """Flat pool slots (`physical_page * page_size + offset`) of logical positions."""
    positions = np.asarray(positions, dtype=np.int64)
    return (page_table_row[positions // page_size] * page_size + positions % page_size).astype(
        np.int32
    )


def padded_page_table(pages: np.ndarray, width: int) -> np.ndarray:
    """A page-table row of `width` entries: `pages`, then the trash page."""
    if len(pages) > width:
        raise ConfigError(f"request has {len(pages)} pages but the page table holds {width}")
    row = np.full((width,), TRASH_PAGE, dtype=np.int32)
    row[: len(pages)] = pages
    return row


class PageAllocator:
    """Free list of one pool's physical pages; page 0 is reserved as the trash page."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ConfigError(
                f"a pool needs at least 2 pages (1 trash + 1 usable), got {num_pages}"
            )
        self.num_pages = num_pages
        # Lowest pages first, so small tests get predictable page numbers.
        self._free = list(range(num_pages - 1, TRASH_PAGE, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray:
        if n > len(self._free):
            raise CacheCapacityError(
                f"need {n} KV pages but only {len(self._free)} of {self.num_pages - 1} are free; "
                "raise the KV pool size or shorten the request"
            )
        out = [self._free.pop() for _ in range(n)]
        return np.asarray(out, dtype=np.int32)

    def free(self, pages: np.ndarray) -> None:
        pages = [int(p) for p in np.asarray(pages).reshape(-1)]
        if TRASH_PAGE in pages:
            raise ValueError("the trash page is never allocated and cannot be freed")
        in_free = set(self._free)
        dup = [p for p in pages if p in in_free or not 0 < p < self.num_pages]
        if dup or len(set(pages)) != len(pages):
            raise ValueError(f"double free or foreign page(s): {dup or pages}")
        self._free.extend(sorted(pages, reverse=True))
