"""A randomized run of mixed PD transfer faults over the Mooncake backend (SPEC S2):
`CPKV_TRANSFER_FAULTS` rounds (default 24 in the suite as for gRPC, every fault kind at
least once; `python -m benchmarks.fault_soak --rounds 100` is the long soak;
`CPKV_TRANSFER_FAULT_SEED` picks another schedule), the decode side dying and transient
write failures included. Skipped, with the reason, where the engine cannot load.

(Until the tests were split by topic, part of tests/test_transfer_mooncake.py.)
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
from support.mooncake import CONFIG, QUARANTINE_S, needs_mooncake
from support.transfer import (
    CP,
    P,
    assert_decode_layout_is,
    finish,
    new_table,
    prefill_free,
    run_transfer,
    settle,
)
from support.transfer_faults import (
    SUITE_ROUNDS,
    decode_dies_before_commit,
    duplicate_position_plan,
    fault_schedule,
    heartbeat_loss_seen,
    log_fault_run,
    missing_position_plan,
)

from transfer.backends.mooncake_engine import MooncakeTransferError
from transfer.backends.mooncake_sender import MooncakeSenderFaults
from transfer.protocol import Aux, RoomState

MC_FAULT_KINDS = (
    "none", "flaky", "kill", "corrupt", "duplicate", "missing", "layout", "abort", "dies"
)  # fmt: skip
# "kill" and "dies" wait for a heartbeat timeout (2 s), hence their small weights.
MC_FAULT_WEIGHTS = (0.3, 0.1, 0.02, 0.15, 0.1, 0.1, 0.05, 0.15, 0.03)


@needs_mooncake
def test_randomized_mixed_faults_leak_nothing_over_mooncake(prefill, mooncake_decode, backends):
    """`CPKV_TRANSFER_FAULTS` Mooncake transfers (default 24, as for gRPC), each with a
    random fault or none: a transient write failure (retried: the room succeeds), a
    sender killed, a page corrupted in the decode staging, a position written by two
    ranks, a missing position, a layout mismatch, an abort before a batch write (the
    write still lands: one-sided), or the decode side dying (its gRPC server stops once
    all ranks but one committed; the prefill side fails the room on heartbeat loss; a
    decode server of its own, sharing the session's Mooncake endpoint).

    After each round: every room finished with the expected state, a successful room's
    pages equal the prefill full view, prefill pages and the round's decode pages are
    back, no staging region is live (a failed room's may be quarantined until its
    writers are done or the quarantine times out) and the sender's host buffer is whole.
    Odd rounds hash each rank's pages before its write, even ones while it writes. At
    the end the staging arena is entirely free again. 0.1-0.3 s a round on 2 cores
    ("kill" and "dies" rounds wait for the 2 s heartbeat timeout)."""
    pre = prefill
    count = int(os.environ.get("CPKV_TRANSFER_FAULTS", str(SUITE_ROUNDS)))
    rng = np.random.default_rng(int(os.environ.get("CPKV_TRANSFER_FAULT_SEED", "4321")))
    dec = mooncake_decode(64)
    backend = backends()  # one backend (engine, host buffer, channel); faults per round
    free = prefill_free(pre)
    t_start = time.perf_counter()
    per_kind: dict[str, list[float]] = {k: [] for k in MC_FAULT_KINDS}
    for i, kind in enumerate(fault_schedule(rng, count, MC_FAULT_KINDS, MC_FAULT_WEIGHTS)):
        room = f"mc-rnd-{i}"
        n_tok = int(rng.integers(1, 14 * P))
        table = new_table(pre, n_tok)
        n_pages = table.num_pages
        victim = int(rng.integers(min(CP, n_pages)))  # a rank that owns pages
        faults, layout, round_dec = MooncakeSenderFaults(), None, dec
        retried: list[int] = []

        if kind == "flaky":

            def write(s, g, attempt, v=victim, retried=retried):
                if s.rank == v and attempt == 0:
                    retried.append(g)
                    raise MooncakeTransferError("simulated transient engine failure", -1)

            faults = MooncakeSenderFaults(write=write)
        elif kind == "kill":
            faults = MooncakeSenderFaults(
                before_write=lambda s, g, v=victim: s.kill() if s.rank == v else None
            )
        elif kind == "corrupt":

            def corrupt(s, v=victim, room=room):
                if s.rank == v:  # its writes are over; position v is its own
                    rows = dec.receiver.staging_rows(room)
                    dec.receiver.staging(room)[0][rows[v], 0] ^= 0xFF

            faults = MooncakeSenderFaults(before_commit=corrupt)
        elif kind == "duplicate" and n_pages > 1:
            other = (victim + 1) % min(CP, n_pages)

            faults = MooncakeSenderFaults(plan=duplicate_position_plan(victim, other))
        elif kind == "missing":
            faults = MooncakeSenderFaults(plan=missing_position_plan(victim))
        elif kind == "layout":
            layout = dataclasses.replace(pre.layout, kv_cache_dim=pre.layout.kv_cache_dim + 1)
        elif kind == "abort":

            def abort(s, g, v=victim, room=room):
                if s.rank == v and g == 0:
                    dec.receiver.abort(room, "random abort")

            faults = MooncakeSenderFaults(before_write=abort)
        elif kind == "dies":
            round_dec = mooncake_decode(32)  # its server dies: a decode server of its own
            faults = MooncakeSenderFaults(
                before_commit=decode_dies_before_commit(round_dec, room, victim)  # type: ignore[arg-type]
            )
        else:
            kind = "none"
        succeeds = kind in ("none", "flaky")
        view = pre.runner.full_view(table) if succeeds else None
        backend.faults = faults  # read by each rank sender as it starts
        # Rooms here are small: odd rounds hash on the rank thread before the write (as
        # small rooms do), even ones on a helper thread during it (as large rooms do).
        backend.config = dataclasses.replace(
            CONFIG, inline_digest_max_bytes=CONFIG.inline_digest_max_bytes if i % 2 else 0
        )
        t0 = time.perf_counter()
        hold, dst = run_transfer(
            pre, round_dec, table, room, Aux(i, -0.5), backend=backend, layout=layout, seed=i
        )
        outcome = finish(hold)
        snap = settle(round_dec.receiver, room)
        per_kind[kind].append(time.perf_counter() - t0)
        want = RoomState.SUCCESS if succeeds else RoomState.FAILED
        assert outcome.state is want and snap.state is want, (i, kind, outcome, snap)
        if kind == "flaky":
            assert retried, i  # the victim's first try really failed
        if kind == "dies":
            assert heartbeat_loss_seen(hold), (i, hold.outcomes())
        if succeeds:
            assert_decode_layout_is(round_dec.receiver, dst, view, i, n_tok)
            round_dec.receiver.free_pages(dst)
        assert prefill_free(pre) == free, (i, kind)
        assert round_dec.receiver.num_free_pages == round_dec.free0, (i, kind)
        assert dec.arena.stats().live_regions == 0, (i, kind, dec.arena.stats())
        host = backend._host
        deadline = time.monotonic() + 2.0
        while host is not None and host.free_bytes != host.nbytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert host is None or host.free_bytes == host.nbytes, (i, kind)
        assert not any(g.locked() for g in backend._prep_gates.values()), (i, kind)
    deadline = time.monotonic() + QUARANTINE_S + 3.0  # the last quarantines expire
    while dec.arena.free_bytes != dec.arena.nbytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dec.arena.free_bytes == dec.arena.nbytes, dec.arena.stats()
    log_fault_run("Mooncake transfer", count, time.perf_counter() - t_start, per_kind)
