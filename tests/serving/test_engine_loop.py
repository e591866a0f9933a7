"""`serving.engine.loop.EngineLoop` around the real `DecodeEngine` on the tiny model.

Concurrent `generate` calls from asyncio must give the reference's greedy tokens
(exact; log-probs within 1e-5, see tests/serving/test_decode_engine.py); a consumer that leaves
mid-stream aborts its request and every page comes back; shutdown drains, then aborts
what is left; an `InputError` from `add` surfaces before any chunk; a failed step fails
the requests it served and the loop serves on, while an engine step that raises (its
pool lost) fails the in-flight requests and marks the loop unhealthy; `stats()` is what
the engine thread published.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.decode_model import INDEX_K, POOL_PAGES, P, two_layer_model

from cpkv_jax.errors import InputError
from cpkv_jax.kv_store import PagedKVStore
from serving.decode.engine import DecodeEngine
from serving.engine.api import EngineClient, GenerateRequest, OutputChunk, SamplingParams
from serving.engine.loop import EngineFailedError, EngineLoop, ServerShuttingDownError

WAIT_S = 30.0  # upper bound on any wait here; never reached when green


@pytest.fixture(scope="module")
def tiny():
    return two_layer_model()


def make_loop(tiny, engine_wrapper=None) -> tuple[EngineLoop, PagedKVStore]:
    cfg, model, _ = tiny
    kv = PagedKVStore.create(cfg, POOL_PAGES, P, jnp.float32, INDEX_K)
    engine = DecodeEngine(
        cfg=cfg,
        model=model,
        kv=kv,
        page_size=P,
        index_k_dtype=INDEX_K,
        mode="null",
        max_running_requests=8,
        context_length=256,
    )
    loop = EngineLoop(engine if engine_wrapper is None else engine_wrapper(engine))
    assert isinstance(loop, EngineClient)
    return loop, kv


def request(rid: str, seed: int, n: int, max_new: int) -> GenerateRequest:
    prompt = np.random.default_rng(seed).integers(3, 300, n)
    return GenerateRequest(
        rid,
        tuple(int(t) for t in prompt),
        SamplingParams(max_new_tokens=max_new, ignore_eos=True),
        return_logprob=True,
    )


async def collect(client: EngineLoop, req: GenerateRequest) -> list[OutputChunk]:
    return [c async for c in client.generate(req)]


def start(client: EngineLoop, req: GenerateRequest):
    """Consume `req` in a task; the event is set at its first chunk."""
    first = asyncio.Event()

    async def consume() -> list[OutputChunk]:
        chunks = []
        async for c in client.generate(req):
            chunks.append(c)
            first.set()
        return chunks

    return asyncio.create_task(consume()), first


async def wait_for(cond, timeout=WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


class WrappedEngine:
    """Delegates to a real engine; each step sleeps `delay_s` first (so a request
    outlives the test's next move), and step number `fail_at` raises."""

    def __init__(self, engine: DecodeEngine, fail_at: int | None = None, delay_s: float = 0.0):
        self.engine = engine
        self.mode = engine.mode
        self.steps = 0
        self.fail_at = fail_at
        self.delay_s = delay_s

    def add(self, req):
        self.engine.add(req)

    def abort(self, rid):
        self.engine.abort(rid)

    def has_work(self):
        return self.engine.has_work()

    def stats(self):
        return self.engine.stats()

    def step(self):
        self.steps += 1
        time.sleep(self.delay_s)
        if self.steps == self.fail_at:
            raise RuntimeError("device lost")
        return self.engine.step()


def slow(engine: DecodeEngine) -> WrappedEngine:
    return WrappedEngine(engine, delay_s=0.02)  # 16+ tokens take >= 0.3 s


def test_concurrent_generate_matches_reference(tiny):
    _, _, ref = tiny
    loop, kv = make_loop(tiny)
    reqs = [request(f"c{i}", 10 + i, n, m) for i, (n, m) in enumerate([(16, 6), (11, 8), (5, 12)])]

    async def main():
        results = await asyncio.gather(*(collect(loop, r) for r in reqs))
        await loop.shutdown(drain_timeout=5.0)
        return results

    results = asyncio.run(main())
    for r, chunks in zip(reqs, results, strict=True):
        want = ref.generate(r.input_ids, r.sampling.max_new_tokens, ignore_eos=True)
        assert [t for c in chunks for t in c.token_ids] == want.output_ids
        lps = [x for c in chunks for x in c.logprobs]
        np.testing.assert_allclose(lps, want.output_logprobs, rtol=0, atol=1e-5)
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert not any(c.finished for c in chunks[:-1])
    assert kv.num_free_pages == POOL_PAGES - 1
    assert not loop.healthy()  # stopped


def test_consumer_leaving_aborts_and_every_page_returns(tiny):
    loop, kv = make_loop(tiny, slow)
    free0 = kv.num_free_pages

    async def main():
        # A consumer that stops reading after the first chunk (client disconnect).
        async with contextlib.aclosing(loop.generate(request("gone", 1, 16, 16))) as gen:
            async for first in gen:
                assert first.token_ids and not first.finished
                break
        # A consumer task cancelled mid-stream.
        started = asyncio.Event()

        async def consume():
            async for _ in loop.generate(request("cancelled", 2, 13, 19)):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: kv.num_free_pages == free0 and loop.stats().running == 0)
        stats = loop.stats()
        await loop.shutdown(drain_timeout=1.0)
        return stats

    stats = asyncio.run(main())
    assert stats.kv_pages_free == (free0,) and stats.waiting == 0


