"""Speculative decoding in the decode engine: draft with the model's MTP layer, verify
with the trunk, one device program per step (issue 39; `cpkv_jax.speculative`).

`cpkv-serve --speculative-algorithm NEXTN --speculative-num-steps K` (SGLang's flags)
gives the unified server's engine a `SpeculativeSteps` in place of the plain
`DecodeSteps`:

- admission with `--disable-radix-cache` (`prefill`): the trunk over the prompt, its
  first token drawn on the device, the MTP layer's pass over the prompt and the first K
  drafts, in one program; on the default prefix-cache engine the CP runner prefills and
  runs the MTP layer over all but the prompt's last position, and `admit_after_prefill`
  draws the first token from its last logits, runs the MTP layer at the last position
  with the trunk's hidden state there and chains the first K drafts; on a PD decode
  server the prefill server ran that pass and drew the first token, and
  `admit_given` runs the MTP layer at the last position on it with the hidden state the
  room's aux data carried, and chains the first K drafts;
- each decode step (`step`): every running row verifies its K drafts and emits 1..K+1
  tokens, then the MTP layer drafts the next K, in one program. The host reads back only
  the emitted tokens, the accepted counts and the tokens' log-probs.

Each running request holds a slot of the draft state (`cpkv_jax.speculative.init_slab`:
its last verified token and position, its drafts and their distributions, its
temperature and seed), which stays on the device between steps; padding rows use the
spare slot. A request reserves `speculative_room(K, overlap)` tokens of pages beyond
`prompt + max_new_tokens`: the last verify and draft chain write up to 2K + 1 positions
past the row's length, and with overlap one more step (K + 1) runs before the host sees
the row finished.

A row's top-k, top-p and min-p filter its target distribution (`softmax(logits / T)`,
filtered as the sampler filters one draw); its drafts come from the MTP layer's unfiltered
distribution, which keeps speculative sampling exact for the filtered target. What a
speculative step cannot apply is refused when the request arrives (`refusal`: HTTP 400
naming the parameter): penalties, logit bias, min_new_tokens, grammars and top log-probs
need a server without `--speculative-algorithm` (each depends on the tokens before it
inside one step's chain, or would need the top-N of every verified position).

Step shapes (the `DecodeSteps` interface, so the engine's warm-up and compile accounting
are unchanged): `("spec" | "spec_greedy", rows, K + 1, width)` for decode steps,
`("spec_prefill" | "spec_prefill_greedy", 1, prefill bucket, width)`,
`("spec_admit" | "spec_admit_greedy", 1, 1, width)` and `("spec_given" |
"spec_given_greedy", 1, 1, width)` for the three kinds of admission; the greedy variants
run when every row is at temperature 0 and keep no distributions.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from cpkv_jax.aot import ShapeCache, abstract
from cpkv_jax.buckets import pow2_at_least
from cpkv_jax.errors import ConfigError
from cpkv_jax.kv_store import KVStore
from cpkv_jax.model.forward_batch import abstract_batch, prefill_batch
from cpkv_jax.model.kv_cache import SINGLE_DEVICE_KV_IO, IndexKDtype, PagedKVIO
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.paging import TRASH_PAGE, padded_page_table
from cpkv_jax.speculative import (
    Filters,
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


def _row(temperature: float, seed: int, filters: RowFilters) -> tuple:
    """One admitted row's sampling arguments: temperature, seed, `Filters`."""
    return (
        np.asarray([temperature], np.float32),
        np.asarray([seed % 2**31], np.int32),
        Filters.of(*([f] for f in filters)),
    )


def speculative_room(num_steps: int, overlap: bool) -> int:
    """Tokens a request reserves beyond `prompt + max_new_tokens` (the module docstring)."""
    return 2 * num_steps + 1 + (num_steps + 1 if overlap else 0)


def refusal(req: GenerateRequest) -> str | None:
    """Why a speculative engine cannot serve `req` as asked, or None."""
    sp = req.sampling
    asked = [
        name
        for name, on in (
            ("frequency_penalty", sp.frequency_penalty != 0.0),
            ("presence_penalty", sp.presence_penalty != 0.0),
            ("repetition_penalty", sp.repetition_penalty != 1.0),
            ("logit_bias", bool(sp.logit_bias)),
            ("min_new_tokens", sp.min_new_tokens > 0),
            ("a grammar (structured output)", sp.grammar is not None),
            ("top_logprobs", req.return_logprob and req.top_logprobs > 0),
        )
        if on
    ]
    if not asked:
        return None
    return (
        f"this server decodes speculatively (--speculative-algorithm), which samples from "
        f"softmax(logits / temperature) with top-k, top-p and min-p only; {', '.join(asked)} "
        f"{'needs' if len(asked) == 1 else 'need'} a server without speculative decoding"
    )


