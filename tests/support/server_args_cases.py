"""Shared pieces of the `ServerArgs` tests (tests/serving/test_server_args_*.py): the
GLM-5 config dir, the S5 limit flags, a shared-KV prefill command line (and one with
expert parallelism over its ranks), a `ServerArgs` maker, a backend registry with two
incapable test backends and the command line that parses back to given args. The
`tiny_config_dir` fixture (a config-only tiny GLM-5-style model dir) is in
tests/serving/conftest.py.
"""

from __future__ import annotations

import dataclasses

from cpkv_jax.model_configs import config_dir
from serving.server_args import ServerArgs, flag_name
from transfer.capabilities import (
    BackendCapabilities,
    TransferBackendRegistry,
    default_backend_registry,
)

GLM5_DIR = config_dir("glm-5")
LIMIT_FLAGS = (
    "--cp-shared-kv-prefill-max-batch-requests",
    "--cp-shared-kv-prefill-max-total-extend-tokens",
    "--cp-shared-kv-prefill-max-cached-tokens",
    "--cp-shared-kv-prefill-max-buffer-size",
)
SHARED_KV = ("--disaggregation-mode", "prefill", "--cp-size", "8", "--enable-cp-shared-kv")
# Expert parallelism over the 8 CP ranks of that prefill server (issue 22).
EP8 = (*SHARED_KV, "--ep-size", "8")
# The host KV cache in the layout built for CP shared KV (SPEC S4.4: host-only, direct).
HICACHE_LPF = ("--enable-hierarchical-cache", "--hicache-mem-layout", "layer_page_first")


def make_args(**kw) -> ServerArgs:
    """`ServerArgs(**kw)` with a placeholder model path; CP > 1 on a PD prefill server."""
    kw.setdefault("model_path", "unused")
    if kw.get("cp_size", 1) > 1:  # CP runs only on a PD prefill server
        kw.setdefault("disaggregation_mode", "prefill")
    return ServerArgs(**kw)


def registry_with_test_backends() -> TransferBackendRegistry:
    """The built-in backends plus two test-only ones, each lacking one capability."""
    reg = default_backend_registry()
    reg.register(BackendCapabilities("slice", owner_filtering=True, position_addressed=False))
    reg.register(BackendCapabilities("broadcast", owner_filtering=False, position_addressed=True))
    return reg


def to_argv(args: ServerArgs) -> list[str]:
    """The command line that should parse back to `args` (every field spelled out)."""
    argv: list[str] = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(value, bool):
            argv += [flag_name(f.name)] if value else []
        else:
            argv += [flag_name(f.name), "none" if value is None else str(value)]
    return argv
