"""benchmarks/bench_host_copy: the report's shape, that every timed copy round-trips bit
for bit (and that the bench's own check catches a copy that does not), and the `--gpu`
mode's refusal without a GPU."""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np
import pytest

from benchmarks import bench_host_copy

PAGES, PAGE, FEATURE, INDEX_FEATURE = 3, 8, 64, 16  # 3 pages: the kernels pad to 4
COPIES = {
    "layer_first",
    "page_first",
    "page_first_direct",
    "layer_page_first_pallas_interpret",
    "layer_page_first_xla_reference",
}
BASELINES = {"backup": {"memcpy", "device_get"}, "load": {"memcpy", "device_put"}}
TIMING = {"ms", "ms_min", "ms_max", "gb_s", "ratio_vs_memcpy"}


def _argv(*extra: str) -> list[str]:
    argv = ["--pages", str(PAGES), "--page-size", str(PAGE), "--feature", str(FEATURE)]
    argv += ["--layers", "2", "--index", "--index-feature", str(INDEX_FEATURE)]
    return [*argv, "--repeats", "2", "--warmup", "1", *extra]


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("host_copy") / "r.json"
    assert bench_host_copy.main(_argv("--json", str(out))) == 0
    return json.loads(out.read_text())


def test_report_shape(tiny_report):
    r = tiny_report
    assert (r["mode"], r["layers"], r["feature"], r["index_feature"]) == ("cpu", 2, FEATURE, 16)
    assert (r["repeats"], r["warmup"], r["backend"]) == (2, 1, "cpu")
    [case] = r["cases"]
    tokens = PAGES * PAGE
    assert case["bytes_by_kind"] == {
        "latent": tokens * FEATURE * 2,  # bf16
        "index_k": tokens * INDEX_FEATURE,  # fp8
        "index_scale": tokens * 4,  # fp32
    }
    assert case["bytes"] == sum(case["bytes_by_kind"].values())
    for direction in ("backup", "load"):
        rows = case[direction]
        assert set(rows) == COPIES | BASELINES[direction]
        for name, row in rows.items():
            assert set(row) >= TIMING and row["ms"] > 0 and row["gb_s"] > 0, (direction, name)
            assert row["ms_min"] <= row["ms"] <= row["ms_max"]
        assert rows["memcpy"]["ratio_vs_memcpy"] == 1.0
        for name in COPIES:
            assert rows[name]["ratio_vs_memcpy"] == pytest.approx(
                rows[name]["gb_s"] / rows["memcpy"]["gb_s"]
            )
        lpf = rows["layer_page_first_pallas_interpret"]
        assert (lpf["layout"], lpf["impl"], lpf["interpret"]) == (
            "layer_page_first",
            "pallas",
            True,
        )
        ref = rows["layer_page_first_xla_reference"]
        assert (ref["layout"], ref["impl"], ref["interpret"]) == ("layer_page_first", "xla", False)
    assert isinstance(case["backup"]["device_get"]["zero_copy"], bool)
    diagnostics = case["diagnostics"]
    assert set(diagnostics["backup"]) == {"xla_gather_device_only"}
    assert set(diagnostics["load"]) == {
        "xla_scatter_device_only",
        "xla_scatter_device_only_1_page",
    }
    for rows in diagnostics.values():
        assert all(set(row) == TIMING and row["ms"] > 0 for row in rows.values())


def test_every_copy_round_trips_bitwise(tiny_report):
    assert tiny_report["bitwise_round_trip_all"] is True
    [case] = tiny_report["cases"]
    for direction in ("backup", "load"):
        for name in COPIES:
            assert case[direction][name]["bitwise_round_trip"] is True, (direction, name)


def test_the_bench_check_catches_a_bad_copy():
    ns = argparse.Namespace(
        page_size=PAGE, feature=FEATURE, layers=2, index=True, index_feature=INDEX_FEATURE
    )
    case = bench_host_copy.Case(ns, PAGES, jax.devices("cpu")[0], interpret=True, seed=3)
    good = case.backup_library("layer_first")
    assert case.check_backup("layer_first", good)
    host = case.hosts["layer_first"]

    def wrong_pages():  # right bytes, host pages in the wrong order
        good()
        rows = host.read_pages("latent", 0, case.host_pages)
        host.write_pages("latent", 0, case.host_pages, rows[::-1].copy())

    def stray_write():  # right pages, plus a write outside them
        good()
        spare = np.setdiff1d(np.arange(1, host.num_pages), case.host_pages)[:1]
        host.write_pages("index_scale", 0, spare, np.ones((1, PAGE), np.float32))

    assert not case.check_backup("layer_first", wrong_pages)
    assert not case.check_backup("layer_first", stray_write)
    assert case.check_backup("layer_first", good)
    assert case.check_load(case.load_library("layer_first"))
    assert not case.check_load(lambda: None)  # targets zeroed, nothing loaded


def test_gpu_mode_refuses_on_cpu(capsys):
    assert bench_host_copy.main(["--gpu", "--pages", "2"]) == 2
    err = capsys.readouterr().err
    assert "--gpu needs a GPU" in err and "no GPU found" in err
