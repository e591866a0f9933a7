"""The gRPC transfer backend's streams and the service's wire format (SPEC S2).

- The sender: a rank's buffers share few streams balanced by bytes, packed into full
  chunks, and a rank opens no more streams than it has chunks; channels are kept per
  (decode target, rank) across rooms.
- The service: bad input on the wire gets a status with a reason and the server keeps
  answering; the sender's one-copy chunk serialization equals protobuf's; the committed
  generated code is up to date; startup refuses a backend without position-addressed
  destinations (S2.3).

(Until the tests were split by topic, part of tests/test_transfer_grpc.py.)
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import threading
import time
from pathlib import Path

import grpc
import jax.numpy as jnp
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.transfer import INDEX_K, SENDER, TIMEOUTS, P, section_spans

from cpkv_jax.model.kv_cache import init_pool
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.paging import PageAllocator
from cpkv_jax.scores import PromptLogprobs
from serving.server_args import ServerArgs, ServerArgsError
from transfer.backends.grpc_backend import GrpcBackend, _stream_groups, serialize_page_chunk
from transfer.capabilities import BackendCapabilities, default_backend_registry
from transfer.hold import TransferHold
from transfer.page_plan import PROTOCOL_VERSION, LayoutDescriptor, page_digests, plan_request
from transfer.page_source import HostPoolPageSource
from transfer.proto import generate as proto_generate
from transfer.proto import kv_transfer_pb2 as pb
from transfer.proto import kv_transfer_pb2_grpc as pb_grpc
from transfer.protocol import (
    SERVICE_NAME,
    Aux,
    BadRequestError,
    RoomSnapshot,
    RoomState,
    aux_from_pb,
    aux_to_pb,
    kind_from_pb,
    kind_to_pb,
    layout_to_pb,
)
from transfer.receiver import Receiver, serve
from transfer.sender import RankJob, TransferBackend

logger = logging.getLogger(__name__)


# ---- the sender's streams, chunks and channels -----------------------------------------------


@pytest.mark.parametrize("streams", [1, 2, 4, 100])
def test_buffers_share_few_streams_balanced_by_bytes(streams):
    """A rank sends all its buffers over `channels_per_rank` streams (not one stream per
    buffer): each buffer in exactly one stream, in layout order, streams about equal in
    bytes (GLM-5 layout: the 8 latent buffers dominate)."""
    layout = LayoutDescriptor(
        PROTOCOL_VERSION, 64, 8, tuple(range(8)), 576, "bfloat16", 128, "float8_e4m3fn", True
    )
    groups = _stream_groups(layout, streams)
    buffers = layout.buffers()
    assert len(groups) == min(streams, len(buffers))
    assert sorted(b for g in groups for b in g) == sorted(buffers)
    for g in groups:
        assert g == sorted(g, key=buffers.index)
    loads = [sum(layout.page_bytes(*b) for b in g) for g in groups]
    assert max(loads) - min(loads) <= max(layout.page_bytes(*b) for b in buffers)


@pytest.mark.parametrize(("max_pages", "local"), [(None, "scattered"), (None, "run"), (5, "run")])
def test_stream_packs_buffers_into_full_chunks(monkeypatch, max_pages, local):
    """A stream's buffers are packed into chunks of at most `chunk_bytes` page bytes (and
    `MAX_CHUNK_PAGES` pages), a chunk ending one buffer and beginning the next (one
    section per buffer run); every chunk but the last is full; the sections carry
    exactly the rank's pages of every buffer, in order, with their digests."""
    import transfer.backends.grpc_backend as gb

    if max_pages is not None:
        monkeypatch.setattr(gb, "MAX_CHUNK_PAGES", max_pages)
    layout = LayoutDescriptor(
        PROTOCOL_VERSION, 4, 3, (0, 2), 16, "float32", 8, "float8_e4m3fn", True
    )
    rng = np.random.default_rng()
    pool_pages, tokens = 40, 13 * 4 - 1
    leaves = {
        b: rng.integers(0, 256, (pool_pages, layout.page_bytes(*b)), dtype=np.uint8)
        for b in layout.buffers()
    }
    # Local pages: one run (chunks are slices of the pool) or scattered (gathered).
    src = np.arange(7, 20) if local == "run" else rng.permutation(np.arange(1, pool_pages))[:13]
    job = RankJob(
        "pack", "127.0.0.1:1", 0, 1, tokens, layout, src, HostPoolPageSource(layout, leaves)
    )
    plan = plan_request(tokens, 4, 1, src, np.arange(1, 14)).ranks[0]
    sender = gb.GrpcRankSender(job, TransferHold("pack", [0], lambda _: None), SENDER)
    group = layout.buffers()
    chunk_bytes = 1000
    chunks = [pb.PageChunk.FromString(c) for c in sender._stream_chunks(plan, group, chunk_bytes)]
    assert sender.chunks_sent == len(chunks) > 1
    got: dict[tuple[str, int], list[tuple[int, bytes, int]]] = {b: [] for b in group}
    flat = []  # (buffer, page bytes) in stream order
    for msg in chunks:
        assert (msg.room, msg.sender_rank, msg.attempt) == ("pack", 0, 0)
        assert len(msg.data) <= chunk_bytes
        assert sum(len(sec.positions) for sec in msg.sections) <= (max_pages or 16384)
        for sec, lo, _ in section_spans(msg, layout):
            b = (kind_from_pb(sec.kind), sec.layer)
            nb = layout.page_bytes(*b)
            for i, (p, d) in enumerate(zip(sec.positions, sec.digests, strict=True)):
                got[b].append((p, msg.data[lo + i * nb : lo + (i + 1) * nb], d))
                flat.append(b)
    for b in group:
        want = leaves[b][src]
        assert [p for p, _, _ in got[b]] == list(range(13))
        assert [x for _, x, _ in got[b]] == [w.tobytes() for w in want]
        assert [d for _, _, d in got[b]] == page_digests(want).tolist()
    assert flat == [b for b in group for _ in range(13)]  # buffer after buffer
    # Full: each chunk but the last could not take the stream's next page.
    sizes = [len(m.data) for m in chunks]
    pages = [sum(len(sec.positions) for sec in m.sections) for m in chunks]
    done = 0
    for size, n in zip(sizes[:-1], pages[:-1], strict=True):
        done += n
        nxt = layout.page_bytes(*flat[done])
        assert size + nxt > chunk_bytes or n == max_pages


