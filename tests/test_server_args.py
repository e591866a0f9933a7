"""ServerArgs: flags generated from the dataclass, byte sizes, the one validation pass
(SPEC S1.6, S2.3, S4.4, S5, S11) and `cpkv-serve --check-config`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path

import pytest

from cpkv_jax.config import CPConfig
from cpkv_jax.errors import ConfigError
from cpkv_jax.model_configs import config_dir
from cpkv_jax.tools.tiny_config import tiny_config_dict
from serving import launch
from serving.server_args import (
    GROUPS,
    HICACHE_NOT_BUILT,
    ServerArgs,
    ServerArgsError,
    as_flags,
    flag_name,
    format_byte_size,
    parse_byte_size,
)
from transfer.capabilities import (
    BackendCapabilities,
    TransferBackendRegistry,
    default_backend_registry,
)

GLM5_DIR = config_dir("glm-5")
LIMIT_FLAGS = (
    "--cp-shared-kv-prefill-max-batch-requests",
    "--cp-shared-kv-prefill-max-total-extend-tokens",
    "--cp-shared-kv-prefill-max-cached-tokens",
    "--cp-shared-kv-prefill-max-buffer-size",
)
SHARED_KV = ("--disaggregation-mode", "prefill", "--cp-size", "8", "--enable-cp-shared-kv")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """Tiny GLM-5-style config (explicit indexer_types list FFSFSS, 6 layers), no weights."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_config_dict("glm_moe_dsa")))
    return d


def _args(**kw) -> ServerArgs:
    kw.setdefault("model_path", "unused")
    if kw.get("cp_size", 1) > 1:  # CP runs only on a PD prefill server
        kw.setdefault("disaggregation_mode", "prefill")
    return ServerArgs(**kw)


def _test_registry() -> TransferBackendRegistry:
    """The built-in backends plus two test-only ones, each lacking one capability."""
    reg = default_backend_registry()
    reg.register(BackendCapabilities("slice", owner_filtering=True, position_addressed=False))
    reg.register(BackendCapabilities("broadcast", owner_filtering=False, position_addressed=True))
    return reg


def _to_argv(args: ServerArgs) -> list[str]:
    """The command line that should parse back to `args` (every field spelled out)."""
    argv: list[str] = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(value, bool):
            argv += [flag_name(f.name)] if value else []
        else:
            argv += [flag_name(f.name), "none" if value is None else str(value)]
    return argv


# ---- flags generated from the dataclass -------------------------------------------------


def test_every_field_has_a_flag_with_help_and_group():
    parser = ServerArgs.build_parser()
    actions = {a.dest: a for a in parser._actions}
    titles = {g.title: g for g in parser._action_groups}
    for f in dataclasses.fields(ServerArgs):
        assert f.metadata["help"], f.name
        assert f.metadata["group"] in GROUPS, f.name
        action = actions[f.name]
        assert action.option_strings == [flag_name(f.name)]
        assert action.help and f.metadata["help"].split("{")[0] in action.help
        group = titles[GROUPS[f.metadata["group"]]]
        assert action in group._group_actions, f.name


def test_flag_names_cover_the_brief():
    flags = {flag_name(f.name) for f in dataclasses.fields(ServerArgs)}
    for flag in (
        "--model-path", "--dtype", "--index-k-dtype", "--page-size", "--cp-size",
        "--enable-cp-shared-kv", "--cp-split-mode", "--chunked-prefill-size",
        "--max-prefill-tokens", "--max-running-requests", "--kv-pool-size",
        "--schedule-policy", "--enable-cp-shared-kv-prefill-bs-gt1", *LIMIT_FLAGS,
        "--enable-hierarchical-cache", "--hicache-mem-layout", "--hicache-io-backend",
        "--hicache-storage-backend", "--hicache-size", "--disaggregation-mode",
        "--transfer-backend", "--transfer-bootstrap-timeout", "--transfer-waiting-timeout",
        "--transfer-heartbeat-interval", "--nsa-index-topk-freq",
        "--nsa-index-skip-topk-offset", "--nsa-index-topk-pattern",
        "--json-model-override-args", "--kernel-impl", "--host", "--port", "--log-level",
        "--request-timeout", "--check-config",
    ):  # fmt: skip
        assert flag in flags


