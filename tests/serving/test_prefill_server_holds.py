"""The PD prefill-mode engine (`serving.prefill.engine`) without a decode side.

- Scheduler page holds (`PrefillScheduler(hold_finished=True)`), host only with a
  closed-form executor: a finished request's pages stay allocated and locked until
  `release_held`, duplicates of pages cached first are swapped for the cache's, and
  afterwards every allocator and cache count equals a non-holding run's.
- The request seed rule; building the engine from `ServerArgs`; sizing the Mooncake
  sender's host buffer and the decode staging arena (tiny checkpoint, GLM-5 config).

The engine end to end with a decode receiver: test_prefill_server_e2e.py. (Until the
tests were split by topic, both were tests/test_prefill_server.py.)
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax.numpy as jnp
import numpy as np
import pytest
from support.prefill_server import (
    CP,
    HCP,
    HP,
    ZeroExecutor,
    host_scheduler,
    lane_counts,
    no_transfer_counts,
    server_args,
)

from benchmarks.bench_memory import DEFAULT_CONFIG as GLM5_DIR
from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import ConfigError, InputError
from cpkv_jax.paging import pages_for_tokens
from serving.engine.api import GenerateRequest, SamplingParams, StepEngine
from serving.prefill.build import pool_pages_per_rank
from serving.prefill.engine import (
    PrefillModeEngine,
    backend_from_args,
    build_prefill_mode_engine,
    mooncake_host_buffer_bytes,
    request_seed,
)
from serving.prefill.scheduler import PrefillScheduler
from serving.server import mooncake_staging_bytes
from transfer.backends.grpc_backend import GrpcBackend
from transfer.page_plan import LayoutDescriptor
from transfer.receiver import staging_region_bytes

# ---- scheduler holds, host only --------------------------------------------------------------


def test_hold_keeps_pages_until_release_then_counts_match_a_plain_run():
    sched, cache, alloc = host_scheduler(True)
    free0 = alloc.num_free_per_lane()
    prompt = np.random.default_rng(1).integers(3, 97, 4 * HP + 3).astype(np.int32)
    sched.submit("a", prompt)
    (out,) = sched.step()
    assert out.status == "finished" and out.table is not None and sched.num_held == 1
    table = out.table
    assert table.num_tokens == prompt.size and table.num_pages == 5
    # Held: whole pages cached but locked (not evictable), the tail page still allocated.
    np.testing.assert_array_equal(cache.evictable_pages_per_lane(), 0)
    np.testing.assert_array_equal(cache.protected_pages_per_lane(), lane_counts(4, HCP))
    np.testing.assert_array_equal(alloc.num_free_per_lane(), free0 - lane_counts(5, HCP))
    assert alloc.allocated_mask()[table.owners(), table.local_pages()].all()
    cache.check_invariants()
    # Nothing can evict a held page, however much is asked for.
    np.testing.assert_array_equal(cache.evict(np.full(HCP, 100)), 0)
    with pytest.raises(InputError, match="already queued or running"):
        sched.submit("a", prompt)  # the id is in use until the hold ends
    sched.release_held("a")
    assert sched.num_held == 0 and table.num_pages == 0
    free, evictable = no_transfer_counts([prompt], HCP, 32, HP)
    np.testing.assert_array_equal(alloc.num_free_per_lane(), free)
    np.testing.assert_array_equal(cache.evictable_pages_per_lane(), evictable)
    np.testing.assert_array_equal(cache.protected_pages_per_lane(), 0)
    cache.check_invariants()
    cache.reset()
    np.testing.assert_array_equal(alloc.num_free_per_lane(), free0)
    with pytest.raises(KeyError, match="holds no pages"):
        sched.release_held("a")


def test_hold_swaps_duplicates_for_cached_pages_and_shares_the_prefix():
    """Two identical prompts in one batch both miss the cache; the second to finish
    finds its whole pages cached by the first: its duplicates are freed and its held
    table points at the cache's pages. A third request reuses the prefix while held."""
    sched, cache, alloc = host_scheduler(True)
    free0 = alloc.num_free_per_lane()
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, 97, 3 * HP + 1).astype(np.int32)
    longer = np.concatenate([prompt[: 3 * HP], rng.integers(3, 97, 2 * HP).astype(np.int32)])
    sched.submit("x", prompt)
    sched.submit("y", prompt)
    outs = {o.rid: o for o in sched.step()}
    tx, ty = outs["x"].table, outs["y"].table
    assert tx is not None and ty is not None and max(sched.batch_sizes) == 2
    np.testing.assert_array_equal(tx.local_pages()[:3], ty.local_pages()[:3])
    assert tx.local_pages()[3] != ty.local_pages()[3]  # each keeps its own tail page
    # Cached once: 3 whole pages; two tail pages (logical page 3, lane 3 % HCP).
    tails = 2 * np.eye(HCP, dtype=np.int64)[3 % HCP]
    np.testing.assert_array_equal(alloc.num_free_per_lane(), free0 - lane_counts(3, HCP) - tails)
    cache.check_invariants()
    sched.submit("z", longer)
    (oz,) = sched.step()
    assert oz.cached_tokens == 3 * HP  # reused while x and y are still held
    for rid in ("x", "z", "y"):
        sched.release_held(rid)
    free, evictable = no_transfer_counts([prompt, prompt, longer], HCP, 32, HP)
    np.testing.assert_array_equal(alloc.num_free_per_lane(), free)
    np.testing.assert_array_equal(cache.evictable_pages_per_lane(), evictable)
    cache.check_invariants()
    cache.reset()
    np.testing.assert_array_equal(alloc.num_free_per_lane(), free0)


