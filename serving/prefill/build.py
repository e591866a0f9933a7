"""Prefill engine startup: from `ServerArgs` to a ready CP prefill scheduler.

What a prefill server does once, before it reports healthy: validate every flag against
the model and the devices, load the model (`load_serving_model`: `--fp8-weights`, and
with `--ep-size N > 1` the routed experts read straight into their shards on the `cp`
mesh), build the `cp` mesh, the runner (expert parallel with `--ep-size N > 1`), the
page-owned (or replicated) pools sized from `--kv-pool-size`, the radix prefix cache on
the pools' owner-lane allocator, the CPU-only buffer estimator, and the prefill
scheduler with the CP shared-KV limits. When `--cp-shared-kv-prefill-max-buffer-size` is
set, that many bytes are allocated once on every CP device after the weights and pools
are placed (SPEC S9.4), and startup fails with a clear message if they do not fit beside
them.

With `--enable-hierarchical-cache` the prefix cache is a `HiRadixCache` over one host
pool per owner lane (`HostCacheIO`: `--hicache-mem-layout`, sized by `--hicache-size` or
`--hicache-ratio`, copies by `--hicache-io-backend`; Pallas kernels interpreted on CPU)
with `--hicache-write-policy`; the scheduler runs its copies, `PrefillEngine.close`
stops its backup worker.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from cpkv_jax import sampling
from cpkv_jax.aot import CompileJob
from cpkv_jax.buckets import StepShape, reachable_step_shapes
from cpkv_jax.cache.hiradix import HiRadixCache
from cpkv_jax.cache.radix import RadixCache
from cpkv_jax.config import ModelConfig
from cpkv_jax.cp_prefill import CPPrefillRunner, chunk_tokens, pages_per_rank_for
from cpkv_jax.decode_mesh import DPPoolLayout
from cpkv_jax.errors import ConfigError
from cpkv_jax.host_cache.pool import HostPools, host_pages_for
from cpkv_jax.kv_layout import KVLayout
from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.kv_store import DevicePool
from cpkv_jax.mesh import CP_AXIS, DP_AXIS, make_cp_mesh, make_dp_mesh
from cpkv_jax.model.expert_parallel import EPSpec
from cpkv_jax.model.kv_cache import DTYPES, KVPool
from cpkv_jax.model.transformer import CausalLM, log_probs
from cpkv_jax.model.weights import LoadStats, load_model
from serving.prefill.adder import CPSharedKVLimits
from serving.prefill.buffer_estimator import (
    BufferEstimator,
    profile_for_platform,
    startup_smoke_allocation,
)
from serving.prefill.host_cache import HostCacheIO, PoolTarget
from serving.prefill.scheduler import CPRunnerExecutor, PrefillScheduler, ScoringExecutor
from serving.server_args import ServerArgs

logger = logging.getLogger(__name__)

# `--kv-pool-size none` where free device memory is unknown (XLA:CPU reports no memory
# stats, and no --device-memory-bytes): pools hold this many tokens (or the model's
# context), the longest GLM-5 prompts benchmarked; elsewhere the memory plan sizes them.
DEFAULT_POOL_TOKENS = 131_072
# The host cache may take at most this share of the host memory available at startup
# (the rest: weights being read, the server's own heap, the transfer staging buffers).
HOST_CACHE_MAX_FRACTION = 0.8


def available_host_memory() -> tuple[int | None, str]:
    """Bytes this process can still get, and where the figure comes from: Linux
    `MemAvailable`, lowered to a cgroup v2 limit's headroom (a container's); None
    where neither is readable."""
    found: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                current = int(f.read().strip())
            found.append((int(limit) - current, "cgroup memory.max - memory.current"))
    except (OSError, ValueError):
        pass
    if not found:
        return None, "unknown"
    return min(found)


def check_host_cache_fits(planned: int, available: int | None, source: str) -> None:
    """Refuse a host cache larger than `HOST_CACHE_MAX_FRACTION` of the available host
    memory before allocating it: the pools are zero pages until written, so an
    oversized one would start fine and be OOM-killed once the cache fills."""
    if available is None:
        logger.warning("host memory unknown: host cache of %.1f GiB not checked", planned / 2**30)
        return
    limit = int(HOST_CACHE_MAX_FRACTION * available)
    if planned > limit:
        raise ConfigError(
            f"the host KV cache needs {planned / 2**30:.2f} GiB of host memory but "
            f"{available / 2**30:.2f} GiB is available ({source}); at most "
            f"{HOST_CACHE_MAX_FRACTION:.0%} of it ({limit / 2**30:.2f} GiB) may be used: "
            "lower --hicache-size (bytes per rank) or --hicache-ratio"
        )


@dataclasses.dataclass
class PrefillEngine:
    args: ServerArgs
    cfg: ModelConfig
    runner: CPPrefillRunner
    cache: RadixCache
    estimator: BufferEstimator
    scheduler: PrefillScheduler
    host_io: HostCacheIO | None = None  # with --enable-hierarchical-cache

    @property
    def longest_prompt_tokens(self) -> int:
        """The longest prompt a request can bring (`PrefillScheduler.longest_prompt`):
        the pool's tokens (usable pages of every owner lane) and the context, each less
        the output token reserved beside the prompt. 0 when not even a one-token prompt
        fits."""
        return min(self.cfg.max_position_embeddings - 1, self.scheduler.longest_prompt())

    def reachable_shapes(self, max_waiting: int | None = None) -> set[StepShape]:
        """Every CP step shape this engine's requests can reach
        (`buckets.reachable_step_shapes`): prompts up to `longest_prompt_tokens`, chunks
        of `--chunked-prefill-size`, batches up to
        `PrefillScheduler.max_batch_rows(max_waiting)` whose pages fit in the pool."""
        page = self.args.page_size
        alloc = self.scheduler.allocator
        longest = self.longest_prompt_tokens
        chunk = chunk_tokens(self.args.chunked_prefill_size, page)
        return reachable_step_shapes(
            cp_size=self.args.cp_size,
            page_size=page,
            max_extend_tokens=longest if chunk is None else chunk,
            longest_tokens=longest,
            max_rows=self.scheduler.max_batch_rows(max_waiting),
            pool_pages=alloc.capacity_per_lane * alloc.cp_size,
        )

    def warm_all_shapes(self, max_waiting: int | None = None) -> int:
        """Compile every reachable step shape not compiled yet (`CPPrefillRunner.warm`)
        and the first token's log-softmax; returns how many steps compiled."""
        steps = self.runner.warm(self.reachable_shapes(max_waiting))
        self._warm_first_token()
        return steps

    def compile_jobs(self, max_waiting: int | None = None) -> list[CompileJob]:
        """`warm_all_shapes` for a background compiler: the first token's log-softmax
        now, the step shapes as jobs (`CPPrefillRunner.compile_jobs`)."""
        self._warm_first_token()
        return self.runner.compile_jobs(self.reachable_shapes(max_waiting))

    def score_compile_jobs(self, max_waiting: int | None = None) -> list[CompileJob]:
        """`compile_jobs` for the step shapes' scoring twins (prompt log-probs); none when
        the scheduler's executor does not score."""
        if not isinstance(self.scheduler.executor, ScoringExecutor):
            return []
        return self.runner.score_compile_jobs(self.reachable_shapes(max_waiting))

    def _warm_first_token(self) -> None:
        """Each finished prefill's log-softmax and its first token's draw (host row), with
        and without a repetition penalty."""
        log_probs(np.zeros((1, self.cfg.vocab_size), np.float32), self.runner.batch_invariant)
        sampling.warm(self.cfg.vocab_size, [1], None, masked=True)  # masked: a grammar's
        sampling.first_token_penalties(self.cfg.vocab_size).warm(set(), {1})

    def warm_host_copies(self) -> int:
        """Compile the host cache's copy programs (`HostCacheIO.warm`); returns how many
        ran (0 without a host cache). Before serving: it writes page 0's own bits back."""
        return 0 if self.host_io is None else self.host_io.warm()

    def hicache_info(self) -> dict[str, Any] | None:
        """The host cache for `/server_info`: its configuration, host pages used / total
        and bytes per owner lane (a lane is a rank with shared KV; replicated KV has one
        lane), and its counters (`HostCacheIO.snapshot`). None without a host cache.
        Read from any thread: the counters are plain ints the scheduler thread updates."""
        io = self.host_io
        if io is None:
            return None
        assert isinstance(self.cache, HiRadixCache)
        return {
            "layout": self.args.hicache_mem_layout,
            "write_policy": self.cache.write_policy,
            "io_backend": self.args.hicache_io_backend,
            "storage_backend": self.args.hicache_storage_backend,
            "host_page_bytes": io.page_bytes,
            "host_bytes_per_lane": [pool.nbytes() for pool in io.pools.lanes],
            **io.snapshot(self.cache),
        }

    def close(self) -> None:
        """Stop the host cache's backup worker (after its queued copies) and apply what it
        finished; nothing to do without a host cache. Call once the engine thread stopped."""
        self.scheduler.close()


