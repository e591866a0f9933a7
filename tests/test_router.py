"""`serving.router` (cpkv-router) against in-test fake servers, all over real HTTP.

Unified (`--worker`) servers are the real server app (`serving.http.app.build_app`) around
the real `EngineLoop` and `serving.engine.mock.MockEngine` (no model needed). The PD pair
is in-test fakes: a mock engine's decode side does not wait for a prefill's KV, and the
checks below need exactly that dependency (who waits for whom, and what each side sees
when the other fails or the client leaves).

The PD fakes implement the `cpkv-serve` contract the router relies on (`/health`,
`/server_info`, the three generate endpoints with the PD fields) around an in-test
`Cluster` that stands in for the KV transfer layer: a fake decode server registers the
request's room and waits (bounded) until a fake prefill server completes that room, then
produces tokens from a closed-form rule (`expected_tokens`). A prefill call that reaches
the wrong decode server (transfer target), the wrong room or another prompt fails the
room, so a wiring mistake in the router cannot pass. Everything runs on real uvicorn
servers on 127.0.0.1 with a real httpx client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from serving.engine.mock import MOCK_FAIL_ID, MockEngine, echo_ids
from serving.http.app import build_app
from serving.http.metrics import ServerMetrics
from serving.router import (
    EXIT_STARTUP_FAILED,
    EXIT_USAGE,
    NoHealthyServerError,
    RouterConfig,
    RouterConfigError,
    RouterInputError,
    ServerInfo,
    ServerModeError,
    ServerPool,
    build_router_app,
    check_client_body,
    main,
    parse_server_info,
    pd_bodies,
)

# The mock worker's vocabulary: prompt ids above `MOCK_FAIL_ID` are echoed as they are.
MOCK_VOCAB = 320
# Fake-server wait bounds: longer than every wall-time bound asserted below, so a test only
# passes when the router itself ends the request, never the fakes' own timeouts.
FAKE_WAIT_S = 10.0
# Router timings for tests: fast health polls so state changes show within ~0.5 s.
HEALTH_INTERVAL_S = 0.2
HEALTH_FAILURES = 2
# A clean failure must reach the client well before any upstream timeout (5 s here).
FAILURE_BOUND_S = 2.5


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    """The fakes' closed-form output: depends on every prompt id and the position."""
    return [(sum(prompt) * 31 + 7 * i + 1) % 1000 for i in range(n)]


def piece(token: int) -> str:
    return f"<{token}>"


# ---- the fake cluster ------------------------------------------------------------------------


@dataclasses.dataclass
class Room:
    decode: str
    transfer_target: str
    cp_size: int
    prompt: list[int]
    max_new_tokens: int
    prefill: str | None = None
    error: str | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    closed: threading.Event = dataclasses.field(default_factory=threading.Event)


