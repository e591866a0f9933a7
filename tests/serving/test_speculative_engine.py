"""Speculative decoding in the decode engine (issue 39; `serving.decode.speculative`): the
unified engine with `--disable-radix-cache` drafting with the MTP layer must emit
exactly what the plain engine emits, tokens and log-probs (bitwise under batch-invariant
numerics: the FP8 checkpoint's engines; within 1e-5 under the default numerics: the
others', `support.speculative_engine.EXACT`), for both architectures and the FP8
checkpoint, with requests joining and leaving the batch, stopping inside a step's
accepted drafts, and being aborted mid-step; every page and draft-state slot comes back.
The oracle that makes steps accept every count of drafts, and the other helpers:
`tests/support/speculative_engine.py`; the DP mesh: `test_speculative_dp.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from support import speculative_engine as se
from support.speculative_engine import (
    EXACT,
    LENGTHS,
    PAGES,
    ROWS,
    P,
    assert_same,
    assert_scores_close,
    assert_top_close,
    install_oracle,
    make_engine,
    record_first_drafts,
    requests,
    run,
    with_stop_tokens,
)
from support.transfer import random_pages

from cpkv_jax.errors import ConfigError, InputError
from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.model.kv_cache import DTYPES, init_pool
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.model.weights import load_model
from cpkv_jax.paging import PageAllocator
from serving.decode.cached import CachedUnifiedEngine
from serving.decode.engine import DecodeEngine
from serving.decode.speculative import SPEC_FORMS
from serving.engine.api import EngineStateLostError, GenerateRequest, Grammar, SamplingParams
from serving.prefill.build import build_prefill_engine
from serving.server_args import ServerArgs
from transfer.page_plan import LayoutDescriptor, page_digests
from transfer.protocol import Aux, RoomState
from transfer.receiver import Receiver

pytestmark = pytest.mark.slow(seconds=150)  # one worker, 2026-12-05

loaded, plain = se.loaded, se.plain  # the module-scoped fixtures

CASES = [("glm", 3), ("glm-fp8", 1), ("dsv32", 2)]
REGEX = Grammar("regex", "[ab]+")


@pytest.mark.parametrize(("ckpt", "k"), CASES)
def test_speculative_engine_emits_the_plain_engines_tokens_and_log_probs(loaded, plain, ckpt, k):
    cfg, model = loaded(ckpt)
    exact = ckpt in EXACT
    engine = make_engine(cfg, model, k, exact=exact)
    free0 = engine.kv.num_free_pages
    # Random drafts: (almost) every step accepts nothing.
    assert_same(run(engine, requests(cfg)), plain(ckpt), exact=exact)
    assert len(plain(ckpt)["r1"][4]) == len(plain(ckpt)["r1"][0])  # r1's top 3, each token
    # Oracle drafts, two requests stopping at a stop token: multi-token steps.
    want = plain(ckpt, stop=True)
    accepted = install_oracle(engine, {rid: o[0] for rid, o in plain(ckpt).items()}, k)
    got = run(engine, with_stop_tokens(requests(cfg), plain(ckpt)))
    assert_same(got, want, exact=exact)
    assert set(accepted) == set(range(k + 1)), accepted
    for rid, (tokens, _, _, meta, _) in got.items():
        assert meta["spec_verify_ct"] >= 1, rid
        assert meta["spec_accept_length"] >= len(tokens) / (meta["spec_verify_ct"] + 1), rid
    assert engine.kv.num_free_pages == free0 and engine.spec.free_slots == ROWS
    assert {s[0] for s in engine.step_shapes} <= {*SPEC_FORMS, "spec_prefill_greedy"}
    assert engine.step_shapes <= engine.reachable_shapes()


def test_penalties_count_the_drafts_a_step_accepts(loaded, plain):
    """A penalized row's target at each verified position counts the drafts before it as
    emitted (`Penalties.scores`): with its whole continuation as drafts, r3's first step
    verifies three more 11s after its first and must count them to stop at the fourth
    (mutation-checked: counting only the outputs before the step fails here), and r4's
    repetition penalty and logit bias hold inside multi-token steps."""
    cfg, model = loaded("glm")
    engine = make_engine(cfg, model, 3)
    reqs = requests(cfg)[3:]
    assert plain("glm")["r3"][0][:5] == [11] * 4 + [28]  # the bias's token, 4 times, then not
    accepted = install_oracle(engine, {r.rid: plain("glm")[r.rid][0] for r in reqs}, 3, False)
    assert_same(run(engine, reqs), {r.rid: plain("glm")[r.rid] for r in reqs}, exact=False)
    assert max(accepted) == 3


def test_sampled_rows_depend_on_their_seed_alone_and_greedy_rows_stay_exact(loaded, plain):
    """A batch with a sampled row runs the sampled variant, in which the greedy rows'
    distributions are one-hot: they must still emit the plain greedy tokens; a sampled
    request's tokens depend on its seed, not on its batch."""
    cfg, model = loaded("glm")
    engine = make_engine(cfg, model, 2)
    reqs = requests(cfg)
    sampled = dataclasses.replace(
        reqs[1],
        rid="s",
        sampling=dataclasses.replace(reqs[1].sampling, temperature=0.8, seed=11),
    )
    mixed = run(engine, [reqs[0], sampled, reqs[2]])
    want = {k: plain("glm")[k] for k in ("r0", "r2")}
    assert_same({k: v for k, v in mixed.items() if k != "s"}, want, exact=False)
    alone = run(engine, [dataclasses.replace(sampled, rid="s")])
    assert_same({"s": alone["s"]}, {"s": mixed["s"]}, exact=False)  # its batch's rounding
    assert len(mixed["s"][0]) == sampled.sampling.max_new_tokens
    assert alone["s"][0] != plain("glm")["r1"][0][: len(alone["s"][0])]  # it did sample


