"""`EngineLoop`: the asyncio `EngineClient` in front of a synchronous `StepEngine`.

One daemon thread owns the engine: it takes commands (add, abort) from an inbox, runs
`engine.step()` while the engine has work, and otherwise sleeps on a condition variable
(woken by new commands, with a bounded wait so a missed wake-up costs at most
`idle_wait_s`). JAX dispatch and host planning therefore never run on the event loop.

Chunks go back to the awaiting coroutine through a per-request `asyncio.Queue`, filled
with `loop.call_soon_threadsafe` on the loop that called `generate`.

`stats()` (what `/server_info`, `/metrics` and the router read) never touches the
engine from the caller's thread: the engine thread calls `engine.stats()` after every
step, after the commands it applied and on each idle wake-up, and publishes the
immutable `EngineStats` it returns (one reference assignment); `stats()` returns the
latest. Once the thread has stopped nothing steps the engine, and `stats()` asks it.

Failure and lifecycle:
- `generate` raises the engine's `InputError` (or another `CpkvError` from `add`) before
  it yields anything, so the HTTP layer can answer 400 (or 503);
- a consumer that stops early (client disconnect: `GeneratorExit` / `CancelledError`)
  aborts its request in the engine, which frees its pages;
- one command never stops the thread: an add whose caller left while it was queued (a
  cancelled future) is skipped, and anything a command or a chunk delivery raises is
  logged and fails only that request;
- a failure while serving fails the requests it hit, never the loop: the engine ends
  them itself, with an "error" chunk (HTTP 500 or the stream's error event) and their
  pages freed, and `step` returns (the `StepEngine` contract: a failed model step fails
  the requests that step served, one request's failed token only that request);
- `engine.step()` raises only when the engine can serve no more
  (`EngineStateLostError`: a failed step lost the KV pool it donated). The exception is
  logged with its traceback, every in-flight request ends with `finish_reason="error"`,
  and the loop is marked unhealthy (later requests get `EngineFailedError`).
  `fatal_reason()` says why; the server exits non-zero on it (a supervisor restarts the
  process) instead of keeping a port open that cannot serve;
- if the thread dies anyway, `healthy()` turns False and `fatal_reason()` says so;
- `shutdown(drain_timeout)` refuses new requests (`ServerShuttingDownError`), lets the
  in-flight ones finish for up to `drain_timeout` seconds, aborts the rest, and stops
  the thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence

from cpkv_jax.errors import CpkvError, InputError
from serving.engine.api import EngineStats, GenerateRequest, OutputChunk, ServerMode, StepEngine

logger = logging.getLogger(__name__)

# After the drain, aborted requests get this long to receive their "abort" chunk.
_ABORT_FLUSH_S = 5.0
_DRAIN_POLL_S = 0.02


class ServerShuttingDownError(CpkvError):
    """The server is shutting down and takes no new requests; retry on another server."""


class EngineFailedError(CpkvError):
    """The engine thread hit a fatal error earlier; this server cannot serve requests."""


@dataclasses.dataclass(frozen=True)
class _Add:
    req: GenerateRequest
    done: concurrent.futures.Future[None]


@dataclasses.dataclass(frozen=True)
class _Abort:
    rid: str


@dataclasses.dataclass(frozen=True)
class _Route:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[OutputChunk]


class EngineLoop:
    """Runs `engine` on a daemon thread and serves it as an `EngineClient`."""

    def __init__(self, engine: StepEngine, *, idle_wait_s: float = 0.05, name: str = "engine-loop"):
        if idle_wait_s <= 0:
            raise ValueError(f"idle_wait_s must be > 0, got {idle_wait_s}")
        self.mode: ServerMode = engine.mode
        self._engine = engine
        self._idle_wait_s = idle_wait_s
        self._cv = threading.Condition()
        self._inbox: collections.deque[_Add | _Abort] = collections.deque()  # guarded by _cv
        self._routes: dict[str, _Route] = {}  # guarded by _cv
        self._accepting = True
        self._stop = False
        self._fatal: str | None = None
        # Replaced whole by the engine thread (`_publish`); read by `stats`.
        self._stats: EngineStats | None = None
        self._stats_failing = False
        self._publish()  # nothing steps the engine yet
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- EngineClient --------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[OutputChunk]:
        """Submit `req`; yield its chunks until the finished one.

        Raises (before any chunk) what `engine.add` raised, `ServerShuttingDownError`
        during shutdown, or `EngineFailedError` after a fatal engine error.
        """
        loop = asyncio.get_running_loop()
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        route = _Route(loop, asyncio.Queue())
        with self._cv:
            if not self._accepting:
                raise ServerShuttingDownError(
                    f"request {req.rid!r} refused: the server is shutting down; retry on "
                    "another server"
                )
            if self._fatal is not None:
                raise EngineFailedError(f"request {req.rid!r} refused: {self._fatal}")
            if req.rid in self._routes:
                raise InputError(f"request id {req.rid!r} is already in flight")
            self._routes[req.rid] = route
            self._inbox.append(_Add(req, done))
            self._cv.notify()
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # Cancelled while the add was queued: the abort queued behind it cleans up.
            self._drop(req.rid)
            raise
        except BaseException:
            with self._cv:  # refused: nothing was added
                self._routes.pop(req.rid, None)
            raise
        finished = False
        try:
            while True:
                chunk = await route.queue.get()
                finished = chunk.finished
                yield chunk
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away: client disconnect
                self._drop(req.rid)

    def abort(self, rid: str) -> None:
        """Cancel `rid`; its consumer still receives the final "abort" chunk."""
        with self._cv:
            self._inbox.append(_Abort(rid))
            self._cv.notify()

    def stats(self) -> EngineStats:
        """The engine's stats as the engine thread last published them (never read from
        the live engine while it steps)."""
        if not self._thread.is_alive():
            return self._engine.stats()  # nothing steps it any more
        stats = self._stats
        if stats is None:
            raise RuntimeError("the engine has not reported its stats yet")
        return stats

    def healthy(self) -> bool:
        """False once shutdown started (so routers stop sending), the thread died, or a
        step failed fatally."""
        return self._accepting and self.fatal_reason() is None

    def fatal_reason(self) -> str | None:
        """Why this loop can serve no more (a failed step, a dead thread), else None."""
        if self._fatal is not None:
            return self._fatal
        if not self._thread.is_alive() and not self._stop:
            return "the engine thread is not running"
        return None

    async def shutdown(self, drain_timeout: float) -> None:
        """Stop taking requests, drain for up to `drain_timeout` s, abort the rest,
        stop the thread."""
        with self._cv:
            self._accepting = False
        deadline = time.monotonic() + max(drain_timeout, 0.0)
        while self._in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        left = self._in_flight()
        if left:
            logger.warning(
                "shutdown: aborting %d request(s) still running after the %gs drain",
                len(left),
                drain_timeout,
            )
            for rid in left:
                self.abort(rid)
            flush_deadline = time.monotonic() + _ABORT_FLUSH_S
            while self._in_flight() and time.monotonic() < flush_deadline:
                await asyncio.sleep(_DRAIN_POLL_S)
        # Work no client waits for any more (e.g. a PD prefill server's transfer whose HTTP
        # caller left, still holding pages until its senders stop) must finish too, or its
        # pages stay held: keep stepping until the engine is idle.
        idle_deadline = max(deadline, time.monotonic()) + _ABORT_FLUSH_S
        while self._engine_busy() and time.monotonic() < idle_deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        if self._engine_busy():
            logger.warning("shutdown: the engine still has work (e.g. transfers) after the drain")
        with self._cv:
            self._stop = True
            self._cv.notify()
        await asyncio.to_thread(self._thread.join, _ABORT_FLUSH_S)
        if self._thread.is_alive():
            logger.error("shutdown: the engine thread did not stop within %gs", _ABORT_FLUSH_S)

    # ---- engine thread -------------------------------------------------------------------
    def _engine_busy(self) -> bool:
        return self._thread.is_alive() and self._fatal is None and self._engine.has_work()

    def _in_flight(self) -> list[str]:
        with self._cv:
            return list(self._routes)

    def _drop(self, rid: str) -> None:
        """Forget `rid`'s consumer and abort it in the engine (ignored if finished)."""
        with self._cv:
            self._routes.pop(rid, None)
            self._inbox.append(_Abort(rid))
            self._cv.notify()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a bug in the loop itself: say why, never hang silently
            self._fatal = f"engine thread died: {type(e).__name__}: {e}"
            logger.critical("%s", self._fatal, exc_info=e)
            self._fail_routes(self._fatal)  # logged above; the thread ends here

    def _serve(self) -> None:
        engine = self._engine
        while True:
            with self._cv:
                if not self._inbox and not self._stop and not self._can_step():
                    self._cv.wait(self._idle_wait_s)  # then publish the stats once more
                commands = list(self._inbox)
                self._inbox.clear()
                stop = self._stop
            for cmd in commands:
                try:
                    self._apply(cmd, refuse=stop)
                except Exception as e:  # one command fails its own request, never the loop
                    logger.exception("engine command %r failed", cmd)
                    if isinstance(cmd, _Add):
                        self._fail_add(cmd, f"the engine could not take the request: {e}")
            if stop:
                return
            chunks: Sequence[OutputChunk] = ()
            if self._can_step():
                try:
                    chunks = engine.step()
                except Exception as e:  # the engine can serve no more (`StepEngine`)
                    self._fail_all(e)
            # Before the chunks go out: a client that saw its request end sees its stats.
            self._publish()
            self._deliver(chunks)

    def _publish(self) -> None:
        """Replace the published stats with the engine's current ones (engine thread)."""
        try:
            self._stats = self._engine.stats()
        except Exception:  # the previous stats stay; logged once per failing stretch
            if not self._stats_failing:
                logger.exception("engine stats failed; /server_info keeps the previous ones")
            self._stats_failing = True
        else:
            self._stats_failing = False

    def _can_step(self) -> bool:
        return self._fatal is None and self._engine.has_work()

    def _apply(self, cmd: _Add | _Abort, *, refuse: bool) -> None:
        if isinstance(cmd, _Abort):
            if self._fatal is None:
                try:
                    self._engine.abort(cmd.rid)
                except Exception:
                    logger.exception("engine abort of %s failed", cmd.rid)
            return
        if not cmd.done.set_running_or_notify_cancel():
            # The caller left while the add was queued; its abort follows and finds nothing.
            logger.debug("request %s was cancelled before the engine took it", cmd.req.rid)
            return
        if refuse or self._fatal is not None:
            err: CpkvError = (
                EngineFailedError(f"request {cmd.req.rid!r} refused: {self._fatal}")
                if self._fatal is not None
                else ServerShuttingDownError(f"request {cmd.req.rid!r} refused: shutting down")
            )
            cmd.done.set_exception(err)
            return
        try:
            self._engine.add(cmd.req)
        except Exception as e:
            cmd.done.set_exception(e)
        else:
            cmd.done.set_result(None)

    def _deliver(self, chunks: Sequence[OutputChunk]) -> None:
        for chunk in chunks:
            with self._cv:
                route = (
                    self._routes.pop(chunk.rid, None)
                    if chunk.finished
                    else self._routes.get(chunk.rid)
                )
            if route is None:
                continue  # its consumer left (the engine was told to abort it)
            self._deliver_to({chunk.rid: route}, [chunk])

    def _fail_add(self, cmd: _Add, message: str) -> None:
        """An add that broke half way: answer its caller, whichever step it reached."""
        if not cmd.done.done():
            with self._cv:
                self._routes.pop(cmd.req.rid, None)
            try:
                self._engine.abort(cmd.req.rid)
            except Exception:
                logger.exception("abort of %s after its failure failed", cmd.req.rid)
            cmd.done.set_exception(EngineFailedError(message))
        elif not cmd.done.cancelled() and cmd.done.exception() is None:
            self._fail_one(cmd.req.rid, message)  # accepted: its stream gets the error

    def _fail_one(self, rid: str, message: str) -> None:
        """End one accepted request with an error chunk."""
        with self._cv:
            route = self._routes.pop(rid, None)
        try:
            self._engine.abort(rid)
        except Exception:
            logger.exception("abort of %s after its failure failed", rid)
        if route is not None:
            self._deliver_to(
                {rid: route},
                [OutputChunk(rid, finished=True, finish_reason="error", error=message)],
            )

    def _fail_routes(self, message: str) -> None:
        """Every waiting consumer gets an error chunk (the thread is going away)."""
        with self._cv:
            routes, self._routes = self._routes, {}
            inbox = list(self._inbox)
            self._inbox.clear()
        for cmd in inbox:
            if isinstance(cmd, _Add) and cmd.done.set_running_or_notify_cancel():
                cmd.done.set_exception(EngineFailedError(message))
        self._deliver_to(
            routes,
            [
                OutputChunk(rid, finished=True, finish_reason="error", error=message)
                for rid in routes
            ],
        )

    def _fail_all(self, exc: Exception) -> None:
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        logger.error("%s; failing every in-flight request", message, exc_info=exc)
        self._fatal = message
        with self._cv:
            routes, self._routes = self._routes, {}
        for rid in routes:
            try:  # free what the request holds; its chunks are replaced by the error
                self._engine.abort(rid)
            except Exception:
                logger.exception("abort of %s after the engine failure failed", rid)
        self._deliver_to(
            routes,
            [
                OutputChunk(rid, finished=True, finish_reason="error", error=message)
                for rid in routes
            ],
        )

    @staticmethod
    def _deliver_to(routes: dict[str, _Route], chunks: list[OutputChunk]) -> None:
        for chunk in chunks:
            route = routes[chunk.rid]
            try:
                route.loop.call_soon_threadsafe(route.queue.put_nowait, chunk)
            except RuntimeError:  # that event loop is closed: its consumer is gone
                logger.debug("dropping chunk of %s: its event loop is closed", chunk.rid)
