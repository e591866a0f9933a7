"""Greedy speculative decoding with the model's own MTP layer, one request on one device:
the algorithm the serving engine's draft-and-verify steps follow, and its exactness
oracle (issue 39 item 2, library level).

State between steps: the last verified token `x` at position `p` (its KV not written
yet) and `k` drafts `d1..dk` for positions `p+1..p+k`.

1. Verify: the trunk runs `[x, d1, .., dk]` at positions `p..p+k` in one forward (each
   token attends causally, with its own indexer top-k), writing their KV, and its greedy
   tokens `g0..gk` come back. The drafts accepted are the longest prefix with
   `d_{j+1} == g_j`, say `a` of them; the tokens emitted are `g0..ga` (the accepted
   drafts and the bonus token). The KV of positions `p..p+a` is kept; that of rejected
   drafts lies beyond the sequence's length and is overwritten by the next step.
2. The MTP pass over the accepted tokens: the MTP layer runs at positions `p..p+a` on the
   tokens `g0..ga` (each position's next token) with the trunk's hidden states there,
   writing its own KV; its output at `p+a` predicts the token after `ga`: the first
   draft of the next step.
3. Drafting: `k - 1` more MTP steps, each on its previous draft with the MTP's own output
   hidden state (as SGLang's and vLLM's MTP drafters chain), one position further.

The next step verifies `x = ga` at `p + a + 1`. After the prompt's prefill, the MTP pass
runs over the prompt (positions `0..n-1`, tokens `prompt[1:] + [first token]`).

Greedy acceptance keeps exactly the tokens the trunk would emit one at a time; with
batch-invariant numerics (`batch_invariant=True`) each token's logits are bitwise those
of plain decoding, so the outputs are equal token for token (`tests/core/
test_speculative.py`). For temperature > 0, `accept_drafts` is the accept / reject rule
on the device (checked on synthetic distributions); `MTPSpeculator` does not sample yet.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from cpkv_jax.buckets import pow2_at_least
from cpkv_jax.errors import InputError
from cpkv_jax.model.forward_batch import ForwardBatch, prefill_batch, span_batch
from cpkv_jax.model.kv_cache import (
    INDEX_K_DTYPES,
    SINGLE_DEVICE_KV_IO,
    IndexKDtype,
    KVPool,
    init_pool,
)
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.model.numerics import batch_invariant
from cpkv_jax.model.rope import rope_cos_sin
from cpkv_jax.model.transformer import CausalLM, log_probs
from cpkv_jax.paging import PageAllocator, padded_page_table, pages_for_tokens


@dataclasses.dataclass
class SpeculativeResult:
    output_ids: list[int]
    # Per verify step: drafts accepted (0..k); the step emitted one more token than that.
    accepted: list[int]

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verify step (accepted drafts + the bonus token)."""
        return 1.0 + float(np.mean(self.accepted)) if self.accepted else 0.0


@functools.partial(
    jax.jit, static_argnames=("graphdef", "index_k_dtype", "invariant"), donate_argnames=("pool",)
)
def _trunk(graphdef, state, batch: ForwardBatch, pool: KVPool, *, index_k_dtype, invariant):
    """The trunk over `batch`: every token's logits and final (normed) hidden state."""
    with batch_invariant(invariant):
        model = nnx.merge(graphdef, state)
        hidden, pool = model(batch, pool, kv_io=SINGLE_DEVICE_KV_IO, index_k_dtype=index_k_dtype)
        return model.logits(hidden), hidden, pool


@functools.partial(
    jax.jit, static_argnames=("graphdef", "index_k_dtype", "invariant"), donate_argnames=("pool",)
)
def _mtp(graphdef, state, batch: ForwardBatch, hidden, pool: KVPool, *, index_k_dtype, invariant):
    """The MTP layer over `batch` (tokens one position ahead of `batch.positions`), fed
    the hidden states `hidden` at those positions: logits and its output hidden states."""
    with batch_invariant(invariant):
        model = nnx.merge(graphdef, state)
        cfg = model.cfg
        cos, sin = rope_cos_sin(batch.positions, cfg.qk_rope_head_dim, cfg.rope)
        embeds = model.model.embed_tokens(batch.input_ids)
        out, pool = model.mtp.predict(
            embeds,
            hidden,
            batch,
            pool,
            cos,
            sin,
            kv_io=SINGLE_DEVICE_KV_IO,
            index_k_dtype=index_k_dtype,
        )
        return model.logits(out), out, pool


