"""One process of a CP prefill run, for `test_cp_multiprocess.py` (a script, not a test).

Run alone (`--num-processes 1 --local-devices 8`) or as one of N processes that join a
`jax.distributed` runtime on `--coordinator` (CPU collectives over gloo). Every process
builds the same 8-rank `("cp",)` mesh over all processes' devices, loads the same
checkpoint and prefills the same prompt; process 0 writes the last logits and the
request's materialized full view (latent pool, layer 0) to `--out` as JSON.

Progress goes to stderr as `CPKV_STAGE=<name>` lines: `distributed_ok` (joined, all
devices visible), `collectives_ok` (a cross-process reduction over the mesh worked),
`done`. A JAX runtime error before `collectives_ok` is reported as one
`CPKV_ENV_FAILURE: ...` line with exit code 3: the distributed runtime or gloo does not
work here, which the parent test turns into a skip. Anything else is a plain failure.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import sys
import time

ENV_FAILURE_EXIT = 3
ENV_FAILURE_TAG = "CPKV_ENV_FAILURE:"
STAGE_PREFIX = "CPKV_STAGE="


def stage(name: str) -> None:
    print(f"{STAGE_PREFIX}{name}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (N > 1)")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--local-devices", type=int, default=8, help="virtual CPU devices here")
    p.add_argument("--cp-size", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--model-path", required=True)
    p.add_argument("--out", required=True, help="JSON written by process 0")
    p.add_argument("--prompt-ids", type=int, nargs="+", required=True)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--init-timeout", type=int, default=30, help="seconds for all to join")
    p.add_argument("--timeout", type=float, default=200.0, help="hard limit, whole worker")
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="routed experts sharded over the cp ranks, loaded straight into their shards",
    )
    p.add_argument(
        "--dp-decode-ids",
        type=int,
        nargs="*",
        default=None,
        help="also decode on a ('dp',) mesh of all devices (issue 36): three requests "
        "with these prompt ids, on ranks 1, 5 and 6, prefilled in one step then decoded",
    )
    p.add_argument(
        "--cp-decode-steps",
        type=int,
        default=0,
        help="also prefill and decode the prompt with owner attention on the cp mesh "
        "(issue 40: `cpkv_jax.cp_decode`), this many greedy tokens",
    )
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--shared", dest="shared_kv", action="store_true", default=True)
    kv.add_argument("--replicated", dest="shared_kv", action="store_false")
    args = p.parse_args(argv)
    if args.num_processes > 1 and not args.coordinator:
        p.error("--coordinator is required with --num-processes > 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    # Hard limits: a hung join or collective dumps every thread's stack and exits.
    # Setup (join + probe) gets its own, shorter budget.
    faulthandler.dump_traceback_later(min(args.timeout, args.init_timeout + 30.0), exit=True)

    # Device count and platform must be fixed before JAX is imported.
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
    )
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={args.local_devices}".strip()
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from cpkv_jax.mesh import CP_AXIS, initialize_distributed, make_cp_mesh

    want = args.num_processes * args.local_devices
    try:
        if args.num_processes > 1:
            initialize_distributed(
                args.coordinator,
                args.num_processes,
                args.process_id,
                initialization_timeout=args.init_timeout,
            )
        n_global = jax.device_count()  # backend (and gloo collectives) created here
    except jax.errors.JaxRuntimeError as e:
        print(f"{ENV_FAILURE_TAG} joining jax.distributed: {e}", file=sys.stderr, flush=True)
        return ENV_FAILURE_EXIT
    if n_global != want or jax.process_count() != args.num_processes:
        print(
            f"expected {want} devices in {args.num_processes} processes, got "
            f"{n_global} in {jax.process_count()}",
            file=sys.stderr,
        )
        return 1
    stage("distributed_ok")

    mesh = make_cp_mesh(args.cp_size)
    # Probe: a reduction over every rank of the mesh (cross-process when N > 1).
    n = 4 * args.cp_size
    host = np.arange(n, dtype=np.float32)
    x = jax.make_array_from_callback((n,), NamedSharding(mesh, P(CP_AXIS)), lambda i: host[i])
    try:
        total = float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x))
    except jax.errors.JaxRuntimeError as e:
        print(f"{ENV_FAILURE_TAG} cross-process collective: {e}", file=sys.stderr, flush=True)
        return ENV_FAILURE_EXIT
    if total != host.sum():
        print(f"collective probe: sum {total} != {host.sum()}", file=sys.stderr)
        return 1
    stage("collectives_ok")
    faulthandler.cancel_dump_traceback_later()
    faulthandler.dump_traceback_later(
        max(1.0, args.timeout - (time.monotonic() - start)), exit=True
    )

    from cpkv_jax.config import CPConfig
    from cpkv_jax.cp_prefill import CPPrefillRunner, pages_per_rank_for
    from cpkv_jax.model.expert_parallel import EPSpec
    from cpkv_jax.model.weights import LoadStats, load_model

    stats = LoadStats()
    ep = args.expert_parallel
    cfg, model = load_model(
        args.model_path,
        progress=False,
        mesh=mesh if ep else None,
        expert_axis=CP_AXIS if ep else None,
        stats=stats,
    )
    cp = CPConfig(
        cp_size=args.cp_size,
        shared_kv=args.shared_kv,
        page_size=args.page_size,
        chunked_prefill_size=args.chunked_prefill_size,
    )
    prompt = np.asarray(args.prompt_ids, np.int32)
    runner = CPPrefillRunner(
        cfg,
        model,
        mesh,
        cp,
        pages_per_rank=pages_per_rank_for(prompt.size, cp.page_size, cp),
        index_k_dtype="float32",
        expert_parallel=EPSpec(CP_AXIS, args.cp_size) if ep else None,
    )
    # What this process holds of one routed-expert leaf, and what it read from the files.
    expert_leaf = runner.state["model"]["layers"][cfg.first_k_dense_replace]["mlp"]["experts"]
    local = {
        "process_id": jax.process_index(),
        "bytes_read": stats.bytes_read,
        "planned_bytes": stats.planned_bytes,
        "expert_shard_bytes": [
            s.data.nbytes for s in expert_leaf["gate_proj"][...].addressable_shards
        ],
        "expert_leaf_bytes": expert_leaf["gate_proj"][...].nbytes,
    }
    with open(f"{args.out}.p{jax.process_index()}.json", "w") as f:
        json.dump(local, f)
    result = runner.prefill([prompt], args.chunked_prefill_size)
    # A collective: every process calls it. The view is replicated, so each process can
    # read it whole.
    view = runner.full_view(result.tables[0])
    latent0 = np.asarray(view.latent[0], np.float32)
    cpd = cp_decode(args, runner, prompt) if args.cp_decode_steps else None
    dp = dp_decode(args, jax, np) if args.dp_decode_ids else None
    if jax.process_index() == 0:
        payload = {
            "dp_decode": dp,
            "cp_decode": cpd,
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(),
            "mesh_process_indices": [d.process_index for d in mesh.devices.reshape(-1)],
            "last_logits": np.asarray(result.last_logits, np.float32).tolist(),
            "full_view_latent0": latent0.tolist(),
            "seconds": time.monotonic() - start,
        }
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f)  # float32 -> Python float -> JSON round-trips exactly
        os.replace(tmp, args.out)
    if args.num_processes > 1:
        jax.distributed.shutdown()
    faulthandler.cancel_dump_traceback_later()
    stage("done")
    return 0


def cp_decode(args, prefill_runner, prompt) -> dict:
    """Owner attention on the same mesh, model and EP (issue 40): CP prefill of the prompt
    without a full view, then `--cp-decode-steps` greedy CP decode steps from the same
    page-owned pools (`cpkv_jax.cp_decode`). Returns the tokens and their log-probs."""
    import dataclasses

    from cpkv_jax.cp_decode import CPDecoder
    from cpkv_jax.cp_prefill import CPPrefillRunner, pages_per_rank_for

    base = prefill_runner
    cp = dataclasses.replace(base.cp, attention="owner")
    runner = CPPrefillRunner(
        base.cfg,
        nnx_merge(base),
        base.mesh,
        cp,
        pages_per_rank=pages_per_rank_for(prompt.size + args.cp_decode_steps, cp.page_size, cp),
        index_k_dtype=base.index_k_dtype,
        expert_parallel=base.expert_parallel,
    )
    tokens, logprobs = CPDecoder(runner).generate(
        [prompt], args.cp_decode_steps, args.chunked_prefill_size
    )
    return {"tokens": tokens[0], "logprobs": logprobs[0]}


def nnx_merge(runner):
    """The runner's model (its placed state: EP shards stay where they are)."""
    from flax import nnx

    return nnx.merge(runner.graphdef, runner.state)


