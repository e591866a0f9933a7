"""Shared pieces of the buffer-estimator tests (tests/serving/test_buffer_estimator*.py):
the CP size and pool geometry, the candidate batches and an `XLA_CPU` estimator for them.
The `cfg` / `mesh` / `estimator` fixtures are in tests/serving/conftest.py.
"""

from __future__ import annotations

from cpkv_jax.buckets import TRANSIENT_BLOCK_BYTES
from cpkv_jax.config import ModelConfig
from serving.prefill.buffer_estimator import XLA_CPU, BufferEstimator, RequestShape

CP = 8
PAGE = 16
PAGES_PER_RANK = 96
INDEX_K = "fp8_e4m3"

# Candidate batches, (extend tokens this step, cached prefix tokens) per request, chosen to
# put the peak in different places: tiny, latent-view bound (long prefix, short extend),
# logits bound (long extend), ragged multi-request, 4 rows.
BATCHES = {
    "one_token": [(1, 0)],
    "two_prompts": [(200, 0), (50, 0)],
    "long_prefix": [(16, 1000)],
    "long_extend": [(533, 0)],
    "ragged_3": [(300, 100), (20, 500), (5, 0)],
    "chunk_pair": [(64, 64), (64, 64)],
}


def cpu_estimator(
    cfg: ModelConfig, dtype: str = "float32", block_bytes: int = TRANSIENT_BLOCK_BYTES
) -> BufferEstimator:
    return BufferEstimator(
        cfg,
        cp_size=CP,
        page_size=PAGE,
        dtype=dtype,
        index_k_dtype=INDEX_K,
        profile=XLA_CPU,
        block_bytes=block_bytes,
    )


def shapes_of(batch):
    return [RequestShape(e, c) for e, c in batch]
