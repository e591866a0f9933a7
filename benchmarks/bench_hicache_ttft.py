"""TTFT of a repeated long prompt: served from the host (L2) cache vs recomputed.

    python -m benchmarks.bench_hicache_ttft [--lengths 512 2048] [--cp 8] [--page-size 16]
                                            [--layout page_first] [--repeats 5] [--json PATH]
                                            [--dp 2]

The real prefill path of a `cpkv-serve --disaggregation-mode prefill
--enable-hierarchical-cache` server, without HTTP: a `PrefillScheduler` over a
`CPPrefillRunner` (CP shared KV on a `("cp",)` mesh of `--cp` devices, the tiny GLM-5
model), a `HiRadixCache` (write_through) and a `HostCacheIO` with `--layout` host pools.
For each prompt length L, each round uses fresh random prompts and times, as the
scheduler sees it (submit -> first-token logits on the host, blocking):

- `recompute`: a prompt nobody has seen (no device or host hit: the whole prefill);
- `device_hit`: the same prompt again at once (its whole pages are on the device);
- `host_hit`: the same prompt again after other prompts have pushed it off the device
  (its pages come back from host: the load-back, then the last partial page's prefill).

The device pool holds about 1.5 prompts, so the filler prompts evict it; the host pool is
`--hicache-ratio` x the device pool. Round 0 compiles every shape and is not timed;
`--repeats` timed rounds follow, medians reported with the ratios `host_hit / recompute`
(the goal: well below 1) and `host_hit / device_hit` (what the load-back costs beyond a
device hit: the part of the copy not hidden behind compute). A round whose host hit was
not loaded back (`host_cached_tokens == 0`) is an error, not a data point.

On this CPU the host copy is an XLA gather / scatter that rewrites the whole pool
(`bench_host_copy`: loads 0.02-0.04x memcpy), and the LPF layout's Pallas kernels run
in interpret mode, so `--layout layer_page_first` here measures the interpreter; the
GPU figure is the one that says what the design costs. Prints one JSON object.
"""

from __future__ import annotations

import os

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    # Must precede the first jax import: the CP mesh wants 8 CPU devices.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.report import emit, environment
from cpkv_jax.cache.hiradix import HiRadixCache
from cpkv_jax.config import CPConfig, ModelConfig
from cpkv_jax.cp_prefill import CPPrefillRunner
from cpkv_jax.decode_mesh import DPPoolLayout, init_dp_pool
from cpkv_jax.host_cache.pool import HOST_LAYOUTS, HostPools
from cpkv_jax.kv_pool import PoolLayout
from cpkv_jax.kv_store import DevicePool, DPPrefixStore
from cpkv_jax.mesh import make_cp_mesh, make_dp_mesh
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.paging import pages_for_tokens
from cpkv_jax.tools.tiny_config import tiny_config_dict
from serving.decode.dp_prefix import DPPrefixPrefill
from serving.decode.engine import DecodeEngine
from serving.engine.api import GenerateRequest, SamplingParams
from serving.prefill.adder import CPSharedKVLimits
from serving.prefill.host_cache import HostCacheIO, PoolTarget
from serving.prefill.scheduler import CPRunnerExecutor, PrefillScheduler

DEFAULT_LENGTHS = (512, 2048)
VOCAB_LOW, VOCAB_HIGH = 3, 300  # the tiny model's vocabulary, minus special tokens


