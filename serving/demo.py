"""`make demo`: CP=8 shared-KV prefill -> KV transfer -> decode, behind the PD router.

    python -m serving.demo [--model-dir .demo/tiny-glm5-fp8] [--transfer-backend grpc|mooncake]
        [--max-new-tokens 16] [--enable-batch-invariant] [--warmup auto|all|common]
        [--router cpkv|smg] [--keep-running]

The model is the tiny GLM-5-architecture checkpoint in the official FP8 format
(block-quantized weights + `weight_scale_inv`, sharded files + index json), written on
first use, with 16 routed experts. On 127.0.0.1 it starts three processes: a decode
server decoding data-parallel over 8 devices (`--dp-size 8`: each request's pages and
rows on one rank, the routed experts split over the 8), a CP=8 shared-KV prefill server
with expert parallelism over the same 8 ranks (`--ep-size 8`: 2 experts per rank, loaded
straight into their shards; 8 virtual CPU devices) and `cpkv-router` in front of them
(`--router smg`: SGLang's gateway in PD mode instead). Both servers keep the weights FP8
on device. It sends a short prompt, a long one (many pages), and two prompts sharing a
long prefix (the second reuses the prefill server's radix cache), half of them streamed;
prints each request's TTFT and output, the per-rank KV bytes of the shared vs a
replicated pool of the same capacity, the weights per device and the transfer throughput;
checks every greedy output against the single-device reference computed here
(`cpkv_jax.generate.ReferenceGenerator`: the same FP8 checkpoint, one device): the tokens
must be equal, and the largest log-prob difference is printed; with
`--enable-batch-invariant` (passed to every server and the reference) the log-probs must
be equal too, bit for bit. Then it stops everything (SIGTERM: drain, exit) and exits 0
only if all outputs match. With `--keep-running` (`make demo ARGS=--keep-running`) the
servers stay up after the checks, for a load test against the router
(`python -m benchmarks.bench_serving --base-url <router>`), until Ctrl-C.

Server logs go to `<model-dir>/../logs/`; the tail of a server's log is printed if it
fails to start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from serving.api_keys import KEY_ENVS
from serving.smg import pd_workers, smg_argv, smg_binary, wait_ready

CP = 8
PAGE = 16
STARTUP_TIMEOUT_S = 420.0
REQUEST_TIMEOUT_S = 300.0
TEXT = (
    "Context-parallel prefill with shared KV stores every page of the cache once, on "
    "the rank that owns it, and rebuilds the full view only while attention runs. "
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server subprocess with its log file; `stop` sends SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str]):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("w")
        self.popen = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode


def dead(procs: Sequence[Proc]) -> str | None:
    """Why startup cannot go on: the first process that exited, with its log's tail."""
    for p in procs:
        if not p.alive():
            return (
                f"{p.name} exited with code {p.popen.returncode} during startup; "
                f"log tail ({p.log_path}):\n{p.tail()}"
            )
    return None


def wait_healthy(url: str, procs: Sequence[Proc], timeout: float) -> None:
    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout:
        why = dead(procs)
        if why is not None:
            raise RuntimeError(why)
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError as e:
            last = str(e)
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f}s ({last})")


