"""Host (L2) KV cache: numpy host pools per owner lane and the device<->host copy paths.

- `pool`: `HostPool` (one lane, one of the four S4.1 layouts), `HostPools` (every lane of
  a device `PoolLayout`), the host page allocator and sizing (`host_pages_for`);
- `copy`: per-layer and all-layer backup / load-back between a lane of the device pool
  and its host pool; LPF goes through the `pallas.lpf_copy` kernels only (SPEC S4.4).
"""

from cpkv_jax.host_cache.copy import (
    CopyImpl,
    CopyPlan,
    DevicePoolLostError,
    HostCopyError,
    LPFKernelUnavailableError,
    backup_all_layers,
    backup_layer,
    deleted_leaves,
    load_all_layers,
    load_layer,
    plan_copy,
    resolve_impl,
)
from cpkv_jax.host_cache.pool import (
    HOST_LAYOUTS,
    HOST_TRASH_PAGE,
    HostLayout,
    HostPageAllocator,
    HostPageError,
    HostPool,
    HostPools,
    host_pages_for,
    token_indices_of_pages,
)

__all__ = [
    "HOST_LAYOUTS",
    "HOST_TRASH_PAGE",
    "CopyImpl",
    "CopyPlan",
    "DevicePoolLostError",
    "HostCopyError",
    "HostLayout",
    "HostPageAllocator",
    "HostPageError",
    "HostPool",
    "HostPools",
    "LPFKernelUnavailableError",
    "backup_all_layers",
    "backup_layer",
    "deleted_leaves",
    "host_pages_for",
    "load_all_layers",
    "load_layer",
    "plan_copy",
    "resolve_impl",
    "token_indices_of_pages",
]
