"""PD speculative decoding (issue 39 item 3): a CP8 shared-KV prefill server and a decode
server on a DP2 mesh, both with `--speculative-algorithm EAGLE --speculative-num-steps
2`, behind `cpkv-router`. The prefill server runs the MTP layer over the prompts (its KV
one more layer of the transfer's layout) and sends the trunk's last hidden state with
the first token; the decode server drafts from them. Greedy answers are the plain
reference's (log-probs within 1e-5: XLA's default numerics; batch-invariant drafting is
checked bitwise in tests/serving/test_unified_cp.py and the engine tests), the decode
server's first drafts a unified whole-prompt admission's; sampled and cancelled requests
give every page and draft-state slot back; a pair that differs in the flag is refused at
the handshake. (Its own module: `conftest._release_compiled_programs` frees the unified
speculative servers' programs before these two servers compile theirs.)
"""

from __future__ import annotations

import inspect

import httpx
import numpy as np
import pytest
from support.pages import assert_pages_back
from support.pd_pair import pd_pair
from support.prefill_server import P, float32_args
from support.unified_server import generate_with_logprobs as generate

from cpkv_jax.buckets import pow2_at_least
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.kv_store import PagedKVStore
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.model.weights import load_model
from cpkv_jax.paging import pages_for_tokens
from serving.decode.speculative import SpeculativeSteps
from transfer.page_plan import LayoutDescriptor, LayoutMismatchError

pytestmark = pytest.mark.slow(seconds=100)  # one worker, 2026-12-05

STEPS = 2
FLAGS = (
    *("--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(STEPS)),
    *("--max-running-requests", "8"),
)
LOGPROB_TOL = 1e-5  # CP8 prefill and DP2 decode against one device (measured: 1e-6)


# CP8 without expert parallelism (the drafting runner under EP8 is checked in
# tests/core/test_expert_parallel.py).
PD_PREFILL = (
    *("--disaggregation-mode", "prefill", "--cp-size", "8", "--enable-cp-shared-kv"),
    *("--chunked-prefill-size", "32", "--kv-pool-size", "1MiB"),
)


# The decode server on a DP mesh (issue 36): two ranks, four experts each; every program
# of `SpeculativeSteps` runs on the rank holding the request's pages. The decode server on
# one device drafts in tests/serving/test_pd_load.py.
DP = 2
PD_DECODE = ("--disaggregation-mode", "decode", "--kv-pool-size", "1MiB", "--dp-size", str(DP))


@pytest.fixture(scope="module")
def spec_pd(tiny_checkpoints):
    """Issue 39 item 3: both servers with the speculative flags; the prefill server runs
    the MTP layer over the prompts (its KV is one more layer of the transfer's layout)
    and sends the last hidden state with the first token; the decode server drafts from
    them. Behind `cpkv-router`."""
    path = tiny_checkpoints("glm_moe_dsa")
    cfg, model = load_model(path, mtp=True)
    ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32")
    decode, prefill = (
        float32_args(path, *PD_DECODE, *FLAGS),
        float32_args(path, *PD_PREFILL, *FLAGS),
    )
    with pd_pair(decode, prefill, 120.0) as pair:
        yield {**pair, "ref": ref, "model": model}


def whole_prompt_drafts(model, ids: list[int]) -> list[int]:
    """The first drafts a unified server's whole-prompt admission writes for `ids`
    (`SpeculativeSteps.prefill`, one device, the servers' numerics)."""
    pages = pages_for_tokens(len(ids) + 1, P) + 1
    kv = PagedKVStore.create(mtp_config(model.cfg), pages, P, np.float32, "float32")
    spec = SpeculativeSteps(
        model, kv, num_steps=STEPS, slots=1, page_size=P, index_k_dtype="float32",
        batch_invariant=False, block_bytes=None,
    )  # fmt: skip
    own = kv.allocate_pages(pages - 1)
    spec.prefill(np.asarray(ids, np.int32), own, pow2_at_least(own.size), 0, 0.0, 0)
    return np.asarray(spec.slab.drafts)[0].tolist()


def test_pd_speculative_decoding_equals_the_reference_and_drafts_as_unified(spec_pd):
    """Greedy tokens through the router are the plain reference's, log-probs within
    `LOGPROB_TOL` (token 0 drawn by the prefill server, the rest verified by the decode
    server), and each request's first drafts - from the MTP KV the CP8 prefill wrote over
    chunks of 32 tokens and the hidden state the room's aux data carried - are those of a
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
        np.testing.assert_allclose(lps, want.output_logprobs, rtol=0, atol=LOGPROB_TOL)
        assert body["meta_info"]["spec_verify_ct"] >= 1
    assert seen == {len(ids): whole_prompt_drafts(spec_pd["model"], ids) for ids in cases}
    info = httpx.get(spec_pd["served"]["decode"].url + "/server_info").json()
    assert info["speculative"]["num_steps"] == STEPS and info["transfer_failures"] == 0
    assert sum(n > 0 for n in decode.engine.admitted_per_rank) == DP  # both ranks drafted
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
