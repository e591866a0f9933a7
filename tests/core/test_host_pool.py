"""Host KV pools (SPEC S4): layouts, sizing, the host page allocator, and the copy paths.

Round trips fill the device pool with fresh random bits (bf16 latent, fp8 index K, fp32
scale), back a lane's pages up, load them into other pages of the same lane and compare
bits: the target pages equal the sources, and every other page of every lane (and
every replica) is unchanged. Malformed indices must be refused before anything moves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding

from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import CacheCapacityError, ConfigError, CpkvError
from cpkv_jax.host_cache import (
    HOST_LAYOUTS,
    HostCopyError,
    HostPageAllocator,
    HostPageError,
    HostPool,
    HostPools,
    LPFKernelUnavailableError,
    backup_all_layers,
    backup_layer,
    host_pages_for,
    load_all_layers,
    load_layer,
    token_indices_of_pages,
)
from cpkv_jax.host_cache.copy import copy_buckets, warm_copies
from cpkv_jax.kv_layout import KVLayout
from cpkv_jax.kv_pool import PoolLayout, cp_pool_shapes, per_rank_pool_bytes
from cpkv_jax.mesh import make_cp_mesh
from cpkv_jax.paging import PageAlignmentError, owned_pages, pages_for_tokens
from cpkv_jax.pallas import lpf_copy
from cpkv_jax.tools.tiny_config import tiny_config_dict

# Among the longest files of the suite: scheduled first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=45)  # on 2 workers, 2026-12-05

P = 4
CP = 4
PAGES_PER_RANK = 8
KINDS = ("latent", "index_k", "index_scale")


@functools.cache
def _cfg(num_layers: int = 3) -> ModelConfig:
    """The tiny model's; six layers where a test needs a full indexer layer after a shared
    one (FFSFSS: layer 3's index K is in slot 2)."""
    return ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa", num_layers=num_layers))


@functools.cache
def _mesh():
    return make_cp_mesh(CP)


def _layout(shared: bool, pages_per_rank: int = PAGES_PER_RANK) -> PoolLayout:
    # The replicated lane holds every page of a prompt: give it room for two copies.
    return PoolLayout(CP, shared, pages_per_rank if shared else 2 * pages_per_rank, P)


def _random_pool(layout: PoolLayout, seed: int, num_layers: int = 3):
    rng = np.random.default_rng(seed)
    shapes = cp_pool_shapes(_cfg(num_layers), layout, jnp.bfloat16, "fp8_e4m3")
    sharding = NamedSharding(_mesh(), layout.spec)

    def leaf(s):
        values = rng.standard_normal(s.shape).astype(np.float32) * 4 + 0.5  # never zeros
        return jax.device_put(jnp.asarray(values).astype(s.dtype), sharding)

    return jax.tree.map(leaf, shapes)


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def _snapshot(pool) -> dict:
    """Bits of every addressable shard of every leaf (replicas included)."""
    return {
        (kind, j, str(s.device)): _bits(s.data)
        for kind in KINDS
        for j, leaf in enumerate(getattr(pool, kind))
        for s in leaf.addressable_shards
    }


def _host_snapshot(host: HostPool) -> dict:
    return {k: _bits(b).copy() for k, b in host.buffers.items()}


def _leaf_bits_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))


# ---- layouts and sizing ------------------------------------------------------------


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_host_buffer_shapes_mirror_device_leaves(layout):
    cfg = _cfg(6)
    pool_layout = _layout(True)
    shapes = cp_pool_shapes(cfg, pool_layout, jnp.bfloat16, "fp8_e4m3")
    host = HostPool.for_device_pool(
        shapes, cfg.full_indexer_layers, layout, device_pages_per_rank=PAGES_PER_RANK, ratio=1.5
    )
    h, lat, nf = host.num_pages, cfg.num_hidden_layers, len(cfg.full_indexer_layers)
    assert h == int(1.5 * PAGES_PER_RANK)
    want = {
        "layer_first": {
            "latent": (lat, h * P, cfg.kv_cache_dim),
            "index_k": (nf, h * P, cfg.index_head_dim),
            "index_scale": (nf, h * P),
        },
        "page_first": {
            "latent": (h, lat, P, cfg.kv_cache_dim),
            "index_k": (h, nf, P, cfg.index_head_dim),
            "index_scale": (h, nf, P),
        },
        "layer_page_first": {
            "latent": (lat, h, P, cfg.kv_cache_dim),
            "index_k": (nf, h, P, cfg.index_head_dim),
            "index_scale": (nf, h, P),
        },
    }
    want["page_first_direct"] = want["page_first"]
    assert {k: b.shape for k, b in host.buffers.items()} == want[layout]
    assert host.buffers["latent"].dtype == jnp.bfloat16
    assert host.buffers["index_k"].dtype == jnp.float8_e4m3fn
    assert host.kinds_at(2) == ("latent",)  # a shared indexer layer has no index K
    assert host.kinds_at(3) == KINDS


