"""Speculative decoding in the decode engine: draft with the model's MTP layer, verify
with the trunk, one device program per step (issue 39; `cpkv_jax.speculative`).

`cpkv-serve --speculative-algorithm NEXTN --speculative-num-steps K` (SGLang's flags)
gives the unified server's engine a `SpeculativeSteps` in place of the plain
`DecodeSteps`:

- admission with `--disable-radix-cache` (`prefill`): the trunk over the prompt, its
  first token drawn on the device, the MTP layer's pass over the prompt and the first K
  drafts, in one program (on a DP mesh with a prefix cache per rank, `prefill_many`
  from the end of each prompt's cached prefix); on the default prefix-cache engine the
  CP runner prefills and runs the MTP layer over all but the prompt's last position, and
  `admit_after_prefill` draws the first token from its last logits, runs the MTP layer
  at the last position with the trunk's hidden state there and chains the first K
  drafts; on a PD decode server the prefill server ran that pass and drew the first
  token, and `admit_given` runs the MTP layer at the last position on it with the hidden state the
  room's aux data carried, and chains the first K drafts;
- each decode step (`step`): every running row verifies its K drafts and emits 1..K+1
  tokens, then the MTP layer drafts the next K, in one program. The host reads back only
  the emitted tokens, the accepted counts and the tokens' log-probs.

Each running request holds a slot of the draft state (`cpkv_jax.speculative.init_slab`:
its last verified token and position, its drafts and their distributions, its
temperature, seed, filters and penalties), which stays on the device between steps;
padding rows use the spare slot. Every program takes flat per-row host arrays (`Row`s,
one builder per program, a padding row per form that also sizes its lowering); on a DP
mesh (`--dp-size`) each runs per rank under `shard_map` (`decode_mesh.dp_slab_program`),
a request's rows on the rank of its pages, in a slot of that rank. On a CP group
(`--cp-size N`, issue 40) the same programs run per CP rank through the group's owner
attention (`cp_decode.row_placement`, `OwnerCPKVIO`): a request's pages are striped over
every lane, so only its draft-state slot, taken on the rank with the most free ones,
says which rank runs its rows.

A request reserves `speculative_room(K, overlap)` tokens of pages beyond
`prompt + max_new_tokens`: the last verify and draft chain write up to 2K + 1 positions
past the row's length, and with overlap one more step (K + 1) runs before the host sees
the row finished.

A row's top-k, top-p and min-p filter its target distribution (`softmax(logits / T)`,
filtered as the sampler filters one draw); its drafts come from the MTP layer's unfiltered
distribution, which keeps speculative sampling exact for the filtered target. A row that
asks for top log-probs gets them at every token it emits: the step takes the top-N of
every verified position when a row of it asks (`cpkv_jax.speculative.top_logprobs`), and
the host fetches them only then. A row's frequency, presence and repetition penalties
and logit bias shape its target too (`cpkv_jax.speculative.Penalties`, kept in its
draft-state slot: each verified position counts the drafts before it as emitted), as
the plain sampler applies them, and so do `min_new_tokens`' bans of the stop tokens
(bias pairs of -inf, for the tokens at positions before `Penalties.ban_until`). What a
speculative step cannot apply is refused when the request arrives (`refusal`: HTTP 400
naming the parameter): a grammar needs a server without `--speculative-algorithm` (its
mask at each token of the chain depends on host-side matcher state).

Step shapes (the `DecodeSteps` interface, so the engine's warm-up and compile accounting
are unchanged): `("spec" | "spec_greedy", rows, K + 1, width)` for decode steps,
`("spec_prefill" | "spec_prefill_greedy", 1, prefill bucket, width)`,
`("spec_admit" | "spec_admit_greedy", 1, 1, width)` and `("spec_given" |
"spec_given_greedy", 1, 1, width)` for the three kinds of admission; the greedy variants
run when every row is at temperature 0 and keep no distributions. On a DP mesh `rows`
counts the busiest rank's rows, as `MeshDecodeSteps`' keys do. A request that asks for
prompt log-probs is prefilled by the scoring twin of its prefill shape
(`"spec_prefill_score[_greedy]"`, `compiled_score`): the same program that also scores
the fed tokens against the prompt's next ones from the trunk's hidden states.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from cpkv_jax.aot import ShapeCache, abstract
from cpkv_jax.buckets import page_table_width, pow2_at_least, prefill_bucket
from cpkv_jax.cp_decode import CPDecoder, row_placement
from cpkv_jax.decode_mesh import DPPlacement, DPPoolLayout, dp_slab_program
from cpkv_jax.errors import ConfigError
from cpkv_jax.kv_store import KVStore
from cpkv_jax.model.expert_parallel import EPDispatch
from cpkv_jax.model.forward_batch import ForwardBatch, span_batch
from cpkv_jax.model.kv_cache import SINGLE_DEVICE_KV_IO, IndexKDtype, KVPool, PagedKVIO
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.paging import padded_page_table
from cpkv_jax.sampling import bias_rows
from cpkv_jax.scores import next_tokens
from cpkv_jax.speculative import (
    Filters,
    Penalties,
    StepOutput,
    init_slab,
    slab_admit,
    slab_admit_from_hidden,
    slab_admit_given,
    slab_step,
)
from serving.decode.request import DecodeRequest
from serving.decode.steps import _CACHES, _CACHES_LOCK, CompiledShapes, Shape
from serving.engine.api import GenerateRequest

# SGLang's names for drafting with the checkpoint's own MTP layer ("EAGLE" is what its
# GLM-5 recipe passes; "NEXTN" is the DeepSeek name it maps to EAGLE).
SPECULATIVE_ALGORITHMS = ("NEXTN", "EAGLE", "MTP")
SPEC_FORMS = ("spec", "spec_greedy")
# Draft-state slots at most: each keeps K x vocab float32 draft distributions (GLM-5, K =
# 3: 1.9 MB a slot, 475 MB at 256); requests beyond them wait to be admitted.
SPEC_SLOTS_MAX = 256
SPEC_PREFILL_FORMS = ("spec_prefill", "spec_prefill_greedy")
# The scoring twins of the prefill forms (prompt log-probs: `prefill_many` with targets),
# compiled on first use or by `--warmup-prompt-scoring`, as the plain steps' twins are.
SPEC_SCORE_FORMS = ("spec_prefill_score", "spec_prefill_score_greedy")
# After a prefill elsewhere (the prefix-cache engine's CP runner): the first token, the
# MTP layer at the prompt's last position and the first drafts, `(form, 1, 1, width)`.
SPEC_ADMIT_FORMS = ("spec_admit", "spec_admit_greedy")
# After a PD prefill server's prefill and first token (`admit_given`), `(form, 1, 1, width)`.
SPEC_GIVEN_FORMS = ("spec_given", "spec_given_greedy")
# How a request's first drafts are made, by who prefilled it: the engine's own program
# (None), a prefill that hands over its last logits ("logits"), or one that also drew
# the first token ("token").
ADMISSION_FORMS = {"logits": SPEC_ADMIT_FORMS, "token": SPEC_GIVEN_FORMS}


# A row's target filters as the sampler takes them: (top_k, top_p, min_p).
RowFilters = tuple[int, float, float]
NO_FILTERS: RowFilters = (0, 1.0, 0.0)
# A row's penalties as the sampler takes them: (its prompt's tokens, its logit bias as
# (token, value) pairs with its stop tokens' bans (-inf: `stop_token_bias`), frequency,
# presence and repetition penalties, the position the bans end at (0: none)).
RowPenalty = tuple[
    np.ndarray | Sequence[int], Sequence[tuple[int, float]], float, float, float, int
]
NO_PENALTY: RowPenalty = ((), (), 0.0, 0.0, 1.0, 0)
# One admission of `prefill_many`: (prompt, pages, page-table width, draft-state slot,
# temperature, seed, filters, whether it reports top log-probs, penalties).
SpecAdmission = tuple[np.ndarray, np.ndarray, int, int, float, int, RowFilters, bool, RowPenalty]
# A program's arguments for one row: a tuple of host arrays, each with a leading axis of 1
# (`SpeculativeSteps._rows` stacks them into the step's rows).
Row = tuple[np.ndarray, ...]


def _sampling(
    vocab: int,
    temperature: float,
    seed: int,
    filters: RowFilters,
    top: bool,
    penalty: RowPenalty = NO_PENALTY,
) -> Row:
    """One admitted row's temperature, seed, target filters (top-k, top-p, min-p),
    whether it reports its tokens' top log-probs, and its penalties (`Penalties`' row:
    the prompt as a `[vocab]` mask, the bias pairs in `PenaltyCounts`' layout)."""
    top_k, top_p, min_p = filters
    prompt_ids, logit_bias, frequency, presence, repetition, ban_until = penalty
    prompt = np.zeros((1, vocab), bool)
    if repetition != 1.0:  # the only penalty that reads the prompt
        prompt[0, np.asarray(prompt_ids, np.int64)] = True
    bias_ids, bias_values = (a[None] for a in bias_rows(logit_bias, vocab))
    return (
        np.asarray([temperature], np.float32),
        np.asarray([seed % 2**31], np.int32),
        np.asarray([top_k], np.int32),
        np.asarray([top_p], np.float32),
        np.asarray([min_p], np.float32),
        np.asarray([top], bool),
        prompt,
        bias_ids,
        bias_values,
        np.asarray([frequency], np.float32),
        np.asarray([presence], np.float32),
        np.asarray([repetition], np.float32),
        np.asarray([ban_until], np.int32),
    )


