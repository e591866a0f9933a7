"""Admission of requests into one prefill batch: generic budgets, then CP shared-KV gates.

Host-side only: integers in, decisions out. Nothing here touches or synchronizes a
device (the scheduler's hot path).

Generic budgets (the usual prefill-adder semantics):
- total tokens: free + evictable device tokens, minus the reservations of running
  requests' expected output; a request needs its extend tokens plus its own reservation;
- input tokens (`max_prefill_tokens`): the first request of a batch may exceed it;
- chunk tokens (`chunked_prefill_size`): a request that does not fit the remaining chunk
  budget is truncated to the page-floored remainder and becomes the batch's in-flight
  chunked request; an in-flight chunked request is admitted first (`add_chunked`).

CP shared-KV gates (only with `cp.shared_kv`), each in one named method:
- S5.1 `_gate_s5_1_batch_size_one`: without the bs>1 flag a batch holds one request;
- S5.2/S5.3 `_gate_s5_2_max_batch_requests`;
- S8 `effective_max_total_extend_tokens` + `_gate_s5_2_max_total_extend_tokens`
  (page-aligned, capped by the remaining chunk tokens when chunked prefill is on);
- S7 `_gate_s7_max_cached_tokens` (cached tokens counted after the host load-back plan);
- S9.3 `_gate_s9_3_max_buffer_bytes` (the CPU-only estimator's peak bytes);
- S6 `initial_input_budget` (the input budget lift).
Every gate only stops adding to a *non-empty* batch (S5.3): a lone request larger than any
CP limit is admitted alone, so the scheduler never deadlocks. Real memory capacity stays
with the total-token budget (S5.4): the gates do no byte-level capacity maths.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from collections.abc import Sequence
from typing import Protocol, runtime_checkable


class AddResult(enum.Enum):
    """Outcome of offering one request to the batch (CONTINUE = admitted)."""

    CONTINUE = "continue"
    NO_TOKEN = "total_tokens"  # not enough free + evictable KV
    INPUT_BUDGET = "max_prefill_tokens"
    CHUNK_BUDGET = "chunk_tokens"
    CP_BS1 = "cp_shared_kv_bs1"
    CP_MAX_REQUESTS = "cp_max_batch_requests"
    CP_MAX_EXTEND = "cp_max_total_extend_tokens"
    CP_MAX_CACHED = "cp_max_cached_tokens"
    CP_MAX_BUFFER = "cp_max_buffer_size"


@dataclasses.dataclass(frozen=True)
class CPSharedKVLimits:
    """The CP shared-KV batching group of flags (SPEC S5.2: None = unlimited)."""

    shared_kv: bool = False
    bs_gt1: bool = False
    max_batch_requests: int | None = None
    max_total_extend_tokens: int | None = None
    max_cached_tokens: int | None = None
    max_buffer_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What admission knows about a waiting request (all counts in tokens)."""

    rid: str
    extend_tokens: int  # tokens still to prefill
    cached_tokens: int  # prefix after the host load-back plan: device hits + loaded host hits
    reserve_tokens: int  # expected output, reserved in the total budget


@dataclasses.dataclass(frozen=True)
class Admitted:
    candidate: Candidate
    extend_tokens: int  # tokens this step (may be a truncated chunk)

    @property
    def chunked(self) -> bool:
        """True when the request still has tokens left after this step."""
        return self.extend_tokens < self.candidate.extend_tokens


@runtime_checkable
class BatchEstimator(Protocol):
    """CPU-only peak transient bytes of a candidate batch (SPEC S9.1)."""

    def estimate_bytes(self, batch: Sequence[Admitted]) -> int: ...


