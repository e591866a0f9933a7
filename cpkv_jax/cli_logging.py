"""Logging setup shared by the command-line entry points (library code only logs)."""

from __future__ import annotations

import logging

# Backend probing lines (no TPU, no GPU plugin) are noise on every CPU run.
_QUIET = ("jax._src.xla_bridge", "absl")


def configure_logging(level: str | int = "INFO") -> None:
    """Root handler at `level`; `force` because importing orbax/absl installs one early."""
    if isinstance(level, str):
        level = level.upper()
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
