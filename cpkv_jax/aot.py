"""Ahead-of-time compiled executables of one jitted step, one per shape key (issue 25).

A server's model steps (the CP prefill step, the decode engine's steps) dispatch through
a `ShapeCache` instead of jit's own cache: `get(key, lower)` returns the executable of
`key`, compiling it with `lower().compile()` the first time. Each key compiles exactly
once in the process: a thread that needs a key another thread is compiling waits for
that compile (and counts as a wait) instead of starting a second one. That is what lets
a server compile its later buckets in the background while it serves
(`BackgroundCompiler`): a request that reaches a shape still compiling blocks on it.

`lower` lowers on abstract inputs (`abstract`: `jax.ShapeDtypeStruct` with the real
shardings), so compiling never touches, donates or waits for a live buffer.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

import jax

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)

_ALL: weakref.WeakSet[ShapeCache] = weakref.WeakSet()

BACKGROUND_THREAD = "background-compile"  # its compiles are no request's (compile counts)


def clear_all() -> None:
    """Drop every live `ShapeCache`'s executables (each compiles again on next use):
    `jax.clear_caches()` for these, for a process that must return XLA's memory."""
    for cache in list(_ALL):
        cache.clear()


def abstract(tree: Any) -> Any:
    """`tree` with every array replaced by its `ShapeDtypeStruct` (sharding kept)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


@dataclasses.dataclass
class _Entry:
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    compiled: jax.stages.Compiled | None = None
    error: BaseException | None = None
    seconds: float = 0.0


class ShapeCache(Generic[K]):
    """The executables of one jitted function by shape key (see the module docstring).

    `name` labels the log lines. A compile that raises is not kept: the error goes to
    every caller waiting on it, and the next `get` of that key tries again.
    """

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._entries: dict[K, _Entry] = {}
        self.waits = 0  # gets that blocked on another thread's compile of their key
        self.compiles = 0  # compiles run (since the last `clear`): one per key, never two
        self.compile_seconds = 0.0
        _ALL.add(self)

    def clear(self) -> None:
        """Forget the finished executables and the counts (a compile in progress finishes
        as usual and is counted)."""
        with self._lock:
            self._entries = {k: e for k, e in self._entries.items() if not e.done.is_set()}
            self.waits = self.compiles = 0
            self.compile_seconds = 0.0

    def __contains__(self, key: K) -> bool:
        with self._lock:
            entry = self._entries.get(key)
        return entry is not None and entry.done.is_set() and entry.compiled is not None

    def compiled_keys(self) -> set[K]:
        """Keys whose executable is ready."""
        with self._lock:
            entries = dict(self._entries)
        return {k for k, e in entries.items() if e.done.is_set() and e.compiled is not None}

    def estimate(self, keys: set[K]) -> tuple[int, float]:
        """How many of `keys` are not compiled yet, and the seconds they would take at
        the mean of this cache's compiles so far (0 before the first: unknown)."""
        with self._lock:
            mean = self.compile_seconds / self.compiles if self.compiles else 0.0
        left = len(set(keys) - self.compiled_keys())
        return left, left * mean

    def get(self, key: K, lower: Callable[[], jax.stages.Lowered]) -> jax.stages.Compiled:
        """The executable of `key`: compiled now by `lower().compile()`, or the one
        another thread compiled or is compiling (then this waits for it)."""
        with self._lock:
            entry = self._entries.get(key)
            owner = entry is None
            if owner:
                entry = self._entries[key] = _Entry()
        if not owner:
            if not entry.done.is_set():
                with self._lock:
                    self.waits += 1
                logger.info("%s %s: waiting for its compile on another thread", self.name, key)
                entry.done.wait()
            if entry.error is not None:
                raise entry.error
            assert entry.compiled is not None
            return entry.compiled
        t0 = time.perf_counter()
        try:
            entry.compiled = lower().compile()
        except BaseException as e:
            entry.error = e
            with self._lock:
                del self._entries[key]  # the next caller tries again
            raise
        finally:
            entry.seconds = time.perf_counter() - t0
            entry.done.set()
        with self._lock:
            self.compiles += 1
            self.compile_seconds += entry.seconds
        logger.info("%s %s compiled in %.2fs", self.name, key, entry.seconds)
        return entry.compiled


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """One program for the background compiler: `compile()` compiles it (a
    `ShapeCache.get`, so a request that needs it meanwhile waits instead of compiling)."""

    label: str
    compile: Callable[[], object]


class BackgroundCompiler:
    """Compiles `jobs` in order on one daemon thread while the server serves.

    A job that fails is logged and skipped (a request that needs that shape compiles it
    itself). `close` stops after the compile in progress. `progress()` is what
    `/server_info` shows.
    """

    def __init__(self, jobs: Sequence[CompileJob]):
        self.jobs = list(jobs)
        self._done = 0
        self._failed = 0
        self._seconds = 0.0
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name=BACKGROUND_THREAD, daemon=True)

    def start(self) -> BackgroundCompiler:
        if self.jobs:
            self._thread.start()
        else:
            self._finished.set()
        return self

    def progress(self) -> dict[str, Any]:
        return {
            "programs": len(self.jobs),
            "compiled": self._done,
            "failed": self._failed,
            "seconds": round(self._seconds, 3),
            "finished": self._finished.is_set(),
        }

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every job ran (or `close`); True when finished."""
        return self._finished.wait(timeout)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            for i, job in enumerate(self.jobs):
                if self._stop.is_set():
                    logger.info("background compile stopped after %d of %d", i, len(self.jobs))
                    return
                t = time.perf_counter()
                try:
                    job.compile()
                except Exception:
                    self._failed += 1
                    logger.exception("background compile of %s failed", job.label)
                    continue
                self._done += 1
                self._seconds = time.perf_counter() - t0
                logger.info(
                    "background compile %d/%d: %s (%.2fs)",
                    i + 1,
                    len(self.jobs),
                    job.label,
                    time.perf_counter() - t,
                )
            logger.info(
                "background compile finished: %d programs in %.1fs (%d failed)",
                self._done,
                time.perf_counter() - t0,
                self._failed,
            )
        finally:
            self._seconds = time.perf_counter() - t0
            self._finished.set()
