"""The `PageChunk` wire format by hand: the sender's encoder and the receiver's parser.

A chunk's page bytes are most of a `WritePages` message, and protobuf would copy them
twice each way. `serialize_page_chunk` (`transfer.backends.grpc_backend`) serializes the
header with protobuf and appends the `data` field itself, copying the page bytes once;
`split_len_field` (`transfer.receiver.servicer`) finds that field in a received message
and returns a view of it, so the receiver parses only the header. Both agree with
protobuf (`test_grpc_wire.test_fast_chunk_serialization_equals_protobuf`).
"""

from __future__ import annotations

from collections.abc import Sequence

from transfer.proto import kv_transfer_pb2 as pb

# Field number of `PageChunk.data` (the page bytes).
PAGE_CHUNK_DATA = pb.PageChunk.DESCRIPTOR.fields_by_name["data"].number


# ---- encoder (sender) ----------------------------------------------------------------------


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


_DATA_TAG = _varint_bytes(PAGE_CHUNK_DATA << 3 | 2)  # field `data`, wire type LEN


def serialize_page_chunk(header: pb.PageChunk, parts: Sequence[memoryview | bytes]) -> bytes:
    """The wire bytes of `header` (a `PageChunk` without `data`) with the concatenated
    `parts` as its `data` field, copying the page bytes once (protobuf would copy them
    twice: into the message and again when serializing). Protobuf parsers accept fields
    in any order, so this equals `PageChunk(..., data=b"".join(parts)).SerializeToString()`
    as a message (`test_grpc_wire.test_fast_chunk_serialization_equals_protobuf`)."""
    if header.data:
        raise ValueError("serialize_page_chunk: the header must not carry data")
    n = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
    return b"".join((header.SerializeToString(), _DATA_TAG, _varint_bytes(n), *parts))


# ---- parser (receiver) ---------------------------------------------------------------------


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]  # IndexError when truncated
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift >= 64:
            raise ValueError("varint too long")


def split_len_field(raw: bytes, field: int) -> tuple[bytes, memoryview] | None:
    """Split one length-delimited `field` out of a serialized message without copying
    it: (the message's other fields, serialized; a view of the field's bytes). None when
    the field is absent or repeated, or the message is malformed - the caller then
    parses `raw` whole, and protobuf reports what is wrong."""
    i, n, spans = 0, len(raw), []
    try:
        while i < n:
            start = i
            key, i = _varint(raw, i)
            wire = key & 7
            if wire == 0:
                _, i = _varint(raw, i)
            elif wire == 1:
                i += 8
            elif wire == 2:
                size, i = _varint(raw, i)
                if key >> 3 == field:
                    spans.append((start, i, i + size))
                i += size
            elif wire == 5:
                i += 4
            else:
                return None
            if i > n:
                return None
    except (IndexError, ValueError):
        return None
    if len(spans) != 1:
        return None
    start, lo, hi = spans[0]
    return raw[:start] + raw[hi:], memoryview(raw)[lo:hi]
