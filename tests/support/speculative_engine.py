"""The speculative decode engine's test helpers (`tests/serving/test_speculative_engine.py`
and `test_speculative_dp.py`): the tiny checkpoints with their MTP layers, the requests
both compare, a driver that runs an engine to the end, the plain engine's outputs as the
reference, and the oracle that makes steps accept every count of drafts.

The tiny checkpoints' MTP layers are random, so their drafts are almost never accepted.
The oracle wraps the engine's step: before each step it replaces the drafts in the
device state with the plain engine's continuation, corrupted at a place that moves with
the step and the row, so steps accept every count from 0 to K and rows of one step accept
different counts (the positions come from the device state itself, so the overlap stays
on).

Numerics: the FP8 checkpoint's engines run batch-invariant numerics and compare bit for
bit (the acceptance's "bitwise under `--enable-batch-invariant`"); the other checkpoints'
run XLA's default numerics and compare tokens exactly and log-probs within `LOGPROB_TOL`.
A batch-invariant program takes about twice as long to trace and compile (its tiles run
in loops), and these files compiled one per form and row bucket for every checkpoint."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import numpy as np
import pytest

from cpkv_jax.model.weights import load_model
from serving.decode.engine import DecodeEngine, whole_prompt_engine
from serving.engine.api import GenerateRequest, SamplingParams

P = 16
PAGES = 64
ROWS = 4
# Five requests for four rows (one waits for a slot), all in one prefill bucket (64) and,
# with the speculative room, one page-table width (8 pages): few shapes to compile.
LENGTHS = (50, 53, 57, 51, 60)
# The checkpoints whose engines run batch-invariant numerics and compare bitwise.
EXACT = frozenset({"glm-fp8"})
# Default numerics: a verify step scores k + 1 tokens per row where plain decoding scores
# one, and a DP step shards what one device computes whole, so XLA's reductions may round
# a few ulps apart (measured up to 2e-6 on the tiny model's log-probs); greedy tokens
# stay equal.
LOGPROB_TOL = 1e-5
CHECKPOINTS = {
    "glm": ("glm_moe_dsa", {}),
    "glm-fp8": ("glm_moe_dsa", {"fp8": True}),
    "dsv32": ("deepseek_v32", {}),
}


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


def make_engine(cfg, model, k: int, *, exact: bool = False, **kw) -> DecodeEngine:
    """The unified whole-prompt engine drafting `k` tokens (0: plain decoding); `exact`:
    batch-invariant numerics."""
    return whole_prompt_engine(
        cfg, model, pages=PAGES, page_size=P, index_k_dtype="fp8_e4m3",
        max_running_requests=ROWS, batch_invariant=exact, speculative_num_steps=k, **kw,
    )  # fmt: skip


def requests(cfg, seed: int = 3, **sampling) -> list[GenerateRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = tuple(rng.integers(3, cfg.vocab_size, n).tolist())
        sp = SamplingParams(max_new_tokens=10 + 2 * i, ignore_eos=True, **sampling)
        # Penalized targets: each verified position counts the drafts before it. r3's bias
        # makes token 11 the argmax until its count's penalty outweighs it (four times,
        # then not: the counts decide inside a step); r4 has a repetition penalty.
        if i == 3:
            sp = dataclasses.replace(sp, logit_bias=((11, 6.0), (5, -3.0)), frequency_penalty=1.0)
        if i == 4:
            sp = dataclasses.replace(sp, repetition_penalty=1.3, logit_bias=((7, 1.0),))
        # r1 reports its top 3 at every token (`cpkv_jax.speculative.top_logprobs`).
        top = 3 if i == 1 else 0
        out.append(GenerateRequest(f"r{i}", ids, sp, return_logprob=True, top_logprobs=top))
    return out


def run(engine: DecodeEngine, reqs, abort_after: dict[str, int] | None = None) -> dict:
    """rid -> (tokens, log-probs, finish reason, meta, top log-probs); `abort_after`: rid
    -> the engine step after which that request is aborted."""
    for r in reqs:
        engine.add(r)
    out: dict = {r.rid: [[], [], None, None, []] for r in reqs}
    for n in range(400):
        for c in engine.step():
            o = out[c.rid]
            o[0] += c.token_ids
            o[1] += c.logprobs or ()
            o[4] += c.top_logprobs or ()
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
    (inside a step's accepted drafts once the oracle makes them accepted); r0's stop
    token is banned until its 9th output token (`min_new_tokens`: a step verifying the
    drafts must reject it at output 5, where the oracle proposes it)."""
    out = []
    for i, r in enumerate(reqs):
        sp = r.sampling
        if i in (0, 2):
            stop = plain[r.rid][0][5 + i]
            sp = dataclasses.replace(sp, stop_token_ids=(stop,), ignore_eos=False)
        if i == 0:
            sp = dataclasses.replace(sp, min_new_tokens=8)
        out.append(dataclasses.replace(r, sampling=sp))
    return out


def install_oracle(
    engine: DecodeEngine, truth: dict[str, list[int]], k: int, corrupt: bool = True
) -> list[int]:
    """Replace each step's drafts by the plain continuation, corrupted at `(step + row)
    mod (k + 1)` (k: none corrupted; `corrupt` False: never); returns the list the
    accepted counts go to."""
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
                if bad < k and corrupt:
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
    """`get(checkpoint, stop: bool)` -> the plain engine's outputs of `requests`, in the
    checkpoint's numerics (`EXACT`)."""
    out: dict = {}

    def get(ckpt: str, stop: bool = False):
        if (ckpt, stop) not in out:
            cfg, model = loaded(ckpt)
            reqs = requests(cfg)
            if stop:
                reqs = with_stop_tokens(reqs, get(ckpt))
            out[ckpt, stop] = run(make_engine(cfg, model, 0, exact=ckpt in EXACT), reqs)
        return out[ckpt, stop]

    return get


def assert_same(got: dict, want: dict, *, exact: bool) -> None:
    """`run` outputs: the same tokens and finish reasons; log-probs and top log-probs bit
    for bit (`exact`) or within `LOGPROB_TOL` (the same top tokens)."""
    for rid, w in want.items():
        g = got[rid]
        assert g[0] == w[0], rid
        assert g[2] == w[2], rid
        if exact:
            np.testing.assert_array_equal(g[1], w[1], err_msg=rid)
            assert g[4] == w[4], rid  # top log-probs (those asked for)
            continue
        assert_scores_close(g[1], w[1], rid)
        assert_top_close(g[4], w[4], rid)


def assert_scores_close(got, want, what: str) -> None:
    """Log-probs within `LOGPROB_TOL`; None where there is none (token 0's prompt score,
    or none asked for) in both."""
    if got is None or want is None:
        assert got is want, what
        return
    assert [v is None for v in got] == [v is None for v in want], what
    pairs = [(g, w) for g, w in zip(got, want, strict=True) if w is not None]
    if pairs:
        np.testing.assert_allclose(*zip(*pairs, strict=True), rtol=0, atol=LOGPROB_TOL,
                                   err_msg=what)  # fmt: skip


def assert_top_close(got, want, what: str) -> None:
    """Top log-probs, one `(token, log-prob)` list per position (None: none asked for):
    the same tokens in the same order, log-probs within `LOGPROB_TOL`."""
    if got is None or want is None:
        assert got is want, what
        return
    assert len(got) == len(want), what
    for g, w in zip(got, want, strict=True):
        assert [t for t, _ in g] == [t for t, _ in w], what
        np.testing.assert_allclose([v for _, v in g], [v for _, v in w], rtol=0,
                                   atol=LOGPROB_TOL, err_msg=what)  # fmt: skip


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
