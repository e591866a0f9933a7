"""Units behind the HTTP API: streamed output text (`serving.http.text.OutputText`:
whole characters only, stop strings trimmed) and chat templates
(`serving.http.chat_template`: loading rules, refusals, the tiny checkpoint's template
against a plain-jinja2 rendering).
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from support.http_client import reference_chat_prompt

from cpkv_jax.errors import CheckpointError, InputError
from cpkv_jax.tokenizer import Tokenizer
from cpkv_jax.tools.make_tiny_checkpoint import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_byte_tokenizer,
)
from serving.http.chat_template import ChatTemplate, load_chat_template
from serving.http.text import OutputText

# ---- units: text, templates ------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return Tokenizer(build_byte_tokenizer())


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(min_size=1, max_size=40),
    cuts=st.lists(st.integers(0, 200), max_size=6),
    stop_spans=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 4)), max_size=2),
    keep=st.booleans(),
)
def test_output_text_streams_whole_characters_and_trims_stops(
    byte_tok, text, cuts, stop_spans, keep
):
    """The output ends at the first stop string to appear as the text streams in: at the
    first chunk after which one is complete, the earliest of those found (at one position
    the least), as `OutputText` picks - the engine stops generating there, so a stop that
    starts earlier but would complete later never forms. `keep`: `no_stop_trim`, that stop
    string stays."""
    # Special-token strings encode to special ids, which the output text drops (hypothesis
    # draws string literals from the source, "<|pad|>" among them): not this property.
    assume(not any(special in text for special in SPECIAL_TOKENS))
    ids = byte_tok.encode(text)
    stops = [text[a : a + n] for a, n in stop_spans if text[a : a + n]]
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    out = OutputText(byte_tok, stops, no_stop_trim=keep)
    deltas = [out.add(ids[a:b]) for a, b in itertools.pairwise(bounds)]
    deltas.append(out.finish())
    raw = text.encode()
    assert len(ids) == len(raw)  # the byte tokenizer: one id per byte
    want = text
    for b in bounds[1:]:
        seen = raw[:b].decode("utf-8", errors="ignore")  # the whole characters so far
        hits = [(seen.find(s), s) for s in stops if s in seen]
        if hits:
            first, stop = min(hits)
            want = text[: first + len(stop)] if keep else text[:first]
            break
    assert "".join(deltas) == want == out.text
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas)


def test_chat_template_loading_rules(tmp_path):
    assert load_chat_template(tmp_path) is None
    cfg = {
        "bos_token": {"content": "<s>"},
        "eos_token": "</s>",
        "chat_template": "A{{ bos_token }}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_chat_template(tmp_path).render([]) == "A<s>"
    (tmp_path / "chat_template.jinja").write_text("F{{ eos_token }}{{ messages[0].content }}")
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "x"}]) == "F</s>x"
    (tmp_path / "chat_template.jinja").unlink()
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_chat_template(tmp_path).render([]) == "D"
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="default"):
        load_chat_template(tmp_path)
    with pytest.raises(CheckpointError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_chat_template_refusals_are_input_errors():
    refuse = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    with pytest.raises(InputError, match="user first"):
        refuse.render([{"role": "assistant", "content": "x"}])
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InputError):
        escape.render([])
    assert (
        ChatTemplate(CHAT_TEMPLATE, bos_token="B", eos_token="E").render(
            [{"role": "user", "content": "q"}]
        )
        == "B<|user|>\nqE\n<|assistant|>\n"
    )


def test_tiny_checkpoint_tokenizer_config_has_the_chat_template(tokenizer_dir):
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE
    loaded = load_chat_template(tokenizer_dir)
    assert loaded is not None and loaded.bos_token == SPECIAL_TOKENS[0]
    msgs = [{"role": "user", "content": "hey"}]
    assert loaded.render(msgs) == reference_chat_prompt(msgs)


def test_a_stop_that_completes_first_ends_the_output(byte_tok):
    """Overlapping stops (found by hypothesis): "1000" starts at 4 but completes at 8;
    "00" completes at 7. Streamed in two chunks, the output ends at "00" (the engine
    stops there); in one chunk both are complete and the earlier start wins."""
    text = "01011000000000000000"
    ids = byte_tok.encode(text)
    for cuts, want in (([7], "01011"), ([], "0101")):
        out = OutputText(byte_tok, ["1000", "00"])
        bounds = [0, *cuts, len(ids)]
        deltas = [out.add(ids[a:b]) for a, b in itertools.pairwise(bounds)]
        assert "".join([*deltas, out.finish()]) == want
