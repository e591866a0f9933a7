"""Reading a compiled SPMD program's collectives from its HLO text."""

from __future__ import annotations

import re

_COLLECTIVE = re.compile(
    r"\s*(?:ROOT )?%\S+ = (.+?) (all-gather|all-to-all|reduce-scatter|all-reduce|"
    r"collective-permute)\("
)


def collectives(hlo: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """Each collective of `hlo`: its kind and the shapes of its result."""
    out = []
    for line in hlo.splitlines():
        if (m := _COLLECTIVE.match(line)) is None:
            continue
        shapes = [
            tuple(int(d) for d in dims.split(",") if d)
            for _, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        ]
        out.append((m.group(2), shapes))
    return out


def vocab_wide_collectives(hlo: str, vocab: int) -> list[tuple[str, list[tuple[int, ...]]]]:
    """The collectives of `hlo` that move an array with a `vocab`-wide last axis (logits,
    log-probs): a rank receiving rows it did not compute."""
    return [(k, s) for k, s in collectives(hlo) if any(x and x[-1] == vocab for x in s)]
