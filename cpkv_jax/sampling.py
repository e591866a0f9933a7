"""Token sampling on the device: only token ids and their log-probs come back.

`sample(logprobs, rows)` takes a step's log-softmax rows `[R, vocab]` where they were
computed (on the device, for the decode steps) and per-row `RowSampling` parameters, and
returns each row's token, that token's log-prob (under the untempered distribution, the
one the API reports) and whether the row had a finite maximum - three small arrays
instead of the whole vocabulary's log-probs. `sample_async` dispatches the same draw and
returns a `PendingSample` whose tokens stay on the device (a decode engine feeds them to
its next step) until `fetch`. A `token_mask` (a grammar's packed bitmask,
`mask_tokens`) restricts each row to its allowed tokens before the draw.

Per row, as SGLang and vLLM order the filters: temperature, then top-k (`top_k > 0`: the
k most likely tokens, ties broken towards the lower token id), then top-p (the smallest
most-likely-first prefix of the renormalized top-k whose mass is >= `top_p`, at least
one token), then min-p (of those, the tokens whose tempered probability is at least
`min_p` times the most likely token's; that token always stays), then one uniform draw
through the kept tokens' CDF. `temperature == 0` is
greedy: `argmax`, the lowest id among ties, as the reference generator picks.

A step on a mesh leaves its logit rows on the ranks that ran them, in its own layout
(`order`: the caller's row `i` is the step's row `order[i]`, the rest padding): the draw
runs there, each rank over its own rows, and only the tokens, their log-probs and the
asked-for alternatives come back in the caller's order (`StepLogits`). The whole
vocabulary's logits never cross ranks, and no rank sorts another's rows.

A row may also ask for its `top_n` (at most `TOP_LOGPROBS_MAX`) most likely tokens and
their log-probs, under the same untempered distribution (OpenAI's `top_logprobs`, SGLang's
`top_logprobs_num`): the step's program always takes the `TOP_LOGPROBS_MAX` best per row
(one `lax.top_k`, ties towards the lower id as greedy breaks them, so a greedy token that
ranks there is first), and those `[R, 20]` arrays come to the host only when a row of
the step asked.

Penalties need each request's history: `PenaltyCounts` keeps it on the device, a slot
per running request that asked for one: its output-token counts `[slots, vocab]` int32
and its prompt's tokens `[slots, vocab]` bool, set when the request takes the slot (from
its prompt and output so far), then updated by the sampler's own program with the tokens
it draws, so nothing crosses to or from the host per step. In vLLM's order, a penalized
row's logits first get the repetition penalty (HF's: a logit of a token in the prompt or
the output is divided by `repetition_penalty` when positive, multiplied when not; this
needs the raw logits, so `sample` takes them too), then OpenAI's frequency and presence
penalties (`- frequency_penalty * count - presence_penalty * (count > 0)` over the
output: a per-row shift, exact on the log-softmax). The log-probs a row reports stay the
unpenalized ones, as vLLM's default. OpenAI's `logit_bias` (at most `LOGIT_BIAS_MAX`
tokens, each a value added to that token's logit) rides in the same slot, as `(token,
value)` pairs, and comes first, as in vLLM.

The draw is stateless per output position: token `step` of a request uses the key
`fold_in(fold_in(fold_in(key(0), seed_lo), seed_hi), step)` (the 63-bit seed's 32-bit
halves), so a prefill server that samples token 0 and a decode server that samples tokens
1.. give the same stream as one unified server, and a row's token does not depend on the
rows batched with it. JAX's threefry keys are the same on every backend.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from cpkv_jax.model.transformer import log_probs

_U32 = 0xFFFFFFFF
# The most alternatives a row may ask for (OpenAI's chat limit; vLLM's default cap).
TOP_LOGPROBS_MAX = 20
TopLogprobs = tuple[tuple[int, float], ...]  # (token id, log-prob), most likely first
# The most tokens one request's `logit_bias` may name (OpenAI's limit).
LOGIT_BIAS_MAX = 300


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """One row's sampling: `step` is the output position the token will take."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int = 0
    step: int = 0
    min_p: float = 0.0
    top_n: int = 0  # alternatives to return, 0..TOP_LOGPROBS_MAX
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: bool = False  # its slot holds a logit bias (`PenaltyCounts.reset`)
    slot: int = -1  # its `PenaltyCounts` slot; a row with a penalty must have one

    @property
    def penalized(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )


