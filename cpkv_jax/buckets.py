"""Shape buckets of the CP prefill step (pure Python: the scheduler imports this).

One place decides the padded shapes of a step, so the runner that builds it
(`CPPrefillRunner.plan_step`) and the admission-time buffer estimator agree exactly:
batch rows and the zigzag block length are powers of two, and the page-table width is
`cp` times a power of two. The number of compiled step shapes is bounded by the number
of distinct `StepShape`s.
"""

from __future__ import annotations

import dataclasses

from cpkv_jax.paging import pages_for_tokens


def pow2_at_least(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


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
    block = pow2_at_least(-(-max_extend_tokens // (2 * cp_size)))
    width = page_table_width(pages_for_tokens(max_kv_tokens, page_size), cp_size)
    return StepShape(cp_size, page_size, pow2_at_least(num_requests), block, width)
