"""Owner attention (issue 40 item 1) against the full-view path it replaces, on 8 virtual
devices: the same top-k positions in the same order, and the same attention output.

Exactness of the selection needs bitwise-equal index scores: the owner path scores the
`cp * t` all-gathered queries against `S / cp` keys, the full-view path `t` queries
against `S` keys, and XLA:CPU may round a dot of another shape differently. The top-k
tests therefore use small-integer queries, keys and head weights, whose scores are exact
in float32 whatever the reduction order - which also forces ties everywhere (repeated
keys, and ReLU zeros), the case the tie rule (score descending, then lowest position)
exists for. A float-valued case checks the selections agree on random data too.

Attention merges `cp` partial softmaxes by log-sum-exp instead of one softmax over the
selected rows: the outputs agree to float32 rounding (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from cpkv_jax.materialize import CPKVIO
from cpkv_jax.mesh import CP_AXIS, make_cp_mesh
from cpkv_jax.model.indexer import indexer_topk
from cpkv_jax.model.kv_cache import dequantize_index_k, take_view_rows
from cpkv_jax.model.mla import sparse_attention
from cpkv_jax.model.numerics import batch_invariant, token_block_bytes
from cpkv_jax.owner_attention import merge_partials, owner_attention, owner_topk

CP = 8
PAGE = 4
PAGES_PER_LANE = 12
T_LOCAL = 6  # query tokens per rank
HEADS, DIM = 4, 16


def _layout(rng, lengths):
    """A shared-KV page table: logical page p of row b on lane p % CP, at a distinct
    random local page (1.. : page 0 is the trash page); width a multiple of CP."""
    pages = [-(-n // PAGE) for n in lengths]
    width = CP * -(-max(pages) // CP)
    table = np.zeros((len(lengths), width), np.int32)
    free = {lane: list(rng.permutation(np.arange(1, PAGES_PER_LANE))) for lane in range(CP)}
    for b, n in enumerate(pages):
        for p in range(n):
            table[b, p] = free[p % CP].pop()
    return table


def _queries(rng, lengths):
    """Per row, `CP * T_LOCAL` query positions (in rank order) inside the row's KV."""
    return np.stack([rng.integers(0, n, CP * T_LOCAL) for n in lengths]).astype(np.int32)


def _run(fn, *args, in_specs):
    mesh = make_cp_mesh(CP)
    split = P(None, CP_AXIS)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=split, check_vma=False)
    return np.asarray(jax.jit(mapped)(*args))


def _topk_both(q, w, keys, scale, table, positions, kv_lens, index_topk):
    def full(q, w, keys, scale, table, positions, kv_lens):
        io = CPKVIO(CP, shared=True)
        view = dequantize_index_k(
            io.view(keys, table), None if scale is None else io.view(scale, table)
        )
        return indexer_topk(q, w, view, positions, kv_lens, index_topk)

    def owner(q, w, keys, scale, table, positions, kv_lens):
        return owner_topk(q, w, keys, scale, table, positions, kv_lens, index_topk, cp=CP)

    split = P(None, CP_AXIS)
    specs = (split, split, P(CP_AXIS), P(CP_AXIS) if scale is not None else None, P(), split, P())
    args = (q, w, keys, scale, table, positions, kv_lens)
    return [_run(f, *args, in_specs=specs) for f in (full, owner)]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("index_topk", [5, 16, 64])
