"""The serving meshes: `("cp",)` for context-parallel prefill, `("dp",)` for
data-parallel decode, `("dp", "cp")` for decode on DP groups of CP ranks (each with
expert parallelism over the same devices).

Single process: the first `cp_size` local devices (virtual CPU devices in tests, GPUs in
production). Multi-host: call `initialize_distributed` in every process first (JAX's own
multi-controller runtime; CPU collectives go through gloo), then `make_cp_mesh` spans the
devices of all processes in process order, so the same mesh code runs unchanged.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import Mesh

from cpkv_jax.errors import ConfigError

logger = logging.getLogger(__name__)

CP_AXIS = "cp"
DP_AXIS = "dp"


def make_cp_mesh(cp_size: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh `("cp",)` over `cp_size` devices (all processes' devices by default)."""
    return _line_mesh(CP_AXIS, "cp_size", cp_size, devices)


def make_dp_mesh(dp_size: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh `("dp",)` over `dp_size` devices: data-parallel decode ranks."""
    return _line_mesh(DP_AXIS, "dp_size", dp_size, devices)


GROUP_AXES = (DP_AXIS, CP_AXIS)


def make_group_mesh(dp_size: int, cp_size: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A 2-D mesh `("dp", "cp")` over `dp_size * cp_size` devices: `dp_size` decode groups
    of `cp_size` CP ranks each, group `g` on the `g`-th run of `cp_size` devices."""
    line = _line_mesh(CP_AXIS, "dp_size * cp_size", dp_size * cp_size, devices)
    return Mesh(line.devices.reshape(dp_size, cp_size), GROUP_AXES)


def _line_mesh(axis: str, flag: str, size: int, devices: list[jax.Device] | None) -> Mesh:
    devices = list(jax.devices()) if devices is None else list(devices)
    if size < 1:
        raise ConfigError(f"`{flag}` must be >= 1, got {size}")
    if size > len(devices) or len(devices) % size:
        raise ConfigError(
            f"`{flag}` {size} must divide the {len(devices)} available devices "
            f"({devices[0].platform}); pick a divisor of {len(devices)} or expose more "
            "devices (tests: XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    # Keep process order so a multi-host mesh places rank r on process r // local_count.
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))[:size]
    return Mesh(np.asarray(devices), (axis,))


def initialize_distributed(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    cpu_collectives: bool = True,
    initialization_timeout: int = 300,
) -> None:
    """Join a multi-process JAX runtime (one call per process, before any JAX work).

    `cpu_collectives` selects gloo so CPU devices of different processes can all-gather
    (the CI path); on GPUs NCCL is used and the flag is ignored. `initialization_timeout`
    (seconds, JAX's default 300) bounds the wait for all processes to join.
    """
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=initialization_timeout,
    )
    logger.info(
        "process %d/%d joined %s: %d local / %d global devices",
        process_id,
        num_processes,
        coordinator_address,
        jax.local_device_count(),
        jax.device_count(),
    )
