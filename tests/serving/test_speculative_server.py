"""`cpkv-serve --speculative-algorithm EAGLE --speculative-num-steps 2` (issue 39), with
its prefix cache and chunked prefill (the default engine) and with
`--disable-radix-cache`: the unified server drafting with the MTP layer answers
with the plain reference's greedy tokens and log-probs (within 1e-5: XLA's default
numerics; batch-invariant drafting is checked bitwise in tests/serving/test_unified_cp.py
and the engine tests), reports its speculative configuration and per-request
acceptance (`meta_info`, `/metrics`), refuses what a speculative step cannot apply with a
400 that names it, and under many clients, some disconnecting mid-stream, returns every
page and draft-state slot (SPEC-less: issue 39's load acceptance point). Flag
combinations it cannot serve are refused at startup with the fix."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest
from support.prefill_server import P
from support.unified_server import client_wave, serving, settled_held_pages, unified_args
from support.unified_server import generate_with_logprobs as generate

from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.model.weights import load_model
from serving.decode.engine import DecodeEngine
from serving.server_args import ServerArgs, ServerArgsError

pytestmark = pytest.mark.slow(seconds=130)  # one worker, both engines, 2026-12-05

POOL_PAGES = 96
STEPS = 2
FLAGS = (
    "--speculative-algorithm",
    "EAGLE",
    "--speculative-num-steps",
    str(STEPS),
    "--max-running-requests",
    "8",
)


# The whole-prompt engine, and the default one: prefix cache, chunked CP prefill at cp 1.
ENGINES = {
    "whole-prompt": ("--disable-radix-cache",),
    "prefix-cache": ("--chunked-prefill-size", "32"),
}


@pytest.fixture(scope="module", params=list(ENGINES))
def spec_server(request, tiny_checkpoints):
    path = tiny_checkpoints("glm_moe_dsa")
    cfg, model = load_model(path, mtp=True)
    args = unified_args(path, cfg, POOL_PAGES, *FLAGS, *ENGINES[request.param])
    with serving(args) as (server, served):
        ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32")
        yield server, served, ref, cfg


def step_metrics(url: str) -> tuple[int, float]:
    """`/metrics`' speculative decode steps so far and their seconds."""
    text = httpx.get(url + "/metrics").text

    def value(stat: str) -> float:
        line = rf'^cpkv_decode_step_seconds_{stat}{{kind="verify_draft"}} (\S+)$'
        m = re.search(line, text, re.M)
        return float(m[1]) if m else 0.0

    return int(value("count")), value("sum")


def test_greedy_answers_are_the_references_with_acceptance_reported(spec_server):
    server, served, ref, cfg = spec_server
    rng = np.random.default_rng(7)
    steps0, verified = step_metrics(served.url), 0
    for n, new in ((37, 12), (20, 5)):
        ids = rng.integers(3, cfg.vocab_size, n).tolist()
        r = generate(served.url, ids, new, temperature=0.0)
        assert r.status_code == 200, r.text
        body = r.json()
        want = ref.generate(ids, new, ignore_eos=True)
        assert body["output_ids"] == want.output_ids
        lps = [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]
        np.testing.assert_allclose(lps, want.output_logprobs, rtol=0, atol=1e-5)
        meta = body["meta_info"]
        assert meta["spec_verify_ct"] >= 1 and 1.0 <= meta["spec_accept_length"] <= STEPS + 1
        verified += meta["spec_verify_ct"]
    # One request at a time: every step the engine fetched verified one request's row.
    steps1 = step_metrics(served.url)
    assert steps1[0] - steps0[0] == verified and steps1[1] > steps0[1]
    info = httpx.get(served.url + "/server_info").json()
    assert info["speculative"] == {
        "algorithm": "EAGLE",
        "num_steps": STEPS,
        "num_draft_tokens": STEPS + 1,
        "eagle_topk": 1,
    }
    metrics = httpx.get(served.url + "/metrics").text
    assert "cpkv_spec_accept_length_count 2.0" in metrics


