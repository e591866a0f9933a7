"""A unified server decoding on a ("dp",) mesh (`--dp-size 4 --disable-radix-cache`,
issue 36): the tiny model's routed experts split over 4 virtual CPU devices (reached by
the padded all-to-all dispatch here), each request's pages in one rank's shard of the
pool.

Concurrent requests of mixed lengths give the single-device reference's greedy tokens
(compared exactly: the reference and the DP step run the same model code; rows batched
with others may differ in the last bits of a log-prob, which never flips an argmax
here), land on more than one rank, and every rank's pages come back; `/server_info`
reports the ranks. Flag checks refuse what DP decode does not do.
"""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import numpy as np
import pytest
from support.prefill_server import float32_args
from support.unified_server import greedy_ids, serving, unified_args

from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.model.weights import load_model
from serving.server_args import ServerArgsError

P = 16
DP = 4
NEW = 5
WAIT_S = 120.0


@pytest.fixture(scope="module")
def dp_server(tiny_checkpoints):
    path = tiny_checkpoints("glm_moe_dsa")
    cfg, model = load_model(path, progress=False)
    args = unified_args(
        path,
        cfg,
        12,  # pages per rank
        "--dp-size",
        str(DP),
        "--disable-radix-cache",
        "--max-running-requests",
        "8",
        # The padded all-to-all expert dispatch (exact at its default capacity); the PD
        # tests and `make demo` run the default all-gather.
        "--ep-dispatch",
        "all_to_all",
    )
    with serving(args) as (server, served):
        yield cfg, model, server, served


def test_dp_unified_server_equals_the_reference(dp_server):
    cfg, model, server, served = dp_server
    engine = server.engine
    assert engine.dp_size == DP
    rng = np.random.default_rng(7)
    prompts = [
        rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 2 * P, 3 * P + 3, 9, 40, 17)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda ids: greedy_ids(served.url, ids, NEW, WAIT_S), prompts))
    ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32")
    for ids, out in zip(prompts, got, strict=True):
        assert out == ref.generate(ids, NEW, ignore_eos=True).output_ids
    assert sum(n > 0 for n in engine.admitted_per_rank) > 1  # spread over the ranks
    stats = engine.stats()
    assert len(stats.kv_pages_total) == DP
    assert stats.kv_pages_free == stats.kv_pages_total  # every rank's pages back
    ranks = {shape[1] for shape in engine.step_shapes}  # rows per rank ran in buckets
    assert ranks and all(r & (r - 1) == 0 for r in ranks)
    info = httpx.get(served.url + "/server_info", timeout=10).json()
    assert info["dp_size"] == DP and info["running_per_rank"] == [0] * DP
    assert len(info["kv_pages_free"]) == DP
    metrics = httpx.get(served.url + "/metrics", timeout=10).text
    assert 'cpkv_rank_running_requests{rank="3"} 0.0' in metrics
    steps = re.search(r'^cpkv_decode_step_seconds_count{kind="decode"} (\S+)$', metrics, re.M)
    assert steps is not None and float(steps[1]) >= NEW - 1  # each request's decode steps


def test_dp_flags_refuse_what_dp_decode_does_not_do(tiny_checkpoints):
    path = tiny_checkpoints("glm_moe_dsa")
    with pytest.raises(ServerArgsError, match="--disable-radix-cache"):
        float32_args(path, "--dp-size", "2").validate()
    with pytest.raises(ServerArgsError, match="--cp-size ranks instead"):
        float32_args(path, "--dp-size", "2", "--disaggregation-mode", "prefill").validate()
    with pytest.raises(ServerArgsError, match="divide the 8 available devices"):
        float32_args(path, "--dp-size", "3", "--disable-radix-cache").validate(device_count=8)
    capped = float32_args(
        path, "--dp-size", "4", "--disable-radix-cache", "--ep-dispatch", "all_to_all",
        "--ep-capacity-factor", "1",
    )  # fmt: skip
    assert any("not exact" in w for w in capped.validate())
    with pytest.raises(ServerArgsError, match="--ep-dispatch"):  # nothing to dispatch
        float32_args(path, "--ep-dispatch", "all_to_all").validate()
    with pytest.raises(ServerArgsError, match="--dp-size must be >= 1"):
        float32_args(path, "--dp-size", "0", "--disable-radix-cache").validate()
