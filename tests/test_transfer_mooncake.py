"""PD transfer with the Mooncake backend (SPEC S2): staging arena, quarantine, end to end, faults.

- The staging arena and the receiver's region logic without an engine: owner-major
  rows, digests checked at commit, quarantine of a failed room's region until every
  one-sided writer is done (or the quarantine timeout), fake clock.
- With the Mooncake Transfer Engine over loopback TCP (skipped, with the reason
  `mooncake_available()` gives, where the engine cannot load): end to end on 8 virtual
  devices exactly like the gRPC test - CP shared-KV prefill of the tiny model -> 8
  Mooncake senders writing into the decode receiver's registered staging arena -> one
  device scatter per buffer into a single-device decode pool at shuffled decode pages;
  the decode-side full layout equals the prefill full view bitwise and decoding from it
  reproduces the single-device reference. Then faults (corrupted page, missing and
  duplicated position, layout mismatch, sender killed, abort then late write), each
  ending with every allocator - prefill pages, decode pages, the decode staging arena
  and the sender's registered host buffer - back at its initial free count.
- Write retries: a transient engine failure (half the batch landed) is retried with the
  same attempt and destinations and the room succeeds bitwise; a write failing past
  `write_retries` fails the room.
- A randomized run of mixed faults (`CPKV_TRANSFER_FAULTS`, default 100 as for gRPC;
  about 40 s on 2 cores; `CPKV_TRANSFER_FAULT_SEED` picks another schedule), the decode
  side dying and transient write failures included.

The prefill fixture and helpers are the gRPC test module's (`test_transfer_grpc`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_transfer_grpc as grpc_tests
from test_transfer_grpc import (  # helpers shared with the gRPC tests
    CP,
    INDEX_K,
    LENGTHS,
    TIMEOUTS,
    FakeClock,
    Prefill,
    _with_positions,
    assert_decode_layout_is,
    bitwise_equal,
    decode_dies_before_commit,
    duplicate_position_plan,
    fault_schedule,
    finish,
    heartbeat_loss_seen,
    log_fault_run,
    missing_position_plan,
    new_table,
    prefill_free,
    random_pages,
    run_transfer,
    settle,
)

from cpkv_jax.model.kv_cache import init_pool
from cpkv_jax.paging import PageAllocator, pages_for_tokens
from serving.server_args import ServerArgs
from transfer.backends import make_backend
from transfer.backends.mooncake_backend import (
    MooncakeBackend,
    MooncakeBackendConfig,
    MooncakeReceiverEndpoint,
)
from transfer.backends.mooncake_engine import (
    MooncakeEngine,
    MooncakeTransferError,
    mooncake_available,
)
from transfer.backends.mooncake_sender import MooncakeSenderFaults, coalesce
from transfer.page_plan import owner_major_order, page_digests, row_digests
from transfer.protocol import Aux, RoomState
from transfer.receiver import Receiver, pow2_pieces, serve, staging_region_bytes
from transfer.staging_arena import StagingArena, StagingFullError

logger = logging.getLogger(__name__)

# The gRPC tests' fixtures: the tiny model config, its layout, the CP prefill.
cfg = grpc_tests.cfg
layout = grpc_tests.layout
prefill = grpc_tests.prefill

P = 16
AVAILABLE, REASON = mooncake_available()
needs_mooncake = pytest.mark.skipif(
    not AVAILABLE, reason=f"Mooncake Transfer Engine unavailable: {REASON}"
)
ARENA_BYTES = 4 << 20  # decode staging arena: rooms here are <= 16 pages of 17 KiB
QUARANTINE_S = 2.0  # decode side: a silent writer's region is reused after this
CONFIG = MooncakeBackendConfig(
    transfer_timeout_s=5.0,
    host_buffer_bytes=1 << 20,
    write_group_bytes=16 * 1024,  # several batch writes per rank, so hooks fire between
    rpc_timeout_s=10.0,
    max_retries=2,
    retry_backoff_s=0.02,
    heartbeat_interval_s=0.1,
    heartbeat_timeout_s=2.0,
    bootstrap_timeout_s=3.0,
    write_retry_backoff_s=0.01,
    uncertain_hold_s=0.5,  # a failed write's host region comes back fast (tests check it)
)


def test_mooncake_availability_is_reported():
    """Printed so a CI log shows why the engine tests below skip, if they do."""
    ok, reason = mooncake_available()
    print(f"Mooncake available: {ok}" + (f" ({reason})" if reason else ""))
    assert ok == (reason == "")


# ---- staging arena (no engine) ------------------------------------------------------------


def test_arena_first_fit_coalesces_and_quarantines():
    arena = StagingArena(64 * 1024, alignment=4096, prefault=False)
    a = arena.alloc(5000, "a")  # rounded up to 8 KiB
    b = arena.alloc(4096, "b")
    c = arena.alloc(4096, "c")
    assert (a.offset, a.nbytes, b.offset, c.offset) == (0, 8192, 8192, 12288)
    assert arena.view(b).ctypes.data == arena.address + 8192
    arena.quarantine(b)
    assert arena.is_quarantined(b) and arena.stats().quarantined_bytes == 4096
    arena.free(a)
    d = arena.alloc(8192, "d")  # a's range again; b is still out of use
    assert d.offset == 0
    with pytest.raises(StagingFullError, match="1 quarantined"):
        arena.alloc(60 * 1024, "big")
    for r in (b, c, d):
        arena.free(r)
    s = arena.stats()
    assert s.free_bytes == s.largest_free_bytes == arena.nbytes  # coalesced back to one range
    with pytest.raises(ValueError, match="not a live or quarantined region"):
        arena.free(b)


def test_coalesce_runs():
    s, d, c = coalesce(np.array([4, 5, 6, 9, 10]), np.array([0, 1, 2, 3, 4]))
    assert s.tolist() == [4, 9] and d.tolist() == [0, 3] and c.tolist() == [3, 2]
    s, d, c = coalesce(np.array([1, 2, 3]), np.array([7, 9, 10]))
    assert c.tolist() == [1, 2]


# ---- the receiver's region logic with a fake endpoint (no engine) ----------------------------


@dataclasses.dataclass
class FakeEndpoint:
    """A `StagingEndpoint` without an engine: tests write into regions with numpy."""

    arena: StagingArena
    session_id: str = "127.0.0.1:1"
    protocol: str = "tcp"
    quarantine_timeout_s: float = 10.0


def region_receiver(cfg, layout, clock, pages=16):
    ep = FakeEndpoint(StagingArena(ARENA_BYTES, prefault=False))
    pool = init_pool(cfg, pages, P, jnp.float32, INDEX_K)
    rx = Receiver(layout, pool, PageAllocator(pages), timeouts=TIMEOUTS, clock=clock, mooncake=ep)
    return rx, ep


def one_sided_write(ep, region, data, positions):
    """What a Mooncake sender's engine does: bytes straight into the region's rows, by
    address (the receiver is not asked, and cannot refuse)."""
    for b, pages in enumerate(data):
        nb = pages.shape[1]
        off = region.buffer_addrs[b] - ep.arena.address
        rows = ep.arena.memory[off : off + region.row_count * nb].reshape(-1, nb)
        rows[region.rows[positions]] = pages[positions]


def digests_of(data, positions):
    return np.concatenate([page_digests(d[positions]) for d in data])


def test_region_owner_major_rows_digests_and_scatter(cfg, layout):
    rx, ep = region_receiver(cfg, layout, FakeClock())
    n_tok, cp = 5 * P + 3, 2
    n = pages_for_tokens(n_tok, P)
    data = random_pages(layout, n, seed=11)
    dst = rx.allocate_pages(n)[::-1].copy()
    rx.register_room("m", dst, n_tok, cp)
    res = rx.handshake("m", 1, cp, n_tok, layout, data_plane="mooncake")
    assert res.accepted and res.status.state is RoomState.TRANSFERRING
    region = res.region
    assert region is not None and region.session_id == ep.session_id
    # Owner-major: rank 0's positions 0, 2, 4 take rows 0-2, rank 1's 1, 3, 5 rows 3-5.
    np.testing.assert_array_equal(region.rows[owner_major_order(n, cp)], np.arange(n))
    assert region.row_count == n  # exactly the room's 6 pages, scattered as 4 + 2
    staging = rx.staging("m")
    assert [int(s.ctypes.data) for s in staging] == list(region.buffer_addrs)
    assert rx.handshake("m", 0, cp, n_tok, layout, data_plane="mooncake").region == region
    mine = {r: np.arange(r, n, cp) for r in range(cp)}
    for r in (1, 0):
        one_sided_write(ep, region, data, mine[r])
    snap = rx.commit("m", 1, 0, mine[1], digests=digests_of(data, mine[1]))
    assert snap.state is RoomState.TRANSFERRING
    snap = rx.commit("m", 0, 0, mine[0], Aux(9, -0.5), digests=digests_of(data, mine[0]))
    assert snap.state is RoomState.SUCCESS, snap.reason
    pool = rx.pool
    for b, (kind, layer) in enumerate(layout.buffers()):
        leaf = np.asarray(getattr(pool, kind)[layout.leaf_index(kind, layer)])
        np.testing.assert_array_equal(leaf[dst].reshape(n, -1).view(np.uint8), data[b])
    assert ep.arena.free_bytes == ep.arena.nbytes  # success frees the region at once


def test_region_digest_mismatch_and_quarantine_until_writers_done(cfg, layout):
    clock = FakeClock()
    rx, ep = region_receiver(cfg, layout, clock)
    free0 = rx.num_free_pages
    n_tok, cp = 4 * P, 2
    data = random_pages(layout, 4, seed=12)
    rx.register_room("q", rx.allocate_pages(4), n_tok, cp)
    region = rx.handshake("q", 0, cp, n_tok, layout, data_plane="mooncake").region
    rx.handshake("q", 1, cp, n_tok, layout, data_plane="mooncake")
    one_sided_write(ep, region, data, np.array([0, 2]))
    sent = digests_of(data, np.array([0, 2]))
    rx.staging("q")[1][region.rows[2], 5] ^= 0x10  # flipped in transit
    snap = rx.commit("q", 0, 0, np.array([0, 2]), Aux(1, 0.0), digests=sent)
    assert snap.state is RoomState.FAILED
    assert "digest mismatch on index_k layer 0 position 2 from prefill rank 0" in snap.reason
    assert rx.num_free_pages == free0  # decode pages freed at once
    # Rank 1 got the region's address and has not said it is done: quarantined.
    assert rx.quarantined_rooms() == {"q": (1,)}
    assert ep.arena.stats().quarantined_regions == 1
    one_sided_write(ep, region, data, np.array([1, 3]))  # a late write lands there only
    rx.heartbeat("q", 1, writes_done=True)
    assert rx.quarantined_rooms() == {} and ep.arena.free_bytes == ep.arena.nbytes

    # A silent writer: the region is reused only after the quarantine timeout.
    rx.register_room("s", rx.allocate_pages(1), P, 1)
    rx.handshake("s", 0, 1, P, layout, data_plane="mooncake")
    rx.abort("s", "decode request cancelled")
    assert rx.quarantined_rooms() == {"s": (0,)}
    clock.t += ep.quarantine_timeout_s - 0.1
    rx.poll_timeouts()
    assert rx.quarantined_rooms() == {"s": (0,)}
    clock.t += 0.2
    rx.poll_timeouts()
    assert rx.quarantined_rooms() == {} and ep.arena.free_bytes == ep.arena.nbytes
    assert rx.num_free_pages == free0


def test_region_refusals(cfg, layout):
    clock = FakeClock()
    rx, ep = region_receiver(cfg, layout, clock)
    # A Mooncake rank cannot come back as a new incarnation (its writes are unfenced).
    rx.register_room("a", rx.allocate_pages(2), 2 * P, 1)
    assert rx.handshake("a", 0, 1, 2 * P, layout, attempt=0, data_plane="mooncake").accepted
    res = rx.handshake("a", 0, 1, 2 * P, layout, attempt=1, data_plane="mooncake")
    assert not res.accepted and "cannot be fenced" in res.status.reason
    assert rx.quarantined_rooms() == {"a": (0,)}
    rx.heartbeat("a", 0, writes_done=True)
    # The arena full: the handshake is retryable, the room untouched.
    hog = ep.arena.alloc(ep.arena.free_bytes, "hog")
    rx.register_room("b", rx.allocate_pages(2), 2 * P, 1)
    with pytest.raises(StagingFullError, match="staging arena full"):
        rx.handshake("b", 0, 1, 2 * P, layout, data_plane="mooncake")
    assert rx.status("b").state is RoomState.BOOTSTRAPPING
    ep.arena.free(hog)
    assert rx.handshake("b", 0, 1, 2 * P, layout, data_plane="mooncake").accepted
    rx.abort("b", "done")
    rx.heartbeat("b", 0, writes_done=True)
    # A receiver without an endpoint refuses the Mooncake data plane before data moves.
    plain = Receiver(
        layout, init_pool(cfg, 4, P, jnp.float32, INDEX_K), PageAllocator(4), timeouts=TIMEOUTS
    )
    plain.register_room("c", plain.allocate_pages(1), P, 1)
    res = plain.handshake("c", 0, 1, P, layout, data_plane="mooncake")
    assert not res.accepted and "no Mooncake endpoint" in res.status.reason
    assert ep.arena.free_bytes == ep.arena.nbytes


def test_room_larger_than_the_whole_staging_arena_is_refused_at_once(cfg, layout):
    """A room whose staging can never fit the arena (even empty) is refused at its
    handshake with the reason, and its pages freed; one that fits but finds the arena
    busy stays retryable. `staging_bytes` is what `_ensure_staging` carves: the room's
    pages, buffer after buffer, each 4 KiB-aligned."""
    pages = 16
    pool = init_pool(cfg, pages, P, jnp.float32, INDEX_K)
    small = StagingArena(staging_region_bytes(layout, 4, 4096))
    ep = FakeEndpoint(small)
    rx = Receiver(
        layout, pool, PageAllocator(pages), timeouts=TIMEOUTS, clock=FakeClock(), mooncake=ep
    )
    assert rx.staging_bytes(4) == small.nbytes < rx.staging_bytes(5)
    free0 = rx.num_free_pages
    rx.register_room("long", rx.allocate_pages(5), 5 * P, 2)
    res = rx.handshake("long", 1, 2, 5 * P, layout, data_plane="mooncake")
    assert not res.accepted and res.status.state is RoomState.FAILED
    assert "need" in res.status.reason and "--transfer-staging-size" in res.status.reason
    assert rx.num_free_pages == free0 and small.free_bytes == small.nbytes
    rx.register_room("fits", rx.allocate_pages(4), 4 * P - 3, 2)  # the whole arena
    hog = small.alloc(4096, "hog")  # another room's region: busy, not too small
    with pytest.raises(StagingFullError, match="staging arena full"):
        rx.handshake("fits", 0, 2, 4 * P - 3, layout, data_plane="mooncake")
    small.free(hog)
    assert rx.handshake("fits", 0, 2, 4 * P - 3, layout, data_plane="mooncake").accepted
    rx.abort("fits", "done")
    for rank in (0, 1):
        rx.heartbeat("fits", rank, writes_done=True)
    assert rx.num_free_pages == free0 and small.free_bytes == small.nbytes


def test_host_only_receiver_hands_verified_rows_to_the_sink(layout):
    ep = FakeEndpoint(StagingArena(ARENA_BYTES, prefault=False))
    got = {}
    rx = Receiver(
        layout,
        None,
        PageAllocator(16),
        timeouts=TIMEOUTS,
        clock=FakeClock(),
        mooncake=ep,
        host_sink=lambda room, pos, dst, st: got.update(
            {room: (pos.copy(), dst.copy(), [s.copy() for s in st])}
        ),
    )
    n = 3
    data = random_pages(layout, n, seed=13)
    dst = rx.allocate_pages(n)
    rx.register_room("h", dst, 3 * P, 2)
    region = rx.handshake("h", 0, 2, 3 * P, layout, data_plane="mooncake").region
    rx.handshake("h", 1, 2, 3 * P, layout, data_plane="mooncake")
    assert region.row_count == n  # no device scatter: no padding rows
    for r in (0, 1):
        pos = np.arange(r, n, 2)
        one_sided_write(ep, region, data, pos)
        rx.commit("h", r, 0, pos, Aux(1, 0.0) if r == 0 else None, digests_of(data, pos))
    assert rx.status("h").state is RoomState.SUCCESS
    pos, dst_rows, staged = got["h"]
    np.testing.assert_array_equal(pos, [0, 2, 1])
    np.testing.assert_array_equal(dst_rows, dst[pos])
    for b in range(len(data)):
        np.testing.assert_array_equal(staged[b], data[b][pos])
    with pytest.raises(ValueError, match="host-only"):
        _ = rx.pool


def test_pow2_pieces_sum_to_n_largest_first():
    for n in [0, 1, 2, 3, 7, 8, 2049, 1999]:
        parts = pow2_pieces(n)
        assert sum(parts) == n and parts == sorted(set(parts), reverse=True)
        assert all(p & (p - 1) == 0 for p in parts)
    assert pow2_pieces(2049) == [2048, 1]


def test_row_digests_equal_page_digests():
    a = np.random.default_rng(0).integers(0, 256, (6, 100), dtype=np.uint8)
    np.testing.assert_array_equal(row_digests(a, [4, 0, 5]), page_digests(a[[4, 0, 5]]))


def test_registry_and_factory_know_mooncake():
    assert MooncakeBackend.capabilities.supports_cp_shared_kv
    ServerArgs(
        model_path="unused",
        cp_size=8,
        enable_cp_shared_kv=True,
        disaggregation_mode="prefill",
        transfer_backend="mooncake",
    ).validate()
    with pytest.raises(ValueError, match="unknown transfer backend"):
        make_backend("slice")


# ---- with the engine: end to end and faults ----------------------------------------------------


@pytest.fixture(scope="module")
def endpoint():
    if not AVAILABLE:
        pytest.skip(f"Mooncake Transfer Engine unavailable: {REASON}")
    ep = MooncakeReceiverEndpoint(
        ARENA_BYTES, quarantine_timeout_s=QUARANTINE_S, transfer_timeout_s=5.0
    )
    yield ep
    ep.close()


@pytest.fixture(scope="module")
def sender_engine():
    if not AVAILABLE:
        pytest.skip(f"Mooncake Transfer Engine unavailable: {REASON}")
    engine = MooncakeEngine(transfer_timeout_s=5.0)
    yield engine
    engine.close()


@dataclasses.dataclass
class Decode:
    receiver: Receiver
    server: grpc.Server
    target: str
    free0: int
    arena: StagingArena


@pytest.fixture
def decode(cfg, layout, endpoint):
    """A receiver with the module's Mooncake endpoint, served on loopback."""

    def make(pages: int) -> Decode:
        pool = init_pool(cfg, pages, P, jnp.float32, INDEX_K)
        rx = Receiver(
            layout, pool, PageAllocator(pages), timeouts=TIMEOUTS, mooncake=endpoint
        ).start(interval=0.02)
        server, port = serve(rx)
        made.append(Decode(rx, server, f"127.0.0.1:{port}", rx.num_free_pages, endpoint.arena))
        return made[-1]

    made: list[Decode] = []
    assert endpoint.arena.free_bytes == endpoint.arena.nbytes
    yield make
    for d in made:
        d.server.stop(0)
        d.receiver.close()


