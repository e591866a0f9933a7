"""Launching SGLang's gateway `smg` in front of test servers (regular or PD mode)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

STARTUP_S = 60.0


def smg_binary() -> str | None:
    """The `smg` of this environment (next to the interpreter), else one on PATH."""
    here = Path(sys.executable).parent / "smg"
    return str(here) if here.exists() else shutil.which("smg")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gateway(
    workers: Sequence[str], log_path: Path, *, expect: int, headers: dict[str, str] | None = None
) -> Iterator[str]:
    """`smg launch` with `workers` (its worker arguments: `--worker-urls ...` or PD's
    `--pd-disaggregation --prefill URL PORT --decode URL`) on loopback ports, yielding its
    URL once `expect` workers are registered and ready; terminated after."""
    binary = smg_binary()
    assert binary is not None
    port = free_port()
    # Loopback ports (its Prometheus port too: the default 29000 may be taken), without
    # the tokenizer the gateway would load from /model_info's path.
    cmd = [
        binary, "launch", "--host", "127.0.0.1", "--port", str(port),
        *workers,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--disable-tokenizer-autoload",
        "--shutdown-grace-period-secs", "1",  # nothing is in flight at teardown
        "--log-level", "warn",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"smg exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                # Until it listens, then a body without "workers" until it registers some.
                listed = httpx.get(url + "/workers", headers=headers, timeout=5).json()
                listed = listed.get("workers", [])
                if len(listed) == expect and all(w["status"] == "ready" for w in listed):
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"smg did not register the workers:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
