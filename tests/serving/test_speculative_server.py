"""`cpkv-serve --speculative-algorithm EAGLE --speculative-num-steps 2` (issue 39), with
its prefix cache and chunked prefill (the default engine) and with
`--disable-radix-cache`: the unified server drafting with the MTP layer answers
with the plain reference's greedy tokens and log-probs (bitwise under
`--enable-batch-invariant`), reports its speculative configuration and per-request
acceptance (`meta_info`, `/metrics`), refuses what a speculative step cannot apply with a
400 that names it, and under many clients, some disconnecting mid-stream, returns every
page and draft-state slot (SPEC-less: issue 39's load acceptance point). Flag
combinations it cannot serve are refused at startup with the fix.

PD (issue 39 item 3): a CP4/EP4 shared-KV prefill server and a decode server, both with
the speculative flags, behind `cpkv-router`: greedy answers bitwise the reference's, the
decode server's first drafts bitwise a unified whole-prompt admission's, sampled and
cancelled requests give every page and slot back, and a pair that differs in the flag
is refused at the handshake."""

from __future__ import annotations

import asyncio
import inspect
import json

import httpx
import numpy as np
import pytest
from support.http_client import Served
from support.pages import assert_pages_back
from support.prefill_server import P, float32_args
from support.unified_server import serving, unified_args

from cpkv_jax.buckets import pow2_at_least
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.kv_store import PagedKVStore
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.model.weights import load_model
from cpkv_jax.paging import pages_for_tokens
from serving.decode.engine import DecodeEngine
from serving.decode.speculative import SpeculativeSteps
from serving.router import RouterConfig, build_router_app
from serving.server import build_server
from serving.server_args import ServerArgs, ServerArgsError
from transfer.page_plan import LayoutDescriptor, LayoutMismatchError

pytestmark = pytest.mark.slow(seconds=130)  # one worker, both engines, 2026-12-05

POOL_PAGES = 96
STEPS = 2
FLAGS = (
    "--speculative-algorithm",
    "EAGLE",
    "--speculative-num-steps",
    str(STEPS),
    "--enable-batch-invariant",
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
        ref = ReferenceGenerator(
            cfg, model, page_size=P, index_k_dtype="float32", batch_invariant=True
        )
        yield server, served, ref, cfg


def generate(url: str, ids: list[int], new: int, **sampling) -> httpx.Response:
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": new, "ignore_eos": True, **sampling},
    }
    return httpx.post(url + "/generate", json=body, timeout=120.0)


def test_greedy_answers_are_the_references_with_acceptance_reported(spec_server):
    server, served, ref, cfg = spec_server
    rng = np.random.default_rng(7)
    for n, new in ((37, 12), (20, 5)):
        ids = rng.integers(3, cfg.vocab_size, n).tolist()
        r = generate(served.url, ids, new, temperature=0.0)
        assert r.status_code == 200, r.text
        body = r.json()
        want = ref.generate(ids, new, ignore_eos=True)
        assert body["output_ids"] == want.output_ids
        lps = [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]
        np.testing.assert_array_equal(lps, want.output_logprobs)  # bitwise
        meta = body["meta_info"]
        assert meta["spec_verify_ct"] >= 1 and 1.0 <= meta["spec_accept_length"] <= STEPS + 1
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
    r = generate(served.url, [5, 6, 7], 4, temperature=0.7, frequency_penalty=0.5)
    assert r.status_code == 400, r.text
    assert "frequency_penalty" in r.json()["error"]["message"]
    assert "speculative" in r.json()["error"]["message"]
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 2}
    r = httpx.post(served.url + "/generate", json=body, timeout=30.0)
    assert r.status_code == 400 and "top_logprobs" in r.text


