"""Attention where the pages live: exact NSA top-k and sparse MLA over page-owned KV
(issue 40 item 1), as a `KVIO` the model plugs in.

`CPKVIO` (`cpkv_jax.materialize`) all-gathers each request's whole KV into a full view on
every rank, layer by layer, so a CP step's transient memory grows with the context's
latent and index-K bytes. `OwnerCPKVIO` never builds that view. Inside `shard_map` over
`cp`, for one block of each rank's query tokens at a time:

1. **Top-k.** The block's indexer queries are all-gathered (every rank now holds the
   `cp * block` queries of the block index); each rank scores them against the index K of
   the pages it owns only (logical pages `r, r + cp, ...`, read from its lane), keeps its
   local top-k candidates (score, logical position), and one all-to-all returns each
   query's `cp` candidate lists to the query's rank, which picks the global top-k by
   score descending, then lowest position - the order `lax.top_k` gives over the full
   view, so the selection (and its order) is the single-device path's whenever the
   scores are bitwise equal. The global top-k of a query is inside the union of the
   ranks' local top-k's: a position ahead of it in that order on its own rank is ahead of
   it globally.
2. **Sparse MLA.** The block's absorbed queries `[q_lat, q_pe]` and their top-k are
   all-gathered; each rank attends over the selected positions it owns (rows gathered
   from its lane by (page, offset)), keeping an unnormalized partial output with its
   running max and sum; one all-to-all returns the `cp` partials to the query's rank, and
   they merge by log-sum-exp. Decode rows (axis 0) send the model's `q_nope` / `q_pe`
   instead and each rank absorbs them, and the partials go back through `w_uv` (the merge
   is linear in them): fewer bytes per step for two small matmuls per gathered row.
   Only index-K scores, candidates, queries and partial outputs cross ranks; the latent
   KV never does.

The rank's owned index K is read as one local view (`S / cp` tokens, not `S`); the rest
is bounded by the token-block budget (`cpkv_jax.buckets.block_rows`), so nothing else
grows with the context. The cost is traffic and work on gathered queries: every rank
scores every query of the block against its `S / cp` keys (the full view's indexer work
in total), merges `cp` candidate lists per query with a two-key sort, and attends each
query over its own share of the selection, compacted to `ceil(2 * top-k / cp)` columns
(twice the even share; a block where a query owns more runs over all `top-k`, so the
result is exact either way). Where this pays: decode, whose few queries meet a long
context. In prefill a chunk's gathered queries outweigh the view: measured in
`docs/results.md` (`benchmarks/bench_prefill.py --owner`), and at GLM-5 dims the full
view is a small term of today's step transient (the indexer's logits blocks lead).

Exactness: top-k positions equal the full-view path's where the index scores are
bitwise equal (`tests/core/test_owner_attention.py`, with forced ties); the attention
output differs from a single softmax by float32 rounding of the log-sum-exp merge
(tolerance, not bits, even under batch-invariant numerics: there `cp_decode.CPDecoder`
decodes through each row's full view instead).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from cpkv_jax.buckets import block_rows
from cpkv_jax.materialize import CPKVIO, all_gather_bits, owned_pages
from cpkv_jax.mesh import CP_AXIS
from cpkv_jax.model.indexer import index_scores
from cpkv_jax.model.kv_cache import TRASH_PAGE, OwnerAttentionIO, dequantize_index_k
from cpkv_jax.model.numerics import block_budget, per_sequence, tokenwise
from cpkv_jax.pallas.paged_gather import GatherImpl, paged_gather
from cpkv_jax.pallas.paged_index_scores import MAX_KERNEL_TOKENS, paged_index_scores

__all__ = ["OwnerCPKVIO", "merge_partials", "owner_attention", "owner_topk"]


def _gather(x: Array, axis: int) -> Array:
    """All-gather the query axis over `cp` (1: tokens `[b, t, ...] -> [b, cp * t, ...]`;
    0: batch rows), rank order (rank r's queries at `[r * n, (r + 1) * n)`)."""
    return jax.lax.all_gather(x, CP_AXIS, axis=axis, tiled=True)


def _return(x: Array, cp: int, axis: int) -> Array:
    """Each query's per-rank results back to the query's rank: `x` holds them for the
    `_gather`ed queries; the result is `[b, cp, t, ...]` for this rank's queries (axis 1:
    the rank that computed them), one all-to-all."""
    if axis == 1:
        b, n = x.shape[:2]
        x = x.reshape(b, cp, n // cp, *x.shape[2:])
        return jax.lax.all_to_all(x, CP_AXIS, 1, 1, tiled=True)
    x = x.reshape(cp, x.shape[0] // cp, *x.shape[1:])
    return jnp.moveaxis(jax.lax.all_to_all(x, CP_AXIS, 0, 0, tiled=True), 0, 1)


def owner_topk(
    q: Float[Array, "b t nh d"],
    w: Float[Array, "b t nh"],
    index_k: Array,
    index_scale: Array | None,
    page_table: Int[Array, "rows w"],
    positions: Int[Array, "b t"],
    kv_lens: Int[Array, " rows"],
    index_topk: int,
    *,
    cp: int,
    axis: int = 1,
    block_bytes: int | None = None,
    impl: GatherImpl = "xla",
) -> Int[Array, "b t k"]:
    """`select_topk(index_scores(...))` of this rank's query tokens over the whole
    context, each rank scoring only the pages it owns (module docstring, step 1). Runs
    inside `shard_map` over `cp`; `index_k` / `index_scale` are this rank's lane.

    `axis`: the query axis split over `cp`. 1 (prefill): each rank holds some tokens of
    every request, `page_table` / `kv_lens` are the batch's. 0 (decode, `cp_decode`):
    each rank holds whole rows; `page_table` / `kv_lens` are then every rank's rows
    (`[cp * b, ...]`, replicated), `q` / `w` / `positions` this rank's. `impl`
    (`--kernel-impl`): the owned pages' gather by XLA or the Pallas paged-gather kernel
    (bitwise the same pages); with `"pallas"`, a decode step's scores come from the
    paged indexer-scores kernel instead, which reads the owned pages' fp8 index K from
    the lane itself (no local float32 view) and skips those past each row's length."""
    owned, logical_pages = owned_pages(page_table, cp)
    b, wo = owned.shape
    page = index_k.shape[1]
    key_pos = (logical_pages[:, None] * page + jnp.arange(page)).reshape(-1)
    s_full = page_table.shape[1] * page
    k_local = min(index_topk, wo * page)
    k_out = min(index_topk, s_full)
    gathered_tokens = q.shape[1] * (cp if axis == 1 else 1)
    if impl == "pallas" and gathered_tokens <= MAX_KERNEL_TOKENS:

        def local_scores(q_all, w_all, pos_all):
            return paged_index_scores(
                q_all, w_all, index_k, index_scale, owned, pos_all, kv_lens,
                page_starts=logical_pages * page,
            )  # fmt: skip

    else:
        keys = paged_gather(index_k, owned.reshape(-1), impl=impl).reshape(b, wo * page, -1)
        scale = None
        if index_scale is not None:
            scale = paged_gather(index_scale, owned.reshape(-1), impl=impl)
            scale = scale.reshape(b, wo * page)
        keys = dequantize_index_k(keys, scale)  # [b, S / cp, d] float32: the one local view

        def local_scores(q_all, w_all, pos_all):
            return index_scores(q_all, w_all, keys, pos_all, kv_lens, key_positions=key_pos)

    def block(q, w, positions):
        # One gather for the queries and their head weights (concatenate promotes
        # losslessly if their dtypes ever differ).
        qw = _gather(jnp.concatenate([q, w[..., None]], axis=-1), axis)
        q_all, w_all, pos_all = qw[..., :-1], qw[..., -1], _gather(positions, axis)
        scores = local_scores(q_all, w_all, pos_all)
        scores = jnp.where(scores == 0, 0.0, scores)  # signed zeros tie (`select_topk`)
        vals, idx = jax.lax.top_k(scores, k_local)  # ties: lowest local index = position
        # Scores (as their int32 bits) and positions in one all-to-all: one collective
        # per indexer layer instead of two (each costs its latency, every decode step).
        pos = jnp.take(key_pos, idx).astype(jnp.int32)
        both = jnp.stack([jax.lax.bitcast_convert_type(vals, jnp.int32), pos], axis=-1)
        both = _return(both, cp, axis)  # [b, cp, t, k_local, 2]
        cand_vals = jax.lax.bitcast_convert_type(both[..., 0], vals.dtype)
        cand_pos = both[..., 1]
        b, t = q.shape[:2]
        cand_vals = jnp.moveaxis(cand_vals, 1, 2).reshape(b, t, cp * k_local)
        cand_pos = jnp.moveaxis(cand_pos, 1, 2).reshape(b, t, cp * k_local)
        # Score descending, then lowest position: lax.top_k's order over the full view.
        _, chosen = jax.lax.sort((-cand_vals, cand_pos), dimension=2, num_keys=2)
        chosen = chosen[..., :k_out]
        n_valid = jnp.minimum(positions + 1, index_topk)
        keep = jnp.arange(k_out)[None, None, :] < n_valid[:, :, None]
        return jnp.where(keep, chosen, -1).astype(jnp.int32)

    # One local token's share: its gathered queries' logits [heads, S / cp] and scores
    # (`b` rows here are already every rank's when the rows are split, axis 0).
    gathered = b * cp if axis == 1 else b
    row_bytes = gathered * (q.shape[2] + 2) * wo * page * 4
    return tokenwise(
        block,
        q,
        w,
        positions,
        axis=1,
        block=block_rows(q.shape[1], row_bytes, block_budget(block_bytes)),
    )


def _take_rows(pool: Array, slots: Array, impl: GatherImpl) -> Array:
    """`pool` rows at flat `slots` (page * page_size + offset): `[*slots.shape, *row]`."""
    page = pool.shape[1]
    if impl == "xla":
        return pool[slots // page, slots % page]
    rows = pool.reshape((pool.shape[0] * page, 1, *pool.shape[2:]))  # one-row pages, free
    out = paged_gather(rows, slots.reshape(-1).astype(jnp.int32), impl=impl)
    return out.reshape((*slots.shape, *pool.shape[2:]))


def merge_partials(
    out: Float[Array, "b n t h c"],
    row_max: Float[Array, "b n t h"],
    row_sum: Float[Array, "b n t h"],
) -> Float[Array, "b t h c"]:
    """Merge `n` softmax partials over disjoint key sets by log-sum-exp: each holds the
    unnormalized output `sum_k exp(s_k - m) v_k`, its max `m` (-inf: no key) and
    `sum_k exp(s_k - m)`. A query with no key in any partial gets 0 (as
    `sparse_attention` gives a padding token)."""
    top = jnp.max(row_max, axis=1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.where(jnp.isfinite(row_max), jnp.exp(row_max - top), 0.0)
    total = jnp.sum(weight * row_sum, axis=1)
    merged = jnp.sum(weight[..., None] * out, axis=1)
    return jnp.where(
        total[..., None] > 0, merged / jnp.where(total > 0, total, 1.0)[..., None], 0.0
    )


def owner_attention(
    q_nope: Float[Array, "b t h n"],
    q_pe: Float[Array, "b t h r"],
    latent: Array,
    page_table: Int[Array, "rows w"],
    topk: Int[Array, "b t k"],
    w_kv_b: Float[Array, "hx lora"],
    *,
    cp: int,
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
    axis: int = 1,
    block_bytes: int | None = None,
    capacity: int | None = None,
    impl: GatherImpl = "xla",
) -> Float[Array, "b t h v"]:
    """`sparse_attention(..., form="absorbed")` of this rank's query tokens, each rank
    attending over the selected positions it owns (module docstring, step 2). Runs
    inside `shard_map` over `cp`; `latent` is this rank's lane of the layer's pool.

    `capacity`: selected positions per query a rank attends over in its compact pass
    (default `ceil(2 * k / cp)`, twice the even share); a block where some query owns
    more on this rank runs over all `k` instead (`lax.cond`), so the result never
    depends on it. The token blocks are sized for that worst case. `axis`: as in
    `owner_topk` (0: `page_table` holds every rank's rows). `impl`: the selected rows'
    gather from the lane by XLA or the Pallas kernel over one-row pages (bitwise the same
    rows, as `kv_cache.take_paged_rows`)."""
    n_heads, nope = q_nope.shape[2], q_nope.shape[3]
    w = w_kv_b.astype(jnp.float32).reshape(n_heads, nope + v_head_dim, kv_lora_rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]

    def absorb(q_nope, q_pe):  # [b, t, h, c + r] float32
        q_lat = jnp.einsum("bthn,hnc->bthc", q_nope.astype(jnp.float32), w_uk)
        return jnp.concatenate([q_lat, q_pe.astype(jnp.float32)], axis=-1)

    # Decode (rows split, axis 0) exchanges the model's own queries (q_nope, q_pe in its
    # dtype) and partials already through w_uv: 4.5x / 2x fewer bytes than the absorbed
    # float32 query and latent partial at GLM-5 dims (`cp_decode.decode_bytes_per_rank`),
    # for two small matmuls per gathered row. Prefill keeps the absorbed exchange: over
    # `cp x` a chunk's tokens those matmuls would add ~40% to the attention's
    # multiply-adds (GLM-5, by count: 14.7M per gathered query beside 35.6M).
    late = axis == 0
    # One array per query, gathered once: `[q_nope, q_pe]` as the model made them (late),
    # or absorbed.
    query = jnp.concatenate([q_nope, q_pe], axis=-1) if late else absorb(q_nope, q_pe)

    def gathered_query(query):  # [b, cp * t (or cp * b rows), h, c + r] float32
        if not late:
            return _gather(query, axis)
        q_all = all_gather_bits(query, axis)
        return absorb(q_all[..., :nope], q_all[..., nope:])

    page = latent.shape[1]
    rank = jax.lax.axis_index(CP_AXIS)

    def sequence(query, topk, page_table):

        def partial(q_all, sel, mine):
            pos = jnp.maximum(sel, 0)
            logical = pos // page
            local = jax.vmap(lambda row, i: jnp.take(row, i, axis=0))(page_table, logical)
            slots = jnp.where(mine, local, TRASH_PAGE) * page + pos % page
            rows = _take_rows(latent, slots, impl).astype(jnp.float32)
            scores = jnp.einsum("bthc,btkc->bthk", q_all, rows) * scale
            scores = jnp.where(mine[:, :, None, :], scores, -jnp.inf)
            row_max = jnp.max(scores, axis=-1)
            safe = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
            probs = jnp.where(mine[:, :, None, :], jnp.exp(scores - safe[..., None]), 0.0)
            out = jnp.einsum("bthk,btkc->bthc", probs, rows)[..., :kv_lora_rank]
            if late:  # linear in `out`: the merge commutes with it
                out = jnp.einsum("bthc,hvc->bthv", out, w_uv)
            return out, row_max, jnp.sum(probs, axis=-1)

        def block(query, topk):
            q_all = gathered_query(query)
            sel = _gather(topk, axis)
            mine = (sel >= 0) & ((jnp.maximum(sel, 0) // page) % cp == rank)
            k = sel.shape[-1]
            cap = min(k, capacity if capacity is not None else -(-2 * k // cp))

            def compact(_):
                # This rank's selected positions first, in selection order: an owned
                # column's count among the owned (a cumulative sum) is its slot of `cap`
                # (3 ms where a top_k of the same order took 55, XLA:CPU).
                slot = jnp.where(mine, jnp.cumsum(mine, axis=-1) - 1, cap)  # cap: dropped
                b, n = sel.shape[:2]
                at = (jnp.arange(b)[:, None, None], jnp.arange(n)[None, :, None], slot)
                kept = jnp.full((b, n, cap), -1, sel.dtype).at[at].set(sel, mode="drop")
                return partial(q_all, kept, kept >= 0)

            # Exact either way: when some query owns more than `cap` of its selection
            # here, the block runs over all `k` columns. No collective inside: each rank
            # may take its own branch.
            if cap < k:
                parts = jax.lax.cond(
                    jnp.max(jnp.sum(mine, axis=-1)) > cap,
                    lambda _: partial(q_all, sel, mine),
                    compact,
                    None,
                )
            else:
                parts = partial(q_all, sel, mine)
            # Output, max and sum in one all-to-all (one collective per layer, not three).
            out, row_max, row_sum = parts
            packed = jnp.concatenate([out, row_max[..., None], row_sum[..., None]], axis=-1)
            back = _return(packed, cp, axis)
            return merge_partials(back[..., :-2], back[..., -2], back[..., -1])

        # One local token's share: its cp queries' gathered rows [k, c + r] float32.
        row_bytes = topk.shape[0] * cp * topk.shape[2] * latent.shape[2] * 4
        blk = block_rows(topk.shape[1], row_bytes, block_budget(block_bytes))
        return tokenwise(block, query, topk, axis=1, block=blk)

    if late:  # a rank's rows meet every rank's rows in the gather: no per-row split
        return sequence(query, topk, page_table)
    o_row = per_sequence(sequence, query, topk, page_table)
    return jnp.einsum("bthc,hvc->bthv", o_row, w_uv)


@dataclasses.dataclass(frozen=True)
class OwnerCPKVIO(CPKVIO):
    """`CPKVIO` whose model reads select top-k and attend where the pages live
    (`owner_topk`, `owner_attention`); writes are `CPKVIO`'s (owners keep their pages).
    Shared-KV pools only. `view` / `rows` stay available (full views for checks). The
    token blocks follow the traced `numerics.token_block_bytes` budget. `query_axis`
    (`CPKVIO`'s): 0 for a decode step whose rows are split over the ranks."""

    def __post_init__(self) -> None:
        if not self.shared:
            raise ValueError("owner attention needs page-owned (shared) KV pools")

    def _rows(self, x: Array) -> Array:
        """A batch field the owner functions need for every gathered query: rows split
        over the ranks (decode, `query_axis` 0) are all-gathered (a small int32 array)."""
        return _gather(x, 0) if self.query_axis == 0 else x

    def select_topk(self, q, w, index_k, index_scale, batch, index_topk: int):
        with jax.named_scope("owner_topk"):
            return owner_topk(
                q,
                w,
                index_k,
                index_scale,
                self._rows(batch.page_table),
                batch.positions,
                self._rows(batch.kv_lens),
                index_topk,
                cp=self.cp_size,
                axis=self.query_axis,
                impl=self.gather_impl,
            )

    def attend(self, q_nope, q_pe, latent, batch, topk, w_kv_b, **dims):
        with jax.named_scope("owner_attention"):
            return owner_attention(
                q_nope,
                q_pe,
                latent,
                self._rows(batch.page_table),
                topk,
                w_kv_b,
                cp=self.cp_size,
                axis=self.query_axis,
                impl=self.gather_impl,
                **dims,
            )


assert issubclass(OwnerCPKVIO, OwnerAttentionIO)
