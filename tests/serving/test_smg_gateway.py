"""Our servers as workers behind SGLang's real gateway `smg` in regular mode (issue 38).

Two unified servers of the tiny checkpoint (radix prefix cache on, API key set) on
127.0.0.1, and `smg launch --worker-urls A B --policy cache_aware --api-key KEY` in front:
the gateway registers both as SGLang workers (it read `/server_info` and `/model_info`
with their types right, and no `/version` made them vLLM); `/generate`, `/v1/completions`
(streamed and not) and `/v1/chat/completions` through it answer what a server answers
directly (greedy), the client's `Authorization` and `X-Request-Id` reaching the worker;
requests sharing a long prefix go to the worker that holds it (their `cached_tokens`).

Skipped, saying so, only where the `smg` binary is not installed (`pip install smg`, in
the `test` extras). The worker-side checks without the gateway:
tests/serving/test_gateway_worker.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from support.prefill_server import P
from support.smg import gateway as smg_gateway
from support.smg import smg_binary
from support.unified_server import serving, unified_args

from cpkv_jax import __version__

pytestmark = pytest.mark.slow(seconds=65)  # alone on 2 cores, 2026-12-04

KEY = "gw-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
RUNNING = 2
POOL_PAGES = 24
NEW = 4
WAIT_S = 60.0  # a first request may compile a step shape on a busy 2-core host


@pytest.fixture(scope="module")
def workers(tiny_checkpoint) -> Iterator[list[str]]:
    """Two unified servers (radix cache on) serving model `tiny`, keyed by `KEY`."""
    if smg_binary() is None:
        pytest.skip("the `smg` gateway is not installed (pip install smg==1.13.0)")
    path, cfg, _ = tiny_checkpoint
    extra = ("--max-running-requests", str(RUNNING), "--served-model-name", MODEL)
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(2):
            args = unified_args(path, cfg, POOL_PAGES, *extra, "--api-key", KEY)
            _, served = stack.enter_context(serving(args))
            urls.append(served.url)
        yield urls


@pytest.fixture(scope="module")
def gateway(workers, tmp_path_factory) -> Iterator[str]:
    """`smg launch` in regular mode in front of `workers`, once both are registered (the
    command line README "Behind SGLang's gateway (smg)" gives; regular mode routes on
    text, so the gateway needs no tokenizer)."""
    log_path = tmp_path_factory.mktemp("smg") / "smg.log"
    args = ["--worker-urls", *workers, "--policy", "cache_aware", "--api-key", KEY]
    with smg_gateway(args, log_path, expect=2, headers=AUTH) as url:
        yield url


def post(url: str, path: str, body: dict, **headers: str) -> dict:
    r = httpx.post(url + path, json=body, headers={**AUTH, **headers}, timeout=WAIT_S)
    assert r.status_code == 200, (path, r.text)
    return r.json()


def streamed(url: str, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed request (ending in `[DONE]`)."""
    events, done = [], False
    with httpx.stream("POST", url + path, json=body, headers=AUTH, timeout=WAIT_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    assert done and events
    return events


def test_the_gateway_registers_both_servers_as_sglang_workers(gateway, workers):
    listed = httpx.get(gateway + "/workers", headers=AUTH, timeout=10).json()["workers"]
    assert sorted(w["url"] for w in listed) == sorted(workers)
    for w in listed:
        # "sglang", not "vllm" (no /version) nor "generic" (it read /server_info).
        assert w["runtime_type"] == "sglang" and w["model_id"] == MODEL
        labels = w["labels"]  # from /server_info and /model_info: every type parsed
        assert labels["served_model_name"] == MODEL and labels["version"] == __version__
        assert labels["tp_size"] == "1" and labels["max_running_requests"] == str(RUNNING)
        assert labels["is_generation"] == "true"
        # What its load monitor polls: SGLang's schema, in tokens of the real pool.
        (load,) = httpx.get(w["url"] + "/v1/loads", headers=AUTH, timeout=10).json()["loads"]
        assert load["max_total_num_tokens"] % P == 0 and load["max_total_num_tokens"] > 0
        assert load["max_running_requests"] == RUNNING and load["disagg_mode"] == "null"


def test_generation_routes_through_the_gateway_answer_as_a_server_does(gateway, workers):
    direct = workers[0]
    greedy = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
    gen = {"text": "The gateway says", "sampling_params": greedy}
    via = post(gateway, "/generate", gen, **{"x-request-id": "gw-trace-1"})
    want = post(direct, "/generate", gen)
    assert via["output_ids"] == want["output_ids"] and via["text"] == want["text"]
    assert len(via["output_ids"]) == NEW
    assert via["meta_info"]["id"] == "gw-trace-1"  # the header reached the worker

    comp = {"model": MODEL, "prompt": "Once upon", "max_tokens": NEW, "temperature": 0.0}
    comp["ignore_eos"] = True
    want = post(direct, "/v1/completions", comp)["choices"][0]
    got = post(gateway, "/v1/completions", comp)["choices"][0]
    assert (got["text"], got["token_ids"]) == (want["text"], want["token_ids"])
    events = streamed(gateway, "/v1/completions", {**comp, "stream": True})
    chunks = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in chunks) == want["text"]
    assert [t for c in chunks for t in c["token_ids"]] == want["token_ids"]

    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": NEW,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    want = post(direct, "/v1/chat/completions", chat)
    got = post(gateway, "/v1/chat/completions", chat)
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert got["usage"]["completion_tokens"] == NEW


def test_cache_aware_routing_sends_a_shared_prefix_to_the_worker_holding_it(gateway):
    """Each group's first request is new to both workers (no cached tokens); the second
    shares its whole pages and is served from the prefix cache, which only the worker
    that served the first holds: all groups hit only if the gateway routed by prefix
    (by chance: 1 in 2**GROUPS)."""
    rng = np.random.default_rng(38)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    sampling = {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}
    for group in range(4):
        prefix = "".join(rng.choice(letters, 3 * P))
        first, second = (
            post(gateway, "/generate", {"text": f"{prefix} {tail}", "sampling_params": sampling})
            for tail in ("one", "two")
        )
        assert first["meta_info"]["cached_tokens"] == 0, group
        assert second["meta_info"]["cached_tokens"] >= 3 * P, (group, second["meta_info"])
