"""Speculative decoding with the model's own MTP layer (issue 39 item 2): draft and verify
for a batch of rows as one jitted device step, greedy or sampled.

State between steps, per row: the last verified token `x` at position `p` (its KV not
written yet), `k` drafts `d1..dk` for positions `p+1..p+k` and the distributions `q` they
were drawn from. One step:

    verify  [x, d1..dk] at p..p+k (the trunk, B x (k+1) tokens, each causal with its own
            indexer top-k, writing their KV): target distributions p_0..p_k
    accept  `accept_drafts`: draft i kept with min(1, p_i(d_i) / q_i(d_i)), in order; at
            the first rejection, a, the next token is drawn from max(p_a - q_a, 0), or
            from p_k when all were kept (the bonus token). The row emits d_1..d_a and
            that token, t, and the next step verifies x' = t at p' = p + a + 1
    MTP     the MTP layer at p..p+k on the emitted tokens (each position's next token)
            with the trunk's hidden states there, writing its own KV; its output at p + a
            gives the first draft d'_1 and its distribution
    chain   k - 1 more MTP steps, each on its previous draft with the MTP's own output
            hidden state (as SGLang's and vLLM's MTP drafters chain), one position on

Greedy is the special case: a row at temperature 0 has one-hot p and q (the argmax of the
log-probs, as the reference generator picks it), so `accept_drafts` keeps the longest
prefix of drafts equal to the trunk's greedy tokens and emits the trunk's greedy token
after it (a batch whose rows are all greedy runs a variant that compares argmaxes and
keeps no distributions); at temperature T > 0, p and q are `softmax(logits / T)` and
the emitted tokens are distributed as if drawn from the target one at a time
(`tests/core/test_speculative.py` checks both on the tiny model). A row's draws come from its seed:
draft j of the chain starting at position p from stream j at p, the accept / reject
draws of the step verifying at p from stream `ACCEPT_STREAM` at p.

After a prompt's prefill the MTP pass runs over the prompt (positions 0..n-1, tokens
`prompt[1:] + [first token]`) and the chain gives the first drafts (`first_drafts`).

`DraftState` is the step's input and output and never leaves the device; the host reads
back the `k + 1` emitted-token slots, the accepted count and the tokens' log-probs
(untempered, the target's). Rows may be dead (`live` False: padding, or a finished
request): they write only the trash page.

The KV of positions past `p + a` (rejected drafts in the trunk, tokens the row did not
emit in the MTP layer) lies beyond the row's new length; the next step writes every such
position before any query reads it (a query at position q reads KV at positions <= q,
and the next verify, MTP pass and chain write p'..p'+k in order). A row's page table
must cover `p + 2k` (the chain's last write) before each step.

Under batch-invariant numerics each greedy token's logits and log-probs are bitwise
those of plain decoding. `num_steps=0` is plain decoding through the same driver (no
MTP layer needed): the baseline of the speed figure (`benchmarks/bench_speculative.py`).
A row's top-k, top-p and min-p (`Filters`) filter its target distributions p_i as
`cpkv_jax.sampling` filters one draw (`filtered_probs`); its drafts are still drawn
from the MTP layer's unfiltered q_i. The accept / reject rule is exact for any q, so the
emitted tokens are distributed as the filtered target's draws. A row's penalties and
logit bias (`Penalties`, applied by `cpkv_jax.sampling.penalize` as to one draw) shape
its target the same way: position i of a step counts the row's outputs so far and the
drafts d_1..d_i as emitted, which they are whenever position i's token is read (a
rejection before i discards it); the emitted tokens are counted after the step, and
`min_new_tokens`' stop-token bans hold at the positions before `Penalties.ban_until`. A
row's top log-probs (`DraftState.top`) are the top-N of every verified position's
untempered log-probs (`top_logprobs`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from cpkv_jax.buckets import pow2_at_least, prefill_bucket
from cpkv_jax.errors import InputError
from cpkv_jax.model.forward_batch import ForwardBatch, batch_from_host
from cpkv_jax.model.kv_cache import (
    INDEX_K_DTYPES,
    KVIO,
    SINGLE_DEVICE_KV_IO,
    IndexKDtype,
    KVPool,
    init_pool,
)
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.model.numerics import batch_invariant, is_batch_invariant, token_block_bytes
from cpkv_jax.model.rope import rope_cos_sin
from cpkv_jax.model.transformer import CausalLM, log_probs, score_tokens
from cpkv_jax.paging import PageAllocator, padded_page_table, pages_for_tokens
from cpkv_jax.sampling import (
    LOGIT_BIAS_MAX,
    bias_rows,
    dense_bias,
    filtered_probs,
    penalize,
)
from cpkv_jax.sampling import top_logprobs as sampling_top_logprobs


@dataclasses.dataclass
class Filters:
    """Per row, the filters of the target distribution, as `cpkv_jax.sampling` applies
    them to one draw: top-k (<= 0: off), top-p (1: off), min-p (0: off)."""

    top_k: Int[Array, " b"]
    top_p: Float[Array, " b"]
    min_p: Float[Array, " b"]

    @classmethod
    def none(cls, rows: int) -> Filters:
        """Every filter off for `rows` rows."""
        return cls(
            jnp.zeros((rows,), jnp.int32),
            jnp.ones((rows,), jnp.float32),
            jnp.zeros((rows,), jnp.float32),
        )

    @classmethod
    def of(cls, top_k, top_p, min_p) -> Filters:
        """From per-row host values (sequences or arrays)."""
        return cls(
            jnp.asarray(top_k, jnp.int32),
            jnp.asarray(top_p, jnp.float32),
            jnp.asarray(min_p, jnp.float32),
        )


@dataclasses.dataclass
class Penalties:
    """Per row, its penalties as `cpkv_jax.sampling.penalize` applies them to one draw
    (logit bias, repetition, frequency, presence; a row with none is not penalized) and
    what they read: its output-token counts so far (the last verified token included)
    and its prompt's tokens. They shape the target only: drafts stay unpenalized, which
    keeps the accept / reject rule exact. Bias pairs of value -inf are bans (the stop
    tokens of `min_new_tokens`, as `serving.engine.api.stop_token_bias` makes them): they
    hold for the tokens at positions before `ban_until` only."""

    counts: Int[Array, "b v"]
    prompt: Bool[Array, "b v"]
    bias_ids: Int[Array, "b n"]  # `PenaltyCounts`' layout: unused pairs name token v
    bias_values: Float[Array, "b n"]
    frequency: Float[Array, " b"]
    presence: Float[Array, " b"]
    repetition: Float[Array, " b"]
    ban_until: Int[Array, " b"]  # absolute position; 0: no ban

    @classmethod
    def none(cls, rows: int, vocab: int) -> Penalties:
        """No penalty for `rows` rows."""
        return cls(
            jnp.zeros((rows, vocab), jnp.int32),
            jnp.zeros((rows, vocab), bool),
            jnp.full((rows, LOGIT_BIAS_MAX), vocab, jnp.int32),
            jnp.zeros((rows, LOGIT_BIAS_MAX), jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.ones((rows,), jnp.float32),
            jnp.zeros((rows,), jnp.int32),
        )

    def on(self) -> Bool[Array, " b"]:
        """The rows with a penalty or a logit bias."""
        biased = jnp.any(self.bias_ids < self.counts.shape[-1], axis=-1)
        return (self.frequency != 0) | (self.presence != 0) | (self.repetition != 1) | biased

    def scores(
        self, lp: Array, logits: Array, positions: Array, drafts: Array | None = None
    ) -> Array:
        """The penalized log-probs (`[b, v]`, or `[b, k + 1, v]` at the positions a step
        verifies after its `drafts` `[b, k]`, each counting the drafts before it as
        emitted: a position is read only if they were) of the tokens at `positions`
        (`[b]` or `[b, k + 1]`, for the bans): what a penalized row's greedy token
        maximizes and its target is tempered from; `lp` itself when no row is penalized
        (`lax.cond`: no `[b, k + 1, v]` counts are built then)."""
        v = lp.shape[-1]

        def penalized():
            counts = self.counts
            if drafts is not None:
                before = jnp.cumsum(jax.nn.one_hot(drafts, v, dtype=jnp.int32), axis=1)
                zero = jnp.zeros((drafts.shape[0], 1, v), jnp.int32)
                counts = counts[:, None] + jnp.concatenate([zero, before], axis=1)
            ban = jnp.isinf(self.bias_values)
            bias = dense_bias(self.bias_ids, jnp.where(ban, 0.0, self.bias_values), v)
            banned = dense_bias(self.bias_ids, ban.astype(jnp.float32), v) > 0
            out = penalize(
                lp, logits, counts, self.prompt, bias,
                self.frequency, self.presence, self.repetition,
            )  # fmt: skip
            extra = (1,) * (lp.ndim - 2)
            active = positions < self.ban_until.reshape((-1, *extra))
            banned = banned.reshape(banned.shape[:1] + extra + banned.shape[1:])
            return jnp.where(banned & active[..., None], -jnp.inf, out)

        return jax.lax.cond(jnp.any(self.on()), penalized, lambda: lp.astype(jnp.float32))

    def first(self, token: Int[Array, " b"]) -> Penalties:
        """A newly admitted row's: its one output so far is `token`."""
        counts = jax.nn.one_hot(token, self.counts.shape[-1], dtype=jnp.int32)
        return dataclasses.replace(self, counts=counts)

    def after(self, tokens: Int[Array, "b t"], emitted: Bool[Array, "b t"]) -> Penalties:
        """With the `emitted` ones of `tokens` counted (penalized rows only matter; the
        scatter runs only when a row is)."""

        def add():
            v = self.counts.shape[-1]
            hot = jax.nn.one_hot(tokens, v, dtype=jnp.int32) * emitted[..., None]
            return self.counts + hot.sum(axis=1)

        counts = jax.lax.cond(jnp.any(self.on()), add, lambda: self.counts)
        return dataclasses.replace(self, counts=counts)


