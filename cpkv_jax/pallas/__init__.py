"""Pallas kernels (paged gather for materialization, LF<->LPF host copies).

Each kernel lives beside a pure-jnp reference and runs in interpret mode on CPU. The
first kernel arrives with the CP shared-KV issue; nothing is exported yet.
"""