def test_input_error_surfaces_before_streaming(tiny):
    loop, kv = make_loop(tiny)

    async def main():
        gen = loop.generate(request("long", 3, 250, 16))  # 266 > context length 256
        with pytest.raises(InputError, match="exceeds the context length 256"):
            await gen.__anext__()
        ok = await collect(loop, request("ok", 4, 5, 12))
        await loop.shutdown(drain_timeout=5.0)
        return ok

    ok = asyncio.run(main())
    assert ok[-1].finish_reason == "length" and kv.num_free_pages == POOL_PAGES - 1


def test_shutdown_drains_then_aborts_and_refuses(tiny):
    loop, kv = make_loop(tiny)

    async def main():
        task, first = start(loop, request("drained", 5, 13, 19))
        await asyncio.wait_for(first.wait(), WAIT_S)
        await loop.shutdown(drain_timeout=WAIT_S)
        drained = await task
        with pytest.raises(ServerShuttingDownError):
            await loop.generate(request("late", 6, 5, 4)).__anext__()

        short, kv2 = make_loop(tiny, slow)
        task, first = start(short, request("cut", 7, 5, 27))
        await asyncio.wait_for(first.wait(), WAIT_S)
        await short.shutdown(drain_timeout=0.0)
        return drained, await task, kv2

    drained, cut, kv2 = asyncio.run(main())
    assert drained[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in drained) == 19
    assert cut[-1].finish_reason == "abort" and sum(len(c.token_ids) for c in cut) < 27
    assert kv.num_free_pages == kv2.num_free_pages == POOL_PAGES - 1


def test_step_exception_fails_requests_and_marks_unhealthy(tiny, caplog):
    loop, kv = make_loop(tiny, lambda e: WrappedEngine(e, fail_at=3))

    async def main():
        results = await asyncio.gather(
            collect(loop, request("f0", 8, 16, 10)), collect(loop, request("f1", 9, 5, 12))
        )
        with pytest.raises(EngineFailedError, match="device lost"):
            await loop.generate(request("after", 10, 5, 4)).__anext__()
        healthy = loop.healthy()
        await loop.shutdown(drain_timeout=1.0)
        return results, healthy

    results, healthy = asyncio.run(main())
    assert not healthy
    for chunks in results:
        assert chunks[-1].finish_reason == "error"
        assert "RuntimeError: device lost" in chunks[-1].error
    assert kv.num_free_pages == POOL_PAGES - 1  # the failed requests' pages were freed
    assert any("engine step failed" in r.getMessage() and r.exc_info for r in caplog.records)


