"""The startup device-memory plan (`serving.prefill.memory_plan`, issue 22) and the FP8 /
expert-parallel serving path: the plan's weight bytes against a model loaded into its
expert shards, the budget check (refusal naming every number and flag, a big budget, a
device without a limit, device memory x fraction), the transient bound, the refusal
before any weight is read, and a CP shared-KV prefill server with the experts split over
its 8 ranks giving the logits of one without.

The checkpoint is the FP8 tiny GLM-5 one with 16 routed experts (2 per rank at ep 8).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import jax
import numpy as np
import pytest
from flax import nnx
from support.server_args_cases import SHARED_KV

from cpkv_jax.config import ModelConfig
from cpkv_jax.kv_pool import PoolLayout, per_rank_pool_bytes
from cpkv_jax.mesh import CP_AXIS, make_cp_mesh
from cpkv_jax.model.expert_parallel import EPSpec, is_expert_leaf
from cpkv_jax.model.kv_cache import DTYPES
from cpkv_jax.model.weights import checkpoint_model, load_model
from cpkv_jax.model_configs import config_dir
from serving import server as server_mod
from serving.prefill import memory_plan
from serving.prefill.build import build_prefill_engine, pool_page_bytes, pool_pages_per_rank
from serving.prefill.memory_plan import (
    MemoryPlan,
    device_budget,
    gib,
    plan_device_memory,
    resolve_kv_pool_size,
    transient_bytes_per_rank,
)
from serving.server import build_server
from serving.server_args import ServerArgs, ServerArgsError

CHUNK = 64


@pytest.fixture(scope="module")
def fp8_ckpt(tiny_checkpoints):
    """The FP8 tiny checkpoint (sharded files + index) with 16 routed experts."""
    return tiny_checkpoints("glm_moe_dsa", fp8=True, n_routed_experts=16)


def prefill_args(path, *extra: str) -> ServerArgs:
    """A CP 8 shared-KV prefill server over the tiny checkpoint (float32, 1 MiB pools)."""
    return ServerArgs.from_cli(
        [
            "--model-path", str(path), "--dtype", "float32", "--index-k-dtype", "float32",
            "--page-size", "16", *SHARED_KV, "--chunked-prefill-size", str(CHUNK),
            "--kv-pool-size", "1MiB", "--transfer-backend", "grpc", *extra,
        ]
    )  # fmt: skip


def plan_for(args: ServerArgs) -> MemoryPlan:
    cfg = args.model_config()
    args.validate(cfg, device_count=jax.device_count())
    return plan_device_memory(args, cfg)


def device0_bytes(state: nnx.State) -> tuple[int, int]:
    """(all, routed-expert) bytes of the model state's shards that live on device 0."""
    d0 = jax.devices()[0]
    total = experts = 0
    for path, var in nnx.to_flat_state(state):
        n = sum(s.data.nbytes for s in var.get_value().addressable_shards if s.device == d0)
        total += n
        experts += n if is_expert_leaf(path) else 0
    return total, experts


def test_checkpoint_model_is_the_layout_the_loader_builds(fp8_ckpt):
    cfg, loaded = load_model(fp8_ckpt, progress=False)
    abstract = checkpoint_model(cfg, fp8_ckpt)
    spec = jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(abstract))
    assert spec == jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(loaded))
    dtypes = {v.get_value().dtype.name for _, v in nnx.to_flat_state(nnx.state(abstract))}
    assert "float8_e4m3fn" in dtypes
    deq = checkpoint_model(cfg, fp8_ckpt, fp8="dequantize")
    dtypes = {v.get_value().dtype.name for _, v in nnx.to_flat_state(nnx.state(deq))}
    assert dtypes == {"float32"}


