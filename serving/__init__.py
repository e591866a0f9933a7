"""Serving: server arguments, prefill scheduler and admission gates, decode engine,
HTTP API and router. Wires `cpkv_jax` and `transfer` together; arrives with the
scheduler and serving issues (nothing is exported yet)."""
