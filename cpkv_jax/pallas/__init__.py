"""Pallas kernels, each beside a pure-jnp reference, interpret mode on CPU.

- `paged_gather`: materialization gather of rank-local pages into a contiguous buffer
  (Triton-lowerable; `impl="xla"` selects the reference for comparison).
- `lpf_copy`: the host cache's LF<->LPF copies - one layer's page spans gathered from the
  layer-first pool into contiguous staging (backup), or a staged span scattered back into
  the pool in place (load); validated page-aligned indices first (SPEC S3.2, S4.2).
"""
