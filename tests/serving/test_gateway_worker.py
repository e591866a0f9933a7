"""What SGLang's gateway `smg` (regular mode) needs of a worker (issue 38), over the real
app around `MockEngine` (`srv`, `bare` in tests/serving/conftest.py): the registration
endpoints and their JSON types, no `/version`, the `/generate` body the gateway sends
(captured from smg 1.13.0) with its `model`, the gateway fields refused where they ask for
what this server cannot do, and `X-Request-Id` as the request id. The real gateway in
front of real servers: tests/serving/test_smg_gateway.py."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from support.http_client import CONTEXT

from cpkv_jax import __version__
from serving.engine.mock import echo_ids, mock_logprob

IDS = [40, 41, 42]
N = 4


def gateway_body(model: str | None = "unknown", **extra) -> dict:
    """A `/generate` body as smg 1.13.0 forwards it (the fields after `sampling_params` are
    the ones it always adds; sglang-router 0.3.2 sends `model: null`)."""
    return {
        "input_ids": IDS,
        "model": model,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": N},
        "return_text_in_logprobs": False,
        "stream": False,
        "log_metrics": True,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
        **extra,
    }


# ---- registration ------------------------------------------------------------------------


def test_server_info_has_sglangs_fields_with_sglangs_types(srv):
    for path in ("/server_info", "/get_server_info"):
        info = srv.http.get(path).json()
        assert info["served_model_name"] == "tiny-tok"
        assert info["model_path"] == "tiny-tok"  # no model path given: the served name
        assert info["tp_size"] == 1 and info["dp_size"] == 1
        assert info["disaggregation_mode"] == "null"
        assert info["version"] == __version__
        # The types the gateway's typed parse takes (one wrong type voids all of it).
        for key in ("served_model_name", "model_path", "disaggregation_mode", "version"):
            assert isinstance(info[key], str), key
        for key in ("tp_size", "dp_size", "context_length"):
            assert type(info[key]) is int and info[key] >= 0, key
        assert info["context_length"] == CONTEXT
        assert info["server_name"] == "tok"  # the server's own fields are kept


def test_model_info_and_no_version_route(srv, bare):
    for path in ("/model_info", "/get_model_info"):
        assert srv.http.get(path).json() == {
            "model_path": "tiny-tok",
            "tokenizer_path": "tiny-tok",
            "is_generation": True,
        }
    assert bare.http.get("/model_info").json()["tokenizer_path"] is None
    # A 2xx on /version makes the gateway take the worker for vLLM.
    for method in ("GET", "POST"):
        assert srv.http.request(method, "/version").status_code == 404
    models = srv.http.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny-tok"


def test_v1_loads_is_sglangs_load_schema(srv):
    body = srv.http.get("/v1/loads", params={"include": "core,disagg,queues,memory"}).json()
    assert body["dp_rank_count"] == 1 and isinstance(body["timestamp"], str)
    (load,) = body["loads"]
    stats = srv.loop.stats()
    total = sum(stats.kv_pages_total)
    # (The mock's made-up cached pages overlap its free ones: never below 0.)
    used = max(0, total - sum(stats.kv_pages_free) - sum(stats.kv_pages_cached))
    assert load["token_usage"] == used / total and 0 <= load["token_usage"] <= 1
    assert load["num_running_reqs"] == load["num_waiting_reqs"] == 0
    assert load["disagg_mode"] == "null"
    assert load["max_total_num_tokens"] == 0  # the mock server reports no page size
    for key in ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs",
                "num_used_tokens", "max_total_num_tokens", "max_running_requests"):  # fmt: skip
        assert type(load[key]) is int, key  # i32 in the gateway's parse


# ---- /generate as the gateway sends it ----------------------------------------------------


@pytest.mark.parametrize("model", ["unknown", None, "tiny-tok"])
def test_generate_accepts_the_gateways_body(srv, model):
    r = srv.http.post("/generate", json=gateway_body(model))
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == echo_ids(IDS, N)


def test_generate_naming_another_model_is_404(srv):
    r = srv.http.post("/generate", json=gateway_body("gpt-4"))
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "model_not_found"
    assert "'tiny-tok'" in r.json()["error"]["message"]
    # "unknown" means "any model" on /generate only: the OpenAI routes get it from no client.
    r = srv.http.post("/v1/completions", json={"model": "unknown", "prompt": IDS})
    assert r.status_code == 404


@pytest.mark.parametrize(
    ("field", "value"),
    [("return_entropy", True), ("background", True), ("return_bytes", True)],
)
def test_gateway_fields_asking_for_what_is_not_done_are_400(srv, field, value):
    r = srv.http.post("/generate", json=gateway_body(**{field: value}))
    assert r.status_code == 400
    assert f"{field}=true is not supported" in r.json()["error"]["message"]


def test_gateway_hints_are_accepted(srv):
    # Nothing here logs request contents (`no_logs`) or has per-request metrics switches.
    r = srv.http.post("/generate", json=gateway_body(no_logs=True, log_metrics=False))
    assert r.status_code == 200, r.text


def test_return_text_in_logprobs(srv, tok, bare):
    ids = tok.encode("abc")
    body = gateway_body(input_ids=ids, return_logprob=True, return_text_in_logprobs=True)
    r = srv.http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    want = echo_ids(ids, N)
    got = r.json()["meta_info"]["output_token_logprobs"]
    assert got == [[mock_logprob(t, i), t, tok.decode([t])] for i, t in enumerate(want)]
    r = bare.http.post("/generate", json={**body, "model": None})
    assert r.status_code == 400 and "needs a tokenizer" in r.json()["error"]["message"]


# ---- X-Request-Id ----------------------------------------------------------------------


def test_x_request_id_becomes_the_request_id(srv):
    hdr = {"x-request-id": "trace-abc"}
    r = srv.http.post("/generate", json=gateway_body(), headers=hdr)
    assert r.json()["meta_info"]["id"] == "trace-abc"
    # A body rid wins over the header.
    r = srv.http.post("/generate", json=gateway_body(rid="body-rid"), headers=hdr)
    assert r.json()["meta_info"]["id"] == "body-rid"
    r = srv.http.post("/v1/completions", json={"prompt": IDS, "max_tokens": 2}, headers=hdr)
    assert r.json()["id"] == "cmpl-trace-abc"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = srv.http.post("/v1/chat/completions", json=chat, headers=hdr)
    assert r.json()["id"] == "chatcmpl-trace-abc"
    # An over-long header is ignored (a fresh id), not refused.
    r = srv.http.post("/generate", json=gateway_body(), headers={"x-request-id": "x" * 300})
    assert r.status_code == 200 and len(r.json()["meta_info"]["id"]) == 32


def test_a_repeated_x_request_id_in_flight_is_made_unique(srv):
    """A header id already in flight gets a suffix (tracing ids repeat); a body `rid`
    already in flight stays a 400, as in SGLang; the first request is untouched."""
    srv.engine.step_delay = 0.01
    hdr = {"x-request-id": "dup-1"}
    long = gateway_body(stream=True, sampling_params={"max_new_tokens": 60})
    first: dict = {}
    started = threading.Event()

    def run_first() -> None:
        with (
            httpx.Client(base_url=srv.server.url, timeout=30) as c,
            c.stream("POST", "/generate", json=long, headers=hdr) as r,
        ):
            first["status"] = r.status_code
            for line in r.iter_lines():
                started.set()
                if line.startswith("data: {"):
                    first["last"] = json.loads(line.removeprefix("data: "))
        started.set()

    t = threading.Thread(target=run_first, daemon=True)
    try:
        t.start()
        assert started.wait(20)
        r = srv.http.post("/generate", json=gateway_body(), headers=hdr)
        assert r.status_code == 200, r.text
        rid = r.json()["meta_info"]["id"]
        assert rid.startswith("dup-1-") and len(rid) == len("dup-1-") + 32
        r = srv.http.post("/generate", json=gateway_body(rid="dup-1"))
        assert r.status_code == 400 and "already in flight" in r.text
        t.join(30)
        assert not t.is_alive()
    finally:
        srv.engine.step_delay = 0.0005
    assert first["status"] == 200
    meta = first["last"]["meta_info"]
    assert meta["id"] == "dup-1" and meta["finish_reason"] == {"type": "length"}
    # Finished: the id is free again.
    r = srv.http.post("/generate", json=gateway_body(), headers=hdr)
    assert r.json()["meta_info"]["id"] == "dup-1"