@pytest.fixture
def backends(sender_engine):
    """`make(faults)`: a Mooncake backend on the module's sender engine."""
    made: list[MooncakeBackend] = []

    def make(faults: MooncakeSenderFaults | None = None) -> MooncakeBackend:
        made.append(MooncakeBackend(CONFIG, faults, engine=sender_engine))
        return made[-1]

    yield make
    for b in made:
        b.close()


def all_back(pre: Prefill, dec: Decode, free_prefill: int, backend: MooncakeBackend) -> None:
    """Every allocator at its initial free count (the arena after its quarantine), no
    preparation gate held."""
    assert prefill_free(pre) == free_prefill
    assert dec.receiver.num_free_pages == dec.free0
    deadline = time.monotonic() + QUARANTINE_S + 3.0
    while dec.arena.free_bytes != dec.arena.nbytes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert dec.arena.free_bytes == dec.arena.nbytes, (
        dec.arena.stats(),
        dec.receiver.quarantined_rooms(),
    )
    host = backend._host
    deadline = time.monotonic() + 2.0
    while host is not None and host.free_bytes != host.nbytes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert host is None or host.free_bytes == host.nbytes
    # Every rank let go of its peer's preparation gate, whatever ended it.
    assert not any(gate.locked() for gate in backend._prep_gates.values())


