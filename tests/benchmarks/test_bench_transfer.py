"""bench_transfer runs end to end (tiny: 4096 tokens, 2 layers, 1 repeat) and reports
the issue's keys. The benchmark figures themselves are not checked here (docs/results.md)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_transfer import main
from transfer.backends.mooncake_engine import mooncake_available

AVAILABLE, REASON = mooncake_available()
KEYS = ("tokens", "bytes", "grpc_gbps", "mooncake_gbps", "raw_mooncake_gbps")


@pytest.fixture(scope="module")
def report() -> dict:
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        # glibc's defaults: tune_malloc would change this pytest process for good.
        argv = ["--json", "--tokens", "4096", "--layers", "2", "--repeats", "1", "--warmup", "2"]
        assert main([*argv, "--no-malloc-tuning"]) == 0
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 1, "the benchmark prints exactly one JSON object"
    return json.loads(lines[0])


def test_bench_transfer_reports_the_plan_and_grpc(report):
    for key in (*KEYS, "grpc_ratio", "mooncake_ratio"):
        assert key in report
    assert report["tokens"] == 4096 and report["layers"] == 2 and report["cp"] == 8
    # 64 pages of (2 latent + 2 index_k + 2 scale) buffers: 2 * (1152 + 132) B per token.
    assert report["bytes"] == 4096 * 2 * (1152 + 132)
    assert report["grpc_gbps"] > 0 and len(report["grpc_seconds"]) == 1
    assert report["warmup"] == 2 and len(report["grpc_warmup_seconds"]) == 2
    assert report["malloc_tuning"] == "glibc defaults"
    # The host pools are sealed once built: the senders send those digests.
    assert report["grpc_sender_digests"] == "sealed" and report["seal_ms"] > 0


def test_bench_transfer_reports_mooncake_and_raw(report):
    if not AVAILABLE:
        assert report["mooncake_unavailable"] == REASON
        pytest.skip(f"Mooncake Transfer Engine unavailable: {REASON}")
    for key in (
        "mooncake_gbps",
        "raw_mooncake_gbps",
        "raw_sync_call_gbps",
        "grpc_ratio",
        "mooncake_ratio",
        "mooncake_at_send_gbps",
        "mooncake_at_send_ratio",
    ):
        assert report[key] > 0, key
    for name in ("mooncake", "mooncake_at_send"):
        assert report[f"{name}_ratio"] == pytest.approx(
            report[f"{name}_gbps"] / report["raw_mooncake_gbps"]
        )
    assert report["mooncake_sender_digests"] == "sealed"
    assert report["mooncake_at_send_sender_digests"] == "at send"
    # One raw write each way after every timed run of each backend; each backend's
    # paired ratio pairs its run with the raw write right after it (default order:
    # mooncake, grpc, mooncake-at-send).
    assert len(report["raw_seconds"]) == len(report["raw_sync_call_seconds"]) == 3
    assert report["backend_order"] == ["mooncake", "grpc", "mooncake-at-send"]
    for i, name in enumerate(report["backend_order"]):
        key = name.replace("-", "_")
        assert report[f"{key}_paired_ratio"] == pytest.approx(
            report["raw_seconds"][i] / report[f"{key}_seconds"][0]
        )
    # Contiguous local pages + owner-major staging: one descriptor per buffer per rank.
    assert set(report["mooncake_descriptors_per_rank"].values()) == {6}


def test_bench_transfer_fragmented_host_pools_over_grpc():
    """Scattered local pages: the gRPC sender gathers each chunk's rows from the host
    pool leaves itself (no contiguous slices); the benchmark's warm-up run checks every
    staged page's digest against its source page and raises if one differs."""
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    args = ["--json", "--tokens", "2048", "--layers", "2", "--repeats", "1", "--fragment"]
    args += ["--warmup", "1"]
    args.append("--no-malloc-tuning")  # as in `report`
    with redirect_stdout(out):
        assert main([*args, "--backends", "grpc", "--in-process-receiver"]) == 0
    report = json.loads(out.getvalue().strip().splitlines()[-1])
    assert report["fragmented_sources"] is True and report["grpc_gbps"] > 0
    assert report["mooncake_gbps"] is None  # not asked for


def test_bench_transfer_refuses_unknown_or_repeated_backends(capsys):
    for bad in ("grpc,rdma", "grpc,grpc", ","):
        with pytest.raises(SystemExit) as e:
            main(["--backends", bad, "--no-malloc-tuning"])
        assert e.value.code == 2
        assert "--backends" in capsys.readouterr().err
