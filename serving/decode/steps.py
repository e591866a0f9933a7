"""The decode engine's two model steps on the single-device pool, as host-built batches.

- `prefill`: one request's whole prompt (absorbed MLA form, as the CP prefill), padded to
  `prefill_bucket(len)` tokens;
- `decode`: one token for each running request, rows padded to a power of two and page
  tables to a power of two of the longest reservation.

Both donate the pool through `KVStore.update_pool` and return the step's logit rows where
they were computed (on the device: the engine takes their log-softmax and
`cpkv_jax.sampling.sample` draws from both there, bringing back only tokens), so the
number of compiled shapes is bounded by the buckets (`shapes` records them).
`reachable_shapes` enumerates every shape an engine's requests can reach from its limits
(the same bucket rules, one source of truth) and `warm` runs each once on trash-page-only
tables, so a server that warms them all compiles nothing while serving (issue 25).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from cpkv_jax import sampling
from cpkv_jax.aot import ShapeCache, abstract
from cpkv_jax.buckets import MIN_PREFILL_BUCKET, pow2_at_least, prefill_bucket
from cpkv_jax.cp_decode import CPDecoder, plan_groups
from cpkv_jax.decode_mesh import DPDecodeSteps, DPPoolLayout, DPRow, build_batch
from cpkv_jax.errors import ConfigError
from cpkv_jax.kv_store import KVStore
from cpkv_jax.model.expert_parallel import EPDispatch
from cpkv_jax.model.forward_batch import (
    ForwardBatch,
    abstract_batch,
    batch_from_host,
    feed_ids,
    span_batch,
)
from cpkv_jax.model.kv_cache import SINGLE_DEVICE_KV_IO, IndexKDtype, PagedKVIO
from cpkv_jax.model.transformer import CausalLM, forward_score_step, forward_step
from cpkv_jax.paging import TRASH_PAGE, padded_page_table, pages_for_tokens, slots_for_positions
from cpkv_jax.sampling import StepLogits
from cpkv_jax.scores import TokenScores, next_tokens, span_scores

# One decode row: (token fed now, its position, the request's pages, pages reserved).
DecodeRow = tuple[int, int, np.ndarray, int]
# Input ids from the last draw, left on the device (issue 35 item 5: the engine dispatches
# step n+1 before it fetches step n's tokens): (that draw's `[R]` tokens, per row of the
# step the row of the draw it feeds, or -1 for the row's own host token).
PrevTokens = tuple[jax.Array, Sequence[int]]
# A compiled step: (form, rows, tokens, page-table width).
Shape = tuple[str, int, int, int]


def reachable_shapes(
    *,
    prefill_form: str,
    page_size: int,
    context_length: int,
    usable_pages: int,
    max_running_requests: int,
    prefill: bool = True,
    room: int = 0,
    prefill_chunk: int | None = None,
) -> set[Shape]:
    """Every step shape a `DecodeEngine` with these limits can dispatch.

    A request has `n >= 1` prompt tokens and `m >= 1` new ones with `n + m <=
    context_length` and `pages(n + m) <= usable_pages` (`DecodeEngine._validate`). Its
    prefill is `(form, 1, prefill_bucket(n), pow2(pages(n + m)))`; a prefill of
    `prefill_chunk` tokens at most a step (or a prefix-cache hit's rest) feeds fewer
    tokens of the same request: a smaller bucket, as a shorter prompt's, at the same
    width (every bucket's widths run to the pool's). A decode step of `k <=
    max_running_requests` running requests is `("absorbed", pow2(k), 1, pow2(max pages))`,
    and the running requests' reservations fit the pool together. `room`: tokens each
    request reserves beyond `n + m` (a speculative engine's draft room).
    """
    # prompt + new tokens one request can hold
    longest = min(context_length, usable_pages * page_size - room)
    out: set[Shape] = set()
    if longest < 2:
        return out  # no request fits (one prompt token and one new one at least)
    max_pages = pages_for_tokens(longest + room, page_size)
    min_pages = pages_for_tokens(2 + room, page_size)  # the smallest reservation
    if prefill:
        bucket = MIN_PREFILL_BUCKET
        # Bucket `bucket` holds prompts of n in [lo, bucket]; with m >= 1 a request's
        # pages run over every integer in [pages(lo + 1), max_pages], so its widths are
        # every power of two from pow2(pages(lo + 1)) to pow2(max_pages).
        top = longest - 1 if prefill_chunk is None else min(longest - 1, prefill_chunk)
        while (lo := 1 if bucket == MIN_PREFILL_BUCKET else bucket // 2 + 1) <= top:
            w = pow2_at_least(pages_for_tokens(lo + 1 + room, page_size))
            while w <= pow2_at_least(max_pages):
                out.add((prefill_form, 1, prefill_bucket(lo), w))
                w *= 2
            bucket *= 2
    rows = 1
    while rows <= pow2_at_least(max_running_requests):
        k_min = 1 if rows == 1 else rows // 2 + 1  # fewest requests that pad to `rows`
        if k_min <= min(max_running_requests, usable_pages // min_pages):
            w = 1
            while w <= pow2_at_least(max_pages):
                # the widest request's fewest pages; the others hold min_pages at least
                widest_min = max(min_pages, 1 if w == 1 else w // 2 + 1)
                fits = widest_min + (k_min - 1) * min_pages <= usable_pages
                if widest_min <= min(w, max_pages) and fits:
                    out.add(("absorbed", rows, 1, w))
                w *= 2
        rows *= 2
    return out


_CACHES: weakref.WeakKeyDictionary[CausalLM, dict[tuple, ShapeCache[Shape]]] = (
    weakref.WeakKeyDictionary()
)
_CACHES_LOCK = threading.Lock()


class CompiledShapes:
    """The compile side of a step executor whose executables live in a `ShapeCache`
    (`self._compiled`), lowered by `self._lower(shape)`."""

    _compiled: ShapeCache[Shape]

    def _lower(self, shape: Shape) -> jax.stages.Lowered:
        raise NotImplementedError

    def compiled(self, shape: Shape) -> jax.stages.Compiled:
        """The executable of step `shape`, compiled on abstract inputs the first time (a
        caller that needs a shape another thread is compiling waits for it)."""
        return self._compiled.get(shape, lambda: self._lower(shape))

    def compile_estimate(self, shapes: set[Shape]) -> tuple[int, float]:
        """Shapes of `shapes` not compiled yet and their estimated compile seconds."""
        return self._compiled.estimate(shapes)

    @property
    def compile_count(self) -> int:
        """Step compiles run (one per shape: a shape being compiled is waited for)."""
        return self._compiled.compiles

    @property
    def compiled_shapes(self) -> set[Shape]:
        return self._compiled.compiled_keys()


class DecodeSteps(CompiledShapes):
    """The compiled steps of one model over one `KVStore` (see the module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVStore,
        page_size: int,
        index_k_dtype: IndexKDtype,
        batch_invariant: bool,
        block_bytes: int | None,
        kv_io: PagedKVIO = SINGLE_DEVICE_KV_IO,
    ):
        self._graphdef, self._state = nnx.split(model)
        self.kv_io = kv_io  # sparse (top-k rows from the pool) or the dense-view reference
        self.vocab_size = model.cfg.vocab_size
        self.kv = kv
        self.page_size = page_size
        self.index_k_dtype = index_k_dtype
        self.batch_invariant = batch_invariant
        self.block_bytes = block_bytes  # token-block budget of the indexer / sparse attention
        # The CP prefill's absorbed form (attention on the latent rows): the expanded one
        # up-projects every (token, selected position) pair and is only a test reference.
        self.prefill_form = "absorbed"
        self.shapes: set[tuple[str, int, int, int]] = set()  # (form, rows, tokens, width)
        # Executables by shape, shared by the engines of this model object with the same
        # pool and numerics (the warm-up probe's compiles serve the real engine); they
        # go with the model.
        self._abstract = (abstract(self._state), abstract(kv.pool))
        leaves, tree = jax.tree.flatten(self._abstract)
        context = (
            self._graphdef,
            tree,
            *leaves,
            index_k_dtype,
            batch_invariant,
            block_bytes,
            kv_io,
        )
        with _CACHES_LOCK:
            caches = _CACHES.setdefault(model, {})
            self._compiled = caches.setdefault(context, ShapeCache("decode step"))
            # Prompt scoring's prefill twin: compiled on first use, or in the background
            # (`--warmup-prompt-scoring`).
            self._score_compiled = caches.setdefault(
                (*context, "score"), ShapeCache("prompt-scoring step")
            )

    def prefill(
        self, prompt: np.ndarray, pages: np.ndarray, width: int, start: int = 0
    ) -> StepLogits:
        """Logits `[1, vocab]` after the prompt's last token, on the device; its KV lands
        in `pages`. `start`: the positions before it have their KV there already (a
        chunk of a longer prompt), so only `prompt[start:]` is fed."""
        batch, shape = self._prefill_batch(prompt[start:], start, pages, width)
        step = self.compiled(shape)  # before the pool lock: it may compile or wait
        self.shapes.add(shape)
        with jax.named_scope("decode_engine.prefill"):
            return StepLogits(self.kv.update_pool(lambda pool: step(self._state, batch, pool)))

    def score_many(
        self,
        requests: Sequence[tuple[np.ndarray, np.ndarray, int]],
        starts: Sequence[int],
        ends: Sequence[int],
        wanted: Sequence[bool] | None = None,
    ) -> tuple[StepLogits, list[TokenScores]]:
        """`prefill` of `prompt[start:end]` (one request: the whole prompt, its pages and
        width) that also scores the fed tokens against the prompt's next ones (prompt
        log-probs, `MeshDecodeSteps.score_many`; its one request is the one scored)."""
        ((prompt, pages, width),), (start,), (end,) = requests, starts, ends
        ids = prompt[start:end]
        batch, shape = self._prefill_batch(ids, start, pages, width)
        step = self.compiled_score(shape)
        targets = np.full(batch.input_ids.shape, -1, np.int32)  # padding: not scored
        targets[0, : len(ids)] = next_tokens(prompt, start, len(ids))
        with jax.named_scope("decode_engine.prefill"):
            logits, *scored = self.kv.update_pool(
                lambda pool: step(self._state, batch, pool, targets)
            )
        return StepLogits(logits), _span_scores(requests, starts, ends, scored)

    def compiled_score(self, shape: Shape) -> jax.stages.Compiled:
        """The scoring twin of the prefill step `shape` (`score_many`)."""
        return self._score_compiled.get(shape, lambda: self._lower(shape, score=True))

    @property
    def compiled_score_shapes(self) -> set[Shape]:
        return self._score_compiled.compiled_keys()

    def _prefill_batch(
        self, ids: np.ndarray, start: int, pages: np.ndarray, width: int
    ) -> tuple[ForwardBatch, Shape]:
        """One row feeding `ids` at positions from `start` into `pages`, padded to its
        prefill bucket, and its step shape."""
        table = padded_page_table(pages, width)
        batch = span_batch(ids, start, table, self.page_size, prefill_bucket(len(ids)))
        return batch, (self.prefill_form, 1, batch.input_ids.shape[1], width)

    def decode(self, rows: Sequence[DecodeRow], prev: PrevTokens | None = None) -> StepLogits:
        """Logits after feeding each row's token at its position, on the device:
        `[pow2(len(rows)), vocab]`, the first `len(rows)` rows those of `rows`. With
        `prev`, a row whose source is `>= 0` feeds that row of the last draw instead of
        its host token."""
        rows_p = pow2_at_least(len(rows))
        width = pow2_at_least(max(n_pages for *_, n_pages in rows))
        ids = np.zeros((rows_p, 1), np.int32)
        positions = np.zeros((rows_p, 1), np.int32)
        valid = np.zeros((rows_p, 1), bool)
        slots = np.full((rows_p, 1), TRASH_PAGE * self.page_size, np.int32)
        tables = np.full((rows_p, width), TRASH_PAGE, np.int32)
        kv_lens = np.zeros((rows_p,), np.int32)
        for i, (token, pos, pages, _) in enumerate(rows):
            tables[i] = padded_page_table(pages, width)
            ids[i, 0] = token
            positions[i, 0] = pos
            valid[i, 0] = True
            slots[i, 0] = slots_for_positions(tables[i], np.asarray([pos]), self.page_size)[0]
            kv_lens[i] = pos + 1
        batch = batch_from_host(ids, positions, valid, slots, tables, kv_lens)
        if prev is not None:
            src = np.full((rows_p,), -1, np.int32)
            src[: len(prev[1])] = prev[1]
            batch = dataclasses.replace(batch, input_ids=_feed_ids(prev[0], src, batch.input_ids))
        shape = ("absorbed", rows_p, 1, width)
        step = self.compiled(shape)
        self.shapes.add(shape)
        with jax.named_scope("decode_engine.decode"):
            return StepLogits(self.kv.update_pool(lambda pool: step(self._state, batch, pool)))

    def warm(self, shapes: Sequence[Shape]) -> None:
        """Run each shape once on tables of the trash page only (every write lands in page
        0, which no request reads), through the same code the requests take (the step,
        then the sampler on its rows)."""
        _warm(self, shapes, "compiling decode steps")

    @property
    def logits_sharding(self) -> jax.sharding.Sharding:
        """Where the steps leave their logit rows (the pool's device)."""
        return jax.tree.leaves(self._abstract[1])[0].sharding

    @property
    def state_sharding(self) -> jax.sharding.Sharding:
        """Where the sampler keeps its per-request state (the pool's device)."""
        return self.logits_sharding

    @staticmethod
    def logit_rows(rows: int) -> int:
        """Log-prob rows of a decode step of `rows` (padded) rows."""
        return rows

    def warm_feeds(self, rows: set[int]) -> None:
        """Compile the next-ids feed (`PrevTokens`) between every pair of the row buckets
        `rows`: a draw of one bucket feeds a step of any other (rows join and leave)."""
        # Its steps' ids are an uncommitted device array (`batch_from_host`), so these are.
        _warm_feeds(self, rows, lambda t, src, ids: _feed_ids(t, src, jax.device_put(ids)))

    def warm_log_probs(self, rows: set[int]) -> None:
        """Run the small programs around the steps (the log-softmax of `[rows, vocab]`
        logits and the sampler on it) for each batch-row bucket, on committed arrays as
        the steps return them: what `warm` covers by running the steps, for a server
        whose steps compile in the background."""
        _warm_log_probs(self, rows)

    def _lower(self, shape: Shape, score: bool = False) -> jax.stages.Lowered:
        """Lower step `shape` on the abstract weights, pool and batch: the live pool is
        never touched and nothing else compiles (the steps' batches are uncommitted
        arrays, as an abstract value without a sharding). `score`: its scoring twin."""
        form, rows, tokens, width = shape
        state, pool = self._abstract

        batch = abstract_batch(rows, tokens, width)
        if score:
            return forward_score_step.lower(
                self._graphdef,
                state,
                batch,
                pool,
                jax.ShapeDtypeStruct((rows, tokens), np.int32),
                kv_io=self.kv_io,
                index_k_dtype=self.index_k_dtype,
                form=form,
                invariant=self.batch_invariant,
                block_bytes=self.block_bytes,
            )
        return forward_step.lower(
            self._graphdef,
            state,
            batch,
            pool,
            kv_io=self.kv_io,
            index_k_dtype=self.index_k_dtype,
            form=form,
            invariant=self.batch_invariant,
            block_bytes=self.block_bytes,
        )


def _span_scores(
    requests: Sequence[tuple[np.ndarray, np.ndarray, int]],
    starts: Sequence[int],
    ends: Sequence[int],
    scored: Sequence[jax.Array],
    order: np.ndarray | None = None,
) -> list[TokenScores]:
    """Each request's `TokenScores` from a scoring step's `(chosen, top_ids,
    top_logprobs)`, row `order[i]` (default `i`) that of `requests[i]` (fetched: the
    caller waits)."""
    chosen, top_ids, top_lps = jax.device_get(scored)
    at = range(len(requests)) if order is None else order
    return [
        span_scores(prompt, start, end - start, chosen[j], top_ids[j], top_lps[j])
        for j, (prompt, _, _), start, end in zip(at, requests, starts, ends, strict=False)
    ]


def _warm(
    steps: DecodeSteps | MeshDecodeSteps | CPMeshDecodeSteps, shapes: Sequence[Shape], desc: str
) -> None:
    """Run each shape once on tables of the trash page only (every write lands in a
    trash page, which no request reads), through the same code the requests take (the
    step, then the sampler on its rows)."""
    trash = np.zeros((1,), np.int32)
    bar = tqdm(shapes, desc=desc, unit="shape", disable=None)
    for form, rows, tokens, width in bar:  # a bar on a terminal only
        if tokens > 1:  # a prefill: one row, `tokens` padded prompt tokens
            if form != steps.prefill_form:
                raise ValueError(f"this engine prefills in {steps.prefill_form!r}, not {form!r}")
            out = steps.prefill(np.full((tokens,), 3, np.int32), trash, width)
        else:
            out = steps.decode([(3, 0, trash, width)] * rows)
        lp = sampling.rows_log_probs(out.logits, steps.batch_invariant)
        sampling.sample(lp, [sampling.GREEDY], order=out.order)


def _warm_feeds(
    steps: DecodeSteps | MeshDecodeSteps | CPMeshDecodeSteps, rows: set[int], feed
) -> None:
    """Run `feed` (the executor's next-ids program) from the draw of every logit-row
    count of the buckets `rows` into a step of every other (rows join and leave)."""
    counts = sorted({steps.logit_rows(r) for r in rows})
    # A draw's tokens, placed as the sampler leaves them (from logits placed as the
    # steps leave theirs).
    drawn = {a: _drawn_tokens(steps, a) for a in counts}
    for a, b in itertools.product(counts, repeat=2):
        feed(drawn[a], np.full((b,), -1, np.int32), np.zeros((b, 1), np.int32))


def _drawn_tokens(steps: DecodeSteps | MeshDecodeSteps | CPMeshDecodeSteps, n: int) -> jax.Array:
    logits = jax.device_put(np.zeros((n, steps.vocab_size), np.float32), steps.logits_sharding)
    lp = sampling.rows_log_probs(logits, steps.batch_invariant)
    return sampling.sample_async(lp, [sampling.GREEDY]).tokens


def _warm_log_probs(
    steps: DecodeSteps | MeshDecodeSteps | CPMeshDecodeSteps, rows: set[int]
) -> None:
    """The log-softmax and the sampler on `[logit_rows(R), vocab]` logits placed as the
    executor's steps return them, for each row bucket `R` (and 1)."""
    for n in sorted({steps.logit_rows(r) for r in rows | {1}}):
        logits = jax.device_put(np.zeros((n, steps.vocab_size), np.float32), steps.logits_sharding)
        sampling.sample(sampling.rows_log_probs(logits, steps.batch_invariant), [sampling.GREEDY])


_feed_ids = jax.jit(feed_ids)


_DP_STEPS: weakref.WeakKeyDictionary[CausalLM, dict[tuple, DPDecodeSteps]] = (
    weakref.WeakKeyDictionary()
)


class MeshDecodeSteps:
    """`DecodeSteps` on a `("dp",)` mesh (`cpkv_jax.decode_mesh`): the same interface
    for `DecodeEngine`, with a request's rank read from its (global) pages.

    Shape keys count rows *per rank*: `("absorbed", R, 1, W)` is a step in which the
    busiest rank has up to `R` rows. A prefill runs one request on its rank while the
    other ranks run padding. The `DPDecodeSteps` (placed weights, executables) are
    shared by the engines of one model, mesh and pool layout (the warm-up probe's and
    the served engine's)."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVStore,
        mesh: Mesh,
        page_size: int,
        index_k_dtype: IndexKDtype,
        batch_invariant: bool,
        block_bytes: int | None,
        kv_io: PagedKVIO = SINGLE_DEVICE_KV_IO,
        ep_dispatch: EPDispatch = "allgather",
        ep_capacity_factor: float | None = None,
    ):
        pool = kv.pool
        dp = mesh.size
        self.layout = DPPoolLayout(dp, pool.num_pages // dp, page_size)
        self.kv = kv
        self.vocab_size = model.cfg.vocab_size
        self.batch_invariant = batch_invariant
        self.prefill_form = "absorbed"
        self.shapes: set[Shape] = set()
        key = (
            tuple(d.id for d in mesh.devices.reshape(-1)),
            self.layout,
            index_k_dtype,
            batch_invariant,
            block_bytes,
            kv_io,
            ep_dispatch,
            ep_capacity_factor,
        )
        with _CACHES_LOCK:
            by_key = _DP_STEPS.setdefault(model, {})
            if key not in by_key:
                by_key[key] = DPDecodeSteps(
                    model,
                    mesh,
                    self.layout,
                    pool,
                    index_k_dtype=index_k_dtype,
                    batch_invariant=batch_invariant,
                    block_bytes=block_bytes,
                    kv_io=kv_io,
                    ep_dispatch=ep_dispatch,
                    ep_capacity_factor=ep_capacity_factor,
                )
            self._dp = by_key[key]

    def _run(
        self,
        rows: list[DPRow],
        prefill: bool,
        prev: PrevTokens | None = None,
        targets: Sequence[np.ndarray] | None = None,
    ) -> Any:
        """The step over `rows`: its `StepLogits` (each rank's rows on that rank), and
        with `targets` its scores too (`(chosen, top_ids, top_logprobs)`, laid out as
        the logits)."""
        shape, order, host = build_batch(self.layout, rows, prefill=prefill)
        if targets is None:
            self._dp.compiled(shape)  # before the pool lock: it may compile or wait
            self.shapes.add(shape)
            tgt = None
        else:  # row `i`'s targets where `build_batch` put its tokens
            self._dp.compiled_score(shape)
            tgt = np.full_like(host[0], -1)  # -1: not scored (`score_tokens` skips it)
            for i, t in enumerate(targets):
                tgt[order[i], : len(t)] = t
        ids = None
        if prev is not None:  # the step's row of rows[i] is order[i]
            src = np.full(order.shape, -1, np.int32)
            src[order[: len(prev[1])]] = prev[1]
            ids = self._dp.feed_ids(prev[0], src, host[0])
        with jax.named_scope("decode_engine.prefill" if prefill else "decode_engine.decode"):
            out = self.kv.update_pool(lambda pool: self._dp.run(shape, host, pool, ids, tgt))
        if targets is None:
            return StepLogits(out, order)
        logits, *scored = out
        return StepLogits(logits, order), scored

    def _rank(self, pages: np.ndarray) -> int:
        return self.layout.rank_of(np.asarray(pages)[0])

    def prefill(
        self, prompt: np.ndarray, pages: np.ndarray, width: int, start: int = 0
    ) -> StepLogits:
        """Logits after the prompt's last token (the step's row of its rank, `order[0]`);
        `start` as `DecodeSteps.prefill`."""
        return self.prefill_many([(prompt, pages, width)], [start])

    def prefill_many(
        self,
        requests: Sequence[tuple[np.ndarray, np.ndarray, int]],
        starts: Sequence[int] | None = None,
    ) -> StepLogits:
        """One step prefilling `(prompt, pages, width)` requests, each on its pages' rank
        (at most one per rank: a prefill row is one request's prompt); the logits' row
        `order[i]` is after `requests[i]`'s last prompt token. `starts[i]`: the prompt
        positions before it already have their KV in the pages (a prefix-cache hit), so
        only the rest is fed."""
        starts = [0] * len(requests) if starts is None else starts
        ends = [len(prompt) for prompt, _, _ in requests]
        return self._run(self._prefill_rows(requests, starts, ends), prefill=True)

    def _prefill_rows(
        self,
        requests: Sequence[tuple[np.ndarray, np.ndarray, int]],
        starts: Sequence[int],
        ends: Sequence[int],
    ) -> list[DPRow]:
        """A row feeding `prompt[start:end]` for each request, on its pages' rank."""
        rows = [
            DPRow(self._rank(pages), np.asarray(prompt[start:end], np.int32), start, pages, width)
            for (prompt, pages, width), start, end in zip(requests, starts, ends, strict=True)
        ]
        if len({r.rank for r in rows}) != len(rows):
            raise ValueError("a DP prefill step takes at most one request per rank")
        return rows

    def score_many(
        self,
        requests: Sequence[tuple[np.ndarray, np.ndarray, int]],
        starts: Sequence[int],
        ends: Sequence[int],
        wanted: Sequence[bool] | None = None,
    ) -> tuple[StepLogits, list[TokenScores]]:
        """`prefill_many` of `prompt[start:end]` for each `(prompt, pages, width)` (the
        whole prompt) that also scores the fed tokens against the prompt's next ones
        (prompt log-probs; on the host, the step waited for); the logits stay on the
        device. `wanted[i]` False: request `i` rides along unscored (its row skips the
        LM head's scoring blocks; its scores are zeros)."""
        rows = self._prefill_rows(requests, starts, ends)
        wanted = [True] * len(requests) if wanted is None else wanted
        targets = [
            next_tokens(prompt, start, end - start) if want else np.full(end - start, -1)
            for (prompt, _, _), start, end, want in zip(requests, starts, ends, wanted, strict=True)
        ]
        out, scored = self._run(rows, prefill=True, targets=targets)
        return out, _span_scores(requests, starts, ends, scored, out.order)

    def decode(self, rows: Sequence[DecodeRow], prev: PrevTokens | None = None) -> StepLogits:
        """Logits of each row's next token, row `order[i]` that of `rows[i]`, each on its
        rank; `prev` as `DecodeSteps.decode`."""
        dp_rows = [
            DPRow(self._rank(pages), np.asarray([token], np.int32), pos, pages, n_pages)
            for token, pos, pages, n_pages in rows
        ]
        return self._run(dp_rows, prefill=False, prev=prev)

    def warm(self, shapes: Sequence[Shape]) -> None:
        """Run each shape once on rank 0's trash page, then the sampler on its rows."""
        _warm(self, shapes, "compiling DP decode steps")

    @property
    def logits_sharding(self) -> jax.sharding.Sharding:
        """The steps leave each rank's logit rows on that rank."""
        return self._dp.rows_sharding

    @property
    def state_sharding(self) -> jax.sharding.Sharding:
        """The sampler's per-request state is on every device (a rank's rows may take
        any penalty slot)."""
        return self._dp.replicated

    def logit_rows(self, rows: int) -> int:
        """Log-prob rows of a step whose busiest rank has `rows` (padded) rows."""
        return self.layout.dp_size * rows

    def warm_feeds(self, rows: set[int]) -> None:
        """`DecodeSteps.warm_feeds` for steps whose busiest rank has `rows` rows."""
        _warm_feeds(self, rows, self._dp.feed_ids)

    def warm_log_probs(self, rows: set[int]) -> None:
        """The log-softmax and sampler on the steps' `[dp * R, vocab]` logits for each row
        bucket `R` (see `DecodeSteps.warm_log_probs`)."""
        _warm_log_probs(self, rows)

    def compiled(self, shape: Shape) -> jax.stages.Compiled:
        return self._dp.compiled(shape)

    def compiled_score(self, shape: Shape) -> jax.stages.Compiled:
        """The scoring twin of the prefill step `shape` (`score_many`)."""
        return self._dp.compiled_score(shape)

    @property
    def compiled_score_shapes(self) -> set[Shape]:
        return self._dp.compiled_score_shapes

    def compile_estimate(self, shapes: set[Shape]) -> tuple[int, float]:
        return self._dp.compile_estimate(shapes)

    @property
    def compile_count(self) -> int:
        return self._dp.compile_count

    @property
    def compiled_shapes(self) -> set[Shape]:
        return self._dp.compiled_shapes


def cp_bucket(shape: Shape, cp: int) -> Shape:
    """The CP decode step an engine shape runs as: rows and width at least `cp`."""
    form, rows, tokens, width = shape
    return form, max(rows, cp), tokens, max(width, cp)


class CPMeshDecodeSteps:
    """`DecodeSteps` on a CP mesh over a shared-KV CP runner's page-owned pools
    (`cpkv_jax.cp_decode`, issue 40): the unified server with `--cp-size N`, whose
    prompts the runner prefills (`serving.decode.cached.CachedPrefill`) and whose decode
    rows run here with a request's KV striped over the ranks by owner; or a PD decode
    server's CP group, or its DP groups of CP ranks (`cp_decode.DecodeGroups`).

    A request's `pages` are global page ids (lane `l`'s local page `j` is `l *
    pages_per_rank + j`, as a DP pool's shards; group `g`'s lanes are `g * N ..`),
    logical page `p` on its group's lane `p % cp`: the prefix cache's intake allocates
    them there, and so does a PD decode server's admission (`DecodeEngine.admit`), whose
    receiver scatters each page by logical position. Shape keys are the engine's
    (`("absorbed", R, 1, W)`, powers of two, `R` rows per group) raised to at least `cp`,
    which for `cp` a power of two are exactly one group's rows and page-table width in
    the CP step (`cp_decode.plan_rows`; groups stack theirs, `plan_groups`): `bucket` maps
    the engine's reachable shapes onto them. Decode only (`prefill` raises)."""

    prefill_form = "absorbed"

    def __init__(self, decoder: CPDecoder):
        cp = decoder.runner.cp.cp_size
        if cp & (cp - 1):
            raise ConfigError(f"CP decode steps need a power-of-two cp_size, got {cp}")
        self.decoder = decoder
        self.cp = cp
        self.groups = decoder.groups
        self.layout = decoder.runner.layout  # one group's lanes
        self.vocab_size = decoder.runner.cfg.vocab_size
        self.batch_invariant = decoder.runner.batch_invariant
        self.shapes: set[Shape] = set()

    def bucket(self, shape: Shape) -> Shape:
        """The CP step an engine shape runs as: rows and width at least `cp`."""
        return cp_bucket(shape, self.cp)

    def local(self, pages: np.ndarray) -> np.ndarray:
        """A request's global page ids as local ones on their lanes."""
        return np.asarray(pages, np.int64) % self.layout.pages_per_rank

    def group_of(self, pages: np.ndarray) -> int:
        """The group whose lanes hold a request's pages."""
        return int(np.asarray(pages)[0]) // (self.layout.pages_per_rank * self.cp)

    def prefill(
        self, prompt: np.ndarray, pages: np.ndarray, width: int, start: int = 0
    ) -> jax.Array:
        raise ValueError("the CP decode steps do not prefill: the CP runner does")

    def decode(self, rows: Sequence[DecodeRow], prev: PrevTokens | None = None) -> StepLogits:
        """Logits of each row's next token, row `order[i]` that of `rows[i]` (one group:
        row `i`), each on the rank that ran it; `prev` as `DecodeSteps.decode`."""
        by_group: list[list] = [[] for _ in range(self.groups)]
        where = []
        for token, pos, pages, n in rows:
            g = self.group_of(pages)
            where.append((g, len(by_group[g])))
            by_group[g].append((token, pos, self.local(pages), n))
        plan, at = plan_groups(self.layout, by_group)
        rows_p, width = plan.shape
        self.decoder.compiled_step(plan.shape)  # before the pool lock: it may compile or wait
        self.shapes.add(("absorbed", rows_p // self.groups, 1, width))
        # The step's row of rows[i] (then its padding rows), as `build_batch`'s `order`.
        order = np.zeros((rows_p,), np.int32)
        order[: len(rows)] = [at[g][j] for g, j in where]
        order[len(rows) :] = np.setdiff1d(np.arange(rows_p), order[: len(rows)])
        ids = None
        if prev is not None:
            src = np.full((rows_p,), -1, np.int32)
            src[order[: len(prev[1])]] = prev[1]
            ids = self.decoder.feed(prev[0], src, plan.input_ids)
        with jax.named_scope("decode_engine.decode"):
            logits = self.decoder.launch(plan, ids)
        # One group's rows are planned in order; groups stack theirs group-major.
        return StepLogits(logits, None if self.groups == 1 else order)

    def warm(self, shapes: Sequence[Shape]) -> None:
        """Run each shape once on lane 0's trash page, then the sampler on its rows."""
        _warm(self, shapes, "compiling CP decode steps")

    @property
    def logits_sharding(self) -> jax.sharding.Sharding:
        """The steps leave each row's logits on the rank that ran it."""
        return self.decoder.rows_sharding

    @property
    def state_sharding(self) -> jax.sharding.Sharding:
        """The sampler's per-request state is on every device."""
        return self.decoder.replicated

    def logit_rows(self, rows: int) -> int:
        return self.groups * max(rows, self.cp)

    def warm_feeds(self, rows: set[int]) -> None:
        """`DecodeSteps.warm_feeds` for the CP steps' row buckets."""
        _warm_feeds(self, rows, self.decoder.feed)

    def warm_log_probs(self, rows: set[int]) -> None:
        """The log-softmax and sampler on the steps' logits for each row bucket (see
        `DecodeSteps.warm_log_probs`)."""
        _warm_log_probs(self, rows)

    def _key(self, shape: Shape) -> tuple[int, int]:
        """The decoder's step key of an engine shape: every group's rows, the width."""
        _, rows, _, width = self.bucket(shape)
        return self.groups * rows, width

    def compiled(self, shape: Shape) -> jax.stages.Compiled:
        return self.decoder.compiled_step(self._key(shape))

    def compile_estimate(self, shapes: set[Shape]) -> tuple[int, float]:
        return self.decoder.steps.estimate({self._key(s) for s in shapes})

    @property
    def compile_count(self) -> int:
        return self.decoder.steps.compiles

    @property
    def compiled_shapes(self) -> set[Shape]:
        return {
            ("absorbed", rows // self.groups, 1, width)
            for rows, width in self.decoder.steps.compiled_keys()
        }
