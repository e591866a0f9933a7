"""API keys of the HTTP servers (`cpkv-serve`) and the router (`cpkv-router`): the keys,
the checks of a configured key, the comparison of a request's `Authorization: Bearer KEY`
and the warning for a server open to the network. Standard library only, so the flag
modules (`serving.server_args`, `serving.router.config`) can use it without importing
the HTTP app; the ASGI middleware that enforces the keys is `serving.http.auth`.

Keys come from `--api-key` / `--admin-api-key` (and the router's `--upstream-api-key`)
or, when the flag is not given, from these environment variables, so a key need not
show in the process list (`serving.flags.from_cli` reads them).
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress

API_KEY_ENV = "CPKV_API_KEY"
ADMIN_API_KEY_ENV = "CPKV_ADMIN_API_KEY"
UPSTREAM_API_KEY_ENV = "CPKV_UPSTREAM_API_KEY"
KEY_ENVS = (API_KEY_ENV, ADMIN_API_KEY_ENV, UPSTREAM_API_KEY_ENV)


@dataclasses.dataclass(frozen=True)
class ApiKeys:
    """The keys one app enforces (None: not set). `api_key` guards every route but the
    open ones; `admin_api_key`, when set, is the only key the admin routes take (and is
    accepted everywhere else too). Never printed: `repr` hides them."""

    api_key: str | None = dataclasses.field(default=None, repr=False)
    admin_api_key: str | None = dataclasses.field(default=None, repr=False)

    def enabled(self) -> bool:
        return self.api_key is not None or self.admin_api_key is not None


def key_problem(key: str | None) -> str | None:
    """Why `key` cannot be an API key (None: it can, or it is not set).

    A key travels in an HTTP header, so it must be printable ASCII without spaces; an
    empty key (an unset shell variable in `CPKV_API_KEY=$KEY`) would lock nobody out
    of anything, so it is refused rather than taken as "no key"."""
    if key is None:
        return None
    if not key:
        return "is empty"
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        return "must be printable ASCII without spaces (it is sent as an HTTP header)"
    return None


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header value (the scheme is
    case-insensitive, RFC 6750), or None when there is no such header."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    token = token.strip()
    return token or None


def same_key(token: bytes, key: str | None) -> bool:
    """Whether `token` is `key`, in time independent of where they differ (a timing
    side channel must not reveal a key prefix by prefix)."""
    return key is not None and hmac.compare_digest(token, key.encode("ascii"))


def is_loopback(host: str) -> bool:
    """Whether a listen address only takes connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name (or 0.0.0.0 spelled otherwise): assume reachable


def open_bind_warning(host: str, port: int, api_key: str | None, exposes: str) -> str | None:
    """The startup warning for HTTP on a non-loopback address without `--api-key`
    (None when bound to loopback or a key is set); `exposes` says what anyone who
    reaches the port can then do."""
    if api_key is not None or is_loopback(host):
        return None
    return (
        f"--host {host} is not a loopback address and no --api-key (or ${API_KEY_ENV}) is "
        f"set: anyone who reaches port {port} can {exposes}; set an API key or listen on "
        "127.0.0.1"
    )
