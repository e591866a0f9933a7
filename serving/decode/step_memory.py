"""Transient device bytes of a decode engine's steps (issue 36 item 6): the term the
startup memory plan (`serving.prefill.memory_plan`) adds on decode and unified servers
for the step's own buffers, on top of weights, the KV pool and FP8 dequantization.

Integer arithmetic on the step's bucketed shapes, no JAX (like the prefill
`BufferEstimator`). One step of `B` rows (per DP rank) of `T` tokens each over page tables
of `W` pages, `S = W * page_size` tokens; `Di` / `Hi` the indexer's head dim / heads, `K =
min(index_topk, S)`, `c + r` the stored latent row, `V` the vocabulary. `Bs` is `B`, or 1
under batch-invariant numerics (the indexer and sparse attention then run one sequence at
a time). Bytes, per device:

- `index_view` `4*Bs*S*Di`: the float32 dequantized view of the rows' index K (its fp8
  gather fuses into the conversion);
- `indexer_logits` `Bs*Tb*S*(8*Hi + 4)`: the per-head logits, their ReLU (not updated in
  place) and the head-weighted scores, for `Tb` query tokens per block
  (`buckets.block_rows` under the token-block budget, as `indexer.index_scores` splits
  them; all `T` at decode). Where the profile's decode indexer runs in page blocks
  (`LoweringProfile.cpu_paths`, XLA:CPU: `kv_cache.blocked_index_scores`),
  a decode or verify step holds one block of `Sb` keys instead: `index_view`
  `4*Bs*Sb*Di`, `indexer_logits` `Bs*T*Sb*(8*Hi + 4) + 4*Bs*T*S` (the whole width's
  scores the loop fills);
- `sparse_rows` `4*Bs*Ts*K*(c + r)`: the float32 latent rows sparse attention gathers from
  the pool for `Ts` tokens per block (absorbed form; decode reads only these rows);
- `topk` `4*B*T*K`: the selection, live from a full indexer layer through the shared
  layers after it;
- `moe_dispatch` (a DP mesh of `dp` ranks, all-gather dispatch) `8*dp*B*T*hidden`: the
  gathered tokens and their combined expert outputs before the reduce-scatter;
- `head` `20*B*V` (`T*` that for a speculative step verifying every token; `min(512,
  B*T)` rows for a prefill's prompt-scoring twin, whose head runs in blocks of
  `SCORE_BLOCK_TOKENS`): the LM head's float32 logits, their log-softmax and the
  sampler's sorted copy with its indices, of the rank's own rows (on a mesh the logits
  stay where their rows ran, `cpkv_jax.sampling.StepLogits`);
- `pool_copy` (`LoweringProfile.cpu_paths`: XLA:CPU; 0 on XLA:GPU): a layer's write goes
  through its narrow (bf16, fp8) pools' integer views (`kv_cache.write_rows`), which
  XLA:CPU copies at their stored width (latent, and index K on a full layer), operand and
  result, one layer's at a time; a one-token step (a dynamic-update-slice) has every
  layer's copies at once. (Until 2026-12-07 it upcast them to f32 / f16 instead: twice
  the bytes.)

Phases: the attention of a layer (`index_view + indexer_logits`, then `sparse_rows`), its
MoE (`moe_dispatch`), then once the head; layers run in sequence, so the step's peak is
`pool_copy + max(topk + max(index phase, sparse_rows, moe_dispatch), head)`.

Checked against XLA:CPU's `memory_analysis()` of the step the engine compiles, at GLM-5's
attention and indexer dims (`tests/serving/test_decode_step_memory.py`): within 25% from
1 to 64 rows and 4K to 128K tokens of context; with the view (`XLA_GPU`) the index phase
is 772 B per row and token of context (`4*Di + 8*Hi + 4`), 6.5 GB for 64 rows at 128K.
Not counted: one layer's dequantized weights (the plan's own FP8 term), projections and
other activations of `B*T*hidden` size, and fragmentation (`1 - --mem-fraction-static`
keeps room for them). A CP group's owner-attention step is not estimated here.
"""

from __future__ import annotations

import dataclasses
import math

from cpkv_jax.buckets import TRANSIENT_BLOCK_BYTES, block_rows
from cpkv_jax.config import ModelConfig
from cpkv_jax.kv_layout import KVLayout
from cpkv_jax.model.kv_cache import DTYPES, INDEX_BLOCK_TOKENS
from cpkv_jax.model.transformer import SCORE_BLOCK_TOKENS
from cpkv_jax.pallas.paged_index_scores import MAX_KERNEL_TOKENS
from serving.decode.steps import Shape, reachable_shapes
from serving.prefill.buffer_estimator import XLA_GPU, LoweringProfile


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """One step shape's estimate (`terms` by name, bytes per device)."""

    shape: Shape
    terms: dict[str, int]
    total_bytes: int


