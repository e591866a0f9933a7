"""Per-rank KV memory of CP prefill: page-owned (shared) pools vs the replicated baseline.

    python -m benchmarks.bench_memory [--json] [--cp-size 8] [--page-size 64]
        [--context-tokens 131072] [--budget-gib 64] [--config PATH]
        [--json-model-override-args '{"index_topk_freq": 4, "index_skip_topk_offset": 3}']
        [--dtype bfloat16] [--index-k-dtype fp8_e4m3] [--measured | --no-measured]
        [--weights | --no-weights] [--device-gb 141] [--mem-fraction-static 0.88]
        [--measured-weights-checkpoint DIR]

Figures at real model dimensions (GLM-5 by default, from `cpkv_jax/model_configs/glm-5`) are
computed from `jax.ShapeDtypeStruct`s, never allocated: every byte goes through
`kv_cache.pool_shapes` (via `kv_pool.per_rank_pool_bytes`), the function the device
pools are built from, so no per-token size is written down here.

Definitions (one request of `context_tokens` tokens, `n_pages = ceil(tokens / page_size)`):
- **shared per-rank pool**: `PoolLayout(shared=True)` with `ceil(n_pages / cp_size) + 1`
  pages per rank - the owner lane with the most pages (page `p` lives on rank
  `p mod cp_size`) plus that lane's trash page.
- **replicated per-rank pool**: `PoolLayout(shared=False)` with `n_pages + 1` pages on
  every rank (all pages + the trash page).
- `ratio` = shared / replicated per-rank pool bytes (SPEC S1.3: `1/cp_size` up to page
  rounding).
- **transient full view**: the materialized view of ONE layer, `n_pages * page_size *
  bytes_per_token` of that layer: its MLA latent, plus its index K and fp8 scale when it
  is a `full` indexer layer (both views can be live together: the latent gather depends
  only on the latent write, so XLA may schedule it next to the indexer); the max over
  layers. One layer is counted, not two: layer `l + 1`'s view is built from its own KV
  write, which needs layer `l`'s output, which consumes layer `l`'s view - so XLA has
  freed it before the next one exists. Both layouts materialize the same view (the
  replicated one by a local page gather), so it is added to both. Not counted (they
  belong to the S9 buffer estimator): the dequantized fp32 copy of index K, indexer
  logits, and the padding of the page-table width to the runner's power-of-two bucket
  (reported separately as `transient_full_view_bytes_bucketed`).
- **max_context_X**: the largest token count, a multiple of `page_size` (binary search
  over pages), for which X's per-rank persistent pool bytes + the transient full view
  bytes <= `--budget-gib` GiB. It is a memory bound only; compare with
  `max_position_embeddings`, which the JSON also reports. `max_context_ratio` = shared /
  replicated.

`--measured` (default on) adds a `"measured"` section from REAL pools of the tiny model
(`tiny_config_dict("glm_moe_dsa")`, float32, fp8 index K) on a `jax.device_count()`-rank
mesh (8 virtual CPU devices when run as `__main__` without a device-count flag): both
layouts holding the same logical pages are allocated with `init_cp_pool`, and the bytes
each device really holds (sum of `shard.data.nbytes` over `addressable_shards`) are
reported next to `per_rank_pool_bytes`'s prediction.

`--weights` (default on) adds a `"weights"` section: the weights one device holds for
GLM-5-FP8 and DeepSeek-V3.2-FP8 (the vendored `glm-5` / `deepseek-v3.2` configs, no
overrides; FP8 block 128x128 where the official checkpoints are FP8, `fp8_weight_names`;
bfloat16 params and compute) at EP 1, 8 and 16 over the cp axis, computed only through
the code the server sizes and places them with: `weights.abstract_model` (eval_shape, so
seconds and no allocation), `expert_parallel.param_shardings` on an `AbstractMesh` and
`expert_parallel.bytes_per_device`. Also per model:
- the bf16 figure (`fp8_block=None`) at EP 8, and the parameter counts (scales excluded);
- `bytes_by_dtype` at EP 1, what OUR model holds: FP8 weights, their float32
  `weight_scale_inv`, bf16 for the rest except norms and the router (`MoEGate`), which
  our model keeps float32 (the releases store norms and the router weight bf16);
- `dequant_transient_bytes_per_device`: the step dequantizes one layer's experts at a
  time, so the largest layer's local routed-expert weights in the compute dtype (3
  projections x local experts x out x in x 2 bytes). `..._layer_all_fp8` adds that
  layer's other FP8 weights (attention, indexer, shared expert), the upper bound
  `serving.prefill.memory_plan` budgets;
- `kv_tokens_per_rank_on_device`: on one `--device-gb` device (decimal GB; 141 = an H200)
  with `--mem-fraction-static` of it for weights + KV pool (SGLang's meaning), the CP
  shared KV pool (cp = `--cp-size`, EP = cp over the same devices, `--page-size`,
  `--dtype`, `--index-k-dtype`) left after the weights and the dequant transient: its
  usable pages (trash page excluded) in tokens per rank, sized through
  `per_rank_pool_bytes`, and the context one node holds (a page-owned pool holds 1/cp of
  each request's pages: tokens per rank x cp). `fits`: at least one usable page is left.
- `decode_dp_rank_on_device`: the same device as one rank of a data-parallel decode
  server (`--dp-size` = `--cp-size`, experts split over it): its own KV pool in tokens
  and the longest request it holds (a request's pages all live on one rank).
- `decode_cp_group_on_device`: the same devices as one CP decode group (issue 40,
  `cpkv_jax.cp_decode`): the page-owned pool above on each, so one request's pages stripe
  over all of them; the tokens one request can have (`single_request_pool_tokens`), the
  longest request (capped by `max_position_embeddings`) and both against a DP rank's;
  `bytes_per_row_step_by_context`: per decode row per step, the KV a rank reads and what
  it sends, on a DP rank and a CP rank (`cp_decode.decode_bytes_per_rank`).
`measured_weights` (with `--measured`): a tiny FP8 checkpoint (`make_tiny_checkpoint(...,
fp8=True, n_routed_experts=16)`, temp dir) loaded by `weights.load_model` on a
`jax.device_count()`-rank mesh with experts split over `"cp"`; the bytes each device's
addressable shards really hold, per leaf, beside `bytes_per_device` of the abstract state
`abstract_model(cfg, fp8_block=cfg.weight_block_size)` under `param_shardings`
(`--measured-weights-checkpoint DIR` loads that checkpoint instead of writing one).

JSON goes to stdout (one object with `--json`, `key: value` lines otherwise); progress is
logged to stderr.
"""

