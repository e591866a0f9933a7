"""What every device benchmark records about where it ran, and how it prints its result."""

from __future__ import annotations

import json
import os
from typing import Any

import jax


def environment() -> dict[str, Any]:
    """Backend, device kind, JAX version, XLA flags and default matmul precision."""
    return {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
    }


def emit(report: dict[str, Any], json_path: str | None) -> None:
    """Print `report` as one JSON line on stdout; also write it (indented) to `json_path`."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))
