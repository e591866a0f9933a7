"""Clients of the field against our servers (issue 24): the request bodies that SGLang's
`bench_serving` (backends `sglang`, `sglang-oai`, `sglang-oai-chat`), vLLM's benchmark
(`vllm`, `vllm-chat`) and the official `openai` python client send get a 200 from the
unified server app and through the PD router, streaming (with `stream_options:
{"include_usage": true}`) and not; a field we do not implement is accepted at its neutral
value, refused with a 400 naming it at any other; an unknown field stays a 400. The model
is named as SGLang and vLLM name it by default: by its path.

The bodies are written from the clients' request code and the documented schemas
(OpenAI's API reference, vLLM's `CompletionRequest` / `ChatCompletionRequest`, SGLang's
`GenerateReqInput` / `SamplingParams`), not imported: none of these clients is a test
dependency. The servers are the real app over `MockEngine` (`srv`, `pd_deployment` in
tests/serving/conftest.py; `model_server` below for a path-named model).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from support.http_client import CONTEXT, VOCAB, Served, sse

from serving.engine.mock import MockEngine
from serving.http.app import build_app
from serving.http.chat_template import load_chat_template
from serving.http.metrics import ServerMetrics
from serving.http.models import (
    CHAT_NEUTRAL,
    COMPLETIONS_NEUTRAL,
    GENERATE_NEUTRAL,
    GENERATE_SAMPLING_NEUTRAL,
    ChatCompletionBody,
    CompletionBody,
    GenerateBody,
    GenerateSamplingParams,
    Neutral,
)
from serving.server_args import ServerArgs

N = 4  # output tokens per request
PROMPT = "Hello, what is the capital of France?"
MODEL_PATH = "/path/to/tiny-own"  # as `--model-path`, never read: the engine is a mock

# ---- request bodies, as each client sends them -----------------------------------------------


def sglang_generate(model: str, stream: bool) -> dict[str, Any]:
    """`bench_serving --backend sglang` (SGLang 0.5.x `async_request_sglang_generate`)."""
    del model  # /generate names no model
    return {
        "text": PROMPT,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": N, "ignore_eos": True},
        "stream": stream,
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }


def sglang_oai(model: str, stream: bool) -> dict[str, Any]:
    """`bench_serving --backend sglang-oai` and `--backend vllm` (same request function)."""
    return {
        "model": model,
        "prompt": PROMPT,
        "best_of": 1,
        "max_tokens": N,
        "stream": stream,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def sglang_oai_chat(model: str, stream: bool) -> dict[str, Any]:
    """`bench_serving --backend sglang-oai-chat` (and `vllm-chat`)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_completion_tokens": N,
        "stream": stream,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def vllm_completions(model: str, stream: bool) -> dict[str, Any]:
    """`vllm bench serve --backend vllm` (`async_request_openai_completions`; it always
    streams, non-streaming is the same body without the stream fields)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "repetition_penalty": 1.0,
        "max_tokens": N,
        "logprobs": None,
        "stream": stream,
        "ignore_eos": True,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def vllm_chat(model: str, stream: bool) -> dict[str, Any]:
    """`vllm bench serve --backend openai-chat`: content as a list of text parts."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "max_completion_tokens": N,
        "stream": stream,
        "ignore_eos": True,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def openai_completions(model: str, stream: bool) -> dict[str, Any]:
    """`client.completions.create(...)` with every documented parameter at its default
    (the client sends what its caller passed, `NOT_GIVEN` ones are left out)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "best_of": 1,
        "echo": False,
        "frequency_penalty": 0,
        "logit_bias": {},
        "logprobs": None,
        "max_tokens": N,
        "n": 1,
        "presence_penalty": 0,
        "seed": 7,
        "stop": None,
        "stream": stream,
        "suffix": None,
        "temperature": 0.0,
        "top_p": 1,
        "user": "user-1234",
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def openai_chat(model: str, stream: bool) -> dict[str, Any]:
    """`client.chat.completions.create(...)` with the documented parameters at their
    defaults, in a second turn whose assistant message is the first answer's
    `message.model_dump()` (as callers build a conversation)."""
    assistant = {
        "content": "Paris.",
        "refusal": None,
        "role": "assistant",
        "annotations": [],
        "audio": None,
        "function_call": None,
        "tool_calls": None,
    }
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": PROMPT, "name": "ann"},
            assistant,
            {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]},
        ],
        "frequency_penalty": 0,
        "logit_bias": {},
        "logprobs": False,
        "max_completion_tokens": N,
        "metadata": {"job": "compat"},
        "modalities": ["text"],
        "n": 1,
        "presence_penalty": 0,
        "response_format": {"type": "text"},
        "seed": 7,
        "service_tier": "auto",
        "stop": None,
        "store": False,
        "stream": stream,
        "temperature": 0.0,
        "tool_choice": "none",
        "top_logprobs": None,
        "top_p": 1,
        "user": "user-1234",
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


CLIENTS: dict[str, tuple[str, Callable[[str, bool], dict[str, Any]]]] = {
    "sglang": ("/generate", sglang_generate),
    "sglang-oai": ("/v1/completions", sglang_oai),
    "vllm-via-sglang-bench": ("/v1/completions", sglang_oai),
    "sglang-oai-chat": ("/v1/chat/completions", sglang_oai_chat),
    "vllm": ("/v1/completions", vllm_completions),
    "vllm-chat": ("/v1/chat/completions", vllm_chat),
    "openai-completions": ("/v1/completions", openai_completions),
    "openai-chat": ("/v1/chat/completions", openai_chat),
}


# ---- answers ---------------------------------------------------------------------------------


def check_answer(endpoint: str, body: dict[str, Any], events_or_json: Any) -> None:
    """A 200 answer carries `N` output tokens; a stream with `include_usage` ends with a
    choice-less usage chunk."""
    if not body.get("stream"):
        out = events_or_json
        if endpoint == "/generate":
            assert out["meta_info"]["completion_tokens"] == N, out
        else:
            assert out["usage"]["completion_tokens"] == N, out
            assert out["choices"][0]["finish_reason"] == "length", out
        return
    events = events_or_json
    assert events
    assert all("error" not in e for e in events), events
    if endpoint == "/generate":
        assert events[-1]["meta_info"]["completion_tokens"] == N, events[-1]
        return
    finished = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert [e["choices"][0]["finish_reason"] for e in finished] == ["length"], events
    if (body.get("stream_options") or {}).get("include_usage"):
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == N
    else:
        assert all("usage" not in e for e in events), events


def post(http: httpx.Client, endpoint: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, JSON body, or a stream's events checked for SSE framing and `[DONE]`)."""
    r = http.post(endpoint, json=body)
    if r.status_code != 200 or not body.get("stream"):
        return r.status_code, r.json()
    return 200, sse(r)


