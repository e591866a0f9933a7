"""Test session setup: 8 virtual CPU devices, fast XLA:CPU compiles and runtime
shape/type checks.

Both must happen before JAX (or cpkv_jax) is imported anywhere, hence module level.
"""

import gc
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from support.xla_flags import FAST_COMPILE_FLAGS

# Bytecode caching on for the run, whatever the environment says (the dev machines set
# PYTHONDONTWRITEBYTECODE=1): every xdist worker and server subprocess imports the
# project through jaxtyping's import hook, which rewrites and compiles each module again
# without its cached bytecode, 2.5 s more per process (8.5 vs 6.0 s measured 2026-12-06).
# The caches land in `__pycache__` (git-ignored); children inherit the environment.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# XLA:CPU compiles the tests' programs at LLVM -O0 with the classic loop emitters: about
# 85% of a compile-bound module's time is XLA compiling tiny-model programs whose run
# time does not matter, and these flags cut the suite's pytest time by a quarter
# (1,142 -> 839 s in one run each, 2026-12-05; every test passing either way). Runs of
# the model itself (`make demo`, the servers, benchmarks) keep XLA's defaults;
# `tests/core/test_batch_invariant.py` repeats the bitwise checks that LLVM's
# vectorization could break (decoder layers, a chunked CP prefill) under the defaults
# (`CPKV_TEST_XLA_DEFAULT=1` runs the whole suite so). A jaxlib that lacks a flag would
# abort at start-up, so the flags are tried once in a child process first (the xdist
# workers inherit the result).
_FAST_COMPILE_ENV = "CPKV_TEST_FAST_COMPILE"  # "1"/"0" once decided for this run


def _fast_compile_flags_work() -> bool:
    env = {**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} {FAST_COMPILE_FLAGS}"}
    probe = "import jax.numpy as jnp; (jnp.arange(4.0) * 2).block_until_ready()"
    try:
        done = subprocess.run([sys.executable, "-c", probe], env=env, timeout=120,
                              capture_output=True)  # fmt: skip
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


if _FAST_COMPILE_ENV not in os.environ:
    fast = os.environ.get("CPKV_TEST_XLA_DEFAULT") != "1" and _fast_compile_flags_work()
    os.environ[_FAST_COMPILE_ENV] = "1" if fast else "0"
    if not fast and os.environ.get("CPKV_TEST_XLA_DEFAULT") != "1":
        print(f"tests: XLA rejected {FAST_COMPILE_FLAGS!r}; running with its defaults")
if os.environ[_FAST_COMPILE_ENV] == "1" and FAST_COMPILE_FLAGS not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" {FAST_COMPILE_FLAGS}"
# One directory per `make test` run, shared by every xdist worker (they inherit this
# environment from the controller) and the servers the tests start: JAX's persistent
# compilation cache lives there, so a program compiled once in the run (the tiny model's
# steps, which dozens of modules build again after `_release_compiled_programs`) is read
# back instead of compiled again. The controller removes it when the session ends.
_RUN_DIR_ENV = "CPKV_TEST_RUN_DIR"
_OWNS_RUN_DIR = _RUN_DIR_ENV not in os.environ
if _OWNS_RUN_DIR:
    os.environ[_RUN_DIR_ENV] = tempfile.mkdtemp(prefix="cpkv-tests-")
_RUN_DIR = os.environ[_RUN_DIR_ENV]
os.environ["XDG_CACHE_HOME"] = _RUN_DIR  # `--compilation-cache-dir auto` resolves here

import jaxtyping._import_hook as _jaxtyping_hook  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402


class _BoundaryTransformer(_jaxtyping_hook.JaxtypingTransformer):
    """jaxtyping's import-hook transformer, minus functions and classes defined inside a
    function body. jaxtyping decorates a def each time it executes, building two beartype
    checkers (milliseconds): a closure made per request or per step (the mock engine's
    per-row helpers, the HTTP handlers' callbacks) cost more than the work around it, and
    32-client load tests timed out on slower machines. Closures are not module
    boundaries; the functions, methods and classes they live in stay checked."""

    _depth = 0  # function bodies we are inside

    def visit_FunctionDef(self, node):
        nested = self._depth > 0
        self._no_type_check_level += nested
        self._depth += 1
        try:
            return super().visit_FunctionDef(node)
        finally:
            self._depth -= 1
            self._no_type_check_level -= nested

    def visit_AsyncFunctionDef(self, node):  # jaxtyping leaves these unchecked
        self._depth += 1
        try:
            self.generic_visit(node)
            return node
        finally:
            self._depth -= 1

    def visit_ClassDef(self, node):
        nested = self._depth > 0
        self._no_type_check_level += nested
        try:
            return super().visit_ClassDef(node)
        finally:
            self._no_type_check_level -= nested


