"""Startup device-memory plan: what one device will hold, checked before any weight is read.

Per device, from the checkpoint's headers and the flags alone (no tensor data, no device
allocation):

- weights: `expert_parallel.bytes_per_device` of the abstract state the loader will build
  (`weights.checkpoint_model`: FP8 + block scales where the checkpoint is F8_E4M3 and
  `--fp8-weights keep`) under `param_shardings(state, mesh, "cp" if EP else None)`: with
  `--ep-size N` a device holds `1/N` of the routed experts, everything else whole;
- KV pool: `kv_pool.per_rank_pool_bytes` of the layout the server builds
  (`serving.prefill.build.pool_pages_per_rank`; one lane on a null / decode server).
  `--kv-pool-size none` is resolved here (`resolve_kv_pool_size`): the most whole pages
  that fit the budget below less the bytes the devices already hold
  (`memory_stats()["bytes_in_use"]`), the weights, FP8 dequantization and the transient
  buffers of the steps that pool admits; where no budget is known (XLA:CPU without
  `--device-memory-bytes`) the pool of `DEFAULT_POOL_TOKENS` tokens, said in the log;
- transient step buffers (prefill mode): the CPU-only `BufferEstimator` (the one the
  scheduler's S9.3 gate asks) for the largest step the scheduler can admit, with the
  batch's maxima taken independently (so an upper bound): rows = the most requests one
  batch can hold (1 for CP shared KV without bs>1; else bounded by
  `--cp-shared-kv-prefill-max-batch-requests`, the input / chunk / page-aligned extend
  budgets and the pool's pages), extend = a whole chunk (the whole context unchunked),
  KV = the context (capped by the pool). With `--cp-shared-kv-prefill-max-buffer-size`
  the bound is `max(limit, estimate of a lone request)`: the limit gates only batches
  of several requests; a lone request is admitted whatever its estimate (SPEC S5.3). The
  estimator leaves out activations of projections / MoE / the LM head and fragmentation:
  that is what `1 - --mem-fraction-static` keeps free. Null / decode servers: their CP
  prefill steps on a CP mesh as above, else none;
- decode steps (null / decode servers): `serving.decode.step_memory.largest_step`, the
  largest of every step shape the engine can dispatch with this pool and these limits
  (rows per DP rank, page-table widths the pool holds, a speculative step's draft tokens,
  the engine's own prefills with `--disable-radix-cache` or on a DP mesh); a CP group's
  owner-attention
  step is not estimated (0, said in the source). The plan adds it to the prefill
  transient, though the two steps run apart (an upper bound);
- FP8 dequantization: the step dequantizes one layer at a time, so the largest decoder
  layer's FP8 weights on one device (its shard under EP) in the compute dtype.

Budget per device: `--device-memory-bytes` when set, else `--mem-fraction-static` of the
whole device (SGLang's meaning), capped by XLA's pool: the smallest
`device.memory_stats()["bytes_limit"]` of the server's devices is the pool, the device
is that over `XLA_PYTHON_CLIENT_MEM_FRACTION` (`cpkv-serve` sets 0.95 unless the
environment has it; JAX's own default is 0.75). A device that reports no limit (XLA:CPU) skips the
comparison, with one INFO line saying so. Over budget: `ServerArgsError` with every
number and the flags that change them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from cpkv_jax.config import ModelConfig
from cpkv_jax.cp_prefill import chunk_tokens
from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.mesh import CP_AXIS, DP_AXIS, GROUP_AXES, make_cp_mesh, make_dp_mesh, make_group_mesh
from cpkv_jax.model.expert_parallel import bytes_per_device, param_shardings
from cpkv_jax.model.kv_cache import DTYPES
from cpkv_jax.model.weights import checkpoint_model
from serving.prefill.buffer_estimator import profile_for_platform
from serving.prefill.build import (
    DEFAULT_POOL_TOKENS,
    buffer_estimator,
    pool_page_bytes,
    pool_pages_per_rank,
)
from serving.server_args import ServerArgs, ServerArgsError, max_running_requests

logger = logging.getLogger(__name__)

GiB = 2**30
XLA_CLIENT_MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_DEFAULT_MEM_FRACTION = 0.75
# What `cpkv-serve` gives XLA's GPU pool unless the environment says otherwise: static
# allocations (`--mem-fraction-static`, 0.88) plus step activations, leaving 5% to the
# CUDA context, NCCL and the Mooncake / pinned host registrations' device side.
XLA_CLIENT_MEM_FRACTION = 0.95


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _size(n: int) -> str:
    """GiB for big numbers, MiB below one GiB (startup logs of small models)."""
    return gib(n) if n >= GiB else f"{n / 2**20:.2f} MiB"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes one device holds (see the module docstring); `budget_bytes` None = not
    checked (`budget_source` says why)."""

    weight_bytes: int
    kv_pool_bytes: int
    transient_bytes: int
    dequant_bytes: int
    budget_bytes: int | None
    routed_expert_bytes: int = 0  # part of weight_bytes
    transient_source: str = ""
    decode_step_bytes: int = 0
    decode_step_source: str = ""
    budget_source: str = ""
    kv_pool_source: str = "--kv-pool-size"  # how the pool was sized

    @property
    def total_bytes(self) -> int:
        return (
            self.weight_bytes
            + self.kv_pool_bytes
            + self.transient_bytes
            + self.decode_step_bytes
            + self.dequant_bytes
        )

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.total_bytes <= self.budget_bytes

    def describe(self) -> str:
        budget = (
            f"budget {_size(self.budget_bytes)} ({self.budget_source})"
            if self.budget_bytes is not None
            else "budget not checked"
        )
        return (
            f"weights {_size(self.weight_bytes)} (routed experts "
            f"{_size(self.routed_expert_bytes)}) + KV pool {_size(self.kv_pool_bytes)} + "
            f"transient buffers {_size(self.transient_bytes)} ({self.transient_source}) + "
            f"decode step {_size(self.decode_step_bytes)} ({self.decode_step_source}) + "
            f"FP8 dequantization {_size(self.dequant_bytes)} (largest layer) = "
            f"{_size(self.total_bytes)} per device; {budget}"
        )

    def server_info(self) -> dict[str, Any]:
        """The `/server_info` fields (bytes per device)."""
        return {
            "weight_bytes_per_device": self.weight_bytes,
            "kv_pool_bytes_per_device": self.kv_pool_bytes,
            "transient_bytes_per_device": self.transient_bytes,
            "decode_step_bytes_per_device": self.decode_step_bytes,
            "fp8_dequant_bytes_per_device": self.dequant_bytes,
            "device_memory_budget_bytes": self.budget_bytes,
            "kv_pool_source": self.kv_pool_source,
        }


