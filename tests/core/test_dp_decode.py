"""Data-parallel decode with expert-parallel MoE on a ("dp",) mesh (issue 36, item 1).

A small host-side driver plays the engine: requests of mixed lengths arrive over time,
`choose_rank` admits each to a rank (its pages from that rank's shard), every step
prefills the newly admitted requests (at most one per rank, all ranks in one step) and
decodes every running row, rows join and leave. Each request's greedy tokens must equal
the single-device `ReferenceGenerator`'s.

Tolerances: batch-invariant numerics (`--enable-batch-invariant`): log-probs bitwise
equal (every token-wise matmul has the same shapes wherever the row runs; the EP
exchange moves rows and its reduce adds zeros). Default numerics: log-probs within 1e-5
(XLA:CPU blocks its matmuls by row count, so a row batched with others rounds
differently in the last bits), tokens equal.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx
from support.hlo import vocab_wide_collectives

from cpkv_jax.decode_mesh import (
    DPDecodeSteps,
    DPPoolLayout,
    DPRow,
    build_batch,
    choose_rank,
    init_dp_pool,
)
from cpkv_jax.errors import ConfigError
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.mesh import make_dp_mesh
from cpkv_jax.model.expert_parallel import is_expert_leaf
from cpkv_jax.model.weights import load_model
from cpkv_jax.paging import pages_for_tokens
from cpkv_jax.sampling import rows_log_probs

# Among the longer files of the suite: scheduled early, longest first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=50)  # on 2 workers, 2026-12-05

P = 16
PAGES_PER_RANK = 12
INDEX_K = "float32"


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    """`get(arch, **checkpoint_kwargs) -> (cfg, model)`, each loaded once per module."""
    loaded: dict[tuple, tuple] = {}

    def get(arch: str = "glm_moe_dsa", **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in loaded:
            loaded[key] = load_model(tiny_checkpoints(arch, **kw), progress=False)
        return loaded[key]

    return get


@dataclasses.dataclass(eq=False)
class _Req:
    prompt: np.ndarray
    new: int
    arrive: int  # step at which it arrives
    rank: int = -1
    pages: np.ndarray | None = None
    out: list[int] = dataclasses.field(default_factory=list)
    lps: list[float] = dataclasses.field(default_factory=list)


def _requests(seed: int, n: int, vocab: int) -> list[_Req]:
    """Mixed lengths within few buckets (compiles are the test's cost): most prompts in
    one prefill bucket and page-table width, one page multiple, one longer (a wider
    table, so rows of different reservations share a step)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2 * P + 1, 3 * P + 11, n)
    lengths[0] = 3 * P
    lengths[-1] = 5 * P + 3
    news = rng.integers(2, 7, n)
    return [
        _Req(rng.integers(3, vocab, int(length)).astype(np.int32), int(new), arrive=i // 3)
        for i, (length, new) in enumerate(zip(lengths, news, strict=True))
    ]


def _serve(cfg, model, dp: int, reqs: list[_Req], *, invariant: bool, max_rows: int = 3):
    """Run `reqs` through DP steps; fills each request's `out` / `lps` and returns the
    distinct compiled shapes and the steps object."""
    mesh = make_dp_mesh(dp)
    layout = DPPoolLayout(dp, PAGES_PER_RANK, P)
    pool = init_dp_pool(cfg, layout, mesh, model.dtype, INDEX_K)
    steps = DPDecodeSteps(
        model, mesh, layout, pool, index_k_dtype=INDEX_K, batch_invariant=invariant
    )
    free = [list(range(r * PAGES_PER_RANK + 1, (r + 1) * PAGES_PER_RANK)) for r in range(dp)]
    waiting = list(reqs)
    running: list[_Req] = []
    clock = 0
    while waiting or running:
        # Admit in arrival order: one prefill per rank per step.
        prefills: list[_Req] = []
        for r in [r for r in waiting if r.arrive <= clock]:
            need = pages_for_tokens(len(r.prompt) + r.new, P)
            rows = [sum(q.rank == k for q in running + prefills) for k in range(dp)]
            busy = {q.rank for q in prefills}
            free_now = [0 if k in busy else len(free[k]) for k in range(dp)]
            rank = choose_rank(free_now, rows, need, max_rows)
            if rank is None:
                break  # FIFO: later ones wait too
            r.rank = rank
            r.pages = np.asarray([free[rank].pop(0) for _ in range(need)], np.int32)
            waiting.remove(r)
            prefills.append(r)
        if prefills:
            shape, order, host = build_batch(
                layout,
                [DPRow(r.rank, r.prompt, 0, r.pages, len(r.pages)) for r in prefills],
                prefill=True,
            )
            logits, pool = steps.run(shape, host, pool)
            _take(prefills, logits, order, invariant)
            running += prefills
        decoding = [r for r in running if r not in prefills and len(r.out) < r.new]
        if decoding:
            rows = [
                DPRow(
                    r.rank,
                    np.asarray([r.out[-1]], np.int32),
                    len(r.prompt) + len(r.out) - 1,
                    r.pages,
                    len(r.pages),
                )
                for r in decoding
            ]
            shape, order, host = build_batch(layout, rows, prefill=False)
            logits, pool = steps.run(shape, host, pool)
            _take(decoding, logits, order, invariant)
        for r in [r for r in running if len(r.out) >= r.new]:
            running.remove(r)
            free[r.rank] += r.pages.tolist()
        clock += 1
    assert all(len(f) == PAGES_PER_RANK - 1 for f in free)  # every page back
    return steps


def _take(reqs, logits, order, invariant: bool) -> None:
    lp = np.asarray(rows_log_probs(logits, invariant))  # each rank its rows, as served
    for r, j in zip(reqs, order, strict=False):  # row order[i] is reqs[i]'s
        tok = int(np.argmax(lp[j]))
        r.out.append(tok)
        r.lps.append(float(lp[j, tok]))


def _check(cfg, model, reqs, *, invariant: bool) -> None:
    ref = ReferenceGenerator(
        cfg, model, page_size=P, index_k_dtype=INDEX_K, batch_invariant=invariant
    )
    for r in reqs:
        want = ref.generate(r.prompt.tolist(), r.new, ignore_eos=True)
        assert r.out == want.output_ids
        if invariant:
            assert r.lps == want.output_logprobs
        else:
            np.testing.assert_allclose(r.lps, want.output_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("arch", "dp"), [("glm_moe_dsa", 8), ("deepseek_v32", 8), ("glm_moe_dsa", 2)]
)
def test_dp_decode_equals_the_single_device_reference(models, arch, dp):
    cfg, m = models(arch)
    reqs = _requests(dp, 2 * dp + 1, cfg.vocab_size)
    steps = _serve(cfg, m, dp, reqs, invariant=False)
    assert {r.rank for r in reqs} == set(range(dp))  # every rank served someone
    # Bucketed shapes only: rows per rank and widths are powers of two.
    for _, rows, _, width in steps.compiled_shapes:
        assert rows & (rows - 1) == 0 and width & (width - 1) == 0
    _check(cfg, m, reqs, invariant=False)


def test_dp4_fp8_batch_invariant_is_bitwise(models):
    cfg, m = models("glm_moe_dsa", fp8=True, n_routed_experts=16)
    reqs = _requests(4, 6, cfg.vocab_size)
    _serve(cfg, m, 4, reqs, invariant=True)
    _check(cfg, m, reqs, invariant=True)


def test_idle_ranks_and_experts_split_over_dp(models):
    cfg, m = models()
    dp = 8
    reqs = _requests(1, 1, cfg.vocab_size)  # one request: seven ranks idle every step
    steps = _serve(cfg, m, dp, reqs, invariant=False)
    _check(cfg, m, reqs, invariant=False)
    flat = nnx.to_flat_state(steps.state)
    experts = [var.get_value() for path, var in flat if is_expert_leaf(path)]
    assert experts
    for leaf in experts:  # each device holds 1/dp of every routed-expert weight
        assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // dp
    # Each rank's rows' logits stay on it (the sampler draws there): none cross ranks.
    for shape in steps.compiled_shapes:
        assert not vocab_wide_collectives(steps.compiled(shape).as_text(), cfg.vocab_size)


def test_choose_rank_prefers_free_pages_then_rows_then_round_robin():
    assert choose_rank([5, 9, 9], [0, 2, 1], 3, 4) == 2  # most free, then fewest rows
    assert choose_rank([5, 9, 9], [0, 1, 1], 3, 4) == 1  # then the first from rank 0
    assert choose_rank([9, 9, 9], [1, 1, 1], 3, 4, first=2) == 2  # ... or from `first`
    assert choose_rank([9, 9, 5], [1, 1, 1], 3, 4, first=2) == 0  # cyclic order
    assert choose_rank([5, 9, 9], [0, 4, 4], 3, 4) == 0  # full ranks are skipped
    assert choose_rank([2, 2], [0, 0], 3, 4) is None  # no rank has the pages
    assert choose_rank([9, 9], [4, 4], 1, 4) is None  # no rank has a row free


def test_layout_and_mesh_errors():
    layout = DPPoolLayout(2, 4, P)
    assert layout.local(np.asarray([5, 7]), 1).tolist() == [1, 3]
    assert layout.trash_page(1) == 4
    with pytest.raises(ValueError, match="not all on DP rank 0"):
        layout.local(np.asarray([3, 4]), 0)
    with pytest.raises(ConfigError, match="trash page"):
        DPPoolLayout(2, 1, P)
    with pytest.raises(ConfigError, match="dp_size"):
        make_dp_mesh(3)