def test_defaults_round_trip():
    assert ServerArgs.from_cli(["--model-path", "m"]) == ServerArgs(model_path="m")
    assert ServerArgs.from_cli(_to_argv(ServerArgs(model_path="m"))) == ServerArgs(model_path="m")
    hints = typing.get_type_hints(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        if f.default is dataclasses.MISSING:
            continue
        # A Literal default must be one of the flag's choices.
        if typing.get_origin(hints[f.name]) is typing.Literal:
            assert f.default in typing.get_args(hints[f.name]), f.name


def test_non_default_values_round_trip_through_the_command_line():
    args = ServerArgs(
        model_path="/models/glm-5",
        dtype="float32",
        index_k_dtype="bfloat16",
        json_model_override_args='{"index_topk": 7}',
        nsa_index_topk_freq=4,
        nsa_index_skip_topk_offset=3,
        nsa_index_topk_pattern="FFS",
        cp_size=8,
        enable_cp_shared_kv=True,
        page_size=32,
        chunked_prefill_size=8192,
        max_running_requests=64,
        kv_pool_size=40 * 2**30,
        transient_block_size=256 * 2**20,
        schedule_policy="lpm",
        enable_cp_shared_kv_prefill_bs_gt1=True,
        cp_shared_kv_prefill_max_batch_requests=4,
        cp_shared_kv_prefill_max_total_extend_tokens=65536,
        cp_shared_kv_prefill_max_cached_tokens=1 << 20,
        cp_shared_kv_prefill_max_buffer_size=3 * 10**9,
        enable_hierarchical_cache=True,
        hicache_mem_layout="layer_page_first",
        hicache_size=2**36,
        disaggregation_mode="prefill",
        transfer_backend="mooncake",
        transfer_bootstrap_timeout=12.5,
        disable_transfer_malloc_tuning=True,
        kernel_impl="pallas",
        port=8000,
        log_level="debug",
        request_timeout=30.0,
        check_config=True,
    )
    assert ServerArgs.from_cli(_to_argv(args)) == args


def test_optional_ints_accept_none_and_byte_sizes_accept_units():
    args = ServerArgs.from_cli(
        ["--model-path", "m", "--chunked-prefill-size", "None", "--kv-pool-size", "512MiB"]
    )
    assert args.chunked_prefill_size is None
    assert args.kv_pool_size == 512 * 2**20
    assert ServerArgs.from_cli(["--model-path", "m"]).transient_block_size == 2**30
    short = ServerArgs.from_cli(["--model-path", "m", "--transient-block-size", "64MiB"])
    assert short.transient_block_size == 64 * 2**20


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "--model-path"),
        (["--model-path", "m", "--dtype", "float16"], "--dtype"),
        (["--model-path", "m", "--page-size", "x"], "--page-size"),
        (["--model-path", "m", "--kv-pool-size", "2G"], "--kv-pool-size"),
        (["--model-path", "m", "--no-such-flag"], "--no-such-flag"),
    ],
)
def test_parse_errors_are_server_args_errors_naming_the_flag(argv, needle):
    with pytest.raises(ServerArgsError, match=needle):
        ServerArgs.from_cli(argv)


# ---- byte sizes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("0", 0),
        ("10B", 10),
        ("512MiB", 512 * 2**20),
        ("2GiB", 2 * 2**30),
        ("2gib", 2 * 2**30),
        (" 2 GiB ", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("1.5KiB", 1536),
        ("3kb", 3000),
        ("1TiB", 2**40),
    ],
)
def test_parse_byte_size_good(text, expected):
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "byte size"),
        ("abc", "byte size"),
        ("-1", ">= 0"),
        ("-2GiB", ">= 0"),
        (-1, ">= 0"),
        ("12X", "unknown byte-size unit"),
        ("2G", "unknown byte-size unit"),
        ("1.5B", "whole number of bytes"),
        ("0.1KiB", "whole number of bytes"),
        (True, "byte size"),
    ],
)
def test_parse_byte_size_bad(text, needle):
    with pytest.raises(ServerArgsError, match=needle):
        parse_byte_size(text)


def test_format_byte_size_round_trips():
    for n in (0, 1, 1536, 2**30, 3 * 2**40, 1_500_000_000):
        assert parse_byte_size(format_byte_size(n)) == n
    assert format_byte_size(2 * 2**30) == "2GiB"


