"""The paged indexer-scores kernel (`cpkv_jax.pallas.paged_index_scores`, issue 35): the
lightning indexer's decode scores read from the paged index-K pool, checked in interpret
mode against its plain-jnp reference and against the served XLA path (`index_scores`
over the dequantized view), and cross-lowered to Triton at GLM-5's dims.

Tolerance: the kernel sums the dot over `d` and the heads in its own order, so its
scores may differ from XLA's in the last float32 bits, on a GPU and in interpret mode on
CPU too, where XLA:CPU picks its dot kernels by shape and by the host's vector units:
equal on earlier dev machines, 2.4e-6 apart on an AMD EPYC one (2026-12-07) for
3-token rows. Asserted within 1e-6 relative plus `ATOL` = 1e-5 absolute: the cases'
scores reach ~25 in magnitude, whose float32 spacing is 1.9e-6, and a sum over `d` = 32
in another order moves it by a few spacings of its largest partial sums.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpkv_jax.errors import ConfigError
from cpkv_jax.model.indexer import index_scores, select_topk
from cpkv_jax.model.kv_cache import (
    SINGLE_DEVICE_KV_IO,
    blocked_index_scores,
    dequantize_index_k,
    quantize_index_k,
)
from cpkv_jax.pallas.paged_index_scores import (
    MAX_KERNEL_TOKENS,
    _decode_e4m3,
    paged_index_scores,
    paged_index_scores_reference,
)

_TRITON_CALL = "__gpu$xla.gpu.triton"
PAGE = 16
HEADS, DIM = 4, 32  # the tiny config's indexer
ATOL = 1e-5  # a few float32 spacings of the cases' largest scores (module docstring)


def test_fp8_codes_decode_to_xla_s_values_bit_for_bit():
    """Every float8_e4m3fn code but the two NaNs (which quantization never writes)
    decodes to the bits of XLA's convert, signed zeros and subnormals included."""
    codes = jnp.arange(256, dtype=jnp.uint8)
    want = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)
    got = _decode_e4m3(codes)
    nan = np.isnan(np.asarray(want))
    assert np.flatnonzero(nan).tolist() == [0x7F, 0xFF]
    bits = jax.lax.bitcast_convert_type
    np.testing.assert_array_equal(
        np.asarray(bits(got, jnp.int32))[~nan], np.asarray(bits(want, jnp.int32))[~nan]
    )


def _case(rng, index_k_dtype: str, tokens: int):
    """Three rows of different lengths (mid-page, one page, past half the width) over a
    shuffled page table of 8 pages each, with the trash page after a short row's end."""
    b, width, pages = 3, 8, 40
    q = jnp.asarray(rng.standard_normal((b, tokens, HEADS, DIM)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, tokens, HEADS)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((pages, PAGE, DIM)), jnp.float32)
    if index_k_dtype == "fp8_e4m3":
        index_k, scale = quantize_index_k(keys, "fp8_e4m3")
    else:
        index_k, scale = keys.astype(jnp.dtype(index_k_dtype)), None
    table = rng.permutation(np.arange(1, pages))[: b * width].reshape(b, width)
    kv_lens = np.asarray([5, PAGE, 5 * PAGE + 3])
    table[0, 1:] = 0  # past row 0's one page: the trash page, as a decode table pads
    positions = kv_lens[:, None] - tokens + np.arange(tokens)[None]
    args = (q, w, index_k, scale, jnp.asarray(table, jnp.int32))
    return (*args, jnp.asarray(positions, jnp.int32), jnp.asarray(kv_lens, jnp.int32))


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("index_k_dtype", ["fp8_e4m3", "bfloat16", "float32"])
def test_kernel_scores_are_the_view_path_s(index_k_dtype, tokens):
    """A decode step (1 token) and a speculative verify (3, padded to 4 in the kernel):
    the kernel's scores are its reference's and the served XLA path's (`index_scores` over
    the dequantized view), -inf at exactly the same slots (past a token's position or its
    row's length, and all of the pages the kernel skips)."""
    args = _case(np.random.default_rng(1), index_k_dtype, tokens)
    q, w, index_k, scale, table, positions, kv_lens = args
    got = paged_index_scores(*args)
    ref = paged_index_scores_reference(*args)
    view = dequantize_index_k(
        SINGLE_DEVICE_KV_IO.view(index_k, table),
        None if scale is None else SINGLE_DEVICE_KV_IO.view(scale, table),
    )
    served = index_scores(q, w, view, positions, kv_lens)
    chex.assert_shape(got, (3, tokens, 8 * PAGE))
    finite = np.isfinite(np.asarray(served))
    assert finite.sum() > 0
    for scores in (got, ref):
        np.testing.assert_array_equal(np.isfinite(np.asarray(scores)), finite)
        np.testing.assert_allclose(
            np.asarray(scores)[finite], np.asarray(served)[finite], rtol=1e-6, atol=ATOL
        )


