"""SGLang-style `POST /generate`: text or token ids in; the text (with a tokenizer), the
output ids and `meta_info` out. Stream events carry the cumulative `text` and
`output_ids` so far, as SGLang's do. The body's `model`, which SGLang's gateway `smg` adds,
is checked like the OpenAI routes' (`ApiCore.check_model`), its "no model named"
placeholder accepted (`GATEWAY_ANY_MODEL`).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from serving.engine.api import OutputChunk
from serving.http.errors import ApiError
from serving.http.generation import ApiCore, Generation
from serving.http.models import GATEWAY_ANY_MODEL, GenerateBody

_ANY_MODEL = frozenset({GATEWAY_ANY_MODEL})


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
        core.check_model(body.model, also_any=_ANY_MODEL)
        if body.return_text_in_logprobs and body.return_logprob and core.tokenizer is None:
            raise ApiError(
                400,
                "return_text_in_logprobs needs a tokenizer, and this server has none: "
                "send return_text_in_logprobs=false",
            )
        texts = body.return_text_in_logprobs
        if body.batched():
            return await self.generate_batch(body, request, arrival)
        if isinstance(body.text, str):
            ids = await core.tokenize(body.text, field="text")
        else:
            ids = list(body.prompts()[0])  # type: ignore[arg-type]
        assert not isinstance(body.rid, list)
        pd = await core.pd_fields(body)
        req = core.make_request(
            ids,
            body.sampling_params.to_engine(),
            rid=core.request_id(request, body.rid),
            return_logprob=body.return_logprob,
            top_logprobs=body.top_logprobs_num,
            prompt_logprobs_from=body.prompt_logprobs_from(),
            arrival=arrival,
            **pd,
        )
        if not body.stream:
            gen = await core.run_to_end(req, request, arrival)  # gone: 499 (errors.py)
            return JSONResponse(self.result(gen, texts))
        stream, gen, first = await core.first_chunk(req, request, arrival)

        def render(
            g: Generation, chunk: OutputChunk, delta: str, before: int
        ) -> list[dict[str, Any]]:
            return [self.result(g, texts)]

        return core.stream_response(stream, gen, first, render)

    async def generate_batch(
        self, body: GenerateBody, request: Request, arrival: float
    ) -> Response:
        """A batch (`text` / `input_ids` lists, SGLang's): every prompt its own engine
        request, submitted together; a list of results in prompt order. The first
        failure fails the response (`ApiCore.run_all`); streaming is refused by the body."""
        core = self.core
        prompts = body.prompts()
        if body.bootstrap_room is not None:
            raise ApiError(
                400,
                "a batch is not supported behind the PD router (one bootstrap room is one "
                "engine request): send one prompt per request",
            )
        if isinstance(body.rid, list):
            rids = body.rid
        else:
            rids = core.request_ids(request, len(prompts))[1]
        sampling = body.sampling_params.to_engine()
        reqs = []
        for i, prompt in enumerate(prompts):
            try:
                if isinstance(prompt, str):
                    ids = await core.tokenize(prompt, field="text")
                else:
                    ids = list(prompt)
                reqs.append(
                    core.make_request(
                        ids,
                        sampling,
                        rid=rids[i],
                        return_logprob=body.return_logprob,
                        top_logprobs=body.top_logprobs_num,
                        prompt_logprobs_from=body.prompt_logprobs_from(),
                        arrival=arrival,
                    )
                )
            except ApiError as e:
                where = "text" if body.text is not None else "input_ids"
                raise ApiError(e.status, f"{where}[{i}]: {e.message}", e.kind) from None
        gens = await core.run_all(reqs, request, arrival)  # gone: 499 (errors.py)
        return JSONResponse([self.result(g, body.return_text_in_logprobs) for g in gens])

    def result(self, gen: Generation, texts: bool = False) -> dict[str, Any]:
        """`/generate`'s body (and each stream event): cumulative text and ids so far;
        `texts`: each log-prob entry carries its token's text (SGLang's third element)."""
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
        if "spec_verify_ct" in gen.meta:  # speculative decoding (SGLang's field)
            meta["spec_verify_ct"] = int(gen.meta["spec_verify_ct"])
            meta["spec_accept_length"] = float(gen.meta["spec_accept_length"])
        if gen.req.return_logprob:
            token_text = gen.out.detok.token_text if texts else lambda t: None
            meta["output_token_logprobs"] = [
                [lp, t, token_text(t)] for lp, t in zip(gen.logprobs, gen.ids, strict=False)
            ]
            if gen.req.top_logprobs:  # SGLang's: per output token, its alternatives
                meta["output_top_logprobs"] = [
                    [[lp, t, token_text(t)] for t, lp in alts] for alts in gen.top_logprobs
                ]
            start = gen.req.prompt_logprobs_from
            if start is not None:  # SGLang's: token 0 has no log-prob (None) nor alternatives
                prompt = gen.req.input_ids[start:]
                meta["input_token_logprobs"] = [
                    [lp, t, token_text(t)]
                    for lp, t in zip(gen.prompt_logprobs, prompt, strict=False)
                ]
                if gen.req.top_logprobs:
                    meta["input_top_logprobs"] = [
                        [[lp, t, token_text(t)] for t, lp in alts] if alts else None
                        for alts in gen.prompt_top_logprobs
                    ]
        out: dict[str, Any] = {"output_ids": list(gen.ids), "meta_info": meta}
        if self.core.tokenizer is not None:
            out = {"text": gen.out.text, **out}
        return out
