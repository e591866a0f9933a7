"""PD transfer throughput per backend vs the raw Mooncake engine, over loopback.

    python -m benchmarks.bench_transfer --json [--tokens 65536] [--layers 8] [--repeats 3]

One GLM-5-sized request (page 64; per token and layer 576 bf16 latent = 1152 B, plus
index K 128 fp8 + a float32 scale = 132 B on full indexer layers; the layout comes from
the GLM-5 config, whose 78 layers are all full - `--layers` keeps the first N so the
pools fit in memory; synthetic GLM-5 dims, with a warning, when the config is missing)
is sent by `--cp` (8) prefill ranks to one decode server on 127.0.0.1:

- prefill side (this process, one thread per rank, as a JAX single-controller prefill
  runs its CP ranks): per rank a host-memory pool per (kind, layer) buffer holding random
  bytes (`transfer.page_source.HostPoolPageSource`); each rank owns pages `p mod cp`, held in
  contiguous local pages (a fresh allocation; `--fragment` scatters them);
- decode side (a child process by default, `--in-process-receiver` otherwise):
  `transfer.receiver.Receiver` in its documented host-only mode (`pool=None`): no decode
  pool and no device scatter - this measures the transfer, not a device copy. Pages
  stage in one pre-faulted arena (the Mooncake endpoint's, registered once; gRPC rooms
  stage there too, so both backends write into the same warm memory), page digests are
  verified as in production, coverage is checked, the room succeeds. The first
  (untimed) run of each backend also checks every staged page against its source;
- warm-up: `--warmup` (3) untimed rooms per backend before the timed ones, so the runs
  measure the steady state. A fresh process's first gRPC rooms fault in the memory
  their message buffers come to live in (glibc malloc arenas of the handler threads,
  grown until they hold a room's peak): measured at 64K tokens, about 28K, 23K, 3K and
  then 0-5K page faults per room on the decode side, and rooms of 0.72, 0.62, 0.48,
  then 0.37-0.43 s. A server pays that on its first requests only. The warm-up rooms'
  times are in `*_warmup_seconds`;
- timing: each room is bootstrapped first, as a prefill server does when it admits a
  request (`transfer.sender.bootstrap_request`: every rank handshakes and heartbeats,
  waiting for its inputs); once every rank is ready, the clock starts when the page
  table and aux data are provided (`TransferHold.provide`, where a prefill server's
  prefill ends) and stops when the decode side's room reaches Success - the moment is
  taken in the decode process (`time.perf_counter` is CLOCK_MONOTONIC, one clock for
  both processes), not after the reply crosses the pipe back: page reads, digests,
  data movement, commits and the coverage check. `*_bootstrap_ms`: the median time
  from the bootstrap's start until every rank was ready (not in `*_gbps`: in a
  server it overlaps the prefill). `--send-at-once` times `send_request` instead, from
  before the first handshake (the handshakes on the clock, as before 2026-11-30).
  `*_gbps` = request bytes / median seconds over `--repeats` (1e9 B/s); `*_cpu_cores`
  = CPU seconds of both processes per second during the timed part;
- raw: `benchmarks.bench_mooncake_raw.RawWriter`, the same total bytes as ONE contiguous
  write between two engines of its own in this process, timed after every timed backend
  run (so the baseline sees the same machine load as the runs around it); `*_ratio` =
  backend GB/s / `raw_mooncake_gbps` (median over all those raw writes). Every timed
  run and raw write starts after a `SETTLE_S` (0.3 s) pause, so none pays for the
  aftermath of the one before (right after a gRPC run, a raw write was up to 70%
  slower, flattering the ratios). `*_paired_ratio`: the median over runs of (the raw
  write right after a run) / (that run) - pairs measured under the same load.
  `raw_sync_call_gbps`: the same write through the binding's blocking call, which spins
  on the transfer status (`transfer.backends.mooncake_engine`), shown for comparison.

Backends: `grpc` (`GrpcBackendConfig`: 4 MiB chunks, `--grpc-channels` channels per
rank, 2 by default as in production) and `mooncake` (zero-copy from the registered host
pools by default; `--mooncake-source copy` reads pages into the backend's registered
host buffer first, as for device pools).

Sender digests: the host pools are sealed once built (`HostPoolPageSource.seal`, the
digests a host cache takes once when a page is written and keeps for every transfer
of it; `seal_ms`: one rank's pool, median, not on the timed path), so senders send
those and only the decode side hashes on the clock. `mooncake-at-send` and
`grpc-at-send` run the same backends from unsealed pools - every page hashed by its
sender during the timed part, as for device pools - and report under
`mooncake_at_send_*` / `grpc_at_send_*`. By default `mooncake`, `grpc` and
`mooncake-at-send` run, in that order, against the same raw baseline.

On a 2-core machine the raw engine write alone keeps most of both cores busy (the
kernel's loopback copies), so every other CPU cycle and memory pass (xxh3 digests, the
Python control plane) comes out of the ratio.

Both processes apply `transfer.malloc_tuning.tune_malloc` first, as the prefill and
decode servers do (`malloc_tuning` in the JSON; `--no-malloc-tuning` keeps glibc's
defaults, for comparison): without it many 4 MiB gRPC chunk buffers are fresh `mmap`s
whose pages the kernel faults in again. The raw baseline runs in the tuned parent
process too (measured alone, the tuning does not change it beyond noise).

Prints ONE JSON object on stdout; progress goes to stderr. Mooncake parts are null, with
the reason in `mooncake_unavailable`, where the engine cannot load.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog: errors only

import numpy as np

from benchmarks.bench_mooncake_raw import RawWriter
from cpkv_jax.config import ModelConfig
from cpkv_jax.model_configs import config_dir
from cpkv_jax.paging import PageAllocator, owned_pages, pages_for_tokens
from cpkv_jax.units import MiB
from transfer.backends.grpc_backend import GrpcBackend, GrpcBackendConfig
from transfer.backends.mooncake_engine import mooncake_available
from transfer.malloc_tuning import tune_malloc
from transfer.page_plan import PROTOCOL_VERSION, LayoutDescriptor, row_digests
from transfer.page_source import HostPoolPageSource
from transfer.protocol import MAX_CHUNK_BYTES, Aux, RoomState, TransferTimeouts
from transfer.receiver import Receiver, serve
from transfer.sender import TransferBackend, bootstrap_request, rank_jobs, send_request
from transfer.staging_arena import StagingArena

logger = logging.getLogger("bench_transfer")

GLM5_CONFIG = config_dir("glm-5")
PAGE_SIZE = 64
BACKENDS = ("mooncake", "mooncake-at-send", "grpc", "grpc-at-send")


def glm5_layout(layers: int, config_dir: Path = GLM5_CONFIG) -> tuple[LayoutDescriptor, str]:
    """The GLM-5 KV layout (page 64, bf16 latent, fp8 index K + scale), first `layers`
    layers; synthetic GLM-5 dims with a warning when the config is missing."""
    if (config_dir / "config.json").is_file():
        cfg = ModelConfig.from_pretrained(config_dir)
        full = LayoutDescriptor.from_model(cfg, PAGE_SIZE, "bfloat16", "fp8_e4m3")
        source = f"GLM-5 config {config_dir}"
    else:
        logger.warning(
            "%s not found: using synthetic GLM-5 dims (576 bf16 latent, 128 fp8 index K + "
            "scale, 78 layers, all full indexer layers)",
            config_dir,
        )
        full = LayoutDescriptor(
            PROTOCOL_VERSION, PAGE_SIZE, 78, tuple(range(78)), 576, "bfloat16", 128,
            "float8_e4m3fn", True,
        )  # fmt: skip
        source = "synthetic GLM-5 dims"
    if not 1 <= layers <= full.num_layers:
        raise SystemExit(f"--layers must be in [1, {full.num_layers}], got {layers}")
    layout = dataclasses.replace(
        full,
        num_layers=layers,
        full_indexer_layers=tuple(x for x in full.full_indexer_layers if x < layers),
    )
    return layout, source


@dataclasses.dataclass
class Plan:
    layout: LayoutDescriptor
    tokens: int
    cp: int
    n_pages: int
    src_local: np.ndarray  # [n_pages] local page of each position on its owner rank
    leaves: list[dict]  # per rank: (kind, layer) -> uint8 [pages_per_rank, page_bytes]

    @property
    def bytes(self) -> int:
        return self.n_pages * self.layout.bytes_per_page()


def build_plan(layout: LayoutDescriptor, tokens: int, cp: int, fragment: bool, seed: int) -> Plan:
    """Random host pools per rank and the request's local pages (contiguous unless
    `fragment`)."""
    n = pages_for_tokens(tokens, layout.page_size)
    rng = np.random.default_rng(seed)
    src_local = np.zeros(n, np.int64)
    pages_per_rank = -(-n // cp) * (2 if fragment else 1) + 1  # + the trash page 0
    for r in range(cp):
        own = owned_pages(n, r, cp)
        local = np.arange(1, pages_per_rank, dtype=np.int64)
        if fragment:
            local = rng.permutation(local)
        src_local[own] = local[: own.size]
    leaves = []
    for _ in range(cp):
        per = {}
        for kind, layer in layout.buffers():
            nb = layout.page_bytes(kind, layer)
            per[(kind, layer)] = (
                np.frombuffer(rng.bytes(pages_per_rank * nb), np.uint8)
                .reshape(pages_per_rank, nb)
                .copy()
            )  # writable, owned
        leaves.append(per)
    return Plan(layout, tokens, cp, n, src_local, leaves)


class DecodeServer:
    """The decode side: a host-only `Receiver` (pool=None) served over gRPC, its staging
    in one pre-faulted arena (the Mooncake endpoint's when the engine loads; gRPC rooms
    stage there too). Rooms opened with `check` hand their staged rows to a sink that
    digests every page (compared with the sources by the caller)."""

    def __init__(self, layout: LayoutDescriptor, n_pages: int, arena_bytes: int, mooncake: bool):
        self.layout = layout
        self.endpoint = None
        if mooncake:
            from transfer.backends.mooncake_backend import MooncakeReceiverEndpoint

            self.endpoint = MooncakeReceiverEndpoint(arena_bytes, quarantine_timeout_s=120.0)
        self._check: set[str] = set()
        self._digests: dict[str, np.ndarray] = {}
        self._dst: dict[str, np.ndarray] = {}
        self._success_at: dict[str, float] = {}
        self._rng = np.random.default_rng(1)
        self._cpu0 = time.process_time()
        self.rx = Receiver(
            layout,
            None,
            PageAllocator(n_pages + 1),
            timeouts=TransferTimeouts(
                bootstrap=120, waiting=120, heartbeat=60, heartbeat_interval=1
            ),
            mooncake=self.endpoint,
            staging_arena=None if self.endpoint is not None else StagingArena(arena_bytes),
            host_sink=self._sink,
        ).start()
        self.server, port = serve(self.rx)
        self.target = f"127.0.0.1:{port}"

    def _sink(self, room: str, positions, dst_pages, staging) -> None:
        # Called by the receiver right before the room turns Success.
        self._success_at[room] = time.perf_counter()
        if room not in self._check:
            return
        out = np.zeros((len(staging), positions.size), np.uint64)
        for b, rows in enumerate(staging):
            out[b, positions] = row_digests(rows, np.arange(positions.size))
        self._digests[room] = out

    def open_room(self, room: str, tokens: int, cp: int, check: bool) -> None:
        n = pages_for_tokens(tokens, self.layout.page_size)
        dst = self._rng.permutation(self.rx.allocate_pages(n))  # shuffled decode pages
        if check:
            self._check.add(room)
        self._dst[room] = dst
        self.rx.register_room(room, dst, tokens, cp)

    def wait(self, room: str) -> tuple[str, str, np.ndarray | None, float, float | None]:
        """(state label, reason, per-(buffer, position) digests of checked rooms, CPU s
        since `mark_cpu`, `time.perf_counter()` when the room turned Success)."""
        snap = self.rx.wait(room, timeout=600)
        cpu = time.process_time() - self._cpu0
        self.rx.free_pages(self._dst.pop(room))
        self._check.discard(room)
        return (
            snap.state.label,
            snap.reason,
            self._digests.pop(room, None),
            cpu,
            self._success_at.pop(room, None),
        )

    def mark_cpu(self) -> None:
        """Start counting this process's CPU time for the next `wait`."""
        self._cpu0 = time.process_time()

    def close(self) -> None:
        self.server.stop(0)
        self.rx.close()
        if self.endpoint is not None:
            self.endpoint.close()


