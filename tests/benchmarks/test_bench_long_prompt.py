"""`benchmarks.bench_long_prompt`'s pieces (a whole run starts a server on a GLM-5-shaped
checkpoint: about a minute even at hidden 64, so it is not part of the suite): the
checkpoint keeps GLM-5's attention and indexer dims, and the stream timing counts every
token of events that bring several."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_long_prompt import glm5_shaped_config, stream_times, summarize
from cpkv_jax.config import ModelConfig
from cpkv_jax.model_configs import config_dir


def test_the_checkpoint_keeps_glm5_attention_and_indexer_dims():
    glm5 = ModelConfig.from_dict(json.loads((config_dir("glm-5") / "config.json").read_text()))
    small = ModelConfig.from_dict(glm5_shaped_config(layers=2, hidden=1024))
    for name in (
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "num_attention_heads",
        "index_head_dim",
        "index_n_heads",
        "index_topk",
    ):
        assert getattr(small, name) == getattr(glm5, name), name
    assert (small.hidden_size, small.num_hidden_layers, small.vocab_size) == (1024, 2, 4096)


def test_stream_times_count_each_token_of_an_event():
    events = [
        'data: {"output_ids": [5]}',
        ": keep-alive",
        'data: {"output_ids": [5, 6, 7]}',
        'data: {"output_ids": [5, 6, 7, 8]}',
        "data: [DONE]",
    ]
    ticks = iter([10.5, 11.0, 11.25])
    times = stream_times(iter(events), t0=10.0, clock=lambda: next(ticks))
    assert times == [0.5, 1.0, 1.0, 1.25]
    row = summarize(2048, 0, times)
    assert row["ttft_s"] == 0.5 and row["tokens"] == 4
    assert row["itl_ms_median"] == 250.0  # diffs 500, 0, 250 ms


def test_a_stream_error_or_no_token_raises():
    with pytest.raises(RuntimeError, match="the stream failed: boom"):
        stream_times(iter(['data: {"error": "boom"}']), t0=0.0)
    with pytest.raises(RuntimeError, match="without a token"):
        stream_times(iter(["data: [DONE]"]), t0=0.0)