class SpeculativeSteps(CompiledShapes):
    """Draft-and-verify steps of one model (with its MTP layer) over one `KVStore`, and
    the draft-state slots of the rows (see the module docstring)."""

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
        self.batch_invariant = batch_invariant
        self.prefill_form = SPEC_PREFILL_FORMS[0]
        self.shapes: set[Shape] = set()
        self.num_slots = slots
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._graphdef, self._state = nnx.split(model)
        self.slab = jax.device_put(
            init_slab(slots, num_steps, self.vocab_size), self.logits_sharding
        )
        static = {
            "page_size": page_size,
            "index_k_dtype": index_k_dtype,
            "invariant": batch_invariant,
            "kv_io": kv_io,
            "block_bytes": block_bytes,
        }
        self._fns = {}
        for greedy in (False, True):
            step = functools.partial(slab_step, self._graphdef, greedy=greedy, **static)
            admit = functools.partial(
                slab_admit, self._graphdef, k=num_steps, greedy=greedy, **static
            )
            after = functools.partial(
                slab_admit_from_hidden, self._graphdef, k=num_steps, greedy=greedy, **static
            )
            given = functools.partial(
                slab_admit_given, self._graphdef, k=num_steps, greedy=greedy, **static
            )
            donate = ("slab", "pool")
            self._fns[SPEC_FORMS[greedy]] = jax.jit(step, donate_argnames=donate)
            self._fns[SPEC_PREFILL_FORMS[greedy]] = jax.jit(admit, donate_argnames=donate)
            self._fns[SPEC_ADMIT_FORMS[greedy]] = jax.jit(after, donate_argnames=donate)
            self._fns[SPEC_GIVEN_FORMS[greedy]] = jax.jit(given, donate_argnames=donate)
        self.hidden_size = model.cfg.hidden_size
        self._abstract = (abstract(self._state), abstract(self.slab), abstract(kv.pool))
        leaves, tree = jax.tree.flatten(self._abstract)
        context = ("speculative", num_steps, self._graphdef, tree, *leaves, *static.items())
        with _CACHES_LOCK:
            caches = _CACHES.setdefault(model, {})
            self._compiled = caches.setdefault(context, ShapeCache("speculative step"))

    @property
    def slab_bytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self.slab))

    # ---- slots ---------------------------------------------------------------------------
    def take_slot(self) -> int:
        """A free draft-state slot (the engine admits at most `num_slots` rows)."""
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

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
    ) -> tuple[jax.Array, jax.Array]:
        """Admit one request: its prompt's KV (trunk and MTP layer) into `pages`, its first
        K drafts into `slot`; returns its first token and that token's log-prob, on the
        device (`[1]` each)."""
        batch = prefill_batch(prompt, padded_page_table(pages, width), self.page_size)
        greedy = temperature == 0
        shape = (SPEC_PREFILL_FORMS[greedy], 1, batch.input_ids.shape[1], width)
        run = self.compiled(shape)
        self.shapes.add(shape)
        rows = _row(temperature, seed, filters)
        return self._admit(run, slot, "spec_prefill", batch, *rows)

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
    ) -> tuple[jax.Array, jax.Array]:
        """Admit one request whose prompt (`n` tokens) was prefilled elsewhere with the
        MTP layer's pass over all but its last position: from that prefill's last logits
        and hidden state, its first token and drafts (`slab_admit_from_hidden`); returns
        the token and its log-prob, on the device (`[1]` each)."""
        first = np.asarray(logits, np.float32).reshape(1, -1)
        return self._after_prefill(
            SPEC_ADMIT_FORMS, first, hidden, n, pages, width, slot, temperature, seed, filters
        )

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
    ) -> None:
        """Admit one request whose prompt (`n` tokens) was prefilled elsewhere, with the
        MTP layer's pass over all but its last position, and whose first output `token`
        was drawn there too (a PD prefill server): its first drafts from `token` and the
        trunk's hidden state at the last position (`slab_admit_given`)."""
        first = np.asarray([token], np.int32)
        self._after_prefill(
            SPEC_GIVEN_FORMS, first, hidden, n, pages, width, slot, temperature, seed, filters
        )

    def _after_prefill(
        self, forms, first, hidden, n, pages, width, slot, temperature, seed, filters
    ) -> tuple:
        """Run one of the two admissions after a prefill elsewhere (`forms`), from
        `first` (the prefill's last logits, or the first token it drew)."""
        greedy = temperature == 0
        shape = (forms[greedy], 1, 1, width)
        run = self.compiled(shape)
        self.shapes.add(shape)
        args = (
            first,
            np.asarray(hidden, np.float32).reshape(1, -1),
            np.asarray([n], np.int32),
            padded_page_table(pages, width)[None],
            *_row(temperature, seed, filters),
        )
        return self._admit(run, slot, forms[0], *args)

    def _admit(self, run, slot: int, scope: str, *args):
        """Run an admission program `run` for one request into draft-state `slot` (the
        slab and the pool donated); returns what the program returns before the slab and
        the pool (the first token and its log-prob, on the device, when it drew them)."""
        slots = np.asarray([slot], np.int32)

        def go(pool):
            *out, self.slab, pool = run(self._state, self.slab, slots, *args, pool)
            return tuple(out), pool

        with jax.named_scope(f"decode_engine.{scope}"):
            return self.kv.update_pool(go)

    def step(self, rows: Sequence[tuple[int, np.ndarray, int]], greedy: bool) -> StepOutput:
        """One draft-and-verify step for `rows` (slot, pages, pages reserved), padded to a
        power of two (padding rows write the trash page and the spare slot); `greedy` when
        every row is at temperature 0. The output stays on the device."""
        rows_p = pow2_at_least(len(rows))
        width = pow2_at_least(max(n for *_, n in rows))
        slots = np.full((rows_p,), self.num_slots, np.int32)
        tables = np.full((rows_p, width), TRASH_PAGE, np.int32)
        live = np.zeros((rows_p,), bool)
        for i, (slot, pages, _) in enumerate(rows):
            slots[i], live[i] = slot, True
            tables[i] = padded_page_table(pages, width)
        shape = (SPEC_FORMS[greedy], rows_p, self.k + 1, width)
        run = self.compiled(shape)
        self.shapes.add(shape)

        def go(pool):
            out, self.slab, pool = run(self._state, self.slab, slots, tables, live, pool)
            return out, pool

        with jax.named_scope("decode_engine.spec_step"):
            return self.kv.update_pool(go)

    # ---- shapes and compiles (the `DecodeSteps` interface) --------------------------------
    def shapes_for(self, plain: set[Shape], admission: str | None = None) -> set[Shape]:
        """The speculative twins of step shapes (`steps.reachable_shapes` computed with
        this engine's page room and `prefill_form`; decode steps in any other form): both
        variants of each; with an `admission` (prompts
        prefilled elsewhere, an `ADMISSION_FORMS` key), the admission of one request at
        every decode width."""
        admit = ADMISSION_FORMS[admission] if admission is not None else ()
        out: set[Shape] = set()
        for form, rows, tokens, width in plain:
            forms = SPEC_PREFILL_FORMS if form == self.prefill_form else SPEC_FORMS
            n = self.k + 1 if forms is SPEC_FORMS else tokens
            out |= {(f, rows, n, width) for f in forms}
            if forms is SPEC_FORMS:
                out |= {(f, 1, 1, width) for f in admit}
        return out

    def warm(self, shapes: Sequence[Shape]) -> None:
        """Run each shape once with the trash page's table and the spare slot: every write
        lands where no request reads."""
        trash = np.zeros((1,), np.int32)
        spare = self.num_slots
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
        return jax.tree.leaves(self.kv.pool)[0].sharding

    @staticmethod
    def logit_rows(rows: int) -> int:
        return rows

    def warm_feeds(self, rows: set[int]) -> None:
        """Nothing to feed: a step's next tokens never leave the device state."""

    def warm_log_probs(self, rows: set[int]) -> None:
        """Nothing around the steps: the draws and log-probs are inside them."""

    def _lower(self, shape: Shape) -> jax.stages.Lowered:
        """Lower `shape` on abstract weights, slab and pool (nothing live is touched)."""
        form, rows, tokens, width = shape
        state, slab, pool = self._abstract
        i32 = np.int32

        def arg(shape_, dtype):
            return jax.ShapeDtypeStruct(shape_, dtype)

        f32 = np.float32
        # Each admitted row's temperature, seed and target filters.
        row = (
            arg((rows,), f32),
            arg((rows,), i32),
            jax.tree.map(lambda a: arg((rows,), a.dtype), Filters.none(1)),
        )
        if form in SPEC_PREFILL_FORMS:
            batch = abstract_batch(rows, tokens, width)
            return self._fns[form].lower(state, slab, arg((rows,), i32), batch, *row, pool)
        if form in SPEC_ADMIT_FORMS or form in SPEC_GIVEN_FORMS:
            first = (
                arg((rows, self.vocab_size), f32) if form in SPEC_ADMIT_FORMS else arg((rows,), i32)
            )
            return self._fns[form].lower(
                state,
                slab,
                arg((rows,), i32),
                first,
                arg((rows, self.hidden_size), f32),
                arg((rows,), i32),
                arg((rows, width), i32),
                *row,
                pool,
            )
        return self._fns[form].lower(
            state, slab, arg((rows,), i32), arg((rows, width), i32), arg((rows,), bool), pool
        )


@dataclasses.dataclass
class SpecInFlight:
    """A dispatched speculative step whose tokens are not fetched yet: its rows in the
    step's row order and its output (on the device)."""

    rows: list[DecodeRequest]
    out: StepOutput