from __future__ import annotations

import os

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    # Must precede the first jax import: the measured section wants an 8-rank CPU mesh.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import math
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh
from jax.typing import DTypeLike

from cpkv_jax.buckets import pow2_at_least
from cpkv_jax.cli_logging import configure_logging
from cpkv_jax.config import CPConfig, ModelConfig, parse_override_args
from cpkv_jax.cp_decode import decode_bytes_per_rank
from cpkv_jax.errors import ConfigError, CpkvError, name_flags
from cpkv_jax.kv_layout import KVLayout
from cpkv_jax.kv_pool import PoolLayout, init_cp_pool, per_rank_pool_bytes
from cpkv_jax.mesh import CP_AXIS, make_cp_mesh
from cpkv_jax.model.expert_parallel import (
    bytes_per_device,
    check_divisible,
    is_expert_leaf,
    param_shardings,
)
from cpkv_jax.model.fp8 import DEFAULT_BLOCK, SCALE_SUFFIX
from cpkv_jax.model.kv_cache import DTYPES, INDEX_K_DTYPES, IndexKDtype, KVPool
from cpkv_jax.model.weights import abstract_model, load_model
from cpkv_jax.model_configs import CONFIGS_DIR, config_dir
from cpkv_jax.paging import pages_for_tokens
from cpkv_jax.tools.make_tiny_checkpoint import make_tiny_checkpoint
from cpkv_jax.tools.tiny_config import tiny_config_dict
from cpkv_jax.units import GiB
from serving.prefill.memory_plan import decode_step_bytes_per_device
from serving.server_args import ServerArgs

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = config_dir("glm-5")
# The weights section's models: release name -> vendored config (FP8 releases, 128x128).
WEIGHT_MODELS = {"GLM-5-FP8": "glm-5", "DeepSeek-V3.2-FP8": "deepseek-v3.2"}
WEIGHT_EP_SIZES = (1, 8, 16)
WEIGHT_DTYPE = "bfloat16"  # param and compute dtype of the served real models
BF16_EP = 8  # the bf16 (no FP8) comparison's EP size
MEASURED_EXPERTS = 16  # tiny checkpoint's routed experts (2 per rank on 8 ranks)
GB = 10**9