@needs_mooncake
def test_e2e_cp_prefill_to_decode_over_mooncake(prefill, decode, backends):
    pre = prefill
    free_prefill = prefill_free(pre)
    held = sum(t.num_pages for t in pre.tables)
    views = [pre.runner.full_view(t) for t in pre.tables]  # before the holds release them
    steps = 4
    dec = decode(9)  # one request at a time: 8 usable pages, as the reference allocates
    backend = backends()
    for i, (prompt, table) in enumerate(zip(pre.prompts, pre.tables, strict=True)):
        n, n_pages = len(prompt), table.num_pages
        assert n == LENGTHS[i]
        extra = pages_for_tokens(n + steps, P) - n_pages
        t0 = time.perf_counter()
        hold, dst = run_transfer(
            pre, dec, table, f"mc-e2e-{i}", pre.aux[i], backend=backend, extra_pages=extra, seed=i
        )
        outcome = finish(hold)
        logger.info("mooncake e2e transfer of %d tokens: %.2fs", n, time.perf_counter() - t0)
        assert outcome.state is RoomState.SUCCESS, outcome
        snap = dec.receiver.status(f"mc-e2e-{i}")
        assert snap.state is RoomState.SUCCESS and snap.aux == pre.aux[i]
        assert np.any(np.diff(dst[:n_pages]) != 1)  # really non-contiguous decode pages
        # Owner-major staging + a contiguous host copy: one descriptor per buffer per rank.
        stats = backend.stats(f"mc-e2e-{i}")
        assert set(stats) == set(range(min(CP, n_pages)))  # ranks that own pages wrote
        assert all(s.descriptors == len(pre.layout.buffers()) for s in stats.values())
        grpc_tests.assert_decodes_like_reference(
            pre, dec.receiver, dst, prompt, views[i], pre.aux[i], steps
        )
        dec.receiver.free_pages(dst)  # the decode request is done
    assert prefill_free(pre) == free_prefill + held
    assert dec.receiver.num_free_pages == dec.free0
    assert dec.arena.free_bytes == dec.arena.nbytes


