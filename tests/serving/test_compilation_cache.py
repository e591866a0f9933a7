"""`--compilation-cache-dir` (issue 25, item 3): JAX's persistent cache, on by default.

The cache configuration is process-wide, so the compile check runs in a child process:
a program compiled there lands in the directory, and a second process finds it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zlib

import zstandard

from serving.compilation_cache import (
    default_cache_dir,
    drop_foreign_entries,
    jax_cache_codec,
    resolve_cache_dir,
)
from serving.server_args import ServerArgs

CHILD = """
import json, sys, time
import jax, jax.numpy as jnp
from serving.compilation_cache import enable_compilation_cache
got = enable_compilation_cache(sys.argv[1])
f = jax.jit(lambda x: jnp.tanh(x @ x.T) * 3.0)
f(jnp.ones((8, 8))).block_until_ready()
print(json.dumps({"dir": got}))
"""


def test_cache_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "cpkv-jax" / "jax-compilation-cache"
    assert resolve_cache_dir("auto") == default_cache_dir()
    assert resolve_cache_dir("none") is None and resolve_cache_dir(None) is None
    assert resolve_cache_dir(str(tmp_path / "x")) == tmp_path / "x"
    assert ServerArgs.from_cli(["--model-path", "m"]).compilation_cache_dir == "auto"
    off = ServerArgs.from_cli(["--model-path", "m", "--compilation-cache-dir", "none"])
    assert off.compilation_cache_dir is None


def test_compiled_programs_land_in_the_cache_and_are_found_again(tmp_path):
    cache = tmp_path / "jcc"

    def child() -> dict:
        r = subprocess.run(
            [sys.executable, "-c", CHILD, str(cache)],
            capture_output=True,
            text=True,
            timeout=120,
            env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    assert child()["dir"] == str(cache)
    entries = sorted(p.name for p in cache.iterdir())
    assert any(name.startswith("jit__lambda") for name in entries), entries
    child()  # the same program again: read from the cache, nothing new written
    assert sorted(p.name for p in cache.iterdir()) == entries


def test_entries_of_the_other_codec_are_removed_with_their_use_times(tmp_path):
    """JAX compresses entries with zstd (`zstandard` is a dependency); an entry an earlier
    install wrote with zlib cannot be read and would never be replaced, so startup
    removes it (and its `-atime` file) and keeps the others."""
    assert jax_cache_codec() == "zstd"
    payload = bytes(range(256)) * 64
    (tmp_path / "old-cache").write_bytes(zlib.compress(payload))
    (tmp_path / "old-atime").write_bytes(b"12345678")
    (tmp_path / "new-cache").write_bytes(zstandard.ZstdCompressor().compress(payload))
    (tmp_path / "new-atime").write_bytes(b"12345678")
    (tmp_path / ".lockfile").write_bytes(b"")
    assert drop_foreign_entries(tmp_path, "zstd") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lockfile", "new-atime", "new-cache"]
    assert drop_foreign_entries(tmp_path, "zstd") == 0
    assert drop_foreign_entries(tmp_path, "zlib") == 1  # and the other way round
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lockfile"]