@dataclasses.dataclass(frozen=True)
class MemoryBenchArgs:
    """Every flag of the benchmark, its default and help; argparse is built from this."""

    # Each field: its default, and argparse's help (+ type/choices) in `metadata`.
    cp_size: int = field(default=8, metadata={"help": "CP ranks the model figures are for"})
    page_size: int = field(default=64, metadata={"help": "tokens per KV page"})
    context_tokens: int = field(
        default=131072, metadata={"help": "tokens of the one request sized (ratio, full view)"}
    )
    budget_gib: float = field(
        default=64.0, metadata={"help": "per-rank KV byte budget, GiB, for max_context_*"}
    )
    config: Path | None = field(
        default=None,
        metadata={
            "help": f"HF config.json or its directory (default: {DEFAULT_CONFIG})",
            "type": Path,
        },
    )
    json_model_override_args: str = field(
        default="",
        metadata={"help": "JSON merged into config.json, e.g. an index top-k sharing schedule"},
    )
    dtype: str = field(
        default="bfloat16", metadata={"help": "MLA latent pool dtype", "choices": sorted(DTYPES)}
    )
    index_k_dtype: str = field(
        default="fp8_e4m3",
        metadata={"help": "index-K pool dtype", "choices": sorted(INDEX_K_DTYPES)},
    )
    json: bool = field(default=False, metadata={"help": "print one JSON object on stdout"})
    measured: bool = field(
        default=True, metadata={"help": "also allocate real tiny-model pools on the device mesh"}
    )
    measured_tokens: int = field(
        default=16384, metadata={"help": "tokens (logical pages) of the measured tiny pools"}
    )
    measured_weights_checkpoint: Path | None = field(
        default=None,
        metadata={
            "help": "tiny FP8 checkpoint dir for measured_weights (default: one written to a "
            "temp dir by make_tiny_checkpoint(fp8=True, n_routed_experts=16))",
            "type": Path,
        },
    )
    weights: bool = field(
        default=True,
        metadata={"help": "also size GLM-5-FP8 / DeepSeek-V3.2-FP8 weights per device (EP)"},
    )
    device_gb: float = field(
        default=141.0,
        metadata={"help": "device memory, decimal GB (1e9 B), for kv_tokens_per_rank (H200)"},
    )
    mem_fraction_static: float = field(
        default=0.88,
        metadata={"help": "fraction of --device-gb for weights + KV pool (as SGLang's)"},
    )
    decode_running_requests: int = field(
        default=512,
        metadata={
            "help": "--max-running-requests of the DP decode server sized (the whole server's; "
            "its decode step's transient grows with the rows per rank)"
        },
    )
    log_level: str = field(default="INFO", metadata={"help": "logging level (stderr)"})

    def validate(self) -> None:
        """Fail fast on values no figure can be computed for."""
        CPConfig(cp_size=self.cp_size, page_size=self.page_size).validate()
        for name in ("context_tokens", "measured_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if not self.budget_gib > 0:
            raise ConfigError(f"--budget-gib must be > 0, got {self.budget_gib}")
        if not self.device_gb > 0:
            raise ConfigError(f"--device-gb must be > 0, got {self.device_gb}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ConfigError(
                f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}"
            )
        ckpt = self.measured_weights_checkpoint
        if ckpt is not None and not (ckpt / "config.json").is_file():
            raise ConfigError(
                f"--measured-weights-checkpoint {ckpt} has no config.json (write one with "
                "`python -m cpkv_jax.tools.make_tiny_checkpoint DIR --fp8 "
                f"--n-routed-experts {MEASURED_EXPERTS}`)"
            )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_memory",
        description="Per-rank KV pool bytes, shared vs replicated (see the module docstring).",
    )
    for f in dataclasses.fields(MemoryBenchArgs):
        kwargs = dict(f.metadata)
        if isinstance(f.default, bool):
            action = "store_true" if f.default is False else argparse.BooleanOptionalAction
            ap.add_argument(
                f"--{f.name.replace('_', '-')}", action=action, default=f.default, **kwargs
            )
            continue
        kwargs.setdefault("type", type(f.default))
        ap.add_argument(f"--{f.name.replace('_', '-')}", default=f.default, **kwargs)
    return ap


def parse_args(argv: Sequence[str] | None = None) -> MemoryBenchArgs:
    return MemoryBenchArgs(**vars(build_parser().parse_args(argv)))


