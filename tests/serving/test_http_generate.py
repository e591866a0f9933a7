"""The HTTP API's generation endpoints (`/generate`, `/v1/completions`,
`/v1/chat/completions`), streaming and not, over a real uvicorn server and a real `httpx`
client around `MockEngine`; and a client leaving mid-request aborts the engine request.

Every expected output is recomputed here from the mock's rule (`support.http_client`)
and, for chat, from a plain-jinja2 rendering of the tiny checkpoint's template, never read
back from the server. Log-probs are compared exactly (`==`): they are Python floats that
only pass through JSON, which round-trips doubles.
"""

from __future__ import annotations

import itertools

import httpx
import numpy as np
import pytest
from support.http_client import CONTEXT, EOS_ID, reference_chat_prompt, sse, wait_for

from cpkv_jax.tools.make_tiny_checkpoint import SPECIAL_TOKENS
from serving.engine.mock import echo_ids, mock_logprob, mock_top_logprobs

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


def test_stop_tokens_and_special_tokens_in_the_text(srv, tok):
    """A stop token that ends the output is an output id but not text (SGLang and vLLM);
    `no_stop_trim` / `include_stop_str_in_output` keep it, and the stop string;
    `skip_special_tokens: false` shows special tokens (`<|bos|>` mid-output, `<|eos|>`)."""
    bos = SPECIAL_TOKENS.index("<|bos|>")  # a special token that is not a stop
    a, b, c = tok.encode("abc")

    def generate(ids: list[int], **params) -> dict:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 9, **params}}
        r = srv.http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    out = generate([a, b, c], stop_token_ids=[c])
    assert out["output_ids"] == [a, b, c] and out["text"] == "ab"
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": c}
    assert generate([a, b, c], stop_token_ids=[c], no_stop_trim=True)["text"] == "abc"
    with_eos = [a, bos, b, EOS_ID]
    for params, text in [
        ({}, "ab"),
        ({"skip_special_tokens": False}, "a<|bos|>b"),
        ({"no_stop_trim": True}, "ab"),  # the EOS kept, but a special token
        ({"skip_special_tokens": False, "no_stop_trim": True}, "a<|bos|>b<|eos|>"),
    ]:
        out = generate(with_eos, **params)
        assert out["output_ids"] == with_eos and out["text"] == text, params
    # The stop string kept: "abcXY..." stops at "cX" (streamed and not).
    stream = {"text": "abcXY", "stream": True}
    params = {"max_new_tokens": 30, "stop": ["cX"], "no_stop_trim": True}
    assert generate(tok.encode("abcXY"), **params)["text"] == "abcX"
    r = srv.http.post("/generate", json={**stream, "sampling_params": params})
    assert sse(r)[-1]["text"] == "abcX"
    # OpenAI endpoints: vLLM's and SGLang's names, streamed and not.
    for extra in ({"include_stop_str_in_output": True}, {"no_stop_trim": True}):
        for streamed in (False, True):
            body = {"prompt": "abcXY", "max_tokens": 30, "stop": "cX", "stream": streamed}
            r = srv.http.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 200, r.text
            if streamed:
                text = "".join(e["choices"][0]["text"] for e in sse(r) if e["choices"])
            else:
                text = r.json()["choices"][0]["text"]
            assert text == "abcX", (extra, streamed)
    body = {"prompt": [a, bos, b, EOS_ID], "max_tokens": 9, "skip_special_tokens": False}
    r = srv.http.post("/v1/completions", json=body)
    assert r.json()["choices"][0]["text"] == "a<|bos|>b"
    assert r.json()["choices"][0]["finish_reason"] == "stop"


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
    # Chunks whose text is held back (a character split over byte tokens) still carry
    # their token ids: the streamed ids are the whole output.
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want_ids
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


