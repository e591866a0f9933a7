"""Host overhead of the decode loop: the engine's time per token against the step alone.

    python -m benchmarks.bench_host_overhead [--batches 1 16] [--steps 40] [--repeats 5]
        [--json PATH]

Issue 35's figure: (inter-token time of a running batch) / (the step's device time), on
the tiny model (`cpkv_jax.tools.tiny_config`, GLM-5 style, 3 layers), one CPU device.

- `engine_ms`: `DecodeEngine.step()` in steady state (every row running, none joining or
  finishing; a `stop` string per request so the detokenizing stop check runs as it does
  for a served request). One call yields one token per row: what a streaming client sees
  between tokens, less the HTTP layer.
- `device_ms`: the same batch's work alone: the step and the sampler, dispatched back to
  back with the next step's input ids kept on the device, fetched only at the end
  (`--steps` steps per timing), so no host work sits between them.
- `ratio` = engine_ms / device_ms: 1.0 means the host work hides entirely behind the
  device. Each figure is the median of `--repeats` timings of `--steps` steps.

`--no-overlap` runs the engine with `overlap=False` (each step's tokens fetched before
the next is dispatched: the engine before issue 35's item 5); the default JSON has both,
measured in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.report import emit
from cpkv_jax import sampling
from cpkv_jax.config import ModelConfig
from cpkv_jax.kv_store import PagedKVStore
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.tools.tiny_config import tiny_config_dict
from serving.decode.engine import DecodeEngine
from serving.engine.api import GenerateRequest, SamplingParams

PAGE = 16
INDEX_K = "fp8_e4m3"
PROMPT = 24


def detokenize(ids: list[int]) -> str:
    """A byte-per-token stand-in for a tokenizer, so stop strings are checked."""
    return "".join(chr(97 + t % 26) for t in ids)


def build(cfg: ModelConfig, model: CausalLM, batch: int, steps: int, overlap: bool):
    new = 4 * steps + 8  # room for the warm-up and every timing
    pages = batch * (-(-(PROMPT + new) // PAGE)) + 2
    kv = PagedKVStore.create(cfg, pages, PAGE, jnp.float32, INDEX_K)
    engine = DecodeEngine(
        cfg=cfg,
        model=model,
        kv=kv,
        page_size=PAGE,
        index_k_dtype=INDEX_K,
        mode="null",
        max_running_requests=batch,
        detokenize=detokenize,
        overlap=overlap,
    )
    rng = np.random.default_rng(batch)
    for i in range(batch):
        engine.add(
            GenerateRequest(
                f"r{i}",
                tuple(int(t) for t in rng.integers(3, cfg.vocab_size, PROMPT)),
                # "~~" never appears in `detokenize`'s output: checked, never hit.
                SamplingParams(max_new_tokens=new, ignore_eos=True, stop=("~~",)),
            )
        )
    while engine.stats().waiting or engine.stats().running < batch:
        engine.step()  # prefills one request per step
    for _ in range(3):  # every row decoding, the step compiled
        engine.step()
    return engine


def time_engine(engine: DecodeEngine, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        chunks = engine.step()
        assert all(not c.finished for c in chunks)
    return (time.perf_counter() - t0) / steps


def time_device(engine: DecodeEngine, steps: int) -> float:
    """The engine's own step program and sampler on its running rows, `steps` times,
    the tokens fed back on the device, one fetch at the end."""
    rows = [r for r in engine.running.values()]
    dsteps = engine.steps
    t0 = time.perf_counter()
    prev = None
    for k in range(steps):
        batch_rows = [(r.out_ids[-1], r.kv_len + k, r.pages, r.n_pages) for r in rows]
        src = None if prev is None else list(range(len(rows)))
        out = dsteps.decode(batch_rows, None if prev is None else (prev, src))
        greedy = [sampling.GREEDY] * len(rows)
        lp = sampling.rows_log_probs(out.logits)
        prev = sampling.sample_async(lp, greedy, order=out.order).tokens
    jax.block_until_ready(prev)
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_host_overhead")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    rows = []
    for batch in args.batches:
        for overlap in (False, True):
            engine = build(cfg, model, batch, args.steps * args.repeats, overlap)
            eng = [time_engine(engine, args.steps) for _ in range(args.repeats)]
            dev = [time_device(engine, args.steps) for _ in range(args.repeats)]
            e, d = statistics.median(eng), statistics.median(dev)
            rows.append(
                {
                    "batch": batch,
                    "overlap": overlap,
                    "engine_ms": round(e * 1e3, 3),
                    "device_ms": round(d * 1e3, 3),
                    "ratio": round(e / d, 3),
                    "engine_ms_all": [round(x * 1e3, 3) for x in eng],
                    "device_ms_all": [round(x * 1e3, 3) for x in dev],
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
    out = {
        "bench": "host_overhead",
        "model": "tiny glm_moe_dsa (3 layers)",
        "device": str(jax.devices()[0]),
        "steps": args.steps,
        "repeats": args.repeats,
        "rows": rows,
    }
    emit(out, str(args.json) if args.json else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
