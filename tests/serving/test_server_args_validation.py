"""ServerArgs validation, the one pass before anything is built: NSA index top-k
overrides (SPEC S11), CP and shared KV (S1.6), transfer backend capabilities and transfer
flags (S2.3), the host cache startup matrix (S3.3, S4.4: what is built, what is refused),
bs > 1 limits (S5) and ranges.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import typing

import pytest
from support.server_args_cases import GLM5_DIR, make_args, registry_with_test_backends

from cpkv_jax.cache.hiradix import WRITE_POLICIES
from cpkv_jax.errors import ConfigError
from serving.server_args import (
    HICACHE_NOT_BUILT,
    HICACHE_STORAGE_NOT_BUILT,
    HiCacheWritePolicy,
    ServerArgs,
    ServerArgsError,
    flag_name,
)
from transfer.capabilities import BackendCapabilities, default_backend_registry

# ---- SPEC S11: NSA index top-k overrides -------------------------------------------------


def test_s11_1_flags_merge_into_json_override_keeping_other_keys(tiny_config_dir):
    args = make_args(
        model_path=str(tiny_config_dir),
        json_model_override_args='{"index_topk": 7, "rms_norm_eps": 1e-5}',
        nsa_index_topk_freq=2,
        nsa_index_skip_topk_offset=3,
    )
    assert args.effective_model_overrides() == {
        "index_topk": 7,
        "rms_norm_eps": 1e-5,
        "index_topk_freq": 2,
        "index_skip_topk_offset": 3,
    }
    cfg = args.model_config()
    assert cfg.index_topk == 7 and cfg.rms_norm_eps == 1e-5
    assert make_args(nsa_index_topk_pattern="FSFSFS").effective_model_overrides() == {
        "index_topk_pattern": "FSFSFS"
    }


def test_s11_2_offset_zero_injects_nothing(tiny_config_dir):
    assert make_args().effective_model_overrides() == {}
    assert make_args(nsa_index_skip_topk_offset=0).effective_model_overrides() == {}
    args = make_args(
        model_path=str(tiny_config_dir),
        json_model_override_args='{"index_topk": 8}',
        nsa_index_topk_freq=2,
        nsa_index_skip_topk_offset=0,
    )
    assert args.effective_model_overrides() == {"index_topk": 8, "index_topk_freq": 2}
    # Unset offset -> default 2: full at max(i - 1, 0) % 2 == 0 -> layers 0, 1, 3, 5.
    assert args.model_config().full_indexer_layers == (0, 1, 3, 5)
    # An offset 0 flag does not contradict an offset in the JSON: it is not set.
    args = make_args(json_model_override_args='{"index_skip_topk_offset": 3}')
    assert args.effective_model_overrides() == {"index_skip_topk_offset": 3}


@pytest.mark.parametrize(
    ("key", "json_value", "field", "flag_value"),
    [
        ("index_topk_freq", 2, "nsa_index_topk_freq", 4),
        ("index_skip_topk_offset", 2, "nsa_index_skip_topk_offset", 3),
        ("index_topk_pattern", "FFSFSS", "nsa_index_topk_pattern", "FSSSSS"),
    ],
)
def test_s11_3_flag_contradicting_json_override_is_error(key, json_value, field, flag_value):
    flags = {field: flag_value}
    flag = flag_name(field)
    args = make_args(json_model_override_args=json.dumps({key: json_value}), **flags)
    with pytest.raises(ServerArgsError) as e:
        args.effective_model_overrides()
    assert f"{flag} {flag_value}" in str(e.value) and f"{key!r}: {json_value!r}" in str(e.value)
    assert "--json-model-override-args" in str(e.value)
    with pytest.raises(ServerArgsError, match=flag):
        args.validate()
    # Agreeing values are fine.
    agree = make_args(json_model_override_args=json.dumps({key: flag_value}), **flags)
    assert agree.effective_model_overrides() == {key: flag_value}


def test_s11_4_model_config_derives_schedule_from_flags(tiny_config_dir):
    base = make_args(model_path=str(tiny_config_dir))
    assert base.model_config().indexer_types == (
        "full",
        "full",
        "shared",
        "full",
        "shared",
        "shared",
    )
    # freq 2 offset 3: full iff max(i - 2, 0) % 2 == 0 -> 0, 1, 2, 4.
    cfg = make_args(
        model_path=str(tiny_config_dir), nsa_index_topk_freq=2, nsa_index_skip_topk_offset=3
    )
    assert cfg.model_config().full_indexer_layers == (0, 1, 2, 4)
    # A pattern wins over freq / offset.
    cfg = make_args(
        model_path=str(tiny_config_dir), nsa_index_topk_freq=2, nsa_index_topk_pattern="FSSSSF"
    )
    assert cfg.model_config().full_indexer_layers == (0, 5)


def test_s11_4_glm5_freq4_offset3_schedule():
    args = make_args(model_path=str(GLM5_DIR), nsa_index_topk_freq=4, nsa_index_skip_topk_offset=3)
    cfg = args.model_config()
    full = list(cfg.full_indexer_layers)
    assert full == [l for l in range(78) if l < 3 or (l - 2) % 4 == 0]
    assert len(full) == 21
    assert args.validate(cfg) == ()


def test_nsa_flag_ranges():
    with pytest.raises(ServerArgsError, match="--nsa-index-topk-freq must be >= 1"):
        make_args(nsa_index_topk_freq=0).validate()
    with pytest.raises(ServerArgsError, match="--nsa-index-skip-topk-offset must be >= 0"):
        make_args(nsa_index_skip_topk_offset=-1).validate()
    with pytest.raises(ServerArgsError, match="--nsa-index-topk-pattern"):
        make_args(nsa_index_topk_pattern="FXS").validate()
    with pytest.raises(ServerArgsError, match="--json-model-override-args"):
        make_args(json_model_override_args="[1]").validate()


# ---- SPEC S1.6: CP and shared KV ---------------------------------------------------------


def test_s1_6_defaults_validate_clean(tiny_config_dir):
    args = make_args(model_path=str(tiny_config_dir))
    assert args.validate(args.model_config(), device_count=8) == ()
    shared = make_args(model_path=str(tiny_config_dir), cp_size=8, enable_cp_shared_kv=True)
    assert shared.validate(shared.model_config(), device_count=8) == ()


@pytest.mark.parametrize(
    ("kw", "needles"),
    [
        ({"enable_cp_shared_kv": True}, ("--enable-cp-shared-kv", "--cp-size")),
        (
            {"enable_cp_shared_kv": True, "cp_size": 8, "cp_split_mode": "round_robin"},
            ("--enable-cp-shared-kv", "--cp-split-mode in_seq"),
        ),
        ({"cp_size": 8, "cp_split_mode": "round_robin"}, ("--cp-split-mode",)),
        ({"cp_size": 0}, ("--cp-size",)),
        ({"page_size": 0}, ("--page-size",)),
        ({"chunked_prefill_size": 32}, ("--chunked-prefill-size",)),
        ({"cp_size": 3}, ("--cp-size 3", "8 available devices")),
    ],
)
def test_s1_6_refusals(kw, needles):
    with pytest.raises(ServerArgsError) as e:
        make_args(**kw).validate(device_count=8)
    for needle in needles:
        assert needle in str(e.value)


def test_cp_config_is_built_from_the_args():
    cp = make_args(cp_size=4, enable_cp_shared_kv=True, page_size=32, chunked_prefill_size=64)
    c = cp.cp_config()
    assert (c.cp_size, c.shared_kv, c.split_mode, c.page_size, c.chunked_prefill_size) == (
        4,
        True,
        "in_seq",
        32,
        64,
    )
    assert c.attention == "full-view"
    owner = make_args(cp_size=4, enable_cp_shared_kv=True, cp_attention="owner").cp_config()
    assert owner.attention == "owner"


# ---- SPEC S2.3: transfer backend capabilities --------------------------------------------


def test_default_backend_registry_is_a_fresh_object_with_both_backends():
    a, b = default_backend_registry(), default_backend_registry()
    assert a is not b and a.names() == ("grpc", "mooncake")
    for name in a.names():
        caps = a.get(name)
        assert caps.owner_filtering and caps.position_addressed and caps.supports_cp_shared_kv
    a.register(BackendCapabilities("x", owner_filtering=False, position_addressed=False))
    assert "x" in a and "x" not in b
    with pytest.raises(ConfigError, match="already registered"):
        a.register(BackendCapabilities("grpc", owner_filtering=True, position_addressed=True))
    with pytest.raises(ConfigError, match="unknown transfer backend 'nixl'"):
        a.get("nixl")


def test_s2_3_backend_without_position_addressed_destinations_is_refused():
    reg = registry_with_test_backends()
    prefill = {"cp_size": 8, "enable_cp_shared_kv": True, "disaggregation_mode": "prefill"}
    with pytest.raises(ServerArgsError) as e:
        make_args(**prefill, transfer_backend="slice").validate(backends=reg)
    msg = str(e.value)
    assert "--transfer-backend slice" in msg and "position-addressed destinations" in msg
    assert "owner filtering" not in msg and "grpc or mooncake" in msg
    assert "--enable-cp-shared-kv" in msg


def test_s2_3_backend_without_owner_filtering_is_refused_even_without_disaggregation():
    reg = registry_with_test_backends()
    with pytest.raises(ServerArgsError, match="lacks owner filtering"):
        make_args(cp_size=8, enable_cp_shared_kv=True, transfer_backend="broadcast").validate(
            backends=reg
        )


def test_s2_3_capable_backends_and_non_shared_runs_are_accepted():
    reg = registry_with_test_backends()
    for name in ("grpc", "mooncake"):
        args = make_args(
            cp_size=8,
            enable_cp_shared_kv=True,
            disaggregation_mode="prefill",
            transfer_backend=name,
        )
        assert args.validate(backends=reg) == ()
    # Without shared KV the chunk-slice backend is fine: every rank holds every page.
    args = make_args(cp_size=8, disaggregation_mode="prefill", transfer_backend="slice")
    assert args.validate(backends=reg) == ()


@pytest.mark.parametrize(
    "extra",
    [
        # Issue 40 with issue 39: drafting (`tests/serving/test_speculative_cp.py`).
        {"speculative_algorithm": "EAGLE"},
        # Issue 40's bitwise mode: each row's view put together on its rank
        # (`tests/serving/test_unified_cp.py` serves it bit for bit).
        {"enable_batch_invariant": True},
    ],
)
def test_a_cp_group_decodes_with(extra):
    """A unified or decode server on a CP group takes these flags."""
    reg = registry_with_test_backends()
    for mode in ("null", "decode"):
        args = make_args(
            disaggregation_mode=mode,
            cp_size=8,
            enable_cp_shared_kv=True,
            transfer_backend="grpc",
            **extra,
        )
        assert args.validate(backends=reg) == ()


def test_a_decode_server_runs_dp_groups_of_cp_ranks():
    """Issue 40 item 3: `--dp-size 2 --cp-size 4` on a decode server is two CP4 groups,
    the experts over all eight devices (`tests/serving/test_pd_cp_decode.py` serves it)."""
    args = make_args(
        disaggregation_mode="decode",
        dp_size=2,
        cp_size=4,
        ep_size=8,
        enable_cp_shared_kv=True,
        transfer_backend="grpc",
    )
    assert args.decodes_on_groups()
    assert args.validate(backends=registry_with_test_backends(), device_count=8) == ()
    drafting = dataclasses.replace(args, speculative_algorithm="EAGLE")
    assert drafting.validate(backends=registry_with_test_backends(), device_count=8) == ()


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        # DP groups of CP ranks (issue 40 item 3): decode servers, experts over every device.
        (
            {"disaggregation_mode": "decode", "transfer_backend": "grpc", "dp_size": 2}
            | {"cp_size": 4, "enable_cp_shared_kv": True},
            "use --ep-size 8",
        ),
        # A unified server on a CP mesh (issue 40): page-owned KV through the prefix cache.
        (
            {"disaggregation_mode": "null", "cp_size": 8},
            "unified (null) server with --cp-size 8 needs --enable-cp-shared-kv",
        ),
        (
            {"disaggregation_mode": "null", "cp_size": 8, "enable_cp_shared_kv": True}
            | {"disable_radix_cache": True},
            "drop --disable-radix-cache",
        ),
        (
            {"disaggregation_mode": "null", "cp_size": 4, "enable_cp_shared_kv": True}
            | {"dp_size": 2},
            "use --dp-size 1",
        ),
        (
            {"disaggregation_mode": "null", "cp_size": 6, "enable_cp_shared_kv": True},
            "needs a power-of-two --cp-size",
        ),
        (
            {"disaggregation_mode": "prefill", "transfer_backend": "nixl"},
            "--transfer-backend 'nixl' is not registered",
        ),
        (
            {"disaggregation_mode": "decode", "transfer_backend": "grpc", "cp_size": 8},
            "a decode server with --cp-size 8 needs --enable-cp-shared-kv",
        ),
        ({"transfer_backend": "mooncake"}, "--transfer-backend has no effect without"),
        (
            {"disaggregation_mode": "prefill", "cp_size": 8, "cp_attention": "owner"},
            "owner attention needs page-owned KV (--enable-cp-shared-kv)",
        ),
        (
            {"disaggregation_mode": "prefill", "cp_size": 8, "enable_cp_shared_kv": True}
            | {"cp_attention": "owner", "enable_batch_invariant": True},
            "--cp-attention owner is not batch-invariant",
        ),
        ({"transfer_waiting_timeout": 1.0}, "--transfer-waiting-timeout has no effect"),
        (
            {"disable_transfer_malloc_tuning": True},
            "--disable-transfer-malloc-tuning has no effect",
        ),
        (
            {"disaggregation_mode": "decode", "transfer_backend": "grpc"}
            | {"transfer_heartbeat_interval": 0.0},
            "--transfer-heartbeat-interval must be > 0",
        ),
        (
            {"disaggregation_mode": "prefill", "transfer_backend": "grpc"}
            | {"transfer_host_buffer_size": 1 << 30},
            "needs --disaggregation-mode prefill --transfer-backend mooncake",
        ),
        (
            {"disaggregation_mode": "decode", "transfer_backend": "mooncake"}
            | {"transfer_host_buffer_size": 1 << 30},
            "needs --disaggregation-mode prefill --transfer-backend mooncake",
        ),
        (
            {"disaggregation_mode": "prefill", "transfer_backend": "mooncake"}
            | {"transfer_host_buffer_size": 0},
            "--transfer-host-buffer-size must be >= 1",
        ),
        (
            {"disaggregation_mode": "prefill", "transfer_backend": "mooncake"}
            | {"transfer_staging_size": 1 << 30},
            "needs --disaggregation-mode decode --transfer-backend mooncake",
        ),
        (
            {"disaggregation_mode": "decode", "transfer_backend": "grpc"}
            | {"transfer_staging_size": 1 << 30},
            "needs --disaggregation-mode decode --transfer-backend mooncake",
        ),
    ],
)
def test_transfer_flag_refusals(kw, needle):
    with pytest.raises(ServerArgsError) as e:
        make_args(**kw).validate()
    assert needle in str(e.value)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_mode_without_a_backend_uses_the_embedded_default(mode):
    """SGLang applies its default transfer backend; ours is gRPC (no system libraries)."""
    args = ServerArgs.from_cli(["--model-path", "m", "--disaggregation-mode", mode])
    assert args.transfer_backend == "grpc"
    assert args.validate() == ()


# ---- SPEC S4.4: layer_page_first host layout ---------------------------------------------


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"hicache_storage_backend": "file"}, "--hicache-storage-backend none"),
        ({"hicache_io_backend": "kernel"}, "--hicache-io-backend direct"),
    ],
)
def test_s4_4_layer_page_first_refusals(kw, needle):
    args = make_args(enable_hierarchical_cache=True, hicache_mem_layout="layer_page_first", **kw)
    with pytest.raises(ServerArgsError) as e:
        args.validate()
    assert "--hicache-mem-layout layer_page_first" in str(e.value) and needle in str(e.value)


LAYOUTS = ("layer_first", "page_first", "page_first_direct", "layer_page_first")
# (mode, CP kwargs): every CP / shared-KV setup a mode may run.
SETUPS = (
    ("prefill", {}),
    ("prefill", {"cp_size": 8}),
    ("prefill", {"cp_size": 8, "enable_cp_shared_kv": True}),
    ("null", {}),
    ("decode", {}),
)


@pytest.mark.parametrize(
    ("setup", "layout", "io", "storage"),
    list(itertools.product(SETUPS, LAYOUTS, ("direct", "kernel"), ("none", "file"))),
    ids=lambda v: "-".join([v[0], *map(str, v[1].values())]) if isinstance(v, tuple) else v,
)
def test_s3_3_s4_4_host_cache_startup_matrix(setup, layout, io, storage):
    """Every combination is supported or refused naming the flags: LPF with a storage
    tier or non-direct I/O is invalid (S4.4); a unified / decode server or a storage
    tier is valid but not built, so `validate` warns and startup refuses; the rest
    (prefill mode, storage none: any layout with direct I/O, non-LPF with kernel I/O)
    validates with no warning and starts."""
    mode, cp = setup
    args = make_args(
        disaggregation_mode=mode,
        enable_hierarchical_cache=True,
        hicache_mem_layout=layout,
        hicache_io_backend=io,
        hicache_storage_backend=storage,
        **cp,
    )
    if layout == "layer_page_first" and (storage != "none" or io != "direct"):
        with pytest.raises(ServerArgsError) as e:
            args.validate()
        flag = "--hicache-storage-backend none" if storage != "none" else "--hicache-io-backend"
        assert "--hicache-mem-layout layer_page_first" in str(e.value) and flag in str(e.value)
        return
    unbuilt = [HICACHE_NOT_BUILT] if mode == "decode" else []
    unbuilt += [HICACHE_STORAGE_NOT_BUILT] if storage != "none" else []
    assert list(args.validate()) == unbuilt
    if not unbuilt:
        args.refuse_unbuilt()  # built: starts
        return
    with pytest.raises(ServerArgsError) as e:
        args.refuse_unbuilt()
    assert str(e.value) == unbuilt[0]
    assert ("unified servers only" if mode == "decode" else "--hicache-storage-backend none") in (
        str(e.value)
    )


def test_hicache_ratio_and_write_policy():
    args = make_args(
        cp_size=8,
        enable_cp_shared_kv=True,
        enable_hierarchical_cache=True,
        hicache_ratio=4.0,
        hicache_write_policy="write_back",
    )
    assert args.validate() == ()
    # SGLang's names, the host cache's own.
    assert typing.get_args(HiCacheWritePolicy) == WRITE_POLICIES
    for ratio in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ServerArgsError, match="--hicache-ratio must be a finite number > 0"):
            make_args(enable_hierarchical_cache=True, hicache_ratio=ratio).validate()
    # --hicache-size wins; a ratio beside it does nothing (a warning names both).
    (warning,) = make_args(
        disaggregation_mode="prefill",
        enable_hierarchical_cache=True,
        hicache_size=2**30,
        hicache_ratio=3.0,
    ).validate()
    assert "--hicache-ratio 3 has no effect with --hicache-size 1GiB" in warning
    for kw in ({"hicache_ratio": 3.0}, {"hicache_write_policy": "write_through"}):
        with pytest.raises(ServerArgsError, match="without --enable-hierarchical-cache"):
            make_args(disaggregation_mode="prefill", **kw).validate()


def test_hicache_options_need_the_hierarchical_cache():
    with pytest.raises(ServerArgsError, match="--hicache-size has no effect without"):
        make_args(hicache_size=2**30).validate()


# ---- SPEC S5: bs > 1 limits ---------------------------------------------------------------


LIMIT_FIELDS = (
    "cp_shared_kv_prefill_max_batch_requests",
    "cp_shared_kv_prefill_max_total_extend_tokens",
    "cp_shared_kv_prefill_max_cached_tokens",
    "cp_shared_kv_prefill_max_buffer_size",
)
BS_GT1 = {"cp_size": 8, "enable_cp_shared_kv": True, "enable_cp_shared_kv_prefill_bs_gt1": True}
EP8 = {"cp_size": 8, "enable_cp_shared_kv": True, "ep_size": 8}


@pytest.mark.parametrize("field", LIMIT_FIELDS)
@pytest.mark.parametrize("value", [0, -1])
def test_s5_2_zero_or_negative_limits_are_refused(field, value):
    with pytest.raises(ServerArgsError) as e:
        make_args(**BS_GT1, **{field: value}).validate()
    assert f"{flag_name(field)} must be >= 1, got {value}" in str(e.value)
    assert "none" in str(e.value)


@pytest.mark.parametrize("field", LIMIT_FIELDS)
def test_s5_limits_without_the_bs_gt1_flag_are_refused(field):
    with pytest.raises(ServerArgsError) as e:
        make_args(cp_size=8, enable_cp_shared_kv=True, **{field: 4}).validate()
    assert f"{flag_name(field)} has no effect without --enable-cp-shared-kv-prefill-bs-gt1" in str(
        e.value
    )


def test_s5_limits_with_bs_gt1_are_accepted_and_bs_gt1_on_ordinary_cp_warns():
    limits = dict.fromkeys(LIMIT_FIELDS, 1)
    args = make_args(**BS_GT1, **limits)
    assert args.bs_gt1_active() and args.validate() == ()
    ordinary = make_args(cp_size=8, enable_cp_shared_kv_prefill_bs_gt1=True, **limits)
    (warning,) = ordinary.validate()
    assert not ordinary.bs_gt1_active()
    assert "--enable-cp-shared-kv-prefill-bs-gt1 has no effect" in warning and "S5.1" in warning


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"max_prefill_tokens": 0}, "--max-prefill-tokens must be >= 1"),
        ({"max_running_requests": 0}, "--max-running-requests must be >= 1"),
        ({"kv_pool_size": 0}, "--kv-pool-size must be >= 1"),
        ({"transient_block_size": 0}, "--transient-block-size must be >= 1"),
        ({"port": 0}, "--port must be in [1, 65535]"),
        ({"request_timeout": -1.0}, "--request-timeout must be > 0"),
        ({"model_path": ""}, "--model-path is empty"),
        ({"ep_size": 0}, "--ep-size must be >= 1"),
        ({"device_memory_bytes": 0}, "--device-memory-bytes must be >= 1"),
        ({"mem_fraction_static": 0.0}, "--mem-fraction-static must be in (0, 1]"),
        ({"mem_fraction_static": 1.5}, "--mem-fraction-static must be in (0, 1]"),
        ({**EP8, "ep_dispatch": "all_to_all", "ep_capacity_factor": 0.0}, "must be > 0"),
    ],
)
def test_range_refusals(kw, needle):
    with pytest.raises(ServerArgsError) as e:
        make_args(**kw).validate()
    assert needle in str(e.value)


# ---- expert parallelism (issue 22) ---------------------------------------------------------


def test_ep_over_the_cp_ranks_of_a_prefill_server_is_accepted(tiny_config_dir):
    args = make_args(model_path=str(tiny_config_dir), **EP8)  # 8 experts over 8 ranks
    assert args.validate(args.model_config(), device_count=8) == ()
    a2a = make_args(**EP8, ep_dispatch="all_to_all", ep_capacity_factor=8.0)
    assert a2a.validate() == ()


@pytest.mark.parametrize(
    ("kw", "needles"),
    [
        ({"ep_size": 8}, ("--ep-size 8", "it needs --cp-size 8", "--disaggregation-mode null")),
        (
            {"ep_size": 2, "disaggregation_mode": "decode"},
            ("--ep-size 2", "--disaggregation-mode decode", "--ep-size 1"),
        ),
        (
            {"ep_size": 2, "disaggregation_mode": "prefill"},
            ("--ep-size 2", "needs --cp-size 2", "--disaggregation-mode prefill --cp-size 1"),
        ),
        ({"cp_size": 8, "ep_size": 4}, ("--ep-size 4 must be 1 or equal --cp-size (8)",)),
        (
            {"ep_dispatch": "all_to_all"},
            ("--ep-dispatch has no effect without --ep-size N",),
        ),
        (
            {**EP8, "ep_capacity_factor": 2.0},
            ("--ep-capacity-factor has no effect without --ep-dispatch all_to_all",),
        ),
    ],
)
def test_ep_refusals_name_the_flags(kw, needles):
    with pytest.raises(ServerArgsError) as e:
        make_args(**kw).validate()
    for needle in needles:
        assert needle in str(e.value)


def test_ep_needs_the_experts_to_split_evenly(tiny_config_dir):
    args = make_args(
        model_path=str(tiny_config_dir), json_model_override_args='{"n_routed_experts": 12}', **EP8
    )
    cfg = args.model_config()
    assert cfg.n_routed_experts == 12
    args.validate()  # without the model config the count is not known yet
    with pytest.raises(ServerArgsError) as e:
        args.validate(cfg, device_count=8)
    msg = str(e.value)
    assert "--ep-size 8" in msg and "divisible by --cp-size (8)" in msg and "(12)" in msg


def test_ep_capacity_factor_below_ep_size_warns_not_exact():
    args = make_args(**EP8, ep_dispatch="all_to_all", ep_capacity_factor=2.0)
    (warning,) = args.validate()
    assert "--ep-capacity-factor 2 < --ep-size 8" in warning
    assert "dropped" in warning and "not exact" in warning
    assert make_args(**EP8, ep_dispatch="all_to_all").validate() == ()


def test_a_unified_server_runs_on_a_cp_mesh_with_page_owned_kv():
    """Issue 40: `--cp-size N --enable-cp-shared-kv` (and experts over the same ranks) on
    a unified server is valid; its model runs on the CP mesh as a prefill server's does."""
    args = make_args(disaggregation_mode="null", cp_size=8, enable_cp_shared_kv=True, ep_size=8)
    assert args.validate() == ()
    assert args.runs_on_cp_mesh() and args.uses_prefix_cache()
    assert not make_args().runs_on_cp_mesh()
    assert not make_args(disaggregation_mode="decode").runs_on_cp_mesh()
    # A decode server's CP group (PD into a CP decode group): no prefix cache there.
    group = make_args(disaggregation_mode="decode", cp_size=8, enable_cp_shared_kv=True)
    assert group.validate() == () and group.runs_on_cp_mesh() and not group.runs_cp_prefill()
