"""The upstream servers of `cpkv-router`: what it knows of each (`ServerState`), the pool
and its least-loaded choice (`ServerPool`), the health monitor that keeps that knowledge
fresh (`HealthMonitor`).

Health: `HealthMonitor` polls `/health` and `/server_info` of every server every
`--health-interval` seconds. A server is out of rotation after `--health-failures`
consecutive failed checks, at once when it refuses connections (also when a request finds
that out), and when it reports another mode than the flag it was registered with; one good
check puts it back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import httpx

from cpkv_jax.errors import CpkvError
from serving.api_keys import UPSTREAM_API_KEY_ENV
from serving.router.config import ROLES, Role, RouterConfig

logger = logging.getLogger(__name__)

# The `/server_info` "mode" each registration flag expects.
EXPECTED_MODE: dict[Role, str] = {"prefill": "prefill", "decode": "decode", "worker": "null"}


class NoHealthyServerError(CpkvError):
    """No healthy server can take a request; the message lists each server's last error."""


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
            logger.info("%s server %s is healthy (%s)", s.role, s.url, describe(s))

    def record_failure(self, s: ServerState, reason: str, *, immediate: bool = False) -> None:
        """A failed check; `immediate` (connection refused, wrong mode) skips the count."""
        s.consecutive_failures += 1
        s.last_error = reason
        limit = 1 if immediate else self.config.health_failures
        if s.healthy and s.consecutive_failures >= limit:
            s.healthy = False
            logger.warning("%s server %s is out of rotation: %s", s.role, s.url, reason)


def describe(s: ServerState) -> str:
    extra = {"prefill": f"cp_size={s.cp_size}", "decode": f"transfer_target={s.transfer_target}"}
    return f"mode={s.mode}, load={s.load}" + (f", {extra[s.role]}" if s.role in extra else "")


class Lease:
    """One request counted in a server's `in_flight` until `release` (idempotent)."""

    def __init__(self, server: ServerState):
        self.server = server
        self._held = True
        server.in_flight += 1

    def release(self) -> None:
        if self._held:
            self._held = False
            self.server.in_flight -= 1


class HealthMonitor:
    """Polls every server of `pool` (`poll_once`, then every `health_interval` seconds
    once `start`ed) on its own HTTP client, so health checks never queue behind request
    traffic, and records the outcome in the pool; `on_failure(server)` is called for each
    failed check (the router counts them)."""

    def __init__(
        self,
        config: RouterConfig,
        pool: ServerPool,
        on_failure: Callable[[ServerState], None] = lambda s: None,
    ):
        self.config = config
        self.pool = pool
        self.on_failure = on_failure
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.health_timeout),
            headers=config.upstream_headers(),  # /server_info needs the servers' key
            trust_env=False,
        )
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the background polls (the first one after `health_interval`)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="cpkv-router-health")

    async def close(self) -> None:
        """Stop the polls and close the client (idempotent)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._client.aclose()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            await self.poll_once()

    async def poll_once(self) -> None:
        """Check every server now, concurrently."""
        await asyncio.gather(*(self._check(s) for s in self.pool.all()))

    async def _check(self, s: ServerState) -> None:
        try:
            health = await self._client.get(s.url + "/health")
            if health.status_code != 200:
                raise ValueError(f"/health answered {health.status_code}")
            r = await self._client.get(s.url + "/server_info")
            if r.status_code in (401, 403):
                raise ValueError(
                    f"/server_info answered {r.status_code}: the server wants another API "
                    f"key; give the router its key with --upstream-api-key (or "
                    f"${UPSTREAM_API_KEY_ENV})"
                )
            if r.status_code != 200:
                raise ValueError(f"/server_info answered {r.status_code}")
            info = parse_server_info(s.role, r.json())
        except httpx.ConnectError as e:
            self.on_failure(s)
            self.pool.record_failure(s, f"connection refused ({e})", immediate=True)
        except httpx.TimeoutException:
            self.on_failure(s)
            self.pool.record_failure(
                s, f"health check timed out after {self.config.health_timeout:g} s"
            )
        except (httpx.HTTPError, ValueError) as e:
            self.on_failure(s)
            immediate = isinstance(e, ServerModeError)  # misregistered: never route to it
            self.pool.record_failure(s, str(e) or type(e).__name__, immediate=immediate)
        else:
            self.pool.record_success(s, info)
