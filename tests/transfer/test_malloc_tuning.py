"""transfer.malloc_tuning: glibc mmap / trim thresholds for gRPC page chunks."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from transfer import malloc_tuning as mt
from transfer.protocol import MAX_MESSAGE_BYTES

MiB = 1 << 20


class FakeMallopt:
    """Records mallopt calls; refuses the parameters in `refuse`."""

    def __init__(self, refuse: tuple[int, ...] = ()):
        self.calls: list[tuple[int, int]] = []
        self.refuse = refuse

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 0 if param in self.refuse else 1


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(mt, "_applied", None)  # this process's real state is left alone
    f = FakeMallopt()
    monkeypatch.setattr(mt, "_mallopt", lambda: f)
    return f


def test_sets_both_thresholds_once(fake):
    got = mt.tune_malloc()
    assert got == mt.MallocTuning(16 * MiB, 64 * MiB) == mt.current_malloc_tuning()
    assert fake.calls == [(mt._M_MMAP_THRESHOLD, 16 * MiB), (mt._M_TRIM_THRESHOLD, 64 * MiB)]
    assert mt.tune_malloc() == got and len(fake.calls) == 2  # same values: nothing to do
    assert mt.tune_malloc(32 * MiB, 128 * MiB) == mt.MallocTuning(32 * MiB, 128 * MiB)
    assert fake.calls[2:] == [(mt._M_MMAP_THRESHOLD, 32 * MiB), (mt._M_TRIM_THRESHOLD, 128 * MiB)]
    assert "16 MiB" in got.describe() and "64 MiB" in got.describe()


@pytest.mark.parametrize(
    ("mmap_b", "trim_b", "needle"),
    [
        (MAX_MESSAGE_BYTES, 64 * MiB, "must exceed the largest transfer message"),
        (4 * MiB, 64 * MiB, "must exceed the largest transfer message"),
        (32 * MiB, 16 * MiB, "trim threshold"),
        (16 * MiB, 1 << 31, "trim threshold"),
    ],
)
def test_bad_thresholds_change_nothing(fake, mmap_b, trim_b, needle):
    with pytest.raises(ValueError, match=needle):
        mt.tune_malloc(mmap_b, trim_b)
    assert fake.calls == [] and mt.current_malloc_tuning() is None


def test_a_refused_mmap_threshold_changes_nothing(fake):
    fake.refuse = (mt._M_MMAP_THRESHOLD,)
    with pytest.raises(ValueError, match="glibc refused mmap threshold"):
        mt.tune_malloc()
    assert fake.calls == [(mt._M_MMAP_THRESHOLD, 16 * MiB)]  # the trim threshold untouched
    assert mt.current_malloc_tuning() is None


def test_not_glibc_is_a_logged_no_op(monkeypatch, caplog):
    monkeypatch.setattr(mt, "_applied", None)
    monkeypatch.setattr(mt, "_mallopt", lambda: None)
    with caplog.at_level(logging.INFO, logger=mt.__name__):
        assert mt.tune_malloc() is None
    assert "not glibc" in caplog.text and mt.current_malloc_tuning() is None


@pytest.mark.skipif(mt._glibc_version() is None, reason="glibc only")
def test_real_glibc_accepts_the_defaults():
    # A child process: the thresholds are process-wide and cannot be put back exactly.
    code = "from transfer.malloc_tuning import tune_malloc; print(tune_malloc().describe())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "glibc malloc: mmap threshold 16 MiB, trim threshold 64 MiB"


def test_pd_server_processes_tune_and_unified_ones_do_not(fake):
    from serving.server import apply_transfer_malloc_tuning
    from serving.server_args import ServerArgs

    assert apply_transfer_malloc_tuning(ServerArgs(model_path="m")) is None
    pd = dict(model_path="m", disaggregation_mode="decode", transfer_backend="grpc")
    off = ServerArgs(**pd, disable_transfer_malloc_tuning=True)
    assert "--disable-transfer-malloc-tuning" in apply_transfer_malloc_tuning(off)
    assert fake.calls == []
    got = apply_transfer_malloc_tuning(ServerArgs(**pd))
    assert got == mt.MallocTuning(16 * MiB, 64 * MiB).describe() and len(fake.calls) == 2