@pytest.mark.parametrize(("chunks", "streams"), [(1, 1), (2, 2), (3, 3), (40, 3)])
def test_a_rank_opens_no_more_streams_than_it_has_chunks(monkeypatch, chunks, streams):
    """Each stream costs a call and threads on both sides, so a rank whose pages fill
    fewer chunks than it has channels opens one stream per chunk - a single one on the
    rank's own thread (a 512-token GLM-5 room: ~36 -> ~29 ms); bigger ranks one stream
    per channel. Every buffer goes in exactly one stream."""
    import transfer.backends.grpc_backend as gb

    layout = LayoutDescriptor(
        PROTOCOL_VERSION, 4, 3, (0, 2), 16, "float32", 8, "float8_e4m3fn", True
    )
    src = np.arange(1, 14)
    rng = np.random.default_rng()
    leaves = {
        b: rng.integers(0, 256, (20, layout.page_bytes(*b)), dtype=np.uint8)
        for b in layout.buffers()
    }
    job = RankJob(
        "streams", "127.0.0.1:1", 0, 1, 13 * 4, layout, src, HostPoolPageSource(layout, leaves)
    )
    plan = plan_request(13 * 4, 4, 1, src, np.arange(1, 14)).ranks[0]
    config = dataclasses.replace(SENDER, channels_per_rank=3)
    sender = gb.GrpcRankSender(job, TransferHold("streams", [0], lambda _: None), config)
    sender._stubs = [None] * 3  # three channels; no call is made here
    calls: list[tuple[int, list, threading.Thread]] = []

    def record(plan, group, channel, chunk_bytes):
        calls.append((channel, group, threading.current_thread()))

    monkeypatch.setattr(sender, "_send_stream", record)
    rank_bytes = plan.num_pages * layout.bytes_per_page()
    sender._send_pages(plan, -(-rank_bytes // chunks))  # `chunks` chunks of pages
    assert len(calls) == streams
    assert sorted(b for _, g, _ in calls for b in g) == sorted(layout.buffers())
    assert sorted(c for c, _, _ in calls) == list(range(streams))
    if streams == 1:
        assert calls[0][2] is threading.current_thread()


def test_backend_keeps_each_ranks_channels_across_rooms():
    """Channels are made once per (decode target, rank) and reused by later rooms (no
    connection setup per room); `close()` closes them and refuses later sends."""
    backend = GrpcBackend(dataclasses.replace(SENDER, channels_per_rank=3))
    first = backend.channels("127.0.0.1:1", 0)
    assert len(first) == 3 and len({id(c) for c in first}) == 3
    assert backend.channels("127.0.0.1:1", 0) == first  # the same objects, reused
    assert not set(map(id, backend.channels("127.0.0.1:1", 1))) & set(map(id, first))
    assert not set(map(id, backend.channels("127.0.0.1:2", 0))) & set(map(id, first))
    backend.close()
    with pytest.raises(RuntimeError, match="closed"):
        backend.channels("127.0.0.1:1", 0)


# ---- the gRPC service and its wire format ----------------------------------------------------


@pytest.fixture
def wire(cfg, layout):
    """A receiver (64 KiB chunk limit) served on loopback, with a raw channel."""
    rx = Receiver(
        layout,
        init_pool(mtp_config(cfg), 8, P, jnp.float32, INDEX_K),
        PageAllocator(8),
        timeouts=TIMEOUTS,
        max_chunk_bytes=64 * 1024,
    )
    server, port = serve(rx)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield rx, channel
    channel.close()
    server.stop(0)


def _raw(channel: grpc.Channel, method: str, payload: bytes, stream: bool = False):
    path = f"/{SERVICE_NAME}/{method}"
    ident = lambda b: b
    if stream:
        call = channel.stream_unary(path, request_serializer=ident, response_deserializer=ident)
        return call(iter([payload]), timeout=5)
    return channel.unary_unary(path, request_serializer=ident, response_deserializer=ident)(
        payload, timeout=5
    )


def _still_serving(rx: Receiver, channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = pb_grpc.KVTransferStub(channel)
    name = f"ok-{time.monotonic_ns()}"
    rx.register_room(name, rx.allocate_pages(1), P, 1)
    assert stub.GetRoom(pb.RoomRef(room=name), timeout=5).state == pb.ROOM_STATE_BOOTSTRAPPING
    rx.abort(name, "test cleanup")


def _expect_status(code: grpc.StatusCode, match: str, fn, *args, **kw) -> None:
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, **kw)
    assert e.value.code() == code, (e.value.code(), e.value.details())
    assert match in e.value.details(), e.value.details()


def test_wire_bad_input_gets_a_status_and_the_server_keeps_serving(wire, layout):
    rx, channel = wire
    stub = pb_grpc.KVTransferStub(channel)
    good_layout = layout_to_pb(layout)
    _still_serving(rx, channel)

    _expect_status(
        grpc.StatusCode.NOT_FOUND,
        "unknown room 'nope'",
        stub.GetRoom,
        pb.RoomRef(room="nope"),
        timeout=5,
    )
    _still_serving(rx, channel)

    rx.register_room("v", rx.allocate_pages(1), P, 1)
    old = pb.LayoutDescriptor()
    old.CopyFrom(good_layout)
    old.protocol_version = PROTOCOL_VERSION + 1
    _expect_status(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"protocol version {PROTOCOL_VERSION + 1}",
        stub.Handshake,
        pb.HandshakeRequest(room="v", sender_rank=0, cp_size=1, num_tokens=P, layout=old),
        timeout=5,
    )
    _still_serving(rx, channel)

    # Truncated and garbage bytes, unary and streamed.
    req = pb.HandshakeRequest(room="v", sender_rank=0, cp_size=1, num_tokens=P, layout=good_layout)
    wire_bytes = req.SerializeToString()
    _expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        "malformed cpkv.transfer.v1.HandshakeRequest",
        _raw,
        channel,
        "Handshake",
        wire_bytes[:-3],
    )
    _expect_status(
        grpc.StatusCode.INVALID_ARGUMENT, "truncated", _raw, channel, "GetRoom", b"\xff\xff\xff"
    )
    chunk = pb.PageChunk(
        room="v",
        sender_rank=0,
        sections=[pb.PageSection(kind=kind_to_pb("latent"), positions=[0])],
        data=b"x" * 100,
    )
    cut = chunk.SerializeToString()[:-10]
    _expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        "malformed cpkv.transfer.v1.PageChunk",
        _raw,
        channel,
        "WritePages",
        cut,
        stream=True,
    )
    _still_serving(rx, channel)

    # Oversized chunks: over the receiver's limit, and over gRPC's message limit.
    rx.register_room("big", rx.allocate_pages(2), 2 * P, 1)
    assert stub.Handshake(
        pb.HandshakeRequest(
            room="big", sender_rank=0, cp_size=1, num_tokens=2 * P, layout=good_layout
        )
    ).accepted
    one_page = [pb.PageSection(kind=kind_to_pb("latent"), positions=[0], digests=[0])]
    mid = pb.PageChunk(room="big", sections=one_page, data=bytes(100_000))
    _expect_status(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "over the 65536 B limit",
        stub.WritePages,
        iter([mid]),
        timeout=5,
    )
    huge = pb.PageChunk(room="big", sections=one_page, data=bytes(1 << 20))
    _expect_status(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "larger than max",
        stub.WritePages,
        iter([huge]),
        timeout=5,
    )
    _still_serving(rx, channel)
    assert rx.status("big").state is RoomState.WAITING_FOR_INPUT  # refused chunks moved nothing


