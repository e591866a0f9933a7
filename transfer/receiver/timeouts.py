"""Room timeouts (`TransferTimeouts`): why a live room is past one, failing the rooms that
are, and the thread that polls for them (`Receiver.start`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from cpkv_jax.errors import quote
from transfer.protocol import RoomState, TransferTimeouts
from transfer.receiver.rooms import RoomTable, _Room

logger = logging.getLogger(__name__)


def timeout_reason(r: _Room, now: float, t: TransferTimeouts) -> str:
    """Why the live room `r` is past a timeout at `now` (room lock held), or "".

    Bootstrap: not every sender handshaken in time; heartbeat: a handshaken sender that
    has not committed went silent; waiting: no page in time after the handshakes.
    """
    waiting_for = [i for i, s in enumerate(r.senders) if not s.handshaken]
    silent = [
        i
        for i, s in enumerate(r.senders)
        if s.handshaken and s.committed is None and now - s.last_seen > t.heartbeat
    ]
    if waiting_for and now - r.registered_at > t.bootstrap:
        return (
            f"bootstrap timeout: prefill rank(s) {quote(waiting_for)} did not "
            f"handshake within {t.bootstrap:g}s"
        )
    if silent:
        return (
            f"heartbeat timeout: prefill rank(s) {quote(silent)} silent for more "
            f"than {t.heartbeat:g}s"
        )
    if r.state is RoomState.WAITING_FOR_INPUT and now - r.state_since > t.waiting:
        return f"waiting timeout: no page arrived within {t.waiting:g}s"
    return ""


def fail_timed_out(
    rooms: RoomTable, t: TransferTimeouts, clock: Callable[[], float]
) -> tuple[list[str], float]:
    """Fail every live room past a timeout; returns their ids and the time checked at."""
    live = rooms.live_rooms()
    now, failed = clock(), []
    for r in live:
        with r.lock:
            if r.state.terminal:
                continue
            reason = timeout_reason(r, now, t)
            if reason:
                rooms.fail(r, reason)
                failed.append(r.room)
    return failed, now


class Reaper:
    """Runs `poll` on a daemon thread every `every` seconds, from `start` to `stop`."""

    def __init__(self, poll: Callable[[], object]):
        self._poll = poll
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self, every: float) -> None:
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(every):
                try:
                    self._poll()
                except Exception:  # keep reaping: one bad room must not stop the rest
                    logger.exception("transfer receiver: timeout poll failed")

        self._thread = threading.Thread(target=loop, name="transfer-receiver-reaper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
