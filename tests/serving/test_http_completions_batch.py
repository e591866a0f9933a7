"""`/v1/completions` batched prompts, `n` > 1 and `echo` (issue 37), on the real app over
`MockEngine` (`srv`, `bare` in tests/serving/conftest.py): output token `i` of a prompt is
`prompt[i % len(prompt)]` (`echo_ids`), so every expected value is recomputed here."""

from __future__ import annotations

import pytest
from support.http_client import FAIL_ID, sse

from serving.engine.mock import echo_ids, mock_logprob, mock_prompt_logprob, mock_top_logprobs
from serving.engine.stopping import request_seed

N = 3


def _post(s, **body):
    return s.http.post("/v1/completions", json={"max_tokens": N, "ignore_eos": True, **body})


def test_token_id_lists_one_choice_each_as_lm_eval_sends(bare):
    prompts = [[10, 11, 12], [20, 21], [30]]
    r = _post(bare, prompt=prompts, temperature=0)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in out["choices"]] == [echo_ids(p, N) for p in prompts]
    assert out["usage"]["prompt_tokens"] == 6
    assert out["usage"]["completion_tokens"] == 3 * N
    assert out["usage"]["total_tokens"] == 6 + 3 * N


def test_every_prompt_form(srv, tok):
    texts = ["hello", "bye now"]
    ids = tok.encode("hello")
    cases = {
        "string": ("hello", [ids]),
        "token ids": (ids, [ids]),
        "strings": (texts, [tok.encode(t) for t in texts]),
        "token-id lists": ([ids, ids[:2]], [ids, ids[:2]]),
    }
    for name, (prompt, want) in cases.items():
        r = _post(srv, prompt=prompt, temperature=0)
        assert r.status_code == 200, (name, r.text)
        choices = r.json()["choices"]
        assert [c["token_ids"] for c in choices] == [echo_ids(p, N) for p in want], name
        assert [c["text"] for c in choices] == [tok.decode(echo_ids(p, N)) for p in want]


