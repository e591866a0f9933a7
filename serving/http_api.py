"""The HTTP front of one server: SGLang-style `/generate`, OpenAI-compatible completions
and chat, health, Prometheus metrics, server info and profiling.

    app = build_app(client, model_name=..., tokenizer=..., vocab_size=..., context_length=...,
                    chat_template=load_chat_template(model_dir), metrics=ServerMetrics())

Every endpoint validates its request before the engine sees it (`serving.api_models`:
strict bodies; token ids in `[0, vocab_size)`; a non-empty prompt; `prompt + max_new_tokens
<= context_length`; `SamplingParams.validate`), and every error is an OpenAI-style body
`{"error": {"message", "type", "code"}}`: 4xx for the request's fault (including an
`InputError` the engine raises at submit), 503 for a server that cannot take work now (any
other `CpkvError` at submit, e.g. the engine loop's `ServerShuttingDownError`, or a request
the server aborted), 500 for an engine error (`finish_reason == "error"`).

Streaming (`stream: true`) answers Server-Sent Events, `data: {json}\\n\\n` ... `data:
[DONE]\\n\\n`. The status line is sent with the first generated token, so a request the
engine refuses still gets its 4xx / 503; an error after that is one `data: {"error": ...}`
event before `[DONE]`. `/generate` events carry the cumulative `text` and `output_ids` so
far (as SGLang does); OpenAI chunks carry deltas. Text is decoded incrementally and only
emitted once it no longer ends in an incomplete UTF-8 character, and stop strings are
trimmed (OpenAI semantics: the stop string and what follows it are not returned; while
streaming, the last `len(longest stop) - 1` characters are held back until they cannot
start a stop string).

A client that goes away aborts its request in the engine: every wait on the engine races
a listener for the ASGI `http.disconnect` message, and the streaming response closes the
engine stream (which aborts, per `EngineClient`) however it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from cpkv_jax.errors import CpkvError, InputError
from cpkv_jax.tokenizer import Tokenizer
from serving.api_models import (
    ChatCompletionBody,
    CompletionBody,
    GenerateBody,
    ProfileBody,
    describe_validation_error,
)
from serving.chat_template import ChatTemplate
from serving.engine_api import EngineClient, GenerateRequest, OutputChunk, SamplingParams
from serving.metrics import RequestTimer, ServerMetrics
from serving.wait_queue import QueueFullError

logger = logging.getLogger(__name__)
_M = TypeVar("_M", bound=BaseModel)

# Prompts longer than this many characters are tokenized off the event loop.
_TOKENIZE_INLINE_CHARS = 4096
_REPLACEMENT_CHAR = "\ufffd"
_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
# nginx's "client closed request": logged, never seen by the (gone) client.
_CLIENT_CLOSED_REQUEST = 499


class ApiError(Exception):
    """An HTTP error answered as `{"error": {"message", "type", "code"}}`."""

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
        self.kind = kind or _ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers


class ClientDisconnectedError(Exception):
    """The HTTP client went away while its request was being served."""


def error_body(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    kind = kind or _ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": status}}


def _sse(obj: dict[str, Any] | str) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


# ---- text --------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Token ids -> text, one token at a time, never emitting a partial UTF-8 character.

    The window algorithm of TGI / vLLM: decode `ids[prefix:]` and `ids[prefix:read]`; the
    difference is new text once it does not end in U+FFFD (a character split across
    tokens). Decoding from a recent `prefix` keeps it O(window) per token and lets
    tokenizers that drop leading spaces decode a word's continuation correctly.
    `offsets[i]` is the length of `text` before token `i` contributed to it.
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self.offsets: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def add(self, ids: Sequence[int]) -> None:
        for t in ids:
            self.offsets.append(len(self.text))
            self.ids.append(t)
            self._advance(final=False)

    def flush(self) -> None:
        """At the end of the output: emit what is pending even if it is incomplete."""
        self._advance(final=True)

    def _advance(self, *, final: bool) -> None:
        if self._tok is None or self._read == len(self.ids):
            return
        prefix_text = self._tok.decode(self.ids[self._prefix : self._read])
        new_text = self._tok.decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(_REPLACEMENT_CHAR)):
            self.text += new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)

    def token_text(self, token_id: int) -> str:
        """One token on its own (special tokens kept), for log-prob listings."""
        if self._tok is None:
            return f"token_id:{token_id}"
        return self._tok.decode([token_id], skip_special_tokens=False)


class OutputText:
    """The client-visible text of one output: decoded, trimmed at the first stop string.

    `add` returns the text that became safe to send (for streams); `text` is all the text
    released so far. `matched` is the stop string that ended the output, if any.
    """

    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._sent = 0
        self._cut: int | None = None
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """The text released so far (all of it, trimmed, once `finish` ran)."""
        return self.detok.text[: self._sent]

    def add(self, ids: Sequence[int]) -> str:
        self.detok.add(ids)
        return self._delta(final=False)

    def finish(self) -> str:
        self.detok.flush()
        return self._delta(final=True)

    def _delta(self, *, final: bool) -> str:
        full = self.detok.text
        if self._cut is None and self._stop:
            # No stop string can start before `_sent`: the held-back tail covers it.
            hits = [(i, s) for s in self._stop if (i := full.find(s, self._sent)) >= 0]
            if hits:
                self._cut, self.matched = min(hits)
        if self._cut is not None:
            limit = self._cut
        elif final:
            limit = len(full)
        else:
            limit = max(self._sent, len(full) - self._hold)
        delta = full[self._sent : limit]
        self._sent = max(self._sent, limit)
        return delta


# ---- one request against the engine ---------------------------------------------------


class _EngineStream:
    """The engine's chunk stream for one request, raced against the client's disconnect.

    `close` is synchronous so that it also runs to completion inside a task that is being
    cancelled (Starlette cancels a streaming response whose client went away).
    """

    def __init__(self, client: EngineClient, req: GenerateRequest, request: Request) -> None:
        self._client = client
        self.req = req
        self._agen = client.generate(req)
        self._receive = request.receive
        self._disconnect: asyncio.Task[None] | None = None
        self._pending: asyncio.Task[OutputChunk] | None = None
        self.finished = False
        self._dead = False
        self._closed = False

    async def _wait_disconnect(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return

    async def next(self) -> OutputChunk:
        """The next chunk; raises `ClientDisconnectedError` if the client left first."""
        if self._disconnect is None:
            self._disconnect = asyncio.ensure_future(self._wait_disconnect())
        self._pending = asyncio.ensure_future(anext(self._agen))
        done, _ = await asyncio.wait(
            {self._pending, self._disconnect}, return_when=asyncio.FIRST_COMPLETED
        )
        if self._pending in done:
            try:
                chunk = self._pending.result()
            except StopAsyncIteration:
                self._dead = True
                raise RuntimeError(
                    f"the engine stream of request {self.req.rid} ended without a final chunk"
                ) from None
            except BaseException:
                # The generator raised (e.g. the engine refused the request at submit):
                # it is finished, and there is nothing in the engine to abort.
                self._dead = True
                raise
            finally:
                self._pending = None
            self.finished = chunk.finished
            return chunk
        raise ClientDisconnectedError(self.req.rid)

    def close(self, background: set[asyncio.Task[None]]) -> None:
        """Stop listening; abort the request in the engine unless it finished."""
        if self._closed:
            return
        self._closed = True
        if self._disconnect is not None:
            self._disconnect.cancel()
        if self._dead:
            return
        if not self.finished:
            # Closing the stream aborts per the EngineClient contract; the explicit abort
            # also covers a stream still waiting inside a cancelled task.
            self._client.abort(self.req.rid)
        if self._pending is not None and not self._pending.done():
            # The engine generator is suspended in this task: cancelling it closes it.
            self._pending.cancel()
        else:
            task = asyncio.ensure_future(self._agen.aclose())
            background.add(task)
            task.add_done_callback(background.discard)


@dataclasses.dataclass
class _Generation:
    """What one request produced, accumulated chunk by chunk."""

    req: GenerateRequest
    timer: RequestTimer
    out: OutputText
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    meta: dict[str, float | int] = dataclasses.field(default_factory=dict)
    e2e: float | None = None

    @property
    def ids(self) -> list[int]:
        return self.out.detok.ids

    def absorb(self, chunk: OutputChunk) -> str:
        """Take one chunk in; returns the text delta that is now safe to send."""
        self.timer.on_tokens(len(chunk.token_ids))
        if chunk.logprobs is not None:
            self.logprobs.extend(chunk.logprobs)
        delta = self.out.add(chunk.token_ids)
        if chunk.finished:
            delta += self.out.finish()
            self.finish_reason = chunk.finish_reason or "stop"
            self.error = chunk.error
            self.meta = dict(chunk.meta)
            self.e2e = self.timer.finish(self.finish_reason, len(self.req.input_ids))
        return delta

    def abandon(self) -> None:
        """The client left or the stream broke before the final chunk."""
        if self.finish_reason is None:
            self.finish_reason = "abort"
            self.e2e = self.timer.finish("abort", len(self.req.input_ids))

    def failure(self) -> ApiError | None:
        """The HTTP error of a request that finished with "error" or "abort"."""
        if self.finish_reason == "error":
            return ApiError(500, self.error or "the engine failed while serving this request")
        if self.finish_reason == "abort":
            return ApiError(503, "the request was aborted by the server (shutting down?)")
        return None

    def matched(self) -> str | int | None:
        if self.finish_reason != "stop":
            return None
        if self.out.matched is not None:
            return self.out.matched
        return self.ids[-1] if self.ids else None

    def usage(self) -> dict[str, Any]:
        prompt = len(self.req.input_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": len(self.ids),
            "total_tokens": prompt + len(self.ids),
            "prompt_tokens_details": {"cached_tokens": int(self.meta.get("cached_tokens", 0))},
        }

    def completion_logprobs(self, start: int, end: int) -> dict[str, Any]:
        """OpenAI legacy `logprobs` for output tokens `[start, end)`."""
        detok = self.out.detok
        tokens = [detok.token_text(t) for t in self.ids[start:end]]
        values = self.logprobs[start:end]
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": [{t: v} for t, v in zip(tokens, values, strict=True)],
            "text_offset": detok.offsets[start:end],
        }

    def chat_logprobs(self, start: int, end: int) -> dict[str, Any]:
        """OpenAI chat `logprobs` for output tokens `[start, end)` (no alternatives)."""
        content = []
        for t, v in zip(self.ids[start:end], self.logprobs[start:end], strict=True):
            text = self.out.detok.token_text(t)
            raw = None if _REPLACEMENT_CHAR in text else list(text.encode())
            content.append({"token": text, "logprob": v, "bytes": raw, "top_logprobs": []})
        return {"content": content}


class _SSEResponse(StreamingResponse):
    """A streaming response that runs `on_close` however it ends (done, cancelled,
    disconnected, or never iterated), so the engine request is never left running."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# ---- the app --------------------------------------------------------------------------


