"""`serving.engine.wait_queue.WaitQueue`: FIFO order, the bound, removal, wait accounting and the
`Retry-After` a refusal suggests (a fake clock, so every figure is exact)."""

from __future__ import annotations

import pytest

from serving.engine.wait_queue import RETRY_AFTER_MAX_S, QueueFullError, WaitQueue


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_fifo_bound_remove_and_wait_accounting():
    clock = Clock()
    q: WaitQueue[str] = WaitQueue(3, what="decode", clock=clock)
    for rid in ("a", "b", "c"):
        q.push(rid, rid.upper())
    assert len(q) == 3 and list(q) == ["A", "B", "C"] and q.head() == "A"
    with pytest.raises(QueueFullError, match="--max-queued-requests 3") as e:
        q.push("d", "D")
    assert e.value.retry_after_s == 1  # no wait seen yet: the minimum
    assert "d" not in q and q.stats().rejected == 1
    assert q.remove("b") == "B" and q.remove("b") is None  # a client that left
    clock.t += 4.0
    assert q.pop("a") == "A" and q.head() == "C"
    clock.t += 2.0
    assert q.pop("c") == "C" and q.head() is None
    s = q.stats()
    assert (s.length, s.limit, s.waits, s.wait_seconds, s.rejected) == (0, 3, 2, 10.0, 1)
    with pytest.raises(ValueError, match="already queued"):
        q.push("x", "X")
        q.push("x", "X")


def test_retry_after_follows_recent_waits_within_bounds():
    clock = Clock()
    q: WaitQueue[int] = WaitQueue(1, what="prefill", clock=clock)
    for wait in (10.0, 10.0, 10.0):
        q.push("r", 0)
        clock.t += wait
        q.pop("r")
    q.push("r", 0)
    with pytest.raises(QueueFullError) as e:
        q.push("s", 1)
    # EMA of three 10 s waits with weight 0.2: 2.0, 3.6, 4.88 -> 5 s
    assert e.value.retry_after_s == 5
    q.pop("r")
    for _ in range(40):
        q.push("r", 0)
        clock.t += 1000.0
        q.pop("r")
    assert q.retry_after_s() == RETRY_AFTER_MAX_S
    assert WaitQueue(None, what="x").limit is None
    with pytest.raises(ValueError, match="at least one"):
        WaitQueue(0, what="x")
