"""Pallas kernels, each beside a pure-jnp reference, interpret mode on CPU.

- `paged_gather`: materialization gather of rank-local pages into a contiguous buffer
  (Triton-lowerable; `impl="xla"` selects the reference for comparison).
LF<->LPF host-copy kernels arrive with the host cache.
"""
