"""The paged-gather kernel (interpret mode) equals `pool[page_ids]` bit for bit.

Pools hold fresh random values in every dtype the KV pools use (fp8 is drawn as floats
and cast); bits are compared, so a kernel that moved values through another dtype would
fail. Sharded runs check that each CP rank gathers from its own pool shard only.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cpkv_jax.errors import CpkvError
from cpkv_jax.pallas.paged_gather import (
    PageIndexError,
    paged_gather,
    paged_gather_pallas,
    paged_gather_reference,
    validate_page_ids,
)

# Among the longer files of the suite: scheduled early, longest first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=25)  # on 2 workers, 2026-12-05

PAGE = 8
NUM_PAGES = 40
BLOCK = 8

# (dtype, feature dims): MLA latent, index K (fp8 / bf16), per-token index-K scale.
LAYOUTS = [
    (jnp.float32, (576,)),
    (jnp.bfloat16, (576,)),
    (jnp.float8_e4m3fn, (576,)),
    (jnp.float8_e4m3fn, (128,)),
    (jnp.bfloat16, (128,)),
    (jnp.float32, ()),
    (jnp.int8, (128,)),
    (jnp.bool_, ()),
]


def _param_id(value):
    return getattr(value, "__name__", str(value))


def _pool(rng, dtype, feature, num_pages=NUM_PAGES, page=PAGE):
    values = rng.standard_normal((num_pages, page, *feature)).astype(np.float32) * 4
    if dtype in (jnp.bool_, jnp.int8):
        values = np.round(values)  # bool: about a third False; int8: small integers
    return jnp.asarray(values).astype(dtype)


def _ids(rng, n, num_pages=NUM_PAGES):
    return jnp.asarray(rng.integers(0, num_pages, n), jnp.int32)


def _bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype != np.bool_ else x


def _assert_bitwise_equal(got, want):
    chex.assert_equal_shape([got, want])
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    chex.assert_trees_all_equal(_bits(got), _bits(want))


# Every page count around the block size (the padding logic) on the MLA latent layout,
# and every layout at one count that crosses a block: the kernel moves bits by element
# width, so a layout adds nothing at other counts (each case is seconds of interpreter).
CASES = [(*LAYOUTS[0], n) for n in (1, 7, 8, 9, 33)] + [(*layout, 9) for layout in LAYOUTS[1:]]


@pytest.mark.parametrize(("dtype", "feature", "n"), CASES, ids=_param_id)
def test_kernel_equals_reference_bitwise(dtype, feature, n):
    rng = np.random.default_rng([LAYOUTS.index((dtype, feature)), n])  # reproducible
    pool, ids = _pool(rng, dtype, feature), _ids(rng, n)
    got = paged_gather_pallas(pool, ids, pages_per_block=BLOCK, interpret=True)
    chex.assert_shape(got, (n, PAGE, *feature))
    _assert_bitwise_equal(got, paged_gather_reference(pool, ids))
    _assert_bitwise_equal(got, np.asarray(pool)[np.asarray(ids)])


@pytest.mark.parametrize(
    "ids",
    [
        [5, 5, 5, 2, 39, 0, 5, 17, 17, 3, 38],  # repeats, unsorted, trash page, last page
        list(range(NUM_PAGES - 1, -1, -1)),  # every page, descending
    ],
)
def test_repeated_and_unsorted_ids(ids):
    rng = np.random.default_rng(len(ids))
    pool = _pool(rng, jnp.float32, (128,))
    got = paged_gather_pallas(pool, jnp.asarray(ids, jnp.int32), pages_per_block=BLOCK)
    _assert_bitwise_equal(got, np.asarray(pool)[ids])


@pytest.mark.parametrize("pages_per_block", [1, 3, 16])
def test_other_block_sizes(pages_per_block):
    rng = np.random.default_rng(pages_per_block)
    pool, ids = _pool(rng, jnp.bfloat16, (576,)), _ids(rng, 9)
    got = paged_gather_pallas(pool, ids, pages_per_block=pages_per_block)
    _assert_bitwise_equal(got, np.asarray(pool)[np.asarray(ids)])


class PagedGatherJitTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_pallas_and_xla_impls_agree(self):
        rng = np.random.default_rng(11)
        pool, ids = _pool(rng, jnp.float8_e4m3fn, (576,)), _ids(rng, 13)
        xla = self.variant(functools.partial(paged_gather, impl="xla"))(pool, ids)
        pallas = self.variant(functools.partial(paged_gather, impl="pallas"))(pool, ids)
        _assert_bitwise_equal(pallas, xla)
        _assert_bitwise_equal(pallas, np.asarray(pool)[np.asarray(ids)])


# check_vma=True takes the interpreter's nested-shard_map path (`paged_gather_pallas`):
# every layout; the plain path once.
@pytest.mark.parametrize(
    ("dtype", "feature", "check_vma"),
    [
        (jnp.bfloat16, (576,), True),
        (jnp.float8_e4m3fn, (128,), True),
        (jnp.float32, (), True),
        (jnp.bool_, (), True),
        (jnp.bfloat16, (576,), False),
    ],
    ids=_param_id,
)
def test_inside_shard_map_each_rank_gathers_from_its_own_shard(dtype, feature, check_vma):
    mesh = Mesh(np.array(jax.devices()[:8]), ("cp",))
    cp, pages_per_rank, per_rank = 8, 6, 9  # 9 ids per rank: not a multiple of the block
    rng = np.random.default_rng(8)
    pool = _pool(rng, dtype, feature, num_pages=cp * pages_per_rank)
    local_ids = rng.integers(0, pages_per_rank, cp * per_rank).astype(np.int32)
    pool = jax.device_put(pool, NamedSharding(mesh, P("cp")))
    ids = jax.device_put(jnp.asarray(local_ids), NamedSharding(mesh, P("cp")))

    pool_np = np.asarray(pool)
    want = np.concatenate(
        [
            pool_np[r * pages_per_rank : (r + 1) * pages_per_rank][
                local_ids[r * per_rank : (r + 1) * per_rank]
            ]
            for r in range(cp)
        ]
    )
    for impl in ("pallas", "xla"):
        step = jax.jit(
            jax.shard_map(
                functools.partial(paged_gather, impl=impl, pages_per_block=BLOCK),
                mesh=mesh,
                in_specs=(P("cp"), P("cp")),
                out_specs=P("cp"),
                check_vma=check_vma,
            )
        )
        got = step(pool, ids)
        chex.assert_shape(got, (cp * per_rank, PAGE, *feature))
        _assert_bitwise_equal(got, want)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize(
    ("ids", "named"),
    [
        ([3, -1, 7], ["page_ids[1]=-1"]),
        ([NUM_PAGES, 0, 2, NUM_PAGES + 5], [f"page_ids[0]={NUM_PAGES}", "page_ids[3]=45"]),
        ([-2, 1, NUM_PAGES], ["page_ids[0]=-2", f"page_ids[2]={NUM_PAGES}"]),
    ],
)
def test_concrete_out_of_range_ids_raise(impl, ids, named):
    pool = _pool(np.random.default_rng(0), jnp.float32, (128,))
    with pytest.raises(PageIndexError) as err:
        paged_gather(pool, jnp.asarray(ids, jnp.int32), impl=impl)
    assert isinstance(err.value, IndexError)
    assert isinstance(err.value, CpkvError)
    message = str(err.value)
    assert f"[0, {NUM_PAGES})" in message
    for part in named:
        assert part in message, message


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_traced_out_of_range_ids_read_the_trash_page(impl):
    rng = np.random.default_rng(3)
    pool = _pool(rng, jnp.bfloat16, (128,))
    ids = jnp.asarray([4, -1, NUM_PAGES, 9, -100, 2 * NUM_PAGES], jnp.int32)
    got = jax.jit(functools.partial(paged_gather, impl=impl))(pool, ids)
    pool_np = np.asarray(pool)
    _assert_bitwise_equal(got, pool_np[[4, 0, 0, 9, 0, 0]])


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_checkify_reports_traced_out_of_range_ids(impl):
    pool = _pool(np.random.default_rng(5), jnp.float32, ())
    checked = checkify.checkify(
        jax.jit(functools.partial(paged_gather, impl=impl, check_bounds=True))
    )
    err, _ = checked(pool, jnp.asarray([1, 2, 3], jnp.int32))
    err.throw()  # in range: no error
    err, out = checked(pool, jnp.asarray([1, NUM_PAGES + 2, 3], jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match=f"page id {NUM_PAGES + 2} at position 1"):
        err.throw()
    _assert_bitwise_equal(out, np.asarray(pool)[[1, 0, 3]])


def test_validate_page_ids_accepts_host_plans():
    validate_page_ids(np.array([0, 3, NUM_PAGES - 1], np.int32), NUM_PAGES)
    with pytest.raises(PageIndexError, match=r"page_ids\[2\]=-7"):
        validate_page_ids(np.array([0, 3, -7], np.int32), NUM_PAGES)


_TRITON_CALL = "__gpu$xla.gpu.triton"


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
    """Cross-lowering from CPU runs the Pallas Triton backend (power-of-two loads and
    stores, no TPU-only features) and yields one Triton call; nothing is compiled to PTX
    or run, which needs a GPU."""
    gather = jax.jit(functools.partial(paged_gather, impl="pallas", interpret=False))
    exported = jax.export.export(
        gather,
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)],
    )(
        jax.ShapeDtypeStruct((1000, 64, *feature), dtype),
        jax.ShapeDtypeStruct((37,), jnp.int32),
    )
    module = exported.mlir_module()
    assert module.count(_TRITON_CALL) == 1
    assert f"grid_x = {grid[0]} : i32, grid_y = {grid[1]} : i32" in module
    assert exported.out_avals[0].shape == (37, 64, *feature)


def test_lowers_to_triton_inside_shard_map():
    mesh = Mesh(np.array(jax.devices()[:8]), ("cp",))
    step = jax.jit(
        jax.shard_map(
            functools.partial(paged_gather, impl="pallas", interpret=False),
            mesh=mesh,
            in_specs=(P("cp"), P("cp")),
            out_specs=P("cp"),
        )
    )
    exported = jax.export.export(
        step,
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)],
    )(
        jax.ShapeDtypeStruct((8 * 100, 64, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((8 * 37,), jnp.int32),
    )
    assert exported.mlir_module().count(_TRITON_CALL) == 1


def test_empty_id_list():
    pool = _pool(np.random.default_rng(9), jnp.float32, (128,))
    got = paged_gather_pallas(pool, jnp.zeros((0,), jnp.int32))
    chex.assert_shape(got, (0, PAGE, 128))


def test_the_sparse_decode_row_gather_lowers_to_triton_at_glm5_dims(monkeypatch):
    """The sparse decode's top-k row gather (`take_paged_rows(..., "pallas")`, issue 35)
    at GLM-5's dims: batch 8, index top-k 2,048 rows of the 576-wide bf16 latent from a
    pool of 64-token pages, seen as one-row pages. It lowers to one Triton call whose
    grid walks 8-row blocks and 64-element column chunks. The serving path picks compiled
    (not interpret) mode from the backend; CPU stands in for a GPU here."""
    from cpkv_jax.model.kv_cache import take_paged_rows

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    rows = jax.jit(lambda pool, table, pos: take_paged_rows(pool, table, pos, "pallas"))
    exported = jax.export.export(
        rows,
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)],
    )(
        jax.ShapeDtypeStruct((4096, 64, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 512), jnp.int32),
        jax.ShapeDtypeStruct((8, 1, 2048), jnp.int32),
    )
    module = exported.mlir_module()
    assert module.count(_TRITON_CALL) == 1
    assert f"grid_x = {8 * 2048 // 8} : i32, grid_y = 9 : i32" in module
    assert exported.out_avals[0].shape == (8, 1, 2048, 576)
