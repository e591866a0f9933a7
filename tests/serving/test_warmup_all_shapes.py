"""`--warmup all` (issue 25; the default since issue 35): a unified server (the plain engine,
`--disable-radix-cache`) that compiled every reachable step shape before turning healthy
compiles nothing while serving a mixed workload (prompt lengths from 1 token to what the
pool holds, 1-8 requests at once), counted by JAX's compile events; every shape it
dispatched is in the enumerated set.

With `--warmup-background` a server of the same flags turns healthy after the common
buckets and compiles the other reachable step shapes on a background thread while it
serves. Requests sent at once are answered right (a request that needs a shape still
compiling waits for it, one that needs a shape not started compiles it itself, neither
compiles a shape twice); once the background finished, every reachable shape is
compiled, the programs compiled after healthy (background + by requests) number exactly
the jobs it was given, and a second round compiles nothing. Both servers in one module:
one test worker runs them in turn, so the second reads the first's programs from the
run's compilation cache (in two modules they ran at once on the two workers, each
compiling every shape)."""

from __future__ import annotations

import concurrent.futures
import gc

import httpx
import jax
import numpy as np
import pytest
from support.prefill_server import P
from support.unified_server import greedy_ids, serving, unified_args

from cpkv_jax import aot
from cpkv_jax.generate import ReferenceGenerator
from serving.compile_events import COMPILES
from serving.server import build_server

# Among the longest files of the suite: scheduled first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=70)  # on 2 workers, 2026-12-05

# The plain whole-prompt engine: the default engine's (prefix cache) all-shapes warm-up
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
    with serving(unified_args(path, cfg, POOL_PAGES, *running, "--warmup", "all")) as s:
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


# ---- --warmup-background --------------------------------------------------------------


def _background_compiles() -> int:
    return COMPILES.snapshot()["background"]["compiles"]  # per process, never reset


@pytest.fixture(scope="module")
def background(tiny_checkpoint):
    path, cfg, _ = tiny_checkpoint
    running = ("--max-running-requests", str(RUNNING), *ENGINE)
    warm = ("--warmup", "all", "--warmup-background", "--warmup-prompt-scoring")
    # The all-shapes server above left these shapes' executables in this process: drop
    # them, so this server compiles its own (read back from the run's persistent cache,
    # which still counts as a compile) and its background jobs have work to do.
    gc.collect()
    jax.clear_caches()
    aot.clear_all()
    before = _background_compiles()  # this process's earlier servers', if any
    with serving(unified_args(path, cfg, POOL_PAGES, *running, *warm)) as (server, served):
        yield server, served, before


def test_serves_while_compiling_and_compiles_each_shape_once(background, tiny_checkpoint):
    _, cfg, model = tiny_checkpoint
    server, served, before = background
    engine, compiler = server.engine, server.compiler
    assert compiler is not None and compiler.jobs  # shapes were left to the background
    programs = len(compiler.jobs)
    reachable = engine.reachable_shapes()
    rng = np.random.default_rng(25)
    longest = (POOL_PAGES - 1) * P
    lengths = [longest - 9, 1, 100, 17, *rng.integers(1, longest - 8, 8).tolist()]
    jobs = [(rng.integers(3, cfg.vocab_size, n).tolist(), int(rng.integers(1, 9))) for n in lengths]
    with concurrent.futures.ThreadPoolExecutor(RUNNING) as pool:  # at once, while compiling
        outs = list(pool.map(lambda j: greedy_ids(served.url, *j, WAIT_S), jobs))
    assert compiler.wait(WAIT_S)
    progress = compiler.progress()
    assert progress["finished"] and progress["failed"] == 0
    assert progress["compiled"] == programs
    assert reachable <= engine.compiled_step_shapes
    # Each shape compiled once: on the background thread or by the request that needed
    # it first (a request that found it compiling waited: no second compile). XLA
    # compiles after healthy are at most the jobs (JAX's own caches may serve some).
    assert engine.step_compile_count == len(engine.compiled_step_shapes)
    serving = COMPILES.snapshot()["serving"]["compiles"]  # since this server's healthy
    assert 0 < serving + _background_compiles() - before <= programs
    info = httpx.get(served.url + "/server_info", timeout=WAIT_S).json()
    assert info["background_compile"]["finished"] is True
    assert info["background_compile"]["programs"] == programs

    serving = COMPILES.snapshot()["serving"]["compiles"]
    with concurrent.futures.ThreadPoolExecutor(RUNNING) as pool:
        again = list(pool.map(lambda j: greedy_ids(served.url, *j, WAIT_S), jobs))
    assert COMPILES.snapshot()["serving"]["compiles"] == serving  # all compiled now
    assert again == outs
    # `--warmup-prompt-scoring`: the prefill steps' scoring twins were jobs too, so
    # prompt log-prob requests (whole prompts, from a later token) compile nothing.
    scoring = [j for j in compiler.jobs if j.label.startswith("prompt-scoring step")]
    assert len(scoring) == len({s for s in reachable if s[2] > 1}) > 0
    for ids, _ in jobs[:3]:
        for start in (0, len(ids) // 2):
            body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start,
                    "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}  # fmt: skip
            r = httpx.post(served.url + "/generate", json=body, timeout=WAIT_S)
            assert r.status_code == 200, r.text
            assert len(r.json()["meta_info"]["input_token_logprobs"]) == len(ids) - start
    assert COMPILES.snapshot()["serving"]["compiles"] == serving
    ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32")
    for (ids, new), out in list(zip(jobs, outs, strict=True))[:4]:
        assert out == ref.generate(ids, new, ignore_eos=True).output_ids