def test_batch_engine_requests_and_ids(bare):
    r = bare.http.post(
        "/v1/completions",
        json={"prompt": [[10, 11], [20, 21]], "max_tokens": 2, "n": 2},
        headers={"X-Request-Id": "batch-trace"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "cmpl-batch-trace"
    rids = [f"batch-trace-{k}" for k in range(4)]
    reqs = {rid: bare.engine.requests[rid] for rid in rids if rid in bare.engine.requests}
    assert sorted(reqs) == rids
    assert [reqs[rid].input_ids for rid in rids] == [(10, 11), (10, 11), (20, 21), (20, 21)]


def test_stream_with_several_prompts_carries_indices(bare):
    prompts = [[10, 11, 12], [20, 21]]
    r = _post(bare, prompt=prompts, n=2, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200, r.text
    events = sse(r)
    usage = events[-1]
    assert usage["choices"] == []
    ids: dict[int, list[int]] = {k: [] for k in range(4)}
    finish: dict[int, str] = {}
    for e in events[:-1]:
        (c,) = e["choices"]
        ids[c["index"]] += c["token_ids"]
        if c["finish_reason"] is not None:
            finish[c["index"]] = c["finish_reason"]
    assert ids == {k: echo_ids(prompts[k // 2], N) for k in range(4)}
    assert finish == dict.fromkeys(range(4), "length")
    assert usage["usage"]["prompt_tokens"] == 5
    assert usage["usage"]["completion_tokens"] == 4 * N


def test_n_greedy_identical_and_usage(srv, tok):
    r = _post(srv, prompt="abcd", n=3, temperature=0)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in out["choices"]}) == 1
    assert out["usage"]["prompt_tokens"] == len(tok.encode("abcd"))
    assert out["usage"]["completion_tokens"] == 3 * N


def test_n_sampled_choices_get_distinct_seeds(bare):
    # The mock does not sample: check what the engine was asked for. Seeded: choice 0 keeps
    # the seed, later ones derive theirs from it (the same on a repeat).
    seeds = []
    for attempt in range(2):
        r = bare.http.post(
            "/v1/completions",
            json={"prompt": [5, 6], "n": 3, "seed": 42, "max_tokens": 1},
            headers={"X-Request-Id": f"seeded-{attempt}"},
        )
        assert r.status_code == 200, r.text
        by_rid = dict(bare.engine.requests)
        seeds.append([request_seed(by_rid[f"seeded-{attempt}-{j}"]) for j in range(3)])
    assert seeds[0] == seeds[1]
    assert seeds[0][0] == 42
    assert len(set(seeds[0])) == 3
    # Unseeded: each choice's engine request id gives it its own seed.
    r = bare.http.post(
        "/v1/completions",
        json={"prompt": [5, 6], "n": 3, "max_tokens": 1},
        headers={"X-Request-Id": "unseeded"},
    )
    assert r.status_code == 200, r.text
    by_rid = dict(bare.engine.requests)
    assert len({request_seed(by_rid[f"unseeded-{j}"]) for j in range(3)}) == 3


def test_one_failing_prompt_fails_the_response(bare):
    r = _post(bare, prompt=[[10, 11], [FAIL_ID, 5]])
    assert r.status_code == 500, r.text
    r = _post(bare, prompt=[[10, 11], [FAIL_ID, 5]], stream=True)
    assert r.status_code == 200
    events = sse(r)
    assert "error" in events[-1], events


def test_bad_prompt_of_a_batch_is_named(bare):
    r = _post(bare, prompt=[[10], [10, 99999]])
    assert r.status_code == 400
    assert "prompt[1]" in r.json()["error"]["message"]
    r = _post(bare, prompt=[[10], []])
    assert r.status_code == 400
    assert "prompt[1] is empty" in r.json()["error"]["message"]


def test_echo(srv, tok):
    r = _post(srv, prompt=["hi", "yo"], echo=True, temperature=0)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts == [p + tok.decode(echo_ids(tok.encode(p), N)) for p in ("hi", "yo")]
    # Token ids are echoed as their text; streaming puts the prompt in the first chunk.
    ids = tok.encode("hey")
    r = _post(srv, prompt=ids, echo=True, stream=True, temperature=0)
    events = sse(r)
    assert events[0]["choices"][0]["text"].startswith("hey")
    assert "".join(e["choices"][0]["text"] for e in events) == "hey" + tok.decode(echo_ids(ids, N))


def test_echo_with_zero_max_tokens_answers_without_the_engine(srv, tok):
    before = len(srv.engine.requests)
    r = srv.http.post(
        "/v1/completions", json={"prompt": ["hi", "yo"], "echo": True, "max_tokens": 0, "n": 2}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["text"] for c in out["choices"]] == ["hi", "hi", "yo", "yo"]
    assert {c["finish_reason"] for c in out["choices"]} == {"length"}
    assert out["usage"]["prompt_tokens"] == 2 * len(tok.encode("hi"))
    assert out["usage"]["completion_tokens"] == 0
    r = srv.http.post(
        "/v1/completions",
        json={"prompt": "hi", "echo": True, "max_tokens": 0, "stream": True},
    )
    assert [e["choices"][0]["text"] for e in sse(r)] == ["hi"]
    assert len(srv.engine.requests) == before


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"prompt": "hi", "logprobs": 21}, ["logprobs"]),
        ({"prompt": "hi", "max_tokens": 0}, ["max_tokens=0", "echo"]),
        ({"prompt": "hi", "n": 0}, ["n must be"]),
        ({"prompt": "hi", "n": 129}, ["n must be"]),
        ({"prompt": ["a"] * 20, "n": 128}, ["20 prompts", "n=128"]),
        ({"prompt": ["a", 5]}, ["prompt"]),
        ({"prompt": [[1, 2], "a"]}, ["prompt"]),
    ],
)
def test_refusals_name_the_field(srv, body, words):
    r = srv.http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


def test_echo_without_tokenizer_is_400(bare):
    r = _post(bare, prompt=[5, 6], echo=True)
    assert r.status_code == 400
    assert "echo" in r.json()["error"]["message"]


def _chat(s, **body):
    messages = [{"role": "user", "content": "abcd"}]
    return s.http.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": N, "ignore_eos": True, **body},
    )


