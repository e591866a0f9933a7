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

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from cpkv_jax.errors import InputError
from cpkv_jax.tokenizer import Tokenizer
from serving.engine.api import GenerateRequest, OutputChunk
from serving.http import chat_output
from serving.http.errors import ApiError
from serving.http.generation import ApiCore, Generation, batch_usage, choice_sampling
from serving.http.models import ChatCompletionBody, CompletionBody
from serving.http.streaming import SSE_DONE, sse_event, sse_response
from serving.http.text import REPLACEMENT_CHAR, IncrementalDetokenizer


def _alternatives(gen: Generation, start: int, end: int) -> list[tuple[tuple[int, float], ...]]:
    """Each output token's top log-probs in `[start, end)` (empty tuples when the request
    asked for none)."""
    if not gen.req.top_logprobs:
        return [()] * (end - start)
    return gen.top_logprobs[start:end]


def completion_logprobs(gen: Generation, start: int, end: int) -> dict[str, Any]:
    """OpenAI legacy `logprobs` for output tokens `[start, end)`: `top_logprobs` maps the
    text of each position's `logprobs: N` most likely tokens to their log-probs (the chosen
    token alone for N = 0; tokens with the same text keep the likelier entry)."""
    detok = gen.out.detok
    tokens = [detok.token_text(t) for t in gen.ids[start:end]]
    values = gen.logprobs[start:end]
    tops: list[dict[str, float]] = []
    for text, v, alts in zip(tokens, values, _alternatives(gen, start, end), strict=True):
        top: dict[str, float] = {}
        for t, lp in alts or ((None, v),):
            top.setdefault(text if t is None else detok.token_text(t), lp)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": detok.offsets[start:end],
    }


