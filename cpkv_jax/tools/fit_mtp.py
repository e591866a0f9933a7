"""Fit a checkpoint's MTP layer to its own trunk's greedy continuations (self-distillation).

    python -m cpkv_jax.tools.fit_mtp MODEL_DIR OUT_DIR [--steps N] [--seed S]

A random tiny checkpoint's MTP layer almost never guesses the trunk's next-but-one token,
which tests speculative decoding's correctness but not its speed. As EAGLE heads are
trained, this fits the MTP layer alone (the trunk, embedding and LM head frozen) to
predict what the trunk itself emits: seeded random prompts, the trunk's greedy
continuations of them (`ReferenceGenerator`), the trunk's final hidden states over those
sequences, and a cross-entropy on the MTP layer's prediction of token `i + 2` from token
`i + 1` and the hidden state at `i`, over the continuations. Adam, full batch; the
default 200 steps take about 80 s on 2 CPU cores for the tiny model. OUT_DIR gets the
checkpoint with the fitted MTP layer (and MODEL_DIR's config and tokenizer files). It
prints the loss and, for greedy draft-and-verify with `--num-steps` drafts
(`cpkv_jax.speculative.MTPSpeculator`, the fused device step), the mean acceptance length
and tokens/s against plain decoding, on some of the fitting prompts and on held-out ones
(`benchmarks/bench_speculative.py` gives the same figures for several `k` with repeats).
The prompts are seeded (`--seed`). The output is written by whoever needs it (a test writes a short
fit), not committed: the checkpoint is generated, like the tiny one it starts from.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from cpkv_jax.cli_logging import configure_logging
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.model.kv_cache import SINGLE_DEVICE_KV_IO, init_pool
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.model.rope import rope_cos_sin
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.model.weights import load_model, save_hf_weights
from cpkv_jax.speculative import MTPSpeculator, rows_batch

logger = logging.getLogger(__name__)

PAGE = 16
# Files of a model dir other than the weights, copied to the output as they are.
_COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json")


def greedy_sequences(
    model: CausalLM, n: int, prompt_len: int, new_tokens: int, seed: int
) -> np.ndarray:
    """`[n, prompt_len + new_tokens]`: seeded random prompts (no special tokens) and the
    trunk's greedy continuation of each, as a server would emit it (fp8 index K)."""
    cfg = model.cfg
    gen = ReferenceGenerator(cfg, model, page_size=PAGE, index_k_dtype="fp8_e4m3")
    prompts = np.random.default_rng(seed).integers(3, cfg.vocab_size, (n, prompt_len))
    return np.stack(
        [
            np.concatenate([p, gen.generate(p.tolist(), new_tokens, ignore_eos=True).output_ids])
            for p in prompts
        ]
    ).astype(np.int32)


