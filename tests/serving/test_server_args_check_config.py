"""`cpkv-serve --check-config` (and a start without it): refusals exit 2 with one error
line, the printed config (merged model overrides, warnings) rebuilds the same
`ServerArgs`, and a config-only model dir fails at weight loading with one line.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from support.server_args_cases import (
    EP8,
    HICACHE_LPF,
    LIMIT_FLAGS,
    SHARED_KV,
    registry_with_test_backends,
    to_argv,
)

from serving import launch
from serving.server_args import HICACHE_NOT_BUILT, HICACHE_STORAGE_NOT_BUILT, ServerArgs
from transfer.capabilities import TransferBackendRegistry

# ---- cpkv-serve --check-config ----------------------------------------------------------


@pytest.fixture
def serve(tiny_config_dir, monkeypatch, capsys):
    """Run `cpkv-serve --model-path <tiny> --check-config ARGS`; returns (rc, out, err)."""
    # The launcher reconfigures root logging; keep pytest's handlers intact.
    monkeypatch.setattr(launch, "configure_logging", lambda level: None)

    def run(*argv: str, backends: TransferBackendRegistry | None = None, check: bool = True):
        # A real start runs in this process: leave JAX's process-wide compilation cache off.
        mode = ["--check-config"] if check else ["--compilation-cache-dir", "none"]
        full = ["--model-path", str(tiny_config_dir), *mode, *argv]
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
        (("--ep-size", "8"), ("--ep-size 8", "it needs --cp-size 8")),
        ((*SHARED_KV, "--ep-size", "4"), ("--ep-size 4 must be 1 or equal --cp-size (8)",)),
        (
            (*EP8, "--json-model-override-args", '{"n_routed_experts": 12}'),
            ("--ep-size 8", "divisible by --cp-size (8)"),
        ),
        (("--fp8-weights", "fp16"), ("--fp8-weights",)),
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
        backends=registry_with_test_backends(),
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
    assert rebuilt == ServerArgs.from_cli(to_argv(rebuilt))


def test_check_config_reports_warnings(serve):
    rc, out, _ = serve(
        "--disaggregation-mode", "prefill", "--cp-size", "8", "--enable-cp-shared-kv-prefill-bs-gt1"
    )
    assert rc == 0
    (warning,) = json.loads(out)["warnings"]
    assert "no effect" in warning


def test_check_config_accepts_ep_and_warns_about_a_small_capacity_factor(serve):
    rc, out, _ = serve(*EP8, "--ep-dispatch", "all_to_all", "--ep-capacity-factor", "2")
    assert rc == 0
    config = json.loads(out)
    assert (config["ep_size"], config["ep_dispatch"], config["fp8_weights"]) == (
        8,
        "all_to_all",
        "keep",
    )
    (warning,) = config["warnings"]
    assert "--ep-capacity-factor 2 < --ep-size 8" in warning and "not exact" in warning


def test_check_config_refuses_cp_on_a_unified_server_without_shared_kv(serve):
    """Refused by --check-config, before any weights load: a unified CP mesh decodes
    where each page lives, so it needs page-owned KV (issue 40)."""
    rc, out, err = serve("--cp-size", "8", check=True)
    assert rc == 2 and out == ""
    assert "--cp-size 8 needs --enable-cp-shared-kv" in _one_error_line(err)


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
    """HiCache on a decode server, or with a storage tier, is valid (--check-config
    warns) but the server does not start with it: serving without the cache the user
    asked for would be silent."""
    decode = ("--disaggregation-mode", "decode", "--enable-hierarchical-cache")
    rc, out, _ = serve(*decode)
    assert rc == 0 and json.loads(out)["warnings"] == [HICACHE_NOT_BUILT]
    rc, out, err = serve(*decode, check=False)
    assert rc == 2 and out == ""
    line = _one_error_line(err)
    assert "prefill and unified servers only" in line and "model.safetensors" not in line
    prefill = ("--disaggregation-mode", "prefill", "--enable-hierarchical-cache")
    file = (*prefill, "--hicache-storage-backend", "file")
    rc, out, _ = serve(*file)
    assert rc == 0 and json.loads(out)["warnings"] == [HICACHE_STORAGE_NOT_BUILT]
    rc, out, err = serve(*file, "--disable-transfer-malloc-tuning", check=False)
    assert rc == 2 and "storage (L3) tier" in _one_error_line(err)
    # Prefill mode without a storage tier is built: startup goes on to load the weights.
    rc, out, err = serve(*prefill, "--disable-transfer-malloc-tuning", check=False)
    assert rc == 2 and "model.safetensors" in _one_error_line(err)


@pytest.mark.parametrize(
    "argv",
    [
        (*SHARED_KV, *HICACHE_LPF),
        (*SHARED_KV, *HICACHE_LPF, "--hicache-ratio", "4"),
        (*SHARED_KV, "--hicache-mem-layout", "page_first", "--hicache-io-backend", "kernel"),
        ("--disaggregation-mode", "prefill", "--hicache-mem-layout", "page_first_direct"),
        (
            "--disaggregation-mode",
            "prefill",
            "--cp-size",
            "8",
            "--hicache-size",
            "8GiB",
            "--hicache-write-policy",
            "write_back",
        ),
    ],
)
def test_check_config_accepts_the_built_host_cache(serve, argv):
    rc, out, err = serve("--enable-hierarchical-cache", *argv)
    assert rc == 0 and err == ""
    config = json.loads(out)
    assert config["warnings"] == [] and config["enable_hierarchical_cache"] is True
    assert config["hicache_write_policy"] in ("write_through_selective", "write_back")


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (
            ("--hicache-storage-backend", "file"),
            ("--hicache-mem-layout layer_page_first", "--hicache-storage-backend none"),
        ),
        (
            ("--hicache-io-backend", "kernel"),
            ("--hicache-mem-layout layer_page_first", "--hicache-io-backend direct"),
        ),
        (("--hicache-ratio", "0"), ("--hicache-ratio must be a finite number > 0",)),
        (("--hicache-write-policy", "write_around"), ("--hicache-write-policy",)),
    ],
)
def test_check_config_refuses_unsupported_host_cache_options(serve, argv, needles):
    rc, out, err = serve(*SHARED_KV, *HICACHE_LPF, *argv)
    assert rc == 2 and out == ""
    line = _one_error_line(err)
    for needle in needles:
        assert needle in line
    # An option of the host cache without it names the enabling flag.
    rc, _, err = serve(*SHARED_KV, "--hicache-ratio", "3")
    assert rc == 2 and "without --enable-hierarchical-cache" in _one_error_line(err)
