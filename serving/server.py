"""One `cpkv-serve` process: engine by mode, warm-up, HTTP API, graceful shutdown.

`build_server(args)` assembles everything without starting the HTTP listener (tests run
the app on their own uvicorn); `run_server(args)` serves until SIGTERM / SIGINT.

Modes (`--disaggregation-mode`):
- `null`: `CachedUnifiedEngine` on one device or a CP mesh (the prefill scheduler with
  its radix cache, and the host cache with `--enable-hierarchical-cache`, feeding the
  decode batch on one pool); on a DP mesh (`--dp-size N`) a `DecodeEngine` whose intake
  is `dp_prefix.DPPrefixPrefill` over a `DPPrefixStore` (a radix cache per rank, prompts
  prefilled from their cached prefix); with `--disable-radix-cache` the plain
  `DecodeEngine(mode="null")` over a `PagedKVStore`, each prompt prefilled whole (both:
  in `--chunked-prefill-size` chunks when given);
- `decode`: a `transfer.receiver.Receiver` owns the pool and allocator (page-addressed
  writes from the prefill ranks land in it), served over gRPC on `--transfer-port` (plus
  a Mooncake receiver endpoint with `--transfer-backend mooncake`), and
  `DecodeEngine(mode="decode")` decodes from it. `/server_info` reports
  `transfer_target` (host:port) for the router;
- `prefill`: `PrefillModeEngine` (CP prefill scheduler on the `cp` mesh + the transfer
  backend). `/server_info` reports `cp_size`; with `--enable-hierarchical-cache`, also
  `hicache` (layout, write policy, host pages used / total and bytes per owner lane, the
  copy counters), and `/metrics` the `cpkv_hicache_*` series. The host cache's backup
  worker stops when the server closes.

Pool size of a single-device (null / decode) server: as a prefill rank's
(`serving.prefill.build.pool_pages_per_rank` with one lane): `--kv-pool-size` bytes; with
`none` what the device memory plan leaves (`memory_plan.resolve_kv_pool_size`; on CPU
without `--device-memory-bytes`, `min(max_position_embeddings, 131072)` tokens).
`--max-running-requests none` is as many requests as that pool holds
(`max_running_requests`). The startup log and `/server_info` give the longest prompt the
server takes (`longest_prompt_tokens`) and its running-request bound.

Before any weight is read, every mode validates the flags and runs the device memory
plan (`serving.prefill.memory_plan`: weights, KV pool, transient buffers, FP8
dequantization per device against `--device-memory-bytes` or device memory x
`--mem-fraction-static`); `/server_info` reports its numbers. The weights then load with
`--fp8-weights`, on a prefill server with `--ep-size N > 1` straight into their expert
shards (`serving.prefill.build.load_serving_model`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import jax
import uvicorn
from fastapi import FastAPI

from cpkv_jax.aot import BackgroundCompiler, CompileJob
from cpkv_jax.buckets import min_block
from cpkv_jax.config import ModelConfig
from cpkv_jax.cp_decode import CPDecoder, DecodeGroups
from cpkv_jax.cp_prefill import CPPrefillRunner
from cpkv_jax.decode_mesh import PREFIX_ROW_SLACK, DPPoolLayout, init_dp_pool
from cpkv_jax.errors import ConfigError
from cpkv_jax.kv_store import DevicePool, DPPrefixStore, PagedKVStore
from cpkv_jax.mesh import GROUP_AXES, make_cp_mesh, make_dp_mesh, make_group_mesh
from cpkv_jax.model.expert_parallel import EPSpec
from cpkv_jax.model.kv_cache import DTYPES, PagedKVIO, init_pool
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.paging import PageAllocator, pages_for_tokens
from cpkv_jax.tokenizer import Tokenizer, load_tokenizer
from serving.api_keys import ApiKeys
from serving.compilation_cache import enable_compilation_cache
from serving.compile_events import COMPILES
from serving.decode.cached import CachedUnifiedEngine
from serving.decode.dp_prefix import DPPrefixPrefill
from serving.decode.engine import DecodeEngine
from serving.engine.api import GenerateRequest, SamplingParams, StepEngine
from serving.engine.loop import EngineLoop
from serving.grammar import GrammarBackend, load_grammar_backend
from serving.http.app import build_app
from serving.http.chat_template import load_chat_template
from serving.http.deepseek_v32_template import builtin_chat_template
from serving.http.gateway_pd import GatewayPD
from serving.http.keepalive import HTTP_KEEPALIVE_S
from serving.http.metrics import ServerMetrics
from serving.prefill.build import (
    build_prefill_engine,
    dp_host_caches,
    ep_spec,
    load_serving_model,
    pool_pages_per_rank,
    runner_flags,
)
from serving.prefill.engine import PrefillModeEngine, backend_from_args
from serving.prefill.memory_plan import plan_device_memory
from serving.server_args import ServerArgs, max_running_requests
from transfer.bootstrap import (
    DEFAULT_BOOTSTRAP_PORT,
    BootstrapClient,
    BootstrapRegistry,
    BootstrapServer,
    layout_json,
)
from transfer.page_plan import LayoutDescriptor
from transfer.receiver import staging_region_bytes
from transfer.staging_arena import DEFAULT_ALIGNMENT

logger = logging.getLogger(__name__)

# Exit code of a server whose engine failed while serving (distinct from a leak's 1).
EXIT_ENGINE_FAILED = 3
# How often the server checks that its engine thread can still serve.
ENGINE_WATCH_S = 0.5
WARMUP_STEPS_LIMIT = 64
# A Mooncake receiver's staging arena is never smaller than this.
MOONCAKE_ARENA_MIN_BYTES = 64 << 20


@dataclasses.dataclass
class Server:
    """Everything one server process runs; `close()` releases what `build_server` made."""

    args: ServerArgs
    cfg: ModelConfig
    engine: StepEngine
    loop: EngineLoop
    app: FastAPI
    info: dict[str, Any]
    closers: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    engine_failure: str | None = None  # set when the engine failed while serving
    compiler: BackgroundCompiler | None = None  # --warmup-background: the rest compiling

    def close(self) -> None:
        for close in reversed(self.closers):
            try:
                close()
            except Exception:
                logger.exception("error while closing the server")
        self.closers.clear()

    def settle_caches(self) -> None:
        """Evict the prefix cache (after shutdown), so free == total unless leaked."""
        if isinstance(self.engine, PrefillModeEngine | CachedUnifiedEngine):
            self.engine.scheduler.cache.reset()
        elif isinstance(self.engine, DecodeEngine) and isinstance(self.engine.kv, DPPrefixStore):
            self.engine.kv.reset_caches()

    def kv_free_summary(self) -> str:
        stats = self.engine.stats()
        free, total = stats.kv_pages_free, stats.kv_pages_total
        return ", ".join(
            f"rank {r}: {f}/{t}" for r, (f, t) in enumerate(zip(free, total, strict=True))
        )

    def kv_leaked(self) -> bool:
        stats = self.engine.stats()
        return stats.kv_pages_free != stats.kv_pages_total


def mooncake_staging_bytes(
    args: ServerArgs, cfg: ModelConfig, layout: LayoutDescriptor, pool_pages: int
) -> int:
    """The decode side's Mooncake staging arena: `--transfer-staging-size`, else room to
    stage the longest request this server can hold (its pages of a context-length
    request, capped by the pool's `pool_pages` less the trash page), at least
    `MOONCAKE_ARENA_MIN_BYTES`. Rooms stage there whole, so a smaller arena refuses
    longer requests at their handshake; rooms that fit but find it full wait (the
    prefill side retries its handshake)."""
    if args.transfer_staging_size is not None:
        return args.transfer_staging_size
    longest = min(pool_pages - 1, pages_for_tokens(cfg.max_position_embeddings, args.page_size))
    need = staging_region_bytes(layout, longest, DEFAULT_ALIGNMENT)
    return max(MOONCAKE_ARENA_MIN_BYTES, need)


def longest_prompt_tokens(engine: StepEngine) -> int:
    """The longest prompt `engine` takes (0: none fits): the context and the pool's
    tokens, each less one output token (`PrefillEngine.longest_prompt_tokens`; a decode
    engine's requests need `prompt + max_new_tokens` within both)."""
    if isinstance(engine, PrefillModeEngine):
        return engine.engine.longest_prompt_tokens
    assert isinstance(engine, DecodeEngine)
    usable = engine.stats().kv_pages_total[0]
    # A speculative engine's requests also reserve its draft room.
    held = min(engine.context_length, usable * engine.page_size - engine.room)
    return max(0, held - 1)


def log_longest_prompt(engine: StepEngine, args: ServerArgs, cfg: ModelConfig) -> int:
    """Log the longest prompt `engine` takes and why (the startup line); `ConfigError`
    when the pool cannot hold one request (a 1-token prompt and its output token)."""
    longest = longest_prompt_tokens(engine)
    if isinstance(engine, PrefillModeEngine):
        alloc = engine.runner.allocator
        pages = f"{alloc.capacity_per_lane} usable pages in each of {alloc.cp_size} owner lane(s)"
    else:
        pages = f"{engine.stats().kv_pages_total[0]} usable pages"
    pool = (
        f"KV pool of {pages}, {args.page_size} tokens a page; context "
        f"{cfg.max_position_embeddings}; one token kept for output"
    )
    if longest < 1:
        raise ConfigError(f"no request fits: {pool}; raise --kv-pool-size")
    logger.info("longest prompt: %d tokens (%s)", longest, pool)
    return longest


def _detokenizer(tokenizer: Tokenizer | None):
    if tokenizer is None:
        return None
    return lambda ids: tokenizer.decode(list(ids))


def _build_decode_side(
    args: ServerArgs,
    cfg: ModelConfig,
    model: CausalLM,
    tokenizer: Tokenizer | None,
    devices: list,
    grammar: GrammarBackend | None = None,
) -> tuple[DecodeEngine, dict[str, Any], list[Callable[[], None]]]:
    if args.uses_prefill_scheduler():
        return _build_cached_unified(args, cfg, model, tokenizer, devices, grammar)
    dtype = DTYPES[args.dtype]
    # Speculative decoding keeps the MTP layer's KV in the same pages (one more layer).
    pool_cfg = args.kv_model_config(cfg)
    pages = pool_pages_per_rank(args, cfg)  # per rank (DP or CP), its trash page included
    dp = args.dp_size
    # A DP mesh, unless its ranks are DP groups of CP ranks (a CP decoder's groups).
    mesh = make_dp_mesh(dp, devices) if dp > 1 and args.cp_size == 1 else None
    # One shard of `pages` per DP rank, each with its trash page.
    dp_layout = DPPoolLayout(dp, pages, args.page_size) if mesh is not None else None
    cp_decoder = None
    if args.cp_size > 1 and dp > 1:  # DP groups of CP ranks (issue 40 item 3)
        groups = _decode_groups(args, cfg, model, devices, pages)
        cp_decoder = CPDecoder(groups)
        pool: Any = groups.kv
        logger.info(
            "decode on %d DP groups of %d CP ranks: a request's pages striped by owner over "
            "one group's ranks (%d usable pages per rank), attention where they live, "
            "routed experts split %d per device",
            dp,
            args.cp_size,
            pages - 1,
            cfg.n_routed_experts // max(args.ep_size, 1),
        )
    elif args.cp_size > 1:  # a CP decode group (issue 40): one pool striped by owner
        runner = _cp_group(args, cfg, model, devices, pages)
        cp_decoder = CPDecoder(runner)
        pool = runner.kv  # shared with the runner, whose weights the steps use
        logger.info(
            "CP decode group over %d devices: each request's pages striped by owner (%d "
            "usable pages per rank), attention where they live, routed experts split %d "
            "per rank",
            args.cp_size,
            pages - 1,
            cfg.n_routed_experts // max(args.ep_size, 1),
        )
    elif mesh is None:
        pool = init_pool(pool_cfg, pages, args.page_size, dtype, args.index_k_dtype)
    else:
        assert dp_layout is not None
        pool = init_dp_pool(pool_cfg, dp_layout, mesh, dtype, args.index_k_dtype)
    ranks = dp * args.cp_size  # pool shards: DP ranks, or CP groups' owner lanes
    running, why = max_running_requests(args, ranks * (pages - 1))
    logger.info("max running requests: %d (%s)", running, why)
    info: dict[str, Any] = {"max_running_requests": running, "dp_size": dp}
    if mesh is not None:
        logger.info(
            "data-parallel decode over %d devices: %d KV pages per rank, routed experts "
            "split %d per rank",
            dp,
            pages - 1,
            cfg.n_routed_experts // dp,
        )
    closers: list[Callable[[], None]] = []
    intake = None
    chunk = args.own_prefill_chunk()
    if args.disaggregation_mode == "null" and args.uses_prefix_cache():
        # A DP mesh (one device goes through the prefill scheduler): a cache per rank.
        assert dp_layout is not None
        device = DevicePool(pool)  # the host caches' copies run under its lock too
        host = None
        if args.enable_hierarchical_cache:
            host = dp_host_caches(args, pool_cfg, device, dp_layout, devices[0].platform)
            for io in host:
                closers.append(io.close)  # after the engine thread: its queued backups
        kv: Any = DPPrefixStore(device, dp_layout, host, args.hicache_write_policy)
        hicache = {
            "layout": args.hicache_mem_layout,
            "write_policy": args.hicache_write_policy,
            "io_backend": args.hicache_io_backend,
            "storage_backend": args.hicache_storage_backend,
        }
        intake = DPPrefixPrefill(kv, chunk, hicache if host is not None else None)
        logger.info(
            "prefix cache: one radix cache per DP rank%s, a request sent to the rank "
            "caching its longest prefix (within %d running rows of the least busy rank)",
            "" if host is None else " with its host cache",
            PREFIX_ROW_SLACK,
        )
    elif args.disaggregation_mode == "null":
        kv = PagedKVStore(pool, PageAllocator(dp * pages, ranks=dp))
    else:
        from transfer.page_plan import LayoutDescriptor
        from transfer.protocol import TransferTimeouts
        from transfer.receiver import Receiver, serve

        layout = LayoutDescriptor.from_model(pool_cfg, args.page_size, dtype, args.index_k_dtype)
        endpoint = None
        if args.transfer_backend == "mooncake":
            from transfer.backends.mooncake_backend import MooncakeReceiverEndpoint

            # A CP group's request spans every lane: its usable pages and one trash page.
            longest = pages if args.cp_size == 1 else args.cp_size * (pages - 1) + 1
            arena = mooncake_staging_bytes(args, cfg, layout, longest)
            logger.info("Mooncake receiver: %d MiB registered staging arena", arena >> 20)
            endpoint = MooncakeReceiverEndpoint(arena, hostname=args.host)
            closers.append(endpoint.close)
        timeouts = TransferTimeouts(
            bootstrap=args.transfer_bootstrap_timeout,
            waiting=args.transfer_waiting_timeout,
            heartbeat=max(15.0, 3 * args.transfer_heartbeat_interval),
            heartbeat_interval=args.transfer_heartbeat_interval,
        )
        store = PagedKVStore(pool, PageAllocator(ranks * pages, ranks=ranks))
        receiver = Receiver(layout, store, timeouts=timeouts, mooncake=endpoint)
        receiver.start()
        closers.append(receiver.close)
        grpc_server, port = serve(receiver, host=args.host, port=args.transfer_port)
        closers.append(lambda: grpc_server.stop(grace=1.0).wait(5.0))
        info["transfer_target"] = f"{args.host}:{port}"
        info["transfer_backend"] = args.transfer_backend
        kv = receiver
    engine = _decode_engine(
        args,
        cfg,
        model,
        kv,
        mode=args.disaggregation_mode,
        intake=intake,
        prefill_chunk=chunk if intake is None else None,
        max_running_requests=running,
        max_queued_requests=args.max_queued_requests,
        detokenize=_detokenizer(tokenizer),
        mesh=mesh,
        grammar=grammar,
        cp_decoder=cp_decoder,
        **_dp_flags(args),
    )
    info.update(_speculative_info(args, engine))
    return engine, info, closers


def _cp_group(
    args: ServerArgs, cfg: ModelConfig, model: CausalLM, devices: list, pages: int
) -> CPPrefillRunner:
    """A decode server's CP group: the weights placed on the `cp` mesh (experts split
    with `--ep-size`) and the page-owned pool, held by a `CPPrefillRunner`, the one
    owner of both on a CP mesh (its prefill programs are never compiled here)."""
    return CPPrefillRunner(
        cfg,
        model,
        make_cp_mesh(args.cp_size, devices),
        args.cp_config(),
        pages_per_rank=pages,
        expert_parallel=ep_spec(args),
        **runner_flags(args),  # its decode steps' numerics; drafting: the MTP layer's KV
    )


def _decode_groups(
    args: ServerArgs, cfg: ModelConfig, model: CausalLM, devices: list, pages: int
) -> DecodeGroups:
    """A decode server's DP groups of CP ranks: the weights placed on the `("dp", "cp")`
    mesh (routed experts split over all its devices, `--ep-size dp x cp`) and every
    group's page-owned pool."""
    ep = None
    if args.ep_size > 1:
        ep = EPSpec(GROUP_AXES, args.ep_size, args.ep_dispatch, args.ep_capacity_factor)
    return DecodeGroups(
        cfg,
        model,
        make_group_mesh(args.dp_size, args.cp_size, devices),
        args.cp_config(),
        pages_per_rank=pages,
        expert_parallel=ep,
        **runner_flags(args),
    )


def _build_cached_unified(
    args: ServerArgs,
    cfg: ModelConfig,
    model: CausalLM,
    tokenizer: Tokenizer | None,
    devices: list,
    grammar: GrammarBackend | None = None,
) -> tuple[DecodeEngine, dict[str, Any], list[Callable[[], None]]]:
    """Unified mode with the prefix cache: the CP prefill engine (its radix cache, host
    cache and scheduler) on one device, or on `--cp-size` devices with page-owned KV
    (issue 40), feeding the decode batch on its pool."""
    prefill = build_prefill_engine(
        args, model=model, devices=devices[: args.cp_size], hold_finished=True
    )
    alloc = prefill.scheduler.allocator
    running, why = max_running_requests(args, alloc.capacity_per_lane * alloc.cp_size)
    if args.cp_size > 1:
        logger.info(
            "unified server on a CP mesh of %d devices: each request's KV pages striped over "
            "the ranks by owner (%d usable pages per rank), decode attends where they live",
            args.cp_size,
            alloc.capacity_per_lane,
        )
    logger.info("max running requests: %d (%s)", running, why)
    try:
        engine = CachedUnifiedEngine(
            prefill=prefill,
            **_model_flags(args, cfg, model),
            max_running_requests=running,
            max_queued_requests=args.max_queued_requests,
            detokenize=_detokenizer(tokenizer),
            grammar=grammar,
        )
    except BaseException:
        prefill.close()
        raise
    info = {"max_running_requests": running, **_speculative_info(args, engine)}
    return engine, info, [prefill.close]


def _speculative_info(args: ServerArgs, engine: DecodeEngine) -> dict[str, Any]:
    """`/server_info`'s `speculative` entry (none without it), logged at startup."""
    if engine.spec is None:
        return {}
    logger.info(
        "speculative decoding: %s, %d draft tokens per step from the MTP layer, verified "
        "in the same step; %d draft-state slots (%.1f MiB); each request reserves %d "
        "tokens of pages beyond prompt + max_new_tokens",
        args.speculative_algorithm,
        engine.spec.k,
        engine.spec.num_slots,
        engine.spec.slab_bytes / 2**20,
        engine.room,
    )
    return {
        "speculative": {
            "algorithm": args.speculative_algorithm,
            "num_steps": engine.spec.k,
            "num_draft_tokens": engine.spec.k + 1,
            "eagle_topk": 1,
        }
    }


# A decode server's calls to a prefill server's bootstrap endpoint (info, registration).
BOOTSTRAP_CALL_TIMEOUT_S = 10.0


def _prefill_bootstrap(
    args: ServerArgs, engine: PrefillModeEngine
) -> tuple[GatewayPD | None, BootstrapServer | None]:
    """The bootstrap endpoint where decode servers that SGLang's gateway drives register
    their rooms (`transfer.bootstrap`). On the default port, a port already taken (a
    second prefill server on this host) turns only that off, with a warning."""
    registry = BootstrapRegistry(
        {
            "cp_size": args.cp_size,
            "page_size": args.page_size,
            "layout": layout_json(engine.layout),
        },
        expire_s=args.transfer_bootstrap_timeout,
    )
    port = args.disaggregation_bootstrap_port
    try:
        server = BootstrapServer(registry, args.host, port).start()
    except OSError as e:
        if port != DEFAULT_BOOTSTRAP_PORT:
            raise
        logger.warning(
            "PD bootstrap port %d is taken (%s): SGLang's gateway cannot drive this prefill "
            "server in PD mode; start it with --disaggregation-bootstrap-port PORT for that "
            "(cpkv-router does not need it)",
            port,
            e,
        )
        return None, None
    logger.info("PD bootstrap endpoint (SGLang's gateway) on %s:%d", args.host, server.port)
    gateway = GatewayPD("prefill", wait_s=args.transfer_bootstrap_timeout, registry=registry)
    return gateway, server


def _model_flags(args: ServerArgs, cfg: ModelConfig, model: CausalLM) -> dict[str, Any]:
    """A decode engine's model-facing arguments from `args` (the served engine and the
    warm-up probe must compile the same shapes)."""
    spec = {"speculative_num_steps": k} if (k := args.speculative_steps()) else {}
    return {
        **spec,
        "cfg": cfg,
        "model": model,
        "page_size": args.page_size,
        "index_k_dtype": args.index_k_dtype,
        "batch_invariant": args.enable_batch_invariant,
        "block_bytes": args.transient_block_size,
        "overlap": not args.disable_overlap_schedule,
        # The sparse decode's row gather and indexer scores: XLA or the Pallas kernels
        # (`--kernel-impl`).
        "kv_io": PagedKVIO(gather_impl=args.kernel_impl, index_impl=args.kernel_impl),
    }


def _dp_flags(args: ServerArgs) -> dict[str, Any]:
    """A data-parallel decode engine's expert dispatch (`--ep-dispatch`, its factor)."""
    return {"ep_dispatch": args.ep_dispatch, "ep_capacity_factor": args.ep_capacity_factor}


def _decode_engine(
    args: ServerArgs, cfg: ModelConfig, model: CausalLM, kv: Any, **kw: Any
) -> DecodeEngine:
    """A `DecodeEngine` over `kv` with the model-facing flags of `args`."""
    return DecodeEngine(kv=kv, **_model_flags(args, cfg, model), **kw)


def _pow2_upto(n: int) -> list[int]:
    """1, 2, 4, ... up to and including the power of two >= n."""
    out = [1]
    while out[-1] < n:
        out.append(out[-1] * 2)
    return out


def warm_up(
    engine: StepEngine, args: ServerArgs, cfg: ModelConfig, model: CausalLM
) -> tuple[float, list[CompileJob]]:
    """Compile the common shapes before the server reports healthy; returns seconds and
    the step shapes left to a background compiler (`--warmup-background`, else none).

    First it logs the longest prompt the server takes (`log_longest_prompt`; a pool that
    holds no request fails here); no warm-up prompt is longer. Prefill servers run one CP
    prefill per zigzag block bucket up to a chunk (prompts of `2 * cp * block` tokens,
    then a whole chunk or the longest prompt: every short prompt's step shape and the
    first chunk of every long one) and release the pages. Null servers run a few short
    requests at once through a unified `DecodeEngine` on the same pool, so the prefill
    buckets of short prompts and the decode batch buckets 1, 2, 4, 8 compile (fewer,
    shorter requests where the pool holds less). Decode servers, which never prefill, run
    those decode buckets alone on trash-page tables: no prefill program compiles there.
    With `--warmup all` (the default `auto` on GPU and TPU) every reachable step shape then
    compiles here (CP steps
    `buckets.reachable_step_shapes`, decode steps `decode.steps.reachable_shapes`), with
    a prefill server's transfer gathers, a decode server's commit scatters and the host
    cache's copies; with `--warmup-background` those still compile here and the step
    shapes become background jobs (on abstract inputs: they never touch the pool). With
    `--warmup common` (`auto` on CPU) longer contexts (wider page tables) compile on
    first use.
    """
    all_shapes = args.warms_all_shapes(jax.default_backend())
    background = all_shapes and args.warmup_background
    jobs: list[CompileJob] = []
    t0 = time.perf_counter()
    vocab = cfg.vocab_size - 3
    # Warm-up prompts stay within what the pool and the context take (a small pool
    # holds less than a default chunk); a pool that holds no request fails here.
    longest = log_longest_prompt(engine, args, cfg)

    def prompt(n: int) -> list[int]:
        return [3 + (7 * i) % vocab for i in range(n)]

    if isinstance(engine, PrefillModeEngine | CachedUnifiedEngine):
        runner = engine.prefill.runner if isinstance(engine, CachedUnifiedEngine) else engine.runner
        chunk = args.chunked_prefill_size or 4 * args.page_size * args.cp_size
        chunk = min(chunk, longest)
        cp = args.cp_size
        lengths = [
            2 * cp * b
            for b in _pow2_upto(chunk // (2 * cp))
            if b >= min_block(cp) and 2 * cp * b < chunk
        ]
        for n in [*lengths, chunk]:
            result = runner.prefill([prompt(n)], args.chunked_prefill_size)
            runner.release(result.tables[0])
        jobs += _warm_prefill_steps(engine, all_shapes, background)
        if isinstance(engine, PrefillModeEngine):
            return time.perf_counter() - t0, jobs
    # The decode batch buckets (a unified cached engine: on its runner's pool).
    assert isinstance(engine, DecodeEngine)
    free0 = engine.kv.num_free_pages
    # Prompts of a page and a token and of 5 tokens (two prefill buckets), 9 new tokens
    # (early requests keep decoding while later ones join: batches 1..8); shorter where
    # the pool or the context holds less (`longest` + 1 tokens at most).
    long_prompt = min(args.page_size + 1, longest)
    new_tokens = min(9, longest + 1 - long_prompt)
    per_request = pages_for_tokens(long_prompt + new_tokens, args.page_size)
    k = max(1, min(8, engine.max_running_requests, free0 // per_request))
    if engine.mode == "decode" or args.cp_size > 1:
        # A decode server never prefills, and a CP mesh's prompts were prefilled above by
        # its runner: the batch buckets run on trash-page tables (the step and the
        # sampler), no request and no prefill program.
        warmed = {
            ("absorbed", rows, 1, width)
            for rows in _pow2_upto(k)
            for width in _pow2_upto(per_request)
        }
        if engine.spec is not None:  # their speculative twins and this engine's admissions
            warmed = engine.spec.shapes_for(warmed, engine.spec_admission)
        warmed = engine.as_run(warmed)
        engine.warm_shapes(warmed)
    else:
        warmed = _run_warmup_requests(args, cfg, model, engine, k, long_prompt, new_tokens)
        engine.warm_feeds(warmed)  # the probe's steps fed only the pairs it met
    reachable = engine.reachable_shapes()
    _log_compile_work("decode step", len(reachable), *engine.compile_estimate())
    if all_shapes:
        t = time.perf_counter()
        if background:
            decode_jobs = engine.compile_jobs()
            jobs += decode_jobs
            n = 0
        else:
            n = engine.warm_all_shapes(warmed)
        from transfer.receiver import Receiver  # as in _build_decode_side

        # A decode server's rooms commit into the pool in power-of-two scatters.
        commits = engine.kv.warm_commits(free0) if isinstance(engine.kv, Receiver) else 0
        # A unified DP server's host caches: one warm covers every rank's device.
        host = engine.kv.host if isinstance(engine.kv, DPPrefixStore) else None
        copies = host[0].warm() if host else 0
        logger.info(
            "warm-up: %d reachable step shapes (%d more compiled%s), %d commit scatters "
            "and %d host cache copies in %.1fs",
            len(reachable),
            n,
            f", {len(decode_jobs)} left to the background" if background else "",
            commits,
            copies,
            time.perf_counter() - t,
        )
    else:
        left = len(reachable - warmed)
        logger.info(
            "warm-up: %d of %d reachable step shapes compiled; %d compile on first use "
            "(--warmup all compiles them all)",
            len(reachable) - left,
            len(reachable),
            left,
        )
    return time.perf_counter() - t0, jobs


def _run_warmup_requests(
    args: ServerArgs,
    cfg: ModelConfig,
    model: CausalLM,
    engine: DecodeEngine,
    k: int,
    long_prompt: int,
    new_tokens: int,
) -> set[tuple[str, int, int, int]]:
    """`k` short requests at once through a unified probe engine on `engine`'s pool
    (prefill buckets and decode batches 1..k); returns the step shapes they ran."""
    free0 = engine.kv.num_free_pages
    vocab = cfg.vocab_size - 3
    probe = _decode_engine(
        args,
        cfg,
        model,
        engine.kv,
        mode="null",
        max_running_requests=k,
        mesh=engine.mesh,
        **_dp_flags(args),
        # The served engine's slot count: the draft state is part of the compiled shapes.
        **({"speculative_slots": engine.spec.num_slots} if engine.spec is not None else {}),
    )
    for i in range(k):
        n = long_prompt if i % 2 == 0 else min(5, long_prompt)
        ids = tuple(3 + (7 * j) % vocab for j in range(n))
        probe.add(GenerateRequest(f"warmup-{i}", ids, SamplingParams(max_new_tokens=new_tokens)))
    finished = 0
    for _ in range(WARMUP_STEPS_LIMIT):
        finished += sum(c.finished for c in probe.step())
        if finished == k:
            break
    else:
        raise RuntimeError(f"warm-up: {k - finished} of {k} requests did not finish")
    if engine.kv.num_free_pages != free0:
        raise RuntimeError("warm-up requests leaked KV pages")
    return set(probe.step_shapes)


def _log_compile_work(family: str, reachable: int, left: int, seconds: float) -> None:
    """The startup line that sizes the compile work still ahead (issue 25)."""
    logger.info(
        "compile work: %d reachable %s shapes, %d not compiled yet: about %.0fs at this "
        "start's mean per %s compile so far (persistent-cache hits make it shorter)",
        reachable,
        family,
        left,
        seconds,
        family,
    )


def _warm_prefill_steps(
    engine: PrefillModeEngine | CachedUnifiedEngine, all_shapes: bool, background: bool
) -> list[CompileJob]:
    """Log how many CP step shapes the requests can reach; with `all_shapes` compile
    them all, with every transfer gather a prefill server's senders can run and the host
    cache's copies. With `background` the step shapes are returned as jobs instead."""
    if isinstance(engine, PrefillModeEngine):
        reachable, runner = engine.reachable_shapes(), engine.runner
    else:
        # Its scheduler holds at most max_running_requests (waiting + the chunked one).
        bound = engine.max_running_requests - 1
        reachable, runner = engine.prefill.reachable_shapes(bound), engine.prefill.runner

    jobs: list[CompileJob] = []

    def warm() -> dict[str, int]:
        if isinstance(engine, PrefillModeEngine):
            if background:
                jobs.extend(engine.compile_jobs())
            return engine.warm_all_shapes(steps=not background)
        if background:
            jobs.extend(engine.prefill.compile_jobs(bound))
            steps = 0
        else:
            steps = engine.prefill.warm_all_shapes(bound)
        return {"steps": steps, "host cache copies": engine.prefill.warm_host_copies()}

    _log_compile_work("CP prefill step", len(reachable), *runner.compile_estimate(reachable))
    if not all_shapes:
        left = len(reachable - runner.step_shapes)
        logger.info(
            "warm-up: %d of %d reachable CP step shapes compiled; %d compile on first use "
            "(--warmup all compiles them all)",
            len(reachable) - left,
            len(reachable),
            left,
        )
        return jobs
    t = time.perf_counter()
    counts = warm()
    if background:
        counts["steps left to the background"] = len(jobs)
    logger.info(
        "warm-up: %d reachable CP step shapes; compiled %s in %.1fs",
        len(reachable),
        ", ".join(f"{n} {family}" for family, n in counts.items()),
        time.perf_counter() - t,
    )
    return jobs


def hicache_source(engine: StepEngine) -> Callable[[], dict[str, Any] | None] | None:
    """The host cache's live info (`PrefillEngine.hicache_info`), or None when the engine
    has no host cache."""
    if isinstance(engine, PrefillModeEngine) and engine.engine.host_io is not None:
        return engine.engine.hicache_info
    if isinstance(engine, CachedUnifiedEngine) and engine.prefill.host_io is not None:
        return engine.hicache_info
    intake = getattr(engine, "intake", None)
    if isinstance(intake, DPPrefixPrefill) and intake.store.host is not None:
        return intake.hicache_info
    return None


def server_info_source(
    info: dict[str, Any], engine: StepEngine, compiler: BackgroundCompiler | None = None
) -> Callable[[], dict[str, Any]]:
    """What `/server_info` adds to the engine's stats: the static `info`, the compile
    counts, the host cache's live `hicache` entry when there is one, and the background
    compiler's progress (`background_compile`) with `--warmup-background`."""
    hicache = hicache_source(engine)

    def live() -> dict[str, Any]:
        out = {**info, "xla_compiles": COMPILES.snapshot()}
        if hicache is not None:
            out["hicache"] = hicache()
        if compiler is not None:
            out["background_compile"] = compiler.progress()
        return out

    return live


def build_server(args: ServerArgs, *, devices: list | None = None) -> Server:
    """Load the model once, build the mode's engine, warm it up, build the app."""
    devices = list(jax.devices()) if devices is None else devices
    # Every flag, then the device memory plan, before any weight data is read (validate
    # logs its own warnings; the prefill engine validates again against the model).
    model_cfg = args.model_config()
    args.validate(model_cfg, device_count=len(devices))
    plan = plan_device_memory(args, model_cfg, devices)
    # `--kv-pool-size none` is sized by the plan (free device memory); everything after
    # it (pools, estimator, transfer buffers) builds that pool.
    if args.kv_pool_size is None:
        args = dataclasses.replace(args, kv_pool_size=plan.kv_pool_bytes)
    t0 = time.perf_counter()
    cfg, model, _ = load_serving_model(args, devices)
    tokenizer = load_tokenizer(args.model_path)
    # Structured output reads the same tokenizer.json (`serving.grammar`).
    grammar = None
    if tokenizer is not None:
        grammar = load_grammar_backend(args.model_path, cfg.vocab_size, cfg.eos_token_ids)
    # DeepSeek-V3.2's HF checkpoint ships no template: its format is built in.
    chat = load_chat_template(args.model_path) or builtin_chat_template(cfg.model_type)
    logger.info(
        "model %s loaded in %.1fs (%d layers, tokenizer: %s, chat template: %s)",
        cfg.architecture,
        time.perf_counter() - t0,
        cfg.num_hidden_layers,
        "yes" if tokenizer else "no (token-id prompts only)",
        "no" if chat is None else chat.source if chat.source.startswith("built-in") else "yes",
    )
    info: dict[str, Any] = {
        "mode": args.disaggregation_mode,
        "model_path": args.model_path,
        "page_size": args.page_size,
        "cp_size": args.cp_size,
        "shared_kv": args.enable_cp_shared_kv,
        "dtype": args.dtype,
        "index_k_dtype": args.index_k_dtype,
        "fp8_weights": args.fp8_weights,
        "ep_size": args.ep_size,
        "ep_dispatch": args.ep_dispatch,
        **plan.server_info(),
    }
    closers: list[Callable[[], None]] = []
    if args.disaggregation_mode == "prefill":
        engine: StepEngine = PrefillModeEngine(
            build_prefill_engine(args, model=model, devices=devices, hold_finished=True),
            backend_from_args(args, cfg),
            max_queued_requests=args.max_queued_requests,
            grammar=grammar,
        )
        backend_close = getattr(engine.backend, "close", None)
        if backend_close is not None:
            closers.append(backend_close)
        closers.append(engine.engine.close)  # the host cache's backup worker, if any
        t = time.perf_counter()
        engine.backend.prepare()  # Mooncake: engine up, host copy buffer registered
        logger.info("transfer backend ready in %.2fs", time.perf_counter() - t)
        gateway_pd, bootstrap = _prefill_bootstrap(args, engine)
        if bootstrap is not None:
            closers.append(bootstrap.close)
            info["disaggregation_bootstrap_port"] = bootstrap.port
    else:  # validate() refused --cp-size > 1 outside prefill mode
        engine, extra, more = _build_decode_side(args, cfg, model, tokenizer, devices, grammar)
        info.update(extra)
        closers += more
        gateway_pd = None
        if args.disaggregation_mode == "decode":  # SGLang's gateway: `transfer.bootstrap`
            layout = LayoutDescriptor.from_model(
                args.kv_model_config(cfg), args.page_size, DTYPES[args.dtype], args.index_k_dtype
            )
            gateway_pd = GatewayPD(
                "decode",
                wait_s=args.transfer_bootstrap_timeout,
                client=BootstrapClient(timeout=BOOTSTRAP_CALL_TIMEOUT_S),
                layout=layout_json(layout),
                transfer_target=extra["transfer_target"],
            )
    try:
        warm_s, jobs = warm_up(engine, args, cfg, model)
    except Exception:
        for close in reversed(closers):
            close()
        raise
    info["longest_prompt_tokens"] = longest_prompt_tokens(engine)
    COMPILES.mark_healthy()  # every compile after this one is paid by a request
    compiler = None
    scoring = (
        engine.score_compile_jobs()
        if args.warmup_prompt_scoring and isinstance(engine, PrefillModeEngine | DecodeEngine)
        else []
    )
    if args.warmup_prompt_scoring:
        logger.info(
            "--warmup-prompt-scoring: %d prompt-scoring step shapes to compile in the background%s",
            len(scoring),
            "" if scoring else " (this server's steps score no prompts, or all are compiled)",
        )
    if args.warmup_background or scoring:
        # Started after healthy is marked: its compiles count as `background`. Closed
        # first on shutdown (after the compile in progress). The scoring twins go last:
        # only prompt log-prob requests run them.
        compiler = BackgroundCompiler([*jobs, *scoring]).start()
        closers.append(compiler.close)
        logger.info(
            "background compile: %d step shapes, smallest first, then %d scoring twins",
            len(jobs),
            len(scoring),
        )
    compiled = COMPILES.snapshot()["startup"]
    logger.info(
        "startup compiled %d XLA programs in %.1fs (%d from the persistent cache)",
        compiled["compiles"],
        compiled["seconds"],
        compiled["cache_hits"],
    )
    stats = engine.stats()
    per_rank = [t * stats.kv_bytes_per_page for t in stats.kv_pages_total]
    logger.info(
        "%s server ready: compiles warmed up in %.1fs; KV capacity per rank: %s pages of %d "
        "tokens (%.1f MiB)",
        args.disaggregation_mode,
        warm_s,
        stats.kv_pages_total[0],
        args.page_size,
        per_rank[0] / 2**20,
    )
    loop = EngineLoop(engine, name=f"engine-{args.disaggregation_mode}")
    model_names = args.served_model_names()
    context = cfg.max_position_embeddings
    metrics = ServerMetrics()
    metrics.attach_compiles(COMPILES.snapshot)
    hicache = hicache_source(engine)
    if hicache is not None:
        metrics.attach_hicache(hicache)
    app = build_app(
        loop,
        model_name=model_names[0],
        model_aliases=model_names[1:],
        tokenizer=tokenizer,
        vocab_size=cfg.vocab_size,
        context_length=context,
        chat_template=chat,
        metrics=metrics,
        server_info=server_info_source(info, engine, compiler),
        api_keys=ApiKeys(args.api_key, args.admin_api_key),
        model_path=args.model_path,
        chat_parsers=args.chat_parsers(),
        # One prefill for a prompt's `n` choices where later ones find it cached.
        prefix_cache=isinstance(engine, CachedUnifiedEngine),
        grammar=grammar,
        gateway_pd=gateway_pd,
    )
    return Server(args, cfg, engine, loop, app, info, closers, compiler=compiler)


class _DrainingServer(uvicorn.Server):
    """uvicorn that, on SIGTERM / SIGINT, stops the engine loop taking requests first
    (503 + unhealthy at once), lets running requests finish for the drain timeout while
    still serving them, aborts the rest (pages freed), then stops uvicorn. The signal is
    not re-raised afterwards (plain uvicorn does), so `run_server` can log the final KV
    state and choose the exit code. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.cpkv = server
        self.drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Runs as a signal handler (main thread, between bytecodes): hand off to the loop.
        if self.drain_task is None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_drain, sig)
        else:
            self.should_exit = True
            self.force_exit = self.drain_task is not None

    def _start_drain(self, sig: int) -> None:
        if self.drain_task is not None:
            return
        logger.info(
            "%s received: draining (up to %gs), new requests get 503",
            signal.Signals(sig).name,
            self.cpkv.args.shutdown_drain_timeout,
        )
        self.drain_task = asyncio.get_running_loop().create_task(
            self.cpkv.loop.shutdown(self.cpkv.args.shutdown_drain_timeout)
        )
        self.drain_task.add_done_callback(lambda _: setattr(self, "should_exit", True))


async def _serve(server: Server) -> None:
    args = server.args
    config = uvicorn.Config(
        server.app,
        host=args.host,
        port=args.port,
        timeout_keep_alive=HTTP_KEEPALIVE_S,  # longer than clients' idle expiry
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=max(1, int(args.shutdown_drain_timeout)),
        lifespan="off",
    )
    uv = _DrainingServer(config, server)
    watchdog = asyncio.get_running_loop().create_task(_watch_engine(server, uv))
    try:
        await uv.serve()
    finally:
        watchdog.cancel()
    if uv.drain_task is None:  # stopped without a signal (startup failure, dead engine)
        await server.loop.shutdown(0.0)
    else:
        await uv.drain_task


async def _watch_engine(server: Server, uv: _DrainingServer) -> None:
    """Stop serving once the engine can serve no more (a failed step, a dead thread):
    `/health` says why until then, and the process exits with `EXIT_ENGINE_FAILED`, so
    a supervisor restarts it instead of clients hanging on an open port."""
    while True:
        await asyncio.sleep(ENGINE_WATCH_S)
        why = server.loop.fatal_reason()
        if why is not None:
            logger.critical("the engine can serve no more (%s): stopping the server", why)
            server.engine_failure = why
            uv.should_exit = True
            return


def apply_transfer_malloc_tuning(args: ServerArgs) -> str | None:
    """A PD server process's malloc setting for gRPC page chunks (`transfer.malloc_tuning`,
    process-wide, so applied here at the entry point and not by `build_server`); returns
    what it is (for `/server_info`), None in unified mode (no transfer, nothing done)."""
    if not args.disaggregated():
        return None
    if args.disable_transfer_malloc_tuning:
        return "glibc defaults (--disable-transfer-malloc-tuning)"
    from transfer.malloc_tuning import tune_malloc

    tuning = tune_malloc()
    return tuning.describe() if tuning is not None else "C library defaults (not glibc)"


def run_server(args: ServerArgs) -> int:
    """Build, warm up and serve until a signal; returns the process exit code."""
    malloc = apply_transfer_malloc_tuning(args)  # before the transfer side allocates
    cache_dir = enable_compilation_cache(args.compilation_cache_dir)  # before any compile
    if args.kernel_impl == "pallas" and jax.default_backend() == "cpu":
        logger.warning(
            "--kernel-impl pallas on CPU: the Pallas kernels run in interpret mode, which "
            "checks their logic but makes every step far slower; serve on CPU with "
            "--kernel-impl xla"
        )
    server = build_server(args)
    server.info["compilation_cache_dir"] = cache_dir
    if malloc is not None:
        server.info["transfer_malloc_tuning"] = malloc
    logger.info(
        "serving %s on http://%s:%d%s",
        args.disaggregation_mode,
        args.host,
        args.port,
        f" (KV transfer receiver on {server.info['transfer_target']})"
        if "transfer_target" in server.info
        else "",
    )
    try:
        asyncio.run(_serve(server))
    finally:
        server.close()
    if server.engine_failure is not None:
        logger.critical(
            "exiting with code %d: the engine failed (%s)",
            EXIT_ENGINE_FAILED,
            server.engine_failure,
        )
        return EXIT_ENGINE_FAILED
    server.settle_caches()
    leaked = server.kv_leaked()
    log = logger.error if leaked else logger.info
    log(
        "shutdown complete: KV pages free %s%s",
        server.kv_free_summary(),
        " (LEAK)" if leaked else "",
    )
    return 1 if leaked else 0