def test_sizing_by_bytes_and_ratio():
    cfg = _cfg()
    pool_layout = _layout(True)
    shapes = cp_pool_shapes(cfg, pool_layout, jnp.bfloat16, "fp8_e4m3")
    page_bytes = KVLayout.of_pool(shapes, cfg.full_indexer_layers).bytes_per_page
    # Host pages cost what device pages cost.
    assert page_bytes * PAGES_PER_RANK == per_rank_pool_bytes(
        cfg, pool_layout, jnp.bfloat16, "fp8_e4m3"
    )
    assert host_pages_for(page_bytes, PAGES_PER_RANK, ratio=3.0) == 3 * PAGES_PER_RANK
    assert host_pages_for(page_bytes, PAGES_PER_RANK, size_bytes=10 * page_bytes + 1) == 10
    pools = HostPools.create(
        shapes, cfg.full_indexer_layers, pool_layout, "layer_page_first", size_bytes=5 * page_bytes
    )
    assert len(pools) == CP and all(h.num_pages == 5 for h in pools.lanes)
    assert pools[0].nbytes() == 5 * page_bytes
    replicated = HostPools.create(shapes, cfg.full_indexer_layers, _layout(False), "page_first")
    assert len(replicated) == 1
    for bad in (dict(size_bytes=page_bytes), dict(ratio=0.1), dict(ratio=0.0)):
        with pytest.raises(ConfigError, match="host cache"):
            host_pages_for(page_bytes, PAGES_PER_RANK, **bad)
    with pytest.raises(ConfigError, match="unknown host layout"):
        HostPool(KVLayout.of_pool(shapes, cfg.full_indexer_layers), "page_major", 4)


# ---- host page allocator ------------------------------------------------------------


def test_allocator_exhaustion_is_all_or_nothing():
    alloc = HostPageAllocator(6)
    assert alloc.capacity == 5
    first = alloc.alloc(3)
    assert first.dtype == np.int64 and list(first) == [1, 2, 3]
    with pytest.raises(CacheCapacityError, match="need 3 host KV pages but only 2 of 5"):
        alloc.alloc(3)
    assert alloc.num_free == 2
    assert list(alloc.alloc(2)) == [4, 5]
    with pytest.raises(CacheCapacityError):
        alloc.alloc(1)
    with pytest.raises(ConfigError):
        HostPageAllocator(1)


def test_allocator_refuses_double_free_reserved_and_foreign_pages():
    alloc = HostPageAllocator(8)
    pages = alloc.alloc(4)
    alloc.free(pages[:2])
    for bad, match in (
        (pages[:1], "not allocated"),  # freed already
        (np.array([3, 3]), "double free"),
        (np.array([0]), "reserved"),
        (np.array([8]), "foreign"),
        (np.array([-1]), "foreign"),
        (np.array([pages[2], 7]), "not allocated"),  # one good, one never allocated
    ):
        with pytest.raises(HostPageError, match=match) as err:
            alloc.free(bad)
        assert isinstance(err.value, CpkvError)
    assert alloc.num_free == 5  # nothing was freed by the refused calls
    assert alloc.allocated_mask().sum() == 2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40), st.integers(2, 24))
