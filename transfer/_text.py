"""Short renderings of values for error and failure text (room failure reasons)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Values quoted in a failure reason; the rest is elided.
QUOTED = 8


def quote(values: np.ndarray | Sequence[int]) -> str:
    """`values` as `[a, b, ...]`: the first `QUOTED`, then `...` if there are more."""
    v = [int(x) for x in values]
    return "[" + ", ".join(map(str, v[:QUOTED])) + (", ...]" if len(v) > QUOTED else "]")