def test_request_seed_rule():
    """Explicit seed wins; otherwise BLAKE2b of the rid (the rule the decode server
    shares), stable and in [0, 2**63)."""
    seeded = GenerateRequest("r1", (5,), SamplingParams(seed=1234))
    assert request_seed(seeded) == 1234
    a, b = GenerateRequest("req-a", (5,)), GenerateRequest("req-b", (5,))
    want = int.from_bytes(
        hashlib.blake2b(b"req-a", digest_size=8, person=b"cpkv-jax-seed").digest(), "little"
    ) & ((1 << 63) - 1)
    assert request_seed(a) == want == request_seed(GenerateRequest("req-a", (9, 9)))
    assert request_seed(a) != request_seed(b)
    assert all(0 <= request_seed(GenerateRequest(f"q{i}", (1,))) < 2**63 for i in range(50))


# ---- building the engine and sizing its buffers ----------------------------------------------


def test_engine_is_a_step_engine_and_builds_from_args(tiny_checkpoint):
    path, _, model = tiny_checkpoint
    engine = build_prefill_mode_engine(server_args(path), model=model)
    assert isinstance(engine, StepEngine) and engine.mode == "prefill"
    assert engine.scheduler.hold_finished and isinstance(engine.backend, GrpcBackend)
    config = engine.backend.config  # the --transfer-* defaults
    assert (config.bootstrap_timeout_s, config.heartbeat_interval_s) == (300.0, 5.0)
    assert config.heartbeat_timeout_s == 15.0
    assert not engine.has_work()
    s = engine.stats()
    assert s.kv_pages_total == s.kv_pages_free and len(s.kv_pages_total) == CP
    assert s.kv_bytes_per_page == engine.layout.bytes_per_page() > 0
    with pytest.raises(ConfigError, match="disaggregation-mode prefill"):
        build_prefill_mode_engine(
            dataclasses.replace(server_args(path), disaggregation_mode="null"),
            model=model,
        )
    plain = PrefillScheduler(
        cache=engine.engine.cache, executor=ZeroExecutor(), max_prefill_tokens=64
    )
    with pytest.raises(ConfigError, match="hold_finished=True"):
        PrefillModeEngine(dataclasses.replace(engine.engine, scheduler=plain), engine.backend)


