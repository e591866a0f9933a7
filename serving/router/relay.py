"""The routing core of `cpkv-router` (`PDRouter`, with its Prometheus metrics) and the
relay of one client request.

One client request through the router (ARCHITECTURE "Data flow of one request", step 1):

1. Pick the least-loaded healthy prefill and decode server. Load is `waiting + running`
   from the server's last `/server_info` poll plus the requests this router has in flight
   to it (the poll is up to `--health-interval` old; the in-flight count is exact). Ties
   go round-robin, so equally idle servers share a burst.
2. Make a room id (uuid4 hex); on `/generate` it is the request's `rid` on both servers.
3. POST the client's body to the decode server's same endpoint with `bootstrap_room` and
   `bootstrap_cp_size` (the prefill server's CP size) added, streaming the response.
4. Once the decode server's response headers arrive, POST the same body to the prefill
   server's same endpoint with
   `bootstrap_room`, `decode_transfer_target` (the decode server's transfer receiver) and
   `stream=false`. A decode server that holds its headers back until its first output (a
   non-streaming answer does; `cpkv-serve` streams headers with the first token) would
   deadlock a router waiting for them, so the prefill call also starts after
   `--decode-register-wait` seconds without headers (default 0: at once, as any wait is
   added to the TTFT): the transfer layer retries its handshake until the room is
   registered (a decode server that queues the request registers it once its pages
   are free; `bootstrap_timeout_s` bounds only a decode side that does not answer at
   all, the wait itself ends with the request's timeout or the client), and the
   prefill server computes a request only after every rank's handshake succeeded, so
   starting early holds no prefill pages. A full queue on either server is a 503 with
   `Retry-After`, passed on to the client. A decode answer that is
   not 200 (a bad request) means no room: the prefill call is not made, or is cancelled.
5. The decode response goes back to the client unchanged (status, content type, bytes).
   The prefill call runs concurrently and decides nothing unless it fails (connection
   refused, 5xx, timeout, or a 4xx rejection): then the client request fails cleanly and
   the decode upstream is closed, so the decode server aborts the room and frees its pages.
   Before anything was sent to the client the answer is a JSON error (503; 504 for a
   timeout; the prefill server's own 4xx status for a rejection); once an SSE stream has
   started, an error event and `data: [DONE]`. Every wait is bounded (`--request-timeout`,
   `--connect-timeout`).
6. Client disconnect closes both upstream requests; the servers abort and free pages.

Responses carry `x-cpkv-prefill`, `x-cpkv-decode` (or `x-cpkv-worker`) and `x-cpkv-room`
headers naming the servers and the room, so a slow or failed request can be traced.

Decisions written down here:
- OpenAI endpoints are sent to the prefill server's same endpoint (with the PD fields),
  not converted to `/generate`: the OpenAI defaults differ from the native ones (e.g. the
  temperature), and the prefill server samples the first token, so a second copy of that
  mapping in the router could make prefill and decode sample with different parameters.
- A client body that already carries a PD field (`bootstrap_room`, `bootstrap_cp_size`,
  `decode_transfer_target`) is refused with 400: those belong to the router. A client
  `rid` on `/generate` is replaced by the room id (the servers key aborts by it).
- Unified servers (`--worker`, mode "null") get a request as is (least-loaded) when no
  prefill+decode pair is healthy, or when the router has no PD servers at all.
- No retry on another server: by the time a failure is seen the decode server holds a
  room and the client may already have output; the client retries.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping
from typing import Any

import httpx
import prometheus_client
from fastapi import Request
from fastapi.responses import Response

from cpkv_jax.errors import CpkvError, InputError
from serving.http.errors import CLIENT_CLOSED_REQUEST, error_body, error_response
from serving.http.keepalive import UPSTREAM_KEEPALIVE_S
from serving.http.streaming import SSE_DONE, ClosingStreamingResponse, sse_event, wait_disconnect
from serving.router.config import ROLES, RouterConfig
from serving.router.upstreams import (
    HealthMonitor,
    Lease,
    NoHealthyServerError,
    ServerPool,
    ServerState,
    describe,
)

logger = logging.getLogger(__name__)

PD_ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions")
PD_FIELDS = (
    "bootstrap_room",
    "bootstrap_cp_size",
    "decode_transfer_target",
    "bootstrap_host",  # SGLang gateway's
    "bootstrap_port",
)

# Upstream connections the router may hold open at once; a proxy should not queue here.
_MAX_UPSTREAM_CONNECTIONS = 4096


class RouterStartupError(CpkvError):
    """No usable prefill+decode pair (or worker) became healthy within the startup timeout."""


class RouterInputError(InputError):
    """A client body the router cannot forward (not a JSON object, or carrying PD fields)."""


# ---- request bodies ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PDBodies:
    """The two upstream bodies of one PD request (the prefill one goes to the same path)."""

    decode: dict[str, Any]
    prefill: dict[str, Any]


def check_client_body(body: object) -> dict[str, Any]:
    """A client body must be a JSON object without the router-owned PD fields."""
    if not isinstance(body, dict):
        raise RouterInputError(f"the request body must be a JSON object, got {type(body).__name__}")
    taken = [k for k in PD_FIELDS if k in body]
    if taken:
        raise RouterInputError(
            f"{', '.join(taken)} are set by the router for PD serving: remove them from the request"
        )
    return body


def pd_bodies(
    endpoint: str, body: Mapping[str, Any], *, room: str, cp_size: int, transfer_target: str
) -> PDBodies:
    """Decode body: the client's plus `bootstrap_room` and `bootstrap_cp_size`. Prefill
    body: the client's plus `bootstrap_room` and `decode_transfer_target`, non-streaming
    (its answer only says whether the KV went out). On `/generate` both get `rid = room`."""
    if endpoint not in PD_ENDPOINTS:
        raise ValueError(f"{endpoint!r} is not a PD endpoint; expected one of {PD_ENDPOINTS}")
    decode = {**body, "bootstrap_room": room, "bootstrap_cp_size": cp_size}
    prefill = {**body, "bootstrap_room": room, "decode_transfer_target": transfer_target}
    prefill["stream"] = False
    prefill.pop("stream_options", None)  # OpenAI refuses stream_options without stream
    if endpoint == "/generate":
        decode["rid"] = prefill["rid"] = room
    return PDBodies(decode=decode, prefill=prefill)


# ---- upstream outcomes -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why a request failed upstream, as the client will be told."""

    status: int
    type: str
    message: str
    reason: str  # metrics label: connect, timeout, protocol, status_4xx, status_5xx
    retry_after: str | None = None  # an upstream's Retry-After (its queue is full)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.type)

    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after is None else {"Retry-After": self.retry_after}


