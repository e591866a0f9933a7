"""CPU-only, stream-aware peak of the transient device buffers of one CP shared-KV
prefill step (SPEC S9.1-S9.2), and the startup smoke allocation of the limit (S9.4).

The admission gate (S9.3) asks, per candidate batch, how many bytes each CP rank needs
on top of its persistent pools and weights for the buffers CP shared-KV prefill creates
and that grow with the batch. The answer is integer arithmetic on the step's bucketed
shapes - no JAX, no device, no sync - cheap enough for every admission decision (JAX is
imported lazily, by `startup_smoke_allocation` only).

Shapes (per rank), bucketed exactly as `CPPrefillRunner.plan_step` does (`step_shape`):
rows `B = pow2(requests)`, zigzag block `pow2(ceil(max_extend / 2cp))`, tokens per rank
`T = 2 * block`, per step `Ta = cp * T`, page-table width `W = cp * pow2(ceil(max_pages /
cp))`, full view `S = W * page_size` tokens, owned width `Wo = W / cp`, `K = min(
index_topk, S)`. Per token: latent `L = (kv_lora_rank + qk_rope_head_dim) * dtype bytes`
as stored and `L'` as the backend moves it in gathers, all-gathers and scatters; index K
`I' = index_head_dim * k'` likewise (`LoweringProfile.moved_as`: XLA:CPU moves fp8 as f16
and bf16 as f32; XLA:GPU as stored); scale `c = 4` with fp8 index K (else 0);
`Di = index_head_dim`, `Hi = index_n_heads`.

Terms (`Estimate.terms`, bytes per rank) and their lifetimes:
- `host_metadata` `13*B*T + 4*B*W + 8*B`: the rank's input ids, positions, write slots
  (int32) and valid mask (bool); page table, kv lengths, last index. Whole step.
- `slot_map` `4*B*Ta`, `owned_page_ids` `4*B*Wo`, `rank_id` 4: rank-local write slots,
  owned page ids and partition id, which XLA derives once (CSE over all the step's writes
  and views) and keeps for the whole step. Together: `remap_metadata`.
- `slots_all_gather` `4*B*T + 4*B*Ta`: write slots relaid out and all-gathered; during
  the write phase only.
- `transfer_descriptors` `16*B*Wo`: the rank's owned-page descriptor list for the PD
  sender (SPEC S2.1), one int32 (row, logical page, local page, tokens) per owned
  page-table entry of the bucketed batch. Whole step.
- `kv_rows` (`CPKVIO.write`: all-gathered new rows). Each write of feature size `f` has a
  local relayout `B*T*f`, the all-gathered rows `B*Ta*f` and a logical-order copy
  `B*Ta*f` (XLA lays an all-gather out gathered-axis-major, then copies it back). One
  layer's all-gathers may be live together (a backend may combine them), their copies
  one at a time: `rows_latent = (B*T + 2*B*Ta) * L'` on every layer; full indexer layers
  add `rows_index_k = (B*T + B*Ta) * (I' + c)` (+ the excess of the largest copy over the
  latent's). The scatter into the pool is in place (`kv_cache.write_rows`: XLA:CPU had
  upcast a narrow pool to scatter into it, a copy of the rank's whole pool per write, until
  2026-12-07; narrow pools are now written through their integer view there).
- `latent_view` (`CPKVIO.view`): owned pages `B*Wo*P*L'`, all-gathered `B*S*L'`, and the
  logical-order copy `B*S*L` (the full view attention reads). The all-gather only needs
  the layer's latent write, so it is assumed issued early: `latent_owned +
  latent_gathered` are live through the full layer's indexer phases too.
- `index_k_view` (full layers only): owned `B*Wo*P*(I' + c)`, all-gathered
  `B*S*(I' + c)`, float32 dequantized view `index_k_dequantized = 4*B*S*Di` (with float32
  index K this is the logical-order copy instead; the copy fuses into the dequantization).
- `indexer_logits` (full layers only, `index_scores` + `select_topk`): `logits =
  4*B*Tb*Hi*S`, `logits_relu` (same size: XLA:CPU does not update the dot output in
  place), `scores = 4*B*Tb*S`, `topk = 4*B*T*K` - counted live together. `Tb` is the
  indexer's token block, `cpkv_jax.buckets.block_rows(T, 4*B*Hi*S, block_bytes)`: `T`
  when one block's logits fit `block_bytes` (`TRANSIENT_BLOCK_BYTES`, 1 GiB, by default),
  else a multiple of 16 rows that fits - the model runs its blocks one after another and
  each block selects its own top-k (`indexer_topk`), so only one block's scores exist; a
  blocked indexer adds `indexer_block_scores = 4*B*Tb*(S + Hi*(Di + 1))` (the block's
  scores before the causal mask, and its slice of the queries and head weights).
  The logits phase before them holds `index_k_dequantized + logits`. The top-k stays
  live through the shared layers that reuse it.
- `sparse_rows` `4*B*Ts*K*(kv_lora_rank + qk_rope_head_dim)`: the float32 rows sparse
  attention gathers from the full view, for one token block `Ts` (`block_rows` as above,
  with `4*B*K*(kv_lora_rank + qk_rope_head_dim)` bytes per row).

Stream-aware total. A full layer runs the phases write -> index_view -> logits ->
scores -> latent_view -> sparse_rows (a shared layer: write -> latent_view ->
sparse_rows); a phase's bytes are the sum of what is live in it (see `estimate_shape`),
a layer's peak the max over its phases. Layers run in sequence (layer l+1's write needs
layer l's output), so the step's peak is the max over layer types, not a sum.

Not counted (the same with or without CP and outside S9.1's list): weights, persistent
pools, projections, MoE, the per-head K/V that `sparse_attention`'s `expanded` form
builds from the gathered rows, the LM head. `latent_view.astype(float32)` in sparse
attention is assumed fused into the row gather (no float32 copy of a bf16 view). The
model is of CP shared-KV mode (replicated pools have no all-gathers).

Bytes are live bytes: allocator fragmentation is not modelled.

Owner attention (`--cp-attention owner`, `attention="owner"`): no full view is built, so
the phases are write -> index_view (the owned index K and its float32 dequantization,
`S / cp` tokens) -> scores (per block of local tokens: the `cp x` gathered indexer
queries, their logits, ReLU copy and scores against the owned keys, the local, exchanged
and sorted top-k candidates, and the step's top-k) -> sparse_rows (per attention block:
the gathered absorbed queries and their top-k, the selected rows of the exact
fall-back and of the compact pass, scores and probabilities, the partial outputs before
and after the all-to-all; the rank's absorbed queries and merged output). An upper-bound
model of `cpkv_jax.owner_attention`'s dataflow; on XLA:CPU it covers the whole compiled
owner step (MoE included) at 1.07-1.12x where the CP buffers dominate
(`test_owner_attention_estimate_bounds_the_compiled_step`).

Calibration: `tests/serving/test_buffer_estimator.py` checks the `XLA_CPU` profile (float32
compute, fp8 index K, as the tiny model runs) against `compiled.memory_analysis()` per
buffer kind and for two-layer probes (full + shared, full + full): estimate >= XLA and
<= 1.25 x XLA, and with bf16 latent pools. `XLA_GPU` keeps the same dataflow with every
dtype moved as stored, plus the
previous full layer's top-k (`topk_carried`) in a full layer's indexer phases. Measured
on an H200 (2026-12-04, `benchmarks/results/buffer_estimator_h200_2026-12-04.json`):
without that term one GLM-5 probe (two full layers, a 16K chunk) was 1.2% under XLA; with
it every recorded probe is covered (`test_buffer_estimator_units.py`), 1.05-1.24x at
GLM-5 dims.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from cpkv_jax.buckets import TRANSIENT_BLOCK_BYTES, StepShape, block_rows, step_shape
from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import ConfigError, InputError
from cpkv_jax.kv_layout import INDEX_K_NUMPY, KVLayout

# Breakdown keys (one per buffer kind of SPEC S9.1).
KINDS = (
    "latent_view",
    "index_k_view",
    "remap_metadata",
    "kv_rows",
    "indexer_logits",
    "sparse_rows",
    "transfer_descriptors",
)
LAYER_TYPES = ("full", "shared")
# One owned-page transfer descriptor: int32 (row, logical page, local page, tokens).
DESCRIPTOR_BYTES = 16

_F32 = 4
_I32 = 4


class BufferLimitError(ConfigError):
    """`--cp-shared-kv-prefill-max-buffer-size` is invalid or does not fit on a device."""


@dataclasses.dataclass(frozen=True)
class LoweringProfile:
    """How a backend's XLA materializes the step's buffers, where backends differ.

    `moved_as` maps a storage dtype name to the bytes per element the backend uses for it
    in gathers and all-gathers. XLA:CPU gathers fp8 as f16 (the CP collectives move every
    dtype's bits, `kv_cache.as_bits`; bf16 moved as f32 until its writes went through
    integer views too).
    """

    name: str
    moved_as: tuple[tuple[str, int], ...] = ()
    # The previous full layer's top-k indices still live in a full layer's indexer phases
    # (measured on XLA:GPU: two full layers hold 8 KiB = top-k 2,048 x int32 per query
    # token more than full + shared, H200 2026-12-04).
    carries_topk: bool = False
    # CPU's code paths (`cpkv_jax.model.kv_cache`): a decode step's XLA indexer scores in
    # page blocks up to the longest row (`blocked_index_scores`) instead of the whole view,
    # and a pool narrower than 4 bytes is written through its integer view (`write_rows`),
    # which XLA:CPU copies (the decode step estimate's `pool_copy`).
    cpu_paths: bool = False

    def in_flight_itemsize(self, dtype_name: str, itemsize: int) -> int:
        return dict(self.moved_as).get(dtype_name, itemsize)


XLA_CPU = LoweringProfile("xla_cpu", moved_as=(("float8_e4m3fn", 2),), cpu_paths=True)
XLA_GPU = LoweringProfile("xla_gpu", carries_topk=True)


def profile_for_platform(platform: str) -> LoweringProfile:
    """The profile of a JAX platform name (`jax.devices()[0].platform`)."""
    return XLA_CPU if platform == "cpu" else XLA_GPU


@dataclasses.dataclass(frozen=True)
class RequestShape:
    """One request of a candidate batch: tokens prefilled this step, cached prefix."""

    extend_tokens: int
    cached_tokens: int = 0

    @property
    def kv_tokens(self) -> int:
        """KV length after the step."""
        return self.cached_tokens + self.extend_tokens


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Peak transient bytes per CP rank of one step (see the module docstring).

    `total_bytes` is the stream-aware peak: max over layer types of the max over their
    phases. `breakdown[kind]` is the kind's own peak in the worst layer type (kinds peak in
    different phases, so the breakdown does not sum to the total); `layer_breakdown`
    gives it per layer type. `peak_layer` / `peak_phase` say where the total is reached
    and `peak_contributions` what is live there (it sums to `total_bytes`). `terms` are
    the fine-grained buffers (bytes) the kinds are made of.
    """

    total_bytes: int
    breakdown: dict[str, int]
    layer_bytes: dict[str, int]
    layer_breakdown: dict[str, dict[str, int]]
    peak_layer: str
    peak_phase: str
    peak_contributions: dict[str, int]
    terms: dict[str, int]
    shape: StepShape | None


