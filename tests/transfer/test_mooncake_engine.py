"""transfer/backends/mooncake_engine: the Mooncake Transfer Engine wrapper, over loopback TCP.

Where the engine cannot load (wheel not installed, a system library missing) every
engine test skips with the reason `mooncake_available()` gives, printed in the skip
message (`-ra` lists it). Every engine call runs in a worker thread joined with a
timeout, so a hung engine fails a test instead of hanging the suite.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from transfer.backends import mooncake_engine as me
from transfer.page_plan import PROTOCOL_VERSION, LayoutDescriptor, plan_request

AVAILABLE, REASON = me.mooncake_available()
needs_mooncake = pytest.mark.skipif(
    not AVAILABLE, reason=f"Mooncake Transfer Engine unavailable: {REASON}"
)
CALL_TIMEOUT_S = 20.0
REPO = Path(__file__).resolve().parents[2]


def bounded(fn, *args, timeout: float = CALL_TIMEOUT_S):
    """fn(*args) in a daemon thread; its result, its exception, or a failure on timeout."""
    out: dict[str, object] = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {timeout} s")
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


@pytest.fixture(scope="module")
def engines():
    if not AVAILABLE:
        pytest.skip(f"Mooncake Transfer Engine unavailable: {REASON}")
    sender = me.MooncakeEngine("127.0.0.1", "tcp", transfer_timeout_s=10)
    receiver = me.MooncakeEngine("127.0.0.1", "tcp", transfer_timeout_s=10)
    yield sender, receiver
    bounded(sender.close)
    bounded(receiver.close)


# --- no engine needed ---------------------------------------------------------------------


def test_availability_reason_is_reported():
    ok, reason = me.mooncake_available()
    assert isinstance(ok, bool)
    assert ok == (reason == "")
    if not ok:  # printed so a CI log shows why the engine tests skip
        print(f"Mooncake unavailable: {reason}")


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ModuleNotFoundError("No module named 'mooncake'", name="mooncake"), "pip install"),
        (
            ImportError("libibverbs.so.1: cannot open shared object file: No such file"),
            "apt-get install libibverbs1",
        ),
        (
            ImportError("libnuma.so.1: cannot open shared object file: No such file"),
            "apt-get install libnuma1",
        ),
        (
            ImportError("libcudart.so.12: cannot open shared object file: No such file"),
            "mooncake-transfer-engine-non-cuda",
        ),
        (ImportError("undefined symbol: foo"), "undefined symbol: foo"),
    ],
)
def test_import_errors_are_explained(error, expected):
    assert expected in me._explain_import_error(error)


def test_unavailable_error_carries_reason():
    e = me.MooncakeUnavailable("why not")
    assert e.reason == "why not"
    assert isinstance(e, ImportError)


# --- engine -------------------------------------------------------------------------------


@needs_mooncake
def test_session_ids(engines):
    sender, receiver = engines
    for e in engines:
        host, port = e.session_id.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) == e.rpc_port > 0
    assert sender.session_id != receiver.session_id
    assert bounded(sender.probe, receiver.session_id)


@needs_mooncake
def test_scattered_batch_write_lands_exactly(engines):
    sender, receiver = engines
    rng = np.random.default_rng(1234)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = rng.integers(0, 256, 1 << 20, dtype=np.uint8)  # random, so gaps are checkable
    before = dst.copy()
    s = sender.register(src)
    d = receiver.register(dst)
    try:
        # (src_offset, dst_offset, length): not in order, gaps on both sides, odd sizes,
        # one larger than the engine's slices.
        descs = [
            (700_000, 10, 4096),
            (5, 900_000, 1),
            (123_457, 200_000, 65_537),
            (0, 600_000, 300_001),
            (1_000_000, 5000, 3333),
        ]
        bounded(
            sender.batch_write,
            receiver.session_id,
            [s.ptr + so for so, _, _ in descs],
            [d.ptr + do for _, do, _ in descs],
            [n for _, _, n in descs],
        )
        expected = before.copy()
        written = np.zeros(dst.size, bool)
        for so, do, n in descs:
            expected[do : do + n] = src[so : so + n]
            written[do : do + n] = True
        np.testing.assert_array_equal(dst, expected)
        np.testing.assert_array_equal(dst[~written], before[~written])  # gaps untouched
    finally:
        sender.unregister(s)
        receiver.unregister(d)


@needs_mooncake
def test_many_descriptors_are_chunked(engines):
    """More descriptors than the engine's per-peer TCP queue takes in one call (~2000)."""
    sender, receiver = engines
    n, size = 5000, 64
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros(n * size, np.uint8)
    s, d = sender.register(src), receiver.register(dst)
    try:
        perm = rng.permutation(n)
        bounded(
            sender.batch_write,
            receiver.session_id,
            s.ptr + np.arange(n) * size,
            d.ptr + perm * size,
            np.full(n, size),
        )
        np.testing.assert_array_equal(
            dst.reshape(n, size)[perm], src.reshape(n, size), err_msg="page scatter"
        )
    finally:
        sender.unregister(s)
        receiver.unregister(d)


