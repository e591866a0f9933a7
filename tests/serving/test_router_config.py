"""`serving.router` (cpkv-router) with unified workers, its pure parts (server pool,
/server_info parsing, PD bodies) and its command line.

The worker is the real server app around a `MockEngine` (`support.router_fakes.MockWorker`).
"""

from __future__ import annotations

import itertools
import random
import time

import httpx
import pytest
from fastapi import FastAPI
from support.router_fakes import MOCK_VOCAB, MockWorker, Served, router_config

from serving.engine.mock import MOCK_FAIL_ID, echo_ids
from serving.router import (
    EXIT_STARTUP_FAILED,
    EXIT_USAGE,
    NoHealthyServerError,
    RouterConfig,
    RouterConfigError,
    RouterInputError,
    ServerInfo,
    ServerModeError,
    ServerPool,
    build_router_app,
    check_client_body,
    main,
    parse_server_info,
    pd_bodies,
)

# ---- unified workers ---------------------------------------------------------------------


def test_worker_only_router_forwards_as_is() -> None:
    """With only --worker servers, requests go through unchanged (no PD fields): the real
    server app over a mock engine answers the client's prompt, and the request that
    reached the engine carries no PD field and no router-made rid."""
    worker = MockWorker()
    router = Served(build_router_app(router_config(worker=(worker.url,))))
    try:
        with httpx.Client(base_url=router.url, timeout=10.0, trust_env=False) as client:
            # Ids the mock echoes as they are: no EOS, no refused or failing token.
            ids = [random.randrange(MOCK_FAIL_ID + 1, MOCK_VOCAB) for _ in range(7)]
            r = client.post(
                "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}
            )
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == echo_ids(ids, 4)
            assert r.headers["x-cpkv-worker"] == worker.url
            assert client.get("/health").json()["healthy"]["worker"] == 1
        (req,) = worker.engine.requests.values()
        assert list(req.input_ids) == ids and req.sampling.max_new_tokens == 4
        pd_fields = (req.bootstrap_room, req.bootstrap_cp_size, req.decode_transfer_target)
        assert pd_fields == (None, None, None)
        assert r.json()["meta_info"]["id"] == req.rid  # the server's own rid, not a room
        assert "x-cpkv-room" not in r.headers
    finally:
        router.stop()
        worker.stop()


# ---- pure parts and the command line ------------------------------------------------------


def test_pick_is_least_loaded_with_round_robin_ties() -> None:
    cfg = router_config(prefill=("http://p:1",), decode=("http://a:1", "http://b:1", "http://c:1"))
    pool = ServerPool(cfg.validate())
    for s in pool.all():
        info = ServerInfo(
            mode=s.role,
            waiting=0,
            running=0,
            cp_size=2 if s.role == "prefill" else None,
            transfer_target="h:1" if s.role == "decode" else None,
        )
        pool.record_success(s, info)
    a, b, c = pool.servers["decode"]
    a.waiting, b.running, c.in_flight = 1, 1, 0
    assert [pool.pick("decode").url for _ in range(3)] == ["http://c:1"] * 3
    c.in_flight = 1  # now all tie at load 1: round-robin over a, b, c
    picks = [pool.pick("decode").url for _ in range(6)]
    assert sorted(picks) == sorted(["http://a:1", "http://b:1", "http://c:1"] * 2)
    assert all(x != y for x, y in itertools.pairwise(picks))
    pool.record_failure(a, "down", immediate=True)
    pool.record_failure(b, "slow")  # one failure < --health-failures: still in rotation
    assert {s.url for s in pool.healthy("decode")} == {"http://b:1", "http://c:1"}
    pool.record_failure(pool.servers["prefill"][0], "down", immediate=True)
    with pytest.raises(
        NoHealthyServerError, match=r"no healthy prefill server: http://p:1 \(down\)"
    ):
        pool.route()


def test_parse_server_info_checks_the_role() -> None:
    info = parse_server_info(
        "prefill", {"mode": "prefill", "waiting": 1, "running": 2, "cp_size": 8}
    )
    assert (info.waiting, info.running, info.cp_size) == (1, 2, 8)
    with pytest.raises(ServerModeError, match="registered as --decode but .* mode 'prefill'"):
        parse_server_info("decode", {"mode": "prefill", "waiting": 0, "running": 0})
    with pytest.raises(ValueError, match="transfer_target"):
        parse_server_info("decode", {"mode": "decode", "waiting": 0, "running": 0})
    with pytest.raises(ValueError, match="'waiting' must be an int"):
        parse_server_info("worker", {"mode": "null", "waiting": "3", "running": 0})


def test_pd_bodies_and_client_body_checks() -> None:
    room = "ab" * 16
    chat = {"messages": [], "stream": True, "stream_options": {"include_usage": True}}
    b = pd_bodies("/v1/chat/completions", chat, room=room, cp_size=8, transfer_target="h:7")
    assert b.decode == {**chat, "bootstrap_room": room, "bootstrap_cp_size": 8}
    assert b.prefill == {
        "messages": [],
        "stream": False,
        "bootstrap_room": room,
        "decode_transfer_target": "h:7",
    }
    g = pd_bodies(
        "/generate", {"text": "x", "rid": "client"}, room=room, cp_size=2, transfer_target="h:7"
    )
    assert g.decode["rid"] == g.prefill["rid"] == room
    with pytest.raises(RouterInputError, match="JSON object"):
        check_client_body([1, 2])
    with pytest.raises(RouterInputError, match="decode_transfer_target"):
        check_client_body({"decode_transfer_target": "h:1"})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill", "http://a:1"], "--prefill needs --decode"),
        ([], "no servers"),
        (["--worker", "a:1"], "is not a server URL"),
        (["--worker", "http://a:1/v1"], "has a path"),
        (
            ["--worker", "http://a:1", "--decode", "http://a:1/", "--prefill", "http://b:1"],
            "given twice",
        ),
        (["--worker", "http://a:1", "--health-failures", "0"], "--health-failures must be >= 1"),
        (["--worker", "http://a:1", "--request-timeout", "x"], "invalid float value"),
    ],
)
def test_bad_command_lines(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(RouterConfigError, match=message):
        RouterConfig.from_cli(argv)
    assert main(argv) == EXIT_USAGE
    assert capsys.readouterr().err.startswith("error: ")


def test_main_fails_startup_without_a_healthy_pair() -> None:
    """Nothing listens: `main` gives up after --startup-timeout with exit 1."""
    dead = []
    for _ in range(2):  # free ports, closed again
        s = Served(FastAPI())
        s.stop()
        dead.append(s.url)
    argv = ["--prefill", dead[0], "--decode", dead[1], "--port", "0", "--startup-timeout", "0.5"]
    argv += ["--health-interval", "0.1", "--log-level", "warning"]
    t0 = time.monotonic()
    assert main(argv) == EXIT_STARTUP_FAILED
    assert time.monotonic() - t0 < 5.0