def test_owner_topk_equals_the_full_view_with_forced_ties(fp8, index_topk):
    rng = np.random.default_rng(index_topk + 7 * fp8)
    lengths = [41, 150, 3]
    table = _layout(rng, lengths)
    positions = _queries(rng, lengths)
    kv_lens = np.asarray(lengths, np.int32)
    n = CP * PAGES_PER_LANE
    # Small integers: exact scores, repeated keys (8 distinct vectors) and ReLU zeros.
    basis = rng.integers(-2, 3, (8, DIM)).astype(np.float32)
    keys = basis[rng.integers(0, 8, (n, PAGE))]
    q = rng.integers(-2, 3, (3, CP * T_LOCAL, HEADS, DIM)).astype(np.float32)
    w = rng.integers(1, 3, (3, CP * T_LOCAL, HEADS)).astype(np.float32)
    scale = None
    if fp8:  # integers are exact in e4m3; a power-of-two scale keeps them exact
        keys = keys.astype(jnp.float8_e4m3fn)
        scale = np.full((n, PAGE), 0.5, np.float32)
    full, owner = _topk_both(q, w, keys, scale, table, positions, kv_lens, index_topk)
    np.testing.assert_array_equal(owner, full)
    # An independent oracle: exact scores in numpy, ordered by (-score, position).
    k_all = np.asarray(keys, np.float32) * (1.0 if scale is None else scale[..., None])
    ties = 0
    for b, length in enumerate(lengths):
        logical = np.arange(length)
        rows = k_all.reshape(CP, PAGES_PER_LANE, PAGE, DIM)[
            logical // PAGE % CP, table[b, logical // PAGE], logical % PAGE
        ]
        score = np.einsum("thd,sd->ths", q[b], rows)
        score = np.einsum("ths,th->ts", np.maximum(score, 0), w[b])
        for t, pos in enumerate(positions[b]):
            order = np.lexsort((logical[: pos + 1], -score[t, : pos + 1]))
            want = order[: min(index_topk, pos + 1)]
            np.testing.assert_array_equal(full[b, t, : want.size], want)
            assert np.all(full[b, t, want.size :] == -1)
            rest = order[want.size :]
            ties += bool(rest.size) and score[t, rest[0]] == score[t, want[-1]]
    # The inputs do force ties at the selection's edge (a test of the tie rule, not luck).
    assert ties > 10


def test_owner_topk_equals_the_full_view_on_random_floats():
    rng = np.random.default_rng(3)
    lengths = [97, 180]
    table = _layout(rng, lengths)
    positions = _queries(rng, lengths)
    n = CP * PAGES_PER_LANE
    keys = rng.standard_normal((n, PAGE, DIM)).astype(np.float32)
    q = rng.standard_normal((2, CP * T_LOCAL, HEADS, DIM)).astype(np.float32)
    w = rng.standard_normal((2, CP * T_LOCAL, HEADS)).astype(np.float32)
    kv_lens = np.asarray(lengths, np.int32)
    full, owner = _topk_both(q, w, keys, None, table, positions, kv_lens, 32)
    np.testing.assert_array_equal(owner, full)


def test_owner_topk_in_token_blocks_equals_one_block():
    """A 1-byte block budget: the all-gather / all-to-all run once per 16-token block."""
    rng = np.random.default_rng(5)
    lengths = [120]
    table = _layout(rng, lengths)
    positions = np.stack([rng.integers(0, 120, CP * 40)]).astype(np.int32)
    n = CP * PAGES_PER_LANE
    keys = rng.integers(-2, 3, (n, PAGE, DIM)).astype(np.float32)
    q = rng.integers(-2, 3, (1, CP * 40, HEADS, DIM)).astype(np.float32)
    w = np.ones((1, CP * 40, HEADS), np.float32)
    kv_lens = np.asarray(lengths, np.int32)
    args = (q, w, keys, None, table, positions, kv_lens)
    split = P(None, CP_AXIS)
    specs = (split, split, P(CP_AXIS), None, P(), split, P())

    def owner(budget):
        def fn(q, w, keys, scale, table, positions, kv_lens):
            with token_block_bytes(budget):
                return owner_topk(q, w, keys, scale, table, positions, kv_lens, 24, cp=CP)

        return _run(fn, *args, in_specs=specs)

    np.testing.assert_array_equal(owner(1), owner(None))


def _attention_inputs(rng, lengths, k):
    table = _layout(rng, lengths)
    n = CP * PAGES_PER_LANE
    lora, rope, nope, v = 16, 8, 8, 8
    latent = rng.standard_normal((n, PAGE, lora + rope)).astype(np.float32)
    q_nope = rng.standard_normal((len(lengths), CP * T_LOCAL, HEADS, nope)).astype(np.float32)
    q_pe = rng.standard_normal((len(lengths), CP * T_LOCAL, HEADS, rope)).astype(np.float32)
    w_kv_b = rng.standard_normal((HEADS * (nope + v), lora)).astype(np.float32) / 4
    # Distinct positions per query, -1 padded (a short row selects fewer than k).
    topk = np.full((len(lengths), CP * T_LOCAL, k), -1, np.int32)
    for b, length in enumerate(lengths):
        for t in range(CP * T_LOCAL):
            m = min(k, length, int(rng.integers(1, k + 1)))
            topk[b, t, :m] = rng.choice(length, m, replace=False)
    topk[0, 0] = -1  # a query with nothing selected (a padding token) gives 0
    dims = dict(kv_lora_rank=lora, v_head_dim=v, scale=0.3)
    return table, latent, q_nope, q_pe, w_kv_b, topk, dims


