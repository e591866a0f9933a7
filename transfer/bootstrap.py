"""The PD bootstrap rendezvous, for pairs that SGLang's gateway (`smg`) drives.

Behind `cpkv-router` a prefill request arrives knowing its decode server's receiver
(`decode_transfer_target`). SGLang's gateway knows neither our receivers nor our CP
size: in PD mode it sends the same body to both servers with `bootstrap_host` (the
prefill server's host), `bootstrap_port` (its `--disaggregation-bootstrap-port`) and a
`bootstrap_room` it drew. The two servers meet here, on the prefill server:

1. the decode server reads `GET /bootstrap` (the prefill's CP size, page size and KV
   layout, cached per prefill server) and checks the layout against its own;
2. it registers its room with the receiver as for any PD request (pages reserved), then
   `POST /bootstrap/rooms` `{"room", "target", "layout"}`: its receiver's host:port;
3. the prefill server's request waits, bounded, for its room's registration
   (`BootstrapRegistry.wait`), then goes on as if the router had named the target: its
   ranks push pages to the receiver by logical position.

A room whose partner never comes times out on both sides: the prefill request fails
with 504 after `--transfer-bootstrap-timeout`, the decode room fails on the receiver's
bootstrap timeout and frees its pages; a registration nobody claims is dropped after the
same timeout. The bootstrap server is stdlib HTTP on its own port (no request of a user
reaches it), one thread per connection.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from cpkv_jax.errors import CpkvError, InputError

logger = logging.getLogger(__name__)

# SGLang's `--disaggregation-bootstrap-port` default, which the gateway assumes when a
# prefill's port is not given.
DEFAULT_BOOTSTRAP_PORT = 8998
# Registrations kept at most (a gateway retrying against a dead prefill leaves some).
MAX_PENDING_ROOMS = 65536


class BootstrapTimeoutError(CpkvError):
    """No decode server registered the room in time."""


@dataclasses.dataclass(frozen=True)
class _Registration:
    target: str
    at: float


class BootstrapRegistry:
    """Rooms the decode side registered, waited for by the prefill requests (thread-safe)."""

    def __init__(
        self,
        info: Mapping[str, Any],
        *,
        expire_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.info = dict(info)  # what `GET /bootstrap` answers
        self.expire_s = expire_s
        self._clock = clock
        self._rooms: dict[str, _Registration] = {}
        self._cond = threading.Condition()

    def register(self, room: str, target: str, layout: Any) -> None:
        """A decode server's receiver for `room`; `InputError` for a layout that is not
        this server's or a room registered already with another target."""
        if layout != self.info.get("layout"):
            raise InputError(
                f"room {room}: the decode server's KV layout {layout} is not this prefill "
                f"server's {self.info.get('layout')}; serve the same model, page size and "
                "dtypes on both"
            )
        with self._cond:
            self._expire()
            known = self._rooms.get(room)
            if known is not None and known.target != target:
                raise InputError(f"room {room} is registered already, by {known.target}")
            if known is None and len(self._rooms) >= MAX_PENDING_ROOMS:
                raise InputError(f"{len(self._rooms)} rooms wait for their prefill request")
            self._rooms[room] = _Registration(target, self._clock())
            self._cond.notify_all()

    def claim(self, room: str) -> str | None:
        """The receiver registered for `room`, claimed (a room is used once); None while
        none is registered. Never blocks (an event loop polls it)."""
        with self._cond:
            reg = self._rooms.pop(room, None)
        return None if reg is None else reg.target

    def wait(self, room: str, timeout: float) -> str:
        """The receiver registered for `room` (claimed: a room is used once), waiting up to
        `timeout` seconds; `BootstrapTimeoutError` when none came."""
        deadline = self._clock() + timeout
        with self._cond:
            while room not in self._rooms:
                left = deadline - self._clock()
                if left <= 0:
                    raise BootstrapTimeoutError(
                        f"room {room}: no decode server registered it within {timeout:g}s "
                        "(is the decode server up, and given this server's bootstrap port?)"
                    )
                self._cond.wait(min(left, 1.0))
            return self._rooms.pop(room).target

    @property
    def pending(self) -> int:
        with self._cond:
            self._expire()
            return len(self._rooms)

    def _expire(self) -> None:
        old = self._clock() - self.expire_s
        for room in [r for r, reg in self._rooms.items() if reg.at < old]:
            logger.info("bootstrap room %s: registered, never claimed; dropped", room)
            del self._rooms[room]


