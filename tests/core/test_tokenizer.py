"""The byte-level tiny tokenizer and `load_tokenizer`."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cpkv_jax.errors import CheckpointError
from cpkv_jax.tokenizer import Tokenizer, load_tokenizer
from cpkv_jax.tools.make_tiny_checkpoint import SPECIAL_TOKENS, build_byte_tokenizer
from cpkv_jax.tools.tiny_config import tiny_config_dict


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    build_byte_tokenizer().save(str(path / "tokenizer.json"))
    loaded = load_tokenizer(path)
    assert loaded is not None
    return loaded


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "héllo wörld",
        "你好，世界",
        "emoji 🙂👍🏽",
        "  lead\ttab\nnew line \r\n",
        "\x00\x7f",
        "",
    ],
)
def test_round_trip_is_bytes_plus_three(tok, text):
    ids = tok.encode(text)
    assert ids == [3 + b for b in text.encode("utf-8")]
    assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(tok, text):
    # Special-token strings in text become their special ids (as HF tokenizers do), which
    # decode drops: covered by the next test. (Hypothesis draws literals from the source,
    # so it does produce "<|pad|>".)
    assume(not any(special in text for special in SPECIAL_TOKENS))
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("special_id", range(len(SPECIAL_TOKENS)))
def test_special_token_text_encodes_to_its_id_and_decode_drops_it(tok, special_id):
    text = f"a{SPECIAL_TOKENS[special_id]}b"
    ids = tok.encode(text)
    assert ids == [3 + ord("a"), special_id, 3 + ord("b")]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_match_tiny_config(tok):
    cfg = tiny_config_dict()
    assert tok.token_to_id("<|bos|>") == cfg["bos_token_id"] == 0
    assert tok.token_to_id("<|eos|>") == cfg["eos_token_id"] == 1
    assert tok.token_to_id("<|pad|>") == cfg["pad_token_id"] == 2
    assert tok.vocab_size == 259 <= cfg["vocab_size"]
    assert tok.decode([0, 3 + ord("a"), 1]) == "a"
    assert tok.decode([0, 3 + ord("a"), 1], skip_special_tokens=False) == "<|bos|>a<|eos|>"


def test_load_tokenizer_absent_or_broken(tmp_path):
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="not a valid tokenizers file"):
        load_tokenizer(tmp_path)
