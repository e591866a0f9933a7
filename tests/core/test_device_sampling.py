"""Device sampling (`cpkv_jax.sampling.sample`).

The filters are checked against an independent float64 reference written with plain
Python sorting and accumulation: the set of tokens a row can draw exactly, the draws'
frequencies over many seeds within binomial bounds (stated at the check). Float32 on the
device vs float64 here: a kept set could differ only where a cumulative mass lands
within float32 rounding of `top_p`, which these fixed rows do not.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

from cpkv_jax.sampling import GREEDY, TOP_LOGPROBS_MAX, PenaltyCounts, RowSampling, sample


def random_logprobs(rng: np.random.Generator, vocab: int, scale: float = 2.0) -> np.ndarray:
    """One row of log-softmax (float32, as the steps compute it)."""
    z = rng.normal(size=vocab) * scale
    return (z - np.log(np.exp(z - z.max()).sum()) - z.max()).astype(np.float32)


def reference_probs(
    logprobs: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
):
    """Float64 reference: sort by (prob desc, id asc), keep k, then the smallest prefix
    of the renormalized rest with mass >= top_p, then those with probability >= min_p x
    the largest; renormalize."""
    z = [float(x) / temperature for x in logprobs]
    m = max(z)
    p = [math.exp(v - m) for v in z]
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    if top_k > 0:
        order = order[:top_k]
    total = sum(p[i] for i in order)
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += p[i] / total
        if mass >= top_p:
            break
    kept = [i for i in kept if p[i] >= min_p * p[order[0]]]
    out = np.zeros(len(p))
    for i in kept:
        out[i] = p[i]
    return out / out.sum(), set(kept)


def draws(lp: np.ndarray, params: RowSampling, seeds) -> np.ndarray:
    rows = [dataclasses.replace(params, seed=s) for s in seeds]
    got = sample(np.repeat(lp[None], len(rows), 0), rows)
    assert got.finite.all()
    # Each token's log-prob is its untempered log-prob, exactly.
    np.testing.assert_array_equal(got.logprobs, lp[got.tokens])
    return got.tokens


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, -1, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.3, -1, 0.8, 0.0),
        (0.5, 12, 0.6, 0.0),
        (2.0, 3, 0.3, 0.0),
        (0.8, 8, 0.9, 0.0),
        (1.0, -1, 1.0, 0.3),
        (1.5, 10, 0.95, 0.5),
        (0.6, -1, 1.0, 0.05),
    ],
)
def test_draw_frequencies_follow_the_float64_reference(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(21)
    lp = random_logprobs(rng, 16, scale=1.0)
    want, kept = reference_probs(lp, temperature, top_k, top_p, min_p)
    if min_p:  # the filter removes tokens here (else the case checks nothing new)
        assert len(kept) < len(reference_probs(lp, temperature, top_k, top_p)[1])
    n = 4000
    params = RowSampling(temperature, top_k, top_p, step=7, min_p=min_p)
    counts = np.bincount(draws(lp, params, range(n)), minlength=16)
    assert set(np.flatnonzero(counts).tolist()) <= kept  # filtered tokens never drawn
    # Each count is Binomial(n, p): within 5 standard deviations (the seeds are fixed,
    # so this is deterministic; 5 sigma leaves margin for any one of 16 tokens).
    sigma = np.sqrt(n * want * (1 - want))
    assert np.all(np.abs(counts - n * want) <= 5 * sigma + 1), (counts, n * want)


def test_greedy_and_top_k_one_are_argmax_with_ties_to_the_lower_id():
    rng = np.random.default_rng(5)
    rows = np.stack([random_logprobs(rng, 64) for _ in range(8)])
    rows[3, [10, 20]] = rows[3].max() + 0.5  # a tie
    want = np.argmax(rows, axis=-1)
    assert want[3] == 10
    greedy = sample(rows, [GREEDY] * 8)
    top1 = sample(rows, [RowSampling(1.5, 1, 1.0, seed=i, step=i) for i in range(8)])
    assert greedy.tokens.tolist() == top1.tokens.tolist() == want.tolist()


def test_top_p_and_min_p_keep_at_least_one_token():
    lp = np.log(np.asarray([0.1, 0.6, 0.1, 0.2], np.float32))
    assert set(draws(lp, RowSampling(1.0, -1, 1e-6), range(200)).tolist()) == {1}
    # min_p 1: only the most likely token (and its ties) stay; 0.3: 0.2 >= 0.18 stays.
    assert set(draws(lp, RowSampling(1.0, min_p=1.0), range(200)).tolist()) == {1}
    assert set(draws(lp, RowSampling(1.0, min_p=0.3), range(400)).tolist()) == {1, 3}
    flat = np.full(6, -math.log(6), np.float32)  # ties: top-k 2 keeps ids 0 and 1
    assert set(draws(flat, RowSampling(1.0, 2, 1.0), range(200)).tolist()) == {0, 1}


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_row_without_a_finite_maximum_is_refused_greedy_or_not(temperature):
    """Broken logits (a NaN anywhere, or nothing finite) are flagged and `pick` raises:
    the engines fail that request alone. A row with some -inf entries is fine."""
    rows = np.asarray(
        [[-1.0, np.nan, -0.5], [-np.inf] * 3, [np.nan] * 3, [-np.inf, -0.1, -np.inf]], np.float32
    )
    got = sample(rows, [RowSampling(temperature, seed=1)] * 4)
    assert got.finite.tolist() == [False, False, False, True]
    for i in range(3):
        with pytest.raises(ValueError, match="no finite maximum"):
            got.pick(i)
    assert got.pick(3) == (1, pytest.approx(-0.1), ())


def test_draws_are_seeded_stateless_per_step_and_independent_of_the_batch():
    """Token `step` depends only on the row's log-probs, seed and step: not on the order
    steps are drawn in (a decode server starts at step 1), nor on the row's place in the
    batch or the batch's size (padding rows included), nor on the other rows. Seeds use
    all 63 bits."""
    rng = np.random.default_rng(3)
    lp = random_logprobs(rng, 32, scale=0.5)
    seed = (1 << 62) + 12345

    def one(step: int, seed: int = seed) -> int:
        return int(sample(lp[None], [RowSampling(1.0, seed=seed, step=step)]).tokens[0])

    forward = [one(s) for s in range(40)]
    assert forward == [one(s) for s in reversed(range(40))][::-1]
    assert len(set(forward)) > 5  # steps are different draws, not one repeated token
    assert [one(s, seed + (1 << 32)) for s in range(40)] != forward  # the high half counts
    others = np.stack([random_logprobs(rng, 32) for _ in range(8)])
    others[5] = lp
    rows = [RowSampling(0.9, seed=i, step=3) for i in range(6)]
    rows[5] = RowSampling(1.0, seed=seed, step=11)
    assert sample(others, rows).tokens[5] == forward[11]  # 6 rows of 8, at place 5


def reference_top(logprobs: np.ndarray, n: int) -> list[tuple[int, float]]:
    """Float64 reference of a row's `n` most likely tokens: by (log-prob desc, id asc)."""
    order = sorted(range(len(logprobs)), key=lambda i: (-float(logprobs[i]), i))
    return [(i, float(logprobs[i])) for i in order[:n]]


