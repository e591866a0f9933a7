"""The PD prefill-mode engine (`serving.prefill.engine`): CP prefill -> KV to a decode server.

- The engine on 8 virtual devices (tiny model, float32, CP 8 shared KV, bs > 1) with a
  real `transfer.receiver.Receiver` served over gRPC on loopback: the decode pool's
  layout equals the prefill full view bitwise (SPEC S2.1-S2.2), the first token and its
  log-prob equal `ReferenceGenerator`'s, several requests in flight with a shared prefix
  reused from the radix cache, failures (nobody listening, decode-side abort) and client
  aborts (queued, transferring), each ending with the pages released and, after evicting
  the cache, every prefill allocator lane back at its initial free count.
- The same end to end over the Mooncake backend when its engine loads (else skipped,
  with the reason).

Senders run behind `GatedBackend`, which holds them until a test opens the gate, so a
hold is observably in flight (and the prefill full view can be read before release).
The scheduler holds without a decode side: test_prefill_server_holds.py. (Until the
tests were split by topic, both were tests/test_prefill_server.py.)
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Sequence

import jax
import numpy as np
import pytest
from support.cp_reference import reference as cp_reference
from support.prefill_server import (
    CP,
    SENDER,
    TIMEOUTS,
    GatedBackend,
    P,
    drive,
    lane_counts,
    loopback_receiver,
    no_transfer_counts,
    request,
    server_args,
)
from support.transfer import bitwise_equal, decode_layout

from cpkv_jax.errors import InputError
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.lane_allocator import RequestPageTable
from cpkv_jax.paging import pages_for_tokens
from serving.engine.api import GenerateRequest, OutputChunk, SamplingParams
from serving.prefill.build import PrefillEngine, build_prefill_engine
from serving.prefill.engine import PrefillModeEngine
from serving.server_args import ServerArgs
from transfer.backends.grpc_backend import GrpcBackend
from transfer.backends.mooncake_engine import mooncake_available
from transfer.protocol import Aux, RoomState
from transfer.receiver import Receiver

# Among the longest files of the suite: scheduled first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=42)  # on 2 workers, 2026-12-05

VOCAB = 320  # the tiny model's
WAIT = 120.0  # bound on any one request here (first compiles included); never reached when green
# Log-prob tolerance vs the single-device reference: both float32 log-softmax of logits
# that differ only by CP vs single-device reduction order (ulps of O(1) values).
LOGPROB_ATOL = 1e-5


@dataclasses.dataclass
class PD:
    cfg: object
    model: object
    args: ServerArgs
    pre: PrefillEngine
    backend: GatedBackend
    engine: PrefillModeEngine
    rx: Receiver
    target: str
    free0: np.ndarray
    dec_free0: int
    ref: ReferenceGenerator


@pytest.fixture(scope="module")
def pd(tiny_checkpoint):
    yield from _pd(tiny_checkpoint)


@pytest.fixture(scope="module")
def pd_invariant(tiny_checkpoint):
    yield from _pd(tiny_checkpoint, "--enable-batch-invariant")


def _pd(tiny, *extra: str):
    path, cfg, model = tiny
    args = server_args(path, *extra)
    pre = build_prefill_engine(args, model=model, hold_finished=True)
    backend = GatedBackend(GrpcBackend(SENDER), WAIT)
    engine = PrefillModeEngine(pre, backend)
    rx, server, target = loopback_receiver(engine.layout, cfg, 64, TIMEOUTS)
    ref = ReferenceGenerator(
        cfg,
        model,
        page_size=P,
        index_k_dtype="float32",
        batch_invariant=args.enable_batch_invariant,
    )
    yield PD(
        cfg,
        model,
        args,
        pre,
        backend,
        engine,
        rx,
        target,
        pre.runner.allocator.num_free_per_lane(),
        rx.num_free_pages,
        ref,
    )
    server.stop(0)
    rx.close()


@pytest.fixture
def fresh(pd):
    """Each test starts and ends with an idle engine, an empty cache, an open gate."""
    pd.backend.gate.set()
    yield pd
    pd.backend.gate.set()
    assert not pd.engine.has_work()
    assert pd.pre.scheduler.num_held == 0
    cache = pd.pre.cache
    cache.check_invariants()
    np.testing.assert_array_equal(cache.protected_pages_per_lane(), 0)
    cache.reset()  # evict everything: the allocator is back where it started
    np.testing.assert_array_equal(pd.pre.runner.allocator.num_free_per_lane(), pd.free0)
    assert pd.rx.num_free_pages == pd.dec_free0


def prompt_of(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.int32)


def open_room(pd: PD, room: str, n_tokens: int, seed: int) -> np.ndarray:
    """Decode side: shuffled destination pages and the registered room."""
    dst = pd.rx.allocate_pages(pages_for_tokens(n_tokens, P))
    dst = np.random.default_rng(seed).permutation(dst)
    pd.rx.register_room(room, dst, n_tokens, CP)
    return dst


def held_view(pd: PD, room: str):
    """The prefill full view of the pages rank 0 was asked to send (hold in flight)."""
    job, inputs = pd.backend.jobs[(room, 0)], pd.backend.holds[room].inputs
    assert inputs is not None, "the prefill has not provided the page table yet"
    table = RequestPageTable.from_prefix(CP, inputs.src_local_pages, job.num_tokens, P)
    return pd.pre.runner.full_view(table)


def assert_layout_equal(pd: PD, dst: np.ndarray, n: int, view) -> None:
    got = decode_layout(pd.rx, dst, n)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(view), strict=True):
        assert bitwise_equal(x, y)


def assert_reference_first_token(pd: PD, prompt: np.ndarray, chunk: OutputChunk) -> None:
    r = pd.ref.generate(prompt.tolist(), 1, ignore_eos=True)
    assert chunk.token_ids == (r.output_ids[0],)
    assert chunk.logprobs is not None
    np.testing.assert_allclose(chunk.logprobs[0], r.output_logprobs[0], atol=LOGPROB_ATOL)


def assert_no_transfer_counts(pd: PD, prompts: Sequence[np.ndarray]) -> None:
    free, evictable = no_transfer_counts(prompts, CP, pd.pre.runner.layout.pages_per_rank, P)
    np.testing.assert_array_equal(pd.pre.runner.allocator.num_free_per_lane(), free)
    np.testing.assert_array_equal(pd.pre.cache.evictable_pages_per_lane(), evictable)


def test_add_refuses_bad_requests_with_nothing_queued(fresh):
    pd = fresh
    eng, ok = pd.engine, prompt_of(20, 0)
    with pytest.raises(InputError, match="bootstrap_room and decode_transfer_target"):
        eng.add(GenerateRequest("r", tuple(ok.tolist())))
    with pytest.raises(InputError, match="decode_transfer_target"):
        eng.add(
            dataclasses.replace(request("r", ok, "room", pd.target), decode_transfer_target=None)
        )
    with pytest.raises(InputError, match="host:port"):
        eng.add(request("r", ok, "room", "no-port"))
    with pytest.raises(InputError, match="outside the vocabulary"):
        eng.add(request("r", np.array([3, VOCAB]), "room", pd.target))
    with pytest.raises(InputError, match="exceeds the context length"):
        eng.add(request("r", prompt_of(4094, 0), "room", pd.target))
    with pytest.raises(InputError, match="bootstrap_cp_size 2"):
        eng.add(request("r", ok, "room", pd.target, bootstrap_cp_size=2))
    with pytest.raises(InputError, match="temperature"):
        eng.add(
            dataclasses.replace(
                request("r", ok, "room", pd.target), sampling=SamplingParams(temperature=-1.0)
            )
        )
    with pytest.raises(InputError, match="empty"):
        eng.add(request("r", np.zeros(0, np.int32), "room", pd.target))
    assert not eng.has_work() and pd.pre.scheduler.num_waiting == 0
    # Queued, then refused twice (same id, same room), then aborted before any step.
    eng.add(request("q", ok, "room-q", pd.target))
    with pytest.raises(InputError, match="already queued"):
        eng.add(request("q", ok, "room-q2", pd.target))
    with pytest.raises(InputError, match="room 'room-q' is in use"):
        eng.add(request("q2", ok, "room-q", pd.target))
    eng.abort("q")
    eng.abort("unknown")  # ignored
    (chunk,) = eng.step()
    assert chunk.rid == "q" and chunk.finish_reason == "abort" and chunk.token_ids == ()
    np.testing.assert_array_equal(pd.pre.runner.allocator.num_free_per_lane(), pd.free0)


def test_e2e_one_request_bitwise_layout_reference_token_and_page_hold(fresh):
    pd = fresh
    n = 3 * P + 5  # a partial tail page
    prompt = prompt_of(n, 10)
    dst = open_room(pd, "e2e", n, 10)
    bytes0 = pd.engine.stats().transfer_bytes
    pd.backend.gate.clear()
    pd.engine.add(request("e2e", prompt, "e2e", pd.target))
    assert pd.engine.step() == []  # prefilled; senders started, held at the gate
    s = pd.engine.stats()
    assert (s.waiting, s.running) == (0, 1) and pd.engine.has_work()
    # The hold keeps the pages: whole pages cached but locked, the tail page allocated.
    cache, alloc = pd.pre.cache, pd.pre.runner.allocator
    np.testing.assert_array_equal(cache.evictable_pages_per_lane(), 0)
    np.testing.assert_array_equal(cache.protected_pages_per_lane(), lane_counts(n // P, CP))
    np.testing.assert_array_equal(
        alloc.num_free_per_lane(), pd.free0 - lane_counts(pages_for_tokens(n, P), CP)
    )
    np.testing.assert_array_equal(s.kv_pages_free, alloc.num_free_per_lane())
    view = held_view(pd, "e2e")
    assert pd.engine.step() == []  # still gated: nothing released
    pd.backend.gate.set()
    chunk = drive(pd.engine, ["e2e"])["e2e"]
    assert chunk.finish_reason == "length" and chunk.error is None, chunk
    assert chunk.meta["prompt_tokens"] == n and chunk.meta["cached_tokens"] == 0
    assert chunk.meta["completion_tokens"] == 1 and chunk.meta["e2e_s"] >= chunk.meta["ttft_s"]
    assert_reference_first_token(pd, prompt, chunk)
    snap = pd.rx.status("e2e")
    assert snap.state is RoomState.SUCCESS
    assert snap.aux == Aux(chunk.token_ids[0], chunk.logprobs[0])
    assert_layout_equal(pd, dst, n, view)
    s = pd.engine.stats()
    # Every logical page once, over every buffer (SPEC S2.2: the tail page too).
    assert s.transfer_bytes - bytes0 == pages_for_tokens(n, P) * pd.engine.layout.bytes_per_page()
    assert s.running == 0 and not pd.engine.has_work()
    assert_no_transfer_counts(pd, [prompt])
    pd.rx.free_pages(dst)  # the decode request is done


def test_several_in_flight_with_a_shared_prefix(fresh):
    pd = fresh
    rng_seeds = (20, 21, 22)
    a = prompt_of(3 * P + 9, rng_seeds[0])
    c = prompt_of(2 * P + 7, rng_seeds[1])
    b = np.concatenate([a[: 3 * P], prompt_of(12, rng_seeds[2])])  # 3 pages shared with a
    prompts = {"a": a, "c": c, "b": b}
    dsts = {
        rid: open_room(pd, f"many-{rid}", len(p), i) for i, (rid, p) in enumerate(prompts.items())
    }
    pd.backend.gate.clear()
    pd.engine.add(request("a", a, "many-a", pd.target))
    pd.engine.add(request("c", c, "many-c", pd.target))
    assert pd.engine.step() == []
    assert pd.engine.stats().running == 2
    pd.engine.add(request("b", b, "many-b", pd.target))
    assert pd.engine.step() == []  # b prefilled on a's cached pages while a is held
    assert pd.engine.stats().running == 3
    views = {rid: held_view(pd, f"many-{rid}") for rid in prompts}
    pd.backend.gate.set()
    chunks = drive(pd.engine, list(prompts))
    assert chunks["b"].meta["cached_tokens"] == 3 * P
    # ... and the decode side gets it with the first token (the aux data), for its client.
    assert pd.rx.status("many-b").aux.cached_tokens == 3 * P
    assert pd.rx.status("many-a").aux.cached_tokens == 0
    assert chunks["a"].meta["cached_tokens"] == chunks["c"].meta["cached_tokens"] == 0
    for rid, p in prompts.items():
        assert chunks[rid].finish_reason == "length", chunks[rid]
        assert pd.rx.status(f"many-{rid}").state is RoomState.SUCCESS
        assert_layout_equal(pd, dsts[rid], len(p), views[rid])
        assert_reference_first_token(pd, p, chunks[rid])
        pd.rx.free_pages(dsts[rid])
    assert_no_transfer_counts(pd, list(prompts.values()))


def test_batch_invariant_pd_is_bitwise_equal_to_single_device(pd_invariant):
    """`--enable-batch-invariant` end to end at library level: two requests in flight on
    CP 8, the second prefilled on the first's cached prefix pages (its suffix computed as
    a chunk), shipped over gRPC. The decode pool holds exactly the single-device
    reference's KV and the first token's log-prob is the reference's, bit for bit."""
    pd = pd_invariant
    a = prompt_of(3 * P + 9, 30)
    b = np.concatenate([a[: 3 * P], prompt_of(12, 31)])
    prompts = {"ia": a, "ib": b}
    dsts = {rid: open_room(pd, rid, len(p), i) for i, (rid, p) in enumerate(prompts.items())}
    pd.backend.gate.clear()  # a stays in flight while b is prefilled on its pages
    pd.engine.add(request("ia", a, "ia", pd.target))
    assert pd.engine.step() == []
    pd.engine.add(request("ib", b, "ib", pd.target))
    assert pd.engine.step() == []
    pd.backend.gate.set()
    chunks = drive(pd.engine, list(prompts))
    assert chunks["ib"].meta["cached_tokens"] == 3 * P
    for rid, prompt in prompts.items():
        assert pd.rx.status(rid).state is RoomState.SUCCESS
        _, ref_view = cp_reference(pd.cfg, pd.model, prompt, "float32", invariant=True)
        assert_layout_equal(pd, dsts[rid], len(prompt), ref_view)
        want = pd.ref.generate(prompt.tolist(), 1, ignore_eos=True)
        assert chunks[rid].token_ids == (want.output_ids[0],)
        assert chunks[rid].logprobs == (want.output_logprobs[0],)
        pd.rx.free_pages(dsts[rid])
    pd.pre.cache.reset()
    np.testing.assert_array_equal(pd.pre.runner.allocator.num_free_per_lane(), pd.free0)
    assert pd.rx.num_free_pages == pd.dec_free0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failure_nobody_listens_and_decode_side_abort(fresh):
    pd = fresh
    failures0 = pd.engine.stats().transfer_failures
    p1, p2 = prompt_of(2 * P + 3, 30), prompt_of(P + 1, 31)
    open_room(pd, "aborted-by-decode", len(p2), 31)
    pd.backend.gate.clear()
    pd.engine.add(request("gone", p1, "nobody", f"127.0.0.1:{free_port()}"))
    pd.engine.add(request("dec-abort", p2, "aborted-by-decode", pd.target))
    assert pd.engine.step() == []
    pd.rx.abort("aborted-by-decode", "decode server draining")
    assert pd.rx.num_free_pages == pd.dec_free0  # the decode side freed the room's pages
    pd.backend.gate.set()
    chunks = drive(pd.engine, ["gone", "dec-abort"])
    for c in chunks.values():
        assert c.finish_reason == "error" and c.token_ids == () and c.logprobs is None, c
    assert "handshake" in chunks["gone"].error and "room nobody" in chunks["gone"].error
    assert "decode server draining" in chunks["dec-abort"].error
    assert pd.engine.stats().transfer_failures == failures0 + 2
    assert_no_transfer_counts(pd, [p1, p2])  # the prefix stays cached, nothing leaks