@dataclasses.dataclass
class DraftState:
    """Per row: the last verified token (its KV not written yet), its position, the
    drafts for the positions after it and the distributions they were drawn from, and
    the row's sampling temperature (0: greedy), seed and target filters, and whether it
    reports its tokens' top log-probs (`top`), and its penalties. `q` is `[b, k, 0]` in
    the greedy variant of the step, which keeps no distributions."""

    token: Int[Array, " b"]
    pos: Int[Array, " b"]
    drafts: Int[Array, "b k"]
    q: Float[Array, "b k v"]
    temperature: Float[Array, " b"]
    seed: Int[Array, " b"]
    filters: Filters
    top: Bool[Array, " b"]
    penalties: Penalties


def _register(cls) -> None:
    """`cls` as a pytree whose unflatten skips `__init__`: JAX unflattens around
    non-array leaves too (`ShapeDtypeStruct`s of an ahead-of-time lowering), which the
    tests' type checks of the fields would refuse."""
    names = tuple(f.name for f in dataclasses.fields(cls))

    def unflatten(_, children):
        obj = object.__new__(cls)
        obj.__dict__.update(zip(names, children, strict=True))
        return obj

    jax.tree_util.register_pytree_node(
        cls, lambda o: ([getattr(o, n) for n in names], None), unflatten
    )


_register(Filters)
_register(Penalties)
_register(DraftState)


@dataclasses.dataclass
class StepOutput:
    """What one step gives the host: per row the tokens emitted (the first
    `accepted + 1`: the accepted drafts, then the token drawn after them; the rest is
    padding) and their log-probs under the target model (untempered); with them, when a
    row of the step reports them (`DraftState.top`), the `TOP_LOGPROBS_MAX` most likely
    tokens at each of those positions and their log-probs (zeros otherwise)."""

    tokens: Int[Array, "b k1"]
    accepted: Int[Array, " b"]
    logprobs: Float[Array, "b k1"]
    top_ids: Int[Array, "b k1 n"]
    top_logprobs: Float[Array, "b k1 n"]


_register(StepOutput)

# Fold-in tags of a row's random streams at a position: draft j of the chain that starts
# there uses tag j; the accept / reject draws of the step verifying there use this one.
ACCEPT_STREAM = 1 << 20