def pool_page_bytes(args: ServerArgs, cfg: ModelConfig) -> int:
    """Bytes of one page of the pool on each rank (pools are linear in their pages)."""
    cp = args.cp_config()
    layout = PoolLayout(cp.cp_size, cp.shared_kv, 2, args.page_size)
    kv_cfg = args.kv_model_config(cfg)  # with the MTP layer's KV when speculative
    return per_rank_pool_bytes(kv_cfg, layout, DTYPES[args.dtype], args.index_k_dtype) // 2


def pool_pages_per_rank(args: ServerArgs, cfg: ModelConfig) -> int:
    """Pages per rank: from `--kv-pool-size` bytes per rank; None = `DEFAULT_POOL_TOKENS`
    of context (a server resolves `none` first: `memory_plan.resolve_kv_pool_size`)."""
    if args.kv_pool_size is None:
        tokens = min(cfg.max_position_embeddings, DEFAULT_POOL_TOKENS)
        return pages_per_rank_for(tokens, args.page_size, args.cp_config())
    one_page = pool_page_bytes(args, cfg)
    pages = args.kv_pool_size // one_page
    if pages < 2:
        raise ConfigError(
            f"--kv-pool-size {args.kv_pool_size} bytes holds {pages} page(s) of {one_page} "
            "bytes per rank; a rank needs at least 2 (one trash page): raise --kv-pool-size"
        )
    return pages