def _upstream_message(r: httpx.Response) -> tuple[str, str | None]:
    """(message, type) from an upstream error body, whatever its shape."""
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        err = None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"], err.get("type") if isinstance(err.get("type"), str) else None
    return r.text[:300] or r.reason_phrase, None


# ---- metrics -----------------------------------------------------------------------------


class RouterMetrics:
    """Prometheus metrics in their own registry (several routers may share a process)."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        self.requests = prometheus_client.Counter(
            "cpkv_router_requests",
            "Client requests by endpoint and outcome (success, bad_request, no_server, "
            "upstream_rejected, upstream_failed, client_disconnect)",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.upstream_failures = prometheus_client.Counter(
            "cpkv_router_upstream_failures",
            "Failed upstream calls by server role, server and reason",
            ["role", "server", "reason"],
            registry=self.registry,
        )
        self.health_check_failures = prometheus_client.Counter(
            "cpkv_router_health_check_failures",
            "Failed health checks by server role and server",
            ["role", "server"],
            registry=self.registry,
        )
        self.healthy_servers = prometheus_client.Gauge(
            "cpkv_router_healthy_servers",
            "Servers in rotation by role",
            ["role"],
            registry=self.registry,
        )
        self.in_flight = prometheus_client.Gauge(
            "cpkv_router_in_flight_requests",
            "Requests the router has in flight to servers of a role",
            ["role"],
            registry=self.registry,
        )

    def refresh(self, pool: ServerPool) -> None:
        for role in ROLES:
            self.healthy_servers.labels(role).set(len(pool.healthy(role)))
            self.in_flight.labels(role).set(sum(s.in_flight for s in pool.servers[role]))

    def render(self, pool: ServerPool) -> bytes:
        self.refresh(pool)
        return prometheus_client.generate_latest(self.registry)


# ---- the router core -----------------------------------------------------------------------


def _consume(task: asyncio.Task[Any]) -> None:
    """Done-callback: retrieve a dropped task's exception so asyncio does not log it."""
    if not task.cancelled():
        task.exception()


