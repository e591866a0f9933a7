"""The decode engine's sampler: each row's next token drawn on the device.

`RowSampler` turns a step's rows into `cpkv_jax.sampling.RowSampling`s (temperature, top-k,
top-p, min-p, seed and output position, top log-probs) and draws from the step's
logits on the device, with two pieces of per-request state it owns:
- penalty slots (`PenaltyCounts`: output-token counts, prompt flags and logit bias per
  slot, on the device) for requests with a frequency / presence / repetition penalty,
  a logit bias or `min_new_tokens`: a slot is reserved when such a request is admitted
  (it waits in the queue while none is free), set at its first draw, set again once its
  output reaches `min_new_tokens`, and given back once it is no longer in flight. At
  most `PENALTY_SLOTS_MAX` slots: the arrays are `[slots, vocab]`;
- structured output: the rows' grammar masks (`serving.grammar.token_mask`), applied on
  the device before the draw.

Only token ids, their log-probs and the requested top-N come back to the host.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from cpkv_jax.config import ModelConfig
from cpkv_jax.sampling import (
    PenaltyCounts,
    PendingSample,
    RowSampling,
    Sampled,
    StepLogits,
    rows_log_probs,
    sample,
    sample_async,
)
from cpkv_jax.sampling import warm as sampling_warm
from serving.decode.request import DecodeRequest
from serving.engine.api import SamplingParams, stop_token_bias
from serving.grammar import GrammarBackend, token_mask

logger = logging.getLogger(__name__)

# Penalty slots at most (`cpkv_jax.sampling.PenaltyCounts`: GLM-5's vocabulary at 256
# slots is 198 MB on each device); penalized requests beyond them wait to be admitted.
PENALTY_SLOTS_MAX = 256


class RowSampler:
    """Draws for the decode engine's rows (see the module docstring). `logits_sharding`
    is where the steps leave their logit rows (on a mesh: each rank's rows on it),
    `state_sharding` where the penalty slots live (default `logits_sharding`; on a mesh:
    every device, as a rank's rows may take any slot)."""

    def __init__(
        self,
        cfg: ModelConfig,
        slots: int,
        logits_sharding: Any,
        grammar: GrammarBackend | None = None,
        batch_invariant: bool = False,
        state_sharding: Any = None,
    ):
        self.vocab_size = cfg.vocab_size
        self.invariant = batch_invariant  # the log-softmax's tiles (`log_probs`)
        self.eos_token_ids = cfg.eos_token_ids
        self.grammar = grammar
        self._logits_sharding = logits_sharding
        self.penalties = PenaltyCounts(
            slots,
            cfg.vocab_size,
            logits_sharding if state_sharding is None else state_sharding,
            logits_sharding,
        )
        self._slots: dict[str, int] = {}  # rid -> slot, reserved at admission
        # Of those, the slots already set: rid -> whether the set bias bans the stop tokens
        # (`min_new_tokens`; the slot is set again once the request is past it).
        self._ready: dict[str, bool] = {}
        logger.info(
            "penalty slots: %d x %d tokens, %.1f MiB on each device",
            self.penalties.slots,
            cfg.vocab_size,
            self.penalties.nbytes / 2**20,
        )

    # ---- penalty slots ---------------------------------------------------------------------
    def slot_free(self, r: DecodeRequest, live: Collection[str]) -> bool:
        """Whether `r` can be admitted as far as penalty slots go: it needs none, or one is
        free once the slots of requests not in `live` (the rids in flight) are given back."""
        if not penalized(r.req.sampling):
            return True
        for rid in [rid for rid in self._slots if rid not in live]:
            del self._slots[rid]
            self._ready.pop(rid, None)
        return len(self._slots) < self.penalties.slots

    def reserve(self, r: DecodeRequest) -> None:
        """Reserve a slot for an admitted request that needs one (`slot_free` said one is
        free)."""
        if not penalized(r.req.sampling) or r.rid in self._slots:
            return
        taken = set(self._slots.values())
        self._slots[r.rid] = next(i for i in range(self.penalties.slots) if i not in taken)

    def _set_slots(self, rows: Sequence[DecodeRequest]) -> None:
        """Set the reserved slots of rows drawing for the first time from their prompt,
        logit bias and output so far (the first token, when the prefill server drew it);
        its bias again once a row's output reaches `min_new_tokens` (its stop tokens
        allowed; the counts stay: they may hold a token still in flight)."""
        for r in rows:
            slot = self._slots.get(r.rid)
            if slot is None:
                continue
            s = r.req.sampling
            n_out = len(r.out_ids) + r.pending
            banning = n_out < s.min_new_tokens
            ready = self._ready.get(r.rid)
            if ready == banning:
                continue
            bias = stop_token_bias(s, self.eos_token_ids, n_out)
            if ready is None:
                assert r.pending == 0, "a row's first draw has nothing in flight"
                self.penalties.reset(slot, r.out_ids, r.prompt, bias)
            else:
                self.penalties.set_bias(slot, bias)
            self._ready[r.rid] = banning

    # ---- draws -----------------------------------------------------------------------------
    def row(self, r: DecodeRequest) -> RowSampling:
        """`r`'s draw parameters for the token at its next output position."""
        s = r.req.sampling
        top_n = r.req.top_logprobs if r.req.return_logprob else 0
        slot = self._slots.get(r.rid, -1)
        return RowSampling(
            s.temperature,
            s.top_k,
            s.top_p,
            r.seed,
            len(r.out_ids) + r.pending,  # the output position this draw's token takes
            s.min_p,
            top_n,
            s.frequency_penalty if slot >= 0 else 0.0,
            s.presence_penalty if slot >= 0 else 0.0,
            s.repetition_penalty if slot >= 0 else 1.0,
            bool(s.logit_bias or s.min_new_tokens) and slot >= 0,
            slot,
        )

    def _args(self, rows: Sequence[DecodeRequest], out: StepLogits) -> tuple[list, dict]:
        self._set_slots(rows)
        mask = token_mask([r.grammar for r in rows], out.logits.shape[0], self.vocab_size)
        kw = {"logits": out.logits, "token_mask": mask, "order": out.order}
        return [self.row(r) for r in rows], kw

    def draw(self, rows: Sequence[DecodeRequest], out: StepLogits) -> Sampled:
        """The next token of each of `rows` from a step's logit rows (on the device where
        the step left them, or one host row), fetched; penalties read from and counted on
        the device."""
        params, kw = self._args(rows, out)
        return sample(rows_log_probs(out.logits, self.invariant), params, self.penalties, **kw)

    def draw_async(self, rows: Sequence[DecodeRequest], out: StepLogits) -> PendingSample:
        """`draw`, dispatched and not fetched: its tokens stay on the device (the next
        step's ids) until `fetch`."""
        params, kw = self._args(rows, out)
        lp = rows_log_probs(out.logits, self.invariant)
        return sample_async(lp, params, self.penalties, **kw)

    def warm(self, row_counts: set[int], host_row: bool) -> None:
        """Compile the penalized sampler for steps of `row_counts` logit rows (and, with
        `host_row`, a first token's host row: a prefill that hands its logits over on
        the host), and the slot reset: what a request with a penalty runs, before
        serving; with a grammar backend, the masked draws too."""
        self.penalties.warm(row_counts, {1} if host_row else set())
        if host_row:  # its log-softmax (the steps' rows: `warm_log_probs`)
            rows_log_probs(np.zeros((1, self.vocab_size), np.float32), self.invariant)
        if self.grammar is not None:  # the token mask of a step with a grammar row
            sampling_warm(self.vocab_size, sorted(row_counts), self._logits_sharding, masked=True)
            if host_row:
                sampling_warm(self.vocab_size, [1], None, masked=True)


def penalized(s: SamplingParams) -> bool:
    """Whether `s` needs a `PenaltyCounts` slot (a penalty, a logit bias, or stop tokens
    banned by `min_new_tokens`)."""
    return bool(
        s.frequency_penalty != 0
        or s.presence_penalty != 0
        or s.repetition_penalty != 1
        or s.logit_bias
        or s.min_new_tokens
    )
