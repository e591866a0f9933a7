"""Server arguments: one frozen dataclass is the single source of every `cpkv-serve` flag.

Each field carries its help text and help group in `dataclasses.field(metadata=...)`;
the flag name is the field name with dashes (`page_size` -> `--page-size`), and the
argparse type comes from the annotation (the generic part, shared with `cpkv-router`,
is `serving.flags`):

- `bool` -> `--flag` (store_true, default off);
- `Literal[...]` -> `choices`;
- `int` / `float` / `str` -> that type; `X | None` also accepts `none` (-> None);
- byte sizes (`metadata["parse"] = parse_byte_size`) accept `512MiB`, `2GiB`, `1.5GB`
  or a plain number of bytes, and are stored as int bytes.

`ServerArgs.validate` is the one startup check (SPEC S1.6, S2.3, S4.4, S5, S11): it
raises `ServerArgsError` naming the flag(s) and the fix, and returns warnings for flags
that are accepted but do nothing. Rules that belong to another module call it
(`cpkv_jax.config.check_cp_config` for CP, `transfer.capabilities` for backends).

Decisions written down here (SPEC leaves them open):
- `--kv-pool-size` is bytes per rank (byte-size string); `none` = size the pool at startup
  from the device memory budget left after what is in use, the weights, FP8
  dequantization and the prefill transient buffers (`memory_plan.resolve_kv_pool_size`);
  where the device reports no memory (XLA:CPU) and no `--device-memory-bytes` is given,
  a pool of 131,072 tokens (or the context). `--max-running-requests none` = as many
  requests as that pool holds at once (each at least one smallest request's pages).
- `--enable-cp-shared-kv-prefill-bs-gt1` without `--enable-cp-shared-kv` is a warning,
  not an error: SPEC S5.1 says it has no effect on ordinary CP, so launch lines shared
  between prefill setups keep working.
- A flag that only configures a feature which is off (a bs>1 limit without the bs>1
  flag, a `--hicache-*` option without `--enable-hierarchical-cache`, a transfer option
  without `--disaggregation-mode`) is an error naming the enabling flag: the launch line
  asks for something that would silently not happen. "Set" means "differs from its
  default", the only thing a frozen dataclass can tell.
- The host KV cache (`--enable-hierarchical-cache`, SPEC S4) is built for the PD prefill
  server and the unified (null) server, with no storage tier: `--disaggregation-mode
  decode` and `--hicache-storage-backend file` are valid (`--check-config` accepts them
  with a warning) but refused at startup (`refuse_unbuilt`). `--hicache-size` wins over
  `--hicache-ratio` (a non-default ratio beside it is a warning).
- API keys (`--api-key`, `--admin-api-key`, or `$CPKV_API_KEY` / `$CPKV_ADMIN_API_KEY`
  when the flag is not given; enforced by `serving.http.auth`): an empty key is an error,
  not "no key" (an unset shell variable must not open the server); `to_dict` and so
  `--check-config` print them as `<redacted>`. A non-loopback `--host` without
  `--api-key` is a warning, not an error: the cluster network may be closed.
- The served model name (`served_model_names`) is `--model-path` as given, as SGLang and
  vLLM name it, with the path's base name accepted too; `--served-model-name`, when
  given, is the only name (as in vLLM: an explicit name should not be shadowed by the
  path's).
- Expert parallelism (`--ep-size`) runs over the CP ranks of a prefill server: it is 1
  or `--cp-size`, and the model's routed experts must split evenly over the ranks. An
  `--ep-capacity-factor` below `--ep-size` is accepted with a warning (pairs over a
  rank's capacity are dropped: not exact). The device memory check itself
  (`--mem-fraction-static`, `--device-memory-bytes`) is `serving.prefill.memory_plan`,
  run at startup before any weight is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
import typing
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from cpkv_jax.buckets import TRANSIENT_BLOCK_BYTES
from cpkv_jax.config import (
    CPAttention,
    CPConfig,
    CPSplitMode,
    ModelConfig,
    check_cp_config,
    parse_override_args,
)
from cpkv_jax.errors import ConfigError, name_flags
from cpkv_jax.model.expert_parallel import EPDispatch, check_divisible
from cpkv_jax.model.kv_cache import IndexKDtype
from cpkv_jax.paging import pages_for_tokens
from cpkv_jax.pallas.paged_gather import GatherImpl
from serving import flags
from serving.api_keys import ADMIN_API_KEY_ENV, API_KEY_ENV, key_problem, open_bind_warning
from serving.flags import flag_name
from serving.parsers import ChatParserConfig
from transfer.bootstrap import DEFAULT_BOOTSTRAP_PORT
from transfer.capabilities import DEFAULT_BACKEND as DEFAULT_TRANSFER_BACKEND
from transfer.capabilities import TransferBackendRegistry, default_backend_registry

logger = logging.getLogger(__name__)

# Requests a server lets wait before it answers 503 (SGLang's --max-queued-requests).
DEFAULT_MAX_QUEUED_REQUESTS = 256

Dtype = Literal["float32", "bfloat16"]
# `cpkv_jax.model.weights.Fp8Mode` (not imported: that module pulls in orbax).
Fp8Weights = Literal["keep", "dequantize"]
# SGLang's default share of device memory for the static allocations.
DEFAULT_MEM_FRACTION_STATIC = 0.88
SchedulePolicy = Literal["fcfs", "lpm"]
HiCacheMemLayout = Literal["layer_first", "page_first", "page_first_direct", "layer_page_first"]
HiCacheIOBackend = Literal["direct", "kernel"]
HiCacheStorageBackend = Literal["none", "file"]

HiCacheWritePolicy = Literal["write_through", "write_through_selective", "write_back"]
DEFAULT_HICACHE_RATIO = 2.0

# The host KV cache is built for the PD prefill server (`serving.prefill.build`) and the
# unified server (`serving.decode.cached`); these
# valid launch lines are refused at startup (`refuse_unbuilt`) and warned about by
# `validate` / `--check-config`, rather than served without the cache.
HICACHE_NOT_BUILT = (
    "--enable-hierarchical-cache: the host KV cache (HiCache, SPEC S4) is built for the "
    "prefill and unified servers only (--disaggregation-mode prefill or null); cpkv-serve "
    "refuses to start a decode server with it rather than serve without it (a decode "
    "server's prompt KV comes from the prefill server, whose host cache holds it); drop "
    "--enable-hierarchical-cache and the --hicache-* options on the decode server"
)
HICACHE_STORAGE_NOT_BUILT = (
    "--hicache-storage-backend file: the storage (L3) tier behind the host cache is not "
    "built yet; cpkv-serve refuses to start with it rather than serve without it; use "
    "--hicache-storage-backend none (host cache only)"
)
DisaggregationMode = Literal["null", "prefill", "decode"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
# `serving.parsers.TOOL_CALL_PARSERS` / `REASONING_PARSERS` (SGLang's names), or none.
ToolCallParserName = Literal["none", "glm45", "glm47", "deepseekv32"]
ReasoningParserName = Literal["none", "glm45", "deepseek-v3"]
# Drafting with the checkpoint's own MTP layer, under SGLang's names for it (its GLM-5
# recipe passes EAGLE; NEXTN is the DeepSeek name SGLang maps to EAGLE).
SpeculativeAlgorithm = Literal["none", "EAGLE", "NEXTN", "MTP"]
DEFAULT_SPECULATIVE_STEPS = 3  # SGLang's GLM-5 recipe: 3 steps, 4 draft tokens
MAX_SPECULATIVE_STEPS = 8

# Help groups, in the order `--help` shows them.
GROUPS: dict[str, str] = {
    "model": "model",
    "nsa": "NSA index top-k sharing overrides (SPEC S11)",
    "cp": "context-parallel prefill and shared KV (SPEC S1)",
    "ep": "expert parallelism over the CP ranks of a prefill server",
    "dp": "data-parallel decode with expert parallelism (decode and unified servers)",
    "speculative": "speculative decoding with the model's MTP layer (issue 39)",
    "scheduler": "scheduler and memory",
    "bs_gt1": "CP shared-KV prefill batches of more than one request (SPEC S5-S9)",
    "hicache": "host KV cache, HiCache (SPEC S4)",
    "transfer": "prefill/decode disaggregation and KV transfer (SPEC S2)",
    "kernel": "kernels",
    "server": "server",
}


class ServerArgsError(ConfigError):
    """A `cpkv-serve` flag, or a combination of flags, is invalid; says which and the fix."""


# ---- byte sizes ---------------------------------------------------------------------

_BYTE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTE_SIZE_RE = re.compile(r"^\s*(-?)(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_byte_size(value: str | int) -> int:
    """`"512MiB"`, `"2GiB"`, `"1.5GB"`, `"4096"` or an int -> bytes (>= 0).

    Units are case-insensitive: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers
    of 1024). A bare `K`/`M`/`G` is refused because it is ambiguous between the two.
    """
    if isinstance(value, bool):
        raise ServerArgsError(f"byte size must be a number of bytes or a string, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ServerArgsError(f"byte size must be >= 0, got {value}")
        return value
    m = _BYTE_SIZE_RE.match(value)
    if m is None:
        raise ServerArgsError(
            f"cannot read {value!r} as a byte size: use a number with an optional unit, "
            "e.g. 4096, 512MiB, 2GiB, 1.5GB"
        )
    sign, number, unit = m.group(1), m.group(2), m.group(3).lower()
    if sign:
        raise ServerArgsError(f"byte size must be >= 0, got {value!r}")
    if unit not in _BYTE_UNITS:
        raise ServerArgsError(
            f"unknown byte-size unit {m.group(3)!r} in {value!r}: use B, KB, MB, GB, TB "
            "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
        )
    try:
        size = Decimal(number) * _BYTE_UNITS[unit]
    except InvalidOperation as e:  # pragma: no cover - the regex admits only decimals
        raise ServerArgsError(f"cannot read {value!r} as a byte size") from e
    if size != size.to_integral_value():
        raise ServerArgsError(f"byte size {value!r} is not a whole number of bytes ({size})")
    return int(size)


def format_byte_size(n: int) -> str:
    """Shortest exact binary-unit spelling (`2147483648` -> `2GiB`), for help and logs."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _BYTE_UNITS[unit.lower()]
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


