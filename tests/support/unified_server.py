"""A unified (`null`) `cpkv-serve` of the tiny checkpoint in this process, for the
warm-up tests (tests/serving/test_warmup_*.py): flags for a pool of a given page count,
the server on a loopback port (stopped and closed afterwards), and a greedy `/generate`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import httpx

from cpkv_jax.config import ModelConfig
from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.model.kv_cache import DTYPES
from serving.server import Server, build_server
from serving.server_args import ServerArgs
from support.http_client import Served
from support.prefill_server import P, float32_args


def unified_args(path, cfg: ModelConfig, pool_pages: int, *extra: str) -> ServerArgs:
    """Float32 unified-server flags with a pool of `pool_pages` pages of `P` tokens."""
    page = per_rank_pool_bytes(cfg, PoolLayout(1, False, 2, P), DTYPES["float32"], "float32") // 2
    return float32_args(path, "--kv-pool-size", str(pool_pages * page), *extra)


@contextlib.contextmanager
def serving(args: ServerArgs) -> Iterator[tuple[Server, Served]]:
    """`build_server(args)` served on 127.0.0.1; shut down and closed on exit."""
    server = build_server(args)
    served = Served(server.app)
    try:
        yield server, served
    finally:
        served.stop()
        asyncio.run(server.loop.shutdown(0.0))
        server.close()


def greedy_ids(url: str, ids: list[int], new: int, timeout: float) -> list[int]:
    """The output ids of a greedy `/generate` of `new` tokens (EOS ignored); asserts 200."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
    }
    r = httpx.post(url + "/generate", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def generate_with_logprobs(url: str, ids: list[int], new: int, **sampling) -> httpx.Response:
    """`/generate` of `new` tokens (EOS ignored) with their log-probs; `sampling` adds
    sampling parameters. The response as it came (the caller checks the status)."""
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": new, "ignore_eos": True, **sampling},
    }
    return httpx.post(url + "/generate", json=body, timeout=120.0)