DP_RANKS = (1, 5, 6)  # with 4 devices per process, ranks 5 and 6 are the second's
DP_STEPS = 3


def dp_decode(args, jax, np) -> dict:
    """Data-parallel decode over every device: the model loaded with the routed experts
    split over `"dp"`, three requests (prompt lengths 1/3, 2/3 and all of
    `--dp-decode-ids`) prefilled in one step on `DP_RANKS`, then `DP_STEPS` greedy
    decode steps. Returns each step's tokens and their log-probs (every process gathers
    the logits)."""
    from jax.experimental import multihost_utils

    from cpkv_jax.decode_mesh import DPDecodeSteps, DPPoolLayout, DPRow, build_batch, init_dp_pool
    from cpkv_jax.mesh import DP_AXIS, make_dp_mesh
    from cpkv_jax.model.weights import load_model
    from cpkv_jax.paging import pages_for_tokens
    from cpkv_jax.sampling import rows_log_probs

    page = args.page_size
    mesh = make_dp_mesh(jax.device_count())
    cfg, model = load_model(args.model_path, progress=False, mesh=mesh, expert_axis=DP_AXIS)
    ids = np.asarray(args.dp_decode_ids, np.int32)
    prompts = [ids[: len(ids) // 3], ids[: 2 * len(ids) // 3], ids]
    need = max(pages_for_tokens(len(p) + DP_STEPS + 1, page) for p in prompts)
    layout = DPPoolLayout(mesh.size, need + 1, page)
    pool = init_dp_pool(cfg, layout, mesh, model.dtype, "float32")
    steps = DPDecodeSteps(model, mesh, layout, pool, index_k_dtype="float32")
    pages = [r * layout.pages_per_rank + 1 + np.arange(need) for r in DP_RANKS]
    rows = [DPRow(r, p, 0, pg, need) for r, p, pg in zip(DP_RANKS, prompts, pages, strict=True)]
    tokens, lps = [], []
    for step in range(DP_STEPS + 1):
        shape, order, host = build_batch(layout, rows, prefill=step == 0)
        logits, pool = steps.run(shape, host, pool)
        # Each rank's rows' logits stay on it: gather them for every process.
        lp = multihost_utils.process_allgather(rows_log_probs(logits), tiled=True)
        lp = np.asarray(lp, np.float32)[order[: len(rows)]]
        tok = lp.argmax(-1)
        tokens.append(tok.tolist())
        lps.append(lp[np.arange(len(rows)), tok].tolist())
        rows = [
            DPRow(r.rank, np.asarray([t], np.int32), r.start + len(r.tokens), r.pages, need)
            for r, t in zip(rows, tok, strict=True)
        ]
    return {"tokens": tokens, "logprobs": lps}


if __name__ == "__main__":
    sys.exit(main())