def test_fast_chunk_serialization_equals_protobuf():
    """`serialize_page_chunk` (the sender's one-copy path) parses to exactly the message
    protobuf serializes, for empty, small and multi-byte-length payloads given in 1-3
    parts under 1-3 sections, and the receiver's zero-copy split finds the same data
    bytes in it."""
    from transfer.wire import PAGE_CHUNK_DATA, split_len_field

    rng = np.random.default_rng()
    for n in (0, 1, 127, 128, 16384, 3 * 65536 + 5):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        sections = []
        for _ in range(int(rng.integers(1, 4))):
            k = int(rng.integers(1, 9))
            sections.append(
                pb.PageSection(
                    kind=kind_to_pb(str(rng.choice(["latent", "index_k", "index_scale"]))),
                    layer=int(rng.integers(80)),
                    positions=rng.integers(0, 1 << 20, k).tolist(),
                    digests=rng.integers(0, 1 << 63, k, dtype=np.uint64).tolist(),
                )
            )
        header = pb.PageChunk(
            room=f"room-{n}",
            sender_rank=int(rng.integers(8)),
            attempt=int(rng.integers(3)),
            sections=sections,
        )
        cuts = np.sort(rng.integers(0, n + 1, int(rng.integers(0, 3))))
        parts = [memoryview(p) for p in np.split(data, cuts)]  # 1-3 parts, maybe empty
        raw = serialize_page_chunk(header, parts)
        want = pb.PageChunk()
        want.CopyFrom(header)
        want.data = data.tobytes()
        assert pb.PageChunk.FromString(raw) == want
        split = split_len_field(raw, PAGE_CHUNK_DATA)
        assert split is not None and bytes(split[1]) == data.tobytes()
        assert pb.PageChunk.FromString(split[0]) == header
    with pytest.raises(ValueError, match="must not carry data"):
        serialize_page_chunk(pb.PageChunk(data=b"x"), [b"y"])