def error_message(status_and_body: tuple[int, Any]) -> str:
    status, out = status_and_body
    assert status == 400, out
    return out["error"]["message"]


# ---- the clients' bodies get a 200 -----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("client", CLIENTS)
def test_client_bodies_on_the_unified_server(srv, client: str, stream: bool) -> None:
    endpoint, make = CLIENTS[client]
    body = make("tiny-tok", stream)
    status, out = post(srv.http, endpoint, body)
    assert status == 200, out
    check_answer(endpoint, body, out)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("client", CLIENTS)
def test_client_bodies_through_the_router(deployment, client: str, stream: bool) -> None:
    """The router forwards the bodies unchanged (it adds only its PD fields) to a prefill
    and a decode server, which both accept them."""
    endpoint, make = CLIENTS[client]
    body = make("mock", stream)
    before = {s.name: s.bad_requests() for s in (*deployment.prefill, *deployment.decode)}
    status, out = post(deployment.client, endpoint, body)
    assert status == 200, out
    check_answer(endpoint, body, out)
    after = {s.name: s.bad_requests() for s in (*deployment.prefill, *deployment.decode)}
    assert after == before  # neither upstream refused its copy


def test_sglang_bench_without_a_tokenizer_sends_ids(bare) -> None:
    """`bench_serving --tokenize-prompt` sends `input_ids` instead of `text`."""
    body = sglang_generate("", stream=False)
    del body["text"]
    body["input_ids"] = [5, 6, 7]
    status, out = post(bare.http, "/generate", body)
    assert status == 200 and out["output_ids"] == [5, 6, 7, 5], out


# ---- every neutral value is accepted, every other one is a 400 naming the field ----------


