"""`cpkv-router`: the HTTP front door of a PD (prefill/decode disaggregated) deployment.

    cpkv-router --prefill URL [URL ...] --decode URL [URL ...] [--worker URL ...]
                --host 127.0.0.1 --port 8000

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
   registered (`bootstrap_timeout_s` in `transfer.backends.grpc_backend`; a decode
   server that queues the request registers it once its pages are free), and the
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

Health: a background task polls `/health` and `/server_info` of every server every
`--health-interval` seconds. A server is out of rotation after `--health-failures`
consecutive failed checks, at once when it refuses connections (also when a request finds
that out), and when it reports another mode than the flag it was registered with; one good
check puts it back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import sys
import typing
import urllib.parse
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, Literal

import httpx
import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from cpkv_jax.cli_logging import configure_logging
from cpkv_jax.errors import ConfigError, CpkvError, InputError

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "worker"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "worker")
# The `/server_info` "mode" each registration flag expects.
EXPECTED_MODE: dict[Role, str] = {"prefill": "prefill", "decode": "decode", "worker": "null"}
PD_ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions")
PD_FIELDS = ("bootstrap_room", "bootstrap_cp_size", "decode_transfer_target")

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1
EXIT_USAGE = 2  # argparse's convention for a bad command line

# Status for a request whose client went away (nginx's convention; nobody reads it).
CLIENT_CLOSED_REQUEST = 499
# Upstream connections the router may hold open at once; a proxy should not queue here.
_MAX_UPSTREAM_CONNECTIONS = 4096
_SSE_DONE = b"data: [DONE]\n\n"


class RouterConfigError(ConfigError):
    """A `cpkv-router` flag is missing, malformed or inconsistent."""


class RouterStartupError(CpkvError):
    """No usable prefill+decode pair (or worker) became healthy within the startup timeout."""


class RouterInputError(InputError):
    """A client body the router cannot forward (not a JSON object, or carrying PD fields)."""


class NoHealthyServerError(CpkvError):
    """No healthy server can take a request; the message lists each server's last error."""


# ---- configuration -------------------------------------------------------------------


def _arg(default: Any, *, help: str, metavar: str | None = None) -> Any:
    """A `RouterConfig` field with its help text (argparse is generated from the fields)."""
    return dataclasses.field(default=default, metadata={"help": help, "metavar": metavar})