def test_top_logprobs_are_the_untempered_n_best_ties_to_the_lower_id():
    """Each row's `top_n` alternatives are its most likely tokens under the untempered
    log-probs, most likely first, ties towards the lower id (as greedy picks, so a greedy
    token is the first alternative); rows that asked for none get none, and the values
    are the row's own log-probs exactly (they are gathered, not recomputed)."""
    rng = np.random.default_rng(7)
    vocab = 97
    lp = np.stack([random_logprobs(rng, vocab) for _ in range(5)])
    lp[1, [3, 40, 41, 90]] = lp[1].max() + 0.5  # a four-way tie for the best token
    lp[2, [10, 11]] = np.sort(lp[2])[-3]  # a tie inside the top 5, not at its head
    rows = [
        RowSampling(top_n=5),
        RowSampling(top_n=3),
        RowSampling(0.8, seed=3, top_n=TOP_LOGPROBS_MAX),
        RowSampling(),
        RowSampling(1.0, top_k=4, seed=9, top_n=1),
    ]
    got = sample(lp, rows)
    for i, row in enumerate(rows):
        token, logprob, top = got.pick(i)
        assert list(top) == reference_top(lp[i], row.top_n), i
        assert logprob == float(lp[i, token])
        if row.temperature == 0 and row.top_n:
            assert top[0][0] == token  # the greedy token leads its alternatives
    assert [t for t, _ in got.pick(1)[2]] == [3, 40, 41]
    # A step where no row asked leaves the alternatives on the device.
    plain = sample(lp, [RowSampling()] * 5)
    assert plain.top_ids is None and plain.pick(0)[2] == ()
    with pytest.raises(ValueError, match="top_n 21 outside"):
        sample(lp, [RowSampling(top_n=TOP_LOGPROBS_MAX + 1)])