@pytest.mark.parametrize(
    ("invariant", "capacity"), [(False, None), (True, None), (False, 1), (False, 12)]
)
def test_owner_attention_equals_sparse_attention_over_the_full_view(invariant, capacity):
    """Capacity 1: nearly every block runs over all k columns (some query owns two of
    its 24 positions on the rank); 12: no query owns that many, every block compacts;
    the default (6) mixes both."""
    rng = np.random.default_rng(11)
    table, latent, q_nope, q_pe, w_kv_b, topk, dims = _attention_inputs(rng, [150, 37], 24)

    def full(q_nope, q_pe, latent, table, topk, w_kv_b):
        with batch_invariant(invariant):
            view = CPKVIO(CP, shared=True).view(latent, table)
            return sparse_attention(
                q_nope, q_pe, view, topk, w_kv_b, form="absorbed", take=take_view_rows, **dims
            )

    def owner(q_nope, q_pe, latent, table, topk, w_kv_b):
        with batch_invariant(invariant):
            return owner_attention(
                q_nope, q_pe, latent, table, topk, w_kv_b, cp=CP, capacity=capacity, **dims
            )

    split = P(None, CP_AXIS)
    specs = (split, split, P(CP_AXIS), P(), split, P())
    args = (q_nope, q_pe, latent, table, topk, w_kv_b)
    want, got = (_run(f, *args, in_specs=specs) for f in (full, owner))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(got[0, 0] == 0) and np.abs(want).max() > 0.1


def test_the_pallas_gathers_give_the_xla_paths_bits():
    """`--kernel-impl pallas` reaches owner attention: the owned index-K pages (fp8 with
    scales) and the selected latent rows come from the Pallas paged-gather kernel
    (interpret mode here), and the top-k and the attention output are bitwise the XLA
    gathers' (the kernel copies bytes)."""
    rng = np.random.default_rng(21)
    lengths = [97, 180]
    table = _layout(rng, lengths)
    positions = _queries(rng, lengths)
    n = CP * PAGES_PER_LANE
    keys = rng.standard_normal((n, PAGE, DIM)).astype(jnp.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, (n, PAGE)).astype(np.float32)
    q = rng.standard_normal((2, CP * T_LOCAL, HEADS, DIM)).astype(np.float32)
    w = rng.standard_normal((2, CP * T_LOCAL, HEADS)).astype(np.float32)
    kv_lens = np.asarray(lengths, np.int32)
    split = P(None, CP_AXIS)

    def topk(impl):
        def fn(q, w, keys, scale, table, positions, kv_lens):
            return owner_topk(q, w, keys, scale, table, positions, kv_lens, 32, cp=CP, impl=impl)

        specs = (split, split, P(CP_AXIS), P(CP_AXIS), P(), split, P())
        return _run(fn, q, w, keys, scale, table, positions, kv_lens, in_specs=specs)

    np.testing.assert_array_equal(topk("pallas"), topk("xla"))
    table, latent, q_nope, q_pe, w_kv_b, sel, dims = _attention_inputs(rng, lengths, 24)

    def attend(impl):
        def fn(q_nope, q_pe, latent, table, sel, w_kv_b):
            return owner_attention(
                q_nope, q_pe, latent, table, sel, w_kv_b, cp=CP, impl=impl, **dims
            )

        specs = (split, split, P(CP_AXIS), P(), split, P())
        return _run(fn, q_nope, q_pe, latent, table, sel, w_kv_b, in_specs=specs)

    got = attend("pallas")
    np.testing.assert_array_equal(got, attend("xla"))
    assert np.abs(got).max() > 0.1