class BlockingAdd(WrappedEngine):
    """`add` of request `block` waits for `release`: commands queue up behind it."""

    def __init__(self, engine: DecodeEngine, block: str):
        super().__init__(engine)
        self.block = block
        self.adding = threading.Event()
        self.release = threading.Event()

    def add(self, req):
        if req.rid == self.block:
            self.adding.set()
            assert self.release.wait(WAIT_S)
        self.engine.add(req)


def test_a_request_cancelled_while_its_add_is_queued_leaves_the_loop_running(tiny):
    """The client of a queued add leaves (its future is cancelled) before the engine
    thread takes it: the add is skipped and the loop keeps serving. Before the fix the
    thread took the add, then `set_result` on the cancelled future raised
    InvalidStateError and the engine thread died (every later request hung)."""
    loop, kv = make_loop(tiny, lambda e: BlockingAdd(e, "first"))
    engine = loop._engine

    async def main():
        first = asyncio.create_task(collect(loop, request("first", 11, 6, 4)))
        assert await asyncio.to_thread(engine.adding.wait, WAIT_S)
        victim = asyncio.create_task(collect(loop, request("victim", 12, 6, 4)))
        await asyncio.sleep(0.05)  # its add is queued behind "first"
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        engine.release.set()
        got = await asyncio.wait_for(first, WAIT_S)
        after = await asyncio.wait_for(collect(loop, request("after", 13, 7, 5)), WAIT_S)
        healthy = loop.healthy(), loop.fatal_reason()
        await loop.shutdown(drain_timeout=5.0)
        return got, after, healthy

    got, after, (healthy, why) = asyncio.run(main())
    assert healthy and why is None
    assert got[-1].finish_reason == after[-1].finish_reason == "length"
    assert kv.num_free_pages == POOL_PAGES - 1
    assert "victim" not in {r.rid for r in engine.engine.running.values()}


class BrokenLoopEngine(WrappedEngine):
    """`has_work` raises after `n` calls: a bug the loop itself cannot survive."""

    def __init__(self, engine: DecodeEngine, n: int):
        super().__init__(engine)
        self.calls = n

    def has_work(self):
        self.calls -= 1
        if self.calls < 0:
            raise RuntimeError("corrupt engine state")
        return self.engine.has_work()


def test_a_dead_engine_thread_says_why_and_fails_waiting_requests(tiny):
    loop, _ = make_loop(tiny, lambda e: BrokenLoopEngine(e, 4))

    async def main():
        chunks = await asyncio.wait_for(collect(loop, request("doomed", 14, 6, 30)), WAIT_S)
        await wait_for(lambda: not loop._thread.is_alive())
        with pytest.raises(EngineFailedError, match="engine thread died"):
            await loop.generate(request("late", 15, 5, 4)).__anext__()
        return chunks, loop.healthy(), loop.fatal_reason()

    chunks, healthy, why = asyncio.run(main())
    assert chunks[-1].finish_reason == "error" and "engine thread died" in chunks[-1].error
    assert not healthy and "RuntimeError: corrupt engine state" in why


def test_server_watchdog_stops_serving_when_the_engine_dies():
    """`serving.server._watch_engine`: once the loop reports a fatal reason, uvicorn is
    told to exit and the server records why (`run_server` then exits non-zero)."""
    from types import SimpleNamespace

    from serving import server as server_mod

    loop = SimpleNamespace(reason=None)
    loop.fatal_reason = lambda: loop.reason
    srv = SimpleNamespace(loop=loop, engine_failure=None)
    uv = SimpleNamespace(should_exit=False)

    async def main():
        task = asyncio.create_task(server_mod._watch_engine(srv, uv))
        await asyncio.sleep(2 * server_mod.ENGINE_WATCH_S)
        assert not task.done() and not uv.should_exit
        loop.reason = "engine step failed: RuntimeError: device lost"
        await asyncio.wait_for(task, WAIT_S)

    asyncio.run(main())
    assert uv.should_exit and srv.engine_failure == loop.reason
    assert server_mod.EXIT_ENGINE_FAILED not in (0, 1)


