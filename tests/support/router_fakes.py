"""Fakes and helpers for the `serving.router` tests (tests/serving/test_router_*.py).

The PD fakes implement the `cpkv-serve` contract the router relies on (`/health`,
`/server_info`, the three generate endpoints with the PD fields) around an in-test
`Cluster` that stands in for the KV transfer layer: a fake decode server registers the
request's room and waits (bounded) until a fake prefill server completes that room, then
produces tokens from a closed-form rule (`expected_tokens`). A prefill call that reaches
the wrong decode server (transfer target), the wrong room or another prompt fails the
room, so a wiring mistake in the router cannot pass. `MockWorker` is a unified
(`--worker`) server: the real server app around the real `EngineLoop` and
`serving.engine.mock.MockEngine`. Everything runs on real uvicorn servers on 127.0.0.1
(`Served`); the `pd_deployment` / `deployment` fixtures are in tests/serving/conftest.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from serving.engine.mock import MockEngine
from serving.http.app import build_app
from serving.http.metrics import ServerMetrics
from serving.router import RouterConfig

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


def decode_of(r: httpx.Response, d: Deployment) -> str:
    return {s.url: st.name for s, st in zip(d.decode, d.decode_states, strict=True)}[
        r.headers["x-cpkv-decode"]
    ]


def last_room(d: Deployment) -> str:
    with d.cluster.lock:
        return next(reversed(d.cluster.rooms))


def role_gauge(d: Deployment, name: str, role: str) -> float:
    for fam in text_string_to_metric_families(d.client.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and s.labels.get("role") == role:
                return s.value
    raise AssertionError(f"{name}{{role={role}}} not exported")