def test_allocator_random_run_returns_every_page(ops, num_pages):
    alloc = HostPageAllocator(num_pages)
    held: list[int] = []
    rng = np.random.default_rng(len(ops))
    for do_alloc, n in ops:
        if do_alloc:
            if n > alloc.num_free:
                with pytest.raises(CacheCapacityError):
                    alloc.alloc(n)
                continue
            got = alloc.alloc(n)
            assert not set(got) & set(held) and 0 not in got
            assert ((got >= 1) & (got < num_pages)).all()
            held += got.tolist()
        elif held:
            k = min(n, len(held))
            pick = rng.choice(len(held), k, replace=False)
            alloc.free(np.array([held[i] for i in pick], np.int64))
            held = [p for i, p in enumerate(held) if i not in set(pick)]
        assert alloc.num_free + len(held) == num_pages - 1
    alloc.free(np.array(held, np.int64))
    assert alloc.num_free == num_pages - 1
    assert sorted(alloc.alloc(num_pages - 1)) == list(range(1, num_pages))


# ---- round trips ---------------------------------------------------------------------


def _round_trip_pages(
    rng, lane: int, num_tokens: int, cp: int, pages_per_rank: int
) -> tuple[np.ndarray, np.ndarray]:
    """Source and target local pages (disjoint, random order) for the lane's share of a
    prompt of `num_tokens` (a partial last page is copied whole)."""
    k = owned_pages(pages_for_tokens(num_tokens, P), lane, cp).size
    usable = rng.permutation(np.arange(1, pages_per_rank, dtype=np.int64))
    return usable[:k], usable[k : 2 * k]


@pytest.mark.parametrize("num_tokens", [6 * P, 5 * P + 3], ids=["page_multiple", "partial"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "replicated"])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_backup_then_load_into_other_pages_is_bitwise(layout, shared, num_tokens):
    seed = [HOST_LAYOUTS.index(layout), shared, num_tokens]
    rng = np.random.default_rng(seed)
    pool_layout = _layout(shared)
    pool = _random_pool(pool_layout, rng.integers(1 << 30))
    hosts = HostPools.create(pool, _cfg().full_indexer_layers, pool_layout, layout)
    per_layer = num_tokens % P != 0  # partial prompts take the per-layer entries
    lanes = (1, CP - 1) if shared else (0,)
    cp = CP if shared else 1
    for lane in lanes:
        host = hosts[lane]
        src, dst = _round_trip_pages(rng, lane, num_tokens, cp, pool_layout.pages_per_rank)
        host_pages = rng.permutation(host.allocator.alloc(src.size))  # caller order
        dev_src, dev_dst = token_indices_of_pages(src, P), token_indices_of_pages(dst, P)
        host_idx = token_indices_of_pages(host_pages, P)
        before = _snapshot(pool)
        common = dict(pool_layout=pool_layout, lane=lane)
        if per_layer:
            for layer in range(len(pool.latent)):
                backup_layer(
                    pool, host, layer, device_indices=dev_src, host_indices=host_idx, **common
                )
        else:
            backup_all_layers(pool, host, device_indices=dev_src, host_indices=host_idx, **common)
        _leaf_bits_equal(_snapshot(pool), before)  # backup only reads

        base = lane * pool_layout.pages_per_rank
        for kind in KINDS:
            for layer in host.specs[kind].layers:
                j = host.slot(kind, layer)
                got = _bits(host.read_pages(kind, layer, host_pages))
                want = _bits(np.asarray(getattr(pool, kind)[j])[base + src])
                np.testing.assert_array_equal(got, want, err_msg=f"host {kind} layer {layer}")

        if per_layer:
            for layer in range(len(pool.latent)):
                pool = load_layer(
                    pool, host, layer, host_indices=host_idx, device_indices=dev_dst, **common
                )
        else:
            pool = load_all_layers(
                pool, host, host_indices=host_idx, device_indices=dev_dst, **common
            )
        after = _snapshot(pool)
        for (kind, j, device), old in before.items():
            # A shard holds lane `lane` at offset 0 (its own lane, or a full replica).
            want = old.copy()
            if not shared or device == str(_mesh().devices[lane]):
                want[dst] = old[src]
            np.testing.assert_array_equal(
                after[kind, j, device], want, err_msg=str((kind, j, device))
            )
        assert pool.latent[0].sharding.is_equivalent_to(NamedSharding(_mesh(), pool_layout.spec), 3)