# ---- SPEC S11: NSA index top-k overrides -------------------------------------------------


def test_s11_1_flags_merge_into_json_override_keeping_other_keys(model_dir):
    args = _args(
        model_path=str(model_dir),
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
    assert _args(nsa_index_topk_pattern="FSFSFS").effective_model_overrides() == {
        "index_topk_pattern": "FSFSFS"
    }


def test_s11_2_offset_zero_injects_nothing(model_dir):
    assert _args().effective_model_overrides() == {}
    assert _args(nsa_index_skip_topk_offset=0).effective_model_overrides() == {}
    args = _args(
        model_path=str(model_dir),
        json_model_override_args='{"index_topk": 8}',
        nsa_index_topk_freq=2,
        nsa_index_skip_topk_offset=0,
    )
    assert args.effective_model_overrides() == {"index_topk": 8, "index_topk_freq": 2}
    # Unset offset -> default 2: full at max(i - 1, 0) % 2 == 0 -> layers 0, 1, 3, 5.
    assert args.model_config().full_indexer_layers == (0, 1, 3, 5)
    # An offset 0 flag does not contradict an offset in the JSON: it is not set.
    args = _args(json_model_override_args='{"index_skip_topk_offset": 3}')
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
    args = _args(json_model_override_args=json.dumps({key: json_value}), **flags)
    with pytest.raises(ServerArgsError) as e:
        args.effective_model_overrides()
    assert f"{flag} {flag_value}" in str(e.value) and f"{key!r}: {json_value!r}" in str(e.value)
    assert "--json-model-override-args" in str(e.value)
    with pytest.raises(ServerArgsError, match=flag):
        args.validate()
    # Agreeing values are fine.
    agree = _args(json_model_override_args=json.dumps({key: flag_value}), **flags)
    assert agree.effective_model_overrides() == {key: flag_value}


def test_s11_4_model_config_derives_schedule_from_flags(model_dir):
    base = _args(model_path=str(model_dir))
    assert base.model_config().indexer_types == (
        "full",
        "full",
        "shared",
        "full",
        "shared",
        "shared",
    )
    # freq 2 offset 3: full iff max(i - 2, 0) % 2 == 0 -> 0, 1, 2, 4.
    cfg = _args(model_path=str(model_dir), nsa_index_topk_freq=2, nsa_index_skip_topk_offset=3)
    assert cfg.model_config().full_indexer_layers == (0, 1, 2, 4)
    # A pattern wins over freq / offset.
    cfg = _args(model_path=str(model_dir), nsa_index_topk_freq=2, nsa_index_topk_pattern="FSSSSF")
    assert cfg.model_config().full_indexer_layers == (0, 5)


def test_s11_4_glm5_freq4_offset3_schedule():
    args = _args(model_path=str(GLM5_DIR), nsa_index_topk_freq=4, nsa_index_skip_topk_offset=3)
    cfg = args.model_config()
    full = list(cfg.full_indexer_layers)
    assert full == [l for l in range(78) if l < 3 or (l - 2) % 4 == 0]
    assert len(full) == 21
    assert args.validate(cfg) == ()


def test_nsa_flag_ranges():
    with pytest.raises(ServerArgsError, match="--nsa-index-topk-freq must be >= 1"):
        _args(nsa_index_topk_freq=0).validate()
    with pytest.raises(ServerArgsError, match="--nsa-index-skip-topk-offset must be >= 0"):
        _args(nsa_index_skip_topk_offset=-1).validate()
    with pytest.raises(ServerArgsError, match="--nsa-index-topk-pattern"):
        _args(nsa_index_topk_pattern="FXS").validate()
    with pytest.raises(ServerArgsError, match="--json-model-override-args"):
        _args(json_model_override_args="[1]").validate()


# ---- SPEC S1.6: CP and shared KV ---------------------------------------------------------


def test_s1_6_defaults_validate_clean(model_dir):
    args = _args(model_path=str(model_dir))
    assert args.validate(args.model_config(), device_count=8) == ()
    shared = _args(model_path=str(model_dir), cp_size=8, enable_cp_shared_kv=True)
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
        _args(**kw).validate(device_count=8)
    for needle in needles:
        assert needle in str(e.value)


def test_cp_config_is_built_from_the_args():
    cp = _args(cp_size=4, enable_cp_shared_kv=True, page_size=32, chunked_prefill_size=64)
    c = cp.cp_config()
    assert (c.cp_size, c.shared_kv, c.split_mode, c.page_size, c.chunked_prefill_size) == (
        4,
        True,
        "in_seq",
        32,
        64,
    )


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
    reg = _test_registry()
    prefill = {"cp_size": 8, "enable_cp_shared_kv": True, "disaggregation_mode": "prefill"}
    with pytest.raises(ServerArgsError) as e:
        _args(**prefill, transfer_backend="slice").validate(backends=reg)
    msg = str(e.value)
    assert "--transfer-backend slice" in msg and "position-addressed destinations" in msg
    assert "owner filtering" not in msg and "grpc or mooncake" in msg
    assert "--enable-cp-shared-kv" in msg


def test_s2_3_backend_without_owner_filtering_is_refused_even_without_disaggregation():
    reg = _test_registry()
    with pytest.raises(ServerArgsError, match="lacks owner filtering"):
        _args(cp_size=8, enable_cp_shared_kv=True, transfer_backend="broadcast").validate(
            backends=reg
        )


def test_s2_3_capable_backends_and_non_shared_runs_are_accepted():
    reg = _test_registry()
    for name in ("grpc", "mooncake"):
        args = _args(
            cp_size=8,
            enable_cp_shared_kv=True,
            disaggregation_mode="prefill",
            transfer_backend=name,
        )
        assert args.validate(backends=reg) == ()
    # Without shared KV the chunk-slice backend is fine: every rank holds every page.
    args = _args(cp_size=8, disaggregation_mode="prefill", transfer_backend="slice")
    assert args.validate(backends=reg) == ()


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (
            {"disaggregation_mode": "null", "cp_size": 8, "enable_cp_shared_kv": True},
            "--cp-size 8 needs --disaggregation-mode prefill",
        ),
        (
            {"disaggregation_mode": "prefill", "transfer_backend": "nixl"},
            "--transfer-backend 'nixl' is not registered",
        ),
        (
            {"disaggregation_mode": "decode", "transfer_backend": "grpc", "cp_size": 8},
            "decode side is not context-parallel",
        ),
        ({"transfer_backend": "mooncake"}, "--transfer-backend has no effect without"),
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
        _args(**kw).validate()
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
    args = _args(enable_hierarchical_cache=True, hicache_mem_layout="layer_page_first", **kw)
    with pytest.raises(ServerArgsError) as e:
        args.validate()
    assert "--hicache-mem-layout layer_page_first" in str(e.value) and needle in str(e.value)


def test_s4_4_layer_page_first_direct_host_only_is_accepted():
    args = _args(
        cp_size=8,
        enable_cp_shared_kv=True,
        enable_hierarchical_cache=True,
        hicache_mem_layout="layer_page_first",
    )
    # Valid; the only warning says the host cache itself is not built yet.
    assert args.validate() == (HICACHE_NOT_BUILT,)
    # Other layouts may use a storage tier and the kernel I/O backend.
    args = _args(
        enable_hierarchical_cache=True,
        hicache_mem_layout="page_first",
        hicache_io_backend="kernel",
        hicache_storage_backend="file",
    )
    assert args.validate() == (HICACHE_NOT_BUILT,)


def test_hicache_options_need_the_hierarchical_cache():
    with pytest.raises(ServerArgsError, match="--hicache-size has no effect without"):
        _args(hicache_size=2**30).validate()


# ---- SPEC S5: bs > 1 limits ---------------------------------------------------------------


LIMIT_FIELDS = (
    "cp_shared_kv_prefill_max_batch_requests",
    "cp_shared_kv_prefill_max_total_extend_tokens",
    "cp_shared_kv_prefill_max_cached_tokens",
    "cp_shared_kv_prefill_max_buffer_size",
)
BS_GT1 = {"cp_size": 8, "enable_cp_shared_kv": True, "enable_cp_shared_kv_prefill_bs_gt1": True}


@pytest.mark.parametrize("field", LIMIT_FIELDS)
@pytest.mark.parametrize("value", [0, -1])
def test_s5_2_zero_or_negative_limits_are_refused(field, value):
    with pytest.raises(ServerArgsError) as e:
        _args(**BS_GT1, **{field: value}).validate()
    assert f"{flag_name(field)} must be >= 1, got {value}" in str(e.value)
    assert "none" in str(e.value)


@pytest.mark.parametrize("field", LIMIT_FIELDS)
def test_s5_limits_without_the_bs_gt1_flag_are_refused(field):
    with pytest.raises(ServerArgsError) as e:
        _args(cp_size=8, enable_cp_shared_kv=True, **{field: 4}).validate()
    assert f"{flag_name(field)} has no effect without --enable-cp-shared-kv-prefill-bs-gt1" in str(
        e.value
    )


def test_s5_limits_with_bs_gt1_are_accepted_and_bs_gt1_on_ordinary_cp_warns():
    limits = dict.fromkeys(LIMIT_FIELDS, 1)
    args = _args(**BS_GT1, **limits)
    assert args.bs_gt1_active() and args.validate() == ()
    ordinary = _args(cp_size=8, enable_cp_shared_kv_prefill_bs_gt1=True, **limits)
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
    ],
)
def test_range_refusals(kw, needle):
    with pytest.raises(ServerArgsError) as e:
        _args(**kw).validate()
    assert needle in str(e.value)