def load_config(path: Path | None, json_model_override_args: str = "") -> ModelConfig:
    """The model config at `path` (a config.json or its directory), overrides merged."""
    path = DEFAULT_CONFIG if path is None else path
    if path.is_dir():
        return ModelConfig.from_pretrained(path, json_model_override_args)
    if not path.is_file():
        raise ConfigError(
            f"no model config at {path}: pass --config PATH (a config.json or its directory; "
            f"the real models' configs are in {CONFIGS_DIR})"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    return ModelConfig.from_dict(raw, json_model_override_args)


# ---- model maths (ShapeDtypeStructs only, nothing allocated) --------------------------
def layouts_for(n_pages: int, cp_size: int, page_size: int) -> tuple[PoolLayout, PoolLayout]:
    """(shared, replicated) layouts holding one request of `n_pages` logical pages."""
    shared = PoolLayout(cp_size, True, -(-n_pages // cp_size) + 1, page_size)
    replicated = PoolLayout(cp_size, False, n_pages + 1, page_size)
    return shared, replicated


def full_view_bytes(
    cfg: ModelConfig,
    n_pages: int,
    page_size: int,
    dtype: DTypeLike,
    index_k_dtype: IndexKDtype,
) -> int:
    """Bytes of the largest one-layer full view of `n_pages` pages (see module docstring)."""
    kv = KVLayout.from_model(cfg, page_size, dtype, index_k_dtype)
    return max(
        sum(kv.page_bytes(kind, layer) for kind in kv.kinds_at(layer)) * n_pages
        for layer in range(kv.num_layers)
    )


def per_token_bytes(
    cfg: ModelConfig, dtype: DTypeLike, index_k_dtype: IndexKDtype
) -> dict[str, int]:
    """Bytes per token of one layer's latent and of one full layer's index K (+ scale)."""
    kv = KVLayout.from_model(cfg, 1, dtype, index_k_dtype)
    index = [b.token_bytes for b in kv.buffers if b.kind != "latent"]
    return {
        "latent_bytes_per_token_layer": kv.by_kind()["latent"].token_bytes,
        "index_k_bytes_per_token_full_layer": sum(index),
    }


def footprint_bytes(
    cfg: ModelConfig,
    n_pages: int,
    cp_size: int,
    page_size: int,
    dtype: DTypeLike,
    index_k_dtype: IndexKDtype,
    *,
    shared: bool,
) -> int:
    """Per-rank persistent pool bytes + transient full view bytes for `n_pages` pages."""
    layout = layouts_for(n_pages, cp_size, page_size)[0 if shared else 1]
    persistent = per_rank_pool_bytes(cfg, layout, dtype, index_k_dtype)
    return persistent + full_view_bytes(cfg, n_pages, page_size, dtype, index_k_dtype)


def max_context_tokens(budget_bytes: int, page_size: int, footprint: Callable[[int], int]) -> int:
    """Longest request (whole pages) whose per-rank `footprint(n_pages)` bytes fit
    `budget_bytes`; 0 if none (footprints grow with the page count)."""

    def fits(n_pages: int) -> bool:
        return footprint(n_pages) <= budget_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2  # fits(lo) holds; grow hi until it does not
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * page_size


def model_report(cfg: ModelConfig, args: MemoryBenchArgs) -> dict[str, Any]:
    """Predicted figures at `cfg`'s dimensions (nothing allocated)."""
    cp, page = args.cp_size, args.page_size
    dtype = DTYPES[args.dtype]
    ikd: IndexKDtype = args.index_k_dtype  # type: ignore[assignment]
    CPConfig(cp_size=cp, shared_kv=cp > 1, page_size=page).validate(cfg)
    n_pages = pages_for_tokens(args.context_tokens, page)
    shared, replicated = layouts_for(n_pages, cp, page)
    shared_bytes = per_rank_pool_bytes(cfg, shared, dtype, ikd)
    replicated_bytes = per_rank_pool_bytes(cfg, replicated, dtype, ikd)
    # The CP runner pads the page-table width to cp * pow2(pages per rank) (cp_prefill).
    width = cp * pow2_at_least(-(-n_pages // cp))
    budget = int(args.budget_gib * GiB)
    logger.info("max context search: %.1f GiB per rank, cp %d", args.budget_gib, cp)
    max_shared, max_replicated = (
        max_context_tokens(
            budget, page, lambda n, s=owned: footprint_bytes(cfg, n, cp, page, dtype, ikd, shared=s)
        )
        for owned in (True, False)
    )
    return {
        "model_type": cfg.model_type,
        "num_layers": cfg.num_hidden_layers,
        "full_indexer_layers": len(cfg.full_indexer_layers),
        "dtype": args.dtype,
        "index_k_dtype": args.index_k_dtype,
        **per_token_bytes(cfg, dtype, ikd),
        "cp_size": cp,
        "page_size": page,
        "context_tokens": args.context_tokens,
        "context_pages": n_pages,
        "pages_per_rank_shared": shared.pages_per_rank,
        "pages_per_rank_replicated": replicated.pages_per_rank,
        "per_rank_pool_bytes_shared": shared_bytes,
        "per_rank_pool_bytes_replicated": replicated_bytes,
        "ratio": shared_bytes / replicated_bytes,
        "transient_full_view_bytes": full_view_bytes(cfg, n_pages, page, dtype, ikd),
        "transient_full_view_bytes_bucketed": full_view_bytes(cfg, width, page, dtype, ikd),
        "transient_live_layers": 1,
        "budget_gib": args.budget_gib,
        "budget_bytes": budget,
        "max_context_shared": max_shared,
        "max_context_replicated": max_replicated,
        "max_context_ratio": max_shared / max_replicated if max_replicated else None,
        "max_position_embeddings": cfg.max_position_embeddings,
    }


# ---- real pools on the device mesh ----------------------------------------------------
def _bytes_per_device(pool: KVPool) -> dict[jax.Device, int]:
    held: dict[jax.Device, int] = {}
    for leaf in jax.tree_util.tree_leaves(pool):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def measure_tiny_pools(page_size: int, tokens: int) -> dict[str, Any]:
    """Allocate both layouts of the tiny model's pools for `tokens` tokens; bytes per device."""
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    dtype, ikd = jnp.float32, "fp8_e4m3"
    cp = jax.device_count()
    mesh = make_cp_mesh(cp)
    n_pages = pages_for_tokens(tokens, page_size)
    out: dict[str, Any] = {
        "measured": True,
        "model": "tiny glm_moe_dsa",
        "platform": jax.devices()[0].platform,
        "dtype": "float32",
        "index_k_dtype": ikd,
        "cp_size": cp,
        "page_size": page_size,
        "context_tokens": tokens,
        "context_pages": n_pages,
    }
    for name, layout in zip(
        ("shared", "replicated"), layouts_for(n_pages, cp, page_size), strict=True
    ):
        logger.info("allocating the %s tiny pool: %d pages per rank", name, layout.pages_per_rank)
        pool = jax.block_until_ready(init_cp_pool(cfg, layout, mesh, dtype, ikd))
        held = _bytes_per_device(pool)
        # This process's ranks (all of them on one host).
        per_device = [
            held[d] for d in mesh.devices.reshape(-1) if d.process_index == jax.process_index()
        ]
        del pool
        out[f"pages_per_rank_{name}"] = layout.pages_per_rank
        out[f"per_device_pool_bytes_{name}"] = per_device
        out[f"per_rank_pool_bytes_{name}"] = max(per_device)
        out[f"predicted_per_rank_pool_bytes_{name}"] = per_rank_pool_bytes(cfg, layout, dtype, ikd)
    out["ratio"] = out["per_rank_pool_bytes_shared"] / out["per_rank_pool_bytes_replicated"]
    out["predicted_ratio"] = (
        out["predicted_per_rank_pool_bytes_shared"]
        / out["predicted_per_rank_pool_bytes_replicated"]
    )
    out["measured_equals_predicted"] = all(
        b == out[f"predicted_per_rank_pool_bytes_{name}"]
        for name in ("shared", "replicated")
        for b in out[f"per_device_pool_bytes_{name}"]
    )
    return out


# ---- weights per device (abstract: the server's sizing and placement code) -------------
def _value(x: Any) -> Any:
    return x.get_value() if hasattr(x, "get_value") else x


def _flat(state: nnx.State) -> list[tuple[tuple, Any]]:
    return [(path, _value(var)) for path, var in nnx.to_flat_state(state)]


@functools.cache
def real_abstract_state(
    config: Path, fp8_block: tuple[int, int] | None
) -> tuple[ModelConfig, nnx.State]:
    """`nnx.state(abstract_model(cfg, bf16, bf16, fp8_block=...))` of a config dir (cached:
    the sections and tests reuse it)."""
    cfg = ModelConfig.from_pretrained(config)
    dt = DTYPES[WEIGHT_DTYPE]
    logger.info("abstract %s model (eval_shape), fp8 block %s", config.name, fp8_block)
    model = abstract_model(cfg, dt, dt, fp8_block=fp8_block)
    return cfg, nnx.state(model)


def ep_shardings(state: nnx.State, ep: int) -> nnx.State:
    """What the server places `state` with at EP `ep` over the cp axis (1: no EP)."""
    return param_shardings(state, AbstractMesh((ep,), (CP_AXIS,)), CP_AXIS if ep > 1 else None)


def param_counts(state: nnx.State) -> dict[str, int]:
    """Parameters (FP8 scales not counted) and the routed experts' share of them."""
    total = routed = 0
    for path, value in _flat(state):
        if str(path[-1]).endswith(SCALE_SUFFIX):
            continue
        n = math.prod(value.shape)
        total += n
        routed += n if is_expert_leaf(path) else 0
    return {"params": total, "routed_expert_params": routed}


def bytes_by_dtype(state: nnx.State) -> dict[str, int]:
    """Bytes of the whole model (no sharding) by leaf dtype; FP8 scales on their own."""
    out: dict[str, int] = {}
    for path, value in _flat(state):
        dt = np.dtype(value.dtype)
        key = f"{dt.name}_scale_inv" if str(path[-1]).endswith(SCALE_SUFFIX) else dt.name
        out[key] = out.get(key, 0) + math.prod(value.shape) * dt.itemsize
    return dict(sorted(out.items()))


def dequant_transient_bytes(
    state: nnx.State, shardings: nnx.State, dtype: DTypeLike, *, experts_only: bool = True
) -> int:
    """The largest decoder layer's FP8 weights on one device (shard shapes), dequantized to
    `dtype`: its routed experts' 3 projections (`experts_only`), or every FP8 weight of
    the layer. 0 for a model without FP8 weights."""
    itemsize = np.dtype(dtype).itemsize
    flat_sh = {path: _value(sh) for path, sh in nnx.to_flat_state(shardings)}
    per_layer: dict[int, int] = {}
    for path, value in _flat(state):
        if path[:2] != ("model", "layers") or not np.dtype(value.dtype).name.startswith("float8"):
            continue
        if experts_only and not is_expert_leaf(path):
            continue
        shard = flat_sh[path].shard_shape(tuple(value.shape))
        per_layer[int(path[2])] = per_layer.get(int(path[2]), 0) + math.prod(shard) * itemsize
    return max(per_layer.values(), default=0)


def ep_figures(state: nnx.State, ep: int) -> dict[str, Any]:
    """Weights and dequant transient one device holds at EP `ep`."""
    shardings = ep_shardings(state, ep)
    dt = DTYPES[WEIGHT_DTYPE]
    return {
        "weights_bytes_per_device": bytes_per_device(state, shardings),
        "dequant_transient_bytes_per_device": dequant_transient_bytes(state, shardings, dt),
        "dequant_transient_bytes_per_device_layer_all_fp8": dequant_transient_bytes(
            state, shardings, dt, experts_only=False
        ),
    }


def kv_budget_on_device(
    weights_bytes: int, dequant_bytes: int, args: MemoryBenchArgs
) -> tuple[int, int, int]:
    """(device bytes, the static fraction of them, what is left of it for the KV pool
    after the weights and the dequant transient) on one `--device-gb` device."""
    device_bytes = int(args.device_gb * GB)
    static = int(device_bytes * args.mem_fraction_static)
    return device_bytes, static, static - weights_bytes - dequant_bytes


def kv_on_device(
    cfg: ModelConfig, weights_bytes: int, dequant_bytes: int, args: MemoryBenchArgs
) -> dict[str, Any]:
    """The CP shared KV pool one `--device-gb` device has room for after the weights."""
    cp, page = args.cp_size, args.page_size
    dtype = DTYPES[args.dtype]
    ikd: IndexKDtype = args.index_k_dtype  # type: ignore[assignment]
    device_bytes, static, kv_budget = kv_budget_on_device(weights_bytes, dequant_bytes, args)

    def pool_bytes(usable_pages: int) -> int:  # + the lane's trash page
        return per_rank_pool_bytes(cfg, PoolLayout(cp, True, usable_pages + 1, page), dtype, ikd)

    tokens = max_context_tokens(kv_budget, page, pool_bytes)
    node_tokens = tokens * cp
    view = full_view_bytes(cfg, node_tokens // page, page, dtype, ikd) if tokens else 0
    return {
        "cp_size": cp,
        "ep_size": cp,
        "shared_kv": True,
        "page_size": page,
        "dtype": args.dtype,
        "index_k_dtype": args.index_k_dtype,
        "device_bytes": device_bytes,
        "mem_fraction_static": args.mem_fraction_static,
        "static_bytes": static,
        "weights_bytes": weights_bytes,
        "dequant_transient_bytes": dequant_bytes,
        "kv_budget_bytes": kv_budget,
        "pool_bytes_per_rank": pool_bytes(tokens // page) if tokens else 0,
        "tokens_per_rank": tokens,
        "context_tokens_per_node": node_tokens,
        "max_position_embeddings": cfg.max_position_embeddings,
        "holds_max_position_embeddings": node_tokens >= cfg.max_position_embeddings,
        # One layer's full view of a node-length request; must fit the 1 - fraction left.
        "transient_full_view_bytes_at_node_context": view,
        "headroom_bytes": device_bytes - static,
        "fits": tokens > 0,
    }


def decode_rank_kv_on_device(
    cfg: ModelConfig,
    weights_bytes: int,
    dequant_bytes: int,
    args: MemoryBenchArgs,
    config: Path,
) -> dict[str, Any]:
    """One rank of a data-parallel decode server (`--dp-size` = `--cp-size` devices,
    routed experts split over them, issue 36) on one `--device-gb` device: its own
    (non-CP) KV pool after the weights, and the longest request it can hold (a request's
    pages all live on its rank). Sized through `per_rank_pool_bytes`, as the server's
    pool is, beside the transient buffers of the largest decode step the server can then
    dispatch with `--decode-running-requests` (the server's memory plan's own term,
    `memory_plan.decode_step_bytes_per_device`, XLA:GPU profile)."""
    page = args.page_size
    dtype = DTYPES[args.dtype]
    ikd: IndexKDtype = args.index_k_dtype  # type: ignore[assignment]
    _, _, kv_budget = kv_budget_on_device(weights_bytes, dequant_bytes, args)
    server = ServerArgs(  # the decode server sized (`config`: its model directory)
        model_path=str(config),
        disaggregation_mode="decode",
        dp_size=args.cp_size,
        page_size=page,
        dtype=args.dtype,
        index_k_dtype=ikd,
        max_running_requests=args.decode_running_requests,
    )

    def pool_bytes(usable_pages: int) -> int:  # + the rank's trash page
        return per_rank_pool_bytes(cfg, PoolLayout(1, False, usable_pages + 1, page), dtype, ikd)

    def step_bytes(usable_pages: int) -> tuple[int, str]:
        return decode_step_bytes_per_device(server, cfg, "gpu", usable_pages + 1)

    tokens = max_context_tokens(kv_budget, page, lambda n: pool_bytes(n) + step_bytes(n)[0])
    step, step_source = step_bytes(tokens // page) if tokens else (0, "")
    pool_only = max_context_tokens(kv_budget, page, pool_bytes)
    return {
        "dp_size": args.cp_size,
        "ep_size": args.cp_size,
        "page_size": page,
        "dtype": args.dtype,
        "index_k_dtype": args.index_k_dtype,
        "weights_bytes": weights_bytes,
        "dequant_transient_bytes": dequant_bytes,
        "kv_budget_bytes": kv_budget,
        "max_running_requests": args.decode_running_requests,
        "decode_step_bytes": step,
        "decode_step": step_source,
        "kv_tokens_per_rank": tokens,
        "kv_tokens_per_server": tokens * args.cp_size,
        "longest_request_tokens": min(tokens, cfg.max_position_embeddings),
        # The pool alone in the same budget: what a CP group (whose decode step is not
        # estimated) is compared with.
        "kv_tokens_per_rank_pool_only": pool_only,
        "longest_request_tokens_pool_only": min(pool_only, cfg.max_position_embeddings),
        "fits": tokens > 0,
    }


def decode_cp_group_on_device(
    cfg: ModelConfig, cp_kv: dict[str, Any], dp_rank: dict[str, Any]
) -> dict[str, Any]:
    """A CP decode group over `--cp-size` devices (issue 40, `cpkv_jax.cp_decode`): the
    same page-owned pool per device as the CP prefill's (`kv_tokens_per_rank_on_device`),
    so one request's pages stripe over every rank of the group (page `p` on rank
    `p mod cp`), against one data-parallel decode rank, which holds a request whole. Both
    sides count the pool alone (the CP group's owner-attention step is not estimated)."""
    pool_tokens = cp_kv["tokens_per_rank"] * cp_kv["cp_size"]
    longest = min(pool_tokens, cfg.max_position_embeddings)
    dp_longest = dp_rank["longest_request_tokens_pool_only"]
    kw = dict(page_size=cp_kv["page_size"], dtype=cp_kv["dtype"])
    kw["index_k_dtype"] = cp_kv["index_k_dtype"]
    traffic = {
        str(n): {
            "dp_rank": decode_bytes_per_rank(cfg, n, 1, **kw),
            "cp_rank": decode_bytes_per_rank(cfg, n, cp_kv["cp_size"], **kw),
        }
        for n in sorted({8192, 32768, 131072, longest})
        if n <= longest
    }
    return {
        "cp_size": cp_kv["cp_size"],
        "kv_tokens_per_rank": cp_kv["tokens_per_rank"],
        "single_request_pool_tokens": pool_tokens,
        "longest_request_tokens": longest,
        "max_position_embeddings": cfg.max_position_embeddings,
        "pool_over_dp_rank": pool_tokens / dp_rank["kv_tokens_per_rank_pool_only"]
        if dp_rank["kv_tokens_per_rank_pool_only"]
        else None,
        "longest_over_dp_rank": longest / dp_longest if dp_longest else None,
        # Per decode row per step, every layer (`cpkv_jax.cp_decode.decode_bytes_per_rank`).
        "bytes_per_row_step_by_context": traffic,
    }


def weights_model_report(name: str, args: MemoryBenchArgs) -> dict[str, Any]:
    """One model's weights per device at each EP size, FP8 and (EP 8) bf16."""
    config = config_dir(WEIGHT_MODELS[name])
    cfg, fp8 = real_abstract_state(config, DEFAULT_BLOCK)
    _, bf16 = real_abstract_state(config, None)
    for ep in (*WEIGHT_EP_SIZES, args.cp_size):
        check_divisible(cfg.n_routed_experts, ep)
    per_ep = {str(ep): ep_figures(fp8, ep) for ep in WEIGHT_EP_SIZES}
    at_cp = ep_figures(fp8, args.cp_size)
    weights = at_cp["weights_bytes_per_device"]["total"]
    dequant = at_cp["dequant_transient_bytes_per_device"]
    cp_kv = kv_on_device(cfg, weights, dequant, args)
    dp_rank = decode_rank_kv_on_device(cfg, weights, dequant, args, config)
    return {
        "config": str(config.relative_to(CONFIGS_DIR.parents[1])),
        "model_type": cfg.model_type,
        "num_layers": cfg.num_hidden_layers,
        "n_routed_experts": cfg.n_routed_experts,
        **param_counts(fp8),
        "bytes_by_dtype": bytes_by_dtype(fp8),
        "ep": per_ep,
        "bf16_ep": BF16_EP,
        "bf16_weights_bytes_per_device": bytes_per_device(bf16, ep_shardings(bf16, BF16_EP)),
        "kv_tokens_per_rank_on_device": cp_kv,
        "decode_dp_rank_on_device": dp_rank,
        "decode_cp_group_on_device": decode_cp_group_on_device(cfg, cp_kv, dp_rank),
    }


def weights_report(args: MemoryBenchArgs) -> dict[str, Any]:
    """The `"weights"` section (module docstring)."""
    return {
        "fp8_block": list(DEFAULT_BLOCK),
        "param_dtype": WEIGHT_DTYPE,
        "compute_dtype": WEIGHT_DTYPE,
        "ep_sizes": list(WEIGHT_EP_SIZES),
        "device_gb": args.device_gb,
        "mem_fraction_static": args.mem_fraction_static,
        "models": {name: weights_model_report(name, args) for name in WEIGHT_MODELS},
    }


def measure_tiny_weights(checkpoint: Path | None = None) -> dict[str, Any]:
    """Load a tiny FP8 checkpoint (`checkpoint`, else one written to a temp dir) with
    experts split over every device; the bytes each device's shards hold, per leaf,
    against `bytes_per_device`'s prediction."""
    ep = jax.device_count()
    with contextlib.ExitStack() as stack:
        if checkpoint is None:
            checkpoint = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bm_fp8_")))
            make_tiny_checkpoint(
                checkpoint, "glm_moe_dsa", fp8=True, n_routed_experts=MEASURED_EXPERTS
            )
        check_divisible(ModelConfig.from_pretrained(checkpoint).n_routed_experts, ep)
        mesh = make_cp_mesh(ep)
        logger.info("loading %s with experts over %d ranks", checkpoint, ep)
        cfg, model = load_model(checkpoint, mesh=mesh, expert_axis=CP_AXIS, progress=False)
    abstract = nnx.state(
        abstract_model(cfg, jnp.float32, jnp.float32, fp8_block=cfg.weight_block_size)
    )
    shardings = param_shardings(abstract, mesh, CP_AXIS)
    predicted = bytes_per_device(abstract, shardings)
    flat_sh = {path: _value(sh) for path, sh in nnx.to_flat_state(shardings)}
    expected = {
        path: math.prod(flat_sh[path].shard_shape(tuple(v.shape))) * np.dtype(v.dtype).itemsize
        for path, v in _flat(abstract)
    }
    devices = [d for d in mesh.devices.reshape(-1) if d.process_index == jax.process_index()]
    held = {d: {"routed_experts": 0, "other": 0} for d in devices}
    mismatched: list[str] = []
    loaded = _flat(nnx.state(model))
    total_routed = 0
    for path, arr in loaded:
        kind = "routed_experts" if is_expert_leaf(path) else "other"
        total_routed += arr.nbytes if kind == "routed_experts" else 0
        leaf: dict[jax.Device, int] = dict.fromkeys(devices, 0)
        for shard in arr.addressable_shards:
            leaf[shard.device] += shard.data.nbytes
        for d, n in leaf.items():
            held[d][kind] += n
        if any(n != expected.get(path) for n in leaf.values()):
            mismatched.append(".".join(map(str, path)))
    missing = sorted(".".join(map(str, p)) for p in expected.keys() - {p for p, _ in loaded})
    per_device = {kind: [held[d][kind] for d in devices] for kind in ("routed_experts", "other")}
    per_device["total"] = [r + o for r, o in zip(*per_device.values(), strict=True)]
    return {
        "measured": True,
        "model": f"tiny glm_moe_dsa, FP8 block {list(cfg.weight_block_size or ())}",
        "platform": jax.devices()[0].platform,
        "param_dtype": "float32",
        "n_routed_experts": cfg.n_routed_experts,
        "ep_size": ep,
        "leaves": len(loaded),
        "leaves_mismatched": mismatched[:10],
        "leaves_missing": missing[:10],
        "total_routed_expert_bytes": total_routed,
        "per_device_weights_bytes": per_device,
        "predicted_weights_bytes_per_device": predicted,
        "measured_equals_predicted": not mismatched
        and not missing
        and all(b == predicted[kind] for kind, col in per_device.items() for b in col),
    }


def run(args: MemoryBenchArgs) -> dict[str, Any]:
    """The whole report: model figures, the measured pools, the weights, the measured
    weights (`--no-measured` / `--no-weights` leave sections out: None)."""
    args.validate()
    cfg = load_config(args.config, args.json_model_override_args)
    logger.info("model figures for %s (%d layers)", cfg.model_type, cfg.num_hidden_layers)
    report = model_report(cfg, args)
    report["config"] = str(DEFAULT_CONFIG if args.config is None else args.config)
    report["model_overrides"] = parse_override_args(args.json_model_override_args)
    report["measured"] = (
        measure_tiny_pools(args.page_size, args.measured_tokens) if args.measured else None
    )
    report["weights"] = weights_report(args) if args.weights else None
    report["measured_weights"] = (
        measure_tiny_weights(args.measured_weights_checkpoint)
        if args.weights and args.measured
        else None
    )
    return report


_BYTE_KEYS = ("_bytes", "_bytes_shared", "_bytes_replicated", "_bytes_bucketed")


def _human_bytes(n: int) -> str:
    return f"{n / GiB:.3f} GiB" if n >= GiB else f"{n / (1 << 20):.3f} MiB"


def _text(report: dict[str, Any], indent: str = "") -> str:
    """`key: value` lines (nested sections indented); byte counts also in MiB/GiB."""
    lines = []
    for key, value in report.items():
        if isinstance(value, dict) and value:
            lines.append(f"{indent}{key}:")
            lines.append(_text(value, indent + "  "))
        elif value is None:
            lines.append(f"{indent}{key}: -")
        elif isinstance(value, int) and not isinstance(value, bool) and key.endswith(_BYTE_KEYS):
            lines.append(f"{indent}{key}: {value} ({_human_bytes(value)})")
        else:
            lines.append(f"{indent}{key}: {value}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        configure_logging(args.log_level)
        report = run(args)
    except CpkvError as e:
        flags = {
            f.name: "--" + f.name.replace("_", "-") for f in dataclasses.fields(MemoryBenchArgs)
        }
        print(f"error: {name_flags(str(e), flags)}", file=sys.stderr)
        return 2
    print(json.dumps(report) if args.json else _text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
