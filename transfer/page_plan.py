"""Which pages each prefill CP rank sends to a decode server, and where they land.

Host-side numpy only (no JAX, no device), so the plan is cheap and unit-testable.

- `LayoutDescriptor`: the versioned description of a KV pool (page size, dtypes, dims,
  layers, full-indexer layers) that the handshake compares before any data moves
  (ARCHITECTURE "Transfer protocol shape"). Its `buffers()` are the pool leaves a request
  transfers: `latent[l]` `[pages, P, kv_cache_dim]` for every layer, and `index_k[j]`
  `[pages, P, index_head_dim]` (+ `index_scale[j]` `[pages, P]` float32 for fp8) for the
  j-th *full* indexer layer only, as `cpkv_jax.model.kv_cache.pool_shapes` lays them out.
- `plan_request`: per CP rank, the logical pages it owns (`p mod cp_size`, SPEC S1.1) with
  their prefill-side local page and their decode-side page `dst_pages[p]`, chosen by
  position, never by "the next slice" (SPEC S2.1). The partial tail page goes as a page;
  nothing is padded to a multiple of `cp_size` pages (SPEC S2.2). `plan_rank`: one rank's
  part of it, after the same checks of the whole tables (what a sender needs).
- `RequestPlan.descriptors`: byte ranges per (page run, kind, layer). Contiguous page
  runs (source and destination both advancing by one page) are coalesced into one
  descriptor per layer run. They are kept as arrays (`RankDescriptors`), since a
  fragmented 4096-page GLM-5 request has ~1M of them; iterate for `TransferDescriptor`s.
- `page_digest`: the per-page integrity digest the decode side checks (SPEC S2.4).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from jaxtyping import Int, UInt64

from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import ConfigError, CpkvError
from cpkv_jax.kv_layout import BUFFER_KINDS, BufferKind, KVLayout, numpy_dtype
from cpkv_jax.paging import TRASH_PAGE, owned_pages, owner_of_page, pages_for_tokens

try:
    import xxhash
except ImportError:  # surfaced by page_digest, never replaced by a slower digest
    xxhash = None

# Bump on any change of the descriptor fields, the page plan, the digest or the wire
# format of page data. 2: PageChunk carries PageSections of several buffers.
PROTOCOL_VERSION = 2


class PagePlanError(CpkvError, ValueError):
    """A page plan or layout query got inconsistent input (lengths, pages, kinds)."""


class LayoutMismatchError(CpkvError):
    """Prefill and decode KV layouts differ; the handshake refuses before data moves."""


def _dtype_name(dtype: Any, what: str) -> str:
    """Canonical numpy name of a dtype given by name, numpy/ml_dtypes type or dtype (or an
    index-K flag name such as "fp8_e4m3")."""
    try:
        return numpy_dtype(dtype).name
    except ConfigError as e:
        raise PagePlanError(f"{what} {e}") from e


# --- layout descriptor --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayoutDescriptor:
    """The KV pool layout both ends of a transfer must share (compared at handshake)."""

    protocol_version: int
    page_size: int
    num_layers: int
    full_indexer_layers: tuple[int, ...]
    kv_cache_dim: int
    latent_dtype: str
    index_head_dim: int
    index_k_dtype: str
    has_index_scale: bool

    def __post_init__(self) -> None:
        for name in ("protocol_version", "page_size", "num_layers", "kv_cache_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise PagePlanError(f"layout {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.index_head_dim, int | np.integer) or self.index_head_dim < 0:
            raise PagePlanError(
                f"layout index_head_dim must be an integer >= 0, got {self.index_head_dim!r}"
            )
        full = tuple(int(layer) for layer in self.full_indexer_layers)
        if list(full) != sorted(set(full)) or any(not 0 <= x < self.num_layers for x in full):
            raise PagePlanError(
                f"full_indexer_layers must be ascending, unique and in [0, num_layers="
                f"{self.num_layers}), got {self.full_indexer_layers!r}"
            )
        object.__setattr__(self, "full_indexer_layers", full)
        object.__setattr__(self, "latent_dtype", _dtype_name(self.latent_dtype, "latent_dtype"))
        object.__setattr__(self, "index_k_dtype", _dtype_name(self.index_k_dtype, "index_k_dtype"))
        object.__setattr__(self, "has_index_scale", bool(self.has_index_scale))

    @classmethod
    def from_model(
        cls, cfg: ModelConfig, page_size: int, dtype_name: Any, index_k_dtype: str
    ) -> LayoutDescriptor:
        """The descriptor of `KVLayout.from_model(cfg, page_size, dtype_name, index_k_dtype)`,
        the layout of the pools the servers build.

        `dtype_name` is the latent dtype ("bfloat16", `jnp.float32`, ...); `index_k_dtype`
        is a `kv_cache.IndexKDtype` ("fp8_e4m3", "bfloat16", "float32") or a numpy name.
        """
        return cls.of(KVLayout.from_model(cfg, page_size, dtype_name, index_k_dtype))

    @classmethod
    def of(cls, layout: KVLayout) -> LayoutDescriptor:
        """The wire form of a `KVLayout`."""
        kinds = layout.by_kind()
        index_k = kinds.get("index_k")
        return cls(
            protocol_version=PROTOCOL_VERSION,
            page_size=layout.page_size,
            num_layers=layout.num_layers,
            full_indexer_layers=() if index_k is None else index_k.layers,
            kv_cache_dim=kinds["latent"].feature[0],
            latent_dtype=kinds["latent"].dtype.name,
            index_head_dim=0 if index_k is None else index_k.feature[0],
            index_k_dtype="float32" if index_k is None else index_k.dtype.name,
            has_index_scale="index_scale" in kinds,
        )

    @functools.cached_property
    def kv_layout(self) -> KVLayout:
        """The `KVLayout` this descriptor names (buffers, leaves and bytes come from it)."""
        return KVLayout.mla(
            self.page_size,
            self.num_layers,
            self.full_indexer_layers,
            latent=(self.kv_cache_dim, self.latent_dtype),
            index_k=(self.index_head_dim, self.index_k_dtype),
            index_scale=self.has_index_scale,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict for the handshake (tuples become lists)."""
        out = dataclasses.asdict(self)
        out["full_indexer_layers"] = list(self.full_indexer_layers)
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LayoutDescriptor:
        """Inverse of `to_dict`; missing or unknown keys are an error naming them."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in raw]
        unknown = sorted(set(raw) - set(names))
        if missing or unknown:
            raise LayoutMismatchError(
                f"peer layout descriptor (protocol_version={raw.get('protocol_version')!r}, "
                f"ours {PROTOCOL_VERSION}) has missing fields {missing} and unknown fields "
                f"{unknown}; run the same cpkv-jax version on prefill and decode"
            )
        values = dict(raw)
        values["full_indexer_layers"] = tuple(values["full_indexer_layers"])
        return cls(**values)

    def mismatches(self, other: LayoutDescriptor) -> list[str]:
        """One line per differing field, `"name: ours != theirs"`; empty when compatible."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def check_compatible(self, other: LayoutDescriptor) -> None:
        """Raise `LayoutMismatchError` listing every differing field (ours != theirs)."""
        diff = self.mismatches(other)
        if diff:
            # Speculative decoding keeps the MTP layer's KV as one more layer.
            mtp = (
                " and the same --speculative-algorithm (the MTP layer's KV is one more layer)"
                if abs(self.num_layers - other.num_layers) == 1
                else ""
            )
            raise LayoutMismatchError(
                "prefill and decode KV layouts differ (ours != peer's): "
                + "; ".join(diff)
                + f"; start both servers with the same model, page size and KV dtypes{mtp}"
            )

    def buffers(self) -> tuple[tuple[BufferKind, int], ...]:
        """Every (kind, layer) buffer a request transfers, layer by layer.

        `latent` for every layer; `index_k` (and `index_scale` when present) only for
        full indexer layers. Layer-major, so a layer-wise sender can stream in this order.
        """
        return self.kv_layout.layer_buffers()

    def leaf_index(self, kind: BufferKind, layer: int) -> int:
        """Index of the (kind, layer) buffer in its `KVPool` tuple (`index_k[j]`: j-th full)."""
        self._check(kind, layer)
        return self.kv_layout.leaf_index(kind, layer)

    def page_bytes(self, kind: str, layer: int) -> int:
        """Bytes of one page of the (kind, layer) buffer; `kind` is a `BufferKind` (it
        may come off the wire: anything else raises `PagePlanError`)."""
        self._check(kind, layer)
        return self.kv_layout.page_bytes(kind, layer)

    def bytes_per_page(self) -> int:
        """Bytes of one logical page over every buffer (what one position costs to send)."""
        return self.kv_layout.bytes_per_page

    def _check(self, kind: str, layer: int) -> None:
        if kind not in BUFFER_KINDS:
            raise PagePlanError(f"unknown buffer kind {kind!r}; expected one of {BUFFER_KINDS}")
        if not 0 <= layer < self.num_layers:
            raise PagePlanError(f"layer {layer} is outside [0, num_layers={self.num_layers})")
        if kind != "latent" and layer not in self.full_indexer_layers:
            raise PagePlanError(
                f"layer {layer} is a shared indexer layer: it has no {kind} buffer (only "
                f"full layers {self.full_indexer_layers} do)"
            )
        if kind == "index_scale" and not self.has_index_scale:
            raise PagePlanError(
                f"index_k_dtype {self.index_k_dtype} stores no index_scale (only fp8 does)"
            )


