"""`serving.router` (cpkv-router) when something fails, over real HTTP: a prefill 500
mid-request, a full wait queue, a client leaving mid-stream or before the answer, an
unhealthy decode server and a dead prefill server. Each failure must reach the client
cleanly and fast (`FAILURE_BOUND_S`), close what the router opened upstream and leave
the server pool's view (/servers, /health, /metrics) right.

The PD servers are the real server app over `MockEngine`s sharing a `MockRooms`
(`support.router_fakes.MockPD`); a decode request the router closes shows as aborted in
its engine.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.router_fakes import (
    FAILURE_BOUND_S,
    KV_WAIT_S,
    Deployment,
    MockPD,
    Served,
    decode_closed,
    decode_of,
    decode_rooms,
    expected_ids,
    fresh_prompt,
    new_room,
    role_gauge,
    router_config,
    sse_events,
    wait_until,
)

from serving.engine.mock import MOCK_RETRY_AFTER_S, MockRooms
from serving.http.chat_template import load_chat_template
from serving.router import build_router_app

# ---- failures ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "stream", "started"),
    [
        ("/generate", False, False),
        ("/generate", True, False),  # decode holds its first event until the KV is there
        # The prefill fails after its KV went out: the decode stream has begun.
        ("/v1/chat/completions", True, True),
    ],
)
def test_prefill_500_fails_the_request_cleanly(
    deployment: Deployment, endpoint: str, stream: bool, started: bool
) -> None:
    """A prefill 500 mid-request: 503 naming the prefill server when nothing was sent,
    else an SSE error event and [DONE]; well before any timeout; the decode upstream is
    closed (the decode request is aborted in its engine, before any KV)."""
    d = deployment
    d.rooms.prefill_fail, d.rooms.prefill_delay = True, 0.3
    if started:
        d.rooms.prefill_fail_after_kv_s = 0.4
        for s in d.decode:
            s.engine.step_delay = 0.15  # the stream goes on past the prefill's answer
    before = decode_rooms(d)
    body, _ = fresh_prompt(endpoint)
    body["stream"] = stream
    if started:
        body["max_tokens"] = 50  # far from done when the prefill fails
    t0 = time.monotonic()
    with d.client.stream("POST", endpoint, json=body) as r:
        raw = r.read()
    elapsed = time.monotonic() - t0
    assert elapsed < FAILURE_BOUND_S, f"took {elapsed:.2f} s"
    if started:
        assert r.status_code == 200
        events = sse_events(iter(raw.decode().splitlines()))
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
    else:
        assert r.status_code == 503, raw
        error = json.loads(raw)["error"]
    assert error["code"] == 503
    assert "prefill server http://127.0.0.1:" in error["message"] and "500" in error["message"]
    assert "the CP prefill step failed" in error["message"]
    room = new_room(d, before)
    wait_until(lambda: decode_closed(d, room), what="the decode upstream closed")
    assert len(d.rooms.targets(room)) == started  # KV went out only in the started case
    metrics = d.client.get("/metrics").text
    assert 'cpkv_router_upstream_failures_total{reason="status_5xx",role="prefill"' in metrics


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_full_queue_is_503_with_retry_after_for_the_client(
    deployment: Deployment, side: str
) -> None:
    """Backpressure passes through the router: a decode or prefill server whose wait
    queue is full answers 503 + Retry-After, and so does the router, at once."""
    d = deployment
    for s in d.decode if side == "decode" else d.prefill:
        s.engine.queue_full = True
    body, _ = fresh_prompt("/generate")
    t0 = time.monotonic()
    r = d.client.post("/generate", json=body)
    assert time.monotonic() - t0 < FAILURE_BOUND_S
    assert r.status_code == 503, (r.status_code, r.text)
    assert r.headers.get("retry-after") == str(MOCK_RETRY_AFTER_S), r.headers
    assert "wait queue is full" in r.json()["error"]["message"]


def test_client_disconnect_closes_the_upstream_stream(deployment: Deployment) -> None:
    """A client leaving mid-stream: the router closes the decode stream (the decode
    server aborts the request), releases its in-flight count and counts a
    client_disconnect."""
    d = deployment
    for s in d.decode:
        s.engine.step_delay = 0.05
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 200}, "stream": True}
    with d.client.stream("POST", "/generate", json=body) as r:
        room = r.headers["x-cpkv-room"]
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 2:
                break
    wait_until(lambda: decode_closed(d, room), what="the decode server to see the disconnect")
    decode = d.by_url(r.headers["x-cpkv-decode"])
    assert decode.engine.finished[room] < 200  # cut short, not run to the end
    wait_until(
        lambda: all(s["in_flight"] == 0 for s in d.servers().values()),
        what="in-flight counts back to 0",
    )
    families = {f.name: f for f in text_string_to_metric_families(d.client.get("/metrics").text)}
    samples = families["cpkv_router_requests"].samples
    assert any(
        s.labels == {"endpoint": "/generate", "outcome": "client_disconnect"} and s.value >= 1
        for s in samples
    )


def test_client_gone_before_the_answer_closes_both_upstreams(deployment: Deployment) -> None:
    """A non-streaming client that gives up while the prefill is still running: the
    router notices before any response started, closes the decode request (the decode
    server aborts it) and cancels the prefill call (its in-flight count is released)."""
    d = deployment
    d.rooms.prefill_delay = 6.0  # far longer than every wait below
    before = decode_rooms(d)
    body = {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2}}
    with pytest.raises(httpx.ReadTimeout):
        d.client.post("/generate", json=body, timeout=0.4)
    room = new_room(d, before)
    wait_until(
        lambda: decode_closed(d, room),
        timeout=2.0,
        what="the decode server to see the disconnect",
    )
    assert d.rooms.targets(room) == []  # gone before the prefill finished
    (prefill,) = [s for s in d.prefill if s.request(room) is not None]
    wait_until(
        lambda: room in prefill.engine.aborted and room in prefill.engine.finished,
        timeout=2.0,
        what="the prefill request aborted",
    )
    wait_until(
        lambda: all(s["in_flight"] == 0 for s in d.servers().values()),
        timeout=2.0,
        what="in-flight counts back to 0 (prefill call cancelled)",
    )


def test_unhealthy_decode_leaves_rotation_and_returns(deployment: Deployment) -> None:
    """A decode server answering /health 503 is out after `--health-failures` polls
    (/servers says why, /health stays 200 with the other pair), gets no requests, and
    is back after it recovers; the healthy-servers gauge follows."""
    d = deployment
    d.decode[0].loop.unhealthy = "a test switched it off"
    u0 = d.decode[0].url
    wait_until(lambda: not d.servers()[u0]["healthy"], what="d0 out of rotation")
    info = d.servers()[u0]
    assert info["mode"] == "decode" and "/health answered 503" in info["last_error"]
    health = d.client.get("/health")
    assert health.status_code == 200 and health.json()["healthy"]["decode"] == 1
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 1}}
    assert {decode_of(d.client.post("/generate", json=body), d) for _ in range(4)} == {"d1"}
    gauge = role_gauge(d, "cpkv_router_healthy_servers", "decode")
    assert gauge == 1.0
    d.decode[0].loop.unhealthy = None
    wait_until(lambda: d.servers()[u0]["healthy"], what="d0 back")
    assert role_gauge(d, "cpkv_router_healthy_servers", "decode") == 2.0


# ---- a dead prefill server ------------------------------------------------------------------


def test_dead_prefill_is_503_leaves_rotation_and_comes_back(tokenizer_dir, tok) -> None:
    """Prefill port closed: the request fails fast with 503 naming the server, the server
    leaves rotation (/servers, /health), later requests are refused at once; restarted on
    the same port it is back and requests succeed."""
    rooms = MockRooms(wait_s=KV_WAIT_S)
    common = {"tokenizer": tok, "chat_template": load_chat_template(tokenizer_dir)}
    prefill = MockPD("p", rooms, cp_size=2, **common)
    decode = MockPD("d", rooms, transfer_target="10.0.1.1:17000", **common)
    router = Served(build_router_app(router_config(prefill=(prefill.url,), decode=(decode.url,))))
    client = httpx.Client(base_url=router.url, timeout=10.0, trust_env=False)
    body = {"input_ids": [9, 9], "sampling_params": {"max_new_tokens": 3}}
    try:
        r = client.post("/generate", json=body)
        assert r.status_code == 200 and r.json()["output_ids"] == expected_ids([9, 9], 3)
        prefill.stop()
        for stream in (False, True):
            t0 = time.monotonic()
            r = client.post("/generate", json={**body, "stream": stream})
            assert time.monotonic() - t0 < FAILURE_BOUND_S
            assert r.status_code == 503
            message = r.json()["error"]["message"]
            assert prefill.url in message and "prefill" in message, message
        servers = {s["url"]: s for s in client.get("/servers").json()["servers"]}
        assert not servers[prefill.url]["healthy"]
        assert "connection refused" in servers[prefill.url]["last_error"]
        health = client.get("/health")
        assert health.status_code == 503
        assert "no healthy prefill server" in health.json()["error"]["message"]
        t0 = time.monotonic()
        r = client.post("/generate", json=body)
        assert r.status_code == 503 and time.monotonic() - t0 < 0.5
        assert "no healthy prefill server" in r.json()["error"]["message"]
        # Every decode request the router opened (if it got that far) was closed or done.
        for rid in list(decode.engine.added):
            wait_until(lambda rid=rid: rid in decode.engine.finished, what="decode request ended")
            assert rid in decode.engine.aborted or rooms.targets(
                decode.engine.requests[rid].bootstrap_room
            )
        wait_until(lambda: not decode.engine.has_work(), what="nothing left on the decode server")

        prefill = MockPD("p", rooms, cp_size=2, port=prefill.port, **common)
        wait_until(lambda: client.get("/health").status_code == 200, what="prefill back")
        r = client.post("/generate", json=body)
        assert r.status_code == 200 and r.json()["output_ids"] == expected_ids([9, 9], 3)
    finally:
        client.close()
        for s in (router, prefill, decode):
            if s.served.thread.is_alive() if isinstance(s, MockPD) else s.thread.is_alive():
                s.stop()
