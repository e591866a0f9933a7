"""Shared vocabulary of the PD transfer protocol: room states, errors, limits, wire codecs.

Both ends use it: `transfer.receiver` (decode side) and `transfer.sender` /
`transfer.backends` (prefill side). The wire format is `transfer/proto/kv_transfer.proto`.

Room status machine (SPEC S2, ARCHITECTURE "Transfer protocol shape")::

    BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS
          \\________________\\___________________\\______-> FAILED

Transitions only go forward (states may be skipped: a fast rank's first page can arrive
while a slow rank is still handshaking); SUCCESS and FAILED are terminal, FAILED is
sticky, and a finished room is never revived.

Errors carry a `code` (a `grpc.StatusCode` name) so the gRPC servicer can turn a
receiver error into a status with the same reason text, and the sender can tell a
retryable failure from a final one.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal

import numpy as np

from cpkv_jax.errors import CpkvError
from cpkv_jax.scores import PromptLogprobs
from cpkv_jax.units import MiB
from transfer.page_plan import PROTOCOL_VERSION, BufferKind, LayoutDescriptor
from transfer.proto import kv_transfer_pb2 as pb

# Page bytes per PageChunk: the 1-4 MiB messages. A chunk always holds at least
# one page, so a page larger than the chunk size is refused at sender construction.
MIN_CHUNK_BYTES = 1 * MiB
MAX_CHUNK_BYTES = 4 * MiB
DEFAULT_CHUNK_BYTES = 2 * MiB
# gRPC message limit = page bytes + room for positions/digests/room id (a 4 MiB chunk of
# 4 KiB pages carries 1024 positions and digests: ~14 KiB); 256 KiB leaves ample slack.
MESSAGE_SLACK_BYTES = 256 * 1024
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + MESSAGE_SLACK_BYTES
# Prompt log-probs ride in rank 0's commit (`Aux.prompt_scores`), beside every page's
# position and digest: a bound well inside the smallest chunk's message limit.
MAX_PROMPT_SCORE_BYTES = 768 * 1024


def prompt_score_bytes(tokens: int, top_n: int) -> int:
    """Bytes `tokens` scored prompt tokens with `top_n` alternatives each take in an
    `Aux` (a float32 log-prob, then an int32 id and a float32 log-prob per alternative;
    protobuf's packed encoding, its few bytes of framing aside)."""
    return tokens * (4 + 8 * top_n)


def transfer_scores(scores: PromptLogprobs | None, top_n: int) -> PromptLogprobs | None:
    """`scores` with the request's `top_n` alternatives per token (what the aux sends)."""
    if scores is None:
        return None
    return PromptLogprobs(
        scores.start, scores.logprobs, scores.top_ids[:, :top_n], scores.top_logprobs[:, :top_n]
    )


# Pages per chunk, whatever their size: each costs up to 13 header bytes (a position
# varint and a fixed64 digest), so 16384 of them stay within the slack (tiny pages, e.g.
# index scales at page size 1, would otherwise overflow the message limit).
MAX_CHUNK_PAGES = 16384
# A Handshake for a room the decode side has not registered yet (its request waits in the
# decode server's queue) is held this long for the room to appear before NOT_FOUND, so a
# sender learns of the registration at once and does not poll. Senders retry at once
# after a held NOT_FOUND.
HANDSHAKE_HOLD_S = 1.0
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name


class RoomState(enum.IntEnum):
    """Status of one room; the values are the proto `RoomState` numbers (and the order)."""

    BOOTSTRAPPING = pb.ROOM_STATE_BOOTSTRAPPING
    WAITING_FOR_INPUT = pb.ROOM_STATE_WAITING_FOR_INPUT
    TRANSFERRING = pb.ROOM_STATE_TRANSFERRING
    SUCCESS = pb.ROOM_STATE_SUCCESS
    FAILED = pb.ROOM_STATE_FAILED

    @property
    def terminal(self) -> bool:
        return self in (RoomState.SUCCESS, RoomState.FAILED)

    def can_become(self, new: RoomState) -> bool:
        """Whether `self -> new` is a legal transition (forward only, terminal is final)."""
        if self.terminal:
            return False
        if new is RoomState.FAILED:
            return True
        return new > self

    @property
    def label(self) -> str:
        """The issue's spelling: Bootstrapping, WaitingForInput, Transferring, ..."""
        return "".join(w.capitalize() for w in self.name.split("_"))


# ---- errors ------------------------------------------------------------------------------


class TransferError(CpkvError):
    """A PD transfer request cannot be served. `code` is a `grpc.StatusCode` name."""

    code: str = "INTERNAL"


class BadRequestError(TransferError, ValueError):
    """A message is malformed or inconsistent (lengths, kinds, positions, ranks)."""

    code = "INVALID_ARGUMENT"


class ChunkTooLargeError(BadRequestError):
    """A PageChunk carries more page bytes than the receiver accepts."""

    code = "RESOURCE_EXHAUSTED"


class UnknownRoomError(TransferError, KeyError):
    """No room with that id was registered (or it was forgotten long ago)."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class RoomExistsError(TransferError):
    """A room id was registered twice (a finished room is never revived)."""

    code = "ALREADY_EXISTS"


class RoomClosedError(TransferError):
    """The room is finished (Success or Failed): the request is rejected untouched."""

    code = "FAILED_PRECONDITION"


class ProtocolVersionError(TransferError):
    """The peer speaks another protocol version; nothing else of its message is trusted."""

    code = "FAILED_PRECONDITION"


class NotHandshakenError(TransferError):
    """A sender wrote or committed before its handshake was accepted."""

    code = "FAILED_PRECONDITION"


class DigestMismatchError(TransferError):
    """A page's bytes do not match its digest; the room failed."""

    code = "DATA_LOSS"


# ---- values shared by both sides -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Aux:
    """A request's auxiliary data, sent once by rank 0: the first output token, and the
    prompt tokens the prefill reused from its cache (of them, `host_cached_tokens` loaded
    back from its host cache), which the decode server reports as `cached_tokens`."""

    first_token: int
    logprob: float
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    # The first token's most likely alternatives, (token id, log-prob) most likely first,
    # when the request asked for top log-probs (the decode server streams them).
    top: tuple[tuple[int, float], ...] = ()
    # A drafting prefill's (`--speculative-algorithm`): the trunk's final hidden state at
    # the prompt's last position, float32 little-endian (`hidden_state`), from which the
    # decode server's MTP layer drafts; empty otherwise.
    hidden: bytes = b""
    # A request's prompt log-probs (`logprob_start_len`, or `echo` with `logprobs`): the
    # prefill server scored its prompt; `top_ids` / `top_logprobs` hold the request's own
    # number of alternatives per token (`[m, top_n]`).
    prompt_scores: PromptLogprobs | None = None

    def __post_init__(self) -> None:
        if len(self.hidden) % 4:
            raise ValueError(f"aux hidden state of {len(self.hidden)} bytes is not float32s")

    @classmethod
    def with_hidden(cls, hidden: np.ndarray | None, **fields: Any) -> Aux:
        """An `Aux` of `fields` carrying `hidden` (any float array of one row), or none."""
        raw = b"" if hidden is None else np.asarray(hidden, "<f4").reshape(-1).tobytes()
        return cls(**fields, hidden=raw)

    def hidden_state(self) -> np.ndarray | None:
        """The hidden state as a float32 vector, or None when none was sent."""
        return np.frombuffer(self.hidden, "<f4") if self.hidden else None


@dataclasses.dataclass(frozen=True)
class RoomSnapshot:
    """A room's status at one instant (what `GetRoom` returns)."""

    room: str
    state: RoomState
    reason: str = ""
    aux: Aux | None = None
    num_pages: int = 0
    committed_ranks: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class PageSection:
    """Pages of one (kind, layer) buffer in a chunk (proto `PageSection`): `positions[i]`
    is the logical position of the chunk's i-th page of this buffer and `digests[i]` its
    xxh3-64. The bytes are the chunk data's next `len(positions) * page_bytes` bytes."""

    kind: BufferKind
    layer: int
    positions: np.ndarray  # [k] int64 (any int array-like is checked by the receiver)
    digests: np.ndarray  # [k] uint64


@dataclasses.dataclass(frozen=True)
class TransferTimeouts:
    """Decode-side timeouts, in seconds (set by the server's `--transfer-*-timeout` flags).

    - `bootstrap`: from registration until every sender's handshake was accepted;
    - `waiting`: in WaitingForInput, i.e. from the last handshake to the first page;
    - `heartbeat`: a handshaken sender that has not committed yet and sent nothing
      (heartbeat, page, commit) for this long is presumed dead;
    - `heartbeat_interval`: what the decode side asks senders to send (handshake reply).
    """

    bootstrap: float = 300.0
    waiting: float = 300.0
    heartbeat: float = 15.0
    heartbeat_interval: float = 5.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"transfer timeout {f.name} must be > 0 seconds, got {value}")
        if self.heartbeat_interval >= self.heartbeat:
            raise ValueError(
                f"heartbeat_interval ({self.heartbeat_interval}s) must be below the heartbeat "
                f"timeout ({self.heartbeat}s), or every sender looks dead"
            )


