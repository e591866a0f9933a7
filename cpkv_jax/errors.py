"""Typed errors raised by cpkv_jax.

Every error says what was wrong, with which value, and what to do about it, so that a
bad config or checkpoint never surfaces as a traceback from deep inside JAX.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import numpy as np

QUOTED = 8  # values an error message quotes; the rest is elided


def name_flags(message: str, flags: Mapping[str, str]) -> str:
    """Library errors name parameters in backticks (`cp_size`); a command line says the
    flag its user typed instead (`flags`: parameter -> flag; other names stay)."""
    return re.sub(r"`([a-z][a-z0-9_]*)`", lambda m: flags.get(m.group(1), m.group(0)), message)


def quote(values: np.ndarray | Iterable[int], limit: int = QUOTED) -> str:
    """`values` as `[a, b, ...]` for an error message: the first `limit`, then `...`."""
    v = [int(x) for x in values]
    return "[" + ", ".join(map(str, v[:limit])) + (", ...]" if len(v) > limit else "]")


class CpkvError(Exception):
    """Base class of every error cpkv_jax raises on purpose."""


class ConfigError(CpkvError, ValueError):
    """A model or runtime configuration is missing a field or is inconsistent."""


class UnknownModelTypeError(ConfigError):
    """`config.json` names a `model_type` this package does not implement."""


class CheckpointError(CpkvError):
    """A checkpoint is missing a tensor, has a wrong shape, or cannot be read."""


class InputError(CpkvError, ValueError):
    """A request's input cannot be served (empty, too long, out-of-vocabulary ids)."""


class CacheCapacityError(CpkvError):
    """The paged KV pool has no free page left for a request."""
