"""The error answer every cpkv HTTP server (and the router) gives:
`{"error": {"message", "type", "code"}}` with `code` the HTTP status, OpenAI-style.

    raise ApiError(400, "the prompt is empty")          # inside a handler
    return error_response(503, "no server", "service_unavailable")
    yield sse_event(error_body(500, "the stream failed"))  # see serving.http.streaming

`error_body` is the single place that body is built, so the server, its stream error
events and the router cannot drift apart. `engine_error` maps what an engine raises at
submit to the status the client gets; `install_error_handlers` makes every exception a
route raises (an `ApiError`, a routing 404 / 405, a validation error, a bug) such a body.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from cpkv_jax.errors import CpkvError, InputError
from serving.engine.wait_queue import QueueFullError
from serving.server_args import as_flags

logger = logging.getLogger(__name__)

# The OpenAI `type` of a status when the caller names none.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
# nginx's "client closed request": logged, never seen by the (gone) client.
CLIENT_CLOSED_REQUEST = 499


def error_type(status: int) -> str:
    """The default `type` of an error with HTTP status `status`."""
    return ERROR_TYPES.get(status, "invalid_request_error")


def error_body(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """`{"error": {"message", "type", "code"}}`; `kind` defaults to `error_type(status)`.

    Parameters that library errors name (`staging_bytes`) are said as the flags a server
    user sets (`--transfer-staging-size`)."""
    body = {"message": as_flags(message), "type": kind or error_type(status), "code": status}
    return {"error": body}


def error_response(
    status: int,
    message: str,
    kind: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A JSON response with `error_body(status, message, kind)` and status `status`."""
    return JSONResponse(error_body(status, message, kind), status_code=status, headers=headers)


class ApiError(Exception):
    """An HTTP error answered as `error_body(status, message, kind)` (with `headers`).

    Raise it from a handler; the app's exception handler turns it into the response.
    """

    def __init__(
        self,
        status: int,
        message: str,
        kind: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or error_type(status)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.kind)

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.kind, self.headers)


class ClientDisconnectedError(Exception):
    """The HTTP client went away while its request was being served (answered 499)."""


def engine_error(e: BaseException) -> ApiError | None:
    """The `ApiError` for an exception an engine raised at submit, or None if it is not an
    engine refusal (a bug: let it become a 500).

    `InputError` is the request's fault (400); a full wait queue is backpressure (503 with
    `Retry-After`); any other `CpkvError` (e.g. `ServerShuttingDownError`) means the server
    cannot take work now (503).
    """
    if isinstance(e, InputError):
        return ApiError(400, str(e))
    if isinstance(e, QueueFullError):
        return ApiError(503, str(e), "service_unavailable", {"Retry-After": str(e.retry_after_s)})
    if isinstance(e, CpkvError):
        return ApiError(503, f"{type(e).__name__}: {e}")
    return None


def install_error_handlers(
    app: FastAPI, *, on_client_error: Callable[[], None] | None = None
) -> None:
    """Answer every exception `app`'s routes raise with `error_body`: an `ApiError` as it
    says, Starlette's HTTP errors (unknown path, wrong method) with their status, a request
    validation error as 400, anything else as 500 (logged). `on_client_error()` runs for
    each 4xx (the server counts bad requests)."""

    def respond(
        status: int, message: str, kind: str | None = None, headers: dict[str, str] | None = None
    ) -> JSONResponse:
        if on_client_error is not None and 400 <= status < 500:
            on_client_error()
        return error_response(status, message, kind, headers)

    @app.exception_handler(ClientDisconnectedError)
    async def _client_gone(request: Request, exc: ClientDisconnectedError) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads a body

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return respond(exc.status, exc.message, exc.kind, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(400, str(exc))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return respond(500, f"internal error: {type(exc).__name__}: {exc}")
