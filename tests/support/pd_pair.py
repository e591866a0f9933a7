"""A PD pair served in this process behind `cpkv-router` (the PD end-to-end tests): the
decode and prefill servers built from their flags, each on a loopback uvicorn, and the
router in front; everything stopped and closed on exit."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from serving.router import RouterConfig, build_router_app
from serving.server import build_server
from serving.server_args import ServerArgs
from support.http_client import Served


@contextlib.contextmanager
def pd_pair(
    decode_args: ServerArgs, prefill_args: ServerArgs, wait_s: float
) -> Iterator[dict[str, Any]]:
    """`{"decode": Server, "prefill": Server, "served": {"decode", "prefill", "router"}}`;
    the decode server is built first (the prefill side's senders find it up), the router
    waits `wait_s` for a request."""
    decode = build_server(decode_args)
    try:
        prefill = build_server(prefill_args)
    except BaseException:
        decode.close()
        raise
    served = {"decode": Served(decode.app), "prefill": Served(prefill.app)}
    config = RouterConfig(
        prefill=(served["prefill"].url,),
        decode=(served["decode"].url,),
        request_timeout=wait_s,
        health_interval=0.5,
        startup_timeout=30.0,
    ).validate()
    served["router"] = Served(build_router_app(config))
    try:
        yield {"decode": decode, "prefill": prefill, "served": served}
    finally:
        for s in reversed(list(served.values())):
            s.stop()
        for server in (prefill, decode):
            asyncio.run(server.loop.shutdown(0.0))
            server.close()
