"""Where a test process's time goes inside JAX, per test module: tracing to jaxprs,
lowering to StableHLO and XLA compiling (persistent-cache reads included, with their
count), from JAX's monitoring events. A jit traced (or lowered) inside another's trace
is timed by both: each kind's seconds are the union of its spans on a thread, so nested
ones count once. `tests/conftest.py` prints the suite's totals and its heaviest modules
at the end of a run, so that suite-time work starts from figures. Servers the tests
start in subprocesses are not counted (their own processes); `serving.compile_events`
counts a server's own compiles by phase from the same events."""

from __future__ import annotations

import collections
import threading

from jax import monitoring

from serving.compile_events import BACKEND_COMPILE_EVENT, CACHE_HIT_EVENT

TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
KINDS = {TRACE: "trace", LOWER: "lower", BACKEND_COMPILE_EVENT: "compile"}
FIELDS = ("trace", "lower", "compile", "programs", "cache_hits")


class JaxTime:
    """Seconds per kind and program counts, keyed by the test module running when they
    happened (`module`, set by the conftest's hooks; "" outside tests)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.module = ""
        self.by_module: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter
        )
        # (thread, kind) -> the spans counted so far that a later one may contain: spans
        # on one thread nest or are disjoint, and an inner one ends first.
        self._spans: dict[tuple[int, str], list[tuple[float, float]]] = {}

    def on_span(self, event: str, start: float, end: float, **_: object) -> None:
        if (kind := KINDS.get(event)) is None:
            return
        with self._lock:
            spans = self._spans.setdefault((threading.get_ident(), kind), [])
            seconds = end - start
            while spans and spans[-1][0] >= start:  # nested inside this one: counted
                inner = spans.pop()
                seconds -= inner[1] - inner[0]
            spans.append((start, end))
            counts = self.by_module[self.module]
            counts[kind] += seconds
            counts["programs"] += kind == "compile"

    def on_event(self, event: str, **_: object) -> None:
        if event == CACHE_HIT_EVENT:
            with self._lock:
                self.by_module[self.module]["cache_hits"] += 1

    def as_dict(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {m: {f: c[f] for f in FIELDS} for m, c in self.by_module.items()}


def install() -> JaxTime:
    recorder = JaxTime()
    monitoring.register_event_time_span_listener(recorder.on_span)
    monitoring.register_event_listener(recorder.on_event)
    return recorder


def merge(parts: list[dict[str, dict[str, float]]]) -> dict[str, collections.Counter]:
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for part in parts:
        for module, counts in part.items():
            out[module].update(counts)
    return out


def report(by_module: dict[str, collections.Counter], top: int = 10) -> list[str]:
    """The summary lines: totals over every module, then the `top` modules by JAX time."""
    total: collections.Counter = collections.Counter()
    for counts in by_module.values():
        total.update(counts)

    def line(counts: collections.Counter) -> str:
        return (
            f"trace {counts['trace']:.0f} s, lower {counts['lower']:.0f} s, XLA compile "
            f"{counts['compile']:.0f} s ({counts['programs']:.0f} programs, "
            f"{counts['cache_hits']:.0f} from the persistent cache)"
        )

    lines = [f"JAX in the test processes (servers in subprocesses not counted): {line(total)}"]
    spent = sorted(
        by_module.items(), key=lambda kv: -(kv[1]["trace"] + kv[1]["lower"] + kv[1]["compile"])
    )
    for module, counts in spent[:top]:
        lines.append(f"  {module or '(outside tests)'}: {line(counts)}")
    return lines