@needs_mooncake
def test_prepare_registers_the_host_copy_buffer_up_front(sender_engine):
    """A prefill server calls `prepare()` at startup, so its first device-pool request
    does not allocate, pre-fault and register the host copy buffer on its critical path."""
    backend = MooncakeBackend(CONFIG, engine=sender_engine)
    try:
        assert backend._host is None  # lazy until asked
        backend.prepare()
        host = backend._host
        assert host is not None and host.nbytes == CONFIG.host_buffer_bytes
        assert host.free_bytes == host.nbytes
        backend.prepare()  # idempotent
        assert backend._host is host
    finally:
        backend.close()


@needs_mooncake
def test_room_larger_than_the_host_copy_buffer_takes_turns(prefill, decode, sender_engine):
    """Device pools go through the backend's registered host buffer (the copy path). A
    rank gives its region back once its writes are over, so a room whose ranks' copies
    together need several times the buffer still succeeds, bitwise, when the largest
    one fits alone. (Held until the room ended, the ranks with a region waited for that
    end and the others for space: the room failed after `host_buffer_wait_s`.)"""
    pre, dec = prefill, decode(32)
    free = prefill_free(pre)
    table = new_table(pre, 14 * P + 7)  # reuses pages holding real KV (the fixture's)
    view = pre.runner.full_view(table)  # before the hold releases the table
    page_bytes = [pre.layout.page_bytes(kind, layer) for kind, layer in pre.layout.buffers()]

    def copy_bytes(k: int) -> int:  # a rank's region: buffer after buffer, 4 KiB aligned
        return sum(-(-k * nb // 4096) * 4096 for nb in page_bytes)

    owned = np.bincount(table.owners(), minlength=CP)
    largest = copy_bytes(int(owned.max()))
    assert sum(copy_bytes(int(k)) for k in owned) > 3 * largest
    config = dataclasses.replace(CONFIG, host_buffer_bytes=largest, host_buffer_wait_s=5.0)
    backend = MooncakeBackend(config, engine=sender_engine)
    try:
        hold, dst = run_transfer(pre, dec, table, "mc-turns", Aux(3, -0.25), backend=backend)
        outcome = finish(hold)
        assert outcome.state is RoomState.SUCCESS, outcome
        stats = backend.stats("mc-turns")
        assert len(stats) == CP and not any(s.zero_copy for s in stats.values())
        assert_decode_layout_is(dec.receiver, dst, view, "room larger than the host buffer")
        dec.receiver.free_pages(dst)
        all_back(pre, dec, free, backend)
    finally:
        backend.close()


@needs_mooncake
@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "copied"])
def test_sealed_host_pool_over_mooncake(prefill, decode, sender_engine, zero_copy):
    """Host pools whose pages were sealed (`HostPoolPageSource.seal`), written from the
    registered pool (zero copy) or through the host copy buffer: the ranks send the
    sealed digests and hash nothing, the decode pool gets the pool's bytes, and the
    decode side still hashes every staged page: a page rewritten after its seal fails
    the room with a digest mismatch, every allocator back."""
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)
    min_descriptor = 1 if zero_copy else 1 << 40  # the tiny pages are far below 1 MiB
    config = dataclasses.replace(CONFIG, zero_copy_min_descriptor_bytes=min_descriptor)
    backend = MooncakeBackend(config, engine=sender_engine)
    try:
        sources = grpc_tests.host_pool_sources(pre, seed=5)
        for s in sources:
            s.seal()
        table = new_table(pre, 9 * P + 5)
        want = grpc_tests.expected_pages(sources, pre.layout, table)
        room = f"mc-sealed-{zero_copy}"
        hold, dst = run_transfer(
            pre, dec, table, room, Aux(2, -0.5), backend=backend, sources=sources
        )
        assert finish(hold).state is RoomState.SUCCESS
        stats = backend.stats(room)
        assert len(stats) == CP
        for st in stats.values():
            assert st.sealed_digests and st.digest_s == 0.0 and st.zero_copy == zero_copy, st
        for got, exp in zip(grpc_tests.decode_pages(dec.receiver, dst), want, strict=True):
            np.testing.assert_array_equal(got, exp)
        dec.receiver.free_pages(dst)

        table = new_table(pre, 9 * P)
        sources[3].host_buffer("latent", 1)[int(table.local_pages()[3]), 11] ^= 0x40
        hold, _ = run_transfer(
            pre, dec, table, f"{room}-stale", Aux(2, -0.5), backend=backend, sources=sources
        )
        outcome = finish(hold)
        assert outcome.state is RoomState.FAILED, outcome
        assert "digest mismatch on latent layer 1 position 3 from prefill rank 3" in outcome.reason
        all_back(pre, dec, free, backend)
    finally:
        backend.close()