# ---- cpkv-serve --check-config ----------------------------------------------------------


@pytest.fixture
def serve(model_dir, monkeypatch, capsys):
    """Run `cpkv-serve --model-path <tiny> --check-config ARGS`; returns (rc, out, err)."""
    # The launcher reconfigures root logging; keep pytest's handlers intact.
    monkeypatch.setattr(launch, "configure_logging", lambda level: None)

    def run(*argv: str, backends: TransferBackendRegistry | None = None, check: bool = True):
        full = ["--model-path", str(model_dir), *(["--check-config"] if check else []), *argv]
        rc = launch.main(full, backends=backends)
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (("--enable-cp-shared-kv",), ("--enable-cp-shared-kv", "--cp-size > 1")),
        (
            (*SHARED_KV, "--cp-split-mode", "round_robin"),
            ("--cp-split-mode in_seq", "round_robin"),
        ),
        (
            ("--nsa-index-topk-freq", "4", "--json-model-override-args", '{"index_topk_freq": 2}'),
            ("--nsa-index-topk-freq 4", "'index_topk_freq': 2"),
        ),
        (("--kv-pool-size", "lots"), ("--kv-pool-size", "byte size")),
        (("--cp-shared-kv-prefill-max-batch-requests", "4"), ("bs-gt1",)),
    ],
)
def test_check_config_refusals_exit_2_with_one_line(serve, argv, needles):
    rc, out, err = serve(*argv)
    assert rc == 2 and out == ""
    line = _one_error_line(err)
    for needle in needles:
        assert needle in line


