"""The HTTP front of one server: SGLang-style `/generate` (`serving.http.native`),
OpenAI-compatible completions and chat (`serving.http.openai`), and here health,
Prometheus metrics, server info and profiling, and the app that wires them together.

    app = build_app(client, model_name=..., tokenizer=..., vocab_size=..., context_length=...,
                    chat_template=load_chat_template(model_dir), metrics=ServerMetrics())

Every endpoint validates its request before the engine sees it (`serving.http.models`:
strict bodies; token ids in `[0, vocab_size)`; a non-empty prompt; `prompt + max_new_tokens
<= context_length`; `SamplingParams.validate`), and every error is an OpenAI-style body
`{"error": {"message", "type", "code"}}`: 4xx for the request's fault (including an
`InputError` the engine raises at submit), 503 for a server that cannot take work now (any
other `CpkvError` at submit, e.g. the engine loop's `ServerShuttingDownError`, or a request
the server aborted), 500 for an engine error (`finish_reason == "error"`); see
`serving.http.errors`.

Streaming (`stream: true`) answers Server-Sent Events, `data: {json}\\n\\n` ... `data:
[DONE]\\n\\n`. The status line is sent with the first generated token, so a request the
engine refuses still gets its 4xx / 503; an error after that is one `data: {"error": ...}`
event before `[DONE]`. `/generate` events carry the cumulative `text` and `output_ids` so
far (as SGLang does); OpenAI chunks carry deltas. Text is decoded incrementally and only
emitted once it no longer ends in an incomplete UTF-8 character, and stop strings are
trimmed (`serving.http.text`).

A client that goes away aborts its request in the engine: every wait on the engine races
a listener for the ASGI `http.disconnect` message, and the streaming response closes the
engine stream (which aborts, per `EngineClient`) however it ends
(`serving.http.generation`, `serving.http.streaming`).

SGLang's gateway `smg` (regular mode) registers a worker from `/health`, `/v1/models`,
`/server_info` (or `/get_server_info`; its SGLang fields `served_model_name`, `model_path`,
`tp_size`, `dp_size`, `disaggregation_mode`, `max_running_requests`, `version` must have
SGLang's JSON types: one wrong type voids the whole parse) and `/model_info` (or
`/get_model_info`), and polls the load from `/v1/loads`. Nothing answers `/version`: a
2xx there makes it treat the worker as vLLM. See README "Behind SGLang's gateway (smg)".

API keys (`api_keys`, from `--api-key` / `--admin-api-key`; `serving.http.auth`): every
route but `/health` and `/metrics` then needs `Authorization: Bearer KEY` (401 without
it); the routes that change server state (`AdminRoutes.ADMIN_PATHS`, the profiler) need
the admin key when one is set (403 for the plain API key).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from cpkv_jax import __version__
from cpkv_jax.tokenizer import Tokenizer
from serving.api_keys import ApiKeys
from serving.engine.api import EngineClient
from serving.grammar import GrammarBackend
from serving.http.auth import install_api_keys
from serving.http.chat_template import ChatRenderer, ChatTemplate
from serving.http.errors import ApiError, install_error_handlers
from serving.http.gateway_pd import GatewayPD
from serving.http.generation import ApiCore
from serving.http.metrics import ServerMetrics
from serving.http.models import AbortBody, ProfileBody
from serving.http.native import NativeRoutes
from serving.http.openai import OpenAIRoutes
from serving.parsers import ChatParserConfig

logger = logging.getLogger(__name__)


class AdminRoutes:
    """`/health`, `/metrics`, `/server_info`, `/model_info` and the JAX profiler routes of
    one app."""

    # The routes that change server state: with `--admin-api-key` only that key opens them.
    # (A client aborts its own request by disconnecting; `/abort_request` aborts anyone's.)
    ADMIN_PATHS = frozenset({"/start_profile", "/stop_profile", "/abort_request"})

    def __init__(
        self,
        core: ApiCore,
        *,
        server_info: Callable[[], dict[str, Any]] | None,
        profile_dir: str,
        model_path: str | None = None,
    ) -> None:
        self.core = core
        self.server_info_fn = server_info
        self.model_path = model_path if model_path is not None else core.model_name
        self.profile_dir = profile_dir
        self.profiling_to: str | None = None

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/health", self.health, response_model=None, methods=["GET"])
        app.add_api_route("/metrics", self.metrics_text, response_model=None, methods=["GET"])
        # SGLang serves both names (`/get_*` is the older one; the gateway falls back to it).
        for path in ("/server_info", "/get_server_info"):
            app.add_api_route(path, self.server_info, response_model=None, methods=["GET"])
        for path in ("/model_info", "/get_model_info"):
            app.add_api_route(path, self.model_info, response_model=None, methods=["GET"])
        app.add_api_route("/v1/loads", self.loads, response_model=None, methods=["GET"])
        app.add_api_route(
            "/start_profile", self.start_profile, response_model=None, methods=["POST"]
        )
        app.add_api_route("/stop_profile", self.stop_profile, response_model=None, methods=["POST"])
        app.add_api_route(
            "/abort_request", self.abort_request, response_model=None, methods=["POST"]
        )

    def health(self) -> Response:
        if self.core.client.healthy():
            return JSONResponse({"status": "ok"})
        why = self.core.client.fatal_reason()
        raise ApiError(
            503, f"the engine is not healthy: {why}" if why else "the server is shutting down"
        )

    def metrics_text(self) -> Response:
        text, content_type = self.core.metrics.render()
        return Response(content=text, media_type=content_type)

    async def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = dict(self.server_info_fn()) if self.server_info_fn else {}
        try:
            stats = self.core.client.stats()
        except Exception as e:
            raise ApiError(503, f"the engine could not report its stats: {e}") from e
        info.update(dataclasses.asdict(stats))
        info.update(
            model_name=self.core.model_name,
            context_length=self.core.context_length,
            vocab_size=self.core.vocab_size,
            has_tokenizer=self.core.tokenizer is not None,
            has_chat_template=self.core.chat_template is not None,
            # SGLang's fields, which its gateway reads (module docstring): no tensor
            # parallelism; a decode server's data-parallel ranks (`--dp-size`) are one
            # engine behind one address, its own scheduler picking the rank.
            served_model_name=self.core.model_name,
            model_path=self.model_path,
            tp_size=1,
            dp_size=int(info.get("dp_size", 1)),
            disaggregation_mode=stats.mode,  # "null", "prefill" or "decode", as SGLang's
            version=__version__,
        )
        return info

    async def loads(self) -> dict[str, Any]:
        """SGLang's `/v1/loads` (one data-parallel rank): the queue and the KV usage its
        gateway's load-aware routing reads. Prefix-cached pages count as free (evictable),
        as in SGLang's `token_usage`; token counts are 0 when the page size is unknown."""
        try:
            stats = self.core.client.stats()
        except Exception as e:
            raise ApiError(503, f"the engine could not report its stats: {e}") from e
        info = self.server_info_fn() if self.server_info_fn else {}
        page = info.get("page_size", 0)
        total = sum(stats.kv_pages_total)
        used = max(0, total - sum(stats.kv_pages_free) - sum(stats.kv_pages_cached))
        load = {
            "dp_rank": 0,
            "num_running_reqs": stats.running,
            "num_waiting_reqs": stats.waiting,
            "num_total_reqs": stats.running + stats.waiting,
            "num_used_tokens": used * page,
            "max_total_num_tokens": total * page,
            "token_usage": used / total if total else 0.0,
            "max_running_requests": info.get("max_running_requests", 0),
            "disagg_mode": stats.mode,
        }
        now = datetime.datetime.now(datetime.UTC).isoformat()
        return {"timestamp": now, "dp_rank_count": 1, "loads": [load]}

    def model_info(self) -> dict[str, Any]:
        """SGLang's `/model_info` fields that its gateway reads."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path if self.core.tokenizer is not None else None,
            "is_generation": True,
        }

    async def abort_request(self, request: Request) -> dict[str, Any]:
        """SGLang's `/abort_request`: abort `rid` and its choices (`rid-k`, `n` > 1 and
        batches), or every request of this app (`abort_all`). Each aborted request ends
        with finish reason "abort" for its client; an id not running here is ignored,
        as SGLang does (the request may have just finished). Answers which ids it aborted."""
        body = await self.core.parse(request, AbortBody, empty_ok=False)
        live = set(self.core.in_flight)
        if body.abort_all:
            rids = sorted(live)
        else:
            assert body.rid is not None
            prefix = body.rid + "-"
            rids = sorted(r for r in live if r == body.rid or r.startswith(prefix))
            if body.rid not in rids:
                rids.insert(0, body.rid)  # maybe submitted by another front (the router)
        for rid in rids:
            self.core.client.abort(rid)
        logger.info("abort_request: aborting %d request(s): %s", len(rids), rids[:8])
        return {"aborted": rids}

    async def start_profile(self, request: Request) -> dict[str, Any]:
        body = await self.core.parse(request, ProfileBody, empty_ok=True)
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
    chat_template: str | ChatRenderer | None,
    metrics: ServerMetrics,
    server_info: Callable[[], dict[str, Any]] | None = None,
    profile_dir: str = "/tmp/cpkv-profile",
    model_aliases: Sequence[str] = (),
    api_keys: ApiKeys | None = None,
    model_path: str | None = None,
    chat_parsers: ChatParserConfig | None = None,
    prefix_cache: bool = False,
    grammar: GrammarBackend | None = None,
    gateway_pd: GatewayPD | None = None,
) -> FastAPI:
    """The FastAPI app serving `client`.

    `model_name` is the served name (responses and `/v1/models` give it); a request's
    `model` may also be one of `model_aliases` (`serving.http.openai`).

    `chat_template` is a `ChatRenderer` (a `ChatTemplate` from
    `serving.http.chat_template.load_chat_template`, which knows the model's bos / eos
    strings, or a built-in format) or a bare template source. `metrics` gets
    the engine's stats attached (read at each scrape of `/metrics`). `server_info()` is
    merged into `GET /server_info` with the engine's `stats()`. `api_keys` guards the
    routes (module docstring; None or no key set: open). `model_path` (default: the
    served name) is what `/model_info` reports. `chat_parsers` are the chat route's
    tool-call and reasoning parsers (`serving.http.chat_output`; default: none).
    `prefix_cache`: the engine caches prompts' KV, so the `n` choices of a prompt are
    submitted after its first choice's first token (`ApiCore.prefill_order`).
    """
    if vocab_size <= 0 or context_length <= 0:
        raise ValueError(
            f"vocab_size and context_length must be positive, got {vocab_size}, {context_length}"
        )
    template = ChatTemplate(chat_template) if isinstance(chat_template, str) else chat_template
    metrics.attach_stats(client.stats)
    core = ApiCore(
        client,
        model_name=model_name,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        context_length=context_length,
        chat_template=template,
        metrics=metrics,
        model_aliases=model_aliases,
        chat_parsers=chat_parsers,
        prefix_cache=prefix_cache,
        grammar=grammar,
        gateway_pd=gateway_pd,
    )
    app = FastAPI(title="cpkv-jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = core  # the shared state, for tests and debugging
    install_error_handlers(app, on_client_error=metrics.record_bad_request)
    NativeRoutes(core).register(app)
    OpenAIRoutes(core).register(app)
    AdminRoutes(
        core, server_info=server_info, profile_dir=profile_dir, model_path=model_path
    ).register(app)
    install_api_keys(
        app,
        api_keys or ApiKeys(),
        admin_paths=AdminRoutes.ADMIN_PATHS,
        on_reject=metrics.record_bad_request,  # a 4xx like any other
    )
    return app
