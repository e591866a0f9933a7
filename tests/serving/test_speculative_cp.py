"""Speculative decoding on a CP group (issue 40 with issue 39's MTP drafting):
`cpkv-serve --cp-size 8 --enable-cp-shared-kv --ep-size 8 --speculative-algorithm EAGLE`
prefills through the prefix cache's drafting CP runner (the trunk's and the MTP layer's
KV, striped over the ranks by owner) and drafts and verifies on the same pools: each
rank runs the rows of its draft-state slots, the trunk and the MTP layer attending where
the pages live (`OwnerCPKVIO`), their KV written on the owner lanes.

Greedy tokens must equal `ReferenceGenerator`'s plain decoding on one device exactly,
log-probs within 1e-5 (the CP tolerance of tests/serving/test_unified_cp.py: rank-sized
matmuls and the log-sum-exp merge of the ranks' partial attention round in the last
bits), for a prompt longer than one rank's pool and shorter ones joining and leaving.
Under many clients, some leaving mid-stream, every page and draft-state slot comes back.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import pytest
from support.prefill_server import P
from support.speculative_engine import install_oracle
from support.unified_server import (
    assert_greedy_reference,
    client_wave,
    cp_group_args,
    generate_with_logprobs,
    serving,
    settled_held_pages,
)

from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.model.weights import load_model
from cpkv_jax.speculative import MTPSpeculator
from serving.decode.cached import CachedUnifiedEngine
from serving.decode.placement import StripedPlacement
from serving.decode.speculative import SPEC_ADMIT_FORMS, SPEC_FORMS, SpeculativeSteps

pytestmark = pytest.mark.slow(seconds=90)

CP = 8
STEPS = 2
PAGES_PER_RANK = 8  # 7 usable and the trash page
LONG = 33 * P + 5  # 35 pages with its output and draft room: more than one rank's 7
WAIT_S = 300.0


@pytest.fixture(scope="module")
def spec_cp(cp_checkpoint):
    path, cfg, _ = cp_checkpoint
    drafting = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(STEPS))
    # The pool keeps the MTP layer's KV too: pages of one more layer.
    with serving(cp_group_args(path, mtp_config(cfg), CP, PAGES_PER_RANK, *drafting)) as s:
        yield s


class _ByPrompt(dict):
    """The oracle's truth by request id, looked up by the running request's prompt (the
    server names its requests)."""

    def __init__(self, engine, by_prompt: dict[tuple[int, ...], list[int]]):
        super().__init__()
        self.engine, self.by_prompt = engine, by_prompt

    def __getitem__(self, rid: str) -> list[int]:
        return self.by_prompt[tuple(int(t) for t in self.engine.running[rid].prompt)]


def test_drafts_verify_where_the_pages_live_and_answer_as_plain_decoding(spec_cp, cp_checkpoint):
    """The long request and two short ones at once, then the long one again from the
    prefix cache, with the oracle's drafts (`support.speculative_engine.install_oracle`:
    the plain continuation, corrupted at a place that moves with the step and the row, so
    steps accept every count from 0 to K): greedy tokens and log-probs of one device's
    plain decoding, and every step shape one the engine's warm-up accounting knows (its
    admissions and verify steps among those the warm-up probe ran)."""
    _, cfg, ref = cp_checkpoint
    server, served = spec_cp
    engine = server.engine
    assert isinstance(engine, CachedUnifiedEngine)
    spec = engine.spec
    assert isinstance(spec, SpeculativeSteps) and spec.cp == CP
    assert isinstance(engine.placement, StripedPlacement)
    info = httpx.get(served.url + "/server_info", timeout=WAIT_S).json()
    assert info["cp_size"] == CP and info["speculative"]["num_steps"] == STEPS
    # The warm-up probe ran this engine's admissions (after the runner's prefill: from
    # its logits) and verify steps at a rank's rows, not the plain CP step's raised ones.
    probed = {form for form, *_ in spec.shapes}
    assert probed >= {*SPEC_ADMIT_FORMS, *SPEC_FORMS}, probed
    rng = np.random.default_rng(5)
    jobs = [
        (rng.integers(3, cfg.vocab_size, n).tolist(), new)
        for n, new in ((LONG, 6), (P + 3, 9), (7, 12))
    ]
    assert -(-(LONG + 6) // P) > PAGES_PER_RANK - 1  # one rank could not hold it
    truth = {tuple(ids): ref.generate(ids, new, ignore_eos=True).output_ids for ids, new in jobs}
    accepted = install_oracle(engine, _ByPrompt(engine, truth), STEPS)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            outs = list(
                pool.map(
                    lambda job: generate_with_logprobs(served.url, *job, temperature=0.0).json(),
                    jobs,
                )
            )
        again = generate_with_logprobs(served.url, jobs[0][0], 6, temperature=0.0).json()
    finally:
        del spec.step  # the oracle's wrapper
    for out, (ids, new) in zip([*outs, again], [*jobs, jobs[0]], strict=True):
        assert_greedy_reference(out, ref, ids, new)
        assert 1.0 <= out["meta_info"]["spec_accept_length"] <= STEPS + 1
    assert again["meta_info"]["cached_tokens"] > 0  # the trunk's and the MTP layer's KV
    assert set(accepted) == set(range(STEPS + 1))  # every count of drafts kept
    assert engine.step_shapes <= engine.reachable_shapes()
    assert settled_held_pages(engine) == 0
    assert spec.free_slots == spec.num_slots


def test_sampled_rows_draw_what_one_device_s_speculative_decoding_draws(spec_cp, cp_checkpoint):
    """Temperature 0.8 with top-p, seeded: the CP group's draft-and-verify steps draw the
    tokens `MTPSpeculator` draws on one device from the same seed (the same random
    streams, the same accept / reject rule over target distributions that agree within
    the CP tolerance), log-probs within 1e-5."""
    path, cfg, _ = cp_checkpoint
    _, served = spec_cp
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (P + 3, 2 * P + 9)]
    _, model = load_model(path, progress=False, mtp=True)
    one = MTPSpeculator(model, STEPS, page_size=P, index_k_dtype="float32")
    for seed, ids in enumerate(prompts, start=11):
        want = one.generate([ids], 10, temperature=0.8, top_p=0.9, seeds=[seed])[0]
        r = generate_with_logprobs(served.url, ids, 10, temperature=0.8, top_p=0.9, seed=seed)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == want.output_ids
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        np.testing.assert_allclose(got, want.logprobs, rtol=1e-5, atol=1e-5)


def test_many_clients_with_disconnects_leave_every_page_and_slot(spec_cp, cp_checkpoint):
    """12 clients at once, sampled and greedy, some prompts spanning every rank, a third
    streaming and leaving after their first event: every finished answer has its length,
    and at the end no page or draft-state slot is held."""
    _, cfg, _ = cp_checkpoint
    server, served = spec_cp
    engine = server.engine
    rng = np.random.default_rng(13)
    lengths = [
        int(rng.integers(20, 40)) if i % 4 else int(rng.integers(200, 260)) for i in range(12)
    ]
    jobs = [(rng.integers(3, cfg.vocab_size, n).tolist(), i) for i, n in enumerate(lengths)]
    problems = client_wave(served.url, jobs)
    assert not problems, problems
    assert settled_held_pages(engine) == 0
    assert engine.spec is not None and engine.spec.free_slots == engine.spec.num_slots
    assert engine.step_shapes <= engine.reachable_shapes()
