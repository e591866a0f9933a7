"""Speculative decoding in the decode engine (issue 39; `serving.decode.speculative`): the
unified engine with `--disable-radix-cache` drafting with the MTP layer must emit exactly
what the plain engine emits, tokens and log-probs (bitwise under batch-invariant
numerics), for both architectures and the FP8 checkpoint, with requests joining and
leaving the batch, stopping inside a step's accepted drafts, and being aborted mid-step;
every page and draft-state slot comes back.

The tiny checkpoints' MTP layers are random, so their drafts are almost never accepted.
The oracle wraps the engine's step: before each step it replaces the drafts in the
device state with the plain engine's continuation, corrupted at a place that moves with
the step and the row, so steps accept every count from 0 to K and rows of one step accept
different counts (the positions come from the device state itself, so the overlap stays
on).
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import numpy as np
import pytest
from support.transfer import random_pages

from cpkv_jax.decode_mesh import DPPoolLayout, init_dp_pool
from cpkv_jax.errors import ConfigError, InputError
from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.kv_store import PagedKVStore
from cpkv_jax.mesh import make_dp_mesh
from cpkv_jax.model.kv_cache import DTYPES, init_pool
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.model.weights import load_model
from cpkv_jax.paging import PageAllocator
from serving.decode.cached import CachedUnifiedEngine
from serving.decode.engine import DecodeEngine, whole_prompt_engine
from serving.decode.speculative import SPEC_FORMS
from serving.engine.api import EngineStateLostError, GenerateRequest, SamplingParams
from serving.prefill.build import build_prefill_engine
from serving.server_args import ServerArgs
from transfer.page_plan import LayoutDescriptor, page_digests
from transfer.protocol import Aux, RoomState
from transfer.receiver import Receiver

pytestmark = pytest.mark.slow(seconds=150)  # one worker, 2026-12-05

P = 16
PAGES = 64
ROWS = 4
# Five requests for four rows (one waits for a slot), all in one prefill bucket (64) and,
# with the speculative room, one page-table width (8 pages): few shapes to compile.
LENGTHS = (50, 53, 57, 51, 60)
CHECKPOINTS = {
    "glm": ("glm_moe_dsa", {}),
    "glm-fp8": ("glm_moe_dsa", {"fp8": True}),
    "dsv32": ("deepseek_v32", {}),
}
CASES = [("glm", 3), ("glm-fp8", 1), ("dsv32", 2)]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    """`get(checkpoint) -> (cfg, model)` with its MTP layer, loaded once."""
    out: dict = {}

    def get(ckpt: str):
        if ckpt not in out:
            arch, kw = CHECKPOINTS[ckpt]
            out[ckpt] = load_model(tiny_checkpoints(arch, **kw), mtp=True)
        return out[ckpt]

    return get


def make_engine(cfg, model, k: int, **kw) -> DecodeEngine:
    return whole_prompt_engine(
        cfg, model, pages=PAGES, page_size=P, index_k_dtype="fp8_e4m3",
        max_running_requests=ROWS, batch_invariant=True, speculative_num_steps=k, **kw,
    )  # fmt: skip


def requests(cfg, seed: int = 3, **sampling) -> list[GenerateRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = tuple(rng.integers(3, cfg.vocab_size, n).tolist())
        sp = SamplingParams(max_new_tokens=10 + 2 * i, ignore_eos=True, **sampling)
        out.append(GenerateRequest(f"r{i}", ids, sp, return_logprob=True))
    return out


def run(engine: DecodeEngine, reqs, abort_after: dict[str, int] | None = None) -> dict:
    """rid -> (tokens, log-probs, finish reason, meta); `abort_after`: rid -> the engine
    step after which that request is aborted."""
    for r in reqs:
        engine.add(r)
    out: dict = {r.rid: [[], [], None, None] for r in reqs}
    for n in range(400):
        for c in engine.step():
            o = out[c.rid]
            o[0] += c.token_ids
            o[1] += c.logprobs or ()
            if c.finished:
                o[2], o[3] = c.finish_reason, c.meta
        for rid, at in (abort_after or {}).items():
            if at == n:
                engine.abort(rid)
        if all(o[2] is not None for o in out.values()) and not engine.has_work():
            return out
    raise AssertionError(f"requests did not finish: {out}")


def with_stop_tokens(reqs, plain: dict) -> list[GenerateRequest]:
    """The same requests, two of them stopping at a token of their plain continuation
    (inside a step's accepted drafts once the oracle makes them accepted)."""
    out = []
    for i, r in enumerate(reqs):
        sp = r.sampling
        if i in (0, 2):
            stop = plain[r.rid][0][5 + i]
            sp = dataclasses.replace(sp, stop_token_ids=(stop,), ignore_eos=False)
        out.append(dataclasses.replace(r, sampling=sp))
    return out


def install_oracle(engine: DecodeEngine, truth: dict[str, list[int]], k: int) -> list[int]:
    """Replace each step's drafts by the plain continuation, corrupted at `(step + row)
    mod (k + 1)` (k: none corrupted); returns the list the accepted counts go to."""
    spec = engine.spec
    assert spec is not None
    step_fn, steps = spec.step, [0]
    accepted: list[int] = []

    def step(rows, greedy):
        by_slot = {r.slot: r for r in engine.running.values()}
        slab = spec.slab
        pos, drafts = (np.array(a) for a in jax.device_get((slab.pos, slab.drafts)))
        for i, (slot, _, _) in enumerate(rows):
            r = by_slot[slot]
            start = int(pos[slot]) + 1 - len(r.prompt)  # output index of position pos + 1
            true = truth[r.rid][start : start + k]
            if len(true) == k:
                drafts[slot] = true
                bad = (steps[0] + i) % (k + 1)
                if bad < k:
                    drafts[slot, bad] = (drafts[slot, bad] + 1) % engine.cfg.vocab_size
        spec.slab = dataclasses.replace(slab, drafts=jax.device_put(drafts, slab.drafts.sharding))
        steps[0] += 1
        out = step_fn(rows, greedy)
        accepted.extend(np.asarray(out.accepted)[: len(rows)].tolist())
        return out

    spec.step = step
    return accepted


@pytest.fixture(scope="module")
def plain(loaded):
    """`get(checkpoint, stop: bool)` -> the plain engine's outputs of `requests`."""
    out: dict = {}

    def get(ckpt: str, stop: bool = False):
        if (ckpt, stop) not in out:
            cfg, model = loaded(ckpt)
            reqs = requests(cfg)
            if stop:
                reqs = with_stop_tokens(reqs, get(ckpt))
            out[ckpt, stop] = run(make_engine(cfg, model, 0), reqs)
        return out[ckpt, stop]

    return get


def assert_same(got: dict, want: dict) -> None:
    for rid, w in want.items():
        g = got[rid]
        assert g[0] == w[0], rid
        np.testing.assert_array_equal(g[1], w[1], err_msg=rid)  # bitwise
        assert g[2] == w[2], rid


@pytest.mark.parametrize(("ckpt", "k"), CASES)
def test_speculative_engine_emits_the_plain_engines_tokens_and_log_probs(loaded, plain, ckpt, k):
    cfg, model = loaded(ckpt)
    engine = make_engine(cfg, model, k)
    free0 = engine.kv.num_free_pages
    # Random drafts: (almost) every step accepts nothing.
    assert_same(run(engine, requests(cfg)), plain(ckpt))
    # Oracle drafts, two requests stopping at a stop token: multi-token steps.
    want = plain(ckpt, stop=True)
    accepted = install_oracle(engine, {rid: o[0] for rid, o in plain(ckpt).items()}, k)
    got = run(engine, with_stop_tokens(requests(cfg), plain(ckpt)))
    assert_same(got, want)
    assert set(accepted) == set(range(k + 1)), accepted
    for rid, (tokens, _, _, meta) in got.items():
        assert meta["spec_verify_ct"] >= 1, rid
        assert meta["spec_accept_length"] >= len(tokens) / (meta["spec_verify_ct"] + 1), rid
    assert engine.kv.num_free_pages == free0 and engine.spec.free_slots == ROWS
    assert {s[0] for s in engine.step_shapes} <= {*SPEC_FORMS, "spec_prefill_greedy"}
    assert engine.step_shapes <= engine.reachable_shapes()


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
    assert_same(
        {k: v for k, v in mixed.items() if k != "s"}, {k: plain("glm")[k] for k in ("r0", "r2")}
    )
    alone = run(engine, [dataclasses.replace(sampled, rid="s")])
    assert alone["s"][0] == mixed["s"][0]
    assert alone["s"][1] == mixed["s"][1]
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
    for field, value in (("repetition_penalty", 1.2), ("presence_penalty", 0.5)):
        bad = dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, **{field: value}))
        with pytest.raises(InputError, match=field):
            engine.add(bad)
    with pytest.raises(InputError, match="top_logprobs"):
        engine.add(dataclasses.replace(r, top_logprobs=2))
    assert not engine.has_work() and engine.kv.num_free_pages == free0