def _decode_process(
    conn, layout: LayoutDescriptor, n_pages: int, arena: int, mc: bool, malloc_tuning: bool
) -> None:
    """Child process body: a `DecodeServer` driven by (method, args) messages."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        if malloc_tuning:  # as the decode server process does (`serving.server.run_server`)
            tune_malloc()
        server = DecodeServer(layout, n_pages, arena, mc)
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", server.target))
    try:
        while True:
            method, args = conn.recv()
            if method == "close":
                break
            try:
                conn.send(("ok", getattr(server, method)(*args)))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        server.close()
        conn.send(("ok", None))


class DecodeProcess:
    """A `DecodeServer` in a child process (spawned): the decode server runs apart from
    the prefill senders, as in a deployment, with its own interpreter lock."""

    def __init__(
        self,
        layout: LayoutDescriptor,
        n_pages: int,
        arena_bytes: int,
        mooncake: bool,
        malloc_tuning: bool = True,
    ):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_decode_process,
            args=(child, layout, n_pages, arena_bytes, mooncake, malloc_tuning),
            name="bench-decode",
            daemon=True,
        )
        self._proc.start()
        self.target = self._reply()

    def _reply(self):
        if not self._conn.poll(120):
            raise RuntimeError("the decode process did not answer within 120 s")
        status, value = self._conn.recv()
        if status not in ("ok", "ready"):
            raise RuntimeError(f"decode process: {value}")
        return value

    def open_room(self, room: str, tokens: int, cp: int, check: bool) -> None:
        self._conn.send(("open_room", (room, tokens, cp, check)))
        self._reply()

    def wait(self, room: str) -> tuple[str, str, np.ndarray | None, float, float | None]:
        self._conn.send(("wait", (room,)))
        return self._reply()

    def mark_cpu(self) -> None:
        self._conn.send(("mark_cpu", ()))
        self._reply()

    def close(self) -> None:
        try:
            self._conn.send(("close", ()))
            self._reply()
        finally:
            self._proc.join(30)
            if self._proc.is_alive():
                self._proc.kill()


def source_digests(plan: Plan) -> np.ndarray:
    """Digest of every (buffer, position) page at its source: what a checked room's
    staging must hold."""
    out = np.zeros((len(plan.layout.buffers()), plan.n_pages), np.uint64)
    owners = np.arange(plan.n_pages) % plan.cp
    for b, key in enumerate(plan.layout.buffers()):
        for r in range(plan.cp):
            pos = np.flatnonzero(owners == r)
            out[b, pos] = row_digests(plan.leaves[r][key], plan.src_local[pos])
    return out


# Pause before every timed run and raw write. Right after a gRPC run, an immediate raw
# write measured 0.29-0.40 s instead of 0.19-0.23 s (64K tokens; neither process was
# using CPU then: the aftermath is in the kernel - freed buffers, socket state), which
# made the baseline slower and every ratio look better than it was.
SETTLE_S = 0.3


@dataclasses.dataclass
class RawTimes:
    """The raw baseline's writer and its writes timed between backend runs (seconds)."""

    writer: RawWriter
    polled: list[float] = dataclasses.field(default_factory=list)
    sync_call: list[float] = dataclasses.field(default_factory=list)

    def take(self) -> None:
        time.sleep(SETTLE_S)
        self.polled.append(self.writer.write_seconds())
        time.sleep(SETTLE_S)
        self.sync_call.append(self.writer.sync_call_seconds())


