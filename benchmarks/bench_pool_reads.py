"""What it costs that KV transfers read the prefill pool beside donating prefill steps.

    python -m benchmarks.bench_pool_reads [--held-tokens 1024] [--chunk 256] [--steps 12]
        [--repeats 5] [--json PATH]

A PD prefill server's transfers read a finished request's held pages while the engine
runs the next prefill steps, and every step donates the pool. The choice made
(`CPPrefillRunner.kv.lock`, `transfer.page_source.CPPoolPageSource`): a read dispatches
its gather under the lock the step swaps the pool under, so it always reads a live pool;
the copy to host and the step's compute run outside the lock. What that costs is
measured here on the tiny model (float32, CP=8 shared KV on 8 virtual CPU devices):

- `step_ms`: one chunked prefill step (`--chunk` tokens) alone, and while a reader
  thread reads a held `--held-tokens` request's owned pages (every rank, every buffer:
  what the CP8 senders read) in a loop; `step_ratio` = with / alone;
- `read_ms`: one whole read of that request (the 8 ranks in parallel, one thread each,
  as their senders do) alone, and while steps run back to back; `read_ratio` = with /
  alone. A gather queues behind the step already dispatched on its device, so a read
  beside steps costs about one step (per `READ_GROUP_BYTES` of a rank's pages);
- `step_lock_wait_ms`: how long steps waited for the lock while reads ran (the part of
  the step cost the lock itself adds: the rest is the two sharing the CPU).

Medians over `--repeats` rounds of `--steps` steps. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np
from flax import nnx

from benchmarks.report import emit, environment
from cpkv_jax.config import CPConfig, ModelConfig
from cpkv_jax.cp_prefill import CPPrefillRunner
from cpkv_jax.mesh import make_cp_mesh
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.tools.tiny_config import tiny_config_dict
from transfer.page_plan import LayoutDescriptor
from transfer.page_source import CPPoolPageSource

CP = 8
PAGE = 16
INDEX_K = "float32"


class _TimedLock:
    """The runner's lock, timing how long each acquire waited (steps only)."""

    def __init__(self, lock: threading.Lock):
        self._lock = lock
        self.waits: list[float] = []
        self.timing = False

    def __enter__(self):
        t = time.perf_counter()
        self._lock.acquire()
        if self.timing and threading.current_thread() is threading.main_thread():
            self.waits.append(time.perf_counter() - t)
        return self

    def __exit__(self, *exc):
        self._lock.release()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--held-tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=str, default=None, help="also write the result here")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    model = CausalLM(cfg, rngs=nnx.Rngs(3))
    cp = CPConfig(cp_size=CP, shared_kv=True, page_size=PAGE)
    runner = CPPrefillRunner(
        cfg, model, make_cp_mesh(CP), cp, pages_per_rank=256, index_k_dtype=INDEX_K
    )
    timed = _TimedLock(runner.kv.lock)
    runner.kv.lock = timed  # type: ignore[assignment]
    layout = LayoutDescriptor.from_model(cfg, PAGE, "float32", INDEX_K)
    sources = [CPPoolPageSource(lambda: runner.pool, layout, r, lock=timed) for r in range(CP)]
    rng = np.random.default_rng(0)
    held = runner.prefill([rng.integers(3, cfg.vocab_size, args.held_tokens)], args.chunk)
    local = held.tables[0].local_pages()
    owned = [local[r::CP] for r in range(CP)]
    buffers = layout.buffers()
    prompt = rng.integers(3, cfg.vocab_size, args.chunk * args.steps).astype(np.int32)

    def read_rank(r: int) -> None:
        for kind, layer in buffers:
            sources[r].read(kind, layer, owned[r])

    def read_all() -> None:  # the ranks' senders read in parallel, one thread each
        threads = [threading.Thread(target=read_rank, args=(r,)) for r in range(CP)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def steps() -> list[float]:
        out = []
        result = runner.prefill([prompt[: args.chunk]], args.chunk)  # compiled shapes
        runner.release(result.tables[0])
        for _ in range(args.steps):
            t = time.perf_counter()
            result = runner.prefill([prompt[: args.chunk]], args.chunk)
            out.append(time.perf_counter() - t)
            runner.release(result.tables[0])
        return out

    read_all()  # compiles the gathers
    steps()
    rounds: dict[str, list[float]] = {k: [] for k in ("step", "step_r", "read", "read_s", "wait")}
    for _ in range(args.repeats):
        rounds["step"].append(statistics.median(steps()))
        t0 = time.perf_counter()
        for _ in range(5):
            read_all()
        rounds["read"].append((time.perf_counter() - t0) / 5)
        stop = threading.Event()
        read_times: list[float] = []

        def reader(stop=stop, read_times=read_times) -> None:
            while not stop.is_set():
                t = time.perf_counter()
                read_all()
                read_times.append(time.perf_counter() - t)

        thread = threading.Thread(target=reader, daemon=True)
        timed.waits.clear()
        timed.timing = True
        thread.start()
        rounds["step_r"].append(statistics.median(steps()))
        stop.set()
        thread.join()
        timed.timing = False
        rounds["wait"].append(statistics.median(timed.waits) if timed.waits else 0.0)
        rounds["read_s"].append(statistics.median(read_times))
    med = {k: statistics.median(v) * 1e3 for k, v in rounds.items()}
    emit(
        {
            **environment(),
            "benchmark": "pool_reads",
            "cp_size": CP,
            "page_size": PAGE,
            "held_tokens": args.held_tokens,
            "chunk": args.chunk,
            "held_bytes": int(sum(len(p) for p in owned) * layout.bytes_per_page()),
            "step_ms": {"alone": round(med["step"], 2), "with_reads": round(med["step_r"], 2)},
            "step_ratio": round(med["step_r"] / med["step"], 3),
            "step_lock_wait_ms": round(med["wait"], 3),
            "read_ms": {"alone": round(med["read"], 2), "with_steps": round(med["read_s"], 2)},
            "read_ratio": round(med["read_s"] / med["read"], 3),
            "repeats": args.repeats,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