# ---- field metadata -------------------------------------------------------------------


def _arg(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    group: str,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    override_key: str | None = None,
    requires: str | None = None,
    env: str | None = None,
    secret: bool = False,
) -> Any:
    """A `ServerArgs` field with what the flag needs (`serving.flags.arg`, plus):

    group: its help group, a key of `GROUPS`.
    override_key: the model-config key this flag overrides (SPEC S11); the default
        value means "not set".
    requires: name of the boolean-valued predicate method that must hold when this field
        differs from its default (a parameter of a feature that is off is an error).
    """
    if group not in GROUPS:
        raise ValueError(f"unknown help group {group!r}")
    return flags.arg(
        default,
        help=help,
        group=group,
        parse=parse,
        metavar=metavar,
        format_default=_format_byte_default if parse is parse_byte_size else None,
        override_key=override_key,
        requires=requires,
        env=env,
        secret=secret,
    )


def _format_byte_default(default: Any) -> str:
    return format_byte_size(default) if isinstance(default, int) else str(default)


# ---- the arguments -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerArgs:
    """Every `cpkv-serve` flag, its default and its help. Build with `from_cli` or directly."""

    # RUF009 below: `_arg` returns a `dataclasses.field`; ruff cannot see that through a
    # Literal alias (it can for int/str/bool/float annotations).

    # model
    model_path: str = _arg(
        help="Hugging Face model dir (config.json, weights)", group="model", metavar="DIR"
    )
    dtype: Dtype = _arg("bfloat16", help="activation and MLA KV dtype", group="model")  # noqa: RUF009
    index_k_dtype: IndexKDtype = _arg(  # noqa: RUF009
        "fp8_e4m3", help="NSA indexer key storage dtype (fp8 adds a per-token scale)", group="model"
    )
    json_model_override_args: str = _arg(
        "",
        help="JSON object merged into config.json before the model config is read",
        group="model",
        metavar="JSON",
    )
    fp8_weights: Fp8Weights = _arg(  # noqa: RUF009
        "keep",
        help="FP8 block-quantized checkpoint tensors: keep = stay FP8 + block scales on the "
        "device (1 byte per weight, dequantized one layer at a time in the step); "
        "dequantize = dequantize at load to --dtype (the old path, for comparison)",
        group="model",
    )
    enable_batch_invariant: bool = _arg(
        False,
        help="batch-invariant numerics: a request's tokens and log-probs do not depend on "
        "its batch, chunking or CP size (bitwise; slower, see cpkv_jax/model/numerics.py)",
        group="model",
    )

    # NSA overrides (SPEC S11)
    nsa_index_topk_freq: int | None = _arg(
        None,
        help="run the indexer every N layers (index_topk_freq); none = not set",
        group="nsa",
        override_key="index_topk_freq",
    )
    nsa_index_skip_topk_offset: int = _arg(
        0,
        help="layer offset of the freq schedule (index_skip_topk_offset); 0 = not set",
        group="nsa",
        override_key="index_skip_topk_offset",
    )
    nsa_index_topk_pattern: str | None = _arg(
        None,
        help="per-layer letters F (full indexer) / S (shared top-k); wins over freq/offset",
        group="nsa",
        metavar="LETTERS",
        override_key="index_topk_pattern",
    )

    # CP
    cp_size: int = _arg(1, help="devices that prefill one request together", group="cp")
    enable_cp_shared_kv: bool = _arg(
        False, help="store each KV page only on its owner rank (p mod cp_size)", group="cp"
    )
    cp_split_mode: CPSplitMode = _arg(  # noqa: RUF009
        "in_seq", help="how a prompt's tokens are split over CP ranks", group="cp"
    )
    page_size: int = _arg(64, help="tokens per KV page", group="cp")
    cp_attention: CPAttention = _arg(  # noqa: RUF009
        "full-view",
        help="how a CP prefill step's indexer and sparse attention read the KV: full-view = "
        "each rank all-gathers every request's whole KV, one layer at a time (transient "
        "memory grows with the context); owner = each rank scores and attends over the "
        "pages it owns, and only index scores, top-k candidates, queries and partial "
        "outputs cross ranks (the latent KV never does)",
        group="cp",
        requires="cp_shared_kv_enabled",
    )

    # expert parallelism
    ep_size: int = _arg(
        1,
        help="ranks the routed experts are split over: 1 (every rank holds all experts) "
        "or --cp-size (prefill mode only; n_routed_experts must divide evenly; a decode "
        "server splits them over its --dp-size ranks)",
        group="ep",
    )
    ep_dispatch: EPDispatch = _arg(  # noqa: RUF009
        "allgather",
        help="how tokens reach their experts' ranks: allgather (all-gather + "
        "reduce-scatter) or all_to_all (padded per-rank buffers); both exact by default",
        group="ep",
        requires="ep_enabled",
    )
    ep_capacity_factor: float | None = _arg(
        None,
        help="all_to_all only: rows per destination rank as a multiple of the even share; "
        "below --ep-size, token-expert pairs over a rank's capacity are dropped (not "
        "exact); none = --ep-size (never drops)",
        group="ep",
        requires="ep_all_to_all",
    )

    # speculative decoding
    speculative_algorithm: SpeculativeAlgorithm = _arg(  # noqa: RUF009
        "none",
        help="draft tokens with the checkpoint's own MTP layer and verify them with the "
        "model in the same decode step (greedy: exactly the tokens of plain decoding; "
        "temperature > 0: speculative sampling, with top-k / top-p / min-p, penalties, "
        "logit bias and min_new_tokens). Unified or PD (give both servers the flag: the "
        "prefill server sends the MTP layer's KV), on one device or a DP mesh (--dp-size); "
        "requests with a grammar are refused with 400",
        group="speculative",
    )
    speculative_num_steps: int | None = _arg(
        None,
        help=f"draft tokens per step (K): each step verifies K drafts and emits 1 to K + 1 "
        f"tokens; none = {DEFAULT_SPECULATIVE_STEPS}",
        group="speculative",
        requires="speculative_enabled",
    )
    speculative_eagle_topk: int | None = _arg(
        None,
        help="SGLang's draft-tree width: only 1 (a chain of drafts) is built",
        group="speculative",
        requires="speculative_enabled",
    )
    speculative_num_draft_tokens: int | None = _arg(
        None,
        help="SGLang's tokens verified per step, the current one and the drafts: must be "
        "--speculative-num-steps + 1 when given",
        group="speculative",
        requires="speculative_enabled",
    )

    # data-parallel decode
    dp_size: int = _arg(
        1,
        help="devices a decode (or --disable-radix-cache unified) server decodes on: each "
        "request's KV pages and rows stay on one rank, the routed experts are split over "
        "all of them; --kv-pool-size is per rank (as on a CP prefill server), "
        "--max-running-requests for the whole server",
        group="dp",
    )

    # scheduler and memory
    chunked_prefill_size: int | None = _arg(
        None, help="prefill chunk size in tokens; none = no chunking", group="scheduler"
    )
    max_prefill_tokens: int = _arg(
        16384, help="input-token budget of one prefill batch", group="scheduler"
    )
    max_running_requests: int | None = _arg(
        None,
        help="requests running at once on a unified or decode server; none = as many as the "
        "KV pool holds at once: its usable pages / the pages of the smallest request (a "
        "1-token prompt and 1 new token); logged at startup, in /server_info",
        group="scheduler",
    )
    max_queued_requests: int | None = _arg(
        DEFAULT_MAX_QUEUED_REQUESTS,
        help="requests that may wait (FIFO) for KV pages, batch slots or, on a prefill "
        "server, their decode side; a request beyond that gets 503 with Retry-After; "
        "none = unbounded",
        group="scheduler",
    )
    kv_pool_size: int | None = _arg(
        None,
        help="device KV pool bytes per rank (e.g. 40GiB); none = the most whole pages that "
        "fit the device memory budget (--mem-fraction-static of the device, or "
        "--device-memory-bytes) less the memory in use, the weights, FP8 dequantization "
        "and the prefill transient buffers (the rest of the device is headroom); where the "
        "device reports no memory (CPU) and no --device-memory-bytes: 131072 tokens (or "
        "the context); the choice is logged at startup",
        group="scheduler",
        parse=parse_byte_size,
        metavar="BYTES",
    )
    transient_block_size: int = _arg(
        TRANSIENT_BLOCK_BYTES,
        help="largest array of one token block of the indexer and sparse attention "
        "(bytes per rank, e.g. 1GiB): bounds a long-context prefill step's transient memory; "
        "the buffer estimator sizes blocks the same way",
        group="scheduler",
        parse=parse_byte_size,
        metavar="BYTES",
    )
    schedule_policy: SchedulePolicy = _arg(  # noqa: RUF009
        "fcfs", help="waiting-queue order: first come or longest prefix match", group="scheduler"
    )
    disable_radix_cache: bool = _arg(
        False,
        help="unified server (null mode): no prefix cache; each prompt is prefilled whole "
        "in one step. By default it keeps the radix prefix cache and prefills through the "
        "prefill scheduler (--chunked-prefill-size chunks, the admission gates) between "
        "decode steps; with --dp-size N, one cache per rank, each request sent to the rank "
        "caching its longest prefix (prompts prefilled whole, one per rank a step)",
        group="scheduler",
    )
    disable_overlap_schedule: bool = _arg(
        False,
        help="unified and decode servers: fetch each decode step's tokens before the next "
        "step is built. By default the next step is dispatched first (its input ids stay "
        "on the device) and the host's stop checks, detokenization and streaming run while "
        "the device computes; a row that finished drops the one extra token it drew",
        group="scheduler",
    )
    mem_fraction_static: float = _arg(
        DEFAULT_MEM_FRACTION_STATIC,
        help="share of each device's memory the static allocations - weights, KV pools, "
        "transient step buffers, FP8 dequantization - may take (capped by XLA's pool); "
        "checked at startup before the weights load",
        group="scheduler",
    )
    device_memory_bytes: int | None = _arg(
        None,
        help="explicit per-device memory budget for the startup check (e.g. 80GiB), "
        "replacing device memory x --mem-fraction-static; none = from the device (a "
        "device that reports no limit, e.g. CPU, skips the check)",
        group="scheduler",
        parse=parse_byte_size,
        metavar="BYTES",
    )

    # bs > 1 (SPEC S5-S9)
    enable_cp_shared_kv_prefill_bs_gt1: bool = _arg(
        False,
        help="let one CP shared-KV prefill batch hold several requests (no effect on ordinary CP)",
        group="bs_gt1",
    )
    cp_shared_kv_prefill_max_batch_requests: int | None = _arg(
        None,
        help="max requests per CP shared-KV prefill batch; none = unlimited",
        group="bs_gt1",
        requires="bs_gt1_requested",
    )
    cp_shared_kv_prefill_max_total_extend_tokens: int | None = _arg(
        None,
        help="max page-aligned extend tokens per batch (capped by the chunk budget); none = "
        "unlimited",
        group="bs_gt1",
        requires="bs_gt1_requested",
    )
    cp_shared_kv_prefill_max_cached_tokens: int | None = _arg(
        None,
        help="max cached (prefix, incl. host load-back) tokens per batch; none = unlimited",
        group="bs_gt1",
        requires="bs_gt1_requested",
    )
    cp_shared_kv_prefill_max_buffer_size: int | None = _arg(
        None,
        help="max estimated transient device buffer bytes per batch (e.g. 2GiB); also "
        "allocated once per CP device at startup as a smoke check; none = unlimited",
        group="bs_gt1",
        parse=parse_byte_size,
        metavar="BYTES",
        requires="bs_gt1_requested",
    )

    # HiCache (SPEC S4)
    enable_hierarchical_cache: bool = _arg(
        False,
        help="keep KV pages evicted from the device in a host (L2) cache and load them "
        "back on a prefix hit (prefill mode only; the host pool is per rank, one per "
        "owner lane)",
        group="hicache",
    )
    hicache_mem_layout: HiCacheMemLayout = _arg(  # noqa: RUF009
        "layer_first",
        help="host cache layout; layer_page_first is for CP shared KV, host-only and direct-only",
        group="hicache",
        requires="hicache_enabled",
    )
    hicache_io_backend: HiCacheIOBackend = _arg(  # noqa: RUF009
        "direct",
        help="device<->host copy path: direct (XLA gathers / scatters; layer_page_first: "
        "its LF<->LPF kernels) or kernel (the Pallas copy kernels; not layer_page_first)",
        group="hicache",
        requires="hicache_enabled",
    )
    hicache_storage_backend: HiCacheStorageBackend = _arg(  # noqa: RUF009
        "none",
        help="storage (L3) tier behind the host cache (file: not built yet, refused at startup)",
        group="hicache",
        requires="hicache_enabled",
    )
    hicache_size: int | None = _arg(
        None,
        help="host cache bytes per rank (e.g. 64GiB); none = --hicache-ratio x the device KV pool",
        group="hicache",
        parse=parse_byte_size,
        metavar="BYTES",
        requires="hicache_enabled",
    )
    hicache_ratio: float = _arg(
        DEFAULT_HICACHE_RATIO,
        help="host cache pages per rank as a multiple of the device KV pool's (SGLang's "
        "--hicache-ratio); used when --hicache-size is none",
        group="hicache",
        requires="hicache_enabled",
    )
    hicache_write_policy: HiCacheWritePolicy = _arg(  # noqa: RUF009
        "write_through_selective",
        help="when device pages are backed up to host: write_through (at insert), "
        "write_through_selective (once a prefix is reused), write_back (on eviction)",
        group="hicache",
        requires="hicache_enabled",
    )

    # transfer (SPEC S2)
    disaggregation_mode: DisaggregationMode = _arg(  # noqa: RUF009
        "null",
        help="null = prefill and decode here; prefill / decode = one side of PD",
        group="transfer",
    )
    transfer_backend: str = _arg(
        DEFAULT_TRANSFER_BACKEND,
        help="PD KV transfer backend, one of: {transfer_backends}",
        group="transfer",
        metavar="NAME",
        requires="disaggregated",
    )
    transfer_port: int = _arg(
        0,
        help="decode mode: port of the KV transfer receiver (gRPC control plane); "
        "0 = any free port (reported by /server_info)",
        group="transfer",
        requires="disaggregated",
    )
    disaggregation_bootstrap_port: int = _arg(
        DEFAULT_BOOTSTRAP_PORT,
        help="prefill mode: port of the PD bootstrap endpoint where a decode server driven "
        "by SGLang's gateway (smg --pd-disaggregation) registers its receiver for a room "
        "(SGLang's flag and default; give the gateway this port with the prefill URL). "
        "0 = any free port; the default port, when taken, only turns the gateway's PD "
        "mode off on this server (logged); an explicit port must be free",
        group="transfer",
        requires="disaggregated",
    )
    transfer_bootstrap_timeout: float = _arg(
        300.0,
        help="seconds for a PD pair's bootstrap handshake: decode mode, from a room's "
        "registration to its senders' handshakes; prefill mode, how long a sender retries "
        "while the decode server does not answer (a room still queued there is waited for "
        "until --request-timeout or the client leaves)",
        group="transfer",
        requires="disaggregated",
    )
    transfer_waiting_timeout: float = _arg(
        300.0,
        help="seconds a request may wait for its KV transfer",
        group="transfer",
        requires="disaggregated",
    )
    transfer_heartbeat_interval: float = _arg(
        5.0,
        help="seconds between PD peer heartbeats",
        group="transfer",
        requires="disaggregated",
    )
    transfer_host_buffer_size: int | None = _arg(
        None,
        help="prefill mode with --transfer-backend mooncake: the registered host buffer "
        "the ranks copy their device pages into before writing them (bytes, e.g. 4GiB); "
        "the ranks of a request take turns in it, so it must hold one rank's share. "
        "Default: one rank's share of a request as long as the model's context, capped "
        "by the rank's pool (at least 64MiB)",
        group="transfer",
        parse=parse_byte_size,
        metavar="BYTES",
        requires="disaggregated",
    )
    transfer_staging_size: int | None = _arg(
        None,
        help="decode mode with --transfer-backend mooncake: the registered host arena "
        "the prefill ranks write a request's pages into before they go to the decode "
        "pool (bytes, e.g. 16GiB); a request stages there whole, and one too large for "
        "it is refused at its handshake. Default: room for the longest request the "
        "decode pool can hold (at least 64MiB)",
        group="transfer",
        parse=parse_byte_size,
        metavar="BYTES",
        requires="disaggregated",
    )
    disable_transfer_malloc_tuning: bool = _arg(
        False,
        help="keep glibc's malloc defaults; by default a prefill or decode process raises "
        "the mmap / trim thresholds so 4 MiB gRPC page chunks reuse memory instead of "
        "being faulted in afresh (transfer/malloc_tuning.py; keeps up to 64 MiB freed per "
        "malloc arena)",
        group="transfer",
        requires="disaggregated",
    )

    # kernels
    kernel_impl: GatherImpl = _arg(  # noqa: RUF009
        "xla",
        help="paged kernels: the CP prefill's full-view materialization, the sparse "
        "decode's top-k row gather and its indexer scores read from the paged index K "
        "(xla, or the Pallas kernels; batch-invariant numerics keep the XLA indexer)",
        group="kernel",
    )

    # server
    host: str = _arg("127.0.0.1", help="HTTP listen address", group="server", metavar="ADDR")
    served_model_name: str | None = _arg(
        None,
        help="model name in the OpenAI API (then the only one accepted); none = "
        "--model-path as given, its base name accepted too",
        group="server",
        metavar="NAME",
    )
    tool_call_parser: ToolCallParserName = _arg(  # noqa: RUF009
        "none",
        help="parse the model's tool calls in /v1/chat/completions into `tool_calls` "
        "(requests may then send `tools`): glm47 for GLM-4.7 / GLM-5, glm45 for GLM-4.5, "
        "deepseekv32 for DeepSeek-V3.2 (SGLang's names); none = `tools` is refused",
        group="server",
    )
    reasoning_parser: ReasoningParserName = _arg(  # noqa: RUF009
        "none",
        help="split the model's <think> block into `reasoning_content` in "
        "/v1/chat/completions: glm45 for GLM-4.5 .. GLM-5 (thinks unless "
        "chat_template_kwargs.enable_thinking is false), deepseek-v3 for DeepSeek-V3.x "
        "(thinks when chat_template_kwargs.thinking is true); none = the text as it is",
        group="server",
    )
    shutdown_drain_timeout: float = _arg(
        30.0,
        help="on SIGTERM, seconds to let running requests finish before aborting them",
        group="server",
    )
    port: int = _arg(30000, help="HTTP listen port", group="server")
    api_key: str | None = _arg(
        None,
        help="key every HTTP route but /health and /metrics requires, sent as "
        "`Authorization: Bearer KEY` (the openai client's api_key); none = no key, the "
        "routes are open to whoever reaches --port",
        group="server",
        metavar="KEY",
        env=API_KEY_ENV,
        secret=True,
    )
    admin_api_key: str | None = _arg(
        None,
        help="the only key the routes that change server state take (/start_profile, "
        "/stop_profile), also accepted on every other route; none = those routes take "
        "--api-key",
        group="server",
        metavar="KEY",
        env=ADMIN_API_KEY_ENV,
        secret=True,
    )
    log_level: LogLevel = _arg("info", help="logging level", group="server")  # noqa: RUF009
    request_timeout: float | None = _arg(
        None, help="seconds before an unfinished request fails; none = no limit", group="server"
    )
    warmup: Literal["auto", "all", "common"] = _arg(
        "auto",
        help="what compiles before the server turns healthy: all = every step shape the "
        "requests can reach (and, on PD servers, every transfer gather and commit scatter): "
        "none compiles while serving, cached by --compilation-cache-dir for the next start "
        "(but the prefill steps' prompt-scoring twins, which only echo / prompt log-prob "
        "requests run: each compiles on the first such request of its shape, unless "
        "--warmup-prompt-scoring); "
        "common = the short prompts' prefill buckets and decode batches 1-8 only, the rest "
        "compiling on first use in that request's time (a fast start for development); "
        "auto = all on GPU and TPU, common on CPU (XLA:CPU maps each program's code into "
        "the process: a unified server's 297 prefill step shapes alone exhaust Linux's "
        "vm.max_map_count)",
        group="server",
        env="CPKV_WARMUP",
    )
    warmup_background: bool = _arg(
        False,
        help="with --warmup all: turn healthy after the short prompts' prefill "
        "buckets, decode batches 1-8, transfer and host-cache copies, and compile the other "
        "step shapes on a background thread while serving (a request that needs a shape "
        "still compiling waits for that compile); progress in /server_info",
        group="server",
    )
    warmup_prompt_scoring: bool = _arg(
        False,
        help="after healthy, compile the prompt-scoring twin of every reachable prefill "
        "step shape on a background thread (the steps that echo / prompt log-prob "
        "requests run, e.g. lm-eval's log-likelihood tasks; without it each compiles on "
        "the first such request of its shape, holding the engine meanwhile); prefill and "
        "unified servers",
        group="server",
    )
    compilation_cache_dir: str | None = _arg(
        "auto",
        help="JAX's persistent compilation cache: a restart of the same configuration "
        "reuses the programs compiled before; auto = $XDG_CACHE_HOME/cpkv-jax/"
        "jax-compilation-cache (else ~/.cache/...), none = off, or a directory",
        group="server",
        metavar="DIR",
    )
    check_config: bool = _arg(
        False,
        help="validate the flags and the model config, print the effective configuration "
        "as JSON and exit",
        group="server",
    )

    # ---- argparse, generated ---------------------------------------------------------
    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, backends: TransferBackendRegistry | None = None
    ) -> None:
        """Add one flag per field, in help groups. `backends` names the transfer backends
        listed in `--transfer-backend`'s help (default: `default_backend_registry()`)."""
        backends = backends if backends is not None else default_backend_registry()
        flags.add_dataclass_args(
            parser,
            cls,
            groups=GROUPS,
            converters={int: flags.parse_int, float: flags.parse_float},
            type_metavar=True,
            help_format={"transfer_backends": ", ".join(backends.names())},
        )

    @classmethod
    def build_parser(
        cls, backends: TransferBackendRegistry | None = None
    ) -> argparse.ArgumentParser:
        parser = flags.RaisingParser(
            prog="cpkv-serve",
            description="Serve a GLM-5 / DeepSeek-V3.2 NSA model with CP prefill.",
            error_class=ServerArgsError,
        )
        cls.add_cli_args(parser, backends)
        return parser

    @classmethod
    def from_cli(
        cls, argv: Sequence[str] | None = None, backends: TransferBackendRegistry | None = None
    ) -> ServerArgs:
        """Parse (not validate) the command line; errors raise `ServerArgsError`."""
        return flags.from_cli(cls, cls.build_parser(backends), argv)

    def to_dict(self) -> dict[str, Any]:
        """Every field, API keys that are set as `<redacted>` (this is printed and logged)."""
        return flags.redacted_dict(self)

    def chat_parsers(self) -> ChatParserConfig:
        """`--tool-call-parser` and `--reasoning-parser`, for the chat route."""
        return ChatParserConfig(
            reasoning=None if self.reasoning_parser == "none" else self.reasoning_parser,
            tool_call=None if self.tool_call_parser == "none" else self.tool_call_parser,
        )

    def warms_all_shapes(self, backend: str) -> bool:
        """Whether the warm-up compiles every reachable shape on `backend` (`--warmup`)."""
        return self.warmup == "all" or (self.warmup == "auto" and backend != "cpu")

    def served_model_names(self) -> tuple[str, ...]:
        """The names the OpenAI API accepts for the model, the served one (that answers
        and `/v1/models` give) first: `--served-model-name` alone when given, else
        `--model-path` as given (SGLang's and vLLM's default), then its spelling without
        a trailing slash and its base name (`/m/tiny/` -> `/m/tiny/`, `/m/tiny`, `tiny`)."""
        if self.served_model_name is not None:
            return (self.served_model_name,)
        path = self.model_path
        norm = os.path.normpath(path)
        return tuple(dict.fromkeys(n for n in (path, norm, os.path.basename(norm)) if n))

    # ---- feature predicates (named by `requires=` metadata) ----------------------------
    def bs_gt1_requested(self) -> bool:
        return self.enable_cp_shared_kv_prefill_bs_gt1

    def bs_gt1_active(self) -> bool:
        """Whether CP shared-KV batches may hold more than one request (SPEC S5.1)."""
        return self.enable_cp_shared_kv_prefill_bs_gt1 and self.enable_cp_shared_kv

    def cp_shared_kv_enabled(self) -> bool:
        return self.enable_cp_shared_kv

    def hicache_enabled(self) -> bool:
        return self.enable_hierarchical_cache

    def disaggregated(self) -> bool:
        return self.disaggregation_mode != "null"

    def ep_enabled(self) -> bool:
        """Routed experts split over ranks: a CP prefill's `--ep-size`, or a data-parallel
        decode server's `--dp-size` (its experts always split over its ranks)."""
        return self.ep_size > 1 or (self.disaggregation_mode != "prefill" and self.dp_size > 1)

    def ep_all_to_all(self) -> bool:
        return self.ep_enabled() and self.ep_dispatch == "all_to_all"

    def cp_config(self) -> CPConfig:
        return CPConfig(
            cp_size=self.cp_size,
            shared_kv=self.enable_cp_shared_kv,
            split_mode=self.cp_split_mode,
            page_size=self.page_size,
            chunked_prefill_size=self.chunked_prefill_size,
            attention=self.cp_attention,
        )

    # ---- model config (SPEC S11) -------------------------------------------------------
    def effective_model_overrides(self) -> dict[str, Any]:
        """`--json-model-override-args` with the NSA flags merged in (SPEC S11.1-S11.3).

        A flag at its default (offset 0, freq/pattern none) injects nothing (S11.2); a
        flag that disagrees with the JSON value for the same key is an error (S11.3).
        """
        try:
            overrides = parse_override_args(self.json_model_override_args)
        except ConfigError as e:
            raise ServerArgsError(as_flags(str(e))) from e
        for f in dataclasses.fields(self):
            key = f.metadata["override_key"]
            value = getattr(self, f.name)
            if key is None or value == f.default:
                continue
            if key in overrides and overrides[key] != value:
                raise ServerArgsError(
                    f"{flag_name(f.name)} {value} contradicts {key!r}: {overrides[key]!r} in "
                    "--json-model-override-args; drop one of them or make them agree"
                )
            overrides[key] = value
        return overrides

    def model_config(self) -> ModelConfig:
        """The model config of `--model-path` with the effective overrides merged in."""
        overrides = self.effective_model_overrides()
        try:
            return ModelConfig.from_pretrained(self.model_path, overrides)
        except ServerArgsError:
            raise
        except ConfigError as e:
            raise ServerArgsError(as_flags(str(e))) from e

    # ---- the one validation pass -------------------------------------------------------
    def validate(
        self,
        model_config: ModelConfig | None = None,
        device_count: int | None = None,
        backends: TransferBackendRegistry | None = None,
    ) -> tuple[str, ...]:
        """Check every flag and combination; raise `ServerArgsError` on the first problem.

        model_config: checks that need the model (SPEC S1.6 NSA check); device_count: CP
        size against the devices; backends: the transfer backend registry (default:
        `default_backend_registry()`). Returns warnings (also logged) for accepted flags
        that have no effect.
        """
        backends = backends if backends is not None else default_backend_registry()
        warnings: list[str] = []
        self._check_ranges()
        self.effective_model_overrides()
        try:  # SPEC S1.6 lives with the CP config; reuse it, as a ServerArgsError.
            check_cp_config(self.cp_config(), model_config, device_count)
        except ConfigError as e:
            raise ServerArgsError(as_flags(str(e))) from e
        self._check_transfer(backends)
        self._check_expert_parallel(model_config, warnings)
        self._check_data_parallel(model_config, device_count, warnings)
        self._check_hicache(warnings)
        self._check_radix_cache()
        self._check_speculative(model_config)
        self._check_api_keys(warnings)
        if self.cp_attention == "owner" and self.enable_batch_invariant:
            # Owner attention merges partial softmaxes by log-sum-exp, and its blocks mix
            # the queries of every rank (other requests, other chunks): not bitwise.
            raise ServerArgsError(
                "--cp-attention owner is not batch-invariant (a token's attention is merged "
                "from the ranks' partial softmaxes, computed beside other requests' "
                "queries); drop --enable-batch-invariant or use --cp-attention full-view"
            )
        warnings += self._hicache_unbuilt()
        own_prefill = self.disaggregation_mode == "null" and not self.uses_prefill_scheduler()
        if (
            own_prefill
            and self.dp_size > 1
            and self.chunked_prefill_size is None
            and not self.speculative_enabled()
        ):
            warnings.append(
                f"--dp-size {self.dp_size} on a unified server without --chunked-prefill-size: "
                "each prompt is prefilled whole in one step, whose buffers grow with the "
                "longest prompt (the memory plan counts them) and which stalls every running "
                "request for the whole prefill; --chunked-prefill-size 8192 bounds both"
            )
        if self.chunked_prefill_size is not None and own_prefill and self.speculative_enabled():
            warnings.append(
                "--chunked-prefill-size has no effect on a speculative unified server that "
                "prefills with its own steps (--disable-radix-cache, or --dp-size above 1): "
                "its admission program prefills a whole prompt"
            )
        if self.enable_cp_shared_kv_prefill_bs_gt1 and not self.enable_cp_shared_kv:
            warnings.append(
                "--enable-cp-shared-kv-prefill-bs-gt1 has no effect without "
                "--enable-cp-shared-kv (ordinary CP prefill batches are unchanged, SPEC S5.1)"
            )
        if self.warmup_prompt_scoring and self.disaggregation_mode == "decode":
            warnings.append(
                "--warmup-prompt-scoring has no effect on a decode server (the prefill "
                "server scores prompts)"
            )
        if self.warmup_background and self.warmup == "common":
            warnings.append(
                "--warmup-background has no effect with --warmup common (the shapes the "
                "warm-up leaves out compile on first use)"
            )
        self._check_requires()
        for w in warnings:
            logger.warning(w)
        return tuple(warnings)

    def _check_ranges(self) -> None:
        at_least_one = [
            "max_prefill_tokens",
            "max_running_requests",
            "max_queued_requests",
            "kv_pool_size",
            "transient_block_size",
            "device_memory_bytes",
            "ep_size",
            "nsa_index_topk_freq",
            # SPEC S5.2: each bs>1 limit is None (unlimited) or >= 1.
            "cp_shared_kv_prefill_max_batch_requests",
            "cp_shared_kv_prefill_max_total_extend_tokens",
            "cp_shared_kv_prefill_max_cached_tokens",
            "cp_shared_kv_prefill_max_buffer_size",
            "hicache_size",
            "transfer_host_buffer_size",
            "transfer_staging_size",
        ]
        for name in at_least_one:
            value = getattr(self, name)
            if value is not None and value < 1:
                optional = flags.unwrap_optional(typing.get_type_hints(type(self))[name])[0]
                fix = "use a value >= 1" + (" or none (unlimited / not set)" if optional else "")
                raise ServerArgsError(f"{flag_name(name)} must be >= 1, got {value}: {fix}")
        if self.nsa_index_skip_topk_offset < 0:
            raise ServerArgsError(
                f"--nsa-index-skip-topk-offset must be >= 0 (0 = not set), got "
                f"{self.nsa_index_skip_topk_offset}"
            )
        pattern = self.nsa_index_topk_pattern
        if pattern is not None and (not pattern or set(pattern) - {"F", "S"}):
            raise ServerArgsError(
                f"--nsa-index-topk-pattern {pattern!r} must be letters F (full indexer) and "
                "S (shared top-k), one per layer"
            )
        positive = [
            "transfer_bootstrap_timeout",
            "transfer_waiting_timeout",
            "transfer_heartbeat_interval",
            "request_timeout",
            "shutdown_drain_timeout",
        ]
        for name in positive:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ServerArgsError(f"{flag_name(name)} must be > 0 seconds, got {value}")
        if self.ep_capacity_factor is not None and not self.ep_capacity_factor > 0:
            raise ServerArgsError(
                f"--ep-capacity-factor must be > 0, got {self.ep_capacity_factor}: use a "
                "positive factor or none (--ep-size, never drops)"
            )
        if not 0 < self.mem_fraction_static <= 1:
            raise ServerArgsError(
                f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}"
            )
        if not 1 <= self.port <= 65535:
            raise ServerArgsError(f"--port must be in [1, 65535], got {self.port}")
        if not 0 <= self.disaggregation_bootstrap_port <= 65535:
            raise ServerArgsError(
                "--disaggregation-bootstrap-port must be in [0, 65535], got "
                f"{self.disaggregation_bootstrap_port}"
            )
        if not 0 <= self.transfer_port <= 65535:
            raise ServerArgsError(
                f"--transfer-port must be in [0, 65535] (0 = any free port), got "
                f"{self.transfer_port}"
            )
        if not self.model_path:
            raise ServerArgsError("--model-path is empty: point it at a HF model dir")

    def _check_api_keys(self, warnings: list[str]) -> None:
        """Keys must be sendable as a header and distinct; an HTTP port open to the
        network without a key is a warning (a cluster may firewall it)."""
        for name, env in (("api_key", API_KEY_ENV), ("admin_api_key", ADMIN_API_KEY_ENV)):
            problem = key_problem(getattr(self, name))
            if problem is not None:
                raise ServerArgsError(f"{flag_name(name)} (or ${env}) {problem}")
        if self.api_key is not None and self.api_key == self.admin_api_key:
            raise ServerArgsError(
                "--admin-api-key equals --api-key: every API key holder would be an admin; "
                "use a different admin key, or drop --admin-api-key"
            )
        exposes = "generate, read /server_info" + (
            "" if self.admin_api_key is not None else " and start profiler traces"
        )
        warning = open_bind_warning(self.host, self.port, self.api_key, exposes)
        if warning is not None:
            warnings.append(warning)

    def _check_transfer(self, backends: TransferBackendRegistry) -> None:
        if self.disaggregation_mode != "prefill" and self.cp_size > 1:
            self._check_cp_group()
        if self.transfer_host_buffer_size is not None and (
            self.disaggregation_mode != "prefill" or self.transfer_backend != "mooncake"
        ):
            raise ServerArgsError(
                "--transfer-host-buffer-size sizes the Mooncake sender's registered host "
                "buffer: it needs --disaggregation-mode prefill --transfer-backend mooncake"
            )
        if self.transfer_staging_size is not None and (
            self.disaggregation_mode != "decode" or self.transfer_backend != "mooncake"
        ):
            raise ServerArgsError(
                "--transfer-staging-size sizes the Mooncake receiver's staging arena: it "
                "needs --disaggregation-mode decode --transfer-backend mooncake"
            )
        if self.transfer_backend not in backends:
            raise ServerArgsError(
                f"--transfer-backend {self.transfer_backend!r} is not registered; use one of: "
                f"{', '.join(backends.names())}"
            )
        # SPEC S2.3: any shared-KV run with a backend (prefill disaggregation included).
        caps = backends.get(self.transfer_backend)
        missing = caps.missing_for_cp_shared_kv()
        if self.enable_cp_shared_kv and missing:
            fit = [n for n in backends.names() if backends.get(n).supports_cp_shared_kv]
            raise ServerArgsError(
                f"--transfer-backend {caps.name} lacks {' and '.join(missing)}, which "
                "--enable-cp-shared-kv needs (a chunk-slice backend would pair owned pages "
                f"with the wrong decode pages, SPEC S2.3); use --transfer-backend "
                f"{' or '.join(fit) or '<a backend with both>'}, or drop --enable-cp-shared-kv"
            )

    def _check_cp_group(self) -> None:
        """Decode on a CP mesh (issue 40): a unified server prefills and decodes over the
        same page-owned pools; a decode server receives each page on its owner rank. The
        decode attends where the pages live. Refused here, before any weights load,
        where that is not what would run."""
        cp = self.cp_size
        unified = self.disaggregation_mode == "null"
        why = None
        if not self.enable_cp_shared_kv:
            why = (
                "needs --enable-cp-shared-kv: the decode steps attend where each page lives "
                "(page p on rank p mod cp), with no replicated copy"
            )
        elif unified and not self.uses_prefix_cache():
            why = "runs through the prefix cache's scheduler: drop --disable-radix-cache"
        elif self.dp_size > 1 and unified:
            why = "is one CP group: use --dp-size 1 (DP groups of CP ranks run on a decode server)"
        elif self.dp_size > 1 and self.ep_size != self.dp_size * cp:
            # As a DP decode server's, its experts always split (`ep_enabled`).
            why = (
                f"and --dp-size {self.dp_size} splits the routed experts over all "
                f"{self.dp_size * cp} devices of its groups: use --ep-size {self.dp_size * cp}"
            )
        elif cp & (cp - 1):
            why = "needs a power-of-two --cp-size (its step buckets are powers of two)"
        if why is not None:
            server = "a unified (null)" if unified else "a decode"
            raise ServerArgsError(f"{server} server with --cp-size {cp} {why}; or use --cp-size 1")

    def decodes_on_groups(self) -> bool:
        """A decode server on DP groups of CP ranks (`--dp-size G --cp-size N`, issue 40):
        each request's pages striped over one group's ranks."""
        return self.disaggregation_mode == "decode" and self.cp_size > 1 and self.dp_size > 1

    def runs_on_cp_mesh(self) -> bool:
        """Whether the model runs on a `("cp",)` mesh: a prefill server, or a unified or
        decode one with `--cp-size N > 1` (decode where the pages live)."""
        return self.disaggregation_mode == "prefill" or self.cp_size > 1

    def runs_cp_prefill(self) -> bool:
        """Whether the CP prefill steps run here (their transient buffers count): a prefill
        server, or a unified one on a CP mesh."""
        return self.disaggregation_mode == "prefill" or (
            self.disaggregation_mode == "null" and self.cp_size > 1
        )

    def _check_expert_parallel(self, model_config: ModelConfig | None, warnings: list[str]) -> None:
        """`--ep-size` is 1 or `--cp-size` on a CP mesh (a prefill server, or a unified
        one with `--cp-size N`); experts split evenly."""
        ep = self.ep_size
        if ep == 1:
            return
        if self.decodes_on_groups() and ep == self.dp_size * self.cp_size:
            # DP groups of CP ranks: experts over every device of the groups.
            self._check_expert_split(model_config, "--ep-size", ep, "dp_size * cp_size", warnings)
            return
        if not self.runs_on_cp_mesh() or self.cp_size == 1:
            raise ServerArgsError(
                f"--ep-size {ep} splits the routed experts over the CP ranks: it needs "
                f"--cp-size {ep} (got "
                f"--disaggregation-mode {self.disaggregation_mode} --cp-size {self.cp_size});"
                " use --ep-size 1 here"
            )
        if ep != self.cp_size:
            raise ServerArgsError(
                f"--ep-size {ep} must be 1 or equal --cp-size ({self.cp_size}): expert "
                f"parallelism runs over the CP ranks; use --ep-size {self.cp_size} or 1"
            )
        self._check_expert_split(model_config, "--ep-size", ep, "cp_size", warnings)

    def refuse_unbuilt(self) -> None:
        """Raise `ServerArgsError` for a valid flag whose feature the server does not have
        yet: starting anyway would silently serve without it."""
        for reason in self._hicache_unbuilt():
            raise ServerArgsError(reason)

    def _check_data_parallel(
        self, model_config: ModelConfig | None, device_count: int | None, warnings: list[str]
    ) -> None:
        """`--dp-size N > 1`: a decode server, or a unified one (with a prefix cache per
        rank, `serving.decode.dp_prefix`, unless `--disable-radix-cache`); experts split
        evenly."""
        dp = self.dp_size
        if dp < 1:
            raise ServerArgsError(f"--dp-size must be >= 1, got {dp}")
        if dp == 1:
            return
        if self.disaggregation_mode == "prefill":
            raise ServerArgsError(
                f"--dp-size {dp} is for decode: a prefill server splits a request over "
                "--cp-size ranks instead; use --dp-size 1 here"
            )
        used = dp * self.cp_size if self.decodes_on_groups() else dp
        if device_count is not None and (used > device_count or device_count % used):
            what = f"--dp-size {dp}" + (
                f" x --cp-size {self.cp_size}" if self.decodes_on_groups() else ""
            )
            raise ServerArgsError(f"{what} must divide the {device_count} available devices")
        self._check_expert_split(model_config, "--dp-size", dp, "dp_size", warnings)

    def _check_expert_split(
        self,
        model_config: ModelConfig | None,
        flag: str,
        ranks: int,
        ranks_param: str,
        warnings: list[str],
    ) -> None:
        """Routed experts split over `ranks` (`flag`'s value; the mesh size is
        `ranks_param`): they divide evenly, and a capped all_to_all buffer is warned
        about (it drops pairs: not exact)."""
        if model_config is not None:
            try:
                check_divisible(model_config.n_routed_experts, ranks, ranks_param)
            except ConfigError as e:
                raise ServerArgsError(f"{flag} {ranks}: {as_flags(str(e))}") from e
        factor = self.ep_capacity_factor
        if self.ep_dispatch == "all_to_all" and factor is not None and factor < ranks:
            warnings.append(
                f"--ep-capacity-factor {factor:g} < {flag} {ranks}: each rank's all_to_all "
                "buffer holds fewer rows than the worst case, so token-expert pairs over "
                "a rank's capacity are dropped and results are not exact; use a "
                f"factor >= {ranks} or none for exact results"
            )

    def _check_radix_cache(self) -> None:
        if not self.disable_radix_cache:
            return
        if self.disaggregation_mode != "null":
            raise ServerArgsError(
                "--disable-radix-cache applies to the unified server (--disaggregation-mode "
                f"null); a {self.disaggregation_mode} server keeps its prefix pages as built"
            )
        if self.enable_hierarchical_cache:
            raise ServerArgsError(
                "--enable-hierarchical-cache extends the radix prefix cache: drop "
                "--disable-radix-cache (or the host cache)"
            )

    def speculative_enabled(self) -> bool:
        return self.speculative_algorithm != "none"

    def speculative_steps(self) -> int:
        """Draft tokens per decode step; 0 without speculative decoding."""
        if not self.speculative_enabled():
            return 0
        steps = self.speculative_num_steps
        return DEFAULT_SPECULATIVE_STEPS if steps is None else steps

    def kv_model_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config this server's KV pools are laid out for (`cfg`, the trunk's): with
        speculative decoding the MTP layer keeps its KV in the same pages, one more layer
        (`mtp_config`), on the prefill side (it runs the layer over the prompts and sends
        that KV) as on the decode side."""
        from cpkv_jax.model.mtp import mtp_config

        return mtp_config(cfg) if self.speculative_steps() else cfg

    def _check_speculative(self, model_config: ModelConfig | None) -> None:
        """`--speculative-algorithm`: a chain of 1..MAX_SPECULATIVE_STEPS drafts from the
        checkpoint's MTP layer, on a unified or PD decode server (one device, a DP mesh or
        a CP group);
        a PD prefill server given the same flags runs the MTP layer over the prompts and
        sends its KV and the last hidden state with the room (both sides must, or the
        layouts differ at the handshake)."""
        if not self.speculative_enabled():
            return
        k = self.speculative_steps()
        if not 1 <= k <= MAX_SPECULATIVE_STEPS:
            raise ServerArgsError(
                f"--speculative-num-steps must be in [1, {MAX_SPECULATIVE_STEPS}], got {k}"
            )
        if self.speculative_eagle_topk not in (None, 1):
            raise ServerArgsError(
                f"--speculative-eagle-topk {self.speculative_eagle_topk}: only a chain of "
                "drafts (1) is built; drop the flag or use 1"
            )
        if self.speculative_num_draft_tokens not in (None, k + 1):
            raise ServerArgsError(
                f"--speculative-num-draft-tokens {self.speculative_num_draft_tokens} must be "
                f"--speculative-num-steps + 1 = {k + 1} (one chain: the current token and "
                "its drafts)"
            )
        if model_config is not None and model_config.num_nextn_predict_layers < 1:
            raise ServerArgsError(
                f"--speculative-algorithm {self.speculative_algorithm} drafts with the "
                "checkpoint's MTP layer, and its config.json says num_nextn_predict_layers "
                "= 0; drop --speculative-algorithm"
            )

    def uses_prefix_cache(self) -> bool:
        """Whether a unified server keeps a radix prefix cache (the default)."""
        return self.disaggregation_mode == "null" and not self.disable_radix_cache

    def own_prefill_chunk(self) -> int | None:
        """Prompt tokens a unified engine's own prefill steps (`--disable-radix-cache`, or
        a DP mesh) feed at most a step: `--chunked-prefill-size` in whole pages; None for
        whole prompts, and where the engine's steps do not prefill or a speculative
        engine's admission program prefills a whole prompt."""
        if self.disaggregation_mode != "null" or self.uses_prefill_scheduler():
            return None
        if self.speculative_enabled():
            return None
        from cpkv_jax.cp_prefill import chunk_tokens  # the scheduler's rule: whole pages

        return chunk_tokens(self.chunked_prefill_size, self.page_size)

    def uses_prefill_scheduler(self) -> bool:
        """Whether a unified server prefills through the prefill scheduler on one device
        or a CP mesh (`CachedUnifiedEngine`); on a DP mesh the engine's own steps prefill,
        with a prefix cache per rank (`serving.decode.dp_prefix`) or whole prompts."""
        return self.uses_prefix_cache() and self.dp_size == 1

    def _hicache_unbuilt(self) -> list[str]:
        """Valid host-cache launch lines this server cannot run yet (SPEC S4): the host
        cache is built for prefill and null modes, without a storage tier."""
        if not self.enable_hierarchical_cache:
            return []
        out = []
        if self.disaggregation_mode == "decode":
            out.append(HICACHE_NOT_BUILT)
        if self.hicache_storage_backend != "none":
            out.append(HICACHE_STORAGE_NOT_BUILT)
        return out

    def _check_hicache(self, warnings: list[str]) -> None:
        """SPEC S3.3 / S4.4 startup matrix. Supported (prefill mode, any CP size, shared
        or replicated KV): every layout with `--hicache-io-backend direct`, the non-LPF
        layouts also with `kernel`; storage backend `none`. `file` is valid but not
        built (`_hicache_unbuilt`); LPF with a storage tier or non-direct I/O is refused."""
        if not (self.hicache_ratio > 0 and math.isfinite(self.hicache_ratio)):
            raise ServerArgsError(
                f"--hicache-ratio must be a finite number > 0, got {self.hicache_ratio:g}: "
                "the host pool is that many times the device KV pool (e.g. 2)"
            )
        if (
            self.enable_hierarchical_cache
            and self.hicache_size is not None
            and self.hicache_ratio != DEFAULT_HICACHE_RATIO
        ):
            warnings.append(
                f"--hicache-ratio {self.hicache_ratio:g} has no effect with --hicache-size "
                f"{format_byte_size(self.hicache_size)} (the size wins); drop one of them"
            )
        # SPEC S4.4: layer_page_first is host-only and direct-only, with no fallback.
        if self.hicache_mem_layout != "layer_page_first":
            return
        if self.hicache_storage_backend != "none":
            raise ServerArgsError(
                f"--hicache-mem-layout layer_page_first does not support --hicache-storage-backend "
                f"{self.hicache_storage_backend} (it is host-only, SPEC S4.4); use "
                "--hicache-storage-backend none or another --hicache-mem-layout"
            )
        if self.hicache_io_backend != "direct":
            raise ServerArgsError(
                f"--hicache-mem-layout layer_page_first needs --hicache-io-backend direct, got "
                f"{self.hicache_io_backend} (SPEC S4.4); use --hicache-io-backend direct"
            )

    def _check_requires(self) -> None:
        """A parameter of a feature that is off is an error naming the enabling flag."""
        enabling = {
            "bs_gt1_requested": "--enable-cp-shared-kv-prefill-bs-gt1",
            "cp_shared_kv_enabled": "--enable-cp-shared-kv",
            "hicache_enabled": "--enable-hierarchical-cache",
            "disaggregated": "--disaggregation-mode prefill|decode",
            "ep_enabled": "--ep-size N (N > 1), or --dp-size N (N > 1) on a decode server",
            "ep_all_to_all": "--ep-dispatch all_to_all (with expert parallelism)",
            "speculative_enabled": "--speculative-algorithm",
        }
        for f in dataclasses.fields(self):
            predicate = f.metadata["requires"]
            if predicate is None or getattr(self, f.name) == f.default:
                continue
            if not getattr(self, predicate)():
                raise ServerArgsError(
                    f"{flag_name(f.name)} has no effect without {enabling[predicate]}; add "
                    f"{enabling[predicate]} or drop {flag_name(f.name)}"
                )


