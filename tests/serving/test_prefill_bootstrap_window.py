"""The PD prefill engine's transfer work is bounded by what runs, not by what waits
(`serving.prefill.engine`, the bootstrap window; `transfer.session`, the handshake).

The CP 8 prefill engine of the tiny model (float32, bs > 1) with a real
`transfer.receiver.Receiver` served over gRPC on loopback:

- 256 queued requests whose decode side never registers their rooms: only the bootstrap
  window's requests run senders, so the process's threads stay bounded (and come back
  when the requests are aborted); the window moves on in arrival order;
- window requests whose rooms stay unregistered give way (park) to waiting requests the
  decode side did register, so the two servers' different arrival orders cannot stall;
- a request whose decode side queues it for several times the sender's bootstrap
  timeout still prefills and delivers once its room is registered;
- the wait for the decode side ends at the request's own timeout (`--request-timeout`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
from support.prefill_server import (
    CP,
    GatedBackend,
    P,
    fast_grpc_sender,
    loopback_receiver,
    server_args,
)

from cpkv_jax.paging import pages_for_tokens
from serving.engine.api import GenerateRequest, OutputChunk, SamplingParams
from serving.prefill.build import build_prefill_engine
from serving.prefill.engine import PrefillModeEngine
from transfer.backends.grpc_backend import GrpcBackend, GrpcBackendConfig
from transfer.protocol import RoomState, TransferTimeouts

VOCAB = 320  # the tiny model's
WAIT = 30.0  # bound on any one wait here; never reached when green
QUEUED = 256  # the default --max-queued-requests
# This engine's default bootstrap window: 2 x its batch rows, capped at 32 requests.
WINDOW = 32
# Threads a queue of QUEUED may add: the window's ranks, each a sender thread plus (once
# handshaken) a heartbeat thread, plus the receiver's gRPC workers (at most 64, made on
# demand) and the channels' threads. Before the fix every queued request ran its
# senders: QUEUED x CP = 2,048 sender threads.
THREAD_BOUND = WINDOW * CP * 2 + 96
TIMEOUTS = TransferTimeouts(bootstrap=WAIT, waiting=WAIT, heartbeat=2.0, heartbeat_interval=0.1)
# The senders give up after 0.5 s without any answer from the decode side: far below
# how long the decode side queues a room here.
SHORT = fast_grpc_sender(bootstrap_timeout_s=0.5)
# As the default 300 s: before the fix, queued requests' senders lived this long.
LONG = fast_grpc_sender(bootstrap_timeout_s=WAIT)


class PD:
    """The prefill engine's scheduler and runner, and a decode receiver on loopback."""

    def __init__(self, tiny):
        path, cfg, model = tiny
        self.pre = build_prefill_engine(server_args(path), model=model, hold_finished=True)
        self.free0 = self.pre.runner.allocator.num_free_per_lane()
        self.backends: list[GrpcBackend] = []
        self.rx, self.server, self.target = loopback_receiver(
            self.mode_engine(SHORT)[0].layout, cfg, 64, TIMEOUTS
        )

    def mode_engine(self, config: GrpcBackendConfig) -> tuple[PrefillModeEngine, GatedBackend]:
        """A PD prefill engine over the shared scheduler, sending with `config`; its
        backend's gate stays open (it only records the rooms whose senders started)."""
        inner = GrpcBackend(config)
        self.backends.append(inner)
        backend = GatedBackend(inner, WAIT)
        return PrefillModeEngine(self.pre, backend, max_queued_requests=QUEUED), backend

    def close(self) -> None:
        self.server.stop(0)
        self.rx.close()
        for backend in self.backends:
            backend.close()


@pytest.fixture(scope="module")
def pd(tiny_checkpoint) -> Iterator[PD]:
    pd = PD(tiny_checkpoint)
    yield pd
    pd.close()


def prompt_of(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.int32)


def request(rid: str, prompt: np.ndarray, target: str) -> GenerateRequest:
    return GenerateRequest(
        rid,
        tuple(int(t) for t in prompt),
        SamplingParams(max_new_tokens=4),
        bootstrap_room=rid,
        decode_transfer_target=target,
    )


def sender_threads() -> int:
    return sum(t.name.startswith(("kv-send-", "kv-heartbeat-")) for t in threading.enumerate())


