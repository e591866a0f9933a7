"""PD serving under concurrent load and a decode server killed (issue: PD under load).

Real processes on 127.0.0.1 (`benchmarks.pd_load.PDCluster`): a decode server (over
Mooncake, data-parallel on 2 ranks: `--dp-size 2`, issue 36; over gRPC, decoding
speculatively with the MTP layer, both servers with `--speculative-algorithm EAGLE`,
issue 39; over gRPC again, two CP4 decode groups (`--dp-size 2 --cp-size 4`) with each
request's pages striped over one group's ranks, issue 40, drafting too), a CP=8 shared-KV
prefill server (8 virtual CPU devices, `--chunked-prefill-size 256`) and a router in front:
`cpkv-router` over gRPC, SGLang's gateway `smg` in PD mode over Mooncake (issue 38: the
same pass rule through the gateway). Small KV pools make requests wait for pages, and
some prompts are near the decode pool's size. 16 clients send a mixed load (`LoadMix`:
5 to ~1,300-token prompts, 1-16 new tokens, 40% streamed and half of those cancelled
after two chunks, a few bad requests). Then, under load, the decode server is SIGKILLed
and started again. API keys are on (issue 41): every process gets `$CPKV_API_KEY`, the
router sends it upstream (the gateway with `--api-key` for its own probes; it passes the
client's header on), the clients send it to the router.

Asserts:
- before the kill, every request ends with 200 and the right token count, a client
  cancel, a 400 for a bad request, or a 503 with Retry-After (a full queue): none fails;
- a sample of greedy outputs equals the single-device reference (`ReferenceGenerator`);
- while the decode server dies, requests end with an explicit error (a 503 or an SSE
  error event) within the per-request bound, never a hang; after the restart, service
  resumes (every request of a new wave succeeds);
- a request without the key is a 401 from the router (through the gateway, from the
  servers it passes the request to) and from each server;
- at the end, every prefill lane's free pages equal its total minus what the prefix
  cache holds (the cache's own count, `/server_info` `kv_pages_cached`), the restarted
  decode server has every page free, no engine thread died (`/health` 200), and the
  prefill log never shows a read of a donated pool ("Array has been deleted").
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.pd_load import (
    ClusterConfig,
    LoadMix,
    Outcome,
    PDCluster,
    page_balance,
    pool_tokens,
    run_load,
    summarize,
    wait_idle,
)
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.model.weights import load_model
from serving.decode.speculative import speculative_room
from serving.smg import smg_binary
from transfer.backends.mooncake_engine import mooncake_available

pytestmark = pytest.mark.slow(seconds=110)  # on 2 workers, 2026-12-05

DECODE_POOL = "720KiB"  # ~89 pages of 16 tokens: long prompts wait for each other
PREFILL_POOL = "1MiB"  # per rank
CONCURRENCY = 16
# One request's bound; a hang fails the test. The first wave compiles the step shapes
# it reaches (about 60 on first use) while the other test worker compiles too: CI saw a
# p50 of 86 s and requests cut off at a 120 s bound.
REQUEST_TIMEOUT_S = 300.0
KILL_AFTER_S = 4.0
SAMPLE = 4  # outputs checked against the single-device reference
SPEC_STEPS = 2
SPECULATIVE = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(SPEC_STEPS))
OK_KINDS = {"ok", "cancelled", "bad_request_ok", "queue_full"}


def _explicit(o: Outcome) -> bool:
    """Ended by the servers with a stated reason (not a timeout or a dropped socket). A
    502 is SGLang's gateway (`smg`) saying its upstream failed, with the transport error
    (seen when the decode server dies while the gateway sends it a request)."""
    if o.kind in OK_KINDS | {"unavailable"}:
        return True
    stated = bool(o.detail) and "no answer" not in o.detail
    return o.status in (200, 500, 502, 503, 504) and stated


def _why(c: PDCluster, summary: dict) -> str:
    """A failed wave's message: the failures, which processes live, each log's last
    warnings (CI keeps only the test's output)."""
    lines = [f"failures: {summary['failures']}", f"alive: {c.alive()}", f"summary: {summary}"]
    for log in sorted(c.config.log_dir.glob("*.log")):
        bad = [ln for ln in log.read_text(errors="replace").splitlines() if " WARNING " in ln
               or " ERROR " in ln or "Traceback" in ln]  # fmt: skip
        lines += [f"--- {log.name}: {len(bad)} warnings/errors, last ones:", *bad[-8:]]
    return "\n".join(lines)


API_KEY = "pd-load-test-key"
KEYED = {"Authorization": f"Bearer {API_KEY}"}


def _run(url: str, requests, *, timeout_s: float = REQUEST_TIMEOUT_S) -> list[Outcome]:
    return asyncio.run(
        run_load(url, requests, concurrency=CONCURRENCY, timeout_s=timeout_s, headers=KEYED)
    )


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints) -> Path:
    return tiny_checkpoints("glm_moe_dsa")


@pytest.fixture(scope="module")
def reference(model_dir) -> ReferenceGenerator:
    cfg, model = load_model(model_dir, progress=False)
    return ReferenceGenerator(cfg, model, page_size=16)


MOONCAKE, MOONCAKE_WHY = mooncake_available()
BACKENDS = [
    "grpc",
    pytest.param(
        "mooncake",
        marks=[
            pytest.mark.skipif(
                not MOONCAKE, reason=f"Mooncake Transfer Engine unavailable: {MOONCAKE_WHY}"
            ),
            pytest.mark.skipif(
                smg_binary() is None,
                reason="the `smg` gateway is not installed (pip install smg==1.13.0)",
            ),
        ],
    ),
    # DP groups of CP ranks (issue 40): two CP4 decode groups, each request's pages
    # striped over one group's ranks by owner, the same load, kill and restart over gRPC;
    # smaller waves (the suite's time).
    "grpc-groups",
]