class Cluster:
    """Shared between fake servers (each in its own uvicorn thread): rooms and knobs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rooms: dict[str, Room] = {}
        self.prefill_bodies: list[tuple[str, str, dict[str, Any]]] = []
        self.reset()

    def reset(self) -> None:
        self.prefill_fail = False  # prefill answers 500 (after `prefill_delay`)
        self.prefill_delay = 0.0  # seconds a prefill call takes before it acts
        self.token_delay = 0.0
        self.queue_full: str | None = None  # "decode" / "prefill": that one answers 503

    def room(self, room: str) -> Room:
        with self.lock:
            return self.rooms[room]


def prompt_of(endpoint: str, body: dict[str, Any]) -> tuple[list[int], int]:
    """(prompt ids, max new tokens) as the fake servers tokenize: ord() per character."""
    if endpoint == "/generate":
        ids = body.get("input_ids") or [ord(c) for c in body["text"]]
        return ids, body.get("sampling_params", {}).get("max_new_tokens", 16)
    if endpoint == "/v1/completions":
        p = body["prompt"]
        return (p if isinstance(p, list) else [ord(c) for c in p]), body.get("max_tokens", 16)
    text = "\n".join(m["content"] for m in body["messages"])
    return [ord(c) for c in text], body.get("max_tokens", 16)


def bad_request(message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": 400}}, 400
    )


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def stream_event(endpoint: str, room: str, tokens: list[int], k: int) -> dict[str, Any]:
    if endpoint == "/generate":  # SGLang style: cumulative
        done = tokens[: k + 1]
        return {
            "text": "".join(map(piece, done)),
            "output_ids": done,
            "meta_info": {"id": room},
        }
    fin = "length" if k == len(tokens) - 1 else None
    if endpoint == "/v1/completions":
        choice = {"index": 0, "text": piece(tokens[k]), "finish_reason": fin}
        return {"id": room, "object": "text_completion", "choices": [choice]}
    choice = {"index": 0, "delta": {"content": piece(tokens[k])}, "finish_reason": fin}
    return {"id": room, "object": "chat.completion.chunk", "choices": [choice]}


def full_answer(endpoint: str, room: str, tokens: list[int]) -> dict[str, Any]:
    text = "".join(map(piece, tokens))
    if endpoint == "/generate":
        return {"text": text, "output_ids": tokens, "meta_info": {"id": room}}
    if endpoint == "/v1/completions":
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        return {"id": room, "object": "text_completion", "choices": [choice]}
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "finish_reason": "length"}
    return {"id": room, "object": "chat.completion", "choices": [choice]}


@dataclasses.dataclass
class FakeState:
    name: str
    healthy: bool = True
    waiting: int = 0
    running: int = 0


ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions")


def base_app(state: FakeState, info: Callable[[], dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.healthy else 503)

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {"waiting": state.waiting, "running": state.running, **info()}

    return app


def queue_full_response() -> JSONResponse:
    """What `cpkv-serve` answers when its wait queue is full (`serving.engine.wait_queue`)."""
    error = {"message": "wait queue is full", "type": "service_unavailable", "code": 503}
    return JSONResponse({"error": error}, 503, headers={"Retry-After": "4"})


def fake_decode(cluster: Cluster, state: FakeState, transfer_target: str) -> FastAPI:
    """Registers the room, waits for the prefill (watching for its client going away),
    streams or returns `expected_tokens`."""
    app = base_app(state, lambda: {"mode": "decode", "transfer_target": transfer_target})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake", "owned_by": state.name}]}

    async def wait_room(r: Room, request: Request | None) -> str | None:
        """None when the prefill completed the room, else why not."""
        deadline = time.monotonic() + FAKE_WAIT_S
        while not r.done.is_set():
            if request is not None and await request.is_disconnected():
                r.closed.set()
                return "client disconnected"
            if time.monotonic() > deadline:
                return "timed out waiting for the KV"
            await asyncio.sleep(0.005)
        return r.error

    def handler(endpoint: str) -> Callable[[Request], Any]:
        async def generate(request: Request) -> Response:
            body = await request.json()
            room = body.get("bootstrap_room")
            cp_size = body.get("bootstrap_cp_size")
            if not isinstance(room, str) or type(cp_size) is not int:
                return bad_request("decode mode needs bootstrap_room and bootstrap_cp_size")
            if "decode_transfer_target" in body:
                return bad_request("decode_transfer_target is for the prefill server")
            if endpoint == "/generate" and body.get("rid") != room:
                return bad_request(f"rid {body.get('rid')!r} is not the room {room!r}")
            if endpoint != "/generate" and "rid" in body:
                return bad_request("unknown field rid")  # strict OpenAI models
            if cluster.queue_full == "decode":
                return queue_full_response()
            prompt, n = prompt_of(endpoint, body)
            r = Room(state.name, transfer_target, cp_size, prompt, n)
            with cluster.lock:
                cluster.rooms[room] = r
            tokens = expected_tokens(prompt, n)
            if not body.get("stream"):
                why = await wait_room(r, request)
                if why is not None:
                    message = {"message": why, "type": "server_error", "code": 500}
                    return JSONResponse({"error": message}, 500)
                return JSONResponse(full_answer(endpoint, room, tokens))

            async def events() -> Any:
                try:
                    if endpoint == "/v1/chat/completions":  # OpenAI servers open with the role
                        delta = {"role": "assistant", "content": ""}
                        yield sse({"id": room, "choices": [{"index": 0, "delta": delta}]})
                    why = await wait_room(r, None)
                    if why is not None:
                        yield sse({"error": {"message": why, "type": "server_error", "code": 500}})
                    else:
                        for k in range(n):
                            await asyncio.sleep(cluster.token_delay)
                            yield sse(stream_event(endpoint, room, tokens, k))
                    yield b"data: [DONE]\n\n"
                except (asyncio.CancelledError, GeneratorExit):
                    r.closed.set()
                    raise

            return StreamingResponse(events(), media_type="text/event-stream")

        return generate

    for endpoint in ENDPOINTS:
        app.add_api_route(endpoint, handler(endpoint), methods=["POST"])
    return app


def fake_prefill(cluster: Cluster, state: FakeState, cp_size: int) -> FastAPI:
    """Waits (bounded) for the room like the transfer handshake retry, checks the wiring,
    completes the room; or fails with 500 when `cluster.prefill_fail`."""
    app = base_app(state, lambda: {"mode": "prefill", "cp_size": cp_size})

    def handler(endpoint: str) -> Callable[[Request], Any]:
        async def generate(request: Request) -> Response:
            body = await request.json()
            with cluster.lock:
                cluster.prefill_bodies.append((state.name, endpoint, body))
            room_id, target = body.get("bootstrap_room"), body.get("decode_transfer_target")
            if not isinstance(room_id, str) or not isinstance(target, str):
                return bad_request("prefill mode needs bootstrap_room and decode_transfer_target")
            if body.get("stream") is not False or "stream_options" in body:
                return bad_request("the prefill call must be non-streaming")
            if "bootstrap_cp_size" in body:
                return bad_request("bootstrap_cp_size is for the decode server")
            await asyncio.sleep(cluster.prefill_delay)
            if cluster.queue_full == "prefill":
                return queue_full_response()
            if cluster.prefill_fail:
                error = {"message": "CP step crashed", "type": "server_error", "code": 500}
                return JSONResponse({"error": error}, 500)
            deadline = time.monotonic() + FAKE_WAIT_S
            while True:
                with cluster.lock:
                    r = cluster.rooms.get(room_id)
                if r is not None:
                    break
                if time.monotonic() > deadline:
                    return JSONResponse({"error": {"message": "room never registered"}}, 500)
                await asyncio.sleep(0.005)
            prompt, n = prompt_of(endpoint, body)
            if (target, prompt, n) != (r.transfer_target, r.prompt, r.max_new_tokens):
                r.error = f"prefill got {(target, n)} for a room of {(r.transfer_target, n)}"
            r.prefill = state.name
            r.done.set()
            first = expected_tokens(prompt, 1)
            return JSONResponse({"output_ids": first, "meta_info": {"id": body.get("rid")}})

        return generate

    for endpoint in ENDPOINTS:
        app.add_api_route(endpoint, handler(endpoint), methods=["POST"])
    return app


class MockWorker:
    """A unified (mode null) `cpkv-serve` app on uvicorn: the real HTTP app and
    `EngineLoop` around a `MockEngine` (token ids only, output `echo_ids`)."""

    def __init__(self) -> None:
        self.engine = MockEngine(None)
        self.loop = self.engine.loop(name="router-test-worker")
        app = build_app(
            self.loop,
            model_name="mock",
            tokenizer=None,
            vocab_size=MOCK_VOCAB,
            context_length=256,
            chat_template=None,
            metrics=ServerMetrics(),
        )
        self.served = Served(app)
        self.url = self.served.url

    def stop(self) -> None:
        self.served.stop()
        asyncio.run(self.loop.shutdown(1.0))


# ---- running servers -------------------------------------------------------------------------


class Served:
    """A uvicorn server on 127.0.0.1 in a daemon thread."""

    def __init__(self, app: FastAPI, port: int = 0):
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=1,
            # No uvicorn handlers: they would keep the stderr of the test that made them.
            log_config=None,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.port: int = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive(), "uvicorn did not stop"


def router_config(**kw: Any) -> RouterConfig:
    defaults = {
        "request_timeout": 5.0,
        "connect_timeout": 1.0,
        "decode_register_wait": 0.1,
        "health_interval": HEALTH_INTERVAL_S,
        "health_failures": HEALTH_FAILURES,
        "health_timeout": 1.0,
        "startup_timeout": 5.0,
    }
    return RouterConfig(**{**defaults, **kw})


def wait_until(pred: Callable[[], bool], timeout: float = 3.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@dataclasses.dataclass
class Deployment:
    cluster: Cluster
    prefill: list[Served]
    prefill_states: list[FakeState]
    decode: list[Served]
    decode_states: list[FakeState]
    router: Served
    client: httpx.Client

    def servers(self) -> dict[str, dict[str, Any]]:
        return {s["url"]: s for s in self.client.get("/servers").json()["servers"]}


PREFILL_CP = (8, 4)


@pytest.fixture(scope="module")
def pd() -> Iterator[Deployment]:
    """Two prefill (CP 8 and 4) and two decode fakes behind one router."""
    cluster = Cluster()
    p_states = [FakeState(f"p{i}") for i in range(2)]
    d_states = [FakeState(f"d{i}") for i in range(2)]
    prefill = [
        Served(fake_prefill(cluster, s, cp)) for s, cp in zip(p_states, PREFILL_CP, strict=True)
    ]
    decode = [
        Served(fake_decode(cluster, s, f"10.0.0.{i}:1700{i}")) for i, s in enumerate(d_states)
    ]
    cfg = router_config(prefill=tuple(s.url for s in prefill), decode=tuple(s.url for s in decode))
    router = Served(build_router_app(cfg))
    client = httpx.Client(base_url=router.url, timeout=10.0, trust_env=False)
    yield Deployment(cluster, prefill, p_states, decode, d_states, router, client)
    client.close()
    for s in (router, *prefill, *decode):
        s.stop()


@pytest.fixture
def deployment(pd: Deployment) -> Iterator[Deployment]:
    yield pd
    pd.cluster.reset()
    for st in pd.prefill_states + pd.decode_states:
        st.healthy, st.waiting, st.running = True, 0, 0
    # The next test starts from a router that has seen the reset state.
    wait_until(
        lambda: all(s["healthy"] and s["load"] == 0 for s in pd.servers().values()),
        what="servers healthy and idle",
    )


def fresh_prompt(endpoint: str) -> tuple[dict[str, Any], list[int]]:
    """A random request body for `endpoint` and the prompt ids the fakes will see."""
    rng = random.Random()
    text = "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(3, 40)))
    if endpoint == "/generate":
        if rng.random() < 0.5:
            ids = [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
            return {"input_ids": ids, "sampling_params": {"max_new_tokens": 5}}, ids
        return {"text": text, "sampling_params": {"max_new_tokens": 5}}, [ord(c) for c in text]
    if endpoint == "/v1/completions":
        return {"model": "fake", "prompt": text, "max_tokens": 5}, [ord(c) for c in text]
    messages = [{"role": "user", "content": text}]
    return {"model": "fake", "messages": messages, "max_tokens": 5}, [ord(c) for c in text]


def sse_events(lines: Iterator[str]) -> list[Any]:
    """`data:` payloads in order, `[DONE]` kept as the string."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def output_tokens(endpoint: str, answer: dict[str, Any] | list[Any]) -> list[int]:
    """Token ids recovered from a non-streaming answer or a list of SSE events."""
    if isinstance(answer, dict):
        if endpoint == "/generate":
            return answer["output_ids"]
        choice = answer["choices"][0]
        text = choice["text"] if endpoint == "/v1/completions" else choice["message"]["content"]
    elif endpoint == "/generate":
        return answer[-2]["output_ids"]  # cumulative; the last event before [DONE]
    else:
        parts = []
        for ev in answer[:-1]:
            c = ev["choices"][0]
            parts.append(c["text"] if endpoint == "/v1/completions" else c["delta"]["content"])
        text = "".join(parts)
    return [int(t) for t in text.replace("<", " ").replace(">", " ").split()]


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
    assert output_tokens(endpoint, answer) == expected_tokens(prompt, 5)

    room = deployment.cluster.room(r.headers["x-cpkv-room"])
    assert room.error is None and room.done.is_set()
    by_url = {
        s.url: (st.name, cp)
        for s, st, cp in zip(deployment.prefill, deployment.prefill_states, PREFILL_CP, strict=True)
    }
    assert (room.prefill, room.cp_size) == by_url[r.headers["x-cpkv-prefill"]]
    decode_names = {
        s.url: st.name for s, st in zip(deployment.decode, deployment.decode_states, strict=True)
    }
    assert room.decode == decode_names[r.headers["x-cpkv-decode"]]
    if endpoint == "/generate" and not stream:
        assert answer["meta_info"]["id"] == r.headers["x-cpkv-room"]  # the room is the rid
    wait_until(
        lambda: all(s["in_flight"] == 0 for s in deployment.servers().values()),
        what="in-flight counts back to 0",
    )


