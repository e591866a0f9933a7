"""Streaming responses that never leave upstream work running, and the client-disconnect
wait they race against. Shared by the server's SSE answers and the router's relay.

    async def events():
        yield sse_event({"text": "hi"})
        yield SSE_DONE
    return sse_response(events(), on_close=lambda: client.abort(rid))

Starlette cancels a streaming response whose client went away, and never iterates the
body of one whose client left before it started: `ClosingStreamingResponse` runs its
`on_close` in every one of those cases, so it is the place to abort the engine request /
close the upstream. `on_close` is synchronous so that it runs to completion inside a task
that is being cancelled; it must be idempotent (the body's own `finally` may run it too).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_MEDIA_TYPE = "text/event-stream"
# No caching, and no proxy buffering (nginx would otherwise hold events back).
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(obj: dict[str, Any] | str) -> bytes:
    """One Server-Sent Event, `data: {json}\\n\\n` (a str is sent as it is)."""
    payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client goes away. Call it once the request body is read: from then
    on the next ASGI message is `http.disconnect`."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ClosingStreamingResponse(StreamingResponse):
    """A `StreamingResponse` that runs `on_close()` however it ends: done, failed,
    cancelled, client disconnected, or the body never iterated."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], None],
        *,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
        media_type: str | None = None,
    ) -> None:
        super().__init__(content, status_code=status_code, headers=headers, media_type=media_type)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse_response(
    content: AsyncIterator[bytes], on_close: Callable[[], None], *, status_code: int = 200
) -> ClosingStreamingResponse:
    """An SSE `ClosingStreamingResponse` (`text/event-stream`, `SSE_HEADERS`)."""
    return ClosingStreamingResponse(
        content,
        on_close,
        status_code=status_code,
        headers=dict(SSE_HEADERS),
        media_type=SSE_MEDIA_TYPE,
    )