def test_generate_batches_of_texts_and_token_id_lists(srv, tok):
    """SGLang's batched `/generate` (issue 37): a list of texts or of token-id lists is
    one engine request per prompt, answered as a list in prompt order; `rid` may be a list
    of as many ids."""
    sp = {"max_new_tokens": 3, "ignore_eos": True}
    texts = ["hello", "bye now"]
    r = srv.http.post("/generate", json={"text": texts, "sampling_params": sp})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["output_ids"] for o in out] == [echo_ids(tok.encode(t), 3) for t in texts]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(tok.encode(t)) for t in texts]
    ids = [[10, 11, 12], [20, 21]]
    body = {"input_ids": ids, "sampling_params": sp, "rid": ["b-0", "b-1"]}
    r = srv.http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["output_ids"] for o in out] == [echo_ids(p, 3) for p in ids]
    assert [o["meta_info"]["id"] for o in out] == ["b-0", "b-1"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"text": ["a", "b"], "stream": True}, "stream=true takes one prompt"),
        ({"input_ids": [[10], [11]], "rid": "one"}, "rid: a list of ids"),
        ({"input_ids": [[10], [11]], "rid": ["only-one"]}, "rid: a list of ids"),
        ({"input_ids": [[10], []]}, "input_ids[1]"),
        ({"input_ids": [[10], [99999]]}, "input_ids[1]"),
        ({"text": []}, "at least one prompt"),
    ],
)
def test_generate_batch_refusals_name_the_field(srv, body, words):
    r = srv.http.post("/generate", json={"sampling_params": {"max_new_tokens": 2}, **body})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.text


# ---- top log-probs (issue 37 item 4) ----------------------------------------------------


def test_top_logprobs_on_every_endpoint_stream_and_not(srv, tok):
    """`top_logprobs` (chat), `logprobs: N` (completions) and `top_logprobs_num`
    (`/generate`) return each output token's N alternatives the engine computed, most
    likely first, in each API's own shape; streamed, each chunk carries its tokens'."""
    prompt = "top?"
    ids = tok.encode(prompt)
    n, k = 6, 3
    want_ids = echo_ids(ids, n)
    want_top = [mock_top_logprobs(t, i, k) for i, t in enumerate(want_ids)]
    text_of = lambda t: tok.decode([t], skip_special_tokens=False)

    r = srv.http.post(
        "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": n},
            "return_logprob": True,
            "top_logprobs_num": k,
            "return_text_in_logprobs": True,
        },
    )
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["output_top_logprobs"] == [
        [[lp, t, text_of(t)] for t, lp in alts] for alts in want_top
    ]

    def completion_tops(alts):
        top = {}
        for t, lp in alts:  # byte tokens: each id its own text, so no entry merges
            top.setdefault(text_of(t), lp)
        return top

    body = {"prompt": ids, "max_tokens": n, "logprobs": k}
    choice = srv.http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["logprobs"]["top_logprobs"] == [completion_tops(a) for a in want_top]
    chunks = sse(srv.http.post("/v1/completions", json={**body, "stream": True}))
    streamed = [
        x for c in chunks for x in (c["choices"][0]["logprobs"] or {}).get("top_logprobs", [])
    ]
    assert streamed == [completion_tops(a) for a in want_top]
    # logprobs: 0 keeps OpenAI's legacy shape: the chosen token alone.
    body0 = {**body, "logprobs": 0}
    tops0 = srv.http.post("/v1/completions", json=body0).json()["choices"][0]["logprobs"]
    assert tops0["top_logprobs"] == [
        {text_of(t): mock_logprob(t, i)} for i, t in enumerate(want_ids)
    ]

    chat = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": n,
        "logprobs": True,
        "top_logprobs": k,
    }
    chat_ids = tok.encode(reference_chat_prompt(chat["messages"]))
    chat_top = [mock_top_logprobs(t, i, k) for i, t in enumerate(echo_ids(chat_ids, n))]
    want_content = [[(text_of(t), lp) for t, lp in alts] for alts in chat_top]
    content = srv.http.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]
    got = [[(a["token"], a["logprob"]) for a in c["top_logprobs"]] for c in content["content"]]
    assert got == want_content
    events = sse(srv.http.post("/v1/chat/completions", json={**chat, "stream": True}))
    streamed = [
        [(a["token"], a["logprob"]) for a in c["top_logprobs"]]
        for e in events
        if e["choices"] and e["choices"][0]["logprobs"]
        for c in e["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == want_content
