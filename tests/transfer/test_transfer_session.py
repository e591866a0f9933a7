"""The shared sender session's heartbeats (`transfer.session.SenderSession`).

A rank's heartbeats come from a thread of their own, one asynchronous call per beat on a
fixed schedule: neither a data plane stuck on a slow page read (a first-call gather
compile, a pool lock) nor a slow heartbeat reply delays the next beat, so the decode
side never declares a live sender silent. Host-only receiver, no device work.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from cpkv_jax.paging import PageAllocator
from transfer.backends.grpc_backend import GrpcBackend, GrpcBackendConfig
from transfer.page_plan import PROTOCOL_VERSION, BufferKind, LayoutDescriptor
from transfer.page_source import HostPoolPageSource
from transfer.protocol import HANDSHAKE_HOLD_S, Aux, RoomState, TransferTimeouts
from transfer.receiver import Receiver, serve
from transfer.sender import RankJob, rank_jobs, send_request

LAYOUT = LayoutDescriptor(PROTOCOL_VERSION, 4, 3, (0, 2), 16, "float32", 8, "float8_e4m3fn", True)
CP = 2
# The decode side fails a rank silent for 1 s; ranks beat every 50 ms.
TIMEOUTS = TransferTimeouts(bootstrap=10.0, waiting=10.0, heartbeat=1.0, heartbeat_interval=0.05)
SENDER = GrpcBackendConfig(
    chunk_bytes=4096,
    heartbeat_interval_s=0.05,
    heartbeat_timeout_s=5.0,  # beats time out after 2.5 s, longer than any stall here
    rpc_timeout_s=10.0,
    bootstrap_timeout_s=5.0,
)


class SlowSource:
    """A host pool whose first read takes `delay_s` (not a `HostPageSource`: the sender
    reads it), as a device pool's first read waits for its gather to compile."""

    def __init__(self, pool: HostPoolPageSource, delay_s: float):
        self._pool, self._delay_s = pool, delay_s

    def read(self, kind: BufferKind, layer: int, src_pages: np.ndarray) -> np.ndarray:
        delay, self._delay_s = self._delay_s, 0.0
        time.sleep(delay)
        return self._pool.read(kind, layer, src_pages)


@pytest.fixture
def decode() -> Iterator[tuple[Receiver, str]]:
    """A host-only receiver on loopback and its address."""
    rx = Receiver(LAYOUT, None, PageAllocator(32), timeouts=TIMEOUTS).start(interval=0.02)
    server, port = serve(rx)
    yield rx, f"127.0.0.1:{port}"
    server.stop(0)
    rx.close()


N_PAGES = 4


def host_pools() -> list[HostPoolPageSource]:
    """Each rank's host pool: random pages, position p at local page 1 + p // CP."""
    n_pages = N_PAGES
    rng = np.random.default_rng(0)
    return [
        HostPoolPageSource(
            LAYOUT,
            {
                b: rng.integers(0, 256, (1 + n_pages, LAYOUT.page_bytes(*b)), dtype=np.uint8)
                for b in LAYOUT.buffers()
            },
        )
        for _ in range(CP)
    ]


def room_jobs(room: str, target: str, sources) -> list[RankJob]:
    """The `CP` rank jobs of a room of `N_PAGES` pages read from `sources`."""
    # Position p lives on rank p % CP, at its local page 1 + p // CP (0 is the trash page).
    local = 1 + np.arange(N_PAGES, dtype=np.int32) // CP
    return rank_jobs(room, target, LAYOUT, N_PAGES * LAYOUT.page_size, local, sources, Aux(1, -0.5))


def send(rx: Receiver, target: str, room: str, read_delay_s: float) -> RoomState:
    """One room of 4 pages from `CP` ranks whose first read takes `read_delay_s`."""
    n_pages = N_PAGES
    pools = host_pools()
    dst = rx.allocate_pages(n_pages)
    rx.register_room(room, dst, n_pages * LAYOUT.page_size, CP)
    jobs = room_jobs(room, target, [SlowSource(p, read_delay_s) for p in pools])
    backend = GrpcBackend(SENDER)
    try:
        outcome = send_request(backend, jobs, lambda _: None).wait(30.0)
    finally:
        backend.close()
    assert outcome is not None
    if outcome.state is RoomState.SUCCESS:
        rx.free_pages(dst)
    return outcome.state


def test_heartbeats_flow_while_the_data_plane_is_stuck(decode):
    """Each rank's first read stalls for 1.5x the decode side's heartbeat timeout (the
    rank's stream waits): its heartbeats keep the room alive."""
    rx, target = decode
    seen: list[tuple[int, float]] = []
    real = rx.heartbeat

    def heartbeat(room, rank, writes_done=False):
        seen.append((rank, time.monotonic()))
        return real(room, rank, writes_done)

    rx.heartbeat = heartbeat  # type: ignore[method-assign]
    t0 = time.monotonic()
    assert (
        send(rx, target, "stuck-read", read_delay_s=1.5 * TIMEOUTS.heartbeat) is RoomState.SUCCESS
    )
    for rank in range(CP):
        beats = [t0] + [t for r, t in seen if r == rank]
        assert max(np.diff(beats)) < TIMEOUTS.heartbeat / 2, (rank, np.diff(beats))