class _Api:
    """The handlers of one app and the state they share."""

    def __init__(
        self,
        client: EngineClient,
        *,
        model_name: str,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        context_length: int,
        chat_template: ChatTemplate | None,
        metrics: ServerMetrics,
        server_info: Callable[[], dict[str, Any]] | None,
        profile_dir: str,
    ) -> None:
        self.client = client
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.chat_template = chat_template
        self.metrics = metrics
        self.server_info_fn = server_info
        self.profile_dir = profile_dir
        self.profiling_to: str | None = None
        self.created = int(time.time())
        self.background: set[asyncio.Task[None]] = set()

    # -- parsing and validation --

    @staticmethod
    async def parse(request: Request, model: type[_M], *, empty_ok: bool) -> _M:
        body = await request.body()
        if not body.strip() and empty_ok:
            body = b"{}"
        try:
            return model.model_validate_json(body)
        except ValidationError as e:
            raise ApiError(400, describe_validation_error(e)) from None

    async def tokenize(self, text: str, *, field: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(
                400,
                f"'{field}' is text, but this server has no tokenizer (no tokenizer.json in "
                "the model dir): send token ids instead",
            )
        if len(text) > _TOKENIZE_INLINE_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text)
        return self.tokenizer.encode(text)

    def openai_envelope(
        self, rid: str, obj: str, created: int, choices: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The fields every OpenAI completion / chat response and stream chunk carries."""
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.model_name,
            "choices": choices,
        }

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"model {model!r} does not exist here; this server serves {self.model_name!r}",
                "model_not_found",
            )

    def make_request(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        arrival: float,
        bootstrap_room: str | None = None,
        decode_transfer_target: str | None = None,
        bootstrap_cp_size: int | None = None,
    ) -> GenerateRequest:
        """Validate a tokenized request against this model and build the engine request."""
        if not input_ids:
            raise ApiError(400, "the prompt is empty: send at least one token")
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(
                400,
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
            )
        try:
            sampling.validate(self.vocab_size)
        except InputError as e:
            raise ApiError(400, str(e)) from None
        if sampling.stop and self.tokenizer is None:
            raise ApiError(
                400,
                "stop strings need a tokenizer, and this server has none: use stop_token_ids",
            )
        total = len(input_ids) + sampling.max_new_tokens
        if total > self.context_length:
            raise ApiError(
                400,
                f"the prompt ({len(input_ids)} tokens) plus max new tokens "
                f"({sampling.max_new_tokens}) is {total}, over the context length "
                f"{self.context_length}: shorten the prompt or lower max_tokens",
            )
        return GenerateRequest(
            rid=rid or uuid.uuid4().hex,
            input_ids=tuple(input_ids),
            sampling=sampling,
            return_logprob=return_logprob,
            bootstrap_room=bootstrap_room,
            decode_transfer_target=decode_transfer_target,
            bootstrap_cp_size=bootstrap_cp_size,
            arrival_time=arrival,
        )

    # -- driving the engine --

    async def first_chunk(
        self, req: GenerateRequest, request: Request, arrival: float
    ) -> tuple[_EngineStream, _Generation, OutputChunk]:
        """Submit and wait for the first chunk, mapping submit errors to HTTP statuses."""
        stream = _EngineStream(self.client, req, request)
        gen = _Generation(
            req=req,
            timer=self.metrics.start_request(arrival),
            out=OutputText(self.tokenizer, req.sampling.stop),
        )
        try:
            chunk = await stream.next()
        except ClientDisconnectedError:
            stream.close(self.background)
            raise
        except InputError as e:
            stream.close(self.background)
            raise ApiError(400, str(e)) from None
        except QueueFullError as e:  # backpressure: come back later
            stream.close(self.background)
            raise ApiError(
                503, str(e), "service_unavailable", {"Retry-After": str(e.retry_after_s)}
            ) from None
        except CpkvError as e:  # e.g. the engine loop's ServerShuttingDownError
            stream.close(self.background)
            raise ApiError(503, f"{type(e).__name__}: {e}") from None
        except BaseException:
            stream.close(self.background)
            raise
        return stream, gen, chunk

    async def run_to_end(
        self, req: GenerateRequest, request: Request, arrival: float
    ) -> _Generation:
        """A non-streaming request: every chunk, or `ClientDisconnectedError`."""
        stream, gen, chunk = await self.first_chunk(req, request, arrival)
        try:
            gen.absorb(chunk)
            while not chunk.finished:
                chunk = await stream.next()
                gen.absorb(chunk)
        except BaseException:
            gen.abandon()
            raise
        finally:
            stream.close(self.background)
        if (err := gen.failure()) is not None:
            raise err
        return gen

    def stream_response(
        self,
        stream: _EngineStream,
        gen: _Generation,
        first: OutputChunk,
        render: Callable[[_Generation, OutputChunk, str, int], list[dict[str, Any]]],
        tail: Callable[[_Generation], list[dict[str, Any]]] = lambda g: [],
    ) -> _SSEResponse:
        """SSE of one request: `render(gen, chunk, delta, n_tokens_before)` gives the events
        of each chunk, `tail(gen)` those after the last one; then `[DONE]`."""

        async def events() -> AsyncIterator[bytes]:
            chunk = first
            try:
                while True:
                    before = len(gen.ids)
                    delta = gen.absorb(chunk)
                    if chunk.finished and (err := gen.failure()) is not None:
                        yield _sse(error_body(err.status, err.message, err.kind))
                        break
                    for event in render(gen, chunk, delta, before):
                        yield _sse(event)
                    if chunk.finished:
                        for event in tail(gen):
                            yield _sse(event)
                        break
                    chunk = await stream.next()
            except ClientDisconnectedError:
                gen.abandon()
                return
            except Exception as e:
                gen.abandon()
                logger.exception("stream of request %s failed", gen.req.rid)
                yield _sse(error_body(500, f"the stream failed: {type(e).__name__}: {e}"))
            finally:
                stream.close(self.background)
            yield _sse("[DONE]")

        def on_close() -> None:
            gen.abandon()
            stream.close(self.background)

        return _SSEResponse(events(), on_close)

    # -- /generate --

    async def generate(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await self.parse(request, GenerateBody, empty_ok=False)
        if body.text is not None:
            ids = await self.tokenize(body.text, field="text")
        else:
            ids = list(body.input_ids or ())
        req = self.make_request(
            ids,
            body.sampling_params.to_engine(),
            rid=body.rid,
            return_logprob=body.return_logprob,
            arrival=arrival,
            **body.pd_fields(),
        )
        if not body.stream:
            try:
                gen = await self.run_to_end(req, request, arrival)
            except ClientDisconnectedError:
                return Response(status_code=_CLIENT_CLOSED_REQUEST)
            return JSONResponse(self._generate_result(gen))
        try:
            stream, gen, first = await self.first_chunk(req, request, arrival)
        except ClientDisconnectedError:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)

        def render(
            g: _Generation, chunk: OutputChunk, delta: str, before: int
        ) -> list[dict[str, Any]]:
            return [self._generate_result(g)]

        return self.stream_response(stream, gen, first, render)

    def _generate_result(self, gen: _Generation) -> dict[str, Any]:
        """`/generate`'s body (and each stream event): cumulative text and ids so far."""
        finish: dict[str, Any] | None = None
        if gen.finish_reason is not None:
            finish = {"type": gen.finish_reason}
            if (matched := gen.matched()) is not None:
                finish["matched"] = matched
        meta: dict[str, Any] = {
            "id": gen.req.rid,
            "prompt_tokens": len(gen.req.input_ids),
            "completion_tokens": len(gen.ids),
            "cached_tokens": int(gen.meta.get("cached_tokens", 0)),
            "finish_reason": finish,
            "e2e_latency": gen.e2e,
            "ttft": gen.timer.ttft,
        }
        if gen.req.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(gen.logprobs, gen.ids, strict=False)
            ]
        out: dict[str, Any] = {"output_ids": list(gen.ids), "meta_info": meta}
        if self.tokenizer is not None:
            out = {"text": gen.out.text, **out}
        return out

    # -- /v1/completions --

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await self.parse(request, CompletionBody, empty_ok=False)
        self.check_model(body.model)
        if isinstance(body.prompt, str):
            ids = await self.tokenize(body.prompt, field="prompt")
        else:
            ids = list(body.prompt)
        want_logprobs = body.logprobs is not None
        req = self.make_request(
            ids,
            body.to_engine(body.max_new_tokens()),
            return_logprob=want_logprobs,
            arrival=arrival,
            **body.pd_fields(),
        )
        rid, created = f"cmpl-{req.rid}", int(time.time())
        if not body.stream:
            try:
                gen = await self.run_to_end(req, request, arrival)
            except ClientDisconnectedError:
                return Response(status_code=_CLIENT_CLOSED_REQUEST)
            choice = {
                "index": 0,
                "text": gen.out.text,
                "logprobs": gen.completion_logprobs(0, len(gen.ids)) if want_logprobs else None,
                "finish_reason": gen.finish_reason,
                "token_ids": list(gen.ids),  # extension: the ids behind `text`
            }
            body_out = self.openai_envelope(rid, "text_completion", created, [choice])
            return JSONResponse({**body_out, "usage": gen.usage()})
        try:
            stream, gen, first = await self.first_chunk(req, request, arrival)
        except ClientDisconnectedError:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)

        def envelope(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return self.openai_envelope(rid, "text_completion", created, choices)

        def render(
            g: _Generation, chunk: OutputChunk, delta: str, before: int
        ) -> list[dict[str, Any]]:
            # Without a tokenizer the text stays empty: the token ids are the output.
            ids_matter = want_logprobs or self.tokenizer is None
            if not (delta or chunk.finished or (ids_matter and chunk.token_ids)):
                return []
            choice = {
                "index": 0,
                "text": delta,
                "logprobs": g.completion_logprobs(before, len(g.ids)) if want_logprobs else None,
                "finish_reason": g.finish_reason if chunk.finished else None,
                "token_ids": list(chunk.token_ids),
            }
            return [envelope([choice])]

        def tail(g: _Generation) -> list[dict[str, Any]]:
            return [{**envelope([]), "usage": g.usage()}] if body.include_usage else []

        return self.stream_response(stream, gen, first, render, tail)

    # -- /v1/chat/completions --

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await self.parse(request, ChatCompletionBody, empty_ok=False)
        self.check_model(body.model)
        if self.chat_template is None:
            raise ApiError(
                400,
                "the model dir has no chat template (chat_template.jinja or tokenizer_config."
                "json 'chat_template'): use /v1/completions with a formatted prompt",
            )
        try:
            prompt = self.chat_template.render([m.for_template() for m in body.messages])
        except InputError as e:
            raise ApiError(400, str(e)) from None
        ids = await self.tokenize(prompt, field="messages")
        req = self.make_request(
            ids,
            body.to_engine(body.max_new_tokens(len(ids), self.context_length)),
            return_logprob=body.logprobs,
            arrival=arrival,
            **body.pd_fields(),
        )
        rid, created = f"chatcmpl-{req.rid}", int(time.time())
        if not body.stream:
            try:
                gen = await self.run_to_end(req, request, arrival)
            except ClientDisconnectedError:
                return Response(status_code=_CLIENT_CLOSED_REQUEST)
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": gen.out.text},
                "logprobs": gen.chat_logprobs(0, len(gen.ids)) if body.logprobs else None,
                "finish_reason": gen.finish_reason,
            }
            body_out = self.openai_envelope(rid, "chat.completion", created, [choice])
            return JSONResponse({**body_out, "usage": gen.usage()})
        try:
            stream, gen, first = await self.first_chunk(req, request, arrival)
        except ClientDisconnectedError:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)

        def envelope(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return self.openai_envelope(rid, "chat.completion.chunk", created, choices)

        sent_role = False

        def render(
            g: _Generation, chunk: OutputChunk, delta: str, before: int
        ) -> list[dict[str, Any]]:
            nonlocal sent_role
            events = []
            if not sent_role:  # OpenAI opens every chat stream with the role
                sent_role = True
                role_delta = {"role": "assistant", "content": ""}
                events.append(
                    envelope(
                        [{"index": 0, "delta": role_delta, "logprobs": None, "finish_reason": None}]
                    )
                )
            if delta or chunk.finished or (body.logprobs and chunk.token_ids):
                choice = {
                    "index": 0,
                    "delta": {"content": delta} if delta else {},
                    "logprobs": g.chat_logprobs(before, len(g.ids)) if body.logprobs else None,
                    "finish_reason": g.finish_reason if chunk.finished else None,
                }
                events.append(envelope([choice]))
            return events

        def tail(g: _Generation) -> list[dict[str, Any]]:
            return [{**envelope([]), "usage": g.usage()}] if body.include_usage else []

        return self.stream_response(stream, gen, first, render, tail)

    # -- the rest --

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "cpkv-jax",
                    "max_model_len": self.context_length,
                }
            ],
        }

    def health(self) -> Response:
        if self.client.healthy():
            return JSONResponse({"status": "ok"})
        why = self.client.fatal_reason()
        raise ApiError(
            503, f"the engine is not healthy: {why}" if why else "the server is shutting down"
        )

    def metrics_text(self) -> Response:
        text, content_type = self.metrics.render()
        return Response(content=text, media_type=content_type)

    async def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = dict(self.server_info_fn()) if self.server_info_fn else {}
        try:
            stats = self.client.stats()
        except Exception as e:
            raise ApiError(503, f"the engine could not report its stats: {e}") from e
        info.update(dataclasses.asdict(stats))
        info.update(
            model_name=self.model_name,
            context_length=self.context_length,
            vocab_size=self.vocab_size,
            has_tokenizer=self.tokenizer is not None,
            has_chat_template=self.chat_template is not None,
        )
        return info

    async def start_profile(self, request: Request) -> dict[str, Any]:
        body = await self.parse(request, ProfileBody, empty_ok=True)
        if self.profiling_to is not None:
            raise ApiError(400, f"a profile is already being recorded to {self.profiling_to}")
        out_dir = body.output_dir or self.profile_dir
        import jax.profiler  # only this endpoint needs JAX

        try:
            await asyncio.to_thread(jax.profiler.start_trace, out_dir)
        except (RuntimeError, OSError) as e:
            raise ApiError(400, f"could not start the JAX profiler to {out_dir}: {e}") from e
        self.profiling_to = out_dir
        logger.info("JAX profiler trace started, writing to %s", out_dir)
        return {"status": "started", "output_dir": out_dir}

    async def stop_profile(self) -> dict[str, Any]:
        if self.profiling_to is None:
            raise ApiError(400, "no profile is being recorded: POST /start_profile first")
        import jax.profiler

        out_dir, self.profiling_to = self.profiling_to, None
        try:
            await asyncio.to_thread(jax.profiler.stop_trace)
        except RuntimeError as e:
            raise ApiError(400, f"could not stop the JAX profiler: {e}") from e
        logger.info("JAX profiler trace written to %s", out_dir)
        return {"status": "stopped", "output_dir": out_dir}


