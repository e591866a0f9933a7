"""SGLang's gateway `smg` in front of our servers: its command line and its readiness.

The demo (`--router smg`), the PD load run (`benchmarks.pd_load`) and the tests start the
real binary (PyPI `smg`, a dependency) through these, so they all run it the same way.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx


def smg_binary() -> str | None:
    """The `smg` of this environment (next to the interpreter), else one on PATH."""
    here = Path(sys.executable).parent / "smg"
    return str(here) if here.exists() else shutil.which("smg")


def pd_workers(prefill_url: str, bootstrap_port: int, decode_url: str) -> list[str]:
    """PD mode's worker arguments: the prefill with its bootstrap port, and the decode."""
    return [
        "--pd-disaggregation", "--prefill", prefill_url, str(bootstrap_port),
        "--decode", decode_url,
    ]  # fmt: skip


def smg_argv(
    binary: str, port: int, workers: Sequence[str], *, metrics_port: int, extra: Sequence[str] = ()
) -> list[str]:
    """`smg launch` on 127.0.0.1:`port` with `workers` (`--worker-urls ...` or
    `pd_workers(...)`). Its Prometheus port is given (the default 29000 may be taken) and
    it loads no tokenizer: our workers tokenize chat and completions themselves."""
    return [
        binary, "launch", "--host", "127.0.0.1", "--port", str(port), *workers,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--disable-tokenizer-autoload", "--log-level", "warn", *extra,
    ]  # fmt: skip


def ready_workers(url: str, headers: Mapping[str, str] | None = None) -> int:
    """How many workers the gateway lists as ready (0 while it does not answer)."""
    try:
        listed = httpx.get(url + "/workers", headers=headers, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return 0
    workers = listed.get("workers", []) if isinstance(listed, dict) else []
    return sum(w.get("status") == "ready" for w in workers)


def wait_ready(
    url: str,
    expect: int,
    timeout: float,
    *,
    headers: Mapping[str, str] | None = None,
    alive: Callable[[], str | None] = lambda: None,
) -> None:
    """Until the gateway at `url` lists `expect` ready workers; `alive` returns why the
    gateway cannot get there (its process exited), which raises at once."""
    deadline = time.monotonic() + timeout
    while ready_workers(url, headers) < expect:
        why = alive()
        if why is not None:
            raise RuntimeError(why)
        if time.monotonic() > deadline:
            raise TimeoutError(f"smg at {url} did not list {expect} ready workers in {timeout:g}s")
        time.sleep(0.2)
