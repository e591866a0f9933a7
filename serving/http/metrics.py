"""Prometheus metrics of one HTTP server (`GET /metrics`).

`ServerMetrics` owns its own `CollectorRegistry`, so several servers in one process (tests,
an embedded router) never share or collide on series. Two kinds of series:

- observed by the HTTP layer per request (`RequestTimer`): time to first token,
  inter-token latency, end-to-end latency, requests by finish reason, prompt and
  generation tokens, bad requests. Latencies are measured from the moment the HTTP
  request arrived, so they include tokenization and queueing, as a client sees them;
- read at scrape time from the stats the engine thread last published
  (`EngineClient.stats()`, see `attach_stats`):
  queue length, time spent in the wait queue (a summary: `_sum` / `_count`) and
  requests refused by a full queue, running requests, KV pages used / total / held by
  the prefix cache per rank, PD transfer bytes, seconds and failures, admission
  rejections per gate. These are the engine's own cumulative
  counts, reported as-is (no double counting across scrapes);
- read from a prefill server's host (L2) KV cache at scrape time (`attach_hicache`, the
  `PrefillEngine.hicache_info` dict): host hit tokens, load-backs (count, failures,
  bytes, seconds), backups (done, failed, bytes, seconds), dropped backups by reason
  (`queue_full`: the backup queue; `host_full`: no host pages), skipped load-backs,
  the backup queue depth and host pool pages used / total per owner lane;
- XLA compiles of this process by phase (`attach_compiles`): `startup` (warm-up
  included) and `serving` (after the server became healthy: shapes a request reached
  first), with their seconds and persistent-cache hits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from serving.engine.api import EngineStats

logger = logging.getLogger(__name__)

# Seconds. TTFT spans a queued long-context prefill; ITL a single decode step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Tokens per verify step: 1 (nothing accepted) to K + 1 (K <= MAX_SPECULATIVE_STEPS = 8).
SPEC_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 9.0)


class _EngineStatsCollector(Collector):
    """Emits the engine-side series from one `stats()` call per scrape."""

    def __init__(self) -> None:
        self.source: Callable[[], EngineStats] | None = None

    def describe(self) -> Iterator[Metric]:
        # Nothing to pre-register: the registry must not call stats() at registration.
        return iter(())

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        try:
            stats = self.source()
        except Exception:  # a scrape must not fail because the engine is in trouble
            logger.exception("EngineClient.stats() failed; engine series omitted")
            return
        queue = GaugeMetricFamily("cpkv_queue_length", "Requests queued, not yet started.")
        queue.add_metric([], stats.waiting)
        q = stats.queue
        wait = SummaryMetricFamily(
            "cpkv_queue_wait_seconds",
            "Time requests waited in the wait queue before they started.",
            count_value=q.waits,
            sum_value=q.wait_seconds,
        )
        full = CounterMetricFamily(
            "cpkv_queue_full_rejections",
            "Requests refused with 503 because the wait queue was full.",
        )
        full.add_metric([], q.rejected)
        limit = GaugeMetricFamily(
            "cpkv_queue_limit", "Requests the wait queue holds (--max-queued-requests; -1: none)."
        )
        limit.add_metric([], -1 if q.limit is None else q.limit)
        running = GaugeMetricFamily("cpkv_running_requests", "Requests being served.")
        running.add_metric([], stats.running)
        used = GaugeMetricFamily(
            "cpkv_kv_pages_used", "KV cache pages in use, per rank.", labels=["rank"]
        )
        total = GaugeMetricFamily(
            "cpkv_kv_pages_total", "KV cache pages in the pool, per rank.", labels=["rank"]
        )
        cached = GaugeMetricFamily(
            "cpkv_kv_pages_cached",
            "KV cache pages the prefix cache holds, per rank.",
            labels=["rank"],
        )
        for rank, (n_total, n_free) in enumerate(
            zip(stats.kv_pages_total, stats.kv_pages_free, strict=True)
        ):
            used.add_metric([str(rank)], n_total - n_free)
            total.add_metric([str(rank)], n_total)
        for rank, n in enumerate(stats.kv_pages_cached):
            cached.add_metric([str(rank)], n)
        rank_running = GaugeMetricFamily(
            "cpkv_rank_running_requests",
            "Requests holding a data-parallel rank's pages (running or receiving KV).",
            labels=["rank"],
        )
        for rank, n in enumerate(stats.running_per_rank):
            rank_running.add_metric([str(rank)], n)
        t_bytes = CounterMetricFamily(
            "cpkv_transfer_bytes", "Bytes sent or received over PD KV transfer."
        )
        t_bytes.add_metric([], stats.transfer_bytes)
        t_secs = CounterMetricFamily(
            "cpkv_transfer_seconds", "Summed wall time of PD KV transfers (start to outcome)."
        )
        t_secs.add_metric([], stats.transfer_seconds)
        t_fail = CounterMetricFamily("cpkv_transfer_failures", "PD KV transfers that failed.")
        t_fail.add_metric([], stats.transfer_failures)
        rejections = CounterMetricFamily(
            "cpkv_admission_rejections",
            "Times a request was held back by an admission gate.",
            labels=["gate"],
        )
        for gate, n in sorted(stats.admission_rejections.items()):
            rejections.add_metric([gate], n)
        steps = SummaryMetricFamily(
            "cpkv_decode_step_seconds",
            "Decode steps and their device time, by kind: decode (plain) or verify_draft "
            "(speculative: the verify and the next drafts are one program).",
            labels=["kind"],
        )
        for kind, (n, seconds) in sorted(stats.decode_step_seconds.items()):
            steps.add_metric([kind], count_value=n, sum_value=seconds)
        yield from (queue, wait, full, limit, running, used, total, cached, rank_running)
        yield from (t_bytes, t_secs, t_fail, rejections, steps)


# `PrefillEngine.hicache_info` counter keys -> (series name, help).
_HICACHE_COUNTERS = (
    ("host_hit_tokens", "cpkv_hicache_host_hit_tokens", "Prompt tokens loaded back from host."),
    ("load_backs", "cpkv_hicache_load_backs", "Host -> device load-backs that completed."),
    ("load_back_failures", "cpkv_hicache_load_back_failures", "Load-backs whose copy failed."),
    ("load_back_bytes", "cpkv_hicache_load_back_bytes", "Bytes loaded back host -> device."),
    ("load_back_seconds", "cpkv_hicache_load_back_seconds", "Wall time of the load-backs."),
    (
        "skipped_load_backs",
        "cpkv_hicache_skipped_load_backs",
        "Host hits not loaded back (no device room, SPEC S10): recomputed.",
    ),
    ("backups_done", "cpkv_hicache_backups", "Device -> host backups that completed."),
    ("backups_failed", "cpkv_hicache_backup_failures", "Backups whose copy failed."),
    ("backup_bytes", "cpkv_hicache_backup_bytes", "Bytes backed up device -> host."),
    ("backup_seconds", "cpkv_hicache_backup_seconds", "Wall time of the backups (worker)."),
)


class _HostCacheCollector(Collector):
    """Emits the `cpkv_hicache_*` series from one host-cache info dict per scrape."""

    def __init__(self, source: Callable[[], dict | None]) -> None:
        self.source = source

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        try:
            info = self.source()
        except Exception:
            logger.exception("host cache info failed; cpkv_hicache_* series omitted")
            return
        if info is None:
            return
        for key, name, text in _HICACHE_COUNTERS:
            c = CounterMetricFamily(name, text)
            c.add_metric([], info[key])
            yield c
        dropped = CounterMetricFamily(
            "cpkv_hicache_dropped_backups",
            "Backups not made: the backup queue was full, or no host page was free.",
            labels=["reason"],
        )
        dropped.add_metric(["queue_full"], info["dropped_backups"])
        dropped.add_metric(["host_full"], info.get("cache_dropped_backups", 0))
        depth = GaugeMetricFamily("cpkv_hicache_backup_queue_depth", "Backups waiting to copy.")
        depth.add_metric([], info["backup_queue_depth"])
        used = GaugeMetricFamily(
            "cpkv_hicache_host_pages_used",
            "Host cache pages in use, per owner lane (a rank with shared KV).",
            labels=["lane"],
        )
        total = GaugeMetricFamily(
            "cpkv_hicache_host_pages_total",
            "Usable host cache pages, per owner lane.",
            labels=["lane"],
        )
        for lane, (n_used, n_total) in enumerate(
            zip(info["host_pages_used_per_lane"], info["host_pages_total_per_lane"], strict=True)
        ):
            used.add_metric([str(lane)], n_used)
            total.add_metric([str(lane)], n_total)
        yield from (dropped, depth, used, total)


class _CompileCollector(Collector):
    """`cpkv_xla_compile*` from a `serving.compile_events.CompileCounter.snapshot`."""

    def __init__(self, source: Callable[[], dict[str, dict[str, float]]]) -> None:
        self.source = source

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        snap = self.source()
        series = (
            ("compiles", "cpkv_xla_compiles", "XLA compiles (startup, serving, background)."),
            ("seconds", "cpkv_xla_compile_seconds", "Seconds spent in XLA compiles."),
            ("cache_hits", "cpkv_xla_compile_cache_hits", "Compiles the persistent cache served."),
        )
        for key, name, help_ in series:
            family = CounterMetricFamily(name, help_, labels=["phase"])
            for phase, counts in snap.items():
                family.add_metric([phase], counts[key])
            yield family


class ServerMetrics:
    """The metrics of one server, in their own registry. Thread-safe (prometheus_client)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.ttft = Histogram(
            "cpkv_time_to_first_token_seconds",
            "From HTTP request arrival to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "cpkv_inter_token_latency_seconds",
            "Time between consecutive generated tokens (a chunk's gap split over its tokens).",
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "cpkv_e2e_request_latency_seconds",
            "From HTTP request arrival to the last token.",
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.spec_accept_length = Histogram(
            "cpkv_spec_accept_length",
            "Speculative decoding: tokens each verify step of a finished request emitted, "
            "on average (accepted drafts + 1; --speculative-algorithm).",
            buckets=SPEC_ACCEPT_BUCKETS,
            registry=reg,
        )
        self.requests = Counter(
            "cpkv_requests",
            "Finished requests by finish reason (stop, length, abort, error).",
            labelnames=["finish_reason"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "cpkv_prompt_tokens", "Prompt tokens of finished requests.", registry=reg
        )
        self.generation_tokens = Counter(
            "cpkv_generation_tokens",
            "Tokens generated (including aborted requests').",
            registry=reg,
        )
        self.bad_requests = Counter(
            "cpkv_http_bad_requests",
            "HTTP requests answered with a 4xx status.",
            registry=reg,
        )
        self._engine = _EngineStatsCollector()
        reg.register(self._engine)

    def attach_stats(self, source: Callable[[], EngineStats]) -> None:
        """Read engine gauges from `source` (normally `EngineClient.stats`) at scrape time."""
        self._engine.source = source

    def attach_hicache(self, source: Callable[[], dict | None]) -> None:
        """Emit the `cpkv_hicache_*` series from `source` (a prefill server's
        `PrefillEngine.hicache_info`) at scrape time."""
        self.registry.register(_HostCacheCollector(source))

    def attach_compiles(self, source: Callable[[], dict[str, dict[str, float]]]) -> None:
        """Emit `cpkv_xla_compile*` from `source` (`COMPILES.snapshot`) at scrape time."""
        self.registry.register(_CompileCollector(source))

    def record_bad_request(self) -> None:
        self.bad_requests.inc()

    def start_request(self, arrival: float | None = None) -> RequestTimer:
        """A timer for one request; `arrival` is a `time.monotonic()` value (default now)."""
        return RequestTimer(self, time.monotonic() if arrival is None else arrival)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Per-request observations: call `on_tokens` per output chunk, `finish` once."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self._m = metrics
        self.arrival = arrival
        self.first_token_at: float | None = None
        self._last_token_at: float | None = None
        self.completion_tokens = 0
        self._finished = False

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    def on_tokens(self, n: int, now: float | None = None) -> None:
        """`n` tokens arrived together: the first one gives TTFT, later chunks give ITL."""
        if n <= 0:
            return
        now = time.monotonic() if now is None else now
        self.completion_tokens += n
        self._m.generation_tokens.inc(n)
        if self._last_token_at is None:
            self.first_token_at = now
            self._m.ttft.observe(now - self.arrival)
            remaining = n - 1  # tokens after the first in the same chunk
            gap = 0.0
        else:
            remaining = n
            gap = now - self._last_token_at
        for _ in range(remaining):
            self._m.itl.observe(gap / max(remaining, 1))
        self._last_token_at = now

    def finish(
        self,
        finish_reason: str,
        prompt_tokens: int,
        now: float | None = None,
        spec_accept_length: float | None = None,
    ) -> float:
        """Record the request's end once; returns its end-to-end latency in seconds."""
        now = time.monotonic() if now is None else now
        e2e = now - self.arrival
        if not self._finished:
            self._finished = True
            self._m.e2e.observe(e2e)
            if spec_accept_length is not None:
                self._m.spec_accept_length.observe(spec_accept_length)
            self._m.requests.labels(finish_reason=finish_reason).inc()
            self._m.prompt_tokens.inc(prompt_tokens)
        return e2e