# --- page plans ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PageRun:
    """`count` pages of one rank that are contiguous on both sides.

    Page `i` of the run is logical position `position_start + i * position_stride`, source
    local page `src_start + i`, destination page `dst_start + i`.
    """

    position_start: int
    src_start: int
    dst_start: int
    count: int
    position_stride: int

    def positions(self) -> Int[np.ndarray, " count"]:
        return self.position_start + self.position_stride * np.arange(self.count, dtype=np.int64)

    def src_pages(self) -> Int[np.ndarray, " count"]:
        return np.arange(self.src_start, self.src_start + self.count, dtype=np.int64)

    def dst_pages(self) -> Int[np.ndarray, " count"]:
        return np.arange(self.dst_start, self.dst_start + self.count, dtype=np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class RankPlan:
    """What CP rank `rank` sends: the logical pages it owns, ascending (SPEC S2.1).

    `positions`, `src_pages` (its local pages) and `dst_pages` (decode pages) are `[k]`
    int64, entry by entry. `run_offsets` `[len(runs) + 1]` are the indices into those
    arrays where each run starts (and the end). `tail_tokens` is the number of valid
    tokens in the request's partial tail page when this rank owns it, else 0.
    """

    rank: int
    positions: Int[np.ndarray, " k"]
    src_pages: Int[np.ndarray, " k"]
    dst_pages: Int[np.ndarray, " k"]
    run_offsets: Int[np.ndarray, " runs_plus_1"]
    runs: tuple[PageRun, ...]
    tail_tokens: int
    sends_aux: bool  # rank 0 sends the first output token and its log-prob

    @property
    def num_pages(self) -> int:
        return int(self.positions.size)


@dataclasses.dataclass(frozen=True)
class TransferDescriptor:
    """One byte copy: `nbytes` from `src_offset` of the rank's (kind, layer) buffer to
    `dst_offset` of the decode one; it carries `page_count` pages of positions
    `position_start, position_start + position_stride, ...`."""

    rank: int
    kind: BufferKind
    layer: int
    src_offset: int
    dst_offset: int
    nbytes: int
    position_start: int
    position_stride: int
    page_count: int


@dataclasses.dataclass(frozen=True, eq=False)
class RankDescriptors:
    """One rank's descriptors as arrays `[m]`, buffer-major (`buffers` order), runs in
    position order within a buffer. `buffer[i]` indexes `buffers`; offsets and sizes are
    bytes within that (kind, layer) buffer."""

    rank: int
    buffers: tuple[tuple[BufferKind, int], ...]
    buffer: Int[np.ndarray, " m"]
    src_offset: Int[np.ndarray, " m"]
    dst_offset: Int[np.ndarray, " m"]
    nbytes: Int[np.ndarray, " m"]
    position_start: Int[np.ndarray, " m"]
    page_count: Int[np.ndarray, " m"]
    position_stride: int

    def __len__(self) -> int:
        return int(self.buffer.size)

    def __iter__(self) -> Iterator[TransferDescriptor]:
        for i in range(len(self)):
            yield self[i]

    def __getitem__(self, i: int) -> TransferDescriptor:
        kind, layer = self.buffers[int(self.buffer[i])]
        return TransferDescriptor(
            rank=self.rank,
            kind=kind,
            layer=layer,
            src_offset=int(self.src_offset[i]),
            dst_offset=int(self.dst_offset[i]),
            nbytes=int(self.nbytes[i]),
            position_start=int(self.position_start[i]),
            position_stride=self.position_stride,
            page_count=int(self.page_count[i]),
        )

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


@dataclasses.dataclass(frozen=True, eq=False)
class RequestPlan:
    """Every CP rank's share of one request's PD transfer."""

    ranks: tuple[RankPlan, ...]
    num_pages: int
    num_tokens: int
    page_size: int
    cp_size: int

    def coverage(self) -> Int[np.ndarray, " pages"]:
        """How many ranks send each position, `[num_pages]` int64 (all ones when valid)."""
        sent = [r.positions for r in self.ranks]
        allpos = np.concatenate(sent) if sent else np.zeros(0, dtype=np.int64)
        return np.bincount(allpos, minlength=self.num_pages).astype(np.int64)

    def descriptors(self, layout: LayoutDescriptor) -> list[RankDescriptors]:
        """Per rank (index = rank), one descriptor per (run, kind, layer) of `layout`."""
        if layout.page_size != self.page_size:
            raise PagePlanError(
                f"plan has page_size={self.page_size} but the layout {layout.page_size}"
            )
        buffers = layout.buffers()
        page_bytes = np.array([layout.page_bytes(k, layer) for k, layer in buffers], np.int64)
        return [_rank_descriptors(r, buffers, page_bytes, self.cp_size) for r in self.ranks]


def _rank_descriptors(
    plan: RankPlan,
    buffers: tuple[tuple[BufferKind, int], ...],
    page_bytes: Int[np.ndarray, " b"],
    cp_size: int,
) -> RankDescriptors:
    starts = plan.run_offsets[:-1]
    counts = np.diff(plan.run_offsets)
    n_runs, n_buf = starts.size, page_bytes.size
    pb = np.repeat(page_bytes, n_runs)  # buffer-major: all runs of buffer 0, then 1, ...
    return RankDescriptors(
        rank=plan.rank,
        buffers=buffers,
        buffer=np.repeat(np.arange(n_buf, dtype=np.int32), n_runs),
        src_offset=np.tile(plan.src_pages[starts], n_buf) * pb,
        dst_offset=np.tile(plan.dst_pages[starts], n_buf) * pb,
        nbytes=np.tile(counts, n_buf) * pb,
        position_start=np.tile(plan.positions[starts], n_buf),
        page_count=np.tile(counts, n_buf),
        position_stride=cp_size,
    )


def _page_array(pages: npt.ArrayLike, name: str, n_pages: int) -> np.ndarray:
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise PagePlanError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise PagePlanError(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.size != n_pages:
        raise PagePlanError(
            f"{name} has {arr.size} entries but the request needs {n_pages} pages; pass "
            "one page per logical page position"
        )
    arr = arr.astype(np.int64)
    low = np.flatnonzero(arr <= TRASH_PAGE)
    if low.size:
        p = int(low[0])
        raise PagePlanError(
            f"{name}[{p}] = {int(arr[p])}: page {TRASH_PAGE} is the trash page and negative "
            "pages do not exist; every position needs a real page"
        )
    return arr


def plan_request(
    num_tokens: int,
    page_size: int,
    cp_size: int,
    src_local_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
) -> RequestPlan:
    """Split one request's page transfer over its CP ranks (SPEC S2.1-S2.2).

    `src_local_pages[p]` is the prefill-side local page of logical page `p` on lane
    `p % cp_size` (`RequestPageTable.local_pages()`); `dst_pages[p]` is the decode page
    for position `p`. Both have `pages_for_tokens(num_tokens, page_size)` entries, all
    >= 1 (page 0 is the trash page); decode pages are unique, and so are the local pages
    of each lane. Any array-like is accepted and checked here (not by annotations: the
    pages can come from the wire); raises `PagePlanError` naming the bad entry otherwise.
    """
    n, src, dst = _checked_tables(num_tokens, page_size, cp_size, src_local_pages, dst_pages)
    return RequestPlan(
        ranks=tuple(
            _rank_plan(r, num_tokens, page_size, cp_size, src, dst) for r in range(cp_size)
        ),
        num_pages=n,
        num_tokens=num_tokens,
        page_size=page_size,
        cp_size=cp_size,
    )


def plan_rank(
    rank: int,
    num_tokens: int,
    page_size: int,
    cp_size: int,
    src_local_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
) -> RankPlan:
    """`plan_request(...).ranks[rank]`, with the same checks of the whole tables, without
    building the other ranks' plans (each sender rank needs only its own)."""
    _, src, dst = _checked_tables(num_tokens, page_size, cp_size, src_local_pages, dst_pages)
    if not 0 <= rank < cp_size:
        raise PagePlanError(f"rank must be in [0, {cp_size}), got {rank}")
    return _rank_plan(rank, num_tokens, page_size, cp_size, src, dst)


def _checked_tables(
    num_tokens: int,
    page_size: int,
    cp_size: int,
    src_local_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
) -> tuple[int, np.ndarray, np.ndarray]:
    """(page count, src, dst) as int64 arrays after `plan_request`'s checks."""
    for name, value, low in (("num_tokens", num_tokens, 1), ("page_size", page_size, 1)):
        if value < low:
            raise PagePlanError(f"{name} must be >= {low}, got {value}")
    if cp_size < 1:
        raise PagePlanError(f"cp_size must be >= 1, got {cp_size}")
    n = pages_for_tokens(num_tokens, page_size)
    src = _page_array(src_local_pages, "src_local_pages", n)
    dst = _page_array(dst_pages, "dst_pages", n)
    _check_unique(dst, "dst_pages", "decode page")
    lanes = owner_of_page(np.arange(n, dtype=np.int64), cp_size)
    _check_unique(lanes * (int(src.max()) + 1) + src, "src_local_pages", "local page of a lane")
    return n, src, dst


def _rank_plan(
    r: int, num_tokens: int, page_size: int, cp_size: int, src: np.ndarray, dst: np.ndarray
) -> RankPlan:
    """Rank `r`'s plan from checked tables."""
    n = src.size
    tail = num_tokens - (n - 1) * page_size if num_tokens % page_size else 0
    positions = owned_pages(n, r, cp_size)
    s, d = src[positions], dst[positions]
    # A run continues while both sides advance by exactly one page.
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    offsets = np.concatenate(([0], breaks, [positions.size])) if positions.size else np.zeros(1)
    offsets = offsets.astype(np.int64)
    runs = tuple(
        PageRun(int(p), int(a), int(b), int(c), cp_size)
        for p, a, b, c in zip(
            positions[offsets[:-1]].tolist(),
            s[offsets[:-1]].tolist(),
            d[offsets[:-1]].tolist(),
            np.diff(offsets).tolist(),
            strict=True,
        )
    )
    return RankPlan(
        rank=r,
        positions=positions,
        src_pages=s,
        dst_pages=d,
        run_offsets=offsets,
        runs=runs,
        tail_tokens=tail if r == int(owner_of_page(n - 1, cp_size)) else 0,
        sends_aux=r == 0,
    )


def owner_major_order(n_pages: int, cp_size: int) -> Int[np.ndarray, " pages"]:
    """Positions `[0, n_pages)` grouped by owner rank, each group ascending (int64).

    Decode pages are chosen by position, so rank `r`'s pages `r, r + cp, ...` land on
    `dst_pages[r], dst_pages[r + cp], ...`. Assigning a contiguous block of decode pages
    in this order (`dst_pages[owner_major_order(n, cp)] = block`) makes every rank's
    destinations contiguous, so its runs coalesce; plain `arange` order does not when
    `cp_size > 1`.
    """
    return np.concatenate([owned_pages(n_pages, r, cp_size) for r in range(cp_size)])


def _check_unique(keys: np.ndarray, name: str, what: str) -> None:
    order = np.argsort(keys, kind="stable")
    dup = np.flatnonzero(np.diff(keys[order]) == 0)
    if dup.size:
        first, second = int(order[dup[0]]), int(order[dup[0] + 1])
        raise PagePlanError(
            f"{name}[{first}] and {name}[{second}] are the same {what}; each logical "
            "page needs its own page"
        )


# --- integrity ----------------------------------------------------------------------------


def page_digest(array_bytes: bytes | bytearray | memoryview | np.ndarray) -> int:
    """64-bit xxh3 digest (`xxhash.xxh3_64_intdigest`) of one page's bytes.

    Non-cryptographic: it catches corruption and mis-addressed pages, not tampering.
    A numpy array (any dtype, bfloat16 / fp8 included) is digested as its C-order bytes.
    """
    if xxhash is None:
        raise ImportError(
            "page_digest needs the 'xxhash' package (pip install xxhash); there is no "
            "slower fallback digest, so prefill and decode always agree on the algorithm"
        )
    if isinstance(array_bytes, np.ndarray):
        # ml_dtypes arrays do not export a buffer; their bytes do, through a uint8 view.
        array_bytes = np.ascontiguousarray(array_bytes).reshape(-1).view(np.uint8)
    return xxhash.xxh3_64_intdigest(array_bytes)


def page_digests(pages: np.ndarray) -> UInt64[np.ndarray, " pages"]:
    """`page_digest` of every `pages[i]` of a `[pages, ...]` array, `[pages]` uint64."""
    pages = np.ascontiguousarray(pages)
    flat = pages.reshape(pages.shape[0], -1).view(np.uint8) if pages.size else pages
    return np.fromiter(
        (page_digest(flat[i]) for i in range(pages.shape[0])), np.uint64, pages.shape[0]
    )


def row_digests(
    buffer: np.ndarray, rows: Int[np.ndarray, " k"] | Sequence[int]
) -> UInt64[np.ndarray, " k"]:
    """`page_digest(buffer[rows[i]])` of rows of a C-contiguous `[R, page_bytes]` uint8
    buffer, `[k]` uint64, without copying the rows (staging regions, registered pools)."""
    if buffer.ndim != 2 or buffer.dtype != np.uint8 or not buffer.flags.c_contiguous:
        raise PagePlanError(
            f"row_digests needs a C-contiguous 2-D uint8 buffer, got {buffer.shape} {buffer.dtype}"
        )
    if xxhash is None:
        page_digest(b"")  # raises the ImportError that names the package
    nb = buffer.shape[1]
    flat = memoryview(buffer.reshape(-1))
    idx = np.asarray(rows, np.int64).reshape(-1)
    h = xxhash.xxh3_64_intdigest
    return np.fromiter((h(flat[r * nb : (r + 1) * nb]) for r in idx.tolist()), np.uint64, idx.size)
