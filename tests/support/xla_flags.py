"""The XLA flags the test suite compiles with (tests/conftest.py says why)."""

# LLVM -O0 and XLA:CPU's classic loop emitters: compiles of the tiny model's programs
# take about a third less time, and their run time does not matter in tests.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
