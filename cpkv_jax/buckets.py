"""Shape buckets of the CP prefill step (pure Python: the scheduler imports this).

One place decides the padded shapes of a step, so the runner that builds it
(`CPPrefillRunner.plan_step`) and the admission-time buffer estimator agree exactly:
batch rows and the zigzag block length are powers of two, and the page-table width is
`cp` times a power of two. The number of compiled step shapes is bounded by the number
of distinct `StepShape`s.
"""

from __future__ import annotations

import dataclasses
import math

from cpkv_jax.paging import pages_for_tokens


def pow2_at_least(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


MIN_PREFILL_BUCKET = 16  # smallest padded prompt of a one-request prefill


def prefill_bucket(n: int) -> int:
    """Padded token count of an `n`-token prefill: bounds the number of compiled shapes."""
    return pow2_at_least(n, MIN_PREFILL_BUCKET)


def min_block(cp_size: int) -> int:
    """Smallest zigzag block: a step of at least `MIN_PREFILL_BUCKET` tokens, as the plain
    prefill's smallest bucket. A shorter extend pads up to it: below that, each halving
    of the padding is one more program to compile (per width and row bucket) for a step
    that costs the same weight reads either way."""
    return pow2_at_least(-(-MIN_PREFILL_BUCKET // (2 * cp_size)))


def page_table_width(num_pages: int, cp_size: int) -> int:
    """Page-table entries for `num_pages` logical pages: `cp * pow2(ceil(pages / cp))`."""
    return cp_size * pow2_at_least(-(-num_pages // cp_size))


@dataclasses.dataclass(frozen=True)
class StepShape:
    """Bucketed shapes of one CP step, as `CPPrefillRunner.plan_step` builds them."""

    cp_size: int
    page_size: int
    rows: int  # B: batch rows (pow2 of the request count)
    block: int  # zigzag block length (pow2)
    width: int  # W: page-table width in pages (cp * pow2)

    @property
    def tokens_per_rank(self) -> int:
        return 2 * self.block

    @property
    def tokens_per_step(self) -> int:
        return 2 * self.cp_size * self.block

    @property
    def view_tokens(self) -> int:
        """S: tokens of the materialized full view."""
        return self.width * self.page_size

    @property
    def owned_width(self) -> int:
        """Page-table entries each rank owns (and gathers)."""
        return self.width // self.cp_size


def step_shape(
    num_requests: int, max_extend_tokens: int, max_kv_tokens: int, cp_size: int, page_size: int
) -> StepShape:
    """The step shapes `plan_step` picks for a batch with these maxima."""
    block = pow2_at_least(-(-max_extend_tokens // (2 * cp_size)), min_block(cp_size))
    width = page_table_width(pages_for_tokens(max_kv_tokens, page_size), cp_size)
    return StepShape(cp_size, page_size, pow2_at_least(num_requests), block, width)


TRANSIENT_BLOCK_BYTES = 1 << 30
"""Budget of one token block's largest transient in the indexer and in sparse attention.

The indexer's logits are `[B, T, index_n_heads, S]` float32 and sparse attention's gathered
rows `[B, T, index_topk, kv_cache_dim]` float32: at GLM-5 size, 2,048 query tokens per rank
over a 128K-token view, that is 34 GB and 9.7 GB in one piece. With the default numerics
both run over the query tokens in blocks of `block_rows(...)` rows so that one block's
array stays within this budget (all rows at once when they fit, as for every shape the
tiny model sees). The model (`cpkv_jax.model.indexer.index_scores` and `indexer_topk`,
`cpkv_jax.model.mla.sparse_attention`) and the admission-time buffer estimator
(`serving.prefill.buffer_estimator`) both size their blocks with `block_rows`, so the
estimate follows the program.
"""

BLOCK_ROW_MULTIPLE = 16
"""Blocks are a multiple of this many rows (the batch-invariant tile) unless all rows fit."""


def block_rows(rows: int, row_bytes: int, budget: int = TRANSIENT_BLOCK_BYTES) -> int:
    """Rows per block so that `rows_per_block * row_bytes <= budget`.

    All `rows` when they fit (or when there are none); otherwise the largest multiple of
    `BLOCK_ROW_MULTIPLE` within the budget, and never fewer than `BLOCK_ROW_MULTIPLE` rows
    (a budget below one such block is exceeded rather than looped row by row).
    """
    if rows < 0 or row_bytes < 0 or budget <= 0:
        raise ValueError(
            f"block_rows needs rows >= 0, row_bytes >= 0 and budget > 0, got {rows}, "
            f"{row_bytes}, {budget}"
        )
    if rows * row_bytes <= budget:
        return rows
    fit = budget // row_bytes // BLOCK_ROW_MULTIPLE * BLOCK_ROW_MULTIPLE
    return min(rows, max(BLOCK_ROW_MULTIPLE, fit))


def reachable_step_shapes(
    *,
    cp_size: int,
    page_size: int,
    max_extend_tokens: int,
    longest_tokens: int,
    max_rows: int,
    pool_pages: int | None = None,
) -> set[StepShape]:
    """Every `StepShape` a CP prefill step can take under these limits.

    One row's step extends `e` tokens, `1 <= e <= max_extend_tokens` (the page-floored
    chunk, or the longest prompt unchunked), on top of `j >= 0` whole pages already
    there (a prefix hit or earlier chunks, both page multiples), so its KV holds
    `k = e + j * page_size <= longest_tokens` tokens (the longest prompt the pool and
    the context admit). Block bucket `b` takes `e in (cp * b, 2 * cp * b]` (from 1 for
    the smallest, `min_block(cp)`); its widths are those of every page count from
    `pages(e_lo)` to the largest `pages(e) + (longest - e) // page_size` in the bucket.
    Exact for one row (brute-forced in tests/core/test_step_buckets.py).

    Batches of `k >= 2` rows pad to `rows = pow2(k) <= pow2(max_rows)`. They hold their
    pages at once: every row its own `pages(e)` new pages, a prefix at most once (rows
    may share one), so with `pool_pages` (usable pages of all lanes; None = unbounded)
    a padded batch needs its fewest rows `rows // 2 + 1` to fit beside its widest row.
    Exact under that page count (brute-forced in tests/serving/test_reachable_shapes.py);
    per-lane shares and token budgets beyond `max_rows` are not modelled, so it is a
    superset of what the scheduler admits.
    """
    max_e = min(max_extend_tokens, longest_tokens)
    longest_pages = pages_for_tokens(max(longest_tokens, 1), page_size)
    widest = page_table_width(longest_pages, cp_size)
    out: set[StepShape] = set()
    block = first_block = min_block(cp_size)
    while (lo := 1 if block == first_block else cp_size * block + 1) <= max_e:
        hi = min(2 * cp_size * block, max_e)
        # pages(e) + (L - e) // P has period P in e: one period holds its maximum.
        top = max(
            pages_for_tokens(e, page_size) + (longest_tokens - e) // page_size
            for e in range(lo, min(hi, lo + page_size - 1) + 1)
        )
        first = pages_for_tokens(lo, page_size)
        for width in {page_table_width(p, cp_size) for p in range(first, top + 1)}:
            out.add(StepShape(cp_size, page_size, 1, block, width))
        rows = 2
        while rows <= pow2_at_least(max_rows):
            fewest = rows // 2 + 1
            width = page_table_width(first, cp_size)
            while width <= widest:
                # Fewest pages of a widest row of this width that holds the bucket's
                # extend itself (up to `top`), or beside a row that does (any row's
                # pages up to the longest prompt's; the others one page each).
                p = max(first, 1 if width == cp_size else width // 2 + 1)
                need = min(
                    p + fewest - 1 if p <= min(top, width) else math.inf,
                    p + first + fewest - 2 if p <= min(longest_pages, width) else math.inf,
                )
                if pool_pages is None or need <= pool_pages:
                    out.add(StepShape(cp_size, page_size, rows, block, width))
                width *= 2
            rows *= 2
        block *= 2
    return out