@needs_mooncake
def test_fault_corrupted_page(prefill, decode, backends):
    pre, dec = prefill, decode(48)
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
def test_fault_missing_position(prefill, decode, backends):
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)

    def plan(p):
        if p.rank != 3:
            return p
        return _with_positions(p, p.positions[1:].tolist(), p.src_pages[1:].tolist())

    backend = backends(MooncakeSenderFaults(plan=plan))
    hold, _ = run_transfer(
        pre, dec, new_table(pre, 12 * P + 1), "miss", Aux(5, -1.0), backend=backend
    )
    outcome = finish(hold)
    assert outcome.state is RoomState.FAILED
    assert "positions [3] were sent by no rank" in outcome.reason
    all_back(pre, dec, free, backend)


@needs_mooncake
def test_fault_position_sent_by_two_ranks(prefill, decode, backends):
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)

    def plan(p):
        if p.rank != 1:
            return p
        return _with_positions(
            p, [0, *p.positions.tolist()], [p.src_pages[0], *p.src_pages.tolist()]
        )

    backend = backends(MooncakeSenderFaults(plan=plan))
    hold, _ = run_transfer(pre, dec, new_table(pre, 10 * P), "dup", Aux(5, -1.0), backend=backend)
    outcome = finish(hold)
    assert outcome.state is RoomState.FAILED
    # Both ranks wrote position 0's staging row (one-sided writes collide there): the
    # commit that comes second sees two writers, or the first sees the other's bytes.
    r = outcome.reason
    assert ("position 0 of" in r and "one rank" in r) or "digest mismatch" in r, r
    all_back(pre, dec, free, backend)


