"""PD from a CP8 prefill server into a CP8 decode group (issue 40): the prefill ranks send
each owned page by logical position as always, and the decode server, itself a CP mesh
(`--cp-size 8 --enable-cp-shared-kv --ep-size 8`), admits a request with logical page `p`
on its rank `p % 8` (`DecodeEngine.admit`), so the receiver's scatter lands every page
on its owner and the decode attends where the pages live (`CPMeshDecodeSteps`). Behind
`cpkv-router`, over gRPC.

The decode pool holds 6 usable pages per rank; the long prompt needs 35: no single
decode device could hold it. Greedy tokens equal `ReferenceGenerator`'s on one device
and log-probs agree within 1e-5 (the CP tolerance, tests/core/test_cp_decode.py); the
exact-coverage and digest rules of the transfer are the receiver's, unchanged. A client
leaving mid-stream aborts its request on both sides, and every page comes back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from support.http_client import Served
from support.pages import assert_pages_back
from support.prefill_server import P, float32_args

from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.model.kv_cache import DTYPES
from cpkv_jax.model.weights import load_model
from serving.decode.steps import CPMeshDecodeSteps
from serving.router import RouterConfig, build_router_app
from serving.server import build_server

pytestmark = pytest.mark.slow(seconds=70)

CP = 8
DECODE_PAGES = 7  # per rank: 6 usable and the trash page
LONG = 33 * P + 5  # 35 pages with its output
WAIT_S = 300.0


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    path = tiny_checkpoints("glm_moe_dsa", fp8=True, n_routed_experts=16)
    cfg, model = load_model(path, progress=False)
    return path, cfg, ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32")


@pytest.fixture(scope="module")
def pd(checkpoint) -> Iterator[dict[str, Any]]:
    path, cfg, _ = checkpoint
    page = per_rank_pool_bytes(cfg, PoolLayout(CP, True, 2, P), DTYPES["float32"], "float32") // 2
    group = ("--cp-size", str(CP), "--enable-cp-shared-kv", "--ep-size", str(CP))
    decode = build_server(
        float32_args(
            path,
            *("--disaggregation-mode", "decode", *group),
            *("--kv-pool-size", str(DECODE_PAGES * page), "--max-running-requests", "4"),
        )
    )
    prefill = build_server(
        float32_args(
            path,
            *("--disaggregation-mode", "prefill", *group),
            *("--kv-pool-size", str(16 * page), "--chunked-prefill-size", "64"),
            *("--disaggregation-bootstrap-port", "0"),  # not the default another test holds
        )
    )
    served = {"decode": Served(decode.app), "prefill": Served(prefill.app)}
    config = RouterConfig(
        prefill=(served["prefill"].url,),
        decode=(served["decode"].url,),
        request_timeout=WAIT_S,
        health_interval=0.5,
        startup_timeout=30.0,
    ).validate()
    served["router"] = Served(build_router_app(config))
    yield {"decode": decode, "prefill": prefill, "served": served}
    for s in reversed(list(served.values())):
        s.stop()
    for server in (prefill, decode):
        asyncio.run(server.loop.shutdown(0.0))
        server.close()


def _generate(url: str, ids: list[int], new: int) -> dict:
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
    }
    r = httpx.post(url + "/generate", json=body, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.json()


def test_cp_prefill_into_a_cp_decode_group_equals_the_reference(pd, checkpoint):
    _, cfg, ref = checkpoint
    decode = pd["decode"].engine
    assert isinstance(decode.steps, CPMeshDecodeSteps)
    assert decode.stats().kv_pages_total == (CP * (DECODE_PAGES - 1),)
    assert -(-(LONG + 6) // P) > DECODE_PAGES - 1  # one decode rank could not hold it
    rng = np.random.default_rng(3)
    jobs = [
        (rng.integers(3, cfg.vocab_size, n).tolist(), new)
        for n, new in ((LONG, 6), (2 * P, 4), (5, 7))
    ]
    router = pd["served"]["router"].url
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: _generate(router, *job), jobs))
    for out, (ids, new) in zip(outs, jobs, strict=True):
        want = ref.generate(ids, new, ignore_eos=True)
        assert out["output_ids"] == want.output_ids
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        np.testing.assert_allclose(got, want.output_logprobs, rtol=1e-5, atol=1e-5)
    for side in ("decode", "prefill"):
        assert_pages_back(pd[side])
    assert decode.step_shapes <= decode.reachable_shapes()


def test_a_client_leaving_mid_stream_frees_the_group_s_pages(pd, checkpoint):
    _, cfg, _ = checkpoint
    ids = np.random.default_rng(4).integers(3, cfg.vocab_size, 9 * P).tolist()
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": 40, "ignore_eos": True},
    }
    router = pd["served"]["router"].url
    with httpx.stream("POST", router + "/generate", json=body, timeout=WAIT_S) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # leave after the first event
    for side in ("decode", "prefill"):
        assert_pages_back(pd[side])
