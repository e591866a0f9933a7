"""`transformer.score_tokens`, the LM-head scoring behind prompt log-probs: each token's
log-prob of its target and its best tokens, in blocks of `SCORE_BLOCK_TOKENS`, against a
float64 NumPy log-softmax of the same logits (float32 log-softmax vs float64: within
1e-5 at the tiny vocabulary's log-probs of order 1-10); a block whose targets are all
negative (nobody asked) skips the LM head and gives zeros."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from support.decode_model import two_layer_config

from cpkv_jax.model.transformer import SCORE_BLOCK_TOKENS, CausalLM, score_tokens


def test_scores_match_a_float64_log_softmax_and_unasked_blocks_are_skipped():
    cfg = two_layer_config()
    model = CausalLM(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    t = SCORE_BLOCK_TOKENS + 88  # row 0's tail shares a block with row 1's head
    hidden = rng.standard_normal((2, t, cfg.hidden_size)).astype(np.float32)
    targets = rng.integers(0, cfg.vocab_size, (2, t)).astype(np.int32)
    targets[1] = -1  # row 1: nobody asked
    chosen, top_ids, top_lps = jax.jit(lambda h, g: score_tokens(model, h, g))(hidden, targets)
    chosen, top_ids, top_lps = (np.asarray(x) for x in (chosen, top_ids, top_lps))

    z = np.asarray(model.logits(jnp.asarray(hidden[0])), np.float64)
    lp = z - z.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    np.testing.assert_allclose(chosen[0], lp[np.arange(t), targets[0]], rtol=0, atol=1e-5)
    k = top_ids.shape[-1]
    best = np.argsort(-lp, axis=-1, kind="stable")[:, :k]
    np.testing.assert_allclose(top_lps[0], np.take_along_axis(lp, best, -1), rtol=0, atol=1e-5)
    assert (top_ids[0] == best).all()  # random logits: no ties to order
    # Row 1 from its first whole unasked block on: skipped, zeros.
    skipped = slice(2 * SCORE_BLOCK_TOKENS - t, t)
    assert not chosen[1, skipped].any() and not top_ids[1, skipped].any()
    assert not top_lps[1, skipped].any()
    # Its head shares row 0's last block: computed there (and simply not used).
    assert top_lps[1, : SCORE_BLOCK_TOKENS - 88].all()