def _paged(seqs: np.ndarray):
    """A `[B, T]` batch of the rows of `seqs` at positions 0..T-1 (each row its own pages),
    and the page count of a pool that holds them."""
    b, t = seqs.shape
    per_row = -(-t // PAGE)
    table = 1 + np.arange(b * per_row, dtype=np.int32).reshape(b, per_row)
    return rows_batch(list(seqs), table, PAGE, t), 1 + b * per_row


def fit_mtp(
    model: CausalLM, seqs: np.ndarray, prompt_len: int, *, steps: int, lr: float
) -> list[float]:
    """Fit `model.mtp` in place on `seqs` (the trunk's own sequences); the loss per step."""
    cfg = model.cfg
    mcfg = mtp_config(cfg)
    batch, pages = _paged(seqs)
    trunk_pool = init_pool(mcfg, pages, PAGE, jnp.float32, "float32")
    hidden, _ = jax.jit(lambda b, p: model(b, p, index_k_dtype="float32"))(batch, trunk_pool)
    # Position i sees token i + 1 and the trunk's hidden state at i; it predicts i + 2.
    inputs, pages = _paged(seqs[:, 1:-1])
    hidden = hidden[:, :-2]
    targets = jnp.asarray(seqs[:, 2:])
    weight = (np.arange(seqs.shape[1] - 2) >= prompt_len - 1).astype(np.float32)
    weight = jnp.asarray(np.broadcast_to(weight, targets.shape))
    embeds = model.model.embed_tokens(inputs.input_ids)
    cos, sin = rope_cos_sin(inputs.positions, cfg.qk_rope_head_dim, cfg.rope)
    head = (
        model.lm_head.weight[...]
        if model.lm_head is not None
        else model.model.embed_tokens.weight[...]
    )
    graphdef, params = nnx.split(model.mtp, nnx.Param)

    def loss_fn(params):
        layer = nnx.merge(graphdef, params)
        pool = init_pool(mcfg, pages, PAGE, jnp.float32, "float32")
        out, _ = layer.predict(
            embeds,
            hidden,
            inputs,
            pool,
            cos,
            sin,
            kv_io=SINGLE_DEVICE_KV_IO,
            index_k_dtype="float32",
        )
        logp = jax.nn.log_softmax(jnp.einsum("bth,vh->btv", out, head), axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * weight) / jnp.sum(weight)

    opt = optax.adam(lr)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for i in range(steps):
        params, state, loss = step(params, state)
        losses.append(float(loss))
        if i % 50 == 0 or i == steps - 1:
            logger.info("step %d: loss %.4f", i, losses[-1])
    nnx.update(model.mtp, params)
    return losses


def acceptance_length(
    model: CausalLM, prompts: np.ndarray, new_tokens: int, k: int, repeats: int = 1
) -> tuple[float, float, float]:
    """Greedy draft-and-verify over `prompts`, one request at a time, with the fused
    device step (`cpkv_jax.speculative.MTPSpeculator`): mean tokens per verify step, and
    the median tokens/s over `repeats` passes with `k` drafts and without (`k = 0`, the
    same driver), each after a first untimed request (compiles)."""
    accepted: list[float] = []
    rates = {}
    for steps in (k, 0):
        dec = MTPSpeculator(model, steps, page_size=PAGE, index_k_dtype="fp8_e4m3")
        dec.generate([prompts[0].tolist()], new_tokens)  # compiles
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for p in prompts:
                out = dec.generate([p.tolist()], new_tokens)[0]
                if steps:
                    accepted.extend(out.accepted)
            times.append(time.perf_counter() - t0)
        rates[steps] = len(prompts) * new_tokens / statistics.median(times)
    return 1.0 + float(np.mean(accepted)), rates[k], rates[0]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cpkv_jax.tools.fit_mtp", description=__doc__.split("\n", 1)[0]
    )
    ap.add_argument("model_dir", type=Path, help="checkpoint with an MTP layer")
    ap.add_argument("out_dir", type=Path, help="where the fitted checkpoint goes")
    ap.add_argument("--sequences", type=int, default=32, help="training sequences")
    ap.add_argument("--prompt-len", type=int, default=16, help="random prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt")
    ap.add_argument("--steps", type=int, default=200, help="Adam steps (full batch)")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    ap.add_argument("--num-steps", type=int, default=3, help="drafts per verify, measured")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (held-out: seed + 1)")
    args = ap.parse_args(argv)
    configure_logging()
    _, model = load_model(args.model_dir, mtp=True, progress=False)
    seqs = greedy_sequences(model, args.sequences, args.prompt_len, args.new_tokens, args.seed)
    held_out = np.random.default_rng(args.seed + 1).integers(
        3, model.cfg.vocab_size, (4, args.prompt_len)
    )
    fitting = seqs[: len(held_out), : args.prompt_len]
    before = acceptance_length(model, fitting, args.new_tokens, args.num_steps)
    losses = fit_mtp(model, seqs, args.prompt_len, steps=args.steps, lr=args.lr)
    # On the fitting prompts the layer replays continuations it was fitted to (what the
    # tiny checkpoint is for: the speculative path at a high acceptance); on held-out
    # prompts a random trunk's continuations are not predictable from so little data.
    after = acceptance_length(model, fitting, args.new_tokens, args.num_steps)
    unseen = acceptance_length(model, held_out, args.new_tokens, args.num_steps)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in _COPIED:
        if (args.model_dir / name).exists():
            shutil.copy(args.model_dir / name, args.out_dir / name)
    save_hf_weights(model, args.out_dir)
    print(
        json.dumps(
            {
                "loss_first": losses[0],
                "loss_last": losses[-1],
                "num_steps": args.num_steps,
                "fitting_prompts": {
                    "acceptance_length_before": before[0],
                    "acceptance_length_after": after[0],
                    "tokens_per_s_mtp": after[1],
                    "tokens_per_s_plain": after[2],
                    "speedup": after[1] / after[2],
                },
                "held_out_prompts": {
                    "acceptance_length_after": unseen[0],
                    "speedup": unseen[1] / unseen[2],
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