# Library parameters that `ServerArgs` sets under another field's name; the rest match.
_PARAMETER_FIELDS = {
    "shared_kv": "enable_cp_shared_kv",
    "split_mode": "cp_split_mode",
    "attention": "cp_attention",
    "host_buffer_bytes": "transfer_host_buffer_size",
    "staging_bytes": "transfer_staging_size",
}


def as_flags(message: str) -> str:
    """Library errors name parameters in backticks (`cp_size`, as `cpkv_jax` and
    `transfer` know them); a server user typed flags, so say `--cp-size` instead."""
    flags = {f.name: flag_name(f.name) for f in dataclasses.fields(ServerArgs)}
    flags |= {param: flag_name(field) for param, field in _PARAMETER_FIELDS.items()}
    return name_flags(message, flags)


def max_running_requests(args: ServerArgs, usable_pages: int) -> tuple[int, str]:
    """(`--max-running-requests`, why): with `none`, as many requests as the pool holds
    at once, each at least the pages of the smallest request (a 1-token prompt and one
    new token)."""
    if args.max_running_requests is not None:
        return args.max_running_requests, "--max-running-requests"
    smallest = pages_for_tokens(2, args.page_size)
    return max(1, usable_pages // smallest), (
        f"--max-running-requests none: {usable_pages} usable KV pages / {smallest} page(s) "
        "of the smallest request (a 1-token prompt and 1 new token)"
    )
