"""`serving.engine.mock.MockEngine`: the closed-form rules the HTTP and router tests rely on,
in each server mode, driven directly (no loop, no HTTP)."""

from __future__ import annotations

import pytest

from cpkv_jax.errors import InputError
from serving.engine.api import GenerateRequest, SamplingParams, StepEngine
from serving.engine.mock import MOCK_FAIL_ID, MOCK_REFUSE_ID, MockEngine, echo_ids, mock_logprob
from serving.engine.wait_queue import QueueFullError


def run(engine: MockEngine, req: GenerateRequest) -> list:
    engine.add(req)
    chunks = []
    while engine.has_work():
        chunks.extend(engine.step())
    return chunks


def test_null_mode_echoes_with_logprobs_and_meta():
    engine = MockEngine(step_delay=0)
    assert isinstance(engine, StepEngine)
    prompt = (5, 6, 7)
    req = GenerateRequest("a", prompt, SamplingParams(max_new_tokens=5), return_logprob=True)
    chunks = run(engine, req)
    assert [t for c in chunks for t in c.token_ids] == echo_ids(prompt, 5) == [5, 6, 7, 5, 6]
    assert [lp for c in chunks for lp in c.logprobs] == [
        mock_logprob(t, i) for i, t in enumerate(echo_ids(prompt, 5))
    ]
    assert chunks[-1].finish_reason == "length" and chunks[-1].meta["cached_tokens"] == 1
    assert engine.finished == {"a": 5} and engine.requests["a"] is req


def test_stop_eos_refusal_failure_abort_and_full_queue():
    engine = MockEngine(step_delay=0)
    stop = run(engine, GenerateRequest("s", (9, 8), SamplingParams(stop_token_ids=(8,))))
    assert [c.token_ids for c in stop] == [(9,), (8,)] and stop[-1].finish_reason == "stop"
    assert run(engine, GenerateRequest("e", (4, 1)))[-1].finish_reason == "stop"  # EOS
    with pytest.raises(InputError, match="pad token"):
        engine.add(GenerateRequest("p", (4, MOCK_REFUSE_ID)))
    failed = run(engine, GenerateRequest("f", (MOCK_FAIL_ID, 4)))
    assert failed[-1].finish_reason == "error" and failed[-1].error
    engine.add(GenerateRequest("x", (4,), SamplingParams(max_new_tokens=100)))
    engine.step()
    engine.abort("x")
    assert engine.step()[-1].finish_reason == "abort" and engine.aborted == {"x"}
    engine.queue_full = True
    with pytest.raises(QueueFullError) as e:
        engine.add(GenerateRequest("q", (4,)))
    assert e.value.retry_after_s == 7


def test_pd_modes_need_their_fields():
    prefill = MockEngine(mode="prefill", step_delay=0)
    with pytest.raises(InputError, match="bootstrap_room and decode_transfer_target"):
        prefill.add(GenerateRequest("a", (5, 6)))
    req = GenerateRequest(
        "b",
        (5, 6),
        SamplingParams(max_new_tokens=8),
        bootstrap_room="r1",
        decode_transfer_target="127.0.0.1:9",
        bootstrap_cp_size=2,
    )
    chunks = run(prefill, req)
    assert [c.token_ids for c in chunks] == [(5,)] and chunks[-1].finish_reason == "length"
    assert prefill.requests["b"].bootstrap_room == "r1" and prefill.stats().mode == "prefill"

    decode = MockEngine(mode="decode", step_delay=0)
    with pytest.raises(InputError, match="bootstrap_cp_size"):
        decode.add(GenerateRequest("c", (5, 6), bootstrap_room="r2"))
    chunks = run(decode, GenerateRequest("d", (5, 6), bootstrap_room="r2", bootstrap_cp_size=2))
    assert [t for c in chunks for t in c.token_ids] == echo_ids((5, 6), 16)
