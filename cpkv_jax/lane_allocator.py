"""Owner-lane page allocator for CP shared-KV pools, and per-request page tables.

With CP shared KV (SPEC S1) logical page `p` of a request is stored only by rank
`p mod cp_size`, its **owner lane**. Every lane is one rank's pool of `pages_per_lane`
physical pages with its own free list; local page 0 of every lane is that lane's trash
page (padding writes go there) and is never handed out.

Two layers, kept apart as SPEC S1.2 asks:
- `OwnerLaneAllocator` knows physical storage only: which local pages of which lane are
  free. It never sees requests.
- `RequestPageTable` knows one request's logical pages and, for each, the local physical
  page its owner lane gave it.

The replicated baseline (SPEC S1.4) does not use this module: it keeps the single-lane
`paging.PageAllocator`. `cp_size=1` still works here as a degenerate single lane.
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Bool, Int

from cpkv_jax.errors import CacheCapacityError, ConfigError
from cpkv_jax.paging import (
    TRASH_PAGE,
    owner_of_page,
    padded_page_table,
    pages_for_tokens,
)


class OwnerLaneAllocator:
    """Free lists of `cp_size` owner lanes, `pages_per_lane` physical pages each.

    Invariants (checked by tests/core/test_ownership.py):
    - local page `TRASH_PAGE` (0) of a lane is never allocated;
    - a page is allocated at most once until freed;
    - the page handed out for logical page `p` is local to lane `p mod cp_size`;
    - `allocate` is all-or-nothing: on `CacheCapacityError` no lane changed;
    - per lane, free + allocated == `pages_per_lane - 1` at all times.

    Pages come out lowest first per lane (freed pages are reused first), so small tests
    get predictable page numbers. Host-side numpy only; no device work.
    """

    def __init__(self, cp_size: int, pages_per_lane: int):
        if cp_size < 1:
            raise ConfigError(f"cp_size must be >= 1, got {cp_size}")
        if pages_per_lane < 2:
            raise ConfigError(
                f"each owner lane needs at least 2 pages (1 trash + 1 usable), "
                f"got pages_per_lane={pages_per_lane}; raise the KV pool size"
            )
        self.cp_size = cp_size
        self.pages_per_lane = pages_per_lane
        usable = pages_per_lane - 1
        # Per-lane stack of free pages; entries [0, top) are free, popped from the top.
        # Filled highest-first so the lowest page is on top.
        self._stack = np.tile(
            np.arange(pages_per_lane - 1, TRASH_PAGE, -1, dtype=np.int32), (cp_size, 1)
        )
        self._top = np.full((cp_size,), usable, dtype=np.int64)
        self._allocated = np.zeros((cp_size, pages_per_lane), dtype=bool)

    @property
    def capacity_per_lane(self) -> int:
        """Allocatable pages of one lane (the trash page excluded)."""
        return self.pages_per_lane - 1

    def num_free(self, lane: int) -> int:
        """Free pages of `lane`."""
        self._check_lane(lane)
        return int(self._top[lane])

    def num_free_per_lane(self) -> Int[np.ndarray, " cp"]:
        """Free pages of every lane, `[cp_size]` int64 (a copy)."""
        return self._top.copy()

    def allocated_mask(self) -> Bool[np.ndarray, "cp pages_per_lane"]:
        """`[cp_size, pages_per_lane]` bool, True where a page is allocated (a copy)."""
        return self._allocated.copy()

    def pages_needed_per_lane(self, logical_pages: Int[np.ndarray, " n"]) -> Int[np.ndarray, " cp"]:
        """Pages each lane must supply for `logical_pages`, `[cp_size]` int64."""
        owners = self._owners(logical_pages)
        return np.bincount(owners, minlength=self.cp_size).astype(np.int64)

    def can_allocate(self, logical_pages: Int[np.ndarray, " n"]) -> bool:
        """Whether every owner lane has room for its share of `logical_pages`."""
        return bool(np.all(self.pages_needed_per_lane(logical_pages) <= self._top))

    def allocate(self, logical_pages: Int[np.ndarray, " n"]) -> Int[np.ndarray, " n"]:
        """One physical page per logical page position, each local to its owner lane.

        `logical_pages` is 1-D, non-negative logical page positions (order and
        duplicates are the caller's business). Returns `[n]` int32 local page ids;
        entry `i` lives in lane `logical_pages[i] mod cp_size`. All-or-nothing: if any
        lane is short, raises `CacheCapacityError` naming it and allocates nothing.
        """
        owners = self._owners(logical_pages)
        needed = np.bincount(owners, minlength=self.cp_size)
        short = np.flatnonzero(needed > self._top)
        if short.size:
            detail = ", ".join(
                f"lane {int(lane)} needs {int(needed[lane])} but has {int(self._top[lane])} free"
                for lane in short
            )
            raise CacheCapacityError(
                f"owner lane(s) out of KV pages: {detail} (of {self.capacity_per_lane} per "
                "lane); raise the KV pool size, shorten the request, or free cached requests"
            )
        out = np.empty(owners.shape, dtype=np.int32)
        for lane in np.flatnonzero(needed):
            where = np.flatnonzero(owners == lane)
            top = int(self._top[lane])
            pages = self._stack[lane, top - where.size : top][::-1]
            out[where] = pages
            self._top[lane] = top - where.size
            self._allocated[lane, pages] = True
        return out

    def free(self, lanes: Int[np.ndarray, " n"], pages: Int[np.ndarray, " n"]) -> None:
        """Return `pages[i]` to lane `lanes[i]`, for every `i`.

        All-or-nothing: the trash page, a page out of range, a page that is not
        allocated, or a (lane, page) pair given twice raise `ValueError` naming it, and
        nothing is freed.
        """
        lanes = np.asarray(lanes, dtype=np.int64).reshape(-1)
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        if lanes.shape != pages.shape:
            raise ValueError(f"free got {lanes.size} lanes but {pages.size} pages")
        if lanes.size == 0:
            return
        bad_lane = (lanes < 0) | (lanes >= self.cp_size)
        if bad_lane.any():
            i = int(np.flatnonzero(bad_lane)[0])
            raise ValueError(f"foreign page: lane {int(lanes[i])} is outside [0, {self.cp_size})")
        trash = pages == TRASH_PAGE
        if trash.any():
            i = int(np.flatnonzero(trash)[0])
            raise ValueError(
                f"lane {int(lanes[i])}: the trash page {TRASH_PAGE} is never allocated and "
                "cannot be freed"
            )
        foreign = (pages < 0) | (pages >= self.pages_per_lane)
        if foreign.any():
            i = int(np.flatnonzero(foreign)[0])
            raise ValueError(
                f"foreign page: lane {int(lanes[i])} page {int(pages[i])} is outside "
                f"[1, {self.pages_per_lane})"
            )
        flat = lanes * self.pages_per_lane + pages
        uniq, counts = np.unique(flat, return_counts=True)
        if (counts > 1).any():
            dup = int(uniq[np.flatnonzero(counts > 1)[0]])
            lane, page = divmod(dup, self.pages_per_lane)
            raise ValueError(f"double free: lane {lane} page {page} is given more than once")
        not_held = ~self._allocated[lanes, pages]
        if not_held.any():
            i = int(np.flatnonzero(not_held)[0])
            raise ValueError(
                f"double free or foreign page: lane {int(lanes[i])} page {int(pages[i])} "
                "is not allocated"
            )
        self._allocated[lanes, pages] = False
        for lane in np.unique(lanes):
            mine = pages[lanes == lane]
            top = int(self._top[lane])
            # Pushed highest-first so the lowest freed page is reused first.
            self._stack[lane, top : top + mine.size] = np.sort(mine)[::-1]
            self._top[lane] = top + mine.size

    def _owners(self, logical_pages: np.ndarray) -> np.ndarray:
        logical_pages = np.asarray(logical_pages)
        if logical_pages.ndim != 1:
            raise ValueError(f"logical pages must be 1-D, got shape {logical_pages.shape}")
        if logical_pages.size and logical_pages.min() < 0:
            raise ValueError(f"logical page positions must be >= 0, got {int(logical_pages.min())}")
        return owner_of_page(logical_pages.astype(np.int64), self.cp_size)

    def _check_lane(self, lane: int) -> None:
        if not 0 <= lane < self.cp_size:
            raise ValueError(f"lane {lane} is outside [0, cp_size={self.cp_size})")


class RequestPageTable:
    """One request's logical pages -> (owner lane, local physical page) (SPEC S1.2).

    Logical page `p` (tokens `[p * page_size, (p + 1) * page_size)`) is owned by lane
    `p mod cp_size` at local index `p div cp_size` (SPEC S1.1). Chunked prefill grows the
    table chunk by chunk with `extend`; ownership depends only on `p`, never on where the
    chunks were cut. Only the local page id is stored: the lane follows from `p`.
    """

    def __init__(self, cp_size: int):
        if cp_size < 1:
            raise ConfigError(f"cp_size must be >= 1, got {cp_size}")
        self.cp_size = cp_size
        self.num_tokens = 0
        self.page_size: int | None = None
        self._local = np.zeros((0,), dtype=np.int32)

    @classmethod
    def from_prefix(
        cls, cp_size: int, local_pages: Int[np.ndarray, " pages"], num_tokens: int, page_size: int
    ) -> RequestPageTable:
        """A table that starts with already-written pages (e.g. a cached prefix).

        `local_pages[p]` is the page on lane `p % cp_size`; the caller keeps whatever
        ownership those pages have (a prefix cache's pages stay the cache's).
        """
        table = cls(cp_size)
        if pages_for_tokens(num_tokens, page_size) != len(local_pages):
            raise ValueError(
                f"{num_tokens} tokens need {pages_for_tokens(num_tokens, page_size)} pages "
                f"of {page_size}, got {len(local_pages)}"
            )
        table._local = np.asarray(local_pages, dtype=np.int32).copy()
        table.num_tokens = num_tokens
        table.page_size = page_size if num_tokens else None
        return table

    def detach(self) -> Int[np.ndarray, " pages"]:
        """Empty the table *without* freeing: returns its pages, whose new owner (e.g. the
        prefix cache) is now responsible for them."""
        pages = self._local
        self._local = np.zeros((0,), dtype=np.int32)
        self.num_tokens = 0
        self.page_size = None
        return pages

    @property
    def num_pages(self) -> int:
        """Logical pages held (a partially filled tail page counts)."""
        return int(self._local.size)

    def extend(
        self, allocator: OwnerLaneAllocator, new_num_tokens: int, page_size: int
    ) -> Int[np.ndarray, " new"]:
        """Grow the request to `new_num_tokens` tokens in total (not a delta).

        Allocates pages only for logical positions not held yet; a chunk that fits in
        the partially filled tail page allocates nothing. Returns the newly allocated
        logical page positions (int64, ascending). All-or-nothing: on
        `CacheCapacityError` the table and the allocator are unchanged.
        """
        if allocator.cp_size != self.cp_size:
            raise ValueError(
                f"allocator has cp_size={allocator.cp_size} but this table {self.cp_size}"
            )
        if self.page_size is not None and page_size != self.page_size:
            raise ValueError(f"page_size changed from {self.page_size} to {page_size}")
        if page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {page_size}")
        if new_num_tokens < self.num_tokens:
            raise ValueError(
                f"extend cannot shrink a request: it holds {self.num_tokens} tokens, "
                f"asked for {new_num_tokens}"
            )
        new_pages = np.arange(
            self.num_pages, pages_for_tokens(new_num_tokens, page_size), dtype=np.int64
        )
        local = allocator.allocate(new_pages)
        self._local = np.concatenate([self._local, local])
        self.num_tokens = new_num_tokens
        self.page_size = page_size
        return new_pages

    def truncate(self, allocator: OwnerLaneAllocator, num_tokens: int) -> None:
        """Shrink the request back to `num_tokens` tokens (an `extend` undone): the pages
        past `pages_for_tokens(num_tokens)` go back to their owner lanes."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"truncate to {num_tokens} tokens of {self.num_tokens} held")
        keep = 0 if num_tokens == 0 else pages_for_tokens(num_tokens, self.page_size or 1)
        if keep < self.num_pages:
            gone = np.arange(keep, self.num_pages)
            allocator.free(owner_of_page(gone, self.cp_size), self._local[keep:])
            self._local = self._local[:keep].copy()
        self.num_tokens = num_tokens
        if num_tokens == 0:
            self.page_size = None

    def owners(self) -> Int[np.ndarray, " pages"]:
        """Owner lane of every logical page, `[num_pages]` int32."""
        return owner_of_page(np.arange(self.num_pages, dtype=np.int32), self.cp_size)

    def local_pages(self) -> Int[np.ndarray, " pages"]:
        """Local physical page of every logical page, `[num_pages]` int32 (a copy)."""
        return self._local.copy()

    def lane_pages(self, lane: int) -> Int[np.ndarray, " owned"]:
        """Local physical pages `lane` holds for this request, in local-index order."""
        if not 0 <= lane < self.cp_size:
            raise ValueError(f"lane {lane} is outside [0, cp_size={self.cp_size})")
        return self._local[lane :: self.cp_size].copy()

    def as_row(self, width: int) -> Int[np.ndarray, " width"]:
        """Page-table row `[width]` int32: local page ids by logical page, then trash (0).

        Entry `p` is a page of lane `p mod cp_size`; a rank must only dereference the
        entries it owns. `width` is typically a multiple of `cp_size`.
        """
        return padded_page_table(self._local, width)

    def release(self, allocator: OwnerLaneAllocator) -> None:
        """Free every page back to its owner lane and empty the table."""
        if self.num_pages:
            allocator.free(self.owners(), self._local)
        self._local = np.zeros((0,), dtype=np.int32)
        self.num_tokens = 0
        self.page_size = None
