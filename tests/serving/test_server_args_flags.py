"""ServerArgs flags: generated from the dataclass (every field a flag with help and a
group, the brief's flag names, round trips through the command line), byte sizes, parse
errors naming the flag, `--help`, the parser added to a plain argparse parser, and
library errors naming parameters that `as_flags` turns into flags.

Validation (SPEC S1.6, S2.3, S4.4, S5, S11) is in test_server_args_validation.py,
`cpkv-serve --check-config` in test_server_args_check_config.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest
from support.server_args_cases import (
    LIMIT_FLAGS,
    make_args,
    registry_with_test_backends,
    to_argv,
)

from cpkv_jax.config import CPConfig
from cpkv_jax.errors import ConfigError
from cpkv_jax.model.expert_parallel import EP_DISPATCHES
from cpkv_jax.model.weights import FP8_MODES
from serving import launch
from serving.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, ChatParserConfig
from serving.server_args import (
    GROUPS,
    ServerArgs,
    ServerArgsError,
    as_flags,
    flag_name,
    format_byte_size,
    parse_byte_size,
)

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
        "--hicache-storage-backend", "--hicache-size", "--hicache-ratio",
        "--hicache-write-policy", "--disaggregation-mode",
        "--transfer-backend", "--transfer-bootstrap-timeout", "--transfer-waiting-timeout",
        "--transfer-heartbeat-interval", "--nsa-index-topk-freq",
        "--nsa-index-skip-topk-offset", "--nsa-index-topk-pattern",
        "--json-model-override-args", "--kernel-impl", "--host", "--port", "--log-level",
        "--request-timeout", "--check-config", "--fp8-weights", "--ep-size", "--ep-dispatch",
        "--ep-capacity-factor", "--mem-fraction-static", "--device-memory-bytes",
        "--api-key", "--admin-api-key", "--tool-call-parser", "--reasoning-parser",
    ):  # fmt: skip
        assert flag in flags


def test_defaults_round_trip(monkeypatch):
    monkeypatch.delenv("CPKV_WARMUP")  # tests/conftest.py sets it for the suite's servers
    assert ServerArgs.from_cli(["--model-path", "m"]) == ServerArgs(model_path="m")
    assert ServerArgs.from_cli(to_argv(ServerArgs(model_path="m"))) == ServerArgs(model_path="m")
    hints = typing.get_type_hints(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        if f.default is dataclasses.MISSING:
            continue
        # A Literal default must be one of the flag's choices.
        if typing.get_origin(hints[f.name]) is typing.Literal:
            assert f.default in typing.get_args(hints[f.name]), f.name


def test_warmup_defaults_to_all_shapes_on_accelerators(monkeypatch):
    """Issue 35 item 7: no compile on the request path by default: `--warmup auto`
    compiles every reachable shape on GPU and TPU, the common ones on CPU (XLA:CPU's
    per-program memory maps); `all` / `common` (or `$CPKV_WARMUP`) choose. The flag wins
    over the variable, and a bad variable is refused naming both."""
    monkeypatch.delenv("CPKV_WARMUP")
    args = ServerArgs.from_cli(["--model-path", "m"])
    assert args.warmup == "auto"
    assert [args.warms_all_shapes(b) for b in ("gpu", "tpu", "cpu")] == [True, True, False]
    common = ServerArgs.from_cli(["--model-path", "m", "--warmup", "common"])
    assert not common.warms_all_shapes("gpu")
    assert ServerArgs.from_cli(["--model-path", "m", "--warmup", "all"]).warms_all_shapes("cpu")
    monkeypatch.setenv("CPKV_WARMUP", "common")
    assert ServerArgs.from_cli(["--model-path", "m"]).warmup == "common"
    assert ServerArgs.from_cli(["--model-path", "m", "--warmup", "all"]).warmup == "all"
    assert ServerArgs.from_cli(["--model-path", "m", "--warmup=auto"]).warmup == "auto"
    monkeypatch.setenv("CPKV_WARMUP", "some")
    with pytest.raises(ServerArgsError, match=r"\$CPKV_WARMUP='some' is not a choice of --warmup"):
        ServerArgs.from_cli(["--model-path", "m"])


def test_non_default_values_round_trip_through_the_command_line():
    args = ServerArgs(
        model_path="/models/glm-5",
        dtype="float32",
        index_k_dtype="bfloat16",
        json_model_override_args='{"index_topk": 7}',
        nsa_index_topk_freq=4,
        nsa_index_skip_topk_offset=3,
        nsa_index_topk_pattern="FFS",
        fp8_weights="dequantize",
        cp_size=8,
        enable_cp_shared_kv=True,
        page_size=32,
        ep_size=8,
        ep_dispatch="all_to_all",
        ep_capacity_factor=2.5,
        mem_fraction_static=0.8,
        device_memory_bytes=80 * 2**30,
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
        hicache_ratio=3.5,
        hicache_write_policy="write_back",
        disaggregation_mode="prefill",
        transfer_backend="mooncake",
        transfer_bootstrap_timeout=12.5,
        disable_transfer_malloc_tuning=True,
        tool_call_parser="glm47",
        reasoning_parser="glm45",
        kernel_impl="pallas",
        port=8000,
        log_level="debug",
        request_timeout=30.0,
        check_config=True,
        api_key="k-1",
        admin_api_key="k-2",
    )
    assert ServerArgs.from_cli(to_argv(args)) == args


def test_optional_ints_accept_none_and_byte_sizes_accept_units():
    args = ServerArgs.from_cli(
        ["--model-path", "m", "--chunked-prefill-size", "None", "--kv-pool-size", "512MiB"]
    )
    assert args.chunked_prefill_size is None
    assert args.kv_pool_size == 512 * 2**20
    assert ServerArgs.from_cli(["--model-path", "m"]).transient_block_size == 2**30
    short = ServerArgs.from_cli(["--model-path", "m", "--transient-block-size", "64MiB"])
    assert short.transient_block_size == 64 * 2**20


def test_fp8_ep_and_memory_flag_defaults_and_choices():
    args = ServerArgs.from_cli(["--model-path", "m"])
    assert (args.fp8_weights, args.ep_size, args.ep_dispatch) == ("keep", 1, "allgather")
    assert args.ep_capacity_factor is None and args.device_memory_bytes is None
    assert args.mem_fraction_static == 0.88
    hints = typing.get_type_hints(ServerArgs)
    assert typing.get_args(hints["fp8_weights"]) == FP8_MODES  # the loader's modes
    assert typing.get_args(hints["ep_dispatch"]) == EP_DISPATCHES
    args = ServerArgs.from_cli(
        ["--model-path", "m", "--device-memory-bytes", "80GiB", "--ep-capacity-factor", "none"]
    )
    assert args.device_memory_bytes == 80 * 2**30 and args.ep_capacity_factor is None
    with pytest.raises(ServerArgsError, match="--fp8-weights"):
        ServerArgs.from_cli(["--model-path", "m", "--fp8-weights", "bf16"])
    with pytest.raises(ServerArgsError, match="--ep-dispatch"):
        ServerArgs.from_cli(["--model-path", "m", "--ep-dispatch", "ragged"])


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


# ---- help, argparse, and flag names in errors ------------------------------------------


def test_help_exits_zero(capsys):
    assert launch.main(["--help"]) == 0
    assert "--enable-cp-shared-kv" in capsys.readouterr().out


def test_parser_is_a_plain_argparse_parser_when_added_to_one():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser, backends=registry_with_test_backends())
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
        make_args(cp_size=0).validate()


def test_parser_flags_name_the_parsers_and_build_their_config():
    hints = typing.get_type_hints(ServerArgs)
    assert set(typing.get_args(hints["tool_call_parser"])) == {"none", *TOOL_CALL_PARSERS}
    assert set(typing.get_args(hints["reasoning_parser"])) == {"none", *REASONING_PARSERS}
    args = ServerArgs.from_cli(
        [
            "--model-path",
            "m",
            "--tool-call-parser",
            "deepseekv32",
            "--reasoning-parser",
            "deepseek-v3",
        ]
    )
    assert args.chat_parsers() == ChatParserConfig(reasoning="deepseek-v3", tool_call="deepseekv32")
    assert ServerArgs(model_path="m").chat_parsers() == ChatParserConfig()
    with pytest.raises(ServerArgsError, match="tool-call-parser"):
        ServerArgs.from_cli(["--model-path", "m", "--tool-call-parser", "hermes"])