@pytest.mark.parametrize(("fp8", "tokens"), [(False, 1), (True, 3)])
def test_decode_rows_score_their_owned_pages_with_the_paged_kernel(fp8, tokens):
    """A CP decode step (`axis=0`: each rank holds whole rows, one query each; three for
    a speculative verify of two drafts, each causal at its own position) with
    `--kernel-impl pallas`: each rank's scores come from the paged indexer-scores kernel
    over its lane's owned pages (logical pages `r, r + cp, ...`, no local float32 view)
    instead of the view. Small-integer inputs (exact scores, forced ties) make the
    selections of both equal exactly, for rows of one to ten pages."""
    rng = np.random.default_rng(31 + fp8)
    lengths = [3, 40, 17, 33, 9, 26, 38, 12]  # one row per rank; at most 11 pages a lane
    table = _layout(rng, lengths)
    kv_lens = np.asarray(lengths, np.int32)
    positions = (kv_lens[:, None] - tokens + np.arange(tokens)).astype(np.int32)
    n = CP * PAGES_PER_LANE
    basis = rng.integers(-2, 3, (8, DIM)).astype(np.float32)
    keys = basis[rng.integers(0, 8, (n, PAGE))]
    scale = None
    if fp8:
        keys = keys.astype(jnp.float8_e4m3fn)
        scale = np.full((n, PAGE), 0.5, np.float32)
    q = rng.integers(-2, 3, (len(lengths), tokens, HEADS, DIM)).astype(np.float32)
    w = rng.integers(1, 3, (len(lengths), tokens, HEADS)).astype(np.float32)
    rows = P(CP_AXIS)

    def topk(impl):
        def fn(q, w, keys, scale, table, positions, kv_lens):
            return owner_topk(
                q, w, keys, scale, table, positions, kv_lens, 16, cp=CP, axis=0, impl=impl
            )

        lane = P(CP_AXIS) if scale is not None else None
        specs = (rows, rows, P(CP_AXIS), lane, P(), rows, P())
        mapped = jax.shard_map(
            fn, mesh=make_cp_mesh(CP), in_specs=specs, out_specs=rows, check_vma=False
        )
        return np.asarray(jax.jit(mapped)(q, w, keys, scale, table, positions, kv_lens))

    got, want = topk("pallas"), topk("xla")
    np.testing.assert_array_equal(got, want)
    valid = (got >= 0).sum(-1)  # each token selects among the positions up to its own
    np.testing.assert_array_equal(valid, np.minimum(16, positions + 1))


def test_merge_partials_is_one_softmax():
    """Partials over disjoint key sets (one empty) merge to the softmax over all keys."""
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((1, 2, 1, 12)) * 4  # [b, t, h, k]
    values = rng.standard_normal((1, 2, 12, 3))
    owner_of = np.array([0, 0, 2, 2, 2, 0, 3, 3, 0, 2, 3, 0])  # rank 1 owns nothing
    parts = []
    for r in range(4):
        s = np.where(owner_of == r, scores, -np.inf)
        m = s.max(-1)
        e = np.where(owner_of == r, np.exp(s - np.where(np.isfinite(m), m, 0)[..., None]), 0)
        parts.append((np.einsum("bthk,btkc->bthc", e, values), m, e.sum(-1)))
    out, row_max, row_sum = (np.stack(x, axis=1) for x in zip(*parts, strict=True))
    got = merge_partials(jnp.asarray(out), jnp.asarray(row_max), jnp.asarray(row_sum))
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bthk,btkc->bthc", p / p.sum(-1, keepdims=True), values)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    empty = merge_partials(
        jnp.zeros((1, 4, 1, 1, 3)), jnp.full((1, 4, 1, 1), -jnp.inf), jnp.zeros((1, 4, 1, 1))
    )
    assert np.all(np.asarray(empty) == 0)