GREEDY = RowSampling()  # the padding rows of a step


@dataclasses.dataclass(frozen=True)
class Sampled:
    """Host arrays, one entry per requested row."""

    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32, of `tokens` under the untempered distribution
    finite: np.ndarray  # bool: False when the row had no finite maximum (broken logits)
    top_n: tuple[int, ...] = ()  # per row: alternatives asked for (empty: none asked)
    top_ids: np.ndarray | None = None  # int32 [rows, TOP_LOGPROBS_MAX], most likely first
    top_logprobs: np.ndarray | None = None  # float32, same shape

    def pick(self, i: int) -> tuple[int, float, TopLogprobs]:
        """Row `i`'s (token, log-prob, its `top_n` alternatives); `ValueError` for a
        broken row (NaN anywhere, or nothing finite): the engines fail that request
        alone."""
        if not self.finite[i]:
            raise ValueError("log-probs have no finite maximum; the logits are broken")
        return int(self.tokens[i]), float(self.logprobs[i]), self.top(i)

    def top(self, i: int) -> TopLogprobs:
        n = self.top_n[i] if self.top_n else 0
        if n == 0:
            return ()
        assert self.top_ids is not None and self.top_logprobs is not None
        return top_pairs(self.top_ids[i], self.top_logprobs[i], n)


def top_pairs(ids: np.ndarray, logprobs: np.ndarray, n: int) -> TopLogprobs:
    """The first `n` of one position's fetched top ids and log-probs as (token, log-prob)
    pairs; a row with fewer finite entries than `n` (a masked vocabulary) lists only
    those."""
    pairs = zip(ids[:n].tolist(), logprobs[:n].tolist(), strict=True)
    return tuple((t, v) for t, v in pairs if np.isfinite(v))


