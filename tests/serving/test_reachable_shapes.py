"""`serving.decode.steps.reachable_shapes` (issue 25): the step shapes a `DecodeEngine`
can dispatch, enumerated from its limits, equal a brute force over every request a
client could send (prefill) and every set of running reservations that fits the pool
(decode), for random small limits. `cpkv_jax.buckets.reachable_step_shapes` with a pool
(issue 26): the padded CP prefill batches equal a brute force over every batch of rows
whose pages fit the pool together."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cpkv_jax.buckets import pow2_at_least, prefill_bucket, reachable_step_shapes, step_shape
from cpkv_jax.paging import pages_for_tokens
from serving.decode.steps import reachable_shapes


def brute(page: int, context: int, usable: int, running: int, room: int = 0) -> set:
    out = set()
    sizes = set()  # pages of one reservation
    for n in range(1, context):
        for total in range(n + 1, context + 1):
            pages = pages_for_tokens(total + room, page)
            if pages <= usable:
                sizes.add(pages)
                out.add(("absorbed", 1, prefill_bucket(n), pow2_at_least(pages)))
    for k in range(1, running + 1):
        for combo in itertools.combinations_with_replacement(sizes, k):
            if sum(combo) <= usable:
                out.add(("absorbed", pow2_at_least(k), 1, pow2_at_least(max(combo))))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_enumeration_equals_brute_force(seed):
    """Half the cases with a speculative engine's page room beyond prompt + new tokens
    (`speculative_room`: 2K + 1, + K + 1 with overlap)."""
    rng = np.random.default_rng(seed)
    page = int(rng.choice([4, 8, 16]))
    context = int(rng.integers(2, 90))
    usable = int(rng.integers(1, 12))
    running = int(rng.integers(1, 6))
    room = 0 if seed % 2 else int(rng.integers(3, 30))
    got = reachable_shapes(
        prefill_form="absorbed",
        page_size=page,
        context_length=context,
        usable_pages=usable,
        max_running_requests=running,
        room=room,
    )
    case = (page, context, usable, running, room)
    assert got == brute(page, context, usable, running, room), case


def fed_lengths(n: int, page: int, chunk: int | None) -> set[int]:
    """Tokens one prefill step can feed of an `n`-token prompt: from any prefix-cache
    hit (whole pages of all but the last token), in chunks of `chunk` (None: whole)."""
    out = set()
    for start in range(0, n, page):
        if start > n - 1:
            break
        pos = start
        while pos < n:
            end = n if chunk is None else min(n, pos + chunk)
            out.add(end - pos)
            pos = end
    return out


@pytest.mark.parametrize("seed", range(12))
def test_chunked_and_prefix_hit_prefills_equal_brute_force(seed):
    """An engine whose own prefills start after a prefix-cache hit (a DP rank's cache)
    and feed `prefill_chunk` tokens a step at most: every length it feeds, at the
    request's width, is enumerated, and nothing else."""
    rng = np.random.default_rng(100 + seed)
    page = int(rng.choice([4, 8]))
    context = int(rng.integers(2, 70))
    usable = int(rng.integers(1, 12))
    chunk = None if seed % 3 == 0 else page * int(rng.integers(1, 4))
    want = {shape for shape in brute(page, context, usable, 1) if shape[2] == 1}  # decode
    for n in range(1, context):
        for total in range(n + 1, context + 1):
            pages = pages_for_tokens(total, page)
            if pages <= usable:
                for t in fed_lengths(n, page, chunk):
                    want.add(("absorbed", 1, prefill_bucket(t), pow2_at_least(pages)))
    got = reachable_shapes(
        prefill_form="absorbed",
        page_size=page,
        context_length=context,
        usable_pages=usable,
        max_running_requests=1,
        prefill_chunk=chunk,
    )
    assert got == want, (page, context, usable, chunk)


def cp_brute(cp, page, max_extend, longest, max_rows, pool) -> set:
    """Every padded step of k <= max_rows rows (e, j): 1 <= e <= max_extend extend
    tokens over j whole pages, e + j * page <= longest, holding max(j) + sum(pages(e))
    pages (rows may share one prefix) <= pool."""
    rows = [
        (e, j)
        for e in range(1, min(max_extend, longest) + 1)
        for j in range((longest - e) // page + 1)
    ]
    out = set()

    def grow(start, k, max_e, max_kv, max_j, own):
        out.add(step_shape(k, max_e, max_kv, cp, page))
        if k == max_rows:
            return
        for i in range(start, len(rows)):
            e, j = rows[i]
            cost = max(max_j, j) + own + pages_for_tokens(e, page)
            if cost <= pool:
                grow(
                    i,
                    k + 1,
                    max(max_e, e),
                    max(max_kv, e + j * page),
                    max(max_j, j),
                    cost - max(max_j, j),
                )

    for i, (e, j) in enumerate(rows):
        if j + pages_for_tokens(e, page) <= pool:
            grow(i, 1, e, e + j * page, j, pages_for_tokens(e, page))
    return out


@pytest.mark.parametrize("seed", range(24))
def test_cp_step_enumeration_equals_brute_force_for_small_pools(seed):
    """`buckets.reachable_step_shapes` with a pool: batches whose fewest rows cannot sit
    beside their widest row in the pool are left out, and nothing else is."""
    rng = np.random.default_rng(100 + seed)
    cp = int(rng.choice([1, 2, 4]))
    page = int(rng.choice([2, 4]))
    pool = int(rng.integers(1, 9))
    longest = int(rng.integers(1, pool * page + 1))  # what the pool can hold
    max_extend = int(rng.integers(1, longest + 1))
    max_rows = int(rng.integers(1, 6))
    got = reachable_step_shapes(
        cp_size=cp,
        page_size=page,
        max_extend_tokens=max_extend,
        longest_tokens=longest,
        max_rows=max_rows,
        pool_pages=pool,
    )
    assert got == cp_brute(cp, page, max_extend, longest, max_rows, pool), (
        cp,
        page,
        max_extend,
        longest,
        max_rows,
        pool,
    )
