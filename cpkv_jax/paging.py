"""Host-side page arithmetic and the single-lane page allocator (pure numpy, no device).

A request's logical page `p` holds tokens `[p * page_size, (p + 1) * page_size)`. A page
table maps logical pages to physical pages of a pool; unused entries point at the
trash page (physical page 0), which is never handed out.

Page ownership for CP shared KV (SPEC S1.1): logical page `p` is stored only by rank
`owner_of_page(p) = p mod cp_size`, at local order `local_index_of_page(p) = p div cp_size`
among that rank's pages of the request. The per-rank physical allocator is
`cpkv_jax.lane_allocator`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jaxtyping import Int

from cpkv_jax.errors import CacheCapacityError, ConfigError, CpkvError, quote

TRASH_PAGE = 0

# A page position or an array of them; numpy integer scalars come out of array indexing.
PageIndex = int | np.integer | np.ndarray


class PageAlignmentError(CpkvError, ValueError):
    """Token indices handed to a page-granular copy are not a sequence of whole pages."""


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
    """Free lists of one pool's physical pages; page 0 is reserved as the trash page.

    `ranks > 1` (a data-parallel decode pool, `cpkv_jax.decode_mesh`): the pool is split
    into `ranks` equal shards of `num_pages // ranks` pages, each with its own trash page
    (its first) and free list; `alloc(n, rank)` takes all `n` pages from one shard and
    `free` returns pages to the shard they came from.
    """

    def __init__(self, num_pages: int, ranks: int = 1):
        if ranks < 1 or num_pages % ranks:
            raise ConfigError(f"{num_pages} pages do not split into {ranks} equal rank shards")
        per_rank = num_pages // ranks
        if per_rank < 2:
            raise ConfigError(
                f"a pool needs at least 2 pages (1 trash + 1 usable) per rank, got {per_rank}"
            )
        self.num_pages = num_pages
        self.ranks = ranks
        self.pages_per_rank = per_rank
        # Lowest pages first, so small tests get predictable page numbers.
        self._free = [
            list(range((r + 1) * per_rank - 1, r * per_rank + TRASH_PAGE, -1)) for r in range(ranks)
        ]

    @property
    def num_free(self) -> int:
        return sum(len(f) for f in self._free)

    @property
    def num_free_per_rank(self) -> tuple[int, ...]:
        return tuple(len(f) for f in self._free)

    def alloc(self, n: int, rank: int = 0) -> np.ndarray:
        free = self._free[rank]
        if n > len(free):
            where = f" on DP rank {rank}" if self.ranks > 1 else ""
            raise CacheCapacityError(
                f"need {n} KV pages but only {len(free)} of {self.pages_per_rank - 1} are "
                f"free{where}; raise the KV pool size or shorten the request"
            )
        out = [free.pop() for _ in range(n)]
        return np.asarray(out, dtype=np.int32)

    def free(self, pages: np.ndarray) -> None:
        pages = [int(p) for p in np.asarray(pages).reshape(-1)]
        per_rank = self.pages_per_rank
        if any(p % per_rank == TRASH_PAGE and 0 <= p < self.num_pages for p in pages):
            raise ValueError("the trash page is never allocated and cannot be freed")
        in_free = {p for f in self._free for p in f}
        dup = [p for p in pages if p in in_free or not 0 < p < self.num_pages]
        if dup or len(set(pages)) != len(pages):
            raise ValueError(f"double free or foreign page(s): {dup or pages}")
        for p in sorted(pages, reverse=True):
            self._free[p // per_rank].append(p)


def owner_of_page(p: PageIndex, cp_size: int) -> PageIndex:
    """Rank (owner lane) that stores logical page `p`: `p mod cp_size` (SPEC S1.1).

    Works elementwise on numpy arrays. It depends only on the page position, never on
    chunk boundaries or on how tokens were split between ranks for compute.
    """
    return p % cp_size


def local_index_of_page(p: PageIndex, cp_size: int) -> PageIndex:
    """Order of logical page `p` among its owner's pages of the request: `p div cp_size`."""
    return p // cp_size