def bias_rows(
    logit_bias: Sequence[tuple[int, float]], vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """One row's logit bias as `LOGIT_BIAS_MAX` (token, value) pairs, unused ones naming
    token `vocab_size` (which `dense_bias`' scatter drops)."""
    if len(logit_bias) > LOGIT_BIAS_MAX:
        raise ValueError(f"{len(logit_bias)} logit_bias tokens, over {LOGIT_BIAS_MAX}")
    bias_ids = np.full(LOGIT_BIAS_MAX, vocab_size, np.int32)
    bias_values = np.zeros(LOGIT_BIAS_MAX, np.float32)
    for i, (token, value) in enumerate(logit_bias):
        bias_ids[i], bias_values[i] = token, value
    return bias_ids, bias_values


@dataclasses.dataclass(frozen=True)
class StepLogits:
    """A step's logit rows `[R, vocab]` where the step left them (on the device, or the
    host for a prefill's first token) and whose each is: the caller's row `i` is
    `logits[order[i]]` (`order` None: row `i`); the other rows are padding."""

    logits: Any
    order: np.ndarray | None = None


def placement(order: np.ndarray | None, n: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    """`(place, src)` for `n` caller rows over `r` step rows: `place[i]` the step row of
    caller row `i` (`order[:n]`, then the step rows no caller row has, in order) and
    `src` its inverse (the caller row of step row `j`); both the identity without
    `order`."""
    if order is None:
        ident = np.arange(r, dtype=np.int32)
        return ident, ident
    taken = np.asarray(order, np.int64)[:n]
    if len(taken) != n or np.unique(taken).size != n or (taken < 0).any() or (taken >= r).any():
        raise ValueError(f"order {taken.tolist()} does not place {n} rows among {r}")
    rest = np.setdiff1d(np.arange(r), taken)
    place = np.concatenate([taken, rest]).astype(np.int32)
    src = np.empty(r, np.int32)
    src[place] = np.arange(r, dtype=np.int32)
    return place, src


class PenaltyCounts:
    """The history penalized requests need, on the device, one slot per such running
    request (the engine assigns them): `counts[slot, token]` (int32, output tokens so
    far), `prompt[slot, token]` (bool, the prompt's tokens; the repetition penalty's) and
    the slot's logit bias, `LOGIT_BIAS_MAX` (token, value) pairs (unused ones name token
    `vocab_size`, which the sampler's scatter drops).
    `sample` reads a penalized row's slot and adds the token it draws there, in the same
    program (the counts are donated to it and replaced). At GLM-5's vocabulary of 154,880
    and 256 slots, 198 MB on each device holding them (`nbytes`). `sharding`: where they
    live (every device of a mesh: a rank's rows may hold any slot); `rows_sharding`: where
    the steps leave their log-prob rows (default `sharding`), for `warm`."""

    def __init__(
        self,
        slots: int,
        vocab_size: int,
        sharding: jax.sharding.Sharding,
        rows_sharding: jax.sharding.Sharding | None = None,
    ):
        if slots < 1:
            raise ValueError(f"need at least one slot, got {slots}")
        self.slots, self.vocab_size = slots, vocab_size
        self.sharding = sharding
        self.rows_sharding = sharding if rows_sharding is None else rows_sharding
        self.counts = jax.device_put(np.zeros((slots, vocab_size), np.int32), sharding)
        self.prompt = jax.device_put(np.zeros((slots, vocab_size), bool), sharding)
        self.bias_ids = jax.device_put(
            np.full((slots, LOGIT_BIAS_MAX), vocab_size, np.int32), sharding
        )
        self.bias_values = jax.device_put(np.zeros((slots, LOGIT_BIAS_MAX), np.float32), sharding)

    @property
    def nbytes(self) -> int:
        arrays = (self.counts, self.prompt, self.bias_ids, self.bias_values)
        return sum(a.nbytes for a in arrays)

    def reset(
        self,
        slot: int,
        output_ids: Sequence[int] | np.ndarray,
        prompt_ids: Sequence[int] | np.ndarray = (),
        logit_bias: Sequence[tuple[int, float]] = (),
    ) -> None:
        """Slot `slot` now holds a request whose output so far is `output_ids` and whose
        prompt is `prompt_ids`, with `logit_bias`'s (token, value) pairs (two `[vocab]`
        rows and the pairs to the device when it takes the slot)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside [0, {self.slots})")
        bias_ids, bias_values = self._bias_rows(logit_bias)
        counts = np.bincount(np.asarray(output_ids, np.int64), minlength=self.vocab_size)
        prompt = np.zeros(self.vocab_size, bool)
        prompt[np.asarray(prompt_ids, np.int64)] = True
        self.counts, self.prompt, self.bias_ids, self.bias_values = _set_rows(
            (self.counts, self.prompt, self.bias_ids, self.bias_values),
            np.int32(slot),
            (counts.astype(np.int32), prompt, bias_ids, bias_values),
        )

    def set_bias(self, slot: int, logit_bias: Sequence[tuple[int, float]] = ()) -> None:
        """Replace slot `slot`'s logit bias, its counts kept: the counts may already hold
        tokens the host has not seen (a decode step in flight), so they are not rebuilt
        from the host's output."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside [0, {self.slots})")
        bias_ids, bias_values = self._bias_rows(logit_bias)
        self.bias_ids, self.bias_values = _set_rows(
            (self.bias_ids, self.bias_values), np.int32(slot), (bias_ids, bias_values)
        )

    def _bias_rows(self, logit_bias: Sequence[tuple[int, float]]) -> tuple[np.ndarray, ...]:
        return bias_rows(logit_bias, self.vocab_size)

    def warm(self, row_counts: set[int], host_row_counts: set[int] = frozenset()) -> None:
        """Compile the penalized sampler for log-prob rows of each count, on arrays with
        `sharding` (as the steps return them) and, for `host_row_counts`, on host arrays
        (a prefill's first token), and the slot reset. Before serving only: it leaves
        slot 0 empty (a slot is reset whenever it is taken)."""
        row = RowSampling(frequency_penalty=0.5, repetition_penalty=1.5, logit_bias=True, slot=0)
        rows = [(r, self.rows_sharding) for r in sorted(row_counts)]
        for r, where in [*rows, *((r, None) for r in sorted(host_row_counts))]:
            lp = np.zeros((r, self.vocab_size), np.float32)
            lp = lp if where is None else jax.device_put(lp, where)
            sample(lp, [row], self, logits=lp)
        self.reset(0, [])
        self.set_bias(0)


def first_token_penalties(vocab_size: int) -> PenaltyCounts:
    """One slot on the default device, for a server that draws only first tokens (from a
    host row): its repetition penalty over the prompt and its logit bias (the other
    penalties count output tokens, and there are none yet). Built the same way for the
    warm-up and the draws, so they share one program."""
    return PenaltyCounts(1, vocab_size, jax.sharding.SingleDeviceSharding(jax.devices()[0]))


@functools.partial(jax.jit, donate_argnums=0)
def _set_rows(arrays, slot, rows):
    return tuple(a.at[slot].set(r) for a, r in zip(arrays, rows, strict=True))


def sample(
    logprobs: Float[Array, "r v"] | np.ndarray,
    rows: Sequence[RowSampling],
    penalties: PenaltyCounts | None = None,
    logits: Float[Array, "r v"] | np.ndarray | None = None,
    token_mask: np.ndarray | None = None,
    order: np.ndarray | None = None,
) -> Sampled:
    """Sample `len(rows)` tokens from the first rows of `logprobs` (more rows, a step's
    padding, are sampled greedily and dropped), or with `order` from rows `order[:n]`
    (`StepLogits`). One device program per row count (and one more where a row has a
    penalty: it reads and updates `penalties`, and a repetition penalty needs the
    `logits` behind `logprobs`); the result is fetched once."""
    return sample_async(logprobs, rows, penalties, logits, token_mask, order).fetch()


@dataclasses.dataclass(frozen=True)
class PendingSample:
    """A dispatched draw: `tokens` stay on the device (`[R]` int32 in the caller's row
    order, the padding rows' after: a decode engine feeds them to its next step without
    a host round trip) until `fetch` brings back the first `n` rows' tokens and
    log-probs."""

    n: int
    top_n: tuple[int, ...]
    out: tuple[jax.Array, ...]  # tokens, log-probs, finite, top ids, top log-probs

    @property
    def tokens(self) -> jax.Array:
        return self.out[0]

    def fetch(self) -> Sampled:
        """Wait for the draw and bring back what the rows asked for (the alternatives
        only when a row asked)."""
        n, top_n = self.n, self.top_n
        if not any(top_n):  # the alternatives stay on the device
            tokens, lps, finite = jax.device_get(self.out[:3])
            return Sampled(tokens[:n], lps[:n], finite[:n])
        tokens, lps, finite, top_ids, top_lps = jax.device_get(self.out)
        return Sampled(tokens[:n], lps[:n], finite[:n], top_n, top_ids[:n], top_lps[:n])


def sample_async(
    logprobs: Float[Array, "r v"] | np.ndarray,
    rows: Sequence[RowSampling],
    penalties: PenaltyCounts | None = None,
    logits: Float[Array, "r v"] | np.ndarray | None = None,
    token_mask: np.ndarray | None = None,
    order: np.ndarray | None = None,
) -> PendingSample:
    """`sample`, dispatched and not waited for (`PendingSample.fetch` waits). With
    `token_mask` (int32 `[R, ceil(vocab / 32)]` in the caller's row order, bit `t % 32`
    of word `t // 32` set for an allowed token `t`; a grammar's, `mask_tokens`) each row
    draws only among its allowed tokens, and its alternatives are those allowed tokens.
    With `order` (`StepLogits`) each row draws where its log-probs are, and what comes
    back is in the caller's order all the same."""
    n, r = len(rows), logprobs.shape[0]
    if not 0 < n <= r:
        raise ValueError(f"{n} row parameters for {r} log-prob rows")
    place, src = placement(order, n, r)
    if token_mask is not None:
        mask = np.asarray(token_mask) if order is None else np.asarray(token_mask)[src]
        logprobs, logits = mask_tokens(logprobs, logprobs if logits is None else logits, mask)
    bad = [p.top_n for p in rows if not 0 <= p.top_n <= TOP_LOGPROBS_MAX]
    if bad:
        raise ValueError(f"top_n {bad[0]} outside [0, {TOP_LOGPROBS_MAX}]")
    padded = [*rows, *([GREEDY] * (r - n))]
    seeds = np.asarray([p.seed for p in padded], np.uint64)
    per_row = (
        np.asarray([p.temperature for p in padded], np.float32),
        np.asarray([p.top_k for p in padded], np.int32),
        np.asarray([p.top_p for p in padded], np.float32),
        (seeds & _U32).astype(np.uint32),
        (seeds >> np.uint64(32)).astype(np.uint32),
        np.asarray([p.step for p in padded], np.uint32),
        np.asarray([p.min_p for p in padded], np.float32),
    )
    common = (logprobs, per_row, np.bool_(any(p.top_n for p in rows)), src, place)
    at = rows_at(logprobs)
    if any(p.penalized for p in rows):
        if penalties is None:
            raise ValueError("a row has a penalty, but no penalty counts were given")
        bad = [p.slot for p in rows if p.penalized and not 0 <= p.slot < penalties.slots]
        if bad:
            raise ValueError(f"penalized row slot {bad[0]} outside [0, {penalties.slots})")
        if logits is None:
            if any(p.repetition_penalty != 1.0 for p in rows):
                raise ValueError("a row has a repetition penalty, but no logits were given")
            logits = logprobs  # read by no row
        penalty_rows = (
            # Rows without a penalty update no slot (index `slots`: dropped by the scatter).
            np.asarray([p.slot if p.penalized else penalties.slots for p in padded], np.int32),
            np.asarray([p.frequency_penalty for p in padded], np.float32),
            np.asarray([p.presence_penalty for p in padded], np.float32),
            np.asarray([p.repetition_penalty for p in padded], np.float32),
        )
        history = (penalties.prompt, penalties.bias_ids, penalties.bias_values)
        *out, penalties.counts = _sample_penalized(
            *common, penalties.counts, history, penalty_rows, logits, at
        )
    else:
        out = _sample(*common, at)
    return PendingSample(n, tuple(p.top_n for p in rows), tuple(out))


def mask_words(vocab_size: int) -> int:
    """Int32 words of one row's packed token mask (`mask_tokens`)."""
    return (vocab_size + 31) // 32


@jax.jit
def mask_tokens(logprobs, logits, token_mask):
    """`logprobs` and `logits` with every token the packed `token_mask` does not allow at
    -inf (a grammar's bitmask, llguidance's layout: 32 tokens per int32 word, lowest bit
    first). An allowed token keeps its value: its reported log-prob is the model's."""
    ids = jnp.arange(logprobs.shape[-1])
    allowed = ((token_mask[:, ids // 32] >> (ids % 32)) & 1).astype(bool)
    return jnp.where(allowed, logprobs, -jnp.inf), jnp.where(allowed, logits, -jnp.inf)


def _row_key(seed_lo: Array, seed_hi: Array, step: Array) -> Array:
    key = jax.random.key(0)
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, seed_lo), seed_hi), step)


RowsAt = tuple[jax.sharding.Mesh, Any] | None
"""Where a step left its rows: (mesh, the spec entry of the rows' axis), or None for one
device (or rows not split)."""


def rows_at(logprobs: Any) -> RowsAt:
    """The mesh and axes `logprobs`' rows are split over, when they are."""
    sharding = getattr(logprobs, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.mesh.size == 1:
        return None
    spec = sharding.spec
    return (sharding.mesh, spec[0]) if len(spec) and spec[0] is not None else None


def _per_rank(fn, at: RowsAt, n_rows: int, n_whole: int = 0):
    """`fn(*rows, *whole)` (`n_rows` arrays with a leading row axis, then `n_whole` that
    every rank reads whole; results all per row) on each rank over its own rows when
    `at` says they are split: an explicit `shard_map`, so nothing vocabulary-wide crosses
    ranks (XLA's partitioner, left to itself, all-gathers the rows for the top-k) and a
    rank runs the program one device runs on its rows."""
    if at is None:
        return fn
    mesh, axes = at
    rows, whole = jax.sharding.PartitionSpec(axes), jax.sharding.PartitionSpec()
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(*([rows] * n_rows), *([whole] * n_whole)),
        out_specs=rows,
        check_vma=False,
    )


def rows_log_probs(logits: Any, invariant: bool = False) -> Any:
    """`transformer.log_probs` of a step's logit rows where they are (on a mesh, each
    rank its own rows), so each row's values are those one device gives it (under
    batch-invariant numerics too: each rank runs the same tiles)."""
    return _rows_log_probs(logits, invariant, rows_at(logits))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _rows_log_probs(logits, invariant: bool, at: RowsAt):
    return _per_rank(functools.partial(log_probs, invariant=invariant), at, 1)(logits)


def _in_caller_order(out, place, at: RowsAt) -> tuple:
    """The draw's per-row results in the caller's order, on every device of the mesh
    (small arrays: the engine's next step reads its rows' tokens from them, and its feed
    program was compiled for them there)."""
    out = tuple(a[place] for a in out)
    if at is None:
        return out
    whole = jax.sharding.NamedSharding(at[0], jax.sharding.PartitionSpec())
    return tuple(jax.lax.with_sharding_constraint(a, whole) for a in out)


@functools.partial(jax.jit, static_argnums=5)
def _sample(lp, per_row, want_top, src, place, at: RowsAt):
    """The draw over `lp`'s rows where they are (`at`: each rank its own), each with the
    parameters of its caller row (`src`), its results in the caller's order (`place`;
    `placement`): small gathers, the logits stay put."""
    lp = lp.astype(jnp.float32)

    def draw(lp, *rest):
        return _draw(lp, lp, *rest)

    out = _per_rank(draw, at, 1 + len(per_row), 1)(lp, *(a[src] for a in per_row), want_top)
    return _in_caller_order(out, place, at)


@functools.partial(jax.jit, donate_argnums=5, static_argnums=9)
def _sample_penalized(
    lp, per_row, want_top, src, place, counts, history, penalty_rows, logits, at: RowsAt
):
    """`_sample` with the rows' penalties (`penalize`) from their slots' `counts` and
    `history` (prompt flags, logit bias pairs; on every device), the drawn tokens counted
    in them."""
    lp = lp.astype(jnp.float32)
    k = len(per_row)

    def draw(lp, logits, *args):
        row_params, (slots, freq, pres, rep) = args[:k], args[k : k + 4]
        want_top, counts, prompt, bias_ids, bias_values = args[k + 4 :]
        at = jnp.minimum(slots, counts.shape[0] - 1)  # rows without a slot read S-1: unused
        # Zero bias for rows without a slot.
        bias = jnp.where(
            (slots < counts.shape[0])[:, None],
            dense_bias(bias_ids[at], bias_values[at], lp.shape[-1]),
            0.0,
        )
        shifted = penalize(lp, logits, counts[at], prompt[at], bias, freq, pres, rep)
        return _draw(lp, shifted, *row_params, want_top)

    rows = (*(a[src] for a in per_row), *(a[src] for a in penalty_rows))
    out = _per_rank(draw, at, 2 + len(rows), 5)(lp, logits, *rows, want_top, counts, *history)
    out = _in_caller_order(out, place, at)
    # Rows without a penalty update no slot (index `slots`: dropped by the scatter).
    return (*out, counts.at[penalty_rows[0], out[0]].add(1, mode="drop"))


def dense_bias(bias_ids: Array, bias_values: Array, vocab: int) -> Float[Array, "r v"]:
    """Rows' logit bias pairs (`PenaltyCounts`' layout: unused pairs name token `vocab`,
    dropped) as dense `[R, vocab]` rows."""
    rows = bias_ids.shape[0]
    bias = jnp.zeros((rows, vocab), jnp.float32)
    return bias.at[jnp.arange(rows)[:, None], bias_ids].add(bias_values, mode="drop")


def penalize(lp, logits, counts, prompt, bias, freq, pres, rep) -> Array:
    """The penalized log-probs a row draws from (the module docstring's order: logit bias,
    repetition, frequency and presence), for `lp` / `logits` / `counts` of shape `[R, *t,
    vocab]` (`t`: positions of one row, each with its own output counts), `prompt` and
    `bias` `[R, vocab]` and the penalties `[R]`."""
    lp = lp.astype(jnp.float32)

    def per_row(x):  # [R, ...] against [R, *t, vocab]
        return x.reshape(x.shape[:1] + (1,) * (lp.ndim - x.ndim) + x.shape[1:])

    c = counts.astype(jnp.float32)
    seen = per_row(prompt) | (c > 0)
    bias = per_row(bias)
    z = logits.astype(jnp.float32) + bias
    r = per_row(rep[:, None])
    z = jnp.where(seen, jnp.where(z > 0, z / r, z * r), z)
    # Without a repetition penalty the bias is a per-token shift of the log-probs (exact:
    # the log-softmax shifts each row by one constant), kept as they are otherwise.
    base = jnp.where(r != 1.0, jax.nn.log_softmax(z, axis=-1), lp + bias)
    return base - per_row(freq[:, None]) * c - per_row(pres[:, None]) * (c > 0)


def _filter_sorted(z, top_k, top_p, min_p):
    """The filters of the module docstring over rows of tempered logits `z` `[r, v]`:
    (the token ids most likely first, ties by lower id; their top-k-renormalized
    probabilities in that order; which of them the filters keep)."""
    r, v = z.shape
    ids = jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (r, v))
    # Most likely first, ties by lower id (-z ascending, then id ascending).
    neg, order = jax.lax.sort((-z, ids), dimension=1, num_keys=2)
    rank = jnp.arange(v)[None, :]
    keep = rank < jnp.where(top_k > 0, top_k, v)[:, None]
    sz = -neg
    p = jnp.where(keep, jnp.exp(sz - sz[:, :1]), 0.0)
    p = p / p.sum(axis=-1, keepdims=True)
    # The mass of the more likely tokens (exclusive cumsum: no p - p rounding).
    zero = jnp.zeros((r, 1), p.dtype)
    before = jnp.concatenate([zero, jnp.cumsum(p, axis=-1)[:, :-1]], -1)
    keep = keep & (before < top_p[:, None])
    # min-p against the most likely token (rank 0, always kept: p[:, 0] >= min_p p[:, 0]).
    keep = keep & (p >= min_p[:, None] * p[:, :1])
    return order, p, keep


def filtered_probs(
    probs: Float[Array, "r v"],
    z: Float[Array, "r v"],
    top_k: Array,
    top_p: Array,
    min_p: Array,
) -> Float[Array, "r v"]:
    """The distribution a row at tempered logits `z` is drawn from by `sample` (its
    top-k, top-p and min-p filters applied, renormalized), in vocabulary order; `probs`
    (`softmax(z)`) unchanged where no row filters (`lax.cond`: the whole-vocabulary sort
    runs only when one does). Speculative decoding's target distribution
    (`cpkv_jax.speculative`)."""
    r, v = z.shape

    def filtered():
        order, p, keep = _filter_sorted(z, top_k, top_p, min_p)
        kept = jnp.where(keep, p, 0.0)
        kept = kept / kept.sum(axis=-1, keepdims=True)
        rows = jnp.arange(r)[:, None]
        return jnp.zeros((r, v), kept.dtype).at[rows, order].set(kept).astype(probs.dtype)

    any_filter = jnp.any((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))
    return jax.lax.cond(any_filter, filtered, lambda: probs)


def _draw(lp, shifted, temperature, top_k, top_p, seed_lo, seed_hi, step, min_p, want_top):
    """Tokens drawn from `shifted` (the log-probs, penalized where asked); the chosen and
    top log-probs reported from `lp`. The whole-vocabulary sort runs only when a row
    samples, the top-k only when a row asked for alternatives (`lax.cond`: a greedy
    step skips what costs ~40 ms per row on a CPU at GLM-5's vocabulary)."""
    v = lp.shape[-1]
    greedy = jnp.argmax(shifted, axis=-1).astype(jnp.int32)
    finite = jnp.isfinite(jnp.max(lp, axis=-1))  # max propagates NaN

    def drawn_tokens():
        z = shifted / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        order, p, keep = _filter_sorted(z, top_k, top_p, min_p)
        cdf = jnp.cumsum(jnp.where(keep, p, 0.0), axis=-1)
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(
            jax.vmap(_row_key)(seed_lo, seed_hi, step)
        )
        # The first token whose CDF exceeds u: a zero-mass (filtered) token is never chosen.
        at = jnp.minimum(jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1), v - 1)
        return jnp.take_along_axis(order, at[:, None], axis=1)[:, 0]

    drawn = jax.lax.cond(jnp.any(temperature > 0), drawn_tokens, lambda: greedy)
    tokens = jnp.where(temperature > 0, drawn, greedy)
    top_ids, top_lps = top_logprobs(lp, want_top)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=1)[:, 0]
    return tokens, chosen, finite, top_ids, top_lps