def layout_json(layout: Any) -> dict[str, Any]:
    """A `transfer.page_plan.LayoutDescriptor` as the JSON both sides compare."""
    return json.loads(json.dumps(dataclasses.asdict(layout)))


class BootstrapClient:
    """The decode side: each prefill server's `GET /bootstrap` (cached: a prefill server's
    topology does not change while it runs) and room registrations."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._info: dict[tuple[str, int], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def info(self, host: str, port: int) -> dict[str, Any]:
        """The prefill server's bootstrap info; `CpkvError` when it cannot be read."""
        with self._lock:
            known = self._info.get((host, port))
        if known is not None:
            return known
        r = self._call("GET", host, port, "/bootstrap")
        info = r.json()
        if not isinstance(info.get("cp_size"), int) or "layout" not in info:
            raise CpkvError(f"{_url(host, port)}/bootstrap answered {info!r}, not bootstrap info")
        with self._lock:
            self._info[(host, port)] = info
        return info

    def register(self, host: str, port: int, room: str, target: str, layout: Any) -> None:
        """Register `room` at the prefill server: its pages go to `target`."""
        body = {"room": room, "target": target, "layout": layout}
        self._call("POST", host, port, "/bootstrap/rooms", body)

    def _call(self, method: str, host: str, port: int, path: str, body: Any = None):
        import httpx

        url = _url(host, port) + path
        try:
            r = httpx.request(method, url, json=body, timeout=self.timeout)
        except httpx.HTTPError as e:
            with self._lock:  # a restarted prefill server may come back changed
                self._info.pop((host, port), None)
            raise CpkvError(f"PD bootstrap {url} unreachable: {e}") from e
        if r.status_code == 400:
            raise InputError(f"PD bootstrap {url}: {r.json().get('error', r.text)}")
        if r.status_code != 200:
            raise CpkvError(f"PD bootstrap {url} answered {r.status_code}: {r.text[:200]}")
        return r


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class BootstrapServer:
    """`GET /bootstrap` and `POST /bootstrap/rooms` over a `BootstrapRegistry`."""

    def __init__(self, registry: BootstrapRegistry, host: str, port: int):
        self.registry = registry
        handler = _handler(registry)
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="pd-bootstrap", daemon=True
        )

    def start(self) -> BootstrapServer:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():  # `shutdown` waits for a loop that must be running
            self._httpd.shutdown()
            self._thread.join(5.0)
        self._httpd.server_close()


def _handler(registry: BootstrapRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("bootstrap %s: " + format, self.address_string(), *args)

        def _reply(self, status: int, body: Mapping[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path != "/bootstrap":
                self._reply(404, {"error": f"no {self.path} here"})
                return
            self._reply(200, registry.info)

        def do_POST(self) -> None:
            if self.path != "/bootstrap/rooms":
                self._reply(404, {"error": f"no {self.path} here"})
                return
            try:
                n = int(self.headers.get("Content-Length", "0"))
                if not 0 < n <= 1 << 16:
                    raise InputError(f"a registration of {n} bytes")
                body = json.loads(self.rfile.read(n))
                room, target = str(body["room"]), str(body["target"])
                registry.register(room, target, body.get("layout"))
            except (InputError, ValueError, KeyError, TypeError) as e:
                self._reply(400, {"error": str(e)})
                return
            self._reply(200, {"room": room})

    return Handler
