"""Token sampling and stop conditions for one request (host side, numpy only).

`sample_token` is stateless per output position: token `step` of a request is drawn
with `numpy.random.default_rng([seed, step])`, so a prefill server that samples token 0
and a decode server that samples tokens 1.. produce the same stream as one unified
server. The filters run in the usual order: temperature, then top-k, then top-p
(nucleus) on the renormalized top-k distribution, all in float64.

`StopChecker` decides, after each new token, whether a request is finished and why:

- "stop": an eos token (unless `ignore_eos`), a `stop_token_ids` token (always), or a
  `stop` string appearing in the detokenized output;
- "length": `max_new_tokens` tokens were produced.

When a stop string hits, the output token ids run up to and including the token that
completed the stop string (the token is not taken back: its KV is already written and
the ids stay a faithful record of what the model produced). `StopResult.matched_stop`
names the string and `StopResult.text_end` is the character offset in the detokenized
output where it starts; the HTTP layer trims the text there.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from cpkv_jax.errors import InputError
from serving.engine.api import FinishReason, GenerateRequest, SamplingParams

_SEED_MASK = (1 << 63) - 1


def request_seed(req: GenerateRequest) -> int:
    """The sampling seed of a request: `req.sampling.seed` when set, else derived from
    the request id.

    The derived seed is the first 8 bytes of BLAKE2b(rid, person=b"cpkv-jax-seed")
    read little-endian, masked to [0, 2**63): stable across processes and Python
    versions (unlike `hash`). The decode server must use this same function, so the
    tokens of an unseeded request do not depend on which server sampled which token.
    """
    if req.sampling.seed is not None:
        return req.sampling.seed
    digest = hashlib.blake2b(req.rid.encode("utf-8"), digest_size=8, person=b"cpkv-jax-seed")
    return int.from_bytes(digest.digest(), "little") & _SEED_MASK


Detokenize = Callable[[list[int]], str]

# Replacement character a byte-level detokenizer emits for an incomplete UTF-8 sequence:
# text ending in it is not final yet (the next token may complete the character).
_REPLACEMENT = "\ufffd"


def sampling_probs(
    logprobs: np.ndarray, temperature: float, top_k: int, top_p: float
) -> np.ndarray:
    """The float64 distribution a non-greedy draw uses: `[vocab]`, sums to 1.

    Temperature scaling, then top-k (`top_k > 0`: the k most likely tokens, ties broken
    towards the lower token id), then top-p (the smallest most-likely-first set whose
    mass is >= `top_p`, at least one token), renormalized after each filter.
    """
    if temperature <= 0.0:
        raise ValueError(f"sampling_probs needs temperature > 0, got {temperature}")
    z = np.asarray(logprobs, dtype=np.float64).reshape(-1) / temperature
    top = float(np.max(z))
    if not np.isfinite(top):
        raise ValueError(f"log-probs have no finite maximum (max {top}); the logits are broken")
    p = np.exp(z - top)
    # Most likely first; a stable sort of -p keeps equal tokens in id order.
    order = np.argsort(-p, kind="stable")
    keep = len(order)
    if 0 < top_k < keep:
        keep = top_k
    if top_p < 1.0:
        kept = p[order[:keep]]
        cdf = np.cumsum(kept) / kept.sum()
        keep = min(keep, int(np.searchsorted(cdf, top_p, side="left")) + 1)
    out = np.zeros_like(p)
    sel = order[:keep]
    out[sel] = p[sel]
    return out / out.sum()


def sample_token(logprobs: np.ndarray, params: SamplingParams, step: int, seed: int) -> int:
    """Token `step` of a request's output, from one row of log-softmax over the vocab.

    `temperature == 0` is greedy: `argmax(logprobs)` (the lowest id among ties), exactly
    what `ReferenceGenerator` picks. Otherwise one uniform draw from
    `default_rng([seed, step])` is mapped through the CDF of `sampling_probs(...)`.
    A row without a finite maximum (NaN, all -inf: broken logits) raises `ValueError`
    either way; the engines fail that request alone.
    """
    if params.temperature == 0.0:
        tok = int(np.argmax(logprobs))
        if not np.isfinite(logprobs[tok]):  # argmax stops at the first NaN
            raise ValueError(
                f"log-probs have no finite maximum (max {logprobs[tok]}); the logits are broken"
            )
        return tok
    probs = sampling_probs(logprobs, params.temperature, params.top_k, params.top_p)
    cdf = np.cumsum(probs)
    u = np.random.default_rng([seed, step]).random() * cdf[-1]
    # side="right": a zero-probability token (flat CDF) is never chosen.
    return int(min(np.searchsorted(cdf, u, side="right"), len(cdf) - 1))


@dataclasses.dataclass(frozen=True)
class StopResult:
    """Why a request finished. `matched_stop` / `text_end` are set for a stop string:
    the client's text is `detokenized_output[:text_end]`."""

    reason: FinishReason
    matched_stop: str | None = None
    matched_stop_index: int | None = None  # index into `SamplingParams.stop`
    text_end: int | None = None


class StopChecker:
    """Per-request stop logic, fed one token at a time (`append`).

    Stop strings are matched on the output text, built incrementally: each new token
    re-decodes only the tokens since the last complete piece of text (a window of a few
    tokens), and the search covers only the tail that a match could end in (the new
    text plus `longest stop - 1` characters before it). Stop strings need `detokenize`.
    """

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: Sequence[int],
        detokenize: Detokenize | None = None,
    ):
        if params.stop and detokenize is None:
            raise InputError(
                f"stop strings {list(params.stop)[:3]} need a tokenizer, and this server has "
                "none: pass stop_token_ids instead, or start the server with a tokenizer"
            )
        self.params = params
        self._stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        )
        self._detok = detokenize
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self.ids: list[int] = []
        self.text = ""
        # Decoded text is final for ids[:_read]; ids[_prefix:_read] is the context
        # re-decoded with the new tokens (so tokenizers that merge spaces stay right).
        self._prefix = 0
        self._read = 0

    def append(self, token: int) -> StopResult | None:
        """Record the next output token; the reason if the request is now finished."""
        self.ids.append(int(token))
        if token in self._stop_ids:
            return StopResult("stop")
        if self.params.stop:
            hit = self._check_stop_strings()
            if hit is not None:
                return hit
        if len(self.ids) >= self.params.max_new_tokens:
            return StopResult("length")
        return None

    def _check_stop_strings(self) -> StopResult | None:
        assert self._detok is not None
        before = self._detok(self.ids[self._prefix : self._read])
        after = self._detok(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return None  # no complete new character yet
        old_len = len(self.text)
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        start = max(0, old_len - self._max_stop + 1)
        best: StopResult | None = None
        for i, s in enumerate(self.params.stop):
            at = self.text.find(s, start)
            if at >= 0 and (best is None or at < (best.text_end or 0)):
                best = StopResult("stop", s, i, at)
        return best