def test_a_slow_heartbeat_reply_delays_no_later_beat(decode):
    """The decode side takes 1.5x its own heartbeat timeout to answer one beat of each
    rank: the beats after it still arrive on time (a beat waits for no earlier reply),
    so the room does not fail on the silence that waiting would have made."""
    rx, target = decode
    real = rx.heartbeat
    slowed: set[int] = set()
    lock = threading.Lock()

    def heartbeat(room, rank, writes_done=False):
        with lock:
            first = rank not in slowed
            slowed.add(rank)
        if first:
            time.sleep(1.5 * TIMEOUTS.heartbeat)
        return real(room, rank, writes_done)

    rx.heartbeat = heartbeat  # type: ignore[method-assign]
    assert send(rx, target, "slow-reply", read_delay_s=3 * TIMEOUTS.heartbeat) is RoomState.SUCCESS
    assert slowed == set(range(CP))


# ---- the handshake's wait for the decode side -------------------------------------------------


def test_a_room_queued_on_the_decode_side_past_the_bootstrap_timeout_still_succeeds(decode):
    """The decode server queues the request (its room is not registered) for 4x the
    sender's bootstrap timeout: the decode side answers every handshake ("room not
    registered yet"), so the ranks keep waiting - with backoff, the receiver holding a
    handshake up to `HANDSHAKE_HOLD_S` - and send once the room appears. Failed before
    the fix: the ranks gave up after `bootstrap_timeout_s` ("handshake failed:
    NOT_FOUND"), so a request queued on the decode side for 300 s failed."""
    rx, target = decode
    config = dataclasses.replace(SENDER, bootstrap_timeout_s=0.3, retry_backoff_s=0.02)
    calls: list[float] = []
    ranks: list[int] = []
    real = rx.handshake

    def handshake(*args, **kw):
        calls.append(time.monotonic())
        ranks.append(args[1])
        return real(*args, **kw)

    rx.handshake = handshake  # type: ignore[method-assign]
    backend = GrpcBackend(config)
    try:
        hold = send_request(backend, room_jobs("queued", target, host_pools()), lambda _: None)
        t0 = time.monotonic()
        wait_s = 4 * config.bootstrap_timeout_s + HANDSHAKE_HOLD_S
        assert hold.wait(wait_s) is None, hold.outcome  # still waiting, not failed
        # No tight loop: each rank asked about once per hold (held) or backoff.
        per_rank_s = len(calls) / CP / (time.monotonic() - t0)
        assert per_rank_s < 20, f"{len(calls)} handshakes from {CP} ranks in {wait_s:.1f}s"
        assert set(ranks) == {0}, ranks  # only the prober asks while the room is unknown
        dst = rx.allocate_pages(N_PAGES)
        rx.register_room("queued", dst, N_PAGES * LAYOUT.page_size, CP)
        outcome = hold.wait(10.0)
    finally:
        backend.close()
    assert outcome is not None and outcome.state is RoomState.SUCCESS, outcome
    rx.free_pages(dst)


def test_a_parked_hold_stops_every_rank_without_aborting_and_the_room_starts_over(decode):
    """`TransferHold.park` on a room the decode side has not registered: the prober stops
    before its next handshake and the other rank (waiting for the prober, no RPC) with it;
    the hold is released as parked and nothing reaches the decode side's abort. The same
    room, registered later, succeeds from new senders. A park that comes after the
    registration is ignored: the transfer goes on."""
    rx, target = decode
    aborts: list[str] = []
    real_abort = rx.abort

    def abort(room, reason, sender_rank=None):
        aborts.append(room)
        return real_abort(room, reason, sender_rank)

    rx.abort = abort  # type: ignore[method-assign]
    config = dataclasses.replace(SENDER, retry_backoff_s=0.02)
    backend = GrpcBackend(config)
    try:
        hold = send_request(backend, room_jobs("parked", target, host_pools()), lambda _: None)
        assert hold.wait(0.3) is None  # asking
        hold.park()
        outcome = hold.wait(2 * HANDSHAKE_HOLD_S + 5.0)
        assert hold.parked and outcome is not None, outcome
        assert outcome.state is RoomState.BOOTSTRAPPING and "parked" in outcome.reason
        assert not hold.cancelled and aborts == []
        dst = rx.allocate_pages(N_PAGES)
        rx.register_room("parked", dst, N_PAGES * LAYOUT.page_size, CP)
        again = send_request(backend, room_jobs("parked", target, host_pools()), lambda _: None)
        assert again.wait(2.0) is None or again.registered
        again.park()  # too late: the room is registered (or done)
        final = again.wait(10.0)
    finally:
        backend.close()
    assert final is not None and final.state is RoomState.SUCCESS, final
    assert not again.parked and aborts == []
    rx.free_pages(dst)


def test_an_unreachable_decode_side_still_fails_after_the_bootstrap_timeout():
    """Nobody listens at the target: the handshake is retried for `bootstrap_timeout_s`
    (time without any answer) and the room fails with the reason."""
    with socket.socket() as s:  # a port nobody listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{s.getsockname()[1]}"
        config = dataclasses.replace(SENDER, bootstrap_timeout_s=0.5, retry_backoff_s=0.02)
        backend = GrpcBackend(config)
        try:
            t0 = time.monotonic()
            hold = send_request(backend, room_jobs("nobody", target, host_pools()), lambda _: None)
            outcome = hold.wait(10.0)
            took = time.monotonic() - t0
        finally:
            backend.close()
    assert outcome is not None and outcome.state is RoomState.FAILED
    assert "handshake failed: UNAVAILABLE" in outcome.reason, outcome.reason
    assert config.bootstrap_timeout_s <= took < 5.0, took
