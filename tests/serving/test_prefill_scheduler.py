"""Prefill scheduler: batch formation, chunking, prefix reuse, abort/timeout, properties.

A closed-form mock executor (no model: logits encode the prompt) tests the scheduler's
host logic; one test drives the real CP prefill step and compares with the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import chex
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv_jax.cache.radix import RadixCache
from cpkv_jax.errors import InputError
from cpkv_jax.lane_allocator import OwnerLaneAllocator
from serving.prefill.adder import CPSharedKVLimits
from serving.prefill.scheduler import PrefillScheduler, StepRow

PAGE = 4
VOCAB = 97


def expected_logits(prompt: np.ndarray) -> np.ndarray:
    out = np.zeros(VOCAB, np.float32)
    out[int(prompt.astype(np.int64).sum()) % VOCAB] = 1.0
    return out


class MockExecutor:
    """Checks every step's tables and returns closed-form logits."""

    def __init__(self, cp: int):
        self.cp = cp
        self.steps: list[list[tuple[int, int]]] = []

    def execute(self, rows: Sequence[StepRow]) -> np.ndarray:
        self.steps.append([(r.start, r.length) for r in rows])
        for r in rows:
            end = r.start + r.length
            assert r.table.num_tokens == end, "pages allocated for exactly the written tokens"
            assert np.array_equal(r.table.owners(), np.arange(r.table.num_pages) % self.cp)
        return np.stack([expected_logits(r.prompt) for r in rows])


def make(cp=2, pages_per_lane=64, **kw):
    alloc = OwnerLaneAllocator(cp, pages_per_lane)
    cache = RadixCache(alloc, PAGE)
    ex = MockExecutor(cp)
    args = dict(cache=cache, executor=ex, max_prefill_tokens=10_000)
    args.update(kw)
    return PrefillScheduler(**args), ex, cache, alloc


def prompt(n, seed):
    return np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.int32)


def held_pages(alloc: OwnerLaneAllocator) -> int:
    return int(alloc.allocated_mask().sum())


def test_fcfs_batches_and_finishes_everything():
    sched, ex, cache, alloc = make(cp_limits=CPSharedKVLimits(shared_kv=True, bs_gt1=True))
    prompts = {f"r{i}": prompt(5 + 3 * i, i) for i in range(4)}
    for rid, p in prompts.items():
        sched.submit(rid, p)
    out = sched.run_until_idle()
    assert {o.rid for o in out} == set(prompts)
    for o in out:
        np.testing.assert_array_equal(o.last_logits, expected_logits(prompts[o.rid]))
    assert sched.batch_sizes == [4]
    # Whole pages went to the cache; tails were freed: only cached pages stay allocated.
    assert held_pages(alloc) == int(cache.total_pages_per_lane().sum())


def test_cp_shared_kv_without_bs_gt1_runs_one_request_per_batch():
    sched, *_ = make(cp_limits=CPSharedKVLimits(shared_kv=True))
    for i in range(3):
        sched.submit(f"r{i}", prompt(9, i))
    sched.run_until_idle()
    assert sched.batch_sizes == [1, 1, 1]
    assert sched.rejections["cp_shared_kv_bs1"] == 2


def test_chunked_request_continues_first_and_chunks_are_page_floored():
    sched, ex, *_ = make(chunked_prefill_size=10)  # floors to 8 tokens = 2 pages
    sched.submit("long", prompt(21, 1))
    sched.submit("short", prompt(3, 2))
    out = sched.run_until_idle()
    assert [o.rid for o in out] == ["long", "short"]
    # The last 5-token chunk leaves 5 chunk tokens: the short request joins that batch.
    assert ex.steps == [[(0, 8)], [(8, 8)], [(16, 5), (0, 3)]]


def test_prefix_is_reused_on_the_same_owner_lanes():
    sched, ex, cache, alloc = make(cp=4)
    shared = prompt(12, 7)
    sched.submit("a", np.concatenate([shared, prompt(5, 8)]))
    sched.run_until_idle()
    sched.submit("b", np.concatenate([shared, prompt(6, 9)]))
    out = sched.run_until_idle()
    assert out[0].cached_tokens == 12
    assert ex.steps[-1] == [(12, 6)]  # only the new tokens were computed


def test_lpm_policy_prefers_the_longest_cached_prefix():
    sched, ex, *_ = make(policy="lpm", cp_limits=CPSharedKVLimits(shared_kv=True))
    base = prompt(16, 3)
    sched.submit("warm", base)
    sched.run_until_idle()
    sched.submit("cold", prompt(10, 4))
    sched.submit("hit", np.concatenate([base, prompt(2, 5)]))
    out = sched.run_until_idle()
    assert [o.rid for o in out] == ["hit", "cold"]


def test_abort_and_timeout_release_pages():
    now = [0.0]
    sched, ex, cache, alloc = make(chunked_prefill_size=8, clock=lambda: now[0])
    sched.submit("chunky", prompt(30, 1))
    sched.submit("late", prompt(5, 2), timeout=1.0)
    sched.step()  # chunky's first chunk
    assert held_pages(alloc) > 0
    assert sched.abort("chunky").status == "aborted"
    assert held_pages(alloc) == 0
    now[0] = 5.0
    out = sched.step()
    assert [(o.rid, o.status) for o in out] == [("late", "timeout")]
    assert sched.num_waiting == 0 and sched.abort("nobody") is None