def test_aborts_mid_step_and_refusals_leave_nothing_held(loaded):
    cfg, model = loaded("glm")
    engine = make_engine(cfg, model, 3)
    free0 = engine.kv.num_free_pages
    reqs = requests(cfg, seed=5)
    out = run(engine, reqs, abort_after={"r0": 2, "r3": 0, "r4": 1})
    assert out["r0"][2] == out["r3"][2] == out["r4"][2] == "abort"
    assert out["r1"][2] == out["r2"][2] == "length"
    assert engine.kv.num_free_pages == free0 and engine.spec.free_slots == ROWS
    r = requests(cfg)[0]
    bad = dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, grammar=REGEX))
    with pytest.raises(InputError, match="grammar"):
        engine.add(bad)
    assert not engine.has_work() and engine.kv.num_free_pages == free0


def _with_prompt_scores(engine: DecodeEngine, reqs) -> dict:
    """rid -> (tokens, log-probs, prompt log-probs, prompt top log-probs)."""
    for r in reqs:
        engine.add(r)
    out: dict = {r.rid: [[], [], None, None] for r in reqs}
    for _ in range(200):
        for c in engine.step():
            o = out[c.rid]
            o[0] += c.token_ids
            o[1] += c.logprobs or ()
            if c.prompt_logprobs is not None:
                o[2], o[3] = c.prompt_logprobs, c.prompt_top_logprobs
        if not engine.has_work():
            return out
    raise AssertionError(f"requests did not finish: {out}")


def test_prompt_log_probs_are_the_plain_engines(loaded):
    """Prompt log-probs (`echo` with `logprobs`, `logprob_start_len`) on the speculative
    engine that prefills with its own admission program: its scoring twin scores every
    fed token from the trunk's hidden states, in the same program that drafts. The plain
    engine's within `LOGPROB_TOL` (bitwise under batch-invariant numerics: the DP prefix
    cache test), beside a request that asks for none in the same admissions;
    `--warmup-prompt-scoring` has the twins to compile."""
    cfg, model = loaded("glm")
    base = requests(cfg)[:3]
    reqs = [
        dataclasses.replace(base[0], prompt_logprobs_from=0),
        dataclasses.replace(base[1], prompt_logprobs_from=17),  # and top 3 at each
        base[2],
    ]
    spec = make_engine(cfg, model, 3)  # the programs `CASES` compiled for "glm"
    jobs = spec.score_compile_jobs()  # one twin per reachable prefill shape
    got = _with_prompt_scores(spec, reqs)
    assert len(spec.score_compile_jobs()) == len(jobs) - 1  # the twin it ran is compiled
    want = _with_prompt_scores(make_engine(cfg, model, 0), reqs)
    for r in reqs:
        g, w = got[r.rid], want[r.rid]
        assert g[0] == w[0], r.rid
        assert_scores_close(g[1], w[1], r.rid)
        assert_scores_close(g[2], w[2], r.rid)  # None for token 0
        assert_top_close(g[3], w[3], r.rid)
    assert got["r0"][2][0] is None and len(got["r0"][2]) == LENGTHS[0]
    assert len(got["r1"][2]) == LENGTHS[1] - 17 and all(len(t) == 3 for t in got["r1"][3])
    assert got["r2"][2] is None
    assert not {s for s in spec.step_shapes if "score" in s[0]}  # twins counted apart