def runner_flags(args: ServerArgs) -> dict[str, Any]:
    """The flags every CP pool owner takes from `args` (a prefill runner, a decode
    group's, decode groups): index K dtype, gather kernel, numerics, block budget and
    whether the pool keeps the MTP layer's KV (a drafting server)."""
    return {
        "index_k_dtype": args.index_k_dtype,
        "gather_impl": args.kernel_impl,
        "batch_invariant": args.enable_batch_invariant,
        "block_bytes": args.transient_block_size,
        "mtp": args.speculative_steps() > 0,
    }


def ep_spec(args: ServerArgs) -> EPSpec | None:
    """The runner's expert parallelism: over the cp axis with `--ep-size N > 1`."""
    if args.ep_size <= 1:
        return None
    return EPSpec(CP_AXIS, args.ep_size, args.ep_dispatch, args.ep_capacity_factor)


def buffer_estimator(args: ServerArgs, cfg: ModelConfig, platform: str) -> BufferEstimator:
    """The CPU-only transient-buffer estimator of this server's steps (SPEC S9)."""
    return BufferEstimator(
        cfg,
        cp_size=args.cp_size,
        page_size=args.page_size,
        dtype=args.dtype,
        index_k_dtype=args.index_k_dtype,
        profile=profile_for_platform(platform),
        block_bytes=args.transient_block_size,
        attention=args.cp_attention,
    )