def test_plan_weight_bytes_equal_the_shards_a_loaded_model_puts_on_device_0(fp8_ckpt):
    plan8 = plan_for(prefill_args(fp8_ckpt, "--ep-size", "8"))
    _, model = load_model(fp8_ckpt, progress=False, mesh=make_cp_mesh(8), expert_axis=CP_AXIS)
    assert (plan8.weight_bytes, plan8.routed_expert_bytes) == device0_bytes(nnx.state(model))
    # ep 1: every device holds the whole model (what a single-device load holds).
    plan1 = plan_for(prefill_args(fp8_ckpt))
    _, whole = load_model(fp8_ckpt, progress=False)
    assert (plan1.weight_bytes, plan1.routed_expert_bytes) == device0_bytes(nnx.state(whole))
    assert plan1.routed_expert_bytes == 8 * plan8.routed_expert_bytes
    assert plan1.weight_bytes - plan1.routed_expert_bytes == (
        plan8.weight_bytes - plan8.routed_expert_bytes
    )
    # FP8 dequantization: one layer, its expert shard under EP; none when dequantized
    # at load (then 4-byte weights).
    assert 0 < plan8.dequant_bytes < plan1.dequant_bytes
    deq = plan_for(prefill_args(fp8_ckpt, "--fp8-weights", "dequantize"))
    assert deq.dequant_bytes == 0 and deq.weight_bytes > 2 * plan1.weight_bytes
    # The KV pool is the one the engine builds.
    args = prefill_args(fp8_ckpt)
    cfg = args.model_config()
    layout = PoolLayout(8, True, pool_pages_per_rank(args, cfg), args.page_size)
    assert plan1.kv_pool_bytes == per_rank_pool_bytes(cfg, layout, DTYPES["float32"], "float32")


def test_plan_refuses_a_small_budget_naming_every_number_and_flag(fp8_ckpt):
    fits = plan_for(prefill_args(fp8_ckpt, "--ep-size", "8"))
    budget = fits.total_bytes - 1
    with pytest.raises(ServerArgsError) as e:
        plan_for(prefill_args(fp8_ckpt, "--ep-size", "8", "--device-memory-bytes", str(budget)))
    msg = str(e.value)
    for n in (fits.weight_bytes, fits.kv_pool_bytes, fits.transient_bytes, fits.dequant_bytes):
        assert str(n) in msg
    assert f"{fits.total_bytes} > {budget}" in msg
    assert f"{gib(fits.total_bytes)} per device > budget {gib(budget)}" in msg
    for flag in (
        "--kv-pool-size", "--chunked-prefill-size", "--ep-size", "--cp-size",
        "--mem-fraction-static", "--device-memory-bytes", "--fp8-weights keep",
    ):  # fmt: skip
        assert flag in msg


def test_plan_passes_with_a_big_budget_and_reports_it(fp8_ckpt):
    plan = plan_for(prefill_args(fp8_ckpt, "--ep-size", "8", "--device-memory-bytes", "1TiB"))
    assert plan.fits and plan.budget_bytes == 2**40
    info = plan.server_info()
    assert info["device_memory_budget_bytes"] == 2**40
    assert info["weight_bytes_per_device"] == plan.weight_bytes
    assert info["kv_pool_bytes_per_device"] == plan.kv_pool_bytes
    assert info["transient_bytes_per_device"] == plan.transient_bytes > 0


def test_a_device_without_a_limit_skips_the_check_with_one_info_line(fp8_ckpt, caplog):
    with caplog.at_level(logging.INFO, logger=memory_plan.__name__):
        plan = plan_for(prefill_args(fp8_ckpt))
    assert plan.budget_bytes is None and plan.fits
    skipped = [r for r in caplog.records if "check skipped" in r.getMessage()]
    assert len(skipped) == 1
    assert "no memory limit" in skipped[0].getMessage()
    assert "--device-memory-bytes" in skipped[0].getMessage()


class _Device:
    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit, "bytes_in_use": 0}

    def __str__(self):
        return f"fake({self.limit})"


def test_budget_is_the_fraction_of_the_device_capped_by_xlas_pool(monkeypatch):
    """XLA's pool (`bytes_limit`) is the device x XLA_PYTHON_CLIENT_MEM_FRACTION; the
    flag is a fraction of the whole device, as in SGLang, but never more than the pool."""
    args = ServerArgs(model_path="m", mem_fraction_static=0.5)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")
    budget, source = device_budget(args, [_Device(100 * 2**30), _Device(80 * 2**30)])
    assert budget == 50 * 2**30  # the smallest pool, 80 GiB, is 0.8 of a 100 GiB device
    assert "100.00 GiB x --mem-fraction-static 0.5" in source and "80.00 GiB" in source
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")  # the pool is the cap
    assert device_budget(args, [_Device(80 * 2**30)])[0] == 80 * 2**30
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")  # JAX's default, 0.75
    assert device_budget(args, [_Device(75 * 2**30)])[0] == 50 * 2**30
    assert device_budget(args, [_Device(2**30), _Device(None)])[0] is None
    explicit = ServerArgs(model_path="m", device_memory_bytes=123, mem_fraction_static=0.5)
    assert device_budget(explicit, [_Device(2**30)]) == (123, "--device-memory-bytes")


