"""SGLang-style `POST /generate`: text or token ids in; the text (with a tokenizer), the
output ids and `meta_info` out. Stream events carry the cumulative `text` and
`output_ids` so far, as SGLang's do.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from serving.engine.api import OutputChunk
from serving.http.generation import ApiCore, Generation
from serving.http.models import GenerateBody


class NativeRoutes:
    """The `/generate` route of one app."""

    def __init__(self, core: ApiCore) -> None:
        self.core = core

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/generate", self.generate, response_model=None, methods=["POST"])

    async def generate(self, request: Request) -> Response:
        core = self.core
        arrival = time.monotonic()
        body = await core.parse(request, GenerateBody, empty_ok=False)
        if body.text is not None:
            ids = await core.tokenize(body.text, field="text")
        else:
            ids = list(body.input_ids or ())
        req = core.make_request(
            ids,
            body.sampling_params.to_engine(),
            rid=body.rid,
            return_logprob=body.return_logprob,
            arrival=arrival,
            **body.pd_fields(),
        )
        if not body.stream:
            gen = await core.run_to_end(req, request, arrival)  # gone: 499 (errors.py)
            return JSONResponse(self.result(gen))
        stream, gen, first = await core.first_chunk(req, request, arrival)

        def render(
            g: Generation, chunk: OutputChunk, delta: str, before: int
        ) -> list[dict[str, Any]]:
            return [self.result(g)]

        return core.stream_response(stream, gen, first, render)

    def result(self, gen: Generation) -> dict[str, Any]:
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
            "cached_tokens_details": gen.cached_tokens_details(),
            "finish_reason": finish,
            "e2e_latency": gen.e2e,
            "ttft": gen.timer.ttft,
        }
        if gen.req.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(gen.logprobs, gen.ids, strict=False)
            ]
        out: dict[str, Any] = {"output_ids": list(gen.ids), "meta_info": meta}
        if self.core.tokenizer is not None:
            out = {"text": gen.out.text, **out}
        return out