@pytest.mark.parametrize("flag", LIMIT_FLAGS)
@pytest.mark.parametrize("value", ["0", "-3"])
def test_check_config_refuses_zero_or_negative_limits(serve, flag, value):
    rc, _, err = serve(*SHARED_KV, "--enable-cp-shared-kv-prefill-bs-gt1", flag, value)
    assert rc == 2
    line = _one_error_line(err)
    # Byte sizes refuse a sign while parsing (">= 0"), then zero in validation (">= 1").
    assert flag in line and ("must be >= 1" in line or "must be >= 0" in line)


def test_check_config_refuses_backend_without_position_addressed_destinations(serve):
    rc, out, err = serve(
        *SHARED_KV,
        "--disaggregation-mode",
        "prefill",
        "--transfer-backend",
        "slice",
        backends=_test_registry(),
    )
    assert rc == 2 and out == ""
    line = _one_error_line(err)
    assert "--transfer-backend slice" in line and "position-addressed destinations" in line
    # The same backend name is unknown to the default registry.
    rc, _, err = serve(
        *SHARED_KV, "--disaggregation-mode", "prefill", "--transfer-backend", "slice"
    )
    assert rc == 2 and "not registered" in _one_error_line(err)


def test_check_config_prints_merged_overrides(serve):
    rc, out, err = serve(
        *SHARED_KV,
        "--json-model-override-args",
        '{"index_topk": 8}',
        "--nsa-index-topk-freq",
        "2",
        "--nsa-index-skip-topk-offset",
        "0",
        "--enable-cp-shared-kv-prefill-bs-gt1",
        "--cp-shared-kv-prefill-max-buffer-size",
        "1.5GB",
        "--disaggregation-mode",
        "prefill",
        "--transfer-backend",
        "grpc",
    )
    assert rc == 0 and err == ""
    config = json.loads(out)
    assert config["model_overrides"] == {"index_topk": 8, "index_topk_freq": 2}
    assert config["model"]["indexer_pattern"] == "FFSFSF"
    assert config["model"]["full_indexer_layers"] == [0, 1, 3, 5]
    assert config["model"]["index_topk"] == 8
    assert config["cp_shared_kv_prefill_max_buffer_size"] == 1_500_000_000
    assert config["warnings"] == []
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    assert fields <= set(config)
    # The printed args rebuild the same ServerArgs.
    rebuilt = ServerArgs(**{k: config[k] for k in fields})
    assert rebuilt == ServerArgs.from_cli(_to_argv(rebuilt))


