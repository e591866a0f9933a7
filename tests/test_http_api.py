"""The HTTP API (`serving.http.app`) over a real uvicorn server and a real `httpx` client.

The engine is `serving.engine.mock.MockEngine`, a closed-form `StepEngine` (JetStream's
mock-engine idea): output token `i` is `prompt[i % len(prompt)]` (`echo_ids`) with log-prob
`mock_logprob(token, i)`, one token per step, behind the real `serving.engine.loop.EngineLoop`.
Every expected output is recomputed here from that rule (and, for chat, from a plain-jinja2
rendering of the tiny checkpoint's template), never read back from the server. Log-probs are
compared exactly (`==`): they are Python floats that only pass through JSON, which
round-trips doubles.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import jinja2
import numpy as np
import pytest
import uvicorn
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from cpkv_jax.errors import CheckpointError, InputError
from cpkv_jax.tokenizer import Tokenizer, load_tokenizer
from cpkv_jax.tools.make_tiny_checkpoint import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_byte_tokenizer,
    write_tokenizer_files,
)
from serving.engine.mock import (
    MOCK_EOS_ID,
    MOCK_FAIL_ID,
    MOCK_PAGES,
    MOCK_REFUSE_ID,
    MockEngine,
    echo_ids,
    mock_logprob,
)
from serving.engine.wait_queue import QueueStats
from serving.http.app import build_app
from serving.http.chat_template import ChatTemplate, load_chat_template
from serving.http.metrics import ServerMetrics
from serving.http.text import OutputText

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


class LiveServer:
    """uvicorn on 127.0.0.1, an OS-chosen port, in a daemon thread."""

    def __init__(self, app: Any) -> None:
        # log_config=None: no uvicorn handlers, which would keep this test's stderr.
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", log_config=None
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _start(tmp: Path, *, tokenizer: Tokenizer | None, template: Any, name: str) -> SimpleNamespace:
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
    )
    server = LiveServer(app)
    client = httpx.Client(base_url=server.url, timeout=20)
    return SimpleNamespace(engine=engine, loop=loop, server=server, http=client, name=name)


def _stop(s: SimpleNamespace) -> None:
    s.http.close()
    s.server.stop()
    asyncio.run(s.loop.shutdown(1.0))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tokenizer_files(tmp_path_factory.mktemp("tiny"), model_max_length=CONTEXT)


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    loaded = load_tokenizer(model_dir)
    assert loaded is not None
    return loaded


@pytest.fixture(scope="module")
def srv(model_dir, tok, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """The tiny tokenizer and chat template from the model dir, as a launcher loads them."""
    s = _start(
        tmp_path_factory.mktemp("srv"),
        tokenizer=tok,
        template=load_chat_template(model_dir),
        name="tok",
    )
    yield s
    _stop(s)


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """A server without tokenizer or chat template (token ids only)."""
    s = _start(tmp_path_factory.mktemp("bare"), tokenizer=None, template=None, name="bare")
    yield s
    _stop(s)


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


# ---- /generate -----------------------------------------------------------------------------


def test_generate_text_and_ids_non_stream(srv, tok):
    rng = np.random.default_rng()
    word = "".join(rng.choice(list("abcdefghijk"), size=int(rng.integers(3, 9))))
    n = int(rng.integers(5, 20))
    r = srv.http.post(
        "/generate",
        json={"text": word, "sampling_params": {"max_new_tokens": n}, "return_logprob": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    prompt = tok.encode(word)
    want = echo_ids(prompt, n)
    assert body["output_ids"] == want
    assert body["text"] == (word * n)[:n]
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == n
    assert meta["cached_tokens"] == len(prompt) // 2
    assert meta["finish_reason"] == {"type": "length"}
    assert 0 < meta["ttft"] <= meta["e2e_latency"]
    assert meta["output_token_logprobs"] == [
        [mock_logprob(t, i), t, None] for i, t in enumerate(want)
    ]

    ids = [int(x) for x in rng.integers(3, 259, size=5)]
    r = srv.http.post(
        "/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": 7}, "rid": "ids-rid-1"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_ids"] == echo_ids(ids, 7)
    assert body["meta_info"]["id"] == "ids-rid-1"
    assert "output_token_logprobs" not in body["meta_info"]


def test_generate_stream_is_cumulative_and_stop_string_trimmed(srv, tok):
    # Output "abcXYabcXY...": the stop string "cX" appears at output char 2.
    r = srv.http.post(
        "/generate",
        json={
            "text": "abcXY",
            "stream": True,
            "sampling_params": {"max_new_tokens": 30, "stop": ["Yz", "cX"]},
        },
    )
    assert r.status_code == 200, r.text
    events = sse(r)
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts)), texts
    last = events[-1]
    assert last["text"] == "ab"
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": "cX"}
    # The engine stopped at the token that completed "cX": 4 tokens "abcX".
    assert last["output_ids"] == tok.encode("abcX")
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])

    r = srv.http.post(
        "/generate",
        json={"text": "abcXY", "sampling_params": {"max_new_tokens": 30, "stop": "cX"}},
    )
    assert r.json()["text"] == "ab"


def test_stop_token_id_and_eos(bare):
    ids = [10, 11, 12, 13, 14]
    r = bare.http.post(
        "/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": 20, "stop_token_ids": [13]}},
    )
    body = r.json()
    assert body["output_ids"] == [10, 11, 12, 13]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": 13}
    assert "text" not in body  # no tokenizer
    with_eos = [20, EOS_ID, 21]
    r = bare.http.post(
        "/generate", json={"input_ids": with_eos, "sampling_params": {"max_new_tokens": 9}}
    )
    assert r.json()["output_ids"] == [20, EOS_ID]
    r = bare.http.post(
        "/generate",
        json={"input_ids": with_eos, "sampling_params": {"max_new_tokens": 9, "ignore_eos": True}},
    )
    assert r.json()["output_ids"] == echo_ids(with_eos, 9)


# ---- OpenAI endpoints ---------------------------------------------------------------------


def test_completions_non_stream_and_stream_multibyte(srv, tok):
    prompt = "é€😀 ok"  # 2-, 3- and 4-byte characters: split over byte tokens
    n = 23
    want_ids = echo_ids(tok.encode(prompt), n)
    want_text = tok.decode(want_ids)
    r = srv.http.post(
        "/v1/completions",
        json={
            "model": "tiny-tok",
            "prompt": prompt,
            "max_tokens": n,
            "logprobs": 0,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny-tok"
    choice = body["choices"][0]
    assert choice["text"] == want_text and choice["finish_reason"] == "length"
    assert choice["token_ids"] == want_ids
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == [mock_logprob(t, i) for i, t in enumerate(want_ids)]
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in want_ids]
    # text_offset: the characters complete before the token (byte tokens: id = byte + 3).
    raw = bytes(t - 3 for t in want_ids)
    assert lp["text_offset"] == [len(raw[:i].decode("utf-8", "ignore")) for i in range(n)]
    assert body["usage"] == {
        "prompt_tokens": len(tok.encode(prompt)),
        "completion_tokens": n,
        "total_tokens": len(tok.encode(prompt)) + n,
        "prompt_tokens_details": {"cached_tokens": len(tok.encode(prompt)) // 2},
    }

    r = srv.http.post(
        "/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": n,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse(r)
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == n
    chunks = events[:-1]
    deltas = [c["choices"][0]["text"] for c in chunks]
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == want_text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)


def test_completions_token_ids_without_tokenizer(bare):
    ids = [30, 31, 32]
    r = bare.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 5})
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == echo_ids(ids, 5) and choice["text"] == ""
    r = bare.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "stream": True})
    chunks = sse(r)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == echo_ids(ids, 5)


def test_chat_completions_non_stream_and_stream(srv, tok):
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
        },
    ]
    flat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    prompt_ids = tok.encode(reference_chat_prompt(flat))
    n = 12
    want_ids = echo_ids(prompt_ids, n)  # starts with <|bos|>: not in the text
    want_text = tok.decode(want_ids)
    r = srv.http.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-tok",
            "messages": messages,
            "max_completion_tokens": n,
            "logprobs": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": want_text}
    assert choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [mock_logprob(t, i) for i, t in enumerate(want_ids)]
    assert content[0]["token"] == SPECIAL_TOKENS[0] and content[1]["bytes"] == list(b"<")
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == n

    r = srv.http.post(
        "/v1/chat/completions",
        json={
            "messages": messages,
            "max_tokens": n,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[-1]["usage"]["total_tokens"] == len(prompt_ids) + n
    chunks = [e for e in events[1:] if e["choices"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == want_text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    # No max_tokens: as many as the context leaves after the prompt.
    r = srv.http.post("/v1/chat/completions", json={"messages": flat, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == CONTEXT - len(prompt_ids)


def test_chat_without_template_is_400(bare):
    r = bare.http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 400
    assert "no chat template" in r.json()["error"]["message"]


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


# ---- errors -------------------------------------------------------------------------------


def _bad_requests(rng: np.random.Generator) -> list[tuple[str, str, Any, int]]:
    """(method, path, body: dict | raw str | None, expected status) for one round."""
    big = int(rng.integers(VOCAB, 10**9))
    neg = -int(rng.integers(1, 10**6))
    n = int(rng.integers(1, 50))
    return [
        ("POST", "/generate", "{not json", 400),
        ("POST", "/generate", "", 400),
        ("POST", "/generate", "[1, 2]", 400),
        ("POST", "/generate", {"text": "hi", "input_ids": [5]}, 400),
        ("POST", "/generate", {}, 400),
        ("POST", "/generate", {"input_ids": []}, 400),
        ("POST", "/generate", {"text": ""}, 400),
        ("POST", "/generate", {"input_ids": [5, big]}, 400),
        ("POST", "/generate", {"input_ids": [neg]}, 400),
        ("POST", "/generate", {"input_ids": ["5"]}, 400),
        ("POST", "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": "5"}}, 400),
        ("POST", "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": neg}}, 400),
        (
            "POST",
            "/generate",
            {"input_ids": [5], "sampling_params": {"max_new_tokens": 10**30}},
            400,
        ),
        (
            "POST",
            "/generate",
            {"input_ids": [5], "sampling_params": {"max_new_tokens": CONTEXT}},
            400,
        ),
        ("POST", "/generate", {"input_ids": [5] * (CONTEXT + n)}, 400),
        ("POST", "/generate", {"input_ids": [5], "sampling_params": {"temperature": -1.0}}, 400),
        ("POST", "/generate", {"input_ids": [5], "sampling_params": {"top_p": 0}}, 400),
        ("POST", "/generate", {"input_ids": [5], "sampling_params": {"stop": [""]}}, 400),
        (
            "POST",
            "/generate",
            {"input_ids": [5], "sampling_params": {"stop_token_ids": [big]}},
            400,
        ),
        ("POST", "/generate", {"input_ids": [5], "sampling_params": {"bogus": 1}}, 400),
        ("POST", "/generate", {"input_ids": [5], "stream": "yes"}, 400),
        ("POST", "/generate", {"input_ids": [5], "extra_field": n}, 400),
        ("POST", "/generate", {"input_ids": [5], "decode_transfer_target": "nohost"}, 400),
        ("POST", "/generate", {"input_ids": [5, PAD_ID]}, 400),  # refused by the engine
        ("POST", "/v1/completions", {"prompt": ""}, 400),
        ("POST", "/v1/completions", {"prompt": []}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "max_tokens": neg}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "max_tokens": 10**12}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "n": 2}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "echo": True}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "logprobs": 3}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "best_of": 2}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "presence_penalty": 0.5}, 400),
        (
            "POST",
            "/v1/completions",
            {"prompt": [5], "stream_options": {"include_usage": True}},
            400,
        ),
        ("POST", "/v1/completions", {"prompt": ["a", "b"]}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "model": "gpt-4"}, 404),
        ("POST", "/v1/completions", {"prompt": [5], "seed": neg}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "top_k": big}, 400),
        ("POST", "/v1/chat/completions", {"messages": []}, 400),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user"}], "top_logprobs": 2}, 400),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            400,
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * CONTEXT}]},
            400,
        ),
        ("GET", "/generate", None, 405),
        ("GET", "/no/such/path", None, 404),
    ]


def test_200_bad_requests_each_get_a_4xx_with_a_message_then_a_good_one_works(srv, bare):
    rng = np.random.default_rng()
    cases = []
    while len(cases) < 200:
        cases.extend(_bad_requests(rng))
    cases = cases[:200]
    # Text where the server has no tokenizer, and stop strings without one.
    cases[-2] = ("POST", "/generate", {"text": "hello"}, 400)
    cases[-1] = ("POST", "/v1/completions", {"prompt": [5], "stop": "x"}, 400)
    added_before = (len(srv.engine.added), len(bare.engine.added))
    bad_before = metric_samples(srv)[("cpkv_http_bad_requests_total", ())]
    for i, (method, path, body, status) in enumerate(cases):
        target = bare if i >= len(cases) - 2 else srv
        kwargs: dict[str, Any] = {}
        if isinstance(body, str):
            kwargs = {"content": body, "headers": {"content-type": "application/json"}}
        elif body is not None:
            kwargs = {"json": body}
        r = target.http.request(method, path, **kwargs)
        assert r.status_code == status, (i, body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == status and len(err["message"]) > 10, err
        assert err["type"], err
    n_srv = len(cases) - 2
    assert metric_samples(srv)[("cpkv_http_bad_requests_total", ())] - bad_before == n_srv
    # Only the pad-token requests reached the engine (it refused them in `add`).
    assert (len(srv.engine.added), len(bare.engine.added)) == added_before
    r = srv.http.post("/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and r.json()["text"] == "oko"


def test_error_messages_name_the_field_and_numbers(srv, bare):
    r = srv.http.post(
        "/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": "5"}}
    )
    assert "sampling_params.max_new_tokens" in r.json()["error"]["message"]
    r = srv.http.post(
        "/generate", json={"input_ids": [5] * 250, "sampling_params": {"max_new_tokens": 10}}
    )
    msg = r.json()["error"]["message"]
    assert "250" in msg and "10" in msg and str(CONTEXT) in msg
    r = srv.http.post("/generate", json={"input_ids": [5], "junk": 1})
    assert "unknown field 'junk'" in r.json()["error"]["message"]
    r = bare.http.post("/generate", json={"text": "hi"})
    assert "token ids" in r.json()["error"]["message"]
    r = srv.http.post("/generate", json={"input_ids": [5, PAD_ID]})
    assert "pad token" in r.json()["error"]["message"]
    # OpenAI refuses a message without content (only an assistant turn with tool calls may
    # omit it); the template would otherwise render an empty turn.
    for role in ("user", "assistant"):
        r = srv.http.post("/v1/chat/completions", json={"messages": [{"role": role}]})
        assert r.status_code == 400, r.text
        assert "messages.0" in r.json()["error"]["message"]
        assert "content" in r.json()["error"]["message"]


def test_engine_error_is_500_or_an_error_event(srv):
    r = srv.http.post("/generate", json={"input_ids": [FAIL_ID, 5]})
    assert r.status_code == 500 and "KV transfer" in r.json()["error"]["message"]
    r = srv.http.post("/v1/completions", json={"prompt": [FAIL_ID, 5], "stream": True})
    assert r.status_code == 200
    events = sse(r)  # checks the trailing [DONE]
    assert events[-1]["error"]["code"] == 500 and "KV transfer" in events[-1]["error"]["message"]


def test_shutting_down_server_answers_503(tmp_path):
    s = _start(tmp_path, tokenizer=None, template=None, name="down")
    try:
        asyncio.run(s.loop.shutdown(0.0))
        r = s.http.post("/generate", json={"input_ids": [5]})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert s.http.get("/health").status_code == 503
    finally:
        s.http.close()
        s.server.stop()


def test_full_wait_queue_is_503_with_retry_after(tmp_path):
    """Backpressure: a server whose wait queue is full answers 503 with `Retry-After`
    (non-streamed and streamed alike, before any event), and serves again after."""
    s = _start(tmp_path, tokenizer=None, template=None, name="full")
    try:
        s.engine.queue_full = True
        for stream in (False, True):
            r = s.http.post("/generate", json={"input_ids": [5, 6], "stream": stream})
            assert r.status_code == 503 and r.headers["retry-after"] == "7", r.text
            assert "wait queue is full" in r.json()["error"]["message"]
        r = s.http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "7"
        assert s.http.get("/health").status_code == 200  # busy, not broken
        s.engine.queue_full = False
        assert s.http.post("/generate", json={"input_ids": [5, 6]}).status_code == 200
    finally:
        _stop(s)


# ---- client disconnect ----------------------------------------------------------------------


def test_client_disconnect_aborts_the_engine_request(srv):
    srv.engine.step_delay = 0.01
    try:
        with (
            httpx.Client(base_url=srv.server.url, timeout=20) as c,
            c.stream(
                "POST",
                "/generate",
                json={
                    "input_ids": [60, 61],
                    "stream": True,
                    "rid": "gone-stream",
                    "sampling_params": {"max_new_tokens": 200},
                },
            ) as r,
        ):
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break  # leaving the blocks closes the connection mid-stream
        wait_for(lambda: "gone-stream" in srv.engine.finished)
        assert "gone-stream" in srv.engine.aborted
        assert srv.engine.finished["gone-stream"] < 200

        with pytest.raises(httpx.ReadTimeout):
            srv.http.post(
                "/generate",
                json={
                    "input_ids": [62],
                    "rid": "gone-plain",
                    "sampling_params": {"max_new_tokens": 200},
                },
                timeout=0.3,
            )
        wait_for(lambda: "gone-plain" in srv.engine.finished)
        assert "gone-plain" in srv.engine.aborted
        assert srv.engine.finished["gone-plain"] < 200
    finally:
        srv.engine.step_delay = 0.0005


# ---- units: text, templates ------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return Tokenizer(build_byte_tokenizer())


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(min_size=1, max_size=40),
    cuts=st.lists(st.integers(0, 200), max_size=6),
    stop_spans=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 4)), max_size=2),
)
def test_output_text_streams_whole_characters_and_trims_stops(byte_tok, text, cuts, stop_spans):
    # Special-token strings encode to special ids, which the output text drops (hypothesis
    # draws string literals from the source, "<|pad|>" among them): not this property.
    assume(not any(special in text for special in SPECIAL_TOKENS))
    ids = byte_tok.encode(text)
    stops = [text[a : a + n] for a, n in stop_spans if text[a : a + n]]
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    out = OutputText(byte_tok, stops)
    deltas = [out.add(ids[a:b]) for a, b in itertools.pairwise(bounds)]
    deltas.append(out.finish())
    first = min((text.find(s) for s in stops), default=-1)
    want = text[:first] if first >= 0 else text
    assert "".join(deltas) == want == out.text
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas)


def test_chat_template_loading_rules(tmp_path):
    assert load_chat_template(tmp_path) is None
    cfg = {
        "bos_token": {"content": "<s>"},
        "eos_token": "</s>",
        "chat_template": "A{{ bos_token }}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_chat_template(tmp_path).render([]) == "A<s>"
    (tmp_path / "chat_template.jinja").write_text("F{{ eos_token }}{{ messages[0].content }}")
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "x"}]) == "F</s>x"
    (tmp_path / "chat_template.jinja").unlink()
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_chat_template(tmp_path).render([]) == "D"
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="default"):
        load_chat_template(tmp_path)
    with pytest.raises(CheckpointError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_chat_template_refusals_are_input_errors():
    refuse = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    with pytest.raises(InputError, match="user first"):
        refuse.render([{"role": "assistant", "content": "x"}])
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InputError):
        escape.render([])
    assert (
        ChatTemplate(CHAT_TEMPLATE, bos_token="B", eos_token="E").render(
            [{"role": "user", "content": "q"}]
        )
        == "B<|user|>\nqE\n<|assistant|>\n"
    )


def test_tiny_checkpoint_tokenizer_config_has_the_chat_template(model_dir):
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE
    loaded = load_chat_template(model_dir)
    assert loaded is not None and loaded.bos_token == SPECIAL_TOKENS[0]
    msgs = [{"role": "user", "content": "hey"}]
    assert loaded.render(msgs) == reference_chat_prompt(msgs)