def test_a_room_refused_at_admission_fails_the_request_before_its_prefill(fresh):
    """Bootstrap ahead: the senders handshake when the request is admitted, so a room
    the decode side refuses (here: registered for another token count) fails the request
    before any prefill runs, and nothing is allocated or cached for it."""
    pd = fresh
    failures0 = pd.engine.stats().transfer_failures
    p = prompt_of(2 * P + 5, 45)
    open_room(pd, "refused", len(p) + 1, 45)  # the prompt has one token less
    batches = len(pd.pre.scheduler.batch_sizes)
    pd.engine.add(request("early", p, "refused", pd.target))
    hold = pd.backend.holds.get("refused")
    deadline = time.monotonic() + WAIT
    while hold is None:  # the senders start on their threads
        assert time.monotonic() < deadline
        time.sleep(0.005)
        hold = pd.backend.holds.get("refused")
    outcome = hold.wait(WAIT)
    assert outcome is not None and outcome.state is RoomState.FAILED
    (chunk,) = drive(pd.engine, ["early"]).values()
    assert chunk.finish_reason == "error" and chunk.token_ids == ()
    assert "failed before the prefill" in chunk.error and "num_tokens" in chunk.error, chunk
    assert len(pd.pre.scheduler.batch_sizes) == batches  # never prefilled
    assert hold.inputs is None  # nothing was provided, no page left this server
    assert pd.engine.stats().transfer_failures == failures0 + 1
    assert pd.rx.status("refused").state is RoomState.FAILED
    assert pd.rx.num_free_pages == pd.dec_free0  # the failed room's pages are freed