def owned_pages(n_pages: int, rank: int, cp_size: int) -> Int[np.ndarray, " owned"]:
    """Logical pages among `[0, n_pages)` that `rank` owns, ascending (int64).

    Entry `i` is the page with local index `i`; over all ranks these partition
    `[0, n_pages)` exactly.
    """
    if cp_size < 1:
        raise ConfigError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= rank < cp_size:
        raise ConfigError(f"rank {rank} is outside [0, cp_size={cp_size})")
    if n_pages < 0:
        raise ConfigError(f"n_pages must be >= 0, got {n_pages}")
    return np.arange(rank, n_pages, cp_size, dtype=np.int64)


def validate_page_aligned_token_indices(
    indices: np.ndarray | Sequence[int], page_size: int
) -> None:
    """Accept `indices` only when it is a sequence of whole pages (SPEC S3.1).

    `indices` is a 1-D integer array of token slots (CPU int64 in the host-cache paths).
    Its length is a multiple of `page_size`, and each consecutive group of `page_size`
    entries is one whole page: `s, s + 1, ..., s + page_size - 1` with `s` a non-negative
    multiple of `page_size`. The groups may come in any order (host page indices stay in
    caller order, SPEC S4.2) and may repeat a page; only the shape of each group is
    checked. An empty array is zero whole pages and passes.

    Raises `PageAlignmentError` naming the first bad group, its values and the reason
    (not 1-D, not integers, partial, misaligned start, non-contiguous). Vectorized and
    O(len(indices)); it runs before every page-granular copy (SPEC S3.2).
    """
    if page_size < 1:
        raise ConfigError(f"page_size must be >= 1, got {page_size}")
    fix = "pass complete page spans (page p as tokens p*page_size .. (p+1)*page_size-1)"
    arr = np.asarray(indices)
    if arr.ndim != 1:
        raise PageAlignmentError(
            f"token indices must be a 1-D array, got shape {arr.shape}; flatten them, then {fix}"
        )
    if arr.size == 0:
        return
    if not np.issubdtype(arr.dtype, np.integer):
        raise PageAlignmentError(
            f"token indices must be integers, got dtype {arr.dtype} (first values "
            f"{quote(arr)}); convert them to int64, then {fix}"
        )
    num_groups, tail = divmod(arr.size, page_size)
    if tail:
        raise PageAlignmentError(
            f"page group {num_groups} (index entries {num_groups * page_size}..{arr.size - 1}) "
            f"is partial: {tail} of page_size={page_size} tokens {quote(arr[-tail:])}; "
            f"the index length {arr.size} is not a multiple of {page_size}; {fix}"
        )
    # One signed dtype for the arithmetic; uint64 values past int64 turn negative and fail.
    groups = arr.astype(np.int64, copy=False).reshape(num_groups, page_size)
    starts = groups[:, 0]
    misaligned = (starts % page_size != 0) | (starts < 0)
    offsets_ok = groups - starts[:, None] == np.arange(page_size, dtype=np.int64)
    bad = np.flatnonzero(misaligned | ~offsets_ok.all(axis=1))
    if bad.size == 0:
        return
    g = int(bad[0])
    start = int(starts[g])
    where = f"page group {g} (index entries {g * page_size}..{(g + 1) * page_size - 1})"
    if misaligned[g]:
        why = (
            f"has a misaligned start {start}, which is not a non-negative multiple of "
            f"page_size={page_size}"
        )
    else:
        k = int(np.flatnonzero(~offsets_ok[g])[0])
        why = (
            f"is non-contiguous: its entry {k} is {int(groups[g, k])} where a whole page "
            f"starting at {start} has {start + k}"
        )
    raise PageAlignmentError(f"{where} {why}: {quote(groups[g])}; {fix}")


def page_ids_of_token_indices(
    indices: np.ndarray | Sequence[int], page_size: int
) -> Int[np.ndarray, " pages"]:
    """Page ids (int64, caller order) of whole-page token indices; validates them first."""
    validate_page_aligned_token_indices(indices, page_size)
    arr = np.asarray(indices)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    return (arr[::page_size] // page_size).astype(np.int64)
