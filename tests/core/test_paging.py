"""Host-side page arithmetic and the single-lane allocator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpkv_jax.errors import CacheCapacityError
from cpkv_jax.paging import (
    TRASH_PAGE,
    PageAllocator,
    padded_page_table,
    pages_for_tokens,
    slots_for_positions,
)


@pytest.mark.parametrize(("n", "p", "want"), [(1, 64, 1), (63, 64, 1), (64, 64, 1), (65, 64, 2)])
def test_pages_for_tokens_counts_partial_tail(n, p, want):
    assert pages_for_tokens(n, p) == want


def test_slots_follow_page_table():
    row = np.array([5, 2, 9], np.int32)
    slots = slots_for_positions(row, np.array([0, 3, 4, 11]), 4)
    np.testing.assert_array_equal(slots, [20, 23, 8, 39])


def test_padded_table_points_unused_entries_at_trash():
    row = padded_page_table(np.array([3, 4]), 5)
    np.testing.assert_array_equal(row, [3, 4, TRASH_PAGE, TRASH_PAGE, TRASH_PAGE])


def test_allocator_never_hands_out_trash_and_reports_capacity():
    alloc = PageAllocator(4)
    pages = alloc.alloc(3)
    assert TRASH_PAGE not in pages and alloc.num_free == 0
    with pytest.raises(CacheCapacityError, match="need 1 KV pages but only 0"):
        alloc.alloc(1)
    alloc.free(pages[:1])
    assert alloc.num_free == 1
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages[:1])


@given(st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=30))
def test_allocator_conserves_pages(requests):
    alloc = PageAllocator(17)
    held: list[np.ndarray] = []
    for i, n in enumerate(requests):
        if i % 3 == 2 and held:
            alloc.free(held.pop(0))
        elif n <= alloc.num_free:
            held.append(alloc.alloc(n))
        everything = np.concatenate([*held, np.zeros(0, np.int32)])
        assert len(set(everything.tolist())) == len(everything)
        assert alloc.num_free + len(everything) == 16
