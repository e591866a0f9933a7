"""SPEC S1.7 invariant checks for CP shared KV (`CPKV_DEBUG_SHARED_KV=1`).

Every step the runner dispatches (offline `prefill` and requests the prefill server
schedules alike) is replayed on a replicated shadow runner, and then:
- ownership is read from the device: every pool leaf has exactly one shard per lane
  (nothing replicated), lane `r`'s shard lives on mesh device `r`, and each page the step
  wrote sits on the shard of its owner `p mod cp` with the shadow's bytes;
- the step's logits and every row's materialized full view equal the shadow's, bitwise.

The shadow needs no allocator: shared page `(lane, local)` maps to a fixed shadow page
`lane * (pages_per_rank - 1) + local` (trash pages to the shadow's trash page 0), so
prefix-cached pages that earlier requests wrote are already in the shadow when a later
request reads them. These checks synchronize the device: never for measurements.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import numpy as np

from cpkv_jax.errors import CpkvError
from cpkv_jax.kv_pool import PoolLayout

if TYPE_CHECKING:
    from cpkv_jax.cp_prefill import CPPrefillRunner, StepPlan

DEBUG_ENV = "CPKV_DEBUG_SHARED_KV"


class SharedKVInvariantError(CpkvError):
    """A `CPKV_DEBUG_SHARED_KV=1` invariant check failed (a bug, not bad input)."""


def shadow_pages_per_rank(layout: PoolLayout) -> int:
    """Pages of the replicated shadow: every non-trash page of every lane, plus trash."""
    return layout.cp_size * (layout.pages_per_rank - 1) + 1


def shadow_page(layout: PoolLayout, lanes: np.ndarray | int, local: np.ndarray | int) -> np.ndarray:
    """The shadow page of shared page `(lane, local)`; local page 0 (trash) maps to 0."""
    lanes, local = np.asarray(lanes, np.int64), np.asarray(local, np.int64)
    return np.where(local == 0, 0, lanes * (layout.pages_per_rank - 1) + local)


def shadow_plan(layout: PoolLayout, plan: StepPlan) -> StepPlan:
    """The same step addressed to the shadow's pool: slots and page tables remapped."""
    page = layout.page_size
    glob = plan.write_slots.astype(np.int64) // page
    lanes, local = glob // layout.pages_per_rank, glob % layout.pages_per_rank
    slots = shadow_page(layout, lanes, local) * page + plan.write_slots % page
    logical = np.arange(plan.page_table.shape[1])
    table = shadow_page(layout, logical % layout.cp_size, plan.page_table)
    return dataclasses.replace(
        plan, write_slots=slots.astype(np.int32), page_table=table.astype(np.int32)
    )


def check_step(
    runner: CPPrefillRunner, shadow: CPPrefillRunner, plan: StepPlan, logits: np.ndarray
) -> None:
    """Replay `plan` on `shadow`, then check ownership and equality (module docstring)."""
    layout = runner.layout
    mirrored = shadow_plan(layout, plan)
    want = shadow.run_step(mirrored)
    if not np.array_equal(logits, want):
        raise SharedKVInvariantError("step logits differ from the replicated shadow's")
    _check_owned_pages(runner, shadow, plan)
    mine = runner.views(plan.page_table)
    theirs = shadow.views(mirrored.page_table)
    for b, n in enumerate(plan.kv_lens.tolist()):
        for x, y in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs), strict=True):
            if not np.array_equal(np.asarray(x[b, :n]), np.asarray(y[b, :n])):
                raise SharedKVInvariantError(
                    f"batch row {b}: shared-KV full view differs from the replicated shadow"
                )


def _check_owned_pages(runner: CPPrefillRunner, shadow: CPPrefillRunner, plan: StepPlan) -> None:
    layout, cp, page = runner.layout, runner.cp.cp_size, runner.cp.page_size
    written = plan.write_slots[plan.valid].astype(np.int64) // page
    pos_pages = plan.positions[plan.valid].astype(np.int64) // page
    lanes, local = written // layout.pages_per_rank, written % layout.pages_per_rank
    if np.any(lanes != pos_pages % cp):  # the plan's claim; the device check follows
        raise SharedKVInvariantError("a token was planned into a lane that does not own its page")
    pairs = np.unique(np.stack([lanes, local], axis=1), axis=0)
    devices = list(runner.mesh.devices.flat)
    for name, leaf, ref in zip(
        _leaf_names(runner.pool),
        jax.tree.leaves(runner.pool),
        jax.tree.leaves(shadow.pool),
        strict=True,
    ):
        shards = {s.index[0].start or 0: s for s in leaf.addressable_shards}
        if any(s.data.shape[0] != layout.pages_per_rank for s in shards.values()):
            raise SharedKVInvariantError(f"{name}: a shard does not hold exactly one lane")
        for lane, lo in zip(pairs[:, 0].tolist(), pairs[:, 1].tolist(), strict=True):
            shard = shards.get(lane * layout.pages_per_rank)
            if shard is None:  # another process's device (multi-host): its own check
                continue
            if shard.device != devices[lane]:
                raise SharedKVInvariantError(
                    f"{name}: lane {lane} is held by {shard.device}, not mesh rank {lane}"
                )
            got = np.asarray(shard.data[lo])
            expect = np.asarray(ref[int(shadow_page(layout, lane, lo))])
            if not np.array_equal(got, expect):
                raise SharedKVInvariantError(
                    f"{name}: page (lane {lane}, local {lo}) on its owner's shard differs "
                    "from the replicated shadow"
                )


def _leaf_names(pool: object) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(pool)[0]]