def test_check_config_reports_warnings(serve):
    rc, out, _ = serve(
        "--disaggregation-mode", "prefill", "--cp-size", "8", "--enable-cp-shared-kv-prefill-bs-gt1"
    )
    assert rc == 0
    (warning,) = json.loads(out)["warnings"]
    assert "no effect" in warning


def test_check_config_refuses_cp_on_a_unified_server(serve):
    """Refused by --check-config, before any weights load (it used to fail after)."""
    rc, out, err = serve("--cp-size", "8", "--enable-cp-shared-kv", check=True)
    assert rc == 2 and out == ""
    assert "--cp-size 8 needs --disaggregation-mode prefill" in _one_error_line(err)


def test_check_config_missing_model_dir_is_one_line(serve, tmp_path, capsys):
    rc = launch.main(["--model-path", str(tmp_path / "nope"), "--check-config"])
    assert rc == 2
    assert "no config.json" in _one_error_line(capsys.readouterr().err)


def test_serve_without_weights_fails_startup_with_one_error_line(serve):
    """Without --check-config the server starts for real: a config-only model dir fails
    at weight loading with one line naming what is missing (exit 2, nothing served)."""
    rc, out, err = serve(check=False)
    assert rc == 2 and out == ""
    assert "model.safetensors" in _one_error_line(err)


def test_unbuilt_host_cache_is_refused_at_startup_not_ignored(serve):
    """HiCache flags are validated (--check-config warns), but the server does not start
    with them: serving without the cache the user asked for would be silent."""
    rc, out, _ = serve("--enable-hierarchical-cache")
    assert rc == 0 and json.loads(out)["warnings"] == [HICACHE_NOT_BUILT]
    rc, out, err = serve("--enable-hierarchical-cache", check=False)
    assert rc == 2 and out == ""
    line = _one_error_line(err)
    assert "not built yet" in line and "model.safetensors" not in line  # before loading


def test_help_exits_zero(capsys):
    assert launch.main(["--help"]) == 0
    assert "--enable-cp-shared-kv" in capsys.readouterr().out


def test_parser_is_a_plain_argparse_parser_when_added_to_one():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser, backends=_test_registry())
    help_text = " ".join(parser.format_help().split())
    assert "grpc, mooncake, slice, broadcast" in help_text
    ns = parser.parse_args(["--model-path", "m", "--cp-size", "2"])
    assert ServerArgs(**vars(ns)) == ServerArgs(model_path="m", cp_size=2)


def test_library_errors_name_parameters_and_the_server_says_flags():
    """`cpkv_jax` and `transfer` name parameters, not flags (they are also used without
    `cpkv-serve`); `as_flags` turns the names a server user can set into their flags."""
    with pytest.raises(ConfigError) as e:
        CPConfig(cp_size=1, shared_kv=True).validate()
    assert "`shared_kv` needs `cp_size` > 1" in str(e.value) and "--" not in str(e.value)
    assert as_flags(str(e.value)).startswith("--enable-cp-shared-kv needs --cp-size > 1")
    assert as_flags("`page_size` and `staging_bytes`, not `pages_per_rank`") == (
        "--page-size and --transfer-staging-size, not `pages_per_rank`"
    )
    with pytest.raises(ServerArgsError, match="--cp-size must be >= 1, got 0"):
        _args(cp_size=0).validate()
