"""Benchmarks: memory and capacity figures at real model dimensions (`python -m benchmarks.X`)."""
