"""Structured output: `serving.grammar` (llguidance) and the device mask it feeds.

The tiny checkpoint's tokenizer is byte-level (byte `b` is token `3 + b`, EOS is 1) and
the tiny model's vocabulary (320) is wider than the tokenizer's (259): the tokens past
the tokenizer are never allowed. The mask's bit layout (32 tokens per int32 word, lowest
bit first) is checked against NumPy's own bit unpacking; the draws against a float64
argmax over the allowed set.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import numpy as np
import pytest

from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import InputError
from cpkv_jax.sampling import RowSampling, mask_tokens, mask_words, sample
from serving.engine.api import Grammar
from serving.grammar import load_grammar_backend, row_grammar_for, token_mask

VOCAB = 320  # the tiny config's
EOS = 1


@pytest.fixture(scope="module")
def backend(tiny_checkpoints):
    path = tiny_checkpoints("glm_moe_dsa")
    cfg = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    assert cfg.vocab_size == VOCAB and cfg.eos_token_ids == (EOS,)
    return load_grammar_backend(path, VOCAB, cfg.eos_token_ids)


def allowed(mask_row: np.ndarray) -> np.ndarray:
    """Token ids whose bit is set (NumPy's little-endian bit order: bit k of word w is
    token 32 w + k)."""
    bits = np.unpackbits(mask_row.astype("<i4").view(np.uint8), bitorder="little")
    return np.nonzero(bits[:VOCAB])[0]


def byte_token(ch: str) -> int:
    return 3 + ord(ch)


def walk(backend, grammar: Grammar, text: str) -> list[np.ndarray]:
    """Feed `text` byte by byte; the allowed set before each byte (each byte allowed)."""
    g = backend.matcher(grammar)
    row = np.zeros(mask_words(VOCAB), np.int32)
    seen = []
    for ch in text:
        g.fill(row)
        seen.append(allowed(row))
        assert byte_token(ch) in seen[-1], (text, ch)
        g.accept(byte_token(ch))
    g.fill(row)
    seen.append(allowed(row))
    return seen


def test_a_regex_allows_exactly_its_next_bytes_and_ends(backend):
    seen = walk(backend, Grammar("regex", "[ab]c{2}"), "acc")
    assert set(seen[0]) == {byte_token("a"), byte_token("b")}
    assert set(seen[1]) == {byte_token("c")}
    g = backend.matcher(Grammar("regex", "[ab]c{2}"))
    for ch in "bcc":
        assert not g.done
        g.accept(byte_token(ch))
    assert g.done  # nothing can follow: the engine stops the request here
    with pytest.raises(ValueError, match="did not allow token"):
        backend.matcher(Grammar("regex", "[ab]c{2}")).accept(byte_token("z"))
    assert all(t < 259 or t == EOS for s in seen for t in s)  # never a token past the tokenizer


def test_json_schema_choice_and_ebnf_compile_and_constrain(backend):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    seen = walk(backend, Grammar("json_schema", json.dumps(schema)), '{"n": 12, "ok": true}')
    assert set(seen[0]) == {byte_token("{")}
    walk(backend, Grammar("choice", json.dumps(["yes", "no"])), "no")
    seen = walk(backend, Grammar("ebnf", 'root ::= "x" [0-9]+'), "x42")
    assert byte_token("x") in seen[0] and byte_token("y") not in seen[0]


@pytest.mark.parametrize(
    "grammar, why",
    [
        (Grammar("json_schema", '{"type": 5}'), "type must be a string"),
        (Grammar("regex", "(unclosed"), "regex"),
        (Grammar("ebnf", "root ::= undefined_rule"), "ebnf"),
    ],
)
def test_a_bad_grammar_is_an_input_error_naming_it(backend, grammar, why):
    with pytest.raises(InputError, match=why):
        backend.check(grammar)
    with pytest.raises(InputError, match=grammar.kind):
        row_grammar_for(backend, grammar)


def test_without_a_tokenizer_a_grammar_is_refused():
    with pytest.raises(InputError, match="needs the model's tokenizer.json"):
        row_grammar_for(None, Grammar("regex", "a"))


def test_the_step_mask_leaves_other_rows_and_padding_open(backend):
    g = backend.matcher(Grammar("regex", "q"))
    mask = token_mask([None, g, None], 4, VOCAB)
    assert mask.shape == (4, mask_words(VOCAB)) and mask.dtype == np.int32
    assert (mask[[0, 2, 3]] == -1).all()
    assert list(allowed(mask[1])) == [byte_token("q")]
    assert token_mask([None, None], 2, VOCAB) is None


def test_mask_tokens_matches_the_bit_layout_and_the_draw_stays_inside():
    """Random masks with set bits on every word edge (tokens 31, 32, 63, 64 and the
    vocabulary's last): the device mask keeps exactly the allowed tokens, at their own
    values; greedy picks the float64 argmax among them, a sampled row only draws them,
    and the chosen token's reported log-prob is the model's."""
    rng = np.random.default_rng(3)
    rows, vocab = 5, VOCAB
    mask = rng.integers(-(2**31), 2**31, (rows, mask_words(vocab)), dtype=np.int64)
    mask = mask.astype(np.int32)
    mask[0] = 0
    for t in (31, 32, 63, 64, vocab - 1):
        mask[0, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    got_lp, got_logits = (np.asarray(a) for a in mask_tokens(lp, logits, mask))
    for i in range(rows):
        keep = np.zeros(vocab, bool)
        keep[allowed(mask[i]) if i else [31, 32, 63, 64, vocab - 1]] = True
        if i == 0:
            assert set(allowed(mask[0])) == {31, 32, 63, 64, vocab - 1}
        np.testing.assert_array_equal(got_lp[i][keep], lp[i][keep])
        assert np.isneginf(got_lp[i][~keep]).all() and np.isneginf(got_logits[i][~keep]).all()
    greedy = sample(lp, [RowSampling()] * rows, token_mask=mask)
    want = [int(np.argmax(np.where(np.isfinite(got_lp[i]), lp[i].astype(np.float64), -np.inf)))
            for i in range(rows)]  # fmt: skip
    assert greedy.tokens.tolist() == want
    np.testing.assert_array_equal(greedy.logprobs, lp[np.arange(rows), want])
    hot = [RowSampling(temperature=5.0, seed=s, step=7) for s in range(rows)]
    for draw in range(20):
        drawn = sample(lp, [dataclasses.replace(r, step=draw) for r in hot], token_mask=mask)
        assert all(np.isfinite(got_lp[i, t]) for i, t in enumerate(drawn.tokens))


def test_a_regex_output_text_matches(backend):
    """The engine-facing loop in miniature: draw greedily from random log-probs under the
    mask, feed each token back, stop when the grammar ends; the text matches."""
    rng = np.random.default_rng(9)
    pattern = r"[0-9]{2}-[a-c]+;"
    g = backend.matcher(Grammar("regex", pattern))
    out = []
    while not g.done and len(out) < 40:
        mask = token_mask([g], 1, VOCAB)
        lp = np.asarray(jax.nn.log_softmax(rng.normal(size=(1, VOCAB)).astype(np.float32)))
        tok = int(sample(lp, [RowSampling()], token_mask=mask).tokens[0])
        g.accept(tok)
        out.append(tok)
    text = bytes(t - 3 for t in out).decode()
    assert g.done and re.fullmatch(pattern, text), text
