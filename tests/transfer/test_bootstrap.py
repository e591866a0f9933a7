"""`transfer.bootstrap`: the rendezvous of a PD pair driven by SGLang's gateway.

The registry and its stdlib HTTP server on 127.0.0.1 (a free port), the decode side's
client against it: a room registered once and claimed once, a layout that is not the
prefill's refused, a room nobody registers timing out, registrations nobody claims
expiring, and the client's errors for an unreachable or refusing server.
"""

from __future__ import annotations

import threading

import pytest

from cpkv_jax.errors import CpkvError, InputError
from transfer.bootstrap import (
    BootstrapClient,
    BootstrapRegistry,
    BootstrapServer,
    BootstrapTimeoutError,
)

LAYOUT = {"page_size": 16, "num_layers": 3, "latent_dtype": "float32"}
INFO = {"cp_size": 8, "page_size": 16, "layout": LAYOUT}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def server():
    registry = BootstrapRegistry(INFO, expire_s=30.0)
    srv = BootstrapServer(registry, "127.0.0.1", 0).start()
    yield srv
    srv.close()


def test_a_room_is_registered_then_claimed_once_by_the_waiting_prefill(server):
    client = BootstrapClient(timeout=5.0)
    assert client.info("127.0.0.1", server.port) == INFO
    got: dict[str, str] = {}

    def prefill_side() -> None:
        got["target"] = server.registry.wait("9223372036854775807", timeout=10.0)

    waiter = threading.Thread(target=prefill_side)
    waiter.start()  # the prefill request may arrive first: it waits
    client.register("127.0.0.1", server.port, "9223372036854775807", "10.0.0.7:5555", LAYOUT)
    waiter.join(10.0)
    assert got == {"target": "10.0.0.7:5555"} and server.registry.pending == 0
    with pytest.raises(BootstrapTimeoutError, match="no decode server registered it"):
        server.registry.wait("9223372036854775807", timeout=0.05)  # claimed: used once


def test_refusals_name_the_cause(server):
    client = BootstrapClient(timeout=5.0)
    with pytest.raises(InputError, match="KV layout"):
        client.register("127.0.0.1", server.port, "1", "h:1", {**LAYOUT, "page_size": 64})
    client.register("127.0.0.1", server.port, "2", "h:1", LAYOUT)
    client.register("127.0.0.1", server.port, "2", "h:1", LAYOUT)  # a retry: the same
    with pytest.raises(InputError, match="registered already, by h:1"):
        client.register("127.0.0.1", server.port, "2", "h:2", LAYOUT)
    assert server.registry.pending == 1
    closed = BootstrapServer(BootstrapRegistry(INFO, expire_s=1.0), "127.0.0.1", 0)
    port = closed.port
    closed.close()  # never started: nothing listens there now
    with pytest.raises(CpkvError, match="unreachable"):
        client.info("127.0.0.1", port)


def test_unclaimed_registrations_expire():
    clock = Clock()
    registry = BootstrapRegistry(INFO, expire_s=30.0, clock=clock)
    registry.register("a", "h:1", LAYOUT)
    clock.t = 20.0
    registry.register("b", "h:1", LAYOUT)
    assert registry.pending == 2
    clock.t = 40.0  # "a" is 40 s old, "b" 20 s
    assert registry.pending == 1
    assert registry.wait("b", timeout=0.0) == "h:1"