# `_JaxtypingLoader.source_to_code` looks the transformer up in its module at each import.
_jaxtyping_hook.JaxtypingTransformer = _BoundaryTransformer

# jaxtyping annotations at module boundaries are checked (beartype) while tests run; an
# int passes for a float (PEP 484's numeric tower), as for any Python type checker.
# `transfer` is left out: checking every call there made its fault tests ~40% slower
# (sender and receiver threads race 2 s heartbeats on 2 cores); its annotations were
# checked this way once (2026-11-30) and fixed. The decorator string keys jaxtyping's
# bytecode cache (`*.opt-jaxtyping10<md5>.pyc`): `is_debug=False` (the default) is there
# so that checkouts holding bytecode from the old transformer do not reuse it.
install_import_hook(
    ["cpkv_jax", "serving"],
    "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True, is_debug=False))",
)

import jax  # noqa: E402
import pytest  # noqa: E402
from support import jax_time  # noqa: E402

from cpkv_jax import aot  # noqa: E402
from serving.compilation_cache import enable_compilation_cache  # noqa: E402

# Trace / lower / compile seconds per test module, reported at the end of the run.
_JAX_TIME = jax_time.install()
_WORKER_JAX_TIME: list[dict] = []  # the controller's: what each xdist worker reported

# The test processes use the same cache as the servers they start (JAX keys entries on
# the program, options, devices and versions; a hit is still counted as a compile by
# `serving.compile_events`, so the zero-compile checks mean the same with it on).
enable_compilation_cache("auto")

# Servers started by the tests (in-process, and the subprocesses that inherit this
# environment) compile only the common shapes before healthy (`--warmup common`, what
# the default `auto` does on CPU; on an accelerator it would compile every reachable
# shape, tens of seconds per fixture). The warm-up tests and the PD e2e / host-cache
# fixtures ask for `--warmup all` themselves.
os.environ["CPKV_WARMUP"] = "common"


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "tests expect 8 virtual CPU devices (XLA_FLAGS)"


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """`get(arch="glm_moe_dsa", **make_tiny_checkpoint_kwargs) -> Path`: each distinct tiny
    checkpoint written once per test process (seconds each on 2 cores) and shared by
    every module that asks for it. Tests only read them (a test that changes files
    copies the checkpoint first)."""
    from cpkv_jax.tools.make_tiny_checkpoint import make_tiny_checkpoint

    made: dict[tuple, Path] = {}

    def get(arch: str = "glm_moe_dsa", **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in made:
            # The directory is named "tiny": servers serve it as model "tiny".
            made[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(arch) / "tiny", arch, **kw)
        return made[key]

    return get


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


def pytest_collection_modifyitems(config, items):
    """Modules with `slow` tests run first, the longest (`slow(seconds=...)`, a measured
    figure) first among them (a stable sort keeps each file's own order):
    with `-n 2 --dist loadfile` a worker takes whole files in this order, so the long
    files start at once and the short ones fill in behind them, and both workers end
    at about the same time."""
    weight: dict = {}  # file -> seconds its slow mark states (0: unstated)
    for item in items:
        if (mark := item.get_closest_marker("slow")) is not None:
            weight[item.path] = max(weight.get(item.path, 0), mark.kwargs.get("seconds", 0))
    # The longest first, so that no long file starts last and runs alone at the end.
    items.sort(key=lambda item: (item.path not in weight, -weight.get(item.path, 0)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _JAX_TIME.module = item.nodeid.split("::")[0]


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand its figures to the controller
        workeroutput["jax_time"] = _JAX_TIME.as_dict()


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run without xdist has none
def pytest_testnodedown(node, error):
    if (part := getattr(node, "workeroutput", {}).get("jax_time")) is not None:
        _WORKER_JAX_TIME.append(part)


def pytest_terminal_summary(terminalreporter):
    parts = _WORKER_JAX_TIME or [_JAX_TIME.as_dict()]
    for line in jax_time.report(jax_time.merge(parts)):
        terminalreporter.write_line(line)
    limit_path = "/proc/sys/vm/max_map_count"
    if os.path.exists(limit_path):
        with open(limit_path) as f:
            limit = int(f.read())
        terminalreporter.write_line(
            f"memory maps at the end: {_memory_maps()} of vm.max_map_count {limit}"
        )


def pytest_unconfigure(config):
    if _OWNS_RUN_DIR:  # the controller (or a run without xdist), after every worker ended
        shutil.rmtree(_RUN_DIR, ignore_errors=True)
