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

from serving.decode.steps import CPMeshDecodeSteps

pytestmark = pytest.mark.slow(seconds=70)

CP = 8
DECODE_PAGES = 7  # per rank: 6 usable and the trash page
LONG = 33 * P + 5  # 35 pages with its output
WAIT_S = 300.0


@pytest.fixture(scope="module")
def pd(cp_checkpoint) -> Iterator[dict[str, Any]]:
    path, cfg, _ = cp_checkpoint
    page = page_bytes(cfg, CP)
    group = ("--cp-size", str(CP), "--enable-cp-shared-kv", "--ep-size", str(CP))
    decode = float32_args(
        path,
        *("--disaggregation-mode", "decode", *group),
        *("--kv-pool-size", str(DECODE_PAGES * page), "--max-running-requests", "4"),
    )
    prefill = float32_args(
        path,
        *("--disaggregation-mode", "prefill", *group),
        *("--kv-pool-size", str(16 * page), "--chunked-prefill-size", "64"),
        *("--disaggregation-bootstrap-port", "0"),  # not the default another test holds
    )
    with pd_pair(decode, prefill, WAIT_S) as pair:
        yield pair


def test_cp_prefill_into_a_cp_decode_group_equals_the_reference(pd, cp_checkpoint):
    _, cfg, ref = cp_checkpoint
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
        outs = list(
            pool.map(lambda job: generate_with_logprobs(router, *job, temperature=0.0), jobs)
        )
    for out, (ids, new) in zip(outs, jobs, strict=True):
        assert out.status_code == 200, out.text
        assert_greedy_reference(out.json(), ref, ids, new)
    for side in ("decode", "prefill"):
        assert_pages_back(pd[side])
    assert decode.step_shapes <= decode.reachable_shapes()


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
