"""JAX's persistent compilation cache for `cpkv-serve` (issue 25, item 3).

Every program a server compiles (warm-up and first use alike) is written to
`--compilation-cache-dir` and read back by the next start of the same configuration, so
a restart skips XLA compiles it has done before. JAX keys each entry on the program's
HLO, the compile options, the backend and device kind and the JAX / jaxlib versions:
another model, flag set or machine gets other entries, never a wrong one.

- `auto` (the default): `$XDG_CACHE_HOME/cpkv-jax/jax-compilation-cache` (else
  `~/.cache/...`); `none`: off; anything else: that directory. (It was off by default
  for a day after a test process segfaulted inside a cache write: the cause was the
  process's memory maps reaching `vm.max_map_count`, XLA:CPU maps ~17 per program;
  tests/conftest.py now frees programs between test modules.)
- Every program is cached, however quick its compile (JAX's default skips those under
  a second; a server compiles hundreds of small ones).
- The directory is bounded (`MAX_BYTES`, least recently used entries evicted). That
  also puts every read and write under JAX's file lock: without a bound JAX writes an
  entry in place, and a second process on the same directory (two servers on one host,
  the test workers) could read it half written.
- Applied process-wide by `run_server` before anything compiles; `build_server` used
  directly (tests, embedding) leaves JAX's configuration alone.
- Entries are zstd-compressed (`zstandard` is a dependency: JAX falls back to zlib
  without it, 9x slower per write). Entries of the other codec, left by an earlier
  install, are removed at startup: JAX cannot read them and never overwrites an entry,
  so each would cost a warning and a compile at every start.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

AUTO = "auto"
MAX_BYTES = 16 << 30
_ENTRY_SUFFIX = "-cache"  # JAX's entry files; "-atime" files beside them track use
_ATIME_SUFFIX = "-atime"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame's first bytes (RFC 8878)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cpkv-jax" / "jax-compilation-cache"


def resolve_cache_dir(value: str | None) -> Path | None:
    """The directory `--compilation-cache-dir VALUE` means (None: off)."""
    if value is None or value.lower() == "none":
        return None
    if value == AUTO:
        return default_cache_dir()
    return Path(value).expanduser()


def cache_summary(path: Path) -> tuple[int, int]:
    """(entries, bytes) in the cache directory now."""
    entries = size = 0
    for f in path.iterdir():
        if f.is_file() and f.name.endswith(_ENTRY_SUFFIX):
            entries += 1
            size += f.stat().st_size
    return entries, size


def jax_cache_codec() -> str:
    """The codec JAX compresses cache entries with (`jax._src.compilation_cache`): zstd
    when Python's `compression.zstd` (3.14+) or `zstandard` imports, else zlib."""
    for module in ("compression.zstd", "zstandard"):
        try:
            if importlib.util.find_spec(module) is not None:
                return "zstd"
        except ModuleNotFoundError:  # `compression` itself missing before 3.14
            continue
    return "zlib"


def drop_foreign_entries(path: Path, codec: str) -> int:
    """Remove the entries (and their use-time files) that another codec than `codec`
    wrote; returns how many. JAX reads such an entry as an error and never replaces it."""
    removed = 0
    for f in path.iterdir():
        if not (f.is_file() and f.name.endswith(_ENTRY_SUFFIX)):
            continue
        try:
            with f.open("rb") as fh:
                head = fh.read(len(_ZSTD_MAGIC))
        except OSError:  # evicted by another process meanwhile
            continue
        if not head or (head == _ZSTD_MAGIC) == (codec == "zstd"):
            continue
        key = f.name.removesuffix(_ENTRY_SUFFIX)
        f.unlink(missing_ok=True)
        (path / f"{key}{_ATIME_SUFFIX}").unlink(missing_ok=True)
        removed += 1
    return removed


def enable_compilation_cache(value: str | None) -> str | None:
    """Point JAX's persistent cache at `value`'s directory; returns the directory (for
    `/server_info`), None when off. A directory that cannot be created is logged and
    the server runs without the cache (it only costs compile time)."""
    path = resolve_cache_dir(value)
    if path is None:
        logger.info("compilation cache: off (--compilation-cache-dir none)")
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        logger.warning("compilation cache disabled: cannot create %s: %s", path, e)
        return None
    codec = jax_cache_codec()
    if removed := drop_foreign_entries(path, codec):
        logger.warning(
            "compilation cache: removed %d entries of %s not written with %s (an earlier "
            "install's); their programs compile once again", removed, path, codec,
        )  # fmt: skip
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    entries, size = cache_summary(path)
    logger.info(
        "compilation cache: %s (%d entries, %.1f MiB already there)", path, entries, size / 2**20
    )
    return str(path)