def test_what_a_speculative_step_cannot_apply_is_refused_with_400(spec_server):
    _, served, _, _ = spec_server
    r = generate(served.url, [5, 6, 7], 4, temperature=0.7, regex="[ab]+")
    assert r.status_code == 400, r.text
    assert "grammar" in r.json()["error"]["message"]
    assert "speculative" in r.json()["error"]["message"]


def test_top_log_probs_come_with_every_speculated_token(spec_server):
    """Top log-probs with speculative decoding: each emitted token (the first, drawn at
    admission, and every accepted draft and bonus token) reports its position's top 3,
    the greedy token first with its own log-prob."""
    _, served, _, cfg = spec_server
    ids = np.random.default_rng(3).integers(3, cfg.vocab_size, 21).tolist()
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 9, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 3,
    }
    r = httpx.post(served.url + "/generate", json=body, timeout=60.0)
    assert r.status_code == 200, r.text
    out, meta = r.json()["output_ids"], r.json()["meta_info"]
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(out) == 9
    for token, (lp, _, _), top in zip(out, meta["output_token_logprobs"], tops, strict=True):
        assert len(top) == 3 and top[0][1] == token and top[0][0] == lp
        assert top[0][0] >= top[1][0] >= top[2][0]


@pytest.mark.parametrize("spec_server", ["prefix-cache"], indirect=True)
def test_many_clients_with_disconnects_leave_every_page_and_slot(spec_server):
    """24 clients, sampled and greedy, a third of them streaming and leaving after their
    first event: every finished answer has its length, and when all is done every page
    and draft-state slot is free again. On the default (prefix-cache) engine only: the
    whole-prompt one differs in its admission, whose aborts and refusals the engine tests
    cover (the suite's time)."""
    server, served, _, cfg = spec_server
    engine = server.engine
    assert isinstance(engine, DecodeEngine) and engine.spec is not None
    rng = np.random.default_rng(11)
    jobs = [
        # prompts of one prefill bucket (33..64 tokens): fewer shapes to compile
        (rng.integers(3, cfg.vocab_size, int(rng.integers(33, 60))).tolist(), i)
        for i in range(24)
    ]

    def sampling(i: int) -> dict:
        out = {"max_new_tokens": 6 + i % 7, "ignore_eos": True}
        out["temperature"] = 0.0 if i % 2 else 0.9
        if i % 4 == 2:  # a sampled request whose target is filtered
            out |= {"top_k": 20, "top_p": 0.8, "min_p": 0.05}
        return out

    problems = client_wave(served.url, jobs, sampling)
    assert not problems, problems

    assert settled_held_pages(engine) == 0
    assert engine.spec.free_slots == engine.spec.num_slots
    # What ran is what `--warmup all` compiles (`reachable_shapes`, with the draft room).
    assert engine.step_shapes <= engine.reachable_shapes()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (("--speculative-num-steps", "2"), "has no effect without --speculative-algorithm"),
        (
            (
                "--speculative-algorithm",
                "NEXTN",
                "--disable-radix-cache",
                "--speculative-eagle-topk",
                "4",
            ),
            "only a chain",
        ),
        (
            (
                "--speculative-algorithm",
                "NEXTN",
                "--disable-radix-cache",
                "--speculative-num-steps",
                "3",
                "--speculative-num-draft-tokens",
                "3",
            ),
            "must be --speculative-num-steps \\+ 1 = 4",
        ),
        (
            (
                "--speculative-algorithm",
                "MTP",
                "--disable-radix-cache",
                "--speculative-num-steps",
                "9",
            ),
            "in \\[1, 8\\]",
        ),
    ],
)
def test_speculative_flag_combinations(extra, match):
    args = ServerArgs.from_cli(["--model-path", "m", *extra])
    with pytest.raises(ServerArgsError, match=match):
        args.validate()


def test_speculative_flags_accepted_as_sglang_spells_them():
    args = ServerArgs.from_cli(
        [
            "--model-path",
            "m",
            "--disable-radix-cache",
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "4",
        ]
    )
    args.validate()
    assert args.speculative_steps() == 3
    assert ServerArgs.from_cli(["--model-path", "m"]).speculative_steps() == 0
