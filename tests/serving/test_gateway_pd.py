"""`serving.http.gateway_pd.GatewayPD`: a gateway body's PD fields completed before the
engine, against a real `transfer.bootstrap` server on 127.0.0.1 (the end-to-end run
through the `smg` binary is in test_serving_e2e.py)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from serving.http.errors import ApiError
from serving.http.gateway_pd import GatewayPD
from transfer.bootstrap import BootstrapClient, BootstrapRegistry, BootstrapServer

LAYOUT = {"page_size": 16, "num_layers": 3}
FIELDS = {"bootstrap_room": "42", "decode_transfer_target": None, "bootstrap_cp_size": None}


@pytest.fixture
def prefill():
    registry = BootstrapRegistry({"cp_size": 8, "page_size": 16, "layout": LAYOUT}, expire_s=30)
    server = BootstrapServer(registry, "127.0.0.1", 0).start()
    yield server
    server.close()


def decode_side(layout=LAYOUT) -> GatewayPD:
    client = BootstrapClient(timeout=5.0)
    return GatewayPD(
        "decode", wait_s=5.0, client=client, layout=layout, transfer_target="127.0.0.1:7001"
    )


def test_the_pair_meets_and_each_side_gets_its_fields(prefill):
    pre = GatewayPD("prefill", wait_s=10.0, registry=prefill.registry)
    dec = decode_side()

    async def run() -> tuple[dict, dict]:
        waiting = asyncio.ensure_future(pre.resolve(dict(FIELDS), "127.0.0.1", prefill.port))
        got_decode = await dec.resolve(dict(FIELDS), "127.0.0.1", prefill.port)
        await dec.register("42", "127.0.0.1", prefill.port)
        return got_decode, await waiting

    got_decode, got_prefill = asyncio.run(run())
    assert got_decode == {**FIELDS, "bootstrap_cp_size": 8}
    assert got_prefill == {**FIELDS, "decode_transfer_target": "127.0.0.1:7001"}
    # Bodies without the gateway's fields (cpkv-router's) pass unchanged.
    assert asyncio.run(pre.resolve(dict(FIELDS), None, None)) == FIELDS
    routed = {**FIELDS, "decode_transfer_target": "h:1", "bootstrap_cp_size": 8}
    assert asyncio.run(dec.resolve(dict(routed), "127.0.0.1", prefill.port)) == routed


def test_a_missing_partner_a_wrong_layout_and_no_prefill_are_http_errors(prefill):
    pre = GatewayPD("prefill", wait_s=0.1, registry=prefill.registry)
    with pytest.raises(ApiError) as e:
        asyncio.run(pre.resolve(dict(FIELDS), "127.0.0.1", prefill.port))
    assert e.value.status == 504 and "no decode server registered it" in e.value.message
    with pytest.raises(ApiError) as e:
        asyncio.run(decode_side({"page_size": 64}).resolve(dict(FIELDS), "127.0.0.1", prefill.port))
    assert e.value.status == 400 and "KV layout" in e.value.message
    with pytest.raises(ApiError) as e:
        asyncio.run(decode_side().resolve(dict(FIELDS), "127.0.0.1", closed_port()))
    assert e.value.status == 502 and "unreachable" in e.value.message


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_registration_racing_ahead_of_the_prefill_request_is_kept(prefill):
    """The decode side may register before the prefill request arrives: the prefill
    request then finds it at once."""
    decode_side().client.register("127.0.0.1", prefill.port, "7", "127.0.0.1:7001", LAYOUT)
    pre = GatewayPD("prefill", wait_s=0.1, registry=prefill.registry)
    fields = {**FIELDS, "bootstrap_room": "7"}
    got = asyncio.run(pre.resolve(fields, "127.0.0.1", prefill.port))
    assert got["decode_transfer_target"] == "127.0.0.1:7001"


def test_waiting_prefill_requests_hold_no_worker_thread(prefill):
    """A burst of prefill requests waiting for their rooms (more than the default
    executor's threads) leaves the executor free: tokenization runs there too. Each is
    answered once its room is registered."""
    pre = GatewayPD("prefill", wait_s=10.0, registry=prefill.registry)
    rooms = [str(r) for r in range(40)]

    async def run() -> list[dict]:
        waiting = [
            asyncio.ensure_future(
                pre.resolve({**FIELDS, "bootstrap_room": r}, "127.0.0.1", prefill.port)
            )
            for r in rooms
        ]
        await asyncio.sleep(0.05)
        # A worker-thread call while all 40 wait: answered at once.
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 7), timeout=2.0) == 7
        for r in rooms:
            prefill.registry.register(r, f"127.0.0.1:{7000 + int(r)}", LAYOUT)
        return await asyncio.gather(*waiting)

    got = asyncio.run(run())
    assert [g["decode_transfer_target"] for g in got] == [
        f"127.0.0.1:{7000 + i}" for i in range(40)
    ]