def prompt_logprobs(gen: Generation, tokenizer: Tokenizer) -> tuple[dict[str, Any], int]:
    """OpenAI legacy `logprobs` of an echoed prompt's tokens (`echo` with `logprobs`) and
    the length of the prompt's text their `text_offset`s index: the first token has
    no log-prob and no alternatives (None, as OpenAI and vLLM give it)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    ids = list(gen.req.input_ids)
    detok.add(ids)
    detok.flush()
    if not gen.prompt_logprobs:
        # A PD prefill server's answer: the decode server's carries the prompt's scores
        # (from the transfer's aux); SGLang's gateway merges the two, so none here.
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, 0
    tokens = [detok.token_text(t) for t in ids]
    tops: list[dict[str, float] | None] = []
    for text, v, alts in zip(tokens, gen.prompt_logprobs, gen.prompt_top_logprobs, strict=True):
        if v is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for t, lp in alts or ((None, v),):
            top.setdefault(text if t is None else detok.token_text(t), lp)
        tops.append(top)
    out = {
        "tokens": tokens,
        "token_logprobs": list(gen.prompt_logprobs),
        "top_logprobs": tops,
        "text_offset": list(detok.offsets),
    }
    return out, len(detok.text)


def echoed_logprobs(gen: Generation, tokenizer: Tokenizer, start: int, end: int) -> dict[str, Any]:
    """`completion_logprobs` of output tokens `[start, end)` after the echoed prompt's own
    (`prompt_logprobs`); the output's offsets then count from the prompt's text."""
    out = completion_logprobs(gen, start, end)
    prompt, shift = prompt_logprobs(gen, tokenizer)
    out["text_offset"] = [shift + o for o in out["text_offset"]]
    return {k: prompt[k] + out[k] for k in out}


def _token_entry(text: str, logprob: float) -> dict[str, Any]:
    raw = None if REPLACEMENT_CHAR in text else list(text.encode())
    return {"token": text, "logprob": logprob, "bytes": raw}


def chat_logprobs(gen: Generation, start: int, end: int) -> dict[str, Any]:
    """OpenAI chat `logprobs` for output tokens `[start, end)`, each with its
    `top_logprobs` alternatives, most likely first."""
    text_of = gen.out.detok.token_text
    content = []
    alternatives = _alternatives(gen, start, end)
    for t, v, alts in zip(gen.ids[start:end], gen.logprobs[start:end], alternatives, strict=True):
        top = [_token_entry(text_of(a), lp) for a, lp in alts]
        content.append({**_token_entry(text_of(t), v), "top_logprobs": top})
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
        prompts = body.prompts()
        batched, n = body.batched(), body.n
        count = len(prompts) * n
        if count > 1 and body.bootstrap_room is not None:
            raise ApiError(
                400,
                "n > 1 and batched prompts are not supported behind the PD router (one "
                "bootstrap room is one engine request): send one prompt with n=1",
            )
        if body.echo and core.tokenizer is None:
            raise ApiError(400, "echo needs a tokenizer, and this server has none: send echo=false")
        want_logprobs = body.logprobs is not None
        # echo with logprobs: the prompt's log-probs too (lm-evaluation-harness's
        # log-likelihood requests). max_tokens=0 then still runs the prompt, for one token
        # that is not returned (`scored_only`); without logprobs it generates nothing: no
        # engine request, the prompts validated as for one new token.
        scored = body.echo and want_logprobs
        scored_only = scored and body.max_new_tokens() == 0
        generate = body.max_new_tokens() != 0 or scored
        sampling = body.to_engine(body.max_new_tokens() or 1)
        pd = await core.pd_fields(body)
        base, rids = core.request_ids(request, count)  # X-Request-Id, when given
        reqs, echoes = [], []
        for i, prompt in enumerate(prompts):
            where = f"prompt[{i}]: " if batched else ""
            try:
                if isinstance(prompt, str):
                    ids = await core.tokenize(prompt, field="prompt")
                else:
                    ids = list(prompt)
                for j in range(n):
                    reqs.append(
                        core.make_request(
                            ids,
                            choice_sampling(sampling, j),
                            rid=rids[i * n + j],
                            return_logprob=want_logprobs,
                            top_logprobs=body.logprobs or 0,
                            prompt_logprobs_from=0 if scored else None,
                            arrival=arrival,
                            **pd,
                        )
                    )
            except ApiError as e:
                raise ApiError(e.status, where + e.message, e.kind) from None
            if body.echo:
                assert core.tokenizer is not None
                echoes.append(prompt if isinstance(prompt, str) else core.tokenizer.decode(ids))
        rid, created = f"cmpl-{base}", int(time.time())

        def envelope(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return self.envelope(rid, "text_completion", created, choices)

        if not generate:
            return self._echo_only(body, reqs, echoes, envelope)
        tokenizer = core.tokenizer

        def logprobs_of(g: Generation, start: int, end: int, first: bool) -> dict[str, Any] | None:
            if not want_logprobs:
                return None
            if scored_only:  # the prompt's alone: the drawn token is not returned
                assert tokenizer is not None
                return prompt_logprobs(g, tokenizer)[0]
            if not (scored and first):
                return completion_logprobs(g, start, end)
            assert tokenizer is not None
            return echoed_logprobs(g, tokenizer, start, end)

        def usage(gens: list[Generation]) -> dict[str, Any]:
            return batch_usage(gens, n, scored_only=scored_only)

        if not body.stream:
            gens = await core.run_all(reqs, request, arrival)  # gone: 499 (errors.py)
            choices = [
                {
                    "index": g.index,
                    "text": (echoes[g.index // n] if body.echo else "")
                    + ("" if scored_only else g.out.text),
                    "logprobs": logprobs_of(g, 0, len(g.ids), True),
                    "finish_reason": "length" if scored_only else g.finish_reason,
                    "token_ids": [] if scored_only else list(g.ids),  # extension: `text`'s ids
                }
                for g in gens
            ]
            return JSONResponse({**envelope(choices), "usage": usage(gens)})
        items, disconnect = await core.open_streams(reqs, request, arrival)
        echo_pending = set(range(count)) if body.echo else set()

        def render(
            g: Generation, chunk: OutputChunk, delta: str, before: int
        ) -> list[dict[str, Any]]:
            # Every chunk with tokens is sent, even when its text is held back (an
            # incomplete UTF-8 character, a possible stop string): the streamed
            # `token_ids` then add up to `usage.completion_tokens`, and token timing
            # (TTFT, inter-token latency) is what a client measures. The echoed prompt
            # opens a choice's first chunk.
            first = g.index in echo_pending
            if scored_only:  # once, at the end: the echoed prompt and its log-probs
                if not chunk.finished:
                    return []
                delta, chunk = "", OutputChunk(chunk.rid, finished=True)
            if first:
                echo_pending.discard(g.index)
                delta = echoes[g.index // n] + delta
            if not (delta or chunk.finished or chunk.token_ids):
                return []
            choice = {
                "index": g.index,
                "text": delta,
                "logprobs": logprobs_of(g, before, len(g.ids), first),
                "finish_reason": ("length" if scored_only else g.finish_reason)
                if chunk.finished
                else None,
                "token_ids": list(chunk.token_ids),
            }
            return [envelope([choice])]

        def tail(gens: list[Generation]) -> list[dict[str, Any]]:
            return [{**envelope([]), "usage": usage(gens)}] if body.include_usage else []

        return core.stream_many(items, disconnect, render, tail)

    @staticmethod
    def _echo_only(
        body: CompletionBody,
        reqs: list[GenerateRequest],
        echoes: list[str],
        envelope: Callable[[list[dict[str, Any]]], dict[str, Any]],
    ) -> Response:
        """`echo` with `max_tokens: 0`: each choice is its prompt's text, finish "length",
        answered without the engine."""
        n = body.n
        choices = [
            {
                "index": k,
                "text": echoes[k // n],
                "logprobs": None,
                "finish_reason": "length",
                "token_ids": [],
            }
            for k in range(len(reqs))
        ]
        prompt = sum(len(r.input_ids) for r in reqs[::n])
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": 0,
            "total_tokens": prompt,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        if not body.stream:
            return JSONResponse({**envelope(choices), "usage": usage})

        async def events() -> AsyncIterator[bytes]:
            for choice in choices:
                yield sse_event(envelope([choice]))
            if body.include_usage:
                yield sse_event({**envelope([]), "usage": usage})
            yield SSE_DONE

        return sse_response(events(), lambda: None)

    # -- /v1/chat/completions --

    async def chat_completions(self, request: Request) -> Response:
        core = self.core
        arrival = time.monotonic()
        body = await core.parse(request, ChatCompletionBody, empty_ok=False)
        core.check_model(body.model)
        n = body.n
        if n > 1 and body.bootstrap_room is not None:
            raise ApiError(
                400,
                "n > 1 is not supported behind the PD router (one bootstrap room is one "
                "engine request): send n=1",
            )
        if core.chat_template is None:
            raise ApiError(
                400,
                "the model dir has no chat template (chat_template.jinja or tokenizer_config."
                "json 'chat_template'): use /v1/completions with a formatted prompt",
            )
        tools = chat_output.request_tools(body, core.chat_parsers)
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
        # `tool_choice` required / named forces the calls; a reasoning model's grammar
        # applies after its reasoning (`serving.http.chat_output`).
        grammar = chat_output.forced_tool_grammar(body, tools) or sampling.grammar
        grammar = chat_output.grammar_after_reasoning(
            grammar, body, core.chat_parsers, core.tokenizer
        )
        sampling = dataclasses.replace(sampling, grammar=grammar)
        pd = await core.pd_fields(body)
        base, rids = core.request_ids(request, n)  # X-Request-Id, when given
        # One engine request per choice (`choice_sampling`: greedy choices are identical),
        # each with its own output parser (a stream's parser keeps state).
        reqs = [
            core.make_request(
                ids,
                choice_sampling(sampling, j),
                rid=rids[j],
                return_logprob=body.logprobs,
                top_logprobs=body.top_logprobs or 0,
                arrival=arrival,
                **pd,
            )
            for j in range(n)
        ]
        parsers = [chat_output.output_parser(body, core.chat_parsers, tools) for _ in range(n)]
        rid, created = f"chatcmpl-{base}", int(time.time())
        if not body.stream:
            gens = await core.run_all(reqs, request, arrival)  # gone: 499 (errors.py)
            choices = [
                {
                    "index": g.index,
                    "message": chat_output.message(parsers[g.index], g.out.text),
                    "logprobs": chat_logprobs(g, 0, len(g.ids)) if body.logprobs else None,
                    "finish_reason": chat_output.finish_reason(parsers[g.index], g.finish_reason),
                }
                for g in gens
            ]
            body_out = self.envelope(rid, "chat.completion", created, choices)
            return JSONResponse({**body_out, "usage": batch_usage(gens, n)})
        items, disconnect = await core.open_streams(reqs, request, arrival)

        def envelope(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return self.envelope(rid, "chat.completion.chunk", created, choices)

        role_pending = set(range(n))

        def render(
            g: Generation, chunk: OutputChunk, delta: str, before: int
        ) -> list[dict[str, Any]]:
            k, parser = g.index, parsers[g.index]
            events = []
            if k in role_pending:  # OpenAI opens every choice's stream with the role
                role_pending.discard(k)
                role_delta = {"role": "assistant", "content": ""}
                events.append(
                    envelope(
                        [{"index": k, "delta": role_delta, "logprobs": None, "finish_reason": None}]
                    )
                )
            deltas = chat_output.stream_deltas(parser, delta, chunk.finished)
            if not deltas and (chunk.finished or (body.logprobs and chunk.token_ids)):
                deltas = [{}]
            for i, d in enumerate(deltas):  # logprobs on the first, finish on the last
                last = chunk.finished and i == len(deltas) - 1
                choice = {
                    "index": k,
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

        def tail(gens: list[Generation]) -> list[dict[str, Any]]:
            return [{**envelope([]), "usage": batch_usage(gens, n)}] if body.include_usage else []

        return core.stream_many(items, disconnect, render, tail)

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
