"""The `cpkv-router` FastAPI app (`build_router_app`) and its command line (`main`).

    cpkv-router --prefill URL [URL ...] --decode URL [URL ...] [--worker URL ...]
                --host 127.0.0.1 --port 8000

Routes: the PD endpoints (`/generate`, `/v1/completions`, `/v1/chat/completions`,
relayed by `serving.router.relay`), `/v1/models` (from a healthy decode server or
worker), `/health`, `/servers` (every server's state) and `/metrics` (Prometheus).
With `--api-key` every route but `/health` and `/metrics` needs `Authorization: Bearer
KEY` (`serving.http.auth`, the servers' middleware); the key the router sends upstream is
`RouterConfig.upstream_headers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence

import httpx
import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cpkv_jax.cli_logging import configure_logging
from serving.api_keys import ApiKeys
from serving.http.auth import install_api_keys
from serving.http.errors import error_response
from serving.http.keepalive import HTTP_KEEPALIVE_S
from serving.router.config import ROLES, RouterConfig, RouterConfigError
from serving.router.relay import PD_ENDPOINTS, PDRouter, RouterStartupError

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1
EXIT_USAGE = 2  # argparse's convention for a bad command line


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
            return error_response(f.status, f.message, f.type)
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

    install_api_keys(app, ApiKeys(config.api_key))  # no route changes state: no admin key
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
    for warning in config.warnings():
        logger.warning(warning)
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
                timeout_keep_alive=HTTP_KEEPALIVE_S,  # longer than clients' idle expiry
                timeout_graceful_shutdown=5,
            )
        )
        await server.serve()
    finally:
        await router.close()
    return EXIT_OK