def test_a_failed_step_fails_its_requests_and_the_loop_serves_on(tiny, caplog):
    """A decode step whose compile raises (nothing donated yet) fails the request it
    served, with the reason, and frees its pages; the loop stays healthy and serves the
    next request as the reference does. (Before, every such failure ended the server.)"""
    _, _, ref = tiny
    loop, kv = make_loop(tiny)
    steps = loop._engine.steps
    real = steps.compiled
    failed: list = []

    def compiled(shape):
        if shape[2] == 1 and not failed:  # the first decode step
            failed.append(shape)
            raise RuntimeError("XLA compile failed")
        return real(shape)

    steps.compiled = compiled

    async def main():
        doomed = await collect(loop, request("doomed", 16, 16, 6))
        healthy = loop.healthy(), loop.fatal_reason()
        after = await collect(loop, request("after", 17, 11, 8))
        await loop.shutdown(drain_timeout=5.0)
        return doomed, healthy, after

    doomed, (healthy, why), after = asyncio.run(main())
    assert doomed[-1].finish_reason == "error"
    assert doomed[-1].error == "the decode step failed: RuntimeError: XLA compile failed"
    assert healthy and why is None
    want = ref.generate(request("after", 17, 11, 8).input_ids, 8, ignore_eos=True)
    assert [t for c in after for t in c.token_ids] == want.output_ids
    assert after[-1].finish_reason == "length"
    assert kv.num_free_pages == POOL_PAGES - 1
    logged = [r for r in caplog.records if r.exc_info and "XLA compile" in str(r.exc_info[1])]
    assert len(logged) == 1


def test_a_step_that_loses_the_pool_still_ends_the_loop(tiny):
    """A step that donated the pool and then raised leaves deleted arrays: nothing can be
    served any more, so the loop fails the request, turns unhealthy and says why (the
    server exits on it)."""
    loop, _ = make_loop(tiny)
    steps = loop._engine.steps
    real = steps.compiled

    def compiled(shape):
        step = real(shape)
        if shape[2] != 1:
            return step

        def donated_then_failed(state, batch, pool):
            for leaf in jax.tree.leaves(pool):
                leaf.delete()
            raise RuntimeError("device lost mid-step")

        return donated_then_failed

    steps.compiled = compiled

    async def main():
        chunks = await asyncio.wait_for(collect(loop, request("lost", 18, 11, 8)), WAIT_S)
        with pytest.raises(EngineFailedError, match="EngineStateLostError"):
            await loop.generate(request("late", 19, 5, 4)).__anext__()
        state = loop.healthy(), loop.fatal_reason()
        await loop.shutdown(drain_timeout=1.0)
        return chunks, state

    chunks, (healthy, why) = asyncio.run(main())
    assert chunks[-1].finish_reason == "error" and "RuntimeError: device lost" in chunks[-1].error
    assert not healthy
    assert "KV pool arrays were donated to the failed step and are gone" in why


class StatsThreads(WrappedEngine):
    """Records the threads `stats` is called on."""

    def __init__(self, engine: DecodeEngine):
        super().__init__(engine)
        self.threads: set[str] = set()

    def stats(self):
        self.threads.add(threading.current_thread().name)
        return self.engine.stats()


def test_stats_are_what_the_engine_thread_published(tiny):
    """`/server_info` and `/metrics` read `EngineLoop.stats()`: the engine is never asked
    from the caller's thread while it steps (a live read raced the step and could fail),
    and what the caller sees is current once a request's last chunk arrived."""
    loop, kv = make_loop(tiny, StatsThreads)
    engine = loop._engine
    engine.threads.clear()  # the constructor's first read, before the thread ran

    async def main():
        await collect(loop, request("s0", 20, 5, 12))
        seen = [loop.stats() for _ in range(3)]
        threads = set(engine.threads)
        await loop.shutdown(drain_timeout=1.0)
        return seen, threads

    seen, threads = asyncio.run(main())
    assert threads == {loop._thread.name}
    for stats in seen:
        assert (stats.running, stats.waiting) == (0, 0)
        assert stats.kv_pages_free == (POOL_PAGES - 1,) == (kv.num_free_pages,)
