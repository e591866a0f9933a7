"""The LF<->LPF copy kernels (interpret mode) equal their jnp references bit for bit.

Pools and staging hold fresh random values in the KV pool dtypes (fp8 drawn as floats and
cast); bits are compared. The kernels also cross-lower for CUDA (Triton) from CPU.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpkv_jax.errors import ConfigError
from cpkv_jax.host_cache import token_indices_of_pages
from cpkv_jax.paging import PageAlignmentError
from cpkv_jax.pallas.lpf_copy import (
    LPFIndexError,
    lf_to_lpf,
    lf_to_lpf_pallas,
    lf_to_lpf_reference,
    lpf_to_lf,
    lpf_to_lf_pallas,
    lpf_to_lf_reference,
)

# Among the longer files of the suite: scheduled early, longest first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=23)  # on 2 workers, 2026-12-05

PAGE = 8
NUM_PAGES = 24
BLOCK = 8

# (dtype, feature dims, pages): MLA latent (real / tiny), index K (fp8 / bf16), per-token
# index-K scale; page counts off and on the block and power-of-two padding.
CASES = [
    (jnp.bfloat16, (576,), 9),
    (jnp.float32, (40,), 1),
    (jnp.float32, (40,), 5),
    (jnp.float8_e4m3fn, (128,), 9),
    (jnp.bfloat16, (128,), 3),
    (jnp.float32, (), 9),
]


def _param_id(value):
    return getattr(value, "__name__", str(value))


def _rand(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 4 + 0.25).astype(dtype)


def _bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def _assert_bitwise_equal(got, want):
    chex.assert_equal_shape([got, want])
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _pages(rng, n):
    return rng.permutation(NUM_PAGES)[:n].astype(np.int64)  # distinct, caller order


@pytest.mark.parametrize(("dtype", "feature", "n"), CASES, ids=_param_id)
def test_lf_to_lpf_equals_reference_bitwise(dtype, feature, n):
    rng = np.random.default_rng([CASES.index((dtype, feature, n))])
    pool = _rand(rng, (NUM_PAGES, PAGE, *feature), dtype)
    pages = _pages(rng, n)
    got = lf_to_lpf(pool, token_indices_of_pages(pages, PAGE), impl="pallas", interpret=True)
    chex.assert_shape(got, (n, PAGE, *feature))
    ids = jnp.asarray(pages, jnp.int32)
    _assert_bitwise_equal(got, lf_to_lpf_reference(pool, ids))
    _assert_bitwise_equal(lf_to_lpf_pallas(pool, ids, interpret=True), got)
    _assert_bitwise_equal(got, np.asarray(pool)[pages])


@pytest.mark.parametrize(("dtype", "feature", "n"), CASES, ids=_param_id)
def test_lpf_to_lf_equals_reference_bitwise(dtype, feature, n):
    rng = np.random.default_rng([CASES.index((dtype, feature, n)), 1])
    pool = _rand(rng, (NUM_PAGES, PAGE, *feature), dtype)
    staging = _rand(rng, (n, PAGE, *feature), dtype)
    pages = _pages(rng, n)
    want = np.asarray(pool).copy()
    want[pages] = np.asarray(staging)
    ids = jnp.asarray(pages, jnp.int32)
    ref = lpf_to_lf_reference(pool, staging, ids)
    direct = lpf_to_lf_pallas(pool, staging, ids, pages_per_block=BLOCK, interpret=True)
    _assert_bitwise_equal(direct, ref)
    _assert_bitwise_equal(direct, want)
    # The entry pads to a power of two with copies of the last page: no other page moves.
    got = lpf_to_lf(jnp.array(pool), np.asarray(staging), token_indices_of_pages(pages, PAGE))
    _assert_bitwise_equal(got, want)


@pytest.mark.parametrize("pages_per_block", [1, 3])
def test_scatter_other_block_sizes_under_jit(pages_per_block):
    rng = np.random.default_rng(pages_per_block)
    pool = _rand(rng, (NUM_PAGES, PAGE, 576), jnp.bfloat16)
    staging = _rand(rng, (7, PAGE, 576), jnp.bfloat16)
    ids = jnp.asarray(_pages(rng, 7), jnp.int32)
    step = jax.jit(
        functools.partial(lpf_to_lf_pallas, pages_per_block=pages_per_block, interpret=True)
    )
    _assert_bitwise_equal(step(pool, staging, ids), lpf_to_lf_reference(pool, staging, ids))


def test_entries_refuse_bad_indices_before_anything_moves():
    rng = np.random.default_rng(0)
    pool = _rand(rng, (NUM_PAGES, PAGE, 40), jnp.float32)
    before = _bits(pool).copy()
    staging = np.asarray(_rand(rng, (2, PAGE, 40), jnp.float32))
    good = token_indices_of_pages(np.array([3, 5]), PAGE)
    for bad in (good[:-1], good + 1, np.r_[good[:PAGE], good[PAGE:][::-1]]):
        with pytest.raises(PageAlignmentError):
            lpf_to_lf(pool, staging, bad)
        with pytest.raises(PageAlignmentError):
            lf_to_lpf(pool, bad)
    with pytest.raises(LPFIndexError, match="more than once"):
        lpf_to_lf(pool, staging, token_indices_of_pages(np.array([3, 3]), PAGE))
    with pytest.raises(LPFIndexError, match="outside"):
        lf_to_lpf(pool, token_indices_of_pages(np.array([NUM_PAGES]), PAGE))
    with pytest.raises(ConfigError, match="staging has shape"):
        lpf_to_lf(pool, staging[:1], good)
    assert not pool.is_deleted()
    np.testing.assert_array_equal(_bits(pool), before)


_TRITON_CALL = "__gpu$xla.gpu.triton"


def _export_cuda(fn, *args):
    return jax.export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)],
    )(*args)


@pytest.mark.parametrize(
    ("dtype", "feature", "grid"),
    [
        (jnp.bfloat16, (576,), (5, 9)),  # row 64*576 = 9 chunks of 4096 (8 KiB) elements
        (jnp.float8_e4m3fn, (128,), (5, 1)),
        (jnp.float32, (), (5, 1)),
    ],
    ids=_param_id,
)
def test_lowers_to_triton_for_cuda(dtype, feature, grid):
    """Cross-lowering from CPU runs the Pallas Triton backend for both directions; the
    scatter aliases the pool to its output (in place). Nothing is compiled to PTX or run."""
    pool = jax.ShapeDtypeStruct((1000, 64, *feature), dtype)
    staging = jax.ShapeDtypeStruct((37, 64, *feature), dtype)
    ids = jax.ShapeDtypeStruct((37,), jnp.int32)
    scatter = _export_cuda(
        functools.partial(lpf_to_lf_pallas, pages_per_block=BLOCK), pool, staging, ids
    )
    module = scatter.mlir_module()
    assert module.count(_TRITON_CALL) == 1
    assert f"grid_x = {grid[0]} : i32, grid_y = {grid[1]} : i32" in module
    assert "output_operand_aliases" in module
    assert scatter.out_avals[0].shape == (1000, 64, *feature)
    gather = _export_cuda(functools.partial(lf_to_lpf_pallas, pages_per_block=BLOCK), pool, ids)
    assert gather.mlir_module().count(_TRITON_CALL) == 1
    assert gather.out_avals[0].shape == (37, 64, *feature)
