"""Test session setup: 8 virtual CPU devices and runtime shape/type checks.

Both must happen before JAX (or cpkv_jax) is imported anywhere, hence module level.
"""

import gc
import logging
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Servers the tests start (`--compilation-cache-dir auto`) cache their compiled programs
# here, not in the user's cache directory; removed when the session ends.
_XDG_CACHE = tempfile.mkdtemp(prefix="cpkv-tests-cache-")
os.environ["XDG_CACHE_HOME"] = _XDG_CACHE

from jaxtyping import install_import_hook  # noqa: E402

# jaxtyping annotations at module boundaries are checked (beartype) while tests run; an
# int passes for a float (PEP 484's numeric tower), as for any Python type checker.
# `transfer` is left out: checking every call there made its fault tests ~40% slower
# (sender and receiver threads race 2 s heartbeats on 2 cores); its annotations were
# checked this way once (2026-11-30) and fixed.
install_import_hook(
    ["cpkv_jax", "serving"],
    "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))",
)

import jax  # noqa: E402
import pytest  # noqa: E402

from cpkv_jax import aot  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "tests expect 8 virtual CPU devices (XLA_FLAGS)"


@pytest.fixture(autouse=True)
def _drop_cli_log_handlers():
    """A test that runs a command's `main` in-process (`configure_logging`: basicConfig
    with force) leaves a root handler on that test's captured stderr, and every later
    log line from any thread fails on the closed stream ("--- Logging error ---" in the
    CI log). Drop such handlers and restore the root level after each test."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler and handler not in before:
            root.removeHandler(handler)
    root.setLevel(level)


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop every compiled XLA program after each test module.

    XLA:CPU maps each executable's code into the process (~17 memory maps per program,
    measured with JAX 0.10): one pytest process compiling the whole suite's ~4,000
    programs reaches Linux's `vm.max_map_count` (65,530), LLVM then fails with "Cannot
    allocate memory" and the next compile segfaults. Clearing JAX's caches once the
    module's fixtures are gone returns the maps (a server keeps its own programs
    alive, and the limit binds only a process that compiles suites' worth of them)."""
    yield
    gc.collect()
    jax.clear_caches()
    aot.clear_all()  # the servers' ahead-of-time step executables
    gc.collect()


def pytest_terminal_summary(terminalreporter):
    limit_path = "/proc/sys/vm/max_map_count"
    if os.path.exists(limit_path):
        with open(limit_path) as f:
            limit = int(f.read())
        terminalreporter.write_line(
            f"memory maps at the end: {_memory_maps()} of vm.max_map_count {limit}"
        )


def pytest_unconfigure(config):
    shutil.rmtree(_XDG_CACHE, ignore_errors=True)
