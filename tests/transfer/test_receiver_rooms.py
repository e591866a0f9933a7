"""The PD transfer receiver core without gRPC (SPEC S2): the room status machine, exact
coverage, digests, idempotent retries, late writes, handshake refusal, chunks of several
buffers, timeouts (fake clock).

(Until the tests were split by topic, part of tests/test_transfer_grpc.py.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.transfer import INDEX_K, TIMEOUTS, FakeClock, P, decode_pages, random_pages

from cpkv_jax.model.kv_cache import init_pool
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.paging import PageAllocator, pages_for_tokens
from transfer.page_plan import page_digests
from transfer.protocol import (
    Aux,
    BadRequestError,
    ChunkTooLargeError,
    DigestMismatchError,
    NotHandshakenError,
    PageSection,
    ProtocolVersionError,
    RoomClosedError,
    RoomExistsError,
    RoomState,
    UnknownRoomError,
)
from transfer.receiver import Receiver


def make_receiver(cfg, layout, pages=16, clock=None, **kw) -> Receiver:
    pool = init_pool(mtp_config(cfg), pages, P, jnp.float32, INDEX_K)
    return Receiver(
        layout, pool, PageAllocator(pages), timeouts=TIMEOUTS, clock=clock or FakeClock(), **kw
    )


def write_all(rx: Receiver, room: str, rank: int, data, positions, attempt=0) -> None:
    for b, (kind, layer) in enumerate(rx.layout.buffers()):
        pages = data[b][positions]
        rx.write_pages(
            room, rank, attempt, kind, layer, positions, page_digests(pages), pages.tobytes()
        )


def open_room(rx: Receiver, room: str, num_tokens: int, cp: int):
    dst = rx.allocate_pages(pages_for_tokens(num_tokens, P))
    rx.register_room(room, dst, num_tokens, cp)
    for r in range(cp):
        assert rx.handshake(room, r, cp, num_tokens, rx.layout).accepted
    return dst


def test_room_state_machine_is_monotone_with_sticky_failure():
    S = RoomState
    order = [S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS]
    for i, a in enumerate(order[:-1]):
        for b in order[i + 1 :]:
            assert a.can_become(b)
        for b in order[: i + 1]:
            assert not a.can_become(b)
        assert a.can_become(S.FAILED)
    for t in (S.SUCCESS, S.FAILED):
        assert t.terminal and not any(t.can_become(x) for x in S)
    assert S.WAITING_FOR_INPUT.label == "WaitingForInput"


def test_room_lifecycle_success_then_never_revived(cfg, layout):
    rx = make_receiver(cfg, layout)
    free0 = rx.num_free_pages
    n_tok, cp = 3 * P + 5, 2
    data = random_pages(layout, 4, seed=1)
    dst = rx.allocate_pages(4)[::-1].copy()  # reversed: destinations chosen by position
    assert rx.register_room("a", dst, n_tok, cp).state is RoomState.BOOTSTRAPPING
    assert rx.handshake("a", 1, cp, n_tok, layout).status.state is RoomState.BOOTSTRAPPING
    res = rx.handshake("a", 0, cp, n_tok, layout)
    assert res.accepted and res.status.state is RoomState.WAITING_FOR_INPUT
    np.testing.assert_array_equal(res.dst_pages, dst)
    write_all(rx, "a", 1, data, np.array([3, 1]))  # any order
    assert rx.status("a").state is RoomState.TRANSFERRING
    write_all(rx, "a", 0, data, np.array([0, 2]))
    assert rx.commit("a", 1, 0, np.array([1, 3])).state is RoomState.TRANSFERRING
    snap = rx.commit("a", 0, 0, np.array([0, 2]), Aux(7, -0.25))
    assert snap.state is RoomState.SUCCESS and snap.aux == Aux(7, -0.25)
    for got, want in zip(decode_pages(rx, dst), data, strict=True):
        np.testing.assert_array_equal(got, want)
    # Finished: never revived, late messages rejected, abort is a no-op.
    assert rx.abort("a", "too late").state is RoomState.SUCCESS
    with pytest.raises(RoomClosedError, match="Success"):
        write_all(rx, "a", 0, data, np.array([0]))
    with pytest.raises(RoomClosedError):
        rx.handshake("a", 0, cp, n_tok, layout)
    with pytest.raises(RoomExistsError):
        rx.register_room("a", rx.allocate_pages(1), P, 1)
    with pytest.raises(UnknownRoomError, match="unknown room 'zz'"):
        rx.status("zz")
    assert rx.num_free_pages == free0 - 4 - 1  # success keeps its pages (decode owns them)


def test_failed_is_sticky_and_frees_pages(cfg, layout):
    rx = make_receiver(cfg, layout)
    free0 = rx.num_free_pages
    open_room(rx, "f", 2 * P, 2)
    assert rx.abort("f", "decode shutting down").state is RoomState.FAILED
    assert rx.num_free_pages == free0
    snap = rx.status("f")
    assert snap.reason == "aborted by decode side: decode shutting down"
    assert rx.abort("f", "again", sender_rank=1).reason == snap.reason  # sticky: first reason
    assert rx.heartbeat("f", 0).state is RoomState.FAILED
    with pytest.raises(RoomClosedError, match="decode shutting down"):
        rx.commit("f", 0, 0, np.array([0]), Aux(1, 0.0))
    with pytest.raises(RoomExistsError):
        rx.register_room("f", rx.allocate_pages(2), 2 * P, 2)


def test_exact_coverage_missing_position_fails_and_frees(cfg, layout):
    rx = make_receiver(cfg, layout)
    free0 = rx.num_free_pages
    data = random_pages(layout, 3, seed=2)
    open_room(rx, "m", 3 * P, 2)
    write_all(rx, "m", 0, data, np.array([0]))  # rank 0 "owns" 0 and 2 but skips 2
    write_all(rx, "m", 1, data, np.array([1]))
    rx.commit("m", 1, 0, np.array([1]))
    snap = rx.commit("m", 0, 0, np.array([0]), Aux(1, 0.0))
    assert snap.state is RoomState.FAILED
    assert "not exact" in snap.reason and "positions [2] were sent by no rank" in snap.reason
    assert rx.num_free_pages == free0


def test_position_from_two_ranks_fails(cfg, layout):
    rx = make_receiver(cfg, layout)
    free0 = rx.num_free_pages
    data = random_pages(layout, 2, seed=3)
    open_room(rx, "d", 2 * P, 2)
    write_all(rx, "d", 0, data, np.array([0, 1]))
    kind, layer = layout.buffers()[0]
    pages = data[0][[1]]
    res = rx.write_pages(
        "d", 1, 0, kind, layer, np.array([1]), page_digests(pages), pages.tobytes()
    )
    assert res.status.state is RoomState.FAILED
    assert "position 1 of latent layer 0 was sent by prefill ranks 0 and 1" in res.status.reason
    assert rx.num_free_pages == free0


def test_commit_must_match_the_pages_written(cfg, layout):
    rx = make_receiver(cfg, layout)
    data = random_pages(layout, 2, seed=4)
    open_room(rx, "c", 2 * P, 1)
    write_all(rx, "c", 0, data, np.array([0]))
    snap = rx.commit("c", 0, 0, np.array([0, 1]), Aux(1, 0.0))
    assert snap.state is RoomState.FAILED and "lack [1]" in snap.reason


def test_digest_mismatch_fails_with_reason(cfg, layout):
    rx = make_receiver(cfg, layout)
    free0 = rx.num_free_pages
    data = random_pages(layout, 2, seed=5)
    open_room(rx, "g", 2 * P, 1)
    kind, layer = layout.buffers()[1]
    pages = data[1][[0, 1]].copy()
    digests = page_digests(pages)
    pages[1, 7] ^= 0x40  # one flipped bit after the digest was taken
    with pytest.raises(DigestMismatchError, match="position 1"):
        rx.write_pages("g", 0, 0, kind, layer, np.array([0, 1]), digests, pages.tobytes())
    snap = rx.status("g")
    assert (
        snap.state is RoomState.FAILED
        and "digest mismatch on index_k layer 0 position 1" in snap.reason
    )
    assert rx.num_free_pages == free0


def test_idempotent_retries_and_attempts(cfg, layout):
    rx = make_receiver(cfg, layout)
    data = random_pages(layout, 2, seed=6)
    other = random_pages(layout, 2, seed=7)
    dst = open_room(rx, "i", 2 * P, 1)
    kind, layer = layout.buffers()[0]

    def put(src, attempt, positions=(0, 1)):
        pages = src[0][list(positions)]
        return rx.write_pages(
            "i", 0, attempt, kind, layer, np.array(positions), page_digests(pages), pages.tobytes()
        )

    res = put(data, 1)
    assert (res.written, res.duplicate) == (2, 0)
    res = put(data, 1)  # a retry of the same attempt: accepted, ignored
    assert (res.written, res.duplicate) == (0, 2)
    res = put(other, 0)  # an older attempt: ignored, staging keeps attempt 1
    assert (res.written, res.duplicate) == (0, 2)
    res = put(other, 2, (1,))  # a newer attempt replaces the page
    assert (res.written, res.duplicate) == (1, 0)
    staged = rx.staging("i")[0]
    np.testing.assert_array_equal(staged[0], data[0][0])
    np.testing.assert_array_equal(staged[1], other[0][1])
    res = put(data, 2, (1,))  # same attempt, different bytes: a conflict
    assert res.status.state is RoomState.FAILED and "different bytes" in res.status.reason
    assert dst.size == 2


def test_late_write_after_abort_is_rejected_without_touching_memory(cfg, layout):
    rx = make_receiver(cfg, layout)
    free0 = rx.num_free_pages
    data = random_pages(layout, 2, seed=8)
    open_room(rx, "l", 2 * P, 1)
    write_all(rx, "l", 0, data, np.array([0]))
    staging = rx.staging("l")
    before = [s.copy() for s in staging]
    pool_before = [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(rx.pool)]
    rx.abort("l", "client went away")
    assert rx.staging("l") is None and rx.num_free_pages == free0
    for kind, layer in layout.buffers():
        with pytest.raises(RoomClosedError, match="late write rejected"):
            b = layout.buffers().index((kind, layer))
            pages = data[b][[1]]
            rx.write_pages(
                "l", 0, 0, kind, layer, np.array([1]), page_digests(pages), pages.tobytes()
            )
    for s, b in zip(staging, before, strict=True):
        np.testing.assert_array_equal(s, b)
    for x, b in zip(jax.tree_util.tree_leaves(rx.pool), pool_before, strict=True):
        np.testing.assert_array_equal(np.asarray(x), b)


def test_handshake_refuses_layout_mismatch_before_data_moves(cfg, layout):
    rx = make_receiver(cfg, layout)
    free0 = rx.num_free_pages
    dst = rx.allocate_pages(2)
    rx.register_room("h", dst, 2 * P, 2)
    bad = dataclasses.replace(layout, latent_dtype="bfloat16", page_size=2 * P)
    res = rx.handshake("h", 0, 2, 2 * P, bad)
    assert not res.accepted and res.status.state is RoomState.FAILED
    assert any("latent_dtype: 'float32' != 'bfloat16'" in m for m in res.mismatches)
    assert any("page_size: 16 != 32" in m for m in res.mismatches)
    assert "refused before any data moved" in res.status.reason
    assert rx.staging("h") is None and rx.num_free_pages == free0
    # Another protocol version is an error of its own; cp size / token count mismatch too.
    rx.register_room("v", rx.allocate_pages(1), P, 1)
    with pytest.raises(ProtocolVersionError, match="protocol version 99"):
        rx.handshake("v", 0, 1, P, dataclasses.replace(layout, protocol_version=99))
    assert rx.status("v").state is RoomState.FAILED
    rx.register_room("n", rx.allocate_pages(1), P, 1)
    res = rx.handshake("n", 0, 2, P + 1, layout)
    assert res.mismatches == ("cp_size: 1 != 2", "num_tokens: 16 != 17")
    assert rx.num_free_pages == free0


def test_chunk_sections_of_several_buffers(cfg, layout):
    """One chunk carrying pages of three buffers (protocol v2): each section lands at its
    positions in its own buffer; a chunk whose sections need more or fewer bytes than it
    carries is refused with the room untouched; a bad digest in a later section fails the
    room naming that section's buffer and position."""
    rx = make_receiver(cfg, layout)
    rx.register_room("s", rx.allocate_pages(3), 3 * P, 1)
    rx.handshake("s", 0, 1, 3 * P, layout)
    data = random_pages(layout, 3, seed=13)
    picks = {0: [2, 0], 1: [1], 2: [0, 1, 2]}
    sections = [
        PageSection(*layout.buffers()[b], np.array(pos), page_digests(data[b][pos]))
        for b, pos in picks.items()
    ]
    payload = b"".join(data[b][pos].tobytes() for b, pos in picks.items())
    for bad in (payload[:-1], payload + b"x"):
        with pytest.raises(BadRequestError, match=r"its 3 section\(s\) need"):
            rx.write_chunk("s", 0, 0, sections, bad)
    assert rx.status("s").state is RoomState.WAITING_FOR_INPUT and rx.staging("s") is None
    res = rx.write_chunk("s", 0, 0, sections, payload)
    assert (res.written, res.duplicate) == (6, 0)
    staged = rx.staging("s")
    for b, pos in picks.items():
        np.testing.assert_array_equal(staged[b][pos], data[b][pos])
    assert rx.write_chunk("s", 0, 0, sections, payload).duplicate == 6  # a resend

    rx.register_room("t", rx.allocate_pages(3), 3 * P, 1)
    rx.handshake("t", 0, 1, 3 * P, layout)
    digests = sections[2].digests.copy()
    digests[-1] ^= np.uint64(1)  # position 2's
    wrong = dataclasses.replace(sections[2], digests=digests)
    with pytest.raises(DigestMismatchError, match="position 2 from prefill rank 0"):
        rx.write_chunk(
            "t",
            0,
            0,
            [sections[1], wrong],
            payload[sections[0].positions.size * layout.page_bytes(*layout.buffers()[0]) :],
        )
    reason = rx.status("t").reason
    assert f"{layout.buffers()[2][0]} layer {layout.buffers()[2][1]}" in reason