# ---- the terms --------------------------------------------------------------------------


def _value(x: Any) -> Any:
    return x.get_value() if hasattr(x, "get_value") else x


def fp8_dequant_bytes(state: nnx.State, shardings: nnx.State, dtype: Any) -> int:
    """The largest decoder layer's FP8 weights on one device, dequantized to `dtype`."""
    itemsize = np.dtype(dtype).itemsize
    flat_sh = dict(nnx.to_flat_state(shardings))
    per_layer: dict[int, int] = {}
    for path, var in nnx.to_flat_state(state):
        value = _value(var)
        if path[:2] != ("model", "layers") or not np.dtype(value.dtype).name.startswith("float8"):
            continue
        shard = _value(flat_sh[path]).shard_shape(tuple(value.shape))
        layer = int(path[2])
        per_layer[layer] = per_layer.get(layer, 0) + math.prod(shard) * itemsize
    return max(per_layer.values(), default=0)


def kv_pool_bytes_per_rank(args: ServerArgs, cfg: ModelConfig) -> int:
    """Persistent KV bytes per rank of the pool the server builds."""
    cp = args.cp_config()
    layout = PoolLayout(cp.cp_size, cp.shared_kv, pool_pages_per_rank(args, cfg), cp.page_size)
    kv_cfg = args.kv_model_config(cfg)  # with the MTP layer's KV when speculative
    return per_rank_pool_bytes(kv_cfg, layout, DTYPES[args.dtype], args.index_k_dtype)