def test_committed_generated_code_is_up_to_date(tmp_path: Path):
    """Regenerate into a temp dir: the serialized descriptor must equal the committed one
    (always), and the files must be byte-identical when the same grpcio-tools made them."""
    import grpc_tools

    fresh = proto_generate.generate(tmp_path)
    committed = [proto_generate.REPO_ROOT / p for p in proto_generate.GENERATED]

    def descriptor(path: Path) -> bytes:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile":
                return ast.literal_eval(node.args[0])
        raise AssertionError(f"{path} has no serialized descriptor")

    hint = "stale generated code: run `python -m transfer.proto.generate` and commit the result"
    assert descriptor(fresh[0]) == descriptor(committed[0]), hint
    made_by = ast.literal_eval(
        next(
            line.split("=", 1)[1].strip()
            for line in committed[1].read_text().splitlines()
            if line.startswith("GRPC_GENERATED_VERSION")
        )
    )
    tools = getattr(grpc_tools, "__version__", None)
    if tools is None:
        from importlib.metadata import version

        tools = version("grpcio-tools")
    if tools == made_by:
        for new, old in zip(fresh, committed, strict=True):
            assert new.read_bytes() == old.read_bytes(), f"{old.name}: {hint}"
    else:
        logger.warning(
            "grpcio-tools %s != %s (committed): compared descriptors only", tools, made_by
        )


class SliceBackend(TransferBackend):
    """Test-only backend that fills 'the next slice of the page list' (SPEC S2.3)."""

    capabilities = BackendCapabilities(
        "slice", owner_filtering=True, position_addressed=False, description="test only"
    )

    def send_rank(self, job: RankJob, hold: TransferHold) -> RoomSnapshot | None:
        raise NotImplementedError("never started: startup refuses it for CP shared KV")


