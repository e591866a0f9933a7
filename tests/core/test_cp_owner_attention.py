"""CP8 prefill with owner attention (`CPConfig(attention="owner")`, issue 40 item 2)
against the single-device reference and the full-view CP path, on the FP8 tiny
checkpoints of both architectures with their experts split over the ranks (EP8).

Tolerances: owner attention merges `cp` partial softmaxes by log-sum-exp where the
full-view path runs one softmax, and scores the indexer on rank-sized key sets, so
values agree to float32 rounding, not bits (`tests/core/test_owner_attention.py` pins
the selection itself down exactly). Logits are compared at rtol / atol 1e-5 as the CP
tests do, greedy tokens exactly, and the KV the step wrote (every layer's latent and
index K, read back as full views) at atol 1e-5: each layer's KV comes from the previous
layer's attention output, so a rounding difference would show there first.
"""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest
from support.cp_reference import P, reference

from cpkv_jax.config import CPConfig
from cpkv_jax.cp_prefill import CPPrefillRunner, pages_per_rank_for
from cpkv_jax.errors import ConfigError, InputError
from cpkv_jax.mesh import CP_AXIS, make_cp_mesh
from cpkv_jax.model import expert_parallel as ep
from cpkv_jax.model.weights import load_model

pytestmark = pytest.mark.slow(seconds=60)

CP = 8
EXPERTS = 16
CHUNK = 40
LENGTHS = (33 * P + 5, 7 * P + 3)  # index_topk 16: the selection is sparse


def _runner(cfg, model, attention, *, tokens=2 * (LENGTHS[0] + LENGTHS[1]), invariant=False):
    cp = CPConfig(cp_size=CP, shared_kv=True, page_size=P, attention=attention)
    return CPPrefillRunner(
        cfg,
        model,
        make_cp_mesh(CP),
        cp,
        pages_per_rank=pages_per_rank_for(tokens, P, cp, requests=2),
        index_k_dtype="float32",
        batch_invariant=invariant,
        expert_parallel=ep.EPSpec(CP_AXIS, CP, "allgather", None),
    )


def _load(arch, tiny_checkpoints):
    path = tiny_checkpoints(arch, fp8=True, n_routed_experts=EXPERTS)
    cfg, single = load_model(path, progress=False)
    _, placed = load_model(path, progress=False, mesh=make_cp_mesh(CP), expert_axis=CP_AXIS)
    return cfg, single, placed


@pytest.fixture(scope="module", params=["glm_moe_dsa", "deepseek_v32"])
def models(request, tiny_checkpoints):
    return _load(request.param, tiny_checkpoints)


@pytest.fixture(scope="module")
def glm(tiny_checkpoints):
    return _load("glm_moe_dsa", tiny_checkpoints)


def _prompts():
    rng = np.random.default_rng(4)
    return [rng.integers(3, 300, n).astype(np.int32) for n in LENGTHS]


def _views(runner, tables):
    out = [jax.tree.map(np.asarray, runner.full_view(t)) for t in tables]
    for t in tables:
        runner.release(t)
    return out


def test_owner_attention_chunked_batched_equals_the_reference(models):
    """Two prompts in one batch, 40-token chunks (the later chunks select over KV the
    earlier ones wrote, on every rank), against one-device prefill of each prompt."""
    cfg, single, placed = models
    prompts = _prompts()
    runner = _runner(cfg, placed, "owner")
    free = runner.allocator.num_free_per_lane().copy()
    got = runner.prefill(prompts, CHUNK)
    views = _views(runner, got.tables)
    f32 = lambda tree: jax.tree.map(lambda x: np.asarray(x, np.float32), tree)
    for i, ids in enumerate(prompts):
        want, want_view = reference(cfg, single, ids)
        chex.assert_trees_all_close(got.last_logits[i], want, rtol=1e-5, atol=1e-5)
        assert int(np.argmax(got.last_logits[i])) == int(np.argmax(want))
        chex.assert_trees_all_close(f32(views[i]), f32(want_view), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(runner.allocator.num_free_per_lane(), free)


def test_owner_attention_with_batch_invariant_numerics(glm):
    """Batch-invariant numerics: still a tolerance (the log-sum-exp merge), not bits."""
    cfg, single, placed = glm
    ids = _prompts()[1]
    runner = _runner(cfg, placed, "owner", invariant=True)
    got = runner.prefill([ids]).last_logits[0]
    want, _ = reference(cfg, single, ids, invariant=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert int(np.argmax(got)) == int(np.argmax(want))


def test_owner_attention_refusals(glm):
    cfg, _, placed = glm
    with pytest.raises(ConfigError, match="shared_kv"):
        CPConfig(cp_size=CP, shared_kv=False, page_size=P, attention="owner").validate()
    cp = CPConfig(cp_size=CP, shared_kv=True, page_size=P, attention="owner")
    with pytest.raises(InputError, match="full-view attention"):
        CPPrefillRunner(cfg, placed, make_cp_mesh(CP), cp, pages_per_rank=8, debug=True)
