"""A unified (`null`) server with the host (L2) KV cache (issue 23, SPEC S4, S7, S10).

`cpkv-serve --disaggregation-mode null --enable-hierarchical-cache` serves through
`serving.decode.cached.CachedUnifiedEngine`: the CP prefill scheduler on one device
(prefix cache, host cache, chunked prefill) feeding the decode batch on the same pool.
Over HTTP with the engine thread running: a long prompt, then other prompts that push
it off a small device pool, then the long prompt again: it comes back as a host hit
(`meta_info.cached_tokens_details.host > 0`, `cached_tokens` counts device + host),
with the first answer's tokens and the single-device reference's; concurrent requests
and an abort leave no pages behind; `/server_info` and `/metrics` show the host cache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time

import httpx
import numpy as np
import pytest
from support.prefill_server import float32_args
from support.unified_server import serving

from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.model.kv_cache import DTYPES
from serving.compile_events import COMPILES
from serving.decode.cached import CachedUnifiedEngine
from serving.server_args import ServerArgs

# Among the longest files of the suite: scheduled first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=50)  # on 2 workers, 2026-12-05

P = 16
POOL_PAGES = 16  # 15 usable: one long prompt (9 pages + output) at a time, evicted by others
CHUNK = 64
NEW = 4
WAIT_S = 120.0


def _args(path, *extra: str) -> ServerArgs:
    return float32_args(
        path,
        "--chunked-prefill-size",
        str(CHUNK),
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        "4",
        *("--warmup", "all"),  # every step and host copy compiles before healthy (issue 25)
        "--max-running-requests",  # bounds the batch buckets the warm-up compiles
        "2",
        *extra,
    )


@pytest.fixture(scope="module")
def unified(tiny_checkpoint):
    path, cfg, _ = tiny_checkpoint
    page = per_rank_pool_bytes(cfg, PoolLayout(1, False, 2, P), DTYPES["float32"], "float32") // 2
    with serving(_args(path, "--kv-pool-size", str(POOL_PAGES * page))) as s:
        yield s


def _prompt(cfg, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, cfg.vocab_size, n).tolist()


def _generate(url: str, ids: list[int], new: int = NEW) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
    }
    r = httpx.post(url + "/generate", json=body, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.json()


def _settled(engine: CachedUnifiedEngine) -> None:
    engine.scheduler.sync_host_cache(wait=True)


def test_evicted_prompt_comes_back_from_host(unified, tiny_checkpoint):
    _, cfg, model = tiny_checkpoint
    server, served = unified
    engine = server.engine
    assert isinstance(engine, CachedUnifiedEngine)
    io = engine.prefill.host_io
    assert io is not None
    info = httpx.get(served.url + "/server_info", timeout=WAIT_S).json()
    assert info["hicache"]["layout"] == "layer_first" and info["mode"] == "null"
    assert info["xla_compiles"]["startup"]["compiles"] > 0  # the warm-up's (issue 25)

    long = _prompt(cfg, 8 * P + 3, 1)
    compiles = COMPILES.snapshot()["serving"]["compiles"]
    first = _generate(served.url, long)
    assert first["meta_info"]["cached_tokens"] == 0
    assert first["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0}
    again_dev = _generate(served.url, long)  # still on the device: a device hit
    assert again_dev["meta_info"]["cached_tokens_details"] == {"device": 8 * P, "host": 0}
    assert again_dev["output_ids"] == first["output_ids"]
    _settled(engine)
    for i in range(2):  # push `long` off the device pool (the host keeps it)
        _generate(served.url, _prompt(cfg, 10 * P + 5, 10 + i))
        _settled(engine)
    m = engine.prefill.cache.match_prefix(np.asarray(long[:-1], np.int32))
    assert m.host_num_tokens > 0, engine.prefill.cache.pretty()

    again = _generate(served.url, long)
    meta = again["meta_info"]
    assert meta["cached_tokens"] == 8 * P  # device + loaded-back host hits (S7)
    assert meta["cached_tokens_details"]["host"] == m.host_num_tokens > 0
    assert again["output_ids"] == first["output_ids"]
    # A request with every penalty, a logit bias and top log-probs: its sampler programs
    # (the first token's from a host row, the decode rows') were warmed too.
    sampling = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
    sampling |= {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2}
    sampling |= {"logit_bias": {"7": 2.0}}
    body = {"input_ids": _prompt(cfg, 5, 3), "sampling_params": sampling}
    body |= {"return_logprob": True, "top_logprobs_num": 3}
    r = httpx.post(served.url + "/generate", json=body, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    assert len(r.json()["meta_info"]["output_top_logprobs"]) == NEW
    # Backups, load-backs, chunked prefills and decode: all compiled at startup.
    assert COMPILES.snapshot()["serving"]["compiles"] == compiles
    ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32")
    assert again["output_ids"] == ref.generate(long, NEW, ignore_eos=True).output_ids
    assert io.stats.host_hit_tokens >= m.host_num_tokens and io.stats.load_backs >= 1

    info = httpx.get(served.url + "/server_info", timeout=WAIT_S).json()["hicache"]
    assert info["host_hit_tokens"] == io.stats.host_hit_tokens > 0
    text = httpx.get(served.url + "/metrics", timeout=WAIT_S).text
    assert f"cpkv_hicache_host_hit_tokens_total {float(io.stats.host_hit_tokens)}" in text


def test_concurrent_requests_and_an_abort_leave_no_pages(unified, tiny_checkpoint):
    """Eight clients at once (shared prefixes, a pool too small for all of them: they
    queue for pages), one cancelled mid-way: every answer equals the reference, and
    once idle every page is free or cached-and-evictable."""
    _, cfg, model = tiny_checkpoint
    server, served = unified
    engine = server.engine
    ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32")
    base = _prompt(cfg, 3 * P, 40)
    prompts = [base + _prompt(cfg, 5 + 7 * i, 50 + i) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(_generate, served.url, p) for p in prompts]
        # A client that gives up: its request is aborted on the server.
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(
                served.url + "/generate",
                json={"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 200}},
                timeout=0.3,
            )
        outs = [f.result(timeout=WAIT_S) for f in futs]
    for p, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == ref.generate(p, NEW, ignore_eos=True).output_ids
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) >= 3 * P  # shared prefix hit

    end = time.monotonic() + WAIT_S
    while engine.has_work():
        assert time.monotonic() < end, "engine still busy"
        time.sleep(0.05)
    _settled(engine)
    cache = engine.prefill.cache
    assert engine.scheduler.num_held == 0
    assert not cache.protected_pages_per_lane().any()
    stats = engine.stats()
    assert (
        stats.kv_pages_free[0] + int(cache.evictable_pages_per_lane()[0])
        == (stats.kv_pages_total[0])
    )
    cache.check_invariants(request_pages=[])


def test_engine_edges_abort_in_prefill_one_token_and_refusals(unified, tiny_checkpoint):
    """Driven directly (the HTTP loop stopped): a request aborted between its prefill
    chunks frees what it took; `max_new_tokens=1` finishes at the prefill's token; a
    request larger than the pool is refused in `add` with nothing queued; a duplicate id
    in flight is refused. Runs last in the module: it stops the server's engine loop."""
    from cpkv_jax.errors import InputError
    from serving.engine.api import GenerateRequest, SamplingParams

    _, cfg, model = tiny_checkpoint
    server, served = unified
    served.stop()
    asyncio.run(server.loop.shutdown(0.0))
    engine: CachedUnifiedEngine = server.engine
    cache = engine.prefill.cache

    def req(rid: str, ids: list[int], new: int) -> GenerateRequest:
        return GenerateRequest(rid, tuple(ids), SamplingParams(max_new_tokens=new, ignore_eos=True))

    long = _prompt(cfg, 3 * CHUNK + 5, 70)  # four chunks: several steps in prefill
    engine.add(req("gone", long, NEW))
    engine.step()
    assert engine.stats().running == 1 and engine.scheduler.chunked is not None
    with pytest.raises(InputError, match="already in flight"):
        engine.add(req("gone", long, NEW))
    engine.abort("gone")
    (chunk,) = engine.step()
    assert (chunk.rid, chunk.finish_reason) == ("gone", "abort")
    assert engine.scheduler.num_waiting == 0 and not engine.has_work()

    with pytest.raises(InputError, match="whole pool"):
        engine.add(req("huge", _prompt(cfg, POOL_PAGES * P, 71), NEW))
    assert engine.stats().waiting == 0

    one = _prompt(cfg, 2 * P + 1, 72)
    engine.add(req("one", one, 1))
    got = []
    end = time.monotonic() + WAIT_S
    while engine.has_work():
        assert time.monotonic() < end
        got += engine.step()
    (final,) = [c for c in got if c.finished]
    ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32")
    assert list(final.token_ids) == ref.generate(one, 1, ignore_eos=True).output_ids

    _settled(engine)
    assert engine.scheduler.num_held == 0 and not cache.protected_pages_per_lane().any()
    stats = engine.stats()
    free_or_evictable = stats.kv_pages_free[0] + int(cache.evictable_pages_per_lane()[0])
    assert free_or_evictable == stats.kv_pages_total[0]
    cache.check_invariants(request_pages=[])
