"""The HTTP API's refusals and limits over a real uvicorn server around `MockEngine`:
malformed or out-of-range requests are 4xx with a message naming the field (and never
reach the engine), an engine failure is a 500 or an SSE error event, a shutting-down
server and a full wait queue answer 503.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from support.http_client import (
    CONTEXT,
    FAIL_ID,
    PAD_ID,
    VOCAB,
    metric_samples,
    sse,
    start_server,
    stop_server,
)

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
        ("POST", "/v1/completions", {"prompt": [5], "n": 0}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "logprobs": 21}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "logprobs": -1}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "best_of": 2}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "presence_penalty": 2.5}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "repetition_penalty": 0}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "logit_bias": {"5": 101}}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "logit_bias": {"the": 1}}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "logit_bias": {str(big): 1}}, 400),
        (
            "POST",
            "/v1/completions",
            {"prompt": [5], "logit_bias": {str(t): 1 for t in range(301)}},
            400,
        ),
        (
            "POST",
            "/generate",
            {"input_ids": [5], "sampling_params": {"frequency_penalty": -3}},
            400,
        ),
        (
            "POST",
            "/v1/completions",
            {"prompt": [5], "stream_options": {"include_usage": True}},
            400,
        ),
        ("POST", "/v1/completions", {"prompt": ["a", 5]}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "model": "gpt-4"}, 404),
        ("POST", "/v1/completions", {"prompt": [5], "seed": neg}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "top_k": big}, 400),
        ("POST", "/v1/completions", {"prompt": [5], "min_p": 1.5}, 400),
        ("POST", "/generate", {"input_ids": [5], "sampling_params": {"min_p": -0.1}}, 400),
        ("POST", "/v1/chat/completions", {"messages": []}, 400),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},  # no logprobs
            400,
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            400,
        ),
        (
            "POST",
            "/generate",
            {"input_ids": [5], "return_logprob": True, "top_logprobs_num": 99},
            400,
        ),
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
    s = start_server(tmp_path, tokenizer=None, template=None, name="down")
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
    s = start_server(tmp_path, tokenizer=None, template=None, name="full")
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
        stop_server(s)
