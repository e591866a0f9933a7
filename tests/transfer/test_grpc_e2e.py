"""PD transfer over gRPC end to end on 8 virtual devices (SPEC S2).

CP shared-KV prefill of the tiny model -> 8 gRPC senders -> one receiver writing a
single-device decode pool at shuffled decode pages: the decode-side full layout equals
the prefill full view bitwise, and decoding from it reproduces the single-device
reference. Rooms bootstrapped ahead (senders handshake before the page table exists),
and host pools whose sealed digests travel instead of digests taken at send time.

(Until the tests were split by topic, part of tests/test_transfer_grpc.py.)
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from support.transfer import (
    CP,
    SENDER,
    TIMEOUTS,
    WAIT,
    Decode,
    P,
    Prefill,
    assert_decode_layout_is,
    assert_decodes_like_reference,
    decode_pages,
    expected_pages,
    finish,
    host_pool_sources,
    new_table,
    prefill_free,
    run_transfer,
    settle,
)

from cpkv_jax.lane_allocator import RequestPageTable
from cpkv_jax.mesh import DP_AXIS
from cpkv_jax.paging import pages_for_tokens
from transfer.backends import grpc_backend as gb
from transfer.backends.grpc_backend import GrpcBackend
from transfer.hold import RequestInputs, TransferHold
from transfer.page_plan import page_digests
from transfer.page_source import CPPoolPageSource
from transfer.protocol import Aux, RoomState
from transfer.sender import bootstrap_request, rank_jobs, send_request

logger = logging.getLogger(__name__)


def test_e2e_cp_prefill_to_decode_matches_full_view_and_reference(prefill, decode):
    pre = prefill
    free_prefill = pre.runner.allocator.num_free_per_lane().sum()
    held = sum(t.num_pages for t in pre.tables)
    views = [pre.runner.full_view(t) for t in pre.tables]  # before the holds release them
    steps = 4
    dec = decode(9)  # one request at a time: 8 usable pages, as the reference allocates
    for i, (prompt, table) in enumerate(zip(pre.prompts, pre.tables, strict=True)):
        n, n_pages = len(prompt), table.num_pages
        extra = pages_for_tokens(n + steps, P) - n_pages
        t0 = time.perf_counter()
        hold, dst = run_transfer(pre, dec, table, f"e2e-{i}", pre.aux[i], extra_pages=extra, seed=i)
        outcome = hold.wait(WAIT)
        logger.info("e2e transfer of %d tokens: %.2fs", n, time.perf_counter() - t0)
        assert outcome is not None and outcome.state is RoomState.SUCCESS, outcome
        snap = dec.receiver.status(f"e2e-{i}")
        assert snap.state is RoomState.SUCCESS and snap.aux == pre.aux[i]
        assert all(o is not None and o.state is RoomState.SUCCESS for o in hold.outcomes().values())
        assert np.any(np.diff(dst[:n_pages]) != 1)  # really non-contiguous decode pages
        assert_decodes_like_reference(pre, dec.receiver, dst, prompt, views[i], pre.aux[i], steps)
        dec.receiver.free_pages(dst)  # the decode request is done
    assert pre.runner.allocator.num_free_per_lane().sum() == free_prefill + held
    assert dec.receiver.num_free_pages == dec.free0


def test_cp_prefill_to_one_rank_of_a_dp_decode_pool(prefill, decode):
    """PD into a rank (issue 36 item 4): the decode pool is split over 4 DP ranks; the
    room's pages all come from rank 2's shard (global ids); the receiver's commit
    scatter writes them there, the pool keeps its per-rank sharding (the DP steps are
    compiled for it), and the layout equals the prefill full view bitwise."""
    pre = prefill
    dec = decode(12, dp=4)
    table = new_table(pre, 3 * P + 5)
    view = pre.runner.full_view(table)
    n, n_pages = table.num_tokens, table.num_pages  # the hold releases `table`
    dst = dec.receiver.allocate_pages(n_pages, 2)
    assert ((dst >= 2 * 12) & (dst < 3 * 12)).all()
    dec.receiver.register_room("dp-rank-2", dst, table.num_tokens, CP)
    sources = [CPPoolPageSource(lambda: pre.runner.pool, pre.layout, r) for r in range(CP)]
    jobs = rank_jobs(
        "dp-rank-2",
        dec.target,
        pre.layout,
        table.num_tokens,
        table.local_pages(),
        sources,
        Aux(5, -0.5),
    )
    hold = send_request(GrpcBackend(SENDER), jobs, lambda _: pre.runner.release(table))
    assert finish(hold).state is RoomState.SUCCESS
    # Read on the host: a jitted gather from the sharded pool sums the shards' partial
    # rows, which turns a -0.0 into +0.0 (the pool itself holds the sent bits).
    for got, want in zip(
        jax.tree_util.tree_leaves(dec.receiver.pool), jax.tree_util.tree_leaves(view), strict=True
    ):
        rows = np.asarray(got)[dst[:n_pages]].reshape((n_pages * P, *got.shape[2:]))[:n]
        assert rows.tobytes() == np.asarray(want).tobytes()
    for leaf in jax.tree_util.tree_leaves(dec.receiver.pool):
        assert leaf.sharding.spec == PartitionSpec(DP_AXIS), leaf.sharding
    free = dec.receiver.num_free_pages_per_rank
    assert free == (11, 11, 11 - n_pages, 11)
    dec.receiver.free_pages(dst)
    assert dec.receiver.num_free_pages_per_rank == (11,) * 4


def bootstrap_room(
    pre: Prefill, dec: Decode, table: RequestPageTable, room: str, num_tokens: int | None = None
) -> tuple[TransferHold, np.ndarray]:
    """Register `room` (for `num_tokens`, default the table's) at shuffled decode pages
    and bootstrap its 8 senders without inputs; the hold releases `table`."""
    dst = np.random.default_rng(len(room)).permutation(dec.receiver.allocate_pages(table.num_pages))
    dec.receiver.register_room(room, dst, num_tokens or table.num_tokens, CP)
    sources = [CPPoolPageSource(lambda: pre.runner.pool, pre.layout, r) for r in range(CP)]
    jobs = rank_jobs(room, dec.target, pre.layout, table.num_tokens, None, sources, None)
    hold = bootstrap_request(GrpcBackend(SENDER), jobs, lambda _: pre.runner.release(table))
    return hold, dst


def test_bootstrap_ahead_waits_for_inputs_then_sends(prefill, decode):
    """`bootstrap_request` (a prefill server at admission): every rank handshakes and
    heartbeats with no page table yet; the room waits for input past the heartbeat
    timeout with nothing staged; `provide` sends it, and the decode layout equals the
    prefill full view bitwise."""
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)
    table = new_table(pre, 5 * P + 9)
    view = pre.runner.full_view(table)
    hold, dst = bootstrap_room(pre, dec, table, "boot")
    assert hold.wait_ready(WAIT) and hold.inputs is None
    time.sleep(TIMEOUTS.heartbeat + 0.5)  # alive on heartbeats alone
    assert dec.receiver.status("boot").state is RoomState.WAITING_FOR_INPUT
    assert dec.receiver.staging("boot") is None and not hold.released  # nothing moved
    aux = Aux(7, -0.25, cached_tokens=48, host_cached_tokens=16)  # all four fields on the wire
    assert hold.provide(table.local_pages(), aux)
    outcome = finish(hold)
    assert outcome.state is RoomState.SUCCESS and dec.receiver.status("boot").aux == aux
    assert_decode_layout_is(dec.receiver, dst, view, "bootstrapped room")
    with pytest.raises(ValueError, match="provided twice"):
        hold.provide(table.local_pages(), aux)
    dec.receiver.free_pages(dst)
    assert prefill_free(pre) == free and dec.receiver.num_free_pages == dec.free0


def test_bootstrap_ahead_fails_early_and_refuses_misuse(prefill, decode):
    """A room refused at the handshake releases the hold before the prefill provides
    anything (`provide` -> False); a cancel while the senders wait aborts the room on
    the decode side; jobs with and without inputs go to the right entry point only."""
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)
    refused = new_table(pre, 3 * P + 1)
    hold, _ = bootstrap_room(pre, dec, refused, "boot-refused", num_tokens=3 * P + 2)
    outcome = finish(hold)
    assert outcome.state is RoomState.FAILED and "num_tokens: 50 != 49" in outcome.reason
    assert not hold.provide(refused.local_pages(), Aux(1, -1.0)) and hold.inputs is None

    waiting = new_table(pre, 2 * P)
    hold, _ = bootstrap_room(pre, dec, waiting, "boot-cancel")
    assert hold.wait_ready(WAIT)
    hold.cancel("the client went away")
    outcome = finish(hold)
    assert outcome.state is RoomState.FAILED and "the client went away" in outcome.reason
    snap = settle(dec.receiver, "boot-cancel")
    assert snap.state is RoomState.FAILED and "the client went away" in snap.reason
    assert not hold.provide(waiting.local_pages(), Aux(1, -1.0))
    assert prefill_free(pre) == free and dec.receiver.num_free_pages == dec.free0

    sources = [CPPoolPageSource(lambda: pre.runner.pool, pre.layout, r) for r in range(CP)]
    bare = rank_jobs("x", dec.target, pre.layout, 16, None, sources, None)
    full = rank_jobs("x", dec.target, pre.layout, 16, np.arange(1), sources, Aux(1, -1.0))
    with pytest.raises(ValueError, match="use bootstrap_request"):
        send_request(GrpcBackend(SENDER), bare, lambda _: None)
    with pytest.raises(ValueError, match="already have a page table"):
        bootstrap_request(GrpcBackend(SENDER), full, lambda _: None)
    with pytest.raises(ValueError, match="both src_local_pages and aux"):
        rank_jobs("x", dec.target, pre.layout, 16, np.arange(1), sources, None)
    with pytest.raises(ValueError, match="rank 0 needs the aux data"):
        bare[0].with_inputs(RequestInputs(np.arange(1), None))


def test_host_pool_seal_unseal_and_sealed_digests(prefill):
    """`seal` takes each page's digest of every buffer once; `sealed_digests` returns them
    only when every asked page is sealed; `unseal` forgets them; bad pages are refused."""
    pre = prefill
    src = host_pool_sources(pre, seed=3)[0]
    key = pre.layout.buffers()[-1]
    leaf = src.host_buffer(*key)
    assert src.sealed_digests(*key, np.array([1, 2])) is None  # nothing sealed yet
    src.seal([1, 2, 5])
    got = src.sealed_digests(*key, np.array([5, 1]))
    assert got is not None and got.dtype == np.uint64
    np.testing.assert_array_equal(got, page_digests(leaf[[5, 1]]))
    assert src.sealed_digests(*key, np.array([1, 3])) is None  # page 3 is not sealed
    src.unseal([1])
    assert src.sealed_digests(*key, np.array([1])) is None
    assert src.sealed_digests(*key, np.array([2, 5])) is not None
    src.seal()  # every page
    assert src.sealed_digests(*key, np.arange(leaf.shape[0])) is not None
    with pytest.raises(ValueError, match="outside the pool"):
        src.seal([leaf.shape[0]])


def test_sealed_host_pool_sends_its_digests_and_decode_still_checks(prefill, decode):
    """A sealed host pool's digests travel instead of digests taken at send time; the
    decode side still checks every page on arrival: a page rewritten after its seal fails
    the room with a digest mismatch (never goes through as good), and one unsealed
    before it is rewritten is hashed at send time again - the room succeeds bitwise."""
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)
    sources = host_pool_sources(pre, seed=4)
    for s in sources:
        s.seal()
    hashed_at_send: list[int] = []
    real = gb.row_digests
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gb, "row_digests", lambda *a: hashed_at_send.append(1) or real(*a))
        table = new_table(pre, 9 * P + 5)
        want = expected_pages(sources, pre.layout, table)
        hold, dst = run_transfer(pre, dec, table, "sealed", Aux(2, -0.5), sources=sources)
        assert finish(hold).state is RoomState.SUCCESS
        assert not hashed_at_send  # every digest came from the seal
        for got, exp in zip(decode_pages(dec.receiver, dst), want, strict=True):
            np.testing.assert_array_equal(got, exp)
        dec.receiver.free_pages(dst)

        # Rewritten while sealed: the stale digest is caught on arrival.
        table = new_table(pre, 9 * P)
        rank, local = 3, int(table.local_pages()[3])  # position 3 lives on rank 3
        leaf = sources[rank].host_buffer("latent", 1)
        leaf[local, 7] ^= 0xFF
        hold, _ = run_transfer(pre, dec, table, "stale-seal", Aux(2, -0.5), sources=sources)
        outcome = finish(hold)
        assert outcome.state is RoomState.FAILED, outcome
        assert "digest mismatch on latent layer 1 position 3" in outcome.reason
        assert "from prefill rank 3" in outcome.reason
        assert prefill_free(pre) == free and dec.receiver.num_free_pages == dec.free0

        # Unsealed, rewritten (as the contract says): hashed at send, good again.
        sources[rank].unseal([local])
        leaf[local, 8] ^= 0xFF
        table = new_table(pre, 9 * P)
        want = expected_pages(sources, pre.layout, table)
        hold, dst = run_transfer(pre, dec, table, "resealed", Aux(2, -0.5), sources=sources)
        assert finish(hold).state is RoomState.SUCCESS
        assert hashed_at_send  # rank 3's buffers, whose pages are not all sealed now
        for got, exp in zip(decode_pages(dec.receiver, dst), want, strict=True):
            np.testing.assert_array_equal(got, exp)
        dec.receiver.free_pages(dst)
    assert prefill_free(pre) == free and dec.receiver.num_free_pages == dec.free0
