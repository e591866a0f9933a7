"""`serving.router` (cpkv-router) relaying PD requests, over real HTTP: every endpoint
streaming and not, the room wiring a prefill server to a decode server, load balancing,
/servers and /v1/models, and bodies the router or the decode server refuses.

The PD servers are the real server app over `MockEngine`s sharing a `MockRooms`
(`support.router_fakes.MockPD`): a decode request gets no token until the prefill call
for its room and transfer target has answered. Failures of a server or of the client are
in test_router_failures.py; worker-only routing, the pure parts and the command line in
test_router_config.py.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from support.router_fakes import (
    ENDPOINTS,
    MOCK_STEP_S,
    PREFILL_CP,
    Deployment,
    decode_of,
    decode_rooms,
    expected_ids,
    fresh_prompt,
    output_of,
    room_requests,
    sse_events,
    wait_until,
)

# ---- PD success ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_pd_request_round_trip(deployment: Deployment, endpoint: str, stream: bool) -> None:
    """One request through the router on every endpoint, streaming and not: the client
    gets the decode server's tokens for its prompt; the room wires the chosen prefill
    server (its CP size, non-streaming body) to the chosen decode server's transfer
    target; nothing stays in flight."""
    body, prompt = fresh_prompt(endpoint)
    body["stream"] = stream
    c = deployment.client
    if stream:
        with c.stream("POST", endpoint, json=body) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        answer: Any = [e for e in events if not (isinstance(e, dict) and "role" in str(e))]
    else:
        r = c.post(endpoint, json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
    d = deployment
    room = r.headers["x-cpkv-room"]
    prefill, decode = d.by_url(r.headers["x-cpkv-prefill"]), d.by_url(r.headers["x-cpkv-decode"])
    reqs = room_requests(d, room)
    assert set(reqs) == {prefill.name, decode.name}  # one call to each, to the chosen pair
    p_req, d_req = reqs[prefill.name], reqs[decode.name]
    # The room wires the prefill server to the decode server's KV receiver and CP size.
    assert p_req.decode_transfer_target == decode.transfer_target
    assert p_req.bootstrap_cp_size is None and d_req.decode_transfer_target is None
    assert d_req.bootstrap_cp_size == prefill.cp_size
    assert d.rooms.targets(room) == [decode.transfer_target]
    assert d_req.input_ids == p_req.input_ids
    if prompt is not None:
        assert list(d_req.input_ids) == prompt
    if endpoint == "/generate":
        assert p_req.rid == d_req.rid == room  # the room is the rid
    # The decode server's tokens: its first one is the prefill's (the room's KV).
    expected = expected_ids(d_req.input_ids, 5)
    assert d.rooms.get(decode.transfer_target, room).token == expected[0]
    got = output_of(endpoint, answer)
    assert got == (expected if endpoint == "/generate" else d.tok.decode(expected)), got
    assert d_req.sampling.max_new_tokens == 5 and decode.engine.finished[d_req.rid] == len(expected)
    if endpoint == "/generate" and not stream:
        assert answer["meta_info"]["id"] == room
    wait_until(
        lambda: all(s["in_flight"] == 0 for s in deployment.servers().values()),
        what="in-flight counts back to 0",
    )


# ---- load balancing ----------------------------------------------------------------------


def test_least_loaded_decode_then_round_robin_then_in_flight(deployment: Deployment) -> None:
    """Reported load steers requests to the idle decode server; equal loads alternate;
    a request the router has in flight counts as load before any poll sees it."""
    d = deployment
    u0, u1 = d.decode[0].url, d.decode[1].url
    d.decode[0].set_load(3, 2)
    wait_until(lambda: d.servers()[u0]["load"] == 5, what="the load of d0 polled")
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 2}}
    assert [decode_of(d.client.post("/generate", json=body), d) for _ in range(3)] == ["d1"] * 3

    d.decode[0].set_load(0, 0)
    # Both idle as the router sees them: d1's last poll may still count the 3 requests.
    wait_until(
        lambda: all(s["load"] == 0 and s["in_flight"] == 0 for s in d.servers().values()),
        what="both decode servers idle again",
    )
    names = [decode_of(d.client.post("/generate", json=body), d) for _ in range(4)]
    assert sorted(names) == ["d0", "d0", "d1", "d1"]
    assert all(a != b for a, b in itertools.pairwise(names)), names  # round-robin on ties

    for s in d.decode:
        s.engine.step_delay = 0.3  # one slow stream holds its decode server
    slow = {**body, "stream": True, "sampling_params": {"max_new_tokens": 4}}
    with d.client.stream("POST", "/generate", json=slow) as r:
        busy = decode_of(r, d)
        busy_url = u0 if busy == "d0" else u1
        assert d.servers()[busy_url]["in_flight"] == 1
        for s in d.decode:
            s.engine.step_delay = MOCK_STEP_S
        other = decode_of(d.client.post("/generate", json=body), d)
        assert other != busy
        events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["output_ids"] == [4, 5, 6, 4]


# ---- router endpoints and refused bodies -------------------------------------------------


def test_servers_and_models_and_bad_bodies(deployment: Deployment) -> None:
    """/servers lists each server with its mode and role facts; /v1/models comes from a
    decode server; malformed or PD-field bodies are 400 without touching a server."""
    d = deployment
    servers = d.servers()
    for s, cp in zip(d.prefill, PREFILL_CP, strict=True):
        got = {k: servers[s.url][k] for k in ("role", "mode", "cp_size", "load")}
        assert got == {"role": "prefill", "mode": "prefill", "cp_size": cp, "load": 0}
    for i, s in enumerate(d.decode):
        assert servers[s.url]["transfer_target"] == f"10.0.0.{i}:1700{i}"
        assert servers[s.url]["mode"] == "decode"
    assert all(s["healthy"] for s in servers.values())
    assert d.client.get("/health").json()["pairs"] == 2
    models = d.client.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "mock"
    n_rooms = len(decode_rooms(d))
    n_bad = [s.bad_requests() for s in (*d.prefill, *d.decode)]
    bad = d.client.post("/generate", content=b"{not json")
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    pd_field = d.client.post("/generate", json={"text": "x", "bootstrap_room": "r"})
    assert pd_field.status_code == 400
    assert "bootstrap_room" in pd_field.json()["error"]["message"]
    assert len(decode_rooms(d)) == n_rooms
    assert [s.bad_requests() for s in (*d.prefill, *d.decode)] == n_bad  # none reached a server


def test_decode_rejection_is_forwarded_without_a_prefill_call(deployment: Deployment) -> None:
    """A 400 from the decode server reaches the client unchanged and no prefill call is
    made for it (there is no room to send KV to)."""
    d = deployment
    before = [(s.bad_requests(), len(s.engine.added)) for s in d.prefill]
    decode_bad = sum(s.bad_requests() for s in d.decode)
    # The server's OpenAI models refuse a field they do not know (a typo of `max_tokens`).
    r = d.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "max_token": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("unknown field 'max_token'"), r.text
    assert sum(s.bad_requests() for s in d.decode) == decode_bad + 1  # the decode refused it
    time.sleep(0.3)  # longer than --decode-register-wait: a prefill call would have started
    assert [(s.bad_requests(), len(s.engine.added)) for s in d.prefill] == before
