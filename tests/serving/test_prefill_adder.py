"""PrefillAdder: generic budgets and one test per CP shared-KV rule (SPEC S5-S9)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.prefill.adder import (
    AddResult,
    Admitted,
    Candidate,
    CPSharedKVLimits,
    PrefillAdder,
)

PAGE = 64
BIG = 10**9


def cand(rid: str, extend: int, cached: int = 0, reserve: int = 0) -> Candidate:
    return Candidate(rid, extend, cached, reserve)


def adder(cp: CPSharedKVLimits | None = None, **kw) -> PrefillAdder:
    args = dict(
        page_size=PAGE, rem_total_tokens=BIG, max_prefill_tokens=BIG, chunked_prefill_size=None
    )
    args.update(kw)
    return PrefillAdder(cp=cp or CPSharedKVLimits(), **args)


def admit_all(a: PrefillAdder, cands: Sequence[Candidate]) -> list[AddResult]:
    return [a.add(c) for c in cands]


SHARED_BS_GT1 = CPSharedKVLimits(shared_kv=True, bs_gt1=True)


class BytesPerToken:
    """Test estimator: a linear byte model, so gate decisions are easy to predict."""

    def __init__(self, per_token: int):
        self.per_token = per_token
        self.calls = 0

    def estimate_bytes(self, batch: Sequence[Admitted]) -> int:
        self.calls += 1
        return self.per_token * sum(a.extend_tokens + a.candidate.cached_tokens for a in batch)


# ---- generic budgets ----------------------------------------------------------------------
def test_total_token_budget_includes_reservations():
    a = adder(rem_total_tokens=1000)
    assert a.add(cand("a", 600, reserve=300)) is AddResult.CONTINUE
    assert a.add(cand("b", 50, reserve=60)) is AddResult.NO_TOKEN
    assert a.rem_total_tokens == 100


def test_first_request_may_exceed_input_budget_others_may_not():
    a = adder(max_prefill_tokens=100)
    assert a.add(cand("a", 500)) is AddResult.CONTINUE
    assert a.add(cand("b", 10)) is AddResult.INPUT_BUDGET


def test_request_over_chunk_budget_is_truncated_to_whole_pages_and_ends_batch():
    a = adder(chunked_prefill_size=300)
    assert a.add(cand("a", 100)) is AddResult.CONTINUE
    assert a.add(cand("b", 1000)) is AddResult.CONTINUE
    assert a.batch[1].extend_tokens == 192  # floor(200 / 64) pages
    assert a.new_chunked is a.batch[1] and a.batch[1].chunked
    assert a.add(cand("c", 1)) is AddResult.CHUNK_BUDGET


def test_in_flight_chunked_request_goes_first():
    a = adder(chunked_prefill_size=128, rem_total_tokens=10)
    first = a.add_chunked(cand("inflight", 1000))
    assert isinstance(first, Admitted) and first.extend_tokens == 128
    with pytest.raises(ValueError, match="must be added first"):
        a.add_chunked(cand("x", 5))


# ---- S5 -----------------------------------------------------------------------------------
def test_s5_1_cp_shared_kv_batch_holds_one_request_by_default():
    a = adder(CPSharedKVLimits(shared_kv=True))
    assert admit_all(a, [cand("a", 10), cand("b", 10)]) == [
        AddResult.CONTINUE,
        AddResult.CP_BS1,
    ]


def test_s5_1_bs_gt1_flag_has_no_effect_on_ordinary_cp():
    for bs_gt1 in (False, True):
        a = adder(CPSharedKVLimits(shared_kv=False, bs_gt1=bs_gt1, max_batch_requests=1))
        assert admit_all(a, [cand(str(i), 10) for i in range(4)]) == [AddResult.CONTINUE] * 4


def test_s5_2_limits_default_to_unlimited():
    a = adder(SHARED_BS_GT1)
    assert (
        admit_all(a, [cand(str(i), 1000, cached=5000) for i in range(50)])
        == [AddResult.CONTINUE] * 50
    )


def test_s5_2_max_batch_requests():
    a = adder(CPSharedKVLimits(shared_kv=True, bs_gt1=True, max_batch_requests=3))
    results = admit_all(a, [cand(str(i), 10) for i in range(5)])
    assert results[:3] == [AddResult.CONTINUE] * 3
    assert results[3] is AddResult.CP_MAX_REQUESTS


def test_s5_2_max_total_extend_tokens_is_counted_page_aligned():
    # 2 x 65 tokens = 130 raw, but 4 pages = 256 page-aligned > 200.
    a = adder(CPSharedKVLimits(shared_kv=True, bs_gt1=True, max_total_extend_tokens=200))
    assert admit_all(a, [cand("a", 65), cand("b", 65)]) == [
        AddResult.CONTINUE,
        AddResult.CP_MAX_EXTEND,
    ]


@pytest.mark.parametrize(
    "limits",
    [
        CPSharedKVLimits(shared_kv=True),
        CPSharedKVLimits(shared_kv=True, bs_gt1=True, max_batch_requests=1),
        CPSharedKVLimits(shared_kv=True, bs_gt1=True, max_total_extend_tokens=64),
        CPSharedKVLimits(shared_kv=True, bs_gt1=True, max_cached_tokens=10),
        CPSharedKVLimits(shared_kv=True, bs_gt1=True, max_buffer_bytes=100),
    ],
)
def test_s5_3_single_oversized_request_runs_alone(limits):
    est = BytesPerToken(1000)
    a = adder(limits, estimator=est)
    huge = cand("huge", 100_000, cached=50_000)
    assert a.add(huge) is AddResult.CONTINUE  # alone, over every CP limit
    assert a.add(cand("small", 1)) is not AddResult.CONTINUE
    assert [b.candidate.rid for b in a.batch] == ["huge"]


@pytest.mark.parametrize("index_k_bytes_per_token", [132, 256])  # fp8 vs bf16 index K
def test_s5_4_capacity_is_the_allocator_token_budget_for_any_kv_dtype(index_k_bytes_per_token):
    """The CP gates do no byte maths: capacity is free + evictable tokens, whatever dtype."""
    a = adder(SHARED_BS_GT1, rem_total_tokens=1000)
    assert admit_all(a, [cand("a", 600), cand("b", 300), cand("c", 200)]) == [
        AddResult.CONTINUE,
        AddResult.CONTINUE,
        AddResult.NO_TOKEN,
    ]
    assert a.rem_total_tokens == 100


# ---- S6 -----------------------------------------------------------------------------------
def test_s6_input_budget_lifted_to_cp_extend_limit_for_bs_gt1_only():
    limits = CPSharedKVLimits(shared_kv=True, bs_gt1=True, max_total_extend_tokens=4096)
    assert adder(limits, max_prefill_tokens=1024).rem_input_tokens == 4096
    # A smaller CP limit never lowers the generic budget.
    small = CPSharedKVLimits(shared_kv=True, bs_gt1=True, max_total_extend_tokens=512)
    assert adder(small, max_prefill_tokens=1024).rem_input_tokens == 1024
    # Other paths keep max_prefill_tokens.
    for other in (
        CPSharedKVLimits(shared_kv=True, max_total_extend_tokens=4096),
        CPSharedKVLimits(shared_kv=False, bs_gt1=True, max_total_extend_tokens=4096),
    ):
        assert adder(other, max_prefill_tokens=1024).rem_input_tokens == 1024


def test_s6_lift_lets_a_second_request_in():
    limits = CPSharedKVLimits(shared_kv=True, bs_gt1=True, max_total_extend_tokens=4096)
    a = adder(limits, max_prefill_tokens=1024)
    assert admit_all(a, [cand("a", 1024), cand("b", 1024)]) == [AddResult.CONTINUE] * 2


# ---- S7 -----------------------------------------------------------------------------------
def test_s7_cached_token_limit_counts_device_plus_loaded_host_hits():
    """Candidate.cached_tokens is the prefix after the host load-back plan (device + host)."""
    limits = CPSharedKVLimits(shared_kv=True, bs_gt1=True, max_cached_tokens=1000)
    a = adder(limits)
    assert a.add(cand("a", 10, cached=600)) is AddResult.CONTINUE
    assert a.add(cand("b", 10, cached=300)) is AddResult.CONTINUE
    assert a.add(cand("c", 10, cached=200)) is AddResult.CP_MAX_CACHED


def test_s7_cached_token_limit_never_rejects_the_first_request():
    limits = CPSharedKVLimits(shared_kv=True, bs_gt1=True, max_cached_tokens=1)
    assert adder(limits).add(cand("a", 10, cached=10_000)) is AddResult.CONTINUE


# ---- S8 -----------------------------------------------------------------------------------
def test_s8_chunk_budget_caps_the_cp_extend_limit():
    limits = CPSharedKVLimits(shared_kv=True, bs_gt1=True, max_total_extend_tokens=8192)
    a = adder(limits, chunked_prefill_size=1024)
    assert a.effective_max_total_extend_tokens() == 1024
    assert a.rem_input_tokens == max(BIG, 1024)
    b = adder(limits, chunked_prefill_size=1024, max_prefill_tokens=512)
    assert b.rem_input_tokens == 1024  # S6 lift uses the capped limit, not 8192


def test_s8_without_user_limit_the_chunk_tokens_are_the_limit():
    a = adder(SHARED_BS_GT1, chunked_prefill_size=256)
    assert a.effective_max_total_extend_tokens() == 256
    assert admit_all(a, [cand("a", 128), cand("b", 128), cand("c", 64)]) == [
        AddResult.CONTINUE,
        AddResult.CONTINUE,
        AddResult.CP_MAX_EXTEND,
    ]
    assert adder(SHARED_BS_GT1).effective_max_total_extend_tokens() is None


def test_s8_request_count_and_cached_limits_stay_unlimited_under_chunking():
    a = adder(SHARED_BS_GT1, chunked_prefill_size=10 * PAGE)
    results = admit_all(a, [cand(str(i), PAGE, cached=10**6) for i in range(10)])
    assert results == [AddResult.CONTINUE] * 10


# ---- S9 -----------------------------------------------------------------------------------
def test_s9_3_buffer_gate_stops_a_non_empty_batch_over_the_limit():
    est = BytesPerToken(10)
    limits = CPSharedKVLimits(shared_kv=True, bs_gt1=True, max_buffer_bytes=10 * 250)
    a = adder(limits, estimator=est)
    assert admit_all(a, [cand("a", 100), cand("b", 100), cand("c", 100)]) == [
        AddResult.CONTINUE,
        AddResult.CONTINUE,
        AddResult.CP_MAX_BUFFER,
    ]
    assert est.calls == 2  # never consulted for the first request
    assert a.rejections[AddResult.CP_MAX_BUFFER] == 1


def test_s9_3_buffer_limit_needs_an_estimator():
    with pytest.raises(ValueError, match="needs a buffer estimator"):
        adder(CPSharedKVLimits(shared_kv=True, bs_gt1=True, max_buffer_bytes=1))


# ---- properties ---------------------------------------------------------------------------
cands = st.lists(
    st.builds(
        cand,
        st.text(min_size=1, max_size=3),
        st.integers(1, 5000),
        st.integers(0, 5000),
        st.integers(0, 500),
    ),
    min_size=1,
    max_size=30,
)
opt = st.one_of(st.none(), st.integers(1, 20_000))


@given(
    cands,
    st.integers(0, 50_000),
    st.integers(1, 20_000),
    st.one_of(st.none(), st.integers(PAGE, 8192)),
    st.booleans(),
    st.booleans(),
    opt,
    opt,
    opt,
)
def test_admission_never_exceeds_capacity_and_always_takes_a_fitting_first_request(
    queue, total, max_prefill, chunk, shared, bs_gt1, max_reqs, max_extend, max_cached
):
    limits = CPSharedKVLimits(shared, bs_gt1, max_reqs, max_extend, max_cached)
    a = adder(
        limits, rem_total_tokens=total, max_prefill_tokens=max_prefill, chunked_prefill_size=chunk
    )
    results = admit_all(a, queue)
    used = sum(b.extend_tokens + (0 if b.chunked else b.candidate.reserve_tokens) for b in a.batch)
    assert used <= total and a.rem_total_tokens >= 0
    first = queue[0]
    first_fits = first.extend_tokens + first.reserve_tokens <= total
    first_chunk_ok = chunk is None or first.extend_tokens <= chunk or chunk >= PAGE
    if first_fits and first_chunk_ok:
        assert results[0] is AddResult.CONTINUE  # progress: a lone request is never gated
    if chunk is not None:
        assert a.extend_tokens <= chunk
