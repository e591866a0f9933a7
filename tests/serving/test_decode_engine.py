"""`serving.decode.engine.DecodeEngine`: continuous batching against the reference.

The oracle is `ReferenceGenerator` (single request, single device). Greedy tokens must
be equal exactly; log-probs within 1e-5 absolute: a batched decode row and the
reference's single row may differ in the last float32 bits on XLA:CPU (different
shapes, different reduction tiling), far below that bound on log-probs of order 1.

The model is the tiny config cut to two layers (a full and a shared indexer layer, a
dense and an MoE MLP). Every prompt pads to 16 tokens and every reservation to a 2-page
table, and every engine pool has the same page count, so the module compiles a handful
of programs.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.decode_model import INDEX_K, POOL_PAGES, P, two_layer_model

from cpkv_jax.buckets import pow2_at_least, prefill_bucket
from cpkv_jax.errors import InputError
from cpkv_jax.generate import ReferenceGenerator, prefill_batch
from cpkv_jax.kv_store import KVStore, PagedKVStore
from cpkv_jax.model.kv_cache import init_pool
from cpkv_jax.model.transformer import forward_step
from cpkv_jax.paging import PageAllocator, padded_page_table, pages_for_tokens
from cpkv_jax.sampling import RowSampling, StepLogits, sample
from serving.decode.engine import DecodeEngine
from serving.engine.api import EngineStats, GenerateRequest, SamplingParams, StepEngine
from serving.engine.wait_queue import QueueFullError
from serving.http.errors import error_body
from transfer.page_plan import LayoutDescriptor, page_digests
from transfer.protocol import Aux, RoomState, UnknownRoomError
from transfer.receiver import Receiver, staging_region_bytes
from transfer.staging_arena import DEFAULT_ALIGNMENT, StagingArena

# Among the longer files of the suite: scheduled early, longest first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=30)  # on 2 workers, 2026-12-05

LP_TOL = 1e-5  # see the module docstring

# (prompt length, max_new_tokens): a page multiple (16) and not; each one's decode
# crosses into its second page, so all share the prefill bucket and table width.
WAVE = [(16, 6), (11, 8), (5, 12), (13, 5), (16, 2)]
# Step at which each request of a wave is added: three together, then two joining a
# running batch (and one of them leaving early: max_new_tokens=2).
JOIN_AT = [0, 0, 0, 2, 4]


@pytest.fixture(scope="module")
def tiny():
    return two_layer_model()


def make_engine(tiny, num_pages=POOL_PAGES, **kw) -> tuple[DecodeEngine, PagedKVStore]:
    cfg, model, _ = tiny
    kv = PagedKVStore.create(cfg, num_pages, P, jnp.float32, INDEX_K)
    opts = dict(max_running_requests=8) | kw
    engine = DecodeEngine(
        cfg=cfg, model=model, kv=kv, page_size=P, index_k_dtype=INDEX_K, mode="null", **opts
    )
    return engine, kv


def wave_requests(seed: int, tag: str, **sampling) -> list[GenerateRequest]:
    rng = np.random.default_rng(seed)
    return [
        GenerateRequest(
            f"{tag}{i}",
            tuple(int(t) for t in rng.integers(3, 300, n)),
            SamplingParams(max_new_tokens=m, **sampling),
            return_logprob=True,
        )
        for i, (n, m) in enumerate(WAVE)
    ]


def run(engine, schedule: dict[int, list[GenerateRequest]], max_steps=200):
    """Add requests at their steps, step until idle; tokens, log-probs, final chunks."""
    toks: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    final = {}
    step = 0
    while step in schedule or engine.has_work():
        for r in schedule.get(step, []):
            engine.add(r)
        for c in engine.step():
            assert c.rid not in final, f"{c.rid} got a chunk after its final one"
            toks.setdefault(c.rid, []).extend(c.token_ids)
            lps.setdefault(c.rid, []).extend(c.logprobs or ())
            if c.finished:
                final[c.rid] = c
        step += 1
        assert step < max_steps
    return toks, lps, final


def check_against_reference(tiny, reqs, toks, lps, final):
    _, _, ref = tiny
    for r in reqs:
        want = ref.generate(
            r.input_ids, r.sampling.max_new_tokens, ignore_eos=r.sampling.ignore_eos
        )
        assert toks[r.rid] == want.output_ids, r.rid
        np.testing.assert_allclose(lps[r.rid], want.output_logprobs, rtol=0, atol=LP_TOL)
        f = final[r.rid]
        assert f.finish_reason == want.finish_reason
        assert f.meta["prompt_tokens"] == len(r.input_ids)
        assert f.meta["completion_tokens"] == len(want.output_ids)
        assert f.meta["cached_tokens"] == 0
        assert 0 <= f.meta["ttft_s"] <= f.meta["e2e_s"]


def test_continuous_batching_matches_reference_with_bounded_compiles(tiny):
    engine, kv = make_engine(tiny)
    assert isinstance(engine, StepEngine) and isinstance(kv, KVStore)
    free0 = kv.num_free_pages
    wave1 = wave_requests(1, "a", ignore_eos=True)
    sched = {}
    for r, s in zip(wave1, JOIN_AT, strict=True):
        sched.setdefault(s, []).append(r)
    toks, lps, final = run(engine, sched)
    check_against_reference(tiny, wave1, toks, lps, final)
    assert kv.num_free_pages == free0
    shapes = set(engine.step_shapes)
    # Decode rows and widths are powers of two; prefill lengths are `bucket`s.
    for form, rows, t, width in shapes:
        assert rows & (rows - 1) == 0 and width & (width - 1) == 0
        assert form == "absorbed" and (t == 1 or t == prefill_bucket(t))
    # A second wave (fresh prompts, eos honoured, same buckets and join pattern)
    # compiles nothing new.
    wave2 = wave_requests(2, "b")
    sched = {}
    for r, s in zip(wave2, JOIN_AT, strict=True):
        sched.setdefault(s, []).append(r)
    _, _, ref = tiny
    for r in wave2:  # the reference's own compiles happen before the count
        ref.generate(r.input_ids, r.sampling.max_new_tokens)
    compiled = set(engine.compiled_step_shapes)
    toks, lps, final = run(engine, sched)
    assert engine.compiled_step_shapes == compiled
    assert engine.step_shapes == shapes
    check_against_reference(tiny, wave2, toks, lps, final)
    assert kv.num_free_pages == free0


def test_chunked_prefill_on_one_device_equals_the_reference(tiny):
    """`prefill_chunk=16` (`--chunked-prefill-size` with `--disable-radix-cache`): a
    37-token prompt is fed over 3 steps from the positions its earlier chunks filled,
    while a running request decodes between them; both equal the reference, and no
    prefill step feeds more than a chunk. Then the same prompt, its log-probs asked, after
    the scoring twins compiled as `--warmup-prompt-scoring` compiles them."""
    engine, kv = make_engine(tiny, prefill_chunk=P)
    free0 = kv.num_free_pages
    rng = np.random.default_rng(9)
    reqs = [
        GenerateRequest(
            rid, tuple(int(t) for t in rng.integers(3, 300, n)),
            SamplingParams(max_new_tokens=m, ignore_eos=True), return_logprob=True,
        )
        for rid, n, m in (("short", 5, 8), ("long", 2 * P + 5, 4))
    ]  # fmt: skip
    toks, lps, final = run(engine, {0: reqs[:1], 2: reqs[1:]})
    check_against_reference(tiny, reqs, toks, lps, final)
    assert {t for _, _, t, _ in engine.step_shapes} == {1, P}
    assert kv.num_free_pages == free0
    # `--warmup-prompt-scoring`: one job per reachable prefill shape compiles its scoring
    # twin, so the scored request below compiles nothing.
    jobs = engine.score_compile_jobs()
    prefills = {s for s in engine.reachable_shapes() if s[2] > 1}
    assert sorted(j.label for j in jobs) == sorted(f"prompt-scoring step {s}" for s in prefills)
    for job in jobs:
        job.compile()
    assert engine.steps.compiled_score_shapes == prefills and engine.score_compile_jobs() == []
    compiles = engine.steps._score_compiled.compiles
    # Prompt log-probs from token 2 (`logprob_start_len`), scored chunk by chunk by the
    # prefill step's scoring twin: the reference's teacher-forced float64 log-softmax
    # within 1e-4 (float32 logits of another program), and the reference's tokens.
    ids = reqs[1].input_ids
    echo = GenerateRequest(
        "echo", ids, SamplingParams(max_new_tokens=3), return_logprob=True, top_logprobs=2,
        prompt_logprobs_from=2,
    )  # fmt: skip
    engine.add(echo)
    chunks = []
    while engine.has_work():
        chunks += engine.step()
    (head,) = [c for c in chunks if c.prompt_logprobs is not None]
    want, want_top = tiny[2].prompt_logprobs(list(ids), top_n=2)
    np.testing.assert_allclose(head.prompt_logprobs, want[1:], rtol=0, atol=1e-4)
    assert [[t for t, _ in alts] for alts in head.prompt_top_logprobs] == [
        [t for t, _ in alts] for alts in want_top[1:]
    ]
    assert [t for c in chunks for t in c.token_ids] == tiny[2].generate(ids, 3).output_ids
    assert engine.steps._score_compiled.compiles == compiles  # compiled by the jobs
    assert kv.num_free_pages == free0


def test_batch_invariant_engine_is_bitwise_alone_or_batched(tiny):
    """`batch_invariant=True`: each request's tokens and log-probs are the same bits
    whether it runs alone or in a continuously changing batch (rows 1..4, joins and
    leaves), and equal to the batch-invariant reference generator's (another page-table
    width, one row per step) - no tolerance."""
    cfg, model, _ = tiny
    ref = ReferenceGenerator(cfg, model, page_size=P, index_k_dtype=INDEX_K, batch_invariant=True)
    engine, kv = make_engine(tiny, batch_invariant=True)
    free0 = kv.num_free_pages
    reqs = wave_requests(3, "inv", ignore_eos=True)
    sched: dict[int, list[GenerateRequest]] = {}
    for r, s in zip(reqs, JOIN_AT, strict=True):
        sched.setdefault(s, []).append(r)
    toks, lps, _ = run(engine, sched)
    for r in reqs:
        alone_toks, alone_lps, _ = run(engine, {0: [dataclasses.replace(r, rid=r.rid + "-alone")]})
        assert (alone_toks[r.rid + "-alone"], alone_lps[r.rid + "-alone"]) == (
            toks[r.rid],
            lps[r.rid],
        ), r.rid
        want = ref.generate(r.input_ids, r.sampling.max_new_tokens, ignore_eos=True)
        assert (toks[r.rid], lps[r.rid]) == (want.output_ids, want.output_logprobs), r.rid
    assert kv.num_free_pages == free0


def test_fcfs_queue_waits_for_pages(tiny):
    # 4 free pages; each request reserves 2: the third waits until one finishes.
    engine, kv = make_engine(tiny)
    held = kv.allocate_pages(kv.num_free_pages - 4)
    reqs = wave_requests(1, "q", ignore_eos=True)[:2] + wave_requests(3, "r", ignore_eos=True)[:1]
    for r in reqs:
        engine.add(r)
    engine.step()
    engine.step()
    s = engine.stats()
    assert (s.waiting, s.running, s.kv_pages_free) == (1, 2, (0,))
    assert s.kv_pages_total == (POOL_PAGES - 1,)
    toks, lps, final = run(engine, {})
    assert set(final) == {r.rid for r in reqs}
    first = {r.rid: r for r in reqs}
    check_against_reference(
        tiny, [first["r0"]], {"r0": toks["r0"]}, {"r0": lps["r0"]}, {"r0": final["r0"]}
    )
    assert kv.num_free_pages == 4 and engine.stats().waiting == 0
    kv.free_pages(held)


def test_refusals_allocate_nothing(tiny):
    engine, kv = make_engine(tiny, context_length=700)
    free0 = kv.num_free_pages
    ok = GenerateRequest("ok", (5, 6, 7), SamplingParams(max_new_tokens=2))
    engine.add(ok)
    cases = [
        (GenerateRequest("long", (5,) * 690, SamplingParams(max_new_tokens=20)), "length 700"),
        (GenerateRequest("big", (5,) * 630, SamplingParams(max_new_tokens=8)), "pool has 39"),
        (GenerateRequest("ok", (5,), SamplingParams()), "already in flight"),
        (GenerateRequest("empty", (), SamplingParams()), "prompt is empty"),
        (GenerateRequest("oov", (5, 320), SamplingParams()), r"\[320\] outside the vocabulary"),
        (GenerateRequest("topp", (5,), SamplingParams(top_p=0.0)), "top_p must be in"),
        (GenerateRequest("stop", (5,), SamplingParams(stop=("x",))), "need a tokenizer"),
        (
            GenerateRequest("echo", (5, 6), SamplingParams(), prompt_logprobs_from=2),
            r"logprob_start_len 2 is outside the prompt's 2 tokens",
        ),
    ]
    for req, match in cases:
        with pytest.raises(InputError, match=match):
            engine.add(req)
    # "big" fits the context length but not the pool (its message names the pool).
    assert kv.num_free_pages == free0
    s = engine.stats()
    assert s.waiting == 1 and sum(s.admission_rejections.values()) == len(cases)
    assert s.admission_rejections["pool_capacity"] == 1
    engine.abort("ok")
    (chunk,) = engine.step()
    assert chunk.rid == "ok" and chunk.finish_reason == "abort"


def test_abort_running_and_waiting_frees_pages(tiny):
    engine, kv = make_engine(tiny)
    held = kv.allocate_pages(kv.num_free_pages - 4)
    reqs = wave_requests(1, "x", ignore_eos=True)
    for r in reqs[:3]:
        engine.add(r)
    engine.step()  # x0 prefilled + one decode step; x1, x2 waiting or running
    engine.abort("x0")
    engine.abort("x2")  # still waiting for pages
    engine.abort("nope")  # unknown: ignored
    chunks = engine.step()
    by_rid = {c.rid: c for c in chunks}
    assert by_rid["x0"].finished and by_rid["x0"].finish_reason == "abort"
    assert by_rid["x2"].finish_reason == "abort" and "ttft_s" not in by_rid["x2"].meta
    assert not engine.stats().waiting
    toks, _, final = run(engine, {})
    assert final["x1"].finish_reason == "length"
    assert kv.num_free_pages == 4
    kv.free_pages(held)


def test_stop_token_and_stop_string(tiny):
    _, _, ref = tiny
    rng = np.random.default_rng(6)
    prompt = tuple(int(t) for t in rng.integers(3, 300, 12))
    want = ref.generate(prompt, 8, ignore_eos=True).output_ids

    def detok(ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)

    engine, kv = make_engine(tiny, detokenize=detok)
    stop_tok = want[3]
    text = detok(want)
    stop_str = text[2:4]
    reqs = [
        GenerateRequest(
            "t", prompt, SamplingParams(8, ignore_eos=True, stop_token_ids=(stop_tok,))
        ),
        GenerateRequest("s", prompt, SamplingParams(8, ignore_eos=True, stop=("@@", stop_str))),
    ]
    toks, _, final = run(engine, {0: reqs})
    assert toks["t"] == want[: want.index(stop_tok) + 1] and final["t"].finish_reason == "stop"
    assert final["t"].meta["matched_stop_token"] == stop_tok  # the HTTP text leaves it out
    end = text.index(stop_str)
    assert toks["s"] == want[: end + len(stop_str)]
    assert final["s"].finish_reason == "stop"
    assert final["s"].meta["matched_stop_index"] == 1 and final["s"].meta["stop_text_end"] == end
    assert "matched_stop_token" not in final["s"].meta
    assert kv.num_free_pages == POOL_PAGES - 1


def test_min_new_tokens_bans_the_stop_tokens_until_reached(tiny):
    """`min_new_tokens` (SGLang; vLLM's `min_tokens`): the stop token cannot be drawn for
    the first k tokens (banned on the device through the request's penalty slot), then
    stops as usual. The tokens are the reference's with that token biased away for k
    tokens, then its plain continuation of prompt + those k."""
    _, _, ref = tiny
    rng = np.random.default_rng(16)
    for _ in range(20):  # the second greedy token is the stop token: new at index 1
        prompt = tuple(int(t) for t in rng.integers(3, 300, 12))
        want = ref.generate(prompt, 10, ignore_eos=True).output_ids
        if want[1] != want[0]:
            break
    stop, k = want[1], 3
    engine, _ = make_engine(tiny)
    params = {"max_new_tokens": 10, "ignore_eos": True, "stop_token_ids": (stop,)}
    reqs = [
        GenerateRequest("plain", prompt, SamplingParams(**params)),
        GenerateRequest("min", prompt, SamplingParams(**params, min_new_tokens=k)),
    ]
    toks, _, final = run(engine, {0: reqs})
    assert toks["plain"] == want[: want.index(stop) + 1]
    head = ref.generate(prompt, k, ignore_eos=True, logit_bias={stop: -100.0}).output_ids
    tail = ref.generate(prompt + tuple(head), 10 - k, ignore_eos=True).output_ids
    if stop in tail:
        tail = tail[: tail.index(stop) + 1]
    assert stop not in toks["min"][:k]
    assert toks["min"] == head + tail
    assert final["min"].finish_reason == ("stop" if tail[-1] == stop else "length")


# ---- decode mode: KV arrives through a transfer receiver -----------------------------------


def prefill_into_pages(tiny, prompt: tuple[int, ...], max_new: int, layout: LayoutDescriptor):
    """What a (single-rank) prefill server sends: the prompt's pages, per buffer as
    bytes, and the log-probs after the prompt."""
    cfg, model, ref = tiny
    n = len(prompt)
    n_pages = pages_for_tokens(n, P)
    width = pow2_at_least(pages_for_tokens(n + max_new, P))
    pool = init_pool(cfg, width + 1, P, jnp.float32, INDEX_K)
    table = padded_page_table(np.arange(1, n_pages + 1, dtype=np.int32), width)
    batch = prefill_batch(np.asarray(prompt), table, P)
    graphdef, state = nnx.split(model)
    logits, pool = forward_step(
        graphdef, state, batch, pool, index_k_dtype=INDEX_K, form="absorbed"
    )
    data = []
    for kind, layer in layout.buffers():
        leaf = np.asarray(getattr(pool, kind)[layout.leaf_index(kind, layer)])
        data.append(leaf[1 : n_pages + 1].reshape(n_pages, -1).view(np.uint8))
    return data, np.asarray(jax.nn.log_softmax(logits[0]))


def send(rx: Receiver, room: str, n_tokens: int, data, aux: Aux) -> None:
    assert rx.handshake(room, 0, 1, n_tokens, rx.layout).accepted
    positions = np.arange(data[0].shape[0])
    for b, (kind, layer) in enumerate(rx.layout.buffers()):
        rx.write_pages(room, 0, 0, kind, layer, positions, page_digests(data[b]), data[b].tobytes())
    assert rx.commit(room, 0, 0, positions, aux).state is RoomState.SUCCESS


def test_decode_mode_refuses_prompts_too_long_for_the_mooncake_staging_arena(tiny):
    """With a Mooncake endpoint, a prompt whose pages can never stage in the receiver's
    arena is refused at admission (an `InputError`: a 4xx naming
    `--transfer-staging-size` over HTTP), before any room or page exists; one that fits is
    registered. (Before, the room was refused at the prefill side's handshake.)"""
    cfg, model, _ = tiny
    layout = LayoutDescriptor.from_model(cfg, P, "float32", INDEX_K)
    pool = init_pool(cfg, POOL_PAGES, P, jnp.float32, INDEX_K)
    arena = StagingArena(staging_region_bytes(layout, 3, DEFAULT_ALIGNMENT), prefault=False)
    endpoint = types.SimpleNamespace(
        arena=arena, session_id="127.0.0.1:1", protocol="tcp", quarantine_timeout_s=10.0
    )
    rx = Receiver(layout, pool, PageAllocator(POOL_PAGES), mooncake=endpoint)
    assert rx.staging_bytes(3) == arena.nbytes < rx.staging_bytes(4)
    engine = DecodeEngine(
        cfg=cfg, model=model, kv=rx, page_size=P, index_k_dtype=INDEX_K, mode="decode",
        max_running_requests=4,
    )  # fmt: skip
    free0 = rx.num_free_pages
    rng = np.random.default_rng(11)

    def request(rid: str, n: int) -> GenerateRequest:
        ids = tuple(int(t) for t in rng.integers(3, 300, n))
        return GenerateRequest(
            rid, ids, SamplingParams(max_new_tokens=4), bootstrap_room=f"room-{rid}",
            bootstrap_cp_size=2,
        )  # fmt: skip

    with pytest.raises(InputError, match="`staging_bytes`") as e:
        engine.add(request("long", 3 * P + 1))  # 4 prompt pages; the arena holds 3
    assert "4 pages need" in str(e.value)
    # The library names its parameter; the HTTP answer names the flag.
    assert "--transfer-staging-size" in error_body(400, str(e.value))["error"]["message"]
    assert rx.num_free_pages == free0 and arena.free_bytes == arena.nbytes
    with pytest.raises(UnknownRoomError):
        rx.status("room-long")
    assert engine.stats().admission_rejections == {"staging_capacity": 1}
    engine.add(request("fits", 3 * P))  # 3 prompt pages (its decode pages are not staged)
    assert rx.status("room-fits").state is RoomState.BOOTSTRAPPING
    engine.abort("fits")
    assert rx.status("room-fits").state is RoomState.FAILED
    assert rx.num_free_pages == free0


def test_decode_mode_continues_transferred_kv(tiny):
    cfg, model, ref = tiny
    layout = LayoutDescriptor.from_model(cfg, P, "float32", INDEX_K)
    pool = init_pool(cfg, POOL_PAGES, P, jnp.float32, INDEX_K)
    rx = Receiver(layout, pool, PageAllocator(POOL_PAGES))
    engine = DecodeEngine(
        cfg=cfg, model=model, kv=rx, page_size=P, index_k_dtype=INDEX_K, mode="decode",
        max_running_requests=4, max_queued_requests=1,
    )  # fmt: skip
    free0 = rx.num_free_pages
    reqs = wave_requests(4, "d", ignore_eos=True)
    greedy, sampled, failing, aborted = reqs[0], reqs[1], reqs[2], reqs[3]
    sampled = GenerateRequest(
        "d1",
        sampled.input_ids,
        SamplingParams(sampled.sampling.max_new_tokens, temperature=1.0, seed=7, ignore_eos=True),
    )
    with pytest.raises(InputError, match="needs bootstrap_room"):
        engine.add(greedy)
    rooms = {}
    for r in (greedy, sampled, failing, aborted):
        req = GenerateRequest(
            r.rid, r.input_ids, r.sampling, r.return_logprob, bootstrap_room=f"room-{r.rid}",
            bootstrap_cp_size=1,
        )  # fmt: skip
        engine.add(req)  # registers the room before returning
        rooms[r.rid] = req
        assert rx.status(f"room-{r.rid}").state is RoomState.BOOTSTRAPPING
    assert engine.stats().waiting == 4 and not engine.step()  # nothing arrived yet
    # Every batch slot is taken: the next request waits in the queue, its room not yet
    # registered; one more finds the queue full (SPEC-less backpressure, HTTP 503).
    engine.add(GenerateRequest("e", (5,), bootstrap_room="room-e", bootstrap_cp_size=1))
    with pytest.raises(UnknownRoomError):
        rx.status("room-e")
    with pytest.raises(QueueFullError, match="max-queued-requests 1"):
        engine.add(GenerateRequest("f", (5,), bootstrap_room="room-f", bootstrap_cp_size=1))
    assert engine.stats().queue.rejected == 1 and engine.stats().waiting == 5
    engine.abort("e")  # its client left while it waited: dropped, nothing was held
    assert [c.finish_reason for c in engine.step()] == ["abort"]

    # The prefill side: greedy and seeded-sampled first tokens (step 0), one failure.
    # The greedy one reports a prefix-cache hit on the prefill side (3 tokens, 1 from host).
    for r, cached in ((greedy, (3, 1)), (sampled, (0, 0))):
        data, lp = prefill_into_pages(tiny, r.input_ids, r.sampling.max_new_tokens, layout)
        s = r.sampling
        tok, _, _ = sample(
            lp[None], [RowSampling(s.temperature, s.top_k, s.top_p, s.seed or 0)]
        ).pick(0)
        send(rx, f"room-{r.rid}", len(r.input_ids), data, Aux(tok, float(lp[tok]), *cached))
    rx.abort(f"room-{failing.rid}", "prefill crashed", sender_rank=0)
    engine.abort(aborted.rid)
    assert rx.status(f"room-{aborted.rid}").state is RoomState.FAILED
    toks, lps, final = run(engine, {})

    # The prefill's cache hit reaches the client through the decode server (issue 23).
    assert (
        final[greedy.rid].meta["cached_tokens"],
        final[greedy.rid].meta["cached_tokens_host"],
    ) == (3, 1)
    assert final[sampled.rid].meta["cached_tokens"] == 0
    assert final[failing.rid].finish_reason == "error"
    assert "prefill crashed" in final[failing.rid].error
    assert final[aborted.rid].finish_reason == "abort"
    want = ref.generate(greedy.input_ids, greedy.sampling.max_new_tokens, ignore_eos=True)
    assert toks[greedy.rid] == want.output_ids
    np.testing.assert_allclose(lps[greedy.rid], want.output_logprobs, rtol=0, atol=LP_TOL)
    # Sampled with a seed: the same stream as one unified server sampling every step.
    unified, _ = make_engine(tiny)
    utoks, _, _ = run(unified, {0: [sampled]})
    assert toks[sampled.rid] == utoks[sampled.rid]
    assert len(utoks[sampled.rid]) == sampled.sampling.max_new_tokens
    assert rx.num_free_pages == free0
    stats: EngineStats = engine.stats()
    assert stats.transfer_failures == 1 and stats.kv_pages_free == (free0,)


# ---- failures: a request's own, never the engine's -------------------------------------------


def take(chunks, toks, lps, final) -> dict:
    """Fold one step's chunks into the running outputs; the step's chunks by rid."""
    for c in chunks:
        toks.setdefault(c.rid, []).extend(c.token_ids)
        lps.setdefault(c.rid, []).extend(c.logprobs or ())
        if c.finished:
            final[c.rid] = c
    return {c.rid: c for c in chunks}


def test_a_failed_prefill_compile_fails_that_request_alone(tiny, monkeypatch, caplog):
    """A step whose compile raises (before anything was donated) fails the request it
    prefills and frees its pages; the running batch decodes on in that same step, and the
    same prompt is served afterwards. Logged once, with the traceback. (Before, the
    exception left `step` and the engine loop ended the server.)"""
    engine, kv = make_engine(tiny)
    free0 = kv.num_free_pages
    a, b, c = wave_requests(1, "f", ignore_eos=True)[:3]
    real = engine.steps.compiled
    fail = {"prefill": 0}

    def compiled(shape):
        if shape[0] == engine.steps.prefill_form and shape[2] > 1 and fail["prefill"]:
            fail["prefill"] -= 1
            raise RuntimeError("XLA compile failed")
        return real(shape)

    monkeypatch.setattr(engine.steps, "compiled", compiled)
    toks: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    final: dict = {}
    for r in (a, b):
        engine.add(r)
        take(engine.step(), toks, lps, final)
    fail["prefill"] = 1
    engine.add(c)
    got = take(engine.step(), toks, lps, final)
    assert got[c.rid].finish_reason == "error" and not got[c.rid].token_ids
    assert "the prefill step failed: RuntimeError: XLA compile failed" in got[c.rid].error
    assert got[a.rid].token_ids and got[b.rid].token_ids  # decoded in the same step
    assert not got[a.rid].finished and not got[b.rid].finished
    assert c.rid not in engine.running and kv.num_free_pages == free0 - 4  # a's and b's
    logged = [r for r in caplog.records if r.exc_info and "XLA compile" in str(r.exc_info[1])]
    assert len(logged) == 1 and c.rid in logged[0].getMessage()
    del final[c.rid]
    engine.add(c)  # the same id and prompt again: served
    while engine.has_work():
        take(engine.step(), toks, lps, final)
    check_against_reference(tiny, [a, b, c], toks, lps, final)
    assert kv.num_free_pages == free0


def test_a_broken_log_prob_row_fails_only_its_request(tiny, monkeypatch):
    """One row of a decode step comes back NaN for a sampled (temperature > 0) request:
    that request ends with the sampler's error and its pages are freed; the greedy row of
    the same step goes on to the reference's tokens."""
    engine, kv = make_engine(tiny)
    free0 = kv.num_free_pages
    first, cold = wave_requests(2, "n", ignore_eos=True)[:2]
    hot = dataclasses.replace(
        first, sampling=SamplingParams(8, temperature=0.8, seed=3, ignore_eos=True)
    )
    real = engine.steps.decode
    broken = {"on": False}

    def decode(rows, prev=None):
        out = real(rows, prev)
        if broken["on"]:
            broken["on"] = False
            pages = engine.running[hot.rid].pages
            logits = np.array(out.logits)
            i = next(i for i, row in enumerate(rows) if row[2] is pages)
            logits[i if out.order is None else out.order[i]] = np.nan
            out = StepLogits(logits, out.order)
        return out

    monkeypatch.setattr(engine.steps, "decode", decode)
    toks: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    final: dict = {}
    engine.add(hot)
    engine.add(cold)
    take(engine.step(), toks, lps, final)
    take(engine.step(), toks, lps, final)  # both running now
    broken["on"] = True
    got = take(engine.step(), toks, lps, final)
    # The broken step's tokens are fetched one step later (the next step is in flight).
    assert hot.rid not in final and got[hot.rid].token_ids
    got = take(engine.step(), toks, lps, final)
    assert got[hot.rid].finish_reason == "error" and not got[hot.rid].token_ids
    assert "ValueError: log-probs have no finite maximum" in got[hot.rid].error
    assert got[hot.rid].meta["completion_tokens"] == len(toks[hot.rid]) == 3
    assert got[cold.rid].token_ids and not got[cold.rid].finished
    assert hot.rid not in engine.running
    while engine.has_work():
        take(engine.step(), toks, lps, final)
    del final[hot.rid]
    check_against_reference(tiny, [cold], toks, lps, final)
    assert kv.num_free_pages == free0


def test_a_raising_detokenizer_fails_only_its_request(tiny):
    """The stop-string check of one request calls a detokenizer that raises: only that
    request ends ("error", the tokens it had), the other row of its steps (no stop
    strings: never detokenized) finishes as the reference."""
    calls = {"n": 0}

    def detok(ids: list[int]) -> str:
        calls["n"] += 1
        if calls["n"] > 4:  # two calls per token: tokens 0 and 1 pass, token 2 raises
            raise RuntimeError("tokenizer crashed")
        return "".join(chr(ord("a") + t % 26) for t in ids)

    engine, kv = make_engine(tiny, detokenize=detok)
    first, quiet = wave_requests(5, "d", ignore_eos=True)[:2]
    talker = dataclasses.replace(first, sampling=SamplingParams(6, ignore_eos=True, stop=("@@",)))
    toks, lps, final = run(engine, {0: [talker, quiet]})
    assert final[talker.rid].finish_reason == "error"
    assert final[talker.rid].error == (
        "output token 2 of this request failed: RuntimeError: tokenizer crashed"
    )
    _, _, ref = tiny
    want = ref.generate(talker.input_ids, 6, ignore_eos=True).output_ids
    assert toks[talker.rid] == want[:2]
    del final[talker.rid]
    check_against_reference(tiny, [quiet], toks, lps, final)
    assert kv.num_free_pages == POOL_PAGES - 1


def test_penalized_requests_beyond_the_penalty_slots_wait_then_match_the_reference(tiny):
    """With one penalty slot, a second penalized request waits in the queue (admission,
    FIFO, as for pages), starting only once the first has finished and given its slot
    back; an unpenalized request queued between them runs alongside the first. Each
    penalized one gets the float64 reference's tokens: the slot was set afresh."""
    _, _, ref = tiny
    engine, kv = make_engine(tiny, penalty_slots=1)
    free0 = kv.num_free_pages
    rng = np.random.default_rng(21)
    penalties = (
        {"frequency_penalty": -2.0, "logit_bias": ((7, 1.5),)},
        {"repetition_penalty": 0.3},
    )
    reqs = [
        GenerateRequest(
            f"pen{i}",
            tuple(int(t) for t in rng.integers(3, 300, 9)),
            SamplingParams(max_new_tokens=5, ignore_eos=True, **p),
            return_logprob=True,
        )
        for i, p in enumerate(penalties)
    ]
    plain = wave_requests(3, "plain", ignore_eos=True)[0]
    first_token_step: dict[str, int] = {}
    finished_step: dict[str, int] = {}
    toks: dict[str, list[int]] = {}
    for r in (reqs[0], plain, reqs[1]):
        engine.add(r)
    step = 0
    while engine.has_work():
        for c in engine.step():
            toks.setdefault(c.rid, []).extend(c.token_ids)
            if c.token_ids:
                first_token_step.setdefault(c.rid, step)
            if c.finished:
                assert c.finish_reason == "length", c
                finished_step[c.rid] = step
        step += 1
        assert step < 200
    assert first_token_step["pen1"] > finished_step["pen0"]  # waited for the slot
    assert first_token_step["plain0"] < finished_step["pen0"]  # a plain one did not wait
    for r, p in zip(reqs, penalties, strict=True):
        kw = {**p, "logit_bias": dict(p.get("logit_bias", ()))}
        want = ref.generate(r.input_ids, 5, ignore_eos=True, **kw)
        assert toks[r.rid] == want.output_ids, r.rid
    assert kv.num_free_pages == free0


def _fetch_order(engine, monkeypatch) -> list[tuple[int, int]]:
    """Per fetched decode draw: (the decode step it drew for, decode steps dispatched by
    the time it was fetched)."""
    from cpkv_jax.sampling import PendingSample
    from serving.decode import sampler as sampler_mod

    dispatched = [0]
    drew_for: dict[int, int] = {}
    seen: list[tuple[int, int]] = []
    real_decode, real_async, real_fetch = engine.steps.decode, sampler_mod.sample_async, None
    real_fetch = PendingSample.fetch

    def decode(rows, prev=None):
        dispatched[0] += 1
        return real_decode(rows, prev)

    def sample_async(*a, **k):
        p = real_async(*a, **k)
        drew_for[id(p)] = dispatched[0]
        return p

    def fetch(self):
        if id(self) in drew_for:
            seen.append((drew_for[id(self)], dispatched[0]))
        return real_fetch(self)

    monkeypatch.setattr(engine.steps, "decode", decode)
    monkeypatch.setattr(sampler_mod, "sample_async", sample_async)
    monkeypatch.setattr(PendingSample, "fetch", fetch)
    return seen


def test_overlap_dispatches_the_next_step_before_fetching_and_gives_the_same_bits(
    tiny, monkeypatch
):
    """Issue 35 item 5. With overlap (the default) step n+1 is dispatched before step
    n's tokens are fetched, its input ids fed from the draw on the device; without it,
    each draw is fetched before the next step. Under batch-invariant numerics both give
    the same bits for a wave joining and leaving, with a request ending on a stop token
    mid-batch (its extra in-flight token dropped), sampled and penalized rows; every
    page comes back."""
    _, _, ref = tiny
    reqs = wave_requests(4, "ov", ignore_eos=True)
    plain = ref.generate(reqs[1].input_ids, 8, ignore_eos=True).output_ids
    reqs[1] = dataclasses.replace(
        reqs[1], sampling=SamplingParams(8, ignore_eos=True, stop_token_ids=(plain[2],))
    )
    reqs[2] = dataclasses.replace(
        reqs[2],
        sampling=SamplingParams(
            12, temperature=0.9, seed=5, frequency_penalty=0.7, min_new_tokens=4
        ),
    )
    sched: dict[int, list[GenerateRequest]] = {}
    for r, s in zip(reqs, JOIN_AT, strict=True):
        sched.setdefault(s, []).append(r)
    got = {}
    for overlap in (False, True):
        engine, kv = make_engine(tiny, batch_invariant=True, overlap=overlap)
        with monkeypatch.context() as m:
            order = _fetch_order(engine, m)
            got[overlap] = run(engine, sched)
        assert order, "no decode draw was fetched"
        if overlap:  # every draw but the last one's fetched after the next dispatch
            assert sum(now == step + 1 for step, now in order) >= len(order) - 2
        else:
            assert all(now == step for step, now in order)
        assert kv.num_free_pages == POOL_PAGES - 1
    (toks0, lps0, fin0), (toks1, lps1, fin1) = got[False], got[True]
    assert toks0 == toks1 and lps0 == lps1
    assert toks1[reqs[1].rid] == plain[:3] and fin1[reqs[1].rid].finish_reason == "stop"
    assert {r: f.meta["completion_tokens"] for r, f in fin0.items()} == {
        r: f.meta["completion_tokens"] for r, f in fin1.items()
    }


def test_a_step_failing_when_its_tokens_are_fetched_fails_its_rows_alone(tiny, monkeypatch):
    """An error that surfaces only when a step's draw is fetched (the next step is already
    in flight, fed from it): the rows of that step fail with the step's error and their
    pages come back; the in-flight step's tokens for them are dropped; a request arriving
    afterwards runs to the reference's tokens."""
    from cpkv_jax.sampling import PendingSample

    engine, kv = make_engine(tiny)
    free0 = kv.num_free_pages
    a, b, c = wave_requests(7, "ff", ignore_eos=True)[:3]
    real_fetch = PendingSample.fetch
    fail = {"at": None, "n": 0}

    def fetch(self):
        fail["n"] += 1
        if fail["at"] is not None and fail["n"] == fail["at"]:
            raise RuntimeError("device step failed at run time")
        return real_fetch(self)

    monkeypatch.setattr(PendingSample, "fetch", fetch)
    toks: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    final: dict = {}
    for r in (a, b):
        engine.add(r)
        take(engine.step(), toks, lps, final)
    take(engine.step(), toks, lps, final)
    fail["at"] = fail["n"] + 1  # the next fetch: a decode draw of a and b
    got = take(engine.step(), toks, lps, final)
    for r in (a, b):
        assert got[r.rid].finish_reason == "error"
        assert "the decode step failed: RuntimeError: device step failed" in got[r.rid].error
    assert not engine.running and engine.has_work()  # the in-flight step, not fetched
    take(engine.step(), toks, lps, final)
    assert not engine.has_work() and kv.num_free_pages == free0
    toks.clear(), lps.clear(), final.clear()
    engine.add(c)
    while engine.has_work():
        take(engine.step(), toks, lps, final)
    check_against_reference(tiny, [c], toks, lps, final)
    assert kv.num_free_pages == free0


def test_grammar_rows_match_the_masked_reference_beside_plain_rows(tiny, tiny_checkpoints):
    """Structured output in the continuous batch (overlap on): a regex request (greedy)
    and a JSON-schema one (greedy) ride with plain requests. Each grammar row's tokens
    and log-probs equal the reference generator's under the same grammar's masks (its
    own matcher, float64 argmax over the allowed tokens) and it finishes "stop" when the
    grammar ends; its text matches; the plain rows equal the plain reference; a bad
    grammar is refused at `add` with nothing held."""
    import json
    import re

    from support.grammar_ref import BOUNDED_REGEX, BOUNDED_SCHEMA, grammar_reference

    from serving.engine.api import Grammar
    from serving.grammar import load_grammar_backend

    cfg, _, ref = tiny
    path = tiny_checkpoints("glm_moe_dsa")
    backend = load_grammar_backend(path, cfg.vocab_size, cfg.eos_token_ids)
    engine, kv = make_engine(tiny, grammar=backend)
    free0 = kv.num_free_pages
    grammars = {
        "g-regex": Grammar("regex", BOUNDED_REGEX),
        "g-json": Grammar("json_schema", json.dumps(BOUNDED_SCHEMA)),
    }
    plain = wave_requests(8, "gp", ignore_eos=True)[:3]
    rng = np.random.default_rng(8)
    gram = [
        GenerateRequest(
            rid,
            tuple(int(t) for t in rng.integers(3, 300, 9)),
            SamplingParams(40, grammar=g),
            return_logprob=True,
        )
        for rid, g in grammars.items()
    ]
    toks, lps, final = run(engine, {0: [plain[0], gram[0]], 2: [gram[1], plain[1]], 3: [plain[2]]})
    check_against_reference(tiny, plain, toks, lps, final)

    for r in gram:
        g = r.sampling.grammar
        want = grammar_reference(ref, backend, g, r.input_ids, 40)
        assert toks[r.rid] == want.output_ids, r.rid
        np.testing.assert_allclose(lps[r.rid], want.output_logprobs, rtol=0, atol=LP_TOL)
        assert final[r.rid].finish_reason == want.finish_reason == "stop"
        text = bytes(t - 3 for t in toks[r.rid]).decode()
        if g.kind == "regex":
            assert re.fullmatch(g.source, text), text
        else:
            value = json.loads(text)
            assert set(value) == {"id", "tag"} and value["tag"] in ("x", "yz"), text
            assert 0 <= value["id"] <= 999 and text == json.dumps(value)  # `JSON_LAYOUT`
    assert kv.num_free_pages == free0
    with pytest.raises(InputError, match="regex: the grammar cannot be compiled"):
        engine.add(GenerateRequest("bad", (5, 6), SamplingParams(4, grammar=Grammar("regex", "("))))
    no_backend, _ = make_engine(tiny)
    with pytest.raises(InputError, match="needs the model's tokenizer.json"):
        no_backend.add(
            GenerateRequest("nb", (5, 6), SamplingParams(4, grammar=grammars["g-regex"]))
        )
    assert not engine.has_work() and kv.num_free_pages == free0


def test_a_grammar_after_a_marker_leaves_the_output_free_until_it(tiny, tiny_checkpoints):
    """`Grammar.after` (a reasoning model's `</think>`, set by the chat route): tokens
    are drawn unconstrained until the output has produced the marker, then under the
    grammar. The marker here is the model's own greedy tokens 2-3, so the output up to it
    is the plain reference's and the rest matches the regex; equal to the masked
    reference's too."""
    import re

    from support.grammar_ref import grammar_reference

    from serving.engine.api import Grammar
    from serving.grammar import load_grammar_backend

    cfg, _, ref = tiny
    path = tiny_checkpoints("glm_moe_dsa")
    backend = load_grammar_backend(path, cfg.vocab_size, cfg.eos_token_ids)
    prompt = tuple(int(t) for t in np.random.default_rng(14).integers(3, 300, 11))
    plain = ref.generate(prompt, 8, ignore_eos=True).output_ids
    marker = tuple(plain[2:4])
    assert marker != tuple(plain[1:3]) and marker != tuple(plain[0:2])
    grammar = Grammar("regex", "[0-9]{2}!", after=marker)
    engine, kv = make_engine(tiny, grammar=backend)
    req = GenerateRequest("after", prompt, SamplingParams(30, grammar=grammar), return_logprob=True)
    toks, lps, final = run(engine, {0: [req]})
    out = toks["after"]
    assert out[:4] == plain[:4]
    assert re.fullmatch("[0-9]{2}!", bytes(t - 3 for t in out[4:]).decode())
    assert final["after"].finish_reason == "stop"
    want = grammar_reference(ref, backend, grammar, prompt, 30)
    assert out == want.output_ids
    np.testing.assert_allclose(lps["after"], want.output_logprobs, rtol=0, atol=LP_TOL)
    assert kv.num_free_pages == POOL_PAGES - 1


def test_sampled_grammar_outputs_always_match_and_always_finish(tiny, tiny_checkpoints):
    """Issue 37's acceptance: at temperature 1 on the random tiny model, 50 seeded regex
    requests all match the regex, and 50 seeded JSON-schema requests all finish (a schema
    of bounded size, whitespace constrained: `JSON_LAYOUT`) with JSON that validates:
    the keys, the integer range and the enum. Batched 16 at a time (the overlap on; a
    grammar step waits for its tokens); every page comes back."""
    import json
    import re

    from support.grammar_ref import BOUNDED_REGEX, BOUNDED_SCHEMA

    from serving.engine.api import Grammar
    from serving.grammar import load_grammar_backend

    cfg, _, _ = tiny
    backend = load_grammar_backend(
        tiny_checkpoints("glm_moe_dsa"), cfg.vocab_size, cfg.eos_token_ids
    )
    engine, kv = make_engine(tiny, grammar=backend, max_running_requests=16)
    free0 = kv.num_free_pages
    grammars = {"re": Grammar("regex", BOUNDED_REGEX)}
    grammars["js"] = Grammar("json_schema", json.dumps(BOUNDED_SCHEMA))
    rng = np.random.default_rng(50)
    reqs = [
        GenerateRequest(
            f"{kind}{seed}",
            tuple(int(t) for t in rng.integers(3, 300, 6)),
            SamplingParams(40, temperature=1.0, seed=seed, grammar=g),
        )
        for kind, g in grammars.items()
        for seed in range(50)
    ]
    toks, _, final = run(engine, {0: reqs}, max_steps=2000)
    texts = {r.rid: bytes(t - 3 for t in toks[r.rid]).decode() for r in reqs}
    assert all(final[r.rid].finish_reason == "stop" for r in reqs), {
        rid: (c.finish_reason, texts[rid]) for rid, c in final.items() if c.finish_reason != "stop"
    }
    for seed in range(50):
        assert re.fullmatch(BOUNDED_REGEX, texts[f"re{seed}"]), texts[f"re{seed}"]
        value = json.loads(texts[f"js{seed}"])
        assert set(value) == {"id", "tag"} and value["tag"] in ("x", "yz"), value
        assert isinstance(value["id"], int) and 0 <= value["id"] <= 999, value
        assert texts[f"js{seed}"] == json.dumps(value)
    assert len(set(texts.values())) > 10  # sampled: the seeds differ
    assert kv.num_free_pages == free0