@needs_mooncake
def test_concurrent_writers(engines):
    """Several threads (as several CP ranks would) writing disjoint ranges at once."""
    sender, receiver = engines
    threads_n, n, size = 4, 3000, 256
    rng = np.random.default_rng(17)
    src = rng.integers(0, 256, (threads_n, n * size), dtype=np.uint8)
    dst = np.zeros((threads_n, n * size), np.uint8)
    s, d = sender.register(src), receiver.register(dst)
    perms = [rng.permutation(n) for _ in range(threads_n)]
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            row = t * n * size
            sender.batch_write(
                receiver.session_id,
                s.ptr + row + np.arange(n) * size,
                d.ptr + row + perms[t] * size,
                np.full(n, size),
            )
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=writer, args=(t,), daemon=True) for t in range(threads_n)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join(CALL_TIMEOUT_S)
        assert not any(w.is_alive() for w in workers), "a writer hung"
        assert not errors, errors
        for t in range(threads_n):
            np.testing.assert_array_equal(
                dst[t].reshape(n, size)[perms[t]], src[t].reshape(n, size)
            )
    finally:
        sender.unregister(s)
        receiver.unregister(d)


@needs_mooncake
def test_page_plan_descriptors_rebuild_the_layout(engines):
    """A 2-rank plan's `RankDescriptors` written into decode buffers chosen by position."""
    sender, receiver = engines
    layout = LayoutDescriptor(
        protocol_version=PROTOCOL_VERSION,
        page_size=4,
        num_layers=3,
        full_indexer_layers=(1,),
        kv_cache_dim=6,
        latent_dtype="bfloat16",
        index_head_dim=4,
        index_k_dtype="float8_e4m3fn",
        has_index_scale=True,
    )
    cp, tokens, pool_pages = 2, 37, 16  # 10 pages, a partial tail page
    n = -(-tokens // layout.page_size)
    rng = np.random.default_rng(5)
    src_local = np.array([1 + p // cp for p in range(n)])  # lane-local pages, in order
    dst_pages = rng.permutation(np.arange(1, pool_pages))[:n]
    plan = plan_request(tokens, layout.page_size, cp, src_local, dst_pages)
    buffers = layout.buffers()
    page_bytes = [layout.page_bytes(k, layer) for k, layer in buffers]
    srcs = [
        [rng.integers(0, 256, (pool_pages, pb), dtype=np.uint8) for pb in page_bytes]
        for _ in range(cp)
    ]
    dsts = [rng.integers(0, 256, (pool_pages, pb), dtype=np.uint8) for pb in page_bytes]
    before = [a.copy() for a in dsts]
    handles = [sender.register(a) for rank in srcs for a in rank]
    handles_dst = [receiver.register(a) for a in dsts]
    try:
        for rd in plan.descriptors(layout):
            src_base = np.array([a.ctypes.data for a in srcs[rd.rank]], np.int64)
            dst_base = np.array([a.ctypes.data for a in dsts], np.int64)
            order = rng.permutation(len(rd))  # descriptor order must not matter
            bounded(
                sender.batch_write,
                receiver.session_id,
                (src_base[rd.buffer] + rd.src_offset)[order],
                (dst_base[rd.buffer] + rd.dst_offset)[order],
                rd.nbytes[order],
            )
        for b in range(len(buffers)):
            expected = before[b].copy()
            for p in range(n):
                expected[dst_pages[p]] = srcs[p % cp][b][src_local[p]]
            np.testing.assert_array_equal(dsts[b], expected, err_msg=f"buffer {buffers[b]}")
    finally:
        for h in handles:
            sender.unregister(h)
        for h in handles_dst:
            receiver.unregister(h)


@needs_mooncake
def test_single_write_and_registration_handles(engines):
    sender, receiver = engines
    src = bytearray(np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    dst = np.zeros(8192, np.uint8)
    s = sender.register(src)
    d = receiver.register(dst.ctypes.data, dst.nbytes)  # raw pointer + size
    try:
        assert s in sender.registered() and d in receiver.registered()
        bounded(sender.write, receiver.session_id, s.ptr + 100, d.ptr + 4000, 3000)
        assert dst[4000:7000].tobytes() == bytes(src[100:3100])
        assert not dst[:4000].any() and not dst[7000:].any()
        with pytest.raises(me.MooncakeError, match="overlaps"):
            receiver.register(dst[100:200])
    finally:
        sender.unregister(s)
        receiver.unregister(dst)  # by the same array


@needs_mooncake
def test_unregistered_remote_range_is_refused(engines):
    sender, receiver = engines
    src = np.random.default_rng(9).integers(0, 256, 4096, dtype=np.uint8)
    dst = np.zeros(4096, np.uint8)
    stray = np.zeros(4096, np.uint8)  # never registered with the receiver
    s, d = sender.register(src), receiver.register(dst)
    try:
        with pytest.raises(me.MooncakeTransferError, match="failed with code") as info:
            bounded(sender.batch_write, receiver.session_id, [s.ptr], [stray.ctypes.data], [100])
        assert info.value.code is not None and info.value.code != 0
        assert not stray.any()
        # a range running past the end of a registered buffer
        with pytest.raises(me.MooncakeTransferError):
            bounded(sender.write, receiver.session_id, s.ptr, d.ptr + 4000, 200)
        # the engine still works afterwards
        bounded(sender.write, receiver.session_id, s.ptr, d.ptr, 4096)
        np.testing.assert_array_equal(dst, src)
    finally:
        sender.unregister(s)
        receiver.unregister(d)


@needs_mooncake
def test_unregistered_local_range_is_refused_before_sending(engines):
    sender, receiver = engines
    dst = np.zeros(4096, np.uint8)
    d = receiver.register(dst)
    src = np.ones(4096, np.uint8)  # not registered with the sender
    try:
        with pytest.raises(me.MooncakeError, match="not inside a buffer registered"):
            sender.batch_write(receiver.session_id, [src.ctypes.data], [d.ptr], [100])
        assert not dst.any()
    finally:
        receiver.unregister(d)


@needs_mooncake
def test_on_start_runs_in_the_calls_turn_on_the_peer(engines):
    """`on_start` runs once per call, when the call's turn on the peer has come - after
    a concurrent call to the same peer wrote all its bytes - and before any of its own
    bytes land; it is not run when there is nothing to write."""
    sender, receiver = engines
    n = 1 << 20
    src = np.random.default_rng().integers(0, 256, 2 * n, dtype=np.uint8)
    dst = np.zeros(2 * n, np.uint8)
    s, d = sender.register(src), receiver.register(dst)
    seen: list[tuple[int, bool, bool]] = []  # (half, own bytes landed, other half complete)

    def write(half: int) -> None:
        own, other = slice(half * n, (half + 1) * n), slice((1 - half) * n, (2 - half) * n)

        def on_start() -> None:
            seen.append((half, bool(dst[own].any()), bool((dst[other] == src[other]).all())))

        sender.batch_write(
            receiver.session_id, [s.ptr + half * n], [d.ptr + half * n], [n], on_start
        )

    try:
        threads = [threading.Thread(target=write, args=(h,)) for h in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(h for h, _, _ in seen) == [0, 1]
        assert [landed for _, landed, _ in seen] == [False, False]
        assert [complete for _, _, complete in seen] == [False, True]
        np.testing.assert_array_equal(dst, src)
        sender.batch_write(receiver.session_id, [], [], [], lambda: seen.append((9, 0, 0)))
        assert len(seen) == 2
    finally:
        sender.unregister(s)
        receiver.unregister(d)


@needs_mooncake
def test_bad_descriptor_arrays(engines):
    sender, receiver = engines
    with pytest.raises(ValueError, match="differ in number"):
        sender.batch_write(receiver.session_id, [1, 2], [3], [4, 5])
    with pytest.raises(ValueError, match="negative"):
        sender.batch_write(receiver.session_id, [1], [3], [-4])
    sender.batch_write(receiver.session_id, [], [], [])  # nothing to do


@needs_mooncake
def test_dead_peer_raises(engines):
    sender, _ = engines
    src = np.random.default_rng(11).integers(0, 256, 4096, dtype=np.uint8)
    s = sender.register(src)
    peer = me.MooncakeEngine()
    dst = np.zeros(4096, np.uint8)
    d = peer.register(dst)
    try:
        bounded(sender.write, peer.session_id, s.ptr, d.ptr, 4096)  # connection is up
        bounded(peer.close)
        assert peer.closed
        with pytest.raises(me.MooncakeTransferError):
            bounded(sender.write, peer.session_id, s.ptr, d.ptr, 4096)
        assert not bounded(sender.probe, peer.session_id)
        with pytest.raises(me.MooncakeTransferError):  # nothing ever listened there
            bounded(sender.write, "127.0.0.1:1", s.ptr, d.ptr, 4096)
        with pytest.raises(me.MooncakeError, match="closed"):
            peer.register(np.zeros(16, np.uint8))
    finally:
        sender.unregister(s)
        bounded(peer.close)  # idempotent


def _wait_stopped(pid: int) -> None:
    tasks = Path(f"/proc/{pid}/task")
    while True:
        states = []
        for t in tasks.iterdir():
            try:  # "pid (comm) S ..." - comm may hold spaces, so split after the last ")"
                states.append((t / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that exited meanwhile
                continue
        if states and all(s in "Tt" for s in states):
            return
        time.sleep(0.01)


@needs_mooncake
def test_stalled_peer_times_out():
    """A live but stopped peer: the write fails at `transfer_timeout_s` (+ 1 s per GiB),
    which `batch_write` enforces itself - before the engine's own 5 s minimum."""
    peer_code = textwrap.dedent(
        """
        import time, numpy as np
        from transfer.backends.mooncake_engine import MooncakeEngine
        e = MooncakeEngine()
        dst = np.zeros(16 << 20, np.uint8)
        d = e.register(dst)
        print(e.session_id, d.ptr, flush=True)
        time.sleep(120)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", peer_code],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    sender = None
    try:
        line = bounded(proc.stdout.readline)
        session, remote = line.split()
        sender = me.MooncakeEngine(transfer_timeout_s=2)
        # 16 MiB: more than loopback socket buffers hold, so the kernel cannot absorb it.
        src = np.random.default_rng(2).integers(0, 256, 16 << 20, dtype=np.uint8)
        s = sender.register(src)
        bounded(sender.write, session, s.ptr, int(remote), src.nbytes)
        proc.send_signal(signal.SIGSTOP)
        # kill() returns before the peer stops; on a loaded CI machine its receiver thread
        # once served the whole write in that window. Wait until every thread is stopped.
        bounded(_wait_stopped, proc.pid)
        t0 = time.monotonic()
        with pytest.raises(me.MooncakeTransferError, match="after the deadline"):
            bounded(sender.write, session, s.ptr, int(remote), src.nbytes, timeout=25)
        assert 2.0 <= time.monotonic() - t0 < 4.5
    finally:
        proc.kill()
        proc.wait(10)
        if sender is not None:
            bounded(sender.close)


@needs_mooncake
def test_bench_mooncake_raw_prints_its_json(capsys):
    from benchmarks.bench_mooncake_raw import main

    assert bounded(main, ["--bytes", str(8 << 20), "--repeats", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bytes"] == 8 << 20 and len(report["gbps_each"]) == 3
    assert report["raw_mooncake_gbps"] > 0 and report["raw_sync_call_gbps"] > 0
