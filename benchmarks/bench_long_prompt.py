"""A long prompt on a GLM-5-shaped model through the default unified server (issue 35).

    python -m benchmarks.bench_long_prompt --work-dir /tmp/long \
        [--lengths 2048 16384] [--layers 2] [--hidden 1024] [--new 16] [--json PATH]

Writes (once, into `--work-dir/ckpt`) a checkpoint with GLM-5's attention and indexer
dimensions (kv_lora_rank 512, rope 64, 64 heads of 192/256, index head 128 x 32, index
top-k 2048) but `--hidden` wide and `--layers` deep with dense FFNs, vocab 4096, bf16,
random weights; starts `cpkv-serve` on it with default flags (`--chunked-prefill-size
2048`, page 64, a 56 MiB pool) and streams greedy `/generate` requests one at a time, each length
twice (the repeat is a prefix-cache hit) and then with other ids (no hit, shapes warm).
Prints JSON: per run TTFT, inter-token latency median / p90, and the ratio of each
length's ITL to the first length's (a decode step's cost at that context). On the dev
machine (2 cores) a 16K prompt takes about 3.5 minutes: the whole run about 15.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

VOCAB = 4096  # bench_decode.glm5_shaped_raw's


def glm5_shaped_config(layers: int, hidden: int) -> dict[str, Any]:
    """`bench_decode.glm5_shaped_raw` (GLM-5's attention and indexer dims, `hidden` wide,
    `layers` dense-FFN layers, vocab 4096) as a bf16 checkpoint's config, unquantized."""
    from benchmarks.bench_decode import glm5_shaped_raw

    raw = glm5_shaped_raw(layers, hidden)
    raw["torch_dtype"] = "bfloat16"
    raw.pop("quantization_config", None)
    return raw


def write_checkpoint(out: Path, raw: dict[str, Any]) -> Path:
    """Random bf16 weights for `raw` in HF layout at `out` (skipped when already there)."""
    if (out / "config.json").exists():
        return out
    import jax.numpy as jnp
    from flax import nnx

    from cpkv_jax.config import ModelConfig
    from cpkv_jax.model.transformer import CausalLM
    from cpkv_jax.model.weights import save_hf_weights

    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(raw)
    model = CausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    save_hf_weights(model, out)
    (out / "config.json").write_text(json.dumps(raw, indent=1))  # last: marks it complete
    return out


def stream_times(lines: Iterator[str], t0: float, clock=time.perf_counter) -> list[float]:
    """The arrival time of each output token in an SSE `/generate` stream (events carry
    the cumulative `output_ids`; one event may bring several tokens)."""
    times: list[float] = []
    seen = 0
    for line in lines:
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        if "error" in event:
            raise RuntimeError(f"the stream failed: {event['error']}")
        n = len(event.get("output_ids", []))
        now = clock()
        times += [now] * (n - seen)
        seen = max(seen, n)
    if not times:
        raise RuntimeError("the stream ended without a token")
    return [t - t0 for t in times]


def summarize(prompt: int, seed: int, times: Sequence[float]) -> dict[str, Any]:
    itl = np.diff(np.asarray(times)) * 1e3
    return {
        "prompt": prompt,
        "ids_seed": seed,
        "ttft_s": round(times[0], 2),
        "total_s": round(times[-1], 2),
        "itl_ms_median": round(float(np.median(itl)), 1) if itl.size else None,
        "itl_ms_p90": round(float(np.percentile(itl, 90)), 1) if itl.size else None,
        "tokens": len(times),
    }


def run_one(url: str, n: int, seed: int, new: int, timeout: float) -> dict[str, Any]:
    ids = np.random.default_rng(seed).integers(3, VOCAB - 96, n).tolist()
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
    }
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/generate", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered {r.status_code}: {r.read()[:300]!r}")
        return summarize(n, seed, stream_times(r.iter_lines(), t0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(ckpt: Path, log: Path, extra: Sequence[str], timeout: float) -> Iterator[str]:
    """`cpkv-serve` (unified, default flags but `extra`) on loopback; its URL once healthy."""
    port = free_port()
    argv = [sys.executable, "-m", "serving.launch", "--model-path", str(ckpt)]
    argv += ["--host", "127.0.0.1", "--port", str(port), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not healthy within {timeout:g}s; see {log}")
            time.sleep(1.0)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_long_prompt")
    ap.add_argument("--work-dir", type=Path, required=True)
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048, 16384])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--new", type=int, default=16, help="tokens generated per request")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per request and startup")
    ap.add_argument("--server-arg", action="append", default=[], help="extra cpkv-serve flag")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    ckpt = write_checkpoint(args.work_dir / "ckpt", glm5_shaped_config(args.layers, args.hidden))
    flags = ["--dtype", "bfloat16", "--page-size", "64", "--chunked-prefill-size", "2048"]
    flags += ["--kv-pool-size", "56MiB"]  # 16K-token prompts with room to spare
    flags += [a for f in args.server_arg for a in f.split()]
    runs = []
    t0 = time.perf_counter()
    with server(ckpt, args.work_dir / "server.log", flags, args.timeout) as url:
        healthy_s = time.perf_counter() - t0
        plan = [(n, 0, "first") for n in args.lengths]
        plan += [(n, 0, "repeat: prefix cache") for n in args.lengths]
        plan += [(n, 1, "other ids: no cache hit") for n in args.lengths]
        for n, seed, note in plan:
            row = {**run_one(url, n, seed, args.new, args.timeout), "note": note}
            print(json.dumps(row), file=sys.stderr, flush=True)
            runs.append(row)
    base = next(r["itl_ms_median"] for r in runs if r["note"].startswith("other"))
    for r in runs:
        if r["itl_ms_median"] and base:
            r["itl_vs_first_length"] = round(r["itl_ms_median"] / base, 2)
    result = {
        "what": f"unified cpkv-serve (default engine) on a GLM-5-shaped checkpoint: "
        f"{args.layers} layers, hidden {args.hidden}, dense FFNs, bf16; flags {flags}",
        "healthy_s": round(healthy_s, 1),
        "runs": runs,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
