"""Helpers shared by the PD prefill server tests (tests/serving/test_prefill_*.py and
their neighbours):

- the host-only schedulers with a closed-form executor, and the free and evictable
  counts of a non-holding run (the oracle for "after the holds are released");
- the tiny checkpoint's server arguments;
- transfer backends that stand in for or wrap the real one: `InstantBackend` (nothing
  sent), `GatedBackend` (records the jobs, holds senders at a gate);
- the senders' short-timeout gRPC config (`fast_grpc_sender`) and a decode receiver
  served on loopback (`loopback_receiver`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from cpkv_jax.cache.radix import RadixCache
from cpkv_jax.config import ModelConfig
from cpkv_jax.lane_allocator import OwnerLaneAllocator
from cpkv_jax.model.kv_cache import init_pool
from cpkv_jax.paging import PageAllocator, owner_of_page
from serving.engine.api import GenerateRequest, OutputChunk, SamplingParams
from serving.prefill.engine import PrefillModeEngine
from serving.prefill.scheduler import PrefillScheduler, StepRow
from serving.server_args import ServerArgs
from transfer.backends.grpc_backend import GrpcBackendConfig
from transfer.capabilities import BackendCapabilities, default_backend_registry
from transfer.hold import TransferHold
from transfer.page_plan import LayoutDescriptor
from transfer.protocol import RoomSnapshot, RoomState, TransferTimeouts
from transfer.receiver import Receiver, ReceiverServer, serve
from transfer.sender import RankJob, TransferBackend

P = 16
CP = 8
HP = 4  # page size of the host-only tests
HCP = 2
WAIT_S = 60.0  # default bound on a backend's wait; never reached when green


class ZeroExecutor:
    """Closed-form logits (one-hot at the prompt sum mod vocab); checks the tables."""

    def execute(self, rows: Sequence[StepRow]) -> np.ndarray:
        out = np.zeros((len(rows), 97), np.float32)
        for i, r in enumerate(rows):
            assert r.table.num_tokens == r.start + r.length
            out[i, int(r.prompt.astype(np.int64).sum()) % 97] = 1.0
        return out


def host_scheduler(hold: bool, pages_per_lane: int = 32, page: int = HP, cp: int = HCP):
    alloc = OwnerLaneAllocator(cp, pages_per_lane)
    cache = RadixCache(alloc, page)
    sched = PrefillScheduler(
        cache=cache, executor=ZeroExecutor(), max_prefill_tokens=10_000, hold_finished=hold
    )
    return sched, cache, alloc


def no_transfer_counts(
    prompts: Sequence[np.ndarray], cp: int, pages_per_lane: int, page: int
) -> tuple[np.ndarray, np.ndarray]:
    """(free, evictable) per lane after a non-holding scheduler prefilled `prompts`.

    The oracle for "after the holds are released": what the cache keeps depends only on
    the set of whole-page prefixes, not on batching or order.
    """
    sched, cache, alloc = host_scheduler(False, pages_per_lane, page, cp)
    for i, p in enumerate(prompts):
        sched.submit(f"oracle-{i}", p)
    sched.run_until_idle()
    cache.check_invariants()
    return alloc.num_free_per_lane(), cache.evictable_pages_per_lane()


def lane_counts(n_pages: int, cp: int) -> np.ndarray:
    return np.bincount(owner_of_page(np.arange(n_pages), cp), minlength=cp).astype(np.int64)


def float32_args(path, *extra: str) -> ServerArgs:
    """Flags of a float32 server of the tiny checkpoint at `path` (page `P`), plus `extra`
    (a unified server unless `extra` names a mode)."""
    return ServerArgs.from_cli(
        [
            "--model-path",
            str(path),
            "--dtype",
            "float32",
            "--index-k-dtype",
            "float32",
            "--page-size",
            str(P),
            *extra,
        ]
    )


def server_args(path, *extra: str) -> ServerArgs:
    return float32_args(
        path,
        *[
            "--cp-size",
            str(CP),
            "--enable-cp-shared-kv",
            "--enable-cp-shared-kv-prefill-bs-gt1",
            "--kv-pool-size",
            "1MiB",
            "--disaggregation-mode",
            "prefill",
            "--transfer-backend",
            "grpc",
            *extra,
        ],
    )


# ---- transfer backends and the decode side -------------------------------------------------


class InstantBackend(TransferBackend):
    """Every rank is ready at once; the room succeeds as soon as the prefill hands over
    its pages (nothing is sent), and fails when the hold is cancelled (or no pages came
    within `wait_s`)."""

    capabilities: ClassVar[BackendCapabilities] = default_backend_registry().get("grpc")

    def __init__(self, wait_s: float = WAIT_S):
        self.wait_s = wait_s

    def send_rank(self, job: RankJob, hold: TransferHold) -> RoomSnapshot:
        hold.mark_ready(job.rank)
        woke = threading.Event()
        hold.add_waker(woke)
        woke.wait(self.wait_s)
        if hold.inputs is None or hold.cancelled:
            return RoomSnapshot(job.room, RoomState.FAILED, hold.cancel_reason or "no inputs")
        return RoomSnapshot(job.room, RoomState.SUCCESS, aux=hold.inputs.aux)


class GatedBackend(TransferBackend):
    """Wraps a backend: records each rank's job and hold, and holds senders until `gate`
    is set (or the hold is cancelled, or `wait_s` passed), so a test sees a transfer in
    flight. The gate starts open: a pass-through that records."""

    capabilities: ClassVar[BackendCapabilities] = default_backend_registry().get("grpc")

    def __init__(self, inner: TransferBackend, wait_s: float = WAIT_S):
        self.inner = inner
        self.wait_s = wait_s
        self.gate = threading.Event()
        self.gate.set()
        self.jobs: dict[tuple[str, int], RankJob] = {}
        self.holds: dict[str, TransferHold] = {}
        self._lock = threading.Lock()

    def send_rank(self, job: RankJob, hold: TransferHold):
        with self._lock:
            self.jobs[(job.room, job.rank)] = job
            self.holds[job.room] = hold
        if not self.gate.is_set():
            # The engine prefills once every rank says it handshook; these tests open the
            # rooms themselves, so a gated rank says so at once and the prefill runs while
            # its transfer is held here (the real handshake follows when the gate opens).
            hold.mark_ready(job.rank)
        deadline = time.monotonic() + self.wait_s
        while not self.gate.wait(0.01) and not hold.cancelled and time.monotonic() < deadline:
            pass
        return self.inner.send_rank(job, hold)

    def started(self) -> set[str]:
        """The rooms whose senders started."""
        with self._lock:
            return {room for room, _ in self.jobs}


def fast_grpc_sender(bootstrap_timeout_s: float) -> GrpcBackendConfig:
    """gRPC senders with fast beats, a 5 s loss deadline and quick retries, giving up
    after `bootstrap_timeout_s` without any answer from the decode side."""
    return GrpcBackendConfig(
        chunk_bytes=64 * 1024,
        max_retries=2,
        retry_backoff_s=0.02,
        rpc_timeout_s=10.0,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=5.0,
        bootstrap_timeout_s=bootstrap_timeout_s,
    )


def loopback_receiver(
    layout: LayoutDescriptor,
    cfg: ModelConfig,
    pages: int,
    timeouts: TransferTimeouts,
    **receiver_kw: Any,
) -> tuple[Receiver, ReceiverServer, str]:
    """A started decode `Receiver` with a float32 pool of `pages` pages laid out as
    `layout`, served over gRPC on loopback: `(rx, server, target)`. The caller stops
    both: `server.stop(0)`, then `rx.close()`."""
    rx = Receiver(
        layout,
        init_pool(cfg, pages, layout.page_size, jnp.float32, "float32"),
        PageAllocator(pages),
        timeouts=timeouts,
        **receiver_kw,
    ).start(interval=0.02)
    try:
        server, port = serve(rx)
    except BaseException:
        rx.close()
        raise
    return rx, server, f"127.0.0.1:{port}"


# ---- the PD prefill engine tests' requests, rooms and stepping -----------------------------

PD_WAIT_S = 120.0  # bound on one request of those tests (first compiles included)
# Decode side: rooms are registered before the prefill steps and the gated senders
# handshake only after them, so bootstrap and waiting cover a step's first compile
# (over 30 s for the batch-invariant CP step with two test workers on 2 cores);
# heartbeats are short.
ROOM_WAIT_S = 180.0
TIMEOUTS = TransferTimeouts(
    bootstrap=ROOM_WAIT_S, waiting=ROOM_WAIT_S, heartbeat=2.0, heartbeat_interval=0.1
)
SENDER = fast_grpc_sender(bootstrap_timeout_s=1.5)  # "nobody listens" fails after this


def request(rid: str, prompt: np.ndarray, room: str, target: str, **kw) -> GenerateRequest:
    """A PD request of 4 greedy tokens with log-probs, for `room` at `target`."""
    return GenerateRequest(
        rid,
        tuple(int(t) for t in prompt),
        SamplingParams(max_new_tokens=4),
        return_logprob=True,
        bootstrap_room=room,
        decode_transfer_target=target,
        **kw,
    )


def drive(engine: PrefillModeEngine, rids: Sequence[str]) -> dict[str, OutputChunk]:
    """Step until every rid has its (single, final) chunk."""
    got: dict[str, OutputChunk] = {}
    deadline = time.monotonic() + PD_WAIT_S
    while set(got) != set(rids):
        assert time.monotonic() < deadline, f"no final chunk for {set(rids) - set(got)}"
        for c in engine.step():
            assert c.finished and c.rid in rids and c.rid not in got, c
            got[c.rid] = c
    return got
