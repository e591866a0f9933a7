"""Prefill engine startup from ServerArgs: pools, cache, estimator, scheduler (SPEC S9.4)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from cpkv_jax import cp_prefill
from cpkv_jax.errors import ConfigError
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.model.weights import load_model
from serving.prefill import build as prefill_build
from serving.prefill.build import build_prefill_engine
from serving.server_args import ServerArgs

# Among the longer files of the suite: scheduled early, longest first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=23)  # on 2 workers, 2026-12-05


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    path = tiny_checkpoints("glm_moe_dsa")
    return path, load_model(path, progress=False)


def args_for(path, *extra: str) -> ServerArgs:
    base = ["--model-path", str(path), "--dtype", "float32", "--page-size", "16"]
    base += ["--disaggregation-mode", "prefill", "--cp-size", "8", "--enable-cp-shared-kv"]
    base += ["--chunked-prefill-size", "64"]
    return ServerArgs.from_cli([*base, *extra])


def bs_gt1_args(path, buffer: str | None, *extra: str) -> ServerArgs:
    """CP shared-KV batches of several requests (SPEC S5), with the S9 buffer limit
    `buffer` when given."""
    limit = ["--cp-shared-kv-prefill-max-buffer-size", buffer] if buffer else []
    return args_for(path, "--enable-cp-shared-kv-prefill-bs-gt1", *limit, *extra)


@pytest.mark.parametrize("attention", ["full-view", "owner"])
def test_engine_prefills_batches_and_matches_the_reference(tiny, attention):
    """Both `--cp-attention` modes (owner: issue 40, its admission estimate included)."""
    path, (cfg, model) = tiny
    args = bs_gt1_args(
        path,
        "64MiB",
        "--cp-shared-kv-prefill-max-batch-requests",
        "4",
        "--kv-pool-size",
        "1MiB",
        "--index-k-dtype",
        "float32",
        "--cp-attention",
        attention,
    )
    engine = build_prefill_engine(args, model=model)
    assert engine.runner.layout.shared and engine.runner.layout.pages_per_rank > 2
    assert engine.runner.cp.attention == attention
    assert engine.scheduler.estimator.attention == attention
    prompts = {
        f"r{i}": np.random.default_rng(i).integers(3, 300, n).astype(np.int32)
        for i, n in enumerate((40, 75, 9))
    }
    for rid, p in prompts.items():
        engine.scheduler.submit(rid, p)
    out = {o.rid: o for o in engine.scheduler.run_until_idle()}
    assert set(out) == set(prompts) and max(engine.scheduler.batch_sizes) > 1
    ref = ReferenceGenerator(cfg, model, page_size=16, index_k_dtype="float32")
    for rid, p in prompts.items():
        r = ref.generate([int(t) for t in p], 1, ignore_eos=True)
        logits = out[rid].last_logits
        assert int(np.argmax(logits)) == r.output_ids[0]
        logprob = (
            logits[r.output_ids[0]] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        )
        np.testing.assert_allclose(logprob, r.output_logprobs[0], atol=1e-5)


def test_s9_4_startup_fails_cleanly_when_the_buffer_limit_does_not_fit(tiny):
    path, (_, model) = tiny
    args = bs_gt1_args(path, "1024TiB")
    with pytest.raises(ConfigError, match="max-buffer-size .* does not fit on device"):
        build_prefill_engine(args, model=model)


def test_s9_4_smoke_allocation_runs_beside_the_placed_weights_and_pools(tiny, monkeypatch):
    """The limit must fit next to what the server keeps resident: when the smoke runs,
    every weight and pool leaf is already on the devices."""
    path, (_, model) = tiny
    seen: list[set[int]] = []

    def record(max_bytes, devices):
        seen.append({id(a) for a in jax.live_arrays()})

    monkeypatch.setattr(prefill_build, "startup_smoke_allocation", record)
    args = bs_gt1_args(path, "1MiB")
    runner = build_prefill_engine(args, model=model).runner
    (live,) = seen
    resident = jax.tree.leaves((runner.state, runner.pool))
    assert resident and all(id(leaf) in live for leaf in resident)


def test_s1_7_debug_checks_cover_served_requests(tiny, monkeypatch):
    """`CPKV_DEBUG_SHARED_KV=1` checks every step the scheduler dispatches (batched and
    prefix-cached requests too), not only `CPPrefillRunner.prefill`."""
    path, (_, model) = tiny
    monkeypatch.setenv("CPKV_DEBUG_SHARED_KV", "1")
    checked: list[int] = []
    real = cp_prefill.check_step

    def counting(runner, shadow, plan, logits):
        real(runner, shadow, plan, logits)
        checked.append(int(plan.valid.sum()))

    monkeypatch.setattr(cp_prefill, "check_step", counting)
    args = bs_gt1_args(path, None, "--kv-pool-size", "1MiB")
    engine = build_prefill_engine(args, model=model)
    rng = np.random.default_rng()
    shared_prefix = rng.integers(3, 300, 32).astype(np.int32)
    prompts = {
        "a": rng.integers(3, 300, 40).astype(np.int32),
        "b": np.concatenate([shared_prefix, rng.integers(3, 300, 20).astype(np.int32)]),
    }
    for rid, p in prompts.items():
        engine.scheduler.submit(rid, p)
    assert {o.rid for o in engine.scheduler.run_until_idle()} == set(prompts)
    # Same prefix again: served from the radix cache, the rest checked against the shadow.
    engine.scheduler.submit("c", np.concatenate([shared_prefix, prompts["a"][:9]]))
    (out,) = engine.scheduler.run_until_idle()
    assert out.rid == "c" and out.cached_tokens >= 32
    assert sum(checked) == 40 + 52 + 41 - out.cached_tokens


def test_kv_pool_size_too_small_is_refused(tiny):
    path, (_, model) = tiny
    with pytest.raises(ConfigError, match="--kv-pool-size .* raise --kv-pool-size"):
        build_prefill_engine(args_for(path, "--kv-pool-size", "1KiB"), model=model)