def step_bytes(
    cfg: ModelConfig,
    shape: Shape,
    page_size: int,
    *,
    batch_invariant: bool = False,
    block_bytes: int | None = None,
    dp: int = 1,
    all_logits: bool = False,
    score: bool = False,
    pool_pages: int = 0,
    dtype: str = "bfloat16",
    index_k_dtype: str = "fp8_e4m3",
    profile: LoweringProfile = XLA_GPU,
) -> StepBytes:
    """The transient bytes per device of the step `shape` = `(form, rows, tokens, width)`
    (rows per DP rank), by the terms of the module docstring (`score`: a prefill's
    scoring twin, for prompt log-probs); `pool_pages` (per rank),
    `dtype` (`--dtype`), `index_k_dtype` and `profile` decide `pool_copy`; `profile` the
    indexer's form too."""
    _, rows, tokens, width = shape
    budget = TRANSIENT_BLOCK_BYTES if block_bytes is None else block_bytes
    s = width * page_size
    seqs = 1 if batch_invariant else rows
    k = min(cfg.index_topk, s)
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    row = cfg.kv_cache_dim
    tb = block_rows(tokens, seqs * hi * s * 4, budget)  # `indexer._block`
    ts = block_rows(tokens, seqs * k * row * 4, budget)  # `mla.sparse_attention`
    head_rows = rows * (tokens if all_logits else 1)
    if score:  # `transformer.score_tokens`: the head over every token, a block at a time
        head_rows = max(head_rows, min(SCORE_BLOCK_TOKENS, rows * tokens))
    if profile.cpu_paths and tokens <= MAX_KERNEL_TOKENS and not batch_invariant:
        keys = max(1, min(width, INDEX_BLOCK_TOKENS // page_size)) * page_size
        index_view = 4 * seqs * keys * di
        indexer_logits = seqs * tokens * keys * (8 * hi + 4) + 4 * seqs * tokens * s
    else:
        index_view, indexer_logits = 4 * seqs * s * di, seqs * tb * s * (8 * hi + 4)
    terms = {
        "index_view": index_view,
        "indexer_logits": indexer_logits,
        "sparse_rows": 4 * seqs * ts * k * row,
        "topk": 4 * rows * tokens * k,
        "moe_dispatch": 8 * dp * rows * tokens * cfg.hidden_size if dp > 1 else 0,
        "head": 20 * head_rows * cfg.vocab_size,
        "pool_copy": pool_pages
        * page_size
        * _copy_per_token(cfg, dtype, index_k_dtype, profile, every_layer=rows * tokens == 1),
    }
    index_phase = terms["index_view"] + terms["indexer_logits"]
    layer = terms["topk"] + max(index_phase, terms["sparse_rows"], terms["moe_dispatch"])
    return StepBytes(shape, terms, terms["pool_copy"] + max(layer, terms["head"]))


def _copy_per_token(
    cfg: ModelConfig, dtype: str, index_k_dtype: str, profile: LoweringProfile, every_layer: bool
) -> int:
    """Bytes per pool token of the copies `profile`'s writes make (0: none): the largest
    layer's buffers of the pool's `KVLayout` narrower than 4 bytes, which
    `kv_cache.write_rows` writes through their integer view on CPU, at their stored
    width, twice (the write's operand and result); `every_layer`: every layer's
    (XLA:CPU makes a one-row write a dynamic-update-slice and its copies all at once:
    1.03 GB for three GLM-5 layers of 2,049 bf16 pages, 2026-12-07)."""
    layout = KVLayout.from_model(cfg, 1, DTYPES[dtype], index_k_dtype)
    per_layer: dict[int, int] = {}
    for b in layout.buffers:
        if profile.cpu_paths and b.dtype.itemsize < 4:
            for layer in b.layers:
                per_layer[layer] = per_layer.get(layer, 0) + math.prod(b.feature) * b.dtype.itemsize
    if every_layer:
        return 2 * sum(per_layer.values())
    return 2 * max(per_layer.values(), default=0)


def largest_step(
    cfg: ModelConfig,
    *,
    page_size: int,
    context_length: int,
    usable_pages: int,
    rows_per_rank: int,
    prefill: bool,
    prefill_chunk: int | None = None,
    room: int = 0,
    draft_tokens: int = 0,
    batch_invariant: bool = False,
    block_bytes: int | None = None,
    dp: int = 1,
    pool_pages: int = 0,
    dtype: str = "bfloat16",
    index_k_dtype: str = "fp8_e4m3",
    profile: LoweringProfile = XLA_GPU,
) -> StepBytes | None:
    """The largest estimate over every step an engine with these limits can dispatch
    (`steps.reachable_shapes`: decode steps, and its own prefills when `prefill`); a
    speculative engine's decode steps verify `draft_tokens + 1` tokens per row (and score
    each); `step_bytes` for the rest. None when no request fits."""
    best: StepBytes | None = None
    shapes = reachable_shapes(
        prefill_form="absorbed",
        page_size=page_size,
        context_length=context_length,
        usable_pages=usable_pages,
        max_running_requests=rows_per_rank,
        prefill=prefill,
        room=room,
        prefill_chunk=prefill_chunk,
    )
    for form, rows, tokens, width in shapes:
        verify = tokens == 1 and draft_tokens > 0
        if verify:
            tokens = draft_tokens + 1
        # A plain engine's own prefill may be a prompt-scoring one (a speculative engine
        # refuses prompt log-probs).
        score = tokens > 1 and not draft_tokens
        est = step_bytes(
            cfg,
            (form, rows, tokens, width),
            page_size,
            batch_invariant=batch_invariant,
            block_bytes=block_bytes,
            dp=dp,
            all_logits=verify,
            score=score,
            pool_pages=pool_pages,
            dtype=dtype,
            index_k_dtype=index_k_dtype,
            profile=profile,
        )
        if best is None or est.total_bytes > best.total_bytes:
            best = est
    return best
