"""Helpers shared by the incremental parsers."""

from __future__ import annotations

from collections.abc import Iterable


def held_suffix(text: str, markers: Iterable[str]) -> int:
    """How many trailing characters of `text` are a proper prefix of one of `markers`
    (they might still become that marker, so a streaming parser holds them back)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def find_first(text: str, markers: Iterable[str]) -> tuple[int, str]:
    """The earliest occurrence of any of `markers` in `text`: (index, marker), or (-1, "")."""
    best, which = -1, ""
    for marker in markers:
        i = text.find(marker)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, marker
    return best, which
