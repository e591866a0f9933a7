"""Greedy MTP draft-and-verify against plain decoding, side by side in one run (issue 39).

    python -m benchmarks.bench_speculative [--model-dir FITTED] [--num-steps 1 2 3]
        [--repeats 5] [--new-tokens 48] [--json PATH]

Without `--model-dir` it writes the tiny checkpoint and fits its MTP layer first
(`cpkv_jax.tools.fit_mtp` with its defaults: 32 sequences, 200 Adam steps), in a
temporary folder. Then, for each `k` in `--num-steps` and for `k = 0` (plain decoding
through the same driver, `cpkv_jax.speculative.MTPSpeculator`: one fused jitted step and
one read-back per step), one request at a time over 4 of the fitting prompts and 4
held-out prompts: the mean acceptance length (tokens per verify step) and the median
tokens/s over `--repeats` rounds (after an untimed first request that compiles; in each
round every `k` makes one pass, in turn), and the ratio to `k = 0` on the same prompts.
`step_ms_one_row`: one greedy step on one row timed alone (median of `--step-repeats`), the device
cost without the driver's host work.
Timed end to end per request: prefill, first drafts and `--new-tokens` tokens, the
steps overlapped (`MTPSpeculator.generate`'s default).

`engine`: the same comparison through the serving engine (`serving.decode.DecodeEngine`
with `speculative_num_steps=k`, what `cpkv-serve --speculative-algorithm` runs; k = 0 is
the plain engine with its own sampler), one request at a time on the fitting prompts:
the driver's host work per step (stop checks, chunks) is in these figures.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
from flax import nnx

from benchmarks.report import emit, environment
from cpkv_jax.model.kv_cache import init_pool
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.model.weights import load_model, save_hf_weights
from cpkv_jax.speculative import DraftState, Filters, MTPSpeculator, Penalties, spec_step
from cpkv_jax.tools import fit_mtp
from cpkv_jax.tools.make_tiny_checkpoint import make_tiny_checkpoint
from serving.decode.engine import DecodeEngine, whole_prompt_engine
from serving.engine.api import GenerateRequest, SamplingParams

PAGE = fit_mtp.PAGE
PROMPT_LEN = 16  # fit_mtp's default


def fitted_checkpoint(out: Path) -> Path:
    """The tiny checkpoint with its MTP layer fitted as `fit_mtp`'s defaults do."""
    src = make_tiny_checkpoint(out / "tiny")
    _, model = load_model(src, mtp=True, progress=False)
    seqs = fit_mtp.greedy_sequences(model, 32, PROMPT_LEN, 48, seed=0)
    fit_mtp.fit_mtp(model, seqs, PROMPT_LEN, steps=200, lr=3e-3)
    dst = out / "fitted"
    dst.mkdir()
    for name in fit_mtp._COPIED:
        if (src / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())
    save_hf_weights(model, dst)
    return dst


def step_ms(model, k: int, repeats: int = 300) -> float:
    """Median milliseconds of one greedy `spec_step` on one row (40 tokens of context),
    to the step's outputs on the host side of `block_until_ready`: the device cost of a
    step without the driver's host work."""
    graphdef, state = nnx.split(model)
    step = jax.jit(
        functools.partial(
            spec_step,
            graphdef,
            page_size=PAGE,
            index_k_dtype="fp8_e4m3",
            invariant=False,
            greedy=True,
        ),
        donate_argnames=("pool",),
    )
    pool = init_pool(mtp_config(model.cfg), 9, PAGE, model.dtype, "fp8_e4m3")
    table = jax.device_put(np.arange(1, 9, dtype=np.int32)[None])
    host = [[5], [40], np.full((1, k), 7), np.zeros((1, k, 0)), [0.0], [0]]
    dtypes = [np.int32, np.int32, np.int32, np.float32, np.float32, np.int32]
    fields = [np.asarray(x, d) for x, d in zip(host, dtypes, strict=True)]
    extra = [Filters.of([0], [1.0], [0.0]), np.zeros(1, bool)]  # no filters, no top log-probs
    ds = DraftState(*jax.device_put([*fields, *extra]), Penalties.none(1, model.cfg.vocab_size))
    live = jax.device_put(np.ones(1, bool))
    times = []
    for _ in range(repeats + 1):  # the first compiles
        t0 = time.perf_counter()
        out, _, pool = step(state, ds, table, live, pool)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:])