def step_until(
    engine: PrefillModeEngine, done: Callable[[], bool], what: str, out: list[OutputChunk]
) -> None:
    deadline = time.monotonic() + WAIT
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        out += engine.step()


def drive(engine: PrefillModeEngine, rids: Sequence[str]) -> dict[str, OutputChunk]:
    """Step until every rid has its (single, final) chunk."""
    got: list[OutputChunk] = []
    step_until(engine, lambda: {c.rid for c in got} >= set(rids), f"chunks of {rids}", got)
    assert all(c.finished for c in got) and len(got) == len({c.rid for c in got}), got
    return {c.rid: c for c in got}


def assert_idle(pd: PD, engine: PrefillModeEngine) -> None:
    assert not engine.has_work()
    assert pd.pre.scheduler.num_held == 0
    pd.pre.cache.reset()  # evict everything: the allocator is back where it started
    np.testing.assert_array_equal(pd.pre.runner.allocator.num_free_per_lane(), pd.free0)


def test_queued_requests_run_no_senders_beyond_the_bootstrap_window(pd):
    """256 requests whose decode side never registers their rooms (CP 8): threads grow by
    at most `THREAD_BOUND` (the window's 32 requests x 8 ranks x sender + heartbeat,
    plus gRPC's), sender threads by at most 32 x 8 = 256; failed before the fix with
    2,048 sender threads, one per queued request and rank. The window moves on in
    arrival order as requests leave, and no prefill page is held meanwhile."""
    engine, backend = pd.mode_engine(LONG)
    engine.park_after_s = WAIT  # no parking here: the window moves in arrival order
    rids = [f"w{i}" for i in range(QUEUED)]
    base, base_senders = threading.active_count(), sender_threads()
    for rid in rids:
        engine.add(request(rid, prompt_of(2 * P + 1, 0), pd.target))
    peak = peak_senders = 0
    out: list[OutputChunk] = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # handshakes come back "not registered" meanwhile
        peak = max(peak, threading.active_count() - base)
        peak_senders = max(peak_senders, sender_threads() - base_senders)
        out += engine.step()
    print(f"threads +{peak} (bound {THREAD_BOUND}), sender threads +{peak_senders}")
    assert peak <= THREAD_BOUND, f"{QUEUED} queued requests added {peak} threads"
    assert peak_senders <= WINDOW * CP, peak_senders
    assert out == []
    assert engine.bootstrap_window == WINDOW
    assert backend.started() == set(rids[:WINDOW])
    s = engine.stats()
    assert (s.waiting, s.running) == (QUEUED, 0)
    np.testing.assert_array_equal(pd.pre.runner.allocator.num_free_per_lane(), pd.free0)

    for rid in rids[:8]:  # their senders stop; the next 8 in arrival order start
        engine.abort(rid)
    want = set(rids[: WINDOW + 8])
    step_until(engine, lambda: backend.started() == want, "the window to move on", out)
    for rid in rids[8:]:
        engine.abort(rid)
    step_until(engine, lambda: len(out) >= QUEUED, "every abort chunk", out)
    assert sorted(c.rid for c in out) == sorted(rids)
    assert all(c.finish_reason == "abort" for c in out)
    assert backend.started() == want  # aborted before their window slot: never started
    deadline = time.monotonic() + WAIT
    while sender_threads() > base_senders:  # every started sender stops
        assert time.monotonic() < deadline, f"{sender_threads()} sender threads left"
        time.sleep(0.05)
    assert_idle(pd, engine)


def test_a_room_queued_past_the_bootstrap_timeout_still_completes(pd):
    """The decode side queues the request (its room unregistered) for 4x the senders'
    bootstrap timeout: the request waits, holding no prefill pages, then prefills and
    delivers when the room is registered. Failed before the fix: "KV transfer ... failed
    before the prefill: prefill rank r: handshake failed: NOT_FOUND" once the bootstrap
    timeout passed (300 s by default), however long the client was willing to wait."""
    (engine, _), n = pd.mode_engine(SHORT), 2 * P + 3
    engine.add(request("late", prompt_of(n, 31), pd.target))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 4 * SHORT.bootstrap_timeout_s:
        assert engine.step() == []
    s = engine.stats()
    assert (s.waiting, s.running, s.transfer_failures) == (1, 0, 0)
    np.testing.assert_array_equal(pd.pre.runner.allocator.num_free_per_lane(), pd.free0)
    dst = pd.rx.allocate_pages(pages_for_tokens(n, P))
    pd.rx.register_room("late", dst, n, CP)  # the decode server took it from its queue
    chunk = drive(engine, ["late"])["late"]
    assert chunk.finish_reason == "length", chunk
    assert pd.rx.status("late").state is RoomState.SUCCESS
    pd.rx.free_pages(dst)
    assert_idle(pd, engine)