@pytest.mark.parametrize(
    ("layout", "shared"),
    [(layout, True) for layout in HOST_LAYOUTS] + [("page_first", False)],
)
def test_warm_copies_compile_every_copy_and_change_no_bits(layout, shared):
    """Issue 25: `warm_copies` compiles each program a copy of 1 to all usable pages of
    any lane dispatches (per kind, page bucket and device), leaving every bit as it was;
    copies afterwards compile nothing."""
    from serving.compile_events import COMPILES

    rng = np.random.default_rng([HOST_LAYOUTS.index(layout), shared, 25])
    # Small pools (page buckets 1-2 shared, 1-8 replicated): each bucket is 24 programs
    # (kinds x gather/scatter x devices); the 8-page pools took 22 s alone, these 14 s.
    pool_layout = _layout(shared, pages_per_rank=3)
    pool = _random_pool(pool_layout, rng.integers(1 << 30))
    hosts = HostPools.create(pool, _cfg().full_indexer_layers, pool_layout, layout)
    before = _snapshot(pool)
    c0 = COMPILES.total.compiles
    pool, programs = warm_copies(pool, hosts[0], pool_layout=pool_layout)
    buckets = copy_buckets(hosts[0], pool_layout)
    devices = CP  # every device holds a lane (its own, or a replica of the one lane)
    assert programs == 2 * len(KINDS) * len(buckets) * devices
    assert COMPILES.total.compiles - c0 <= programs  # an earlier case may have compiled some
    _leaf_bits_equal(_snapshot(pool), before)

    c1 = COMPILES.total.compiles
    usable = pool_layout.pages_per_rank - 1
    for lane in (0, CP - 1) if shared else (0,):
        host = hosts[lane]
        for k in range(1, usable + 1):
            src = rng.permutation(np.arange(1, usable + 1))[:k]
            host_pages = host.allocator.alloc(k)
            dev_idx, host_idx = (
                token_indices_of_pages(src, P),
                token_indices_of_pages(host_pages, P),
            )
            common = dict(pool_layout=pool_layout, lane=lane)
            backup_all_layers(pool, host, device_indices=dev_idx, host_indices=host_idx, **common)
            pool = load_all_layers(
                pool, host, host_indices=host_idx, device_indices=dev_idx, **common
            )
            host.allocator.free(host_pages)
    assert COMPILES.total.compiles == c1
    _leaf_bits_equal(_snapshot(pool), before)  # loaded back where they came from


def test_index_k_only_copy_leaves_latent_alone():
    pool_layout = _layout(True)
    pool = _random_pool(pool_layout, 5, num_layers=6)
    host = HostPools.create(pool, _cfg(6).full_indexer_layers, pool_layout, "layer_page_first")[2]
    pages = host.allocator.alloc(2)
    dev, hidx = token_indices_of_pages(np.array([3, 1]), P), token_indices_of_pages(pages, P)
    kw = dict(pool_layout=pool_layout, lane=2, kinds=("index_k", "index_scale"))
    backup_layer(pool, host, 3, device_indices=dev, host_indices=hidx, **kw)
    assert not _bits(host.buffers["latent"]).any()
    j = host.slot("index_k", 3)
    want = np.asarray(pool.index_k[j])[2 * PAGES_PER_RANK + np.array([3, 1])]
    np.testing.assert_array_equal(_bits(host.read_pages("index_k", 3, pages)), _bits(want))


# ---- refusals ------------------------------------------------------------------------


@functools.cache
def _refusal_fixture():
    pool_layout = _layout(True)
    pool = _random_pool(pool_layout, 99)
    hosts = {
        layout: HostPools.create(pool, _cfg().full_indexer_layers, pool_layout, layout)
        for layout in HOST_LAYOUTS
    }
    for pools in hosts.values():  # host pages hold random bits too
        rng = np.random.default_rng(1)
        for buf in pools[1].buffers.values():
            _bits(buf)[...] = rng.integers(1, 200, buf.shape)
    return pool_layout, pool, hosts