def test_transient_bound_is_the_largest_admissible_step(fp8_ckpt):
    bs1 = prefill_args(fp8_ckpt)
    cfg = bs1.model_config()
    one, _ = transient_bytes_per_rank(bs1, cfg, "cpu")
    # bs > 1 without limits: several requests per step (more rows than one request).
    many, source = transient_bytes_per_rank(
        prefill_args(fp8_ckpt, "--enable-cp-shared-kv-prefill-bs-gt1"), cfg, "cpu"
    )
    assert many > one and "-request step" in source
    # A buffer limit bounds multi-request steps only: a lone request passes whatever.
    small = prefill_args(
        fp8_ckpt,
        "--enable-cp-shared-kv-prefill-bs-gt1",
        "--cp-shared-kv-prefill-max-buffer-size",
        "1",
    )
    assert transient_bytes_per_rank(small, cfg, "cpu")[0] == one
    big = prefill_args(
        fp8_ckpt,
        "--enable-cp-shared-kv-prefill-bs-gt1",
        "--cp-shared-kv-prefill-max-buffer-size",
        "1GiB",
    )
    assert transient_bytes_per_rank(big, cfg, "cpu")[0] == 2**30


def test_single_device_server_plan_counts_weights_and_its_pool(fp8_ckpt):
    args = ServerArgs.from_cli(
        ["--model-path", str(fp8_ckpt), "--dtype", "float32", "--page-size", "16"]
    )
    plan = plan_for(args)
    ep1 = plan_for(prefill_args(fp8_ckpt))
    assert plan.weight_bytes == ep1.weight_bytes and plan.transient_bytes == 0
    assert plan.kv_pool_bytes > 0


def test_dp_decode_plan_splits_the_routed_experts(fp8_ckpt):
    """`--dp-size 4` (issue 36): each decode device holds 1/4 of the routed experts and
    all the rest, from the same code as the single-device plan."""
    base = ["--model-path", str(fp8_ckpt), "--dtype", "float32", "--page-size", "16"]
    one = plan_for(ServerArgs.from_cli([*base, "--disable-radix-cache"]))
    dp4 = plan_for(ServerArgs.from_cli([*base, "--disable-radix-cache", "--dp-size", "4"]))
    assert dp4.routed_expert_bytes * 4 == one.routed_expert_bytes > 0
    assert dp4.weight_bytes - dp4.routed_expert_bytes == one.weight_bytes - one.routed_expert_bytes
    # DP groups of CP ranks (issue 40 item 3): 2 x 4 decode devices, experts over all 8,
    # the pool per rank as a CP group's.
    groups = [
        *base, "--disaggregation-mode", "decode", "--cp-size", "4", "--enable-cp-shared-kv",
    ]  # fmt: skip
    cp4 = plan_for(ServerArgs.from_cli(groups))
    dp2_cp4 = plan_for(ServerArgs.from_cli([*groups, "--dp-size", "2", "--ep-size", "8"]))
    assert dp2_cp4.routed_expert_bytes * 8 == one.routed_expert_bytes
    assert dp2_cp4.kv_pool_bytes == cp4.kv_pool_bytes


