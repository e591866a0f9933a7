"""What each PD transfer backend can do, and the explicit registry of backends (SPEC S2.3).

CP shared-KV prefill needs a backend that sends only a rank's owned pages (owner
filtering) and writes each page to `decode_page_table[p]` by its logical position
(position-addressed destinations). A backend that fills "the next slice of the page
list" instead would silently pair pages with the wrong decode pages, so startup asks the
registry and refuses such a backend (`serving.server_args`).

The registry is an object, not module state: callers build one (`default_backend_registry`)
and pass it where it is needed; tests build their own with test-only backends.
"""

from __future__ import annotations

import dataclasses

from cpkv_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BackendCapabilities:
    """A transfer backend's name and what it guarantees for CP shared-KV pages."""

    name: str
    owner_filtering: bool  # each prefill rank sends only the pages it owns
    position_addressed: bool  # decode writes page p to decode_page_table[p]
    description: str = ""

    @property
    def supports_cp_shared_kv(self) -> bool:
        return self.owner_filtering and self.position_addressed

    def missing_for_cp_shared_kv(self) -> tuple[str, ...]:
        """Names of the capabilities CP shared-KV prefill needs and this backend lacks."""
        missing = []
        if not self.owner_filtering:
            missing.append("owner filtering")
        if not self.position_addressed:
            missing.append("position-addressed destinations")
        return tuple(missing)


class TransferBackendRegistry:
    """Transfer backends by name. Registration order is kept (it is the listing order)."""

    def __init__(self, backends: tuple[BackendCapabilities, ...] = ()) -> None:
        self._backends: dict[str, BackendCapabilities] = {}
        for b in backends:
            self.register(b)

    def register(self, capabilities: BackendCapabilities) -> None:
        if not capabilities.name:
            raise ConfigError("a transfer backend needs a non-empty name")
        if capabilities.name in self._backends:
            raise ConfigError(f"transfer backend {capabilities.name!r} is already registered")
        self._backends[capabilities.name] = capabilities

    def get(self, name: str) -> BackendCapabilities:
        try:
            return self._backends[name]
        except KeyError:
            raise ConfigError(
                f"unknown transfer backend {name!r}; registered: {', '.join(self.names())}"
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._backends)

    def __contains__(self, name: object) -> bool:
        return name in self._backends


DEFAULT_BACKEND = "grpc"  # embedded, no system libraries; what PD modes use unless told


def default_backend_registry() -> TransferBackendRegistry:
    """A new registry with the built-in backends, both fit for CP shared KV."""
    return TransferBackendRegistry(
        (
            BackendCapabilities(
                name="grpc",
                owner_filtering=True,
                position_addressed=True,
                description="gRPC page stream; each page carries its logical position",
            ),
            BackendCapabilities(
                name="mooncake",
                owner_filtering=True,
                position_addressed=True,
                description=(
                    "Mooncake Transfer Engine writes (TCP/RDMA) into the decode side's "
                    "registered staging arena, by position; gRPC control plane"
                ),
            ),
        )
    )