def load_serving_model(
    args: ServerArgs, devices: list | None = None, *, progress: bool = True
) -> tuple[ModelConfig, CausalLM, LoadStats]:
    """Load `--model-path` as the server runs it: `--dtype` weights (FP8 kept FP8 with
    `--fp8-weights keep`); on a prefill server with `--ep-size N > 1`, every leaf built
    straight into its shards on the `cp` mesh (routed experts split, the rest
    replicated), so each process reads only the experts its devices hold. Logs what was
    read (`LoadStats`)."""
    ep = args.runs_on_cp_mesh() and args.ep_size > 1
    dp = args.disaggregation_mode != "prefill" and args.dp_size > 1
    mesh = make_cp_mesh(args.cp_size, devices) if ep else None
    axis = CP_AXIS if ep else None
    if dp:  # a data-parallel decode server: experts split over its dp ranks
        mesh, axis = make_dp_mesh(args.dp_size, devices), DP_AXIS
    stats = LoadStats()
    cfg, model = load_model(
        args.model_path,
        dtype=DTYPES[args.dtype],
        json_model_override_args=args.effective_model_overrides(),
        progress=progress,
        fp8=args.fp8_weights,
        mesh=mesh,
        expert_axis=axis,
        stats=stats,
        mtp=args.speculative_steps() > 0,  # the MTP layer drafts (issue 39)
    )
    logger.info(
        "weights: read %.3f GB (%d tensors, planned %.3f GB) in %.1f s, %.2f GB/s; "
        "--fp8-weights %s, %s",
        stats.bytes_read / 1e9,
        stats.tensors_read,
        stats.planned_bytes / 1e9,
        stats.seconds,
        stats.bytes_read / 1e9 / max(stats.seconds, 1e-9),
        args.fp8_weights,
        f"routed experts split over {args.ep_size} cp ranks"
        if ep
        else f"routed experts split over {args.dp_size} dp ranks"
        if dp
        else "no expert parallelism",
    )
    return cfg, model, stats


def build_prefill_engine(
    args: ServerArgs,
    *,
    model: CausalLM | None = None,
    devices: list | None = None,
    hold_finished: bool = False,
) -> PrefillEngine:
    """Validate `args`, load the model (unless given), build pools, cache and scheduler.

    `hold_finished`: finished requests keep their pages until the caller releases them
    (`PrefillScheduler.release_held`), as a PD prefill server needs while it transfers
    their KV (`serving.prefill.engine`). The device memory check
    (`serving.prefill.memory_plan`) is the server's: `build_server` runs it before it
    loads the weights.
    """
    cfg = args.model_config() if model is None else model.cfg
    devices = list(jax.devices()) if devices is None else devices
    for warning in args.validate(cfg, device_count=len(devices)):
        logger.warning("%s", warning)
    if model is None:
        cfg, model, _ = load_serving_model(args, devices)
    mesh = make_cp_mesh(args.cp_size, devices)
    pages = pool_pages_per_rank(args, cfg)
    runner = CPPrefillRunner(
        cfg,
        model,
        mesh,
        args.cp_config(),
        pages_per_rank=pages,
        expert_parallel=ep_spec(args),
        # A speculative server's runner also runs the MTP layer over the prompts.
        **runner_flags(args),
    )
    if args.cp_shared_kv_prefill_max_buffer_size is not None:
        # SPEC S9.4: the buffer limit must fit beside the weights and pools, so allocate it
        # only once both are resident (placement is asynchronous).
        jax.block_until_ready((runner.state, runner.pool))
        startup_smoke_allocation(args.cp_shared_kv_prefill_max_buffer_size, list(mesh.devices.flat))
    host_io, cache = prefix_cache(args, runner, devices[0].platform)
    estimator = buffer_estimator(args, cfg, devices[0].platform)
    limits = CPSharedKVLimits(
        shared_kv=args.enable_cp_shared_kv,
        bs_gt1=args.enable_cp_shared_kv_prefill_bs_gt1,
        max_batch_requests=args.cp_shared_kv_prefill_max_batch_requests,
        max_total_extend_tokens=args.cp_shared_kv_prefill_max_total_extend_tokens,
        max_cached_tokens=args.cp_shared_kv_prefill_max_cached_tokens,
        max_buffer_bytes=args.cp_shared_kv_prefill_max_buffer_size,
    )
    scheduler = PrefillScheduler(
        cache=cache,
        executor=CPRunnerExecutor(runner),
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        cp_limits=limits,
        estimator=estimator,
        policy=args.schedule_policy,
        request_timeout=args.request_timeout,
        hold_finished=hold_finished,
        host_io=host_io,
    )
    per_rank = per_rank_pool_bytes(cfg, runner.layout, DTYPES[args.dtype], args.index_k_dtype)
    logger.info(
        "prefill engine: cp=%d %s KV, %d pages of %d tokens per rank (%.1f MiB per rank), ep=%d%s",
        args.cp_size,
        "shared" if args.enable_cp_shared_kv else "replicated",
        pages,
        args.page_size,
        per_rank / 2**20,
        args.ep_size,
        f" ({args.ep_dispatch})" if args.ep_size > 1 else "",
    )
    return PrefillEngine(args, cfg, runner, cache, estimator, scheduler, host_io)


