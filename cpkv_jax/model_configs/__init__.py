"""The real models' Hugging Face `config.json` files (no weights), vendored with the package.

GLM-5, GLM-5 with index top-k sharing (freq 4, skip offset 3, as GLM-5.2 ships it) and
DeepSeek-V3.2, as their public defaults define them (README.md here). Tests and the
memory / capacity benchmarks size things at real dimensions from them; nothing here
needs weights, and nothing outside the package is read.
"""

from __future__ import annotations

from pathlib import Path

CONFIGS_DIR = Path(__file__).resolve().parent
NAMES = ("glm-5", "glm-5-indexshare-freq4", "deepseek-v3.2")


def config_dir(name: str) -> Path:
    """The directory holding `name`'s `config.json` (`ValueError` for another name)."""
    if name not in NAMES:
        raise ValueError(f"no vendored model config {name!r}; known: {', '.join(NAMES)}")
    return CONFIGS_DIR / name
