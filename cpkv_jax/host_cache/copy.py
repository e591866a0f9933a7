"""Backup and load-back between one owner lane of the device pool and its `HostPool`.

Indices (SPEC S3, S4.2). `device_indices` are the lane's *local* token slots
(`local_page * page_size + offset`) and `host_indices` the host pool's
(`host_page * page_size + offset`), both CPU int64 whole-page spans, paired group by
group in caller order. Every entry validates both with
`paging.validate_page_aligned_token_indices`, then checks ranges (the trash / reserved
page 0 is refused on both sides) and that the targets are distinct, all before any data
moves; the kernel entries of `pallas.lpf_copy` validate again. A partial prompt copies
its last page whole.

Device side. A lane lives in the shard(s) of the pool whose page range covers it: one
shard in shared mode (`P("cp")`, lane r = rank r), every replica in replicated mode.
Backup gathers the lane's pages from one covering shard into staging on that device and
`jax.device_get`s it; load `device_put`s host rows next to every covering shard, scatters
them in (the shard buffers are donated) and reassembles the global array with
`jax.make_array_from_single_device_arrays`, so the pool is updated functionally: use the
returned pool, never the one passed in. A load scatters leaf by leaf; its `commit`
callback gets the pool after every shard's scatter, so a caller that keeps that pool
holds no donated buffer when a later scatter raises (`deleted_leaves` checks). Only
locally addressable shards are touched, so in a multi-process run each process copies
its own lane(s) only (SPEC S4.5).

Copy paths per host layout (`impl`):
- `layer_page_first` (LPF): the LF<->LPF kernels (`impl="pallas"`, the only one accepted;
  SPEC S4.4), one layer at a time; all-layer copies loop over the per-layer ones (S4.3).
  A kernel that fails to lower or run raises `LPFKernelUnavailableError`; nothing falls
  back to another copy path.
- `layer_first`, `page_first`: XLA gathers / scatters (`impl="xla"`, default) or the same
  kernels (`"pallas"`); all-layer copies dispatch every leaf, then transfer once.
- `page_first_direct`: like `page_first`, but each page is gathered, transferred and
  stored on its own (a page-by-page copy).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding
from jaxtyping import Int

from cpkv_jax.errors import ConfigError, CpkvError, quote
from cpkv_jax.host_cache.pool import HOST_TRASH_PAGE, HostPool, token_indices_of_pages
from cpkv_jax.kv_pool import PoolLayout
from cpkv_jax.model.kv_cache import KVPool
from cpkv_jax.paging import TRASH_PAGE, page_ids_of_token_indices
from cpkv_jax.pallas import lpf_copy

logger = logging.getLogger(__name__)

CopyImpl = Literal["pallas", "xla"]
LPF = "layer_page_first"


class HostCopyError(CpkvError, ValueError):
    """A host-cache copy names pages outside a pool, a reserved page, or a repeated target."""


class LPFKernelUnavailableError(CpkvError, RuntimeError):
    """The LF<->LPF direct copy kernel could not be lowered or run (no fallback, S4.4)."""


class DevicePoolLostError(CpkvError, RuntimeError):
    """A load into the device pool raised after a buffer it donated was consumed: the
    pool cannot be used again (fatal: restart the process)."""


KVPOOL_KINDS = ("latent", "index_k", "index_scale")


def deleted_leaves(pool: KVPool) -> list[str]:
    """Names (`latent[3]`) of the pool's leaves with a deleted (donated) buffer. Every
    addressable shard is asked: `jax.Array.is_deleted` can miss a donated shard of a
    sharded array (JAX 0.10)."""
    return [
        f"{kind}[{j}]"
        for kind in KVPOOL_KINDS
        for j, leaf in enumerate(getattr(pool, kind))
        if leaf.is_deleted() or any(s.data.is_deleted() for s in leaf.addressable_shards)
    ]


class _LoadTarget:
    """The pool's leaves while a load replaces them. Each scatter result is stored and
    handed to `commit` (as a whole pool) the moment it exists: after a failure part-way
    the committed pool holds the loaded pages in the leaves written and the untouched,
    undonated arrays in the others."""

    def __init__(self, pool: KVPool, commit: Callable[[KVPool], None] | None):
        self.leaves = {kind: list(getattr(pool, kind)) for kind in KVPOOL_KINDS}
        self.commit = commit

    def set(self, kind: str, j: int, leaf: jax.Array) -> None:
        self.leaves[kind][j] = leaf
        if self.commit is not None:
            self.commit(self.pool())

    def pool(self) -> KVPool:
        return KVPool(**{kind: tuple(leaves) for kind, leaves in self.leaves.items()})


def resolve_impl(layout: str, impl: CopyImpl | None) -> CopyImpl:
    """The copy implementation for `layout`: LPF is direct-only (the Pallas kernels)."""
    if layout == LPF:
        if impl not in (None, "pallas"):
            raise ConfigError(
                f"host layout {LPF} is direct-only: it copies with the LF<->LPF kernels "
                f"(impl='pallas'), got impl={impl!r}; drop the impl override or pick "
                "another host layout"
            )
        return "pallas"
    if impl not in (None, "pallas", "xla"):
        raise ConfigError(f"unknown host copy impl {impl!r}; use 'pallas' or 'xla'")
    return impl or "xla"


@dataclasses.dataclass(frozen=True)
class CopyPlan:
    """Validated page pairs of one copy: lane-local device pages and host pages (int64)."""

    device_pages: Int[np.ndarray, " n"]
    host_pages: Int[np.ndarray, " n"]


def plan_copy(
    host: HostPool,
    pool_layout: PoolLayout,
    *,
    device_indices: Int[np.ndarray, " device_tokens"],
    host_indices: Int[np.ndarray, " host_tokens"],
    load: bool,
) -> CopyPlan:
    """Validate a copy's indices (S3.2) and pair its pages; raises before anything moves.

    Raises `PageAlignmentError` for malformed spans, `HostCopyError` for a page count
    mismatch, pages out of range, page 0 on either side, or repeated targets (host pages
    on backup, device pages on load).
    """
    page_size = pool_layout.page_size
    if host.page_size != page_size:
        raise ConfigError(f"host pool page_size {host.page_size} != device page_size {page_size}")
    device_pages = page_ids_of_token_indices(device_indices, page_size)
    host_pages = page_ids_of_token_indices(host_indices, page_size)
    if device_pages.size != host_pages.size:
        raise HostCopyError(
            f"{device_pages.size} device pages but {host_pages.size} host pages; pair "
            "every device page with one host page"
        )
    for name, pages, count, trash in (
        ("device", device_pages, pool_layout.pages_per_rank, TRASH_PAGE),
        ("host", host_pages, host.num_pages, HOST_TRASH_PAGE),
    ):
        bad = (pages < 0) | (pages >= count) | (pages == trash)
        if bad.any():
            raise HostCopyError(
                f"{name} page(s) {quote(pages[bad])} are outside the usable pages "
                f"[1, {count}) of this lane (page {trash} is reserved); fix the page plan"
            )
    target_name, target = ("device", device_pages) if load else ("host", host_pages)
    uniq, counts = np.unique(target, return_counts=True)
    if (counts > 1).any():
        raise HostCopyError(
            f"{target_name} target page(s) {quote(uniq[counts > 1])} appear more than once "
            "in one copy; each target page takes one source page"
        )
    return CopyPlan(device_pages, host_pages)


def _check_pool(pool: KVPool, host: HostPool, pool_layout: PoolLayout) -> None:
    for kind, spec in host.specs.items():
        leaves = getattr(pool, kind)
        if len(leaves) != len(spec.layers):
            raise ConfigError(
                f"device pool has {len(leaves)} {kind} leaves, host pool {len(spec.layers)}"
            )
        leaf = leaves[0]
        want = (pool_layout.global_pages, pool_layout.page_size, *spec.feature)
        if tuple(leaf.shape) != want or np.dtype(leaf.dtype) != spec.dtype:
            raise ConfigError(
                f"device {kind} leaf is {tuple(leaf.shape)} {leaf.dtype} but this host pool "
                f"and layout expect {want} {spec.dtype}"
            )


def _check_kinds(host: HostPool, kinds: Sequence[str] | None) -> tuple[str, ...]:
    if kinds is None:
        return host.kinds
    unknown = [k for k in kinds if k not in host.kinds]
    if unknown:
        raise ConfigError(f"host pool has no leaf kind(s) {unknown}; it holds {host.kinds}")
    return tuple(kinds)


def _check_layer(pool: KVPool, layer: int) -> None:
    if not 0 <= layer < len(pool.latent):
        raise ConfigError(f"layer {layer} is outside [0, {len(pool.latent)})")


def _lane_shards(leaf: jax.Array, lane: int, pool_layout: PoolLayout) -> list[tuple]:
    """`(shard, page_offset)` of every addressable shard holding all of lane `lane`."""
    if not 0 <= lane < pool_layout.lanes:
        raise ConfigError(f"lane {lane} is outside [0, {pool_layout.lanes})")
    start = lane * pool_layout.pages_per_rank
    stop = start + pool_layout.pages_per_rank
    out = []
    for shard in leaf.addressable_shards:
        lo, hi, _ = shard.index[0].indices(leaf.shape[0])
        if lo <= start and stop <= hi:
            out.append((shard, start - lo))
    if not out:
        raise ConfigError(
            f"no device shard of this process holds all of lane {lane} (pages "
            f"[{start}, {stop})); back up and load a lane on the rank that owns it"
        )
    return out


def _kernel(fn, impl: str, *args, **kwargs):
    """Run a copy kernel; a Pallas failure is `LPFKernelUnavailableError`, never a fallback."""
    try:
        return fn(*args, impl=impl, **kwargs)
    except CpkvError:
        raise
    except Exception as e:
        if impl != "pallas":
            raise
        raise LPFKernelUnavailableError(
            f"the LF<->LPF direct copy kernel failed to lower or run ({type(e).__name__}: "
            f"{e}); there is no fallback copy path (SPEC S4.4): fix the kernel or its "
            "Pallas/Triton install, or pick a non-LPF host layout"
        ) from e


def _shard_data(shard) -> jax.Array:
    """`shard.data` as a `SingleDeviceSharding` array (no copy). A one-device mesh's jit
    outputs hand back the array itself, `NamedSharding` and all, and a copy program
    compiled for one sharding is not reused for the other (issue 25)."""
    data = shard.data
    if isinstance(data.sharding, SingleDeviceSharding):
        return data
    return jax.make_array_from_single_device_arrays(
        data.shape, SingleDeviceSharding(shard.device), [data]
    )


def _gather(leaf, lane, pool_layout, device_pages, impl, interpret) -> jax.Array:
    shard, offset = _lane_shards(leaf, lane, pool_layout)[0]
    tokens = token_indices_of_pages(device_pages + offset, pool_layout.page_size)
    data = _shard_data(shard)
    return _kernel(lpf_copy.lf_to_lpf, impl, data, tokens, interpret=interpret, padded=True)


def _scatter(
    target: _LoadTarget, kind: str, j: int, lane, pool_layout, device_pages, data, impl, interpret
) -> None:
    """Scatter `data` into leaf `kind[j]` of `target`, committing it after every covering
    shard (each donates its buffer: the replacement must be in the pool before the next
    kernel can raise)."""
    leaf = target.leaves[kind][j]
    covering = {s.device: off for s, off in _lane_shards(leaf, lane, pool_layout)}
    shards = leaf.addressable_shards
    arrays = [shard.data for shard in shards]
    for i, shard in enumerate(shards):
        if shard.device not in covering:
            continue
        tokens = token_indices_of_pages(
            device_pages + covering[shard.device], pool_layout.page_size
        )
        arrays[i] = _kernel(
            lpf_copy.lpf_to_lf, impl, _shard_data(shard), data, tokens, interpret=interpret
        )
        target.set(
            kind, j, jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays)
        )


def _backup(pool, host, layers, plan, pool_layout, lane, impl, kinds, interpret) -> None:
    direct = host.layout == "page_first_direct"
    staged = {}
    for layer in layers:
        for kind in host.kinds_at(layer):
            if kind not in kinds:
                continue
            leaf = getattr(pool, kind)[host.slot(kind, layer)]
            if direct:
                staged[kind, layer] = [
                    _gather(leaf, lane, pool_layout, plan.device_pages[i : i + 1], impl, interpret)
                    for i in range(plan.device_pages.size)
                ]
            else:
                staged[kind, layer] = _gather(
                    leaf, lane, pool_layout, plan.device_pages, impl, interpret
                )
    # One transfer for everything dispatched above (a page-by-page copy fetches per page).
    if direct:
        for (kind, layer), pages in staged.items():
            for i, page in enumerate(pages):
                host.write_pages(kind, layer, plan.host_pages[i : i + 1], jax.device_get(page))
        return
    n = plan.device_pages.size  # the staging is padded to its bucket: drop the tail here
    for (kind, layer), data in jax.device_get(staged).items():
        host.write_pages(kind, layer, plan.host_pages, np.asarray(data)[:n])


def _load(pool, host, layers, plan, pool_layout, lane, impl, kinds, interpret, commit) -> KVPool:
    direct = host.layout == "page_first_direct"
    target = _LoadTarget(pool, commit)
    for layer in layers:
        for kind in host.kinds_at(layer):
            if kind not in kinds:
                continue
            j = host.slot(kind, layer)
            rows = host.read_pages(kind, layer, plan.host_pages)
            if direct:
                for i in range(plan.device_pages.size):
                    _scatter(
                        target,
                        kind,
                        j,
                        lane,
                        pool_layout,
                        plan.device_pages[i : i + 1],
                        rows[i : i + 1],
                        impl,
                        interpret,
                    )
            else:
                _scatter(
                    target, kind, j, lane, pool_layout, plan.device_pages, rows, impl, interpret
                )
    return target.pool()


def _prepare(
    pool: KVPool,
    host: HostPool,
    layer: int | None,
    device_indices: np.ndarray,
    host_indices: np.ndarray,
    pool_layout: PoolLayout,
    impl: CopyImpl | None,
    kinds: Sequence[str] | None,
    *,
    load: bool,
) -> tuple[CopyImpl, tuple[str, ...], CopyPlan]:
    """Every check of a copy entry, in order, before any data moves (`layer`: None = all)."""
    impl = resolve_impl(host.layout, impl)
    kinds = _check_kinds(host, kinds)
    if layer is not None:
        _check_layer(pool, layer)
    _check_pool(pool, host, pool_layout)
    plan = plan_copy(
        host, pool_layout, device_indices=device_indices, host_indices=host_indices, load=load
    )
    return impl, kinds, plan


def backup_layer(
    pool: KVPool,
    host: HostPool,
    layer: int,
    *,
    device_indices: Int[np.ndarray, " device_tokens"],
    host_indices: Int[np.ndarray, " host_tokens"],
    pool_layout: PoolLayout,
    lane: int = 0,
    impl: CopyImpl | None = None,
    kinds: Sequence[str] | None = None,
    interpret: bool | None = None,
) -> None:
    """Copy layer `layer`'s pages of lane `lane` (latent, and index K + scale on a full
    indexer layer; `kinds` narrows it) into `host`. The pool is only read."""
    impl, kinds, plan = _prepare(
        pool, host, layer, device_indices, host_indices, pool_layout, impl, kinds, load=False
    )
    _backup(pool, host, (layer,), plan, pool_layout, lane, impl, kinds, interpret)


def load_layer(
    pool: KVPool,
    host: HostPool,
    layer: int,
    *,
    host_indices: Int[np.ndarray, " host_tokens"],
    device_indices: Int[np.ndarray, " device_tokens"],
    pool_layout: PoolLayout,
    lane: int = 0,
    impl: CopyImpl | None = None,
    kinds: Sequence[str] | None = None,
    interpret: bool | None = None,
    commit: Callable[[KVPool], None] | None = None,
) -> KVPool:
    """Load host pages into layer `layer` of lane `lane`; returns the new pool (the
    layer's leaves of `pool` are donated). `commit` gets the pool after every leaf
    scatter: what to keep if a later one raises (see the module docstring)."""
    impl, kinds, plan = _prepare(
        pool, host, layer, device_indices, host_indices, pool_layout, impl, kinds, load=True
    )
    return _load(pool, host, (layer,), plan, pool_layout, lane, impl, kinds, interpret, commit)


def backup_all_layers(
    pool: KVPool,
    host: HostPool,
    *,
    device_indices: Int[np.ndarray, " device_tokens"],
    host_indices: Int[np.ndarray, " host_tokens"],
    pool_layout: PoolLayout,
    lane: int = 0,
    impl: CopyImpl | None = None,
    kinds: Sequence[str] | None = None,
    interpret: bool | None = None,
) -> None:
    """`backup_layer` for every layer; LPF loops over the per-layer copies (S4.3)."""
    impl, kinds, plan = _prepare(
        pool, host, None, device_indices, host_indices, pool_layout, impl, kinds, load=False
    )
    layers = range(len(pool.latent))
    if host.layout == LPF:
        for layer in layers:
            _backup(pool, host, (layer,), plan, pool_layout, lane, impl, kinds, interpret)
    else:
        _backup(pool, host, layers, plan, pool_layout, lane, impl, kinds, interpret)


def load_all_layers(
    pool: KVPool,
    host: HostPool,
    *,
    host_indices: Int[np.ndarray, " host_tokens"],
    device_indices: Int[np.ndarray, " device_tokens"],
    pool_layout: PoolLayout,
    lane: int = 0,
    impl: CopyImpl | None = None,
    kinds: Sequence[str] | None = None,
    interpret: bool | None = None,
    commit: Callable[[KVPool], None] | None = None,
) -> KVPool:
    """`load_layer` for every layer, layer by layer; returns the new pool (`pool` is
    donated). `commit` as for `load_layer`: a caller that must keep a usable pool when
    the copy raises part-way (a server's device pool) stores what it is given."""
    impl, kinds, plan = _prepare(
        pool, host, None, device_indices, host_indices, pool_layout, impl, kinds, load=True
    )
    layers = range(len(pool.latent))
    return _load(pool, host, layers, plan, pool_layout, lane, impl, kinds, interpret, commit)


def copy_buckets(host: HostPool, pool_layout: PoolLayout) -> list[int]:
    """The padded page counts a copy of one lane reaches: 1 to the lane's usable pages
    (page 0 is reserved), or 1 only for a page-by-page layout."""
    if host.layout == "page_first_direct":
        return [1]
    return lpf_copy.copy_buckets(pool_layout.pages_per_rank - 1)


def warm_copies(
    pool: KVPool,
    host: HostPool,
    *,
    pool_layout: PoolLayout,
    impl: CopyImpl | None = None,
    interpret: bool | None = None,
) -> tuple[KVPool, int]:
    """Compile every program the backups and loads of this pool can dispatch (issue 25):
    per leaf kind (one leaf shape each), page bucket (`copy_buckets`) and device holding
    a lane, the gather and the scatter, run on that device's page 0 with its own bits
    (`lpf_copy.warm_copy_programs`). Returns the new pool (the warmed leaves are donated;
    hold the pool lock) and the programs run."""
    impl = resolve_impl(host.layout, impl)
    _check_pool(pool, host, pool_layout)
    buckets = copy_buckets(host, pool_layout)
    new = {kind: list(getattr(pool, kind)) for kind in ("latent", "index_k", "index_scale")}
    count = 0
    for kind in host.kinds:
        leaf = new[kind][0]  # every leaf of a kind has its shape: warming one warms all
        devices = {
            s.device
            for lane in range(pool_layout.lanes)
            for s, _ in _lane_shards(leaf, lane, pool_layout)
        }
        arrays = []
        for shard in leaf.addressable_shards:
            data = _shard_data(shard)
            if shard.device in devices:
                data, n = _kernel(
                    lpf_copy.warm_copy_programs, impl, data, buckets, interpret=interpret
                )
                count += n
            arrays.append(data)
        new[kind][0] = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays)
    logger.info(
        "host cache copies: %d programs compiled (%s, %d page buckets up to %d)",
        count,
        host.layout,
        len(buckets),
        buckets[-1] if buckets else 0,
    )
    return (
        KVPool(
            latent=tuple(new["latent"]),
            index_k=tuple(new["index_k"]),
            index_scale=tuple(new["index_scale"]),
        ),
        count,
    )