class MTPSpeculator:
    """Greedy draft-and-verify generation for one request (see the module docstring).
    `model` must have its MTP layer (`CausalLM(..., mtp=True)`, `load_model(mtp=True)`)."""

    def __init__(
        self,
        model: CausalLM,
        num_steps: int,
        *,
        page_size: int = 64,
        index_k_dtype: IndexKDtype = "fp8_e4m3",
        batch_invariant: bool = False,
    ):
        if model.mtp is None:
            raise InputError("speculative decoding needs the model's MTP layer (mtp=True)")
        if num_steps < 1:
            raise InputError(f"num_steps must be >= 1, got {num_steps}")
        if index_k_dtype not in INDEX_K_DTYPES:
            raise InputError(
                f"index K dtype {index_k_dtype!r} is not one of {sorted(INDEX_K_DTYPES)}"
            )
        self.cfg, self.k, self.page_size = model.cfg, num_steps, page_size
        self.dtype = model.dtype
        self.graphdef, self.state = nnx.split(model)
        self._kw = {"index_k_dtype": index_k_dtype, "invariant": batch_invariant}
        self.index_k_dtype = index_k_dtype

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> SpeculativeResult:
        """`max_new_tokens` greedy tokens (EOS does not stop it: an exactness oracle)."""
        cfg, k, p = self.cfg, self.k, self.page_size
        prompt = np.asarray(prompt_ids, np.int32)
        n = len(prompt)
        if n == 0 or max_new_tokens < 1:
            raise InputError("give a non-empty prompt and max_new_tokens >= 1")
        # Room for the last verify's drafts beyond the output.
        n_pages = pages_for_tokens(n + max_new_tokens + k, p)
        width = pow2_at_least(n_pages)
        table = padded_page_table(PageAllocator(width + 1).alloc(n_pages), width)
        pool = init_pool(mtp_config(cfg), width + 1, p, self.dtype, self.index_k_dtype)

        batch = prefill_batch(prompt, table, p)
        logits, hidden, pool = _trunk(self.graphdef, self.state, batch, pool, **self._kw)
        x = _greedy(logits[0, n - 1])
        out = [x]
        # The MTP pass over the prompt: position i sees the token at i + 1.
        ahead = np.append(prompt[1:], x)
        draft_logits, draft_hidden, pool = _mtp(
            self.graphdef,
            self.state,
            span_batch(ahead, 0, table, p, len(batch.input_ids[0])),
            hidden,
            pool,
            **self._kw,
        )
        last = n - 1
        accepted: list[int] = []
        pos = n  # x's position
        while len(out) < max_new_tokens:
            drafts, pool = self._draft(
                draft_logits[:, last], draft_hidden[:, last], pos, table, pool
            )
            verify = np.asarray([x, *drafts], np.int32)
            logits, hidden, pool = _trunk(
                self.graphdef, self.state, span_batch(verify, pos, table, p), pool, **self._kw
            )
            greedy = [_greedy(row) for row in logits[0]]
            a = 0
            while a < k and drafts[a] == greedy[a]:
                a += 1
            accepted.append(a)
            out.extend(greedy[: a + 1])
            x = greedy[a]
            # The MTP pass over the accepted positions pos..pos+a: each sees its next token.
            draft_logits, draft_hidden, pool = _mtp(
                self.graphdef,
                self.state,
                span_batch(np.asarray(greedy[: a + 1], np.int32), pos, table, p),
                hidden[:, : a + 1],
                pool,
                **self._kw,
            )
            last = a
            pos += a + 1
        return SpeculativeResult(out[:max_new_tokens], accepted)

    def _draft(self, logits, hidden, pos: int, table: np.ndarray, pool: KVPool):
        """`k` drafts for positions `pos+1..pos+k`: the first from the MTP pass's output at
        `pos - 1`, the rest chained on the MTP's own output hidden states."""
        drafts = [_greedy(logits[0])]
        hidden = hidden[:, None]
        for j in range(1, self.k):
            last = np.asarray([drafts[-1]], np.int32)
            batch = span_batch(last, pos + j - 1, table, self.page_size)
            lg, hidden, pool = _mtp(self.graphdef, self.state, batch, hidden, pool, **self._kw)
            drafts.append(_greedy(lg[0, 0]))
        return drafts, pool


@jax.jit
def accept_drafts(
    target: Float[Array, "k1 v"],
    draft: Float[Array, "k v"],
    drafts: Int[Array, " k"],
    uniforms: Float[Array, " k1"],
) -> tuple[Int[Array, ""], Int[Array, ""]]:
    """Speculative sampling's accept / reject rule on the device, for one row's chain.

    `target[i]` is the target's distribution at draft position `i` (row `k`: after the
    last draft), `draft[i]` the drafter's, `drafts[i]` the token it drew from it, and
    `uniforms` `k + 1` draws from U[0, 1). Draft `i` is accepted with probability
    `min(1, p_i(d_i) / q_i(d_i))`, in order, until the first rejection; returns how many
    were accepted (`a`) and the token after them: drawn from `max(p_a - q_a, 0)`
    (normalized) at a rejection, or from `p_k` when every draft was accepted (the bonus
    token). The emitted tokens `d_0..d_{a-1}, token` are then distributed as if drawn from
    the target one at a time (Leviathan et al. 2023, Chen et al. 2023). With one-hot
    distributions (greedy) this is the longest matching prefix and the target's argmax."""
    k = drafts.shape[0]
    p_d = jnp.take_along_axis(target[:k], drafts[:, None], axis=1)[:, 0]
    q_d = jnp.take_along_axis(draft, drafts[:, None], axis=1)[:, 0]
    ok = uniforms[:k] * q_d < p_d  # u < p / q, without dividing by q
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
    # q after the last draft is 0: there the residual is p_k itself (the bonus token).
    q_next = jnp.concatenate([draft, jnp.zeros_like(target[:1])])[accepted]
    resid = jnp.maximum(target[accepted] - q_next, 0.0)
    # p == q at a rejected position has probability 0 of rejecting; keep the draw defined.
    resid = jnp.where(resid.sum() > 0, resid, target[accepted])
    cdf = jnp.cumsum(resid)
    token = jnp.searchsorted(cdf, uniforms[k] * cdf[-1], side="right")
    return accepted, jnp.minimum(token, target.shape[1] - 1).astype(jnp.int32)


def _greedy(logits_row: jax.Array) -> int:
    """The greedy token as the reference generator picks it (argmax of the log-probs)."""
    return int(np.argmax(np.asarray(log_probs(logits_row))))