def test_many_clients_with_disconnects_leave_every_page_and_slot(spec_server):
    """24 clients, sampled and greedy, a third of them streaming and leaving after their
    first event: every finished answer has its length, and when all is done every page
    and draft-state slot is free again."""
    server, served, _, cfg = spec_server
    engine = server.engine
    assert isinstance(engine, DecodeEngine) and engine.spec is not None
    rng = np.random.default_rng(11)
    jobs = [
        # prompts of one prefill bucket (33..64 tokens): fewer shapes to compile
        (rng.integers(3, cfg.vocab_size, int(rng.integers(33, 60))).tolist(), i)
        for i in range(24)
    ]

    async def one(client: httpx.AsyncClient, ids: list[int], i: int) -> str | None:
        sampling = {"max_new_tokens": 6 + i % 7, "ignore_eos": True}
        sampling["temperature"] = 0.0 if i % 2 else 0.9
        if i % 4 == 2:  # a sampled request whose target is filtered
            sampling |= {"top_k": 20, "top_p": 0.8, "min_p": 0.05}
        body = {"input_ids": ids, "sampling_params": sampling, "stream": i % 3 == 0}
        async with client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                return f"{i}: {r.status_code} {await r.aread()!r}"
            if body["stream"]:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        return None  # leave mid-stream: the server aborts the request
                return f"{i}: no event"
            got = json.loads(await r.aread())
            n = len(got["output_ids"])
            return None if n == sampling["max_new_tokens"] else f"{i}: {n} tokens"

    async def run() -> list[str | None]:
        # Generous: the first sampled rows compile their step shapes on this CPU server
        # (`--warmup common`), and CI machines can be 2.5x slower.
        async with httpx.AsyncClient(base_url=served.url, timeout=240.0) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, ids, i) for ids, i in jobs)), 300
            )

    problems = [p for p in asyncio.run(run()) if p is not None]
    assert not problems, problems

    def held() -> int:
        """Pages held by requests: neither free nor only cached (the prefix cache's
        pages stay until evicted; nothing locks them once no request runs)."""
        st = engine.stats()
        cached = st.kv_pages_cached[0] if st.kv_pages_cached else 0
        return st.kv_pages_total[0] - st.kv_pages_free[0] - cached

    async def settle() -> None:
        for _ in range(200):
            if not engine.has_work() and held() == 0:
                return
            await asyncio.sleep(0.05)

    asyncio.run(settle())
    assert held() == 0
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
                "--disaggregation-mode",
                "decode",
                "--dp-size",
                "2",
            ),
            "runs on one device",
        ),
        (
            ("--speculative-algorithm", "EAGLE", "--enable-hierarchical-cache"),
            "host cache does not carry the MTP layer",
        ),
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


# ---- PD: a drafting CP4/EP4 prefill server -> gRPC -> a speculative decode server --------


PD_PREFILL = (
    *("--disaggregation-mode", "prefill", "--cp-size", "4", "--enable-cp-shared-kv"),
    *("--ep-size", "4", "--chunked-prefill-size", "32", "--kv-pool-size", "1MiB"),
)


@pytest.fixture(scope="module")
def spec_pd(tiny_checkpoints):
    """Issue 39 item 3: both servers with the speculative flags; the prefill server runs
    the MTP layer over the prompts (its KV is one more layer of the transfer's layout)
    and sends the last hidden state with the first token; the decode server drafts from
    them. Behind `cpkv-router`."""
    path = tiny_checkpoints("glm_moe_dsa")
    cfg, model = load_model(path, mtp=True)
    decode = build_server(
        float32_args(path, "--disaggregation-mode", "decode", "--kv-pool-size", "1MiB", *FLAGS)
    )
    try:
        prefill = build_server(float32_args(path, *PD_PREFILL, *FLAGS))
    except BaseException:
        decode.close()
        raise
    served = {"decode": Served(decode.app), "prefill": Served(prefill.app)}
    config = RouterConfig(
        prefill=(served["prefill"].url,),
        decode=(served["decode"].url,),
        request_timeout=120.0,
        health_interval=0.5,
        startup_timeout=30.0,
    ).validate()
    served["router"] = Served(build_router_app(config))
    ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32", batch_invariant=True)
    yield {"decode": decode, "prefill": prefill, "served": served, "ref": ref, "model": model}
    for s in reversed(list(served.values())):
        s.stop()
    for server in (prefill, decode):
        asyncio.run(server.loop.shutdown(0.0))
        server.close()


def whole_prompt_drafts(model, ids: list[int]) -> list[int]:
    """The first drafts a unified server's whole-prompt admission writes for `ids`
    (`SpeculativeSteps.prefill`, one device, the servers' numerics)."""
    pages = pages_for_tokens(len(ids) + 1, P) + 1
    kv = PagedKVStore.create(mtp_config(model.cfg), pages, P, np.float32, "float32")
    spec = SpeculativeSteps(
        model, kv, num_steps=STEPS, slots=1, page_size=P, index_k_dtype="float32",
        batch_invariant=True, block_bytes=None,
    )  # fmt: skip
    own = kv.allocate_pages(pages - 1)
    spec.prefill(np.asarray(ids, np.int32), own, pow2_at_least(own.size), 0, 0.0, 0)
    return np.asarray(spec.slab.drafts)[0].tolist()