def max_batch_rows(args: ServerArgs, usable_pages: int) -> int:
    """The most requests one prefill batch can hold (`PrefillAdder`'s budgets): every
    request brings >= 1 extend token and >= 1 new page."""
    if args.enable_cp_shared_kv and not args.bs_gt1_active():
        return 1  # SPEC S5.1
    chunk = args.chunked_prefill_size
    input_budget = args.max_prefill_tokens
    bounds = [usable_pages] + ([] if chunk is None else [chunk])
    if args.bs_gt1_active():
        user = args.cp_shared_kv_prefill_max_total_extend_tokens
        limit = chunk if user is None else user if chunk is None else min(user, chunk)  # S8
        if limit is not None:
            bounds.append(max(1, limit // args.page_size))  # page-aligned extend total
            input_budget = max(input_budget, limit)  # S6: the lifted input budget
        if args.cp_shared_kv_prefill_max_batch_requests is not None:
            bounds.append(args.cp_shared_kv_prefill_max_batch_requests)
    bounds.append(1 + input_budget)  # the first request may exceed the input budget
    return max(1, min(bounds))


def transient_bytes_per_rank(
    args: ServerArgs, cfg: ModelConfig, platform: str, pages: int | None = None
) -> tuple[int, str]:
    """(bytes, how they were bounded) of the largest admissible prefill step's buffers,
    with `pages` per rank (default: the pool `args` builds)."""
    pages = pool_pages_per_rank(args, cfg) if pages is None else pages
    cp = args.cp_config()
    layout = PoolLayout(cp.cp_size, cp.shared_kv, pages, cp.page_size)
    usable = layout.lanes * (pages - 1)
    max_kv = min(cfg.max_position_embeddings, usable * cp.page_size)
    chunk = chunk_tokens(args.chunked_prefill_size, cp.page_size)
    extend = max_kv if chunk is None else min(chunk, max_kv)
    estimator = buffer_estimator(args, cfg, platform)
    lone = estimator.estimate_for(1, extend, max_kv).total_bytes
    limit = args.cp_shared_kv_prefill_max_buffer_size if args.bs_gt1_active() else None
    if limit is not None:
        return max(limit, lone), (
            f"max(--cp-shared-kv-prefill-max-buffer-size {gib(limit)}, a lone "
            f"{extend}-token step over {max_kv} KV tokens {gib(lone)})"
        )
    rows = max_batch_rows(args, usable)
    if rows == 1:
        return lone, f"estimate of a {extend}-token step over {max_kv} KV tokens"
    total = estimator.estimate_for(rows, extend, max_kv).total_bytes
    return total, (
        f"estimate of a {rows}-request step, {extend} extend / {max_kv} KV tokens per request"
    )


def memory_stats(device: Any) -> dict[str, Any] | None:
    """`device.memory_stats()`, None where the backend reports none (XLA:CPU)."""
    return device.memory_stats() if hasattr(device, "memory_stats") else None


def device_budget(args: ServerArgs, devices: Sequence[Any]) -> tuple[int | None, str]:
    """(per-device budget or None, where it comes from / why there is none)."""
    if args.device_memory_bytes is not None:
        return args.device_memory_bytes, "--device-memory-bytes"
    limits = []
    for d in devices:
        limit = (memory_stats(d) or {}).get("bytes_limit")
        if not limit:
            return None, (
                f"device {d} reports no memory limit (memory_stats() has no bytes_limit); "
                "set --device-memory-bytes to check against a budget"
            )
        limits.append(int(limit))
    smallest = min(limits)
    # `bytes_limit` is XLA's pool: the device times the client fraction. The flag, as in
    # SGLang, is a fraction of the whole device, capped by what the pool can give.
    fraction = client_mem_fraction()
    device = int(smallest / fraction)
    budget = min(int(device * args.mem_fraction_static), smallest)
    return budget, (
        f"device memory {gib(device)} x --mem-fraction-static {args.mem_fraction_static:g}, "
        f"capped by XLA's pool of {gib(smallest)} ({XLA_CLIENT_MEM_FRACTION_ENV}={fraction:g})"
    )


def client_mem_fraction() -> float:
    """The fraction of each GPU XLA's allocator was given (JAX's default 0.75)."""
    raw = os.environ.get(XLA_CLIENT_MEM_FRACTION_ENV)
    try:
        value = float(raw) if raw else JAX_DEFAULT_MEM_FRACTION
    except ValueError:
        return JAX_DEFAULT_MEM_FRACTION
    return value if 0 < value <= 1 else JAX_DEFAULT_MEM_FRACTION


# ---- --kv-pool-size none ----------------------------------------------------------------


def free_static_bytes(args: ServerArgs, devices: Sequence[Any]) -> tuple[int | None, str]:
    """(bytes, source): what the static allocations may still take on each device - the
    budget (`device_budget`: the device x `--mem-fraction-static` capped by XLA's pool,
    or `--device-memory-bytes`) less the most any device already holds
    (`memory_stats()["bytes_in_use"]`, counted where reported); None where no budget is
    known (a device without memory stats and no `--device-memory-bytes`)."""
    budget, source = device_budget(args, devices)
    if budget is None:
        return None, source
    in_use = max(int((memory_stats(d) or {}).get("bytes_in_use", 0)) for d in devices)
    return budget - in_use, f"budget {_size(budget)} ({source}) - {_size(in_use)} in use"


def kv_pool_pages_for(args: ServerArgs, cfg: ModelConfig, room: int, platform: str) -> int:
    """The most pages per rank `p` whose pool and the transient buffers of the steps it
    admits fit in `room` bytes: `p * page + transient(p) <= room` (the CP prefill steps'
    and the decode steps', as in the plan), at most what int32 token slots address.
    The transient bound grows with the pool (longer steps, more rows), so this is a
    binary search; `ServerArgsError` when not even 2 pages (the trash page + one) fit."""
    one_page = pool_page_bytes(args, cfg)
    cp_steps = args.runs_cp_prefill()  # the CP prefill steps' buffers (a unified CP mesh too)

    def transient(pages: int) -> int:
        prefill = transient_bytes_per_rank(args, cfg, platform, pages)[0] if cp_steps else 0
        return prefill + decode_step_bytes_per_device(args, cfg, platform, pages)[0]

    def fits(pages: int) -> bool:
        return pages * one_page + transient(pages) <= room

    cp = args.cp_config()
    lanes = PoolLayout(cp.cp_size, cp.shared_kv, 2, cp.page_size).lanes
    # Token slots are int32 (page tables, write slots): a small model on a big device
    # must not outgrow them.
    most = (2**31 - 1) // (lanes * cp.page_size)
    lo, hi = 1, max(1, min(room // one_page, most))  # invariant: lo fits (or is 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    if lo < 2 or not fits(lo):
        raise ServerArgsError(
            f"--kv-pool-size none: the device memory left after the weights and FP8 "
            f"dequantization, {_size(room)} per device, does not hold 2 KV pages of "
            f"{one_page} bytes (the trash page and one) and the transient step buffers of "
            f"{_size(transient(2))}; split the experts with --ep-size, lower "
            "--chunked-prefill-size, raise --mem-fraction-static or --device-memory-bytes, "
            "or set --kv-pool-size"
        )
    return lo


def resolve_kv_pool_size(
    args: ServerArgs, cfg: ModelConfig, devices: Sequence[Any], fixed_bytes: int, platform: str
) -> tuple[int, str]:
    """(`--kv-pool-size` bytes per rank, how they were chosen). `none`: the free static
    memory (`free_static_bytes`) less `fixed_bytes` (weights and FP8 dequantization per
    device) and the transient buffers, in whole pages (`kv_pool_pages_for`); the
    `1 - --mem-fraction-static` share of the device stays free for what the plan does not
    count. Where free memory is unknown (XLA:CPU without `--device-memory-bytes`): the
    pool of `DEFAULT_POOL_TOKENS` tokens (or the context)."""
    if args.kv_pool_size is not None:
        return args.kv_pool_size, "--kv-pool-size"
    one_page = pool_page_bytes(args, cfg)
    free, source = free_static_bytes(args, devices)
    if free is None:
        pages = pool_pages_per_rank(args, cfg)
        tokens = min(cfg.max_position_embeddings, DEFAULT_POOL_TOKENS)
        return pages * one_page, (
            f"--kv-pool-size none with free device memory unknown ({source}): the default "
            f"pool of {tokens} tokens (min(context, {DEFAULT_POOL_TOKENS})), {pages} pages "
            "per rank; set --kv-pool-size or --device-memory-bytes to size it"
        )
    pages = kv_pool_pages_for(args, cfg, free - fixed_bytes, platform)
    headroom = (
        "the device beyond --device-memory-bytes"
        if args.device_memory_bytes is not None
        else f"{1 - args.mem_fraction_static:.0%} of the device (1 - --mem-fraction-static)"
    )
    return pages * one_page, (
        f"--kv-pool-size none: {pages} pages per rank from free device memory, {source} - "
        f"weights and FP8 dequantization {_size(fixed_bytes)} - transient buffers; "
        f"{headroom} left as headroom"
    )


# ---- the plan -----------------------------------------------------------------------------


def decode_step_bytes_per_device(
    args: ServerArgs, cfg: ModelConfig, platform: str, pages: int | None = None
) -> tuple[int, str]:
    """(bytes, how they were bounded) of the largest decode step a null / decode server
    with `pages` pool pages per rank (default: the pool `args` builds) can dispatch on
    `platform` (`serving.decode.step_memory`); (0, why) for a prefill server or a CP
    group."""
    from serving.decode.speculative import speculative_room
    from serving.decode.step_memory import largest_step

    if args.disaggregation_mode == "prefill":
        return 0, "a prefill server runs no decode step"
    if args.cp_size > 1:
        return 0, "a CP group's owner-attention decode step is not estimated"
    pages = pool_pages_per_rank(args, cfg) if pages is None else pages
    dp = args.dp_size
    running, _ = max_running_requests(args, dp * (pages - 1))
    spec = args.speculative_steps()
    room = speculative_room(spec, not args.disable_overlap_schedule) if spec else 0
    own_prefill = args.disaggregation_mode == "null" and not args.uses_prefill_scheduler()
    step = largest_step(
        cfg,
        page_size=args.page_size,
        context_length=cfg.max_position_embeddings,
        usable_pages=pages - 1,
        rows_per_rank=-(-running // dp),
        prefill=own_prefill,
        prefill_chunk=args.own_prefill_chunk(),
        room=room,
        draft_tokens=spec,
        batch_invariant=args.enable_batch_invariant,
        block_bytes=args.transient_block_size,
        dp=dp,
        pool_pages=pages,
        dtype=args.dtype,
        index_k_dtype=args.index_k_dtype,
        profile=profile_for_platform(platform),
    )
    if step is None:
        return 0, "no request fits the pool"
    _, rows, tokens, width = step.shape
    what = "prefill" if tokens > 1 and not spec else "decode step"
    return step.total_bytes, (
        f"estimate of the largest {what}: {rows} row(s){' per DP rank' if dp > 1 else ''} "
        f"x {tokens} token(s) over {width * args.page_size} KV tokens"
    )


def speculative_state_bytes(args: ServerArgs, cfg: ModelConfig) -> int:
    """The draft state a speculative server keeps on its device
    (`serving.decode.speculative.SpeculativeSteps`): per slot, K draft distributions over
    the vocabulary (float32), K drafts, seven int32 / float32 scalars (token, position,
    temperature, seed, top-k, top-p, min-p), a bool (top log-probs) and the penalties'
    state (`cpkv_jax.speculative.Penalties`: output counts, int32, and prompt tokens,
    bool, over the vocabulary, the logit bias pairs, three penalties and where its
    `min_new_tokens` bans end), for at most
    `SPEC_SLOTS_MAX` slots (or `--max-running-requests`, if fewer) and the spare one; on
    a DP mesh or a CP group each rank keeps its share of the slots and a spare."""
    from cpkv_jax.sampling import LOGIT_BIAS_MAX
    from serving.decode.speculative import SPEC_SLOTS_MAX

    k, v = args.speculative_steps(), cfg.vocab_size
    running = args.max_running_requests
    slots = SPEC_SLOTS_MAX if running is None else min(running, SPEC_SLOTS_MAX)
    ranks = args.cp_size if args.disaggregation_mode != "prefill" else 1
    if args.decodes_on_groups():  # every CP rank of every group
        ranks *= args.dp_size
    per_rank = -(-slots // max(args.dp_size, ranks))
    penalties = v * 5 + LOGIT_BIAS_MAX * 8 + 4 * 4
    return (per_rank + 1) * (k * v * 4 + (7 + k) * 4 + 1 + penalties)


def plan_device_memory(
    args: ServerArgs, cfg: ModelConfig, devices: Sequence[Any] | None = None
) -> MemoryPlan:
    """The per-device plan of `args` (validated) and `cfg` (`args.model_config()`);
    reads only the checkpoint's headers. Raises `ServerArgsError` when over budget."""
    import jax

    devices = list(jax.devices()) if devices is None else list(devices)
    prefill = args.runs_cp_prefill()
    cp_mesh = args.runs_on_cp_mesh()  # a prefill server, or decode where the pages live
    dtype = DTYPES[args.dtype]
    # What the loader will build (`load_model` keeps `param_dtype = dtype`).
    spec = args.speculative_steps()
    model = checkpoint_model(
        cfg, args.model_path, dtype=dtype, param_dtype=dtype, fp8=args.fp8_weights, mtp=spec > 0
    )
    state = nnx.state(model)
    mesh = make_cp_mesh(args.cp_size if cp_mesh else 1, devices)
    ep_axis = CP_AXIS if cp_mesh and args.ep_size > 1 else None
    if args.decodes_on_groups():  # DP groups of CP ranks: experts over every device
        mesh, ep_axis = make_group_mesh(args.dp_size, args.cp_size, devices), GROUP_AXES
    elif not prefill and args.dp_size > 1:  # data-parallel decode: experts split over dp
        mesh, ep_axis = make_dp_mesh(args.dp_size, devices), DP_AXIS
    shardings = param_shardings(state, mesh, ep_axis)
    weights = bytes_per_device(state, shardings)
    dequant = fp8_dequant_bytes(state, shardings, dtype)
    platform = devices[0].platform
    used = list(mesh.devices.flat)
    pool_size, pool_source = resolve_kv_pool_size(
        args, cfg, used, weights["total"] + dequant, platform
    )
    args = dataclasses.replace(args, kv_pool_size=pool_size)
    if prefill:
        transient, source = transient_bytes_per_rank(args, cfg, platform)
        if spec and args.disaggregation_mode == "null":  # a unified CP group drafts too
            transient += speculative_state_bytes(args, cfg)
            source += " and the speculative draft state"
    elif spec:
        transient, source = speculative_state_bytes(args, cfg), "the speculative draft state"
    else:
        transient, source = 0, "no CP prefill step"
    decode_step, decode_source = decode_step_bytes_per_device(args, cfg, platform)
    budget, budget_source = device_budget(args, used)
    plan = MemoryPlan(
        weight_bytes=weights["total"],
        kv_pool_bytes=kv_pool_bytes_per_rank(args, cfg),
        transient_bytes=transient,
        dequant_bytes=dequant,
        budget_bytes=budget,
        routed_expert_bytes=weights["routed_experts"],
        transient_source=source,
        decode_step_bytes=decode_step,
        decode_step_source=decode_source,
        budget_source=budget_source,
        kv_pool_source=pool_source,
    )
    logger.info("KV pool: %s per rank; %s", _size(plan.kv_pool_bytes), pool_source)
    if budget is None:
        logger.info("device memory check skipped: %s", budget_source)
    if not plan.fits:
        raise ServerArgsError(over_budget_message(args, plan))
    logger.info("device memory plan: %s", plan.describe())
    return plan


def over_budget_message(args: ServerArgs, plan: MemoryPlan) -> str:
    """Every number of `plan` (GiB, then exact bytes) and the flags that change them."""
    assert plan.budget_bytes is not None
    if not args.runs_on_cp_mesh():
        ep = (
            f"split the routed experts over more decode devices with --dp-size (now {args.dp_size})"
        )
    elif args.ep_size > 1:
        ep = f"raise --cp-size with --ep-size equal to it (now both {args.ep_size})"
    else:
        ep = (
            "split the routed experts over the CP ranks with --ep-size equal to --cp-size "
            f"(prefill mode; now --ep-size 1 --cp-size {args.cp_size}), or raise both"
        )
    fixes = [
        "lower --kv-pool-size or --chunked-prefill-size",
        ep,
        f"load FP8 checkpoints with --fp8-weights keep (now {args.fp8_weights})",
        f"raise --mem-fraction-static (now {args.mem_fraction_static:g}) or set "
        "--device-memory-bytes to the real per-device budget",
    ]
    if args.bs_gt1_active():
        fixes.insert(
            1,
            "bound CP shared-KV batches with --cp-shared-kv-prefill-max-buffer-size or "
            "--cp-shared-kv-prefill-max-batch-requests",
        )
    return (
        f"the static device allocations do not fit: {gib(plan.total_bytes)} per device > "
        f"budget {gib(plan.budget_bytes)} ({plan.budget_source}). Per device: weights "
        f"{gib(plan.weight_bytes)} (routed experts {gib(plan.routed_expert_bytes)}; "
        f"--fp8-weights {args.fp8_weights}, --ep-size {args.ep_size}) + KV pool "
        f"{gib(plan.kv_pool_bytes)} + transient buffers {gib(plan.transient_bytes)} "
        f"({plan.transient_source}) + FP8 dequantization {gib(plan.dequant_bytes)} "
        f"(largest layer). In bytes: {plan.weight_bytes} + {plan.kv_pool_bytes} + "
        f"{plan.transient_bytes} + {plan.dequant_bytes} = {plan.total_bytes} > "
        f"{plan.budget_bytes}. To fit: " + "; ".join(fixes) + "."
    )
