"""`cpkv-router` configuration: `RouterConfig`, one field per flag (the command line is
generated from the fields by `serving.flags`, as `cpkv-serve`'s is), and its checks.

API keys: `--api-key` (or `$CPKV_API_KEY`) is what the router's clients must send;
`--upstream-api-key` (or `$CPKV_UPSTREAM_API_KEY`) is what the router sends to the
servers behind it, on every request and health poll, and defaults to the router's own
`--api-key`, so one key set in the environment of every process of a deployment just
works. The client's own `Authorization` header is never forwarded. The router has no
route that changes state, hence no admin key."""

from __future__ import annotations

import argparse
import dataclasses
import urllib.parse
from collections.abc import Sequence
from typing import Literal

from cpkv_jax.errors import ConfigError
from serving import flags
from serving.api_keys import API_KEY_ENV, UPSTREAM_API_KEY_ENV, key_problem, open_bind_warning
from serving.flags import arg as _arg

Role = Literal["prefill", "decode", "worker"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "worker")


class RouterConfigError(ConfigError):
    """A `cpkv-router` flag is missing, malformed or inconsistent."""


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
    api_key: str | None = _arg(
        None,
        help="key every route but /health and /metrics requires, sent as "
        "`Authorization: Bearer KEY`; none = no key",
        metavar="KEY",
        env=API_KEY_ENV,
        secret=True,
    )
    upstream_api_key: str | None = _arg(
        None,
        help="key the router sends to its servers (their --api-key); none = the router's "
        "own --api-key, if any",
        metavar="KEY",
        env=UPSTREAM_API_KEY_ENV,
        secret=True,
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
        for name, env in (("api_key", API_KEY_ENV), ("upstream_api_key", UPSTREAM_API_KEY_ENV)):
            problem = key_problem(getattr(self, name))
            if problem is not None:
                raise RouterConfigError(f"{flags.flag_name(name)} (or ${env}) {problem}")
        return dataclasses.replace(self, **urls)

    def warnings(self) -> tuple[str, ...]:
        """What `cpkv-router` logs at startup about an accepted but risky configuration."""
        exposes = "generate through every server behind the router and read /servers"
        warning = open_bind_warning(self.host, self.port, self.api_key, exposes)
        return (warning,) if warning is not None else ()

    def upstream_headers(self) -> dict[str, str]:
        """The headers of every call to a server: its API key, when the router has one."""
        key = self.upstream_api_key if self.upstream_api_key is not None else self.api_key
        return {"Authorization": f"Bearer {key}"} if key is not None else {}

    @classmethod
    def build_parser(cls) -> argparse.ArgumentParser:
        """`--prefill A B` and `--prefill A --prefill B` both work (tuple fields)."""
        parser = flags.RaisingParser(
            prog="cpkv-router",
            description="Route requests over cpkv-serve prefill/decode (PD) servers.",
            error_class=RouterConfigError,
        )
        flags.add_dataclass_args(parser, cls)
        return parser

    @classmethod
    def from_cli(cls, argv: Sequence[str] | None = None) -> RouterConfig:
        """Parse and validate the command line; errors raise `RouterConfigError`."""
        return flags.from_cli(cls, cls.build_parser(), argv).validate()
