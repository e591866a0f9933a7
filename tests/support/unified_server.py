"""A unified (`null`) `cpkv-serve` of the tiny checkpoint in this process, for the
warm-up tests (tests/serving/test_warmup_*.py): flags for a pool of a given page count,
the server on a loopback port (stopped and closed afterwards), and a greedy `/generate`."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path

import httpx
import numpy as np

from cpkv_jax.config import ModelConfig
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.model.kv_cache import DTYPES
from cpkv_jax.model.weights import load_model
from serving.server import Server, build_server
from serving.server_args import ServerArgs
from support.http_client import Served
from support.prefill_server import P, float32_args


def page_bytes(cfg: ModelConfig, cp: int = 1) -> int:
    """Bytes of one page of a float32 pool (float32 index K) on each rank, `--kv-pool-size`
    being per rank: `pages * page_bytes(cfg)` holds `pages` pages, the trash page too."""
    layout = PoolLayout(cp, cp > 1, 2, P)
    return per_rank_pool_bytes(cfg, layout, DTYPES["float32"], "float32") // 2


def unified_args(path, cfg: ModelConfig, pool_pages: int, *extra: str) -> ServerArgs:
    """Float32 unified-server flags with a pool of `pool_pages` pages of `P` tokens."""
    return float32_args(path, "--kv-pool-size", str(pool_pages * page_bytes(cfg)), *extra)


def cp_group_args(path, cfg: ModelConfig, cp: int, pages_per_rank: int, *extra: str) -> ServerArgs:
    """A unified server on a CP mesh of `cp` devices (page-owned KV, experts split over
    the ranks) with `pages_per_rank` pages per rank of a float32 pool laid out for `cfg`
    (`mtp_config(cfg)` for a drafting server), chunked prefill of 64 tokens and 4 running
    requests, plus `extra`."""
    return float32_args(
        path,
        *("--cp-size", str(cp), "--enable-cp-shared-kv", "--ep-size", str(cp)),
        *("--kv-pool-size", str(pages_per_rank * page_bytes(cfg, cp))),
        *("--chunked-prefill-size", "64", "--max-running-requests", "4", *extra),
    )


def fp8_moe_checkpoint(tiny_checkpoints) -> tuple[Path, ModelConfig, ReferenceGenerator]:
    """The FP8 GLM tiny checkpoint with 16 routed experts (two per rank under EP8), its
    config and the single-device reference generator with the servers' float32 index K
    (the CP mesh servers' tests)."""
    path = tiny_checkpoints("glm_moe_dsa", fp8=True, n_routed_experts=16)
    cfg, model = load_model(path, progress=False)
    return path, cfg, ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32")


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


async def generate_or_leave(
    client: httpx.AsyncClient, ids: list[int], sampling: dict, stream: bool, tag: str
) -> str | None:
    """One load-test client: `/generate` of `ids`; streaming, it leaves after the first
    event (the server aborts the request), else checks it got `max_new_tokens` tokens.
    None when all went as planned, else what went wrong (prefixed with `tag`)."""
    body = {"input_ids": ids, "sampling_params": sampling, "stream": stream}
    async with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            return f"{tag}: {r.status_code} {await r.aread()!r}"
        if stream:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    return None  # leave mid-stream: the server aborts the request
            return f"{tag}: no event"
        n = len(json.loads(await r.aread())["output_ids"])
        return None if n == sampling["max_new_tokens"] else f"{tag}: {n} tokens"


def sampled_or_greedy(i: int) -> dict:
    """Load-test client `i`'s sampling: 3 to 7 new tokens (EOS ignored), greedy for odd
    `i`, temperature 0.8 for even."""
    return {"max_new_tokens": 3 + i % 5, "ignore_eos": True, "temperature": 0.0 if i % 2 else 0.8}


def client_wave(
    url: str,
    jobs: Sequence[tuple[list[int], int]],
    sampling: Callable[[int], dict] = sampled_or_greedy,
    extra: Sequence[Callable[[httpx.AsyncClient], Awaitable[str | None]]] = (),
) -> list[str]:
    """Every job `(ids, i)` as one client at once (`generate_or_leave` with
    `sampling(i)`, streaming and leaving after its first event when `i % 3 == 0`), and
    each of `extra` beside them; what went wrong (empty: all went as planned). Generous
    bounds: the first sampled rows compile on these CPU servers, and CI machines can be
    2.5x slower."""

    async def run() -> list[str | None]:
        async with httpx.AsyncClient(base_url=url, timeout=240.0) as client:
            calls = [
                generate_or_leave(client, ids, sampling(i), i % 3 == 0, str(i)) for ids, i in jobs
            ] + [call(client) for call in extra]
            return await asyncio.wait_for(asyncio.gather(*calls), 300)

    return [p for p in asyncio.run(run()) if p is not None]


def assert_greedy_reference(out: dict, ref: ReferenceGenerator, ids: list[int], new: int) -> None:
    """A greedy `/generate` answer with log-probs (`generate_with_logprobs`) against
    `ref`: the same tokens, log-probs within 1e-5 (the CP and mesh tolerance)."""
    want = ref.generate(ids, new, ignore_eos=True)
    assert out["output_ids"] == want.output_ids
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    np.testing.assert_allclose(got, want.output_logprobs, rtol=1e-5, atol=1e-5)


def settled_held_pages(engine) -> int:
    """Pages a unified engine's requests still hold once it is idle (waiting up to 10 s),
    over every rank: neither free nor only cached (the prefix cache's pages stay until
    evicted; nothing locks them once no request runs)."""

    def held() -> int:
        st = engine.stats()
        cached = st.kv_pages_cached or (0,) * len(st.kv_pages_total)
        return sum(
            t - f - c for t, f, c in zip(st.kv_pages_total, st.kv_pages_free, cached, strict=True)
        )

    async def settle() -> None:
        for _ in range(200):
            if not engine.has_work() and held() == 0:
                return
            await asyncio.sleep(0.05)

    asyncio.run(settle())
    return held()