def span_on_device(
    ids: Int[Array, "b t"],
    start: Int[Array, " b"],
    table: Int[Array, "b w"],
    live: Bool[Array, " b"],
    page_size: int,
    kv_io: KVIO = SINGLE_DEVICE_KV_IO,
) -> ForwardBatch:
    """Row `b`'s tokens `ids[b]` at positions `start[b], start[b] + 1, ..` (the device
    twin of `span_batch`), written where `kv_io` puts them (`KVIO.slots`: a CP decode
    group's pages live on their owner lanes). A dead row sits at position 0 and writes
    the trash page."""
    t = ids.shape[1]
    start = jnp.where(live, start, 0)
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    slots = kv_io.slots(table, positions, page_size)
    valid = jnp.broadcast_to(live[:, None], ids.shape)
    return ForwardBatch(
        input_ids=ids,
        positions=positions,
        valid=valid,
        write_slots=jnp.where(valid, slots, 0),
        page_table=table,
        kv_lens=start + t,
    )


def _uniforms(seed: Int[Array, " b"], pos: Int[Array, " b"], tag: int, n: int) -> Array:
    """`[b, n]` U[0, 1) draws of each row's stream `tag` at position `pos`."""

    def row(s, p):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(s), p), tag)
        return jax.random.uniform(key, (n,))

    return jax.vmap(row)(seed, pos)


def _penalized(
    lp, logits, penalties: Penalties | None, positions=None, drafts=None
) -> tuple[Array, Array]:
    """(what each row's greedy token is the argmax of, what its tempered target is
    drawn from): `lp` and `logits`, or a penalized row's penalized log-probs for both
    (`Penalties.scores` at `positions`, after `drafts` when verifying them)."""
    if penalties is None:
        return lp, logits.astype(jnp.float32)
    scores = penalties.scores(lp, logits, positions, drafts)
    on = penalties.on().reshape((-1,) + (1,) * (lp.ndim - 1))
    return jnp.where(on, scores, lp), jnp.where(on, scores, logits.astype(jnp.float32))


def _target(
    logits: Float[Array, "b *t v"],
    temperature: Float[Array, " b"],
    filters: Filters | None = None,
    penalties: Penalties | None = None,
    positions: Int[Array, "b ..."] | None = None,
    drafts: Int[Array, "b k"] | None = None,
) -> tuple[Float[Array, "b *t v"], Float[Array, "b *t v"]]:
    """(log-probs, the distribution to draw from): `softmax(logits / T)` for a row with
    T > 0, with the row's `filters` applied (the target's; a draft's distribution is not
    filtered: any draft distribution keeps speculative sampling exact), the one-hot of
    the greedy token (argmax of the log-probs, as the reference generator picks it) for
    T = 0, so the greedy rule is the sampling rule's special case (`accept_drafts`). A
    row with `penalties` (at `positions`, verifying `drafts`: `Penalties.scores`) has them
    applied before
    both, as `cpkv_jax.sampling` applies them to one draw; the log-probs stay unpenalized."""
    lp = log_probs(logits, is_batch_invariant())
    greedy_scores, source = _penalized(lp, logits, penalties, positions, drafts)
    t = temperature.reshape(temperature.shape + (1,) * (logits.ndim - 1))
    onehot = jax.nn.one_hot(jnp.argmax(greedy_scores, axis=-1), logits.shape[-1], dtype=jnp.float32)
    z = source / jnp.where(t > 0, t, 1.0)
    tempered = jax.nn.softmax(z, axis=-1)
    if filters is not None:
        v = logits.shape[-1]
        per_row = tuple(  # each row's filter at each of its positions
            jnp.broadcast_to(f.reshape(t.shape[:-1]), logits.shape[:-1]).reshape(-1)
            for f in (filters.top_k, filters.top_p, filters.min_p)
        )
        flat = filtered_probs(tempered.reshape(-1, v), z.reshape(-1, v), *per_row)
        tempered = flat.reshape(logits.shape)
    return lp, jnp.where(t > 0, tempered, onehot)


def top_logprobs(lp: Float[Array, "b *t v"], want: Bool[Array, " b"]) -> tuple[Array, Array]:
    """`cpkv_jax.sampling.top_logprobs` of every position of `lp`, when a row `want`s
    them."""
    return sampling_top_logprobs(lp, jnp.any(want))


def _chosen(lp: Float[Array, "*bt v"], tokens: Int[Array, "*bt"]) -> Float[Array, "*bt"]:
    """The log-prob of each of `tokens` under `lp`."""
    return jnp.take_along_axis(lp, tokens[..., None], -1)[..., 0]


def _draw(probs: Float[Array, "b v"], u: Float[Array, " b"]) -> Int[Array, " b"]:
    """Inverse-CDF draws, one per row (a one-hot row gives its token for any u)."""
    cdf = jnp.cumsum(probs, axis=-1)
    token = jax.vmap(lambda c, x: jnp.searchsorted(c, x, side="right"))(cdf, u * cdf[:, -1])
    return jnp.minimum(token, probs.shape[-1] - 1).astype(jnp.int32)


def _pick(
    logits,
    temperature,
    seed,
    pos,
    tag: int,
    greedy: bool,
    filters: Filters | None = None,
    penalties: Penalties | None = None,
):
    """(log-probs, the distribution drawn from - None when `greedy` -, the token) of
    each row's next token: the argmax of the log-probs when `greedy` (every row at
    temperature 0: no draws, no distributions), else a draw from `_target`'s
    distribution (with `filters` and `penalties`: a target token's) with the row's
    stream `tag` at `pos` (the token's position is `pos + 1`)."""
    if greedy:
        lp = log_probs(logits, is_batch_invariant())
        scores, _ = _penalized(lp, logits, penalties, pos + 1)
        return lp, None, jnp.argmax(scores, axis=-1).astype(jnp.int32)
    lp, p = _target(logits, temperature, filters, penalties, pos + 1)
    return lp, p, _draw(p, _uniforms(seed, pos, tag, 1)[:, 0])


def _mtp(
    model: CausalLM,
    batch: ForwardBatch,
    hidden,
    pool: KVPool,
    index_k_dtype: str,
    kv_io: KVIO = SINGLE_DEVICE_KV_IO,
):
    """The MTP layer over `batch` (tokens one position ahead) fed `hidden`: its output
    hidden states and the pool."""
    cfg = model.cfg
    cos, sin = rope_cos_sin(batch.positions, cfg.qk_rope_head_dim, cfg.rope)
    embeds = model.model.embed_tokens(batch.input_ids)
    return model.mtp.predict(
        embeds,
        hidden,
        batch,
        pool,
        cos,
        sin,
        kv_io=kv_io,
        index_k_dtype=index_k_dtype,
    )


