"""Where a decode engine puts a request's pages, and what it may admit: the one seam
between `DecodeEngine`'s admission and page accounting and the kind of mesh it runs on.

- `RankPlacement` (one device, or a `("dp",)` mesh): all of a request's pages on one
  rank, chosen by `decode_mesh.choose_rank` (most free pages, then fewest rows, then
  round robin; with a prefix cache per rank, `choose_rank_for_prefix`: the rank caching
  the longest prefix first); free pages and usable pages are per rank; step shapes run
  as bucketed.
- `StripedPlacement` (a CP group, issue 40): the group is one rank whose pages are
  striped by owner, logical page `p` on lane `p % cp` (global page ids, as a DP pool's
  shards); a request is admitted when every lane has its share, free pages are the
  lanes' sum, and plain step shapes run raised to the CP step's rows and width
  (`steps.cp_bucket`; speculative shapes already count rows per CP rank). DP groups of
  CP ranks: each group is an admission rank over its own lanes, chosen as
  `choose_rank` chooses among those whose every lane has its share.

Both are pure host bookkeeping over the engine's `KVStore`: no device work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cpkv_jax.cp_decode import CPDecoder
from cpkv_jax.decode_mesh import choose_rank, choose_rank_for_prefix
from cpkv_jax.kv_store import KVStore
from serving.decode.steps import Shape, cp_bucket


class RankPlacement:
    """A request's pages on one of `ranks` pool shards (see the module docstring)."""

    def __init__(self, ranks: int, pool_pages: int):
        self.ranks = ranks
        self.usable_pages = pool_pages // ranks - 1  # per rank, less its trash page

    def free_pages(self, free_per_shard: Sequence[int]) -> tuple[int, ...]:
        """Free pages per admission rank."""
        return tuple(free_per_shard)

    def choose(
        self,
        free_per_shard: Sequence[int],
        rows_per_rank: Sequence[int],
        n_pages: int,
        max_rows_per_rank: int,
        first: int,
        cached: Sequence[int] | None = None,
        host: Sequence[int] | None = None,
    ) -> int | None:
        """The rank a request of `n_pages` pages is admitted to now, or None. `cached`:
        with a prefix cache per rank, the leading pages of it each rank caches (then
        `free_per_shard` counts what each rank can give beyond them); `host`: the pages
        after those each rank's host cache holds."""
        if cached is not None:
            return choose_rank_for_prefix(
                free_per_shard, cached, rows_per_rank, n_pages, max_rows_per_rank, first,
                host_pages=host,
            )  # fmt: skip
        return choose_rank(free_per_shard, rows_per_rank, n_pages, max_rows_per_rank, first)

    def allocate(self, kv: KVStore, n_pages: int, rank: int) -> np.ndarray:
        """The request's global page ids, in logical order, all or nothing."""
        return kv.allocate_pages(n_pages, rank)

    def as_run(self, shapes: set[Shape]) -> set[Shape]:
        """The step shapes `shapes` run as."""
        return shapes


class StripedPlacement:
    """A CP group's pages, striped by owner over its lanes; with `groups` DP groups of CP
    ranks, each group an admission rank over its own `cp` lanes (see the module
    docstring)."""

    def __init__(self, cp: int, usable_pages: int, bucketed: bool = True, groups: int = 1):
        """`usable_pages`: one group's lanes', less their trash pages. `bucketed`: the
        engine's shapes run raised to the CP step's rows and width (plain CP decode
        steps); a speculative engine's shapes count rows per CP rank already and run as
        they are."""
        self.cp = cp
        self.usable_pages = usable_pages
        self.bucketed = bucketed
        self.ranks = groups

    @classmethod
    def of(cls, decoder: CPDecoder, bucketed: bool = True) -> StripedPlacement:
        """The placement of `decoder`'s group(s): their lanes' usable pages."""
        cp = decoder.runner.cp.cp_size
        return cls(cp, cp * decoder.usable_pages_per_lane, bucketed, decoder.groups)

    def striped(self, n_pages: int) -> np.ndarray:
        """Pages each lane of a group gives a request of `n_pages` pages, `[cp]`."""
        return np.bincount(np.arange(n_pages) % self.cp, minlength=self.cp)

    def free_pages(self, free_per_shard: Sequence[int]) -> tuple[int, ...]:
        """Free pages per group (the sum of its lanes'; a store may count them per group
        already, as the unified CP runner's does)."""
        if len(free_per_shard) == self.ranks:
            return tuple(free_per_shard)
        free = np.asarray(free_per_shard).reshape(self.ranks, self.cp)
        return tuple(int(n) for n in free.sum(axis=1))

    def choose(
        self,
        free_per_shard: Sequence[int],
        rows_per_rank: Sequence[int],
        n_pages: int,
        max_rows_per_rank: int,
        first: int,
        cached: Sequence[int] | None = None,
        host: Sequence[int] | None = None,
    ) -> int | None:
        """The group whose every lane has its share of `n_pages` free, with a row free:
        most free pages, then fewest rows, then round robin (`choose_rank`); None when
        none can take it now. A CP group's prefix cache is its runner's scheduler's:
        `cached` and `host` are never given."""
        assert cached is None and host is None, "a CP group admits through its scheduler"
        if len(free_per_shard) == self.ranks:  # counted per group: its total must cover it
            totals = [f if f >= n_pages else -1 for f in free_per_shard]
        else:
            free = np.asarray(free_per_shard).reshape(self.ranks, self.cp)
            fits = (free >= self.striped(n_pages)).all(axis=1)
            totals = [int(f.sum()) if ok else -1 for f, ok in zip(free, fits, strict=True)]
        return choose_rank(totals, rows_per_rank, 0, max_rows_per_rank, first)

    def allocate(self, kv: KVStore, n_pages: int, rank: int) -> np.ndarray:
        """Global page ids for logical pages `[0, n_pages)`, page `p` from group `rank`'s
        lane `p % cp` shard; all or nothing."""
        taken: list[np.ndarray] = []
        try:
            for lane, n in enumerate(self.striped(n_pages)):
                taken.append(kv.allocate_pages(int(n), rank * self.cp + lane))
        except Exception:
            for pages in taken:
                kv.free_pages(pages)
            raise
        out = np.empty(n_pages, np.int64)
        for lane, pages in enumerate(taken):
            out[lane :: self.cp] = pages
        return out

    def as_run(self, shapes: set[Shape]) -> set[Shape]:
        return {cp_bucket(s, self.cp) for s in shapes} if self.bucketed else set(shapes)