def test_the_wait_for_the_decode_side_ends_at_the_request_timeout(pd):
    """With no fixed deadline on the decode wait, the request's own timeout (from its
    arrival) ends it: an error naming the timeout, its senders stopped, nothing held;
    a request still outside the bootstrap window times out the same way."""
    (engine, _), scheduler = pd.mode_engine(SHORT), pd.pre.scheduler
    saved, scheduler.request_timeout = scheduler.request_timeout, 0.6
    try:
        rids = [f"t{i}" for i in range(WINDOW + 2)]  # the last two wait for a window slot
        for rid in rids:
            engine.add(request(rid, prompt_of(P + 2, 5), pd.target))
        t0 = time.monotonic()
        chunks = drive(engine, rids)
        took = time.monotonic() - t0
    finally:
        scheduler.request_timeout = saved
    for chunk in chunks.values():
        assert chunk.finish_reason == "error" and "request timeout expired" in (chunk.error or "")
    assert 0.6 <= took < 5.0, took
    deadline = time.monotonic() + WAIT
    while sender_threads():
        assert time.monotonic() < deadline, f"{sender_threads()} sender threads left"
        time.sleep(0.05)
    assert_idle(pd, engine)


def test_window_requests_give_way_to_rooms_the_decode_side_registered(pd):
    """The decode side registers rooms in its own arrival order: here it holds pages for
    the last 4 of 12 requests (registered last-first), all outside a bootstrap window of
    4 on the prefill side, and for nothing else until those are done. Window requests
    whose rooms stay unregistered for `park_after_s` give their slots back (parked, their
    rooms not aborted), the window goes round, the registered requests deliver, and
    then so do the others once their rooms are registered. Failed before parking: the
    window's 4 requests waited for rooms that never came, nothing moved (SPEC S2)."""
    engine, backend = pd.mode_engine(LONG)
    engine.bootstrap_window, engine.park_after_s = 4, 0.3
    n = 2 * P + 3
    rids = [f"p{i}" for i in range(12)]
    base_senders = sender_threads()
    for i, rid in enumerate(rids):
        engine.add(request(rid, prompt_of(n, 40 + i), pd.target))
    assert backend.started() == set(rids[:4])
    first, rest = rids[8:], rids[:8]
    dst = {}
    for rid in reversed(first):  # another arrival order than the prefill side's
        dst[rid] = pd.rx.allocate_pages(pages_for_tokens(n, P))
        pd.rx.register_room(rid, dst[rid], n, CP)
    peak: list[int] = [0]

    def done_and_bounded(want: set[str], got: list[OutputChunk]) -> Callable[[], bool]:
        def check() -> bool:
            peak[0] = max(peak[0], sender_threads() - base_senders)
            return {c.rid for c in got} >= want

        return check

    got: list[OutputChunk] = []
    step_until(engine, done_and_bounded(set(first), got), "the registered rooms", got)
    assert {c.rid: c.finish_reason for c in got} == dict.fromkeys(first, "length"), got
    assert engine.bootstrap_parks >= 8  # the first 8 each gave way at least once
    for rid in rest:  # the decode side frees pages and takes the rest
        dst[rid] = pd.rx.allocate_pages(pages_for_tokens(n, P))
        pd.rx.register_room(rid, dst[rid], n, CP)
    step_until(engine, done_and_bounded(set(rids), got), "the other rooms", got)
    assert sorted(c.rid for c in got) == sorted(rids)
    assert all(c.finish_reason == "length" for c in got), got
    for rid in rids:
        assert pd.rx.status(rid).state is RoomState.SUCCESS, rid
        pd.rx.free_pages(dst[rid])
    # Sender + heartbeat threads of at most 8 requests: the window's 4 and the 4
    # registered ones transferring after their prefill (12 would be 192).
    assert peak[0] <= 8 * CP * 2, peak
    assert_idle(pd, engine)
