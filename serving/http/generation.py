"""Serving one HTTP request against the engine, shared by the `/generate` and OpenAI
routes: parse and validate (`ApiCore.parse`, `tokenize`, `make_request`), submit and wait
for the first chunk (`first_chunk`, which maps an engine refusal to its 4xx / 503), then
either collect every chunk (`run_to_end`) or stream them as SSE (`stream_response`).

Request ids: a body's `rid` (`/generate`), else the `X-Request-Id` header (which SGLang's
gateway `smg` and other proxies pass through, so logs and traces line up), else a fresh
uuid. A body `rid` already in flight is refused by the engine (400), as SGLang does; a
header id already in flight here gets a unique suffix instead (`request_id`), since a
tracing header is not promised to be unique (one trace may fan out into many requests).

The status line of a stream is sent with the first generated token, so a request the
engine refuses still gets its 4xx / 503; an error after that is one `data: {"error": ...}`
event before `[DONE]`. A client that goes away aborts its request in the engine: every
wait on the engine races `wait_disconnect`, and the streaming response closes the engine
stream (which aborts, per `EngineClient`) however it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from cpkv_jax.errors import InputError
from cpkv_jax.tokenizer import Tokenizer
from serving.engine.api import (
    EngineClient,
    GenerateRequest,
    Grammar,
    OutputChunk,
    SamplingParams,
)
from serving.grammar import GrammarBackend, row_grammar_for
from serving.http.chat_template import ChatRenderer
from serving.http.errors import ApiError, ClientDisconnectedError, engine_error, error_body
from serving.http.gateway_pd import GatewayPD
from serving.http.metrics import RequestTimer, ServerMetrics
from serving.http.models import PDFields, describe_validation_error
from serving.http.streaming import (
    SSE_DONE,
    ClosingStreamingResponse,
    sse_event,
    sse_response,
    wait_disconnect,
)
from serving.http.text import OutputText
from serving.parsers import ChatParserConfig

logger = logging.getLogger(__name__)
_M = TypeVar("_M", bound=BaseModel)
_T = TypeVar("_T")

# Prompts longer than this many characters are tokenized off the event loop.
_TOKENIZE_INLINE_CHARS = 4096
# The longest `X-Request-Id` taken as the request id, leaving room for the suffix within
# a body `rid`'s 256 chars; a longer one is ignored (a fresh id is used), not refused.
MAX_HEADER_RID_CHARS = 200
_SEED_MASK = (1 << 63) - 1
# `render(gen, chunk, delta, n_tokens_before)`: the SSE events of one chunk.
Render = Callable[["Generation", OutputChunk, str, int], list[dict[str, Any]]]


class EngineStream:
    """The engine's chunk stream for one request, raced against the client's disconnect.

    `close` is synchronous so that it also runs to completion inside a task that is being
    cancelled (Starlette cancels a streaming response whose client went away).
    """

    def __init__(
        self,
        client: EngineClient,
        req: GenerateRequest,
        request: Request,
        in_flight: set[str] | None = None,
        disconnect: asyncio.Future[None] | None = None,
    ) -> None:
        self._client = client
        self.req = req
        # The app's ids in flight (`ApiCore.in_flight`); the id leaves it on `close`, unless
        # another request holds it (a duplicate body `rid`, which the engine refuses).
        self._in_flight = None
        if in_flight is not None and req.rid not in in_flight:
            in_flight.add(req.rid)
            self._in_flight = in_flight
        self._agen = client.generate(req)
        self._receive = request.receive
        # The client's disconnect wait: this stream's own, or one that the streams of one
        # HTTP request share (`ApiCore.disconnect_watch`; its owner cancels it).
        self._disconnect: asyncio.Future[None] | None = disconnect
        self._owns_disconnect = disconnect is None
        self._pending: asyncio.Task[OutputChunk] | None = None
        self.finished = False
        self._dead = False
        self._closed = False

    async def next(self) -> OutputChunk:
        """The next chunk; raises `ClientDisconnectedError` if the client left first."""
        if self._disconnect is None:
            self._disconnect = asyncio.ensure_future(wait_disconnect(self._receive))
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
        if self._in_flight is not None:
            self._in_flight.discard(self.req.rid)
        if self._disconnect is not None and self._owns_disconnect:
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
class Generation:
    """What one request produced, accumulated chunk by chunk."""

    req: GenerateRequest
    timer: RequestTimer
    out: OutputText
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # Per output token, its (token id, log-prob) alternatives (requests with top_logprobs).
    top_logprobs: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)
    # Requests with `prompt_logprobs_from`: the prompt tokens' from there (None for token 0).
    prompt_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    prompt_top_logprobs: list[tuple[tuple[int, float], ...]] = dataclasses.field(
        default_factory=list
    )
    finish_reason: str | None = None
    error: str | None = None
    meta: dict[str, float | int] = dataclasses.field(default_factory=dict)
    e2e: float | None = None
    # The choice this generation is in its response (several prompts or `n` > 1).
    index: int = 0

    @property
    def ids(self) -> list[int]:
        return self.out.detok.ids

    def absorb(self, chunk: OutputChunk) -> str:
        """Take one chunk in; returns the text delta that is now safe to send."""
        self.timer.on_tokens(len(chunk.token_ids))
        if chunk.logprobs is not None:
            self.logprobs.extend(chunk.logprobs)
        if chunk.top_logprobs is not None:
            self.top_logprobs.extend(chunk.top_logprobs)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs.extend(chunk.prompt_logprobs)
            self.prompt_top_logprobs.extend(chunk.prompt_top_logprobs or ())
        ids = chunk.token_ids
        # The engine names a stop token that ended the output (the chunk's last id).
        stop = chunk.meta.get("matched_stop_token") if chunk.finished else None
        trim = bool(ids) and stop is not None and int(stop) == ids[-1]
        delta = self.out.add(ids[:-1] if trim else ids)
        if chunk.finished:
            delta += self.out.finish(ids[-1] if trim else None)
            self.finish_reason = chunk.finish_reason or "stop"
            self.error = chunk.error
            self.meta = dict(chunk.meta)
            self.e2e = self.timer.finish(
                self.finish_reason,
                len(self.req.input_ids),
                spec_accept_length=self.meta.get("spec_accept_length"),
            )
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
            return ApiError(
                503,
                "the request was aborted by the server (shutting down, or an operator's "
                "/abort_request)",
            )
        return None

    def matched(self) -> str | int | None:
        if self.finish_reason != "stop":
            return None
        if self.out.matched is not None:
            return self.out.matched
        return self.ids[-1] if self.ids else None

    def cached_tokens_details(self) -> dict[str, int]:
        """`cached_tokens` split by where the KV came from: the device prefix cache or
        the host (L2) cache (SGLang's `cached_tokens_details`)."""
        cached = int(self.meta.get("cached_tokens", 0))
        host = int(self.meta.get("cached_tokens_host", 0))
        return {"device": cached - host, "host": host}

    def usage(self) -> dict[str, Any]:
        prompt = len(self.req.input_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": len(self.ids),
            "total_tokens": prompt + len(self.ids),
            "prompt_tokens_details": {"cached_tokens": int(self.meta.get("cached_tokens", 0))},
        }


def choice_sampling(sampling: SamplingParams, j: int) -> SamplingParams:
    """The sampling of choice `j` of a request's `n` (each choice is its own engine request).

    Choice 0 keeps the request's `seed`, so `n: 1` samples as before. A later choice of a
    seeded request gets a seed derived from `(seed, j)` (BLAKE2b, as `request_seed`
    derives one from a request id), so sampled choices differ and the same request gives
    the same choices again; an unseeded choice keeps no seed, and the engine derives one
    from its own request id (`serving.engine.stopping.request_seed`). Greedy choices do
    not depend on the seed: they are identical.
    """
    if j == 0 or sampling.seed is None:
        return sampling
    digest = hashlib.blake2b(
        f"{sampling.seed}:{j}".encode(), digest_size=8, person=b"cpkv-jax-choice"
    )
    seed = int.from_bytes(digest.digest(), "little") & _SEED_MASK
    return dataclasses.replace(sampling, seed=seed)


def batch_usage(gens: Sequence[Generation], n: int, *, scored_only: bool = False) -> dict[str, Any]:
    """OpenAI `usage` of a response whose choices are `gens`, `n` per prompt in prompt
    order: the prompt tokens once per prompt, the completion tokens of every choice
    (none with `scored_only`: the token drawn to score a prompt is not returned), and
    per prompt the most cached tokens any of its choices had."""
    prompt = completion = cached = 0
    for i in range(0, len(gens), n):
        group = gens[i : i + n]
        prompt += len(group[0].req.input_ids)
        completion += 0 if scored_only else sum(len(g.ids) for g in group)
        cached += max(int(g.meta.get("cached_tokens", 0)) for g in group)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class ApiCore:
    """What every route of one app shares (the engine client, the model's limits, the
    tokenizer, metrics), and the steps of serving one request."""

    def __init__(
        self,
        client: EngineClient,
        *,
        model_name: str,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        context_length: int,
        chat_template: ChatRenderer | None,
        metrics: ServerMetrics,
        model_aliases: Sequence[str] = (),
        chat_parsers: ChatParserConfig | None = None,
        prefix_cache: bool = False,
        grammar: GrammarBackend | None = None,
        gateway_pd: GatewayPD | None = None,
    ) -> None:
        self.client = client
        # PD bodies from SGLang's gateway (bootstrap host / port / room); None outside PD.
        self.gateway_pd = gateway_pd
        # Decode side: rooms to register at their prefill server once submitted, with when
        # they were resolved (a request refused before its submit leaves its entry: pruned).
        self._registrations: dict[str, tuple[str, int | None, float]] = {}
        # Structured output's compiler (`serving.grammar`); None without a tokenizer.
        self.grammar = grammar
        # The engine keeps prompts' KV in a prefix cache: the choices of one prompt (`n`)
        # then follow its first, which leaves the prompt's pages cached for them
        # (`prefill_order`), instead of all prefilling it at once.
        self.prefix_cache = prefix_cache
        # `--tool-call-parser` / `--reasoning-parser` (`serving.http.chat_output`).
        self.chat_parsers = chat_parsers or ChatParserConfig()
        self.model_name = model_name
        self.model_aliases = tuple(a for a in model_aliases if a != model_name)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.chat_template = chat_template
        self.metrics = metrics
        self.created = int(time.time())
        # Engine streams closing after their response ended (kept so they are not GCed).
        self.background: set[asyncio.Task[None]] = set()
        # The request ids this app has submitted and not yet closed (`request_id`).
        self.in_flight: set[str] = set()

    # -- model names and request ids --

    def check_model(self, model: str | None, *, also_any: frozenset[str] = frozenset()) -> None:
        """A request's `model`: omitted, the served name, an alias, or one of `also_any`
        (names that mean "any model"); any other name is a 404 listing the accepted ones."""
        name = self.model_name
        if model is None or model == name or model in self.model_aliases or model in also_any:
            return
        also = ""
        if self.model_aliases:
            also = f" (also accepted: {', '.join(repr(a) for a in self.model_aliases)})"
        raise ApiError(
            404,
            f"model {model!r} does not exist here; this server serves {name!r}{also}",
            "model_not_found",
        )

    def request_id(self, request: Request, body_rid: str | None = None) -> str:
        """The engine request id: `body_rid`, else `X-Request-Id`, else a fresh uuid (module
        docstring). A header id already in flight here gets a suffix, so a repeated trace
        id never refuses a request."""
        if body_rid is not None:
            return body_rid
        header = request.headers.get("x-request-id", "").strip()
        if not header or len(header) > MAX_HEADER_RID_CHARS:
            return uuid.uuid4().hex
        if header in self.in_flight:
            return f"{header}-{uuid.uuid4().hex}"
        return header

    def request_ids(self, request: Request, count: int) -> tuple[str, list[str]]:
        """The response's id and the engine request ids of its `count` choices: the
        `request_id` itself for one, `<id>-<k>` for choice `k` of several (a fresh suffix
        on the id when one of those is in flight here)."""
        base = self.request_id(request)
        if count == 1:
            return base, [base]
        if any(f"{base}-{k}" in self.in_flight for k in range(count)):
            base = f"{base}-{uuid.uuid4().hex}"
        return base, [f"{base}-{k}" for k in range(count)]

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

    def make_request(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs: int = 0,
        prompt_logprobs_from: int | None = None,
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
            top_logprobs=top_logprobs if return_logprob else 0,
            prompt_logprobs_from=prompt_logprobs_from if return_logprob else None,
            bootstrap_room=bootstrap_room,
            decode_transfer_target=decode_transfer_target,
            bootstrap_cp_size=bootstrap_cp_size,
            arrival_time=arrival,
        )

    # -- driving the engine --

    def prefill_order(
        self, reqs: Sequence[GenerateRequest]
    ) -> tuple[list[asyncio.Event | None], list[asyncio.Event | None]]:
        """For requests submitted together: `(after, then)`, per request the event it
        waits for before it is submitted and the one it sets once its first token came
        (or it failed). With a prefix cache, a request whose prompt an earlier one of
        `reqs` has waits for that one's first token: its prompt's pages are cached by
        then, so it prefills only what the cache lacks (one prefill serves `n` choices)."""
        after: list[asyncio.Event | None] = [None] * len(reqs)
        then: list[asyncio.Event | None] = [None] * len(reqs)
        if not self.prefix_cache:
            return after, then
        first: dict[tuple[int, ...], int] = {}
        for k, r in enumerate(reqs):
            lead = first.setdefault(r.input_ids, k)
            if lead != k:
                then[lead] = then[lead] or asyncio.Event()
                after[k] = then[lead]
        return after, then

    async def first_chunk(
        self,
        req: GenerateRequest,
        request: Request,
        arrival: float,
        *,
        index: int = 0,
        disconnect: asyncio.Future[None] | None = None,
        after: asyncio.Event | None = None,
        then: asyncio.Event | None = None,
    ) -> tuple[EngineStream, Generation, OutputChunk]:
        """Submit (once `after` is set) and wait for the first chunk, mapping submit
        errors to HTTP statuses; `then` is set when the first chunk came or it failed."""
        try:
            if after is not None:
                await after.wait()
            return await self._first_chunk(req, request, arrival, index, disconnect)
        finally:
            if then is not None:
                then.set()

    async def _first_chunk(
        self,
        req: GenerateRequest,
        request: Request,
        arrival: float,
        index: int,
        disconnect: asyncio.Future[None] | None,
    ) -> tuple[EngineStream, Generation, OutputChunk]:
        where = self._registrations.pop(req.bootstrap_room or "", None)
        if req.sampling.grammar is not None:
            await self.check_grammar(req.sampling.grammar)
        stream = EngineStream(self.client, req, request, self.in_flight, disconnect)
        if where is not None:  # submitted below: then tell the prefill server our receiver
            self._register_soon(stream, req, where[0], where[1])
        gen = Generation(
            req=req,
            timer=self.metrics.start_request(arrival),
            out=OutputText(
                self.tokenizer,
                req.sampling.stop,
                skip_special_tokens=req.sampling.skip_special_tokens,
                no_stop_trim=req.sampling.no_stop_trim,
            ),
            index=index,
        )
        try:
            chunk = await stream.next()
        except BaseException as e:
            stream.close(self.background)
            # An engine refusal at submit (bad input, full queue, shutting down) is the
            # client's 4xx / 503; anything else (a disconnect, a bug) goes on as it is.
            if (err := engine_error(e)) is not None:
                raise err from None
            raise
        return stream, gen, chunk

    async def pd_fields(self, body: PDFields) -> dict[str, Any]:
        """`GenerateRequest`'s PD keywords from `body`, completed through the bootstrap
        rendezvous for a body from SGLang's gateway (`serving.http.gateway_pd`)."""
        fields = body.pd_fields()
        if body.bootstrap_host is None:
            return fields
        if self.gateway_pd is None:
            raise ApiError(
                400,
                "bootstrap_host: this server is not one side of a PD pair; send the "
                "request to a prefill or decode server, or without the bootstrap fields",
            )
        out = await self.gateway_pd.resolve(fields, body.bootstrap_host, body.bootstrap_port)
        if self.gateway_pd.mode == "decode":
            now = time.monotonic()
            old = now - self.gateway_pd.wait_s
            for room in [r for r, (*_, at) in self._registrations.items() if at < old]:
                del self._registrations[room]
            room = out["bootstrap_room"]
            self._registrations[room] = (body.bootstrap_host, body.bootstrap_port, now)
        return out

    async def check_grammar(self, grammar: Grammar) -> None:
        """Compile `grammar` in a worker thread (cached), so the engine thread only copies
        its matcher; a 400 saying why when it cannot be used."""
        try:
            await asyncio.to_thread(row_grammar_for, self.grammar, grammar)
        except InputError as e:
            raise ApiError(400, str(e)) from None

    def _register_soon(
        self, stream: EngineStream, req: GenerateRequest, host: str, port: int | None
    ) -> None:
        """Register `req`'s room at its prefill server in the background; a failure aborts
        the request (its room and pages freed), whose stream then ends with the reason."""
        assert self.gateway_pd is not None and req.bootstrap_room is not None
        room = req.bootstrap_room

        async def register() -> None:
            await asyncio.sleep(0)  # after the submit that the first `next` starts
            try:
                await self.gateway_pd.register(room, host, port)  # type: ignore[union-attr]
            except Exception as e:
                logger.warning("request %s: PD bootstrap registration failed: %s", req.rid, e)
                self.client.abort(req.rid)

        task = asyncio.ensure_future(register())
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def run_to_end(
        self,
        req: GenerateRequest,
        request: Request,
        arrival: float,
        *,
        index: int = 0,
        disconnect: asyncio.Future[None] | None = None,
        after: asyncio.Event | None = None,
        then: asyncio.Event | None = None,
    ) -> Generation:
        """A non-streaming request: every chunk, or `ClientDisconnectedError`."""
        stream, gen, chunk = await self.first_chunk(
            req, request, arrival, index=index, disconnect=disconnect, after=after, then=then
        )
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
        stream: EngineStream,
        gen: Generation,
        first: OutputChunk,
        render: Render,
        tail: Callable[[Generation], list[dict[str, Any]]] = lambda g: [],
    ) -> ClosingStreamingResponse:
        """SSE of one request: `render(gen, chunk, delta, n_tokens_before)` gives the events
        of each chunk, `tail(gen)` those after the last one; then `[DONE]`."""

        async def events() -> AsyncIterator[bytes]:
            chunk = first
            try:
                while True:
                    before = len(gen.ids)
                    delta = gen.absorb(chunk)
                    if chunk.finished and (err := gen.failure()) is not None:
                        yield sse_event(err.body())
                        break
                    for event in render(gen, chunk, delta, before):
                        yield sse_event(event)
                    if chunk.finished:
                        for event in tail(gen):
                            yield sse_event(event)
                        break
                    chunk = await stream.next()
            except ClientDisconnectedError:
                gen.abandon()
                return
            except Exception as e:
                gen.abandon()
                logger.exception("stream of request %s failed", gen.req.rid)
                yield sse_event(error_body(500, f"the stream failed: {type(e).__name__}: {e}"))
            finally:
                stream.close(self.background)
            yield SSE_DONE

        def on_close() -> None:
            gen.abandon()
            stream.close(self.background)

        return sse_response(events(), on_close)

    # -- several engine requests behind one response (batched prompts, `n` > 1) --

    async def run_all(
        self, reqs: Sequence[GenerateRequest], request: Request, arrival: float
    ) -> list[Generation]:
        """`run_to_end` of every request, submitted together (generation `k` has index `k`).
        The first to fail (in index order, among those failed when one is seen) fails the
        whole response: the others are aborted and its error is raised."""
        if len(reqs) == 1:
            return [await self.run_to_end(reqs[0], request, arrival)]
        disconnect = asyncio.ensure_future(wait_disconnect(request.receive))
        tasks = self._submit_all(self.run_to_end, reqs, request, arrival, disconnect)
        try:
            await self._wait_all_or_failure(tasks)
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()  # no-op for the done ones; a cancelled one closes its stream
            disconnect.cancel()

    def _submit_all(
        self,
        start: Callable[..., Awaitable[_T]],
        reqs: Sequence[GenerateRequest],
        request: Request,
        arrival: float,
        disconnect: asyncio.Future[None],
    ) -> list[asyncio.Task[_T]]:
        """`start` (`run_to_end` or `first_chunk`) of every request as a task, request `k`
        as choice index `k`, in `prefill_order`."""
        after, then = self.prefill_order(reqs)
        return [
            asyncio.ensure_future(
                start(
                    r,
                    request,
                    arrival,
                    index=k,
                    disconnect=disconnect,
                    after=after[k],
                    then=then[k],
                )
            )
            for k, r in enumerate(reqs)
        ]

    @staticmethod
    async def _wait_all_or_failure(tasks: Sequence[asyncio.Task[Any]]) -> None:
        """Wait for every task; when one fails, cancel the others (awaiting them) and
        raise the failure of the lowest index."""
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
        if failed:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            exc = failed[0].exception()
            assert exc is not None
            raise exc

    async def open_streams(
        self, reqs: Sequence[GenerateRequest], request: Request, arrival: float
    ) -> tuple[list[tuple[EngineStream, Generation, OutputChunk]], asyncio.Future[None]]:
        """`first_chunk` of every request, submitted together, and the disconnect wait
        they share (for `stream_many`). A refusal of any fails them all (`run_all`)."""
        disconnect = asyncio.ensure_future(wait_disconnect(request.receive))
        tasks = self._submit_all(self.first_chunk, reqs, request, arrival, disconnect)
        try:
            await self._wait_all_or_failure(tasks)
            return [t.result() for t in tasks], disconnect
        except BaseException:
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is None:
                    t.result()[0].close(self.background)
                else:
                    t.cancel()
            disconnect.cancel()
            raise

    def stream_many(
        self,
        items: Sequence[tuple[EngineStream, Generation, OutputChunk]],
        disconnect: asyncio.Future[None],
        render: Render,
        tail: Callable[[list[Generation]], list[dict[str, Any]]] = lambda gens: [],
    ) -> ClosingStreamingResponse:
        """SSE of several requests (`open_streams`), their chunks sent as they come:
        `render` gives each chunk's events (`gen.index` names the choice), `tail(gens)`
        the events after the last request finished; then `[DONE]`. A request that fails
        ends the stream with its error event (the others are aborted)."""
        streams = [s for s, _, _ in items]
        gens = [g for _, g, _ in items]
        nexts: dict[asyncio.Future[OutputChunk], int] = {}

        def close() -> None:
            for t in nexts:
                t.cancel()
            for g in gens:
                g.abandon()
            for s in streams:
                s.close(self.background)
            disconnect.cancel()

        async def events() -> AsyncIterator[bytes]:
            ready = [(k, first) for k, (_, _, first) in enumerate(items)]
            try:
                while True:
                    failed: ApiError | None = None
                    for k, chunk in ready:
                        gen = gens[k]
                        before = len(gen.ids)
                        delta = gen.absorb(chunk)
                        if chunk.finished and (failed := gen.failure()) is not None:
                            break
                        for event in render(gen, chunk, delta, before):
                            yield sse_event(event)
                        if not chunk.finished:
                            nexts[asyncio.ensure_future(streams[k].next())] = k
                    if failed is not None:
                        yield sse_event(failed.body())
                        break
                    if not nexts:
                        for event in tail(gens):
                            yield sse_event(event)
                        break
                    done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
                    ready = []
                    for t in sorted(done, key=lambda t: nexts[t]):
                        ready.append((nexts.pop(t), t.result()))
            except ClientDisconnectedError:
                return
            except Exception as e:
                logger.exception("stream of request %s failed", gens[0].req.rid)
                yield sse_event(error_body(500, f"the stream failed: {type(e).__name__}: {e}"))
            finally:
                close()
            yield SSE_DONE

        return sse_response(events(), close)