def test_mooncake_host_buffer_size_floor_and_flag(tiny_checkpoint):
    """The Mooncake sender's registered host buffer (`mooncake_host_buffer_bytes`): the
    tiny model's largest rank share is far below the 64 MiB floor; the flag overrides
    the default and reaches the backend's config."""
    path, _, model = tiny_checkpoint
    args = dataclasses.replace(server_args(path), transfer_backend="mooncake")
    assert mooncake_host_buffer_bytes(args, model.cfg) == 64 << 20
    sized = dataclasses.replace(args, transfer_host_buffer_size=3 << 30)
    assert mooncake_host_buffer_bytes(sized, model.cfg) == 3 << 30
    backend = backend_from_args(sized, model.cfg)
    try:
        assert backend.config.host_buffer_bytes == 3 << 30  # registered when first used
    finally:
        backend.close()


def test_mooncake_host_buffer_holds_one_ranks_largest_share_of_glm5(tiny_checkpoint):
    """Sized for the full GLM-5 config (78 layers, 64-token pages of 576 bf16 latent +
    132 B index K per token and layer, cp 8): by default one rank's pages of the
    default 128K-token pool (the pool is shorter than the 200K context), about 1.66 GB; a
    4-page pool gets the 64 MiB floor."""
    path, _, _ = tiny_checkpoint
    glm5 = ModelConfig.from_pretrained(GLM5_DIR)
    args = dataclasses.replace(
        server_args(path),
        transfer_backend="mooncake",
        page_size=64,
        dtype="bfloat16",
        index_k_dtype="fp8_e4m3",
        kv_pool_size=None,  # the default pool: 128K tokens
    )
    page = 78 * 64 * (1152 + 132)
    assert LayoutDescriptor.from_model(glm5, 64, jnp.bfloat16, "fp8_e4m3").bytes_per_page() == page
    pool = pool_pages_per_rank(args, glm5)  # 128K tokens / 64 / 8 = 256, plus slack
    context_share = -(-pages_for_tokens(glm5.max_position_embeddings, 64) // CP)
    assert 256 <= pool < context_share  # the pool, not the 200K context, binds
    assert mooncake_host_buffer_bytes(args, glm5) == pool * page  # 1.66 GB
    small = dataclasses.replace(args, kv_pool_size=4 * page)
    assert mooncake_host_buffer_bytes(small, glm5) == 64 << 20


def test_mooncake_decode_staging_holds_the_longest_request_of_glm5(tiny_checkpoint):
    """The decode side's Mooncake staging arena (`serving.server.mooncake_staging_bytes`):
    by default room for the longest request the decode pool holds: GLM-5's default
    128K-token pool has 2,050 pages with the trash page, so 2,049 pages of 6.4 MB, 13.1
    GB; a 1,000-page pool stages 999 pages; the flag overrides it."""
    path, _, _ = tiny_checkpoint
    glm5 = ModelConfig.from_pretrained(GLM5_DIR)
    args = dataclasses.replace(
        server_args(path),
        disaggregation_mode="decode",
        transfer_backend="mooncake",
        cp_size=1,
        page_size=64,
        dtype="bfloat16",
        index_k_dtype="fp8_e4m3",
        kv_pool_size=None,
    )
    layout = LayoutDescriptor.from_model(glm5, 64, jnp.bfloat16, "fp8_e4m3")
    page = layout.bytes_per_page()
    pool = pool_pages_per_rank(args, glm5)
    assert pool == 2050  # 131,072 / 64 pages, the trash page and slack
    aligned = 3 * 78 * 4096  # each of the 234 buffers starts 4 KiB-aligned
    got = mooncake_staging_bytes(args, glm5, layout, pool)
    assert got == staging_region_bytes(layout, 2049, 4096) and 0 <= got - 2049 * page < aligned
    got = mooncake_staging_bytes(args, glm5, layout, 1000)
    assert 0 <= got - 999 * page < aligned
    assert mooncake_staging_bytes(args, glm5, layout, 3) == 64 << 20  # the floor
    sized = dataclasses.replace(args, transfer_staging_size=5 << 30)
    assert mooncake_staging_bytes(sized, glm5, layout, pool) == 5 << 30
