"""Helpers for tests of the HTTP API (`serving.http.app`, tests/serving/test_http_*.py):
a real uvicorn server around `MockEngine` and the real `EngineLoop`, and client-side
readers of what it answers (SSE bodies, /metrics samples).

The engine is `serving.engine.mock.MockEngine`, a closed-form `StepEngine` (JetStream's
mock-engine idea): output token `i` is `prompt[i % len(prompt)]` (`echo_ids`) with log-prob
`mock_logprob(token, i)`, one token per step. The `srv` / `bare` fixtures (module scope)
are in tests/serving/conftest.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import jinja2
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from cpkv_jax.tokenizer import Tokenizer
from cpkv_jax.tools.make_tiny_checkpoint import CHAT_TEMPLATE, SPECIAL_TOKENS
from serving.api_keys import ApiKeys
from serving.engine.mock import MOCK_EOS_ID, MOCK_FAIL_ID, MOCK_PAGES, MOCK_REFUSE_ID, MockEngine
from serving.engine.wait_queue import QueueStats
from serving.http.app import build_app
from serving.http.keepalive import HTTP_KEEPALIVE_S
from serving.http.metrics import ServerMetrics

VOCAB = 320  # the tiny config's vocab_size (the byte tokenizer uses ids < 259)
CONTEXT = 256
EOS_ID, PAD_ID = MOCK_EOS_ID, MOCK_REFUSE_ID  # the mock refuses prompts with the pad token
FAIL_ID = MOCK_FAIL_ID  # byte 0xff: never in UTF-8 text; the mock fails requests starting with it
PAGES = MOCK_PAGES
# Known values for the `EngineStats` fields the mock does not compute (`/metrics` checks).
STATS_EXTRA = {
    "transfer_bytes": 123456,
    "transfer_seconds": 1.5,
    "transfer_failures": 2,
    "admission_rejections": {"buffer_bytes": 3, "max_requests": 1},
    "kv_pages_cached": (5, 0),
    "queue": QueueStats(length=0, limit=9, waits=4, wait_seconds=2.5, rejected=1),
}


class Served:
    """An ASGI app on uvicorn, 127.0.0.1, in a daemon thread (`port` 0: any free one)."""

    def __init__(self, app: Any, port: int = 0, lifespan: str = "on") -> None:
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan=lifespan,
            timeout_graceful_shutdown=1,
            # As `cpkv-serve` and `cpkv-router` (serving.http.keepalive): longer than the
            # router's pooled connections live, else a request can go out on a connection
            # the server is closing (uvicorn's 5 s: a ReadError, then a 503, under load).
            timeout_keep_alive=HTTP_KEEPALIVE_S,
            # No uvicorn handlers: they would keep the stderr of the test that made them.
            log_config=None,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.port: int = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "uvicorn did not stop"


def start_server(
    tmp: Path,
    *,
    tokenizer: Tokenizer | None,
    template: Any,
    name: str,
    api_keys: ApiKeys | None = None,
) -> SimpleNamespace:
    """A live server named `name` (its model is `tiny-<name>`, its keys `api_keys`);
    `s.http` is its client (sending no key)."""
    engine = MockEngine(tokenizer, stats_extra=STATS_EXTRA)
    loop = engine.loop(idle_wait_s=0.01, name=f"engine-{name}")
    metrics = ServerMetrics()
    app = build_app(
        loop,
        model_name=f"tiny-{name}",
        tokenizer=tokenizer,
        vocab_size=VOCAB,
        context_length=CONTEXT,
        chat_template=template,
        metrics=metrics,
        server_info=lambda: {"server_name": name, "waiting": -1},
        profile_dir=str(tmp / f"profile-{name}"),
        api_keys=api_keys,
    )
    server = Served(app, lifespan="off")
    client = httpx.Client(base_url=server.url, timeout=20)
    return SimpleNamespace(engine=engine, loop=loop, server=server, http=client, name=name)


def stop_server(s: SimpleNamespace) -> None:
    s.http.close()
    s.server.stop()
    asyncio.run(s.loop.shutdown(1.0))


def sse(resp: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of an SSE body, checking the framing and the final `[DONE]`."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in resp.text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames), frames
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]


def reference_chat_prompt(messages: list[dict[str, str]]) -> str:
    """The tiny template rendered by plain jinja2 (not the server's sandboxed loader)."""
    bos, eos, _ = SPECIAL_TOKENS
    return (
        jinja2.Environment()
        .from_string(CHAT_TEMPLATE)
        .render(messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
    )


def metric_samples(s: SimpleNamespace) -> dict[tuple[str, tuple], float]:
    r = s.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(r.text)
        for sample in family.samples
    }


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)