def test_abort_while_transferring(fresh):
    pd = fresh
    p = prompt_of(2 * P, 40)  # whole pages only
    open_room(pd, "abort-t", len(p), 40)
    pd.backend.gate.clear()
    pd.engine.add(request("t", p, "abort-t", pd.target))
    assert pd.engine.step() == []
    pd.engine.abort("t")  # senders stop (cancelled hold) and abort the room
    (chunk,) = drive(pd.engine, ["t"]).values()
    assert chunk.finish_reason == "abort" and chunk.token_ids == ()
    snap = pd.rx.wait("abort-t", WAIT)
    assert snap.state is RoomState.FAILED and "aborted" in snap.reason
    assert_no_transfer_counts(pd, [p])


AVAILABLE, REASON = mooncake_available()


@pytest.mark.skipif(not AVAILABLE, reason=f"Mooncake Transfer Engine unavailable: {REASON}")
def test_e2e_over_mooncake(fresh):
    from transfer.backends.mooncake_backend import (
        MooncakeBackend,
        MooncakeBackendConfig,
        MooncakeReceiverEndpoint,
    )

    pd = fresh
    print(f"Mooncake available: {AVAILABLE}" + (f" ({REASON})" if REASON else ""))
    config = MooncakeBackendConfig(
        transfer_timeout_s=5.0,
        host_buffer_bytes=1 << 20,
        rpc_timeout_s=10.0,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=5.0,  # as the support senders: a loaded suite stalls ~2 s
        bootstrap_timeout_s=3.0,
    )
    with MooncakeReceiverEndpoint(4 << 20, quarantine_timeout_s=2.0, transfer_timeout_s=5.0) as ep:
        rx, server, target = loopback_receiver(pd.engine.layout, pd.cfg, 16, TIMEOUTS, mooncake=ep)
        backend = GatedBackend(MooncakeBackend(config), WAIT)
        try:
            engine = PrefillModeEngine(pd.pre, backend)  # same scheduler, other backend
            n = 4 * P + 2
            prompt = prompt_of(n, 50)
            dst = rx.allocate_pages(pages_for_tokens(n, P))
            rx.register_room("mc", dst, n, CP)
            backend.gate.clear()
            engine.add(request("mc", prompt, "mc", target))
            assert engine.step() == []
            job, inputs = backend.jobs[("mc", 0)], backend.holds["mc"].inputs
            assert inputs is not None
            view = pd.pre.runner.full_view(
                RequestPageTable.from_prefix(CP, inputs.src_local_pages, job.num_tokens, P)
            )
            backend.gate.set()
            chunk = drive(engine, ["mc"])["mc"]
            assert chunk.finish_reason == "length", chunk
            assert_reference_first_token(pd, prompt, chunk)
            assert rx.status("mc").state is RoomState.SUCCESS
            got = decode_layout(rx, dst, n)
            for x, y in zip(
                jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(view), strict=True
            ):
                assert bitwise_equal(x, y)
            assert_no_transfer_counts(pd, [prompt])
        finally:
            server.stop(0)
            rx.close()
            backend.inner.close()


