"""Ahead-of-time compiles of a PD prefill server (issue 25): after
`PrefillModeEngine.warm_all_shapes` (every reachable CP step shape and every transfer
gather) and `Receiver.warm_commits` (every commit scatter), a mixed workload - prompts
from 1 token to what the pool holds, chunked ones, prefix hits, several in flight, each
transferred over gRPC to a real receiver - compiles nothing, counted by JAX's compile
events; every step shape it dispatched is in the enumerated set."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from support.prefill_server import CP, SENDER, TIMEOUTS, P, drive, float32_args, request

from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.model.kv_cache import DTYPES, init_pool
from cpkv_jax.paging import PageAllocator, pages_for_tokens
from serving.compile_events import COMPILES
from serving.prefill.build import build_prefill_engine
from serving.prefill.engine import PrefillModeEngine
from transfer.backends.grpc_backend import GrpcBackend
from transfer.receiver import Receiver, serve

PAGES_PER_RANK = 5  # 4 usable per lane: prompts of up to 32 pages (512 tokens)
CHUNK = 4 * P
DECODE_PAGES = 80


@pytest.fixture(scope="module")
def warmed(tiny_checkpoint):
    path, cfg, model = tiny_checkpoint
    layout = PoolLayout(CP, True, PAGES_PER_RANK, P)
    pool_bytes = per_rank_pool_bytes(cfg, layout, DTYPES["float32"], "float32")
    args = float32_args(
        path,
        *("--disaggregation-mode", "prefill", "--transfer-backend", "grpc"),
        *("--cp-size", str(CP), "--enable-cp-shared-kv"),
        *("--kv-pool-size", str(pool_bytes), "--chunked-prefill-size", str(CHUNK)),
    )
    engine = PrefillModeEngine(
        build_prefill_engine(args, model=model, hold_finished=True), GrpcBackend(SENDER)
    )
    rx = Receiver(
        engine.layout,
        init_pool(cfg, DECODE_PAGES, P, jnp.float32, "float32"),
        PageAllocator(DECODE_PAGES),
        timeouts=TIMEOUTS,
    ).start(interval=0.02)
    server, port = serve(rx)
    try:
        counts = engine.warm_all_shapes()
        steps, gathers = counts["steps"], counts["transfer gathers"]
        assert counts["host cache copies"] == 0  # no host cache here
        commits = rx.warm_commits(pages_for_tokens(PAGES_PER_RANK * CP * P, P))
        yield engine, rx, f"127.0.0.1:{port}", (steps, gathers, commits)
    finally:
        server.stop(0)
        rx.close()
        engine.engine.close()


def test_mixed_pd_workload_compiles_nothing(warmed):
    engine, rx, target, (steps, gathers, commits) = warmed
    reachable = engine.reachable_shapes()
    # One row (CP shared KV without bs>1), blocks of chunks up to 64 tokens (1, 2, 4 x 16
    # tokens), widths 8 to 32 pages; every rank's gathers of 1, 2, 4 pages; 6 scatters.
    assert {s.rows for s in reachable} == {1}
    assert {s.block for s in reachable} == {1, 2, 4}
    assert {s.width for s in reachable} == {8, 16, 32}
    assert engine.runner.step_shapes == reachable and steps > 0
    assert gathers >= 3 * CP and commits == 6
    longest = (PAGES_PER_RANK - 1) * CP * P - P  # a page left for the output reservation
    rng = np.random.default_rng(5)
    base = rng.integers(3, 300, 150)
    prompts = [rng.integers(3, 300, n) for n in (1, 15, 16, 17, 63, 64, 65, 200, longest)]
    prompts += [base, np.concatenate([base, rng.integers(3, 300, 70)])]  # a prefix hit
    before = COMPILES.total.compiles
    done = {}
    for group in ([0, 1, 2, 3], [4, 5, 6], [7], [8], [9], [10]):  # in flight together
        rooms = {}
        for i in group:
            n = prompts[i].size
            dst = rx.allocate_pages(pages_for_tokens(n, P))
            rx.register_room(f"room{i}", dst, n, CP)
            rooms[i] = dst
            engine.add(request(f"r{i}", prompts[i], f"room{i}", target))
        got = drive(engine, [f"r{i}" for i in group])
        for i in group:
            assert got[f"r{i}"].finish_reason == "length", got[f"r{i}"]
            rx.free_pages(rooms[i])
        done.update(got)
    assert COMPILES.total.compiles == before  # nothing compiled while serving
    assert engine.runner.step_shapes == reachable
    assert engine.prefix_cache_hit_tokens >= 144  # the repeated 150-token prefix's 9 pages
