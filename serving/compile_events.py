"""XLA compiles in this process, counted from JAX's monitoring events (issue 25).

JAX records `/jax/core/compile/backend_compile_duration` once per program it hands to
XLA (a program the persistent compilation cache returns is still recorded, with the
cache's `/jax/compilation_cache/cache_hits` beside it) and nothing for a program its
in-memory jit cache already holds. `COMPILES` listens to both from the first import on;
a server marks the end of its warm-up (`mark_healthy`), and every compile after that is
one a request paid for: logged, counted in `/server_info` `xla_compiles` and
`/metrics` `cpkv_xla_compiles_total{phase="serving"}`. Compiles on the background
compiler's thread (`--warmup-background`) are their own phase, `background`: no request
waited for them unless it needed that shape (`ShapeCache.waits` counts those). The counts
are per process (tests that run several servers in one process share them).
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from jax import monitoring

from cpkv_jax.aot import BACKGROUND_THREAD

logger = logging.getLogger(__name__)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass
class CompileCounts:
    compiles: int = 0  # programs handed to XLA (persistent-cache hits included)
    seconds: float = 0.0
    cache_hits: int = 0  # of which the persistent compilation cache served


class CompileCounter:
    """Process-wide compile counts, split at the moment the server became healthy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = CompileCounts()  # every thread but the background compiler's
        self.background = CompileCounts()
        self._at_healthy: CompileCounts | None = None

    def on_duration(self, event: str, seconds: float, **_: object) -> None:
        if event != BACKEND_COMPILE_EVENT:
            return
        if threading.current_thread().name == BACKGROUND_THREAD:
            with self._lock:
                self.background.compiles += 1
                self.background.seconds += seconds
            return
        with self._lock:
            self.total.compiles += 1
            self.total.seconds += seconds
            serving = self._at_healthy is not None
            n = self.total.compiles - (self._at_healthy.compiles if serving else 0)
        if serving:
            logger.info(
                "XLA compile while serving (%.2fs; %d since the server became healthy): a "
                "request reached a shape the warm-up did not compile",
                seconds,
                n,
            )

    def on_event(self, event: str, **_: object) -> None:
        if event == CACHE_HIT_EVENT:
            counts = (
                self.background
                if threading.current_thread().name == BACKGROUND_THREAD
                else self.total
            )
            with self._lock:
                counts.cache_hits += 1

    def mark_healthy(self) -> None:
        with self._lock:
            self._at_healthy = dataclasses.replace(self.total)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """`{"startup": counts, "serving": counts, "background": counts}` (serving: since
        `mark_healthy`, on every thread but the background compiler's)."""
        with self._lock:
            total = dataclasses.replace(self.total)
            start = dataclasses.replace(self._at_healthy or total)
            background = dataclasses.replace(self.background)
        serving = CompileCounts(
            total.compiles - start.compiles,
            total.seconds - start.seconds,
            total.cache_hits - start.cache_hits,
        )
        return {
            "startup": dataclasses.asdict(start),
            "serving": dataclasses.asdict(serving),
            "background": dataclasses.asdict(background),
        }


COMPILES = CompileCounter()
monitoring.register_event_duration_secs_listener(COMPILES.on_duration)
monitoring.register_event_listener(COMPILES.on_event)
