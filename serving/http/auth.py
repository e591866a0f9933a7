"""API-key enforcement for the server app and the router app: one pure ASGI middleware.

    install_api_keys(app, ApiKeys(api_key, admin_api_key), admin_paths=ADMIN_PATHS)

Every path but `open_paths` (`/health` and `/metrics`, for load balancers and Prometheus)
needs `Authorization: Bearer KEY`. A path in `admin_paths` needs the admin key when one
is set (the API key alone gets 403), else the API key; any other path takes the API key
or the admin key. A missing or wrong key is a 401, a 403 an API key on an admin path,
each with the `{"error": ...}` body of `serving.http.errors` and logged without the key
(at most one line per client host every 10 s, with the count of the others).

It is a middleware, not a per-route dependency, so a route added later is guarded by
default, unknown paths included (no probing which routes exist), and it never touches
a streaming response (it answers before the app runs, or passes everything through).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.api_keys import ApiKeys, bearer_token, same_key
from serving.http.errors import error_body

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})
# OpenAI's `type` for these statuses (its clients raise AuthenticationError /
# PermissionDeniedError from the status alone).
UNAUTHORIZED_TYPE = "authentication_error"
# Refusals are logged at most once per client host per this many seconds (with a count).
REFUSAL_LOG_INTERVAL_S = 10.0
MAX_TRACKED_HOSTS = 4096
FORBIDDEN_TYPE = "permission_error"


def route_path(scope: Scope) -> str:
    """The path the app's router matches (`scope["path"]` less a `root_path` prefix), as
    Starlette computes it: the key check must classify exactly what the route will be."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root) and path != root and path[len(root)] == "/":
        return path[len(root) :]
    return path


class ApiKeyMiddleware:
    """Refuses an HTTP request without the key its path needs (module docstring);
    `on_reject()` runs for each refusal (the server counts them as bad requests)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: ApiKeys,
        admin_paths: Collection[str] = (),
        open_paths: Collection[str] = OPEN_PATHS,
        on_reject: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.keys = keys
        self.admin_paths = frozenset(admin_paths)
        self.open_paths = frozenset(open_paths)
        self.on_reject = on_reject
        self.clock = clock
        # Per client host: when its last refusal was logged, and how many since then went
        # unlogged (a flood of bad keys must not become a flood of log lines).
        self._logged: dict[str, tuple[float, int]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.check(scope)
            if refusal is not None:
                await self.refuse(scope, send, *refusal)
                return
        await self.app(scope, receive, send)

    def check(self, scope: Scope) -> tuple[int, str, str] | None:
        """None when the request may go on, else (status, type, message)."""
        path = route_path(scope)
        if path in self.open_paths:
            return None
        api, admin = self.keys.api_key, self.keys.admin_api_key
        admin_only = path in self.admin_paths and admin is not None
        if not admin_only and api is None:
            return None  # no API key: only the admin paths are guarded (by the admin key)
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        token = bearer_token(header)
        if token is None:
            return 401, UNAUTHORIZED_TYPE, "missing API key: send `Authorization: Bearer KEY`"
        # Both comparisons always run: how long the check takes says nothing of which matched.
        is_admin, is_api = same_key(token, admin), same_key(token, api)
        if is_admin or (is_api and not admin_only):
            return None
        if is_api:
            return (
                403,
                FORBIDDEN_TYPE,
                f"{path} needs the admin API key (--admin-api-key): the API key is not enough",
            )
        return 401, UNAUTHORIZED_TYPE, "invalid API key"

    async def refuse(self, scope: Scope, send: Send, status: int, kind: str, message: str) -> None:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "unknown client"
        self._log(client[0] if client else "", who, scope, status, message)
        if self.on_reject is not None:
            self.on_reject()
        body = json.dumps(error_body(status, message, kind)).encode()
        headers: list[tuple[bytes, bytes]] = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))  # RFC 6750
        # The request body is left unread: the server closes or drains it (h11 / httptools).
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _log(self, host: str, who: str, scope: Scope, status: int, message: str) -> None:
        """Log a refusal, at most one per client host every `REFUSAL_LOG_INTERVAL_S`; the
        next line logged for that host says how many were refused in between."""
        now = self.clock()
        last, quiet = self._logged.get(host, (None, 0))
        if last is not None and now - last < REFUSAL_LOG_INTERVAL_S:
            self._logged[host] = (last, quiet + 1)
            return
        if len(self._logged) >= MAX_TRACKED_HOSTS:  # bounded memory under a spread-out flood
            self._logged.clear()
        self._logged[host] = (now, 0)
        also = f" ({quiet} more refused from {host} since the last line)" if quiet else ""
        logger.warning(
            "refused %s %s from %s (%d): %s%s",
            scope["method"],
            scope["path"],
            who,
            status,
            message,
            also,
        )


def install_api_keys(
    app: FastAPI,
    keys: ApiKeys,
    *,
    admin_paths: Collection[str] = (),
    on_reject: Callable[[], None] | None = None,
) -> None:
    """Guard `app` with `keys` (nothing to do when no key is set)."""
    if not keys.enabled():
        return
    kw: dict[str, Any] = {"keys": keys, "admin_paths": admin_paths, "on_reject": on_reject}
    app.add_middleware(ApiKeyMiddleware, **kw)
