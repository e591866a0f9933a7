"""`serving.engine.mock.MockEngine`: the closed-form rules the HTTP and router tests rely on,
in each server mode, and a prefill / decode pair sharing `MockRooms`, driven directly (no
loop, no HTTP)."""

from __future__ import annotations

import pytest

from cpkv_jax.errors import InputError
from serving.engine.api import GenerateRequest, SamplingParams, StepEngine
from serving.engine.mock import (
    MOCK_FAIL_ID,
    MOCK_REFUSE_ID,
    MockEngine,
    MockRooms,
    RoomKV,
    echo_ids,
    mock_logprob,
)
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


# ---- a prefill / decode pair sharing MockRooms ---------------------------------------------

TARGET = "10.0.0.1:17000"


def pd_pair(rooms: MockRooms, cp: int = 4) -> tuple[MockEngine, MockEngine]:
    prefill = MockEngine(mode="prefill", step_delay=0, rooms=rooms, cp_size=cp)
    decode = MockEngine(mode="decode", step_delay=0, rooms=rooms, transfer_target=TARGET)
    return prefill, decode


def pd_req(rid: str, prompt: tuple[int, ...], *, side: str, cp: int = 4, target: str = TARGET):
    pd = {"decode_transfer_target": target} if side == "prefill" else {"bootstrap_cp_size": cp}
    return GenerateRequest(
        rid, prompt, SamplingParams(max_new_tokens=4), return_logprob=True, bootstrap_room="r", **pd
    )


def steps(engine: MockEngine, n: int) -> list:
    return [c for _ in range(n) for c in engine.step()]


def test_decode_waits_for_the_prefill_of_its_room_then_echoes():
    """A decode request gets nothing until the prefill for its room and target answered;
    its token 0 (and log-prob) is the one the prefill published."""
    rooms = MockRooms()
    prefill, decode = pd_pair(rooms)
    decode.add(pd_req("d", (5, 6, 7), side="decode"))
    assert steps(decode, 20) == [] and decode.has_work()  # held: no KV yet
    assert rooms.targets("r") == []
    p_chunks = run(prefill, pd_req("p", (5, 6, 7), side="prefill"))
    assert [c.token_ids for c in p_chunks] == [(5,)] and p_chunks[-1].finish_reason == "length"
    assert rooms.get(TARGET, "r") == RoomKV(5, mock_logprob(5, 0), 4, "p")
    chunks = []
    while decode.has_work():
        chunks.extend(decode.step())
    assert [t for c in chunks for t in c.token_ids] == echo_ids((5, 6, 7), 4)
    assert [lp for c in chunks for lp in c.logprobs] == [
        mock_logprob(t, i) for i, t in enumerate(echo_ids((5, 6, 7), 4))
    ]
    assert chunks[-1].finish_reason == "length"

    # Token 0 comes from the room: another prompt's prefill shows in the output.
    rooms2 = MockRooms()
    prefill2, decode2 = pd_pair(rooms2)
    run(prefill2, pd_req("p", (9, 6, 7), side="prefill"))
    out = [t for c in run(decode2, pd_req("d", (5, 6, 7), side="decode")) for t in c.token_ids]
    assert out == [9, 6, 7, 5]


def test_a_room_for_another_target_or_cp_size_never_feeds_the_decode():
    rooms = MockRooms(wait_s=0.05)
    prefill, decode = pd_pair(rooms)
    run(prefill, pd_req("p", (5, 6), side="prefill", target="10.9.9.9:1"))
    assert rooms.targets("r") == ["10.9.9.9:1"]
    chunks = run(decode, pd_req("d", (5, 6), side="decode"))  # waits out wait_s
    assert (
        chunks[-1].finish_reason == "error" and "timed out waiting for the KV" in chunks[-1].error
    )
    assert [c.token_ids for c in chunks] == [()]

    rooms = MockRooms()
    prefill, decode = pd_pair(rooms, cp=8)
    run(prefill, pd_req("p", (5, 6), side="prefill"))
    chunks = run(decode, pd_req("d", (5, 6), side="decode", cp=4))
    assert chunks[-1].finish_reason == "error" and "bootstrap_cp_size 4" in chunks[-1].error


def test_room_switches_fail_delay_and_abort():
    rooms = MockRooms()
    prefill, decode = pd_pair(rooms)
    rooms.fail(TARGET, "r", "lost the KV")
    chunks = run(decode, pd_req("d", (5, 6), side="decode"))
    assert chunks[-1].finish_reason == "error" and "lost the KV" in chunks[-1].error

    rooms = MockRooms()
    prefill, decode = pd_pair(rooms)
    rooms.prefill_fail = True
    chunks = run(prefill, pd_req("p", (5, 6), side="prefill"))
    assert chunks[-1].finish_reason == "error" and "CP prefill step failed" in chunks[-1].error
    assert rooms.targets("r") == []  # nothing published: the decode keeps waiting
    rooms.prefill_fail_after_kv_s = 0.05
    prefill.add(pd_req("p2", (5, 6), side="prefill"))
    assert steps(prefill, 1) == [] and rooms.targets("r") == [TARGET]  # published, no answer
    chunks = []
    while prefill.has_work():
        chunks.extend(prefill.step())
    assert chunks[-1].finish_reason == "error"

    rooms = MockRooms()
    prefill, decode = pd_pair(rooms)
    rooms.prefill_delay = 0.05
    prefill.add(pd_req("p", (5, 6), side="prefill"))
    assert steps(prefill, 3) == [] and rooms.targets("r") == []  # held for prefill_delay
    rooms.reset()
    assert [c.token_ids for c in steps(prefill, 1)] == [(5,)] and rooms.targets("r") == [TARGET]

    # A decode request held for its KV is aborted like any other.
    rooms = MockRooms()
    prefill, decode = pd_pair(rooms)
    decode.add(pd_req("d", (5, 6), side="decode"))
    assert steps(decode, 2) == []
    decode.abort("d")
    assert [c.finish_reason for c in decode.step()] == ["abort"] and decode.aborted == {"d"}


def test_rooms_need_a_pd_mode_and_a_decode_target():
    with pytest.raises(ValueError, match="not mode 'null'"):
        MockEngine(rooms=MockRooms())
    with pytest.raises(ValueError, match="transfer_target"):
        MockEngine(mode="decode", rooms=MockRooms())
