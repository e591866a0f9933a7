"""`benchmarks.profile_prefill`: the trace is written, read back and split by named scope."""

from __future__ import annotations

import json

from benchmarks import profile_prefill


def test_scope_of_takes_the_innermost_known_scope():
    path = "jit(step)/shard_map/ffn/moe/dot_general"
    assert profile_prefill.scope_of(path) == "moe"
    assert profile_prefill.scope_of("jit(step)/shard_map/materialize/all_gather") == "materialize"
    assert profile_prefill.scope_of("jit(step)/add") == "other"


def test_instruction_scopes_parses_hlo_metadata():
    hlo = (
        '  %fusion.3 = f32[4]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(s)/indexer/mul"}\n'
        '  ROOT %all-gather.2 = f32[8]{0} all-gather(%x), metadata={op_name="jit(s)/kv_write/ag"}\n'
        "  %no_metadata = f32[4]{0} add(%a, %b)\n"
    )
    assert profile_prefill.instruction_scopes(hlo) == {
        "fusion.3": "indexer",
        "all-gather.2": "kv_write",
    }


def test_profile_of_a_cp8_prefill_attributes_time_to_the_model_scopes(tmp_path, capsys):
    rc = profile_prefill.main(
        ["--tokens", "64", "--page-size", "8", "--trace-dir", str(tmp_path), "--json", "--top", "5"]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert list(tmp_path.glob("**/*.xplane.pb")), "no trace written"
    assert result["device_op_seconds"] > 0
    # Every traced step runs materialization, KV writes and the indexer on full layers.
    assert {"materialize", "kv_write", "indexer"} <= set(result["by_scope"])
    assert len(result["top_ops"]) == 5
    assert abs(sum(v["share"] for v in result["by_scope"].values()) - 1.0) < 1e-6
