"""XLA compile counting (issue 25): JAX's monitoring events split at the moment a server
became healthy, so compiles a request paid for are visible (`/server_info`
`xla_compiles`, `/metrics` `cpkv_xla_compiles_total{phase="serving"}`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from serving.compile_events import (
    BACKEND_COMPILE_EVENT,
    CACHE_HIT_EVENT,
    COMPILES,
    CompileCounter,
)
from serving.http.metrics import ServerMetrics


def test_counts_split_at_healthy():
    c = CompileCounter()
    secs = np.random.default_rng(0).uniform(0.01, 2.0, 5)
    for s in secs[:3]:
        c.on_duration(BACKEND_COMPILE_EVENT, float(s))
    c.on_duration("/jax/core/compile/jaxpr_trace_duration", 9.0)  # not a compile
    c.on_event(CACHE_HIT_EVENT)
    c.mark_healthy()
    for s in secs[3:]:
        c.on_duration(BACKEND_COMPILE_EVENT, float(s))
    snap = c.snapshot()
    assert snap["startup"]["compiles"] == 3 and snap["startup"]["cache_hits"] == 1
    assert np.isclose(snap["startup"]["seconds"], secs[:3].sum())
    assert snap["serving"]["compiles"] == 2 and snap["serving"]["cache_hits"] == 0
    assert np.isclose(snap["serving"]["seconds"], secs[3:].sum())


def test_real_jit_compiles_are_counted_once_and_exported():
    COMPILES.mark_healthy()
    before = COMPILES.snapshot()["serving"]["compiles"]
    seed = float(np.random.default_rng(1).uniform())
    f = jax.jit(lambda x: jnp.cos(x) * seed)
    x = jnp.ones((3, 5))
    f(x).block_until_ready()
    once = COMPILES.snapshot()["serving"]["compiles"]
    assert once > before
    f(x).block_until_ready()  # in jit's cache: no compile
    assert COMPILES.snapshot()["serving"]["compiles"] == once
    metrics = ServerMetrics()
    metrics.attach_compiles(COMPILES.snapshot)
    text = metrics.render()[0].decode()
    got = {
        (s.name, s.labels.get("phase")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert got[("cpkv_xla_compiles_total", "serving")] == once
