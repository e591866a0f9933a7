"""Test session setup: 8 virtual CPU devices and runtime shape/type checks.

Both must happen before JAX (or cpkv_jax) is imported anywhere, hence module level.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxtyping import install_import_hook

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


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "tests expect 8 virtual CPU devices (XLA_FLAGS)"