def neutral_value(rule: Neutral) -> Any:
    """The first non-null value `rule` accepts (null for a null-only or any-kind row)."""
    return rule.values[0] if rule.values else None


@pytest.mark.parametrize(
    ("endpoint", "table", "base"),
    [
        ("/generate", GENERATE_NEUTRAL, {"text": PROMPT, "sampling_params": {"max_new_tokens": N}}),
        ("/v1/completions", COMPLETIONS_NEUTRAL, {"prompt": PROMPT, "max_tokens": N}),
        (
            "/v1/chat/completions",
            CHAT_NEUTRAL,
            {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": N},
        ),
    ],
    ids=["generate", "completions", "chat"],
)
def test_every_field_at_its_neutral_value_together(srv, endpoint, table, base) -> None:
    """One body with every row of the endpoint's table at its neutral value: a 200 with
    the output of the body without them; at null too."""
    plain = srv.http.post(endpoint, json=base).json()
    for pick in (neutral_value, lambda rule: None):
        body = {**base, **{name: pick(rule) for name, rule in table.items()}}
        if endpoint == "/generate":
            body["sampling_params"] = {
                **base["sampling_params"],
                **{name: pick(rule) for name, rule in GENERATE_SAMPLING_NEUTRAL.items()},
            }
        r = srv.http.post(endpoint, json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        if endpoint == "/generate":
            assert got["output_ids"] == plain["output_ids"]
        else:
            assert got["choices"][0] | {"index": 0} == plain["choices"][0] | {"index": 0}


def test_tables_and_model_fields_do_not_overlap() -> None:
    """A field is either implemented (a model field) or a table row, never both (the body
    classes refuse that at creation; this names the tables)."""
    for model, table in [
        (GenerateBody, GENERATE_NEUTRAL),
        (GenerateSamplingParams, GENERATE_SAMPLING_NEUTRAL),
        (CompletionBody, COMPLETIONS_NEUTRAL),
        (ChatCompletionBody, CHAT_NEUTRAL),
    ]:
        assert model.NEUTRAL is table
        assert not set(table) & set(model.model_fields), model.__name__
    # What the clients sent is in the tables.
    assert {"lora_path", "return_routed_experts"} <= set(GENERATE_NEUTRAL)
    assert "logprob_start_len" in GenerateBody.model_fields  # implemented (issue 37)
    assert "best_of" in COMPLETIONS_NEUTRAL and "best_of" in CHAT_NEUTRAL


REFUSED = [
    ("/generate", {"lora_path": "my-adapter"}, "lora_path"),
    ("/generate", {"return_routed_experts": True}, "return_routed_experts"),
    ("/generate", {"logprob_start_len": -2}, "logprob_start_len must be"),
    ("/generate", {"image_data": "http://x/cat.png"}, "image_data"),
    ("/generate", {"sampling_params": {"max_new_tokens": N, "n": 2}}, "sampling_params: n=2"),
    ("/generate", {"sampling_params": {"stop_regex": ["a+"]}}, "stop_regex"),
    (
        "/generate",
        {"sampling_params": {"max_new_tokens": N, "min_new_tokens": N + 1}},
        "min_new_tokens must be in",
    ),
    ("/v1/completions", {"max_tokens": 2, "min_tokens": 3}, "min_new_tokens must be in"),
    ("/generate", {"session_id": 5}, "session_id must be a string"),
    ("/v1/completions", {"best_of": 3}, "best_of=3"),
    ("/v1/completions", {"n": 200}, "n must be"),  # n and echo: test_http_completions_batch.py
    ("/v1/completions", {"allowed_token_ids": [5]}, "allowed_token_ids"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"lora_path": "my-adapter"}, "lora_path"),
    ("/v1/completions", {"length_penalty": 1.2}, "length_penalty=1.2"),
    ("/v1/completions", {"user": 42}, "user must be a string"),
    (
        "/v1/completions",
        {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        "stream_options: continuous_usage_stats=true",
    ),
    ("/v1/chat/completions", {"echo": True}, "echo=true"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    (
        "/v1/chat/completions",
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
    ),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"best_of": 2}, "best_of=2"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
]


def refused_body(endpoint: str, extra: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any]
    if endpoint == "/generate":
        base = {"text": PROMPT, "sampling_params": {"max_new_tokens": N}}
    elif endpoint == "/v1/completions":
        base = {"model": "mock", "prompt": PROMPT, "max_tokens": N}
    else:
        base = {"model": "mock", "messages": [{"role": "user", "content": PROMPT}]}
    return {**base, **extra}


@pytest.mark.parametrize(("endpoint", "extra", "named"), REFUSED)
def test_a_non_neutral_value_is_a_400_naming_the_field(srv, endpoint, extra, named) -> None:
    body = refused_body(endpoint, extra)
    body.pop("model", None)
    msg = error_message(post(srv.http, endpoint, body))
    assert named in msg, msg
    if "must be" not in named:
        assert "not supported" in msg and ("send" in msg or "omit" in msg), msg


@pytest.mark.parametrize(
    ("endpoint", "extra", "named"),
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "json_schema goes"),
        ("/v1/completions", {"regex": "a+", "guided_json": {}}, "at most one"),
        ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format"),
        (
            "/generate",
            {"sampling_params": {"max_new_tokens": N, "json_schema": "{not json"}},
            "not valid JSON",
        ),
        ("/v1/chat/completions", {"guided_choice": []}, "guided_choice must list"),
        ("/v1/completions", {"guided_regex": " "}, "the regex grammar is empty"),
        # A valid constraint on a server built without a grammar backend (no tokenizer.json).
        ("/v1/completions", {"response_format": {"type": "json_object"}}, "tokenizer.json"),
        ("/generate", {"sampling_params": {"max_new_tokens": N, "regex": "[0-9]+"}}, "tokenizer"),
    ],
)
def test_structured_output_fields_are_checked_before_the_engine(srv, endpoint, extra, named):
    """Issue 37: `response_format`, SGLang's `json_schema` / `regex` / `ebnf`, vLLM's
    `guided_*`: at most one, well formed, and a server that cannot compile grammars says
    so (400s naming the field or the cause; the engine never sees them)."""
    body = refused_body(endpoint, extra)
    body.pop("model", None)
    status, _ = post(srv.http, endpoint, body)
    assert status == 400
    msg = error_message(post(srv.http, endpoint, body))
    assert named in msg, msg


