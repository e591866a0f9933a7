"""`--warmup-all-shapes` (issue 25): a unified server that compiled every reachable step
shape before turning healthy compiles nothing while serving a mixed workload (prompt
lengths from 1 token to what the pool holds, 1-8 requests at once), counted by JAX's
compile events; every shape it dispatched is in the enumerated set."""

from __future__ import annotations

import asyncio
import concurrent.futures

import httpx
import numpy as np
import pytest
from support.http_client import Served
from support.prefill_server import P, float32_args

from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.model.kv_cache import DTYPES
from serving.compile_events import COMPILES
from serving.server import build_server

POOL_PAGES = 17  # 16 usable: 256 tokens per request at most
RUNNING = 8  # batches of 1-8 (issue 25)
WAIT_S = 120.0


@pytest.fixture(scope="module")
def warmed(tiny_checkpoint):
    path, cfg, _ = tiny_checkpoint
    page = per_rank_pool_bytes(cfg, PoolLayout(1, False, 2, P), DTYPES["float32"], "float32") // 2
    args = float32_args(
        path,
        "--kv-pool-size",
        str(POOL_PAGES * page),
        "--max-running-requests",
        str(RUNNING),
        "--warmup-all-shapes",
    )
    server = build_server(args)
    served = Served(server.app)
    try:
        yield server, served
    finally:
        served.stop()
        asyncio.run(server.loop.shutdown(0.0))
        server.close()


def _generate(url: str, ids: list[int], new: int) -> list[int]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
    }
    r = httpx.post(url + "/generate", json=body, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_mixed_workload_compiles_nothing(warmed, tiny_checkpoint):
    _, cfg, model = tiny_checkpoint
    server, served = warmed
    engine = server.engine
    reachable = engine.reachable_shapes()
    assert engine.step_shapes <= reachable
    rng = np.random.default_rng(11)
    longest = (POOL_PAGES - 1) * P
    lengths = [1, 2, 15, 16, 17, 100, longest - 9, *rng.integers(1, longest - 8, 9).tolist()]
    jobs = [(rng.integers(3, cfg.vocab_size, n).tolist(), int(rng.integers(1, 9))) for n in lengths]
    before = COMPILES.snapshot()["serving"]["compiles"]
    with concurrent.futures.ThreadPoolExecutor(RUNNING) as pool:
        outs = list(pool.map(lambda j: _generate(served.url, *j), jobs))
    assert COMPILES.snapshot()["serving"]["compiles"] == before  # nothing compiled
    assert engine.step_shapes <= reachable
    info = httpx.get(served.url + "/server_info", timeout=WAIT_S).json()
    assert info["xla_compiles"]["serving"]["compiles"] == before
    # Outputs are right too (the reference compiles in this process: after the count).
    ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32")
    for (ids, new), out in list(zip(jobs, outs, strict=True))[:4]:
        assert out == ref.generate(ids, new, ignore_eos=True).output_ids
