"""cpkv-jax: context-parallel prefill with shared (page-owned) KV for NSA models in JAX.

Core library: model config, the GLM-5 / DeepSeek-V3.2 model, paged KV, reference
generation. `cpkv_jax` never imports `serving` or `transfer`.
"""

__version__ = "0.1.0"
