"""The CP prefill server's parts: `build` (from `ServerArgs` to a ready scheduler on the
`cp` mesh), `scheduler` + `adder` (admission gates, SPEC S5-S9), `buffer_estimator` (the
CPU-only transient-memory estimator), and `engine` (the PD prefill-mode engine that ships
each finished request's owned pages to its decode server)."""
