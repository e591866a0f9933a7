"""Owner attention in CP prefill (`--cp-attention owner`, issue 40 item 2) and CP decode
(item 3, `cpkv_jax.cp_decode`): prefill and decode on one CP8 mesh from the same
page-owned pools, against single-device generation.

The FP8 tiny checkpoints, experts split over the 8 ranks (EP8): DeepSeek-V3.2's
generation here, GLM-5's for the batch-invariant prefill and the refusals (its CP decode
runs end to end behind both servers, tests/serving/test_unified_cp.py and
test_pd_cp_decode.py).
Greedy tokens must equal `ReferenceGenerator`'s exactly; log-probs agree within 1e-5
(the CP prefill tolerance: rank-sized matmuls round differently in the last bits, and
owner attention merges partial softmaxes by log-sum-exp, so not bits even under
batch-invariant numerics; the decoder then puts each row's full view together on its
rank instead, and its generation is one device's bit for bit). The generation's
prefill is the owner-attention prefill, chunked and batched, so its first token and
log-prob check it, and every later token checks the KV it wrote
(`tests/core/test_owner_attention.py` pins the selection down exactly).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.cp_reference import P, reference
from support.hlo import collectives, vocab_wide_collectives

from cpkv_jax.config import CPConfig
from cpkv_jax.cp_decode import CPDecoder, decode_bytes_per_rank
from cpkv_jax.cp_prefill import CPPrefillRunner, pages_per_rank_for
from cpkv_jax.errors import CacheCapacityError, ConfigError, InputError
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.lane_allocator import RequestPageTable
from cpkv_jax.mesh import CP_AXIS, make_cp_mesh
from cpkv_jax.model import expert_parallel as ep
from cpkv_jax.model.weights import load_model
from cpkv_jax.owner_attention import OwnerCPKVIO

pytestmark = pytest.mark.slow(seconds=60)

CP = 8
EXPERTS = 16
NEW = 6
LONG = 33 * P + 5  # index_topk 16 of 533+ positions: the selection is sparse


def _runner(cfg, placed, pages_per_rank, *, invariant=False, attention="owner"):
    cp = CPConfig(cp_size=CP, shared_kv=True, page_size=P, attention=attention)
    return CPPrefillRunner(
        cfg,
        placed,
        make_cp_mesh(CP),
        cp,
        pages_per_rank=pages_per_rank,
        index_k_dtype="float32",
        batch_invariant=invariant,
        expert_parallel=ep.EPSpec(CP_AXIS, CP, "allgather", None),
    )


def _decoder(cfg, placed, pages_per_rank):
    return CPDecoder(_runner(cfg, placed, pages_per_rank))


def _load(arch, tiny_checkpoints):
    path = tiny_checkpoints(arch, fp8=True, n_routed_experts=EXPERTS)
    cfg, single = load_model(path, progress=False)
    _, placed = load_model(path, progress=False, mesh=make_cp_mesh(CP), expert_axis=CP_AXIS)
    return cfg, single, placed


@pytest.fixture(scope="module")
def deepseek(tiny_checkpoints):
    # GLM-5's CP decode runs end to end in tests/serving/test_unified_cp.py and
    # test_pd_cp_decode.py (FP8, EP8, a request past one rank's pool, the same tolerance).
    return _load("deepseek_v32", tiny_checkpoints)


@pytest.fixture(scope="module")
def glm(tiny_checkpoints):
    return _load("glm_moe_dsa", tiny_checkpoints)


def test_cp_decode_equals_single_device_generation(deepseek):
    """Two requests decoded together (one short, one long), chunked prefill, on pools
    where the long request's pages (36) are far more than one rank holds (6): its KV
    lives striped over the eight ranks for the whole generation."""
    cfg, single, placed = deepseek
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 300, n).astype(np.int32) for n in (LONG, P + 1)]
    pages = pages_per_rank_for(sum(len(p) + NEW for p in prompts), P, CPConfig(CP, True), 2)
    decoder = _decoder(cfg, placed, pages)
    long_pages = -(-(LONG + NEW) // P)
    assert long_pages > pages  # more than one rank's whole pool
    free = decoder.runner.allocator.num_free_per_lane().copy()
    tokens, logprobs = decoder.generate(prompts, NEW, chunked_prefill_size=40)
    ref = ReferenceGenerator(cfg, single, page_size=P, index_k_dtype="float32")
    for i, ids in enumerate(prompts):
        want = ref.generate(ids.tolist(), NEW, ignore_eos=True)
        assert tokens[i] == want.output_ids
        np.testing.assert_allclose(logprobs[i], want.output_logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(decoder.runner.allocator.num_free_per_lane(), free)
    assert len(decoder.steps.compiled_keys()) == 1  # one (rows, width) bucket


def test_owner_prefill_with_batch_invariant_numerics(glm):
    """Batch-invariant numerics: still a tolerance (the log-sum-exp merge), not bits; the
    prefill's KV (every layer's full view) too."""
    cfg, single, placed = glm
    ids = np.random.default_rng(5).integers(3, 300, 7 * P + 3).astype(np.int32)
    runner = _runner(cfg, placed, 8, invariant=True)
    result = runner.prefill([ids])
    view = runner.full_view(result.tables[0])
    want, want_view = reference(cfg, single, ids, invariant=True)
    np.testing.assert_allclose(result.last_logits[0], want, rtol=1e-5, atol=1e-5)
    assert int(np.argmax(result.last_logits[0])) == int(np.argmax(want))
    for got_leaf, want_leaf in zip(jax.tree.leaves(view), jax.tree.leaves(want_view), strict=True):
        np.testing.assert_allclose(np.asarray(got_leaf), np.asarray(want_leaf), atol=1e-5, rtol=0)


def test_batch_invariant_cp_decode_is_bitwise_one_device(glm):
    """Batch-invariant numerics (issue 40's bitwise acceptance): the full-view CP prefill
    and CP decode steps that put each row's view together on its rank (`CPKVIO` with the
    rows split) give one device's batch-invariant generation bit for bit - tokens and
    log-probs - for a request striped over every rank beside a short one."""
    cfg, single, placed = glm
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 300, n).astype(np.int32) for n in (LONG, P + 1)]
    pages = pages_per_rank_for(sum(len(p) + NEW for p in prompts), P, CPConfig(CP, True), 2)
    decoder = CPDecoder(_runner(cfg, placed, pages, invariant=True, attention="full-view"))
    assert not isinstance(decoder.kv_io, OwnerCPKVIO)
    tokens, logprobs = decoder.generate(prompts, NEW)
    ref = ReferenceGenerator(
        cfg, single, page_size=P, index_k_dtype="float32", batch_invariant=True
    )
    for i, ids in enumerate(prompts):
        want = ref.generate(ids.tolist(), NEW, ignore_eos=True)
        assert tokens[i] == want.output_ids
        assert logprobs[i] == want.output_logprobs  # bit for bit


_HLO_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "u16": 2, "u8": 1, "pred": 1}


def _sent_by_scope(hlo: str, cp: int) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """Bytes one rank sends in a compiled SPMD program's collectives, by the named scope
    they come from (a tiled all-gather sends the rank's 1/cp of its result to each of
    the cp - 1 others, an all-to-all (cp - 1)/cp of its operands), and how many of each
    collective each scope runs."""
    out: dict[str, int] = {}
    ops_by_scope: dict[tuple[str, str], int] = {}
    for kind, arrays, name in collectives(hlo):
        size = sum(_HLO_BYTES[dtype] * math.prod(shape) for dtype, shape in arrays)
        scope = next(
            (s for s in ("owner_attention", "owner_topk", "kv_write") if s in name), "other"
        )
        out[scope] = out.get(scope, 0) + size * (cp - 1) // cp
        ops_by_scope[scope, kind] = ops_by_scope.get((scope, kind), 0) + 1
    return out, ops_by_scope


def test_decode_bytes_per_rank_counts_the_compiled_steps_exchanges(glm, tiny_checkpoints):
    """`decode_bytes_per_rank`'s `sent` (the figure `bench_memory` and the results give at
    real dims) against the collectives of the CP decode step the servers compile: one row
    per rank at a 256-token context (16 pages, the step's width), bf16 as served. The
    decode exchange sends `q_nope` / `q_pe` and partials through `w_uv`; KV rows and
    queries cross as their stored bits (XLA:CPU moved a bf16 -> float32 convert from
    after a gather to before it: 2x the bytes). What else crosses (the MoE dispatch) is
    not KV traffic; the logits do not cross at all. Compiled only."""
    cfg, _, _ = glm
    path = tiny_checkpoints("glm_moe_dsa", fp8=True, n_routed_experts=EXPERTS)
    mesh = make_cp_mesh(CP)
    _, placed = load_model(path, progress=False, mesh=mesh, expert_axis=CP_AXIS, dtype=jnp.bfloat16)
    decoder = _decoder(cfg, placed, 8)
    hlo = decoder.compiled_step((CP, 16)).as_text()
    sent, ops = _sent_by_scope(hlo, CP)
    want = decode_bytes_per_rank(
        cfg, 16 * P, CP, page_size=P, dtype="bfloat16", index_k_dtype="float32"
    )["sent"]
    assert sent["owner_attention"] > 0 and sent["owner_topk"] > 0 and sent["kv_write"] > 0
    assert sent["owner_attention"] + sent["owner_topk"] + sent["kv_write"] == want
    # One all-to-all per layer for the partials (output, max and sum packed) and one per
    # indexer layer for the candidates (scores and positions): each costs its latency.
    layers, full = cfg.num_hidden_layers, len(cfg.full_indexer_layers)
    assert ops["owner_attention", "all-to-all"] == layers
    assert ops["owner_topk", "all-to-all"] == full
    # Each rank's rows' logits stay on it (the sampler draws there): none cross.
    assert not vocab_wide_collectives(hlo, cfg.vocab_size)


def test_cp_decode_plan_is_all_or_nothing_and_refusals(glm):
    cfg, _, placed = glm
    decoder = _decoder(cfg, placed, 4)  # 3 usable pages per lane
    runner = decoder.runner
    alloc = runner.allocator
    first, table = RequestPageTable(CP), RequestPageTable(CP)
    first.extend(alloc, P, P)  # page 0 (lane 0) full: its next token needs lane 1
    table.extend(alloc, 9 * P, P)  # pages 0-8 full: its next token needs lane 1 too
    filler = alloc.allocate(np.asarray([1]))  # lane 1 keeps one free page
    assert alloc.num_free(1) == 1
    free = alloc.num_free_per_lane().copy()
    with pytest.raises(CacheCapacityError):  # `first` takes lane 1's page, `table` finds none
        decoder.plan([first, table], [5, 6])
    assert (first.num_tokens, first.num_pages) == (P, 1)  # rolled back
    assert (table.num_tokens, table.num_pages) == (9 * P, 9)
    np.testing.assert_array_equal(alloc.num_free_per_lane(), free)
    alloc.free(np.asarray([1]), filler)
    for t in (first, table):
        t.release(alloc)
    table = RequestPageTable(CP)
    with pytest.raises(InputError, match="tables for"):
        decoder.plan([table], [])
    rep = CPConfig(cp_size=CP, shared_kv=False, page_size=P)
    with pytest.raises(InputError, match="shared_kv"):
        CPDecoder(CPPrefillRunner(cfg, placed, make_cp_mesh(CP), rep, pages_per_rank=4))
    with pytest.raises(ConfigError, match="shared_kv"):
        dataclasses.replace(rep, attention="owner").validate()
    owner = dataclasses.replace(rep, shared_kv=True, attention="owner")
    with pytest.raises(InputError, match="full-view attention"):  # the bitwise debug shadow
        CPPrefillRunner(cfg, placed, make_cp_mesh(CP), owner, pages_per_rank=8, debug=True)


def test_device_write_slots_are_the_host_plans_global_slots():
    """`KVIO.slots` (the speculative programs' write slots, computed on the device) for a
    CP group's rows: logical page `p` on lane `p % cp` at its local page, the global slot
    `PoolLayout.global_slots` gives the host plans (`plan_rows`); positions past the
    table's width take its last column, as the one-device `PagedKVIO.slots` does.
    Replicated pools and a missing `lane_pages` too."""
    from cpkv_jax.kv_pool import PoolLayout
    from cpkv_jax.materialize import CPKVIO
    from cpkv_jax.model.kv_cache import SINGLE_DEVICE_KV_IO

    rng = np.random.default_rng(8)
    layout = PoolLayout(CP, True, 9, P)
    width = 2 * CP
    table = jnp.asarray(rng.integers(1, layout.pages_per_rank, (3, width)), jnp.int32)
    positions = jnp.asarray(rng.integers(0, width * P + 2 * P, (3, 4)), jnp.int32)
    io = CPKVIO(CP, True, lane_pages=layout.pages_per_rank)
    got = np.asarray(io.slots(table, positions, P))
    positions_h, table_h = np.asarray(positions), np.asarray(table)
    logical = np.minimum(positions_h // P, width - 1)
    local = np.take_along_axis(table_h, logical, axis=1)
    want = layout.global_slots(logical % CP, local, positions_h % P)
    np.testing.assert_array_equal(got, want)
    assert (got // (layout.pages_per_rank * P) == logical % CP).all()  # on the owner lane
    flat = np.asarray(SINGLE_DEVICE_KV_IO.slots(table, positions, P))
    np.testing.assert_array_equal(flat, local * P + positions_h % P)
    replicated = CPKVIO(CP, False, lane_pages=layout.pages_per_rank)
    np.testing.assert_array_equal(np.asarray(replicated.slots(table, positions, P)), flat)
    with pytest.raises(ValueError, match="lane_pages"):
        CPKVIO(CP, True).slots(table, positions, P)
