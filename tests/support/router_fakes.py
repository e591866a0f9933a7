"""Servers and helpers for the `serving.router` tests (tests/serving/test_router_*.py).

Every server is the real `cpkv-serve` HTTP app (`serving.http.app.build_app`) and the real
`EngineLoop` around a `serving.engine.mock.MockEngine`, on a real uvicorn server on
127.0.0.1 (`Served`):

- `MockWorker`: a unified (`--worker`, mode null) server, token ids only;
- `MockPD`: a PD prefill or decode server with the tiny byte tokenizer and chat template.
  The prefill and decode mocks of one deployment share a `MockRooms` (the in-process KV
  transfer): a decode request produces nothing until a prefill request for its room and
  its decode server's `transfer_target` has answered, so a router that does not wire the
  prefill call right (room, transfer target, CP size) cannot pass. The output is the
  mock's closed-form echo (`expected_ids`).

The `pd_deployment` / `deployment` fixtures are in tests/serving/conftest.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cpkv_jax.tokenizer import Tokenizer
from serving.api_keys import ApiKeys
from serving.engine.api import GenerateRequest, StepEngine
from serving.engine.loop import EngineLoop
from serving.engine.mock import MOCK_EOS_ID, MockEngine, MockRooms, echo_ids
from serving.http.app import build_app
from serving.http.metrics import ServerMetrics
from serving.router import RouterConfig
from support.http_client import Served

# The mock worker's vocabulary: prompt ids above `MOCK_FAIL_ID` are echoed as they are.
MOCK_VOCAB = 320
MOCK_CONTEXT = 256
# How long a decode mock waits for its room's KV: longer than every wall-time bound
# asserted below, so a test only passes when the router itself ends the request.
KV_WAIT_S = 10.0
# Router timings for tests: fast health polls so state changes show within ~0.5 s.
HEALTH_INTERVAL_S = 0.2
HEALTH_FAILURES = 2
# A clean failure must reach the client well before any upstream timeout (5 s here).
FAILURE_BOUND_S = 2.5
MOCK_STEP_S = 0.0005  # `MockEngine`'s default step time


def expected_ids(prompt: Sequence[int], n: int) -> list[int]:
    """The mock's output for `prompt` with `max_new_tokens=n`: the echo, up to and
    including an EOS (the prompts here hold no stop ids and ignore_eos is off)."""
    out: list[int] = []
    for t in echo_ids(prompt, n):
        out.append(t)
        if t == MOCK_EOS_ID:
            break
    return out


ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions")


class SwitchLoop(EngineLoop):
    """The real `EngineLoop` with a test switch for its health: `unhealthy = "why"` makes
    the real app's `/health` answer 503 (as after a fatal step), None restores it."""

    def __init__(self, engine: StepEngine, **kw: Any) -> None:
        super().__init__(engine, **kw)
        self.unhealthy: str | None = None

    def healthy(self) -> bool:
        return self.unhealthy is None and super().healthy()

    def fatal_reason(self) -> str | None:
        return self.unhealthy or super().fatal_reason()


class MockPD:
    """A PD prefill (`cp_size`) or decode (`transfer_target`) server named `name`: the
    real app over a `MockEngine` in that mode sharing `rooms`, with the tiny tokenizer and
    chat template; `/server_info` reports `cp_size` / `transfer_target` as `cpkv-serve`
    does. `set_load` sets the waiting / running counts its stats report."""

    def __init__(
        self,
        name: str,
        rooms: MockRooms,
        *,
        tokenizer: Tokenizer,
        chat_template: Any,
        cp_size: int | None = None,
        transfer_target: str | None = None,
        port: int = 0,
        api_keys: ApiKeys | None = None,
    ) -> None:
        self.name = name
        self.mode = "prefill" if cp_size is not None else "decode"
        self.cp_size, self.transfer_target = cp_size, transfer_target
        self.engine = MockEngine(
            tokenizer,
            mode=self.mode,
            rooms=rooms,
            transfer_target=transfer_target,
            cp_size=cp_size or 1,
        )
        self.loop = SwitchLoop(self.engine, idle_wait_s=0.01, name=f"router-test-{name}")
        info = {"cp_size": cp_size} if cp_size is not None else {"transfer_target": transfer_target}
        self.metrics = ServerMetrics()
        app = build_app(
            self.loop,
            model_name="mock",
            tokenizer=tokenizer,
            vocab_size=MOCK_VOCAB,
            context_length=MOCK_CONTEXT,
            chat_template=chat_template,
            metrics=self.metrics,
            server_info=lambda: dict(info),
            api_keys=api_keys,
        )
        self.served = Served(app, port=port)
        self.url, self.port = self.served.url, self.served.port

    def set_load(self, waiting: int, running: int) -> None:
        self.engine.stats_extra.update(waiting=waiting, running=running)

    def reset(self) -> None:
        self.engine.stats_extra.clear()
        self.engine.queue_full = False
        self.engine.step_delay = MOCK_STEP_S
        self.loop.unhealthy = None

    def request(self, room: str) -> GenerateRequest | None:
        """The accepted request of `room` here, if one reached this server."""
        found = [r for r in list(self.engine.requests.values()) if r.bootstrap_room == room]
        assert len(found) <= 1, found
        return found[0] if found else None

    def bad_requests(self) -> float:
        """The 4xx answers this server's app gave (its `cpkv_http_bad_requests` counter)."""
        value = self.metrics.registry.get_sample_value("cpkv_http_bad_requests_total")
        assert value is not None
        return value

    def stop(self) -> None:
        self.served.stop()
        asyncio.run(self.loop.shutdown(1.0))