def build_app(
    client: EngineClient,
    *,
    model_name: str,
    tokenizer: Tokenizer | None,
    vocab_size: int,
    context_length: int,
    chat_template: str | ChatTemplate | None,
    metrics: ServerMetrics,
    server_info: Callable[[], dict[str, Any]] | None = None,
    profile_dir: str = "/tmp/cpkv-profile",
) -> FastAPI:
    """The FastAPI app serving `client`.

    `chat_template` is a `ChatTemplate` (from `serving.chat_template.load_chat_template`,
    which knows the model's bos / eos strings) or a bare template source. `metrics` gets
    the engine's stats attached (read at each scrape of `/metrics`). `server_info()` is
    merged into `GET /server_info` with the engine's `stats()`.
    """
    if vocab_size <= 0 or context_length <= 0:
        raise ValueError(
            f"vocab_size and context_length must be positive, got {vocab_size}, {context_length}"
        )
    template = ChatTemplate(chat_template) if isinstance(chat_template, str) else chat_template
    metrics.attach_stats(client.stats)
    api = _Api(
        client,
        model_name=model_name,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        context_length=context_length,
        chat_template=template,
        metrics=metrics,
        server_info=server_info,
        profile_dir=profile_dir,
    )
    app = FastAPI(title="cpkv-jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = api

    def error_response(
        status: int, message: str, kind: str | None = None, headers: dict[str, str] | None = None
    ) -> JSONResponse:
        if 400 <= status < 500:
            metrics.record_bad_request()
        return JSONResponse(error_body(status, message, kind), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.kind, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    app.add_api_route("/generate", api.generate, response_model=None, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, response_model=None, methods=["POST"])
    app.add_api_route(
        "/v1/chat/completions", api.chat_completions, response_model=None, methods=["POST"]
    )
    app.add_api_route("/v1/models", api.models, response_model=None, methods=["GET"])
    app.add_api_route("/health", api.health, response_model=None, methods=["GET"])
    app.add_api_route("/metrics", api.metrics_text, response_model=None, methods=["GET"])
    app.add_api_route("/server_info", api.server_info, response_model=None, methods=["GET"])
    app.add_api_route("/start_profile", api.start_profile, response_model=None, methods=["POST"])
    app.add_api_route("/stop_profile", api.stop_profile, response_model=None, methods=["POST"])
    return app