def _reports(rest: tuple) -> tuple[tuple, Filters, jax.Array, Penalties, KVPool]:
    """Split an admission program's trailing arguments (`_sampling`'s row after the
    temperature and seed, then the pool) off `rest`: (the arguments before them,
    filters, top, penalties, pool)."""
    *head, top_k, top_p, min_p, top, prompt, bias_ids, bias_values = rest[:-5]
    *scalars, pool = rest[-5:]  # frequency, presence, repetition, ban_until; the pool
    counts = jnp.zeros(prompt.shape, jnp.int32)  # a prompt has no outputs yet
    penalties = Penalties(counts, prompt, bias_ids, bias_values, *scalars)
    return tuple(head), Filters(top_k, top_p, min_p), top, penalties, pool


def _programs(graphdef, k: int, greedy: bool, static: dict) -> dict[str, Callable]:
    """The speculative programs of `cpkv_jax.speculative` over flat row arguments (the
    `Row`s `SpeculativeSteps` builds, stacked), each returning `(out, slab, pool)`:
    `out` the step's `StepOutput`; the first tokens, their log-probs and top log-probs
    (ids, values) of an admission that draws them (a scoring prefill: then the fed
    tokens' scores); or nothing."""

    def step(state, slab, slots, table, live, pool):
        return slab_step(graphdef, state, slab, slots, table, live, pool, greedy=greedy, **static)

    def prefill(state, slab, slots, *rest, targets=None):
        (*batch, temperature, seed), filters, top, penalties, pool = _reports(rest)
        *out, slab, pool = slab_admit(
            graphdef, state, slab, slots, ForwardBatch(*batch), temperature, seed,
            filters, top, penalties, pool, k=k, greedy=greedy, targets=targets, **static,
        )  # fmt: skip
        return tuple(out), slab, pool

    def score(state, slab, slots, targets, *rest):
        return prefill(state, slab, slots, *rest, targets=targets)

    def admit(state, slab, slots, logits, hidden, n, table, *rest):
        row, filters, top, penalties, pool = _reports(rest)
        *out, slab, pool = slab_admit_from_hidden(
            graphdef, state, slab, slots, logits, hidden, n, table, *row,
            filters, top, penalties, pool, k=k, greedy=greedy, **static,
        )  # fmt: skip
        return tuple(out), slab, pool

    def given(state, slab, slots, token, hidden, n, table, *rest):
        row, filters, top, penalties, pool = _reports(rest)
        slab, pool = slab_admit_given(
            graphdef, state, slab, slots, token, hidden, n, table, *row,
            filters, top, penalties, pool, k=k, greedy=greedy, **static,
        )  # fmt: skip
        return (), slab, pool

    return {
        SPEC_FORMS[greedy]: step,
        SPEC_PREFILL_FORMS[greedy]: prefill,
        SPEC_SCORE_FORMS[greedy]: score,
        SPEC_ADMIT_FORMS[greedy]: admit,
        SPEC_GIVEN_FORMS[greedy]: given,
    }