def test_decode_and_unified_plans_count_their_largest_decode_step(fp8_ckpt):
    """Issue 36 item 6: a unified or decode server's plan adds the largest decode step
    its engine can dispatch (`serving.decode.step_memory`, from the engine's reachable
    shapes: rows per DP rank, widths the pool holds), in the total, the description and
    `/server_info`; more running requests raise it. A prefill server runs none; a CP
    group's owner-attention step is not estimated (said, not hidden)."""
    base = [
        "--model-path", str(fp8_ckpt), "--dtype", "float32", "--page-size", "16",
        "--kv-pool-size", "1MiB", "--disaggregation-mode", "decode",
        "--transfer-backend", "grpc",
    ]  # fmt: skip
    few = plan_for(ServerArgs.from_cli([*base, "--max-running-requests", "2"]))
    many = plan_for(ServerArgs.from_cli([*base, "--max-running-requests", "64"]))
    assert 0 < few.decode_step_bytes < many.decode_step_bytes
    assert many.total_bytes - many.decode_step_bytes == few.total_bytes - few.decode_step_bytes
    assert "decode step" in many.describe() and "row(s)" in many.decode_step_source
    assert many.server_info()["decode_step_bytes_per_device"] == many.decode_step_bytes
    dp = plan_for(ServerArgs.from_cli([*base, "--max-running-requests", "64", "--dp-size", "4"]))
    assert "per DP rank" in dp.decode_step_source and dp.decode_step_bytes > 0
    assert plan_for(prefill_args(fp8_ckpt)).decode_step_bytes == 0
    # A unified server that prefills with its own steps: its largest is a whole prompt.
    unified = ["--disable-radix-cache" if a == "decode" else a for a in base]
    own = plan_for(ServerArgs.from_cli([x for x in unified if x != "--disaggregation-mode"]))
    assert "largest prefill: 1 row(s)" in own.decode_step_source
    assert own.decode_step_bytes > many.decode_step_bytes
    # On a DP mesh the engine's own steps prefill with the prefix cache on too (a cache
    # per rank, `serving.decode.dp_prefix`).
    cached_dp = [x for x in unified if x not in ("--disaggregation-mode", "--disable-radix-cache")]
    dp_own = plan_for(ServerArgs.from_cli([*cached_dp, "--dp-size", "4"]))
    assert "largest prefill: 1 row(s)" in dp_own.decode_step_source
    # --chunked-prefill-size bounds what one of those prefills feeds.
    chunked = plan_for(
        ServerArgs.from_cli([*cached_dp, "--dp-size", "4", "--chunked-prefill-size", "32"])
    )
    assert chunked.decode_step_bytes < dp_own.decode_step_bytes
    cp = ServerArgs.from_cli(
        ["--model-path", str(fp8_ckpt), "--dtype", "float32", "--page-size", "16",
         "--kv-pool-size", "1MiB", "--cp-size", "8", "--enable-cp-shared-kv", "--ep-size", "8"]
    )  # fmt: skip
    cp_plan = plan_for(cp)
    assert cp_plan.decode_step_bytes == 0 and "not estimated" in cp_plan.decode_step_source