def test_chat_n_greedy_identical_and_usage(srv):
    r = _chat(srv, n=3, temperature=0)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in out["choices"]}) == 1
    one = _chat(srv, n=1, temperature=0).json()
    assert out["choices"][0]["message"] == one["choices"][0]["message"]
    assert out["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # counted once
    assert out["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]


def test_chat_n_stream_opens_each_choice_with_its_role(srv):
    r = _chat(srv, n=2, temperature=0, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200, r.text
    events = sse(r)
    usage = events[-1]
    text: dict[int, str] = {0: "", 1: ""}
    roles: dict[int, int] = {0: 0, 1: 0}
    finish: dict[int, str] = {}
    for e in events[:-1]:
        (c,) = e["choices"]
        if c["delta"].get("role") == "assistant":
            assert text[c["index"]] == "", "the role comes first"
            roles[c["index"]] += 1
        text[c["index"]] += c["delta"].get("content") or ""
        if c["finish_reason"] is not None:
            finish[c["index"]] = c["finish_reason"]
    assert roles == {0: 1, 1: 1}
    assert text[0] == text[1] != ""
    assert finish == {0: "length", 1: "length"}
    assert usage["usage"]["completion_tokens"] == 2 * N


def test_chat_n_behind_the_pd_router_is_400(srv):
    r = _chat(srv, n=2, bootstrap_room="room-1", decode_transfer_target="127.0.0.1:1")
    assert r.status_code == 400, r.text
    assert "n > 1" in r.json()["error"]["message"]


def _prompt_part(tok, ids: list[int], top: int) -> dict:
    """What `logprobs` holds for an echoed prompt under the mock's closed form."""
    texts = [tok.decode([t], skip_special_tokens=False) for t in ids]
    offsets = [len(tok.decode(ids[:i], skip_special_tokens=False)) for i in range(len(ids))]
    tops: list = [None]
    for p in range(1, len(ids)):
        alts = mock_top_logprobs(ids[p], -p, top) or ((ids[p], mock_prompt_logprob(ids[p], p)),)
        entry: dict = {}
        for t, lp in alts:
            entry.setdefault(tok.decode([t], skip_special_tokens=False), lp)
        tops.append(entry)
    return {
        "tokens": texts,
        "token_logprobs": [None] + [mock_prompt_logprob(ids[p], p) for p in range(1, len(ids))],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


@pytest.mark.parametrize("top", [0, 2])
def test_echo_with_logprobs_puts_the_prompts_logprobs_first(srv, tok, top):
    """Issue 37: `echo` + `logprobs` (lm-evaluation-harness's log-likelihood requests):
    `logprobs` lists the prompt's tokens first (token 0 without a log-prob), then the
    output's, whose offsets count from the prompt's text; `max_tokens: 0` returns the
    prompt's alone and no output, streamed or not."""
    text = "hello there"
    ids = tok.encode(text)
    want_prompt = _prompt_part(tok, ids, top)
    out_ids = echo_ids(ids, N)
    r = _post(srv, prompt=text, echo=True, logprobs=top, temperature=0)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == text + tok.decode(out_ids)
    assert {k: v[: len(ids)] for k, v in lp.items()} == want_prompt
    assert lp["token_logprobs"][len(ids) :] == [mock_logprob(t, i) for i, t in enumerate(out_ids)]
    shift = len(tok.decode(ids, skip_special_tokens=False))
    assert lp["text_offset"][len(ids)] == shift
    assert srv.engine.requests[list(srv.engine.requests)[-1]].prompt_logprobs_from == 0

    for stream in (False, True):
        r = _post(srv, prompt=ids, echo=True, logprobs=top, max_tokens=0, stream=stream,
                  stream_options={"include_usage": True} if stream else None)  # fmt: skip
        assert r.status_code == 200, r.text
        if stream:
            *events, usage = sse(r)
            (choice,) = [e["choices"][0] for e in events]  # one event: the prompt
            usage = usage["usage"]
        else:
            (choice,) = r.json()["choices"]
            usage = r.json()["usage"]
        assert choice["text"] == tok.decode(ids)
        assert choice["logprobs"] == want_prompt
        assert choice["token_ids"] == [] and choice["finish_reason"] == "length"
        assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(ids)


def test_generate_logprob_start_len_gives_input_token_logprobs(bare):
    """SGLang's `logprob_start_len`: `meta_info.input_token_logprobs` from that prompt
    index (token 0's log-prob None), `input_top_logprobs` with `top_logprobs_num`."""
    ids = [10, 11, 12, 13]
    for start in (0, 2):
        body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start,
                "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 2}}  # fmt: skip
        r = bare.http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        want = [
            [None if p == 0 else mock_prompt_logprob(ids[p], p), ids[p], None]
            for p in range(start, len(ids))
        ]
        assert meta["input_token_logprobs"] == want
        assert meta["input_top_logprobs"] == [
            None if p == 0 else [[lp, t, None] for t, lp in mock_top_logprobs(ids[p], -p, 2)]
            for p in range(start, len(ids))
        ]
    plain = bare.http.post("/generate", json={"input_ids": ids, "return_logprob": True})
    assert "input_token_logprobs" not in plain.json()["meta_info"]
    for bad in (-2, len(ids)):
        body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": bad}
        r = bare.http.post("/generate", json=body)
        assert r.status_code == 400 and "logprob_start_len" in r.text, r.text