def _tied_case():
    """`_case`'s rows over keys that tie: every page holds one key repeated (one of two
    multiples of a single key), so many slots score the same."""
    rng = np.random.default_rng(2)
    q, w, _, _, table, positions, kv_lens = _case(rng, "fp8_e4m3", 1)
    key = rng.standard_normal((1, 1, DIM))
    tied = np.broadcast_to(key * rng.integers(1, 3, (40, 1, 1)), (40, PAGE, DIM))
    index_k, scale = quantize_index_k(jnp.asarray(tied, jnp.float32), "fp8_e4m3")
    return q, w, index_k, scale, table, positions, kv_lens


def test_tied_keys_select_the_same_positions():
    """Forced ties (`_tied_case`): the top-k from the kernel's scores is the XLA path's,
    ties lowest position first."""
    args = _tied_case()
    positions = args[5]
    want = select_topk(paged_index_scores_reference(*args), positions, 16)
    got = select_topk(paged_index_scores(*args), positions, 16)
    np.testing.assert_array_equal(got, want)
    assert len(set(np.asarray(paged_index_scores(*args))[2, 0, :64].tolist())) <= 3  # ties


@pytest.mark.parametrize("block_tokens", [PAGE, 3 * PAGE, 64 * PAGE])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("index_k_dtype", ["fp8_e4m3", "bfloat16"])
def test_blocked_xla_scores_are_the_view_path_s(index_k_dtype, tokens, block_tokens):
    """The XLA decode indexer on CPU (`blocked_index_scores`): blocks of one page, of
    three (not a divisor of the 8-page width: the table pads with trash pages) and one
    block past the width. The loop stops after the block with the longest row's last key
    (row 2's, in page 6); the scores are the view path's, -inf at the same slots. Summed
    in another dot kernel than the whole view's: the kernel's tolerance."""
    args = _case(np.random.default_rng(4), index_k_dtype, tokens)
    q, w, index_k, scale, table, positions, kv_lens = args
    got = jax.jit(functools.partial(blocked_index_scores, block_tokens=block_tokens))(*args)
    view = dequantize_index_k(
        SINGLE_DEVICE_KV_IO.view(index_k, table),
        None if scale is None else SINGLE_DEVICE_KV_IO.view(scale, table),
    )
    served = np.asarray(index_scores(q, w, view, positions, kv_lens))
    chex.assert_shape(got, (3, tokens, 8 * PAGE))
    finite = np.isfinite(served)
    assert finite[2].sum() > 5 * PAGE  # row 2 reaches into its sixth page
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), finite)
    np.testing.assert_allclose(np.asarray(got)[finite], served[finite], rtol=1e-6, atol=ATOL)


