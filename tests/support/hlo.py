"""Reading a compiled SPMD program's collectives from its HLO text."""

from __future__ import annotations

import re

_COLLECTIVE = re.compile(
    r"\s*(?:ROOT )?%\S+ = (.+?) (all-gather|all-to-all|reduce-scatter|all-reduce|"
    r"collective-permute)\("
)


Collective = tuple[str, list[tuple[str, tuple[int, ...]]], str]
"""(kind, the (dtype, shape) of each array of its result, the op's `op_name` or "")."""


def collectives(hlo: str) -> list[Collective]:
    """Each collective of `hlo`: its kind, its result's arrays and where it came from."""
    out = []
    for line in hlo.splitlines():
        if (m := _COLLECTIVE.match(line)) is None:
            continue
        arrays = [
            (dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        ]
        name = re.search(r'op_name="([^"]*)"', line)
        out.append((m.group(2), arrays, name[1] if name else ""))
    return out


def vocab_wide_collectives(hlo: str, vocab: int) -> list[Collective]:
    """The collectives of `hlo` that move an array with a `vocab`-wide last axis (logits,
    log-probs): a rank receiving rows it did not compute."""
    return [c for c in collectives(hlo) if any(s and s[-1] == vocab for _, s in c[1])]
