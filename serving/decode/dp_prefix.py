"""The unified server's prefix cache on a DP mesh: one radix cache per rank (issue 36 item 5).

A unified server with `--dp-size N` prefills with the engine's own steps, up to one
request per rank in one step, chunked or whole (as `intake.LocalPrefill`), and keeps
each rank's prompts in that rank's radix cache (`cpkv_jax.kv_store.DPPrefixStore`): a
request's KV never leaves its rank, so a prefix is reusable only on the rank that
computed it.

Which rank, with no router in front (`decode_mesh.choose_rank_for_prefix`): the rank
caching the longest prefix of the prompt, when it can take the request (its pages
beyond that prefix, free or evictable, and a row) and runs at most `PREFIX_ROW_SLACK`
rows more than the least busy rank that could; otherwise the most free pages, the
fewest rows, round robin. Every step pads all ranks to the busiest one's rows, so a
shared system prompt spreads over the ranks (each caches it once) instead of piling
its requests onto the first rank that computed it.

One request:
1. it waits in the engine's FIFO queue until a rank can take it (nobody overtakes the
   head; a rank already prefilling this step does not count);
2. `DPPrefixStore.admit` locks the rank's cached prefix of its prompt (all but the last
   token: at least one is computed) and allocates the rest of its pages, evicting that
   rank's least recently used unlocked pages when its free ones run short;
3. the prefill steps feed the prompt from the end of the hit (`DecodeRequest.prefill_from`;
   `cached_tokens` in its final chunk's meta), whole or `--chunked-prefill-size` tokens
   a step (`LocalPrefill`), and the first token is drawn;
4. its prompt's whole pages go into the rank's cache at once, locked by it
   (`hold_prompt`), so requests admitted later match them while it decodes;
5. when it ends its own pages (the prompt's tail page and the output's) are freed and
   its prefix unlocked: cached, evictable.

A speculative engine admits whole prompts from the hit (its admission program drafts
from the prompt's last position; no chunks): the prefix's trunk and MTP KV are cached,
the MTP KV of its last position computed with the caching request's next token (only
acceptance can differ), as with the one-device prefix cache.

Prompt log-probs (`logprob_start_len`): such a request's cached prefix stops before the
token ahead of its first scored one (`scores.match_end`: a cached token's hidden state,
which predicts the next, is gone), and its prefill steps are the scoring twins
(`LocalPrefill`).

With `--enable-hierarchical-cache` each rank's cache is a `HiRadixCache` over its own
host pool (`HostCacheIO` with its `rank`): its pages are backed up there by the write
policy (a background worker per rank), and a request whose prefix continues in the
rank's host copies loads them back into the rank's shard before its prefill when the
rank's free and evictable pages cover them and the rest of the request (SPEC S10), or
recomputes. The rank choice weighs host copies after device hits (they need device
pages back, so they do not count toward the fit).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from cpkv_jax.kv_store import DPPrefixStore, PrefixHold
from serving.decode.intake import LocalPrefill
from serving.decode.request import DecodeRequest
from serving.engine.api import EngineStats
from serving.prefill.host_cache import HostCacheIO

if TYPE_CHECKING:
    from serving.decode.engine import DecodeEngine, Touched


class DPPrefixPrefill(LocalPrefill):
    """The `Intake` of a unified server on a DP mesh with its prefix cache (see the
    module docstring): `LocalPrefill`'s admission and prefill step, with each rank's
    cache choosing the rank, giving the pages and keeping the prompts."""

    def __init__(
        self,
        store: DPPrefixStore,
        chunk: int | None = None,
        host_config: dict[str, Any] | None = None,
    ):
        super().__init__(chunk)
        self.store = store
        self.host_config = host_config or {}  # the host cache's flags, for `hicache_info`
        self.holds: dict[str, PrefixHold] = {}  # by request: what it holds of the cache
        self.prefix_cache_hit_tokens = 0

    def bind(self, engine: DecodeEngine) -> None:
        if engine.dp_size != self.store.ranks:
            raise ValueError(
                f"the store has {self.store.ranks} ranks but the engine {engine.dp_size}"
            )
        super().bind(engine)

    def advance(self, touched: Touched, idle: bool) -> None:
        """`LocalPrefill.advance`, after the host caches' finished backups are applied
        and their new ones queued (with `--enable-hierarchical-cache`)."""
        self.store.sync_host()
        super().advance(touched, idle)

    def _rank_for(self, r: DecodeRequest, busy: set[int]) -> int | None:
        """`DecodeEngine.rank_for` with each rank's cached prefix of `r` (a busy rank
        neither fits, as every request needs a page, nor draws by its cache)."""
        cached, free, host = [], [], []
        for rank in range(self.store.ranks):
            hit, capacity, on_host = self.store.peek(rank, r.prompt, r.req.prompt_logprobs_from)
            cached.append(0 if rank in busy else hit)
            free.append(0 if rank in busy else capacity)
            host.append(0 if rank in busy else on_host)
        return self.engine.rank_for(r, free, cached, host)

    def _admit(self, r: DecodeRequest, rank: int) -> None:
        """Its cached prefix locked, the rest of its pages allocated on `rank`; its
        prefill starts after the hit."""
        pages, hold = self.store.admit(rank, r.prompt, r.n_pages, r.req.prompt_logprobs_from)
        self.engine.admit(r, rank, pages)
        self.holds[r.rid] = hold
        r.prefill_from = r.cached_tokens = hold.own_from * self.store.page_size
        r.host_cached_tokens = hold.host_pages * self.store.page_size

    def _prefilled(self, done: list[DecodeRequest]) -> None:
        """The prompts' whole pages into their ranks' caches, locked by their requests."""
        for r in done:
            assert r.pages is not None
            r.pages = self.store.hold_prompt(self.holds[r.rid], r.prompt, r.pages)
            self.prefix_cache_hit_tokens += r.cached_tokens

    def release(self, r: DecodeRequest) -> None:
        """Free `r`'s own pages and unlock its prefix (once)."""
        hold = self.holds.pop(r.rid, None)
        if hold is not None and r.pages is not None:
            self.store.release(hold, r.pages)
        r.pages = None
        self.engine.give_back_slot(r)

    def hicache_info(self) -> dict[str, Any]:
        """The ranks' host caches for `/server_info` `hicache` and the `cpkv_hicache_*`
        series (`PrefillEngine.hicache_info`'s keys): the flags, each rank's IO counters
        summed, host pages used / total and bytes per rank. Read from any thread."""
        assert self.store.host is not None, "no host cache"
        ios = self.store.host
        assert all(isinstance(io, HostCacheIO) and io.rank is not None for io in ios)
        out: dict[str, Any] = {
            **self.host_config,
            "host_page_bytes": ios[0].page_bytes,
            "host_bytes_per_lane": [io.pools[io.rank].nbytes() for io in ios],
        }
        for io, cache in zip(ios, self.store.caches, strict=True):
            for key, value in io.snapshot(cache).items():
                if isinstance(value, list):
                    out.setdefault(key, []).extend(value)
                else:
                    out[key] = out.get(key, 0) + value
        # Counted by the store (the prefill scheduler counts them in its IO's stats).
        out["host_hit_tokens"] = self.store.host_hit_tokens
        out["skipped_load_backs"] = self.store.skipped_load_backs
        return out

    def stats(self, base: EngineStats) -> EngineStats:
        return dataclasses.replace(
            base,
            kv_pages_cached=self.store.cached_pages_per_rank(),
            prefix_cache_hit_tokens=self.prefix_cache_hit_tokens,
        )