def _drop(task: asyncio.Task[Any] | None) -> None:
    if task is not None:
        task.add_done_callback(_consume)
        task.cancel()


async def _next_chunk(chunks: AsyncIterator[bytes]) -> bytes | None:
    """The next body bytes, or None at the end (a Task cannot raise StopAsyncIteration)."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


def _status_outcome(status: int) -> str:
    """Metrics outcome of a forwarded upstream answer."""
    if status < 400:
        return "success"
    return "upstream_rejected" if status < 500 else "upstream_failed"


def _sse_error(failure: Failure, tail: bytes) -> bytes:
    """An SSE error event then `[DONE]`, starting on an event boundary."""
    sep = b"" if not tail or tail.endswith((b"\n\n", b"\r\n\r\n")) else b"\n\n"
    return sep + sse_event(failure.body()) + SSE_DONE


class PDRouter:
    """The routing core behind the FastAPI app: HTTP clients, the server pool, the health
    monitor, and the relay of one request (`handle`)."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.pool = ServerPool(config)
        self.metrics = RouterMetrics()
        self._client: httpx.AsyncClient | None = None
        self._health: HealthMonitor | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = False

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the clients, poll every server once, start the health monitor, then wait
        (bounded by `startup_timeout`) until a pair or a worker is healthy. Once only."""
        if self._started:
            return
        self._started = True
        cfg = self.config
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=cfg.connect_timeout,
                read=cfg.request_timeout,
                write=cfg.request_timeout,
                pool=cfg.connect_timeout,
            ),
            limits=httpx.Limits(
                max_connections=_MAX_UPSTREAM_CONNECTIONS, keepalive_expiry=UPSTREAM_KEEPALIVE_S
            ),
            headers=cfg.upstream_headers(),  # the router's key, never the client's
            trust_env=False,  # a proxy from the environment must not sit between router and servers
        )
        self._health = HealthMonitor(cfg, self.pool, on_failure=self._count_check_failure)
        await self._health.poll_once()
        self._health.start()
        if cfg.startup_timeout > 0 and not self.pool.usable():
            loop = asyncio.get_running_loop()
            deadline = loop.time() + cfg.startup_timeout
            logger.info("waiting up to %.0f s for a healthy server pair", cfg.startup_timeout)
            while not self.pool.usable():
                if loop.time() >= deadline:
                    reason = self.pool.unavailable_reason()
                    logger.error("router startup failed: %s", reason)
                    await self.close()
                    raise RouterStartupError(
                        f"no usable server after {cfg.startup_timeout:g} s (--startup-timeout): "
                        f"{reason}"
                    )
                await asyncio.sleep(min(0.05, cfg.health_interval))
        for s in self.pool.all():
            state = "healthy" if s.healthy else f"NOT healthy ({s.last_error})"
            logger.info("%s server %s: %s, %s", s.role, s.url, state, describe(s))

    async def close(self) -> None:
        """Stop the health monitor and background work, close the clients (idempotent)."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if self._health is not None:
            await self._health.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    def _count_check_failure(self, s: ServerState) -> None:
        self.metrics.health_check_failures.labels(s.role, s.url).inc()

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("PDRouter.start() has not run")
        return self._client

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A background task the router owns (cancelled by `close`)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or (exc := task.exception()) is None:
            return
        if isinstance(exc, httpx.HTTPError):  # an upstream call: its request reports it
            logger.debug("router upstream call failed: %s: %s", type(exc).__name__, exc)
        else:
            logger.error("router background task failed", exc_info=exc)

    # -- upstream failures ----------------------------------------------------------------

    def failure_from_exception(self, s: ServerState, e: httpx.HTTPError) -> Failure:
        """Classify a transport error of a call to `s`; refused connections take `s` out of
        rotation at once."""
        who = f"{s.role} server {s.url}"
        if isinstance(e, httpx.ConnectError):
            self.pool.record_failure(s, f"connection refused ({e})", immediate=True)
            failure = Failure(
                503, "service_unavailable", f"{who} refused the connection: {e}", "connect"
            )
        elif isinstance(e, httpx.TimeoutException):
            failure = Failure(
                504,
                "timeout",
                f"{who} did not answer within {self.config.request_timeout:g} s "
                f"(--request-timeout): {type(e).__name__}",
                "timeout",
            )
        else:
            failure = Failure(
                503, "service_unavailable", f"{who} failed: {type(e).__name__}: {e}", "protocol"
            )
        self.metrics.upstream_failures.labels(s.role, s.url, failure.reason).inc()
        return failure

    def failure_from_status(self, s: ServerState, r: httpx.Response) -> Failure:
        """A prefill server's non-2xx answer: its 4xx stays a 4xx (the request is bad),
        anything else is a 503."""
        message, type_ = _upstream_message(r)
        retry_after = r.headers.get("retry-after")
        if 400 <= r.status_code < 500:
            failure = Failure(
                r.status_code,
                type_ or "invalid_request_error",
                f"{s.role} server {s.url} rejected the request ({r.status_code}): {message}",
                "status_4xx",
            )
        else:
            failure = Failure(
                503,
                "service_unavailable",
                f"{s.role} server {s.url} failed ({r.status_code}): {message}",
                "status_5xx",
                retry_after,
            )
        self.metrics.upstream_failures.labels(s.role, s.url, failure.reason).inc()
        return failure

    async def call_prefill(
        self, s: ServerState, path: str, body: dict[str, Any], lease: Lease
    ) -> Failure | None:
        """POST the prefill body; None when the server accepted it (2xx)."""
        try:
            try:
                r = await self.client.post(s.url + path, json=body)
            except httpx.HTTPError as e:
                return self.failure_from_exception(s, e)
            if r.status_code < 300:
                return None
            return self.failure_from_status(s, r)
        finally:
            lease.release()

    # -- requests -------------------------------------------------------------------------

    async def handle(self, request: Request, endpoint: str) -> Response:
        """Route one `/generate` or OpenAI request (module docstring, steps 1-6)."""
        count = self.metrics.requests.labels
        try:
            body = check_client_body(json.loads(await request.body()))
        except (ValueError, RouterInputError) as e:  # json.JSONDecodeError is a ValueError
            count(endpoint, "bad_request").inc()
            message = str(e) if isinstance(e, RouterInputError) else f"malformed JSON body: {e}"
            return error_response(400, message, "invalid_request_error")
        try:
            route = self.pool.route()
        except NoHealthyServerError as e:
            count(endpoint, "no_server").inc()
            return error_response(503, str(e), "service_unavailable")
        headers = {"x-cpkv-" + ("decode" if route.prefill else "worker"): route.target.url}
        prefill_call = None
        if route.prefill is not None:
            p, d = route.prefill, route.target
            assert p.cp_size is not None and d.transfer_target is not None  # healthy => parsed
            room = uuid.uuid4().hex
            bodies = pd_bodies(
                endpoint, body, room=room, cp_size=p.cp_size, transfer_target=d.transfer_target
            )
            body = bodies.decode
            prefill_call = (p, bodies.prefill)
            headers.update({"x-cpkv-prefill": p.url, "x-cpkv-room": room})
        relay = _Relay(self, endpoint, route.target, prefill_call, headers)
        return await relay.open(request, body)


