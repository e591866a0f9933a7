"""The Mooncake transfer backend without a transfer (SPEC S2): the staging arena and the
receiver's region logic without an engine - owner-major rows, digests checked at commit,
quarantine of a failed room's region until every one-sided writer is done (or the
quarantine timeout), fake clock; run coalescing, power-of-two scatter pieces, row
digests, the backend registry.

(Until the tests were split by topic, part of tests/test_transfer_mooncake.py.)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from support.mooncake import ARENA_BYTES
from support.transfer import INDEX_K, TIMEOUTS, FakeClock, P, random_pages

from cpkv_jax.model.kv_cache import init_pool
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.paging import PageAllocator, pages_for_tokens
from serving.server_args import ServerArgs
from transfer.backends import make_backend
from transfer.backends.mooncake_backend import MooncakeBackend
from transfer.backends.mooncake_engine import mooncake_available
from transfer.backends.mooncake_sender import coalesce
from transfer.page_plan import owner_major_order, page_digests, row_digests
from transfer.protocol import Aux, RoomState
from transfer.receiver import Receiver, pow2_pieces, staging_region_bytes
from transfer.staging_arena import StagingArena, StagingFullError


def test_mooncake_availability_is_reported():
    """Printed so a CI log shows why the engine tests below skip, if they do."""
    ok, reason = mooncake_available()
    print(f"Mooncake available: {ok}" + (f" ({reason})" if reason else ""))
    assert ok == (reason == "")


# ---- staging arena (no engine) ---------------------------------------------------------------


def test_arena_first_fit_coalesces_and_quarantines():
    arena = StagingArena(64 * 1024, alignment=4096, prefault=False)
    a = arena.alloc(5000, "a")  # rounded up to 8 KiB
    b = arena.alloc(4096, "b")
    c = arena.alloc(4096, "c")
    assert (a.offset, a.nbytes, b.offset, c.offset) == (0, 8192, 8192, 12288)
    assert arena.view(b).ctypes.data == arena.address + 8192
    arena.quarantine(b)
    assert arena.is_quarantined(b) and arena.stats().quarantined_bytes == 4096
    arena.free(a)
    d = arena.alloc(8192, "d")  # a's range again; b is still out of use
    assert d.offset == 0
    with pytest.raises(StagingFullError, match="1 quarantined"):
        arena.alloc(60 * 1024, "big")
    for r in (b, c, d):
        arena.free(r)
    s = arena.stats()
    assert s.free_bytes == s.largest_free_bytes == arena.nbytes  # coalesced back to one range
    with pytest.raises(ValueError, match="not a live or quarantined region"):
        arena.free(b)


def test_coalesce_runs():
    s, d, c = coalesce(np.array([4, 5, 6, 9, 10]), np.array([0, 1, 2, 3, 4]))
    assert s.tolist() == [4, 9] and d.tolist() == [0, 3] and c.tolist() == [3, 2]
    s, d, c = coalesce(np.array([1, 2, 3]), np.array([7, 9, 10]))
    assert c.tolist() == [1, 2]


# ---- the receiver's region logic with a fake endpoint (no engine) ----------------------------


@dataclasses.dataclass
class FakeEndpoint:
    """A `StagingEndpoint` without an engine: tests write into regions with numpy."""

    arena: StagingArena
    session_id: str = "127.0.0.1:1"
    protocol: str = "tcp"
    quarantine_timeout_s: float = 10.0


def region_receiver(cfg, layout, clock, pages=16):
    ep = FakeEndpoint(StagingArena(ARENA_BYTES, prefault=False))
    pool = init_pool(mtp_config(cfg), pages, P, jnp.float32, INDEX_K)
    rx = Receiver(layout, pool, PageAllocator(pages), timeouts=TIMEOUTS, clock=clock, mooncake=ep)
    return rx, ep


def one_sided_write(ep, region, data, positions):
    """What a Mooncake sender's engine does: bytes straight into the region's rows, by
    address (the receiver is not asked, and cannot refuse)."""
    for b, pages in enumerate(data):
        nb = pages.shape[1]
        off = region.buffer_addrs[b] - ep.arena.address
        rows = ep.arena.memory[off : off + region.row_count * nb].reshape(-1, nb)
        rows[region.rows[positions]] = pages[positions]


def digests_of(data, positions):
    return np.concatenate([page_digests(d[positions]) for d in data])


def test_region_owner_major_rows_digests_and_scatter(cfg, layout):
    rx, ep = region_receiver(cfg, layout, FakeClock())
    n_tok, cp = 5 * P + 3, 2
    n = pages_for_tokens(n_tok, P)
    data = random_pages(layout, n, seed=11)
    dst = rx.allocate_pages(n)[::-1].copy()
    rx.register_room("m", dst, n_tok, cp)
    res = rx.handshake("m", 1, cp, n_tok, layout, data_plane="mooncake")
    assert res.accepted and res.status.state is RoomState.TRANSFERRING
    region = res.region
    assert region is not None and region.session_id == ep.session_id
    # Owner-major: rank 0's positions 0, 2, 4 take rows 0-2, rank 1's 1, 3, 5 rows 3-5.
    np.testing.assert_array_equal(region.rows[owner_major_order(n, cp)], np.arange(n))
    assert region.row_count == n  # exactly the room's 6 pages, scattered as 4 + 2
    staging = rx.staging("m")
    assert [int(s.ctypes.data) for s in staging] == list(region.buffer_addrs)
    assert rx.handshake("m", 0, cp, n_tok, layout, data_plane="mooncake").region == region
    mine = {r: np.arange(r, n, cp) for r in range(cp)}
    for r in (1, 0):
        one_sided_write(ep, region, data, mine[r])
    snap = rx.commit("m", 1, 0, mine[1], digests=digests_of(data, mine[1]))
    assert snap.state is RoomState.TRANSFERRING
    snap = rx.commit("m", 0, 0, mine[0], Aux(9, -0.5), digests=digests_of(data, mine[0]))
    assert snap.state is RoomState.SUCCESS, snap.reason
    pool = rx.pool
    for b, (kind, layer) in enumerate(layout.buffers()):
        leaf = np.asarray(getattr(pool, kind)[layout.leaf_index(kind, layer)])
        np.testing.assert_array_equal(leaf[dst].reshape(n, -1).view(np.uint8), data[b])
    assert ep.arena.free_bytes == ep.arena.nbytes  # success frees the region at once


def test_region_digest_mismatch_and_quarantine_until_writers_done(cfg, layout):
    clock = FakeClock()
    rx, ep = region_receiver(cfg, layout, clock)
    free0 = rx.num_free_pages
    n_tok, cp = 4 * P, 2
    data = random_pages(layout, 4, seed=12)
    rx.register_room("q", rx.allocate_pages(4), n_tok, cp)
    region = rx.handshake("q", 0, cp, n_tok, layout, data_plane="mooncake").region
    rx.handshake("q", 1, cp, n_tok, layout, data_plane="mooncake")
    one_sided_write(ep, region, data, np.array([0, 2]))
    sent = digests_of(data, np.array([0, 2]))
    rx.staging("q")[1][region.rows[2], 5] ^= 0x10  # flipped in transit
    snap = rx.commit("q", 0, 0, np.array([0, 2]), Aux(1, 0.0), digests=sent)
    assert snap.state is RoomState.FAILED
    assert "digest mismatch on index_k layer 0 position 2 from prefill rank 0" in snap.reason
    assert rx.num_free_pages == free0  # decode pages freed at once
    # Rank 1 got the region's address and has not said it is done: quarantined.
    assert rx.quarantined_rooms() == {"q": (1,)}
    assert ep.arena.stats().quarantined_regions == 1
    one_sided_write(ep, region, data, np.array([1, 3]))  # a late write lands there only
    rx.heartbeat("q", 1, writes_done=True)
    assert rx.quarantined_rooms() == {} and ep.arena.free_bytes == ep.arena.nbytes

    # A silent writer: the region is reused only after the quarantine timeout.
    rx.register_room("s", rx.allocate_pages(1), P, 1)
    rx.handshake("s", 0, 1, P, layout, data_plane="mooncake")
    rx.abort("s", "decode request cancelled")
    assert rx.quarantined_rooms() == {"s": (0,)}
    clock.t += ep.quarantine_timeout_s - 0.1
    rx.poll_timeouts()
    assert rx.quarantined_rooms() == {"s": (0,)}
    clock.t += 0.2
    rx.poll_timeouts()
    assert rx.quarantined_rooms() == {} and ep.arena.free_bytes == ep.arena.nbytes
    assert rx.num_free_pages == free0


def test_region_refusals(cfg, layout):
    clock = FakeClock()
    rx, ep = region_receiver(cfg, layout, clock)
    # A Mooncake rank cannot come back as a new incarnation (its writes are unfenced).
    rx.register_room("a", rx.allocate_pages(2), 2 * P, 1)
    assert rx.handshake("a", 0, 1, 2 * P, layout, attempt=0, data_plane="mooncake").accepted
    res = rx.handshake("a", 0, 1, 2 * P, layout, attempt=1, data_plane="mooncake")
    assert not res.accepted and "cannot be fenced" in res.status.reason
    assert rx.quarantined_rooms() == {"a": (0,)}
    rx.heartbeat("a", 0, writes_done=True)
    # The arena full: the handshake is retryable, the room untouched.
    hog = ep.arena.alloc(ep.arena.free_bytes, "hog")
    rx.register_room("b", rx.allocate_pages(2), 2 * P, 1)
    with pytest.raises(StagingFullError, match="staging arena full"):
        rx.handshake("b", 0, 1, 2 * P, layout, data_plane="mooncake")
    assert rx.status("b").state is RoomState.BOOTSTRAPPING
    ep.arena.free(hog)
    assert rx.handshake("b", 0, 1, 2 * P, layout, data_plane="mooncake").accepted
    rx.abort("b", "done")
    rx.heartbeat("b", 0, writes_done=True)
    # A receiver without an endpoint refuses the Mooncake data plane before data moves.
    plain = Receiver(
        layout,
        init_pool(mtp_config(cfg), 4, P, jnp.float32, INDEX_K),
        PageAllocator(4),
        timeouts=TIMEOUTS,
    )
    plain.register_room("c", plain.allocate_pages(1), P, 1)
    res = plain.handshake("c", 0, 1, P, layout, data_plane="mooncake")
    assert not res.accepted and "no Mooncake endpoint" in res.status.reason
    assert ep.arena.free_bytes == ep.arena.nbytes


def test_room_larger_than_the_whole_staging_arena_is_refused_at_once(cfg, layout):
    """A room whose staging can never fit the arena (even empty) is refused at its
    handshake with the reason, and its pages freed; one that fits but finds the arena
    busy stays retryable. `staging_bytes` is what `_ensure_staging` carves: the room's
    pages, buffer after buffer, each 4 KiB-aligned."""
    pages = 16
    pool = init_pool(mtp_config(cfg), pages, P, jnp.float32, INDEX_K)
    small = StagingArena(staging_region_bytes(layout, 4, 4096))
    ep = FakeEndpoint(small)
    rx = Receiver(
        layout, pool, PageAllocator(pages), timeouts=TIMEOUTS, clock=FakeClock(), mooncake=ep
    )
    assert rx.staging_bytes(4) == small.nbytes < rx.staging_bytes(5)
    free0 = rx.num_free_pages
    rx.register_room("long", rx.allocate_pages(5), 5 * P, 2)
    res = rx.handshake("long", 1, 2, 5 * P, layout, data_plane="mooncake")
    assert not res.accepted and res.status.state is RoomState.FAILED
    assert "need" in res.status.reason and "`staging_bytes`" in res.status.reason
    assert rx.num_free_pages == free0 and small.free_bytes == small.nbytes
    rx.register_room("fits", rx.allocate_pages(4), 4 * P - 3, 2)  # the whole arena
    hog = small.alloc(4096, "hog")  # another room's region: busy, not too small
    with pytest.raises(StagingFullError, match="staging arena full"):
        rx.handshake("fits", 0, 2, 4 * P - 3, layout, data_plane="mooncake")
    small.free(hog)
    assert rx.handshake("fits", 0, 2, 4 * P - 3, layout, data_plane="mooncake").accepted
    rx.abort("fits", "done")
    for rank in (0, 1):
        rx.heartbeat("fits", rank, writes_done=True)
    assert rx.num_free_pages == free0 and small.free_bytes == small.nbytes


def test_host_only_receiver_hands_verified_rows_to_the_sink(layout):
    ep = FakeEndpoint(StagingArena(ARENA_BYTES, prefault=False))
    got = {}
    rx = Receiver(
        layout,
        None,
        PageAllocator(16),
        timeouts=TIMEOUTS,
        clock=FakeClock(),
        mooncake=ep,
        host_sink=lambda room, pos, dst, st: got.update(
            {room: (pos.copy(), dst.copy(), [s.copy() for s in st])}
        ),
    )
    n = 3
    data = random_pages(layout, n, seed=13)
    dst = rx.allocate_pages(n)
    rx.register_room("h", dst, 3 * P, 2)
    region = rx.handshake("h", 0, 2, 3 * P, layout, data_plane="mooncake").region
    rx.handshake("h", 1, 2, 3 * P, layout, data_plane="mooncake")
    assert region.row_count == n  # no device scatter: no padding rows
    for r in (0, 1):
        pos = np.arange(r, n, 2)
        one_sided_write(ep, region, data, pos)
        rx.commit("h", r, 0, pos, Aux(1, 0.0) if r == 0 else None, digests_of(data, pos))
    assert rx.status("h").state is RoomState.SUCCESS
    pos, dst_rows, staged = got["h"]
    np.testing.assert_array_equal(pos, [0, 2, 1])
    np.testing.assert_array_equal(dst_rows, dst[pos])
    for b in range(len(data)):
        np.testing.assert_array_equal(staged[b], data[b][pos])
    with pytest.raises(ValueError, match="host-only"):
        _ = rx.pool


def test_pow2_pieces_sum_to_n_largest_first():
    for n in [0, 1, 2, 3, 7, 8, 2049, 1999]:
        parts = pow2_pieces(n)
        assert sum(parts) == n and parts == sorted(set(parts), reverse=True)
        assert all(p & (p - 1) == 0 for p in parts)
    assert pow2_pieces(2049) == [2048, 1]


def test_row_digests_equal_page_digests():
    a = np.random.default_rng(0).integers(0, 256, (6, 100), dtype=np.uint8)
    np.testing.assert_array_equal(row_digests(a, [4, 0, 5]), page_digests(a[[4, 0, 5]]))


def test_registry_and_factory_know_mooncake():
    assert MooncakeBackend.capabilities.supports_cp_shared_kv
    ServerArgs(
        model_path="unused",
        cp_size=8,
        enable_cp_shared_kv=True,
        disaggregation_mode="prefill",
        transfer_backend="mooncake",
    ).validate()
    with pytest.raises(ValueError, match="unknown transfer backend"):
        make_backend("slice")