def _setup(args: argparse.Namespace, length: int):
    cfg = ModelConfig.from_dict(tiny_config_dict(args.arch))
    model = CausalLM(cfg, rngs=nnx.Rngs(args.seed))
    # Shared KV needs ranks to share over; one device (a GPU run) is the plain pool.
    cp = CPConfig(cp_size=args.cp, shared_kv=args.cp > 1, page_size=args.page_size)
    # About 1.5 prompts of device pages (+ the trash page per lane): one filler evicts it.
    pages = pages_for_tokens(length, args.page_size)
    per_rank = -(-(pages * 3 // 2) // args.cp) + 1
    runner = CPPrefillRunner(
        cfg, model, make_cp_mesh(args.cp), cp, pages_per_rank=per_rank, index_k_dtype="float32"
    )
    io = HostCacheIO.create(runner, args.layout, ratio=args.hicache_ratio)
    cache = HiRadixCache(runner.allocator, args.page_size, io.host_allocators)
    sched = PrefillScheduler(
        cache=cache,
        executor=CPRunnerExecutor(runner),
        max_prefill_tokens=max(length, args.chunk),
        chunked_prefill_size=args.chunk,
        cp_limits=CPSharedKVLimits(shared_kv=args.cp > 1),
        host_io=io,
    )
    return sched, cache, io, per_rank


def _serve(sched: PrefillScheduler, rid: str, ids: np.ndarray):
    """Submit -> logits on the host; returns (seconds, outcome). Backups finish after."""
    t0 = time.perf_counter()
    sched.submit(rid, ids)
    (out,) = sched.run_until_idle()
    seconds = time.perf_counter() - t0
    if out.status != "finished":
        raise RuntimeError(f"request {rid}: {out.status}: {out.reason}")
    sched.sync_host_cache(wait=True)  # off the timed path: the next request sees them
    return seconds, out


class _DPEngine:
    """`--dp N`: the unified server's DP path without HTTP (`cpkv-serve --dp-size N
    --enable-hierarchical-cache`): a `DecodeEngine` on a `("dp",)` mesh whose intake is
    `DPPrefixPrefill` over a `DPPrefixStore` with one write-through `HostCacheIO` per
    rank; each rank's pool holds about 1.5 prompts. `serve` times add -> first token."""

    def __init__(self, args: argparse.Namespace, length: int):
        cfg = ModelConfig.from_dict(tiny_config_dict(args.arch))
        model = CausalLM(cfg, rngs=nnx.Rngs(args.seed))
        mesh = make_dp_mesh(args.dp, jax.devices()[: args.dp])
        self.per_rank = pages_for_tokens(length, args.page_size) * 3 // 2 + 2
        layout = DPPoolLayout(args.dp, self.per_rank, args.page_size)
        device = DevicePool(init_dp_pool(cfg, layout, mesh, jnp.float32, "float32"))
        lanes = PoolLayout(args.dp, True, self.per_rank, args.page_size)
        pools = HostPools.create(
            device.pool, cfg.full_indexer_layers, lanes, args.layout, ratio=args.hicache_ratio
        )
        target = PoolTarget(device, lanes)
        self.ios = [HostCacheIO(target, pools, rank=r) for r in range(args.dp)]
        self.store = DPPrefixStore(device, layout, self.ios, "write_through")
        self.intake = DPPrefixPrefill(self.store)
        self.engine = DecodeEngine(
            cfg=cfg, model=model, kv=self.store, page_size=args.page_size,
            index_k_dtype="float32", mode="null", intake=self.intake,
            max_running_requests=4, mesh=mesh,
        )  # fmt: skip

    def serve(self, rid: str, ids: np.ndarray) -> tuple[float, dict]:
        """Add -> the first token's chunk; returns (seconds, its final meta). Backups
        finish after, off the timed path."""
        req = GenerateRequest(rid, tuple(int(t) for t in ids), SamplingParams(max_new_tokens=1))
        t0 = time.perf_counter()
        self.engine.add(req)
        seconds, meta = None, None
        while self.engine.has_work():
            for c in self.engine.step():
                if c.rid == rid and c.token_ids and seconds is None:
                    seconds = time.perf_counter() - t0
                if c.rid == rid and c.finished:
                    if c.error is not None:
                        raise RuntimeError(f"request {rid}: {c.error}")
                    meta = c.meta
        assert seconds is not None and meta is not None
        for io in self.ios:
            io.wait_backups()
        self.store.sync_host()
        return seconds, meta

    def close(self) -> dict:
        snap = self.intake.hicache_info()
        for io in self.ios:
            io.close()
        return snap


def run_length_dp(args: argparse.Namespace, length: int) -> dict:
    """`run_length` on the DP path (`_DPEngine`): 2 * dp fillers push the prompt off
    its rank's device (a filler lands on each rank in turn)."""
    dp = _DPEngine(args, length)
    rng = np.random.default_rng(args.seed + length)
    times: dict[str, list[float]] = {"recompute": [], "device_hit": [], "host_hit": []}
    host_tokens: list[int] = []
    device_tokens: list[int] = []
    for rnd in range(args.repeats + 1):
        ids = rng.integers(VOCAB_LOW, VOCAB_HIGH, length).astype(np.int32)
        t_cold, _ = dp.serve(f"{rnd}-cold", ids)
        t_dev, dev = dp.serve(f"{rnd}-device", ids)
        for i in range(2 * args.dp):
            dp.serve(f"{rnd}-filler{i}", rng.integers(VOCAB_LOW, VOCAB_HIGH, length))
        t_host, host = dp.serve(f"{rnd}-host", ids)
        if host["cached_tokens_host"] == 0:
            raise RuntimeError(f"length {length}, round {rnd}: the repeat was not a host hit")
        if rnd == 0:
            continue  # compiles
        times["recompute"].append(t_cold)
        times["device_hit"].append(t_dev)
        times["host_hit"].append(t_host)
        host_tokens.append(int(host["cached_tokens_host"]))
        device_tokens.append(int(dev["cached_tokens"]))
    return _report(length, dp.per_rank, times, host_tokens, device_tokens, dp.close())


def _report(
    length: int,
    per_rank: int,
    times: dict[str, list[float]],
    host_tokens: list[int],
    device_tokens: list[int],
    snap: dict,
) -> dict:
    """One length's JSON row: medians, both ratios and the load-back counters."""
    med = {k: statistics.median(v) for k, v in times.items()}
    loads = max(snap["load_backs"], 1)
    return {
        "length": length,
        "pages_per_rank": per_rank,
        "median_s": med,
        "all_s": times,
        "host_hit_tokens_per_round": host_tokens,
        "device_hit_tokens_per_round": device_tokens,
        "ratio_host_hit_over_recompute": med["host_hit"] / med["recompute"],
        "ratio_host_hit_over_device_hit": med["host_hit"] / med["device_hit"],
        "load_backs": snap["load_backs"],
        "load_back_seconds_mean": snap["load_back_seconds"] / loads,
        "load_back_bytes_mean": snap["load_back_bytes"] // loads,
    }


def run_length(args: argparse.Namespace, length: int) -> dict:
    if args.dp > 1:
        return run_length_dp(args, length)
    sched, cache, io, per_rank = _setup(args, length)
    rng = np.random.default_rng(args.seed + length)
    times: dict[str, list[float]] = {"recompute": [], "device_hit": [], "host_hit": []}
    host_tokens: list[int] = []
    device_tokens: list[int] = []
    for rnd in range(args.repeats + 1):

        def prompt() -> np.ndarray:
            return rng.integers(VOCAB_LOW, VOCAB_HIGH, length).astype(np.int32)

        ids = prompt()
        t_cold, _ = _serve(sched, f"{rnd}-cold", ids)
        t_dev, dev = _serve(sched, f"{rnd}-device", ids)
        for i in range(2):  # fillers push `ids` off the device (the host keeps it)
            _serve(sched, f"{rnd}-filler{i}", prompt())
        t_host, host = _serve(sched, f"{rnd}-host", ids)
        if host.host_cached_tokens == 0:
            raise RuntimeError(
                f"length {length}, round {rnd}: the repeat was not served from host "
                f"(cached {host.cached_tokens}, host {host.host_cached_tokens}); host stats "
                f"{io.snapshot(cache)}"
            )
        if rnd == 0:
            continue  # compiles
        times["recompute"].append(t_cold)
        times["device_hit"].append(t_dev)
        times["host_hit"].append(t_host)
        host_tokens.append(host.host_cached_tokens)
        device_tokens.append(dev.cached_tokens)
    snap = io.snapshot(cache)
    sched.close()
    return _report(length, per_rank, times, host_tokens, device_tokens, snap)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument(
        "--dp", type=int, default=1, help="> 1: the unified DP server's path, host cache per rank"
    )
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=1024, help="chunked prefill size")
    ap.add_argument("--layout", choices=HOST_LAYOUTS, default="page_first")
    ap.add_argument("--hicache-ratio", type=float, default=4.0)
    ap.add_argument("--arch", choices=("glm_moe_dsa", "deepseek_v32"), default="glm_moe_dsa")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the result here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if jax.device_count() < max(args.cp, args.dp):
        print(
            f"--cp {args.cp} needs {args.cp} devices, found {jax.device_count()} (CPU: "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={args.cp})",
            file=sys.stderr,
        )
        return 2
    if args.repeats < 1:
        print("--repeats must be >= 1", file=sys.stderr)
        return 2
    results = [run_length(args, n) for n in args.lengths]
    emit(
        {
            **environment(),
            "cp_size": args.cp if args.dp == 1 else None,
            "dp_size": args.dp,
            "page_size": args.page_size,
            "layout": args.layout,
            "arch": args.arch,
            "chunk": args.chunk,
            "repeats": args.repeats,
            "lengths": results,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