# ---- load balancing ----------------------------------------------------------------------


def decode_of(r: httpx.Response, d: Deployment) -> str:
    return {s.url: st.name for s, st in zip(d.decode, d.decode_states, strict=True)}[
        r.headers["x-cpkv-decode"]
    ]


def test_least_loaded_decode_then_round_robin_then_in_flight(deployment: Deployment) -> None:
    """Reported load steers requests to the idle decode server; equal loads alternate;
    a request the router has in flight counts as load before any poll sees it."""
    d = deployment
    u0, u1 = d.decode[0].url, d.decode[1].url
    d.decode_states[0].waiting, d.decode_states[0].running = 3, 2
    wait_until(lambda: d.servers()[u0]["load"] == 5, what="the load of d0 polled")
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    assert [decode_of(d.client.post("/generate", json=body), d) for _ in range(3)] == ["d1"] * 3

    d.decode_states[0].waiting = d.decode_states[0].running = 0
    wait_until(lambda: d.servers()[u0]["load"] == 0, what="d0 idle again")
    names = [decode_of(d.client.post("/generate", json=body), d) for _ in range(4)]
    assert sorted(names) == ["d0", "d0", "d1", "d1"]
    assert all(a != b for a, b in itertools.pairwise(names)), names  # round-robin on ties

    d.cluster.token_delay = 0.3  # one slow stream holds its decode server
    slow = {**body, "stream": True, "sampling_params": {"max_new_tokens": 4}}
    with d.client.stream("POST", "/generate", json=slow) as r:
        busy = decode_of(r, d)
        busy_url = u0 if busy == "d0" else u1
        assert d.servers()[busy_url]["in_flight"] == 1
        d.cluster.token_delay = 0.0
        other = decode_of(d.client.post("/generate", json=body), d)
        assert other != busy
        assert sse_events(r.iter_lines())[-1] == "[DONE]"


