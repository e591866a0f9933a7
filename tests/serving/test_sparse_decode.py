"""Sparse paged decode (issue 35): attention reads only the top-k latent rows.

`PagedKVIO` (the default `kv_io` of every single-device step) gathers each query's
selected latent rows from the pool by (page, offset); `DENSE_VIEW_KV_IO` gathers the
request's whole context into a view first, as every step did before. The two must give
the same tokens, and log-probs within 1e-5 (the gathered rows are the same values, but
XLA may fuse the two gathers into different programs; observed differences are ~1e-7),
and the same bits under batch-invariant numerics. Each case runs the decode engine over
requests of mixed lengths, all well past `index_topk` (16 in the tiny config), joining
and leaving a running batch, for both architectures and the FP8 checkpoint's weights.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.decode_model import INDEX_K, P, two_layer_config

from cpkv_jax.config import ModelConfig
from cpkv_jax.kv_store import PagedKVStore
from cpkv_jax.model.forward_batch import abstract_batch
from cpkv_jax.model.kv_cache import (
    DENSE_VIEW_KV_IO,
    SINGLE_DEVICE_KV_IO,
    PagedKVIO,
    pool_shapes,
    take_paged_rows,
    write_rows,
)
from cpkv_jax.model.transformer import CausalLM, forward_step
from cpkv_jax.model.weights import load_model
from cpkv_jax.tools.tiny_config import tiny_config_dict
from serving.decode.engine import DecodeEngine
from serving.engine.api import GenerateRequest, SamplingParams

# Among the longer files of the suite: scheduled early, longest first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=43)  # on 2 workers, 2026-12-05

LP_TOL = 1e-5  # see the module docstring
POOL_PAGES = 48
# (prompt length, max_new_tokens, step it joins at): contexts 2-5x index_topk in one
# prefill bucket (64), 3 to 5 pages each in one batch (the first, the longest, runs
# throughout: every decode table is 8 wide), one leaving after 2 tokens while others
# join. Few distinct shapes (5 programs per path): each one compiles.
WAVE = [(60, 14, 0), (37, 7, 0), (50, 2, 1), (45, 6, 1), (62, 3, 2)]
TWO_LAYERS = {"num_hidden_layers": 2, "first_k_dense_replace": 1}


def _deepseek_two_layers() -> tuple[ModelConfig, CausalLM]:
    d = tiny_config_dict("deepseek_v32") | TWO_LAYERS
    cfg = ModelConfig.from_dict(d)
    return cfg, CausalLM(cfg, rngs=nnx.Rngs(1))


def _glm_two_layers() -> tuple[ModelConfig, CausalLM]:
    cfg = two_layer_config()
    return cfg, CausalLM(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    def fp8():  # the tiny FP8 checkpoint: full, shared, shared indexer; dense, MoE, MoE
        path = tiny_checkpoints("glm_moe_dsa", fp8=True)
        cfg, model = load_model(path, progress=False)
        assert any("weight_scale" in str(k) for k, _ in nnx.to_flat_state(nnx.state(model)))
        return cfg, model

    return {"glm": _glm_two_layers, "deepseek": _deepseek_two_layers, "glm-fp8": fp8}


def _run(cfg, model, kv_io, *, batch_invariant=False):
    kv = PagedKVStore.create(cfg, POOL_PAGES, P, jnp.float32, INDEX_K)
    engine = DecodeEngine(
        cfg=cfg,
        model=model,
        kv=kv,
        page_size=P,
        index_k_dtype=INDEX_K,
        mode="null",
        max_running_requests=8,
        batch_invariant=batch_invariant,
        kv_io=kv_io,
    )
    rng = np.random.default_rng(7)
    schedule: dict[int, list[GenerateRequest]] = {}
    for i, (n, m, at) in enumerate(WAVE):
        ids = tuple(int(t) for t in rng.integers(3, cfg.vocab_size, n))
        req = GenerateRequest(
            f"r{i}",
            ids,
            SamplingParams(max_new_tokens=m, ignore_eos=True),
            return_logprob=True,
        )
        schedule.setdefault(at, []).append(req)
    toks: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    step = 0
    free0 = kv.num_free_pages
    while step in schedule or engine.has_work():
        for r in schedule.get(step, []):
            engine.add(r)
        for c in engine.step():
            assert c.error is None, c.error
            toks.setdefault(c.rid, []).extend(c.token_ids)
            lps.setdefault(c.rid, []).extend(c.logprobs or ())
        step += 1
        assert step < 100
    assert kv.num_free_pages == free0
    return toks, lps, engine.step_shapes


@pytest.mark.parametrize("which", ["deepseek", "glm-fp8"])
def test_sparse_decode_gives_the_dense_paths_tokens(models, which):
    cfg, model = models[which]()
    sparse_toks, sparse_lps, shapes = _run(cfg, model, SINGLE_DEVICE_KV_IO)
    dense_toks, dense_lps, _ = _run(cfg, model, DENSE_VIEW_KV_IO)
    assert {rows for _, rows, t, _ in shapes if t == 1} == {1, 2, 4}, shapes  # decode steps
    assert sparse_toks == dense_toks
    assert [len(sparse_toks[f"r{i}"]) for i in range(len(WAVE))] == [m for _, m, _ in WAVE]
    for rid, lp in sparse_lps.items():
        np.testing.assert_allclose(lp, dense_lps[rid], rtol=0, atol=LP_TOL, err_msg=rid)
    if which != "deepseek":
        # The XLA indexer's page blocks (`blocked_index_scores`, CPU): two pages per
        # block, so these 3-5 page contexts score in 2-3 blocks of their 8-page tables.
        blocked = PagedKVIO(index_block_tokens=2 * P)
        blocked_toks, blocked_lps, _ = _run(cfg, model, blocked)
        assert blocked_toks == sparse_toks
        for rid, lp in blocked_lps.items():
            np.testing.assert_allclose(lp, sparse_lps[rid], rtol=0, atol=LP_TOL, err_msg=rid)
        return
    # `--kernel-impl pallas` (interpret mode here): the row gather and the indexer scores
    # read from the paged index K by the Pallas kernels give the same tokens.
    kernels = PagedKVIO(gather_impl="pallas", index_impl="pallas")
    kernel_toks, kernel_lps, _ = _run(cfg, model, kernels)
    assert kernel_toks == sparse_toks
    for rid, lp in kernel_lps.items():
        np.testing.assert_allclose(lp, sparse_lps[rid], rtol=0, atol=LP_TOL, err_msg=rid)


def test_sparse_decode_is_bitwise_the_dense_path_when_batch_invariant(models):
    """The GLM case: batch-invariant numerics make the comparison exact. The sparse row
    gather through the Pallas kernel (`--kernel-impl pallas`, interpret mode here) gives
    the same bits too."""
    cfg, model = models["glm"]()
    sparse = _run(cfg, model, SINGLE_DEVICE_KV_IO, batch_invariant=True)[:2]
    dense = _run(cfg, model, DENSE_VIEW_KV_IO, batch_invariant=True)[:2]
    assert sparse == dense
    pallas = _run(cfg, model, PagedKVIO(gather_impl="pallas"), batch_invariant=True)[:2]
    assert pallas == sparse


def _shapes_in(jaxpr) -> set[tuple[int, ...]]:
    """Every intermediate's shape in `jaxpr` and the jaxprs nested in it (jit, loops)."""
    out: set[tuple[int, ...]] = set()
    for eqn in jaxpr.eqns:
        out |= {tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")}
        for p in eqn.params.values():
            for sub in p if isinstance(p, list | tuple) else [p]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    out |= _shapes_in(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    out |= _shapes_in(sub)
    return out


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_sparse_decode_step_never_builds_the_latent_view(batch_invariant):
    """Traced, not run: the decode step's program has no `[rows, width * P, latent]`
    array (the dense path's view, the context-sized read sparse decode removes), while
    the float32 index K view is there on the XLA path (the indexer scores every token)
    and gone with the Pallas indexer kernel."""
    cfg, model = _glm_two_layers()
    graphdef, state = nnx.split(model)
    rows, width = 4, 64
    pool = pool_shapes(cfg, POOL_PAGES, P, jnp.float32, INDEX_K)
    batch = abstract_batch(rows, 1, width)

    def shapes(kv_io):
        jaxpr = jax.make_jaxpr(
            lambda s, b, p: forward_step(
                graphdef,
                s,
                b,
                p,
                kv_io=kv_io,
                index_k_dtype=INDEX_K,
                form="absorbed",
                invariant=batch_invariant,
            )
        )(state, batch, pool)
        return _shapes_in(jaxpr.jaxpr)

    view_rows = 1 if batch_invariant else rows  # batch-invariant: one sequence at a time
    latent_view = (view_rows, width * P, cfg.kv_cache_dim)
    index_view = (view_rows, width * P, cfg.index_head_dim)
    dense, sparse = shapes(DENSE_VIEW_KV_IO), shapes(SINGLE_DEVICE_KV_IO)
    assert latent_view in dense and index_view in dense  # the check can see a view
    assert latent_view not in sparse
    assert index_view in sparse
    # The Pallas indexer-scores kernel reads the index K from the pool instead; under
    # batch-invariant numerics the view path (whose bits prefill matches) stays.
    kernels = shapes(PagedKVIO(gather_impl="pallas", index_impl="pallas"))
    assert latent_view not in kernels
    assert (index_view in kernels) == batch_invariant


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_the_pallas_row_gather_is_the_xla_gather_bit_for_bit(dtype):
    """`--kernel-impl pallas` (issue 35): the sparse decode's top-k row gather through
    the paged-gather kernel (interpret mode here) moves the XLA gather's bits, for a
    latent-like row (576 = 9 x 64 elements), any dtype, a shuffled page table and
    positions that repeat (top-k ties) and sit on page edges."""
    rng = np.random.default_rng(3)
    pages, page, dim = 12, 4, 576
    pool = jnp.asarray(rng.standard_normal((pages, page, dim)), jnp.float32).astype(dtype)
    table = jnp.asarray(np.stack([rng.permutation(np.arange(1, pages))[:5] for _ in range(2)]))
    positions = rng.integers(0, 5 * page, (2, 3, 7))
    positions[0, 0, :3] = [0, page - 1, page]  # page edges
    positions[1, 2, 4:] = positions[1, 2, 3]  # a tie: one row taken four times
    positions = jnp.asarray(positions, jnp.int32)
    xla = take_paged_rows(pool, table, positions)
    pallas = jax.jit(lambda p, t, i: take_paged_rows(p, t, i, "pallas"))(pool, table, positions)
    assert pallas.shape == (2, 3, 7, dim) and pallas.dtype == pool.dtype
    np.testing.assert_array_equal(
        np.asarray(jax.lax.bitcast_convert_type(pallas, jnp.uint8)),
        np.asarray(jax.lax.bitcast_convert_type(xla, jnp.uint8)),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("n", [1, 6])
def test_the_kv_write_is_the_flat_scatter_bit_for_bit(dtype, n):
    """`write_rows` (every step's KV write, by (page, offset); narrow pools through their
    integer view on CPU) leaves the pool a flat scatter of the same rows would, bit for
    bit: random rows at shuffled slots across pages, page edges and the trash page."""
    rng = np.random.default_rng(n)
    pages, page, dim = 9, 8, 24
    pool = jnp.asarray(rng.standard_normal((pages, page, dim)), jnp.float32).astype(dtype)
    slots = rng.permutation(pages * page)[:n]
    slots[0] = page - 1  # the trash page's last row
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    want = np.asarray(pool).reshape(pages * page, dim).copy()
    want[slots] = np.asarray(jnp.asarray(rows).astype(dtype))
    got = jax.jit(write_rows, donate_argnums=0)(pool, jnp.asarray(slots, jnp.int32), rows)
    assert got.dtype == pool.dtype
    np.testing.assert_array_equal(
        np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint8)).reshape(pages * page, -1),
        np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(want), jnp.uint8)).reshape(
            pages * page, -1
        ),
    )