def normalize_url(url: str, flag: str) -> str:
    """`http://host:port[/]` -> `http://host:port`; anything else is a `RouterConfigError`."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RouterConfigError(f"{flag} {url!r} is not a server URL: write it as http://HOST:PORT")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise RouterConfigError(
            f"{flag} {url!r} has a path or query: give the server root, http://HOST:PORT"
        )
    try:
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as e:
        raise RouterConfigError(f"{flag} {url!r}: {e}") from None
    return f"{parts.scheme}://{parts.netloc}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """Every `cpkv-router` flag, its default and its help. Build with `from_cli` or directly
    (then call `validate`, which also normalizes the URLs: use its return value)."""

    prefill: tuple[str, ...] = _arg(
        (), help="prefill server URLs (cpkv-serve, mode prefill)", metavar="URL"
    )
    decode: tuple[str, ...] = _arg(
        (), help="decode server URLs (cpkv-serve, mode decode)", metavar="URL"
    )
    worker: tuple[str, ...] = _arg(
        (), help="unified server URLs (mode null): requests forwarded as is", metavar="URL"
    )
    host: str = _arg("127.0.0.1", help="address to listen on")
    port: int = _arg(8000, help="port to listen on (0: any free port)")
    request_timeout: float = _arg(
        600.0,
        help="seconds the router waits for any single upstream event (response headers, the "
        "next body bytes, the prefill answer) before failing the request",
        metavar="S",
    )
    connect_timeout: float = _arg(5.0, help="seconds to open an upstream connection", metavar="S")
    decode_register_wait: float = _arg(
        0.0,
        help="seconds to wait for the decode server's response headers (its room is "
        "registered) before starting the prefill call anyway; 0 = start both at once "
        "(the prefill's transfer handshake retries until the room exists, and a decode "
        "server streams headers only with its first token, so any wait here is TTFT)",
        metavar="S",
    )
    health_interval: float = _arg(
        1.0, help="seconds between health polls of every server", metavar="S"
    )
    health_failures: int = _arg(
        3, help="consecutive failed health checks that take a server out of rotation", metavar="N"
    )
    health_timeout: float = _arg(2.0, help="seconds one health check may take", metavar="S")
    startup_timeout: float = _arg(
        300.0,
        help="seconds to wait at startup for a healthy prefill+decode pair or worker "
        "(0: do not wait)",
        metavar="S",
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] = _arg(
        "info", help="log level"
    )

    def validate(self) -> RouterConfig:
        """Raise `RouterConfigError` naming the flag and the fix; return the config with
        normalized URLs."""
        urls = {
            role: tuple(normalize_url(u, f"--{role}") for u in getattr(self, role))
            for role in ROLES
        }
        if bool(urls["prefill"]) != bool(urls["decode"]):
            have, missing = (
                ("--prefill", "--decode") if urls["prefill"] else ("--decode", "--prefill")
            )
            raise RouterConfigError(
                f"{have} needs {missing}: PD serving pairs a prefill server with a decode server "
                "(use --worker for unified servers)"
            )
        if not urls["prefill"] and not urls["worker"]:
            raise RouterConfigError(
                "no servers: give --prefill URL ... --decode URL ..., or --worker URL ..."
            )
        seen: dict[str, str] = {}
        for role in ROLES:
            for u in urls[role]:
                if u in seen:
                    raise RouterConfigError(
                        f"{u} is given twice (--{seen[u]} and --{role}): register each server once"
                    )
                seen[u] = role
        for name in ("request_timeout", "connect_timeout", "health_interval", "health_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise RouterConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        for name in ("decode_register_wait", "startup_timeout"):
            value = getattr(self, name)
            if not value >= 0:
                raise RouterConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.health_failures < 1:
            raise RouterConfigError(f"--health-failures must be >= 1, got {self.health_failures}")
        if not 0 <= self.port <= 65535:
            raise RouterConfigError(f"--port must be in [0, 65535], got {self.port}")
        return dataclasses.replace(self, **urls)

    @classmethod
    def build_parser(cls) -> argparse.ArgumentParser:
        parser = _RaisingParser(
            prog="cpkv-router",
            description="Route requests over cpkv-serve prefill/decode (PD) servers.",
        )
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default}
            help_text = f.metadata["help"]
            if typing.get_origin(tp) is tuple:
                # `--prefill A B` and `--prefill A --prefill B` both work.
                kwargs.update(nargs="+", action="extend", type=str, default=None)
            elif typing.get_origin(tp) is Literal:
                kwargs["choices"] = typing.get_args(tp)
                help_text += f" (default: {f.default})"
            else:
                kwargs["type"] = tp
                help_text += f" (default: {f.default})"
            if f.metadata["metavar"]:
                kwargs["metavar"] = f.metadata["metavar"]
            parser.add_argument("--" + f.name.replace("_", "-"), help=help_text, **kwargs)
        return parser

    @classmethod
    def from_cli(cls, argv: Sequence[str] | None = None) -> RouterConfig:
        """Parse and validate the command line; errors raise `RouterConfigError`."""
        ns = vars(cls.build_parser().parse_args(argv))
        for role in ROLES:
            ns[role] = tuple(ns[role] or ())
        return cls(**ns).validate()


class _RaisingParser(argparse.ArgumentParser):
    """Parse errors become `RouterConfigError` (one line) instead of usage + exit."""

    def error(self, message: str) -> typing.NoReturn:
        raise RouterConfigError(message)


# ---- server registry and selection ---------------------------------------------------


@dataclasses.dataclass
class ServerState:
    """What the router knows about one upstream server (mutated on the event loop only)."""

    url: str
    role: Role
    healthy: bool = False
    consecutive_failures: int = 0
    last_error: str = "not checked yet"
    mode: str | None = None
    waiting: int = 0
    running: int = 0
    in_flight: int = 0
    cp_size: int | None = None  # prefill servers
    transfer_target: str | None = None  # decode servers

    @property
    def load(self) -> int:
        return self.waiting + self.running + self.in_flight

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role,
            "mode": self.mode,
            "healthy": self.healthy,
            "load": self.load,
            "waiting": self.waiting,
            "running": self.running,
            "in_flight": self.in_flight,
            "consecutive_failures": self.consecutive_failures,
            "last_error": None if self.healthy else self.last_error,
            "cp_size": self.cp_size,
            "transfer_target": self.transfer_target,
        }


class ServerModeError(ValueError):
    """A server reports another mode than the flag it was registered with."""


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """The fields of `/server_info` the router uses, checked against the server's role."""

    mode: str
    waiting: int
    running: int
    cp_size: int | None = None
    transfer_target: str | None = None


