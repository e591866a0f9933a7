"""Greedy speculative decoding with the MTP layer (issue 39 item 2 at library level,
`cpkv_jax.speculative`): it must emit exactly the plain greedy tokens.

Under batch-invariant numerics each verified token's logits are bitwise those of
one-token decoding, so the comparison with `ReferenceGenerator` is exact. The tiny
checkpoint's MTP layer is random and its drafts are almost never accepted, which tests
the one-token path; `_OracleDrafts` replaces the drafts' tokens (after the MTP layer ran
and wrote its KV) with the true continuation, corrupted at a different place every step,
so verify steps accept every count from 0 to k, and the rejected drafts' KV must be
overwritten correctly for the outputs to stay equal.
"""

from __future__ import annotations

import numpy as np
import pytest

from cpkv_jax.errors import InputError
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.model.weights import load_model
from cpkv_jax.speculative import MTPSpeculator

pytestmark = pytest.mark.slow(seconds=60)  # on 2 workers, 2026-12-05

PAGE = 16
PROMPT = 40  # > index_topk (16): the indexers really select
NEW = 14


class _OracleDrafts(MTPSpeculator):
    """Drafts = the true next tokens, with draft `s % (k + 1)` of step `s` corrupted (none
    when that is `k`): verify step `s` then accepts exactly `s % (k + 1)` drafts."""

    def __init__(self, *args, prompt_len: int, truth: list[int], **kw):
        super().__init__(*args, **kw)
        self.n, self.truth, self.steps = prompt_len, truth, 0

    def _draft(self, logits, hidden, pos, table, pool):
        drafts, pool = super()._draft(logits, hidden, pos, table, pool)  # the MTP's KV
        start = pos + 1 - self.n  # output index of the token at pos + 1
        true = self.truth[start : start + self.k]
        if len(true) == self.k:
            drafts = list(true)
            bad = self.steps % (self.k + 1)
            if bad < self.k:
                drafts[bad] = (drafts[bad] + 1) % self.cfg.vocab_size
        self.steps += 1
        return drafts, pool


@pytest.fixture(scope="module", params=["glm_moe_dsa", "deepseek_v32"])
def loaded(request, tiny_checkpoints):
    cfg, model = load_model(tiny_checkpoints(request.param), mtp=True)
    ref = ReferenceGenerator(
        cfg, model, page_size=PAGE, index_k_dtype="fp8_e4m3", batch_invariant=True
    )
    prompt = np.random.default_rng(3).integers(3, cfg.vocab_size, PROMPT).tolist()
    want = ref.generate(prompt, NEW, ignore_eos=True).output_ids
    return cfg, model, prompt, want


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_mtp_emits_the_plain_greedy_tokens(loaded, k):
    cfg, model, prompt, want = loaded
    spec = MTPSpeculator(model, k, page_size=PAGE, index_k_dtype="fp8_e4m3", batch_invariant=True)
    got = spec.generate(prompt, NEW)
    assert got.output_ids == want
    assert len(got.accepted) >= 1 and all(0 <= a <= k for a in got.accepted)


@pytest.mark.parametrize("k", [2, 3])
def test_accepted_drafts_of_every_count_keep_the_tokens_exact(loaded, k):
    cfg, model, prompt, want = loaded
    spec = _OracleDrafts(
        model,
        k,
        page_size=PAGE,
        index_k_dtype="fp8_e4m3",
        batch_invariant=True,
        prompt_len=len(prompt),
        truth=want,
    )
    got = spec.generate(prompt, NEW)
    assert got.output_ids == want
    # Every acceptance count happened, multi-token steps included.
    assert set(range(k + 1)) <= set(got.accepted), got.accepted
    assert len(got.accepted) < NEW  # fewer verify steps than tokens
    assert got.acceptance_length > 1.0


def test_refusals(loaded):
    _, model, prompt, _ = loaded
    with pytest.raises(InputError, match="num_steps"):
        MTPSpeculator(model, 0)
    spec = MTPSpeculator(model, 1, page_size=PAGE)
    with pytest.raises(InputError, match="non-empty prompt"):
        spec.generate([], 4)