@st.composite
def _malformed(draw):
    """(device_indices, host_indices, which side is malformed) for one lane's copy."""
    n = draw(st.integers(1, 3))
    dev_pages = draw(st.permutations(list(range(1, PAGES_PER_RANK))))[:n]
    host_pages = draw(st.permutations(list(range(1, 2 * PAGES_PER_RANK))))[:n]
    good = [token_indices_of_pages(np.array(p, np.int64), P) for p in (dev_pages, host_pages)]
    side = draw(st.sampled_from([0, 1]))
    idx = good[side].copy()
    g = draw(st.integers(0, n - 1))
    kind = draw(st.sampled_from(["partial", "misaligned", "non_contiguous"]))
    if kind == "partial":
        idx = idx[: idx.size - draw(st.integers(1, P - 1))]
    elif kind == "misaligned":
        idx[g * P : (g + 1) * P] += draw(st.integers(1, P - 1))
    else:
        k = draw(st.integers(1, P - 1))
        idx[g * P + k] = idx[g * P + k] + draw(st.sampled_from([-1, 1, P, 7]))
        if idx[g * P + k] == idx[g * P] + k:  # never a no-op
            idx[g * P + k] += 1
    good[side] = idx
    return good[0], good[1], kind


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_malformed(), st.sampled_from(HOST_LAYOUTS), st.booleans(), st.booleans())
def test_malformed_indices_are_refused_before_anything_moves(case, layout, load, all_layers):
    dev, hidx, kind = case
    pool_layout, pool, hosts = _refusal_fixture()
    host = hosts[layout][1]
    pool_before, host_before = _snapshot(pool), _host_snapshot(host)
    kw = dict(device_indices=dev, host_indices=hidx, pool_layout=pool_layout, lane=1)
    if load:
        fn = load_all_layers if all_layers else functools.partial(load_layer, layer=2)
    else:
        fn = backup_all_layers if all_layers else functools.partial(backup_layer, layer=2)
    with pytest.raises(PageAlignmentError, match={"partial": "partial"}.get(kind, "page group")):
        fn(pool, host, **kw)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(pool))
    _leaf_bits_equal(_snapshot(pool), pool_before)
    _leaf_bits_equal(_host_snapshot(host), host_before)


@pytest.mark.parametrize(
    ("dev_pages", "host_pages", "load", "match"),
    [
        ([0, 2], [1, 2], False, "device page"),  # trash page
        ([2, PAGES_PER_RANK], [1, 2], True, "device page"),  # past the lane
        ([2, 3], [0, 1], True, "host page"),  # reserved host page
        ([2, 3], [1, 1], False, "host target"),  # two pages into one host page
        ([2, 2], [1, 3], True, "device target"),  # two pages into one device page
        ([2, 3], [1], False, "2 device pages but 1 host"),
    ],
)
def test_bad_page_plans_are_refused(dev_pages, host_pages, load, match):
    pool_layout, pool, hosts = _refusal_fixture()
    host = hosts["layer_page_first"][1]
    pool_before, host_before = _snapshot(pool), _host_snapshot(host)
    fn = load_all_layers if load else backup_all_layers
    with pytest.raises(HostCopyError, match=match):
        fn(
            pool,
            host,
            device_indices=token_indices_of_pages(np.array(dev_pages), P),
            host_indices=token_indices_of_pages(np.array(host_pages), P),
            pool_layout=pool_layout,
            lane=1,
        )
    _leaf_bits_equal(_snapshot(pool), pool_before)
    _leaf_bits_equal(_host_snapshot(host), host_before)


def test_lpf_is_direct_only_and_never_falls_back(monkeypatch):
    pool_layout, pool, hosts = _refusal_fixture()
    host = hosts["layer_page_first"][1]
    kw = dict(
        device_indices=token_indices_of_pages(np.array([2]), P),
        host_indices=token_indices_of_pages(np.array([3]), P),
        pool_layout=pool_layout,
        lane=1,
    )
    with pytest.raises(ConfigError, match="direct-only"):
        backup_all_layers(pool, host, impl="xla", **kw)
    host_before = _host_snapshot(host)

    def broken(*args, **kwargs):
        raise RuntimeError("Triton lowering failed")

    monkeypatch.setattr(lpf_copy, "_gather", broken)
    monkeypatch.setattr(lpf_copy, "_scatter", broken)
    with pytest.raises(LPFKernelUnavailableError, match="no fallback") as err:
        backup_layer(pool, host, 0, **kw)
    assert isinstance(err.value.__cause__, RuntimeError)
    _leaf_bits_equal(_host_snapshot(host), host_before)
    with pytest.raises(LPFKernelUnavailableError):
        load_layer(pool, host, 0, **kw)