def parse_server_info(role: Role, info: object) -> ServerInfo:
    """Check a `/server_info` JSON body for a server registered as `role`; `ValueError`
    says which field is wrong (a misregistered server must not take traffic)."""
    if not isinstance(info, dict):
        raise ValueError(f"/server_info is not a JSON object: {str(info)[:80]!r}")
    mode = info.get("mode")
    if mode != EXPECTED_MODE[role]:
        raise ServerModeError(
            f"registered as --{role} but /server_info reports mode {mode!r} "
            f"(expected {EXPECTED_MODE[role]!r}): fix the router flags or the server's mode"
        )
    counts = {}
    for key in ("waiting", "running"):
        value = info.get(key)
        if type(value) is not int or value < 0:
            raise ValueError(f"/server_info {key!r} must be an int >= 0, got {value!r}")
        counts[key] = value
    cp_size = transfer_target = None
    if role == "prefill":
        cp_size = info.get("cp_size")
        if type(cp_size) is not int or cp_size < 1:
            raise ValueError(f"prefill /server_info 'cp_size' must be an int >= 1, got {cp_size!r}")
    if role == "decode":
        transfer_target = info.get("transfer_target")
        if not isinstance(transfer_target, str) or ":" not in transfer_target:
            raise ValueError(
                "decode /server_info 'transfer_target' must be 'host:port' of its KV receiver, "
                f"got {transfer_target!r}"
            )
    return ServerInfo(mode, counts["waiting"], counts["running"], cp_size, transfer_target)


@dataclasses.dataclass(frozen=True)
class Route:
    """Where one request goes: a PD pair (`prefill` set) or a unified worker (`prefill` None)."""

    target: ServerState  # the decode server, or the worker
    prefill: ServerState | None = None


class ServerPool:
    """The registered servers, their health and load, and the least-loaded choice."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.servers: dict[Role, list[ServerState]] = {
            role: [ServerState(url, role) for url in getattr(config, role)] for role in ROLES
        }
        self._rr: dict[Role, int] = dict.fromkeys(ROLES, 0)

    def all(self) -> list[ServerState]:
        return [s for role in ROLES for s in self.servers[role]]

    def healthy(self, role: Role) -> list[ServerState]:
        return [s for s in self.servers[role] if s.healthy]

    def usable(self) -> bool:
        """A prefill+decode pair or a worker is healthy."""
        pd = bool(self.healthy("prefill")) and bool(self.healthy("decode"))
        return pd or bool(self.healthy("worker"))

    def pick(self, role: Role) -> ServerState | None:
        """Least-loaded healthy server of `role`; ties round-robin. None if none is healthy."""
        candidates = self.healthy(role)
        if not candidates:
            return None
        least = min(s.load for s in candidates)
        ties = [s for s in candidates if s.load == least]
        chosen = ties[self._rr[role] % len(ties)]
        self._rr[role] += 1
        return chosen

    def route(self) -> Route:
        """Choose the servers for one request or raise `NoHealthyServerError` with why."""
        if self.servers["prefill"]:
            prefill, decode = self.pick("prefill"), self.pick("decode")
            if prefill is not None and decode is not None:
                return Route(target=decode, prefill=prefill)
        worker = self.pick("worker")
        if worker is not None:
            return Route(target=worker)
        raise NoHealthyServerError(self.unavailable_reason())

    def unavailable_reason(self) -> str:
        parts = []
        for role in ROLES:
            servers = self.servers[role]
            if servers and not self.healthy(role):
                why = ", ".join(f"{s.url} ({s.last_error})" for s in servers)
                parts.append(f"no healthy {role} server: {why}")
        return "; ".join(parts) or "no healthy server"

    def record_success(self, s: ServerState, info: ServerInfo) -> None:
        s.mode, s.waiting, s.running = info.mode, info.waiting, info.running
        s.cp_size, s.transfer_target = info.cp_size, info.transfer_target
        s.consecutive_failures = 0
        if not s.healthy:
            s.healthy = True
            logger.info("%s server %s is healthy (%s)", s.role, s.url, _describe(s))

    def record_failure(self, s: ServerState, reason: str, *, immediate: bool = False) -> None:
        """A failed check; `immediate` (connection refused, wrong mode) skips the count."""
        s.consecutive_failures += 1
        s.last_error = reason
        limit = 1 if immediate else self.config.health_failures
        if s.healthy and s.consecutive_failures >= limit:
            s.healthy = False
            logger.warning("%s server %s is out of rotation: %s", s.role, s.url, reason)


def _describe(s: ServerState) -> str:
    extra = {"prefill": f"cp_size={s.cp_size}", "decode": f"transfer_target={s.transfer_target}"}
    return f"mode={s.mode}, load={s.load}" + (f", {extra[s.role]}" if s.role in extra else "")


class _Lease:
    """One request counted in a server's `in_flight` until `release` (idempotent)."""

    def __init__(self, server: ServerState):
        self.server = server
        self._held = True
        server.in_flight += 1

    def release(self) -> None:
        if self._held:
            self._held = False
            self.server.in_flight -= 1


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
        return {"error": {"message": self.message, "type": self.type, "code": self.status}}

    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after is None else {"Retry-After": self.retry_after}