def prefill_copy_impl(args: ServerArgs) -> str | None:
    """`--hicache-io-backend` as the host copy implementation: `kernel` = the Pallas
    copy kernels; `direct` = the layout's default (XLA gathers / scatters, or the
    LF<->LPF kernels of layer_page_first, its only path)."""
    return "pallas" if args.hicache_io_backend == "kernel" else None


def host_pools(
    args: ServerArgs, template: KVPool, index_layers: Sequence[int], layout: PoolLayout
) -> HostPools:
    """One host pool per lane of `layout` (`--hicache-mem-layout`, sized by
    `--hicache-size` or `--hicache-ratio` per lane), refused before any is allocated when
    they would not fit the host's available memory (`check_host_cache_fits`)."""
    page_bytes = KVLayout.of_pool(template, index_layers).bytes_per_page
    size = args.hicache_size or 0
    pages = host_pages_for(
        page_bytes, layout.pages_per_rank, size_bytes=size, ratio=args.hicache_ratio
    )
    check_host_cache_fits(pages * page_bytes * layout.lanes, *available_host_memory())
    return HostPools.create(
        template, index_layers, layout, args.hicache_mem_layout, size_bytes=size,
        ratio=args.hicache_ratio,
    )  # fmt: skip


def dp_host_caches(
    args: ServerArgs, pool_cfg: ModelConfig, device: DevicePool, layout: DPPoolLayout,
    platform: str,
) -> list[HostCacheIO]:  # fmt: skip
    """A unified DP server's host cache (`--enable-hierarchical-cache`): one host pool per
    rank, each rank's copies run by its own `HostCacheIO` (its `rank`) against its shard
    of `device` (a DP pool's ranks are its lanes)."""
    args.refuse_unbuilt()
    lanes = PoolLayout(layout.dp_size, True, layout.pages_per_rank, layout.page_size)
    pools = host_pools(args, device.pool, pool_cfg.full_indexer_layers, lanes)
    target = PoolTarget(device, lanes)
    impl, interpret = prefill_copy_impl(args), platform == "cpu"
    ios = [
        HostCacheIO(target, pools, impl=impl, interpret=interpret, rank=r)
        for r in range(layout.dp_size)
    ]
    logger.info(
        "host cache per DP rank: %s layout, %s, %s I/O, %d ranks x %d host pages "
        "(%.1f MiB per rank)",
        args.hicache_mem_layout,
        args.hicache_write_policy,
        args.hicache_io_backend,
        layout.dp_size,
        ios[0].pages_total_per_lane()[0],
        pools[0].nbytes() / 2**20,
    )
    return ios


def prefix_cache(
    args: ServerArgs, runner: CPPrefillRunner, platform: str
) -> tuple[HostCacheIO | None, RadixCache]:
    """The radix prefix cache on the runner's allocator; with `--enable-hierarchical-cache`,
    a `HiRadixCache` over one host pool per owner lane and the IO that runs its copies
    (Pallas kernels interpreted on CPU)."""
    if not args.enable_hierarchical_cache:
        return None, RadixCache(runner.allocator, args.page_size)
    args.refuse_unbuilt()  # prefill or null mode, no storage tier: what is built
    # `pool_cfg`: a drafting runner's pool has the MTP layer's KV, which the host keeps too.
    pools = host_pools(args, runner.pool, runner.pool_cfg.full_indexer_layers, runner.layout)
    io = HostCacheIO(runner, pools, impl=prefill_copy_impl(args), interpret=platform == "cpu")
    try:
        cache = HiRadixCache(
            runner.allocator,
            args.page_size,
            io.host_allocators,
            write_policy=args.hicache_write_policy,
        )
    except BaseException:
        io.close()
        raise
    lane_bytes = io.pools[0].nbytes()
    logger.info(
        "host cache: %s layout, %s, %s I/O, %d lane(s) x %d host pages (%.1f MiB per lane)",
        args.hicache_mem_layout,
        args.hicache_write_policy,
        args.hicache_io_backend,
        len(io.pools),
        io.pages_total_per_lane()[0],
        lane_bytes / 2**20,
    )
    return io, cache