def test_decode_rows_views_are_the_prefill_layout_s():
    """`CPKVIO(query_axis=0)` (the batch-invariant CP decode): with the rows split over the
    ranks, each rank's rows get the full view the rows-replicated path (a prefill's,
    `query_axis=1`) builds for them - bit for bit, every position in logical order, for
    rows of different lengths (one row per rank here)."""
    rng = np.random.default_rng(21)
    lengths = [45, 3, 17, 32, 9, 1, 26, 40]  # 1 to 12 pages: some wrap the lanes
    table = _layout(rng, lengths)
    pool = jnp.asarray(rng.standard_normal((CP * PAGES_PER_LANE, PAGE, DIM)), jnp.float32)
    mesh = make_cp_mesh(CP)

    def mapped(io, table_spec):
        fn = jax.shard_map(
            lambda pool, table: io.view(pool, table),
            mesh=mesh,
            in_specs=(P(CP_AXIS), table_spec),
            out_specs=table_spec,
            check_vma=False,
        )
        return np.asarray(jax.jit(fn)(pool, table))

    rows_split = mapped(CPKVIO(CP, shared=True, query_axis=0), P(CP_AXIS))
    replicated = mapped(CPKVIO(CP, shared=True), P())
    np.testing.assert_array_equal(rows_split, replicated)
    # And the view is the pool's pages in logical order: page p from lane p % CP.
    host = np.asarray(pool).reshape(CP, PAGES_PER_LANE, PAGE, DIM)
    for b, n in enumerate(lengths):
        want = np.concatenate([host[p % CP, table[b, p]] for p in range(-(-n // PAGE))])
        np.testing.assert_array_equal(rows_split[b, : len(want)], want)


@pytest.mark.parametrize("tokens", [1, 3])
def test_decode_rows_attend_where_the_pages_live(tokens):
    """A CP decode step's attention (`axis=0`: each rank holds whole rows; three tokens
    per row for a speculative verify): the ranks exchange the model's `q_nope` / `q_pe`
    and partials already through `w_uv` (the decode exchange), and the output is sparse
    attention over each row's full view to float32 rounding (rtol 1e-5, atol 1e-6, as
    the prefill form's log-sum-exp merge). One row per rank, 1 to 12 pages (some wrap
    the lanes); a query with nothing selected gives 0."""
    rng = np.random.default_rng(43 + tokens)
    lengths = [45, 3, 17, 32, 9, 1, 26, 40]
    table = _layout(rng, lengths)
    n = CP * PAGES_PER_LANE
    lora, rope, nope, v, k = 16, 8, 8, 8, 24
    latent = rng.standard_normal((n, PAGE, lora + rope)).astype(np.float32)
    q_nope = rng.standard_normal((CP, tokens, HEADS, nope)).astype(np.float32)
    q_pe = rng.standard_normal((CP, tokens, HEADS, rope)).astype(np.float32)
    w_kv_b = rng.standard_normal((HEADS * (nope + v), lora)).astype(np.float32) / 4
    topk = np.full((CP, tokens, k), -1, np.int32)
    for b, length in enumerate(lengths):
        for t in range(tokens):
            m = min(k, length, int(rng.integers(1, k + 1)))
            topk[b, t, :m] = rng.choice(length, m, replace=False)
    topk[3, 0] = -1
    dims = dict(kv_lora_rank=lora, v_head_dim=v, scale=0.3)
    host = latent.reshape(CP, PAGES_PER_LANE, PAGE, lora + rope)
    width = table.shape[1] * PAGE
    view = np.zeros((CP, width, lora + rope), np.float32)
    for b, length in enumerate(lengths):
        pos = np.arange(length)
        view[b, :length] = host[pos // PAGE % CP, table[b, pos // PAGE], pos % PAGE]
    want = np.asarray(
        jax.jit(
            lambda q_nope, q_pe, view, topk, w: sparse_attention(
                q_nope, q_pe, view, topk, w, form="absorbed", take=take_view_rows, **dims
            )
        )(q_nope, q_pe, view, topk, w_kv_b)
    )
    rows = P(CP_AXIS)
    fn = jax.shard_map(
        lambda q_nope, q_pe, latent, table, topk, w: owner_attention(
            q_nope, q_pe, latent, table, topk, w, cp=CP, axis=0, **dims
        ),
        mesh=make_cp_mesh(CP),
        in_specs=(rows, rows, rows, P(), rows, P()),
        out_specs=rows,
        check_vma=False,
    )
    got = np.asarray(jax.jit(fn)(q_nope, q_pe, latent, table, topk, w_kv_b))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(got[3, 0] == 0) and np.abs(want).max() > 0.1
