"""`buckets.reachable_step_shapes` (issue 25): the CP prefill step shapes a server can
reach, against a brute force over every (extend, KV length) a request can have."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cpkv_jax.buckets import reachable_step_shapes, step_shape


def one_row_brute_force(cp, page, max_extend, longest):
    """Every (e, k = e + j * page) with 1 <= e <= max_extend, k <= longest."""
    out = set()
    for e in range(1, min(max_extend, longest) + 1):
        for k in range(e, longest + 1, page):
            out.add(step_shape(1, e, k, cp, page))
    return out


CASES = [  # (cp, page, max_extend, longest)
    (1, 4, 200, 200),  # unchunked, single device
    (2, 4, 24, 150),  # chunked
    (8, 16, 64, 533),  # the tiny CP8 server's shape family
    (4, 8, 1000, 97),  # a chunk larger than the context
    (8, 4, 5, 5),  # a context shorter than one zigzag block set
]


@pytest.mark.parametrize(("cp", "page", "max_extend", "longest"), CASES)
def test_one_row_equals_brute_force(cp, page, max_extend, longest):
    got = reachable_step_shapes(
        cp_size=cp, page_size=page, max_extend_tokens=max_extend, longest_tokens=longest, max_rows=1
    )
    assert got == one_row_brute_force(cp, page, max_extend, longest)


@pytest.mark.parametrize(("cp", "page", "max_extend", "longest"), CASES[:3])
def test_batches_stay_inside_the_enumeration(cp, page, max_extend, longest):
    """Random batches of up to 5 rows (each a reachable row) pad into the enumerated set;
    with `max_rows=5` the one-row shapes are still all there."""
    shapes = reachable_step_shapes(
        cp_size=cp, page_size=page, max_extend_tokens=max_extend, longest_tokens=longest, max_rows=5
    )
    assert one_row_brute_force(cp, page, max_extend, longest) <= shapes
    rows = [
        (e, k) for e in range(1, min(max_extend, longest) + 1) for k in range(e, longest + 1, page)
    ]
    rng = np.random.default_rng(0)
    for n, _ in itertools.product(range(2, 6), range(400)):
        batch = [rows[i] for i in rng.integers(0, len(rows), n)]
        got = step_shape(n, max(e for e, _ in batch), max(k for _, k in batch), cp, page)
        assert got in shapes, (batch, got)
    assert {s.rows for s in shapes} == {1, 2, 4, 8}
