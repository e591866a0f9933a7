"""benchmarks/decode_memory: XLA's memory analysis of the decode step the engine runs,
at GLM-5's real attention dims with a narrow hidden size and few experts (a smoke run;
the real-dims figures are in `docs/results.md`)."""

from __future__ import annotations

import json

from benchmarks import decode_memory as dm


def test_report_has_every_run_and_the_growth_per_moe_layer(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--layers", "4", "5", "--rows", "2", "--contexts", "256", "512"]
    shrink = ["--hidden", "256", "--experts", "16", "--intermediate", "128"]
    assert dm.main([*argv, *shrink, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "decode_memory" and r["model"]["fp8_weights"]
    assert {(x["layers"], x["context"]) for x in r["runs"]} == {
        (n, c) for n in (4, 5) for c in (256, 512)
    }
    # GLM-5's first three layers are dense: layers 4 and 5 hold one and two MoE layers.
    assert {x["layers"]: x["moe_layers"] for x in r["runs"]} == {4: 1, 5: 2}
    assert all(x["temp_bytes"] > 0 and x["argument_bytes"] > 0 for x in r["runs"])
    for g in r["growth"]:
        run = {(x["layers"], x["context"]): x for x in r["runs"]}
        lo, hi = run[4, g["context"]], run[5, g["context"]]
        assert g["temp_per_moe_layer"] == hi["temp_bytes"] - lo["temp_bytes"]
        assert g["weights_per_moe_layer"] == hi["argument_bytes"] - lo["argument_bytes"] > 0