def test_a_non_neutral_value_through_the_router(deployment) -> None:
    """The router does not judge the fields: the decode server's 400 reaches the client."""
    for endpoint, extra, named in [
        ("/generate", {"lora_path": "my-adapter"}, "lora_path"),
        ("/v1/completions", {"best_of": 3}, "best_of=3"),
        ("/v1/chat/completions", {"echo": True}, "echo=true"),
    ]:
        msg = error_message(post(deployment.client, endpoint, refused_body(endpoint, extra)))
        assert named in msg, msg


@pytest.mark.parametrize("endpoint", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_an_unknown_field_is_still_a_400(srv, deployment, endpoint) -> None:
    body = refused_body(endpoint, {"max_token": 5})
    for http, model in ((srv.http, "tiny-tok"), (deployment.client, "mock")):
        if "model" in body:
            body["model"] = model
        msg = error_message(post(http, endpoint, body))
        assert "unknown field 'max_token'" in msg, msg
    nested = refused_body(endpoint, {})
    if endpoint == "/generate":
        nested["sampling_params"]["max_token"] = 5
        where = "sampling_params.max_token"
    elif endpoint == "/v1/completions":
        nested.update(model="tiny-tok", stream=True, stream_options={"include_usge": True})
        where = "stream_options.include_usge"
    else:
        nested.update(model="tiny-tok", messages=[{"role": "user", "content": "x", "nmae": "a"}])
        where = "messages.0.nmae"
    assert f"unknown field '{where}'" in error_message(post(srv.http, endpoint, nested))


def test_null_is_an_omitted_field(srv) -> None:
    """Clients send `null` for what their caller left unset (`openai`'s `logprobs=None`;
    SGLang's Optional fields): it means the default, for implemented fields as for
    table rows; an unknown field is refused even at null, a required one stays required."""
    chat = {
        "messages": [{"role": "user", "content": PROMPT, "name": None}],
        "max_completion_tokens": N,
        **dict.fromkeys(["logprobs", "top_logprobs", "stream", "stream_options", "seed"]),
        **dict.fromkeys(["temperature", "top_p", "stop", "ignore_eos", "max_tokens", "n"]),
    }
    r = srv.http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    generate = {"text": PROMPT, "sampling_params": None, "return_logprob": None, "stream": None}
    r = srv.http.post("/generate", json=generate)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 16, r.text
    for endpoint, body, named in [
        ("/generate", {"text": PROMPT, "max_token": None}, "unknown field 'max_token'"),
        ("/v1/completions", {"prompt": None}, "missing required field 'prompt'"),
        ("/v1/chat/completions", {"messages": None}, "missing required field 'messages'"),
    ]:
        assert named in error_message(post(srv.http, endpoint, body))


def test_the_router_still_refuses_its_own_pd_fields(deployment) -> None:
    for field, value in (("bootstrap_room", "r1"), ("bootstrap_cp_size", 2)):
        body = refused_body("/v1/completions", {field: value})
        msg = error_message(post(deployment.client, "/v1/completions", body))
        assert field in msg and "router" in msg, msg


# ---- the model is named by its path ----------------------------------------------------------


@pytest.fixture(scope="module")
def model_server(tokenizer_dir, tok) -> Iterator[SimpleNamespace]:
    """A server named as `cpkv-serve --model-path /path/to/tiny-own` names its model."""
    names = ServerArgs.from_cli(["--model-path", MODEL_PATH]).served_model_names()
    engine = MockEngine(tok)
    loop = engine.loop(idle_wait_s=0.01, name="engine-compat")
    app = build_app(
        loop,
        model_name=names[0],
        model_aliases=names[1:],
        tokenizer=tok,
        vocab_size=VOCAB,
        context_length=CONTEXT,
        chat_template=load_chat_template(tokenizer_dir),
        metrics=ServerMetrics(),
    )
    served = Served(app, lifespan="off")
    http = httpx.Client(base_url=served.url, timeout=20)
    yield SimpleNamespace(http=http, names=names)
    http.close()
    served.stop()
    asyncio.run(loop.shutdown(1.0))


def test_served_model_names() -> None:
    def names(*argv: str) -> tuple[str, ...]:
        return ServerArgs.from_cli(["--model-path", *argv]).served_model_names()

    assert names(MODEL_PATH) == (MODEL_PATH, "tiny-own")
    assert names(MODEL_PATH + "/") == (MODEL_PATH + "/", MODEL_PATH, "tiny-own")
    assert names("tiny-own") == ("tiny-own",)
    assert names(MODEL_PATH, "--served-model-name", "own") == ("own",)


def test_the_model_path_names_the_model(model_server) -> None:
    """`bench_serving --backend sglang-oai-chat --model /path/to/tiny-own` (the issue's
    404); the base name works too; `/v1/models` lists the path, as SGLang and vLLM do,
    and answers name it."""
    http = model_server.http
    listed = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == [MODEL_PATH]
    for model in (MODEL_PATH, "tiny-own", None):
        body = sglang_oai_chat(model, stream=False)
        if model is None:
            del body["model"]
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == MODEL_PATH
    for make in (sglang_oai, openai_completions):
        r = http.post("/v1/completions", json=make(MODEL_PATH, False))
        assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json=sglang_oai_chat("tiny-other", stream=False))
    assert r.status_code == 404, r.text
    msg = r.json()["error"]["message"]
    assert "'tiny-other'" in msg and repr(MODEL_PATH) in msg and "'tiny-own'" in msg, msg


def test_min_p_maps_to_the_engine_on_every_endpoint():
    """`min_p` (SGLang's sampling param, vLLM's OpenAI extension) is implemented: it is
    no longer among the refused fields and reaches `SamplingParams`; unset means 0."""
    assert "min_p" not in GENERATE_SAMPLING_NEUTRAL
    assert "min_p" not in COMPLETIONS_NEUTRAL and "min_p" not in CHAT_NEUTRAL
    assert GenerateSamplingParams(min_p=0.2).to_engine().min_p == 0.2
    assert GenerateSamplingParams().to_engine().min_p == 0.0
    assert CompletionBody(prompt=[5], min_p=0.3).to_engine(4).min_p == 0.3
    assert CompletionBody(prompt=[5]).to_engine(4).min_p == 0.0
