"""benchmarks/gpu_moe_gmm: the MoE grouped-matmul GPU check - its routing sizes and the
report of its CPU smoke run (the Mosaic GPU kernel itself runs only on a GPU)."""

from __future__ import annotations

import json

import numpy as np

from benchmarks import gpu_moe_gmm as g


def test_routing_sizes_cover_every_slot_and_force_empty_groups():
    rng = np.random.default_rng(3)
    sizes = g.routing_sizes(rng, tokens=300, experts=16, topk=4)
    assert sizes.dtype == np.int32 and sizes.shape == (16,)
    assert sizes.sum() == 300 * 4
    assert (sizes[-2:] == 0).all() and (sizes[:-2] > 0).all()
    # Distinct experts per token: no expert can hold more rows than there are tokens,
    # except expert 0, which takes the emptied experts' rows.
    assert sizes[1:].max() <= 300


def test_cpu_smoke_report(tmp_path):
    out = tmp_path / "r.json"
    assert g.main(["--allow-cpu", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "moe_grouped_matmul" and r["backend"] == "cpu"
    assert [c["matmul"] for c in r["cases"]] == ["gate_or_up", "down"]
    for c in r["cases"]:
        assert c["rows"] == 64 * 2 and c["empty_groups"] == 2
        assert c["dense_expansion_bytes"] == c["experts"] * c["rows"] * c["k"] * 2
        assert c["xla_ms"] > 0 and "mosaic_ms" not in c  # no Mosaic on CPU
