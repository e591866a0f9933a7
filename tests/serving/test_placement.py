"""`serving.decode.placement`: where a decode engine puts a request's pages (host
bookkeeping over a small store; the engines that use it are served in
`test_unified_cp.py`, `test_pd_cp_decode.py` and the DP decode tests)."""

from __future__ import annotations

import numpy as np
import pytest

from cpkv_jax.config import ModelConfig
from cpkv_jax.kv_store import PagedKVStore
from cpkv_jax.model.kv_cache import init_pool
from cpkv_jax.paging import CacheCapacityError, PageAllocator
from cpkv_jax.tools.tiny_config import tiny_config_dict
from serving.decode.placement import RankPlacement, StripedPlacement

CP, PER_LANE = 4, 6  # 4 lanes of 6 pages: each lane's first is its trash page


def striped(cp: int = CP, bucketed: bool = True) -> StripedPlacement:
    """A `StripedPlacement` over `cp` lanes of `PER_LANE` pages."""
    return StripedPlacement(cp, cp * (PER_LANE - 1), bucketed)


def store(ranks: int = CP) -> PagedKVStore:
    """`ranks` shards of `PER_LANE` pages of the tiny model's pool (2 tokens a page)."""
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    pool = init_pool(cfg, ranks * PER_LANE, 2, np.float32, "fp8_e4m3")
    return PagedKVStore(pool, PageAllocator(ranks * PER_LANE, ranks=ranks))


def test_striped_pages_live_on_their_owner_lane():
    """Logical page p comes from lane p % cp's shard, in logical order; a CP group is one
    admission rank whose free pages are its lanes' sum."""
    kv, placement = store(), striped()
    assert placement.choose(kv.num_free_pages_per_rank, (0,), 9, 8, 0) == 0
    pages = placement.allocate(kv, 9, 0)
    assert [int(p) // PER_LANE for p in pages] == [p % CP for p in range(9)]
    assert len(set(pages.tolist())) == 9 and all(int(p) % PER_LANE for p in pages)  # no trash
    assert kv.num_free_pages_per_rank == (2, 3, 3, 3)
    assert placement.free_pages(kv.num_free_pages_per_rank) == (11,)


def test_striped_admission_is_all_or_nothing():
    """A request is admitted only when every lane has its share: a short lane refuses it
    whatever the other lanes hold, and an allocation that fails on a later lane gives back
    what the earlier lanes gave (mutation-checked: without the rollback lane 0 leaks)."""
    kv, placement = store(), striped()
    kv.allocate_pages(PER_LANE - 2, 1)  # lane 1 keeps 1 free page
    free = kv.num_free_pages_per_rank
    assert free == (5, 1, 5, 5) and sum(free) >= 6
    assert placement.choose(free, (0,), 6, 8, 0) is None  # lane 1 would need 2
    assert placement.choose(free, (0,), 5, 8, 0) == 0  # (2, 1, 1, 1)
    with pytest.raises(CacheCapacityError):
        placement.allocate(kv, 6, 0)
    assert kv.num_free_pages_per_rank == free


def test_striped_shapes_run_at_the_cp_step_s_rows_and_width():
    shapes = {("absorbed", 1, 1, 2), ("absorbed", 8, 1, 16)}
    assert striped().as_run(shapes) == {("absorbed", 4, 1, 4), ("absorbed", 8, 1, 16)}
    # A speculative engine's shapes count rows per CP rank (its slots): run as they are.
    spec = {("spec_greedy", 1, 3, 4), ("spec_given_greedy", 1, 1, 4)}
    assert striped(bucketed=False).as_run(spec) == spec


def test_rank_placement_keeps_a_request_on_one_rank():
    """One rank's shard holds all of a request's pages; the rank is the one with the most
    free pages (then the fewest rows); shapes run as bucketed."""
    kv, placement = store(2), RankPlacement(2, 2 * PER_LANE)
    assert placement.usable_pages == PER_LANE - 1
    kv.allocate_pages(2, 0)
    rank = placement.choose(kv.num_free_pages_per_rank, (0, 0), 3, 4, 0)
    assert rank == 1
    pages = placement.allocate(kv, 3, rank)
    assert {int(p) // PER_LANE for p in pages} == {1}
    assert placement.choose(kv.num_free_pages_per_rank, (0, 4), 3, 4, 0) == 0  # rank 1 full
    assert placement.free_pages(kv.num_free_pages_per_rank) == (3, 2)
    shapes = {("absorbed", 2, 1, 4)}
    assert placement.as_run(shapes) == shapes


def test_groups_of_cp_ranks_take_a_request_on_one_group_s_lanes():
    """DP groups of CP ranks (issue 40 item 3): two groups of two lanes; a request goes to
    a group whose every lane has its share (most free pages first, then the fewest rows),
    its logical page p on that group's lane p % 2, and free pages count per group."""
    kv, placement = store(4), StripedPlacement(2, 2 * (PER_LANE - 1), groups=2)
    assert placement.ranks == 2 and placement.usable_pages == 2 * (PER_LANE - 1)
    kv.allocate_pages(PER_LANE - 2, 3)  # group 1's second lane keeps 1 free page
    free = kv.num_free_pages_per_rank
    assert placement.free_pages(free) == (10, 6)
    assert placement.choose(free, (0, 0), 3, 4, 1) == 0  # both fit (2, 1): most free
    assert placement.choose(free, (0, 0), 4, 4, 1) == 0  # group 1's lane 3 lacks 1 of (2, 2)
    assert placement.choose(free, (4, 0), 4, 4, 0) is None  # and group 0's rows are full
    assert placement.choose(free, (4, 0), 3, 4, 0) == 1  # (2, 1): group 1 fits
    pages = placement.allocate(kv, 5, 0)
    assert [int(p) // PER_LANE for p in pages] == [0, 1, 0, 1, 0]
    pages = placement.allocate(kv, 2, 1)
    assert [int(p) // PER_LANE for p in pages] == [2, 3]
    assert placement.free_pages(kv.num_free_pages_per_rank) == (5, 4)
