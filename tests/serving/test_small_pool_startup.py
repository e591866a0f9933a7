"""A server starts with any pool that holds one page per owner lane besides the trash page
(issue 26): the warm-up prefills only what the pool can hold, the startup log and
`/server_info` say the longest prompt, a prompt of that length is served and a longer one
refused with `InputError` (HTTP 400) before anything is queued.

A CP 8 shared-KV PD prefill server of the tiny checkpoint with the smallest pool, 2 pages
of 4 tokens per rank (one usable per lane: 32 tokens in all), and no
`--chunked-prefill-size`, so the warm-up's default chunk (4 pages per rank, 128 tokens)
is more than the pool holds (before: "owner lane(s) out of KV pages" at startup). Small
pages keep the warm-up to two step compiles. The same for a unified server with one
usable page, whose warm-up probe requests must shrink to it; and its
`--max-running-requests none`, bounded by the pool rather than a fixed 64.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
import pytest
from support.prefill_server import (
    CP,
    SENDER,
    TIMEOUTS,
    drive,
    float32_args,
    loopback_receiver,
    request,
)
from support.prefill_server import P as UP
from support.unified_server import unified_args

from cpkv_jax.errors import InputError
from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.model.kv_cache import DTYPES
from cpkv_jax.paging import pages_for_tokens
from serving import server as server_mod
from serving.engine.api import GenerateRequest, SamplingParams
from serving.prefill.build import build_prefill_engine
from serving.prefill.engine import PrefillModeEngine
from transfer.backends.grpc_backend import GrpcBackend

P = 4
PAGES_PER_RANK = 2  # the trash page + 1 usable per lane: the smallest pool
CAPACITY = (PAGES_PER_RANK - 1) * CP * P  # 32 tokens in the pool
LONGEST = CAPACITY - 1  # a token of the output is reserved beside the prompt


@pytest.fixture(scope="module")
def small_prefill(tiny_checkpoint):
    path, cfg, model = tiny_checkpoint
    layout = PoolLayout(CP, True, PAGES_PER_RANK, P)
    args = float32_args(
        path,
        *("--disaggregation-mode", "prefill", "--transfer-backend", "grpc"),
        *("--cp-size", str(CP), "--enable-cp-shared-kv", "--page-size", str(P)),
        *("--kv-pool-size", str(per_rank_pool_bytes(cfg, layout, DTYPES["float32"], "float32"))),
    )
    engine = PrefillModeEngine(
        build_prefill_engine(args, model=model, hold_finished=True), GrpcBackend(SENDER)
    )
    try:
        yield args, cfg, model, engine
    finally:
        engine.engine.close()


def test_small_pool_prefill_server_warms_up_and_says_its_longest_prompt(small_prefill, caplog):
    args, cfg, model, engine = small_prefill
    with caplog.at_level(logging.INFO, logger=server_mod.__name__):
        server_mod.warm_up(engine, args, cfg, model)
    assert server_mod.longest_prompt_tokens(engine) == LONGEST
    lines = [r.getMessage() for r in caplog.records if "longest prompt" in r.getMessage()]
    assert len(lines) == 1 and f"{LONGEST} tokens" in lines[0], lines
    # Every free page is back after the warm-up.
    alloc = engine.scheduler.allocator
    assert alloc.num_free_per_lane().tolist() == [PAGES_PER_RANK - 1] * CP
    # Every warm-up step shape is one the enumeration says requests can reach.
    assert engine.runner.step_shapes <= engine.reachable_shapes()


def test_small_pool_serves_its_longest_prompt_and_refuses_a_longer_one(small_prefill):
    _, cfg, _, engine = small_prefill
    rx, server, target = loopback_receiver(engine.layout, cfg, 16, TIMEOUTS)
    try:
        prompt = np.random.default_rng(1).integers(3, 300, LONGEST)
        with pytest.raises(InputError, match=f"longest prompt this server takes is {LONGEST}"):
            engine.add(request("long", np.concatenate([prompt, [7]]), "room-long", target))
        assert engine.scheduler.num_waiting == 0  # nothing was queued
        dst = rx.allocate_pages(pages_for_tokens(LONGEST, P))
        rx.register_room("room", dst, LONGEST, CP)
        engine.add(request("r", prompt, "room", target))
        got = drive(engine, ["r"])
        assert got["r"].finish_reason == "length", got["r"]
        rx.free_pages(dst)
    finally:
        server.stop(0)
        rx.close()


def unified_side(tiny_checkpoint, pool_pages: int, *extra: str):
    """A unified (null) server's engine and `/server_info` extras, built as `build_server`
    builds them (pool of `pool_pages` pages of 16 tokens)."""
    path, cfg, model = tiny_checkpoint
    args = unified_args(path, cfg, pool_pages, *extra)
    engine, info, closers = server_mod._build_decode_side(args, cfg, model, None, jax.devices())
    # The default engine (prefix cache) closes its prefill engine; the plain one has none.
    assert len(closers) == (0 if args.disable_radix_cache else 1)
    return args, cfg, model, engine, info


def test_smallest_unified_pool_warms_up_and_serves_its_longest_prompt(tiny_checkpoint):
    """One usable page of 16 tokens: the warm-up probe's requests (before: a 17-token
    prompt and 9 new tokens, refused at startup) shrink to what the pool holds; then a
    15-token prompt and its token are served and a 16-token one refused."""
    args, cfg, model, engine, info = unified_side(tiny_checkpoint, 2)
    server_mod.warm_up(engine, args, cfg, model)
    longest = server_mod.longest_prompt_tokens(engine)
    assert longest == UP - 1 and info["max_running_requests"] == 1
    prompt = tuple(range(3, 3 + longest))
    with pytest.raises(InputError, match="whole pool has 1"):
        engine.add(GenerateRequest("long", (*prompt, 7), SamplingParams(max_new_tokens=1)))
    engine.add(GenerateRequest("r", prompt, SamplingParams(max_new_tokens=1)))
    chunks = [c for _ in range(4) for c in engine.step()]
    assert [(c.rid, c.finished, c.finish_reason, len(c.token_ids)) for c in chunks] == [
        ("r", True, "length", 1)
    ]
    assert engine.kv.num_free_pages == 1


def test_max_running_requests_none_is_bounded_by_the_pool(tiny_checkpoint):
    """`--max-running-requests none`: as many requests as the pool holds at once (100
    usable pages, one each for the smallest request), not a fixed 64; the flag wins."""
    _, _, _, engine, info = unified_side(tiny_checkpoint, 101)
    assert engine.max_running_requests == info["max_running_requests"] == 100
    _, _, _, engine, info = unified_side(tiny_checkpoint, 101, "--max-running-requests", "3")
    assert engine.max_running_requests == info["max_running_requests"] == 3
    # One-token pages: the smallest request (1 prompt + 1 new token) holds 2 of them.
    args = dataclasses.replace(float32_args(tiny_checkpoint[0]), page_size=1)
    assert server_mod.max_running_requests(args, 101)[0] == 50