def test_build_server_refuses_before_reading_any_weight(fp8_ckpt, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("weights were read before the memory check")

    monkeypatch.setattr(server_mod, "load_serving_model", no_load)
    args = prefill_args(fp8_ckpt, "--ep-size", "8", "--device-memory-bytes", "1MiB")
    with pytest.raises(ServerArgsError, match="do not fit"):
        build_server(args)


def test_ep8_prefill_server_gives_the_logits_of_ep1(fp8_ckpt):
    """The same first-token logits from a CP 8 shared-KV prefill server with the routed
    experts split over its 8 ranks (built by `build_server`: plan, sharded load, EP
    runner; and an all_to_all engine) as from one without expert parallelism."""
    prompt = np.random.default_rng(7).integers(3, 300, 40).astype(np.int32)

    def first_logits(runner) -> np.ndarray:
        result = runner.prefill([prompt], CHUNK)
        runner.release(result.tables[0])
        return result.last_logits[0]

    want = first_logits(build_prefill_engine(prefill_args(fp8_ckpt)).runner)
    server = build_server(prefill_args(fp8_ckpt, "--ep-size", "8"))
    try:
        asyncio.run(server.loop.shutdown(0.0))  # the test drives the runner itself
        runner = server.engine.runner
        assert runner.expert_parallel == EPSpec(CP_AXIS, 8, "allgather")
        info = server.info
        assert (info["ep_size"], info["ep_dispatch"], info["fp8_weights"]) == (
            8,
            "allgather",
            "keep",
        )
        weights, _ = device0_bytes(runner.state)
        assert info["weight_bytes_per_device"] == weights
        assert info["device_memory_budget_bytes"] is None  # CPU: no limit, not checked
        np.testing.assert_allclose(first_logits(runner), want, rtol=0, atol=1e-5)
    finally:
        server.close()
    a2a = build_prefill_engine(
        prefill_args(fp8_ckpt, "--ep-size", "8", "--ep-dispatch", "all_to_all")
    )
    assert a2a.runner.expert_parallel.dispatch == "all_to_all"
    np.testing.assert_allclose(first_logits(a2a.runner), want, rtol=0, atol=1e-5)


def test_host_cache_larger_than_the_host_memory_is_refused_before_allocating(caplog):
    """The host pools are zero pages until written: an oversized one would start and be
    OOM-killed later, so startup compares it with the host memory available (issue 23)."""
    from cpkv_jax.errors import ConfigError
    from serving.prefill.build import (
        HOST_CACHE_MAX_FRACTION,
        available_host_memory,
        check_host_cache_fits,
    )

    gib_ = 2**30
    avail = int(np.random.default_rng(3).integers(4, 64)) * gib_
    check_host_cache_fits(int(HOST_CACHE_MAX_FRACTION * avail), avail, "test")  # fits
    with pytest.raises(ConfigError, match="--hicache-size") as e:
        check_host_cache_fits(int(HOST_CACHE_MAX_FRACTION * avail) + 1, avail, "test")
    assert f"{avail / gib_:.2f} GiB is available (test)" in str(e.value)
    with caplog.at_level(logging.WARNING):
        check_host_cache_fits(10 * avail, None, "unknown")  # unknown: warned, not refused
    assert "not checked" in caplog.text
    found, source = available_host_memory()  # this Linux machine reports it
    assert found is not None and found > 0 and source


# ---- --kv-pool-size none (issue 26) ---------------------------------------------------


def assert_most_pages(plan: MemoryPlan, args: ServerArgs, room: int) -> int:
    """`plan`'s pool is whole pages, fits `room` beside the weights, dequantization and
    its transient buffers, and one page more (with its own transient bound) would not;
    returns its pages per rank."""
    cfg = args.model_config()
    one_page = pool_page_bytes(args, cfg)
    pages, rest = divmod(plan.kv_pool_bytes, one_page)
    assert rest == 0 and plan.total_bytes <= room
    more = transient_bytes_per_rank(args, cfg, "cpu", pages + 1)[0]
    assert plan.weight_bytes + plan.dequant_bytes + (pages + 1) * one_page + more > room
    # What build_server hands on to the engine builds exactly this pool.
    sized = dataclasses.replace(args, kv_pool_size=plan.kv_pool_bytes)
    assert pool_pages_per_rank(sized, cfg) == pages
    return pages


def test_kv_pool_none_is_sized_from_free_device_memory(fp8_ckpt, monkeypatch, caplog):
    """`--kv-pool-size none` is the most whole pages that fit the budget less what the
    devices hold, the weights, FP8 dequantization and the transient buffers of the steps
    that pool admits: with `--device-memory-bytes` on CPU (no memory stats), and with
    `memory_stats()` reporting a 256 MiB XLA pool (0.95 of the device, the budget 0.88
    of it) of which 10 MiB are in use."""
    explicit = ("--kv-pool-size", "none", "--device-memory-bytes", "64MiB")
    args = prefill_args(fp8_ckpt, "--ep-size", "8", *explicit)
    pages = assert_most_pages(plan_for(args), args, 64 * 2**20)
    assert pages > 1000  # far more than the 4,096-token default (33 pages per rank)

    limit, in_use = 256 * 2**20, 10 * 2**20
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    monkeypatch.setattr(
        memory_plan, "memory_stats", lambda d: {"bytes_limit": limit, "bytes_in_use": in_use}
    )
    args = prefill_args(fp8_ckpt, "--ep-size", "8", "--kv-pool-size", "none")
    with caplog.at_level(logging.INFO, logger=memory_plan.__name__):
        plan = plan_for(args)
    budget = int(int(limit / 0.95) * 0.88)
    assert plan.budget_bytes == budget
    pages = assert_most_pages(plan, args, budget - in_use)
    assert f"{pages} pages per rank from free device memory" in plan.kv_pool_source
    assert "12% of the device" in plan.kv_pool_source
    assert plan.server_info()["kv_pool_source"] == plan.kv_pool_source
    assert any(plan.kv_pool_source in r.getMessage() for r in caplog.records)


def test_kv_pool_none_on_cpu_takes_the_default_and_says_why(fp8_ckpt, caplog):
    """XLA:CPU reports no memory stats: the pool holds 131,072 tokens or the context
    (the tiny model's 4,096), and the log says that and why."""
    args = prefill_args(fp8_ckpt, "--kv-pool-size", "none")
    with caplog.at_level(logging.INFO, logger=memory_plan.__name__):
        plan = plan_for(args)
    cfg = args.model_config()
    assert plan.kv_pool_bytes == pool_pages_per_rank(args, cfg) * pool_page_bytes(args, cfg)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool")]
    assert len(lines) == 1, lines
    for words in ("free device memory unknown", "no memory limit", "4096 tokens", "131072"):
        assert words in lines[0], lines[0]


def glm5_prefill_args(**kw) -> ServerArgs:
    """GLM-5 CP 8 / EP 8 shared-KV prefill flags (config only: no weights are read)."""
    return ServerArgs(
        model_path=str(config_dir("glm-5")),
        disaggregation_mode="prefill",
        transfer_backend="grpc",
        cp_size=8,
        ep_size=8,
        enable_cp_shared_kv=True,
        page_size=64,
        dtype="bfloat16",
        index_k_dtype="fp8_e4m3",
        **kw,
    )


H200 = 141 * 10**9
GLM5_WEIGHTS = 112_030_000_000  # FP8 at EP 8, per device (docs/results.md)
GLM5_DEQUANT = 2_840_000_000


@pytest.mark.parametrize("chunk", [None, 16384])
def test_kv_pool_none_at_glm5_dims(monkeypatch, chunk):
    """The same sizing at GLM-5 dims (78 layers, 64-token pages of 576 bf16 latent + 132 B
    fp8 index K per token and layer) on an H200 whose XLA pool is 0.95 of 141 GB: the
    budget 124.08 GB less the EP 8 weights, dequantization and the transient buffers of
    a whole-context (or 16K-chunk) step holds the 202,752-token context on the node, and
    fewer tokens than the 96,064 per rank the benchmark finds without the transients."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

    class Gpu:
        def memory_stats(self):
            return {"bytes_limit": int(H200 * 0.95), "bytes_in_use": 2**30}

    args = glm5_prefill_args(chunked_prefill_size=chunk)
    cfg = ModelConfig.from_pretrained(config_dir("glm-5"))
    fixed = GLM5_WEIGHTS + GLM5_DEQUANT
    size, source = resolve_kv_pool_size(args, cfg, [Gpu()] * 8, fixed, "gpu")
    page = 78 * 64 * (1152 + 132)
    assert pool_page_bytes(args, cfg) == page
    pages, rest = divmod(size, page)
    room = int(H200 * 0.88) - 2**30 - fixed
    transient = transient_bytes_per_rank(args, cfg, "gpu", pages)[0]
    assert rest == 0 and pages * page + transient <= room
    assert (pages + 1) * page + transient_bytes_per_rank(args, cfg, "gpu", pages + 1)[0] > room
    assert 2**30 < transient < 4 * 2**30  # the estimator's GLM-5 step buffers: GBs
    tokens_per_rank = (pages - 1) * 64
    assert cfg.max_position_embeddings <= 8 * tokens_per_rank < 8 * 96_064
    assert "12% of the device" in source and "1.00 GiB in use" in source
    # Weights that leave less than 2 pages beside the transients are refused, with the numbers.
    with pytest.raises(ServerArgsError, match="does not hold 2 KV pages") as e:
        resolve_kv_pool_size(args, cfg, [Gpu()] * 8, room + fixed - page, "gpu")
    assert "--kv-pool-size" in str(e.value) and str(page) in str(e.value)


def test_a_speculative_servers_plan_counts_its_mtp_layer_and_draft_state(fp8_ckpt):
    """`--speculative-algorithm`: the plan's weights include the MTP layer (what
    `load_model(mtp=True)` builds) and its transient bytes the draft state the engine
    allocates (`init_slab`, at most SPEC_SLOTS_MAX slots and the spare)."""
    from cpkv_jax.speculative import init_slab

    base = [
        "--model-path", str(fp8_ckpt), "--dtype", "float32", "--page-size", "16",
        "--kv-pool-size", "1MiB", "--disable-radix-cache", "--max-running-requests", "6",
    ]  # fmt: skip
    spec = [*base, "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"]
    plain, drafting = plan_for(ServerArgs.from_cli(base)), plan_for(ServerArgs.from_cli(spec))
    cfg, model = load_model(fp8_ckpt, dtype=np.float32, mtp=True)
    mtp = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.mtp)))
    assert drafting.weight_bytes - plain.weight_bytes == mtp > 0
    slab = jax.eval_shape(lambda: init_slab(6, 2, cfg.vocab_size))
    assert drafting.transient_bytes == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(slab))
    assert "speculative draft state" in drafting.transient_source
    # A CP8 decode group (issue 40): each rank keeps its share of the 6 slots (one) and a
    # spare, as `SpeculativeSteps` splits the slab over "cp".
    group = [
        *base[:8], "--max-running-requests", "6", *spec[-4:],
        "--disaggregation-mode", "decode", "--cp-size", "8", "--enable-cp-shared-kv",
    ]  # fmt: skip
    assert "--disable-radix-cache" not in group
    on_group = plan_for(ServerArgs.from_cli(group))
    slab = jax.eval_shape(lambda: init_slab(1, 2, cfg.vocab_size))
    assert on_group.transient_bytes == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(slab))
