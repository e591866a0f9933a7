"""Constants and checks shared by the Mooncake transfer tests (tests/transfer/test_mooncake_*.py):
whether the engine loads, the decode staging arena's and the sender's configuration, the
decode side with its staging arena, and `all_back` (every allocator at its free count)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from support.transfer import CONTROL, Decode, Prefill, prefill_free
from transfer.backends.mooncake_backend import MooncakeBackend, MooncakeBackendConfig
from transfer.backends.mooncake_engine import mooncake_available
from transfer.staging_arena import StagingArena

AVAILABLE, REASON = mooncake_available()
needs_mooncake = pytest.mark.skipif(
    not AVAILABLE, reason=f"Mooncake Transfer Engine unavailable: {REASON}"
)
ARENA_BYTES = 4 << 20  # decode staging arena: rooms here are <= 16 pages of about 8 KiB
QUARANTINE_S = 2.0  # decode side: a silent writer's region is reused after this
CONFIG = MooncakeBackendConfig(
    transfer_timeout_s=5.0,
    host_buffer_bytes=1 << 20,
    write_group_bytes=4 * 1024,  # several batch writes per rank, so hooks fire between
    **CONTROL,
    write_retry_backoff_s=0.01,
    uncertain_hold_s=0.5,  # a failed write's host region comes back fast (tests check it)
)


@dataclasses.dataclass
class MooncakeDecode(Decode):
    """A decode receiver with the Mooncake endpoint, and that endpoint's staging arena."""

    arena: StagingArena


def all_back(
    pre: Prefill, dec: MooncakeDecode, free_prefill: int, backend: MooncakeBackend
) -> None:
    """Every allocator at its initial free count (the arena after its quarantine), no
    preparation gate held."""
    assert prefill_free(pre) == free_prefill
    assert dec.receiver.num_free_pages == dec.free0
    deadline = time.monotonic() + QUARANTINE_S + 3.0
    while dec.arena.free_bytes != dec.arena.nbytes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert dec.arena.free_bytes == dec.arena.nbytes, (
        dec.arena.stats(),
        dec.receiver.quarantined_rooms(),
    )
    host = backend._host
    deadline = time.monotonic() + 2.0
    while host is not None and host.free_bytes != host.nbytes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert host is None or host.free_bytes == host.nbytes
    # Every rank let go of its peer's preparation gate, whatever ended it.
    assert not any(gate.locked() for gate in backend._prep_gates.values())