# ---- failures ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "stream", "started"),
    [
        ("/generate", False, False),
        ("/generate", True, False),  # decode holds its first event until the KV is there
        ("/v1/chat/completions", True, True),  # the role chunk went out first
    ],
)
def test_prefill_500_fails_the_request_cleanly(
    deployment: Deployment, endpoint: str, stream: bool, started: bool
) -> None:
    """A prefill 500 mid-request: 503 naming the prefill server when nothing was sent,
    else an SSE error event and [DONE]; well before any timeout; the decode upstream is
    closed (the fake decode sees its client go away)."""
    d = deployment
    d.cluster.prefill_fail, d.cluster.prefill_delay = True, 0.3
    body, _ = fresh_prompt(endpoint)
    body["stream"] = stream
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
    room = d.cluster.room(_last_room(d))
    wait_until(room.closed.is_set, what="the decode upstream closed")
    metrics = d.client.get("/metrics").text
    assert 'cpkv_router_upstream_failures_total{reason="status_5xx",role="prefill"' in metrics


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_full_queue_is_503_with_retry_after_for_the_client(
    deployment: Deployment, side: str
) -> None:
    """Backpressure passes through the router: a decode or prefill server whose wait
    queue is full answers 503 + Retry-After, and so does the router, at once."""
    d = deployment
    d.cluster.queue_full = side
    body, _ = fresh_prompt("/generate")
    t0 = time.monotonic()
    r = d.client.post("/generate", json=body)
    assert time.monotonic() - t0 < FAILURE_BOUND_S
    assert r.status_code == 503 and r.headers.get("retry-after") == "4", (r.status_code, r.text)
    assert "wait queue is full" in r.json()["error"]["message"]