def test_writes_need_handshake_and_valid_chunks(cfg, layout):
    rx = make_receiver(cfg, layout, max_chunk_bytes=3000)
    rx.register_room("w", rx.allocate_pages(2), 2 * P, 2)
    rx.handshake("w", 0, 2, 2 * P, layout)
    data = random_pages(layout, 2, seed=9)
    kind, layer = layout.buffers()[0]
    one = data[0][[0]]
    with pytest.raises(NotHandshakenError):
        rx.write_pages("w", 1, 0, kind, layer, np.array([0]), page_digests(one), one.tobytes())
    with pytest.raises(BadRequestError, match="outside"):
        rx.write_pages("w", 0, 0, kind, layer, np.array([5]), page_digests(one), one.tobytes())
    with pytest.raises(BadRequestError, match="no index_k buffer for layer 2"):
        rx.write_pages("w", 0, 0, "index_k", 2, np.array([0]), page_digests(one), one.tobytes())
    with pytest.raises(BadRequestError, match="expected one digest"):
        rx.write_pages("w", 0, 0, kind, layer, np.array([0]), page_digests(one), one.tobytes()[:-1])
    two = data[0][[0, 1]]
    with pytest.raises(ChunkTooLargeError, match="over the 3000 B limit"):
        rx.write_pages("w", 0, 0, kind, layer, np.array([0, 1]), page_digests(two), two.tobytes())
    with pytest.raises(BadRequestError, match="sender rank 4"):
        rx.heartbeat("w", 4)
    assert rx.status("w").state is RoomState.BOOTSTRAPPING  # bad chunks leave the room alone