# ---- wire codecs -------------------------------------------------------------------------

_KIND_TO_PB: dict[str, int] = {
    "latent": pb.BUFFER_KIND_LATENT,
    "index_k": pb.BUFFER_KIND_INDEX_K,
    "index_scale": pb.BUFFER_KIND_INDEX_SCALE,
}
_PB_TO_KIND: dict[int, BufferKind] = {v: k for k, v in _KIND_TO_PB.items()}  # type: ignore[misc]


def kind_to_pb(kind: BufferKind) -> int:
    return _KIND_TO_PB[kind]


def kind_from_pb(value: int) -> BufferKind:
    try:
        return _PB_TO_KIND[value]
    except KeyError:
        raise BadRequestError(
            f"unknown buffer kind {value}; expected one of "
            f"{sorted((v, k) for k, v in _KIND_TO_PB.items())}"
        ) from None


def section_from_pb(msg: pb.PageSection) -> PageSection:
    return PageSection(
        kind_from_pb(msg.kind),
        msg.layer,
        np.asarray(msg.positions, np.int64),
        np.asarray(msg.digests, np.uint64),
    )


def layout_to_pb(layout: LayoutDescriptor) -> pb.LayoutDescriptor:
    return pb.LayoutDescriptor(**layout.to_dict())


def layout_from_pb(msg: pb.LayoutDescriptor) -> LayoutDescriptor:
    """Decode a peer's layout. The protocol version is checked first: a peer speaking
    another version may mean anything by the other fields."""
    if msg.protocol_version != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"peer speaks transfer protocol version {msg.protocol_version}, this side "
            f"{PROTOCOL_VERSION}; run the same cpkv-jax version on prefill and decode"
        )
    try:
        return LayoutDescriptor(
            protocol_version=msg.protocol_version,
            page_size=msg.page_size,
            num_layers=msg.num_layers,
            full_indexer_layers=tuple(msg.full_indexer_layers),
            kv_cache_dim=msg.kv_cache_dim,
            latent_dtype=msg.latent_dtype,
            index_head_dim=msg.index_head_dim,
            index_k_dtype=msg.index_k_dtype,
            has_index_scale=msg.has_index_scale,
        )
    except (ValueError, TypeError) as e:
        raise BadRequestError(f"invalid layout descriptor: {e}") from e


