"""Per-rank KV memory of CP prefill: page-owned (shared) pools vs the replicated baseline.

    python -m benchmarks.bench_memory [--json] [--cp-size 8] [--page-size 64]
        [--context-tokens 131072] [--budget-gib 64] [--config PATH]
        [--json-model-override-args '{"index_topk_freq": 4, "index_skip_topk_offset": 3}']
        [--dtype bfloat16] [--index-k-dtype fp8_e4m3] [--measured | --no-measured]

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
import dataclasses
import json
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from cpkv_jax.buckets import pow2_at_least
from cpkv_jax.cli_logging import configure_logging
from cpkv_jax.config import CPConfig, ModelConfig, parse_override_args
from cpkv_jax.errors import ConfigError, CpkvError, name_flags
from cpkv_jax.kv_pool import PoolLayout, init_cp_pool, per_rank_pool_bytes
from cpkv_jax.mesh import make_cp_mesh
from cpkv_jax.model.kv_cache import DTYPES, INDEX_K_DTYPES, IndexKDtype, KVPool, pool_shapes
from cpkv_jax.model_configs import CONFIGS_DIR, config_dir
from cpkv_jax.paging import pages_for_tokens
from cpkv_jax.tools.tiny_config import tiny_config_dict
from cpkv_jax.units import GiB

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = config_dir("glm-5")


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
    shapes = pool_shapes(cfg, n_pages, page_size, dtype, index_k_dtype)
    slot = {layer: j for j, layer in enumerate(cfg.full_indexer_layers)}
    per_layer = []
    for layer, latent in enumerate(shapes.latent):
        j = slot.get(layer)
        one = KVPool(
            (latent,),
            () if j is None else (shapes.index_k[j],),
            () if j is None or not shapes.index_scale else (shapes.index_scale[j],),
        )
        per_layer.append(one.nbytes())
    return max(per_layer)


def per_token_bytes(
    cfg: ModelConfig, dtype: DTypeLike, index_k_dtype: IndexKDtype
) -> dict[str, int]:
    """Bytes per token of one layer's latent and of one full layer's index K (+ scale)."""
    one = pool_shapes(cfg, 1, 1, dtype, index_k_dtype)
    index = KVPool((), one.index_k[:1], one.index_scale[:1]).nbytes()
    return {
        "latent_bytes_per_token_layer": KVPool(one.latent[:1], (), ()).nbytes(),
        "index_k_bytes_per_token_full_layer": index,
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


def run(args: MemoryBenchArgs) -> dict[str, Any]:
    """The whole report: model figures, then (unless `--no-measured`) the measured section."""
    args.validate()
    cfg = load_config(args.config, args.json_model_override_args)
    logger.info("model figures for %s (%d layers)", cfg.model_type, cfg.num_hidden_layers)
    report = model_report(cfg, args)
    report["config"] = str(DEFAULT_CONFIG if args.config is None else args.config)
    report["model_overrides"] = parse_override_args(args.json_model_override_args)
    report["measured"] = (
        measure_tiny_pools(args.page_size, args.measured_tokens) if args.measured else None
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
