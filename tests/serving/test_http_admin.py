"""The HTTP API's non-generation endpoints over a real uvicorn server around
`MockEngine`: /v1/models, /health, /server_info, /metrics (request, token and engine
figures; the engine's known `STATS_EXTRA` values) and /start_profile, /stop_profile.
"""

from __future__ import annotations

from support.http_client import CONTEXT, PAGES, VOCAB, metric_samples

# ---- the other endpoints ------------------------------------------------------------------


def test_models_health_server_info(srv):
    r = srv.http.get("/v1/models")
    assert r.json()["data"][0]["id"] == "tiny-tok" and r.json()["object"] == "list"
    assert srv.http.get("/health").status_code == 200
    info = srv.http.get("/server_info").json()
    assert info["server_name"] == "tok" and info["mode"] == "null"
    assert info["waiting"] == 0  # the engine's stats win over the server_info() dict
    assert info["kv_pages_total"] == list(PAGES) and info["transfer_failures"] == 2
    assert info["context_length"] == CONTEXT and info["vocab_size"] == VOCAB


def test_metrics_count_requests_tokens_and_engine_gauges(srv):
    before = metric_samples(srv)
    n_req, n_tok = 3, 6
    for _ in range(n_req):
        srv.http.post(
            "/generate", json={"input_ids": [40, 41], "sampling_params": {"max_new_tokens": n_tok}}
        )
    srv.http.post("/generate", json={"input_ids": [-1]})
    after = metric_samples(srv)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("cpkv_requests_total", finish_reason="length") == n_req
    assert delta("cpkv_generation_tokens_total") == n_req * n_tok
    assert delta("cpkv_prompt_tokens_total") == n_req * 2
    assert delta("cpkv_time_to_first_token_seconds_count") == n_req
    assert delta("cpkv_inter_token_latency_seconds_count") == n_req * (n_tok - 1)
    assert delta("cpkv_e2e_request_latency_seconds_count") == n_req
    assert delta("cpkv_http_bad_requests_total") == 1
    assert after[("cpkv_kv_pages_total", (("rank", "1"),))] == PAGES[1]
    assert after[("cpkv_kv_pages_used", (("rank", "0"),))] == 0  # nothing running now
    assert after[("cpkv_queue_length", ())] == 0
    assert after[("cpkv_running_requests", ())] == 0
    assert after[("cpkv_transfer_bytes_total", ())] == 123456
    assert after[("cpkv_transfer_failures_total", ())] == 2
    assert after[("cpkv_transfer_seconds_total", ())] == 1.5
    assert after[("cpkv_admission_rejections_total", (("gate", "buffer_bytes"),))] == 3
    # The wait queue: waits (a summary), refusals of a full queue, its limit.
    assert after[("cpkv_queue_wait_seconds_count", ())] == 4
    assert after[("cpkv_queue_wait_seconds_sum", ())] == 2.5
    assert after[("cpkv_queue_full_rejections_total", ())] == 1
    assert after[("cpkv_queue_limit", ())] == 9
    assert after[("cpkv_kv_pages_cached", (("rank", "0"),))] == 5


def test_profile_start_stop(srv, tmp_path):
    out = tmp_path / "trace"
    assert srv.http.post("/stop_profile").status_code == 400
    r = srv.http.post("/start_profile", json={"output_dir": str(out)})
    assert r.status_code == 200, r.text
    again = srv.http.post("/start_profile")
    assert again.status_code == 400 and "already" in again.json()["error"]["message"]
    srv.http.post("/generate", json={"input_ids": [50], "sampling_params": {"max_new_tokens": 2}})
    r = srv.http.post("/stop_profile")
    assert r.status_code == 200, r.text
    assert list(out.rglob("*.xplane.pb")), "the JAX trace was not written"
    assert srv.http.post("/stop_profile").status_code == 400


def _stream_until_first_event(srv, rid: str, stack):

    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": CONTEXT - 3, "ignore_eos": True},
        "stream": True,
        "rid": rid,
    }
    r = stack.enter_context(srv.http.stream("POST", "/generate", json=body, timeout=30))
    assert r.status_code == 200
    lines = r.iter_lines()
    assert next(ln for ln in lines if ln.startswith("data:"))
    return lines


def _aborted(lines) -> bool:
    """Whether the stream ended with the error event of an aborted request."""
    import json

    last = None
    for ln in lines:
        if ln.startswith("data:") and ln[5:].strip() != "[DONE]":
            last = json.loads(ln[5:])
    assert last is not None
    return "/abort_request" in last.get("error", {}).get("message", "")


def test_abort_request_by_rid_and_all(srv):
    """SGLang's `/abort_request`: by `rid` the named stream ends with the abort's error
    event and another goes on; `abort_all` ends every one; an unknown rid is a 200 (it
    may have just finished) and a body naming neither is a 400."""
    import contextlib

    with contextlib.ExitStack() as stack:
        a = _stream_until_first_event(srv, "abort-me", stack)
        b = _stream_until_first_event(srv, "keep-me", stack)
        r = srv.http.post("/abort_request", json={"rid": "abort-me"})
        assert r.status_code == 200, r.text
        assert r.json()["aborted"] == ["abort-me"]
        assert _aborted(a)
        r = srv.http.post("/abort_request", json={"abort_all": True})
        assert r.status_code == 200 and "keep-me" in r.json()["aborted"], r.text
        assert _aborted(b)
    assert srv.http.post("/abort_request", json={"rid": "gone"}).status_code == 200
    for bad in ({}, {"rid": "x", "abort_all": True}, {"abort_all": False}):
        r = srv.http.post("/abort_request", json=bad)
        assert r.status_code == 400, (bad, r.text)
