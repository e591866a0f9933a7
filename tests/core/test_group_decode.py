"""Decode on DP groups of CP ranks (issue 40 item 3, `("dp", "cp")`), the library step:
a 2 x 4 mesh, each group a CP4 decode group whose requests' pages stripe over its four
lanes (`cp_decode.plan_groups`, `build_decode_step(row_axes=("dp", "cp"))`), the routed
experts split over all eight devices (EP over both axes). Owner attention's collectives
name `"cp"` alone, so each group attends over its own lanes. Prompts are fed one token a
step through the decode step (teacher forcing: the CP prefill runner has no 2-D mesh
yet); greedy tokens must equal one device's `ReferenceGenerator`, log-probs within 1e-5
(the CP tolerance, tests/core/test_cp_decode.py). Not served yet: no server builds this
mesh."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cpkv_jax.cp_decode import build_decode_step, plan_groups
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.kv_pool import PoolLayout, cp_pool_shapes, zeros_in
from cpkv_jax.lane_allocator import OwnerLaneAllocator, RequestPageTable
from cpkv_jax.model import expert_parallel as ep
from cpkv_jax.model.transformer import log_probs
from cpkv_jax.model.weights import load_model
from cpkv_jax.owner_attention import OwnerCPKVIO

pytestmark = pytest.mark.slow(seconds=60)

DP, CP, PAGE, PPR, NEW = 2, 4, 16, 10, 4
AXES = ("dp", "cp")


def test_dp_groups_of_cp_ranks_decode_as_one_device(tiny_checkpoints):
    path = tiny_checkpoints("deepseek_v32", fp8=True, n_routed_experts=16)
    cfg, single = load_model(path, progress=False)
    mesh = Mesh(np.asarray(jax.devices()[: DP * CP]).reshape(DP, CP), AXES)
    _, placed = load_model(path, progress=False, mesh=mesh, expert_axis=AXES)
    graphdef, state = nnx.split(placed)
    layout = PoolLayout(CP, True, PPR, PAGE)  # one group's lanes; groups stacked on "dp"
    shapes = cp_pool_shapes(cfg, PoolLayout(DP * CP, True, PPR, PAGE), placed.dtype, "float32")
    rows_sharding = NamedSharding(mesh, P(AXES))
    pool = zeros_in(shapes, jax.tree.map(lambda _: rows_sharding, shapes))
    step = build_decode_step(
        graphdef, mesh, P(AXES), OwnerCPKVIO(CP, True, query_axis=0),
        ep.param_specs(state, AXES), ep=ep.EPSpec(AXES, DP * CP),
        index_k_dtype="float32", row_axes=AXES,
    )  # fmt: skip
    rng = np.random.default_rng(3)
    # Group 0 holds two requests, group 1 one; the long one needs 6 pages over 4 lanes.
    prompts = [rng.integers(3, 300, n).tolist() for n in (5 * PAGE + 3, 9, 2 * PAGE)]
    group = [0, 0, 1]
    allocs = [OwnerLaneAllocator(CP, PPR) for _ in range(DP)]
    tables = [RequestPageTable(CP) for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    lps: list[list[float]] = [[] for _ in prompts]
    fed = [0] * len(prompts)
    total = [len(p) + NEW - 1 for p in prompts]  # tokens fed: the prompt, then outputs
    while any(f < t for f, t in zip(fed, total, strict=True)):
        live = [i for i in range(len(prompts)) if fed[i] < total[i]]
        members: list[list[int]] = [[i for i in live if group[i] == g] for g in range(DP)]
        rows: list[list] = [[] for _ in range(DP)]
        for g, mine in enumerate(members):
            for i in mine:
                pos = fed[i]
                tok = prompts[i][pos] if pos < len(prompts[i]) else outs[i][-1]
                tables[i].extend(allocs[g], pos + 1, PAGE)
                rows[g].append((tok, pos, tables[i].local_pages(), tables[i].num_pages))
        plan, at = plan_groups(layout, rows)
        where = {
            i: row
            for mine, rows_at in zip(members, at, strict=True)
            for i, row in zip(mine, rows_at, strict=True)
        }
        host = (plan.input_ids, plan.positions, plan.valid, plan.write_slots)
        tokens = tuple(jax.device_put(a, rows_sharding) for a in host)
        table, lens = (jax.device_put(a, rows_sharding) for a in (plan.page_table, plan.kv_lens))
        logits, pool = step(state, tokens, table, lens, pool)
        lp = np.asarray(log_probs(logits, False))
        for i in live:
            if fed[i] >= len(prompts[i]) - 1:
                row = lp[where[i]]
                outs[i].append(int(np.argmax(row)))
                lps[i].append(float(row[outs[i][-1]]))
            fed[i] += 1
    ref = ReferenceGenerator(cfg, single, page_size=PAGE, index_k_dtype="float32")
    for i, p in enumerate(prompts):
        want = ref.generate(p, NEW, ignore_eos=True)
        assert outs[i] == want.output_ids, i
        np.testing.assert_allclose(lps[i], want.output_logprobs, rtol=1e-5, atol=1e-5)