def test_blocked_xla_scores_select_the_view_path_s_tied_positions():
    """Forced ties (`_tied_case`): blocks of one page select the view path's top-k, ties
    lowest position first."""
    args = _tied_case()
    positions = args[5]
    want = select_topk(paged_index_scores_reference(*args), positions, 16)
    got = select_topk(blocked_index_scores(*args, block_tokens=PAGE), positions, 16)
    np.testing.assert_array_equal(got, want)


def test_refuses_prefill_sized_token_counts():
    q, w, index_k, scale, table, positions, kv_lens = _case(np.random.default_rng(3), "float32", 1)
    many = MAX_KERNEL_TOKENS + 1
    with pytest.raises(ConfigError, match="at most"):
        paged_index_scores(
            jnp.repeat(q, many, 1), jnp.repeat(w, many, 1), index_k, scale, table,
            jnp.repeat(positions, many, 1), kv_lens,
        )  # fmt: skip


@pytest.mark.parametrize(("tokens", "heads"), [(1, 32), (3, 64)])
def test_lowers_to_triton_at_glm5_dims(tokens, heads):
    """GLM-5's indexer (32 heads of 128, fp8 index K with fp32 scales, 64-token pages) at
    batch 8 over a 512-page table, and a speculative verify of 3 tokens with
    DeepSeek-V3.2's 64 heads: one Triton call whose grid is (rows, 512 / 4 page blocks).
    Cross-lowered from CPU (the whole Triton lowering, not PTX or a run: those need a
    GPU)."""
    scores = jax.jit(functools.partial(paged_index_scores, interpret=False))
    exported = jax.export.export(
        scores,
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)],
    )(
        jax.ShapeDtypeStruct((8, tokens, heads, 128), jnp.float32),
        jax.ShapeDtypeStruct((8, tokens, heads), jnp.float32),
        jax.ShapeDtypeStruct((4096, 64, 128), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((4096, 64), jnp.float32),
        jax.ShapeDtypeStruct((8, 512), jnp.int32),
        jax.ShapeDtypeStruct((8, tokens), jnp.int32),
        jax.ShapeDtypeStruct((8,), jnp.int32),
    )
    module = exported.mlir_module()
    assert module.count(_TRITON_CALL) == 1
    assert "grid_x = 8 : i32, grid_y = 128 : i32" in module
    assert exported.out_avals[0].shape == (8, tokens, 512 * 64)


def test_runs_inside_shard_map_per_rank():
    """A DP decode step runs the kernel inside `shard_map` (each rank over its own pool
    shard and rows): interpret mode there (`check_vma`) gives each rank's own scores."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    ranks = [_case(np.random.default_rng(10 + r), "fp8_e4m3", 1) for r in range(2)]
    stacked = [jnp.concatenate(parts) for parts in zip(*ranks, strict=True)]
    mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    sharded = jax.jit(
        jax.shard_map(paged_index_scores, mesh=mesh, in_specs=(P("dp"),) * 7, out_specs=P("dp"))
    )
    got = np.asarray(sharded(*stacked))
    for r, args in enumerate(ranks):
        np.testing.assert_allclose(
            got[3 * r : 3 * r + 3],
            np.asarray(paged_index_scores_reference(*args)),
            rtol=1e-6,
            atol=ATOL,
        )


def test_any_table_width_and_block_size():
    """A 3-page table and 3 pages per block ask for a non-power-of-two block: the kernel
    takes 2 and pads the table, with the view path's scores."""
    args = _case(np.random.default_rng(4), "fp8_e4m3", 1)
    q, w, index_k, scale, table, positions, kv_lens = args
    table = table[:, :3]
    kv_lens = jnp.minimum(kv_lens, 3 * PAGE)
    positions = kv_lens[:, None] - 1
    args = (q, w, index_k, scale, table, positions, kv_lens)
    got = paged_index_scores(*args, pages_per_block=3)
    chex.assert_shape(got, (3, 1, 3 * PAGE))
    want = paged_index_scores_reference(*args)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_allclose(
        np.asarray(got)[finite], np.asarray(want)[finite], rtol=1e-6, atol=ATOL
    )