@dataclasses.dataclass
class BackendRuns:
    """One backend's timed runs (seconds): to Success, CPU of both sides, bootstrap."""

    times: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)
    bootstrap: list[float] = dataclasses.field(default_factory=list)
    seal: list[float] = dataclasses.field(default_factory=list)  # per rank's pool
    warmup: list[float] = dataclasses.field(default_factory=list)  # untimed rooms


def run_backend(
    name: str,
    backend: TransferBackend,
    decode: DecodeServer | DecodeProcess,
    plan: Plan,
    repeats: int,
    raw: RawTimes | None = None,
    at_once: bool = False,
    seal: bool = True,
    warmup: int = 1,
) -> BackendRuns:
    """`repeats` timed runs after `warmup` (>= 1) untimed ones, the first of which
    checks every staged page against its source: each room bootstrapped, then timed
    from `provide` to the decode side's Success (`at_once`: from `send_request`,
    handshakes included), with the CPU seconds of both sides. With `raw`, one raw
    engine write of the same bytes (each way) is timed after each run. `seal`: seal
    every rank's pool first (its digests taken once, before any room; the senders send
    them), else the senders hash every page they send."""
    sources = [HostPoolPageSource(plan.layout, leaves) for leaves in plan.leaves]
    runs = BackendRuns()
    if seal:
        for source in sources:
            t = time.perf_counter()
            source.seal()
            runs.seal.append(time.perf_counter() - t)
    in_process = isinstance(decode, DecodeServer)
    for i in range(warmup + repeats):
        room = f"{name}-{i}"
        decode.open_room(room, plan.tokens, plan.cp, check=i == 0)
        aux = Aux(1, -0.5)
        boot_s = None
        if at_once:
            jobs = rank_jobs(
                room, decode.target, plan.layout, plan.tokens, plan.src_local, sources, aux
            )
        else:  # as a prefill server: handshakes at admission, pages when prefill ends
            jobs = rank_jobs(room, decode.target, plan.layout, plan.tokens, None, sources, None)
            tb = time.perf_counter()
            hold = bootstrap_request(backend, jobs, lambda _: None)
            if not hold.wait_ready(120):
                raise RuntimeError(f"{name} room {room}: bootstrap failed: {hold.wait(120)}")
            boot_s = time.perf_counter() - tb
        time.sleep(SETTLE_S)
        decode.mark_cpu()
        t0, c0 = time.perf_counter(), time.process_time()
        if at_once:
            hold = send_request(backend, jobs, lambda _: None)
        elif not hold.provide(plan.src_local, aux):
            raise RuntimeError(f"{name} room {room}: failed before provide: {hold.wait(120)}")
        state, reason, digests, decode_cpu, success_at = decode.wait(room)
        dc = time.process_time() - c0
        dt = (success_at if success_at is not None else time.perf_counter()) - t0
        outcome = hold.wait(120)
        if state != RoomState.SUCCESS.label:
            raise RuntimeError(f"{name} room {room} ended {state}: {reason}")
        if outcome is None or outcome.state is not RoomState.SUCCESS:
            raise RuntimeError(f"{name} room {room}: the senders saw {outcome}")
        gbps = plan.bytes / dt / 1e9
        if i < warmup:
            if i == 0 and (digests is None or not np.array_equal(digests, source_digests(plan))):
                raise RuntimeError(f"{name}: the staged pages differ from the sources")
            runs.warmup.append(dt)
            logger.info(
                "%s warm-up %d: %.3fs (%.2f GB/s)%s",
                name,
                i + 1,
                dt,
                gbps,
                ", every page checked" if i == 0 else "",
            )
        else:
            runs.times.append(dt)
            runs.cpu.append(dc + (0.0 if in_process else decode_cpu))
            if boot_s is not None:
                runs.bootstrap.append(boot_s)
            logger.info(
                "%s run %d: %.3fs (%.2f GB/s, %.2f cores)%s",
                name,
                i - warmup + 1,
                dt,
                gbps,
                runs.cpu[-1] / dt,
                "" if boot_s is None else f"; bootstrap before it {1e3 * boot_s:.1f} ms",
            )
            if raw is not None:
                raw.take()
    return runs