# How a sender moves page bytes: gRPC `WritePages` streams, or one-sided Mooncake engine
# writes into the room's staging region (`HandshakeRequest.data_plane`).
DataPlane = Literal["grpc", "mooncake"]
_PLANE_TO_PB: dict[str, int] = {"grpc": pb.DATA_PLANE_GRPC, "mooncake": pb.DATA_PLANE_MOONCAKE}


def data_plane_to_pb(plane: DataPlane) -> int:
    return _PLANE_TO_PB[plane]


def data_plane_from_pb(value: int) -> DataPlane:
    """UNSPECIFIED (a sender from before the field) means gRPC streams."""
    if value in (pb.DATA_PLANE_UNSPECIFIED, pb.DATA_PLANE_GRPC):
        return "grpc"
    if value == pb.DATA_PLANE_MOONCAKE:
        return "mooncake"
    raise BadRequestError(
        f"unknown data plane {value}; expected one of {sorted(_PLANE_TO_PB.items())}"
    )


def aux_to_pb(aux: Aux) -> pb.Aux:
    msg = pb.Aux(
        first_token=aux.first_token,
        logprob=aux.logprob,
        cached_tokens=aux.cached_tokens,
        host_cached_tokens=aux.host_cached_tokens,
        top_ids=[t for t, _ in aux.top],
        top_logprobs=[v for _, v in aux.top],
        hidden=aux.hidden,
    )
    p = aux.prompt_scores
    if p is not None:
        msg.prompt_scores_from = p.start
        msg.prompt_logprobs.extend(np.asarray(p.logprobs, np.float32).tolist())
        msg.prompt_top_n = int(p.top_ids.shape[-1])
        msg.prompt_top_ids.extend(np.asarray(p.top_ids, np.int32).reshape(-1).tolist())
        msg.prompt_top_logprobs.extend(np.asarray(p.top_logprobs, np.float32).reshape(-1).tolist())
    return msg


