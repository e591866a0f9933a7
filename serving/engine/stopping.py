"""A request's sampling seed and stop conditions (host side).

Tokens are drawn on the device by `cpkv_jax.sampling.sample` (stateless per output
position, keyed by `request_seed`), so a prefill server that samples token 0 and a
decode server that samples tokens 1.. produce the same stream as one unified server.

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


@dataclasses.dataclass(frozen=True)
class StopResult:
    """Why a request finished. `matched_stop` / `text_end` are set for a stop string:
    the client's text is `detokenized_output[:text_end]`; `matched_token` for a stop token
    (EOS or one of `stop_token_ids`), the output's last."""

    reason: FinishReason
    matched_stop: str | None = None
    matched_stop_index: int | None = None  # index into `SamplingParams.stop`
    text_end: int | None = None
    matched_token: int | None = None


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
            return StopResult("stop", matched_token=int(token))
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
