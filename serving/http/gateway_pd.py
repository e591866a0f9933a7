"""PD requests from SGLang's gateway (`smg --pd-disaggregation`): the bootstrap fields.

The gateway sends the same body to a prefill and a decode server with `bootstrap_host`,
`bootstrap_port` and `bootstrap_room`, and nothing of ours (`decode_transfer_target`,
`bootstrap_cp_size`). `GatewayPD` fills those in through the rendezvous of
`transfer.bootstrap` before the request reaches the engine:

- prefill server: wait (polled from the event loop, bounded by
  `--transfer-bootstrap-timeout`) for the decode server to register the room; its
  receiver is the request's `decode_transfer_target`. No registration in time: 504,
  nothing was started.
- decode server: read the prefill's bootstrap info (its CP size, and a layout check: a
  400 when the two serve different KV layouts), so the room is registered with the
  right number of senders; once the request is submitted (its room registered with the
  receiver), `register` tells the prefill server where to send.

Requests through `cpkv-router` carry our fields and pass unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal

from cpkv_jax.errors import CpkvError, InputError
from serving.http.errors import ApiError
from transfer.bootstrap import DEFAULT_BOOTSTRAP_PORT, BootstrapClient, BootstrapRegistry

logger = logging.getLogger(__name__)

# A prefill request polls for its room's registration from 1 ms, doubling up to 50 ms.
POLL_MIN_S = 0.001
POLL_MAX_S = 0.05


class GatewayPD:
    """One server's side of the gateway's PD bootstrap (see the module docstring)."""

    def __init__(
        self,
        mode: Literal["prefill", "decode"],
        *,
        wait_s: float,
        registry: BootstrapRegistry | None = None,
        client: BootstrapClient | None = None,
        layout: dict[str, Any] | None = None,
        transfer_target: str | None = None,
    ):
        if mode == "prefill" and registry is None:
            raise ValueError("a prefill server's gateway PD needs its bootstrap registry")
        if mode == "decode" and (client is None or layout is None or transfer_target is None):
            raise ValueError("a decode server's gateway PD needs a client, layout and target")
        self.mode = mode
        self.wait_s = wait_s
        self.registry = registry
        self.client = client
        self.layout = layout
        self.transfer_target = transfer_target

    async def resolve(self, fields: dict[str, Any], host: str | None, port: int | None) -> dict:
        """`fields` (the body's PD keywords for `GenerateRequest`) completed for a gateway
        request (one with `bootstrap_host`); unchanged otherwise."""
        room = fields.get("bootstrap_room")
        if host is None or room is None:
            return fields
        if self.mode == "prefill":
            if fields.get("decode_transfer_target") is not None:
                return fields
            return {**fields, "decode_transfer_target": await self._wait_for(room)}
        if fields.get("bootstrap_cp_size") is not None:
            return fields
        info = await self._info(host, port)
        if info.get("layout") != self.layout:
            raise ApiError(
                400,
                f"the prefill server at {host}:{_port(port)} serves KV layout "
                f"{info.get('layout')}, this decode server {self.layout}: serve the same "
                "model, page size and dtypes on both",
            )
        return {**fields, "bootstrap_cp_size": int(info["cp_size"])}

    async def _wait_for(self, room: str) -> str:
        """The room's receiver once registered, polled from the event loop: waiting
        requests hold no worker thread (a burst of them would otherwise fill the default
        executor that tokenization also runs in). A 504 after `wait_s`."""
        assert self.registry is not None
        deadline = time.monotonic() + self.wait_s
        pause = POLL_MIN_S
        while (target := self.registry.claim(room)) is None:
            if time.monotonic() >= deadline:
                raise ApiError(
                    504,
                    f"room {room}: no decode server registered it within {self.wait_s:g}s "
                    "(is the decode server up, and given this server's bootstrap port?)",
                )
            await asyncio.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        return target

    async def register(self, room: str, host: str, port: int | None) -> None:
        """Decode side: tell the prefill server that `room`'s pages go to this server's
        receiver (the room is registered here already, or about to be: the receiver holds
        an early handshake)."""
        assert self.client is not None and self.transfer_target is not None
        await asyncio.to_thread(
            self.client.register, host, _port(port), room, self.transfer_target, self.layout
        )

    async def _info(self, host: str, port: int | None) -> dict[str, Any]:
        assert self.client is not None
        try:
            return await asyncio.to_thread(self.client.info, host, _port(port))
        except InputError as e:
            raise ApiError(400, str(e)) from None
        except CpkvError as e:
            raise ApiError(502, str(e)) from None


def _port(port: int | None) -> int:
    return DEFAULT_BOOTSTRAP_PORT if port is None else port