def test_s2_3_startup_refuses_a_backend_without_position_addressing():
    assert GrpcBackend.capabilities.supports_cp_shared_kv
    reg = default_backend_registry()
    reg.register(SliceBackend.capabilities)
    args = ServerArgs(
        model_path="unused",
        cp_size=8,
        enable_cp_shared_kv=True,
        disaggregation_mode="prefill",
        transfer_backend="slice",
    )
    with pytest.raises(ServerArgsError, match="lacks position-addressed destinations"):
        args.validate(backends=reg)
    ok = dataclasses.replace(args, transfer_backend="grpc")
    ok.validate(backends=reg)


def test_aux_carries_the_first_tokens_top_logprobs():
    """`Aux.top` (fields 5-6) survives the wire; a sender that leaves it out (or one from
    before the fields) gives an empty tuple; ids and log-probs of different lengths are a
    bad request, not a silent zip."""
    aux = Aux(17, -0.25, 3, 1, ((17, -0.25), (4, -1.5), (99, -2.75)))
    wire = aux_to_pb(aux).SerializeToString()
    assert aux_from_pb(pb.Aux.FromString(wire)) == aux
    assert aux_from_pb(pb.Aux.FromString(aux_to_pb(Aux(5, -1.0)).SerializeToString())).top == ()
    broken = pb.Aux(first_token=1, logprob=-1.0, top_ids=[1, 2], top_logprobs=[-1.0])
    with pytest.raises(BadRequestError, match="2 top token ids but 1 log-probs"):
        aux_from_pb(broken)


def test_aux_carries_prompt_log_probs():
    """`Aux.prompt_scores` (fields 8-12: PD prompt log-probs) survive the wire, from
    token 0 (NaN: no context) with the request's own number of alternatives; an aux
    without them (a sender from before the fields) has None, start 0 included; ids and
    log-probs that do not fill `m x top_n` are a bad request."""
    rng = np.random.default_rng(4)
    m, k = 6, 3
    lps = rng.normal(-2, 1, m).astype(np.float32)
    lps[0] = np.nan
    scores = PromptLogprobs(
        0,
        lps,
        rng.integers(0, 300, (m, k)).astype(np.int32),
        rng.normal(-1, 1, (m, k)).astype(np.float32),
    )
    wire = aux_to_pb(Aux(5, -1.0, prompt_scores=scores)).SerializeToString()
    got = aux_from_pb(pb.Aux.FromString(wire)).prompt_scores
    assert got is not None and got.start == 0
    np.testing.assert_array_equal(got.logprobs, scores.logprobs)  # NaN compares equal here
    np.testing.assert_array_equal(got.top_ids, scores.top_ids)
    np.testing.assert_array_equal(got.top_logprobs, scores.top_logprobs)
    assert (
        aux_from_pb(pb.Aux.FromString(aux_to_pb(Aux(5, -1.0)).SerializeToString())).prompt_scores
        is None
    )
    broken = pb.Aux(
        first_token=1,
        prompt_scores_from=2,
        prompt_logprobs=[-1.0, -2.0],
        prompt_top_n=2,
        prompt_top_ids=[1, 2, 3],
        prompt_top_logprobs=[-1.0] * 4,
    )
    with pytest.raises(BadRequestError, match="2 tokens x 2 alternatives"):
        aux_from_pb(broken)


def test_a_stopped_receiver_server_leaves_no_handler_thread(cfg, layout):
    """`ReceiverServer.stop` ends the handlers' thread pool too: gRPC's `Server.stop`
    leaves a pool it was given running, and its idle threads outlived every stopped
    receiver of a process."""
    pool = init_pool(mtp_config(cfg), 8, P, jnp.float32, INDEX_K)
    rx = Receiver(layout, pool, PageAllocator(8), timeouts=TIMEOUTS)
    before = set(threading.enumerate())  # another server's threads are not this one's
    server, port = serve(rx)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        _still_serving(rx, channel)  # handler threads start on first use
    ours = [
        t for t in threading.enumerate() if t.name.startswith("kv-transfer_") and t not in before
    ]
    assert ours
    assert server.stop(0).wait(10.0)
    for t in ours:
        t.join(10.0)
        assert not t.is_alive(), t.name
    rx.close()
