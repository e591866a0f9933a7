"""`--warmup-all-shapes` (issue 25): a unified server (the plain engine,
`--disable-radix-cache`) that compiled every reachable step shape before turning healthy
compiles nothing while serving a mixed workload (prompt lengths from 1 token to what the
pool holds, 1-8 requests at once), counted by JAX's compile events; every shape it
dispatched is in the enumerated set."""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import pytest
from support.prefill_server import P
from support.unified_server import greedy_ids, serving, unified_args

from cpkv_jax.generate import ReferenceGenerator
from serving.compile_events import COMPILES
from serving.server import build_server

# Among the longest files of the suite: scheduled first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=120)  # on 2 workers, 2026-12-03

# As tests/serving/test_warmup_background.py's server (shapes shared through the cache),
# the plain whole-prompt engine: the default engine's (prefix cache) all-shapes warm-up
# is checked in tests/serving/test_unified_hicache.py, and compiling its CP step shapes
# here as well took 230 s of the suite.
POOL_PAGES = 17  # 16 usable: 256 tokens per request at most
RUNNING = 8  # batches of 1-8 (issue 25)
ENGINE = ("--disable-radix-cache",)
WAIT_S = 120.0


@pytest.fixture(scope="module")
def warmed(tiny_checkpoint):
    path, cfg, _ = tiny_checkpoint
    running = ("--max-running-requests", str(RUNNING), *ENGINE)
    with serving(unified_args(path, cfg, POOL_PAGES, *running, "--warmup-all-shapes")) as s:
        yield s


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
        outs = list(pool.map(lambda j: greedy_ids(served.url, *j, WAIT_S), jobs))
    assert COMPILES.snapshot()["serving"]["compiles"] == before  # nothing compiled
    assert engine.step_shapes <= reachable
    info = httpx.get(served.url + "/server_info", timeout=WAIT_S).json()
    assert info["xla_compiles"]["serving"]["compiles"] == before
    # Outputs are right too (the reference compiles in this process: after the count).
    ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32")
    for (ids, new), out in list(zip(jobs, outs, strict=True))[:4]:
        assert out == ref.generate(ids, new, ignore_eos=True).output_ids


def test_a_decode_server_warms_only_decode_steps(tiny_checkpoint):
    """Issue 35: a decode server never prefills, so its default warm-up compiles the
    decode batch buckets alone (on trash-page tables) and no prefill program."""
    path, cfg, _ = tiny_checkpoint
    args = unified_args(
        path, cfg, POOL_PAGES, "--disaggregation-mode", "decode", "--max-running-requests", "2"
    )
    server = build_server(args)
    try:
        shapes = server.engine.step_shapes
        assert shapes and all(tokens == 1 for _, _, tokens, _ in shapes), shapes
        assert {rows for _, rows, _, _ in shapes} == {1, 2}
        assert server.engine.kv.num_free_pages == POOL_PAGES - 1  # nothing borrowed
    finally:
        server.close()
