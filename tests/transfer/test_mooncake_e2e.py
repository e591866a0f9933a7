"""PD transfer with the Mooncake backend end to end on 8 virtual devices (SPEC S2).

With the Mooncake Transfer Engine over loopback TCP (skipped, with the reason
`mooncake_available()` gives, where the engine cannot load), exactly like the gRPC
test: CP shared-KV prefill of the tiny model -> 8 Mooncake senders writing into the
decode receiver's registered staging arena -> one device scatter per buffer into a
single-device decode pool at shuffled decode pages; the decode-side full layout equals
the prefill full view bitwise and decoding from it reproduces the single-device
reference. Also: the host copy buffer registered up front, rooms larger than it, and
sealed host pools (zero copy or copied).

(Until the tests were split by topic, part of tests/test_transfer_mooncake.py.)
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import pytest
from support.mooncake import CONFIG, all_back, needs_mooncake
from support.transfer import (
    CP,
    LENGTHS,
    P,
    assert_decode_layout_is,
    assert_decodes_like_reference,
    decode_pages,
    expected_pages,
    finish,
    host_pool_sources,
    new_table,
    prefill_free,
    run_transfer,
)

from cpkv_jax.paging import pages_for_tokens
from transfer.backends.mooncake_backend import MooncakeBackend
from transfer.protocol import Aux, RoomState

logger = logging.getLogger(__name__)


@needs_mooncake
def test_e2e_cp_prefill_to_decode_over_mooncake(prefill, mooncake_decode, backends):
    pre = prefill
    free_prefill = prefill_free(pre)
    held = sum(t.num_pages for t in pre.tables)
    views = [pre.runner.full_view(t) for t in pre.tables]  # before the holds release them
    steps = 4
    dec = mooncake_decode(9)  # one request at a time: 8 usable pages, as the reference allocates
    backend = backends()
    for i, (prompt, table) in enumerate(zip(pre.prompts, pre.tables, strict=True)):
        n, n_pages = len(prompt), table.num_pages
        assert n == LENGTHS[i]
        extra = pages_for_tokens(n + steps, P) - n_pages
        t0 = time.perf_counter()
        hold, dst = run_transfer(
            pre, dec, table, f"mc-e2e-{i}", pre.aux[i], backend=backend, extra_pages=extra, seed=i
        )
        outcome = finish(hold)
        logger.info("mooncake e2e transfer of %d tokens: %.2fs", n, time.perf_counter() - t0)
        assert outcome.state is RoomState.SUCCESS, outcome
        snap = dec.receiver.status(f"mc-e2e-{i}")
        assert snap.state is RoomState.SUCCESS and snap.aux == pre.aux[i]
        assert np.any(np.diff(dst[:n_pages]) != 1)  # really non-contiguous decode pages
        # Owner-major staging + a contiguous host copy: one descriptor per buffer per rank.
        stats = backend.stats(f"mc-e2e-{i}")
        assert set(stats) == set(range(min(CP, n_pages)))  # ranks that own pages wrote
        assert all(s.descriptors == len(pre.layout.buffers()) for s in stats.values())
        assert_decodes_like_reference(pre, dec.receiver, dst, prompt, views[i], pre.aux[i], steps)
        dec.receiver.free_pages(dst)  # the decode request is done
    assert prefill_free(pre) == free_prefill + held
    assert dec.receiver.num_free_pages == dec.free0
    assert dec.arena.free_bytes == dec.arena.nbytes


@needs_mooncake
def test_prepare_registers_the_host_copy_buffer_up_front(sender_engine):
    """A prefill server calls `prepare()` at startup, so its first device-pool request
    does not allocate, pre-fault and register the host copy buffer on its critical path."""
    backend = MooncakeBackend(CONFIG, engine=sender_engine)
    try:
        assert backend._host is None  # lazy until asked
        backend.prepare()
        host = backend._host
        assert host is not None and host.nbytes == CONFIG.host_buffer_bytes
        assert host.free_bytes == host.nbytes
        backend.prepare()  # idempotent
        assert backend._host is host
    finally:
        backend.close()


@needs_mooncake
def test_room_larger_than_the_host_copy_buffer_takes_turns(prefill, mooncake_decode, sender_engine):
    """Device pools go through the backend's registered host buffer (the copy path). A
    rank gives its region back once its writes are over, so a room whose ranks' copies
    together need several times the buffer still succeeds, bitwise, when the largest
    one fits alone. (Held until the room ended, the ranks with a region waited for that
    end and the others for space: the room failed after `host_buffer_wait_s`.)"""
    pre, dec = prefill, mooncake_decode(32)
    free = prefill_free(pre)
    table = new_table(pre, 14 * P + 7)  # reuses pages holding real KV (the fixture's)
    view = pre.runner.full_view(table)  # before the hold releases the table
    page_bytes = [pre.layout.page_bytes(kind, layer) for kind, layer in pre.layout.buffers()]

    def copy_bytes(k: int) -> int:  # a rank's region: buffer after buffer, 4 KiB aligned
        return sum(-(-k * nb // 4096) * 4096 for nb in page_bytes)

    owned = np.bincount(table.owners(), minlength=CP)
    largest = copy_bytes(int(owned.max()))
    assert sum(copy_bytes(int(k)) for k in owned) > 3 * largest
    config = dataclasses.replace(CONFIG, host_buffer_bytes=largest, host_buffer_wait_s=5.0)
    backend = MooncakeBackend(config, engine=sender_engine)
    try:
        hold, dst = run_transfer(pre, dec, table, "mc-turns", Aux(3, -0.25), backend=backend)
        outcome = finish(hold)
        assert outcome.state is RoomState.SUCCESS, outcome
        stats = backend.stats("mc-turns")
        assert len(stats) == CP and not any(s.zero_copy for s in stats.values())
        assert_decode_layout_is(dec.receiver, dst, view, "room larger than the host buffer")
        dec.receiver.free_pages(dst)
        all_back(pre, dec, free, backend)
    finally:
        backend.close()


@needs_mooncake
@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "copied"])
def test_sealed_host_pool_over_mooncake(prefill, mooncake_decode, sender_engine, zero_copy):
    """Host pools whose pages were sealed (`HostPoolPageSource.seal`), written from the
    registered pool (zero copy) or through the host copy buffer: the ranks send the
    sealed digests and hash nothing, the decode pool gets the pool's bytes, and the
    decode side still hashes every staged page: a page rewritten after its seal fails
    the room with a digest mismatch, every allocator back."""
    pre, dec = prefill, mooncake_decode(48)
    free = prefill_free(pre)
    min_descriptor = 1 if zero_copy else 1 << 40  # the tiny pages are far below 1 MiB
    config = dataclasses.replace(CONFIG, zero_copy_min_descriptor_bytes=min_descriptor)
    backend = MooncakeBackend(config, engine=sender_engine)
    try:
        sources = host_pool_sources(pre, seed=5)
        for s in sources:
            s.seal()
        table = new_table(pre, 9 * P + 5)
        want = expected_pages(sources, pre.layout, table)
        room = f"mc-sealed-{zero_copy}"
        hold, dst = run_transfer(
            pre, dec, table, room, Aux(2, -0.5), backend=backend, sources=sources
        )
        assert finish(hold).state is RoomState.SUCCESS
        stats = backend.stats(room)
        assert len(stats) == CP
        for st in stats.values():
            assert st.sealed_digests and st.digest_s == 0.0 and st.zero_copy == zero_copy, st
        for got, exp in zip(decode_pages(dec.receiver, dst), want, strict=True):
            np.testing.assert_array_equal(got, exp)
        dec.receiver.free_pages(dst)

        table = new_table(pre, 9 * P)
        sources[3].host_buffer("latent", 1)[int(table.local_pages()[3]), 11] ^= 0x40
        hold, _ = run_transfer(
            pre, dec, table, f"{room}-stale", Aux(2, -0.5), backend=backend, sources=sources
        )
        outcome = finish(hold)
        assert outcome.state is RoomState.FAILED, outcome
        assert "digest mismatch on latent layer 1 position 3 from prefill rank 3" in outcome.reason
        all_back(pre, dec, free, backend)
    finally:
        backend.close()
