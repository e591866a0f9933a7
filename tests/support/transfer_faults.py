"""Fault plans and the randomized fault runs' helpers, shared by the gRPC and Mooncake
transfer fault tests (tests/transfer/test_*_fault*.py)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np

from support.transfer import (
    CP,
    WAIT,
    Decode,
    P,
    Prefill,
    finish,
    new_table,
    run_transfer,
    with_positions,
)
from transfer.hold import TransferHold
from transfer.page_plan import RankPlan
from transfer.protocol import Aux, RoomState
from transfer.sender import TransferBackend

logger = logging.getLogger(__name__)


# Rounds of a fault soak in `make test`: every fault kind at least once plus random draws
# (a few seconds per backend). `python -m benchmarks.fault_soak` runs the long soak.
SUITE_ROUNDS = 24


def fault_schedule(
    rng: np.random.Generator, count: int, kinds: tuple[str, ...], weights: tuple[float, ...]
) -> list[str]:
    """`count` fault kinds drawn with `weights`, every kind at least once (when `count`
    allows), in random order: rare kinds cannot drop out of a run by chance."""
    forced = list(kinds[: min(count, len(kinds))])
    drawn = rng.choice(kinds, size=count - len(forced), p=weights).tolist()
    schedule = [str(k) for k in forced + drawn]
    rng.shuffle(schedule)
    return schedule


def decode_dies_before_commit(dec: Decode, room: str, victim: int):
    """A `before_commit` hook: rank `victim` commits last; once every other rank
    committed (and waits for the outcome, heartbeating), the decode server dies; the
    victim holds back its commit until a waiting rank noticed the silence and failed
    the room (`hold.cancel`), so the prefill side learns it from the peer's loss (its
    open Commit call cut, or heartbeat silence, whichever comes first)."""

    def before_commit(sender) -> None:
        if sender.rank != victim:
            return
        deadline = time.monotonic() + WAIT
        while len(dec.receiver.status(room).committed_ranks) < CP - 1:
            assert time.monotonic() < deadline, dec.receiver.status(room)
            time.sleep(0.01)
        dec.server.stop(0)
        while not sender.hold.cancelled:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    return before_commit


def duplicate_position_plan(victim: int, other: int) -> Callable[[RankPlan], RankPlan]:
    """A plan fault: rank `other` also sends position `victim` (owned by rank `victim`)."""

    def plan(p: RankPlan) -> RankPlan:
        if p.rank != other:
            return p
        return with_positions(
            p, [victim, *p.positions.tolist()], [p.src_pages[0], *p.src_pages.tolist()]
        )

    return plan


def missing_position_plan(victim: int) -> Callable[[RankPlan], RankPlan]:
    """A plan fault: rank `victim` leaves out its first position."""

    def plan(p: RankPlan) -> RankPlan:
        if p.rank != victim:
            return p
        return with_positions(p, p.positions[1:].tolist(), p.src_pages[1:].tolist())

    return plan


def heartbeat_loss_seen(hold: TransferHold) -> bool:
    reasons = [o.reason for o in hold.outcomes().values() if o is not None]
    return any("decode side lost" in r for r in reasons)


def log_fault_run(label: str, count: int, seconds: float, per_kind: dict[str, list[float]]):
    """One summary line of a randomized fault run: rounds, time, rounds and mean per kind."""
    logger.warning(
        "randomized %s faults: %d in %.1fs (%.2fs each); per kind: %s",
        label,
        count,
        seconds,
        seconds / max(count, 1),
        {k: f"{len(v)} x {np.mean(v):.2f}s" for k, v in per_kind.items() if v},
    )


def assert_layout_mismatch_refused(pre: Prefill, dec: Decode, backend: TransferBackend) -> None:
    """Send 4 pages with a layout whose index-K dtype differs from the decode side's: the
    handshake refuses the room before any data moves, naming the field."""
    wrong = dataclasses.replace(pre.layout, index_k_dtype="bfloat16", has_index_scale=False)
    hold, _ = run_transfer(
        pre, dec, new_table(pre, 4 * P), "layout", Aux(5, -1.0), backend=backend, layout=wrong
    )
    outcome = finish(hold)
    assert outcome.state is RoomState.FAILED and "refused before any data moved" in outcome.reason
    assert "index_k_dtype: 'float8_e4m3fn' != 'bfloat16'" in outcome.reason
