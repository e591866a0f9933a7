"""API keys (issue 41): `--api-key` / `--admin-api-key` on `cpkv-serve`, `--api-key` /
`--upstream-api-key` on `cpkv-router`, enforced by `serving.http.auth`.

Against the real server app around `MockEngine` and the real router app, over real HTTP
on 127.0.0.1 (`support.http_client`, `support.router_fakes`); clients are httpx with the
`Authorization: Bearer KEY` header the `openai` client sends (the package is not in the
test extras). Checks: 401 without or with a wrong key and 200 with the right one on every
generation route, `/health` and `/metrics` open, the admin routes' own key, the refusal
logged without the key, every route of both apps classified, the router enforcing its
key and sending its upstream key (the servers see no refusal), many concurrent clients
with keys on, and the flags: environment variables, validation, redaction, the warning
for a non-loopback address without a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from support.http_client import start_server, stop_server
from support.router_fakes import (
    ENDPOINTS,
    MockPD,
    MockWorker,
    Served,
    expected_ids,
    fresh_prompt,
    output_of,
    router_config,
    sse_events,
    wait_until,
)
from support.server_args_cases import make_args

from serving import launch
from serving.api_keys import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    UPSTREAM_API_KEY_ENV,
    ApiKeys,
    bearer_token,
    is_loopback,
)
from serving.engine.mock import MockEngine, MockRooms
from serving.http.app import AdminRoutes, build_app
from serving.http.auth import OPEN_PATHS
from serving.http.chat_template import load_chat_template
from serving.http.metrics import ServerMetrics
from serving.router import PD_ENDPOINTS, RouterConfig, RouterConfigError, build_router_app
from serving.server_args import ServerArgs, ServerArgsError

API, ADMIN = "api-key-0123456789", "admin-key-abcdefghij"
ROUTER_KEY, SERVER_KEY = "router-key-xyz", "server-key-uvw"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def is_error(r: httpx.Response, status: int, kind: str) -> bool:
    """The OpenAI-style error body every refusal carries."""
    err = r.json()["error"]
    return r.status_code == status and err["code"] == status and err["type"] == kind


def generation_body(endpoint: str) -> dict[str, Any]:
    if endpoint == "/generate":
        return {"input_ids": [40, 41, 42], "sampling_params": {"max_new_tokens": 3}}
    if endpoint == "/v1/completions":
        return {"prompt": "abc", "max_tokens": 3}
    return {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 3}


@contextlib.contextmanager
def keyed_server(tmp_path, tok, tokenizer_dir, keys: ApiKeys) -> Iterator[SimpleNamespace]:
    s = start_server(
        tmp_path,
        tokenizer=tok,
        template=load_chat_template(tokenizer_dir),
        name="keys",
        api_keys=keys,
    )
    try:
        yield s
    finally:
        stop_server(s)


@pytest.fixture(scope="module")
def both(tokenizer_dir, tok, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """A server with an API key and an admin key."""
    with keyed_server(
        tmp_path_factory.mktemp("both"), tok, tokenizer_dir, ApiKeys(API, ADMIN)
    ) as s:
        yield s


# ---- the server ------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_generation_routes_need_the_api_key(both, endpoint: str) -> None:
    body = generation_body(endpoint)
    missing = both.http.post(endpoint, json=body)
    assert is_error(missing, 401, "authentication_error"), missing.text
    assert "missing API key" in missing.json()["error"]["message"]
    assert missing.headers["www-authenticate"] == "Bearer"
    for header in (bearer("wrong"), bearer(API + "x"), {"Authorization": API},
                   {"Authorization": f"Basic {API}"}, {"X-Api-Key": API}):  # fmt: skip
        r = both.http.post(endpoint, json=body, headers=header)
        assert r.status_code == 401, (header, r.text)
    for header in (bearer(API), {"Authorization": f"bearer  {API}"}, bearer(ADMIN)):
        r = both.http.post(endpoint, json=body, headers=header)
        assert r.status_code == 200, (header, r.text)
        got = output_of(endpoint, r.json())  # the mock echoes the prompt (chat: templated)
        assert got == {"/generate": [40, 41, 42], "/v1/completions": "abc"}.get(endpoint, got)
    with both.http.stream(
        "POST", endpoint, json={**body, "stream": True}, headers=bearer(API)
    ) as r:
        assert r.status_code == 200 and sse_events(r.iter_lines())[-1] == "[DONE]"


def test_health_and_metrics_are_open_the_rest_is_not(both) -> None:
    for path in ("/health", "/metrics"):
        assert both.http.get(path).status_code == 200, path
    for path in ("/server_info", "/v1/models", "/no/such/route"):
        r = both.http.get(path)
        assert is_error(r, 401, "authentication_error"), (path, r.text)
    assert both.http.get("/server_info", headers=bearer(API)).json()["server_name"] == "keys"
    assert both.http.get("/v1/models", headers=bearer(API)).status_code == 200
    assert both.http.get("/no/such/route", headers=bearer(API)).status_code == 404


def test_admin_routes_take_the_admin_key_only(both, tmp_path) -> None:
    out = tmp_path / "trace"
    start = {"output_dir": str(out)}
    assert is_error(both.http.post("/start_profile", json=start), 401, "authentication_error")
    refused = both.http.post("/start_profile", json=start, headers=bearer(API))
    assert is_error(refused, 403, "permission_error"), refused.text
    assert "--admin-api-key" in refused.json()["error"]["message"]
    assert both.http.post("/stop_profile", headers=bearer(API)).status_code == 403
    assert both.http.post("/start_profile", json=start, headers=bearer("nope")).status_code == 401
    r = both.http.post("/start_profile", json=start, headers=bearer(ADMIN))
    assert r.status_code == 200, r.text
    assert both.http.post("/stop_profile", headers=bearer(ADMIN)).status_code == 200
    assert list(out.rglob("*.xplane.pb")), "the trace was not written"


def test_without_an_admin_key_admin_routes_take_the_api_key(tokenizer_dir, tok, tmp_path) -> None:
    with keyed_server(tmp_path, tok, tokenizer_dir, ApiKeys(API)) as s:
        assert s.http.post("/stop_profile").status_code == 401
        r = s.http.post("/stop_profile", headers=bearer(API))  # reaches the route: none running
        assert r.status_code == 400 and "no profile" in r.json()["error"]["message"]


def test_an_admin_key_alone_guards_only_the_admin_routes(tokenizer_dir, tok, tmp_path) -> None:
    with keyed_server(tmp_path, tok, tokenizer_dir, ApiKeys(admin_api_key=ADMIN)) as s:
        assert s.http.post("/generate", json=generation_body("/generate")).status_code == 200
        assert s.http.get("/server_info").status_code == 200
        assert s.http.post("/stop_profile").status_code == 401
        assert s.http.post("/stop_profile", headers=bearer(ADMIN)).status_code == 400


def test_a_refusal_is_logged_without_the_key_and_counted(both, caplog, monkeypatch) -> None:
    # Every refusal logged here (the earlier tests' refusals from this host are recent).
    monkeypatch.setattr("serving.http.auth.REFUSAL_LOG_INTERVAL_S", 0.0)

    def bad_requests() -> float:
        text = both.http.get("/metrics").text
        (line,) = [ln for ln in text.splitlines() if ln.startswith("cpkv_http_bad_requests_total")]
        return float(line.split()[-1])

    before = bad_requests()
    wrong = "a-wrong-key-that-must-not-be-logged"
    with caplog.at_level(logging.WARNING, logger="serving.http.auth"):
        assert both.http.post("/generate", json={}, headers=bearer(wrong)).status_code == 401
        assert both.http.post("/start_profile", headers=bearer(API)).status_code == 403
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "refused POST /generate from 127.0.0.1" in logged and "invalid API key" in logged
    assert "refused POST /start_profile" in logged
    assert wrong not in logged and API not in logged and ADMIN not in logged
    assert bad_requests() == before + 2


def test_every_route_of_both_apps_is_open_guarded_or_admin() -> None:
    """A route added later is guarded by the middleware; this pins which are open or admin,
    so adding a state-changing route means deciding whether it joins ADMIN_PATHS."""
    loop = MockEngine(None).loop(name="api-keys-routes")
    try:
        engine_app = build_app(
            loop,
            model_name="m",
            tokenizer=None,
            vocab_size=8,
            context_length=8,
            chat_template=None,
            metrics=ServerMetrics(),
            api_keys=ApiKeys(API, ADMIN),
        )
    finally:
        asyncio.run(loop.shutdown(1.0))
    paths = {r.path for r in engine_app.routes}
    api_only = {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/models",
                "/server_info", "/get_server_info", "/model_info", "/get_model_info",
                "/v1/loads"}  # fmt: skip
    assert paths == OPEN_PATHS | AdminRoutes.ADMIN_PATHS | api_only
    router_app = build_router_app(router_config(worker=("http://127.0.0.1:1",), api_key=API))
    router_paths = {r.path for r in router_app.routes}
    # FastAPI's own docs routes are on in the router: guarded like the rest.
    docs = {"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
    assert router_paths == OPEN_PATHS | set(PD_ENDPOINTS) | {"/v1/models", "/servers"} | docs


def test_bearer_token_parsing_and_loopback() -> None:
    assert bearer_token(b"Bearer abc") == b"abc" and bearer_token(b"BEARER  abc ") == b"abc"
    assert bearer_token(None) is None and bearer_token(b"Bearer") is None
    assert bearer_token(b"Basic abc") is None and bearer_token(b"abc") is None
    assert all(map(is_loopback, ("127.0.0.1", "127.1.2.3", "::1", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "10.0.0.5", "node-3.cluster")))


# ---- the router ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_pd(tokenizer_dir, tok) -> Iterator[SimpleNamespace]:
    """A prefill and a decode server taking SERVER_KEY behind a router that takes
    ROUTER_KEY and sends SERVER_KEY upstream."""
    rooms = MockRooms(wait_s=10.0)
    common = {"tokenizer": tok, "chat_template": load_chat_template(tokenizer_dir)}
    keys = ApiKeys(SERVER_KEY)
    prefill = MockPD("p0", rooms, cp_size=2, api_keys=keys, **common)
    decode = MockPD("d0", rooms, transfer_target="10.0.0.9:17009", api_keys=keys, **common)
    cfg = router_config(
        prefill=(prefill.url,),
        decode=(decode.url,),
        api_key=ROUTER_KEY,
        upstream_api_key=SERVER_KEY,
        # 32 clients on 2 cores under the type-checking import hook: a non-streaming
        # answer can take longer than router_config's 5 s (no key involved).
        request_timeout=30.0,
    )
    router = Served(build_router_app(cfg))
    client = httpx.Client(base_url=router.url, timeout=10.0, trust_env=False)
    yield SimpleNamespace(router=router, client=client, prefill=prefill, decode=decode)
    client.close()
    router.stop()
    prefill.stop()
    decode.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_router_enforces_its_key_and_sends_its_upstream_key(
    keyed_pd, tok, endpoint: str, stream: bool
) -> None:
    c = keyed_pd.client
    body, prompt = fresh_prompt(endpoint)
    body["stream"] = stream
    for header in ({}, bearer("wrong"), bearer(SERVER_KEY)):  # the servers' key is not the router's
        r = c.post(endpoint, json=body, headers=header)
        assert is_error(r, 401, "authentication_error"), (header, r.text)
    if stream:
        with c.stream("POST", endpoint, json=body, headers=bearer(ROUTER_KEY)) as r:
            assert r.status_code == 200, r.read()
            answer: Any = sse_events(r.iter_lines())
    else:
        r = c.post(endpoint, json=body, headers=bearer(ROUTER_KEY))
        assert r.status_code == 200, r.text
        answer = r.json()
    if prompt is not None:
        want = expected_ids(prompt, 5)
        got = output_of(endpoint, answer)
        assert got == (want if endpoint == "/generate" else tok.decode(want)), got
    # The router's calls carried the servers' key: neither server refused anything.
    assert keyed_pd.prefill.bad_requests() == keyed_pd.decode.bad_requests() == 0


def test_router_open_and_guarded_routes(keyed_pd) -> None:
    c = keyed_pd.client
    assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    for path in ("/servers", "/v1/models", "/openapi.json"):
        assert c.get(path).status_code == 401, path
        assert c.get(path, headers=bearer(ROUTER_KEY)).status_code == 200, path
    servers = c.get("/servers", headers=bearer(ROUTER_KEY)).json()["servers"]
    assert all(s["healthy"] for s in servers)  # its /server_info polls carry the key


def test_router_upstream_key_defaults_to_its_own_key() -> None:
    worker = MockWorker(api_keys=ApiKeys("shared-key"))
    router = Served(build_router_app(router_config(worker=(worker.url,), api_key="shared-key")))
    try:
        body = {"input_ids": [7, 8], "sampling_params": {"max_new_tokens": 2}}
        r = httpx.post(router.url + "/generate", json=body, headers=bearer("shared-key"))
        assert r.status_code == 200 and r.json()["output_ids"] == [7, 8], r.text
    finally:
        router.stop()
        worker.stop()


def test_router_with_the_wrong_upstream_key_says_which_flag() -> None:
    worker = MockWorker(api_keys=ApiKeys(SERVER_KEY))
    cfg = router_config(worker=(worker.url,), upstream_api_key="not-it", startup_timeout=0.0)
    router = Served(build_router_app(cfg))
    try:
        r = httpx.get(router.url + "/health")
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "/server_info answered 401" in message and "--upstream-api-key" in message
    finally:
        router.stop()
        worker.stop()


def test_many_clients_with_keys_through_the_router(keyed_pd, tok) -> None:
    """32 concurrent clients, 192 requests on the three endpoints (a third streamed), one
    in six with a wrong key, over kept-alive connections: every keyed request gets its
    200 and right output, every other a 401, the servers refuse nothing, nothing stays in
    flight. Bounded by the wait_for below."""
    rng = random.Random(41)
    jobs = []
    for i in range(192):
        endpoint = ENDPOINTS[i % 3]
        body, prompt = fresh_prompt(endpoint)
        body["stream"] = rng.random() < 1 / 3
        key = ROUTER_KEY if rng.random() >= 1 / 6 else rng.choice(["", "wrong", SERVER_KEY])
        jobs.append((endpoint, body, prompt, key))

    async def one(client: httpx.AsyncClient, job) -> str | None:
        endpoint, body, prompt, key = job
        headers = bearer(key) if key else {}
        async with client.stream("POST", endpoint, json=body, headers=headers) as r:
            raw = await r.aread()
        if key != ROUTER_KEY:
            return None if r.status_code == 401 else f"{key!r}: {r.status_code} {raw[:200]!r}"
        if r.status_code != 200:
            return f"{endpoint}: {r.status_code} {raw[:200]!r}"
        text = raw.decode()
        answer = sse_events(iter(text.splitlines())) if body["stream"] else json.loads(text)
        if prompt is not None:
            want = expected_ids(prompt, 5)
            text_or_ids = want if endpoint == "/generate" else tok.decode(want)
            if output_of(endpoint, answer) != text_or_ids:
                return f"{endpoint}: wrong output {answer}"
        return None

    async def run() -> list[str | None]:
        queue = list(jobs)
        out: list[str | None] = []
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(
            # Above the router's 30 s upstream timeout, so a slow upstream shows as the
            # router's 504 rather than a client timeout.
            base_url=keyed_pd.router.url,
            timeout=45.0,
            limits=limits,
            trust_env=False,
        ) as client:

            async def worker() -> None:
                while queue:
                    out.append(await one(client, queue.pop()))

            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(32))), 120)
        return out

    problems = [p for p in asyncio.run(run()) if p is not None]
    assert not problems, problems[:5]
    assert keyed_pd.prefill.bad_requests() == keyed_pd.decode.bad_requests() == 0

    def idle() -> bool:
        servers = keyed_pd.client.get("/servers", headers=bearer(ROUTER_KEY)).json()["servers"]
        return all(s["in_flight"] == 0 for s in servers)

    wait_until(idle, what="nothing in flight")


# ---- flags -----------------------------------------------------------------------------------


def test_server_keys_from_flags_or_environment(monkeypatch, capsys) -> None:
    base = ["--model-path", "m"]
    assert ServerArgs.from_cli(base).api_key is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    monkeypatch.setenv(ADMIN_API_KEY_ENV, "admin-from-env")
    args = ServerArgs.from_cli(base)
    assert (args.api_key, args.admin_api_key) == ("from-env", "admin-from-env")
    assert ServerArgs.from_cli([*base, "--api-key", "from-flag"]).api_key == "from-flag"
    # Never shown: not in repr, redacted in to_dict (what --check-config prints and the
    # startup log logs), the help names the variable only.
    assert "from-env" not in repr(args)
    assert args.to_dict()["api_key"] == args.to_dict()["admin_api_key"] == "<redacted>"
    assert ServerArgs(model_path="m").to_dict()["api_key"] is None
    assert launch.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "$CPKV_API_KEY" in out and "$CPKV_ADMIN_API_KEY" in out and "from-env" not in out


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"api_key": ""}, "--api-key (or $CPKV_API_KEY) is empty"),
        ({"admin_api_key": "two words"}, "--admin-api-key (or $CPKV_ADMIN_API_KEY) must be"),
        ({"api_key": "caf\u00e9"}, "printable ASCII"),
        ({"api_key": "same", "admin_api_key": "same"}, "--admin-api-key equals --api-key"),
    ],
)
def test_bad_server_keys_are_refused(kw, needle) -> None:
    with pytest.raises(ServerArgsError, match=needle.replace("$", r"\$").replace("(", r"\(")
                       .replace(")", r"\)")):  # fmt: skip
        make_args(**kw).validate()


def test_an_empty_environment_key_is_refused_not_ignored(monkeypatch, tiny_config_dir, capsys):
    monkeypatch.setattr(launch, "configure_logging", lambda level: None)
    monkeypatch.setenv(API_KEY_ENV, "")  # `CPKV_API_KEY=$UNSET cpkv-serve ...`
    assert launch.main(["--model-path", str(tiny_config_dir), "--check-config"]) == 2
    assert "$CPKV_API_KEY) is empty" in capsys.readouterr().err


def test_check_config_prints_keys_redacted(tiny_config_dir, monkeypatch, capsys) -> None:
    monkeypatch.setattr(launch, "configure_logging", lambda level: None)
    argv = ["--model-path", str(tiny_config_dir), "--check-config", "--api-key", API]
    assert launch.main([*argv, "--admin-api-key", ADMIN]) == 0
    out = capsys.readouterr().out
    config = json.loads(out)
    assert config["api_key"] == config["admin_api_key"] == "<redacted>"
    assert API not in out and ADMIN not in out


def test_a_non_loopback_host_without_a_key_is_a_warning() -> None:
    open_warning = make_args(host="0.0.0.0").validate()
    (w,) = [w for w in open_warning if "--host 0.0.0.0" in w]
    assert "no --api-key" in w and "port 30000" in w and "profiler" in w
    quiet = [
        make_args(host="0.0.0.0", api_key=API).validate(),
        make_args().validate(),
        make_args(host="::1").validate(),
    ]
    assert not any("--host" in w for ws in quiet for w in ws)
    only_admin = make_args(host="10.1.2.3", admin_api_key=ADMIN).validate()
    assert any("--host 10.1.2.3" in w and "profiler" not in w for w in only_admin)


def test_router_key_flags(monkeypatch) -> None:
    worker = ["--worker", "http://127.0.0.1:1"]
    assert RouterConfig.from_cli(worker).upstream_headers() == {}
    monkeypatch.setenv(API_KEY_ENV, "env-key")
    cfg = RouterConfig.from_cli(worker)
    assert cfg.api_key == "env-key" and cfg.upstream_headers() == bearer("env-key")
    assert "env-key" not in repr(cfg)
    monkeypatch.setenv(UPSTREAM_API_KEY_ENV, "up-env")
    assert RouterConfig.from_cli(worker).upstream_headers() == bearer("up-env")
    flagged = RouterConfig.from_cli([*worker, "--upstream-api-key", "up-flag"])
    assert flagged.upstream_headers() == bearer("up-flag") and flagged.api_key == "env-key"
    monkeypatch.setenv(UPSTREAM_API_KEY_ENV, "")
    with pytest.raises(RouterConfigError, match="--upstream-api-key"):
        RouterConfig.from_cli(worker)
    monkeypatch.delenv(API_KEY_ENV)
    monkeypatch.delenv(UPSTREAM_API_KEY_ENV)
    (w,) = RouterConfig.from_cli([*worker, "--host", "0.0.0.0"]).warnings()
    assert "--host 0.0.0.0" in w and "no --api-key" in w
    assert RouterConfig.from_cli([*worker, "--host", "0.0.0.0", "--api-key", "k"]).warnings() == ()
    assert RouterConfig.from_cli(worker).warnings() == ()


def test_a_flood_of_refusals_is_logged_once_per_host_per_interval(caplog) -> None:
    """Bad keys from one client host: the first refusal is logged, the next ones within
    `REFUSAL_LOG_INTERVAL_S` only counted, and the first line after it says how many; another
    host has its own line. Every refusal is still answered 401."""
    import asyncio

    from serving.http.auth import REFUSAL_LOG_INTERVAL_S, ApiKeyMiddleware

    now = [100.0]

    async def app(scope, receive, send) -> None:
        raise AssertionError("a refused request reached the app")

    mw = ApiKeyMiddleware(app, keys=ApiKeys(api_key=API), clock=lambda: now[0])
    statuses: list[int] = []

    async def send(message) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    def hit(host: str) -> None:
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/generate",
            "headers": [(b"authorization", b"Bearer nope")],
            "client": (host, 5000),
        }
        asyncio.run(mw(scope, None, send))  # type: ignore[arg-type]

    with caplog.at_level(logging.WARNING, logger="serving.http.auth"):
        for _ in range(5):
            hit("10.0.0.1")
        hit("10.0.0.2")
        now[0] += REFUSAL_LOG_INTERVAL_S
        hit("10.0.0.1")
    lines = [r.getMessage() for r in caplog.records]
    assert statuses == [401] * 7
    assert len(lines) == 3, lines
    assert "from 10.0.0.1" in lines[0] and "more refused" not in lines[0]
    assert "from 10.0.0.2" in lines[1]
    assert "(4 more refused from 10.0.0.1 since the last line)" in lines[2]
