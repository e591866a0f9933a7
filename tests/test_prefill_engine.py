"""Prefill engine startup from ServerArgs: pools, cache, estimator, scheduler (SPEC S9.4)."""

from __future__ import annotations

import numpy as np
import pytest

from cpkv_jax.errors import ConfigError
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.model.weights import load_model
from cpkv_jax.tools.make_tiny_checkpoint import make_tiny_checkpoint
from serving.prefill_engine import build_prefill_engine
from serving.server_args import ServerArgs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("engine") / "tiny", "glm_moe_dsa")
    return path, load_model(path, progress=False)


def args_for(path, *extra: str) -> ServerArgs:
    base = ["--model-path", str(path), "--dtype", "float32", "--page-size", "16"]
    base += ["--cp-size", "8", "--enable-cp-shared-kv", "--chunked-prefill-size", "64"]
    return ServerArgs.from_cli([*base, *extra])


def test_engine_prefills_batches_and_matches_the_reference(tiny):
    path, (cfg, model) = tiny
    args = args_for(
        path,
        "--enable-cp-shared-kv-prefill-bs-gt1",
        "--cp-shared-kv-prefill-max-batch-requests",
        "4",
        "--cp-shared-kv-prefill-max-buffer-size",
        "64MiB",
        "--kv-pool-size",
        "1MiB",
        "--index-k-dtype",
        "float32",
    )
    engine = build_prefill_engine(args, model=model)
    assert engine.runner.layout.shared and engine.runner.layout.pages_per_rank > 2
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
    args = args_for(
        path,
        "--enable-cp-shared-kv-prefill-bs-gt1",
        "--cp-shared-kv-prefill-max-buffer-size",
        "1024TiB",
    )
    with pytest.raises(ConfigError, match="max-buffer-size .* does not fit on device"):
        build_prefill_engine(args, model=model)


def test_kv_pool_size_too_small_is_refused(tiny):
    path, (_, model) = tiny
    with pytest.raises(ConfigError, match="--kv-pool-size .* raise --kv-pool-size"):
        build_prefill_engine(args_for(path, "--kv-pool-size", "1KiB"), model=model)