def backend_report(name: str, plan: Plan, runs: BackendRuns, raw: RawTimes | None) -> dict:
    """A backend's keys: GB/s of the median run, the run times, CPU cores, and (with the
        raw baseline) `{name}_paired_ratio`: the median over runs of (raw write right after
        the run) / (run), each pair measured under the same machine load - steadier than the
        ratio of medians when the load drifts, and blind to how other backends' runs leave
        the machine (the raw writes after one backend's runs can be slower than after
        another's). `{name}_bootstrap_ms`: median handshake phase before the timed part
        (None with `--send-at-once`, whose times include it). `{name}_sender_digests`: "sealed"
    (`seal_ms`: sealing one rank's pool, median) or "at send"."""
    times = runs.times
    out = {
        f"{name}_gbps": plan.bytes / statistics.median(times) / 1e9,
        f"{name}_seconds": times,
        f"{name}_cpu_cores": statistics.median(c / t for c, t in zip(runs.cpu, times, strict=True)),
        f"{name}_bootstrap_ms": 1e3 * statistics.median(runs.bootstrap) if runs.bootstrap else None,
        f"{name}_sender_digests": "sealed" if runs.seal else "at send",
        f"{name}_warmup_seconds": runs.warmup,
    }
    if runs.seal:
        out["seal_ms"] = 1e3 * statistics.median(runs.seal)
    if raw is not None:
        after = raw.polled[-len(times) :]  # one raw write after each timed run
        out[f"{name}_paired_ratio"] = statistics.median(
            r / t for r, t in zip(after, times, strict=True)
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_transfer", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print one JSON object (default: also)")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--layers", type=int, default=8, help="first N GLM-5 layers (of 78)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed rooms per backend before the timed ones (the first checks every page)",
    )
    ap.add_argument("--cp", type=int, default=8, help="prefill CP ranks (senders)")
    ap.add_argument(
        "--backends",
        default="mooncake,grpc,mooncake-at-send",
        help=f"comma-separated, run in this order, of {', '.join(BACKENDS)} (*-at-send: "
        "from unsealed pools, every page hashed by its sender on the clock)",
    )
    ap.add_argument(
        "--grpc-channels",
        type=int,
        default=GrpcBackendConfig.channels_per_rank,
        help="gRPC channels per rank (default: the backend's default)",
    )
    ap.add_argument("--grpc-chunk-mib", type=float, default=MAX_CHUNK_BYTES / MiB)
    ap.add_argument(
        "--mooncake-source",
        choices=("zero-copy", "copy"),
        default="zero-copy",
        help="write from the registered host pools, or copy pages to a host buffer first",
    )
    ap.add_argument("--fragment", action="store_true", help="scatter each rank's local pages")
    ap.add_argument(
        "--in-process-receiver",
        action="store_true",
        help="run the decode receiver in this process (default: a child process)",
    )
    ap.add_argument(
        "--no-malloc-tuning",
        action="store_true",
        help="keep glibc's malloc defaults in both processes (default: "
        "transfer.malloc_tuning.tune_malloc, as the servers do)",
    )
    ap.add_argument(
        "--send-at-once",
        action="store_true",
        help="time send_request from before the handshakes (default: bootstrap each room "
        "first, as a prefill server does at admission, and time from provide)",
    )
    ap.add_argument("--config", type=Path, default=GLM5_CONFIG, help="GLM-5 config dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    if args.repeats < 1 or args.tokens < 1 or args.cp < 1 or args.warmup < 1:
        ap.error("--repeats, --warmup, --tokens and --cp must be >= 1")
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not set(wanted) <= set(BACKENDS) or len(set(wanted)) != len(wanted) or not wanted:
        ap.error(
            f"--backends: {args.backends!r}: give each of {', '.join(BACKENDS)} at most "
            "once, at least one"
        )

    tuning = None if args.no_malloc_tuning else tune_malloc()
    layout, layout_source = glm5_layout(args.layers, args.config)
    t = time.perf_counter()
    plan = build_plan(layout, args.tokens, args.cp, args.fragment, args.seed)
    logger.info(
        "plan: %d tokens, %d pages, %d layers, %d buffers, %.1f MB (%d B/token), cp %d; "
        "pools built in %.1fs",
        plan.tokens,
        plan.n_pages,
        layout.num_layers,
        len(layout.buffers()),
        plan.bytes / 1e6,
        layout.bytes_per_page() // layout.page_size,
        args.cp,
        time.perf_counter() - t,
    )
    ok, why = mooncake_available()
    if not ok:
        logger.warning("Mooncake unavailable, mooncake and raw parts skipped: %s", why)

    # The raw baseline: two engines of its own, timed between the backend runs.
    raw = RawTimes(RawWriter(plan.bytes)) if ok else None
    # One host-only decode server for both backends (its own process by default).
    arena_bytes = plan.bytes + 64 * MiB
    t = time.perf_counter()
    decode: DecodeServer | DecodeProcess = (
        DecodeServer(layout, plan.n_pages, arena_bytes, ok)
        if args.in_process_receiver
        else DecodeProcess(layout, plan.n_pages, arena_bytes, ok, tuning is not None)
    )
    logger.info("decode server at %s up in %.1fs", decode.target, time.perf_counter() - t)
    report: dict = {
        "tokens": plan.tokens,
        "bytes": plan.bytes,
        "grpc_gbps": None,
        "mooncake_gbps": None,
        "raw_mooncake_gbps": None,
        "grpc_ratio": None,
        "mooncake_ratio": None,
        "mooncake_at_send_gbps": None,
        "mooncake_at_send_ratio": None,
        "layers": layout.num_layers,
        "layout": layout_source,
        "page_size": layout.page_size,
        "pages": plan.n_pages,
        "bytes_per_token": layout.bytes_per_page() // layout.page_size,
        "buffers": len(layout.buffers()),
        "cp": args.cp,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "backend_order": wanted,
        "fragmented_sources": args.fragment,
        "host": "127.0.0.1",
        "cpu_count": os.cpu_count(),
        "receiver": "host-only (pool=None): staging verified by digest, no device scatter",
        "receiver_process": "this process" if args.in_process_receiver else "child process",
        "malloc_tuning": tuning.describe() if tuning is not None else "glibc defaults",
        "timing": "send_request, handshakes included"
        if args.send_at_once
        else "provide -> Success, rooms bootstrapped first",
    }
    if not ok:
        report["mooncake_unavailable"] = why
    timed = functools.partial(
        run_backend,
        decode=decode,
        plan=plan,
        repeats=args.repeats,
        raw=raw,
        at_once=args.send_at_once,
        warmup=args.warmup,
    )
    try:
        for name in wanted:  # in the order given
            key, seal = name.removesuffix("-at-send"), not name.endswith("-at-send")
            prefix = name.replace("-", "_")  # JSON keys: mooncake_at_send_gbps, ...
            if key == "grpc":
                cfg = GrpcBackendConfig(
                    chunk_bytes=int(args.grpc_chunk_mib * MiB),
                    channels_per_rank=args.grpc_channels,
                    heartbeat_interval_s=1.0,
                    heartbeat_timeout_s=60.0,
                    rpc_timeout_s=600.0,
                )
                grpc_backend = GrpcBackend(cfg)
                try:
                    runs = timed(name, grpc_backend, seal=seal)
                finally:
                    grpc_backend.close()  # its kept channels
                report.update(backend_report(prefix, plan, runs, raw))
                report["grpc_config"] = {
                    "chunk_bytes": cfg.chunk_bytes,
                    "channels_per_rank": cfg.channels_per_rank,
                }
            if key == "mooncake" and ok:
                from transfer.backends.mooncake_backend import (
                    MooncakeBackend,
                    MooncakeBackendConfig,
                )

                mcfg = MooncakeBackendConfig(
                    zero_copy_host_sources=args.mooncake_source == "zero-copy",
                    host_buffer_bytes=plan.bytes + 64 * MiB,
                    heartbeat_interval_s=1.0,
                    heartbeat_timeout_s=60.0,
                    rpc_timeout_s=600.0,
                    transfer_timeout_s=120.0,
                )
                with MooncakeBackend(mcfg) as backend:
                    runs = timed(name, backend, seal=seal)
                    stats = backend.stats(f"{name}-{args.warmup + args.repeats - 1}")
                    assert all(s.sealed_digests == seal for s in stats.values()), stats
                report.update(backend_report(prefix, plan, runs, raw))
                report["mooncake_source"] = args.mooncake_source
                report["mooncake_descriptors_per_rank"] = {
                    str(r): s.descriptors for r, s in sorted(stats.items())
                }
                report["mooncake_batch_writes_per_rank"] = {
                    str(r): s.batch_writes for r, s in sorted(stats.items())
                }
        if raw is not None:
            if not raw.polled:  # no backend ran: time the raw writes on their own
                for _ in range(args.repeats):
                    raw.take()
            raw.writer.write_seconds()
            raw.writer.check()
    finally:
        decode.close()
        if raw is not None:
            raw.writer.close()

    if raw is not None:
        med = statistics.median(raw.polled)
        report["raw_seconds"] = raw.polled
        report["raw_mooncake_gbps"] = report["bytes"] / med / 1e9
        report["raw_sync_call_seconds"] = raw.sync_call
        report["raw_sync_call_gbps"] = report["bytes"] / statistics.median(raw.sync_call) / 1e9
        for name in (n.replace("-", "_") for n in BACKENDS):
            if report.get(f"{name}_gbps") is not None:
                report[f"{name}_ratio"] = report[f"{name}_gbps"] / report["raw_mooncake_gbps"]
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
