"""PD transfer page plans (SPEC S2.1-S2.2), the handshake layout descriptor and the
per-page digest (SPEC S2.4)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from cpkv_jax.config import ModelConfig
from cpkv_jax.lane_allocator import OwnerLaneAllocator, RequestPageTable
from cpkv_jax.model_configs import config_dir
from cpkv_jax.paging import pages_for_tokens
from transfer import page_plan
from transfer.page_plan import (
    PROTOCOL_VERSION,
    LayoutDescriptor,
    LayoutMismatchError,
    PagePlanError,
    owner_major_order,
    page_digest,
    page_digests,
    plan_rank,
    plan_request,
)

REPO = Path(__file__).resolve().parents[2]
log = logging.getLogger(__name__)


def _cfg(name: str) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((config_dir(name) / "config.json").read_text()))


def _small_layout(page_size: int, index_k_dtype: str = "float8_e4m3fn") -> LayoutDescriptor:
    return LayoutDescriptor(
        protocol_version=PROTOCOL_VERSION,
        page_size=page_size,
        num_layers=4,
        full_indexer_layers=(0, 2),
        kv_cache_dim=6,
        latent_dtype="bfloat16",
        index_head_dim=4,
        index_k_dtype=index_k_dtype,
        has_index_scale=index_k_dtype == "float8_e4m3fn",
    )


def _random_pages(rng: np.random.Generator, n: int, cp: int, spare: int):
    """Valid random inputs: per-lane unique local pages >= 1, globally unique dst >= 1."""
    lanes = np.arange(n) % cp
    src = np.zeros(n, dtype=np.int64)
    for r in range(cp):
        mine = np.flatnonzero(lanes == r)
        src[mine] = rng.choice(np.arange(1, mine.size + spare + 1), mine.size, replace=False)
    dst = rng.choice(np.arange(1, n + spare + 1), n, replace=False)
    return src, dst


def _contiguous_blocks(rng: np.random.Generator, n: int, base: int) -> np.ndarray:
    """`n` pages in a few ascending contiguous blocks (what a lightly churned pool hands
    out), so plans mix long runs with breaks."""
    cuts = np.sort(rng.choice(np.arange(1, max(n, 2)), min(3, max(n - 1, 0)), replace=False))
    out, nxt = [], base
    for block in np.split(np.arange(n), cuts):
        out.append(np.arange(nxt, nxt + block.size))
        nxt += block.size + int(rng.integers(1, 5))
    return np.concatenate(out).astype(np.int64)


def _tokens(page_size: int, pages: int, tail: int) -> int:
    return (pages - 1) * page_size + (tail or page_size)


plan_inputs = st.fixed_dictionaries(
    {
        "page_size": st.sampled_from([1, 2, 4, 16, 64]),
        "pages": st.integers(1, 80),
        "tail_frac": st.sampled_from([0.0, 0.0, 0.25, 0.5, 0.99]),  # 0 -> exact multiple
        "cp": st.sampled_from([1, 2, 4, 8]),
        "layout": st.sampled_from(["random", "blocks", "fresh"]),
        "seed": st.integers(0, 2**32 - 1),
    }
)


def _build(d):
    P, n, cp = d["page_size"], d["pages"], d["cp"]
    tail = int(d["tail_frac"] * P)
    num_tokens = _tokens(P, n, tail)
    rng = np.random.default_rng(d["seed"])
    if d["layout"] == "random":
        src, dst = _random_pages(rng, n, cp, spare=int(rng.integers(0, 20)))
    elif d["layout"] == "blocks":
        src = np.zeros(n, np.int64)
        for r in range(cp):
            k = len(range(r, n, cp))
            src[r::cp] = _contiguous_blocks(rng, k, 1) if k else []
        dst = np.empty(n, np.int64)
        dst[owner_major_order(n, cp)] = _contiguous_blocks(rng, n, 1)
    else:
        table = RequestPageTable(cp)
        table.extend(OwnerLaneAllocator(cp, n + 2), num_tokens, P)
        src = table.local_pages()
        dst = np.arange(1, n + 1)
    event(f"layout={d['layout']} cp={cp} tail={'partial' if num_tokens % P else 'exact'}")
    return num_tokens, P, cp, np.asarray(src), np.asarray(dst)


# --- plans --------------------------------------------------------------------------------


@settings(max_examples=250, deadline=None)
@given(plan_inputs)
def test_plan_properties(d):
    num_tokens, P, cp, src, dst = _build(d)
    plan = plan_request(num_tokens, P, cp, src, dst)
    n = pages_for_tokens(num_tokens, P)
    assert plan.num_pages == n and plan.num_tokens == num_tokens and len(plan.ranks) == cp

    # Exactly one sender per position (SPEC S2.4 coverage), nothing padded (S2.2).
    np.testing.assert_array_equal(plan.coverage(), np.ones(n, np.int64))

    for r, rp in enumerate(plan.ranks):
        assert rp.rank == r
        assert rp.sends_aux == (r == 0)
        # A sender's own plan (plan_rank) is that rank's part of the request's plan.
        alone = plan_rank(r, num_tokens, P, cp, src, dst)
        for field in ("positions", "src_pages", "dst_pages", "run_offsets"):
            np.testing.assert_array_equal(getattr(alone, field), getattr(rp, field))
        assert (alone.runs, alone.tail_tokens, alone.sends_aux) == (
            rp.runs,
            rp.tail_tokens,
            rp.sends_aux,
        )
        # Each rank sends exactly the positions it owns, ascending (S1.1 / S2.1).
        np.testing.assert_array_equal(rp.positions, np.arange(n)[np.arange(n) % cp == r])
        assert rp.positions.dtype == np.int64
        # Destination chosen by position, source is the rank's local page of it.
        np.testing.assert_array_equal(rp.dst_pages, dst[rp.positions])
        np.testing.assert_array_equal(rp.src_pages, src[rp.positions])

        # Runs reconstruct exactly the (position, src, dst) triples.
        if rp.runs:
            got = np.stack(
                [
                    np.concatenate([run.positions() for run in rp.runs]),
                    np.concatenate([run.src_pages() for run in rp.runs]),
                    np.concatenate([run.dst_pages() for run in rp.runs]),
                ]
            )
        else:
            got = np.zeros((3, 0), np.int64)
        np.testing.assert_array_equal(got, np.stack([rp.positions, rp.src_pages, rp.dst_pages]))
        assert all(run.position_stride == cp and run.count >= 1 for run in rp.runs)
        np.testing.assert_array_equal(np.diff(rp.run_offsets), [run.count for run in rp.runs])

        # Coalescing is maximal: no two adjacent runs could merge.
        for a, b in zip(rp.runs, rp.runs[1:], strict=False):
            assert not (
                b.src_start == a.src_start + a.count and b.dst_start == a.dst_start + a.count
            )

    # The tail page is sent once, by its owner, with its valid token count (S2.2).
    tail = num_tokens % P
    owner = (n - 1) % cp
    for rp in plan.ranks:
        expect = tail if (tail and rp.rank == owner) else 0
        assert rp.tail_tokens == expect
    assert plan.ranks[owner].positions[-1] == n - 1


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 16, 64]),
    pages=st.integers(1, 300),
    cp=st.sampled_from([1, 2, 4, 8]),
)
def test_fresh_pages_give_long_runs(page_size, pages, cp):
    """Fresh lanes (local pages 1, 2, ...) and a contiguous decode block: one run per rank
    when decode pages are assigned owner-major; plain arange only coalesces at cp=1."""
    num_tokens = _tokens(page_size, pages, page_size // 2)
    table = RequestPageTable(cp)
    table.extend(OwnerLaneAllocator(cp, pages + 2), num_tokens, page_size)
    src = table.local_pages()

    dst = np.empty(pages, np.int64)
    dst[owner_major_order(pages, cp)] = np.arange(1, pages + 1)
    plan = plan_request(num_tokens, page_size, cp, src, dst)
    for rp in plan.ranks:
        assert len(rp.runs) == (1 if rp.num_pages else 0)
        if rp.runs:
            assert rp.runs[0].count == rp.num_pages

    arange_plan = plan_request(num_tokens, page_size, cp, src, np.arange(1, pages + 1))
    runs = sum(len(rp.runs) for rp in arange_plan.ranks)
    # Position p -> decode page p + 1 strides by cp within a rank: runs only at cp=1.
    assert runs == (1 if cp == 1 else pages)


def test_plan_small_example():
    # 10 tokens, page 4 -> 3 pages, the last holds 2 tokens; cp=2.
    plan = plan_request(10, 4, 2, src_local_pages=[1, 1, 2], dst_pages=[5, 9, 6])
    r0, r1 = plan.ranks
    np.testing.assert_array_equal(r0.positions, [0, 2])
    assert r0.runs == (page_plan.PageRun(0, 1, 5, 2, 2),)
    assert r0.tail_tokens == 2 and r0.sends_aux
    np.testing.assert_array_equal(r1.positions, [1])
    assert r1.runs == (page_plan.PageRun(1, 1, 9, 1, 2),)
    assert r1.tail_tokens == 0 and not r1.sends_aux


def test_more_ranks_than_pages():
    plan = plan_request(5, 4, 8, [3, 7], [1, 2])
    assert [rp.num_pages for rp in plan.ranks] == [1, 1, 0, 0, 0, 0, 0, 0]
    assert plan.ranks[1].tail_tokens == 1
    assert plan.ranks[5].runs == () and plan.ranks[5].run_offsets.tolist() == [0]
    np.testing.assert_array_equal(plan.coverage(), [1, 1])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 4, 2, [], []), "num_tokens must be >= 1"),
        ((8, 0, 2, [1], [1]), "page_size must be >= 1"),
        ((8, 4, 0, [1, 1], [1, 2]), "cp_size must be >= 1"),
        ((9, 4, 2, [1, 1], [1, 2]), r"src_local_pages has 2 entries but the request needs 3"),
        ((8, 4, 2, [1, 1], [1, 2, 3]), r"dst_pages has 3 entries but the request needs 2"),
        ((8, 4, 2, [1, 1], [2, 2]), r"dst_pages\[0\] and dst_pages\[1\] are the same"),
        ((8, 4, 2, [1, 1], [0, 2]), r"dst_pages\[0\] = 0: page 0 is the trash page"),
        ((8, 4, 2, [1, -1], [1, 2]), r"src_local_pages\[1\] = -1"),
        ((12, 4, 2, [3, 1, 3], [1, 2, 3]), r"src_local_pages\[0\] and src_local_pages\[2\]"),
        ((8, 4, 2, [[1, 1]], [1, 2]), "must be 1-D"),
        ((8, 4, 2, [1.0, 2.0], [1, 2]), "must be integers"),
    ],
)
def test_plan_rejects_bad_input(args, match):
    with pytest.raises(PagePlanError, match=match):
        plan_request(*args)
    with pytest.raises(PagePlanError, match=match):  # the same checks of the whole tables
        plan_rank(0, *args)


def test_plan_rank_rejects_a_rank_outside_the_cp_group():
    for rank in (-1, 2):
        with pytest.raises(PagePlanError, match=r"rank must be in \[0, 2\)"):
            plan_rank(rank, 8, 4, 2, [1, 1], [1, 2])


def test_same_local_page_on_different_lanes_is_fine():
    # Lanes are separate pools: local page 1 of lane 0 and of lane 1 are different pages.
    plan = plan_request(8, 4, 2, [1, 1], [1, 2])
    np.testing.assert_array_equal(plan.coverage(), [1, 1])


# --- descriptors --------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(plan_inputs, st.sampled_from(["float8_e4m3fn", "bfloat16"]))
def test_descriptors_move_every_page_to_its_position(d, k_dtype):
    """Execute the descriptors as byte copies between random per-rank pools and a decode
    pool: decode page dst[p] ends up with page src[p] of lane p % cp, for every buffer."""
    num_tokens, P, cp, src, dst = _build(d)
    layout = _small_layout(P, k_dtype)
    plan = plan_request(num_tokens, P, cp, src, dst)
    rng = np.random.default_rng(d["seed"])
    buffers = layout.buffers()
    pb = {b: layout.page_bytes(*b) for b in buffers}
    src_pages_per_lane = int(src.max()) + 1
    lanes = {
        b: rng.integers(0, 256, (cp, src_pages_per_lane * pb[b]), dtype=np.uint8) for b in buffers
    }
    decode = {b: np.zeros(int(dst.max() + 1) * pb[b], np.uint8) for b in buffers}

    descs = plan.descriptors(layout)
    assert [rd.rank for rd in descs] == list(range(cp))
    for rd, rp in zip(descs, plan.ranks, strict=True):
        assert len(rd) == len(rp.runs) * len(buffers)
        assert rd.total_bytes == rp.num_pages * layout.bytes_per_page()
        for i, desc in enumerate(rd):
            kind, layer = desc.kind, desc.layer
            run = rp.runs[i % len(rp.runs)]  # buffer-major, runs in order
            assert (kind, layer) == buffers[i // len(rp.runs)]
            page_bytes = layout.page_bytes(kind, layer)
            assert desc.src_offset == run.src_start * page_bytes
            assert desc.dst_offset == run.dst_start * page_bytes
            assert desc.nbytes == run.count * page_bytes
            assert (desc.position_start, desc.page_count) == (run.position_start, run.count)
            assert desc.position_stride == cp and desc.rank == rp.rank
            s, t = desc.src_offset, desc.dst_offset
            decode[(kind, layer)][t : t + desc.nbytes] = lanes[(kind, layer)][rp.rank][
                s : s + desc.nbytes
            ]

    for b in buffers:
        for p in range(plan.num_pages):
            got = decode[b][dst[p] * pb[b] : (dst[p] + 1) * pb[b]]
            want = lanes[b][p % cp][src[p] * pb[b] : (src[p] + 1) * pb[b]]
            np.testing.assert_array_equal(got, want, err_msg=f"buffer {b}, position {p}")


def test_descriptors_reject_other_page_size():
    plan = plan_request(8, 4, 2, [1, 1], [1, 2])
    with pytest.raises(PagePlanError, match="page_size=4 but the layout 8"):
        plan.descriptors(_small_layout(8))


def test_glm5_descriptor_timing():
    """GLM-5 size: 256K tokens, page 64 -> 4096 pages, 78 layers (234 buffers with fp8
    index K + scale), cp=8. Printed, loosely bounded; the worst case is fully fragmented
    pages (every page its own run -> ~958K descriptors)."""
    layout = LayoutDescriptor.from_model(_cfg("glm-5"), 64, "bfloat16", "fp8_e4m3")
    num_tokens, P, cp = 256 * 1024, 64, 8
    n = pages_for_tokens(num_tokens, P)
    rng = np.random.default_rng(0)
    frag_src, frag_dst = _random_pages(rng, n, cp, spare=n)
    table = RequestPageTable(cp)
    table.extend(OwnerLaneAllocator(cp, n // cp + 2), num_tokens, P)
    fresh_dst = np.empty(n, np.int64)
    fresh_dst[owner_major_order(n, cp)] = np.arange(1, n + 1)
    lines = []
    for name, src, dst in (
        ("fresh", table.local_pages(), fresh_dst),
        ("fragmented", frag_src, frag_dst),
    ):
        t0 = time.perf_counter()
        plan = plan_request(num_tokens, P, cp, src, dst)
        t1 = time.perf_counter()
        descs = plan.descriptors(layout)
        t2 = time.perf_counter()
        count = sum(len(rd) for rd in descs)
        total = sum(rd.total_bytes for rd in descs)
        assert total == n * layout.bytes_per_page()
        lines.append(
            f"GLM-5 {name}: {n} pages, {len(layout.buffers())} buffers, cp={cp}: plan "
            f"{(t1 - t0) * 1e3:.1f} ms, descriptors {(t2 - t1) * 1e3:.1f} ms, "
            f"{count} descriptors, {total / 2**30:.2f} GiB"
        )
        assert t2 - t0 < 2.0, lines[-1]
    for line in lines:
        print(line)
        log.info(line)


# --- layout descriptor --------------------------------------------------------------------


def test_layout_from_glm5():
    cfg = _cfg("glm-5")
    layout = LayoutDescriptor.from_model(cfg, 64, "bfloat16", "fp8_e4m3")
    assert layout.protocol_version == PROTOCOL_VERSION == 2
    assert layout.num_layers == 78 and layout.full_indexer_layers == tuple(range(78))
    assert (layout.latent_dtype, layout.index_k_dtype, layout.has_index_scale) == (
        "bfloat16",
        "float8_e4m3fn",
        True,
    )
    assert layout.page_bytes("latent", 5) == 64 * 576 * 2
    assert layout.page_bytes("index_k", 5) == 64 * 128
    assert layout.page_bytes("index_scale", 5) == 64 * 4
    assert len(layout.buffers()) == 3 * 78
    assert layout.buffers()[:4] == (
        ("latent", 0),
        ("index_k", 0),
        ("index_scale", 0),
        ("latent", 1),
    )
    # Per token: 1152 B latent + 128 B index K + 4 B scale per layer.
    assert layout.bytes_per_page() == 64 * 78 * (1152 + 128 + 4)


def test_layout_index_kinds_only_on_full_layers():
    cfg = _cfg("glm-5-indexshare-freq4")
    layout = LayoutDescriptor.from_model(cfg, 64, ml_dtypes.bfloat16, "fp8_e4m3")
    full = cfg.full_indexer_layers
    assert len(full) == 21
    buffers = layout.buffers()
    assert len(buffers) == 78 + 2 * 21
    assert {layer for k, layer in buffers if k == "index_k"} == set(full)
    assert {layer for k, layer in buffers if k == "index_scale"} == set(full)
    shared_layer = next(i for i in range(78) if i not in full)
    for kind in ("index_k", "index_scale"):
        with pytest.raises(PagePlanError, match=f"layer {shared_layer} is a shared indexer"):
            layout.page_bytes(kind, shared_layer)
    assert layout.page_bytes("latent", shared_layer) == 64 * 576 * 2
    assert layout.leaf_index("index_k", full[3]) == 3
    assert layout.leaf_index("latent", shared_layer) == shared_layer
    with pytest.raises(PagePlanError, match="unknown buffer kind 'rope'"):
        layout.page_bytes("rope", 0)
    with pytest.raises(PagePlanError, match="layer 78 is outside"):
        layout.page_bytes("latent", 78)

    bf16 = LayoutDescriptor.from_model(cfg, 64, "float32", "bfloat16")
    assert not bf16.has_index_scale and bf16.index_k_dtype == "bfloat16"
    assert bf16.page_bytes("latent", 0) == 64 * 576 * 4
    assert bf16.page_bytes("index_k", full[0]) == 64 * 128 * 2
    assert not any(k == "index_scale" for k, _ in bf16.buffers())
    with pytest.raises(PagePlanError, match="stores no index_scale"):
        bf16.page_bytes("index_scale", full[0])


def test_layout_wire_round_trip_and_mismatches():
    ours = LayoutDescriptor.from_model(_cfg("glm-5"), 64, "bfloat16", "fp8_e4m3")
    wire = json.loads(json.dumps(ours.to_dict()))
    assert LayoutDescriptor.from_dict(wire) == ours
    assert ours.mismatches(LayoutDescriptor.from_dict(wire)) == []
    ours.check_compatible(LayoutDescriptor.from_dict(wire))

    theirs = LayoutDescriptor.from_model(_cfg("glm-5-indexshare-freq4"), 32, "float32", "bfloat16")
    diff = ours.mismatches(theirs)
    fields = [line.split(":")[0] for line in diff]
    assert fields == [
        "page_size",
        "full_indexer_layers",
        "latent_dtype",
        "index_k_dtype",
        "has_index_scale",
    ]
    assert "page_size: 64 != 32" in diff
    assert "latent_dtype: 'bfloat16' != 'float32'" in diff
    assert "has_index_scale: True != False" in diff
    with pytest.raises(LayoutMismatchError, match="page_size: 64 != 32"):
        ours.check_compatible(theirs)

    newer = dict(wire, protocol_version=PROTOCOL_VERSION + 1)
    assert ours.mismatches(LayoutDescriptor.from_dict(newer)) == [
        f"protocol_version: {PROTOCOL_VERSION} != {PROTOCOL_VERSION + 1}"
    ]
    with pytest.raises(LayoutMismatchError, match=r"missing fields \['page_size'\]"):
        LayoutDescriptor.from_dict({k: v for k, v in wire.items() if k != "page_size"})
    with pytest.raises(LayoutMismatchError, match=r"unknown fields \['rope_dim'\]"):
        LayoutDescriptor.from_dict(dict(wire, rope_dim=64))


def test_layout_validates_fields():
    good = _small_layout(4).to_dict()
    with pytest.raises(PagePlanError, match="page_size must be an integer >= 1"):
        LayoutDescriptor.from_dict(dict(good, page_size=0))
    with pytest.raises(PagePlanError, match="full_indexer_layers must be ascending"):
        LayoutDescriptor.from_dict(dict(good, full_indexer_layers=[2, 0]))
    with pytest.raises(PagePlanError, match="full_indexer_layers must be ascending"):
        LayoutDescriptor.from_dict(dict(good, full_indexer_layers=[0, 4]))
    with pytest.raises(PagePlanError, match="latent_dtype 'fp9' is not a numpy"):
        LayoutDescriptor.from_dict(dict(good, latent_dtype="fp9"))


# --- digest -------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4096), st.data())
def test_digest_detects_a_flipped_bit(nbytes, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    page = rng.integers(0, 256, nbytes, dtype=np.uint8)
    bit = data.draw(st.integers(0, nbytes * 8 - 1))
    flipped = page.copy()
    flipped[bit // 8] ^= np.uint8(1 << (bit % 8))
    assert page_digest(page) == page_digest(page.copy()) == page_digest(page.tobytes())
    assert page_digest(page) != page_digest(flipped)
    assert 0 <= page_digest(page) < 2**64


def test_digest_of_typed_pages():
    rng = np.random.default_rng(1)
    pool = rng.standard_normal((5, 16, 8)).astype(ml_dtypes.bfloat16)
    digests = page_digests(pool)
    assert digests.dtype == np.uint64 and digests.shape == (5,)
    assert [int(x) for x in digests] == [page_digest(pool[i].tobytes()) for i in range(5)]
    assert len(set(digests.tolist())) == 5
    fp8 = pool.astype(ml_dtypes.float8_e4m3fn)
    bits = fp8.view(np.uint8).copy()
    bits[2, 3, 4] ^= 1
    assert page_digest(fp8[2]) != page_digest(bits.view(ml_dtypes.float8_e4m3fn)[2])
    # A strided view digests as its logical C-order bytes.
    assert page_digest(pool[:, ::2][1]) == page_digest(np.ascontiguousarray(pool[1, ::2]))
    assert page_digests(np.zeros((0, 16), np.float32)).shape == (0,)


def test_digest_without_xxhash_is_an_error(monkeypatch):
    monkeypatch.setattr(page_plan, "xxhash", None)
    with pytest.raises(ImportError, match="pip install xxhash"):
        page_digest(b"page")


def test_module_imports_neither_jax_nor_serving():
    code = (
        "import sys, transfer.page_plan; "
        "bad = [m for m in ('jax', 'serving') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