@needs_mooncake
def test_fault_layout_mismatch_refused_before_data_moves(prefill, decode, backends):
    pre, dec = prefill, decode(48)
    free = prefill_free(pre)
    writes: list[int] = []
    backend = backends(MooncakeSenderFaults(before_write=lambda s, g: writes.append(g)))
    wrong = dataclasses.replace(pre.layout, index_k_dtype="bfloat16", has_index_scale=False)
    hold, _ = run_transfer(
        pre, dec, new_table(pre, 4 * P), "layout", Aux(5, -1.0), backend=backend, layout=wrong
    )
    outcome = finish(hold)
    assert outcome.state is RoomState.FAILED and "refused before any data moved" in outcome.reason
    assert "index_k_dtype: 'float8_e4m3fn' != 'bfloat16'" in outcome.reason
    assert writes == []  # no rank wrote a byte
    assert dec.arena.stats().live_regions == dec.arena.stats().quarantined_regions == 0
    all_back(pre, dec, free, backend)


@needs_mooncake
def test_fault_sender_killed_mid_transfer(prefill, decode, backends):
    pre, dec = prefill, decode(48)
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
def test_fault_abort_then_late_write_stays_in_quarantine(prefill, decode, backends):
    pre, dec = prefill, decode(48)
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


# ---- write retries ------------------------------------------------------------------------------


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
    prefill, decode, sender_engine, monkeypatch
):
    """Every rank's first batch write fails after half of it landed: the rank retries
    the same write (same attempt, same destination rows), and the room succeeds with
    the decode pool bitwise equal to the prefill full view."""
    pre, dec = prefill, decode(48)
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
def test_write_failing_past_the_retries_fails_the_room(prefill, decode, backends):
    pre, dec = prefill, decode(48)
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
def test_stalled_write_is_not_retried(prefill, decode, sender_engine):
    """A write that failed only after half the transfer timeout (a stalled peer: the
    engine may still be moving its slices) fails the room at once, no retry."""
    pre, dec = prefill, decode(48)
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


