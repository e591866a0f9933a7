"""Speculative decoding with the MTP layer (issue 39 item 2, `cpkv_jax.speculative`): the
fused draft-and-verify step must emit exactly the plain greedy tokens, and at
temperature > 0 draw from the target's distribution.

Under batch-invariant numerics each verified token's logits and log-probs are bitwise
those of one-token decoding, so the comparison with `ReferenceGenerator` is exact,
tokens and log-probs: the GLM checkpoint's cases (k = 0 and 3). The FP8 and DeepSeek
ones run XLA's default numerics (a batch-invariant program takes about twice as long to
compile): the same tokens, log-probs within 1e-5 (a verify step's k + 1 tokens per row
round a few ulps from one-token decoding). Three prompts of different lengths (all past
`index_topk`, so the indexers really select) decode in one batch of 4 rows (one padding
row). The tiny checkpoint's MTP layer is random and its drafts are almost never
accepted, which tests the one-token path; the oracle hook replaces the drafts (after the
MTP layer ran and wrote its KV) with the true continuation, corrupted at a different
place for each row and step, so rows of one step accept different counts, every count
from 0 to k occurs, and the rejected positions' KV must be overwritten correctly for the
outputs to stay equal. The exactness and sampling tests run the steps overlapped (step
n + 1 dispatched before step n's tokens are read: a finished row runs one more step and
drops its tokens; in the sampling test rows finish at different steps); the oracle test
does not, as it needs the host's positions before each step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpkv_jax.errors import InputError
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.model.forward_batch import batch_from_host
from cpkv_jax.model.kv_cache import init_pool
from cpkv_jax.model.transformer import forward_step
from cpkv_jax.model.weights import load_model
from cpkv_jax.speculative import DraftState, MTPSpeculator

pytestmark = pytest.mark.slow(seconds=110)  # on 2 workers, 2026-12-05

PAGE = 16
LENGTHS = (40, 35, 57)  # > index_topk (16), one prefill bucket (64)
NEW = 14


# Checkpoints: the two architectures, and GLM-5's FP8 one (its MTP layer is FP8 too).
CHECKPOINTS = {
    "glm": ("glm_moe_dsa", {}),
    "glm-fp8": ("glm_moe_dsa", {"fp8": True}),
    "dsv32": ("deepseek_v32", {}),
}
# (checkpoint, k): every k from 0 (plain, the speed baseline) to 3 on one checkpoint or
# another; each case compiles its own steps.
CASES = [("glm", 0), ("glm-fp8", 1), ("glm", 3), ("dsv32", 2)]
EXACT = frozenset({"glm"})  # batch-invariant numerics, compared bitwise
LOGPROB_TOL = 1e-5  # the others' (measured within 2e-6)


@pytest.fixture(scope="module")
def case(tiny_checkpoints):
    """`case(checkpoint, k)`: (cfg, prompts, the reference's outputs, the speculator),
    built once per checkpoint and k."""
    loaded: dict = {}
    speculators: dict = {}

    def get(ckpt: str, k: int):
        if ckpt not in loaded:
            name, kw = CHECKPOINTS[ckpt]
            cfg, model = load_model(tiny_checkpoints(name, **kw), mtp=True)
            ref = ReferenceGenerator(
                cfg, model, page_size=PAGE, index_k_dtype="fp8_e4m3",
                batch_invariant=ckpt in EXACT,
            )  # fmt: skip
            rng = np.random.default_rng(3)
            prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in LENGTHS]
            loaded[ckpt] = (
                cfg,
                model,
                prompts,
                [ref.generate(p, NEW, ignore_eos=True) for p in prompts],
            )
        cfg, model, prompts, want = loaded[ckpt]
        if (ckpt, k) not in speculators:
            speculators[ckpt, k] = MTPSpeculator(
                model, k, page_size=PAGE, index_k_dtype="fp8_e4m3",
                batch_invariant=ckpt in EXACT,
            )  # fmt: skip
        return cfg, prompts, want, speculators[ckpt, k]

    return get


def assert_same(got, want, *, exact: bool) -> None:
    """A speculator's output against the reference's: the same tokens; log-probs bit for
    bit (`exact`) or within `LOGPROB_TOL`."""
    assert got.output_ids == want.output_ids
    if exact:
        np.testing.assert_array_equal(got.logprobs, want.output_logprobs)
    else:
        np.testing.assert_allclose(got.logprobs, want.output_logprobs, rtol=0, atol=LOGPROB_TOL)


@pytest.mark.parametrize(("ckpt", "k"), CASES)
def test_greedy_mtp_emits_the_plain_greedy_tokens_and_log_probs(case, ckpt, k):
    _, prompts, want, spec = case(ckpt, k)
    got = spec.generate(prompts, NEW)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w, exact=ckpt in EXACT)
        assert len(g.accepted) >= 1 and all(0 <= a <= k for a in g.accepted)


@pytest.mark.parametrize(("ckpt", "k"), [c for c in CASES if c[1] > 0])
def test_accepted_drafts_of_every_count_keep_the_tokens_exact(case, ckpt, k):
    cfg, prompts, want, spec = case(ckpt, k)
    truth = [np.asarray(w.output_ids) for w in want]

    def oracle(ds: DraftState, pos: np.ndarray | None, step: int) -> DraftState:
        drafts = np.asarray(ds.drafts).copy()
        for i, prompt in enumerate(prompts):
            start = pos[i] + 1 - len(prompt)  # output index of the token at pos + 1
            true = truth[i][start : start + k]
            if len(true) == k:
                drafts[i] = true
                bad = (step + i) % (k + 1)  # rows of one step accept different counts
                if bad < k:
                    drafts[i, bad] = (drafts[i, bad] + 1) % cfg.vocab_size
        return dataclasses.replace(ds, drafts=jax.device_put(drafts))

    spec.override_drafts = oracle
    try:
        got = spec.generate(prompts, NEW, overlap=False)
    finally:
        del spec.override_drafts
    for g, w in zip(got, want, strict=True):
        assert_same(g, w, exact=ckpt in EXACT)
        assert len(g.accepted) < NEW  # fewer verify steps than tokens
    seen = {a for g in got for a in g.accepted}
    assert set(range(k + 1)) <= seen, seen
    assert min(g.acceptance_length for g in got) > 1.0


def test_refusals(case, tiny_checkpoints):
    _, prompts, _, spec = case("glm", 3)
    _, trunk_only = load_model(tiny_checkpoints())
    with pytest.raises(InputError, match="num_steps"):
        MTPSpeculator(trunk_only, -1)
    with pytest.raises(InputError, match="MTP layer"):
        MTPSpeculator(trunk_only, 1)
    MTPSpeculator(trunk_only, 0)  # plain decoding needs no MTP layer
    with pytest.raises(InputError, match="non-empty prompts"):
        spec.generate([], 4)
    with pytest.raises(InputError, match="non-empty prompts"):
        spec.generate([prompts[0], []], 4)
    with pytest.raises(InputError, match="max_new_tokens"):
        spec.generate(prompts, 0)


def _exact_next_token_probs(model, seqs: np.ndarray, temperature: float) -> np.ndarray:
    """`[n, t, vocab]`: the target's next-token distribution at every position of each
    row of `seqs` (one trunk forward, each row in its own pages), at `temperature`."""
    return np.asarray(jax.nn.softmax(_exact_logits(model, seqs) / temperature, axis=-1))


def _exact_logits(model, seqs: np.ndarray) -> np.ndarray:
    """`[n, t, vocab]` float64: the trunk's logits at every position of each row of
    `seqs` (one forward, each row in its own pages)."""
    n, t = seqs.shape
    per_row = -(-t // PAGE)
    table = 1 + np.arange(n * per_row, dtype=np.int32).reshape(n, per_row)
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)).copy()
    slots = np.take_along_axis(table, pos // PAGE, axis=1) * PAGE + pos % PAGE
    batch = batch_from_host(seqs, pos, np.ones((n, t), bool), slots, table, np.full(n, t))
    pool = init_pool(model.cfg, 1 + n * per_row, PAGE, model.dtype, "fp8_e4m3")
    graphdef, state = nnx.split(model)
    logits, _ = forward_step(graphdef, state, batch, pool, all_logits=True)
    return np.asarray(logits, np.float64)


def _pit_ks(tokens: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> float:
    """Kolmogorov-Smirnov distance from U[0, 1) of the randomized probability integral
    transforms `F(x - 1) + v * p(x)` of draws `tokens[i]` from the distributions
    `probs[i]`: uniform exactly when each token is drawn from its own distribution."""
    cdf = np.cumsum(probs, axis=-1)
    p_x = np.take_along_axis(probs, tokens[:, None], axis=1)[:, 0]
    below = np.take_along_axis(cdf, tokens[:, None], axis=1)[:, 0] - p_x
    u = np.sort(below + rng.random(len(tokens)) * p_x)
    i = np.arange(1, len(u) + 1) / len(u)
    return float(max(np.max(i - u), np.max(u - (i - 1 / len(u)))))


def test_speculative_sampling_draws_from_the_target_distribution(tiny_checkpoints):
    """Temperature 0.7 on the tiny model (issue 39's statistical test):
    2,048 requests of one prompt, each with its own seed, 3 tokens each with k = 2
    drafts from the random MTP layer. The first token is drawn at the prefill, the next
    ones by the speculative steps (accepted drafts or the residual / bonus draw). Each
    token must be distributed as the target's next-token distribution given the tokens
    drawn before it, computed exactly by a separate trunk forward over the sampled
    sequences: the randomized probability integral transforms of the draws must be
    uniform (Kolmogorov-Smirnov distance under 1.95 / sqrt(n), the 0.1% critical value).
    The drafts themselves, drawn from the MTP layer's distribution, must fail the same
    test (the test can tell the distributions apart), and the steps must both accept and
    reject drafts. Fixed seeds: the outcome is deterministic. Measured (dev machine,
    2026-12-05): distances 0.027, 0.018, 0.025 against 0.043; the drafts 0.063; 0.37 of
    the 2 drafts kept per first step."""
    n, k, temperature = 2048, 2, 0.7
    cfg, model = load_model(tiny_checkpoints(), mtp=True)
    prompt = np.random.default_rng(5).integers(3, cfg.vocab_size, 20)
    spec = MTPSpeculator(model, k, page_size=PAGE)
    first_drafts = []

    def record(ds: DraftState, pos: np.ndarray | None, step: int) -> DraftState:
        if step == 0:
            first_drafts.append(np.asarray(ds.drafts)[:n, 0])
        return ds

    spec.override_drafts = record
    got = spec.generate([prompt.tolist()] * n, 3, temperature=temperature, seeds=range(n))
    out = np.asarray([g.output_ids for g in got], np.int32)
    first_step = np.asarray([g.accepted[0] for g in got])
    assert 0 < first_step.mean() < k  # drafts both kept and rejected
    seqs = np.concatenate([np.broadcast_to(prompt, (n, len(prompt))), out[:, :2]], axis=1)
    exact = _exact_next_token_probs(model, seqs.astype(np.int32), temperature)
    critical = 1.95 / np.sqrt(n)
    rng = np.random.default_rng(0)
    for i in range(3):  # token i is drawn given the prompt and tokens 0..i-1
        probs = exact[:, len(prompt) - 1 + i]
        assert _pit_ks(out[:, i], probs, rng) < critical, i
    # The first drafts stand where token 1 does; drawn from the MTP layer's distribution.
    d = _pit_ks(first_drafts[0], exact[:, len(prompt)], rng)
    assert d > critical, d


def _filter_np(probs: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """`probs` `[n, v]` (float64) filtered as the sampler's module docstring states, an
    independent NumPy implementation: the top-k most likely (ties by lower id),
    renormalized; the shortest most-likely-first prefix of mass >= top_p; the tokens at
    least min_p times the most likely; renormalized, back in vocabulary order."""
    n, v = probs.shape
    order = np.argsort(-probs, axis=-1, kind="stable")
    p = np.take_along_axis(probs, order, axis=-1)
    keep = np.arange(v)[None] < (top_k if top_k > 0 else v)
    p = np.where(keep, p, 0.0)
    p = p / p.sum(-1, keepdims=True)
    keep = keep & (np.cumsum(p, -1) - p < top_p) & (p >= min_p * p[:, :1])
    kept = np.where(keep, p, 0.0)
    out = np.zeros_like(probs)
    np.put_along_axis(out, order, kept / kept.sum(-1, keepdims=True), axis=-1)
    return out


def test_speculative_sampling_with_top_k_top_p_min_p_draws_from_the_filtered_target(
    tiny_checkpoints,
):
    """The same test with the sampler's filters on (temperature 1, top-k 40, top-p 0.7,
    min-p 0.05): the target distribution the steps accept against is the filtered one,
    while the drafts still come from the MTP layer's unfiltered distribution, which keeps
    speculative sampling exact. Each token must pass the PIT test against the filtered
    exact distribution (`_filter_np`, independent of `cpkv_jax.sampling`) and fail it
    against the unfiltered one (the filters matter here), with drafts both kept and
    rejected. Fixed seeds: deterministic. Measured (dev machine, 2026-12-05): against the
    filtered target 0.030, 0.020, 0.019; against the unfiltered one 0.198, 0.054, 0.027;
    critical 0.043."""
    n, k, temperature = 2048, 2, 1.0
    filters = {"top_k": 40, "top_p": 0.7, "min_p": 0.05}
    cfg, model = load_model(tiny_checkpoints(), mtp=True)
    prompt = np.random.default_rng(6).integers(3, cfg.vocab_size, 20)
    spec = MTPSpeculator(model, k, page_size=PAGE)
    got = spec.generate(
        [prompt.tolist()] * n, 3, temperature=temperature, seeds=range(n), **filters
    )
    out = np.asarray([g.output_ids for g in got], np.int32)
    first_step = np.asarray([g.accepted[0] for g in got])
    assert 0 < first_step.mean() < k, first_step.mean()  # drafts both kept and rejected
    seqs = np.concatenate([np.broadcast_to(prompt, (n, len(prompt))), out[:, :2]], axis=1)
    exact = _exact_next_token_probs(model, seqs.astype(np.int32), temperature)
    critical = 1.95 / np.sqrt(n)
    rng = np.random.default_rng(0)
    filtered, unfiltered = [], []
    for i in range(3):  # token i is drawn given the prompt and tokens 0..i-1
        full = exact[:, len(prompt) - 1 + i]
        filtered.append(_pit_ks(out[:, i], _filter_np(full, **filters), rng))
        unfiltered.append(_pit_ks(out[:, i], full, rng))
    assert max(filtered) < critical, (filtered, critical)
    # Tokens 0 and 1 (the prefill's draw, then the first verify step's) tell the two
    # distributions apart; token 2's positions are too peaked here for the filters to
    # move its PIT much.
    assert min(unfiltered[:2]) > critical, (unfiltered, critical)


def _penalized_np(
    logits: np.ndarray, prompt: np.ndarray, before: np.ndarray, temperature: float, **pen
) -> np.ndarray:
    """`[n, v]` (float64): the distribution a row at `logits` draws from, with the
    penalties as the sampler's module docstring states them (an independent NumPy
    implementation): the logit bias added, then a logit of a token in the prompt or the
    output so far (`before`, `[n, i]`) divided by the repetition penalty when positive,
    multiplied when not, then frequency x count and presence x (count > 0) subtracted."""
    n, v = logits.shape
    bias = np.zeros(v)
    for token, value in pen["logit_bias"]:
        bias[token] += value
    counts = np.zeros((n, v))
    np.add.at(counts, (np.repeat(np.arange(n), before.shape[1]), before.reshape(-1)), 1)
    seen = counts > 0
    seen[:, prompt] = True
    z = logits + bias
    r = pen["repetition_penalty"]
    z = np.where(seen, np.where(z > 0, z / r, z * r), z)
    z = z - pen["frequency_penalty"] * counts - pen["presence_penalty"] * (counts > 0)
    z = z / temperature
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_speculative_sampling_with_penalties_draws_from_the_penalized_target(tiny_checkpoints):
    """The statistical test with penalties and a logit bias (temperature 1, frequency 2,
    presence 0.5, repetition 1.5 over the prompt and the outputs, token 11 biased +4): a
    verified position's target counts the drafts before it as emitted, so token 2 (drawn
    at the first step's second position whenever its first draft was kept) sees token
    1's penalty (the first step's drafts are forced to the biased token, which about a
    tenth of the rows keep). Each token must pass the PIT test against the penalized
    exact distribution (`_penalized_np`, independent of `cpkv_jax.sampling`), and on the
    rows that kept the draft, token 2 must pass it and fail it against the distribution
    that counts only token 0 (the test tells them apart; mutation-checked: a step that
    ignores its drafts fails the first check). Fixed
    seeds: deterministic. Measured (dev machine, 2026-12-06): tokens 0.027, 0.021, 0.035
    against 0.043; the 10% of rows that kept the draft 0.046 against the target and 0.209
    against the stale one, critical 0.135 (0.184 against the target with the mutation)."""
    n, k, temperature = 2048, 2, 1.0
    pen = {
        "frequency_penalty": 2.0,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.5,
        "logit_bias": ((11, 4.0),),
    }
    cfg, model = load_model(tiny_checkpoints(), mtp=True)
    prompt = np.random.default_rng(7).integers(3, cfg.vocab_size, 20)
    spec = MTPSpeculator(model, k, page_size=PAGE)

    def biased_drafts(ds: DraftState, pos: np.ndarray | None, step: int) -> DraftState:
        # The first step's drafts are the biased token, from a one-hot q (the rule is
        # exact for any q): kept with its target probability, so token 2 is drawn at
        # the step's second position exactly when token 1 is 11, and must count it.
        if step:
            return ds
        drafts = jnp.full_like(ds.drafts, 11)
        q = jax.nn.one_hot(drafts, cfg.vocab_size, dtype=jnp.float32)
        return dataclasses.replace(ds, drafts=drafts, q=q)

    spec.override_drafts = biased_drafts
    got = spec.generate([prompt.tolist()] * n, 3, temperature=temperature, seeds=range(n), **pen)
    out = np.asarray([g.output_ids for g in got], np.int32)
    assert 0 < np.mean([g.accepted[0] for g in got]) < k  # drafts both kept and rejected
    assert 0.05 < np.mean(out[:, 1] == 11) < 0.9  # the kept drafts
    seqs = np.concatenate([np.broadcast_to(prompt, (n, len(prompt))), out[:, :2]], axis=1)
    logits = _exact_logits(model, seqs.astype(np.int32))
    critical = 1.95 / np.sqrt(n)
    rng = np.random.default_rng(0)
    right = []
    for i in range(3):  # token i is drawn given the prompt and tokens 0..i-1
        at = logits[:, len(prompt) - 1 + i]
        right.append(_pit_ks(out[:, i], _penalized_np(at, prompt, out[:, :i], 1.0, **pen), rng))
    assert max(right) < critical, (right, critical)
    # The rows that kept the first draft (token 1 is 11; a rejection's residual never
    # draws it) drew token 2 at the step's second position: against the target there,
    # and against one that forgot token 1 (what a step ignoring its drafts draws from).
    kept = out[:, 1] == 11
    at = logits[kept, len(prompt) + 1]
    sub_critical = 1.95 / np.sqrt(kept.sum())
    exact = _penalized_np(at, prompt, out[kept, :2], 1.0, **pen)
    stale = _penalized_np(at, prompt, out[kept, :1], 1.0, **pen)
    got = (_pit_ks(out[kept, 2], exact, rng), _pit_ks(out[kept, 2], stale, rng))
    assert got[0] < sub_critical < got[1], (got, sub_critical)
