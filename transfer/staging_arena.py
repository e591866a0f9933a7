"""One pre-allocated host arena carved into per-room staging regions (Mooncake data plane).

The decode side of the `mooncake` backend registers ONE block of host memory with its
transfer engine at startup (registration is slow on RDMA, so it happens once) and gives
each room a region of it; prefill ranks write their pages there with one-sided engine
writes, and the receiver scatters the region into the decode pool at commit. The decode
pool itself is never registered, so an engine write can never touch it.

One-sided writes cannot be refused by the receiver: a sender that is slow, stalled or
dead may still write into a region after its room failed. So a failed room's region is
not reused at once: the receiver *quarantines* it (`quarantine`) until every sender
that was given its address has said it will write no more, or a quarantine timeout has
passed; only then is it `free`d and handed to another room.

`StagingArena` is thread-safe and knows nothing of engines or rooms beyond a tag per
region. First-fit over a sorted free list, coalesced on free; every region starts at a
multiple of `alignment` bytes from the arena base.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading

import numpy as np

from transfer.protocol import TransferError

logger = logging.getLogger(__name__)

DEFAULT_ALIGNMENT = 4096


class StagingFullError(TransferError):
    """The arena has no free range large enough now (live or quarantined rooms hold it).

    Retryable: the prefill side retries its handshake until its bootstrap timeout."""

    code = "RESOURCE_EXHAUSTED"


@dataclasses.dataclass(frozen=True)
class Region:
    """`nbytes` bytes at `offset` of an arena, lent to `tag` (a room id)."""

    offset: int
    nbytes: int
    tag: str


@dataclasses.dataclass(frozen=True)
class ArenaStats:
    total_bytes: int
    free_bytes: int
    live_bytes: int
    quarantined_bytes: int
    live_regions: int
    quarantined_regions: int
    largest_free_bytes: int


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


class StagingArena:
    """`nbytes` of host memory (`memory`, uint8) lent out as aligned `Region`s.

    `prefault=True` writes every page of the arena once, so the first transfer into a
    region does not pay the kernel's first-touch page faults.
    """

    def __init__(self, nbytes: int, *, alignment: int = DEFAULT_ALIGNMENT, prefault: bool = True):
        if nbytes <= 0:
            raise ValueError(f"a staging arena needs nbytes > 0, got {nbytes}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.alignment = alignment
        self.nbytes = _align(nbytes, alignment)
        self.memory = np.empty(self.nbytes, np.uint8)
        if prefault:
            self.memory.fill(0)
        self._lock = threading.Lock()
        self._starts: list[int] = [0]  # free ranges, sorted by start, never adjacent
        self._sizes: list[int] = [self.nbytes]
        self._live: dict[int, Region] = {}
        self._quarantined: dict[int, Region] = {}

    @property
    def address(self) -> int:
        """Address of byte 0 (what the engine registered)."""
        return int(self.memory.ctypes.data)

    def alloc(self, nbytes: int, tag: str) -> Region:
        """A free region of at least `nbytes` (rounded up to the alignment), first fit.

        Raises `StagingFullError` when no free range is large enough."""
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        size = _align(nbytes, self.alignment)
        with self._lock:
            for i, (start, free) in enumerate(zip(self._starts, self._sizes, strict=True)):
                if free >= size:
                    if free == size:
                        del self._starts[i], self._sizes[i]
                    else:
                        self._starts[i], self._sizes[i] = start + size, free - size
                    region = Region(start, size, tag)
                    self._live[start] = region
                    return region
            stats = self._stats_locked()
        raise StagingFullError(
            f"staging arena full: {tag!r} needs {size} B; {stats.free_bytes} of "
            f"{stats.total_bytes} B free (largest free range {stats.largest_free_bytes} B), "
            f"{stats.live_bytes} B in {stats.live_regions} live and "
            f"{stats.quarantined_bytes} B in {stats.quarantined_regions} quarantined region(s); "
            "retry later or start the decode receiver with a larger staging arena"
        )

    def view(self, region: Region, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """uint8 view of `nbytes` at `offset` inside `region` (the arena's own memory)."""
        n = region.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or n < 0 or offset + n > region.nbytes:
            raise ValueError(f"[{offset}, +{n}) is outside {region}")
        lo = region.offset + offset
        return self.memory[lo : lo + n]

    def quarantine(self, region: Region) -> None:
        """Keep a live region out of use (late one-sided writes may still land in it)."""
        with self._lock:
            if self._live.get(region.offset) != region:
                raise ValueError(f"{region} is not a live region of this arena")
            del self._live[region.offset]
            self._quarantined[region.offset] = region

    def is_quarantined(self, region: Region) -> bool:
        with self._lock:
            return self._quarantined.get(region.offset) == region

    def free(self, region: Region) -> None:
        """Give a live or quarantined region back (coalesced with its free neighbours)."""
        with self._lock:
            if self._live.get(region.offset) == region:
                del self._live[region.offset]
            elif self._quarantined.get(region.offset) == region:
                del self._quarantined[region.offset]
            else:
                raise ValueError(f"{region} is not a live or quarantined region of this arena")
            start, size = region.offset, region.nbytes
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and start + size == self._starts[i]:  # merge right
                size += self._sizes[i]
                del self._starts[i], self._sizes[i]
            if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:  # merge left
                self._sizes[i - 1] += size
            else:
                self._starts.insert(i, start)
                self._sizes.insert(i, size)

    def stats(self) -> ArenaStats:
        with self._lock:
            return self._stats_locked()

    @property
    def free_bytes(self) -> int:
        return self.stats().free_bytes

    def _stats_locked(self) -> ArenaStats:
        return ArenaStats(
            total_bytes=self.nbytes,
            free_bytes=sum(self._sizes),
            live_bytes=sum(r.nbytes for r in self._live.values()),
            quarantined_bytes=sum(r.nbytes for r in self._quarantined.values()),
            live_regions=len(self._live),
            quarantined_regions=len(self._quarantined),
            largest_free_bytes=max(self._sizes, default=0),
        )
