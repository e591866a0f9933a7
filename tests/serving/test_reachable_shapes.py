"""`serving.decode.steps.reachable_shapes` (issue 25): the step shapes a `DecodeEngine`
can dispatch, enumerated from its limits, equal a brute force over every request a
client could send (prefill) and every set of running reservations that fits the pool
(decode), for random small limits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cpkv_jax.buckets import pow2_at_least, prefill_bucket
from cpkv_jax.paging import pages_for_tokens
from serving.decode.steps import reachable_shapes


def brute(page: int, context: int, usable: int, running: int) -> set:
    out = set()
    for n in range(1, context):
        for total in range(n + 1, context + 1):
            pages = pages_for_tokens(total, page)
            if pages <= usable:
                out.add(("expanded", 1, prefill_bucket(n), pow2_at_least(pages)))
    longest = min(context, usable * page)
    sizes = range(1, pages_for_tokens(longest, page) + 1)  # pages of one reservation
    for k in range(1, running + 1):
        for combo in itertools.combinations_with_replacement(sizes, k):
            if sum(combo) <= usable:
                out.add(("absorbed", pow2_at_least(k), 1, pow2_at_least(max(combo))))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_enumeration_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    page = int(rng.choice([4, 8, 16]))
    context = int(rng.integers(2, 90))
    usable = int(rng.integers(1, 12))
    running = int(rng.integers(1, 6))
    got = reachable_shapes(
        prefill_form="expanded",
        page_size=page,
        context_length=context,
        usable_pages=usable,
        max_running_requests=running,
    )
    assert got == brute(page, context, usable, running), (page, context, usable, running)
