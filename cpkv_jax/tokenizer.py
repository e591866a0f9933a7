"""Text <-> token ids through a checkpoint's `tokenizer.json` (HF `tokenizers`)."""

from __future__ import annotations

from pathlib import Path

import tokenizers

from cpkv_jax.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    """A thin wrapper: ids without added special tokens, decode drops special tokens."""

    def __init__(self, tok: tokenizers.Tokenizer) -> None:
        self._tok = tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(model_path: str | Path) -> Tokenizer | None:
    """The tokenizer in `model_path/tokenizer.json`, or None when there is no such file."""
    path = Path(model_path) / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        return Tokenizer(tokenizers.Tokenizer.from_file(str(path)))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise CheckpointError(f"{path} is not a valid tokenizers file: {e}") from e
