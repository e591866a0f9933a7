"""PD transfer with the Mooncake backend under faults, on 8 virtual devices (SPEC S2).

Skipped, with the reason, where the engine cannot load. A corrupted page, a missing and
a duplicated position, a layout mismatch, a sender killed, an abort then a late write,
each ending with every allocator - prefill pages, decode pages, the decode staging arena
and the sender's registered host buffer - back at its initial free count. Write
retries: a transient engine failure (half the batch landed) is retried with the same
attempt and destinations and the room succeeds bitwise; a write failing past
`write_retries` fails the room; a stalled write is not retried. The randomized mix of
these is test_mooncake_fault_soak.py.

(Until the tests were split by topic, part of tests/test_transfer_mooncake.py.)
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import numpy as np
from support.mooncake import CONFIG, all_back, needs_mooncake
from support.transfer import (
    CP,
    TIMEOUTS,
    P,
    assert_decode_layout_is,
    bitwise_equal,
    finish,
    new_table,
    prefill_free,
    run_transfer,
    settle,
)
from support.transfer_faults import (
    assert_layout_mismatch_refused,
    duplicate_position_plan,
    missing_position_plan,
)

from transfer.backends.mooncake_backend import MooncakeBackend
from transfer.backends.mooncake_engine import MooncakeTransferError
from transfer.backends.mooncake_sender import MooncakeSenderFaults
from transfer.protocol import Aux, RoomState


@needs_mooncake
def test_fault_corrupted_page(prefill, mooncake_decode, backends):
    pre, dec = prefill, mooncake_decode(48)
    free = prefill_free(pre)
    flipped: list[int] = []

    def after_write(sender, group):
        # Rank 1's bytes are damaged after they landed (in transit, say): flip one bit
        # of its first position in the first index_k buffer of the decode staging.
        if sender.rank == 1 and group == 0:
            b = pre.layout.buffers().index(("index_k", 0))
            rows = dec.receiver.staging_rows("corrupt")
            dec.receiver.staging("corrupt")[b][rows[1], 3] ^= 0x01
            flipped.append(1)

    backend = backends(MooncakeSenderFaults(after_write=after_write))
    hold, _ = run_transfer(
        pre, dec, new_table(pre, 9 * P), "corrupt", Aux(5, -1.0), backend=backend
    )
    outcome = finish(hold)
    assert flipped
    assert outcome.state is RoomState.FAILED, outcome
    reason = settle(dec.receiver, "corrupt").reason
    assert "digest mismatch on index_k layer 0 position 1 from prefill rank 1" in reason
    assert outcome.reason == reason
    all_back(pre, dec, free, backend)


@needs_mooncake
def test_fault_missing_position(prefill, mooncake_decode, backends):
    pre, dec = prefill, mooncake_decode(48)
    free = prefill_free(pre)
    backend = backends(MooncakeSenderFaults(plan=missing_position_plan(3)))
    hold, _ = run_transfer(
        pre, dec, new_table(pre, 12 * P + 1), "miss", Aux(5, -1.0), backend=backend
    )
    outcome = finish(hold)
    assert outcome.state is RoomState.FAILED
    assert "positions [3] were sent by no rank" in outcome.reason
    all_back(pre, dec, free, backend)


@needs_mooncake
def test_fault_position_sent_by_two_ranks(prefill, mooncake_decode, backends):
    pre, dec = prefill, mooncake_decode(48)
    free = prefill_free(pre)
    backend = backends(MooncakeSenderFaults(plan=duplicate_position_plan(0, 1)))
    hold, _ = run_transfer(pre, dec, new_table(pre, 10 * P), "dup", Aux(5, -1.0), backend=backend)
    outcome = finish(hold)
    assert outcome.state is RoomState.FAILED
    # Both ranks wrote position 0's staging row (one-sided writes collide there): the
    # commit that comes second sees two writers, or the first sees the other's bytes.
    r = outcome.reason
    assert ("position 0 of" in r and "one rank" in r) or "digest mismatch" in r, r
    all_back(pre, dec, free, backend)


@needs_mooncake
def test_fault_layout_mismatch_refused_before_data_moves(prefill, mooncake_decode, backends):
    pre, dec = prefill, mooncake_decode(48)
    free = prefill_free(pre)
    writes: list[int] = []
    backend = backends(MooncakeSenderFaults(before_write=lambda s, g: writes.append(g)))
    assert_layout_mismatch_refused(pre, dec, backend)
    assert writes == []  # no rank wrote a byte
    assert dec.arena.stats().live_regions == dec.arena.stats().quarantined_regions == 0
    all_back(pre, dec, free, backend)


@needs_mooncake
def test_fault_sender_killed_mid_transfer(prefill, mooncake_decode, backends):
    pre, dec = prefill, mooncake_decode(48)
    free = prefill_free(pre)
    killed_at: list[float] = []

    def before_write(sender, group):
        if sender.rank == 2 and group == 1:
            killed_at.append(time.monotonic())
            sender.kill()

    backend = backends(MooncakeSenderFaults(before_write=before_write))
    hold, _ = run_transfer(
        pre, dec, new_table(pre, 11 * P + 5), "kill", Aux(5, -1.0), backend=backend
    )
    snap = settle(dec.receiver, "kill")
    assert (
        snap.state is RoomState.FAILED and "heartbeat timeout: prefill rank(s) [2]" in snap.reason
    )
    assert time.monotonic() - killed_at[0] < TIMEOUTS.heartbeat + 2.0
    outcome = finish(hold)
    assert outcome.state is RoomState.FAILED and "rank(s) [2]" in outcome.reason
    assert hold.outcomes()[2] is None  # the dead rank never learned anything
    # The dead rank never said its writes ended: its region waits out the quarantine.
    assert dec.receiver.quarantined_rooms().get("kill") == (2,)
    all_back(pre, dec, free, backend)


@needs_mooncake
def test_fault_abort_then_late_write_stays_in_quarantine(prefill, mooncake_decode, backends):
    pre, dec = prefill, mooncake_decode(48)
    free = prefill_free(pre)
    pool_before = [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(dec.receiver.pool)]
    seen: dict[str, object] = {}
    aborted = threading.Event()

    def before_write(sender, group):
        if sender.rank == 4 and group == 1 and not aborted.is_set():
            dec.receiver.abort("late", "decode request cancelled")
            aborted.set()
            seen["quarantine_before"] = dec.receiver.quarantined_rooms().get("late")
        # ...and the write goes ahead: one-sided, the decode side cannot refuse it.

    def after_write(sender, group):
        if sender.rank == 4 and group == 1 and aborted.is_set():
            seen["late_write_landed"] = True
            seen["quarantined"] = dec.arena.stats().quarantined_regions
            seen["pending"] = dec.receiver.quarantined_rooms().get("late")

    backend = backends(MooncakeSenderFaults(before_write=before_write, after_write=after_write))
    hold, _ = run_transfer(pre, dec, new_table(pre, 12 * P), "late", Aux(5, -1.0), backend=backend)
    outcome = finish(hold)
    assert outcome.state is RoomState.FAILED and "decode request cancelled" in outcome.reason
    assert seen.get("late_write_landed"), seen
    assert 4 in seen["quarantine_before"] and 4 in seen["pending"]  # type: ignore[operator]
    assert seen["quarantined"] == 1  # the region stayed out of use while rank 4 wrote
    for x, b in zip(jax.tree_util.tree_leaves(dec.receiver.pool), pool_before, strict=True):
        assert bitwise_equal(x, b)  # the decode pool was never touched
    all_back(pre, dec, free, backend)


# ---- write retries ---------------------------------------------------------------------------


class FlakyWrites:
    """`batch_write` of a real sender engine whose first call from each rank thread half
    lands, then fails the way the engine reports a peer reset (`MooncakeTransferError`,
    code -1): the first half of the descriptors is really written, the rest is not.
    Installed on the engine instance (`monkeypatch.setattr`), so the backend still gets
    a real `MooncakeEngine`."""

    def __init__(self, write):
        self._write = write  # the engine's own bound batch_write
        self._failed: set[int] = set()
        self._lock = threading.Lock()
        self.failures = 0

    def __call__(self, session_id, local, remote, lengths, on_start=None) -> None:
        me = threading.get_ident()
        with self._lock:
            first = me not in self._failed
            self._failed.add(me)
        if not first:
            return self._write(session_id, local, remote, lengths, on_start)
        half = max(1, len(lengths) // 2)
        self._write(session_id, local[:half], remote[:half], lengths[:half], on_start)
        with self._lock:
            self.failures += 1
        raise MooncakeTransferError("simulated peer reset after a partial write", -1)


@needs_mooncake
def test_transient_write_failure_is_retried_and_succeeds(
    prefill, mooncake_decode, sender_engine, monkeypatch
):
    """Every rank's first batch write fails after half of it landed: the rank retries
    the same write (same attempt, same destination rows), and the room succeeds with
    the decode pool bitwise equal to the prefill full view."""
    pre, dec = prefill, mooncake_decode(48)
    free = prefill_free(pre)
    n_tok = 11 * P + 3
    table = new_table(pre, n_tok)
    n_pages = table.num_pages  # the hold's release empties the table
    view = pre.runner.full_view(table)
    flaky = FlakyWrites(sender_engine.batch_write)
    monkeypatch.setattr(sender_engine, "batch_write", flaky)
    backend = MooncakeBackend(CONFIG, engine=sender_engine)
    try:
        hold, dst = run_transfer(pre, dec, table, "flaky", Aux(7, -0.2), backend=backend)
        outcome = finish(hold)
        assert outcome.state is RoomState.SUCCESS, outcome
        assert flaky.failures == min(CP, n_pages)  # each rank with pages failed once
        stats = backend.stats("flaky")
        assert all(s.batch_writes > 1 for s in stats.values())  # failures hit mid-rank
        assert_decode_layout_is(dec.receiver, dst, view)
        dec.receiver.free_pages(dst)
        all_back(pre, dec, free, backend)
    finally:
        backend.close()


@needs_mooncake
def test_write_failing_past_the_retries_fails_the_room(prefill, mooncake_decode, backends):
    pre, dec = prefill, mooncake_decode(48)
    free = prefill_free(pre)
    tries: list[int] = []

    def write(sender, group, attempt):
        if sender.rank == 3 and group == 1:
            tries.append(attempt)
            raise MooncakeTransferError("simulated dead peer", -1)

    backend = backends(MooncakeSenderFaults(write=write))
    hold, _ = run_transfer(
        pre, dec, new_table(pre, 9 * P), "no-retry-left", Aux(5, -1.0), backend=backend
    )
    outcome = finish(hold)
    assert tries == [0, 1, 2]  # the first try and CONFIG.write_retries = 2 retries
    assert outcome.state is RoomState.FAILED
    assert "prefill rank 3: Mooncake write to" in outcome.reason
    assert "simulated dead peer (after 3 tries)" in outcome.reason
    all_back(pre, dec, free, backend)


@needs_mooncake
def test_stalled_write_is_not_retried(prefill, mooncake_decode, sender_engine):
    """A write that failed only after half the transfer timeout (a stalled peer: the
    engine may still be moving its slices) fails the room at once, no retry."""
    pre, dec = prefill, mooncake_decode(48)
    free = prefill_free(pre)
    tries: list[int] = []

    def write(sender, group, attempt):
        if sender.rank == 2 and group == 0:
            tries.append(attempt)
            time.sleep(0.25)  # >= 0.5 * the 0.4 s transfer timeout below
            raise MooncakeTransferError("simulated transfer timeout", -1)

    config = dataclasses.replace(CONFIG, transfer_timeout_s=0.4)  # the stall threshold
    with MooncakeBackend(config, MooncakeSenderFaults(write=write), engine=sender_engine) as b:
        hold, _ = run_transfer(pre, dec, new_table(pre, 9 * P), "stall", Aux(5, -1.0), backend=b)
        outcome = finish(hold)
        assert tries == [0]
        assert outcome.state is RoomState.FAILED
        assert "simulated transfer timeout" in outcome.reason and "not retried" in outcome.reason
        all_back(pre, dec, free, b)