def test_timeouts_bootstrap_waiting_heartbeat(cfg, layout):
    clock = FakeClock()
    rx = make_receiver(cfg, layout, clock=clock)
    free0 = rx.num_free_pages
    rx.register_room("boot", rx.allocate_pages(1), P, 2)
    rx.handshake("boot", 0, 2, P, layout)
    open_room(rx, "wait", P, 1)
    open_room(rx, "beat", 2 * P, 2)
    data = random_pages(layout, 2, seed=10)
    write_all(rx, "beat", 0, data, np.array([0]))
    rx.commit("beat", 0, 0, np.array([0]), Aux(1, 0.0))  # committed: no heartbeat needed
    clock.t += 1.9
    rx.heartbeat("boot", 0)
    rx.heartbeat("wait", 0)
    assert rx.poll_timeouts() == []
    clock.t += 0.2  # rank 1 of "beat" silent 2.1 s > 2 s; the others beat 0.2 s ago
    assert rx.poll_timeouts() == ["beat"]
    assert "heartbeat timeout: prefill rank(s) [1]" in rx.status("beat").reason
    for _ in range(50):
        clock.t += 0.1
        rx.heartbeat("boot", 0)
        rx.heartbeat("wait", 0)
        rx.poll_timeouts()
    assert "bootstrap timeout: prefill rank(s) [1] did not handshake" in rx.status("boot").reason
    assert "waiting timeout: no page arrived within 5s" in rx.status("wait").reason
    assert rx.num_free_pages == free0
