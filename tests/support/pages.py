"""Every KV page back after a server's requests ended (the end-to-end and speculative
server tests)."""

from __future__ import annotations

import time

import numpy as np

from serving.decode.cached import CachedUnifiedEngine
from serving.prefill.engine import PrefillModeEngine
from serving.server import Server

WAIT_S = 60.0


def assert_pages_back(server: Server, timeout: float = WAIT_S) -> None:
    """Every page back: free == total (a prefill or unified server's radix cache may keep
    cached prefixes, evictable and unlocked, which count as back)."""
    engine = server.engine

    def back() -> bool:
        if engine.has_work():
            return False
        stats = engine.stats()
        if isinstance(engine, PrefillModeEngine | CachedUnifiedEngine):
            scheduler = engine.scheduler
            cache = scheduler.cache
            if scheduler.num_held or cache.protected_pages_per_lane().any():
                return False
            evictable = cache.evictable_pages_per_lane()
            free = np.asarray(stats.kv_pages_free) + (
                evictable if evictable.size == len(stats.kv_pages_free) else evictable.sum()
            )
            return bool(np.all(free == np.asarray(stats.kv_pages_total)))
        return stats.kv_pages_free == stats.kv_pages_total

    deadline = time.monotonic() + timeout
    while not back():
        what = f"{server.args.disaggregation_mode} server's pages to come back"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