class _Relay:
    """One client request in flight: the upstream decode (or worker) stream, the concurrent
    prefill call, the leases, and what the client has been sent. `close` is idempotent and
    synchronous, so it can run from a cancelled task."""

    def __init__(
        self,
        router: PDRouter,
        endpoint: str,
        target: ServerState,
        prefill_call: tuple[ServerState, dict[str, Any]] | None,
        headers: dict[str, str],
    ):
        self.router = router
        self.endpoint = endpoint
        self.target = target
        self.prefill_call = prefill_call
        self.headers = headers
        self.target_lease = Lease(target)
        # Counted from the choice on, so a burst of requests spreads over prefill servers.
        self.prefill_lease = Lease(prefill_call[0]) if prefill_call else None
        self.prefill_task: asyncio.Task[Failure | None] | None = None
        self.prefill_checked = False
        self.resp: httpx.Response | None = None
        self.chunks: AsyncIterator[bytes] | None = None
        self.next_task: asyncio.Task[bytes | None] | None = None
        self.eof = False
        self.tail = b""
        self.outcome = "upstream_failed"
        self.closed = False

    # -- phase 1: until the client's response starts --------------------------------------

    def _start_prefill(self) -> None:
        if self.prefill_call is not None and self.prefill_task is None:
            p, body = self.prefill_call
            assert self.prefill_lease is not None
            self.prefill_task = self.router.spawn(
                self.router.call_prefill(p, self.endpoint, body, self.prefill_lease)
            )

    async def open(self, request: Request, body: dict[str, Any]) -> Response:
        """Send the upstream request(s) and wait for the first decode bytes, a prefill
        failure, a client disconnect or the timeout, whichever comes first."""
        router, cfg = self.router, self.router.config
        loop = asyncio.get_running_loop()
        upstream = router.client.build_request("POST", self.target.url + self.endpoint, json=body)
        headers_task = router.spawn(router.client.send(upstream, stream=True))
        disconnect = router.spawn(wait_disconnect(request.receive))
        first: bytes | None = None
        start_prefill_at = loop.time() + cfg.decode_register_wait
        deadline = loop.time() + cfg.connect_timeout + cfg.request_timeout
        handed_off = False
        try:
            while True:
                waiting: set[asyncio.Task[Any]] = {disconnect}
                if self.resp is None:
                    waiting.add(headers_task)
                if self.next_task is not None:
                    waiting.add(self.next_task)
                if self.prefill_task is not None and not self.prefill_checked:
                    waiting.add(self.prefill_task)
                now = loop.time()
                prefill_pending = self.prefill_call is not None and self.prefill_task is None
                until = min(deadline, start_prefill_at) if prefill_pending else deadline
                done, _ = await asyncio.wait(
                    waiting, timeout=max(0.0, until - now), return_when=asyncio.FIRST_COMPLETED
                )
                if disconnect in done:
                    self.outcome = "client_disconnect"
                    return Response(status_code=CLIENT_CLOSED_REQUEST)
                if not done:
                    if prefill_pending and loop.time() < deadline:
                        self._start_prefill()  # headers held back: see module docstring, step 4
                        continue
                    return self._fail(
                        router.failure_from_exception(self.target, httpx.ReadTimeout("no response"))
                    )
                if headers_task in done and self.resp is None:
                    try:
                        self.resp = headers_task.result()
                    except httpx.HTTPError as e:
                        return self._fail(router.failure_from_exception(self.target, e))
                    if self.resp.status_code == 200:
                        self._start_prefill()
                    else:  # no room on the decode side: nothing for a prefill server to do
                        _drop(self.prefill_task)
                        self.prefill_call = None
                        self.prefill_checked = True
                    self.chunks = self.resp.aiter_raw()
                    self.next_task = router.spawn(_next_chunk(self.chunks))
                    continue
                if self.next_task is not None and self.next_task in done:
                    try:
                        first = self.next_task.result()
                    except httpx.HTTPError as e:
                        return self._fail(router.failure_from_exception(self.target, e))
                    self.next_task = None
                    self.eof = first is None
                    break
                if self.prefill_task is not None and self.prefill_task in done:
                    self.prefill_checked = True
                    failure = self.prefill_task.result()
                    if failure is not None:
                        return self._fail(failure)
            assert self.resp is not None
            headers = dict(self.headers)
            for name in ("content-type", "content-encoding", "retry-after"):
                if name in self.resp.headers:
                    headers[name] = self.resp.headers[name]
            handed_off = True
            # Closes the relay even when the body never starts (a client gone before the
            # first byte would otherwise leave the upstream open).
            return ClosingStreamingResponse(
                self.body(first or b""),
                self.close,
                status_code=self.resp.status_code,
                headers=headers,
            )
        finally:
            _drop(disconnect)
            if not headers_task.done():
                _drop(headers_task)  # cancelling the send closes its connection
            elif not headers_task.cancelled() and headers_task.exception() is None:
                late = headers_task.result()
                if late is not self.resp:  # arrived together with what ended the wait
                    router.spawn(late.aclose())
            if not handed_off:
                self.close()

    def _fail(self, failure: Failure) -> Response:
        self.outcome = "upstream_rejected" if failure.status < 500 else "upstream_failed"
        logger.warning("%s request failed: %s", self.endpoint, failure.message)
        return error_response(failure.status, failure.message, failure.type, failure.headers())

    # -- phase 2: streaming the decode body -----------------------------------------------

    @property
    def sse(self) -> bool:
        return self.resp is not None and self.resp.headers.get("content-type", "").startswith(
            "text/event-stream"
        )

    def _note(self, chunk: bytes) -> bytes:
        self.tail = (self.tail + chunk)[-4:]
        return chunk

    async def body(self, first: bytes) -> AsyncIterator[bytes]:
        """The decode body as it arrives; a prefill failure or an upstream error ends an SSE
        stream with an error event and `[DONE]` (a non-SSE body cannot be fixed once
        started: the connection is dropped so the client sees it is truncated)."""
        router, cfg = self.router, self.router.config
        assert self.resp is not None
        try:
            if first:
                yield self._note(first)
            if self.eof:
                self.outcome = _status_outcome(self.resp.status_code)
                return
            assert self.chunks is not None
            chunks = self.chunks
            self.next_task = router.spawn(_next_chunk(chunks))
            while True:
                waiting: set[asyncio.Task[Any]] = {self.next_task}
                if self.prefill_task is not None and not self.prefill_checked:
                    waiting.add(self.prefill_task)
                done, _ = await asyncio.wait(
                    waiting, timeout=cfg.request_timeout, return_when=asyncio.FIRST_COMPLETED
                )
                failure = None
                if not done:
                    failure = router.failure_from_exception(
                        self.target, httpx.ReadTimeout("stalled")
                    )
                elif self.prefill_task in done:
                    self.prefill_checked = True
                    failure = self.prefill_task.result()
                elif self.next_task in done:
                    try:
                        chunk = self.next_task.result()
                    except httpx.HTTPError as e:
                        failure = router.failure_from_exception(self.target, e)
                    else:
                        if chunk is None:
                            self.eof = True
                            self.outcome = _status_outcome(self.resp.status_code)
                            return
                        yield self._note(chunk)
                        self.next_task = router.spawn(_next_chunk(chunks))
                        continue
                if failure is not None:
                    self.outcome = "upstream_failed"
                    logger.warning("%s stream failed: %s", self.endpoint, failure.message)
                    if not self.sse:
                        raise UpstreamStreamError(failure.message)
                    yield _sse_error(failure, self.tail)
                    return
        except (asyncio.CancelledError, GeneratorExit):
            self.outcome = "client_disconnect"
            raise
        finally:
            self.close()

    # -- cleanup ------------------------------------------------------------------------

    def close(self) -> None:
        """Release everything this request holds. After a complete decode answer the
        prefill call may finish on its own (its answer is due); otherwise it is cancelled,
        which closes its connection so the prefill server aborts the request."""
        if self.closed:
            return
        self.closed = True
        _drop(self.next_task)
        if self.resp is not None:
            self.router.spawn(self.resp.aclose())
        self.target_lease.release()
        if self.prefill_task is None:
            if self.prefill_lease is not None:
                self.prefill_lease.release()
        elif not self.eof or self.outcome != "success":
            _drop(self.prefill_task)
        self.router.metrics.requests.labels(self.endpoint, self.outcome).inc()


class UpstreamStreamError(CpkvError):
    """A non-SSE upstream body broke after the client's response had started."""
