"""Full-view materialization over the `cp` axis, as a `KVIO` the model plugs in (SPEC S1.5).

Inside `shard_map` each rank holds its own lane of every pool. `CPKVIO` gives the model
the same two operations the single-device `PagedKVIO` does:

- `write`: the new tokens' rows are all-gathered over `cp` (every rank computed KV only
  for its own zigzag blocks), then each rank scatters only the rows whose page it owns;
  rows it does not own (and padding) go to its trash page. In replicated mode every rank
  writes every row.
- `view`: rank `r` gathers the request's logical pages `r, r + cp, r + 2cp, ...` (the
  ones it owns, in local order) from its lane with the paged-gather kernel, one
  all-gather over `cp` stacks them, and a reshape interleaves them back into logical page
  order. The result is the request's whole KV in logical order, so the indexer and sparse
  attention read it unchanged; it is a transient that XLA frees after the layer.

Page-table rows in shared mode hold, for logical page `p`, the *local* page on lane
`p % cp`; their width must be a multiple of `cp` (padding entries: the trash page 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from cpkv_jax.mesh import CP_AXIS
from cpkv_jax.model.kv_cache import (
    TRASH_PAGE,
    RowGather,
    as_bits,
    from_bits,
    take_view_rows,
    write_rows,
)
from cpkv_jax.pallas.paged_gather import GatherImpl, paged_gather


def owned_pages(page_table: Int[Array, "b w"], cp: int) -> tuple[Array, Array]:
    """This rank's page-table columns `[b, w / cp]` (logical pages `r, r + cp, ...`, in
    local order) and the logical page of each column `[w / cp]`; inside `shard_map`."""
    b, width = page_table.shape
    if width % cp:
        raise ValueError(f"page-table width {width} is not a multiple of cp={cp}")
    rank = jax.lax.axis_index(CP_AXIS)
    owned = jnp.take(page_table.reshape(b, width // cp, cp), rank, axis=2)
    return owned, jnp.arange(width // cp) * cp + rank


def all_gather_bits(x: Array, axis: int, tiled: bool = True) -> Array:
    """`lax.all_gather` over `cp` of `x`'s bytes as they are (`as_bits`)."""
    out = jax.lax.all_gather(as_bits(x), CP_AXIS, axis=axis, tiled=tiled)
    return from_bits(out, x.dtype)


@dataclasses.dataclass(frozen=True)
class CPKVIO:
    """KV reads/writes of one rank inside `shard_map` over the `cp` mesh axis."""

    cp_size: int
    shared: bool
    gather_impl: GatherImpl = "xla"
    # The axis of the new tokens that is split over `cp`: 1, a prefill step's tokens; 0,
    # a decode step's rows (`cpkv_jax.cp_decode`).
    query_axis: int = 1
    # Pages per lane (`PoolLayout.pages_per_rank`): what `slots` needs to name a page on
    # another lane; steps that compute their write slots on the device set it.
    lane_pages: int | None = None

    def write(self, pool: Array, slots: Int[Array, "b t"], values: Array) -> Array:
        with jax.named_scope("kv_write"):
            return self._write(pool, slots, values)

    def slots(
        self, page_table: Int[Array, "b pages"], positions: Int[Array, "b t"], page_size: int
    ) -> Int[Array, "b t"]:
        """Global slots (`kv_pool.PoolLayout.global_slots`) on the device: logical page
        `p` is local page `page_table[:, p]` of lane `p % cp` (of lane 0 in replicated
        pools), as `cp_decode.plan_rows` and the prefill plans lay them out on the host."""
        if self.lane_pages is None:
            raise ValueError("device-side write slots need the pool's `lane_pages`")
        logical = jnp.minimum(positions // page_size, page_table.shape[1] - 1)
        local = jnp.take_along_axis(page_table, logical, axis=1)
        lane = logical % self.cp_size if self.shared else jnp.zeros_like(logical)
        return (lane * self.lane_pages + local) * page_size + positions % page_size

    def view(self, pool: Array, page_table: Int[Array, "b pages"]) -> Array:
        with jax.named_scope("materialize"):
            return self._view(pool, page_table)

    def rows(self, pool: Array, page_table: Int[Array, "b pages"]) -> tuple[Array, RowGather]:
        # A prefill chunk's tokens select over the whole prompt: the full view is read
        # anyway, so the selected rows come from it.
        return self.view(pool, page_table), take_view_rows

    def _write(self, pool: Array, slots: Int[Array, "b t"], values: Array) -> Array:
        axis = self.query_axis
        all_slots = jax.lax.all_gather(slots, CP_AXIS, axis=axis, tiled=True)
        # In the pool's dtype before the gather: the rows cross ranks as stored.
        all_values = all_gather_bits(values.astype(pool.dtype), axis)
        lane_slots = pool.shape[0] * pool.shape[1]
        if self.shared:
            rank = jax.lax.axis_index(CP_AXIS)
            mine = all_slots // lane_slots == rank
            local = jnp.where(mine, all_slots % lane_slots, TRASH_PAGE * pool.shape[1])
        else:
            local = all_slots
        return write_rows(pool, local.reshape(-1), all_values.reshape((-1, *pool.shape[2:])))

    def _view(self, pool: Array, page_table: Int[Array, "b pages"]) -> Array:
        b, width = page_table.shape
        page = pool.shape[1:]
        if not self.shared:
            rows = paged_gather(pool, page_table.reshape(-1), impl=self.gather_impl)
            return rows.reshape((b, width * page[0], *page[1:]))
        cp = self.cp_size
        if self.query_axis == 0:
            # Decode rows split over the ranks: every rank serves the owned pages of
            # every rank's rows, and one all-to-all hands each rank its rows' pages.
            page_table = jax.lax.all_gather(page_table, CP_AXIS, axis=0, tiled=True)
        owned, _ = owned_pages(page_table, cp)  # raises for a width not of cp
        local = paged_gather(pool, owned.reshape(-1), impl=self.gather_impl)
        if self.query_axis == 0:  # [cp (requester) * b, width/cp, ...] -> by owner
            local = local.reshape((cp, b, width // cp, *page))
            moved = jax.lax.all_to_all(as_bits(local), CP_AXIS, 0, 0, tiled=True)
            full = jnp.moveaxis(from_bits(moved, pool.dtype), 0, 2)  # [b, w/cp, cp, P, ...]
        else:
            local = local.reshape((b, width // cp, *page))
            full = all_gather_bits(local, 2, tiled=False)  # [b, width/cp, cp, P, ...]
        return full.reshape((b, width * page[0], *page[1:]))