def speculative_room(num_steps: int, overlap: bool) -> int:
    """Tokens a request reserves beyond `prompt + max_new_tokens` (the module docstring)."""
    return 2 * num_steps + 1 + (num_steps + 1 if overlap else 0)


def refusal(req: GenerateRequest) -> str | None:
    """Why a speculative engine cannot serve `req` as asked, or None."""
    sp = req.sampling
    asked = [
        name for name, on in (("a grammar (structured output)", sp.grammar is not None),) if on
    ]
    if not asked:
        return None
    return (
        f"this server decodes speculatively (--speculative-algorithm), which samples from "
        f"the model's distribution with its penalties, logit bias, min_new_tokens, top-k, "
        f"top-p and min-p only; {', '.join(asked)} "
        f"{'needs' if len(asked) == 1 else 'need'} a server without speculative decoding"
    )


# A model's weights placed on a DP mesh, shared by the speculative engines of one model
# and mesh (the warm-up probe's and the served engine's): one copy of the weights.
_PLACED: weakref.WeakKeyDictionary[CausalLM, dict[tuple, DPPlacement]] = weakref.WeakKeyDictionary()


class SpeculativeSteps(CompiledShapes):
    """Draft-and-verify steps of one model (with its MTP layer) over one `KVStore`, and
    the draft-state slots of the rows (see the module docstring).

    On a `("dp",)` mesh (`mesh`, issue 36's data-parallel decode) every program runs on
    each rank over its shard of the pool and of the draft state, with the routed experts
    split over the ranks (`decode_mesh.dp_slab_program`): a request's rows run on the rank
    holding its pages, in a draft-state slot of that rank (`slots` per rank; slot ids are
    global, `rank * (slots + 1) + local`, the local `slots` being the rank's spare), and
    shape keys count rows per rank as `MeshDecodeSteps`' do.

    On a CP group (`cp_decoder`, issue 40) the programs run per CP rank the same way, over
    the decoder's runner's placed weights and page-owned pool with its owner attention
    (write slots on the owner lanes); a request's pages are global ids striped over every
    lane (`CPMeshDecodeSteps`), its rows run on the rank of its slot, and page-table
    widths are at least `cp` (`page_table_width`)."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVStore,
        *,
        num_steps: int,
        slots: int,
        page_size: int,
        index_k_dtype: IndexKDtype,
        batch_invariant: bool,
        block_bytes: int | None,
        kv_io: PagedKVIO = SINGLE_DEVICE_KV_IO,
        mesh: Mesh | None = None,
        ep_dispatch: EPDispatch = "allgather",
        ep_capacity_factor: float | None = None,
        cp_decoder: CPDecoder | None = None,
    ):
        if num_steps < 1:
            raise ConfigError(f"--speculative-num-steps must be >= 1, got {num_steps}")
        if model.mtp is None:
            raise ConfigError(
                "speculative decoding drafts with the checkpoint's MTP layer, and this model "
                "was loaded without it"
            )
        self.k = num_steps
        self.kv = kv
        self.page_size = page_size
        self.vocab_size = model.cfg.vocab_size
        self.hidden_size = model.cfg.hidden_size
        self.batch_invariant = batch_invariant
        self.prefill_form = SPEC_PREFILL_FORMS[0]
        self.shapes: set[Shape] = set()
        if cp_decoder is not None and mesh is not None:
            raise ConfigError("speculative steps run on a DP mesh or a CP group, not both")
        self.cp_decoder = cp_decoder
        self.cp = 1 if cp_decoder is None else cp_decoder.runner.cp.cp_size
        self.groups = 1 if cp_decoder is None else cp_decoder.groups
        dp = self.cp * self.groups if cp_decoder is not None else 1 if mesh is None else mesh.size
        pool = kv.pool
        # One rank's pages and slots (a single device: the whole pool, rank 0; a CP
        # group: one lane, its page ids global as a DP pool's; DP groups of CP ranks:
        # group g's lanes are ranks g * cp ..).
        self.layout = DPPoolLayout(dp, pool.num_pages // dp, page_size)
        self.slots_per_rank = slots
        self.num_slots = dp * slots
        self._free = [list(range(slots - 1, -1, -1)) for _ in range(dp)]  # pop(): 0 first
        self.mesh = mesh
        self._placed: DPPlacement | None = None
        if cp_decoder is not None:
            self._placed = row_placement(cp_decoder.runner, cp_decoder.row_axes)
            graphdef, self._state = self._placed.graphdef, self._placed.state
            kv_io = cp_decoder.kv_io  # owner attention, rows split over "cp" (and "dp")
            runner = cp_decoder.runner
            block_bytes = runner.block_bytes
            placement: tuple = (
                tuple(d.id for d in runner.mesh.devices.reshape(-1)),
                cp_decoder.row_axes,
                self.layout,
            )
        elif mesh is None:
            graphdef, self._state = nnx.split(model)
            placement = ()
        else:
            key = (tuple(d.id for d in mesh.devices.reshape(-1)), ep_dispatch, ep_capacity_factor)
            with _CACHES_LOCK:
                by_key = _PLACED.setdefault(model, {})
                if key not in by_key:
                    by_key[key] = DPPlacement.of(model, mesh, ep_dispatch, ep_capacity_factor)
                self._placed = by_key[key]
            graphdef, self._state = self._placed.graphdef, self._placed.state
            placement = (*key, self.layout)
        # Every rank's slots and its spare (the last of its `slots + 1`).
        slab = init_slab(dp * (slots + 1) - 1, num_steps, self.vocab_size)
        self.slab = jax.device_put(slab, self._slab_sharding(pool))
        static = {
            "page_size": page_size,
            "index_k_dtype": index_k_dtype,
            "invariant": batch_invariant,
            "kv_io": kv_io,
            "block_bytes": block_bytes,
        }
        self._fns: dict[str, Callable] = {}
        for greedy in (False, True):
            for form, fn in _programs(graphdef, num_steps, greedy, static).items():
                if cp_decoder is not None and form in SPEC_PREFILL_FORMS + SPEC_SCORE_FORMS:
                    continue  # a CP group's runner prefills; these would never run here
                n_rows = len(self._pad_row(form, 1, 1))  # (state, slab, *rows, pool)
                if self._placed is None:
                    self._fns[form] = jax.jit(fn, donate_argnums=(1, 2 + n_rows))
                else:
                    self._fns[form] = dp_slab_program(self._placed, fn, n_rows)
        self._abstract = (abstract(self._state), abstract(self.slab), abstract(pool))
        leaves, tree = jax.tree.flatten(self._abstract)
        context = ("speculative", num_steps, graphdef, tree, *leaves, *placement)
        context += tuple(static.items())
        with _CACHES_LOCK:
            caches = _CACHES.setdefault(model, {})
            self._compiled = caches.setdefault(context, ShapeCache("speculative step"))

    def _slab_sharding(self, pool) -> jax.sharding.Sharding:
        if self._placed is None:
            return jax.tree.leaves(pool)[0].sharding
        return self._placed.rows

    @property
    def slab_bytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self.slab))

    # ---- slots ---------------------------------------------------------------------------
    def take_slot(self, rank: int = 0) -> int:
        """A free draft-state slot on `rank` (`free_slots_on(rank)` says one is); on a CP
        group (admission rank `rank`) on its CP rank with the most free slots, which then
        runs the request's rows."""
        if self.cp_decoder is not None:
            rank = max(self._group_ranks(rank), key=lambda r: (len(self._free[r]), -r))
        return rank * (self.slots_per_rank + 1) + self._free[rank].pop()

    def _group_ranks(self, group: int) -> range:
        """The slab ranks of CP group `group` (its lanes)."""
        return range(group * self.cp, (group + 1) * self.cp)

    def give_back(self, slot: int) -> None:
        rank, local = divmod(slot, self.slots_per_rank + 1)
        self._free[rank].append(local)

    @property
    def free_slots(self) -> int:
        return sum(len(f) for f in self._free)

    def free_slots_on(self, rank: int) -> int:
        """Free slots an admission to `rank` can take (a CP group: any of its ranks')."""
        if self.cp_decoder is not None:
            return sum(len(self._free[r]) for r in self._group_ranks(rank))
        return len(self._free[rank])

    # ---- rows ----------------------------------------------------------------------------
    def _local(self, slot: int, pages: np.ndarray) -> tuple[int, int, np.ndarray]:
        """A row's rank (its pages'; a CP group's: its slot's), its slot there and its
        rank-local pages (a CP group's: each logical page's local id on its lane)."""
        pages = np.asarray(pages)
        slot_rank, local = divmod(slot, self.slots_per_rank + 1)
        if self.cp_decoder is not None:
            return slot_rank, local, pages % self.layout.pages_per_rank
        rank = self.layout.rank_of(pages[0])
        if slot_rank != rank:
            raise ValueError(f"draft-state slot {slot} is on rank {slot_rank}, not {rank}")
        return rank, local, self.layout.local(pages, rank)

    def _table(self, pages: np.ndarray, width: int) -> np.ndarray:
        return padded_page_table(pages, width)[None]

    def _pad_row(self, form: str, tokens: int, width: int) -> Row:
        """A padding row of program `form`: the rank's spare slot, the trash page, nothing
        live (also what sizes the program's arguments when it is lowered)."""
        spare = np.asarray([self.slots_per_rank], np.int32)
        trash = np.zeros((1,), np.int32)
        if form in SPEC_FORMS:
            return (spare, self._table(trash, width), np.zeros((1,), bool))
        none = _sampling(self.vocab_size, 0.0, 0, NO_FILTERS, False)
        if form in SPEC_PREFILL_FORMS + SPEC_SCORE_FORMS:
            table = padded_page_table(trash, width)
            batch = span_batch(np.zeros((0,), np.int32), 0, table, self.page_size, tokens)
            row = (*(np.asarray(a) for a in dataclasses.astuple(batch)), *none)
            if form in SPEC_SCORE_FORMS:  # nothing asked to be scored
                return (spare, np.full((1, tokens), -1, np.int32), *row)
            return (spare, *row)
        first = (
            np.zeros((1, self.vocab_size), np.float32)
            if form in SPEC_ADMIT_FORMS
            else np.zeros((1,), np.int32)
        )
        hidden = np.zeros((1, self.hidden_size), np.float32)
        return (spare, first, hidden, np.zeros((1,), np.int32), self._table(trash, width), *none)

    def _run(self, shape: Shape, rows: Sequence[tuple[int, Row]], scope: str):
        """Run program `shape` on `rows` (each `(rank, its Row)`), padded per rank to the
        shape's rows; returns the program's `out`, row `i` that of `rows[i]` (padding
        after), on the device. The slab and the pool are donated."""
        form, rows_p, tokens, width = shape
        run = self.compiled(shape)  # before the pool lock: it may compile or wait
        if form not in SPEC_SCORE_FORMS:  # scoring twins are counted apart, as the plain ones
            self.shapes.add(shape)
        pad = self._pad_row(form, tokens, width)
        grid: list[Row] = [pad] * (self.layout.dp_size * rows_p)
        order = np.zeros((len(grid),), np.int32)
        used = [0] * self.layout.dp_size
        for i, (rank, row) in enumerate(rows):
            if used[rank] == rows_p:
                raise ValueError(f"more than {rows_p} rows on rank {rank} for {shape}")
            order[i] = at = rank * rows_p + used[rank]
            grid[at], used[rank] = row, used[rank] + 1
        order[len(rows) :] = np.setdiff1d(np.arange(len(grid)), order[: len(rows)])
        args = tuple(np.concatenate(leaf) for leaf in zip(*grid, strict=True))

        if self._placed is None:  # one rank: row i is the i-th given, no order needed

            def go(pool):
                out, self.slab, pool = run(self._state, self.slab, *args, pool)
                return out, pool
        else:
            placed = self._placed
            order_a, args_a = placed.put_replicated(order), placed.put_rows(args)

            def go(pool):
                out, self.slab, pool = run(self._state, self.slab, order_a, args_a, pool)
                return out, pool

        with jax.named_scope(f"decode_engine.{scope}"):
            return self.kv.update_pool(go)

    # ---- steps ---------------------------------------------------------------------------
    def prefill(
        self,
        prompt: np.ndarray,
        pages: np.ndarray,
        width: int,
        slot: int,
        temperature: float,
        seed: int,
        filters: RowFilters = NO_FILTERS,
        top: bool = False,
        penalty: RowPenalty = NO_PENALTY,
    ) -> tuple[jax.Array, ...]:
        """Admit one request: its prompt's KV (trunk and MTP layer) into `pages`, its first
        K drafts into `slot`; returns its first token, that token's log-prob and the top
        log-probs there (ids, values; zeros unless `top`), on the device (row 0 of each is
        the request's)."""
        admission = (prompt, pages, width, slot, temperature, seed, filters, top, penalty)
        return self.prefill_many([admission])

    def prefill_many(
        self,
        requests: Sequence[SpecAdmission],
        starts: Sequence[int] | None = None,
        scored: Sequence[bool] | None = None,
    ) -> tuple[jax.Array, ...]:
        """`prefill` for requests on different DP ranks, in one program (a padding row on
        every other rank); row `i` of what it returns is `requests[i]`'s. `starts[i]`:
        the prompt positions before it have their trunk and MTP KV in the pages already
        (a prefix-cache hit), so only the rest is fed. `scored[i]`: score request `i`'s
        fed tokens against its prompt's next ones (prompt log-probs): the prefill's
        scoring twin runs, and returns after the first tokens' four arrays the fed
        tokens' scores (`transformer.score_tokens`: chosen, top ids, top log-probs;
        zeros for a request not scored)."""
        if self.cp_decoder is not None:
            raise ValueError("speculative steps on a CP group do not prefill: the CP runner does")
        starts = [0] * len(requests) if starts is None else list(starts)
        scored = [False] * len(requests) if scored is None else list(scored)
        fed = [len(req[0]) - start for req, start in zip(requests, starts, strict=True)]
        tokens = prefill_bucket(max(fed))
        width = max(req[2] for req in requests)
        greedy = all(req[4] == 0 for req in requests)
        scoring = any(scored)
        rows = []
        for (prompt, pages, _, slot, temperature, seed, *reports), start, score in zip(
            requests, starts, scored, strict=True
        ):
            rank, local, local_pages = self._local(slot, pages)
            table = padded_page_table(local_pages, width)
            ids = np.asarray(prompt[start:], np.int32)
            batch = span_batch(ids, start, table, self.page_size, tokens)
            batch_rows = (np.asarray(a) for a in dataclasses.astuple(batch))
            slot_row = np.asarray([local], np.int32)
            sampling = _sampling(self.vocab_size, temperature, seed, *reports)
            row: Row = (*batch_rows, *sampling)
            if scoring:  # -1: padding, or a request nobody asked to score
                targets = np.full((1, tokens), -1, np.int32)
                if score:
                    targets[0, : ids.size] = next_tokens(np.asarray(prompt), start, ids.size)
                row = (targets, *row)
            rows.append((rank, (slot_row, *row)))
        if len({rank for rank, _ in rows}) != len(rows):
            raise ValueError("a speculative prefill takes at most one request per rank")
        forms = SPEC_SCORE_FORMS if scoring else SPEC_PREFILL_FORMS
        return self._run((forms[greedy], 1, tokens, width), rows, "spec_prefill")

    def admit_after_prefill(
        self,
        logits: np.ndarray,
        hidden: np.ndarray,
        n: int,
        pages: np.ndarray,
        width: int,
        slot: int,
        temperature: float,
        seed: int,
        filters: RowFilters = NO_FILTERS,
        top: bool = False,
        penalty: RowPenalty = NO_PENALTY,
    ) -> tuple[jax.Array, ...]:
        """Admit one request whose prompt (`n` tokens) was prefilled elsewhere with the
        MTP layer's pass over all but its last position: from that prefill's last logits
        and hidden state, its first token and drafts (`slab_admit_from_hidden`); returns
        what `prefill` returns."""
        first = np.asarray(logits, np.float32).reshape(1, -1)
        return self._after_prefill(
            SPEC_ADMIT_FORMS, first, hidden, n, pages, width, slot, temperature, seed,
            (filters, top, penalty),
        )  # fmt: skip

    def admit_given(
        self,
        token: int,
        hidden: np.ndarray,
        n: int,
        pages: np.ndarray,
        width: int,
        slot: int,
        temperature: float,
        seed: int,
        filters: RowFilters = NO_FILTERS,
        top: bool = False,
        penalty: RowPenalty = NO_PENALTY,
    ) -> None:
        """Admit one request whose prompt (`n` tokens) was prefilled elsewhere, with the
        MTP layer's pass over all but its last position, and whose first output `token`
        was drawn there too (a PD prefill server): its first drafts from `token` and the
        trunk's hidden state at the last position (`slab_admit_given`)."""
        first = np.asarray([token], np.int32)
        self._after_prefill(
            SPEC_GIVEN_FORMS, first, hidden, n, pages, width, slot, temperature, seed,
            (filters, top, penalty),
        )  # fmt: skip

    def _after_prefill(
        self, forms, first, hidden, n, pages, width, slot, temperature, seed, reports
    ) -> tuple:
        """Run one of the two admissions after a prefill elsewhere (`forms`), from
        `first` (the prefill's last logits, or the first token it drew); `reports`:
        (filters, top, penalty)."""
        shape = (forms[temperature == 0], 1, 1, page_table_width(width, self.cp))
        rank, local, local_pages = self._local(slot, pages)
        row = (
            np.asarray([local], np.int32),
            first,
            np.asarray(hidden, np.float32).reshape(1, -1),
            np.asarray([n], np.int32),
            self._table(local_pages, shape[3]),
            *_sampling(self.vocab_size, temperature, seed, *reports),
        )
        return self._run(shape, [(rank, row)], forms[0])

    def step(self, rows: Sequence[tuple[int, np.ndarray, int]], greedy: bool) -> StepOutput:
        """One draft-and-verify step for `rows` (slot, pages, pages reserved), padded to a
        power of two per rank (padding rows write the trash page and the spare slot);
        `greedy` when every row is at temperature 0. The output stays on the device, row
        `i` that of `rows[i]`. On a CP group the width is at least `cp` (each rank reads
        the table's columns it owns)."""
        placed = [self._local(slot, pages) for slot, pages, _ in rows]
        per_rank = np.bincount([rank for rank, _, _ in placed], minlength=self.layout.dp_size)
        width = page_table_width(max(n for *_, n in rows), self.cp)
        shape = (SPEC_FORMS[greedy], pow2_at_least(int(per_rank.max())), self.k + 1, width)
        true = np.ones((1,), bool)
        step_rows = [
            (rank, (np.asarray([local], np.int32), self._table(pages, width), true))
            for rank, local, pages in placed
        ]
        return self._run(shape, step_rows, "spec_step")

    # ---- shapes and compiles (the `DecodeSteps` interface) --------------------------------
    def shapes_for(self, plain: set[Shape], admission: str | None = None) -> set[Shape]:
        """The speculative twins of step shapes (`steps.reachable_shapes` computed with
        this engine's page room and `prefill_form`; decode steps in any other form): both
        variants of each; with an `admission` (prompts
        prefilled elsewhere, an `ADMISSION_FORMS` key), the admission of one request at
        every decode width."""
        admit = ADMISSION_FORMS[admission] if admission is not None else ()
        out: set[Shape] = set()
        busiest = pow2_at_least(self.slots_per_rank)  # a rank runs its slots' rows at most
        for form, plain_rows, tokens, plain_width in plain:
            rows, width = min(plain_rows, busiest), page_table_width(plain_width, self.cp)
            forms = SPEC_PREFILL_FORMS if form == self.prefill_form else SPEC_FORMS
            n = self.k + 1 if forms is SPEC_FORMS else tokens
            out |= {(f, rows, n, width) for f in forms}
            if forms is SPEC_FORMS:
                out |= {(f, 1, 1, width) for f in admit}
        return out

    def compiled_score(self, shape: Shape) -> jax.stages.Compiled:
        """The scoring twin of the prefill step `shape` (prompt log-probs, `prefill_many`
        with `scored`), compiled on abstract inputs the first time."""
        form, *rest = shape
        return self.compiled((SPEC_SCORE_FORMS[SPEC_PREFILL_FORMS.index(form)], *rest))

    @property
    def compiled_score_shapes(self) -> set[Shape]:
        """The prefill shapes whose scoring twin is compiled."""
        return {
            (SPEC_PREFILL_FORMS[SPEC_SCORE_FORMS.index(form)], *rest)
            for form, *rest in self.compiled_shapes
            if form in SPEC_SCORE_FORMS
        }

    def warm(self, shapes: Sequence[Shape]) -> None:
        """Run each shape once with the trash page's table and the spare slot: every write
        lands where no request reads."""
        trash = np.zeros((1,), np.int32)
        spare = self.slots_per_rank  # rank 0's, beside its trash page
        for form, rows, tokens, width in tqdm(
            shapes, desc="compiling speculative steps", unit="shape", disable=None
        ):
            greedy = form.endswith("_greedy")
            temperature = 0.0 if greedy else 1.0
            if form in SPEC_PREFILL_FORMS:
                out = self.prefill(
                    np.full((tokens,), 3, np.int32), trash, width, spare, temperature, 0
                )
            elif form in SPEC_ADMIT_FORMS:
                logits = np.zeros((self.vocab_size,), np.float32)
                hidden = np.zeros((self.hidden_size,), np.float32)
                out = self.admit_after_prefill(
                    logits, hidden, 1, trash, width, spare, temperature, 0
                )
            elif form in SPEC_GIVEN_FORMS:
                hidden = np.zeros((self.hidden_size,), np.float32)
                self.admit_given(0, hidden, 1, trash, width, spare, temperature, 0)
                out = self.slab
            else:
                out = self.step([(spare, trash, width)] * rows, greedy)
            jax.block_until_ready(out)

    @property
    def logits_sharding(self) -> jax.sharding.Sharding:
        """Where the engine's sampler keeps its state (its one slot: no penalties here)."""
        if self._placed is None:
            return jax.tree.leaves(self.kv.pool)[0].sharding
        return self._placed.replicated

    @property
    def state_sharding(self) -> jax.sharding.Sharding:
        return self.logits_sharding

    def logit_rows(self, rows: int) -> int:
        return self.layout.dp_size * rows

    def warm_feeds(self, rows: set[int]) -> None:
        """Nothing to feed: a step's next tokens never leave the device state."""

    def warm_log_probs(self, rows: set[int]) -> None:
        """Nothing around the steps: the draws and log-probs are inside them."""

    def _lower(self, shape: Shape) -> jax.stages.Lowered:
        """Lower `shape` on abstract weights, slab and pool (nothing live is touched): its
        row arguments sized by its padding row."""
        form, rows_p, tokens, width = shape
        state, slab, pool = self._abstract
        n = self.layout.dp_size * rows_p
        sharding = None if self._placed is None else self._placed.rows
        args = tuple(
            jax.ShapeDtypeStruct((n, *a.shape[1:]), a.dtype, sharding=sharding)
            for a in self._pad_row(form, tokens, width)
        )
        if self._placed is None:
            return self._fns[form].lower(state, slab, *args, pool)
        order = jax.ShapeDtypeStruct((n,), np.int32, sharding=self._placed.replicated)
        return self._fns[form].lower(state, slab, order, args, pool)


@dataclasses.dataclass
class SpecInFlight:
    """A dispatched speculative step whose tokens are not fetched yet: its rows in the
    step's row order and its output (on the device)."""

    rows: list[DecodeRequest]
    out: StepOutput
    dispatched_at: float = 0.0  # the engine's clock when it was dispatched
