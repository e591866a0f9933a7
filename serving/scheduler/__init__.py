"""Prefill scheduler: admission (PrefillAdder gates) and the transient-buffer estimator."""
