"""A failed prefill step fails the requests it served, never the server.

- `PrefillScheduler`: a batch whose step raises (a compile, the SPEC S1.7 debug check)
  is dropped as an abort drops it - own pages freed (a chunked request's earlier chunks
  too), cached prefixes unlocked - and reported in `PrefillStepError.outcomes`; the
  scheduler serves the same requests afterwards;
- the PD prefill engine: that batch's requests end with "error" and the reason, and a
  later request is served (so too after a bug elsewhere in its step: then every
  request fails); a step that lost the donated pool raises `EngineStateLostError` (the
  loop then ends the server);
- the unified engine with the prefill scheduler (`CachedUnifiedEngine`): the same, and a
  request whose first token cannot be sampled fails alone, its held pages released.

The prefill steps are closed-form executors (no model compile); the decode batch of the
unified engine is a closed-form stand-in too: these tests are about the bookkeeping.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np
import pytest
from support.prefill_server import HP, InstantBackend, ZeroExecutor, host_scheduler, server_args
from support.unified_server import unified_args

from cpkv_jax.sampling import StepLogits
from cpkv_jax.shared_kv_debug import SharedKVInvariantError
from serving.decode.cached import CachedUnifiedEngine
from serving.engine import api
from serving.engine.api import GenerateRequest, OutputChunk, SamplingParams
from serving.prefill import scheduler as scheduler_mod
from serving.prefill.build import build_prefill_engine
from serving.prefill.engine import PrefillModeEngine, build_prefill_mode_engine
from serving.prefill.scheduler import PrefillScheduler, StepRow

VOCAB = 320  # the tiny checkpoint's
WAIT_S = 30.0  # bound on any wait here; never reached when green
S17 = "step logits differ from the replicated shadow's"


class FlakyExecutor:
    """`inner`'s logits, but each call first runs the next of `faults` (if any left):
    a fault may raise, or corrupt state and raise (a step that lost the pool)."""

    def __init__(self, inner, faults=()):
        self.inner = inner
        self.faults = list(faults)

    def execute(self, rows: Sequence[StepRow]) -> np.ndarray:
        if self.faults:
            self.faults.pop(0)()
        return self.inner.execute(rows)


class ClosedForm:
    """Logits one-hot at the prompt's sum mod the vocabulary; NaN for a prompt whose
    first token is `nan_first` (broken logits)."""

    def __init__(self, vocab: int, nan_first: int | None = None):
        self.vocab, self.nan_first = vocab, nan_first

    def execute(self, rows: Sequence[StepRow]) -> np.ndarray:
        out = np.zeros((len(rows), self.vocab), np.float32)
        for i, r in enumerate(rows):
            out[i, int(r.prompt.astype(np.int64).sum()) % self.vocab] = 8.0
            if r.prompt[0] == self.nan_first:
                out[i] = np.nan
        return out


def raising(exc: Exception):
    def fault():
        raise exc

    return fault


def first_token(prompt: np.ndarray) -> int:
    return int(prompt.astype(np.int64).sum()) % VOCAB


def test_a_failed_step_drops_its_batch_and_the_scheduler_goes_on():
    sched, cache, alloc = host_scheduler(False)
    rng = np.random.default_rng(1)
    base = rng.integers(3, 97, 3 * HP + 1).astype(np.int32)
    sched.submit("warm", base)
    sched.step()  # caches base's 3 whole pages
    free1, evictable1 = alloc.num_free_per_lane(), cache.evictable_pages_per_lane()
    x = np.concatenate([base[: 3 * HP], rng.integers(3, 97, 5).astype(np.int32)])
    y = rng.integers(3, 97, 2 * HP + 3).astype(np.int32)
    sched.executor = FlakyExecutor(ZeroExecutor(), [raising(SharedKVInvariantError(S17))])
    sched.submit("x", x)
    sched.submit("y", y)
    with pytest.raises(scheduler_mod.PrefillStepError) as e:
        sched.step()
    assert isinstance(e.value.__cause__, SharedKVInvariantError)
    outs = {o.rid: o for o in e.value.outcomes}
    assert {rid: o.status for rid, o in outs.items()} == {"x": "failed", "y": "failed"}
    assert outs["x"].reason == f"the prefill step failed: SharedKVInvariantError: {S17}"
    assert sched.num_waiting == 0
    np.testing.assert_array_equal(alloc.num_free_per_lane(), free1)
    np.testing.assert_array_equal(cache.evictable_pages_per_lane(), evictable1)
    np.testing.assert_array_equal(cache.protected_pages_per_lane(), 0)
    cache.check_invariants()
    sched.submit("x", x)  # the same ids again: served, x on the cached prefix
    sched.submit("y", y)
    outs = {o.rid: o for o in sched.step()}
    assert {o.status for o in outs.values()} == {"finished"} and outs["x"].cached_tokens == 3 * HP


def test_a_chunked_request_whose_step_fails_frees_its_earlier_chunks():
    _, cache, alloc = host_scheduler(False)
    free0 = alloc.num_free_per_lane()
    sched = PrefillScheduler(
        cache=cache,
        executor=FlakyExecutor(ZeroExecutor()),
        max_prefill_tokens=10_000,
        chunked_prefill_size=2 * HP,
    )
    long = np.random.default_rng(2).integers(3, 97, 5 * HP + 1).astype(np.int32)
    sched.submit("long", long)
    assert sched.step() == [] and sched.chunked is not None  # first chunk written
    sched.executor.faults.append(raising(RuntimeError("XLA compile failed")))
    with pytest.raises(scheduler_mod.PrefillStepError) as e:
        sched.step()
    assert [(o.rid, o.status) for o in e.value.outcomes] == [("long", "failed")]
    assert sched.chunked is None and sched.num_waiting == 0
    np.testing.assert_array_equal(alloc.num_free_per_lane(), free0)
    cache.check_invariants()


# ---- the PD prefill engine ----------------------------------------------------------------


def pd_request(rid: str, prompt: np.ndarray) -> GenerateRequest:
    return GenerateRequest(
        rid,
        tuple(int(t) for t in prompt),
        SamplingParams(max_new_tokens=4),
        bootstrap_room=f"room-{rid}",
        decode_transfer_target="127.0.0.1:1",  # never dialled (InstantBackend)
    )


def drive(engine, rids: set[str], tokens: dict[str, list[int]] | None = None):
    """Step until every request of `rids` has its final chunk; their output tokens go
    to `tokens`."""
    final: dict[str, OutputChunk] = {}
    tokens = {} if tokens is None else tokens
    deadline = time.monotonic() + WAIT_S
    while not rids <= set(final):
        assert time.monotonic() < deadline, f"no final chunk for {rids - set(final)}"
        for c in engine.step():
            tokens.setdefault(c.rid, []).extend(c.token_ids)
            if c.finished:
                final[c.rid] = c
    return final


@pytest.fixture
def prefill_server(tiny_checkpoint) -> PrefillModeEngine:
    path, _, model = tiny_checkpoint
    engine = build_prefill_mode_engine(server_args(path), model=model)
    engine.backend = InstantBackend(WAIT_S)
    engine.scheduler.executor = FlakyExecutor(ClosedForm(VOCAB))
    return engine


def test_a_failed_prefill_step_fails_its_requests_and_the_server_serves_on(prefill_server):
    """The SPEC S1.7 debug check (`CPKV_DEBUG_SHARED_KV=1`) failing a step: its request
    ends with "error" and the reason (its room aborted, its pages freed), the next one is
    served. (Before, the exception left `step` and the engine loop ended the server.)"""
    engine = prefill_server
    alloc, cache = engine.runner.allocator, engine.scheduler.cache
    free0 = alloc.num_free_per_lane()
    engine.scheduler.executor.faults.append(raising(SharedKVInvariantError(S17)))
    rng = np.random.default_rng(3)
    a, b = (rng.integers(3, VOCAB, n).astype(np.int32) for n in (40, 21))
    engine.add(pd_request("a", a))
    got = drive(engine, {"a"})["a"]
    assert got.finish_reason == "error" and not got.token_ids
    assert got.error == f"the prefill step failed: SharedKVInvariantError: {S17}"
    np.testing.assert_array_equal(alloc.num_free_per_lane(), free0)
    assert not engine.has_work() and engine.scheduler.num_held == 0
    engine.add(pd_request("b", b))
    got = drive(engine, {"b"})["b"]
    assert got.finish_reason == "length" and got.token_ids == (first_token(b),)
    cache.check_invariants()
    cache.reset()
    np.testing.assert_array_equal(alloc.num_free_per_lane(), free0)


def test_a_bug_past_the_prefill_step_fails_the_requests_not_the_server(prefill_server, monkeypatch):
    """Which requests a step's bookkeeping touched before it raised is unknown: every
    request here fails with the reason (rooms aborted, nothing left held), and the
    server serves the next one."""
    engine = prefill_server
    free0 = engine.runner.allocator.num_free_per_lane()
    real = engine._submit_ready
    bugs = [RuntimeError("a bug")]

    def submit_ready():
        if bugs:
            raise bugs.pop()
        real()

    monkeypatch.setattr(engine, "_submit_ready", submit_ready)
    engine.add(pd_request("a", np.arange(3, 40, dtype=np.int32)))
    got = drive(engine, {"a"})["a"]
    assert got.finish_reason == "error"
    assert got.error == "the prefill server's step failed: RuntimeError: a bug"
    assert not engine.has_work()
    b = np.arange(5, 30, dtype=np.int32)
    engine.add(pd_request("b", b))
    got = drive(engine, {"b"})["b"]
    assert got.finish_reason == "length" and got.token_ids == (first_token(b),)
    engine.scheduler.cache.reset()
    np.testing.assert_array_equal(engine.runner.allocator.num_free_per_lane(), free0)


def test_a_prefill_step_that_loses_the_pool_is_fatal(prefill_server):
    engine = prefill_server

    def lose_the_pool():
        for leaf in jax.tree.leaves(engine.runner.pool):
            leaf.delete()
        raise RuntimeError("device lost mid-step")

    engine.scheduler.executor.faults.append(lose_the_pool)
    engine.add(pd_request("a", np.arange(3, 40, dtype=np.int32)))
    with pytest.raises(api.EngineStateLostError, match="donated to the failed step") as e:
        drive(engine, {"a"})
    assert "RuntimeError: device lost mid-step" in str(e.value)
    for entry in engine._requests.values():  # the senders stop now, not at their timeout
        if entry.hold is not None:
            entry.hold.cancel("test over")


# ---- the unified engine on the prefill scheduler -------------------------------------------


def test_the_unified_prefix_cache_engine_fails_a_step_or_a_row_alone(tiny_checkpoint):
    path, cfg, model = tiny_checkpoint
    args = unified_args(path, cfg, 12, "--chunked-prefill-size", "32")
    prefill = build_prefill_engine(args, model=model, devices=jax.devices()[:1], hold_finished=True)
    nan_first = 5
    prefill.scheduler.executor = FlakyExecutor(
        ClosedForm(VOCAB, nan_first), [raising(RuntimeError("XLA compile failed"))]
    )
    engine = CachedUnifiedEngine(
        prefill=prefill, cfg=cfg, model=model, page_size=args.page_size,
        index_k_dtype=args.index_k_dtype, max_running_requests=4,
    )  # fmt: skip

    def decode(rows, prev=None):  # the decode batch, closed-form: token 7 for every row
        out = np.full((len(rows), VOCAB), -30.0, np.float32)
        out[:, 7] = 0.0
        return StepLogits(out)

    engine.steps.decode = decode
    total = engine.stats().kv_pages_total[0]
    rng = np.random.default_rng(4)
    a, b = (rng.integers(8, VOCAB, n).astype(np.int32) for n in (30, 19))
    broken = np.concatenate([[nan_first], rng.integers(8, VOCAB, 12)]).astype(np.int32)

    def req(rid: str, prompt: np.ndarray) -> GenerateRequest:
        ids = tuple(int(t) for t in prompt)
        return GenerateRequest(rid, ids, SamplingParams(max_new_tokens=3, ignore_eos=True))

    def settled() -> None:
        # A decode step dispatched before the last rows' final tokens were seen (the
        # overlap) is still in flight: it yields nothing more.
        assert engine.step() == [] and not engine.has_work() and engine.cached.reserved == 0
        assert engine.scheduler.num_held == 0 and not engine.cached.decode_pages
        cache = engine.prefill.cache
        assert engine.kv.num_free_pages + int(cache.evictable_pages_per_lane()[0]) == total
        cache.check_invariants()

    engine.add(req("a", a))
    got = drive(engine, {"a"})["a"]
    assert got.finish_reason == "error"
    assert got.error == "the prefill step failed: RuntimeError: XLA compile failed"
    settled()
    engine.add(req("b", b))
    engine.add(req("broken", broken))
    tokens: dict[str, list[int]] = {}
    got = drive(engine, {"b", "broken"}, tokens)
    assert got["b"].finish_reason == "length" and tokens["b"] == [first_token(b), 7, 7]
    assert got["broken"].finish_reason == "error" and not tokens["broken"]
    assert "output token 0 of this request failed: ValueError" in got["broken"].error
    settled()
    engine.add(req("long", rng.integers(8, VOCAB, 70).astype(np.int32)))
    assert engine.step() == [] and "long" in engine.cached.prefilling  # one chunk of three
    engine.abort("long")  # aborted between its chunks: what it took comes back
    assert [(c.rid, c.finish_reason) for c in engine.step()] == [("long", "abort")]
    settled()
    engine.close()
