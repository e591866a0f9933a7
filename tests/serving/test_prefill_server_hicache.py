"""A PD prefill server with the host (L2) KV cache (`--enable-hierarchical-cache`).

`build_server` with CP 8 shared KV, `--hicache-mem-layout layer_page_first` (the LF<->LPF
Pallas kernels, interpreted on CPU), write-through, a host pool 4x a 4-page-per-rank
device pool. Its engine is driven directly, behind a transfer backend that accepts every
room at once (the KV transfer itself is test_prefill_server_e2e.py's): a long prompt,
two others that push it off the device, then the long prompt again. It comes back as a
host hit (loaded back, `cached_tokens` counts it), with the first answer's token and
log-prob and the single-device reference's; `/server_info` (`hicache`) and `/metrics`
(`cpkv_hicache_*`) show the hit, the copies and the host pool; closing the server stops
the backup worker, and every device and host page comes back.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from support.prefill_server import CP, InstantBackend, P, server_args

from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.model.kv_cache import DTYPES
from serving.engine.api import GenerateRequest, OutputChunk, SamplingParams
from serving.prefill.engine import PrefillModeEngine
from serving.server import build_server

VOCAB = 320  # the tiny model's
WAIT = 60.0  # bound on any one request here; never reached when green
PAGES_PER_RANK = 4  # 3 usable device pages per lane: 24 pages, 384 tokens in all
CHUNK = 64
LOGPROB_ATOL = 1e-5


def prompt_of(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.int32)


def serve_one(engine: PrefillModeEngine, rid: str, prompt: np.ndarray) -> OutputChunk:
    """Prefill `prompt` to its final chunk, then let the backups finish (so the host
    copies are acknowledged before the next request evicts)."""
    engine.add(
        GenerateRequest(
            rid,
            tuple(int(t) for t in prompt),
            SamplingParams(max_new_tokens=4),
            return_logprob=True,
            bootstrap_room=f"room-{rid}",
            decode_transfer_target="127.0.0.1:1",  # never dialled (InstantBackend)
        )
    )
    deadline = time.monotonic() + WAIT
    while True:
        assert time.monotonic() < deadline, f"no final chunk for {rid}"
        chunks = engine.step()
        if chunks:
            (chunk,) = chunks
            assert chunk.rid == rid and chunk.finish_reason == "length", chunk
            break
    engine.scheduler.sync_host_cache(wait=True)
    engine.scheduler.cache.check_invariants(request_pages=[])
    return chunk


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    path, cfg, _ = tiny_checkpoint
    one_page = (
        per_rank_pool_bytes(cfg, PoolLayout(CP, True, 2, P), DTYPES["float32"], "float32") // 2
    )
    args = server_args(
        path,
        "--kv-pool-size",
        str(PAGES_PER_RANK * one_page),
        "--chunked-prefill-size",
        str(CHUNK),
        "--enable-hierarchical-cache",
        "--hicache-mem-layout",
        "layer_page_first",
        "--hicache-ratio",
        "4",
        "--hicache-write-policy",
        "write_through",
    )
    srv = build_server(args)
    try:
        asyncio.run(srv.loop.shutdown(0.0))  # the test drives the engine itself
        assert isinstance(srv.engine, PrefillModeEngine)
        srv.engine.backend = InstantBackend(WAIT)
        yield srv
    finally:
        srv.close()


def _metrics(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("cpkv_hicache"):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_evicted_prompt_comes_back_from_host_with_the_same_answer(server, tiny_checkpoint):
    _, cfg, model = tiny_checkpoint
    engine: PrefillModeEngine = server.engine
    pre = engine.engine
    cache, io = pre.cache, pre.host_io
    assert io is not None and cache.write_policy == "write_through"
    assert io.pages_total_per_lane() == [4 * PAGES_PER_RANK - 1] * CP  # ratio 4, page 0 kept
    dev0 = pre.runner.allocator.num_free_per_lane().tolist()
    host0 = cache.host_free_per_lane().tolist()
    client = TestClient(server.app)
    info = client.get("/server_info").json()["hicache"]
    assert (info["layout"], info["write_policy"]) == ("layer_page_first", "write_through")
    assert info["host_pages_used_per_lane"] == [0] * CP
    assert info["host_pages_total_per_lane"] == io.pages_total_per_lane()
    assert info["host_bytes_per_lane"] == [4 * PAGES_PER_RANK * info["host_page_bytes"]] * CP

    long = prompt_of(8 * P + 3, 1)
    first = serve_one(engine, "a", long)
    assert first.meta["cached_tokens"] == 0
    assert io.stats.backups_done >= 1 and io.stats.backup_bytes > 0
    for i in range(2):  # enough other prompts to push `long` off the device
        serve_one(engine, f"other{i}", prompt_of(20 * P + 5, 10 + i))
    m = cache.match_prefix(long[:-1])
    assert m.host_num_tokens > 0, cache.pretty()
    hits0 = engine.stats().prefix_cache_hit_tokens

    again = serve_one(engine, "a-again", long)
    assert again.meta["cached_tokens"] == 8 * P  # device + loaded-back host hits (S7)
    assert again.meta["cached_tokens_host"] == m.host_num_tokens > 0  # the breakdown
    assert engine.stats().prefix_cache_hit_tokens - hits0 == 8 * P
    assert io.stats.host_hit_tokens >= m.host_num_tokens > 0
    assert io.stats.load_backs >= 1 and io.stats.load_back_bytes > 0
    assert again.token_ids == first.token_ids
    assert again.logprobs is not None and first.logprobs is not None
    np.testing.assert_allclose(again.logprobs[0], first.logprobs[0], atol=LOGPROB_ATOL)
    ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32")
    want = ref.generate(long.tolist(), 1, ignore_eos=True)
    assert again.token_ids == (want.output_ids[0],)
    np.testing.assert_allclose(again.logprobs[0], want.output_logprobs[0], atol=LOGPROB_ATOL)

    info = client.get("/server_info").json()["hicache"]
    assert info["host_hit_tokens"] == io.stats.host_hit_tokens > 0
    assert info["load_back_bytes"] > 0 and info["backup_bytes"] > 0
    assert sum(info["host_pages_used_per_lane"]) > 0
    got = _metrics(client)
    assert got["cpkv_hicache_host_hit_tokens_total"] == io.stats.host_hit_tokens
    assert got["cpkv_hicache_load_back_bytes_total"] == io.stats.load_back_bytes > 0
    assert got["cpkv_hicache_load_back_seconds_total"] > 0
    assert got["cpkv_hicache_backup_bytes_total"] == io.stats.backup_bytes > 0
    assert got["cpkv_hicache_backup_seconds_total"] > 0
    assert got["cpkv_hicache_skipped_load_backs_total"] == io.stats.skipped_load_backs
    assert got["cpkv_hicache_dropped_backups_total{reason=queue_full}"] == 0
    assert "cpkv_hicache_dropped_backups_total{reason=host_full}" in got
    used = [got[f"cpkv_hicache_host_pages_used{{lane={r}}}"] for r in range(CP)]
    assert used == info["host_pages_used_per_lane"]
    assert got["cpkv_hicache_host_pages_total{lane=0}"] == 4 * PAGES_PER_RANK - 1

    # Closing the server stops the backup worker; then every page comes back.
    workers = sum(t.name == "host-cache-backup" for t in threading.enumerate())
    server.close()
    assert sum(t.name == "host-cache-backup" for t in threading.enumerate()) == workers - 1
    assert not cache.in_flight_jobs()
    server.settle_caches()
    assert not server.kv_leaked()
    assert pre.runner.allocator.num_free_per_lane().tolist() == dev0
    assert cache.host_free_per_lane().tolist() == host0
    assert io.pages_used_per_lane() == [0] * CP
