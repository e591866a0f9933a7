"""PD from a CP8 prefill server into a CP8 decode group (issue 40): the prefill ranks send
each owned page by logical position as always, and the decode server, itself a CP mesh
(`--cp-size 8 --enable-cp-shared-kv --ep-size 8`), admits a request with logical page `p`
on its rank `p % 8` (`DecodeEngine.admit`), so the receiver's scatter lands every page
on its owner and the decode attends where the pages live (`CPMeshDecodeSteps`). Behind
`cpkv-router`, over gRPC. The same into DP groups of CP ranks over Mooncake (issue 40
item 3, `--dp-size 2 --cp-size 4 --ep-size 8`), drafting with the MTP layer (issue 39,
K = 2):
a request's pages stripe over one group's four ranks, the group chosen as DP ranks are
(most free pages), its draft state on one of them; each step runs both groups' rows,
the experts split over all eight devices.

The decode pool holds 6 usable pages per rank (9 in the groups, whose four ranks hold a
request); the long prompt needs 35: no single decode device could hold it. Greedy
tokens equal `ReferenceGenerator`'s on one device and log-probs agree within 1e-5 (the
CP tolerance, tests/core/test_cp_decode.py); the exact-coverage and digest rules of the
transfer are the receiver's, unchanged. A client leaving mid-stream aborts its request
on both sides, and every page comes back.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from support.pages import assert_pages_back
from support.pd_pair import pd_pair
from support.prefill_server import P, float32_args
from support.unified_server import (
    assert_greedy_reference,
    generate_with_logprobs,
    page_bytes,
)

from cpkv_jax.model.mtp import mtp_config
from serving.decode.speculative import SpeculativeSteps
from serving.decode.steps import CPMeshDecodeSteps
from transfer.backends.mooncake_engine import mooncake_available

MOONCAKE, MOONCAKE_REASON = mooncake_available()

pytestmark = pytest.mark.slow(seconds=70)

CP = 8
LONG = 33 * P + 5  # 35 pages with its output
WAIT_S = 300.0
# Decode layouts: (dp, cp, pages per rank with its trash page, speculative steps,
# transfer backend).
LAYOUTS = {"cp8": (1, 8, 7, 0, "grpc"), "dp2-cp4-speculative-mooncake": (2, 4, 10, 2, "mooncake")}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def pd(request, cp_checkpoint) -> Iterator[dict[str, Any]]:
    path, cfg, _ = cp_checkpoint
    dp, cp, pages, k, backend = LAYOUTS[request.param]
    if backend == "mooncake" and not MOONCAKE:
        pytest.skip(f"Mooncake Transfer Engine unavailable: {MOONCAKE_REASON}")
    group = ("--dp-size", str(dp), "--cp-size", str(cp), "--enable-cp-shared-kv")
    group += ("--transfer-backend", backend)
    # Drafting: both servers (the prefill one sends the MTP layer's KV); each page one
    # layer more.
    drafting = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(k))
    drafting = drafting if k else ()
    layer = mtp_config(cfg) if k else cfg
    decode = float32_args(
        path,
        *("--disaggregation-mode", "decode", *group, "--ep-size", str(dp * cp), *drafting),
        *("--kv-pool-size", str(pages * page_bytes(layer, cp)), "--max-running-requests", "4"),
    )
    prefill = float32_args(
        path,
        *("--disaggregation-mode", "prefill", "--cp-size", str(CP), "--enable-cp-shared-kv"),
        *("--transfer-backend", backend),
        *("--ep-size", str(CP), "--kv-pool-size", str(16 * page_bytes(layer, CP)), *drafting),
        *("--chunked-prefill-size", "64", "--disaggregation-bootstrap-port", "0"),
    )  # the bootstrap port: not the default another test holds
    with pd_pair(decode, prefill, WAIT_S) as pair:
        yield {**pair, "layout": (dp, cp, pages, k)}


def test_cp_prefill_into_a_cp_decode_group_equals_the_reference(pd, cp_checkpoint):
    _, cfg, ref = cp_checkpoint
    dp, cp, pages, k = pd["layout"]
    decode = pd["decode"].engine
    steps = decode.steps
    if k:  # drafting over both axes: the slab split over every rank of both groups
        assert isinstance(steps, SpeculativeSteps) and steps.layout.dp_size == dp * cp
    else:
        assert isinstance(steps, CPMeshDecodeSteps)
    assert decode.placement.ranks == dp
    assert decode.stats().kv_pages_total == (cp * (pages - 1),) * dp
    assert pages - 1 < -(-(LONG + 6) // P)  # one decode rank could not hold it
    rng = np.random.default_rng(3)
    jobs = [
        (rng.integers(3, cfg.vocab_size, n).tolist(), new)
        for n, new in ((LONG, 6), (2 * P, 4), (5, 7))
    ]
    router = pd["served"]["router"].url
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(
            pool.map(lambda job: generate_with_logprobs(router, *job, temperature=0.0), jobs)
        )
    for out, (ids, new) in zip(outs, jobs, strict=True):
        assert out.status_code == 200, out.text
        assert_greedy_reference(out.json(), ref, ids, new)
        if k:
            assert 1.0 <= out.json()["meta_info"]["spec_accept_length"] <= k + 1
    for side in ("decode", "prefill"):
        assert_pages_back(pd[side])
    assert decode.step_shapes <= decode.reachable_shapes()
    assert all(n > 0 for n in decode.admitted_per_rank)  # every group decoded some


def test_a_client_leaving_mid_stream_frees_the_group_s_pages(pd, cp_checkpoint):
    _, cfg, _ = cp_checkpoint
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
