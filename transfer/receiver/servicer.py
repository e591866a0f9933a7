"""The gRPC face of a `Receiver`: `KVTransferServicer` and `serve`.

Service `cpkv.transfer.v1.KVTransfer`, plus `grpc.health.v1`. Handlers take raw bytes
and parse them here, so malformed bytes, unknown rooms, another protocol version or an
oversized chunk come back as a gRPC status with the reason, and the server keeps
serving. A `WritePages` chunk's page bytes are split out of the message without a copy
(`transfer.wire.split_len_field`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Iterator
from typing import TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from transfer.page_plan import PROTOCOL_VERSION, PagePlanError
from transfer.proto import kv_transfer_pb2 as pb
from transfer.protocol import (
    HANDSHAKE_HOLD_S,
    MESSAGE_SLACK_BYTES,
    SERVICE_NAME,
    BadRequestError,
    RoomSnapshot,
    RoomState,
    TransferError,
    UnknownRoomError,
    aux_from_pb,
    data_plane_from_pb,
    layout_from_pb,
    layout_to_pb,
    section_from_pb,
    snapshot_to_pb,
)
from transfer.receiver.core import Receiver
from transfer.wire import PAGE_CHUNK_DATA, split_len_field

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

# How long a Commit reply waits for its room to finish (see `KVTransferServicer.Commit`).
COMMIT_WAIT_S = 1.0


def _status_code(e: TransferError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, e.code, grpc.StatusCode.INTERNAL)


class KVTransferServicer:
    """gRPC face of a `Receiver`. Handlers take raw bytes and parse them here, so a
    malformed message is an INVALID_ARGUMENT status naming the message, not a generic
    deserialization error; receiver errors keep their reason text and map to their
    `code`. Nothing a client sends can stop the server."""

    def __init__(
        self,
        receiver: Receiver,
        commit_wait_s: float = COMMIT_WAIT_S,
        *,
        handshake_hold_s: float = HANDSHAKE_HOLD_S,
        max_held_handshakes: int = 16,
    ):
        self.receiver = receiver
        self.commit_wait_s = commit_wait_s
        self.handshake_hold_s = handshake_hold_s
        # Held handshakes occupy server threads: at most this many at once (the rest get
        # NOT_FOUND at once and back off), so page streams always find a thread.
        self._holds = threading.BoundedSemaphore(max_held_handshakes)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        ser = pb.RoomStatus.SerializeToString
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Handshake": grpc.unary_unary_rpc_method_handler(
                    self.Handshake, response_serializer=pb.HandshakeReply.SerializeToString
                ),
                "GetRoom": grpc.unary_unary_rpc_method_handler(
                    self.GetRoom, response_serializer=ser
                ),
                "WritePages": grpc.stream_unary_rpc_method_handler(
                    self.WritePages, response_serializer=pb.WriteAck.SerializeToString
                ),
                "Commit": grpc.unary_unary_rpc_method_handler(self.Commit, response_serializer=ser),
                "Heartbeat": grpc.unary_unary_rpc_method_handler(
                    self.Heartbeat, response_serializer=ser
                ),
                "Abort": grpc.unary_unary_rpc_method_handler(self.Abort, response_serializer=ser),
            },
        )

    # Each handler: parse, call the receiver, map errors to a status (abort raises).
    def Handshake(self, raw: bytes, context: grpc.ServicerContext) -> pb.HandshakeReply:
        msg = _parse(pb.HandshakeRequest, raw, context)
        with _status_on_error(context):
            if not msg.HasField("layout"):
                raise BadRequestError("Handshake has no layout descriptor")
            args = (
                msg.room,
                msg.sender_rank,
                msg.cp_size,
                msg.num_tokens,
                layout_from_pb(msg.layout),
                msg.attempt,
                data_plane_from_pb(msg.data_plane),
            )
            try:
                res = self.receiver.handshake(*args)
            except UnknownRoomError:
                # Its request may be queued here: hold the call until the room appears.
                if not self._holds.acquire(blocking=False):
                    raise
                try:
                    registered = self.receiver.wait_registered(msg.room, self.handshake_hold_s)
                finally:
                    self._holds.release()
                if not registered:
                    raise
                res = self.receiver.handshake(*args)
            reply = pb.HandshakeReply(
                accepted=res.accepted,
                mismatches=list(res.mismatches),
                status=snapshot_to_pb(res.status),
                dst_pages=res.dst_pages.tolist(),
                layout=layout_to_pb(self.receiver.layout),
                max_chunk_bytes=self.receiver.max_chunk_bytes,
                heartbeat_interval_s=self.receiver.timeouts.heartbeat_interval,
            )
            if res.region is not None:
                reply.mooncake.CopyFrom(
                    pb.MooncakeRegion(
                        session_id=res.region.session_id,
                        buffer_addrs=list(res.region.buffer_addrs),
                        rows=res.region.rows.tolist(),
                        row_count=res.region.row_count,
                        protocol=res.region.protocol,
                    )
                )
            return reply

    def GetRoom(self, raw: bytes, context: grpc.ServicerContext) -> pb.RoomStatus:
        msg = _parse(pb.RoomRef, raw, context)
        with _status_on_error(context):
            return snapshot_to_pb(self.receiver.status(msg.room))

    def WritePages(self, raw_iter: Iterator[bytes], context: grpc.ServicerContext) -> pb.WriteAck:
        written = duplicate = 0
        status: RoomSnapshot | None = None
        for raw in raw_iter:
            # The page bytes stay in `raw` (a view): protobuf would copy them twice.
            split = split_len_field(raw, PAGE_CHUNK_DATA)
            if split is None:  # no data field, or malformed: protobuf parses (and says why)
                msg = _parse(pb.PageChunk, raw, context)
                data: bytes | memoryview = msg.data
            else:
                msg = _parse(pb.PageChunk, split[0], context)
                data = split[1]
            with _status_on_error(context):
                res = self.receiver.write_chunk(
                    msg.room,
                    msg.sender_rank,
                    msg.attempt,
                    [section_from_pb(sec) for sec in msg.sections],
                    data,
                )
            written, duplicate, status = (
                written + res.written,
                duplicate + res.duplicate,
                res.status,
            )
            if status.state is RoomState.FAILED:
                break  # the rest of the stream is moot; the ack says why
        if status is None:
            return pb.WriteAck(state=pb.ROOM_STATE_UNSPECIFIED)
        return pb.WriteAck(
            state=int(status.state),
            pages_written=written,
            pages_duplicate=duplicate,
            reason=status.reason,
        )

    def Commit(self, raw: bytes, context: grpc.ServicerContext) -> pb.RoomStatus:
        msg = _parse(pb.CommitRequest, raw, context)
        with _status_on_error(context):
            aux = aux_from_pb(msg.aux) if msg.HasField("aux") else None
            snap = self.receiver.commit(
                msg.room,
                msg.sender_rank,
                msg.attempt,
                np.asarray(msg.positions, np.int64),
                aux,
                np.asarray(msg.digests, np.uint64) if len(msg.digests) else None,
            )
            if not snap.state.terminal:
                # Hold the reply until the room finishes (the last rank's commit ends it),
                # briefly: every rank then learns the outcome from its commit reply and
                # the prefill side releases its page hold at once, instead of at its next
                # heartbeat. Bounded, so a slow room only costs a worker thread this long.
                snap = self.receiver.wait(msg.room, timeout=self.commit_wait_s)
            return snapshot_to_pb(snap)

    def Heartbeat(self, raw: bytes, context: grpc.ServicerContext) -> pb.RoomStatus:
        msg = _parse(pb.HeartbeatRequest, raw, context)
        with _status_on_error(context):
            return snapshot_to_pb(
                self.receiver.heartbeat(msg.room, msg.sender_rank, msg.writes_done)
            )

    def Abort(self, raw: bytes, context: grpc.ServicerContext) -> pb.RoomStatus:
        msg = _parse(pb.AbortRequest, raw, context)
        with _status_on_error(context):
            return snapshot_to_pb(self.receiver.abort(msg.room, msg.reason, msg.sender_rank))


def _parse(cls: type[M], raw: bytes, context: grpc.ServicerContext) -> M:
    """Parse `raw` as `cls`, or end the RPC with INVALID_ARGUMENT naming the message."""
    msg = cls()
    try:
        msg.ParseFromString(raw)
    except DecodeError as e:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"malformed {cls.DESCRIPTOR.full_name} ({len(raw)} bytes): {e}; the message is "
            "truncated or not a cpkv.transfer.v1 message",
        )
    return msg


class _status_on_error:
    """Context manager: receiver errors -> `context.abort` with their code and reason."""

    def __init__(self, context: grpc.ServicerContext):
        self.context = context

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            return False
        if isinstance(exc, TransferError):
            self.context.abort(_status_code(exc), str(exc))
        if isinstance(exc, PagePlanError | ValueError):
            self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if isinstance(exc, Exception):
            logger.exception("transfer receiver: unexpected error")
            self.context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        return False


class ReceiverServer:
    """The receiver's gRPC server and the thread pool its handlers run on. gRPC's
    `Server.stop` leaves a pool it was given running: its idle threads outlived every
    stopped receiver (23 of them after one test module). `stop` ends both."""

    def __init__(self, server: grpc.Server, pool: concurrent.futures.ThreadPoolExecutor):
        self._server, self._pool = server, pool

    def stop(self, grace: float | None) -> threading.Event:
        """`grpc.Server.stop(grace)`; the returned event is set once the server stopped
        (in-flight RPCs finished or, after `grace`, aborted) and the pool was told to
        shut down (its threads exit as their handlers return)."""
        stopped, done = self._server.stop(grace), threading.Event()

        def finish() -> None:
            stopped.wait()
            self._pool.shutdown(wait=False)
            done.set()

        threading.Thread(target=finish, name="kv-transfer-stop", daemon=True).start()
        return done


def serve(
    receiver: Receiver,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    max_workers: int = 64,
) -> tuple[ReceiverServer, int]:
    """Start a gRPC server for `receiver` on `host:port` (0 = any free port).

    Messages up to `receiver.max_chunk_bytes` plus header slack are accepted (larger
    ones get RESOURCE_EXHAUSTED from gRPC itself), compression is off, and
    `grpc.health.v1.Health` reports SERVING for "" and the KVTransfer service until
    `server.stop`. Returns `(server, bound_port)`; the receiver's timeout thread is the
    caller's (`receiver.start()`).
    """
    limit = receiver.max_chunk_bytes + MESSAGE_SLACK_BYTES
    pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="kv-transfer")
    server = grpc.server(
        pool,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ],
        compression=grpc.Compression.NoCompression,
    )
    server.add_generic_rpc_handlers((KVTransferServicer(receiver).generic_handler(),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        pool.shutdown(wait=False)
        raise OSError(f"transfer receiver could not bind {host}:{port}")
    server.start()
    logger.info(
        "KV transfer receiver serving on %s:%d (protocol v%d)", host, bound, PROTOCOL_VERSION
    )
    return ReceiverServer(server, pool), bound