def test_prefill_waits_for_the_decode_room_and_holds_no_pages_meanwhile(fresh):
    """A request whose decode side has not registered its room yet (it waits in the
    decode server's queue) is not prefilled: it holds no prefill pages until every
    rank's handshake is accepted. The decode side's registration wakes the held
    handshakes at once (`KVTransferServicer` holds a handshake for an unknown room)."""
    pd = fresh
    n = 2 * P + 3
    prompt = prompt_of(n, 31)
    pd.engine.add(request("late", prompt, "late-room", pd.target))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.4:  # the room does not exist yet
        assert pd.engine.step() == []
    s = pd.engine.stats()
    assert (s.waiting, s.running) == (1, 0) and s.queue.length == 1
    np.testing.assert_array_equal(pd.pre.runner.allocator.num_free_per_lane(), pd.free0)
    assert not pd.pre.scheduler.batch_sizes or pd.pre.scheduler.num_waiting == 0
    dst = open_room(pd, "late-room", n, 31)  # the decode side takes it from its queue
    t_open = time.monotonic()
    chunk = drive(pd.engine, ["late"])["late"]
    assert chunk.finish_reason == "length", chunk
    assert pd.rx.status("late-room").state is RoomState.SUCCESS
    assert time.monotonic() - t_open < 5.0
    s = pd.engine.stats()
    assert s.queue.waits >= 1 and s.queue.length == 0
    assert_reference_first_token(pd, prompt, chunk)
    assert_no_transfer_counts(pd, [prompt])
    pd.rx.free_pages(dst)