class _EngineDriver:
    """`MTPSpeculator.generate`'s shape over a `DecodeEngine` (one prompt at a time)."""

    def __init__(self, engine: DecodeEngine):
        self.engine = engine

    def generate(self, prompts, new_tokens):
        (prompt,) = prompts
        accepted = engine_generate(self.engine, np.asarray(prompt), new_tokens)
        return [SimpleNamespace(accepted=accepted)]


def measure(decoders: dict, prompts: np.ndarray, new_tokens: int, repeats: int) -> dict[int, dict]:
    """Per `k`: median tokens/s and acceptance length. The decoders take turns, one pass
    over `prompts` each per round, so the machine's drift hits them alike."""
    for dec in decoders.values():
        dec.generate([prompts[0].tolist()], new_tokens)  # compiles
    times: dict[int, list[float]] = {k: [] for k in decoders}
    accepted: dict[int, list[int]] = {k: [] for k in decoders}
    for _ in range(repeats):
        for k, dec in decoders.items():
            t0 = time.perf_counter()
            for p in prompts:
                accepted[k].extend(dec.generate([p.tolist()], new_tokens)[0].accepted)
            times[k].append(time.perf_counter() - t0)
    rows = {
        k: {
            "tokens_per_s": len(prompts) * new_tokens / statistics.median(times[k]),
            "acceptance_length": 1.0 + float(np.mean(accepted[k])),
        }
        for k in decoders
    }
    for row in rows.values():
        row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def engine_for(cfg, model, k: int, pages: int = 64) -> DecodeEngine:
    """A unified `DecodeEngine` (whole-prompt prefill) drafting `k` tokens per step."""
    return whole_prompt_engine(
        cfg, model, pages=pages, page_size=PAGE, index_k_dtype="fp8_e4m3",
        max_running_requests=4, speculative_num_steps=k,
    )  # fmt: skip


def engine_generate(engine: DecodeEngine, prompt: np.ndarray, new_tokens: int) -> list[int]:
    """One greedy request to the end; returns one entry per verify step, each the
    request's mean accepted drafts (the engine reports the mean, `spec_accept_length`).
    A plain engine's request counts as one step with none accepted."""
    rid = f"b{time.perf_counter_ns()}"
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.add(GenerateRequest(rid, tuple(prompt.tolist()), sp))
    while True:
        for c in engine.step():
            if c.finished:
                steps = int(c.meta.get("spec_verify_ct", 0))
                length = float(c.meta.get("spec_accept_length", 1.0))
                return [round(length - 1, 6)] * steps if steps else [0]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model-dir", type=Path, help="a checkpoint with a fitted MTP layer")
    ap.add_argument("--num-steps", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--step-repeats", type=int, default=300, help="timed single steps per k")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or fitted_checkpoint(Path(tmp))
        cfg, model = load_model(model_dir, mtp=True, progress=False)
    sets = {
        # fit_mtp's prompts: the first 4 it was fitted on, and its held-out ones.
        "fitting": np.random.default_rng(0).integers(3, cfg.vocab_size, (32, PROMPT_LEN))[:4],
        "held_out": np.random.default_rng(1).integers(3, cfg.vocab_size, (4, PROMPT_LEN)),
    }
    report: dict = {"environment": environment(), "new_tokens": args.new_tokens, "runs": {}}
    decoders = {
        k: MTPSpeculator(model, k, page_size=PAGE, index_k_dtype="fp8_e4m3")
        for k in [0, *args.num_steps]
    }
    for name, prompts in sets.items():
        rows = measure(decoders, prompts, args.new_tokens, args.repeats)
        report["runs"][name] = {f"k={k}": row for k, row in rows.items()}
    engines = {k: _EngineDriver(engine_for(cfg, model, k)) for k in decoders}
    rows = measure(engines, sets["fitting"], args.new_tokens, args.repeats)
    report["engine"] = {f"k={k}": row for k, row in rows.items()}
    report["step_ms_one_row"] = {f"k={k}": step_ms(model, k, args.step_repeats) for k in decoders}
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
