"""Client-visible text of an output: incremental detokenization that never emits a partial
UTF-8 character, and stop-string trimming with OpenAI semantics (the stop string and what
follows it are not returned; while streaming, the last `len(longest stop) - 1` characters
are held back until they cannot start a stop string). A stop token (EOS, `stop_token_ids`)
that ends the output is not in the text either. `no_stop_trim` (SGLang; vLLM's
`include_stop_str_in_output`) keeps the stop string or token; `skip_special_tokens=False`
keeps special tokens in the text (both as SGLang and vLLM do).
"""

from __future__ import annotations

from collections.abc import Sequence

from cpkv_jax.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Token ids -> text, one token at a time, never emitting a partial UTF-8 character.

    The window algorithm of TGI / vLLM: decode `ids[prefix:]` and `ids[prefix:read]`; the
    difference is new text once it does not end in U+FFFD (a character split across
    tokens). Decoding from a recent `prefix` keeps it O(window) per token and lets
    tokenizers that drop leading spaces decode a word's continuation correctly.
    `offsets[i]` is the length of `text` before token `i` contributed to it.
    """

    def __init__(self, tokenizer: Tokenizer | None, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.offsets: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def add(self, ids: Sequence[int]) -> None:
        for t in ids:
            self.offsets.append(len(self.text))
            self.ids.append(t)
            self._advance(final=False)

    def flush(self) -> None:
        """At the end of the output: emit what is pending even if it is incomplete."""
        self._advance(final=True)

    def add_without_text(self, token_id: int) -> None:
        """After `flush`: a last token that is an output id but no part of the text."""
        self.offsets.append(len(self.text))
        self.ids.append(token_id)
        self._prefix = self._read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        assert self._tok is not None
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)

    def _advance(self, *, final: bool) -> None:
        if self._tok is None or self._read == len(self.ids):
            return
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(REPLACEMENT_CHAR)):
            self.text += new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)

    def token_text(self, token_id: int) -> str:
        """One token on its own (special tokens kept), for log-prob listings."""
        if self._tok is None:
            return f"token_id:{token_id}"
        return self._tok.decode([token_id], skip_special_tokens=False)


class OutputText:
    """The client-visible text of one output: decoded, trimmed at the first stop string.

    `add` returns the text that became safe to send (for streams); `text` is all the text
    released so far. `matched` is the stop string that ended the output, if any.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        stop: Sequence[str],
        *,
        skip_special_tokens: bool = True,
        no_stop_trim: bool = False,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._keep_stop = no_stop_trim
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._sent = 0
        self._cut: int | None = None
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """The text released so far (all of it, trimmed, once `finish` ran)."""
        return self.detok.text[: self._sent]

    def add(self, ids: Sequence[int]) -> str:
        self.detok.add(ids)
        return self._delta(final=False)

    def finish(self, stop_token: int | None = None) -> str:
        """The rest of the text. `stop_token`: the output ended on that stop token, which
        is the last output id but in the text only with `no_stop_trim`."""
        if stop_token is not None and self._keep_stop:
            self.detok.add([stop_token])
            stop_token = None
        self.detok.flush()
        if stop_token is not None:
            self.detok.add_without_text(stop_token)
        return self._delta(final=True)

    def _delta(self, *, final: bool) -> str:
        full = self.detok.text
        if self._cut is None and self._stop:
            # No stop string can start before `_sent`: the held-back tail covers it.
            hits = [(i, s) for s in self._stop if (i := full.find(s, self._sent)) >= 0]
            if hits:
                self._cut, self.matched = min(hits)
                if self._keep_stop:
                    self._cut += len(self.matched)
        if self._cut is not None:
            limit = self._cut
        elif final:
            limit = len(full)
        else:
            limit = max(self._sent, len(full) - self._hold)
        delta = full[self._sent : limit]
        self._sent = max(self._sent, limit)
        return delta
