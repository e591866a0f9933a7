"""`WaitQueue`: the bounded FIFO a server's requests wait in for pages and batch slots.

Backpressure, as SGLang's `--max-queued-requests`: a request that cannot start now waits
here in arrival order; only a full queue refuses one (`QueueFullError`, HTTP 503 with
`Retry-After`); a waiting request whose client leaves is removed at once (`remove`).
Each request's wait is recorded (`stats`: count, summed seconds; `/metrics`), and the
`Retry-After` a refusal suggests follows the recent waits (an exponential moving average,
so a queue that drains fast asks clients back sooner).

Engine thread only (no locks); `stats` returns an immutable snapshot.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from cpkv_jax.errors import CpkvError

T = TypeVar("T")

# Weight of the newest wait in the moving average behind `Retry-After`.
_EMA_WEIGHT = 0.2
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60


class QueueFullError(CpkvError):
    """The server's wait queue is full: retry after `retry_after_s` seconds (HTTP 503)."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclasses.dataclass(frozen=True)
class QueueStats:
    """Cumulative figures of one wait queue (`EngineStats.queue`)."""

    length: int = 0
    limit: int | None = None
    waits: int = 0  # requests that left the queue to start
    wait_seconds: float = 0.0  # their summed time in the queue
    rejected: int = 0  # refused because the queue was full


class WaitQueue(Generic[T]):
    """Requests by id, first in first out, at most `limit` (None: unbounded)."""

    def __init__(
        self, limit: int | None, *, what: str, clock: Callable[[], float] = time.monotonic
    ):
        if limit is not None and limit < 1:
            raise ValueError(f"a wait queue holds at least one request, got limit {limit}")
        self.limit = limit
        self.what = what  # "decode", "prefill": named in the refusal
        self._clock = clock
        self._items: collections.OrderedDict[str, tuple[T, float]] = collections.OrderedDict()
        self._waits = 0
        self._wait_s = 0.0
        self._rejected = 0
        self._ema_s = 0.0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, rid: object) -> bool:
        return rid in self._items

    def __iter__(self) -> Iterator[T]:
        return (item for item, _ in list(self._items.values()))

    def push(self, rid: str, item: T) -> None:
        """Queue `item`; `QueueFullError` (nothing queued) when the queue is full."""
        if rid in self._items:
            raise ValueError(f"request {rid!r} is already queued")
        if self.limit is not None and len(self._items) >= self.limit:
            self._rejected += 1
            retry = self.retry_after_s()
            raise QueueFullError(
                f"the {self.what} server's wait queue is full ({len(self._items)} requests "
                f"waiting, --max-queued-requests {self.limit}); retry in {retry} s or on "
                "another server",
                retry,
            )
        self._items[rid] = (item, self._clock())

    def head(self) -> T | None:
        """The request that starts next, or None."""
        for item, _ in self._items.values():
            return item
        return None

    def pop(self, rid: str) -> T:
        """`rid` leaves the queue to start; its wait is recorded."""
        item, since = self._items.pop(rid)
        wait = max(self._clock() - since, 0.0)
        self._waits += 1
        self._wait_s += wait
        self._ema_s += _EMA_WEIGHT * (wait - self._ema_s)
        return item

    def remove(self, rid: str) -> T | None:
        """`rid` leaves without starting (its client left, it failed); None if absent."""
        entry = self._items.pop(rid, None)
        return None if entry is None else entry[0]

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: the recent mean wait, whole seconds."""
        return int(min(max(math.ceil(self._ema_s), RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S))

    def stats(self) -> QueueStats:
        return QueueStats(
            length=len(self._items),
            limit=self.limit,
            waits=self._waits,
            wait_seconds=self._wait_s,
            rejected=self._rejected,
        )
