"""A unified server on a CP8 mesh (issue 40): `cpkv-serve --cp-size 8
--enable-cp-shared-kv --ep-size 8` prefills through the prefix cache's CP scheduler and
decodes on the same page-owned pools (`CPMeshDecodeSteps`, owner attention), so a
request's KV is striped over the eight ranks from its first token to its last, with no
transfer and no gathered copy.

The server is built and served here as `cpkv-serve` builds it (the model loaded onto
the mesh with its experts split, the warm-up, HTTP). Its pool holds 6 usable pages per
rank; the long prompt needs 35, so one rank could never hold it. Greedy tokens must equal
`ReferenceGenerator`'s on one device exactly and log-probs within 1e-5 (rank-sized
matmuls and the log-sum-exp merge of the ranks' partial attention round differently in
the last bits; `tests/core/test_cp_decode.py` states the same tolerance). With
`--enable-batch-invariant` (and drafting) the answers are one device's batch-invariant
ones bit for bit.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import pytest
from support.prefill_server import P
from support.unified_server import (
    assert_greedy_reference,
    client_wave,
    cp_group_args,
    generate_with_logprobs,
    serving,
    settled_held_pages,
)

from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.model.weights import load_model
from cpkv_jax.owner_attention import OwnerCPKVIO
from serving.decode.cached import CachedUnifiedEngine
from serving.decode.speculative import SpeculativeSteps
from serving.decode.steps import CPMeshDecodeSteps

pytestmark = pytest.mark.slow(seconds=60)

CP = 8
PAGES_PER_RANK = 7  # 6 usable and the trash page
LONG = 33 * P + 5  # 35 pages with its output: more than one rank's 6
WAIT_S = 300.0


@pytest.fixture(scope="module")
def unified_cp(cp_checkpoint):
    path, cfg, _ = cp_checkpoint
    with serving(cp_group_args(path, cfg, CP, PAGES_PER_RANK)) as s:
        yield s


def test_a_prompt_longer_than_one_rank_s_pool_decodes_where_its_pages_live(
    unified_cp, cp_checkpoint
):
    """The long request and two short ones of other lengths at once (rows join and leave
    the batch as they finish), then the long prompt again: its whole pages come from the
    prefix cache, striped as before. Every page is back (free or cached) at the end."""
    _, cfg, ref = cp_checkpoint
    server, served = unified_cp
    engine = server.engine
    assert isinstance(engine, CachedUnifiedEngine)
    assert isinstance(engine.steps, CPMeshDecodeSteps)
    info = httpx.get(served.url + "/server_info", timeout=WAIT_S).json()
    assert info["mode"] == "null" and info["cp_size"] == CP and info["shared_kv"]
    usable = CP * (PAGES_PER_RANK - 1)
    assert engine.stats().kv_pages_total == (usable,)
    rng = np.random.default_rng(7)
    jobs = [
        (rng.integers(3, cfg.vocab_size, n).tolist(), new)
        for n, new in ((LONG, 6), (P + 1, 3), (5, 9))
    ]
    assert -(-(LONG + 6) // P) > PAGES_PER_RANK - 1  # one rank could not hold it
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(
            pool.map(
                lambda job: generate_with_logprobs(served.url, *job, temperature=0.0).json(), jobs
            )
        )
    for out, (ids, new) in zip(outs, jobs, strict=True):
        assert_greedy_reference(out, ref, ids, new)
        assert out["meta_info"]["cached_tokens"] == 0
    # The long prompt fills ranks 0-2's pools: a short request that comes after it takes
    # its rank-0 page by evicting the long prompt's last cached page (logical page 32),
    # one that comes before it leaves the whole prompt cached. Which one came first is
    # the clients' race, so the first repeat hits 32 or 33 pages; it caches all 33 again,
    # and with nothing else running the second repeat hits every whole page.
    whole = (LONG // P) * P
    for hit in ((whole - P, whole), (whole,)):
        again = generate_with_logprobs(served.url, jobs[0][0], 6, temperature=0.0).json()
        assert_greedy_reference(again, ref, *jobs[0])
        assert again["meta_info"]["cached_tokens"] in hit  # whole pages only
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0
    assert stats.kv_pages_free[0] + stats.kv_pages_cached[0] == usable
    # Every decode step ran a shape the engine's warm-up accounting knows.
    assert engine.step_shapes <= engine.reachable_shapes()


def test_many_clients_with_disconnects_and_a_refusal_leave_every_page(unified_cp, cp_checkpoint):
    """16 clients at once on the CP mesh, sampled and greedy, some with long prompts
    (pages on every rank), a third streaming and leaving after their first event, and
    one prompt longer than the whole CP pool, refused with a 400 before anything is
    allocated: every finished answer has its length, and at the end no page is held."""
    _, cfg, _ = cp_checkpoint
    server, served = unified_cp
    engine = server.engine
    rng = np.random.default_rng(12)
    # Prompts of two prefill lengths' buckets (fewer CP step shapes to compile here).
    lengths = [
        int(rng.integers(20, 40)) if i % 4 else int(rng.integers(200, 260)) for i in range(16)
    ]
    jobs = [(rng.integers(3, cfg.vocab_size, n).tolist(), i) for i, n in enumerate(lengths)]

    async def too_long(client: httpx.AsyncClient) -> str | None:
        ids = rng.integers(3, cfg.vocab_size, CP * (PAGES_PER_RANK - 1) * P).tolist()
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
        r = await client.post("/generate", json=body)
        refused = r.status_code == 400 and "whole pool" in r.text  # not the context: 4096
        return None if refused else f"too long: {r.status_code} {r.text}"

    problems = client_wave(served.url, jobs, extra=[too_long])
    assert not problems, problems

    assert settled_held_pages(engine) == 0
    assert engine.step_shapes <= engine.reachable_shapes()


def test_batch_invariant_numerics_answer_bit_for_bit(cp_checkpoint):
    """`--enable-batch-invariant` (issue 40's bitwise acceptance), drafting with the MTP
    layer (K = 2): the full-view CP prefill, chunked, and verify steps that put each
    row's view together on its rank answer as one device's plain batch-invariant
    generation bit for bit - tokens and log-probs - for the long request (striped over
    every rank) beside a short one. (The plain CP decode steps' bits:
    tests/core/test_cp_decode.py.)"""
    path, cfg, _ = cp_checkpoint
    _, model = load_model(path, progress=False)
    ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype="float32", batch_invariant=True)
    rng = np.random.default_rng(12)
    jobs = [
        (rng.integers(3, cfg.vocab_size, n).tolist(), new) for n, new in ((LONG, 5), (P + 3, 7))
    ]
    drafting = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2")
    pages = PAGES_PER_RANK + 1  # the drafts' room
    args = cp_group_args(path, mtp_config(cfg), CP, pages, "--enable-batch-invariant", *drafting)
    with serving(args) as (server, served):
        spec = server.engine.spec
        assert isinstance(spec, SpeculativeSteps) and spec.cp == CP
        assert not isinstance(spec.cp_decoder.kv_io, OwnerCPKVIO)
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            outs = list(
                pool.map(
                    lambda job: generate_with_logprobs(served.url, *job, temperature=0.0).json(),
                    jobs,
                )
            )
    for out, (ids, new) in zip(outs, jobs, strict=True):
        want = ref.generate(ids, new, ignore_eos=True)
        assert out["output_ids"] == want.output_ids
        assert [
            lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]
        ] == want.output_logprobs