@contextlib.contextmanager
def servers(args: argparse.Namespace, log_dir: Path) -> Iterator[dict[str, Any]]:
    py = sys.executable
    base_env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    for name in KEY_ENVS:  # a local demo without keys: the caller's would lock its client out
        base_env.pop(name, None)
    prefill_env = {
        **base_env,
        "XLA_FLAGS": (
            base_env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={CP}"
        ).strip(),
    }
    names = ("decode", "prefill", "router", "transfer", "bootstrap", "metrics")
    ports = {k: free_port() for k in names}
    common = [
        "--model-path",
        str(args.model_dir),
        "--dtype",
        "float32",
        "--page-size",
        str(PAGE),
        "--transfer-backend",
        args.transfer_backend,
        "--log-level",
        args.server_log_level,
        *(["--enable-batch-invariant"] if args.enable_batch_invariant else []),
        *("--warmup", args.warmup),
    ]
    procs: list[Proc] = []
    try:
        print(
            f"starting decode server on :{ports['decode']} (DP={CP} with EP={CP}, {CP} "
            "virtual CPU devices) ...",
            flush=True,
        )
        procs.append(
            Proc(
                "decode",
                [
                    py,
                    "-m",
                    "serving.launch",
                    *common,
                    "--disaggregation-mode",
                    "decode",
                    "--dp-size",
                    str(CP),
                    "--port",
                    str(ports["decode"]),
                    "--transfer-port",
                    str(ports["transfer"]),
                ],
                log_dir,
                prefill_env,
            )
        )
        print(
            f"starting prefill server on :{ports['prefill']} (CP={CP} shared KV, EP={CP}, "
            f"{CP} virtual CPU devices) ...",
            flush=True,
        )
        procs.append(
            Proc(
                "prefill",
                [
                    py,
                    "-m",
                    "serving.launch",
                    *common,
                    "--disaggregation-mode",
                    "prefill",
                    "--cp-size",
                    str(CP),
                    "--enable-cp-shared-kv",
                    "--ep-size",
                    str(CP),
                    "--chunked-prefill-size",
                    "128",
                    "--port",
                    str(ports["prefill"]),
                    # The gateway's PD handshake; on a free port (8998 may be taken).
                    "--disaggregation-bootstrap-port",
                    str(ports["bootstrap"]),
                ],
                log_dir,
                prefill_env,
            )
        )
        urls = {k: f"http://127.0.0.1:{ports[k]}" for k in ("decode", "prefill", "router")}
        t0 = time.monotonic()
        for name in ("decode", "prefill"):
            # Compiling every shape on 2 cores takes minutes more on a cold cache.
            wait_healthy(urls[name], procs, STARTUP_TIMEOUT_S * (4 if args.warmup == "all" else 1))
            print(f"  {name} healthy after {time.monotonic() - t0:.0f}s (compiles warmed up)")
        if args.router == "smg":
            procs.append(start_smg(urls, ports, log_dir, base_env))
            wait_ready(urls["router"], 2, 60.0, alive=lambda: dead(procs))
            print(f"  smg gateway (PD mode) ready on :{ports['router']}\n", flush=True)
        else:
            procs.append(
                Proc(
                    "router",
                    [
                        py, "-m", "serving.router", "--prefill", urls["prefill"],
                        "--decode", urls["decode"], "--port", str(ports["router"]),
                    ],
                    log_dir,
                    base_env,
                )
            )  # fmt: skip
            wait_healthy(urls["router"], procs, 60.0)
            print(f"  router healthy on :{ports['router']}\n", flush=True)
        yield {"urls": urls, "procs": procs}
    finally:
        for p in reversed(procs):
            code = p.stop()
            print(f"stopped {p.name} (exit code {code})")


def start_smg(
    urls: dict[str, str], ports: dict[str, int], log_dir: Path, env: dict[str, str]
) -> Proc:
    """SGLang's gateway in PD mode in front of the pair (`--router smg`)."""
    binary = smg_binary()
    if binary is None:
        raise RuntimeError("--router smg: the `smg` gateway is not installed (pip install smg)")
    workers = pd_workers(urls["prefill"], ports["bootstrap"], urls["decode"])
    argv = smg_argv(binary, ports["router"], workers, metrics_port=ports["metrics"])
    return Proc("smg", argv, log_dir, env)


SSE_DONE: Any = object()  # `sse_event` at `data: [DONE]`


