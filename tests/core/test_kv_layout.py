"""The one KV layout definition (issue 35 item 1): every pool, transfer descriptor, host
pool and byte count derives from `KVLayout`, so they agree by construction; these tests
check that they do, at tiny and at real (GLM-5, DeepSeek-V3.2) dimensions."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import ConfigError
from cpkv_jax.host_cache import HostPool
from cpkv_jax.kv_layout import KVBuffer, KVLayout
from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.model.kv_cache import init_pool, pool_shapes
from cpkv_jax.model_configs import config_dir
from cpkv_jax.tools.tiny_config import tiny_config_dict
from transfer.page_plan import LayoutDescriptor

DTYPES = (jnp.float32, jnp.bfloat16)
INDEX_K = ("fp8_e4m3", "bfloat16", "float32")


def _tiny(num_layers: int = 6) -> ModelConfig:
    # Six layers: full and shared indexer layers interleave (FFSFSS).
    return ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa", num_layers=num_layers))


@pytest.mark.parametrize(("dtype", "index_k"), list(itertools.product(DTYPES, INDEX_K)))
def test_pool_transfer_and_host_agree(dtype, index_k):
    cfg = _tiny()
    kv = KVLayout.from_model(cfg, 4, dtype, index_k)
    pool = init_pool(cfg, 5, 4, dtype, index_k)
    # The pool the servers build is the layout's, leaf for leaf.
    assert KVLayout.of_pool(pool, cfg.full_indexer_layers) == kv
    assert pool.nbytes() == kv.pool_bytes(5)
    shapes = pool_shapes(cfg, 5, 4, dtype, index_k)
    for kind in ("latent", "index_k", "index_scale"):
        got = [(s.shape, np.dtype(s.dtype)) for s in getattr(shapes, kind)]
        assert got == list(kv.leaf_shapes(5)[kind])
    # The wire descriptor names the same layout, and back.
    desc = LayoutDescriptor.from_model(cfg, 4, dtype, index_k)
    assert desc == LayoutDescriptor.of(kv)
    assert desc.kv_layout == kv
    assert LayoutDescriptor.from_dict(desc.to_dict()).kv_layout == kv
    assert desc.bytes_per_page() == kv.bytes_per_page
    for kind, layer in desc.buffers():
        leaf = getattr(pool, kind)[desc.leaf_index(kind, layer)]
        assert desc.page_bytes(kind, layer) == leaf[0].nbytes
    # A host page costs what a device page costs; the CP pool plan too.
    host = HostPool.for_device_pool(
        pool, cfg.full_indexer_layers, "layer_page_first", device_pages_per_rank=5
    )
    assert host.nbytes() == host.num_pages * kv.bytes_per_page
    assert per_rank_pool_bytes(cfg, PoolLayout(2, True, 5, 4), dtype, index_k) == pool.nbytes()


def test_index_k_only_on_full_layers_and_scale_only_with_fp8():
    cfg = _tiny()
    full = tuple(cfg.full_indexer_layers)
    assert 0 < len(full) < cfg.num_hidden_layers  # the schedule mixes both kinds
    kv = KVLayout.from_model(cfg, 8, jnp.bfloat16, "fp8_e4m3")
    assert [b.kind for b in kv.buffers] == ["latent", "index_k", "index_scale"]
    assert kv.by_kind()["index_k"].layers == full
    shared = next(x for x in range(cfg.num_hidden_layers) if x not in full)
    assert kv.kinds_at(shared) == ("latent",)
    assert kv.kinds_at(full[-1]) == ("latent", "index_k", "index_scale")
    assert kv.leaf_index("index_k", full[-1]) == len(full) - 1
    with pytest.raises(ConfigError, match="stores no index_k"):
        kv.page_bytes("index_k", shared)
    assert KVLayout.from_model(cfg, 8, jnp.bfloat16, "bfloat16").buffer("index_scale") is None


@pytest.mark.parametrize(
    ("name", "page_bytes"),
    [
        # 78 layers x (576 bf16 latent + 128 fp8 index K + one fp32 scale), every layer full.
        ("glm-5", 64 * 78 * (1152 + 128 + 4)),
        # 61 layers, the same per-layer widths.
        ("deepseek-v3.2", 64 * 61 * (1152 + 128 + 4)),
    ],
)
def test_real_dims(name, page_bytes):
    cfg = ModelConfig.from_pretrained(config_dir(name))
    kv = KVLayout.from_model(cfg, 64, jnp.bfloat16, "fp8_e4m3")
    assert kv.bytes_per_page == page_bytes
    assert LayoutDescriptor.from_model(cfg, 64, "bfloat16", "fp8_e4m3").bytes_per_page() == (
        page_bytes
    )
    # 1M tokens of GLM-5 KV per rank: the figure the memory plan starts from.
    assert kv.bytes_per_token * 2**20 == page_bytes // 64 * 2**20


def test_index_share_config_stores_fewer_index_layers():
    cfg = ModelConfig.from_pretrained(config_dir("glm-5-indexshare-freq4"))
    kv = KVLayout.from_model(cfg, 64, jnp.bfloat16, "fp8_e4m3")
    n_full = len(cfg.full_indexer_layers)
    assert n_full < cfg.num_hidden_layers
    assert kv.bytes_per_token == cfg.num_hidden_layers * 1152 + n_full * (128 + 4)


def test_mismatches_name_every_difference():
    cfg = _tiny()
    a = KVLayout.from_model(cfg, 4, jnp.bfloat16, "fp8_e4m3")
    b = KVLayout.from_model(cfg, 8, jnp.float32, "bfloat16")
    diff = a.mismatches(b)
    assert diff[0] == "page_size: 4 != 8"
    assert any(line.startswith("latent:") and "bfloat16" in line for line in diff)
    assert any(line.startswith("index_scale:") and "not stored" in line for line in diff)
    assert a.mismatches(a) == []


def test_bad_layouts_are_refused():
    latent = KVBuffer("latent", (0, 1), (8,), np.dtype(ml_dtypes.bfloat16))
    index = KVBuffer("index_k", (1,), (4,), np.dtype(np.float32))
    with pytest.raises(ConfigError, match="start with latent"):
        KVLayout(4, 2, (index, latent))
    with pytest.raises(ConfigError, match="ascending"):
        KVLayout(4, 2, (latent, KVBuffer("index_k", (2,), (4,), np.dtype(np.float32))))
    with pytest.raises(ConfigError, match="page_size"):
        KVLayout(0, 2, (latent,))
    cfg = _tiny()
    pool = init_pool(cfg, 3, 4, jnp.float32, "float32")
    with pytest.raises(ConfigError, match="full indexer layers"):
        KVLayout.of_pool(pool, ())