def _last_room(d: Deployment) -> str:
    with d.cluster.lock:
        return next(reversed(d.cluster.rooms))


def test_client_disconnect_closes_the_upstream_stream(deployment: Deployment) -> None:
    """A client leaving mid-stream: the router closes the decode stream (the fake decode
    observes it), releases its in-flight count and counts a client_disconnect."""
    d = deployment
    d.cluster.token_delay = 0.05
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 200}, "stream": True}
    with d.client.stream("POST", "/generate", json=body) as r:
        room = d.cluster.room(r.headers["x-cpkv-room"])
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 2:
                break
    wait_until(room.closed.is_set, what="the decode server to see the disconnect")
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
    router notices before any response started, closes the decode request (the fake
    decode sees it) and cancels the prefill call (its in-flight count is released)."""
    d = deployment
    d.cluster.prefill_delay = 6.0  # far longer than every wait below
    body = {"input_ids": [4, 2], "sampling_params": {"max_new_tokens": 2}}
    with pytest.raises(httpx.ReadTimeout):
        d.client.post("/generate", json=body, timeout=0.4)
    room = d.cluster.room(_last_room(d))
    wait_until(room.closed.is_set, timeout=2.0, what="the decode server to see the disconnect")
    assert not room.done.is_set()  # gone before the prefill finished
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
    d.decode_states[0].healthy = False
    u0 = d.decode[0].url
    wait_until(lambda: not d.servers()[u0]["healthy"], what="d0 out of rotation")
    info = d.servers()[u0]
    assert info["mode"] == "decode" and "/health answered 503" in info["last_error"]
    health = d.client.get("/health")
    assert health.status_code == 200 and health.json()["healthy"]["decode"] == 1
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 1}}
    assert {decode_of(d.client.post("/generate", json=body), d) for _ in range(4)} == {"d1"}
    gauge = _gauge(d, "cpkv_router_healthy_servers", "decode")
    assert gauge == 1.0
    d.decode_states[0].healthy = True
    wait_until(lambda: d.servers()[u0]["healthy"], what="d0 back")
    assert _gauge(d, "cpkv_router_healthy_servers", "decode") == 2.0


def _gauge(d: Deployment, name: str, role: str) -> float:
    for fam in text_string_to_metric_families(d.client.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and s.labels.get("role") == role:
                return s.value
    raise AssertionError(f"{name}{{role={role}}} not exported")


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
    assert all(s["healthy"] for s in servers.values())
    assert d.client.get("/health").json()["pairs"] == 2
    models = d.client.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake"
    n_rooms = len(d.cluster.rooms)
    bad = d.client.post("/generate", content=b"{not json")
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    pd_field = d.client.post("/generate", json={"text": "x", "bootstrap_room": "r"})
    assert pd_field.status_code == 400
    assert "bootstrap_room" in pd_field.json()["error"]["message"]
    assert len(d.cluster.rooms) == n_rooms


def test_decode_rejection_is_forwarded_without_a_prefill_call(deployment: Deployment) -> None:
    """A 400 from the decode server reaches the client unchanged and no prefill call is
    made for it (there is no room to send KV to)."""
    d = deployment
    before = len(d.cluster.prefill_bodies)
    # The fake decode refuses a client-provided `rid` on OpenAI endpoints (strict models).
    r = d.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "rid": "mine"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "unknown field rid"
    time.sleep(0.3)  # longer than --decode-register-wait: a prefill call would have started
    assert len(d.cluster.prefill_bodies) == before


# ---- a dead prefill server ------------------------------------------------------------------


def test_dead_prefill_is_503_leaves_rotation_and_comes_back() -> None:
    """Prefill port closed: the request fails fast with 503 naming the server, the server
    leaves rotation (/servers, /health), later requests are refused at once; restarted on
    the same port it is back and requests succeed."""
    cluster = Cluster()
    p_state, d_state = FakeState("p"), FakeState("d")
    prefill = Served(fake_prefill(cluster, p_state, 2))
    decode = Served(fake_decode(cluster, d_state, "10.0.1.1:17000"))
    router = Served(build_router_app(router_config(prefill=(prefill.url,), decode=(decode.url,))))
    client = httpx.Client(base_url=router.url, timeout=10.0, trust_env=False)
    body = {"input_ids": [9, 9], "sampling_params": {"max_new_tokens": 3}}
    try:
        assert client.post("/generate", json=body).status_code == 200
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
        for room in cluster.rooms.values():  # every room the router opened got closed or done
            wait_until(lambda r=room: r.closed.is_set() or r.done.is_set(), what="room closed")

        prefill = Served(fake_prefill(cluster, p_state, 2), port=prefill.port)
        wait_until(lambda: client.get("/health").status_code == 200, what="prefill back")
        r = client.post("/generate", json=body)
        assert r.status_code == 200 and r.json()["output_ids"] == expected_tokens([9, 9], 3)
    finally:
        client.close()
        for s in (router, prefill, decode):
            if s.thread.is_alive():
                s.stop()


# ---- unified workers ---------------------------------------------------------------------


def test_worker_only_router_forwards_as_is() -> None:
    """With only --worker servers, requests go through unchanged (no PD fields): the real
    server app over a mock engine answers the client's prompt, and the request that
    reached the engine carries no PD field and no router-made rid."""
    worker = MockWorker()
    router = Served(build_router_app(router_config(worker=(worker.url,))))
    try:
        with httpx.Client(base_url=router.url, timeout=10.0, trust_env=False) as client:
            # Ids the mock echoes as they are: no EOS, no refused or failing token.
            ids = [random.randrange(MOCK_FAIL_ID + 1, MOCK_VOCAB) for _ in range(7)]
            r = client.post(
                "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}
            )
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == echo_ids(ids, 4)
            assert r.headers["x-cpkv-worker"] == worker.url
            assert client.get("/health").json()["healthy"]["worker"] == 1
        (req,) = worker.engine.requests.values()
        assert list(req.input_ids) == ids and req.sampling.max_new_tokens == 4
        pd_fields = (req.bootstrap_room, req.bootstrap_cp_size, req.decode_transfer_target)
        assert pd_fields == (None, None, None)
        assert r.json()["meta_info"]["id"] == req.rid  # the server's own rid, not a room
        assert "x-cpkv-room" not in r.headers
    finally:
        router.stop()
        worker.stop()


# ---- pure parts and the command line ------------------------------------------------------


def test_pick_is_least_loaded_with_round_robin_ties() -> None:
    cfg = router_config(prefill=("http://p:1",), decode=("http://a:1", "http://b:1", "http://c:1"))
    pool = ServerPool(cfg.validate())
    for s in pool.all():
        info = ServerInfo(
            mode=s.role,
            waiting=0,
            running=0,
            cp_size=2 if s.role == "prefill" else None,
            transfer_target="h:1" if s.role == "decode" else None,
        )
        pool.record_success(s, info)
    a, b, c = pool.servers["decode"]
    a.waiting, b.running, c.in_flight = 1, 1, 0
    assert [pool.pick("decode").url for _ in range(3)] == ["http://c:1"] * 3
    c.in_flight = 1  # now all tie at load 1: round-robin over a, b, c
    picks = [pool.pick("decode").url for _ in range(6)]
    assert sorted(picks) == sorted(["http://a:1", "http://b:1", "http://c:1"] * 2)
    assert all(x != y for x, y in itertools.pairwise(picks))
    pool.record_failure(a, "down", immediate=True)
    pool.record_failure(b, "slow")  # one failure < --health-failures: still in rotation
    assert {s.url for s in pool.healthy("decode")} == {"http://b:1", "http://c:1"}
    pool.record_failure(pool.servers["prefill"][0], "down", immediate=True)
    with pytest.raises(
        NoHealthyServerError, match=r"no healthy prefill server: http://p:1 \(down\)"
    ):
        pool.route()


def test_parse_server_info_checks_the_role() -> None:
    info = parse_server_info(
        "prefill", {"mode": "prefill", "waiting": 1, "running": 2, "cp_size": 8}
    )
    assert (info.waiting, info.running, info.cp_size) == (1, 2, 8)
    with pytest.raises(ServerModeError, match="registered as --decode but .* mode 'prefill'"):
        parse_server_info("decode", {"mode": "prefill", "waiting": 0, "running": 0})
    with pytest.raises(ValueError, match="transfer_target"):
        parse_server_info("decode", {"mode": "decode", "waiting": 0, "running": 0})
    with pytest.raises(ValueError, match="'waiting' must be an int"):
        parse_server_info("worker", {"mode": "null", "waiting": "3", "running": 0})


def test_pd_bodies_and_client_body_checks() -> None:
    room = "ab" * 16
    chat = {"messages": [], "stream": True, "stream_options": {"include_usage": True}}
    b = pd_bodies("/v1/chat/completions", chat, room=room, cp_size=8, transfer_target="h:7")
    assert b.decode == {**chat, "bootstrap_room": room, "bootstrap_cp_size": 8}
    assert b.prefill == {
        "messages": [],
        "stream": False,
        "bootstrap_room": room,
        "decode_transfer_target": "h:7",
    }
    g = pd_bodies(
        "/generate", {"text": "x", "rid": "client"}, room=room, cp_size=2, transfer_target="h:7"
    )
    assert g.decode["rid"] == g.prefill["rid"] == room
    with pytest.raises(RouterInputError, match="JSON object"):
        check_client_body([1, 2])
    with pytest.raises(RouterInputError, match="decode_transfer_target"):
        check_client_body({"decode_transfer_target": "h:1"})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill", "http://a:1"], "--prefill needs --decode"),
        ([], "no servers"),
        (["--worker", "a:1"], "is not a server URL"),
        (["--worker", "http://a:1/v1"], "has a path"),
        (
            ["--worker", "http://a:1", "--decode", "http://a:1/", "--prefill", "http://b:1"],
            "given twice",
        ),
        (["--worker", "http://a:1", "--health-failures", "0"], "--health-failures must be >= 1"),
        (["--worker", "http://a:1", "--request-timeout", "x"], "invalid float value"),
    ],
)
def test_bad_command_lines(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(RouterConfigError, match=message):
        RouterConfig.from_cli(argv)
    assert main(argv) == EXIT_USAGE
    assert capsys.readouterr().err.startswith("error: ")


def test_main_fails_startup_without_a_healthy_pair() -> None:
    """Nothing listens: `main` gives up after --startup-timeout with exit 1."""
    dead = []
    for _ in range(2):  # free ports, closed again
        s = Served(FastAPI())
        s.stop()
        dead.append(s.url)
    argv = ["--prefill", dead[0], "--decode", dead[1], "--port", "0", "--startup-timeout", "0.5"]
    argv += ["--health-interval", "0.1", "--log-level", "warning"]
    t0 = time.monotonic()
    assert main(argv) == EXIT_STARTUP_FAILED
    assert time.monotonic() - t0 < 5.0
