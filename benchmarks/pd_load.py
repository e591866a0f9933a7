"""PD serving under concurrent load: a real decode + CP8 prefill + router, many clients.

    python -m benchmarks.pd_load --minutes 10 --concurrency 16 [--transfer-backend grpc]
        [--json benchmarks/results/pd_soak.json]

The soak (not in the suite; `tests/serving/test_pd_load.py` runs a short version with a decode
server killed and restarted): it starts the three processes of `make demo` on 127.0.0.1
(tiny checkpoint, small KV pools so requests queue and some prompts are near a pool's
size) and keeps `--concurrency` clients busy for `--minutes` with a mixed load:

- prompts of 5 to `--max-prompt` random tokens (a share near the decode pool's size),
  1-32 new tokens, greedy with `ignore_eos`, so the token count of a good answer is
  known;
- 40% streamed, half of those cancelled by the client after two chunks;
- a few bad requests (out-of-vocabulary token, `max_new_tokens` 0) that must get 400.

Every request ends in one `Outcome` kind: `ok` (200 and the right token count),
`cancelled` (the client left on purpose), `bad_request_ok` (a bad request refused with
400), `queue_full` (503 with Retry-After: backpressure, counted but allowed),
`unavailable` (503 without it, e.g. no healthy decode server while one restarts), or
`failed` (anything else: wrong count, 5xx, a stream error, a timeout). It prints one
JSON object: outcomes by kind, latency percentiles of `ok` requests, each process's RSS
at the start of the load and at the end, and the page balance at the end (each rank's
free pages + what the prefix cache holds == total, from `/server_info`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from serving.api_keys import API_KEY_ENV, KEY_ENVS
from serving.demo import SSE_DONE, Proc, dead, free_port, sse_event, wait_healthy
from serving.smg import pd_workers, smg_argv, smg_binary, wait_ready

CP = 8
PAGE = 16
VOCAB_LOW = 3  # ids below are the tiny tokenizer's specials
STARTUP_TIMEOUT_S = 420.0
RSS_SAMPLE_S = 30.0


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """How the three processes are started (`PDCluster`)."""

    model_dir: Path
    log_dir: Path
    transfer_backend: str = "grpc"
    chunked_prefill_size: int = 256
    prefill_pool: str = "4MiB"  # bytes per rank
    decode_pool: str = "4MiB"
    max_queued_requests: int | None = 256  # None: the flag is not passed
    max_running_requests: int = 16
    extra: tuple[str, ...] = ()
    decode_dp: int = 1  # > 1: the decode server decodes data-parallel (`--dp-size`)
    # > 1: the decode server is a CP group (`--cp-size N --enable-cp-shared-kv`, issue 40):
    # each request's pages striped over its N ranks by owner; with `decode_dp` > 1, that
    # many groups of N (experts over all their devices)
    decode_cp: int = 1
    # Given to all three processes as $CPKV_API_KEY (the router sends it upstream too);
    # clients then send it (`PDCluster.headers`). None: no key.
    api_key: str | None = None
    # What clients talk to: "cpkv" (`cpkv-router`) or "smg" (SGLang's gateway in PD mode;
    # the prefill server then serves its bootstrap port, and a prefill request waits at
    # most `bootstrap_timeout` s for its decode partner: the gateway waits for both legs).
    router: str = "cpkv"
    bootstrap_timeout: float = 20.0


class PDCluster:
    """Decode (1 device, `decode_dp` data-parallel ranks or a `decode_cp` group), CP=8
    shared-KV prefill (8
    virtual CPU devices) and the router,
    on 127.0.0.1. The decode server can be killed (SIGKILL) and started again on the same
    ports. `close` stops everything and returns each process's exit code."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        config.log_dir.mkdir(parents=True, exist_ok=True)
        if config.router not in ("cpkv", "smg"):
            raise ValueError(f"router must be 'cpkv' or 'smg', not {config.router!r}")
        names = ("decode", "prefill", "router", "transfer", "bootstrap", "metrics")
        self.ports = {k: free_port() for k in names}
        self.urls = {
            k: f"http://127.0.0.1:{self.ports[k]}" for k in ("decode", "prefill", "router")
        }
        self.procs: dict[str, Proc] = {}
        self._restarts = 0
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        for name in KEY_ENVS:  # the cluster's key is config.api_key, not the caller's
            env.pop(name, None)
        if config.api_key is not None:
            env[API_KEY_ENV] = config.api_key  # not on the command line, as in production
        self._env = env
        flags = env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={CP}"
        self._prefill_env = {**env, "XLA_FLAGS": flags.strip()}

    def _common(self) -> list[str]:
        c = self.config
        flags = [
            "--model-path", str(c.model_dir), "--dtype", "float32", "--page-size", str(PAGE),
            "--transfer-backend", c.transfer_backend, "--log-level", "info",
            "--max-running-requests", str(c.max_running_requests), *c.extra,
        ]  # fmt: skip
        if c.max_queued_requests is not None:
            flags += ["--max-queued-requests", str(c.max_queued_requests)]
        return flags

    def _start_decode(self) -> None:
        c = self.config
        name = "decode" if not self._restarts else f"decode-{self._restarts}"
        mesh = ["--dp-size", str(c.decode_dp)]
        if c.decode_cp > 1:
            mesh += ["--cp-size", str(c.decode_cp), "--enable-cp-shared-kv"]
            if c.decode_dp > 1:  # DP groups of CP ranks: experts over every device
                mesh += ["--ep-size", str(c.decode_dp * c.decode_cp)]
        self.procs["decode"] = Proc(
            name,
            [
                sys.executable, "-m", "serving.launch", *self._common(),
                "--disaggregation-mode", "decode", "--kv-pool-size", c.decode_pool,
                "--port", str(self.ports["decode"]),
                "--transfer-port", str(self.ports["transfer"]), *mesh,
            ],
            c.log_dir,
            self._env if max(c.decode_dp, c.decode_cp) == 1 else self._prefill_env,  # devices
        )  # fmt: skip

    def start(self) -> PDCluster:
        c = self.config
        self._start_decode()
        self.procs["prefill"] = Proc(
            "prefill",
            [
                sys.executable, "-m", "serving.launch", *self._common(),
                "--disaggregation-mode", "prefill", "--cp-size", str(CP),
                "--enable-cp-shared-kv", "--chunked-prefill-size", str(c.chunked_prefill_size),
                "--kv-pool-size", c.prefill_pool, "--port", str(self.ports["prefill"]),
                *self._bootstrap_flags(),
            ],
            c.log_dir,
            self._prefill_env,
        )  # fmt: skip
        for name in ("decode", "prefill"):
            wait_healthy(self.urls[name], list(self.procs.values()), STARTUP_TIMEOUT_S)
        if c.router == "smg":
            self._start_smg()
            return self
        self.procs["router"] = Proc(
            "router",
            [
                sys.executable, "-m", "serving.router", "--prefill", self.urls["prefill"],
                "--decode", self.urls["decode"], "--port", str(self.ports["router"]),
                "--health-interval", "0.5",
            ],
            c.log_dir,
            self._env,
        )  # fmt: skip
        self.wait_router_ready(60.0)
        return self

    def _bootstrap_flags(self) -> list[str]:
        if self.config.router != "smg":
            return []
        return [
            "--disaggregation-bootstrap-port", str(self.ports["bootstrap"]),
            "--transfer-bootstrap-timeout", str(self.config.bootstrap_timeout),
        ]  # fmt: skip

    def _start_smg(self) -> None:
        """The gateway in PD mode; probing each worker every second, so the restarted
        decode server is taken back soon (its circuit breaker re-closes as fast)."""
        binary = smg_binary()
        if binary is None:
            raise RuntimeError("the `smg` gateway is not installed (pip install smg)")
        key = self.config.api_key
        workers = pd_workers(self.urls["prefill"], self.ports["bootstrap"], self.urls["decode"])
        extra = [
            "--health-check-interval-secs", "1", "--health-success-threshold", "1",
            "--cb-timeout-duration-secs", "2", "--shutdown-grace-period-secs", "5",
            *(["--api-key", key] if key is not None else []),
        ]  # fmt: skip
        argv = smg_argv(binary, self.ports["router"], workers, metrics_port=self.ports["metrics"],
                        extra=extra)  # fmt: skip
        self.procs["router"] = Proc("smg", argv, self.config.log_dir, self._env)
        self.wait_router_ready(60.0)

    def wait_router_ready(self, timeout_s: float) -> None:
        """Until the router takes requests with both servers: `/health` for `cpkv-router`
        (it checks its upstreams), both workers listed ready for `smg`."""
        if self.config.router == "cpkv":
            wait_healthy(self.urls["router"], list(self.procs.values()), timeout_s)
            return
        gateway = [self.procs["router"]]
        wait_ready(
            self.urls["router"], 2, timeout_s, headers=self.headers(), alive=lambda: dead(gateway)
        )

    def headers(self) -> dict[str, str]:
        """What a client of these servers sends: the API key, if there is one."""
        key = self.config.api_key
        return {"Authorization": f"Bearer {key}"} if key is not None else {}

    def kill_decode(self) -> int | None:
        """SIGKILL the decode server (no drain, no cleanup): its exit code."""
        p = self.procs["decode"]
        p.popen.kill()
        p.popen.wait(30)
        p.stop()
        return p.popen.returncode

    def restart_decode(self) -> None:
        self._restarts += 1
        self._start_decode()
        wait_healthy(self.urls["decode"], [self.procs["decode"]], STARTUP_TIMEOUT_S)

    def alive(self) -> dict[str, bool]:
        return {name: p.alive() for name, p in self.procs.items()}

    def rss_mib(self) -> dict[str, float]:
        """Resident set size of each live process (Linux /proc), MiB."""
        out = {}
        for name, p in self.procs.items():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{p.popen.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[name] = int(line.split()[1]) / 1024
        return out

    def close(self) -> dict[str, int | None]:
        codes = {}
        for name in ("router", "prefill", "decode"):
            if name in self.procs:
                codes[name] = self.procs[name].stop()
        return codes


@contextlib.contextmanager
def cluster(config: ClusterConfig) -> Iterator[PDCluster]:
    c = PDCluster(config)
    try:
        yield c.start()
    finally:
        c.close()


# ---- the load ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """One client request of the mix."""

    index: int
    input_ids: tuple[int, ...]
    max_new_tokens: int
    stream: bool
    cancel_after: int | None  # chunks read before the client leaves (streamed only)
    bad: str | None = None  # why the server must refuse it (400)

    def body(self) -> dict[str, Any]:
        ids = list(self.input_ids)
        new = self.max_new_tokens
        if self.bad == "token":
            ids[len(ids) // 2] = 10**6  # outside any vocabulary
        elif self.bad == "max_new_tokens":
            new = 0
        return {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
            "stream": self.stream,
        }


@dataclasses.dataclass(frozen=True)
class LoadMix:
    """The request mix (module docstring)."""

    vocab_size: int
    min_prompt: int = 5
    max_prompt: int = 1500
    near_pool_tokens: int | None = None  # prompts near a pool's size: a share this long
    near_pool_share: float = 0.1
    max_new_tokens: int = 32
    stream_share: float = 0.4
    cancel_share: float = 0.5  # of the streamed ones
    bad_share: float = 0.05

    def make(self, n: int, seed: int) -> list[LoadRequest]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            if self.near_pool_tokens and rng.random() < self.near_pool_share:
                length = rng.randint(int(0.85 * self.near_pool_tokens), self.near_pool_tokens)
            else:
                span = self.max_prompt / self.min_prompt
                length = round(self.min_prompt * span ** rng.random())  # log-uniform
            ids = tuple(rng.randrange(VOCAB_LOW, self.vocab_size) for _ in range(length))
            stream = rng.random() < self.stream_share
            cancel = 2 if stream and rng.random() < self.cancel_share else None
            bad = None
            if rng.random() < self.bad_share:
                bad = rng.choice(["token", "max_new_tokens"])
                cancel = None
            new = rng.randint(1, self.max_new_tokens)
            if cancel is not None:
                new = max(new, 4)  # enough chunks to leave after two
            out.append(LoadRequest(i, ids, new, stream, cancel, bad))
        return out


@dataclasses.dataclass
class Outcome:
    request: LoadRequest
    kind: str  # ok, cancelled, bad_request_ok, queue_full, unavailable, failed
    status: int | None
    latency_s: float
    ttft_s: float | None = None
    output_ids: list[int] | None = None
    detail: str = ""


def _classify_refusal(
    r: LoadRequest, status: int, headers: httpx.Headers, text: str
) -> tuple[str, str]:
    if r.bad is not None:
        return ("bad_request_ok" if status == 400 else "failed"), text[:300]
    if status == 503 and "retry-after" in headers:
        return "queue_full", text[:300]
    if status == 503:
        return "unavailable", text[:300]
    return "failed", f"HTTP {status}: {text[:300]}"


async def _one(client: httpx.AsyncClient, url: str, r: LoadRequest, timeout_s: float) -> Outcome:
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            if not r.stream:
                resp = await client.post(url + "/generate", json=r.body())
                dt = time.monotonic() - t0
                if resp.status_code != 200:
                    kind, detail = _classify_refusal(r, resp.status_code, resp.headers, resp.text)
                    return Outcome(r, kind, resp.status_code, dt, detail=detail)
                out = resp.json()
                ids = out.get("output_ids") or []
                if r.bad is not None:
                    return Outcome(
                        r, "failed", 200, dt, detail=f"bad request ({r.bad}) answered 200"
                    )
                if len(ids) != r.max_new_tokens:
                    return Outcome(
                        r,
                        "failed",
                        200,
                        dt,
                        output_ids=ids,
                        detail=f"{len(ids)} tokens, want {r.max_new_tokens}",
                    )
                ttft = (out.get("meta_info") or {}).get("ttft")
                return Outcome(r, "ok", 200, dt, ttft, ids)
            async with client.stream("POST", url + "/generate", json=r.body()) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    kind, detail = _classify_refusal(r, resp.status_code, resp.headers, text)
                    return Outcome(r, kind, resp.status_code, time.monotonic() - t0, detail=detail)
                chunks, ids, ttft = 0, [], None
                async for line in resp.aiter_lines():
                    event = sse_event(line)
                    if event is None:
                        continue
                    if event is SSE_DONE:
                        break
                    if "error" in event:
                        return Outcome(
                            r,
                            "failed",
                            200,
                            time.monotonic() - t0,
                            detail=f"stream error: {event['error']}",
                        )
                    ids = event.get("output_ids") or ids
                    if ttft is None and ids:
                        ttft = time.monotonic() - t0
                    chunks += 1
                    if r.cancel_after is not None and chunks >= r.cancel_after:
                        return Outcome(r, "cancelled", 200, time.monotonic() - t0, ttft)
                dt = time.monotonic() - t0
                if r.bad is not None:
                    return Outcome(
                        r, "failed", 200, dt, detail=f"bad request ({r.bad}) answered 200"
                    )
                if r.cancel_after is not None:  # finished before the client could leave
                    return Outcome(
                        r,
                        "cancelled" if len(ids) == r.max_new_tokens else "failed",
                        200,
                        dt,
                        ttft,
                        ids,
                    )
                if len(ids) != r.max_new_tokens:
                    return Outcome(
                        r,
                        "failed",
                        200,
                        dt,
                        ttft,
                        ids,
                        f"{len(ids)} tokens, want {r.max_new_tokens}",
                    )
                return Outcome(r, "ok", 200, dt, ttft, ids)
    except TimeoutError:
        return Outcome(
            r, "failed", None, time.monotonic() - t0, detail=f"no answer within {timeout_s:g} s"
        )
    except httpx.HTTPError as e:
        return Outcome(r, "failed", None, time.monotonic() - t0, detail=f"{type(e).__name__}: {e}")


async def run_load(
    url: str,
    requests: Sequence[LoadRequest],
    *,
    concurrency: int,
    timeout_s: float = 300.0,
    until: float | None = None,
    progress: bool = False,
    headers: Mapping[str, str] | None = None,
) -> list[Outcome]:
    """Send `requests` from `concurrency` clients (each takes the next one when its last
    ended), stopping early at monotonic time `until` (requests then in flight finish);
    every request carries `headers` (e.g. `PDCluster.headers()`)."""
    queue = collections.deque(requests)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), unit="req", desc="load")
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s), limits=limits, headers=headers, trust_env=False
    ) as client:

        async def worker() -> None:
            while queue and (until is None or time.monotonic() < until):
                r = queue.popleft()
                outcomes.append(await _one(client, url, r, timeout_s))
                if bar is not None:
                    bar.update(1)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    if bar is not None:
        bar.close()
    return outcomes


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    kinds = collections.Counter(o.kind for o in outcomes)
    ok = sorted(o.latency_s for o in outcomes if o.kind == "ok")
    ttft = sorted(o.ttft_s for o in outcomes if o.kind == "ok" and o.ttft_s is not None)

    def pct(xs: list[float]) -> dict[str, float] | None:
        if not xs:
            return None
        q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else xs * 99
        return {
            "p50": round(q[49], 3),
            "p90": round(q[89], 3),
            "p99": round(q[98], 3),
            "max": round(xs[-1], 3),
        }

    failures = [
        f"#{o.request.index} ({len(o.request.input_ids)} tok): {o.detail}"
        for o in outcomes
        if o.kind == "failed"
    ]
    return {
        "requests": len(outcomes),
        "outcomes": dict(sorted(kinds.items())),
        "e2e_s": pct(ok),
        "ttft_s": pct(ttft),
        "failures": failures[:20],
    }