def _prompt_scores_from_pb(msg: pb.Aux) -> PromptLogprobs | None:
    if not msg.HasField("prompt_scores_from"):
        return None
    m, k = len(msg.prompt_logprobs), msg.prompt_top_n
    if msg.prompt_scores_from < 0 or k < 0:
        raise BadRequestError(
            f"aux prompt scores from {msg.prompt_scores_from} with {k} alternatives"
        )
    if len(msg.prompt_top_ids) != m * k or len(msg.prompt_top_logprobs) != m * k:
        raise BadRequestError(
            f"aux prompt scores: {m} tokens x {k} alternatives, but "
            f"{len(msg.prompt_top_ids)} ids and {len(msg.prompt_top_logprobs)} log-probs"
        )
    return PromptLogprobs(
        msg.prompt_scores_from,
        np.asarray(msg.prompt_logprobs, np.float32),
        np.asarray(msg.prompt_top_ids, np.int32).reshape(m, k),
        np.asarray(msg.prompt_top_logprobs, np.float32).reshape(m, k),
    )


def aux_from_pb(msg: pb.Aux) -> Aux:
    if len(msg.top_ids) != len(msg.top_logprobs):
        raise BadRequestError(
            f"aux has {len(msg.top_ids)} top token ids but {len(msg.top_logprobs)} log-probs"
        )
    if len(msg.hidden) % 4:
        raise BadRequestError(f"aux hidden state of {len(msg.hidden)} bytes is not float32s")
    top = tuple(zip(msg.top_ids, msg.top_logprobs, strict=True))
    return Aux(
        msg.first_token,
        msg.logprob,
        msg.cached_tokens,
        msg.host_cached_tokens,
        top,
        msg.hidden,
        _prompt_scores_from_pb(msg),
    )


def snapshot_to_pb(s: RoomSnapshot) -> pb.RoomStatus:
    msg = pb.RoomStatus(
        room=s.room,
        state=int(s.state),
        reason=s.reason,
        num_pages=s.num_pages,
        committed_ranks=list(s.committed_ranks),
    )
    if s.aux is not None:
        msg.aux.CopyFrom(aux_to_pb(s.aux))
    return msg


def snapshot_from_pb(msg: pb.RoomStatus) -> RoomSnapshot:
    try:
        state = RoomState(msg.state)
    except ValueError:
        raise BadRequestError(f"room {msg.room!r}: unknown room state {msg.state}") from None
    return RoomSnapshot(
        room=msg.room,
        state=state,
        reason=msg.reason,
        aux=aux_from_pb(msg.aux) if msg.HasField("aux") else None,
        num_pages=msg.num_pages,
        committed_ranks=tuple(msg.committed_ranks),
    )
