"""The reference generator under a grammar: the tokens it may draw at each step come
from a fresh llguidance matcher fed the output so far (independent of the engines'
matchers), applied in float64 (`ReferenceGenerator.generate(allowed=...)`)."""

from __future__ import annotations

import numpy as np

from cpkv_jax.generate import GenerationResult, ReferenceGenerator
from cpkv_jax.sampling import mask_words
from serving.engine.api import Grammar
from serving.grammar import GrammarBackend

# A regex and a JSON schema whose outputs are short whatever the (random) model prefers:
# the request ends with the grammar, well within a few dozen tokens.
BOUNDED_REGEX = r"[a-d]{2}[0-9]{1,3}!"
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["x", "yz"]},
    },
    "required": ["id", "tag"],
    "additionalProperties": False,
}


def grammar_reference(
    ref: ReferenceGenerator,
    backend: GrammarBackend,
    grammar: Grammar,
    prompt: list[int] | tuple[int, ...],
    max_new_tokens: int,
    **kw,
) -> GenerationResult:
    vocab = ref.cfg.vocab_size

    def allowed(out: list[int]) -> np.ndarray | None:
        m = backend.matcher(grammar)
        for t in out:
            m.accept(t)
        if m.done:
            return None
        row = np.zeros(mask_words(vocab), np.int32)
        m.fill(row)
        return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab].astype(bool)

    return ref.generate(prompt, max_new_tokens, allowed=allowed, **kw)