def page_balance(url: str, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`/server_info` pages per rank: free + cached must equal total when idle."""
    info = httpx.get(url + "/server_info", timeout=10, headers=headers).json()
    total, free = info["kv_pages_total"], info["kv_pages_free"]
    cached = info.get("kv_pages_cached") or [0] * len(total)
    return {
        "total": total,
        "free": free,
        "cached": cached,
        "balanced": all(f + c == t for f, c, t in zip(free, cached, total, strict=True)),
        "waiting": info["waiting"],
        "running": info["running"],
        "queue": info.get("queue"),
    }


def wait_idle(
    urls: Sequence[str], timeout_s: float = 60.0, headers: Mapping[str, str] | None = None
) -> bool:
    """Until every server reports nothing waiting or running (transfers settle)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        infos = [httpx.get(u + "/server_info", timeout=10, headers=headers).json() for u in urls]
        if all(i["waiting"] == 0 and i["running"] == 0 for i in infos):
            return True
        time.sleep(0.25)
    return False


def pool_tokens(pool: str, page_bytes: int) -> int:
    """Tokens a `--kv-pool-size` of `pool` holds (its trash page excluded)."""
    from serving.server_args import parse_byte_size

    return (parse_byte_size(pool) // page_bytes - 1) * PAGE


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.pd_load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model-dir", type=Path, default=Path(".demo/tiny-glm5"))
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--transfer-backend", default="grpc", choices=["grpc", "mooncake"])
    ap.add_argument("--max-prompt", type=int, default=1500)
    ap.add_argument("--decode-pool", default="4MiB")
    ap.add_argument("--prefill-pool", default="4MiB")
    ap.add_argument("--max-queued-requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--router", default="cpkv", choices=["cpkv", "smg"],
        help="what the clients talk to: cpkv-router, or SGLang's gateway in PD mode",
    )  # fmt: skip
    ap.add_argument("--json", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from cpkv_jax.tools.make_tiny_checkpoint import make_tiny_checkpoint

    if not (args.model_dir / "config.json").is_file():
        make_tiny_checkpoint(args.model_dir, "glm_moe_dsa")
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    config = ClusterConfig(
        model_dir=args.model_dir,
        log_dir=args.model_dir.parent / "logs-soak",
        transfer_backend=args.transfer_backend,
        prefill_pool=args.prefill_pool,
        decode_pool=args.decode_pool,
        max_queued_requests=args.max_queued_requests,
        router=args.router,
    )
    t_start = time.time()
    with cluster(config) as c:
        info = httpx.get(c.urls["decode"] + "/server_info", timeout=10).json()
        near = min(pool_tokens(args.decode_pool, info["kv_bytes_per_page"]) - 40, 4096 - 40)
        mix = LoadMix(
            vocab_size=vocab, max_prompt=min(args.max_prompt, near), near_pool_tokens=near
        )
        # More than the clients can send in the time (~1 request/s here); made up front.
        requests = mix.make(max(200, int(400 * args.minutes)), args.seed)
        rss0 = c.rss_mib()
        t0 = time.monotonic()
        until = t0 + 60 * args.minutes
        samples: list[dict[str, Any]] = []
        stop = threading.Event()

        def sample() -> None:  # RSS every RSS_SAMPLE_S: growth after the first compiles
            while not stop.wait(RSS_SAMPLE_S):
                samples.append({"t_s": round(time.monotonic() - t0), **c.rss_mib()})

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        outcomes = asyncio.run(
            run_load(
                c.urls["router"], requests, concurrency=args.concurrency, until=until, progress=True
            )
        )
        stop.set()
        sampler.join()
        idle = wait_idle([c.urls["prefill"], c.urls["decode"]])
        rss1 = c.rss_mib()
        balance = {k: page_balance(c.urls[k]) for k in ("prefill", "decode")}
        alive = c.alive()
    result = {
        "benchmark": "pd_soak",
        "date": time.strftime("%Y-%m-%d", time.gmtime(t_start)),
        "command": "python -m benchmarks.pd_load "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPU cores, JAX CPU (virtual devices)",
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "transfer_backend": args.transfer_backend,
        "near_pool_tokens": near,
        **summarize(outcomes),
        "idle_after": idle,
        "pages": balance,
        "rss_mib_start": rss0,
        "rss_mib_end": rss1,
        "rss_growth_mib": {k: round(rss1.get(k, 0) - v, 1) for k, v in rss0.items()},
        # From the first sample (a minute in: most shapes compiled) to the end.
        "rss_growth_after_1min_mib": {
            k: round(rss1.get(k, 0) - v, 1)
            for k, v in (samples[1] if len(samples) > 1 else rss0).items()
            if k != "t_s"
        },
        "rss_samples_mib": samples,
        "processes_alive_at_end": alive,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    bad = result["outcomes"].get("failed", 0) or not all(b["balanced"] for b in balance.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