def floor_to_page(n: int, page_size: int) -> int:
    return (n // page_size) * page_size


def ceil_to_page(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


class PrefillAdder:
    """Builds one prefill batch; create a new adder per scheduling decision."""

    def __init__(
        self,
        *,
        page_size: int,
        rem_total_tokens: int,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        cp: CPSharedKVLimits = CPSharedKVLimits(),
        estimator: BatchEstimator | None = None,
    ):
        if cp.max_buffer_bytes is not None and estimator is None:
            raise ValueError("a max buffer size needs a buffer estimator")
        self.page_size = page_size
        self.cp = cp
        self.estimator = estimator
        self.rem_total_tokens = rem_total_tokens
        self.rem_chunk_tokens = chunked_prefill_size
        self.chunk_budget = chunked_prefill_size  # the chunk tokens this batch started with
        self.max_prefill_tokens = max_prefill_tokens
        self.rem_input_tokens = self.initial_input_budget()
        self.batch: list[Admitted] = []
        self.rejections: Counter[AddResult] = Counter()
        self.new_chunked: Admitted | None = None

    # ---- SPEC S6 / S8 -------------------------------------------------------------------
    @property
    def cp_bs_gt1(self) -> bool:
        return self.cp.shared_kv and self.cp.bs_gt1

    def effective_max_total_extend_tokens(self) -> int | None:
        """S8: min(user limit, chunk tokens) with chunked prefill on; else the user limit.
        Without a user limit and with chunking, the chunk tokens.

        "Chunk tokens" is the chunk budget the batch started with: the gate compares the
        whole batch's page-aligned extend total against it, so using the shrinking
        remainder would count admitted tokens twice.
        """
        if not self.cp.shared_kv:
            return None
        user = self.cp.max_total_extend_tokens
        if self.chunk_budget is None:
            return user
        return self.chunk_budget if user is None else min(user, self.chunk_budget)

    def initial_input_budget(self) -> int:
        """S6: for CP shared-KV bs>1 the input budget is lifted to the (effective) CP extend
        limit when that is larger; every other path keeps `max_prefill_tokens`."""
        if not self.cp_bs_gt1:
            return self.max_prefill_tokens
        limit = self.effective_max_total_extend_tokens()
        return self.max_prefill_tokens if limit is None else max(self.max_prefill_tokens, limit)

    # ---- public ----------------------------------------------------------------------
    def add_chunked(self, cand: Candidate) -> Admitted | None:
        """Admit the in-flight chunked request first, with the next chunk of its tokens."""
        if self.batch:
            raise ValueError("the in-flight chunked request must be added first")
        admitted = self._admit(cand, chunked_continuation=True)
        if isinstance(admitted, AddResult):
            self._reject(admitted)
            return None
        return admitted

    def add(self, cand: Candidate) -> AddResult:
        """Offer one waiting request; CONTINUE means admitted, anything else means stop."""
        if self.new_chunked is not None:
            return self._reject(AddResult.CHUNK_BUDGET)  # a truncated request ends the batch
        if self.batch:
            for gate in (
                self._gate_s5_1_batch_size_one,
                self._gate_s5_2_max_batch_requests,
                self._gate_s5_2_max_total_extend_tokens,
                self._gate_s7_max_cached_tokens,
                self._gate_s9_3_max_buffer_bytes,
            ):
                result = gate(cand)
                if result is not AddResult.CONTINUE:
                    return self._reject(result)
        admitted = self._admit(cand, chunked_continuation=False)
        if isinstance(admitted, AddResult):
            return self._reject(admitted)
        return AddResult.CONTINUE

    @property
    def extend_tokens(self) -> int:
        return sum(a.extend_tokens for a in self.batch)

    # ---- generic budgets -------------------------------------------------------------
    def _admit(self, cand: Candidate, *, chunked_continuation: bool) -> Admitted | AddResult:
        extend = cand.extend_tokens
        need_total = extend + cand.reserve_tokens
        if need_total > self.rem_total_tokens and not chunked_continuation:
            return AddResult.NO_TOKEN
        if self.batch and extend > self.rem_input_tokens:
            return AddResult.INPUT_BUDGET
        if self.rem_chunk_tokens is not None and extend > self.rem_chunk_tokens:
            extend = floor_to_page(self.rem_chunk_tokens, self.page_size)
            if extend <= 0:
                return AddResult.CHUNK_BUDGET
        admitted = Admitted(cand, extend)
        self.batch.append(admitted)
        self.rem_total_tokens -= extend + (0 if admitted.chunked else cand.reserve_tokens)
        self.rem_input_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend
        if admitted.chunked:
            self.new_chunked = admitted
        return admitted

    def _reject(self, result: AddResult) -> AddResult:
        self.rejections[result] += 1
        return result

    # ---- CP shared-KV gates (non-empty batch only, SPEC S5.3) -------------------------
    def _gate_s5_1_batch_size_one(self, cand: Candidate) -> AddResult:
        if self.cp.shared_kv and not self.cp.bs_gt1:
            return AddResult.CP_BS1
        return AddResult.CONTINUE

    def _gate_s5_2_max_batch_requests(self, cand: Candidate) -> AddResult:
        limit = self.cp.max_batch_requests if self.cp_bs_gt1 else None
        if limit is not None and len(self.batch) + 1 > limit:
            return AddResult.CP_MAX_REQUESTS
        return AddResult.CONTINUE

    def _gate_s5_2_max_total_extend_tokens(self, cand: Candidate) -> AddResult:
        if not self.cp_bs_gt1:
            return AddResult.CONTINUE
        limit = self.effective_max_total_extend_tokens()
        if limit is None:
            return AddResult.CONTINUE
        page = self.page_size
        total = sum(ceil_to_page(a.extend_tokens, page) for a in self.batch)
        if total + ceil_to_page(cand.extend_tokens, page) > limit:
            return AddResult.CP_MAX_EXTEND
        return AddResult.CONTINUE

    def _gate_s7_max_cached_tokens(self, cand: Candidate) -> AddResult:
        limit = self.cp.max_cached_tokens if self.cp_bs_gt1 else None
        if limit is None:
            return AddResult.CONTINUE
        cached = sum(a.candidate.cached_tokens for a in self.batch) + cand.cached_tokens
        return AddResult.CP_MAX_CACHED if cached > limit else AddResult.CONTINUE

    def _gate_s9_3_max_buffer_bytes(self, cand: Candidate) -> AddResult:
        limit = self.cp.max_buffer_bytes if self.cp_bs_gt1 else None
        if limit is None:
            return AddResult.CONTINUE
        assert self.estimator is not None
        trial = [*self.batch, Admitted(cand, cand.extend_tokens)]
        if self.estimator.estimate_bytes(trial) > limit:
            return AddResult.CP_MAX_BUFFER
        return AddResult.CONTINUE
