"""OpenAI-compatible routes: `POST /v1/completions`, `POST /v1/chat/completions` and
`GET /v1/models`. Stream chunks carry deltas (a chat stream opens with the role); with
`stream_options.include_usage` a last chunk without choices carries the usage.

Model names: a request's `model` may be omitted, or be the served name or one of its
aliases; any other name is a 404 that lists them (`ApiCore.check_model`). Responses and
`/v1/models` give the served name. `cpkv-serve` serves `--model-path` as given (the SGLang /
vLLM default, so clients that name the model by its path, e.g. `bench_serving --model
/path/to/m`, work) with the path's base name as an alias (`m`), or `--served-model-name`
alone when it is given (`ServerArgs.served_model_names`).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from cpkv_jax.errors import InputError
from serving.engine.api import OutputChunk
from serving.http import chat_output
from serving.http.errors import ApiError
from serving.http.generation import ApiCore, Generation
from serving.http.models import ChatCompletionBody, CompletionBody
from serving.http.text import REPLACEMENT_CHAR


def completion_logprobs(gen: Generation, start: int, end: int) -> dict[str, Any]:
    """OpenAI legacy `logprobs` for output tokens `[start, end)`."""
    detok = gen.out.detok
    tokens = [detok.token_text(t) for t in gen.ids[start:end]]
    values = gen.logprobs[start:end]
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": [{t: v} for t, v in zip(tokens, values, strict=True)],
        "text_offset": detok.offsets[start:end],
    }


def chat_logprobs(gen: Generation, start: int, end: int) -> dict[str, Any]:
    """OpenAI chat `logprobs` for output tokens `[start, end)` (no alternatives)."""
    content = []
    for t, v in zip(gen.ids[start:end], gen.logprobs[start:end], strict=True):
        text = gen.out.detok.token_text(t)
        raw = None if REPLACEMENT_CHAR in text else list(text.encode())
        content.append({"token": text, "logprob": v, "bytes": raw, "top_logprobs": []})
    return {"content": content}


class OpenAIRoutes:
    """The OpenAI-compatible routes of one app."""

    def __init__(self, core: ApiCore) -> None:
        self.core = core

    def register(self, app: FastAPI) -> None:
        app.add_api_route(
            "/v1/completions", self.completions, response_model=None, methods=["POST"]
        )
        app.add_api_route(
            "/v1/chat/completions", self.chat_completions, response_model=None, methods=["POST"]
        )
        app.add_api_route("/v1/models", self.models, response_model=None, methods=["GET"])

    def envelope(
        self, rid: str, obj: str, created: int, choices: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The fields every OpenAI completion / chat response and stream chunk carries."""
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.core.model_name,
            "choices": choices,
        }

    # -- /v1/completions --

    async def completions(self, request: Request) -> Response:
        core = self.core
        arrival = time.monotonic()
        body = await core.parse(request, CompletionBody, empty_ok=False)
        core.check_model(body.model)
        if isinstance(body.prompt, str):
            ids = await core.tokenize(body.prompt, field="prompt")
        else:
            ids = list(body.prompt)
        want_logprobs = body.logprobs is not None
        sampling = body.to_engine(body.max_new_tokens())
        pd = body.pd_fields()
        rid_in = core.request_id(request)  # X-Request-Id, when given
        req = core.make_request(
            ids, sampling, rid=rid_in, return_logprob=want_logprobs, arrival=arrival, **pd
        )
        rid, created = f"cmpl-{req.rid}", int(time.time())
        if not body.stream:
            gen = await core.run_to_end(req, request, arrival)  # gone: 499 (errors.py)
            choice = {
                "index": 0,
                "text": gen.out.text,
                "logprobs": completion_logprobs(gen, 0, len(gen.ids)) if want_logprobs else None,
                "finish_reason": gen.finish_reason,
                "token_ids": list(gen.ids),  # extension: the ids behind `text`
            }
            body_out = self.envelope(rid, "text_completion", created, [choice])
            return JSONResponse({**body_out, "usage": gen.usage()})
        stream, gen, first = await core.first_chunk(req, request, arrival)

        def envelope(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return self.envelope(rid, "text_completion", created, choices)

        def render(
            g: Generation, chunk: OutputChunk, delta: str, before: int
        ) -> list[dict[str, Any]]:
            # Every chunk with tokens is sent, even when its text is held back (an
            # incomplete UTF-8 character, a possible stop string): the streamed
            # `token_ids` then add up to `usage.completion_tokens`, and token timing
            # (TTFT, inter-token latency) is what a client measures.
            if not (delta or chunk.finished or chunk.token_ids):
                return []
            choice = {
                "index": 0,
                "text": delta,
                "logprobs": completion_logprobs(g, before, len(g.ids)) if want_logprobs else None,
                "finish_reason": g.finish_reason if chunk.finished else None,
                "token_ids": list(chunk.token_ids),
            }
            return [envelope([choice])]

        def tail(g: Generation) -> list[dict[str, Any]]:
            return [{**envelope([]), "usage": g.usage()}] if body.include_usage else []

        return core.stream_response(stream, gen, first, render, tail)

    # -- /v1/chat/completions --

    async def chat_completions(self, request: Request) -> Response:
        core = self.core
        arrival = time.monotonic()
        body = await core.parse(request, ChatCompletionBody, empty_ok=False)
        core.check_model(body.model)
        if core.chat_template is None:
            raise ApiError(
                400,
                "the model dir has no chat template (chat_template.jinja or tokenizer_config."
                "json 'chat_template'): use /v1/completions with a formatted prompt",
            )
        tools = chat_output.request_tools(body, core.chat_parsers)
        parser = chat_output.output_parser(body, core.chat_parsers, tools)
        try:
            prompt = core.chat_template.render(
                [m.for_template() for m in body.messages],
                tools=tools,
                template_kwargs=body.chat_template_kwargs,
            )
        except InputError as e:
            raise ApiError(400, str(e)) from None
        ids = await core.tokenize(prompt, field="messages")
        sampling = body.to_engine(body.max_new_tokens(len(ids), core.context_length))
        pd = body.pd_fields()
        rid_in = core.request_id(request)  # X-Request-Id, when given
        req = core.make_request(
            ids, sampling, rid=rid_in, return_logprob=body.logprobs, arrival=arrival, **pd
        )
        rid, created = f"chatcmpl-{req.rid}", int(time.time())
        if not body.stream:
            gen = await core.run_to_end(req, request, arrival)  # gone: 499 (errors.py)
            choice = {
                "index": 0,
                "message": chat_output.message(parser, gen.out.text),
                "logprobs": chat_logprobs(gen, 0, len(gen.ids)) if body.logprobs else None,
                "finish_reason": chat_output.finish_reason(parser, gen.finish_reason),
            }
            body_out = self.envelope(rid, "chat.completion", created, [choice])
            return JSONResponse({**body_out, "usage": gen.usage()})
        stream, gen, first = await core.first_chunk(req, request, arrival)

        def envelope(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return self.envelope(rid, "chat.completion.chunk", created, choices)

        sent_role = False

        def render(
            g: Generation, chunk: OutputChunk, delta: str, before: int
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
            deltas = chat_output.stream_deltas(parser, delta, chunk.finished)
            if not deltas and (chunk.finished or (body.logprobs and chunk.token_ids)):
                deltas = [{}]
            for i, d in enumerate(deltas):  # logprobs on the first, finish on the last
                last = chunk.finished and i == len(deltas) - 1
                choice = {
                    "index": 0,
                    "delta": d,
                    "logprobs": (
                        chat_logprobs(g, before, len(g.ids)) if body.logprobs and i == 0 else None
                    ),
                    "finish_reason": chat_output.finish_reason(parser, g.finish_reason)
                    if last
                    else None,
                }
                events.append(envelope([choice]))
            return events

        def tail(g: Generation) -> list[dict[str, Any]]:
            return [{**envelope([]), "usage": g.usage()}] if body.include_usage else []

        return core.stream_response(stream, gen, first, render, tail)

    # -- /v1/models --

    def models(self) -> dict[str, Any]:
        core = self.core
        return {
            "object": "list",
            "data": [
                {
                    "id": core.model_name,
                    "object": "model",
                    "created": core.created,
                    "owned_by": "cpkv-jax",
                    "max_model_len": core.context_length,
                }
            ],
        }
