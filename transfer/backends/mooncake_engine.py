"""A small, checked wrapper around the Mooncake Transfer Engine (`mooncake.engine`).

It is the foundation of the `mooncake` PD transfer backend (SPEC S2): the decode side
registers its receive buffers once, tells the prefill ranks its `session_id` and buffer
addresses over the control plane, and each prefill rank writes its coalesced page runs
straight into them with `batch_write`.

Install: `pip install 'cpkv-jax[mooncake]'` (the `mooncake-transfer-engine-non-cuda`
wheel; GPU deployments may install the CUDA build `mooncake-transfer-engine` instead,
both provide the same `mooncake.engine` module). The wheel's `engine.so` loads these
system libraries, which the wheel does not bundle: `libibverbs.so.1` (Debian
`libibverbs1`), `libnuma.so.1` (`libnuma1`) and `libcurl.so.4` (`libcurl4`); `.ci/run`
installs them. When the import fails, `mooncake_available()` says why and what to install,
and `MooncakeEngine(...)` raises `MooncakeUnavailable` with the same reason.

Engine facts this wrapper relies on (mooncake-transfer-engine 0.3.13, found by testing):

- `initialize(local_hostname, "P2PHANDSHAKE", protocol, device_name) -> int` (0 = ok)
  starts a P2P-handshake engine (no metadata server). The RPC port is picked by the
  engine (range `MC_MIN_RPC_PORT`..`MC_MAX_RPC_PORT`, ~15000-17000); a port written in the
  hostname is ignored in this mode. Peers address an engine as `session_id` =
  `"host:rpc_port"`. The engine LISTENS ON ALL INTERFACES (0.0.0.0) whatever the hostname,
  and its listening sockets are inherited by child processes started later.
- Several engines can live in one process (the benchmark and tests use two). The memory
  allocator is process-global and fixed by the first engine's protocol. `"rdma"` without
  RDMA devices silently ends up on TCP.
- `transfer_submit_write(session_id, local_ptr, remote_ptr, nbytes) -> batch_id` starts
  one transfer (0 or (uint64) -1 when refused, e.g. a dead peer) and
  `transfer_check_status(batch_id) -> int` polls it without blocking: 1 done (batch
  freed), 0 running, -1 failed (freed), -2 timed out (not freed: the engine offers no way
  to cancel or free it). `batch_write` submits one transfer per descriptor and polls
  them with short sleeps. The remote side checks that every destination range lies
  inside one of ITS registered buffers (else -1); the TCP transport does NOT check local
  source ranges, so this wrapper checks them against its own registrations. More than
  ~2000 transfers in flight to one peer fail ("TCP lane queue-full rejection"):
  `batch_write` keeps at most `max_batch` (default 1024) in flight, and the writes of one
  session go one call at a time.
- Not used: `batch_transfer_sync_write` (blocks, releases the GIL) spins on the batch
  status without pausing; on a 2-core host that thread takes the CPU the engine's socket
  threads need: one 673 MB loopback write ran at 2.2-2.4 GB/s through it against
  3.2-4.1 GB/s submitted and polled (2026-11-30). The async batch API
  (`batch_transfer_async_write` + `get_batch_transfer_status`): the status call spins
  the same way until completion and frees the batch, and a second status call on the
  same batch id crashes the process (double free); `transfer_check_status` of a
  multi-descriptor batch looks at its first descriptor only.
- A dead peer (process gone, nothing listening) fails fast (submit refused, or -1). A
  peer that is alive but stalled (e.g. SIGSTOP) leaves its transfers running until a
  timeout: the engine's own `MC_TRANSFER_TIMEOUT` (whole seconds, read when the engine
  object is constructed, at least 5 s, 30 s when unset; status -2) or, whichever comes
  first, `transfer_timeout_s` + 1 s per GiB, which `batch_write` enforces itself. The
  single-transfer sync call `transfer_sync_write` ignores the engine's timeout (it
  blocked until the peer's TCP connection reset, 25 s here).
- Destroying an engine takes ~1 s (its metadata thread winds down); `close()` does it.
- Logs go to stderr through glog; set `GLOG_minloglevel=2` in the environment before
  `mooncake` is imported to keep only errors.

Lifecycle: `MooncakeEngine(...)` -> `register(...)` each buffer once (before telling peers
its address) -> any number of `batch_write` / `write` -> `close()` (or a `with` block).
Registered numpy arrays are kept alive by the wrapper until they are unregistered or the
engine is closed; raw pointers are the caller's to keep valid.

Thread safety: `batch_write`, `write` and `probe` may be called from several threads at
once (the engine releases the GIL and is built for concurrent transfers); writes to the
same session are serialized by a per-session lock so that the per-peer queue limit above
holds. `register` / `unregister` are safe to call concurrently with writes to other
buffers. `close()` waits for in-flight writes to return, then refuses new calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cpkv_jax.errors import CpkvError

P2P_HANDSHAKE = "P2PHANDSHAKE"
DEFAULT_MAX_BATCH = 1024  # transfers in flight per write call; the TCP per-peer queue holds ~2000
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
# Pauses between status polls of a write: from 50 us, doubling while nothing completes,
# up to 1 ms (the most a poll adds to a write's latency).
_POLL_PAUSE_MIN_S = 5e-5
_POLL_PAUSE_MAX_S = 1e-3
_BATCH_ID_ERROR = 1 << 63  # submit returns 0 or (uint64) -1 when it refuses a transfer

# Shared objects engine.so loads that the wheel does not bundle -> the Debian package.
_DEBIAN_PACKAGE_OF_LIB = {
    "libibverbs.so.1": "libibverbs1",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
    "librdmacm.so.1": "librdmacm1",
}
_CUDA_LIBS = ("libcudart.so", "libcuda.so")

_import_lock = threading.Lock()
_env_lock = threading.Lock()  # MC_TRANSFER_TIMEOUT is set around initialize() only
_engine_module: Any = None
_import_error: str | None = None


class MooncakeError(CpkvError):
    """Base class of the errors this wrapper raises."""


class MooncakeUnavailable(MooncakeError, ImportError):
    """The Mooncake Transfer Engine cannot be loaded here; `reason` says why and what to do."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MooncakeTransferError(MooncakeError, RuntimeError):
    """The engine refused or failed a call (non-zero return code, kept in `code`)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


def _explain_import_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, ModuleNotFoundError) and (e.name or "").startswith("mooncake"):
        return (
            f"the Mooncake Transfer Engine is not installed ({text}); "
            "install it with: pip install 'cpkv-jax[mooncake]'"
        )
    m = re.search(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file", str(e))
    if m:
        lib = m.group(1)
        if lib.startswith(_CUDA_LIBS):
            return (
                f"mooncake.engine needs the CUDA library {lib} ({text}); this is the CUDA "
                "build of the wheel: on a machine without CUDA install "
                "mooncake-transfer-engine-non-cuda instead of mooncake-transfer-engine"
            )
        pkg = _DEBIAN_PACKAGE_OF_LIB.get(lib)
        hint = f"apt-get install {pkg}" if pkg else f"install the system library {lib}"
        return f"mooncake.engine needs the system library {lib} ({text}); {hint}"
    return f"mooncake.engine could not be imported ({text})"


def _load_engine_module() -> Any:
    """`mooncake.engine`, imported once; raises `MooncakeUnavailable` with the reason."""
    global _engine_module, _import_error
    with _import_lock:
        if _engine_module is None and _import_error is None:
            try:
                import mooncake.engine as engine_module
            except Exception as e:  # ImportError / OSError from the loader
                _import_error = _explain_import_error(e)
            else:
                _engine_module = engine_module
        if _engine_module is None:
            raise MooncakeUnavailable(str(_import_error))
        return _engine_module


def mooncake_available() -> tuple[bool, str]:
    """(True, "") when `mooncake.engine` imports here, else (False, the reason)."""
    try:
        _load_engine_module()
    except MooncakeUnavailable as e:
        return False, e.reason
    return True, ""


@dataclasses.dataclass(frozen=True)
class RegisteredBuffer:
    """A memory range registered with one engine; `ptr` is what peers write to."""

    ptr: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.ptr + self.nbytes


def _as_ptr_and_nbytes(buf: Any, nbytes: int | None) -> tuple[int, int, Any]:
    """(address, size, object to keep alive) of a numpy array, buffer object or pointer."""
    if isinstance(buf, (int, np.integer)) and not isinstance(buf, bool):
        if nbytes is None:
            raise ValueError("register(ptr, nbytes): a raw pointer needs nbytes")
        return int(buf), int(nbytes), None
    if not isinstance(buf, np.ndarray):
        try:
            buf = np.frombuffer(buf, dtype=np.uint8)  # shares memory; keeps `buf` alive
        except TypeError:
            raise TypeError(
                f"register() takes a numpy array, a buffer object or an int pointer, "
                f"not {type(buf).__name__}"
            ) from None
    if not buf.flags.c_contiguous:
        raise ValueError("register() needs a C-contiguous array (its bytes must be one range)")
    size = buf.nbytes if nbytes is None else int(nbytes)
    if size > buf.nbytes:
        raise ValueError(f"register(): nbytes={size} exceeds the array's {buf.nbytes} bytes")
    return int(buf.ctypes.data), size, buf


def _int_array(values: Any, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        arr = np.asarray([int(v) for v in np.ravel(arr)], dtype=np.int64)
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what}: value out of range")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{what}: negative value {int(arr.min())}")
    return arr


class MooncakeEngine:
    """One Mooncake Transfer Engine in P2P-handshake mode (see the module docstring).

    `hostname` is the address peers reach this engine at (here 127.0.0.1); `protocol` is
    "tcp" (loopback, any host) or "rdma" (a cluster with RDMA NICs; `device_name` picks
    them, "" = auto-discover). `transfer_timeout_s` bounds each write to a stalled peer:
    `batch_write` gives up this long (plus one second per GiB written) after it starts;
    it also becomes the engine's own `MC_TRANSFER_TIMEOUT` (whole seconds, at least 5).
    None = the environment's value, or the engine's default of 30 s. `max_batch` is the
    most descriptors in flight to the engine at once.
    """

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        *,
        device_name: str = "",
        transfer_timeout_s: float | None = DEFAULT_TRANSFER_TIMEOUT_S,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        module = _load_engine_module()
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.hostname = hostname
        self.protocol = protocol
        self.max_batch = int(max_batch)
        self._lock = threading.Lock()  # registrations, in-flight count, closed flag
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._closed = False
        self._session_locks: dict[str, threading.Lock] = {}
        self._buffers: dict[int, tuple[RegisteredBuffer, Any]] = {}
        self._starts = np.zeros(0, np.int64)  # sorted registered ranges, for local checks
        self._ends = np.zeros(0, np.int64)

        with _env_lock:  # the engine reads MC_TRANSFER_TIMEOUT when it is constructed
            saved = os.environ.get("MC_TRANSFER_TIMEOUT")
            if transfer_timeout_s is not None:
                os.environ["MC_TRANSFER_TIMEOUT"] = str(max(1, math.ceil(transfer_timeout_s)))
            try:
                engine = module.TransferEngine()
                rc = engine.initialize(hostname, P2P_HANDSHAKE, protocol, device_name)
            finally:
                if transfer_timeout_s is not None:
                    if saved is None:
                        os.environ.pop("MC_TRANSFER_TIMEOUT", None)
                    else:
                        os.environ["MC_TRANSFER_TIMEOUT"] = saved
        if rc != 0:
            raise MooncakeTransferError(
                f"Mooncake engine initialize({hostname!r}, {P2P_HANDSHAKE!r}, {protocol!r}, "
                f"{device_name!r}) failed with code {rc}",
                rc,
            )
        self._engine = engine
        if transfer_timeout_s is None:  # what the engine itself read
            env = os.environ.get("MC_TRANSFER_TIMEOUT")
            transfer_timeout_s = max(5, int(env)) if env else DEFAULT_TRANSFER_TIMEOUT_S
        self.transfer_timeout_s = float(transfer_timeout_s)
        self.rpc_port = int(engine.get_rpc_port())
        self.session_id = f"{hostname}:{self.rpc_port}"

    # --- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> MooncakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._buffers)} buffers"
        return f"MooncakeEngine({self.session_id}, {self.protocol}, {state})"

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Wait for in-flight writes, unregister every buffer and destroy the engine (~1 s).

        Idempotent. Peers writing to this engine's buffers afterwards get an error."""
        with self._idle:
            if self._closed:
                return
            self._closed = True
            while self._in_flight:
                self._idle.wait()
            engine, self._engine = self._engine, None
            ptrs = list(self._buffers)
        for ptr in ptrs:
            with contextlib.suppress(Exception):
                engine.unregister_memory(ptr)
        with self._lock:
            self._buffers.clear()
            self._rebuild_ranges()
        del engine  # the pybind destructor stops the engine's threads and sockets

    def _check_open(self) -> None:
        if self._closed:
            raise MooncakeError(f"Mooncake engine {self.session_id} is closed")

    @contextlib.contextmanager
    def _call(self):
        with self._lock:
            self._check_open()
            self._in_flight += 1
        try:
            yield self._engine
        finally:
            with self._idle:
                self._in_flight -= 1
                if not self._in_flight:
                    self._idle.notify_all()

    # --- registration ------------------------------------------------------------------

    def register(self, buf: Any, nbytes: int | None = None) -> RegisteredBuffer:
        """Register a buffer ONCE (registration is slow on RDMA); returns its handle.

        `buf`: a C-contiguous numpy array (kept alive until unregistered / closed), any
        buffer object (bytearray, memoryview), or an int address with `nbytes`. Ranges
        must not overlap an already registered one."""
        ptr, size, keep = _as_ptr_and_nbytes(buf, nbytes)
        if size <= 0:
            raise ValueError(f"register(): cannot register {size} bytes")
        with self._call() as engine, self._lock:
            for other, _ in self._buffers.values():
                if ptr < other.end and other.ptr < ptr + size:
                    raise MooncakeError(
                        f"register(): [{ptr:#x}, +{size}) overlaps the registered "
                        f"[{other.ptr:#x}, +{other.nbytes})"
                    )
            rc = engine.register_memory(ptr, size)
            if rc != 0:
                raise MooncakeTransferError(
                    f"register_memory({ptr:#x}, {size}) failed with code {rc}", rc
                )
            handle = RegisteredBuffer(ptr, size)
            self._buffers[ptr] = (handle, keep)
            self._rebuild_ranges()
        return handle

    def unregister(self, buf: RegisteredBuffer | int | np.ndarray) -> None:
        """Unregister a buffer registered before (by handle, address or the same array)."""
        if isinstance(buf, RegisteredBuffer):
            ptr = buf.ptr
        elif isinstance(buf, np.ndarray):
            ptr = int(buf.ctypes.data)
        else:
            ptr = int(buf)
        with self._call() as engine, self._lock:
            if ptr not in self._buffers:
                raise MooncakeError(f"unregister(): {ptr:#x} is not a registered buffer")
            rc = engine.unregister_memory(ptr)
            del self._buffers[ptr]
            self._rebuild_ranges()
        if rc != 0:
            raise MooncakeTransferError(f"unregister_memory({ptr:#x}) failed with code {rc}", rc)

    def registered(self) -> tuple[RegisteredBuffer, ...]:
        with self._lock:
            return tuple(h for h, _ in self._buffers.values())

    def _rebuild_ranges(self) -> None:  # caller holds self._lock
        handles = sorted((h for h, _ in self._buffers.values()), key=lambda h: h.ptr)
        self._starts = np.array([h.ptr for h in handles], np.int64)
        self._ends = np.array([h.end for h in handles], np.int64)

    def _check_local(self, ptrs: np.ndarray, lengths: np.ndarray) -> None:
        with self._lock:
            starts, ends = self._starts, self._ends
        idx = np.searchsorted(starts, ptrs, side="right") - 1
        ok = idx >= 0
        ok[ok] &= ptrs[ok] + lengths[ok] <= ends[idx[ok]]
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise MooncakeError(
                f"local range [{int(ptrs[i]):#x}, +{int(lengths[i])}) (descriptor {i}) is "
                f"not inside a buffer registered with {self.session_id}"
            )

    # --- transfers ---------------------------------------------------------------------

    def _session_lock(self, session_id: str) -> threading.Lock:
        with self._lock:
            return self._session_locks.setdefault(session_id, threading.Lock())

    def batch_write(
        self,
        session_id: str,
        local_ptrs: Sequence[int] | np.ndarray,
        remote_ptrs: Sequence[int] | np.ndarray,
        lengths: Sequence[int] | np.ndarray,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        """Write `lengths[i]` bytes from local `local_ptrs[i]` to the peer's `remote_ptrs[i]`.

        Blocks until every byte is written; raises `MooncakeTransferError` (with the
        engine's code) if the peer refuses a range (not in its registered buffers), is
        dead or unreachable, or stalls past the transfer timeout, and `MooncakeError`
        before sending anything if a local range is not in a registered buffer. Order
        of the descriptors does not matter; zero-length ones are skipped. On an error,
        other descriptors may already have landed (in flight ones are waited for, except
        past the timeout: `_write_polled`). `on_start` is called once the call's turn on
        the peer has come (writes to one peer go one call at a time), right before its
        first submit; not when there is nothing to write or a local range is bad."""
        local = _int_array(local_ptrs, "local_ptrs")
        remote = _int_array(remote_ptrs, "remote_ptrs")
        sizes = _int_array(lengths, "lengths")
        if not local.size == remote.size == sizes.size:
            raise ValueError(
                f"batch_write: {local.size} local_ptrs, {remote.size} remote_ptrs and "
                f"{sizes.size} lengths differ in number"
            )
        keep = sizes > 0
        if not keep.all():
            local, remote, sizes = local[keep], remote[keep], sizes[keep]
        if not sizes.size:
            return
        self._check_local(local, sizes)
        # The engine's own timeout rule: the transfer timeout plus one second per GiB.
        deadline = time.monotonic() + self.transfer_timeout_s + float(sizes.sum()) / (1 << 30)
        with self._call() as engine, self._session_lock(session_id):
            if on_start is not None:  # this call's turn on the peer has come
                on_start()
            for lo in range(0, sizes.size, self.max_batch):
                hi = min(lo + self.max_batch, sizes.size)
                failure = self._write_polled(
                    engine, session_id, local[lo:hi], remote[lo:hi], sizes[lo:hi], deadline
                )
                if failure is not None:
                    code, what = failure
                    raise MooncakeTransferError(
                        f"batch write to {session_id} failed with code {code} ({what}; "
                        f"descriptors {lo}..{hi - 1} "
                        f"of {sizes.size}, {int(sizes[lo:hi].sum())} bytes): the peer is dead, "
                        "unreachable or stalled, or a remote range is not inside a buffer the "
                        "peer registered",
                        code,
                    )

    def _write_polled(
        self,
        engine: Any,
        session_id: str,
        local: np.ndarray,
        remote: np.ndarray,
        sizes: np.ndarray,
        deadline: float,
    ) -> tuple[int, str] | None:
        """Submit one transfer per descriptor, then poll them, sleeping between polls;
        returns None when all completed, else (code, what went wrong).

        Not `batch_transfer_sync_write`: that call spins on the status without pausing,
        and on a 2-core host the spinning thread takes the CPU the engine's own socket
        threads need (a 673 MB loopback write: 2.2-2.4 GB/s with it, 3.2-4.1 GB/s polled).
        A failed submit stops further submits; descriptors already in flight are still
        waited for (to completion, failure or the deadline), so nothing of this call is
        still moving when it returns - except past the deadline, where the engine gives
        no way to cancel (the batch ids of stalled transfers are not freed, as in the
        engine's own sync call)."""
        pending: list[int] = []
        failure: tuple[int, str] | None = None
        for i in range(sizes.size):
            batch_id = engine.transfer_submit_write(
                session_id, int(local[i]), int(remote[i]), int(sizes[i])
            )
            if not 0 < batch_id < _BATCH_ID_ERROR:
                failure = (-1, f"submit of descriptor {i} refused")
                break
            pending.append(batch_id)
        pause = _POLL_PAUSE_MIN_S
        while pending:
            still = []
            for batch_id in pending:
                rc = engine.transfer_check_status(batch_id)
                if rc == 0:
                    still.append(batch_id)
                elif rc != 1 and failure is None:  # -1 failed (freed), -2 engine timeout
                    failure = (int(rc), "transfer timed out" if rc == -2 else "transfer failed")
            # Back off while nothing finishes (a long transfer costs few polls), poll
            # quickly again once something did (the rest are likely close behind).
            pause = (
                _POLL_PAUSE_MIN_S
                if len(still) < len(pending)
                else min(2 * pause, _POLL_PAUSE_MAX_S)
            )
            pending = still
            if pending and time.monotonic() > deadline:
                return (-2, f"{len(pending)} transfer(s) still running after the deadline")
            if pending:
                time.sleep(pause)
        return failure

    def write(self, session_id: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        """One contiguous write: `batch_write` with one descriptor (same checks, errors and
        transfer timeout; the engine's single-transfer call ignores that timeout)."""
        self.batch_write(session_id, [local_ptr], [remote_ptr], [nbytes])

    def blocking_write(self, session_id: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        """One contiguous write through the binding's own blocking batch call
        (`batch_transfer_sync_write`, which spins on the status: module docstring), for
        benchmarks that compare it with `write`. Same checks and errors as `write`."""
        local, sizes = _int_array([local_ptr], "local_ptr"), _int_array([nbytes], "nbytes")
        self._check_local(local, sizes)
        with self._call() as engine, self._session_lock(session_id):
            rc = engine.batch_transfer_sync_write(session_id, [local_ptr], [remote_ptr], [nbytes])
        if rc != 0:
            raise MooncakeTransferError(
                f"blocking write to {session_id} failed with code {rc} ({nbytes} bytes)", rc
            )

    def probe(self, session_id: str) -> bool:
        """Whether the peer engine answers (a JSON-RPC probe; fast on a dead port)."""
        with self._call() as engine:
            return engine.send_probe(session_id) == 0
