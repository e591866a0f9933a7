"""Structured output: grammars compiled to token masks by llguidance.

A request may constrain its output with one grammar (`serving.engine.api.Grammar`): a
JSON schema (OpenAI's `response_format`, SGLang's `json_schema`, vLLM's `guided_json`;
`json_object` is the schema `{"type": "object"}`), a regular expression (`regex`,
`guided_regex`), an EBNF / GBNF or Lark grammar (`ebnf`, `guided_grammar`) or a choice
of strings (`guided_choice`). llguidance (the Rust library vLLM and SGLang offer as a
grammar backend) turns it into, at each output position, the set of tokens that keep the
output inside the grammar: a bitmask `[ceil(vocab / 32)]` int32 that the sampler applies
on the device (`cpkv_jax.sampling.mask_tokens`). It reads the checkpoint's own
`tokenizer.json`, and it needs neither torch nor transformers (xgrammar, the other
common backend, requires both).

- `GrammarBackend.check` compiles and validates a grammar (a bad one is an `InputError`
  naming the reason) into a matcher at its start, cached by (kind, source); the HTTP
  layer runs it in a worker thread, so the engine thread only copies cached matchers
  (`LLMatcher.deep_copy`, under a microsecond).
- `RowGrammar` follows one request: `fill` writes the mask of its next token, `accept`
  advances it by the token drawn, `done` says the grammar has ended (the request then
  finishes with "stop").

Masks need the token before them, so a decode step with a grammar row is built after the
previous step's tokens are known (the engine gives up the overlap for that step only).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import llguidance
import numpy as np

from cpkv_jax.errors import InputError
from cpkv_jax.sampling import mask_words
from cpkv_jax.tokenizer import TOKENIZER_FILE
from serving.engine.api import Grammar

logger = logging.getLogger(__name__)

# Compiled grammars kept per backend (JSON schemas of tools and response formats repeat).
GRAMMAR_CACHE_SIZE = 1024


class GrammarBackend:
    """llguidance over one tokenizer and model vocabulary (thread-safe: compiled grammars
    are immutable strings; each matcher belongs to one request)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]):
        eos = [int(t) for t in eos_token_ids]
        self._tok = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=eos if eos else None
        )
        self._compile = functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)(self._compile_uncached)

    def check(self, grammar: Grammar) -> None:
        """Compile `grammar` (cached), or `InputError` saying why it cannot be used."""
        self._compiled(grammar)

    def matcher(self, grammar: Grammar) -> RowGrammar:
        """A fresh matcher at the grammar's start (compiled here on a cache miss)."""
        return RowGrammar(self._compiled(grammar).deep_copy(), grammar.after)

    def _compiled(self, grammar: Grammar) -> llguidance.LLMatcher:
        # No lock: a compile never blocks the engine thread's copies of cached grammars
        # (two threads missing on one grammar at once both compile it, harmlessly).
        return self._compile(grammar.kind, grammar.source)

    def _compile_uncached(self, kind: str, source: str) -> llguidance.LLMatcher:
        try:
            if kind == "json_schema":
                text = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_LAYOUT)
            else:
                text = llguidance.grammar_from(_FORMATS[kind], source)
        except (ValueError, RuntimeError, TypeError) as e:
            raise InputError(f"{kind}: the grammar cannot be compiled: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(text, self._tok)
        if error:
            raise InputError(f"{kind}: the grammar cannot be compiled: {error}")
        matcher = llguidance.LLMatcher(self._tok, text, log_level=0)
        if matcher.is_error():
            raise InputError(f"{kind}: the grammar cannot be used: {matcher.get_error()}")
        return matcher


# JSON output laid out as Python's `json.dumps` does: `", "` and `": "` and no other
# whitespace. Flexible whitespace (llguidance's default) lets a model loop on newlines
# inside an object until max_tokens (vLLM's `disable_any_whitespace` exists for that);
# a schema's own `"x-guidance"` options still override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Our kinds -> llguidance's `grammar_from` formats.
_FORMATS = {
    "regex": "regex",
    "ebnf": "ebnf",  # GBNF (llama.cpp's) or Lark, as llguidance reads both
    "choice": "choice",
}


class RowGrammar:
    """One request's place in its grammar; with `after`, every token is allowed until
    the output has produced that token sequence (a reasoning block's end), the grammar
    applies from the next token on."""

    def __init__(self, matcher: llguidance.LLMatcher, after: Sequence[int] = ()):
        self._m = matcher
        if matcher.is_error():
            raise InputError(f"the grammar cannot be used: {matcher.get_error()}")
        self._after = tuple(int(t) for t in after)
        self._tail: list[int] = []  # the last tokens, while waiting for `after`

    @property
    def waiting(self) -> bool:
        """Still before `after`: the grammar does not apply yet."""
        return bool(self._after)

    def fill(self, row: np.ndarray) -> None:
        """Write the mask of the next token into `row` (int32 `[mask_words(vocab)]`)."""
        if self.waiting:
            row[:] = -1
            return
        # llguidance may pad its mask past the vocabulary's words: those bits name no token.
        row[:] = np.frombuffer(self._m.compute_bitmask(), np.int32)[: row.size]

    def accept(self, token: int) -> None:
        """Advance by the drawn token; `ValueError` if the grammar did not allow it (the
        engine fails that request alone)."""
        if self.waiting:
            self._tail = [*self._tail, int(token)][-len(self._after) :]
            if tuple(self._tail) == self._after:
                self._after = ()
            return
        if not self._m.consume_token(int(token)) or self._m.is_error():
            raise ValueError(f"the grammar did not allow token {token}: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar has ended: nothing more may follow."""
        return not self.waiting and self._m.is_stopped()


def row_grammar_for(backend: GrammarBackend | None, grammar: Grammar) -> RowGrammar:
    """A new request's matcher; `InputError` on a server without a tokenizer (no backend)
    or for a grammar that cannot be used."""
    if backend is None:
        raise InputError(
            "structured output (a JSON schema, regex, EBNF grammar or choice) needs the "
            "model's tokenizer.json, and this server has none"
        )
    return backend.matcher(grammar)


def token_mask(
    grammars: Sequence[RowGrammar | None], n_rows: int, vocab_size: int
) -> np.ndarray | None:
    """A step's token bitmask (`cpkv_jax.sampling.mask_tokens`) for its first
    `len(grammars)` rows: a grammar row's next allowed tokens, every token for the other
    rows and the padding; None without a grammar row."""
    if not any(grammars):
        return None
    mask = np.full((n_rows, mask_words(vocab_size)), -1, np.int32)
    for i, g in enumerate(grammars):
        if g is not None:
            g.fill(mask[i])
    return mask


def load_grammar_backend(
    model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]
) -> GrammarBackend | None:
    """The backend over `model_dir`'s `tokenizer.json`, or None without one (the server
    loaded, and so checked, the same file as its tokenizer first)."""
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        return None
    return GrammarBackend(path.read_text(encoding="utf-8"), vocab_size, eos_token_ids)