def sse_event(line: str) -> Any:
    """One line of an SSE body: its JSON event, `SSE_DONE` at the end, else None."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return SSE_DONE if data == "[DONE]" else json.loads(data)


def send(router: str, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """One /generate request through the router; TTFT measured here (client side)."""
    t0 = time.perf_counter()
    body = {**body, "stream": stream}
    if not stream:
        r = httpx.post(router + "/generate", json=body, timeout=REQUEST_TIMEOUT_S)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
        out = r.json()
        out["client_e2e_s"] = time.perf_counter() - t0
        out["client_ttft_s"] = out["meta_info"].get("ttft")
        return out
    ttft = None
    last: dict[str, Any] = {}
    with httpx.stream("POST", router + "/generate", json=body, timeout=REQUEST_TIMEOUT_S) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            event = sse_event(line)
            if event is None:
                continue
            if event is SSE_DONE:
                break
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if ttft is None and event.get("output_ids"):
                ttft = time.perf_counter() - t0
            last = event
    last["client_e2e_s"] = time.perf_counter() - t0
    last["client_ttft_s"] = ttft
    return last


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.demo", description=__doc__)
    ap.add_argument("--model-dir", type=Path, default=Path(".demo/tiny-glm5-fp8"))
    ap.add_argument("--transfer-backend", default="grpc", choices=["grpc", "mooncake"])
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument(
        "--server-log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    ap.add_argument(
        "--enable-batch-invariant",
        action="store_true",
        help="batch-invariant numerics on every server: log-probs must equal the reference's "
        "bit for bit (default: tokens equal, log-prob difference reported)",
    )
    ap.add_argument(
        "--warmup",
        choices=["auto", "all", "common"],
        default=os.environ.get("CPKV_WARMUP", "auto"),
        help="the servers' --warmup: all compiles every reachable shape before turning "
        "healthy (the compilation cache keeps them for the next start), common only the "
        "common ones (the rest on first use), auto (their default) all on GPU and TPU, "
        "common on CPU (default: $CPKV_WARMUP if set, else auto)",
    )
    ap.add_argument(
        "--router",
        default="cpkv",
        choices=["cpkv", "smg"],
        help="what the requests go through: cpkv-router, or SGLang's gateway `smg` in PD "
        "mode (the prefill server's bootstrap port, the same checks)",
    )
    ap.add_argument(
        "--keep-running",
        action="store_true",
        help="after the checks, keep the servers up (e.g. for benchmarks.bench_serving "
        "against the router) until Ctrl-C / SIGTERM",
    )
    args = ap.parse_args(argv)
    t_start = time.monotonic()

    # The demo process itself needs one device (the reference); JAX loads lazily below.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from cpkv_jax.model.weights import load_model
    from cpkv_jax.tokenizer import load_tokenizer
    from cpkv_jax.tools.make_tiny_checkpoint import make_tiny_checkpoint

    if not (args.model_dir / "config.json").is_file():
        make_tiny_checkpoint(args.model_dir, "glm_moe_dsa", fp8=True, n_routed_experts=2 * CP)
        print(f"wrote tiny GLM-5-architecture FP8 checkpoint to {args.model_dir}")
    log_dir = args.model_dir.parent / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cfg, model = load_model(args.model_dir, progress=False)
    tok = load_tokenizer(args.model_dir)
    assert tok is not None, "the tiny checkpoint ships a tokenizer"

    def text_of(n_tokens: int, salt: str = "") -> list[int]:
        ids = tok.encode(salt + TEXT * (1 + n_tokens // 40))
        return ids[:n_tokens]

    prefix = text_of(300)
    prompts = {
        "short": (text_of(20), False),
        "long": (text_of(700), True),
        "prefix-a": ([*prefix, *tok.encode(" First question: what is a page?")], False),
        "prefix-b": ([*prefix, *tok.encode(" Second question: who owns it?")], True),
    }
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "ignore_eos": True}

    results: dict[str, dict[str, Any]] = {}
    with servers(args, log_dir) as s:
        urls = s["urls"]
        for name, (ids, stream) in prompts.items():
            results[name] = send(
                urls["router"],
                {"input_ids": ids, "sampling_params": sampling, "return_logprob": True},
                stream,
            )
        prefill_info = httpx.get(urls["prefill"] + "/server_info", timeout=10).json()
        decode_info = httpx.get(urls["decode"] + "/server_info", timeout=10).json()

        print("request     prompt  cached  stream  TTFT(s)  e2e(s)  output ids (random weights)")
        for name, (ids, stream) in prompts.items():
            r = results[name]
            ttft = r.get("client_ttft_s")
            out = r["output_ids"]
            cached = r["meta_info"].get("cached_tokens", 0)  # the prefill's prefix-cache hit
            print(
                f"{name:<10}{len(ids):>8}{cached:>8}{'yes' if stream else 'no':>8}"
                f"{ttft if ttft is not None else float('nan'):>9.2f}{r['client_e2e_s']:>8.2f}  "
                f"{out[:6]}{' ...' if len(out) > 6 else ''}"
            )
        compiles = sum(
            info["xla_compiles"]["serving"]["compiles"] for info in (prefill_info, decode_info)
        )
        print(
            f"({compiles} XLA programs compiled while serving"
            + (": TTFT and e2e include first-use compiles" if compiles else "")
            + f"; the prefill server's prefix cache reused "
            f"{prefill_info.get('prefix_cache_hit_tokens', 0)} prompt tokens)"
        )

        # Per-rank KV bytes: the prefill server's page-owned pools vs a replicated pool of the
        # same token capacity (every rank would hold every page).
        pages = prefill_info["kv_pages_total"][0]
        per_page = prefill_info["kv_bytes_per_page"]
        shared = pages * per_page
        replicated = (CP * (pages - 1) + 1) * per_page
        print(
            f"\nper-rank persistent KV pool (prefill, cp={CP}): shared {shared / 2**20:.2f} MiB "
            f"vs replicated {replicated / 2**20:.2f} MiB for the same "
            f"{CP * (pages - 1) * PAGE:,} tokens of capacity ({replicated / shared:.2f}x)"
        )
        weights = prefill_info.get("weight_bytes_per_device")
        if weights is not None:
            print(
                f"weights per device: prefill (EP={CP}) {weights / 2**10:.0f} KiB, decode "
                f"(DP={CP}, EP={CP}) {decode_info['weight_bytes_per_device'] / 2**10:.0f} KiB, "
                f"FP8 {prefill_info.get('fp8_weights', 'keep')}"
            )
        sent, secs = (
            prefill_info.get("transfer_bytes", 0),
            prefill_info.get("transfer_seconds", 0.0),
        )
        rate = f"{sent / secs / 2**20:.1f} MiB/s" if secs > 0 else "n/a"
        print(
            f"KV transfer ({args.transfer_backend}): {sent / 2**20:.2f} MiB sent by the prefill "
            f"ranks in {secs:.2f}s of transfer time ({rate}); decode received "
            f"{decode_info.get('transfer_bytes', 0) / 2**20:.2f} MiB, "
            f"{decode_info.get('transfer_failures', 0)} failures"
        )
        print(flush=True)
        if args.keep_running:
            ok = check(args, cfg, model, prompts, results)
            print(f"\ndemo wall time {time.monotonic() - t_start:.0f}s", flush=True)
            wait_for_stop(urls)
            return 0 if ok else 1
    ok = check(args, cfg, model, prompts, results)
    print(f"\ndemo wall time {time.monotonic() - t_start:.0f}s")
    return 0 if ok else 1


def wait_for_stop(urls: dict[str, str]) -> None:
    """Block until SIGINT / SIGTERM (the servers stop when the caller's block exits)."""
    router = urls["router"]
    print(
        f"servers up (--keep-running): router {router}, prefill {urls['prefill']}, decode "
        f"{urls['decode']}. Try:\n  python -m benchmarks.bench_serving --backend sglang "
        f"--base-url {router} --dataset-name generated-shared-prefix --gsp-num-groups 4 "
        "--gsp-prompts-per-group 8 --gsp-system-prompt-len 256 --gsp-question-len 32 "
        "--gsp-output-len 8 --request-rate 4 --output-file bench_serving.json --plot "
        "bench_serving.png\nCtrl-C stops them.",
        flush=True,
    )
    stop = False

    def on_signal(_sig: int, _frame: Any) -> None:
        nonlocal stop
        stop = True

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop:
            time.sleep(0.5)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def check(args: argparse.Namespace, cfg: Any, model: Any, prompts, results) -> bool:
    """Every greedy output against the single-device reference; prints the verdict."""
    from cpkv_jax.generate import ReferenceGenerator

    exact = args.enable_batch_invariant
    ref = ReferenceGenerator(cfg, model, page_size=PAGE, batch_invariant=exact)
    ok = True
    checks = []
    worst = 0.0
    for name, (ids, _) in prompts.items():
        want = ref.generate(ids, args.max_new_tokens, ignore_eos=True)
        got = results[name]["output_ids"]
        got_lp = [lp for lp, _, _ in results[name]["meta_info"]["output_token_logprobs"]]
        same_tokens = got == want.output_ids
        diff = max(abs(a - b) for a, b in zip(got_lp, want.output_logprobs, strict=True))
        worst = max(worst, diff)
        good = same_tokens and (diff == 0.0 or not exact)
        checks.append(f"{name} {'equal' if good else 'DIFFERENT'}")
        if not good:
            ok = False
            print(
                f"MISMATCH {name}: served {got} vs reference {want.output_ids}, "
                f"log-prob max diff {diff:.3g}"
            )
    print(
        "\nsingle-device reference (greedy, this process): "
        + ", ".join(checks)
        + (
            "; log-probs bitwise equal (batch-invariant numerics)"
            if exact and ok
            else f"; log-probs max |diff| {worst:.2g}"
        )
    )
    print(
        "RESULT:",
        "outputs equal the single-device reference"
        if ok
        else "MISMATCH against the single-device reference",
    )
    return ok


if __name__ == "__main__":
    sys.exit(main())