def _materialized(hlo: str) -> list[tuple[str, str, int]]:
    """(op, dtype, element count) of each instruction of a compiled HLO text whose result
    is a buffer: those outside fusions (a fused computation's values stay in registers)."""
    fused = set(re.findall(r"calls=%([\w.-]+)", hlo))
    out, inside = [], False
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%([\w.-]+) \(", line)
        if head:
            inside = head.group(1) in fused
        m = re.search(r"= (\w+)\[([\d,]*)\]\{[^}]*\} ([\w-]+)\(", line)
        if m and not inside:
            dims = [int(d) for d in m.group(2).split(",") if d]
            out.append((m.group(3), m.group(1), int(np.prod(dims))))
    return out


@pytest.mark.parametrize("rows", [1, 4])
def test_a_decode_steps_kv_write_copies_no_pool(rows):
    """The compiled decode step (float32 pool, fp8 index K, the pool donated) writes its
    KV in place: no copy of a latent pool and no wider-float convert of an fp8 index-K
    pool. Before `write_rows`, XLA:CPU copied each layer's latent pool twice per step
    (the flat view the row gathers read and the paged one returned) and converted the
    index-K pool to f16 and back: 258 vs 136 ms for `bench_decode`'s batch-1 32K step."""
    cfg, model = _glm_two_layers()
    graphdef, state = nnx.split(model)
    width = 8  # rows * width != POOL_PAGES: no view has a pool's element count
    pool = pool_shapes(cfg, POOL_PAGES, P, jnp.float32, INDEX_K)
    hlo = (
        forward_step.lower(
            graphdef,
            state,
            abstract_batch(rows, 1, width),
            pool,
            kv_io=SINGLE_DEVICE_KV_IO,
            index_k_dtype=INDEX_K,
            form="absorbed",
        )
        .compile()
        .as_text()
    )
    latent = int(np.prod(pool.latent[0].shape))
    index = int(np.prod(pool.index_k[0].shape))
    ops = _materialized(hlo)
    assert any(op == "fusion" and n == latent for op, _, n in ops)  # the parser sees pools
    assert not [o for o in ops if o[0] == "copy" and o[2] == latent]
    assert not [o for o in ops if o[1] in ("f16", "bf16", "f32") and o[2] == index]