def test_transfer_reads_beside_donating_prefill_steps(fresh):
    """A transfer reads its held pages while later prefill steps donate the pool: every
    read sees a live pool (none raises "Array has been deleted") and returns the held
    pages' bytes unchanged. Failed before the fix: the source looked the pool up outside
    the step lock, then read the array the next step had donated."""
    pd = fresh
    n = 3 * P + 2
    prompt = prompt_of(n, 40)
    dst = open_room(pd, "held", n, 40)
    pd.backend.gate.clear()  # keeps the transfer (and its page hold) in flight
    pd.engine.add(request("held", prompt, "held", pd.target))
    assert pd.engine.step() == []
    inputs = pd.backend.holds["held"].inputs
    assert inputs is not None
    buffers = pd.engine.layout.buffers()
    sources = pd.engine._sources
    pages = {r: inputs.src_local_pages[r::CP] for r in range(CP)}
    before = [s.dispatches for s in sources]
    want = {(r, b): sources[r].read(*b, pages[r]) for r in range(CP) for b in buffers}
    # A rank's read of every buffer is one gather (each waits behind the step on its device).
    assert [s.dispatches - d for s, d in zip(sources, before, strict=True)] == [1] * CP
    errors: list[BaseException] = []
    reads = 0
    stop = threading.Event()

    def reader() -> None:
        nonlocal reads
        while not stop.is_set():
            for (r, b), expected in want.items():
                try:
                    got = sources[r].read(*b, pages[r])
                except BaseException as e:  # reported below
                    errors.append(e)
                    return
                if not np.array_equal(got, expected):
                    errors.append(AssertionError(f"rank {r} {b}: the held pages changed"))
                    return
                reads += 1

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        for i in range(6):  # other prompts, two chunks each: steps that donate the pool
            result = pd.pre.runner.prefill([prompt_of(4 * P * CP // 2 + i, 50 + i)], 2 * P * CP)
            pd.pre.runner.release(result.tables[0])
    finally:
        stop.set()
        thread.join(WAIT)
    assert not errors, errors[0]
    assert reads > len(want)
    pd.backend.gate.set()
    assert drive(pd.engine, ["held"])["held"].finish_reason == "length"
    assert_no_transfer_counts(pd, [prompt])
    pd.rx.free_pages(dst)
