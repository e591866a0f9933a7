"""Ahead-of-time executables by shape (issue 25): each key compiles once per process, a
thread that needs a key being compiled waits for it, a failed compile is retried, and the
background compiler reports its progress."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpkv_jax.aot import BackgroundCompiler, CompileJob, ShapeCache, abstract


def _lowering(n: int, started: threading.Event | None = None, hold: float = 0.0):
    seed = float(np.random.default_rng(n).uniform())
    f = jax.jit(lambda x: jnp.sin(x) * seed)

    def lower():
        if started is not None:
            started.set()
        time.sleep(hold)  # a slow compile, so the second caller finds it in progress
        return f.lower(jax.ShapeDtypeStruct((n, 3), jnp.float32))

    return lower, seed


def test_a_key_compiles_once_and_a_concurrent_caller_waits():
    cache: ShapeCache[int] = ShapeCache("test")
    started = threading.Event()
    lower, seed = _lowering(4, started, hold=0.5)
    calls = []

    def counted():
        calls.append(1)
        return lower()

    got = {}
    t = threading.Thread(target=lambda: got.setdefault("a", cache.get(4, counted)))
    t.start()
    assert started.wait(10)
    got["b"] = cache.get(4, counted)  # in progress on the other thread: waits for it
    t.join(10)
    assert len(calls) == 1 and cache.waits == 1
    assert got["a"] is got["b"] and cache.compiled_keys() == {4} and 4 in cache
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(got["a"](x)), np.sin(x) * seed, rtol=1e-6)
    cache.clear()
    assert cache.compiled_keys() == set()


def test_a_failed_compile_reaches_the_caller_and_is_retried():
    cache: ShapeCache[str] = ShapeCache("test")

    def broken():
        raise RuntimeError("out of compile memory")

    with pytest.raises(RuntimeError, match="compile memory"):
        cache.get("k", broken)
    assert "k" not in cache
    lower, _ = _lowering(2)
    assert cache.get("k", lower) is not None and "k" in cache


def test_abstract_keeps_shapes_dtypes_and_shardings():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5)), jnp.bfloat16)
    (a,) = jax.tree.leaves(abstract({"x": x}))
    assert (a.shape, a.dtype, a.sharding) == (x.shape, x.dtype, x.sharding)


def test_background_compiler_runs_every_job_skips_failures_and_reports():
    cache: ShapeCache[int] = ShapeCache("test")
    jobs = [CompileJob(f"n={n}", lambda n=n: cache.get(n, _lowering(n)[0])) for n in (1, 2, 3)]
    jobs.insert(1, CompileJob("broken", lambda: 1 / 0))
    bg = BackgroundCompiler(jobs).start()
    assert bg.wait(60)
    bg.close()
    p = bg.progress()
    assert (p["programs"], p["compiled"], p["failed"], p["finished"]) == (4, 3, 1, True)
    assert cache.compiled_keys() == {1, 2, 3}
    assert BackgroundCompiler([]).start().wait(0)