def test_requests_beyond_the_draft_state_slots_wait_for_one(loaded, plain):
    cfg, model = loaded("glm")
    engine = make_engine(cfg, model, 1, speculative_slots=2)
    running = []
    step = engine.step

    def counted():
        running.append(len(engine.running))
        return step()

    engine.step = counted
    assert_same(run(engine, requests(cfg)), plain("glm"), exact=False)
    assert max(running) == 2 and engine.spec.free_slots == 2


def test_speculative_engine_refuses_a_model_without_its_mtp_layer(loaded, tiny_checkpoints):
    cfg, _ = loaded("glm")
    _, trunk_only = load_model(tiny_checkpoints("glm_moe_dsa"))
    with pytest.raises(ConfigError, match="MTP layer"):
        make_engine(cfg, trunk_only, 1)


def cached_engine(cfg, model, k: int, *extra: str, pages: int = PAGES) -> DecodeEngine:
    """The unified server's default engine (prefix cache, chunked CP prefill at cp 1)
    drafting `k` tokens per step: its CP runner runs the MTP layer over the prompts."""
    args = ServerArgs.from_cli(
        [
            "--model-path", "unused", "--page-size", str(P), "--index-k-dtype", "fp8_e4m3",
            "--dtype", "float32", "--chunked-prefill-size", "32",
            "--kv-pool-size", str(pages * pool_page_bytes_for(cfg)),
            "--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(k), *extra,
        ]
    )  # fmt: skip
    prefill = build_prefill_engine(args, model=model, devices=jax.devices()[:1], hold_finished=True)
    return CachedUnifiedEngine(
        prefill=prefill, cfg=cfg, model=model, page_size=P, index_k_dtype="fp8_e4m3",
        max_running_requests=ROWS, speculative_num_steps=k,
    )  # fmt: skip


def pool_page_bytes_for(cfg) -> int:
    layout = PoolLayout(1, False, 2, P)
    return per_rank_pool_bytes(mtp_config(cfg), layout, DTYPES["float32"], "fp8_e4m3") // 2


def test_the_prefix_cache_engine_drafts_and_decodes_as_the_whole_prompt_engine(loaded, plain):
    """The default unified engine's CP runner writes the MTP layer's KV while it
    prefills (chunks of 32 tokens here): its first drafts equal those of the engine that
    prefills whole prompts, its outputs the plain engine's; a prompt sharing a cached
    prefix decodes exactly too (its drafts may differ: the MTP KV at the prefix's last
    position was computed with the earlier prompt's next token, which only costs
    acceptance)."""
    cfg, model = loaded("glm")
    whole, cached = make_engine(cfg, model, 2), cached_engine(cfg, model, 2)
    want_drafts = record_first_drafts(whole, "prefill_many")
    got_drafts = record_first_drafts(cached, "admit_after_prefill")
    assert_same(run(whole, requests(cfg)), plain("glm"), exact=False)
    free0 = cached.kv.num_free_pages
    assert_same(run(cached, requests(cfg)), plain("glm"), exact=False)
    assert got_drafts == want_drafts and len(got_drafts) == len(LENGTHS)
    r0 = requests(cfg)[0]
    hit = dataclasses.replace(r0, rid="hit", input_ids=(*r0.input_ids[:48], 7, 8, 9))
    got = run(cached, [hit])
    want = run(make_engine(cfg, model, 0), [hit])
    assert_same(got, want, exact=False)
    assert got["hit"][3]["cached_tokens"] == 48
    cached.cached.scheduler.cache.reset()
    assert cached.kv.num_free_pages >= free0 and cached.spec.free_slots == ROWS


def test_a_prompt_back_from_the_host_cache_drafts_as_the_whole_prompt_engine(loaded, plain):
    """`--enable-hierarchical-cache` with speculative decoding: the host cache keeps the
    MTP layer's KV with the trunk's (one more layer of its pools). A prompt pushed off a
    small device pool and served again from the host decodes exactly, and its first
    drafts - read from the MTP KV that came back - equal the whole-prompt engine's."""
    cfg, model = loaded("glm")
    host = ("--enable-hierarchical-cache", "--hicache-ratio", "4")
    cached = cached_engine(cfg, model, 2, *host, pages=16)
    whole = make_engine(cfg, model, 2)
    want_drafts = record_first_drafts(whole, "prefill_many")
    got_drafts = record_first_drafts(cached, "admit_after_prefill")
    rng = np.random.default_rng(21)

    def req(rid: str, ids) -> GenerateRequest:
        sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
        return GenerateRequest(rid, tuple(int(t) for t in ids), sp, return_logprob=True)

    long = rng.integers(3, cfg.vocab_size, 6 * P + 3).tolist()
    first = run(cached, [req("first", long)])
    cached.scheduler.sync_host_cache(wait=True)
    for i in range(2):  # push `long` off the 15-page device pool (the host keeps it)
        run(cached, [req(f"other{i}", rng.integers(3, cfg.vocab_size, 8 * P + 5))])
        cached.scheduler.sync_host_cache(wait=True)
    m = cached.prefill.cache.match_prefix(np.asarray(long[:-1], np.int32))
    assert m.host_num_tokens > 0, cached.prefill.cache.pretty()
    got_drafts.clear()
    again = run(cached, [req("again", long)])
    assert again["again"][3]["cached_tokens_host"] > 0
    assert_same({"r": again["again"]}, {"r": first["first"]}, exact=False)
    want = run(whole, [req("want", long)])
    assert_same({"again": again["again"]}, {"again": want["want"]}, exact=False)
    assert got_drafts == {len(long): want_drafts[len(long)]}


