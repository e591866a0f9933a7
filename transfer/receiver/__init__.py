"""Decode side of the PD transfer: rooms, staging by position, exact-coverage commit.

`Receiver` is the pure-Python core (no gRPC): the decode server registers a room per
request with its decode page table, and the prefill senders' messages - decoded by the
gRPC servicer (`servicer`), or called directly in tests - drive the room's status machine
(`transfer.protocol.RoomState`). Invariants:

- **Status**: BOOTSTRAPPING (registered) -> WAITING_FOR_INPUT (every sender's handshake
  accepted) -> TRANSFERRING (first page) -> SUCCESS | FAILED. Forward only; FAILED is
  sticky; a finished room is kept as a tombstone and never revived (its id cannot be
  registered again while the tombstone is kept).
- **Handshake first**: a sender's layout descriptor is compared with the decode pool's
  before it may write; a mismatch (or another protocol version, cp size or token count)
  fails the room before any data moves.
- **Position addressing** (SPEC S2.1): page bytes land in a host staging buffer per
  (kind, layer) at row `position`; at commit, row `p` is scattered to decode page
  `dst_pages[p]`. Nothing depends on the order pages arrive in.
- **Integrity** (SPEC S2.4): every page's xxh3 digest is checked on arrival; a mismatch
  fails the room with the position and both digests in the reason.
- **Idempotence**: a write is keyed by (room, sender rank, position, attempt) per
  (kind, layer). A retry of a held page (same rank and attempt, same digest) is accepted
  and ignored; a later attempt of the same rank replaces it; an older one is ignored;
  the same position from a different rank fails the room.
- **Late writes**: a write, commit or handshake for a finished room is rejected
  (`RoomClosedError`) before anything is read into memory.
- **Exact coverage** (SPEC S2.4): each sender commits the positions it sent, which must
  equal what it wrote in every buffer; when all `cp_size` senders committed, the
  positions must cover `[0, n_pages)` exactly once and rank 0 must have sent the aux
  data. Then a jitted scatter writes every (kind, layer) leaf of the decode pool (pool
  donated; one call per power-of-two piece of the room's rows, so compiles stay bounded
  and staging holds exactly the room's pages) and the room succeeds. Otherwise it fails
  with the reason, and on every failure the room's decode pages go back to the
  allocator.
- **Staging arena** (optional, `staging_arena=` or a Mooncake endpoint's arena): one
  pre-allocated (pre-faulted) host arena; each room stages in a region carved from it,
  rows in owner-major order (`page_plan.owner_major_order`: rank 0's positions, then rank
  1's, ...), so each rank's positions are one contiguous row range per buffer. Without
  an arena, a room stages in arrays of its own, row = position.
- **Mooncake data plane** (`mooncake=` endpoint, `transfer.backends.mooncake_backend`):
  a sender whose handshake asks for it gets the engine session id and its room's
  region addresses, writes its pages there one-sided, then commits over gRPC with every
  page's digest; the receiver checks the digests against the staged bytes at that
  commit (the data never passes through this process otherwise). The decode pool is
  never registered with the engine. One-sided writes cannot be refused, so a failed
  room's region is **quarantined** (not reused) until every Mooncake sender of the room
  said its writes are done (commit, or a final heartbeat with `writes_done`) or the
  endpoint's quarantine timeout passed; a Mooncake sender's handshake with a new
  attempt id is refused (an earlier incarnation's writes could not be fenced).
- **Host-only receiver** (`pool=None`, for benchmarks): no decode pool and no device
  scatter; at commit the verified staging rows are handed to `host_sink` (if given)
  and the room succeeds.
- **Timeouts** (`TransferTimeouts`): bootstrap (not every sender handshaken in time),
  waiting (no page in time after the handshakes), heartbeat (a handshaken sender that
  has not committed went silent). `poll_timeouts` checks them; `start()` runs it on a
  background thread.

Locking: each room has its own lock (concurrent streams of one room serialize on it);
the room table's lock guards the room table, the tombstones and the quarantined regions
and is only ever taken *inside* a room lock or alone, never the other way round. The KV
sink's pool and allocator locks are innermost (`cpkv_jax.kv_store`).

Modules, one job each: `rooms` (rooms and their status machine, the room table),
`staging` (staging by position), `commit` (exact-coverage commit, the scatter into the
KV sink), `onesided` (the Mooncake plane: refusals, digest-at-commit, quarantine),
`timeouts`, `core` (the `Receiver` facade composing them) and `servicer` (the gRPC
face: `KVTransferServicer` / `serve`, service `cpkv.transfer.v1.KVTransfer` plus
`grpc.health.v1`; requests are parsed by the handlers, so malformed bytes, unknown
rooms, another protocol version or an oversized chunk come back as a gRPC status with
the reason, and the server keeps serving). The KV store (`cpkv_jax.kv_store.PagedKVStore`)
and the `PageChunk` wire format (`transfer.wire`) live beside the package.
"""

from cpkv_jax.kv_store import KVStore, PagedKVStore
from transfer.receiver.commit import HostSink, pow2_pieces
from transfer.receiver.core import HandshakeResult, Receiver, WriteResult
from transfer.receiver.onesided import RegionInfo, StagingEndpoint
from transfer.receiver.servicer import COMMIT_WAIT_S, KVTransferServicer, ReceiverServer, serve
from transfer.receiver.staging import staging_buffer_sizes, staging_region_bytes

__all__ = [
    "COMMIT_WAIT_S",
    "HandshakeResult",
    "HostSink",
    "KVStore",
    "KVTransferServicer",
    "PagedKVStore",
    "Receiver",
    "ReceiverServer",
    "RegionInfo",
    "StagingEndpoint",
    "WriteResult",
    "pow2_pieces",
    "serve",
    "staging_buffer_sizes",
    "staging_region_bytes",
]