@pytest.mark.timeout(1500)  # startup, three waves of up to REQUEST_TIMEOUT_S, a restart
@pytest.mark.parametrize("backend", BACKENDS)
def test_pd_under_load_then_decode_killed_and_restarted(backend, model_dir, reference, tmp_path):
    groups = backend == "grpc-groups"
    if groups:
        backend = "grpc"
    config = ClusterConfig(
        model_dir=model_dir,
        log_dir=tmp_path / "logs",
        transfer_backend=backend,
        prefill_pool=PREFILL_POOL,
        decode_pool=DECODE_POOL,
        max_queued_requests=64,
        api_key=API_KEY,
        # The Mooncake run's decode server is data-parallel over 2 ranks (issue 36): the
        # same load, kill and restart with pages in two pool shards; its clients talk to
        # SGLang's gateway in PD mode (issue 38), the gRPC run's to cpkv-router.
        decode_dp=2 if groups or backend != "grpc" else 1,
        decode_cp=4 if groups else 1,
        router="cpkv" if backend == "grpc" else "smg",
        # The gRPC pairs decode speculatively with the MTP layer (issue 39; the CP groups
        # draft and verify where the pages live): the prefill server sends the MTP
        # layer's KV and the last hidden state, cancellations land mid-draft, and the
        # killed decode server's draft state goes with it.
        extra=SPECULATIVE if backend == "grpc" else (),
    )
    c = PDCluster(config)
    try:
        c.start()
        router = c.urls["router"]
        assert c.headers() == KEYED
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}
        for name in ("router", "prefill", "decode"):
            assert httpx.post(c.urls[name] + "/generate", json=body, timeout=10).status_code == 401
        info = httpx.get(c.urls["decode"] + "/server_info", timeout=10, headers=KEYED).json()
        assert (info["cp_size"], info["shared_kv"]) == ((4, True) if groups else (1, False))
        assert info["dp_size"] == config.decode_dp
        assert ("speculative" in info) == bool(config.extra)
        # A speculative request also reserves its draft room of pages.
        room = speculative_room(SPEC_STEPS, overlap=True) if config.extra else 0
        near = pool_tokens(DECODE_POOL, info["kv_bytes_per_page"]) - 16 - 1 - room
        mix = LoadMix(vocab_size=info["vocab_size"], max_prompt=600, near_pool_tokens=near,
                      max_new_tokens=16)  # fmt: skip
        # The Mooncake run repeats the checks on a smaller load (suite time).
        n1, n_kill, n_after = (
            (8, 8, 3) if groups else (24, 16, 6) if backend == "grpc" else (12, 10, 4)
        )

        # 1. Mixed load: nothing fails.
        wave = mix.make(n1, seed=1)
        outcomes = _run(router, wave)
        summary = summarize(outcomes)
        assert summary["outcomes"].get("failed", 0) == 0, _why(c, summary)
        assert all(o.kind in OK_KINDS for o in outcomes), _why(c, summary)
        assert sum(o.kind == "ok" for o in outcomes) >= n1 // 3, _why(c, summary)
        good = sorted(
            (o for o in outcomes if o.kind == "ok"), key=lambda o: len(o.request.input_ids)
        )
        for o in good[:SAMPLE]:
            want = reference.generate(
                o.request.input_ids, o.request.max_new_tokens, ignore_eos=True
            )
            assert o.output_ids == want.output_ids, f"request #{o.request.index}"

        # 2. The decode server dies under load: requests end with a reason, never hang.
        kill_wave = mix.make(n_kill, seed=2)
        result: list[list[Outcome]] = []
        load = threading.Thread(target=lambda: result.append(_run(router, kill_wave)))
        load.start()
        time.sleep(KILL_AFTER_S)
        assert c.kill_decode() == -9
        load.join(REQUEST_TIMEOUT_S + 60)
        assert not load.is_alive(), "the load did not finish after the decode server died"
        (killed,) = result
        hung = [o for o in killed if not _explicit(o)]
        assert not hung, [(o.request.index, o.kind, o.status, o.detail) for o in hung]

        # 3. Restarted: service resumes once the router sees it healthy.
        c.restart_decode()
        c.wait_router_ready(30.0)
        after = _run(router, [r for r in mix.make(n_after, seed=3) if r.bad is None])
        summary = summarize(after)
        assert all(o.kind in ("ok", "cancelled") for o in after), _why(c, summary)

        # 4. Every page accounted for; no engine died.
        assert wait_idle([c.urls["prefill"], c.urls["decode"]], timeout_s=60, headers=KEYED)
        for name in ("prefill", "decode"):
            balance = page_balance(c.urls[name], headers=KEYED)
            assert balance["balanced"], (name, balance)
            assert httpx.get(c.urls[name] + "/health", timeout=5).status_code == 200
        assert not any(page_balance(c.urls["decode"], headers=KEYED)["cached"])
        assert c.alive() == {"decode": True, "prefill": True, "router": True}
    finally:
        codes = c.close()
    log = (config.log_dir / "prefill.log").read_text(errors="replace")
    assert "Array has been deleted" not in log
    assert "engine thread died" not in log and "InvalidStateError" not in log
    assert codes["prefill"] == 0, f"prefill exit code {codes['prefill']} (1: KV pages leaked)"
