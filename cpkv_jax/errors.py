"""Typed errors raised by cpkv_jax.

Every error says what was wrong, with which value, and what to do about it, so that a
bad config or checkpoint never surfaces as a traceback from deep inside JAX.
"""

from __future__ import annotations


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