class MockWorker:
    """A unified (mode null) `cpkv-serve` app on uvicorn: the real HTTP app and
    `EngineLoop` around a `MockEngine` (token ids only, output `echo_ids`)."""

    def __init__(self, api_keys: ApiKeys | None = None) -> None:
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
            api_keys=api_keys,
        )
        self.served = Served(app)
        self.url = self.served.url

    def stop(self) -> None:
        self.served.stop()
        asyncio.run(self.loop.shutdown(1.0))


# ---- running servers -------------------------------------------------------------------------


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
    rooms: MockRooms
    prefill: list[MockPD]
    decode: list[MockPD]
    router: Served
    client: httpx.Client
    tok: Tokenizer

    def servers(self) -> dict[str, dict[str, Any]]:
        return {s["url"]: s for s in self.client.get("/servers").json()["servers"]}

    def by_url(self, url: str) -> MockPD:
        (server,) = [s for s in (*self.prefill, *self.decode) if s.url == url]
        return server

    def reset(self) -> None:
        self.rooms.reset()
        for s in (*self.prefill, *self.decode):
            s.reset()


PREFILL_CP = (8, 4)


def fresh_prompt(endpoint: str) -> tuple[dict[str, Any], list[int] | None]:
    """A random request body for `endpoint` and the prompt ids the servers will see (the
    byte tokenizer: byte + 3), None for chat (the template renders the prompt)."""
    rng = random.Random()
    text = "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(3, 40)))
    ids = [b + 3 for b in text.encode()]
    if endpoint == "/generate":
        if rng.random() < 0.5:
            # Ids the mock echoes as they are: no EOS, pad (refused) or failing token.
            ids = [rng.randrange(4, 258) for _ in range(rng.randint(1, 30))]
            return {"input_ids": ids, "sampling_params": {"max_new_tokens": 5}}, ids
        return {"text": text, "sampling_params": {"max_new_tokens": 5}}, ids
    if endpoint == "/v1/completions":
        return {"model": "mock", "prompt": text, "max_tokens": 5}, ids
    messages = [{"role": "user", "content": text}]
    return {"model": "mock", "messages": messages, "max_tokens": 5}, None


def sse_events(lines: Iterator[str]) -> list[Any]:
    """`data:` payloads in order, `[DONE]` kept as the string."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def output_of(endpoint: str, answer: dict[str, Any] | list[Any]) -> list[int] | str:
    """The token ids (/generate) or the text (OpenAI endpoints) of a non-streaming answer
    or of a list of SSE events."""
    if isinstance(answer, dict):
        if endpoint == "/generate":
            return answer["output_ids"]
        choice = answer["choices"][0]
        return choice["text"] if endpoint == "/v1/completions" else choice["message"]["content"]
    if endpoint == "/generate":
        return answer[-2]["output_ids"]  # cumulative; the last event before [DONE]
    parts = []
    for ev in answer[:-1]:
        c = ev["choices"][0]
        parts.append(c["text"] if endpoint == "/v1/completions" else c["delta"].get("content", ""))
    return "".join(parts)


def decode_of(r: httpx.Response, d: Deployment) -> str:
    return d.by_url(r.headers["x-cpkv-decode"]).name


def room_requests(d: Deployment, room: str) -> dict[str, GenerateRequest]:
    """Server name -> the request of `room` that reached it."""
    found = {s.name: s.request(room) for s in (*d.prefill, *d.decode)}
    return {name: req for name, req in found.items() if req is not None}


def decode_rooms(d: Deployment) -> set[str]:
    """The rooms of every request the decode servers accepted so far."""
    return {
        r.bootstrap_room
        for s in d.decode
        for r in list(s.engine.requests.values())
        if r.bootstrap_room is not None
    }


def new_room(d: Deployment, before: set[str]) -> str:
    """The one room a decode server accepted since `before` (`decode_rooms`)."""
    (room,) = decode_rooms(d) - before
    return room


def decode_closed(d: Deployment, room: str) -> bool:
    """Whether the decode request of `room` was aborted (its HTTP client went away) and
    the engine has ended it."""
    for s in d.decode:
        req = s.request(room)
        if req is not None:
            return req.rid in s.engine.aborted and req.rid in s.engine.finished
    raise AssertionError(f"no decode server got room {room}")


def role_gauge(d: Deployment, name: str, role: str) -> float:
    for fam in text_string_to_metric_families(d.client.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and s.labels.get("role") == role:
                return s.value
    raise AssertionError(f"{name}{{role={role}}} not exported")