def test_top_logprobs_list_only_finite_alternatives():
    """A row with fewer finite log-probs than it asked for (a masked vocabulary) lists
    those only: JSON has no -inf."""
    row = np.asarray([[-np.inf, -0.2, -np.inf, -1.7, -np.inf]], np.float32)
    assert sample(row, [RowSampling(top_n=4)]).pick(0)[2] == (
        (1, pytest.approx(-0.2)),
        (3, pytest.approx(-1.7)),
    )


def test_the_api_limit_is_the_samplers():
    """The HTTP layer refuses more alternatives, or more logit-bias tokens, than the
    sampler holds (its limits live in the JAX-free `serving.engine.api`), and prompt
    scores keep as many."""
    from cpkv_jax.sampling import LOGIT_BIAS_MAX
    from cpkv_jax.scores import TOP_SCORES
    from serving.engine.api import LOGIT_BIAS_LIMIT, TOP_LOGPROBS_LIMIT

    assert TOP_LOGPROBS_LIMIT == TOP_LOGPROBS_MAX == TOP_SCORES
    assert LOGIT_BIAS_LIMIT == LOGIT_BIAS_MAX


def test_penalties_shift_the_draw_by_the_device_counts_and_count_the_drawn_tokens():
    """A penalized row draws exactly what the plain sampler draws from its log-probs
    shifted by `frequency * count + presence * (count > 0)` (computed here on the host,
    float32 as on the device), reports the unshifted log-prob, and its drawn token is
    counted in its slot; an unpenalized row in the same step touches no slot."""
    rng = np.random.default_rng(11)
    vocab, slots = 61, 4
    lp = np.stack([random_logprobs(rng, vocab, scale=0.7) for _ in range(4)])
    counts = PenaltyCounts(slots, vocab, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    outputs = {2: [5, 5, 9, 17, 5], 0: [int(np.argmax(lp[1]))] * 3}
    for slot, out in outputs.items():
        counts.reset(slot, out)
    rows = [
        RowSampling(frequency_penalty=0.9, presence_penalty=0.4, slot=2),  # greedy
        RowSampling(0.8, seed=4, step=6, frequency_penalty=1.7, slot=0),  # sampled
        RowSampling(0.8, seed=4, step=6),  # no penalty: no slot
        RowSampling(presence_penalty=-0.3, slot=3),  # a fresh slot: nothing counted yet
    ]
    before = np.asarray(counts.counts)
    got = sample(lp, rows, counts)
    shifted = lp.copy()
    for i, row in enumerate(rows):
        if row.penalized:
            c = before[row.slot].astype(np.float32)
            shifted[i] = lp[i] - np.float32(row.frequency_penalty) * c
            shifted[i] -= np.float32(row.presence_penalty) * (c > 0)
    unpenalized = [
        dataclasses.replace(r, frequency_penalty=0.0, presence_penalty=0.0) for r in rows
    ]
    plain = sample(shifted, unpenalized)
    assert got.tokens.tolist() == plain.tokens.tolist()
    np.testing.assert_array_equal(got.logprobs, lp[np.arange(4), got.tokens])
    # The sampled row's slot counts its greedy token 3 times: at 1.7 each, it loses it.
    assert got.tokens[0] == int(np.argmax(shifted[0]))
    assert int(np.argmax(shifted[1])) != int(np.argmax(lp[1]))
    want = before.copy()
    for i, row in enumerate(rows):
        if row.penalized:
            want[row.slot, got.tokens[i]] += 1
    np.testing.assert_array_equal(np.asarray(counts.counts), want)
    # A row with a penalty needs counts and a slot in range.
    with pytest.raises(ValueError, match="no penalty counts were given"):
        sample(lp[:1], rows[:1])
    with pytest.raises(ValueError, match="slot 4 outside"):
        sample(lp[:1], [RowSampling(frequency_penalty=1.0, slot=4)], counts)
    counts.reset(2, [])  # a slot taken again starts from the new request's output
    assert not np.asarray(counts.counts)[2].any()


@pytest.mark.parametrize("rep", [1.8, 0.4])
def test_repetition_penalty_scales_the_logits_of_prompt_and_output_tokens(rep):
    """HF's / vLLM's repetition penalty on the raw logits of tokens in the prompt or the
    output (positive ones divided, others multiplied), then the frequency penalty, against
    a float64 reference; a row without one in the same step keeps its own draw; the
    reported log-probs are the unpenalized ones."""
    rng = np.random.default_rng(5)
    vocab = 53
    logits = (rng.normal(size=(3, vocab)) * 2).astype(np.float32)  # both signs
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    counts = PenaltyCounts(2, vocab, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    prompt = rng.choice(vocab, 12, replace=False)
    out = [int(t) for t in rng.choice(vocab, 4)]
    counts.reset(1, out, prompt)
    rows = [
        RowSampling(repetition_penalty=rep, slot=1),
        RowSampling(repetition_penalty=rep, frequency_penalty=0.3, slot=1),
        RowSampling(0.9, seed=2, step=4),
    ]
    got = sample(lp, rows, counts, logits=logits)
    seen = np.zeros(vocab, bool)
    seen[prompt] = True
    c = np.bincount(out, minlength=vocab).astype(np.float64)
    seen |= c > 0
    for i, row in enumerate(rows[:2]):
        z = logits[i].astype(np.float64)
        z = np.where(seen, np.where(z > 0, z / rep, z * rep), z)
        want = z - np.log(np.exp(z - z.max()).sum()) - z.max() - row.frequency_penalty * c
        assert got.tokens[i] == int(np.argmax(want)), (i, rep)
    assert got.tokens[2] == sample(lp[2:], rows[2:]).tokens[0]
    np.testing.assert_array_equal(got.logprobs, lp[np.arange(3), got.tokens])
    with pytest.raises(ValueError, match="no logits were given"):
        sample(lp, rows, counts)


def test_logit_bias_rides_in_the_slot_and_shifts_only_its_row():
    """A slot's logit bias adds to its tokens' logits (a +100 forces a token, a -100 bans
    the greedy one), against a float64 reference with and without a repetition penalty
    on the biased logits; rows without the slot in the same step are untouched; a taken
    slot starts from the new request's bias only."""
    rng = np.random.default_rng(8)
    vocab = 47
    logits = (rng.normal(size=(4, vocab)) * 2).astype(np.float32)
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    counts = PenaltyCounts(3, vocab, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    best = [int(np.argmax(row)) for row in lp]
    counts.reset(0, [], (), [(11, 100.0)])
    counts.reset(1, [], (), [(best[1], -100.0), (3, 1.5), (4, -0.25)])
    prompt = rng.choice(vocab, 6, replace=False)
    counts.reset(2, [], prompt, [(best[2], -3.0), (5, 2.0)])
    rows = [
        RowSampling(logit_bias=True, slot=0),
        RowSampling(logit_bias=True, slot=1),
        RowSampling(logit_bias=True, repetition_penalty=1.6, slot=2),
        RowSampling(),  # no slot: its own greedy token
    ]
    got = sample(lp, rows, counts, logits=logits)
    assert got.tokens[0] == 11 and got.tokens[1] != best[1] and got.tokens[3] == best[3]
    bias = np.zeros((3, vocab))
    bias[0, 11] = 100.0
    bias[1, [best[1], 3, 4]] = (-100.0, 1.5, -0.25)
    bias[2, [best[2], 5]] = (-3.0, 2.0)
    assert got.tokens[1] == int(np.argmax(lp[1].astype(np.float64) + bias[1]))
    z = logits[2].astype(np.float64) + bias[2]
    seen = np.zeros(vocab, bool)
    seen[prompt] = True
    z = np.where(seen, np.where(z > 0, z / 1.6, z * 1.6), z)
    assert got.tokens[2] == int(np.argmax(z))
    np.testing.assert_array_equal(got.logprobs, lp[np.arange(4), got.tokens])  # unbiased
    counts.reset(0, [], ())  # slot 0 taken again, without a bias
    assert sample(lp[:1], [RowSampling(frequency_penalty=0.1, slot=0)], counts).tokens[0] == best[0]


def test_set_bias_replaces_a_slots_bias_and_keeps_its_counts():
    """`PenaltyCounts.set_bias` (a `min_new_tokens` ban lifted while a decode step is in
    flight): the slot's counts, which may hold a token the host has not seen, stay as
    the sampler left them; only the bias changes. Reset rebuilds both from the host."""
    rng = np.random.default_rng(12)
    vocab = 31
    counts = PenaltyCounts(2, vocab, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    out = rng.integers(0, vocab, 5)
    counts.reset(1, out, (), [(4, -100.0)])
    lp = np.asarray(jax.nn.log_softmax(rng.normal(size=(1, vocab)).astype(np.float32), axis=-1))
    drawn = sample(lp, [RowSampling(frequency_penalty=0.5, logit_bias=True, slot=1)], counts)
    assert drawn.tokens[0] != 4
    want = np.bincount(np.append(out, drawn.tokens[0]), minlength=vocab)
    np.testing.assert_array_equal(np.asarray(counts.counts[1]), want)  # the sampler counted
    counts.set_bias(1, [(9, 100.0)])
    np.testing.assert_array_equal(np.asarray(counts.counts[1]), want)  # kept
    assert np.asarray(counts.bias_ids[1])[0] == 9 and np.asarray(counts.bias_values[1])[0] == 100
    assert (np.asarray(counts.bias_ids[1])[1:] == vocab).all()  # the old pair is gone
    again = sample(lp, [RowSampling(frequency_penalty=0.5, logit_bias=True, slot=1)], counts)
    assert again.tokens[0] == 9
    with pytest.raises(ValueError, match="slot 2 outside"):
        counts.set_bias(2)


@pytest.mark.parametrize("penalized", [False, True])
def test_rows_left_on_a_mesh_draw_where_they_are_as_on_one_device(penalized):
    """A mesh step leaves its log-prob rows on the ranks that ran them, in its own layout
    (`order`: caller row `i` at step row `order[i]`; `StepLogits`). Drawing there gives
    what one device gives for the same rows in the caller's order, bit for bit: tokens
    (greedy with forced ties, sampled with top-k / top-p / min-p), their log-probs, the
    top alternatives, a grammar mask's restriction, and the penalty slots' counts. The
    compiled sampler moves nothing vocabulary-wide between ranks (XLA's partitioner, left
    to itself, all-gathered the rows for the top-k)."""
    from support.hlo import vocab_wide_collectives

    from cpkv_jax.mesh import make_dp_mesh
    from cpkv_jax.sampling import _sample, _sample_penalized, placement, rows_at, sample_async

    rng = np.random.default_rng(5)
    vocab, n_rows, n = 97, 16, 11
    lp = np.stack([random_logprobs(rng, vocab) for _ in range(n_rows)])
    order = rng.permutation(n_rows).astype(np.int32)
    tie = order[0]  # caller row 0 (greedy): a tie for its best token, the lower id wins
    lp[tie, [7, 40]] = lp[tie].max() + 1.0
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    rows = [
        RowSampling(
            temperature=0.0 if i % 3 == 0 else float(rng.uniform(0.3, 1.5)),
            top_k=int(rng.choice([-1, 5, 40])),
            top_p=float(rng.choice([1.0, 0.8])),
            min_p=float(rng.choice([0.0, 0.05])),
            seed=int(rng.integers(0, 2**40)),
            step=i,
            top_n=i % 4,
            frequency_penalty=0.6 if penalized and i % 2 else 0.0,
            repetition_penalty=1.4 if penalized and i % 4 == 1 else 1.0,
            slot=i % 3 if penalized and i % 2 else -1,
        )
        for i in range(n)
    ]
    mask = np.full((n_rows, (vocab + 31) // 32), -1, np.int32)
    mask[2, 1:] = 0  # caller row 2: a grammar allows tokens 0..31 only
    mesh = make_dp_mesh(8)
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    history = [[int(t) for t in rng.integers(0, vocab, 6)] for _ in range(3)]
    counts = {}
    for name, where in (("one", one), ("mesh", whole)):
        counts[name] = PenaltyCounts(3, vocab, where, split if name == "mesh" else None)
        for slot, out in enumerate(history):
            counts[name].reset(slot, out, prompt_ids=out[:2])
    logits = lp * 1.3  # the raw logits a repetition penalty reads
    want = sample(lp[order], rows, counts["one"], logits[order], mask)
    on_mesh = jax.device_put(lp, split)
    got = sample(on_mesh, rows, counts["mesh"], jax.device_put(logits, split), mask, order)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    np.testing.assert_array_equal(got.top_ids, want.top_ids)
    np.testing.assert_array_equal(got.top_logprobs, want.top_logprobs)
    assert got.tokens[0] == 7
    assert got.tokens[2] < 32  # the grammar row drew an allowed token
    np.testing.assert_array_equal(
        np.asarray(counts["mesh"].counts), np.asarray(counts["one"].counts)
    )
    assert counts["mesh"].counts.sharding.is_fully_replicated
    # The drawn tokens stay on the device for the next step's feed, on every device.
    assert sample_async(on_mesh, rows[:1], order=order).tokens.sharding.is_fully_replicated
    # Compiled on the split rows: no collective moves a vocabulary-wide array.
    place, src = placement(order, n, n_rows)
    per_row = tuple(
        np.zeros(n_rows, d)
        for d in (np.float32, np.int32, np.float32, np.uint32, np.uint32, np.uint32, np.float32)
    )
    args = (on_mesh, per_row, np.bool_(True), src, place)
    if penalized:
        c = counts["mesh"]
        pen = (np.zeros(n_rows, np.int32), *(np.zeros(n_rows, np.float32) for _ in range(3)))
        extra = (c.counts, (c.prompt, c.bias_ids, c.bias_values), pen, on_mesh, rows_at(on_mesh))
        hlo = _sample_penalized.lower(*args, *extra).compile().as_text()
    else:
        hlo = _sample.lower(*args, rows_at(on_mesh)).compile().as_text()
    assert not vocab_wide_collectives(hlo, vocab)
