"""PD transfer over gRPC under faults, on 8 virtual devices (SPEC S2).

Lost acks (streams resent idempotently: the room still succeeds), a sender killed mid
transfer, a corrupted page, a position sent by two ranks, a missing position, a layout
mismatch, a late write after an abort, the decode side dying; each ending with both
allocators back at their initial free counts. The randomized mix of these is
test_grpc_fault_soak.py.

(Until the tests were split by topic, part of tests/test_transfer_grpc.py.)
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import numpy as np
from support.transfer import (
    CP,
    SENDER,
    TIMEOUTS,
    WAIT,
    P,
    assert_decode_layout_is,
    bitwise_equal,
    finish,
    new_table,
    prefill_free,
    run_transfer,
    section_spans,
    settle,
)
from support.transfer_faults import (
    assert_layout_mismatch_refused,
    duplicate_position_plan,
    missing_position_plan,
)

from transfer.backends.grpc_backend import GrpcBackend, SenderFaults
from transfer.protocol import Aux, RoomState, TransferError, kind_to_pb

logger = logging.getLogger(__name__)


class LostAck(TransferError):
    code = "UNAVAILABLE"


def test_stream_retries_resend_idempotently(prefill, decode):
    """On every rank, the stream carrying the first latent chunk fails after that chunk
    was written (a lost ack): the sender sends the stream again with the same attempt,
    the receiver counts what it already has as duplicates, and the room still succeeds
    with the right pages."""
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)
    n_tok = 9 * P + 2
    table = new_table(pre, n_tok)
    view = pre.runner.full_view(table)
    write = dec.receiver.write_chunk
    failed: set[int] = set()
    duplicates: list[int] = []
    lock = threading.Lock()

    def flaky(room, rank, attempt, sections, data):
        res = write(room, rank, attempt, sections, data)
        with lock:
            duplicates.append(res.duplicate)
            if any(s.kind == "latent" for s in sections) and rank not in failed:
                failed.add(rank)
                raise LostAck("simulated lost ack")
        return res

    dec.receiver.write_chunk = flaky  # the servicer calls the receiver's attribute
    hold, dst = run_transfer(pre, dec, table, "retry", Aux(3, -0.1))
    outcome = finish(hold)
    assert outcome.state is RoomState.SUCCESS, outcome
    assert sum(duplicates) > 0 and len(failed) == CP
    assert_decode_layout_is(dec.receiver, dst, view)  # the released table is empty now
    dec.receiver.free_pages(dst)
    assert prefill_free(pre) == free and dec.receiver.num_free_pages == dec.free0


def test_fault_sender_killed_mid_transfer(prefill, decode):
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)
    killed_at: list[float] = []

    def chunk(sender, msg):
        if sender.rank == 2 and sender.chunks_sent == 3:
            killed_at.append(time.monotonic())
            sender.kill()
        return msg

    backend = GrpcBackend(SENDER, SenderFaults(chunk=chunk))
    hold, _ = run_transfer(
        pre, dec, new_table(pre, 11 * P + 5), "kill", Aux(5, -1.0), backend=backend
    )
    snap = settle(dec.receiver, "kill")
    assert (
        snap.state is RoomState.FAILED and "heartbeat timeout: prefill rank(s) [2]" in snap.reason
    )
    outcome = finish(hold)
    assert time.monotonic() - killed_at[0] < TIMEOUTS.heartbeat + 2.0
    assert outcome.state is RoomState.FAILED and "rank(s) [2]" in outcome.reason
    assert hold.outcomes()[2] is None  # the dead rank never learned anything
    assert prefill_free(pre) == free and dec.receiver.num_free_pages == dec.free0


def test_fault_corrupted_page(prefill, decode):
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)

    def chunk(sender, msg):
        for section, lo, _ in section_spans(msg, pre.layout):
            if sender.rank == 1 and section.kind == kind_to_pb("index_k"):
                data = bytearray(msg.data)
                data[lo + 3] ^= 0x01  # a page of a chunk's index K section
                msg.data = bytes(data)
                break
        return msg

    backend = GrpcBackend(SENDER, SenderFaults(chunk=chunk))
    hold, _ = run_transfer(
        pre, dec, new_table(pre, 9 * P), "corrupt", Aux(5, -1.0), backend=backend
    )
    outcome = finish(hold)
    assert outcome.state is RoomState.FAILED and "digest mismatch on index_k" in outcome.reason
    assert "from prefill rank 1" in settle(dec.receiver, "corrupt").reason
    assert prefill_free(pre) == free and dec.receiver.num_free_pages == dec.free0


def test_fault_position_sent_by_two_ranks(prefill, decode):
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)
    # Rank 1 also sends position 0 (rank 0's), from one of its own pages.
    backend = GrpcBackend(SENDER, SenderFaults(plan=duplicate_position_plan(0, 1)))
    hold, _ = run_transfer(pre, dec, new_table(pre, 10 * P), "dup", Aux(5, -1.0), backend=backend)
    outcome = finish(hold)
    assert outcome.state is RoomState.FAILED
    assert "position 0 of" in outcome.reason and "one rank" in outcome.reason
    assert prefill_free(pre) == free and dec.receiver.num_free_pages == dec.free0


def test_fault_missing_position(prefill, decode):
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)
    backend = GrpcBackend(SENDER, SenderFaults(plan=missing_position_plan(3)))
    hold, _ = run_transfer(
        pre, dec, new_table(pre, 12 * P + 1), "miss", Aux(5, -1.0), backend=backend
    )
    outcome = finish(hold)
    assert outcome.state is RoomState.FAILED
    assert "positions [3] were sent by no rank" in outcome.reason
    assert prefill_free(pre) == free and dec.receiver.num_free_pages == dec.free0


def test_fault_layout_mismatch_refused_before_data_moves(prefill, decode):
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)
    sent: list[int] = []
    backend = GrpcBackend(SENDER, SenderFaults(chunk=lambda s, m: sent.append(1) or m))
    assert_layout_mismatch_refused(pre, dec, backend)
    assert sent == []  # no chunk left any rank
    assert prefill_free(pre) == free and dec.receiver.num_free_pages == dec.free0


def test_fault_late_write_after_abort(prefill, decode):
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)
    frozen: list[tuple[np.ndarray, ...]] = []
    copies: list[list[np.ndarray]] = []
    aborted = threading.Event()

    def chunk(sender, msg):
        if sender.rank == 4 and sender.chunks_sent == 2 and not aborted.is_set():
            # Chunks are streamed ahead of the receiver: wait until some have landed.
            deadline = time.monotonic() + WAIT
            while (staging := dec.receiver.staging("late")) is None:
                assert time.monotonic() < deadline, "no chunk of room 'late' ever arrived"
                time.sleep(0.005)
            dec.receiver.abort("late", "decode request cancelled")
            aborted.set()
            frozen.append(staging)
            copies.append([s.copy() for s in staging])
        return msg  # sent after the abort: must be rejected untouched

    pool_before = [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(dec.receiver.pool)]
    backend = GrpcBackend(SENDER, SenderFaults(chunk=chunk))
    hold, _ = run_transfer(pre, dec, new_table(pre, 12 * P), "late", Aux(5, -1.0), backend=backend)
    outcome = finish(hold)
    assert outcome.state is RoomState.FAILED and "decode request cancelled" in outcome.reason
    for s, c in zip(frozen[0], copies[0], strict=True):
        np.testing.assert_array_equal(s, c)
    for x, b in zip(jax.tree_util.tree_leaves(dec.receiver.pool), pool_before, strict=True):
        assert bitwise_equal(x, b)
    assert prefill_free(pre) == free and dec.receiver.num_free_pages == dec.free0


def test_fault_decode_side_dies(prefill, decode):
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)

    def before_commit(sender):
        # Rank 0 commits last: once the others committed (and wait for the outcome,
        # heartbeating), the decode side dies; rank 0 then holds back its commit until
        # a waiting rank has noticed the silence.
        if sender.rank != 0:
            return
        deadline = time.monotonic() + WAIT
        while len(dec.receiver.status("dies").committed_ranks) < CP - 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        dec.server.stop(0)
        while not sender.hold.cancelled:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    backend = GrpcBackend(SENDER, SenderFaults(before_commit=before_commit))
    t0 = time.perf_counter()
    hold, _ = run_transfer(
        pre, dec, new_table(pre, 10 * P + 7), "dies", Aux(5, -1.0), backend=backend
    )
    outcome = finish(hold)
    logger.info("decode death detected after %.2fs", time.perf_counter() - t0)
    assert outcome.state is RoomState.FAILED
    reasons = [o.reason for o in hold.outcomes().values() if o is not None]
    # Ranks that committed hold a Commit call open (replies wait for the room's outcome,
    # COMMIT_WAIT_S) and heartbeat: the death shows as the cut call or as silence.
    assert any("decode side lost" in r for r in reasons), reasons
    assert prefill_free(pre) == free
    # The (in-process) decode core fails the room on the senders' silence and frees pages.
    assert settle(dec.receiver, "dies").state is RoomState.FAILED
    assert dec.receiver.num_free_pages == dec.free0
