"""Page ownership (SPEC S1.1-S1.3), whole-page index validation (SPEC S3.1) and the
owner-lane allocator with its per-request page tables."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from cpkv_jax.errors import CacheCapacityError, ConfigError, CpkvError
from cpkv_jax.lane_allocator import OwnerLaneAllocator, RequestPageTable
from cpkv_jax.paging import (
    TRASH_PAGE,
    PageAlignmentError,
    local_index_of_page,
    owned_pages,
    owner_of_page,
    page_ids_of_token_indices,
    validate_page_aligned_token_indices,
)


def _whole_pages(page_ids, page_size):
    """Token indices of `page_ids` (caller order), each page whole."""
    page_ids = np.asarray(page_ids, dtype=np.int64)
    return (page_ids[:, None] * page_size + np.arange(page_size)).reshape(-1)


# --- ownership formulas ---------------------------------------------------------------


def test_owner_and_local_index_formulas():
    p = np.arange(10)
    np.testing.assert_array_equal(owner_of_page(p, 4), [0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    np.testing.assert_array_equal(local_index_of_page(p, 4), [0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    assert owner_of_page(7, 3) == 1 and local_index_of_page(7, 3) == 2
    assert owner_of_page(np.int64(9), 8) == 1
    np.testing.assert_array_equal(owner_of_page(p, 1), np.zeros(10))


@given(n_pages=st.integers(0, 200), cp_size=st.integers(1, 9))
def test_owned_pages_partition_pages_exactly(n_pages, cp_size):
    per_rank = [owned_pages(n_pages, r, cp_size) for r in range(cp_size)]
    everything = np.concatenate(per_rank)
    np.testing.assert_array_equal(np.sort(everything), np.arange(n_pages))
    for r, pages in enumerate(per_rank):
        assert (owner_of_page(pages, cp_size) == r).all()
        # Entry i is the page with local index i.
        np.testing.assert_array_equal(local_index_of_page(pages, cp_size), np.arange(len(pages)))


def test_owned_pages_rejects_a_rank_outside_the_axis():
    with pytest.raises(ConfigError, match="rank 4 is outside"):
        owned_pages(10, 4, 4)


# --- whole-page index validation ------------------------------------------------------


def test_validation_accepts_whole_pages_in_caller_order():
    # Pages 3, 0, 7, 3: any order and repeats; each group is a whole, aligned page.
    idx = _whole_pages([3, 0, 7, 3], 4)
    validate_page_aligned_token_indices(idx, 4)
    validate_page_aligned_token_indices(idx.astype(np.int32), 4)
    validate_page_aligned_token_indices(list(range(8)), 4)
    validate_page_aligned_token_indices(np.zeros(0, np.int64), 4)
    validate_page_aligned_token_indices(np.array([5, 2, 9]), 1)
    np.testing.assert_array_equal(page_ids_of_token_indices(idx, 4), [3, 0, 7, 3])


def test_validation_errors_are_typed():
    assert issubclass(PageAlignmentError, CpkvError)
    assert issubclass(PageAlignmentError, ValueError)


def test_validation_rejects_a_partial_page():
    idx = np.concatenate([_whole_pages([0, 1], 4), [8, 9]])
    with pytest.raises(PageAlignmentError, match=r"page group 2 .*is partial: 2 of page_size=4"):
        validate_page_aligned_token_indices(idx, 4)


def test_validation_rejects_a_misaligned_start():
    idx = np.concatenate([_whole_pages([5], 4), np.arange(2, 6)])
    with pytest.raises(
        PageAlignmentError, match=r"page group 1 .*misaligned start 2.*\[2, 3, 4, 5\]"
    ):
        validate_page_aligned_token_indices(idx, 4)


def test_validation_rejects_a_negative_start():
    with pytest.raises(PageAlignmentError, match=r"page group 0 .*misaligned start -4"):
        validate_page_aligned_token_indices(np.arange(-4, 0), 4)


def test_validation_rejects_a_non_contiguous_group():
    idx = np.concatenate([_whole_pages([1, 2], 4), [12, 13, 15, 14]])
    with pytest.raises(
        PageAlignmentError, match=r"page group 2 .*non-contiguous: its entry 2 is 15.*has 14"
    ):
        validate_page_aligned_token_indices(idx, 4)


def test_validation_rejects_non_integers():
    with pytest.raises(PageAlignmentError, match="must be integers, got dtype float64"):
        validate_page_aligned_token_indices(np.arange(4.0), 4)


def test_validation_rejects_a_2d_array():
    with pytest.raises(PageAlignmentError, match=r"must be a 1-D array, got shape \(2, 4\)"):
        validate_page_aligned_token_indices(np.arange(8).reshape(2, 4), 4)


@given(
    page_ids=st.lists(st.integers(0, 50), max_size=12),
    page_size=st.integers(2, 8),  # with page_size 1 every non-negative index is a page
    bad_entry=st.integers(0, 10_000),
    delta=st.sampled_from([-1, 1, 3]),
)
def test_validation_names_the_first_broken_group(page_ids, page_size, bad_entry, delta):
    idx = _whole_pages(page_ids, page_size)
    validate_page_aligned_token_indices(idx, page_size)
    if idx.size == 0:
        return
    i = bad_entry % idx.size
    idx[i] += delta
    with pytest.raises(PageAlignmentError, match=rf"page group {i // page_size} "):
        validate_page_aligned_token_indices(idx, page_size)


# --- owner-lane allocator -------------------------------------------------------------


def test_allocator_places_pages_in_owner_lanes_lowest_first():
    alloc = OwnerLaneAllocator(cp_size=4, pages_per_lane=5)
    local = alloc.allocate(np.arange(6))
    # Lanes 0 and 1 give pages 1, 2; lanes 2 and 3 give page 1.
    np.testing.assert_array_equal(local, [1, 1, 1, 1, 2, 2])
    np.testing.assert_array_equal(alloc.num_free_per_lane(), [2, 2, 3, 3])
    assert alloc.num_free(2) == 3 and alloc.can_allocate(np.array([2, 6, 10]))
    assert not alloc.can_allocate(np.array([0, 4, 8]))


def test_allocator_capacity_error_names_the_lane_and_allocates_nothing():
    alloc = OwnerLaneAllocator(cp_size=2, pages_per_lane=3)
    alloc.allocate(np.array([1, 3]))
    before = alloc.allocated_mask()
    with pytest.raises(CacheCapacityError, match="lane 1 needs 1 but has 0 free"):
        alloc.allocate(np.array([0, 5]))
    np.testing.assert_array_equal(alloc.allocated_mask(), before)
    np.testing.assert_array_equal(alloc.num_free_per_lane(), [2, 0])


def test_allocator_free_rejects_trash_double_and_foreign_pages_without_freeing():
    alloc = OwnerLaneAllocator(cp_size=2, pages_per_lane=4)
    local = alloc.allocate(np.arange(4))
    lanes = np.array([0, 1, 0, 1])
    with pytest.raises(ValueError, match="lane 1: the trash page 0"):
        alloc.free(np.array([0, 1]), np.array([1, TRASH_PAGE]))
    with pytest.raises(ValueError, match="lane 0 page 7 is outside"):
        alloc.free(np.array([0]), np.array([7]))
    with pytest.raises(ValueError, match="lane 2 is outside"):
        alloc.free(np.array([2]), np.array([1]))
    with pytest.raises(ValueError, match="double free: lane 0 page 1 is given more than once"):
        alloc.free(np.array([0, 0]), np.array([1, 1]))
    with pytest.raises(ValueError, match="lane 0 page 3 is not allocated"):
        alloc.free(np.array([1, 0]), np.array([1, 3]))
    np.testing.assert_array_equal(alloc.num_free_per_lane(), [1, 1])
    alloc.free(lanes, local)
    np.testing.assert_array_equal(alloc.num_free_per_lane(), [3, 3])
    with pytest.raises(ValueError, match="double free or foreign page: lane 0 page 1"):
        alloc.free(lanes[:1], local[:1])


def test_allocator_rejects_pools_without_a_usable_page():
    with pytest.raises(ConfigError, match="pages_per_lane=1"):
        OwnerLaneAllocator(cp_size=2, pages_per_lane=1)


def test_single_lane_is_a_degenerate_pool():
    alloc = OwnerLaneAllocator(cp_size=1, pages_per_lane=4)
    table = RequestPageTable(cp_size=1)
    table.extend(alloc, 10, 4)
    np.testing.assert_array_equal(table.local_pages(), [1, 2, 3])
    np.testing.assert_array_equal(table.owners(), [0, 0, 0])
    with pytest.raises(CacheCapacityError, match="lane 0 needs 1 but has 0 free"):
        table.extend(alloc, 13, 4)
    table.release(alloc)
    assert alloc.num_free(0) == 3 and table.num_pages == 0


def test_request_table_rows_and_lane_views():
    alloc = OwnerLaneAllocator(cp_size=2, pages_per_lane=8)
    table = RequestPageTable(cp_size=2)
    new = table.extend(alloc, 5, 2)  # 3 pages
    np.testing.assert_array_equal(new, [0, 1, 2])
    assert table.extend(alloc, 6, 2).size == 0  # fills the tail page only
    np.testing.assert_array_equal(table.extend(alloc, 7, 2), [3])
    np.testing.assert_array_equal(table.owners(), [0, 1, 0, 1])
    np.testing.assert_array_equal(table.local_pages(), [1, 1, 2, 2])
    np.testing.assert_array_equal(table.lane_pages(1), [1, 2])
    row = table.as_row(6)
    assert row.dtype == np.int32
    np.testing.assert_array_equal(row, [1, 1, 2, 2, TRASH_PAGE, TRASH_PAGE])
    with pytest.raises(ConfigError, match="4 pages but the page table holds 2"):
        table.as_row(2)
    with pytest.raises(ValueError, match="cannot shrink"):
        table.extend(alloc, 3, 2)
    with pytest.raises(ValueError, match="page_size changed"):
        table.extend(alloc, 9, 4)


# --- properties -----------------------------------------------------------------------


def _check_invariants(alloc: OwnerLaneAllocator, tables: list[RequestPageTable]) -> None:
    mask = alloc.allocated_mask()
    assert not mask[:, TRASH_PAGE].any(), "a trash page was handed out"
    held = np.zeros_like(mask)
    for table in tables:
        owners, local = table.owners(), table.local_pages()
        np.testing.assert_array_equal(owners, np.arange(table.num_pages) % alloc.cp_size)
        assert not held[owners, local].any(), "a page was handed out twice"
        assert len(set(zip(owners.tolist(), local.tolist(), strict=True))) == len(owners)
        held[owners, local] = True
    # Everything allocated belongs to exactly one live request, and nothing else is.
    np.testing.assert_array_equal(held, mask)
    np.testing.assert_array_equal(
        alloc.num_free_per_lane() + mask.sum(axis=1),
        np.full(alloc.cp_size, alloc.capacity_per_lane),
    )


_ops = st.lists(
    st.tuples(
        st.sampled_from(["extend", "extend", "release"]), st.integers(0, 3), st.integers(0, 40)
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(
    cp_size=st.integers(1, 5),
    pages_per_lane=st.integers(2, 12),
    page_size=st.integers(1, 4),
    ops=_ops,
)
def test_allocator_invariants_over_random_extend_and_release(
    cp_size, pages_per_lane, page_size, ops
):
    alloc = OwnerLaneAllocator(cp_size, pages_per_lane)
    tables = [RequestPageTable(cp_size) for _ in range(4)]
    for kind, req, chunk in ops:
        table = tables[req]
        if kind == "release":
            table.release(alloc)
        else:
            target = table.num_tokens + chunk
            need = alloc.pages_needed_per_lane(
                np.arange(table.num_pages, -(-target // page_size), dtype=np.int64)
            )
            before_mask, before_local = alloc.allocated_mask(), table.local_pages()
            if (need <= alloc.num_free_per_lane()).all():
                new = table.extend(alloc, target, page_size)
                assert table.num_tokens == target
                assert (owner_of_page(new, cp_size) == table.owners()[new]).all()
            else:
                event("extend refused: an owner lane is short")
                with pytest.raises(CacheCapacityError, match="owner lane"):
                    table.extend(alloc, target, page_size)
                # All or nothing: neither the allocator nor the table moved.
                np.testing.assert_array_equal(alloc.allocated_mask(), before_mask)
                np.testing.assert_array_equal(table.local_pages(), before_local)
        _check_invariants(alloc, tables)
    for table in tables:
        table.release(alloc)
    np.testing.assert_array_equal(alloc.num_free_per_lane(), alloc.capacity_per_lane)


@settings(max_examples=150, deadline=None)
@given(
    cp_size=st.integers(1, 8),
    page_size=st.integers(1, 8),
    chunks=st.lists(st.integers(0, 30), min_size=1, max_size=10),
)
def test_ownership_does_not_depend_on_chunking(cp_size, page_size, chunks):
    total = sum(chunks)
    pages_per_lane = total // cp_size + 2
    one_shot_alloc = OwnerLaneAllocator(cp_size, pages_per_lane)
    one_shot = RequestPageTable(cp_size)
    one_shot.extend(one_shot_alloc, total, page_size)

    chunked_alloc = OwnerLaneAllocator(cp_size, pages_per_lane)
    chunked = RequestPageTable(cp_size)
    n = 0
    for c in chunks:
        n += c
        chunked.extend(chunked_alloc, n, page_size)

    assert chunked.num_pages == one_shot.num_pages == -(-total // page_size)
    np.testing.assert_array_equal(chunked.owners(), one_shot.owners())
    # On fresh lanes even the physical pages agree: local page = local index + 1.
    np.testing.assert_array_equal(chunked.local_pages(), one_shot.local_pages())
    np.testing.assert_array_equal(
        one_shot.local_pages(), local_index_of_page(np.arange(one_shot.num_pages), cp_size) + 1
    )
    np.testing.assert_array_equal(
        chunked_alloc.num_free_per_lane(), one_shot_alloc.num_free_per_lane()
    )
