"""benchmarks/decode_memory: XLA's memory analysis of the decode step the engine runs,
at GLM-5's real attention dims with a narrow hidden size and few experts (a smoke run;
the real-dims figures are in `docs/results.md`)."""

from __future__ import annotations

import json

import pytest

from benchmarks import decode_memory as dm

ARGV = ["--layers", "4", "5", "--rows", "8", "--contexts", "256", "2048"]
SHRINK = ["--hidden", "256", "--experts", "16", "--intermediate", "128"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode_memory") / "r.json"
    assert dm.main([*ARGV, *SHRINK, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_report_has_every_run_and_the_growth_per_moe_layer(single):
    r = single
    assert r["bench"] == "decode_memory" and r["model"]["fp8_weights"]
    assert {(x["layers"], x["context"]) for x in r["runs"]} == {
        (n, c) for n in (4, 5) for c in (256, 2048)
    }
    # GLM-5's first three layers are dense: layers 4 and 5 hold one and two MoE layers.
    assert {x["layers"]: x["moe_layers"] for x in r["runs"]} == {4: 1, 5: 2}
    assert all(x["temp_bytes"] > 0 and x["argument_bytes"] > 0 for x in r["runs"])
    for g in r["growth"]:
        run = {(x["layers"], x["context"]): x for x in r["runs"]}
        lo, hi = run[4, g["context"]], run[5, g["context"]]
        assert g["temp_per_moe_layer"] == hi["temp_bytes"] - lo["temp_bytes"]
        assert g["weights_per_moe_layer"] == hi["argument_bytes"] - lo["argument_bytes"] > 0


def test_one_more_moe_layer_adds_far_less_than_its_weights(single):
    """Each layer's FP8 weights are dequantized once that layer's rows exist
    (`fp8.dequantize(after=...)`), so XLA cannot hoist every layer's dequantization to
    the start of the step and keep them all: one more MoE layer adds a small part of its
    stored weights to the temporaries. Without the data edge XLA:CPU added about 4x them
    (a float32 copy of the layer, for every layer; 39.5 GB per GLM-5 MoE layer)."""
    for g in single["growth"]:
        assert g["temp_per_moe_layer"] < 0.25 * g["weights_per_moe_layer"], g
        # XLA's cost model: a layer's weights are read at least once (item 3's bytes moved)
        assert g["accessed_per_moe_layer"] >= g["weights_per_moe_layer"], g
        assert g["accessed_over_weights"] == round(
            g["accessed_per_moe_layer"] / g["weights_per_moe_layer"], 3
        )


def test_a_prefill_chunk_dequantizes_layer_by_layer_too(tmp_path):
    """`--tokens 64`: the one-device step on a 64-token chunk per row (the servers' token
    blocks): one more MoE layer adds little beside its weights there as well."""
    out = tmp_path / "chunk.json"
    argv = ["--layers", "4", "5", "--rows", "2", "--contexts", "512", "--tokens", "64"]
    assert dm.main([*argv, *SHRINK, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tokens"] == 64 and all(x["tokens"] == 64 for x in r["runs"])
    (g,) = r["growth"]
    assert g["temp_per_moe_layer"] < 0.25 * g["weights_per_moe_layer"], g


def test_cp_mode_lowers_the_cp_decode_step(tmp_path, single):
    """`--cp 8`: the CP decode step (owner attention, EP 8) per device of the 8 virtual
    devices; the temp a longer context adds is below one device's."""
    out = tmp_path / "cp.json"
    assert dm.main([*ARGV, *SHRINK, "--cp", "8", "--json", str(out)]) == 0
    cp = json.loads(out.read_text())
    assert cp["cp"] == 8 and single["cp"] == 1
    assert all(x["cp"] == 8 and x["temp_bytes"] > 0 for x in cp["runs"])

    def growth(report):  # temp added by the longer context, 5 layers
        run = {(x["layers"], x["context"]): x["temp_bytes"] for x in report["runs"]}
        return run[5, 2048] - run[5, 256]

    assert 0 < growth(cp) < growth(single)