def test_a_failed_step_fails_its_requests_and_a_lost_draft_state_stops_the_engine(loaded):
    """A speculative step that raises before donating anything fails the requests it
    served, frees their pages and slots, and the engine serves on; one that lost the
    donated draft state raises `EngineStateLostError` (the server exits for a restart)."""
    cfg, model = loaded("glm")
    engine = make_engine(cfg, model, 1)
    free0 = engine.kv.num_free_pages
    step = engine.spec.step
    fail = {"on": True}

    def flaky(rows, greedy):
        if fail["on"]:
            raise RuntimeError("injected")
        return step(rows, greedy)

    engine.spec.step = flaky
    out = run(engine, requests(cfg)[:2])
    assert {o[2] for o in out.values()} == {"error"}
    assert engine.kv.num_free_pages == free0 and engine.spec.free_slots == ROWS
    fail["on"] = False
    assert {o[2] for o in run(engine, requests(cfg)[:2]).values()} == {"length"}

    def lossy(rows, greedy):
        engine.spec.slab.token.delete()  # as if donated to a step that never returned
        raise RuntimeError("injected after donation")

    engine.spec.step = lossy
    engine.add(requests(cfg)[0])
    with pytest.raises(EngineStateLostError, match="draft state"):
        for _ in range(10):
            engine.step()


def test_a_decode_server_refuses_to_draft_without_the_prefills_hidden_state(loaded):
    """A PD decode engine that drafts (issue 39 item 3) needs the trunk's last hidden
    state in the room's aux data: a room that commits without it, or with one of another
    model's size, fails that request with the reason (start the prefill server with the
    same flags), and its pages and draft-state slot come back; the engine serves on."""
    cfg, model = loaded("glm")
    layout = LayoutDescriptor.from_model(mtp_config(cfg), P, "float32", "fp8_e4m3")
    pool = init_pool(mtp_config(cfg), PAGES, P, np.float32, "fp8_e4m3")
    rx = Receiver(layout, pool, PageAllocator(PAGES))
    engine = DecodeEngine(
        cfg=cfg, model=model, kv=rx, page_size=P, index_k_dtype="fp8_e4m3", mode="decode",
        max_running_requests=ROWS, speculative_num_steps=2,
    )  # fmt: skip
    free0 = rx.num_free_pages
    ids = tuple(range(3, 3 + 2 * P))
    cases = {"none": None, "short": np.ones(cfg.hidden_size - 1, np.float32)}
    for rid in cases:
        sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
        engine.add(GenerateRequest(rid, ids, sp, bootstrap_room=rid, bootstrap_cp_size=1))
    for rid, hidden in cases.items():
        data = random_pages(layout, 2, seed=1)
        positions = np.arange(2)
        assert rx.handshake(rid, 0, 1, len(ids), layout).accepted
        for b, (kind, layer) in enumerate(layout.buffers()):
            digests, raw = page_digests(data[b]), data[b].tobytes()
            rx.write_pages(rid, 0, 0, kind, layer, positions, digests, raw)
        aux = Aux.with_hidden(hidden, first_token=5, logprob=-1.0)
        assert rx.commit(rid, 0, 0, positions, aux).state is RoomState.SUCCESS
    final: dict = {}
    for _ in range(50):
        final |= {c.rid: c for c in engine.step() if c.finished}
        if len(final) == len(cases) and not engine.has_work():
            break
    assert final["none"].finish_reason == "error", final
    assert "sent no hidden state" in final["none"].error
    assert "same --speculative-algorithm" in final["none"].error
    assert final["short"].finish_reason == "error"
    assert "different models" in final["short"].error
    assert rx.num_free_pages == free0
    assert engine.spec is not None and engine.spec.free_slots == engine.spec.num_slots
