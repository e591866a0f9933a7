"""PD transfer backends behind `transfer.sender.TransferBackend`.

- `grpc_backend.GrpcBackend` ("grpc", the embedded default): raw page bytes streamed
  to `transfer.receiver` over gRPC (`WritePages`, 1-4 MiB chunks, several channels per
  rank, idempotent retries); needs nothing beyond pip.
- `mooncake_backend.MooncakeBackend` ("mooncake"): page bytes written one-sided by the
  Mooncake Transfer Engine (TCP on one machine, RDMA in a cluster) straight into the
  decode receiver's registered staging arena (`MooncakeReceiverEndpoint`), coalesced
  runs, owner-major staging; handshake, heartbeats, the commit with per-page digests
  and aborts stay on the gRPC control plane. Needs `pip install 'cpkv-jax[mooncake]'`
  (`mooncake_engine.mooncake_available()` says why it cannot load). Its rank sender
  is `mooncake_sender.MooncakeRankSender`.

Both backends' rank senders run their control plane (handshake, heartbeats, commit,
outcome, abort) through one `transfer.session.SenderSession`; only the data plane
differs.

Each backend declares its `transfer.capabilities.BackendCapabilities` (both: owner
filtering and position-addressed destinations); startup refuses CP shared-KV prefill
with a backend lacking either (SPEC S2.3). `make_backend(name, ...)` builds the prefill
side of a registered backend by name (imports are lazy: the Mooncake module loads only
when asked for).
"""

from __future__ import annotations

from typing import Any

from transfer.capabilities import TransferBackendRegistry, default_backend_registry
from transfer.sender import TransferBackend


def make_backend(
    name: str, *, registry: TransferBackendRegistry | None = None, **kwargs: Any
) -> TransferBackend:
    """The prefill-side backend `name` ("grpc" or "mooncake"); `kwargs` go to its
    constructor (`config=`, ...). Unknown names raise `ConfigError` listing the
    registered ones; a registered name without an implementation here raises too."""
    caps = (registry or default_backend_registry()).get(name)
    if caps.name == "grpc":
        from transfer.backends.grpc_backend import GrpcBackend

        return GrpcBackend(**kwargs)
    if caps.name == "mooncake":
        from transfer.backends.mooncake_backend import MooncakeBackend

        return MooncakeBackend(**kwargs)
    raise ValueError(
        f"transfer backend {name!r} is registered (capabilities only) but has no "
        "implementation to build"
    )


__all__ = ["make_backend"]
