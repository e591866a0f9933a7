"""Launching SGLang's gateway `smg` in front of test servers (regular or PD mode)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from serving.demo import free_port
from serving.smg import smg_argv, smg_binary, wait_ready

__all__ = ["gateway", "smg_binary"]

STARTUP_S = 60.0


@contextlib.contextmanager
def gateway(
    workers: Sequence[str], log_path: Path, *, expect: int, headers: dict[str, str] | None = None
) -> Iterator[str]:
    """`smg launch` with `workers` (its worker arguments: `--worker-urls ...` or
    `serving.smg.pd_workers(...)`) on loopback ports, yielding its URL once `expect`
    workers are registered and ready; terminated after."""
    binary = smg_binary()
    assert binary is not None
    port = free_port()
    # Nothing is in flight at teardown: a short grace period.
    cmd = smg_argv(binary, port, workers, metrics_port=free_port(),
                   extra=["--shutdown-grace-period-secs", "1"])  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def exited() -> str | None:
        if proc.poll() is None:
            return None
        return f"smg exited with {proc.returncode}"

    try:
        try:
            wait_ready(url, expect, STARTUP_S, headers=headers, alive=exited)
        except (RuntimeError, TimeoutError) as e:
            pytest.fail(f"{e}\n{log_path.read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