def error_response(status: int, message: str, type_: str) -> JSONResponse:
    """The error body every cpkv server uses: `{"error": {"message", "type", "code"}}`."""
    return JSONResponse({"error": {"message": message, "type": type_, "code": status}}, status)


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


async def _wait_disconnect(receive: Receive) -> None:
    """Return when the client goes away (the body is already read: the next ASGI message
    is `http.disconnect`)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _status_outcome(status: int) -> str:
    """Metrics outcome of a forwarded upstream answer."""
    if status < 400:
        return "success"
    return "upstream_rejected" if status < 500 else "upstream_failed"


def _sse_error(failure: Failure, tail: bytes) -> bytes:
    """An SSE error event then `[DONE]`, starting on an event boundary."""
    sep = b"" if not tail or tail.endswith((b"\n\n", b"\r\n\r\n")) else b"\n\n"
    return sep + b"data: " + json.dumps(failure.body()).encode() + b"\n\n" + _SSE_DONE


class PDRouter:
    """The routing core behind the FastAPI app: HTTP clients, the server pool, the health
    monitor, and the relay of one request (`handle`)."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.pool = ServerPool(config)
        self.metrics = RouterMetrics()
        self._client: httpx.AsyncClient | None = None
        self._health_client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None
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
            limits=httpx.Limits(max_connections=_MAX_UPSTREAM_CONNECTIONS),
            trust_env=False,  # a proxy from the environment must not sit between router and servers
        )
        # A separate client, so health checks are never queued behind request traffic.
        self._health_client = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.health_timeout), trust_env=False
        )
        await self.poll_once()
        self._health_task = asyncio.create_task(self._health_loop(), name="cpkv-router-health")
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
            logger.info("%s server %s: %s, %s", s.role, s.url, state, _describe(s))

    async def close(self) -> None:
        """Stop the health monitor and background work, close the clients (idempotent)."""
        tasks = [t for t in (self._health_task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._health_task = None
        for client in (self._client, self._health_client):
            if client is not None:
                await client.aclose()

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

    # -- health -------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            await self.poll_once()

    async def poll_once(self) -> None:
        """Check every server now, concurrently."""
        await asyncio.gather(*(self._check(s) for s in self.pool.all()))

    async def _check(self, s: ServerState) -> None:
        assert self._health_client is not None
        try:
            health = await self._health_client.get(s.url + "/health")
            if health.status_code != 200:
                raise ValueError(f"/health answered {health.status_code}")
            r = await self._health_client.get(s.url + "/server_info")
            if r.status_code != 200:
                raise ValueError(f"/server_info answered {r.status_code}")
            info = parse_server_info(s.role, r.json())
        except httpx.ConnectError as e:
            self.metrics.health_check_failures.labels(s.role, s.url).inc()
            self.pool.record_failure(s, f"connection refused ({e})", immediate=True)
        except httpx.TimeoutException:
            self.metrics.health_check_failures.labels(s.role, s.url).inc()
            self.pool.record_failure(
                s, f"health check timed out after {self.config.health_timeout:g} s"
            )
        except (httpx.HTTPError, ValueError) as e:
            self.metrics.health_check_failures.labels(s.role, s.url).inc()
            immediate = isinstance(e, ServerModeError)  # misregistered: never route to it
            self.pool.record_failure(s, str(e) or type(e).__name__, immediate=immediate)
        else:
            self.pool.record_success(s, info)

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
        self, s: ServerState, path: str, body: dict[str, Any], lease: _Lease
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
        self.target_lease = _Lease(target)
        # Counted from the choice on, so a burst of requests spreads over prefill servers.
        self.prefill_lease = _Lease(prefill_call[0]) if prefill_call else None
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
        disconnect = router.spawn(_wait_disconnect(request.receive))
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
            return _RelayResponse(self, first or b"", self.resp.status_code, headers)
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
        return JSONResponse(failure.body(), failure.status, headers=failure.headers())

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


class _RelayResponse(StreamingResponse):
    """A streaming response that releases its relay even when the body never starts (a
    client gone before the first byte would otherwise leave the upstream open)."""

    def __init__(self, relay: _Relay, first: bytes, status_code: int, headers: dict[str, str]):
        super().__init__(relay.body(first), status_code=status_code, headers=headers)
        self._relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._relay.close()


# ---- the app ---------------------------------------------------------------------------


def build_router_app(config: RouterConfig, *, router: PDRouter | None = None) -> FastAPI:
    """The router's FastAPI app. Its lifespan starts `router` (a new `PDRouter(config)` by
    default; starting an already started one does nothing): the health monitor, then the
    wait for a usable server (`RouterStartupError` after `startup_timeout`). The app owns
    the router from here: shutting the app down closes it. `config` is validated here."""
    config = config.validate()
    router = router if router is not None else PDRouter(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="cpkv-router", lifespan=lifespan)
    app.state.router = router

    def pd_route(endpoint: str) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            return await router.handle(request, endpoint)

        return route

    for endpoint in PD_ENDPOINTS:
        app.add_api_route(endpoint, pd_route(endpoint), methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        servers = router.pool.healthy("decode") + router.pool.healthy("worker")
        if not servers:
            return error_response(503, router.pool.unavailable_reason(), "service_unavailable")
        s = servers[0]
        try:
            r = await router.client.get(s.url + "/v1/models")
        except httpx.HTTPError as e:
            f = router.failure_from_exception(s, e)
            return JSONResponse(f.body(), f.status)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        pool = router.pool
        if pool.usable():
            pairs = min(len(pool.healthy("prefill")), len(pool.healthy("decode")))
            return JSONResponse(
                {
                    "status": "ok",
                    "healthy": {r: len(pool.healthy(r)) for r in ROLES},
                    "pairs": pairs,
                }
            )
        return error_response(503, pool.unavailable_reason(), "service_unavailable")

    @app.get("/servers")
    async def servers() -> Response:
        return JSONResponse({"servers": [s.to_dict() for s in router.pool.all()]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            router.metrics.render(router.pool), media_type=prometheus_client.CONTENT_TYPE_LATEST
        )

    return app


def main(argv: Sequence[str] | None = None) -> int:
    """`cpkv-router`: 0 after a clean shutdown, 1 when no server pair became healthy within
    `--startup-timeout`, 2 for a bad command line (one `error: ...` line on stderr)."""
    try:
        config = RouterConfig.from_cli(argv)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except RouterConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(config.log_level)
    if config.log_level != "debug":  # httpx logs every request, health polls included
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return asyncio.run(_serve(config))
    except SystemExit as e:  # uvicorn exits when it cannot bind or start
        logger.error("router did not start (exit %s)", e.code)
        return EXIT_STARTUP_FAILED
    except KeyboardInterrupt:
        return EXIT_OK


class _QuietExitServer(uvicorn.Server):
    """uvicorn without its re-raise of the stopping signal after a graceful shutdown, so
    SIGTERM ends the router with exit code 0 once it has closed its upstreams."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()


async def _serve(config: RouterConfig) -> int:
    """Wait for the servers first (so a startup failure is one log line, not a
    traceback from the ASGI lifespan), then serve until a signal stops uvicorn."""
    router = PDRouter(config)
    try:
        await router.start()
    except RouterStartupError:
        return EXIT_STARTUP_FAILED  # `start` logged the reason and closed the router
    try:
        server = _QuietExitServer(
            uvicorn.Config(
                build_router_app(config, router=router),
                host=config.host,
                port=config.port,
                log_level=config.log_level,
                lifespan="on",
                timeout_graceful_shutdown=5,
            )
        )
        await server.serve()
    finally:
        await router.close()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