def test_bad_requests_are_refused_with_a_reason():
    sched, *_ = make(cp=2, pages_per_lane=3)
    with pytest.raises(InputError, match="empty prompt"):
        sched.submit("e", [])
    with pytest.raises(InputError, match="KV pool holds 16"):
        sched.submit("big", prompt(17, 0))
    sched.submit("x", prompt(3, 0))
    with pytest.raises(InputError, match="already queued"):
        sched.submit("x", prompt(3, 0))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=12),
    st.sampled_from([1, 2, 4]),
    st.integers(8, 40),
    st.one_of(st.none(), st.integers(PAGE, 48)),
    st.booleans(),
    st.one_of(st.none(), st.integers(1, 4)),
    st.one_of(st.none(), st.integers(1, 64)),
    st.one_of(st.none(), st.integers(1, 64)),
    st.sampled_from(["fcfs", "lpm"]),
)
def test_scheduler_always_progresses_and_never_overcommits(
    lengths, cp, pages_per_lane, chunk, bs_gt1, max_reqs, max_extend, max_cached, policy
):
    """Random queues and limits: every request finishes (progress while the queue is
    non-empty and capacity is free), allocations stay within every lane, and a lone
    request larger than any CP limit is still admitted (alone)."""
    limits = CPSharedKVLimits(True, bs_gt1, max_reqs, max_extend, max_cached)
    sched, ex, cache, alloc = make(
        cp=cp,
        pages_per_lane=pages_per_lane,
        chunked_prefill_size=chunk,
        cp_limits=limits,
        policy=policy,
        max_prefill_tokens=16,
    )
    capacity = alloc.capacity_per_lane
    prompts = {}
    for i, n in enumerate(lengths):
        # The shared first page makes prefix hits common.
        p = np.concatenate([np.full(PAGE, 5, np.int32), prompt(n, i)])
        if -(-p.size // PAGE) > capacity * cp // 2:
            continue
        prompts[f"r{i}"] = p
        sched.submit(f"r{i}", p)
    done = []
    for _ in range(10_000):
        if not sched.num_waiting:
            break
        out = sched.step()
        assert out or ex.steps, "a step with waiting requests must schedule something"
        assert (alloc.allocated_mask().sum(axis=1) <= capacity).all()
        done += out
    assert sched.num_waiting == 0
    assert {o.rid for o in done} == set(prompts)
    for o in done:
        np.testing.assert_array_equal(o.last_logits, expected_logits(prompts[o.rid]))


def test_real_cp_prefill_step_through_the_scheduler():
    """The scheduler drives the real CP shared-KV step; a prefix hit gives the same logits."""
    from flax import nnx

    from cpkv_jax.config import CPConfig, ModelConfig
    from cpkv_jax.cp_prefill import CPPrefillRunner
    from cpkv_jax.mesh import make_cp_mesh
    from cpkv_jax.model.transformer import CausalLM
    from cpkv_jax.tools.tiny_config import tiny_config_dict
    from serving.prefill.scheduler import CPRunnerExecutor

    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    model = CausalLM(cfg, rngs=nnx.Rngs(5))
    page = 16
    cp = CPConfig(cp_size=8, shared_kv=True, page_size=page)
    runner = CPPrefillRunner(
        cfg, model, make_cp_mesh(8), cp, pages_per_rank=12, index_k_dtype="float32"
    )
    cache = RadixCache(runner.allocator, page)
    sched = PrefillScheduler(
        cache=cache,
        executor=CPRunnerExecutor(runner),
        max_prefill_tokens=4096,
        chunked_prefill_size=48,
        cp_limits=CPSharedKVLimits(shared_kv=True, bs_gt1=True),
    )
    shared = np.random.default_rng(0).integers(3, 300, 5 * page).astype(np.int32)
    a = np.concatenate([shared, np.asarray([7, 8, 9], np.int32)])
    b = np.concatenate([shared, np.asarray([10, 11], np.int32)])
    sched.submit("a", a)
    first = sched.run_until_idle()
    sched.submit("b", b)
    second = sched.run_until_idle()
    assert second[0].cached_tokens == 5 * page
    # Reference: the runner alone, no cache, fresh pools.
    fresh = CPPrefillRunner(
        cfg, model, make_cp_mesh(8), cp, pages_per_rank=12, index_k_dtype="float32"
    )
    want = fresh.prefill([a, b], None).last_logits
    chex.assert_trees_all_close(first[0].last_logits, want[0], rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(second[0].last_logits, want[1], rtol=1e-5, atol=1e-5)


def test_request_that_cannot_allocate_is_matched_afresh_next_time():
    """A waiting request whose pages do not fit its owner lanes (enough pages in total,
    not on lane 0) keeps no stale prefix state: the retry uses a fresh match."""
    sched, _, cache, alloc = make(cp=2, pages_per_lane=8)
    base = prompt(4 * PAGE + 1, 0)
    sched.submit("a", base)
    sched.run_until_idle()
    assert cache.total_size() == 4 * PAGE  # 2 pages per lane cached
    # Lane 0 full (its free pages taken, the cached ones locked), lane 1 mostly free.
    taken = alloc.allocate(np.arange(0, 2 * alloc.num_free(0), 2))
    cache.inc_lock_ref(cache.match_prefix(base).node)
    sched.submit("b", np.concatenate([base[: 4 * PAGE], prompt(3 * PAGE, 1)]))
    assert sched.schedule_batch() is None
    (b,) = sched.waiting
    assert sched.rejections["lane_capacity"] == 1
    assert (b.table, b.done, b.cached_tokens, b.lock_node) == (None, 0, 0, None)
    alloc.free(np.zeros(taken.size, np.int64), taken)
    cache.dec_lock_ref(cache.match_prefix(base).node)
    out = sched.run_until_idle()
    assert [o.rid for o in out] == ["b"] and out[0].cached_tokens == 4 * PAGE