def top_logprobs(lp: Array, want: Array) -> tuple[Array, Array]:
    """The `TOP_LOGPROBS_MAX` most likely tokens at each of `lp`'s positions (`[..., v]`)
    and their log-probs, ties towards the lower id (a greedy token that ranks there is
    first), when `want` (a scalar: `lax.cond`, zeros and no top-k otherwise)."""
    n = min(TOP_LOGPROBS_MAX, lp.shape[-1])

    def top():
        values, ids = jax.lax.top_k(lp, n)
        return ids.astype(jnp.int32), values

    def none():
        shape = (*lp.shape[:-1], n)
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, lp.dtype)

    return jax.lax.cond(want, top, none)


def warm(
    vocab_size: int,
    row_counts: Sequence[int],
    sharding: jax.sharding.Sharding | None,
    *,
    masked: bool = False,
) -> None:
    """Compile `sample` for log-prob rows of each count: on committed arrays with
    `sharding` (a step's output), or host arrays when None (a prefill's first token);
    with `masked`, the draw under a token mask (a grammar's) too."""
    for r in sorted(set(row_counts)):
        lp = np.zeros((r, vocab_size), np.float32)
        lp = lp if sharding is None else jax.device_put(lp, sharding)
        sample(lp, [GREEDY])
        if masked:
            sample(lp, [GREEDY], token_mask=np.full((r, mask_words(vocab_size)), -1, np.int32))