def _zero_estimate() -> Estimate:
    zeros = dict.fromkeys(KINDS, 0)
    return Estimate(
        0,
        dict(zeros),
        dict.fromkeys(LAYER_TYPES, 0),
        {t: dict(zeros) for t in LAYER_TYPES},
        "none",
        "none",
        dict(zeros),
        {},
        None,
    )


class BufferEstimator:
    """Peak transient bytes per CP rank of a candidate CP shared-KV prefill batch.

    Per-model constants are computed once here; `estimate` is integer arithmetic on the
    batch's three maxima (request count, longest extend, longest KV). It also satisfies
    the `PrefillAdder` estimator protocol (`estimate_bytes`).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        cp_size: int,
        page_size: int,
        dtype: Any = "bfloat16",
        index_k_dtype: str = "fp8_e4m3",
        profile: LoweringProfile = XLA_GPU,
        block_bytes: int = TRANSIENT_BLOCK_BYTES,
        attention: str = "full-view",
    ):
        if attention not in ("full-view", "owner"):
            raise ConfigError(f"attention must be 'full-view' or 'owner', got {attention!r}")
        self.attention = attention
        if cp_size < 1 or page_size < 1:
            raise ConfigError(f"cp_size and page_size must be >= 1, got {cp_size}, {page_size}")
        if index_k_dtype not in INDEX_K_NUMPY:
            raise ConfigError(
                f"index_k_dtype {index_k_dtype!r} is not one of {sorted(INDEX_K_NUMPY)}"
            )
        # What a token stores comes from the model's KV layout, as for the pools.
        kv = KVLayout.from_model(cfg, page_size, dtype, index_k_dtype)
        latent = kv.by_kind()["latent"]
        latent_dtype, index_dtype = latent.dtype, INDEX_K_NUMPY[index_k_dtype]
        scale = kv.buffer("index_scale")
        if block_bytes <= 0:
            raise ConfigError(f"block_bytes must be > 0, got {block_bytes}")
        self.cfg, self.cp_size, self.page_size = cfg, cp_size, page_size
        self.block_bytes = block_bytes  # the model's token-block budget (buckets.block_rows)
        self.index_k_dtype, self.profile = index_k_dtype, profile
        self.has_full = bool(cfg.full_indexer_layers)
        self.has_shared = len(cfg.full_indexer_layers) < cfg.num_hidden_layers
        self.index_topk = cfg.index_topk
        # Per-token bytes of each stream: as stored, and as the backend moves it.
        lat_moved = profile.in_flight_itemsize(latent_dtype.name, latent_dtype.itemsize)
        k_moved = profile.in_flight_itemsize(index_dtype.name, index_dtype.itemsize)
        self.latent_token = latent.token_bytes
        self.latent_moved = latent.feature[0] * lat_moved
        self.index_k_moved = cfg.index_head_dim * k_moved
        self.scale_token = 0 if scale is None else scale.token_bytes
        self.dequant_token = cfg.index_head_dim * _F32
        self.logits_token = cfg.index_n_heads * _F32  # per (query token, key token)
        self.sparse_row = cfg.kv_cache_dim * _F32  # per (query token, selected token)

    # ---- shapes -------------------------------------------------------------------------
    def step_shape(
        self, num_requests: int, max_extend_tokens: int, max_kv_tokens: int
    ) -> StepShape:
        return step_shape(
            num_requests, max_extend_tokens, max_kv_tokens, self.cp_size, self.page_size
        )

    # ---- estimates ----------------------------------------------------------------------
    def estimate(self, batch: Sequence[RequestShape]) -> Estimate:
        """Peak transient bytes per rank of a step over `batch` (empty -> zero)."""
        if not batch:
            return _zero_estimate()
        max_ext = max_kv = 0
        for r in batch:
            if r.extend_tokens < 0 or r.cached_tokens < 0:
                raise InputError(f"negative token count in {r}")
            max_ext = max(max_ext, r.extend_tokens)
            max_kv = max(max_kv, r.cached_tokens + r.extend_tokens)
        return self.estimate_for(len(batch), max_ext, max_kv)

    def estimate_bytes(self, batch: Sequence[Any]) -> int:
        """`PrefillAdder` protocol: items with `extend_tokens` and `cached_tokens` (or a
        `candidate.cached_tokens`, as `Admitted` has)."""
        if not batch:
            return 0
        max_ext = max_kv = 0
        for a in batch:
            cached = a.cached_tokens if hasattr(a, "cached_tokens") else a.candidate.cached_tokens
            max_ext = max(max_ext, a.extend_tokens)
            max_kv = max(max_kv, cached + a.extend_tokens)
        return self.estimate_for(len(batch), max_ext, max_kv).total_bytes

    def estimate_for(
        self, num_requests: int, max_extend_tokens: int, max_kv_tokens: int
    ) -> Estimate:
        """The estimate of any batch with these maxima (the step shapes depend on no more)."""
        shape = self.step_shape(num_requests, max_extend_tokens, max_kv_tokens)
        return self.estimate_shape(shape)

    def estimate_shape(self, shape: StepShape) -> Estimate:
        """The estimate for explicit step shapes."""
        cp = self.cp_size
        b, t = shape.rows, shape.tokens_per_rank
        t_all, w, s = cp * t, shape.width, shape.width * self.page_size
        wo = w // cp
        k = min(self.index_topk, s)
        bs, bt, bt_all = b * s, b * t, b * t_all

        # Step-long metadata and descriptors.
        host = bt * (3 * _I32 + 1) + b * w * _I32 + 2 * b * _I32
        slot_map, owned = bt_all * _I32, b * wo * _I32
        rank_id = _I32  # the device's partition id, a scalar every CP program derives
        slots_ag = bt * _I32 + bt_all * _I32
        desc = b * wo * DESCRIPTOR_BYTES
        meta_step = host + slot_map + owned + rank_id

        # All-gathered rows: every write's local relayout + all-gathered copy may be live at
        # once (all-gathers can be combined), their logical-order copies one at a time.
        lat, kk, sc = self.latent_moved, self.index_k_moved, self.scale_token
        rows_latent = (bt + 2 * bt_all) * lat
        rows_index = (bt + bt_all) * (kk + sc) + bt_all * (max(lat, kk, sc) - lat)
        lat_gathered = bs * lat
        lat_local = lat_gathered // cp
        lat_full = bs * self.latent_token
        idx_gathered = bs * (kk + sc)
        idx_local = idx_gathered // cp
        dequant = bs * self.dequant_token
        # The indexer and sparse attention run over the query tokens in blocks sized as the
        # model sizes them (`block_rows`); their largest transients are one block's.
        logits_rows = block_rows(t, b * s * self.logits_token, self.block_bytes)
        sparse_rows = block_rows(t, b * k * self.sparse_row, self.block_bytes)
        logits = b * logits_rows * s * self.logits_token
        # A blocked indexer selects each block's top-k from that block's scores, so only
        # one block's scores exist (`indexer_topk`), held before and after the causal mask,
        # with the block's slice of the queries and head weights.
        scores = b * logits_rows * s * _F32
        block_scores = 0
        if logits_rows < t:
            block_q = self.cfg.index_n_heads * (self.cfg.index_head_dim + 1) * _F32
            block_scores = b * logits_rows * (s * _F32 + block_q)
        topk = bt * k * _I32
        sparse = b * sparse_rows * k * self.sparse_row

        terms = {
            "host_metadata": host,
            "slot_map": slot_map,
            "owned_page_ids": owned,
            "rank_id": rank_id,
            "slots_all_gather": slots_ag,
            "transfer_descriptors": desc,
            "rows_latent": rows_latent,
            "rows_index_k": rows_index,
            "latent_owned": lat_local,
            "latent_gathered": lat_gathered,
            "latent_full_view": lat_full,
            "index_k_owned": idx_local,
            "index_k_gathered": idx_gathered,
            "index_k_dequantized": dequant,
            "logits": logits,
            "logits_relu": logits,
            "indexer_block_scores": block_scores,
            "scores": scores,
            "topk": topk,
            "sparse_rows": sparse,
        }
        lat_view = lat_local + lat_gathered + lat_full
        # A phase's kv_rows column: the write's own rows (the scatter itself is in place).
        rows_full, rows_shared = rows_latent + rows_index, rows_latent
        lat_early = lat_local + lat_gathered  # the latent all-gather, issued early
        idx_view = idx_local + idx_gathered + dequant
        window = 2 * logits + block_scores + scores + topk
        meta_write = meta_step + slots_ag
        carried = topk if self.profile.carries_topk and len(self.cfg.full_indexer_layers) > 1 else 0
        terms["topk_carried"] = carried
        # Phases: name, then the live bytes of each kind in `KINDS` order.
        phases = {
            "full": (
                ("write", 0, 0, meta_write, rows_full, carried, 0, desc),
                ("index_view", lat_early, idx_view, meta_step, 0, carried, 0, desc),
                ("logits", lat_early, dequant, meta_step, 0, logits + carried, 0, desc),
                ("scores", lat_early, 0, meta_step, 0, window + carried, 0, desc),
                ("latent_view", lat_view, 0, meta_step, 0, topk, 0, desc),
                ("sparse_rows", lat_full, 0, meta_step, 0, topk, sparse, desc),
            ),
            # The top-k of the preceding full layer stays live through shared layers.
            "shared": (
                ("write", 0, 0, meta_write, rows_shared, topk, 0, desc),
                ("latent_view", lat_view, 0, meta_step, 0, topk, 0, desc),
                ("sparse_rows", lat_full, 0, meta_step, 0, topk, sparse, desc),
            ),
        }
        if self.attention == "owner":
            return self._estimate_owner(
                shape, terms, meta_step, meta_write, rows_full, rows_shared, desc
            )
        return self._assemble(phases, terms, shape)

    def _assemble(self, phases: dict, terms: dict[str, int], shape: StepShape) -> Estimate:
        """The stream-aware peak over `phases` (per layer type: name, then the live bytes
        of each kind in `KINDS` order)."""
        layer_bytes = dict.fromkeys(LAYER_TYPES, 0)
        layer_breakdown = {}
        best: tuple = (-1,)
        for name in LAYER_TYPES:
            if not (self.has_full if name == "full" else self.has_shared):
                layer_breakdown[name] = dict.fromkeys(KINDS, 0)
                continue
            rows = phases[name]
            layer_breakdown[name] = {
                kind: max(r[c] for r in rows) for c, kind in enumerate(KINDS, start=1)
            }
            for r in rows:
                total = sum(r[1:])
                if total > layer_bytes[name]:
                    layer_bytes[name] = total
                if total > best[0]:
                    best = (total, name, r)
        total, peak_layer, peak = best
        breakdown = {
            kind: max(layer_breakdown["full"][kind], layer_breakdown["shared"][kind])
            for kind in KINDS
        }
        return Estimate(
            total_bytes=total,
            breakdown=breakdown,
            layer_bytes=layer_bytes,
            layer_breakdown=layer_breakdown,
            peak_layer=peak_layer,
            peak_phase=peak[0],
            peak_contributions=dict(zip(KINDS, peak[1:], strict=True)),
            terms=terms,
            shape=shape,
        )

    def _estimate_owner(
        self,
        shape: StepShape,
        terms: dict[str, int],
        meta_step: int,
        meta_write: int,
        rows_full: int,
        rows_shared: int,
        desc: int,
    ) -> Estimate:
        """Owner attention (`--cp-attention owner`, `cpkv_jax.owner_attention`): no full
        view. Per rank: the owned index K and its float32 dequantization (`S / cp`
        tokens); per block of local query tokens, the `cp x` gathered queries, their
        logits / scores against the owned keys, local and merged candidates; per
        attention block, the gathered absorbed queries, the selected rows (the exact
        fall-back's `k` columns and the compact pass's, both counted), scores and
        probabilities, and the partial outputs before and after the all-to-all. An
        upper-bound model of the same dataflow, not calibrated against XLA as the
        full-view phases are (`tests/serving/test_buffer_estimator.py` checks it against
        the compiled owner step's total); the memory plan takes the larger of the two."""
        cfg, cp = self.cfg, self.cp_size
        b, t = shape.rows, shape.tokens_per_rank
        s = shape.width * self.page_size
        so = s // cp
        k, kl = min(self.index_topk, s), min(self.index_topk, so)
        cap = min(k, -(-2 * k // cp))
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        h, row = cfg.num_attention_heads, cfg.kv_cache_dim
        lora = cfg.kv_lora_rank
        idx_owned = b * so * (self.index_k_moved + self.scale_token)
        dequant = b * so * self.dequant_token
        tb = block_rows(t, b * cp * (hi + 2) * so * _F32, self.block_bytes)
        gathered_q = b * cp * tb * hi * (di + 1) * _F32
        logits = b * cp * tb * hi * so * _F32
        scores = b * cp * tb * so * _F32
        candidates = 3 * b * cp * tb * kl * 2 * _I32  # local top-k, all-to-all, sorted
        topk = b * t * k * _I32
        window = gathered_q + 2 * logits + scores + candidates + topk
        ta = block_rows(t, b * cp * k * row * _F32, self.block_bytes)
        query = b * t * h * row * _F32
        attn = (
            b
            * cp
            * ta
            * (
                h * row * _F32  # gathered queries
                + k * _I32  # their top-k
                + (k + cap) * row * _F32  # the selected rows: fall-back and compact
                + 2 * h * k * _F32  # scores, probabilities
                + 2 * h * (lora + 2) * _F32  # partials before and after the all-to-all
            )
        )
        attn += query + b * t * h * lora * _F32  # the absorbed queries and the merged output
        terms = {
            **terms,
            "latent_owned": 0,
            "latent_gathered": 0,
            "latent_full_view": 0,
            "index_k_gathered": 0,
            "index_k_owned": idx_owned,
            "index_k_dequantized": dequant,
            "logits": logits,
            "logits_relu": logits,
            "scores": scores,
            "indexer_block_scores": gathered_q + candidates,
            "sparse_rows": attn,
        }
        phases = {
            "full": (
                ("write", 0, 0, meta_write, rows_full, 0, 0, desc),
                ("index_view", 0, idx_owned + dequant, meta_step, 0, 0, 0, desc),
                ("scores", 0, dequant, meta_step, 0, window, 0, desc),
                ("sparse_rows", 0, 0, meta_step, 0, topk, attn, desc),
            ),
            "shared": (
                ("write", 0, 0, meta_write, rows_shared, topk, 0, desc),
                ("sparse_rows", 0, 0, meta_step, 0, topk, attn, desc),
            ),
        }
        return self._assemble(phases, terms, shape)


# ---- SPEC S9.4 --------------------------------------------------------------------------
def startup_smoke_allocation(max_buffer_bytes: int | None, devices: Sequence[Any]) -> None:
    """Allocate `max_buffer_bytes` once on every (addressable) CP device, then free it.

    No-op when the limit is not configured. Raises `BufferLimitError` naming the flag,
    the size and the device when an allocation fails. Multi-host: each process checks
    the devices it can address (each runs this at its own startup).
    """
    if max_buffer_bytes is None:
        return
    if isinstance(max_buffer_bytes, bool) or max_buffer_bytes <= 0:
        raise BufferLimitError(
            f"--cp-shared-kv-prefill-max-buffer-size must be a positive byte count, got "
            f"{max_buffer_bytes!r}; leave it unset for no limit"
        )
    import jax  # lazily: the estimator above must stay importable without JAX
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    for device in devices:
        if device.process_index != jax.process_index():
            continue
        try:
            # Created on the device itself (no host copy) and written, so it is backed.
            buf = jax.jit(
                lambda: jnp.zeros((max_buffer_bytes,), jnp.uint8),
                out_shardings=SingleDeviceSharding(device),
            )()
            buf.block_until_ready()
            buf.delete()
        except Exception as e:  # XLA reports OOM as JaxRuntimeError / MemoryError
            raise BufferLimitError(
                f"--cp-shared-kv-prefill-max-buffer-size {max_buffer_bytes} "
                f"({_human(max_buffer_bytes)}) does not fit on device {device}: {e}. "
                "Lower the limit or free device memory (e.g. a smaller --kv-pool-size)."
            ) from e


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"