def _chain(
    model,
    first: Float[Array, "b h"],
    pos,
    temperature,
    seed,
    table,
    live,
    pool,
    *,
    k: int,
    page_size: int,
    index_k_dtype: str,
    greedy: bool,
    kv_io: KVIO = SINGLE_DEVICE_KV_IO,
):
    """`k` drafts for positions `pos+1..pos+k` and their distributions (`[b, k, 0]` when
    greedy), from the MTP output `first` at `pos - 1`: the first from its logits, each
    next one from an MTP step on the previous draft at the previous position with the
    MTP's own output hidden state; draft j drawn with the row's stream j at `pos`."""
    hidden, drafts, dists = first[:, None], [], []
    for j in range(k):
        if j:
            batch = span_on_device(drafts[-1][:, None], pos + j - 1, table, live, page_size, kv_io)
            hidden, pool = _mtp(model, batch, hidden, pool, index_k_dtype, kv_io)
        _, q, draft = _pick(model.logits(hidden[:, 0]), temperature, seed, pos, j, greedy)
        drafts.append(draft)
        dists.append(jnp.zeros((len(draft), 0), jnp.float32) if greedy else q)
    return jnp.stack(drafts, axis=1), jnp.stack(dists, axis=1), pool


def spec_step(
    graphdef,
    state,
    ds: DraftState,
    table: Int[Array, "b w"],
    live: Bool[Array, " b"],
    pool: KVPool,
    *,
    page_size: int,
    index_k_dtype: str,
    invariant: bool,
    greedy: bool,
    kv_io: KVIO = SINGLE_DEVICE_KV_IO,
    block_bytes: int | None = None,
) -> tuple[StepOutput, DraftState, KVPool]:
    """One verify-and-draft step for every row (see the module docstring); `greedy`
    when every row is at temperature 0 (then `ds.q` is `[b, k, 0]`: no distributions
    are kept). Jit it with the keyword arguments and `graphdef` bound (`MTPSpeculator`
    does), the pool donated: as a static argument the graph definition would be hashed
    on every call (about 1 ms for the tiny model, as long as its whole step). `kv_io` and
    `block_bytes` as for `forward_step`."""
    with batch_invariant(invariant), token_block_bytes(block_bytes):
        model = nnx.merge(graphdef, state)
        b, k = ds.drafts.shape
        ids = jnp.concatenate([ds.token[:, None], ds.drafts], axis=1)
        batch = span_on_device(ids, ds.pos, table, live, page_size, kv_io)
        hidden, pool = model(batch, pool, kv_io=kv_io, index_k_dtype=index_k_dtype)
        logits = model.logits(hidden)
        at = ds.pos[:, None] + 1 + jnp.arange(k + 1)[None]  # the verified tokens' positions
        if greedy:  # the sampling rule with one-hot distributions, without the draws
            lp = log_probs(logits, is_batch_invariant())
            scores, _ = _penalized(lp, logits, ds.penalties, at, ds.drafts)
            tokens = jnp.argmax(scores, axis=-1).astype(jnp.int32)
            accepted = jnp.sum(jnp.cumprod(ds.drafts == tokens[:, :k], axis=1), axis=1)
            accepted = accepted.astype(jnp.int32)
            token = jnp.take_along_axis(tokens, accepted[:, None], axis=1)[:, 0]
        else:
            lp, p = _target(logits, ds.temperature, ds.filters, ds.penalties, at, ds.drafts)
            u = _uniforms(ds.seed, ds.pos, ACCEPT_STREAM, k + 1)
            accepted, token = jax.vmap(accept_drafts)(p, ds.q, ds.drafts, u)
            i = jnp.arange(k + 1)[None]
            drafts = jnp.concatenate([ds.drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
            tokens = jnp.where(i < accepted[:, None], drafts, 0)
            tokens = jnp.where(i == accepted[:, None], token[:, None], tokens)
        out = StepOutput(tokens, accepted, _chosen(lp, tokens), *top_logprobs(lp, ds.top))
        pos = ds.pos + accepted + 1
        emitted = jnp.arange(k + 1)[None] <= accepted[:, None]
        penalties = ds.penalties.after(tokens, emitted)
        nxt = dataclasses.replace(ds, token=token, pos=pos, penalties=penalties)
        if k == 0:
            return out, nxt, pool
        # The MTP pass: position p + i sees the emitted token at p + i + 1.
        mbatch = span_on_device(tokens, ds.pos, table, live, page_size, kv_io)
        mhidden, pool = _mtp(model, mbatch, hidden, pool, index_k_dtype, kv_io)
        first = jnp.take_along_axis(mhidden, accepted[:, None, None], axis=1)[:, 0]
        drafts, q, pool = _chain(
            model,
            first,
            pos,
            ds.temperature,
            ds.seed,
            table,
            live,
            pool,
            k=k,
            page_size=page_size,
            index_k_dtype=index_k_dtype,
            greedy=greedy,
            kv_io=kv_io,
        )
        return out, dataclasses.replace(nxt, drafts=drafts, q=q), pool


def first_drafts(
    graphdef,
    state,
    ahead: ForwardBatch,
    hidden: Float[Array, "b t h"],
    temperature: Float[Array, " b"],
    seed: Int[Array, " b"],
    live: Bool[Array, " b"],
    pool: KVPool,
    *,
    k: int,
    page_size: int,
    index_k_dtype: str,
    invariant: bool,
    greedy: bool,
    kv_io: KVIO = SINGLE_DEVICE_KV_IO,
    block_bytes: int | None = None,
) -> tuple[Int[Array, "b k"], Float[Array, "b k v"], KVPool]:
    """After the prompts' prefill: the MTP pass over each prompt (`ahead`: position i sees
    the token at i + 1, the last one the first generated token) and the first `k` drafts
    with their distributions, chained from its output at the prompt's last position. A
    row may start after a cached prefix (its first column at position `kv_lens - valid
    tokens`): the prompt's last position is its last valid column."""
    with batch_invariant(invariant), token_block_bytes(block_bytes):
        model = nnx.merge(graphdef, state)
        mhidden, pool = _mtp(model, ahead, hidden, pool, index_k_dtype, kv_io)
        n = ahead.kv_lens  # prompt lengths
        last = jnp.maximum(ahead.valid.sum(-1) - 1, 0)
        first = jnp.take_along_axis(mhidden, last[:, None, None], axis=1)[:, 0]
        return _chain(
            model,
            first,
            n,
            temperature,
            seed,
            ahead.page_table,
            live,
            pool,
            k=k,
            page_size=page_size,
            index_k_dtype=index_k_dtype,
            greedy=greedy,
            kv_io=kv_io,
        )


def _prefill(
    graphdef,
    state,
    batch: ForwardBatch,
    temperature,
    seed,
    filters: Filters,
    pool: KVPool,
    *,
    index_k_dtype,
    invariant,
    greedy,
    kv_io: KVIO = SINGLE_DEVICE_KV_IO,
    block_bytes: int | None = None,
    penalties: Penalties | None = None,
):
    """The trunk over the prompts: their final hidden states, each row's first token
    (drawn with the row's accept stream at its prompt's last position; `penalties` as
    `_pick` takes them) and the log-probs it was drawn from (untempered)."""
    with batch_invariant(invariant), token_block_bytes(block_bytes):
        model = nnx.merge(graphdef, state)
        hidden, pool = model(batch, pool, kv_io=kv_io, index_k_dtype=index_k_dtype)
        last = jnp.maximum(batch.valid.sum(-1) - 1, 0)  # column of the prompt's last token
        logits = model.logits(jnp.take_along_axis(hidden, last[:, None, None], 1)[:, 0])
        pos = jnp.maximum(batch.kv_lens - 1, 0)  # its position (a row may start past 0)
        lp, _, token = _pick(
            logits, temperature, seed, pos, ACCEPT_STREAM, greedy, filters, penalties
        )
        return hidden, token, lp, pool


# ---- the serving engine's draft state, by request slot ----------------------------------


def _no_outputs(penalties: Penalties) -> Penalties:
    """`penalties` of rows being admitted: no output counted yet."""
    return dataclasses.replace(penalties, counts=jnp.zeros_like(penalties.counts))


def init_slab(slots: int, k: int, vocab: int) -> DraftState:
    """The draft state of `slots` request slots and a spare one (index `slots`, which
    padding rows read and write): a decode engine's `DraftState` between its steps.
    `q` keeps the sampled rows' draft distributions, `k x vocab` float32 per slot (1.9 MB
    at GLM-5's 154,880-token vocabulary and k = 3); a greedy row's is the one-hot of its
    drafts, made when a sampled step needs it (`slab_step`)."""
    n = slots + 1
    return DraftState(
        token=jnp.zeros((n,), jnp.int32),
        pos=jnp.zeros((n,), jnp.int32),
        drafts=jnp.zeros((n, k), jnp.int32),
        q=jnp.zeros((n, k, vocab), jnp.float32),
        temperature=jnp.zeros((n,), jnp.float32),
        seed=jnp.zeros((n,), jnp.int32),
        filters=Filters.none(n),
        top=jnp.zeros((n,), bool),
        penalties=Penalties.none(n, vocab),
    )


def _gather(slab: DraftState, slots: Int[Array, " b"], greedy: bool) -> DraftState:
    """The rows `slots` of `slab` as a step's `DraftState` (`q` as `spec_step` wants it)."""

    def take(a):
        return jnp.take(a, slots, axis=0)

    drafts, temperature = take(slab.drafts), take(slab.temperature)
    if greedy:
        q = jnp.zeros((*drafts.shape, 0), jnp.float32)
    else:
        onehot = jax.nn.one_hot(drafts, slab.q.shape[-1], dtype=jnp.float32)
        q = jnp.where((temperature > 0)[:, None, None], take(slab.q), onehot)
    filters = jax.tree.map(take, slab.filters)
    seed, top = take(slab.seed), take(slab.top)
    penalties = jax.tree.map(take, slab.penalties)
    return DraftState(
        take(slab.token), take(slab.pos), drafts, q, temperature, seed, filters, top, penalties
    )


def _scatter(
    slab: DraftState, slots: Int[Array, " b"], live: Bool[Array, " b"], ds: DraftState, greedy: bool
) -> DraftState:
    """`slab` with the live rows of `ds` written at their `slots` (dead rows go to the
    spare slot; a greedy step leaves `q` alone: its rows' distributions are one-hot)."""
    at = jnp.where(live, slots, slab.token.shape[0] - 1)

    def put(a, v):
        return a.at[at].set(v)

    return DraftState(
        token=put(slab.token, ds.token),
        pos=put(slab.pos, ds.pos),
        drafts=put(slab.drafts, ds.drafts),
        q=slab.q if greedy else put(slab.q, ds.q),
        temperature=put(slab.temperature, ds.temperature),
        seed=put(slab.seed, ds.seed),
        filters=jax.tree.map(put, slab.filters, ds.filters),
        top=put(slab.top, ds.top),
        penalties=jax.tree.map(put, slab.penalties, ds.penalties),
    )


def slab_step(
    graphdef,
    state,
    slab: DraftState,
    slots: Int[Array, " b"],
    table: Int[Array, "b w"],
    live: Bool[Array, " b"],
    pool: KVPool,
    **static,
) -> tuple[StepOutput, DraftState, KVPool]:
    """`spec_step` (its keyword arguments in `static`) for the rows of `slab` at `slots`,
    their new state written back there: a serving engine's decode step, rows joining and
    leaving between steps while their state stays on the device."""
    greedy = static["greedy"]
    ds = _gather(slab, slots, greedy)
    out, ds, pool = spec_step(graphdef, state, ds, table, live, pool, **static)
    return out, _scatter(slab, slots, live, ds, greedy), pool


def slab_admit(
    graphdef,
    state,
    slab: DraftState,
    slots: Int[Array, " b"],
    batch: ForwardBatch,
    temperature: Float[Array, " b"],
    seed: Int[Array, " b"],
    filters: Filters,
    top: Bool[Array, " b"],
    penalties: Penalties,
    pool: KVPool,
    *,
    k: int,
    page_size: int,
    index_k_dtype: str,
    invariant: bool,
    greedy: bool,
    kv_io: KVIO = SINGLE_DEVICE_KV_IO,
    block_bytes: int | None = None,
    targets: Int[Array, "b t"] | None = None,
) -> tuple:
    """A serving engine's prefill of newly admitted requests, one per row of `batch`
    (each prompt from position 0, or from the end of a prefix whose trunk and MTP KV are
    in the pool already; rows with no valid token are padding): the trunk over
    the prompts, each row's first token and its log-prob, then the MTP pass over each
    prompt and the first `k` drafts, written into `slab` at `slots` with the row's
    temperature, seed, filters, `top` (it reports top log-probs) and `penalties` (their
    counts are ignored: a prompt has no outputs yet; the first token's penalty is the
    repetition and logit bias). Returns (first tokens, their log-probs, their top ids
    and log-probs (`top_logprobs`), slab, pool); with `targets` (the prompt's next
    tokens at each fed position, -1 where nobody asked: prompt log-probs) their scores
    (`transformer.score_tokens`: chosen, top ids, top log-probs) before the slab."""
    live = batch.valid[:, 0]
    kw = {"index_k_dtype": index_k_dtype, "invariant": invariant, "greedy": greedy}
    kw |= {"kv_io": kv_io, "block_bytes": block_bytes}
    penalties = _no_outputs(penalties)
    hidden, token, lp, pool = _prefill(
        graphdef, state, batch, temperature, seed, filters, pool, **kw, penalties=penalties
    )
    tops = top_logprobs(lp, top & live)
    # Position i of the MTP pass sees token i + 1: the prompt shifted, then the first token
    # (at the last valid column: a row fed after a cached prefix starts past position 0).
    n = batch.kv_lens
    last = jnp.maximum(batch.valid.sum(-1) - 1, 0)
    ids = jnp.roll(batch.input_ids, -1, axis=1)
    ids = jnp.where(jnp.arange(ids.shape[1])[None] == last[:, None], token[:, None], ids)
    ahead = dataclasses.replace(batch, input_ids=ids)
    drafts, q, pool = first_drafts(
        graphdef,
        state,
        ahead,
        hidden,
        temperature,
        seed,
        live,
        pool,
        k=k,
        page_size=page_size,
        **kw,
    )
    ds = DraftState(token, n, drafts, q, temperature, seed, filters, top, penalties.first(token))
    scores = ()
    if targets is not None:  # the trunk's hidden states over the fed prompt tokens
        with batch_invariant(invariant), token_block_bytes(block_bytes):
            scores = score_tokens(nnx.merge(graphdef, state), hidden, targets)
    slab = _scatter(slab, slots, live, ds, greedy)
    return token, _chosen(lp, token), *tops, *scores, slab, pool


def slab_admit_from_hidden(
    graphdef,
    state,
    slab: DraftState,
    slots: Int[Array, " b"],
    logits: Float[Array, "b v"],
    hidden: Float[Array, "b h"],
    n: Int[Array, " b"],
    table: Int[Array, "b w"],
    temperature: Float[Array, " b"],
    seed: Int[Array, " b"],
    filters: Filters,
    top: Bool[Array, " b"],
    penalties: Penalties,
    pool: KVPool,
    *,
    k: int,
    page_size: int,
    index_k_dtype: str,
    invariant: bool,
    greedy: bool,
    kv_io: KVIO = SINGLE_DEVICE_KV_IO,
    block_bytes: int | None = None,
) -> tuple[Int[Array, " b"], Float[Array, " b"], Array, Array, DraftState, KVPool]:
    """`slab_admit` after a prefill that ran elsewhere (a CP runner that also ran the MTP
    layer over every prompt position but the last, whose input is the first output
    token): from each prompt's last logits and the trunk's final hidden state there
    (position `n - 1`), draw the first token as `_prefill` does, then draft as
    `slab_admit_given` does. Rows with `n == 0` are padding. Returns what `slab_admit`
    returns."""
    with batch_invariant(invariant), token_block_bytes(block_bytes):
        model = nnx.merge(graphdef, state)
        last = jnp.maximum(n - 1, 0)
        penalties = _no_outputs(penalties)
        lp, _, token = _pick(
            logits, temperature, seed, last, ACCEPT_STREAM, greedy, filters, penalties
        )
        slab, pool = _draft_after_prefill(
            model, slab, slots, token, hidden, n, table, temperature, seed, filters, top,
            penalties, pool,
            k=k, page_size=page_size, index_k_dtype=index_k_dtype, greedy=greedy, kv_io=kv_io,
        )  # fmt: skip
        return token, _chosen(lp, token), *top_logprobs(lp, top & (n > 0)), slab, pool


def slab_admit_given(
    graphdef,
    state,
    slab: DraftState,
    slots: Int[Array, " b"],
    token: Int[Array, " b"],
    hidden: Float[Array, "b h"],
    n: Int[Array, " b"],
    table: Int[Array, "b w"],
    temperature: Float[Array, " b"],
    seed: Int[Array, " b"],
    filters: Filters,
    top: Bool[Array, " b"],
    penalties: Penalties,
    pool: KVPool,
    *,
    k: int,
    page_size: int,
    index_k_dtype: str,
    invariant: bool,
    greedy: bool,
    kv_io: KVIO = SINGLE_DEVICE_KV_IO,
    block_bytes: int | None = None,
) -> tuple[DraftState, KVPool]:
    """Admission after a prefill that ran elsewhere and also drew the first token (a PD
    prefill server: its CP runner ran the MTP layer over all but the prompt's last
    position, and the room's aux data carries the first token and the trunk's final
    hidden state at `n - 1`): the MTP layer at `n - 1` on `token`, the first `k` drafts
    chained from it, written into `slab` at `slots`. Rows with `n == 0` are padding."""
    with batch_invariant(invariant), token_block_bytes(block_bytes):
        model = nnx.merge(graphdef, state)
        return _draft_after_prefill(
            model, slab, slots, token, hidden, n, table, temperature, seed, filters, top,
            _no_outputs(penalties), pool,
            k=k, page_size=page_size, index_k_dtype=index_k_dtype, greedy=greedy, kv_io=kv_io,
        )  # fmt: skip


def _draft_after_prefill(
    model: CausalLM,
    slab: DraftState,
    slots,
    token,
    hidden,
    n,
    table,
    temperature,
    seed,
    filters: Filters,
    top,
    penalties: Penalties,
    pool: KVPool,
    *,
    k: int,
    page_size: int,
    index_k_dtype: str,
    greedy: bool,
    kv_io: KVIO,
) -> tuple[DraftState, KVPool]:
    """The MTP layer at each row's last prompt position `n - 1` on its first output
    `token` and the trunk's hidden state there, the first `k` drafts chained from it,
    the row's draft state written into `slab` at `slots` (rows with `n == 0` skipped)."""
    live = n > 0
    last = jnp.maximum(n - 1, 0)
    batch = span_on_device(token[:, None], last, table, live, page_size, kv_io)
    mhidden, pool = _mtp(model, batch, hidden[:, None], pool, index_k_dtype, kv_io)
    drafts, q, pool = _chain(
        model,
        mhidden[:, 0],
        n,
        temperature,
        seed,
        table,
        live,
        pool,
        k=k,
        page_size=page_size,
        index_k_dtype=index_k_dtype,
        greedy=greedy,
        kv_io=kv_io,
    )
    ds = DraftState(token, n, drafts, q, temperature, seed, filters, top, penalties.first(token))
    return _scatter(slab, slots, live, ds, greedy), pool


def rows_batch(
    rows: Sequence[np.ndarray], tables: np.ndarray, page_size: int, length: int
) -> ForwardBatch:
    """Row i's tokens `rows[i]` at positions 0.. (padded to `length`), the rest of the
    `tables` rows padding (nothing valid, writes to the trash page)."""
    b = len(tables)
    ids, valid = np.zeros((b, length), np.int32), np.zeros((b, length), bool)
    lens = np.zeros(b, np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)], valid[i, : len(r)], lens[i] = r, True, len(r)
    pos = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length))
    page = np.minimum(pos // page_size, tables.shape[1] - 1)
    slots = np.where(valid, np.take_along_axis(tables, page, 1) * page_size + pos % page_size, 0)
    return batch_from_host(ids, pos.copy(), valid, slots, tables, lens)


@dataclasses.dataclass
class SpeculativeResult:
    output_ids: list[int]
    logprobs: list[float]
    # Per step: drafts accepted (0..k); the step emitted one more token than that.
    accepted: list[int]

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verify step (accepted drafts + the bonus token)."""
        return 1.0 + float(np.mean(self.accepted)) if self.accepted else 0.0


class MTPSpeculator:
    """Generation for a batch of requests with `spec_step` (`num_steps` drafts per
    step; 0: plain decoding, one token per step). `model` needs its MTP layer when
    `num_steps > 0` (`CausalLM(..., mtp=True)`, `load_model(mtp=True)`)."""

    def __init__(
        self,
        model: CausalLM,
        num_steps: int,
        *,
        page_size: int = 64,
        index_k_dtype: IndexKDtype = "fp8_e4m3",
        batch_invariant: bool = False,
    ):
        if num_steps < 0:
            raise InputError(f"num_steps must be >= 0, got {num_steps}")
        if num_steps and model.mtp is None:
            raise InputError("speculative decoding needs the model's MTP layer (mtp=True)")
        if index_k_dtype not in INDEX_K_DTYPES:
            raise InputError(
                f"index K dtype {index_k_dtype!r} is not one of {sorted(INDEX_K_DTYPES)}"
            )
        self.cfg, self.k, self.page_size = model.cfg, num_steps, page_size
        self.dtype = model.dtype
        graphdef, self.state = nnx.split(model)
        kw = {"index_k_dtype": index_k_dtype, "invariant": batch_invariant}

        def jit(fn, **static):
            return {  # greedy (every row at temperature 0) and sampled variants
                greedy: jax.jit(
                    functools.partial(fn, graphdef, greedy=greedy, **static),
                    donate_argnames=("pool",),
                )
                for greedy in (True, False)
            }

        self._prefill = jit(_prefill, **kw)
        self._first_drafts = jit(first_drafts, k=num_steps, page_size=page_size, **kw)
        self._step = jit(spec_step, page_size=page_size, **kw)
        self.index_k_dtype = index_k_dtype

    def override_drafts(self, ds: DraftState, pos: np.ndarray | None, step: int) -> DraftState:
        """The drafts the next step verifies (tests replace them with oracle drafts, or
        record them), given each row's position on the host: None when the steps overlap
        and the positions of the steps in flight are not known yet."""
        return ds

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        seeds: Sequence[int] | None = None,
        overlap: bool = True,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Sequence[tuple[int, float]] = (),
    ) -> list[SpeculativeResult]:
        """`max_new_tokens` tokens per prompt, all rows in one batch (EOS does not stop a
        row: the exactness oracle's contract): greedy, or drawn at `temperature` with
        speculative sampling (row i's random streams from `seeds[i]`, default i) from the
        target filtered by `top_k`, `top_p` and `min_p` as `cpkv_jax.sampling` filters,
        with every row's penalties and `logit_bias` (`Penalties`) applied first.

        `overlap`: step n + 1 is dispatched before the host fetches step n's tokens (its
        inputs are step n's device outputs), so the host's work hides behind the device's;
        a row that finished at step n also ran step n + 1, whose tokens it drops, and
        whose writes land in the `k + 1` extra tokens of room its pages keep for that.
        With overlap, `override_drafts` gets no positions after the first step."""
        k, p = self.k, self.page_size
        prompts = [np.asarray(x, np.int32) for x in prompts]
        if not prompts or any(len(x) == 0 for x in prompts) or max_new_tokens < 1:
            raise InputError("give non-empty prompts and max_new_tokens >= 1")
        if temperature < 0:
            raise InputError(f"temperature must be >= 0, got {temperature}")
        seeds = range(len(prompts)) if seeds is None else seeds
        if len(seeds) != len(prompts):
            raise InputError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        rows = pow2_at_least(len(prompts))
        # Room for the last step's verify and chain beyond the output (the module
        # docstring), and for one more step after it when steps overlap.
        room = 2 * k + 1 + (k + 1 if overlap else 0)
        need = [pages_for_tokens(len(x) + max_new_tokens + room, p) for x in prompts]
        width = pow2_at_least(max(need))
        alloc = PageAllocator(sum(need) + 1)
        tables = np.zeros((rows, width), np.int32)
        for i, n in enumerate(need):
            tables[i] = padded_page_table(alloc.alloc(n), width)
        pool_cfg = mtp_config(self.cfg) if k else self.cfg
        pool = init_pool(pool_cfg, sum(need) + 1, p, self.dtype, self.index_k_dtype)

        temps = np.full(rows, temperature, np.float32)
        seed = np.zeros(rows, np.int32)
        seed[: len(prompts)] = seeds
        filters = Filters.of([top_k] * rows, [top_p] * rows, [min_p] * rows)
        penalties = _penalties_for(
            prompts, rows, self.cfg.vocab_size, logit_bias,
            (frequency_penalty, presence_penalty, repetition_penalty),
        )  # fmt: skip
        live = np.arange(rows) < len(prompts)
        # Every prompt in one prefill (and one MTP pass), padded to the longest's bucket.
        length = prefill_bucket(max(len(x) for x in prompts))
        batch = rows_batch(prompts, tables, p, length)
        greedy = temperature == 0
        hidden, token, lp, pool = self._prefill[greedy](
            self.state, batch, temps, seed, filters, pool, penalties=penalties
        )
        drafts = jnp.zeros((rows, k), jnp.int32)
        q = jnp.zeros((rows, k, 0 if greedy else self.cfg.vocab_size), jnp.float32)
        if k:
            ahead = [np.append(x[1:], t) for x, t in zip(prompts, np.asarray(token), strict=False)]
            drafts, q, pool = self._first_drafts[greedy](
                self.state, rows_batch(ahead, tables, p, length), hidden, temps, seed, live, pool
            )
        first = np.asarray(jax.device_get(token))
        lp = np.asarray(jax.device_get(lp))[np.arange(rows), first]
        outs = [SpeculativeResult([int(first[i])], [float(lp[i])], []) for i in range(len(prompts))]
        pos = np.zeros(rows, np.int32)
        pos[: len(prompts)] = [len(x) for x in prompts]
        live &= np.asarray([max_new_tokens > 1] * len(prompts) + [False] * (rows - len(prompts)))
        ds = DraftState(
            token,
            jax.device_put(pos),
            drafts,
            q,
            jax.device_put(temps),
            jax.device_put(seed),
            jax.device_put(filters),
            jax.device_put(np.zeros(rows, bool)),  # no top log-probs
            penalties.first(token),
        )
        table = jax.device_put(tables)
        step, pending = 0, None
        while live.any() or pending is not None:
            launched = None
            if live.any():
                # The host's positions are current before the first step, or without overlap.
                ds = self.override_drafts(ds, pos if step == 0 or not overlap else None, step)
                out, ds, pool = self._step[greedy](
                    self.state, ds, table, jax.device_put(live), pool
                )
                launched, step = (out, live.copy()), step + 1
            if overlap and pending is not None:
                self._record(pending, outs, pos, live, max_new_tokens)
                pending = launched
            elif overlap:
                pending = launched
            else:
                self._record(launched, outs, pos, live, max_new_tokens)
        return outs

    @staticmethod
    def _record(launched, outs, pos, live, max_new_tokens) -> None:
        """Fetch one step's tokens and append those of the rows it ran that still want
        them (a row that finished since keeps nothing of it)."""
        out, ran = launched
        tokens, accepted, lps = jax.device_get((out.tokens, out.accepted, out.logprobs))
        for i in np.flatnonzero(ran):
            o = outs[i]
            room = max_new_tokens - len(o.output_ids)
            if room <= 0:
                continue
            a = int(accepted[i])
            o.output_ids.extend(tokens[i, : a + 1][:room].tolist())
            o.logprobs.extend(lps[i, : a + 1][:room].tolist())
            o.accepted.append(a)
            pos[i] += a + 1
            live[i] = len(o.output_ids) < max_new_tokens


def _penalties_for(
    prompts: Sequence[np.ndarray],
    rows: int,
    vocab: int,
    logit_bias: Sequence[tuple[int, float]],
    values: tuple[float, float, float],
) -> Penalties:
    """`MTPSpeculator.generate`'s rows' `Penalties` (padding rows have none): every
    prompt's tokens, one logit bias and (frequency, presence, repetition) `values`."""
    try:
        row_ids, row_values = bias_rows(logit_bias, vocab)
    except ValueError as e:
        raise InputError(str(e)) from e
    prompt = np.zeros((rows, vocab), bool)
    bias_ids = np.full((rows, LOGIT_BIAS_MAX), vocab, np.int32)
    bias_values = np.zeros((rows, LOGIT_BIAS_MAX), np.float32)
    scalars = np.asarray([[0.0, 0.0, 1.0]] * rows, np.float32)
    ban_until = np.zeros((rows,), np.int32)  # no min_new_tokens here
    for i, x in enumerate(prompts):
        prompt[i, x] = True
        bias_ids[i], bias_values[i] = row_ids, row_values
        scalars[i] = values
    counts = np.zeros((rows, vocab), np.int32)
    host = (counts, prompt, bias_ids, bias_values, *scalars.T, ban_until)
    return Penalties(*(jnp.asarray(a) for a in host))


@jax.jit
def accept_drafts(
    target: Float[Array, "k1 v"],
    draft: Float[Array, "k v"],
    drafts: Int[Array, " k"],
    uniforms: Float[Array, " k1"],
) -> tuple[Int[Array, ""], Int[Array, ""]]:
    """Speculative sampling's accept / reject rule on the device, for one row's chain.

    `target[i]` is the target's distribution at draft position `i` (row `k`: after the
    last draft), `draft[i]` the drafter's, `drafts[i]` the token it drew from it, and
    `uniforms` `k + 1` draws from U[0, 1). Draft `i` is accepted with probability
    `min(1, p_i(d_i) / q_i(d_i))`, in order, until the first rejection; returns how many
    were accepted (`a`) and the token after them: drawn from `max(p_a - q_a, 0)`
    (normalized) at a rejection, or from `p_k` when every draft was accepted (the bonus
    token). The emitted tokens `d_0..d_{a-1}, token` are then distributed as if drawn from
    the target one at a time (Leviathan et al. 2023, Chen et al. 2023). With one-hot
    distributions (greedy) this is the longest matching prefix and the target's argmax."""
    k = drafts.shape[0]
    p_d = jnp.take_along_axis(target[:k], drafts[:, None], axis=1)[:, 0]
    q_d = jnp.take_along_axis(draft, drafts[:, None], axis=1)[:, 0]
    ok = uniforms[:k] * q_d < p_d  # u < p / q, without dividing by q
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
    # q after the last draft is 0: there the residual is p_k itself (the bonus token).
    q_next = jnp.concatenate([draft, jnp.zeros_like(target[:1])])[accepted]
    resid = jnp.maximum(target[accepted] - q_next, 0.0)
    # p == q at a rejected position has probability 0 of rejecting; keep the draw defined.
    resid = jnp.where(resid.sum() > 0, resid, target[accepted])
    cdf = jnp.cumsum(resid)
    token = jnp.searchsorted(cdf, uniforms[k] * cdf[-1], side="right")
    return accepted, jnp.minimum(token, target.shape[1] - 1).astype(jnp.int32)