# ---- randomized mixed faults ------------------------------------------------------------------

MC_FAULT_KINDS = (
    "none", "flaky", "kill", "corrupt", "duplicate", "missing", "layout", "abort", "dies"
)  # fmt: skip
# "kill" and "dies" wait for a heartbeat timeout (2 s), hence their small weights.
MC_FAULT_WEIGHTS = (0.3, 0.1, 0.02, 0.15, 0.1, 0.1, 0.05, 0.15, 0.03)


@needs_mooncake
def test_randomized_mixed_faults_leak_nothing_over_mooncake(prefill, decode, backends):
    """`CPKV_TRANSFER_FAULTS` Mooncake transfers (default 100, as for gRPC), each with a
    random fault or none: a transient write failure (retried: the room succeeds), a
    sender killed, a page corrupted in the decode staging, a position written by two
    ranks, a missing position, a layout mismatch, an abort before a batch write (the
    write still lands: one-sided), or the decode side dying (its gRPC server stops once
    all ranks but one committed; the prefill side fails the room on heartbeat loss; a
    decode server of its own, sharing the module's Mooncake endpoint).

    After each round: every room finished with the expected state, a successful room's
    pages equal the prefill full view, prefill pages and the round's decode pages are
    back, no staging region is live (a failed room's may be quarantined until its
    writers are done or the quarantine times out) and the sender's host buffer is whole.
    Odd rounds hash each rank's pages before its write, even ones while it writes. At
    the end the staging arena is entirely free again. About 40 s on 2 cores (0.1-0.3 s
    a round; "kill" and "dies" rounds wait for the 2 s heartbeat timeout)."""
    pre = prefill
    count = int(os.environ.get("CPKV_TRANSFER_FAULTS", "100"))
    rng = np.random.default_rng(int(os.environ.get("CPKV_TRANSFER_FAULT_SEED", "4321")))
    dec = decode(64)
    backend = backends()  # one backend (engine, host buffer, channel); faults per round
    free = prefill_free(pre)
    t_start = time.perf_counter()
    per_kind: dict[str, list[float]] = {k: [] for k in MC_FAULT_KINDS}
    for i, kind in enumerate(fault_schedule(rng, count, MC_FAULT_KINDS, MC_FAULT_WEIGHTS)):
        room = f"mc-rnd-{i}"
        n_tok = int(rng.integers(1, 14 * P))
        table = new_table(pre, n_tok)
        n_pages = table.num_pages
        victim = int(rng.integers(min(CP, n_pages)))  # a rank that owns pages
        faults, layout, round_dec = MooncakeSenderFaults(), None, dec
        retried: list[int] = []

        if kind == "flaky":

            def write(s, g, attempt, v=victim, retried=retried):
                if s.rank == v and attempt == 0:
                    retried.append(g)
                    raise MooncakeTransferError("simulated transient engine failure", -1)

            faults = MooncakeSenderFaults(write=write)
        elif kind == "kill":
            faults = MooncakeSenderFaults(
                before_write=lambda s, g, v=victim: s.kill() if s.rank == v else None
            )
        elif kind == "corrupt":

            def corrupt(s, v=victim, room=room):
                if s.rank == v:  # its writes are over; position v is its own
                    rows = dec.receiver.staging_rows(room)
                    dec.receiver.staging(room)[0][rows[v], 0] ^= 0xFF

            faults = MooncakeSenderFaults(before_commit=corrupt)
        elif kind == "duplicate" and n_pages > 1:
            other = (victim + 1) % min(CP, n_pages)

            faults = MooncakeSenderFaults(plan=duplicate_position_plan(victim, other))
        elif kind == "missing":
            faults = MooncakeSenderFaults(plan=missing_position_plan(victim))
        elif kind == "layout":
            layout = dataclasses.replace(pre.layout, kv_cache_dim=pre.layout.kv_cache_dim + 1)
        elif kind == "abort":

            def abort(s, g, v=victim, room=room):
                if s.rank == v and g == 0:
                    dec.receiver.abort(room, "random abort")

            faults = MooncakeSenderFaults(before_write=abort)
        elif kind == "dies":
            round_dec = decode(32)  # its server dies: a decode server of its own
            faults = MooncakeSenderFaults(
                before_commit=decode_dies_before_commit(round_dec, room, victim)  # type: ignore[arg-type]
            )
        else:
            kind = "none"
        succeeds = kind in ("none", "flaky")
        view = pre.runner.full_view(table) if succeeds else None
        backend.faults = faults  # read by each rank sender as it starts
        # Rooms here are small: odd rounds hash on the rank thread before the write (as
        # small rooms do), even ones on a helper thread during it (as large rooms do).
        backend.config = dataclasses.replace(
            CONFIG, inline_digest_max_bytes=CONFIG.inline_digest_max_bytes if i % 2 else 0
        )
        t0 = time.perf_counter()
        hold, dst = run_transfer(
            pre, round_dec, table, room, Aux(i, -0.5), backend=backend, layout=layout, seed=i
        )
        outcome = finish(hold)
        snap = settle(round_dec.receiver, room)
        per_kind[kind].append(time.perf_counter() - t0)
        want = RoomState.SUCCESS if succeeds else RoomState.FAILED
        assert outcome.state is want and snap.state is want, (i, kind, outcome, snap)
        if kind == "flaky":
            assert retried, i  # the victim's first try really failed
        if kind == "dies":
            assert heartbeat_loss_seen(hold), (i, hold.outcomes())
        if succeeds:
            assert_decode_layout_is(round_dec.receiver, dst, view, i, n_tok)
            round_dec.receiver.free_pages(dst)
        assert prefill_free(pre) == free, (i, kind)
        assert round_dec.receiver.num_free_pages == round_dec.free0, (i, kind)
        assert dec.arena.stats().live_regions == 0, (i, kind, dec.arena.stats())
        host = backend._host
        deadline = time.monotonic() + 2.0
        while host is not None and host.free_bytes != host.nbytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert host is None or host.free_bytes == host.nbytes, (i, kind)
        assert not any(g.locked() for g in backend._prep_gates.values()), (i, kind)
    deadline = time.monotonic() + QUARANTINE_S + 3.0  # the last quarantines expire
    while dec.arena.free_bytes != dec.arena.nbytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dec.arena.free_bytes == dec.arena.nbytes, dec.arena.stats()
    log_fault_run("Mooncake transfer", count, time.perf_counter() - t_start, per_kind)
