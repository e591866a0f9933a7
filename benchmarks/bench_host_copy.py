"""Host KV cache copies: per-layer backup / load of N pages per host layout vs a memcpy.

    python -m benchmarks.bench_host_copy [--pages 64 256] [--page-size 64] [--feature 576]
                                         [--layers 4] [--index] [--index-feature 128]
                                         [--repeats 9] [--warmup 2] [--json PATH]
    python -m benchmarks.bench_host_copy --gpu [...]   (needs a GPU; exit code 2 otherwise)

One device pool of `--layers` layers (MLA latent `[pages, P, F]` bf16; with `--index`
also the fp8 index K `[pages, P, 128]` and its fp32 per-token scale on every layer) and
one host pool per layout (`host_cache.pool`). For each N in `--pages`, N random device
pages of one layer are backed up into N random host pages (`backup_layer`) and loaded
back into N other device pages (`load_layer`), and each copy is timed with:

- `layer_first`, `page_first`, `page_first_direct`: the library path (XLA gather /
  scatter, `impl="xla"`);
- `layer_page_first_pallas[_interpret]`: the library's LPF path, the LF<->LPF Pallas
  kernels. On CPU they run in Pallas interpret mode, which is slow and says nothing
  about the compiled kernel; `--gpu` runs them compiled (Triton) on a GPU;
- `layer_page_first_xla_reference`: the same LPF copy with the kernels' XLA reference
  (`lpf_copy.lf_to_lpf(..., impl="xla")` + `jax.device_get` + the host row store;
  `host rows` + `lpf_copy.lpf_to_lf(..., impl="xla")` for a load), called directly
  because the library's LPF path is direct-only (SPEC S4.4);
- baselines over the same byte count: `memcpy` (`np.copyto` of one contiguous host
  buffer into another) and, per direction, `device_get` of an already-contiguous device
  array (device -> host) or `device_put` of a contiguous host buffer (host -> device).

GB/s = payload bytes (N pages of the layer, every leaf kind) / median seconds; ratio =
a variant's GB/s / memcpy's GB/s in the same run. Variants are interleaved round by
round (rotating order) after `--warmup` untimed rounds. Every copy variant is checked
bitwise before timing and again after: the host pages equal the device source pages and
nothing else of the host buffer is written; after a load, the target device pages equal
the sources and every other page is unchanged. Prints one JSON object; exits 1 if a
round trip is not bitwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import emit, environment
from cpkv_jax.host_cache import (
    HostPool,
    backup_layer,
    load_layer,
    token_indices_of_pages,
)
from cpkv_jax.kv_layout import KVLayout
from cpkv_jax.kv_pool import PoolLayout
from cpkv_jax.model.kv_cache import KVPool
from cpkv_jax.pallas import lpf_copy

LAYER = 0  # the layer copied; every layer has every leaf kind, so its slot is LAYER too
LIBRARY_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
LPF = "layer_page_first"


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def _random_leaf(rng, shape, dtype, device) -> jax.Array:
    values = rng.standard_normal(shape, dtype=np.float32) * 4 + 0.5  # no zeros, no NaNs
    return jax.device_put(values.astype(jnp.dtype(dtype)), device)


def _make_pool(rng, args, num_pages: int, device) -> tuple[KVPool, tuple[int, ...]]:
    shape = (num_pages, args.page_size)
    latent = tuple(
        _random_leaf(rng, (*shape, args.feature), jnp.bfloat16, device) for _ in range(args.layers)
    )
    index_k, index_scale, index_layers = (), (), ()
    if args.index:
        index_layers = tuple(range(args.layers))
        index_k = tuple(
            _random_leaf(rng, (*shape, args.index_feature), jnp.float8_e4m3fn, device)
            for _ in index_layers
        )
        index_scale = tuple(_random_leaf(rng, shape, jnp.float32, device) for _ in index_layers)
    return KVPool(latent=latent, index_k=index_k, index_scale=index_scale), index_layers


def _with_leaf(pool: KVPool, kind: str, j: int, leaf) -> KVPool:
    leaves = {k: list(getattr(pool, k)) for k in ("latent", "index_k", "index_scale")}
    leaves[kind][j] = leaf
    return KVPool(**{k: tuple(v) for k, v in leaves.items()})


class Case:
    """One N: the device pool, the host pools, the page plan, and every timed variant."""

    def __init__(self, args, n: int, device, interpret: bool, seed: int):
        rng = np.random.default_rng(seed)
        self.n, self.page_size, self.interpret = n, args.page_size, interpret
        pages = 2 * n + 1  # page 0 reserved; N sources + N load targets on the device
        self.pool, index_layers = _make_pool(rng, args, pages, device)
        self.layout = PoolLayout(1, False, pages, args.page_size)
        kv = KVLayout.of_pool(self.pool, index_layers)
        specs = kv.by_kind()
        self.kinds = tuple(specs)
        self.hosts = {layout: HostPool(kv, layout, pages) for layout in (*LIBRARY_LAYOUTS, LPF)}
        usable = rng.permutation(np.arange(1, pages, dtype=np.int64))
        self.src, self.dst = usable[:n], usable[n : 2 * n]
        self.host_pages = rng.permutation(np.arange(1, pages, dtype=np.int64))[:n]
        self.src_tok = token_indices_of_pages(self.src, args.page_size)
        self.dst_tok = token_indices_of_pages(self.dst, args.page_size)
        self.host_tok = token_indices_of_pages(self.host_pages, args.page_size)
        # What the copied layer's leaves must hold after any load: the sources at dst.
        self.initial = {k: _bits(self._leaf(k)).copy() for k in self.kinds}
        self.expect = {}
        for k, bits in self.initial.items():
            want = bits.copy()
            want[self.dst] = bits[self.src]
            self.expect[k] = want
        self.bytes_by_kind = {k: n * args.page_size * s.token_bytes for k, s in specs.items()}
        self.nbytes = sum(self.bytes_by_kind.values())
        # Baseline buffers of the same byte count.
        self.mem_src = rng.integers(0, 256, self.nbytes, dtype=np.uint8)
        self.mem_dst = np.empty_like(self.mem_src)
        self.fresh_device: jax.Array | None = None
        self.device = device
        self.device_get_zero_copy: bool | None = None

    def _leaf(self, kind: str) -> jax.Array:
        return getattr(self.pool, kind)[LAYER]

    def _block(self) -> None:
        jax.block_until_ready([self._leaf(k) for k in self.kinds])

    # ---- copy variants ---------------------------------------------------------------

    def _common(self) -> dict:
        return dict(pool_layout=self.layout, lane=0)

    def backup_library(self, layout: str) -> Callable[[], None]:
        impl = "pallas" if layout == LPF else "xla"

        def run():
            backup_layer(
                self.pool,
                self.hosts[layout],
                LAYER,
                device_indices=self.src_tok,
                host_indices=self.host_tok,
                impl=impl,
                interpret=self.interpret,
                **self._common(),
            )

        return run

    def load_library(self, layout: str) -> Callable[[], None]:
        impl = "pallas" if layout == LPF else "xla"

        def run():
            self.pool = load_layer(
                self.pool,
                self.hosts[layout],
                LAYER,
                host_indices=self.host_tok,
                device_indices=self.dst_tok,
                impl=impl,
                interpret=self.interpret,
                **self._common(),
            )
            self._block()

        return run

    def backup_lpf_reference(self) -> None:
        host = self.hosts[LPF]
        staged = {
            k: lpf_copy.lf_to_lpf(self._leaf(k), self.src_tok, impl="xla") for k in self.kinds
        }
        for k, data in jax.device_get(staged).items():
            host.layer_pages(k, LAYER)[self.host_pages] = data

    def load_lpf_reference(self) -> None:
        host = self.hosts[LPF]
        for k in self.kinds:
            rows = host.layer_pages(k, LAYER)[self.host_pages]
            leaf = lpf_copy.lpf_to_lf(self._leaf(k), rows, self.dst_tok, impl="xla")
            self.pool = _with_leaf(self.pool, k, LAYER, leaf)
        self._block()

    # ---- diagnostics: the device-side XLA step alone (no host copy, no transfer) ------

    def gather_device_only(self) -> None:
        jax.block_until_ready(
            [lpf_copy.lf_to_lpf(self._leaf(k), self.src_tok, impl="xla") for k in self.kinds]
        )

    def scatter_device_only(self, pages: int) -> Callable[[], None]:
        """Scatter `pages` of device-resident staging (the source rows, so the layer still
        ends as expected) into the first `pages` load targets."""
        rows = {
            k: lpf_copy.lf_to_lpf(self._leaf(k), self.src_tok[: pages * self.page_size], impl="xla")
            for k in self.kinds
        }
        tokens = self.dst_tok[: pages * self.page_size]

        def run():
            for k in self.kinds:
                leaf = lpf_copy.lpf_to_lf(self._leaf(k), rows[k], tokens, impl="xla")
                self.pool = _with_leaf(self.pool, k, LAYER, leaf)
            self._block()

        return run

    def memcpy(self) -> None:
        np.copyto(self.mem_dst, self.mem_src)

    def prepare_device_get(self) -> None:
        # A fresh device array each time: `device_get` caches its host value per array.
        self.fresh_device = jax.block_until_ready(jax.device_put(self.mem_src, self.device))

    def device_get(self) -> None:
        out = jax.device_get(self.fresh_device)
        if self.device_get_zero_copy is None:
            try:
                ptr = self.fresh_device.unsafe_buffer_pointer()
                self.device_get_zero_copy = bool(out.ctypes.data == ptr)
            except Exception:  # not every backend exposes the pointer
                self.device_get_zero_copy = False

    def device_put(self) -> None:
        jax.block_until_ready(jax.device_put(self.mem_src, self.device))

    # ---- bitwise checks --------------------------------------------------------------

    def check_backup(self, layout: str, run: Callable[[], None] | None) -> bool:
        """Clear the host pool, run one backup (if given), compare; leaves the pages set."""
        host = self.hosts[layout]
        if run is not None:
            for buf in host.buffers.values():
                buf[...] = 0
            run()
        ok = True
        for k in self.kinds:
            got = host.read_pages(k, LAYER, self.host_pages)
            ok &= bool(np.array_equal(_bits(got), self.initial[k][self.src]))
            host.write_pages(k, LAYER, self.host_pages, np.zeros_like(got))
            ok &= not _bits(host.buffers[k]).any()  # nothing else of the host was written
            host.write_pages(k, LAYER, self.host_pages, got)
        return ok

    def check_load(self, run: Callable[[], None] | None) -> bool:
        """Zero the target pages, run one load (if given), compare the whole layer."""
        if run is not None:
            for k in self.kinds:
                leaf = self._leaf(k)
                zeros = np.zeros((self.n, *leaf.shape[1:]), leaf.dtype)
                leaf = lpf_copy.lpf_to_lf(leaf, zeros, self.dst_tok, impl="xla")
                self.pool = _with_leaf(self.pool, k, LAYER, leaf)
            run()
        return all(np.array_equal(_bits(self._leaf(k)), self.expect[k]) for k in self.kinds)


def _interleaved(variants: dict, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of every variant: `warmup` untimed rounds, then `repeats` timed
    rounds, each round calling every variant once in a rotating order."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            prepare, run = variants[name]
            if prepare is not None:
                prepare()
            t0 = time.perf_counter()
            run()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(dt)
    return times


def _row(seconds: list[float], nbytes: int, memcpy_gb_s: float | None, **extra) -> dict:
    med = statistics.median(seconds)
    gb_s = nbytes / med / 1e9
    return {
        **extra,
        "ms": med * 1e3,
        "ms_min": min(seconds) * 1e3,
        "ms_max": max(seconds) * 1e3,
        "gb_s": gb_s,
        "ratio_vs_memcpy": gb_s / memcpy_gb_s if memcpy_gb_s else 1.0,
    }


def measure(args, n: int, device, gpu: bool, seed: int = 0) -> dict:
    case = Case(args, n, device, interpret=not gpu, seed=seed)
    lpf_name = f"{LPF}_pallas" if gpu else f"{LPF}_pallas_interpret"
    meta = {
        **{name: {"layout": name, "impl": "xla", "interpret": False} for name in LIBRARY_LAYOUTS},
        lpf_name: {"layout": LPF, "impl": "pallas", "interpret": not gpu},
        f"{LPF}_xla_reference": {"layout": LPF, "impl": "xla", "interpret": False},
    }
    out = {
        "pages": n,
        "page_size": args.page_size,
        "bytes": case.nbytes,
        "bytes_by_kind": case.bytes_by_kind,
    }
    for direction in ("backup", "load"):
        if direction == "backup":
            copies = {name: case.backup_library(name) for name in LIBRARY_LAYOUTS}
            copies[lpf_name] = case.backup_library(LPF)
            copies[f"{LPF}_xla_reference"] = case.backup_lpf_reference
            baselines = {"memcpy": (None, case.memcpy)}
            baselines["device_get"] = (case.prepare_device_get, case.device_get)
            diagnostics = {"xla_gather_device_only": (None, case.gather_device_only)}
        else:
            copies = {name: case.load_library(name) for name in LIBRARY_LAYOUTS}
            copies[lpf_name] = case.load_library(LPF)
            copies[f"{LPF}_xla_reference"] = case.load_lpf_reference
            baselines = {"memcpy": (None, case.memcpy), "device_put": (None, case.device_put)}
            diagnostics = {
                "xla_scatter_device_only": (None, case.scatter_device_only(n)),
                "xla_scatter_device_only_1_page": (None, case.scatter_device_only(1)),
            }
        # Each copy checked on its own before timing (the load reads the host pages its
        # layout's backup just wrote and checked), then again after the timed rounds.
        before = {}
        for name, run in copies.items():
            layout = meta[name]["layout"]
            if direction == "backup":
                before[name] = case.check_backup(layout, run)
            else:
                before[name] = case.check_load(run)
        variants = {name: (None, run) for name, run in copies.items()} | baselines | diagnostics
        times = _interleaved(variants, args.warmup, args.repeats)
        after = {}
        for name in copies:
            layout = meta[name]["layout"]
            if direction == "backup":
                after[name] = case.check_backup(layout, None)
            else:
                after[name] = case.check_load(None)
        memcpy = _row(times["memcpy"], case.nbytes, None)
        rows = {"memcpy": memcpy}
        for name in baselines:
            if name != "memcpy":
                extra = {"zero_copy": case.device_get_zero_copy} if name == "device_get" else {}
                rows[name] = _row(times[name], case.nbytes, memcpy["gb_s"], **extra)
        for name in copies:
            rows[name] = _row(
                times[name],
                case.nbytes,
                memcpy["gb_s"],
                **meta[name],
                bitwise_round_trip=before[name] and after[name],
            )
        out[direction] = rows
        # The 1-page row moves 1 page: its GB/s is over that page's bytes.
        out.setdefault("diagnostics", {})[direction] = {
            name: _row(
                times[name],
                case.nbytes // n if name.endswith("_1_page") else case.nbytes,
                memcpy["gb_s"],
            )
            for name in diagnostics
        }
    return out


NOTES = [
    "GB/s = payload bytes of N pages of one layer (every leaf kind) / median seconds per "
    "copy; ratio_vs_memcpy = GB/s / memcpy GB/s (np.copyto of a contiguous buffer of the "
    "same bytes, host to host) in the same run, variants interleaved round by round.",
    "layer_page_first_pallas_interpret: the library's LPF path with the Pallas kernels in "
    "interpret mode (CPU); not representative of the compiled kernel.",
    "layer_page_first_xla_reference: the LPF copy through lpf_copy.lf_to_lpf / lpf_to_lf "
    "with impl='xla' (the kernels' reference), called directly; the library's LPF path "
    "accepts only impl='pallas'.",
    "diagnostics: the device-side XLA gather / scatter of the same copy alone (staging "
    "already on the device, nothing moved to or from the host); the 1-page scatter shows "
    "what a scatter costs regardless of N (its ratio is over one page's bytes).",
    "device_get on CPU can be a zero-copy view of the device buffer (see zero_copy): then "
    "it moves no bytes and its GB/s is not a copy rate.",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--feature", type=int, default=576, help="MLA latent width (bf16)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the device/host pools")
    ap.add_argument("--index", action="store_true", help="also fp8 index K + fp32 scale")
    ap.add_argument("--index-feature", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9, help="timed rounds (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", action="store_true", help="compiled Pallas kernels on a GPU")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.pages) or args.repeats < 1 or args.warmup < 0:
        ap.error("--pages must be >= 1, --repeats >= 1 and --warmup >= 0")
    if args.gpu:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if not gpus:
            print(
                f"--gpu needs a GPU: no GPU found (JAX backend {jax.default_backend()!r}); "
                "run without --gpu for the CPU comparison (Pallas in interpret mode)",
                file=sys.stderr,
            )
            return 2
        device = gpus[0]
    else:
        device = jax.devices("cpu")[0]
    cases = [
        measure(args, n, device, args.gpu, seed=args.seed + i) for i, n in enumerate(args.pages)
    ]
    ok = all(
        row.get("bitwise_round_trip", True)
        for case in cases
        for d in ("backup", "load")
        for row in case[d].values()
    )
    report = {
        **environment(),
        "mode": "gpu" if args.gpu else "cpu",
        "copy_device": str(device),
        "layers": args.layers,
        "feature": args.feature,
        "index": args.index,
        "index_feature": args.index_feature if args.index else None,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "bitwise_round_trip_all": ok,
        "notes": NOTES,
        "cases": cases,
    }
    emit(report, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
