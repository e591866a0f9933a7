"""The shared sender session's heartbeats (`transfer.session.SenderSession`).

A rank's heartbeats come from a thread of their own, one asynchronous call per beat on a
fixed schedule: neither a data plane stuck on a slow page read (a first-call gather
compile, a pool lock) nor a slow heartbeat reply delays the next beat, so the decode
side never declares a live sender silent. Host-only receiver, no device work.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from cpkv_jax.paging import PageAllocator
from transfer.backends.grpc_backend import GrpcBackend, GrpcBackendConfig
from transfer.page_plan import PROTOCOL_VERSION, BufferKind, LayoutDescriptor
from transfer.page_source import HostPoolPageSource
from transfer.protocol import Aux, RoomState, TransferTimeouts
from transfer.receiver import Receiver, serve
from transfer.sender import rank_jobs, send_request

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


def send(rx: Receiver, target: str, room: str, read_delay_s: float) -> RoomState:
    """One room of 4 pages from `CP` ranks whose first read takes `read_delay_s`."""
    n_pages = 4
    rng = np.random.default_rng(0)
    pools = [
        HostPoolPageSource(
            LAYOUT,
            {
                b: rng.integers(0, 256, (1 + n_pages, LAYOUT.page_bytes(*b)), dtype=np.uint8)
                for b in LAYOUT.buffers()
            },
        )
        for _ in range(CP)
    ]
    dst = rx.allocate_pages(n_pages)
    rx.register_room(room, dst, n_pages * LAYOUT.page_size, CP)
    # Position p lives on rank p % CP, at its local page 1 + p // CP (0 is the trash page).
    local = 1 + np.arange(n_pages, dtype=np.int32) // CP
    sources = [SlowSource(p, read_delay_s) for p in pools]
    tokens = n_pages * LAYOUT.page_size
    jobs = rank_jobs(room, target, LAYOUT, tokens, local, sources, Aux(1, -0.5))
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