def test_requests_beyond_the_draft_state_slots_wait_for_one(loaded, plain):
    cfg, model = loaded("glm")
    engine = make_engine(cfg, model, 1, speculative_slots=2)
    running = []
    step = engine.step

    def counted():
        running.append(len(engine.running))
        return step()

    engine.step = counted
    assert_same(run(engine, requests(cfg)), plain("glm"))
    assert max(running) == 2 and engine.spec.free_slots == 2


def dp_engine(cfg, model, k: int, dp: int) -> DecodeEngine:
    """`make_engine` on a `("dp",)` mesh of `dp` devices (issue 36): the pool and the draft
    state split over the ranks, routed experts too (the tiny checkpoints' 8: 4 per rank)."""
    mesh = make_dp_mesh(dp, jax.devices())
    layout = DPPoolLayout(dp, PAGES // dp, P)
    pool = init_dp_pool(mtp_config(cfg), layout, mesh, np.float32, "fp8_e4m3")
    return DecodeEngine(
        cfg=cfg, model=model, kv=PagedKVStore(pool, PageAllocator(PAGES, ranks=dp)),
        page_size=P, index_k_dtype="fp8_e4m3", mode="null", max_running_requests=ROWS,
        batch_invariant=True, speculative_num_steps=k, mesh=mesh,
    )  # fmt: skip


@pytest.mark.parametrize(("ckpt", "k"), [("glm-fp8", 2), ("dsv32", 3)])
def test_speculative_decoding_on_a_dp_mesh_equals_one_device(loaded, plain, ckpt, k):
    """Issue 39 on issue 36's DP mesh (2 ranks): every speculative program runs on the
    rank holding the request's pages, in a draft-state slot of that rank. Greedy tokens
    and log-probs are bitwise the plain single-device engine's, with random and oracle
    drafts (every accepted count, stops inside accepted drafts); requests land on both
    ranks, prefills of two ranks share one program; a sampled row with top-p draws
    bitwise what it draws on one device (same seed); every page and slot comes back."""
    cfg, model = loaded(ckpt)
    engine = dp_engine(cfg, model, k, 2)
    free0 = engine.kv.num_free_pages
    prefills = []
    prefill_many = engine.spec.prefill_many
    engine.spec.prefill_many = lambda reqs: prefills.append(len(reqs)) or prefill_many(reqs)
    assert_same(run(engine, requests(cfg)), plain(ckpt))
    assert all(n > 0 for n in engine.admitted_per_rank) and max(prefills) == 2
    accepted = install_oracle(engine, {rid: o[0] for rid, o in plain(ckpt).items()}, k)
    assert_same(run(engine, with_stop_tokens(requests(cfg), plain(ckpt))), plain(ckpt, True))
    assert set(accepted) == set(range(k + 1)), accepted
    assert engine.kv.num_free_pages == free0 and engine.spec.free_slots == ROWS
    assert engine.step_shapes <= engine.reachable_shapes()
    assert {s[1] for s in engine.step_shapes if s[0] in SPEC_FORMS} == {1, 2}  # rows per rank
    if ckpt != "dsv32":
        return
    reqs = requests(cfg, seed=4)[:3]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.8, seed=5)
    reqs[1] = dataclasses.replace(reqs[1], sampling=sp)
    want = run(make_engine(cfg, model, k), reqs)
    del engine.spec.step  # the oracle's wrapper: random drafts again
    got = run(engine, reqs)
    assert_same(got, want)
    assert got["r1"][0] != plain(ckpt)["r1"][0][:12]  # it did sample


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
            "--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(k),
            "--enable-batch-invariant", *extra,
        ]
    )  # fmt: skip
    prefill = build_prefill_engine(args, model=model, devices=jax.devices()[:1], hold_finished=True)
    return CachedUnifiedEngine(
        prefill=prefill, cfg=cfg, model=model, page_size=P, index_k_dtype="fp8_e4m3",
        max_running_requests=ROWS, batch_invariant=True, speculative_num_steps=k,
    )  # fmt: skip


