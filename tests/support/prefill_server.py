"""Helpers shared by the PD prefill server tests (tests/serving/test_prefill_server_*.py):
the host-only schedulers with a closed-form executor, the free and evictable counts of
a non-holding run (the oracle for "after the holds are released"), and the tiny
checkpoint's server arguments."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cpkv_jax.cache.radix import RadixCache
from cpkv_jax.lane_allocator import OwnerLaneAllocator
from cpkv_jax.paging import owner_of_page
from serving.prefill.scheduler import PrefillScheduler, StepRow
from serving.server_args import ServerArgs

P = 16
CP = 8
HP = 4  # page size of the host-only tests
HCP = 2


class ZeroExecutor:
    """Closed-form logits (one-hot at the prompt sum mod vocab); checks the tables."""

    def execute(self, rows: Sequence[StepRow]) -> np.ndarray:
        out = np.zeros((len(rows), 97), np.float32)
        for i, r in enumerate(rows):
            assert r.table.num_tokens == r.start + r.length
            out[i, int(r.prompt.astype(np.int64).sum()) % 97] = 1.0
        return out


def host_scheduler(hold: bool, pages_per_lane: int = 32, page: int = HP, cp: int = HCP):
    alloc = OwnerLaneAllocator(cp, pages_per_lane)
    cache = RadixCache(alloc, page)
    sched = PrefillScheduler(
        cache=cache, executor=ZeroExecutor(), max_prefill_tokens=10_000, hold_finished=hold
    )
    return sched, cache, alloc


def no_transfer_counts(
    prompts: Sequence[np.ndarray], cp: int, pages_per_lane: int, page: int
) -> tuple[np.ndarray, np.ndarray]:
    """(free, evictable) per lane after a non-holding scheduler prefilled `prompts`.

    The oracle for "after the holds are released": what the cache keeps depends only on
    the set of whole-page prefixes, not on batching or order.
    """
    sched, cache, alloc = host_scheduler(False, pages_per_lane, page, cp)
    for i, p in enumerate(prompts):
        sched.submit(f"oracle-{i}", p)
    sched.run_until_idle()
    cache.check_invariants()
    return alloc.num_free_per_lane(), cache.evictable_pages_per_lane()


def lane_counts(n_pages: int, cp: int) -> np.ndarray:
    return np.bincount(owner_of_page(np.arange(n_pages), cp), minlength=cp).astype(np.int64)


def float32_args(path, *extra: str) -> ServerArgs:
    """Flags of a float32 server of the tiny checkpoint at `path` (page `P`), plus `extra`
    (a unified server unless `extra` names a mode)."""
    return ServerArgs.from_cli(
        [
            "--model-path",
            str(path),
            "--dtype",
            "float32",
            "--index-k-dtype",
            "float32",
            "--page-size",
            str(P),
            *extra,
        ]
    )


def server_args(path, *extra: str) -> ServerArgs:
    return float32_args(
        path,
        *[
            "--cp-size",
            str(CP),
            "--enable-cp-shared-kv",
            "--enable-cp-shared-kv-prefill-bs-gt1",
            "--kv-pool-size",
            "1MiB",
            "--disaggregation-mode",
            "prefill",
            "--transfer-backend",
            "grpc",
            *extra,
        ],
    )