def test_pd_speculative_decoding_equals_the_reference_and_drafts_as_unified(spec_pd):
    """Greedy tokens and log-probs through the router are bitwise the plain reference's
    (token 0 drawn by the prefill server, the rest verified by the decode server), and
    each request's first drafts - from the MTP KV the CP4 prefill wrote over chunks of
    32 tokens and the hidden state the room's aux data carried - are bitwise those of a
    unified server's whole-prompt admission."""
    decode, ref = spec_pd["decode"], spec_pd["ref"]
    spec = decode.engine.spec
    assert spec is not None
    seen: dict[int, list[int]] = {}
    admit = spec.admit_given

    def recorded(*args):
        admit(*args)
        bound = inspect.signature(admit).bind(*args).arguments
        seen[bound["n"]] = np.asarray(spec.slab.drafts)[bound["slot"]].tolist()

    spec.admit_given = recorded
    router = spec_pd["served"]["router"].url
    rng = np.random.default_rng(5)
    cases = [rng.integers(3, ref.cfg.vocab_size, n).tolist() for n in (5, 2 * P, 70)]
    for ids in cases:
        r = generate(router, ids, 7, temperature=0.0)
        assert r.status_code == 200, r.text
        body, want = r.json(), ref.generate(ids, 7, ignore_eos=True)
        assert body["output_ids"] == want.output_ids, len(ids)
        lps = [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]
        np.testing.assert_array_equal(lps, want.output_logprobs)  # bitwise
        assert body["meta_info"]["spec_verify_ct"] >= 1
    assert seen == {len(ids): whole_prompt_drafts(spec_pd["model"], ids) for ids in cases}
    info = httpx.get(spec_pd["served"]["decode"].url + "/server_info").json()
    assert info["speculative"]["num_steps"] == STEPS and info["transfer_failures"] == 0
    assert_pages_back(decode)
    assert_pages_back(spec_pd["prefill"])


def test_pd_speculative_sampled_and_cancelled_requests_give_everything_back(spec_pd):
    """Sampled requests (seeded) end with their lengths; streams left after their first
    event are aborted on both sides: every page of both servers and every draft-state
    slot comes back."""
    router = spec_pd["served"]["router"].url
    rng = np.random.default_rng(9)
    for i in range(4):
        ids = rng.integers(3, 300, int(rng.integers(5, 60))).tolist()
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 40, "temperature": 0.8, "ignore_eos": True},
            "stream": i % 2 == 1,
        }
        if not body["stream"]:
            body["sampling_params"] |= {"max_new_tokens": 6, "sampling_seed": i}
            r = httpx.post(router + "/generate", json=body, timeout=120.0)
            assert r.status_code == 200, r.text
            assert len(r.json()["output_ids"]) == 6
            continue
        with httpx.stream("POST", router + "/generate", json=body, timeout=120.0) as r:
            assert r.status_code == 200
            assert any(line.startswith("data:") for line in r.iter_lines())  # then leave
    decode = spec_pd["decode"]
    assert_pages_back(decode)
    assert_pages_back(spec_pd["prefill"])
    spec = decode.engine.spec
    assert spec is not None and spec.free_slots == spec.num_slots


def test_a_plain_prefill_and_a_speculative_decode_server_refuse_each_others_layout(
    tiny_checkpoints,
):
    """The MTP layer's KV is one more layer of the transfer layout: a decode server that
    drafts refuses a prefill server that does not (and the other way round) at the
    handshake, naming the flag."""
    cfg = load_model(tiny_checkpoints("glm_moe_dsa"))[0]
    plain = LayoutDescriptor.from_model(cfg, P, "float32", "float32")
    drafting = LayoutDescriptor.from_model(mtp_config(cfg), P, "float32", "float32")
    for ours, theirs in ((plain, drafting), (drafting, plain)):
        with pytest.raises(LayoutMismatchError, match="same --speculative-algorithm"):
            ours.check_compatible(theirs)