def pool_page_bytes_for(cfg) -> int:
    layout = PoolLayout(1, False, 2, P)
    return per_rank_pool_bytes(mtp_config(cfg), layout, DTYPES["float32"], "fp8_e4m3") // 2


def record_first_drafts(engine: DecodeEngine, method: str) -> dict[int, list[int]]:
    """Prompt length -> the drafts an admission (`SpeculativeSteps.<method>`) wrote."""
    spec = engine.spec
    assert spec is not None
    admit, seen = getattr(spec, method), {}

    def recorded(*args):
        out = admit(*args)
        bound = inspect.signature(admit).bind(*args).arguments
        drafts = np.asarray(spec.slab.drafts)
        if "requests" in bound:  # `prefill_many`: (prompt, pages, width, slot, ...) each
            seen.update({len(a[0]): drafts[a[3]].tolist() for a in bound["requests"]})
        else:
            seen[bound["n"]] = drafts[bound["slot"]].tolist()
        return out

    setattr(spec, method, recorded)
    return seen


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
    assert_same(run(whole, requests(cfg)), plain("glm"))
    free0 = cached.kv.num_free_pages
    assert_same(run(cached, requests(cfg)), plain("glm"))
    assert got_drafts == want_drafts and len(got_drafts) == len(LENGTHS)
    r0 = requests(cfg)[0]
    hit = dataclasses.replace(r0, rid="hit", input_ids=(*r0.input_ids[:48], 7, 8, 9))
    got = run(cached, [hit])
    want = run(make_engine(cfg, model, 0), [hit])
    assert_same(got, want)
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
    assert again["again"][:3] == first["first"][:3]
    want = run(whole, [req("want", long)])
    assert_same({"again": again["again"]}, {"again": want["want"]})
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
