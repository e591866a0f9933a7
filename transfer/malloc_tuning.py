"""glibc malloc settings for processes that move KV pages over gRPC.

Every gRPC page chunk allocates a few buffers of up to `MAX_MESSAGE_BYTES` (4 MiB and a
little) in Python: the serialized chunk on the sender, the received message (assembled
by grpcio from its slices) on the receiver. glibc serves large requests with a fresh
`mmap` and gives them back with `munmap` when freed (its threshold starts at 128 KiB and
adapts to what is freed, but per-thread arenas still give memory back), so the kernel
faults in and zeroes fresh 4 KiB pages for much of the chunk traffic: on the 2-core
benchmark machine page faults took ~10% of each side's CPU in a gRPC transfer (`perf`,
2026-11-30), at about 2 us each.

`tune_malloc()` raises the mmap threshold above the largest chunk (16 MiB) and lets each
malloc arena keep up to 64 MiB of freed memory (the trim threshold) instead of handing
it back, so a chunk mostly reuses the memory of the ones before. Measured on a 64K-token
GLM-5-sized request (8 layers, cp 8, 673 MB) over loopback, five interleaved rounds of
8 rooms each (2026-11-30): page faults per room 60-70K -> 28-38K (both processes
together), gRPC room time median 0.453 s -> 0.427 s (faster in every round); the
Mooncake data plane (no per-chunk buffers) did not move. Also measured, not adopted:
`glibc.malloc.arena_max=1` cut the faults to ~19K and the time by ~2% more (0.418 s),
but it makes every thread of the process share one malloc lock.

The settings are process-wide (`mallopt`) and cost memory: up to the trim threshold of
freed memory may stay with each malloc arena (glibc makes up to 8 per core); peak use is
unchanged. That is why the library never applies them by itself: process entry points
do (`serving.server.run_server` in prefill and decode modes unless
`--disable-transfer-malloc-tuning`, `benchmarks.bench_transfer`). The same settings can
be given without code as `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=16777216:
glibc.malloc.trim_threshold=67108864`. On a C library other than glibc this does
nothing and says so.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import threading

from cpkv_jax.units import MiB
from transfer.protocol import MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)

DEFAULT_MMAP_THRESHOLD_BYTES = 16 * MiB
DEFAULT_TRIM_THRESHOLD_BYTES = 64 * MiB
# mallopt parameter numbers (glibc <malloc.h>).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_lock = threading.Lock()
_applied: MallocTuning | None = None


@dataclasses.dataclass(frozen=True)
class MallocTuning:
    """What `tune_malloc` set in this process."""

    mmap_threshold_bytes: int
    trim_threshold_bytes: int

    def describe(self) -> str:
        return (
            f"glibc malloc: mmap threshold {self.mmap_threshold_bytes // MiB} MiB, "
            f"trim threshold {self.trim_threshold_bytes // MiB} MiB"
        )


def _glibc_version() -> str | None:
    """This process's glibc ("glibc 2.36"), or None under another C library."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):  # not a glibc system
        return None
    return version if version and version.startswith("glibc") else None


def _mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """glibc's `mallopt`, or None when this process's C library is not glibc."""
    if _glibc_version() is None:
        return None
    fn = getattr(ctypes.CDLL(None), "mallopt", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def tune_malloc(
    mmap_threshold_bytes: int = DEFAULT_MMAP_THRESHOLD_BYTES,
    trim_threshold_bytes: int = DEFAULT_TRIM_THRESHOLD_BYTES,
) -> MallocTuning | None:
    """Set glibc's mmap and trim thresholds for this process (see the module docstring);
    returns what was set, or None (logged) where the C library is not glibc.

    Raises `ValueError` for a threshold that would not keep a page chunk off `mmap`
    (`mmap_threshold_bytes <= MAX_MESSAGE_BYTES`), a trim threshold below the mmap
    threshold, or values glibc refuses (some versions cap the mmap threshold at 32 MiB);
    nothing is changed then. Calling again with the same values does nothing.
    """
    global _applied
    mmap_b, trim_b = int(mmap_threshold_bytes), int(trim_threshold_bytes)
    if mmap_b <= MAX_MESSAGE_BYTES:
        raise ValueError(
            f"tune_malloc: mmap threshold {mmap_b} B must exceed the largest transfer "
            f"message ({MAX_MESSAGE_BYTES} B), or every chunk is still mmapped"
        )
    if not mmap_b <= trim_b < 1 << 31:
        raise ValueError(
            f"tune_malloc: trim threshold {trim_b} B must lie in [the mmap threshold "
            f"{mmap_b} B, 2 GiB)"
        )
    want = MallocTuning(mmap_b, trim_b)
    with _lock:
        if _applied == want:
            return want
        mallopt = _mallopt()
        if mallopt is None:
            logger.info("malloc tuning skipped: this process's C library is not glibc")
            return None
        # The mmap threshold first: it is the one glibc may refuse (a cap), and then
        # nothing has changed yet.
        before = _applied
        if not mallopt(_M_MMAP_THRESHOLD, mmap_b):
            raise ValueError(f"tune_malloc: glibc refused mmap threshold {mmap_b} B")
        if not mallopt(_M_TRIM_THRESHOLD, trim_b):  # glibc accepts any trim value
            raise ValueError(f"tune_malloc: glibc refused trim threshold {trim_b} B")
        _applied = want
    logger.info("%s (was %s)", want.describe(), before.describe() if before else "glibc's default")
    return want


def current_malloc_tuning() -> MallocTuning | None:
    """What `tune_malloc` last set in this process (None: glibc's defaults)."""
    return _applied


__all__ = [
    "DEFAULT_MMAP_THRESHOLD_BYTES",
    "DEFAULT_TRIM_THRESHOLD_BYTES",
    "MallocTuning",
    "current_malloc_tuning",
    "tune_malloc",
]
