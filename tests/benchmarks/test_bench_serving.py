"""bench_serving: the statistics, a run against a deliberately broken upstream (every
failure counted with its reason, the good requests measured), runs against the mock
engine's server (the prefix-cache hit rate it reports, multi-turn prompts, chat text) and
one against the real unified server on the tiny model (JSON and PNG written; its cached
tokens are reported, but no hit rate is asserted: whether it has a prefix cache is the
server's business, the mock's closed-form `cached_tokens` checks the arithmetic).

Every server binds 127.0.0.1 on a free port and is stopped by its fixture; every wait is
bounded (`--request-timeout`, the servers' stop timeouts).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import socket
import statistics
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.http_client import VOCAB, Served, start_server, stop_server

from benchmarks import bench_serving as bs
from cpkv_jax.tokenizer import load_tokenizer
from cpkv_jax.tools.make_tiny_checkpoint import write_tokenizer_files
from serving.engine.mock import MOCK_FAIL_ID, echo_ids
from serving.http.chat_template import load_chat_template

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
STATS = ("mean", "median", "p90", "p99", "std", "max", "count")


def run_bench(tmp_path: Path, capsys, *argv: str, rc: int = 0) -> dict[str, Any]:
    """`main(argv)` with `--output-file`; checks stdout's one JSON object is the file's."""
    out = tmp_path / "bench.json"
    capsys.readouterr()
    assert bs.main([*argv, "--output-file", str(out), "--disable-tqdm"]) == rc
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, "one JSON object on stdout"
    report = json.loads(lines[0])
    assert json.loads(out.read_text()) == report
    return report


def check_metric_keys(run: dict[str, Any]) -> None:
    for key in METRICS:
        assert set(run[key]) == set(STATS), key
    for key in (
        "completed",
        "failed",
        "failure_reasons",
        "duration_s",
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "total_input_tokens",
        "total_output_tokens",
        "cached_tokens",
        "cached_tokens_details",
        "prefix_cache_hit_rate",
    ):
        assert key in run, key


# ---- statistics (pure) ----------------------------------------------------------------------


def linear_percentile(sorted_vals: list[float], p: float) -> float:
    k = (len(sorted_vals) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def test_summarize_gives_mean_median_and_percentiles_in_ms():
    rng = np.random.default_rng()
    for _ in range(50):
        vals = rng.exponential(rng.uniform(0.001, 1.0), int(rng.integers(1, 400))).tolist()
        got = bs.summarize(vals)
        ms = sorted(v * 1e3 for v in vals)
        assert got["count"] == len(vals)
        assert got["mean"] == pytest.approx(statistics.fmean(ms))
        assert got["median"] == pytest.approx(statistics.median(ms))
        assert got["p90"] == pytest.approx(linear_percentile(ms, 90))
        assert got["p99"] == pytest.approx(linear_percentile(ms, 99))
        assert got["std"] == pytest.approx(statistics.pstdev(ms), abs=1e-9)
        assert got["max"] == pytest.approx(ms[-1])
        assert got["median"] <= got["p90"] <= got["p99"] <= got["max"]
    empty = bs.summarize([])
    assert empty["count"] == 0 and all(empty[k] is None for k in STATS if k != "count")


def test_token_timing_from_cumulative_events_splits_multi_token_gaps():
    rng = np.random.default_rng()
    for _ in range(50):
        start = float(rng.uniform(0, 100))
        n_events = int(rng.integers(1, 30))
        times = start + np.cumsum(rng.uniform(0.001, 0.2, n_events))
        new = rng.integers(0, 4, n_events)  # 0: an event without tokens (e.g. a role chunk)
        events = list(zip(times.tolist(), np.cumsum(new).tolist(), strict=True))
        ttft, itl = bs.token_timing(start, events)
        with_tokens = [(t, k) for t, k in zip(times, new, strict=True) if k > 0]
        if not with_tokens:
            assert ttft is None and itl == []
            continue
        assert ttft == pytest.approx(with_tokens[0][0] - start)
        want: list[float] = []
        for (t_prev, _), (t, k) in itertools.pairwise(with_tokens):
            want += [(t - t_prev) / k] * int(k)
        assert itl == pytest.approx(want)
        # The gaps add up to the time from the first token chunk to the last.
        assert sum(itl) == pytest.approx(with_tokens[-1][0] - with_tokens[0][0])
        assert len(itl) == int(new.sum()) - int(with_tokens[0][1])


def test_poisson_arrivals_are_seeded_exponential_gaps_and_inf_is_all_at_once():
    seed = int(np.random.default_rng().integers(2**31))
    rate = float(np.random.default_rng().uniform(0.5, 50))
    a = bs.poisson_arrivals(20_000, rate, np.random.default_rng(seed))
    b = bs.poisson_arrivals(20_000, rate, np.random.default_rng(seed))
    c = bs.poisson_arrivals(20_000, rate, np.random.default_rng(seed + 1))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    gaps = np.diff(np.concatenate([[0.0], a]))
    assert np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    # Exponential: P(gap > mean) = 1/e, and the std equals the mean.
    assert np.mean(gaps > 1 / rate) == pytest.approx(math.exp(-1), abs=0.02)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.06)
    assert np.array_equal(bs.poisson_arrivals(7, math.inf, np.random.default_rng()), np.zeros(7))
    with pytest.raises(ValueError):
        bs.poisson_arrivals(3, 0.0, np.random.default_rng())


def test_request_rate_lists_and_failure_histogram():
    assert bs.parse_rates("1, 4,inf") == [1.0, 4.0, math.inf]
    for bad in ("0", "-1", "", "x"):
        with pytest.raises(ValueError):
            bs.parse_rates(bad)
    reasons = [f"HTTP 400: r{i}" for i in range(bs.MAX_REASONS + 5)] + ["timeout"] * 3
    hist = bs.failure_histogram(reasons)
    assert next(iter(hist)) == "timeout" and hist["timeout"] == 3
    assert len(hist) == bs.MAX_REASONS + 1 and hist["other"] == 6
    assert sum(hist.values()) == len(reasons)
    body = b'{"error": {"message": "request 0123456789abcdef failed", "code": 500}}'
    assert bs.error_message(body) == "request <id> failed"
    assert bs.error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert bs.error_message(b"plain\n text") == "plain text"


# ---- a deliberately broken upstream ---------------------------------------------------------


class BrokenUpstream:
    """A raw HTTP/1.1 server on 127.0.0.1 (its own event loop thread) whose `/generate`
    answers the i-th request by `BEHAVIOURS[i % 6]`; anything else is a 404."""

    BEHAVIOURS = ("ok", "http_500", "malformed", "slow", "close_mid_stream", "error_event")
    OUTPUT = 3  # tokens of an "ok" answer
    CACHED = 2

    def __init__(self, slow_s: float = 30.0) -> None:
        self.slow_s = slow_s
        self.count = 0
        self.tasks: set[asyncio.Task] = set()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        start = asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.server = asyncio.run_coroutine_threadsafe(start, self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            for t in list(self.tasks):
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        assert not self.thread.is_alive()
        self.loop.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ")
            headers = dict(
                (k.strip().lower(), v.strip())
                for k, v in (h.split(":", 1) for h in lines[1:] if ":" in h)
            )
            n = int(headers.get("content-length", "0"))
            body = json.loads(await reader.readexactly(n)) if n else {}
            if (method, path) != ("POST", "/generate"):
                await self.plain(writer, 404, {"detail": "Not Found"})
                return
            kind = self.BEHAVIOURS[self.count % len(self.BEHAVIOURS)]
            self.count += 1
            await getattr(self, kind)(writer, body)
        except (asyncio.CancelledError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.tasks.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    @staticmethod
    async def plain(writer: asyncio.StreamWriter, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: "
            f"{len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()

    @staticmethod
    async def sse_head(writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()

    @staticmethod
    async def chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    async def events(self, writer: asyncio.StreamWriter, body: dict, upto: int) -> None:
        ids = body["input_ids"]
        for k in range(1, upto + 1):
            await asyncio.sleep(0.01)
            meta = {
                "prompt_tokens": len(ids),
                "completion_tokens": k,
                "cached_tokens": self.CACHED,
                "finish_reason": {"type": "length"} if k == self.OUTPUT else None,
            }
            event = {"output_ids": echo_ids(ids, k), "meta_info": meta}
            await self.chunk(writer, f"data: {json.dumps(event)}\n\n".encode())

    async def ok(self, writer: asyncio.StreamWriter, body: dict) -> None:
        await self.sse_head(writer)
        await self.events(writer, body, self.OUTPUT)
        await self.chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def http_500(self, writer: asyncio.StreamWriter, body: dict) -> None:
        await self.plain(writer, 500, {"error": {"message": "upstream exploded", "code": 500}})

    async def malformed(self, writer: asyncio.StreamWriter, body: dict) -> None:
        await self.sse_head(writer)
        await self.chunk(writer, b'data: {"output_ids": [1, 2\n\n')
        await self.chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def slow(self, writer: asyncio.StreamWriter, body: dict) -> None:
        await self.sse_head(writer)
        await asyncio.sleep(self.slow_s)

    async def close_mid_stream(self, writer: asyncio.StreamWriter, body: dict) -> None:
        await self.sse_head(writer)
        await self.events(writer, body, 1)
        writer.close()  # no last chunk: the body is cut off

    async def error_event(self, writer: asyncio.StreamWriter, body: dict) -> None:
        await self.sse_head(writer)
        err = {"error": {"message": "the engine failed while serving this request"}}
        await self.chunk(writer, f"data: {json.dumps(err)}\n\n".encode())
        await self.chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


@pytest.fixture
def broken() -> Iterator[BrokenUpstream]:
    up = BrokenUpstream()
    yield up
    up.stop()


def test_broken_upstream_failures_are_counted_by_reason_and_the_rest_measured(
    broken, tmp_path, capsys
):
    per_kind = 4
    n = per_kind * len(BrokenUpstream.BEHAVIOURS)
    report = run_bench(
        tmp_path,
        capsys,
        *("--backend", "sglang", "--base-url", broken.url, "--dataset-name", "random"),
        *("--num-prompts", str(n), "--random-input-len", "8", "--random-output-len", "3"),
        *("--random-range-ratio", "1", "--request-timeout", "1", "--warmup-requests", "0"),
        *("--plot", str(tmp_path / "broken.png")),
    )
    assert report["vocab_source"].startswith("default") and report["server"] == {}
    (run,) = report["runs"]
    check_metric_keys(run)
    assert run["requests"] == n and run["completed"] == per_kind and run["failed"] == n - per_kind
    reasons = run["failure_reasons"]
    assert sum(reasons.values()) == n - per_kind
    assert reasons.pop("HTTP 500: upstream exploded") == per_kind
    assert reasons.pop("malformed SSE: data is not JSON") == per_kind
    assert reasons.pop("timeout (> 1 s)") == per_kind
    assert reasons.pop("stream error: the engine failed while serving this request") == per_kind
    ((closed, count),) = reasons.items()
    assert closed.startswith("connection error: RemoteProtocolError") and count == per_kind
    out = BrokenUpstream.OUTPUT
    assert run["ttft_ms"]["count"] == per_kind and run["ttft_ms"]["median"] >= 10
    # Events leave 10 ms apart, but a busy client may read them all at once (CI saw a 0.1 ms
    # max), so no lower bound holds. What does: ITL gaps are the time between token
    # arrivals, which fits within E2E - TTFT, so their mean cannot exceed TPOT's.
    assert run["itl_ms"]["count"] == per_kind * (out - 1)
    assert 0 <= run["itl_ms"]["mean"] <= run["tpot_ms"]["mean"] + 1e-3
    assert run["tpot_ms"]["count"] == per_kind
    assert run["total_output_tokens"] == per_kind * out
    assert run["total_input_tokens"] == per_kind * 8 and run["input_tokens_source"] == "server"
    assert run["cached_tokens"] == per_kind * BrokenUpstream.CACHED
    assert run["prefix_cache_hit_rate"] == pytest.approx(BrokenUpstream.CACHED / 8)
    assert run["duration_s"] < 10
    assert (tmp_path / "broken.png").read_bytes().startswith(PNG_MAGIC)


def test_no_server_every_request_fails_with_a_connection_error(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    report = run_bench(
        tmp_path,
        capsys,
        *("--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "3"),
        *("--random-input-len", "4", "--random-output-len", "2", "--request-timeout", "5"),
        rc=1,
    )
    assert report["warmup"]["failed"] == 1
    (run,) = report["runs"]
    assert run["completed"] == 0 and run["failed"] == 3
    ((reason, count),) = run["failure_reasons"].items()
    assert reason.startswith("connection error: ConnectError") and count == 3
    assert run["ttft_ms"]["count"] == 0 and run["prefix_cache_hit_rate"] is None


# ---- the mock engine's server: cached tokens, multi-turn, chat ------------------------------


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return write_tokenizer_files(tmp_path_factory.mktemp("tok"), model_max_length=256)


@pytest.fixture(scope="module")
def mock(tmp_path_factory, tok_dir) -> Iterator[Any]:
    """The real app and EngineLoop over `MockEngine` (cached_tokens = len(prompt) // 2),
    with the tiny byte tokenizer and chat template."""
    tok = load_tokenizer(tok_dir)
    s = start_server(
        tmp_path_factory.mktemp("mock"),
        tokenizer=tok,
        template=load_chat_template(tok_dir),
        name="bench",
    )
    yield s
    stop_server(s)


# The mock fails a request whose first token is its fail id: keep ids below it.
MOCK_VOCAB = ("--vocab-high", str(MOCK_FAIL_ID))


def test_mock_generate_shared_prefix_cached_tokens_and_hit_rate(mock, tmp_path, capsys):
    sys_len, q_len, groups, per_group = 20, 7, 2, 3
    png = tmp_path / "mock.png"
    report = run_bench(
        tmp_path,
        capsys,
        *("--backend", "sglang", "--base-url", mock.server.url, *MOCK_VOCAB),
        *("--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(groups)),
        *("--gsp-prompts-per-group", str(per_group), "--gsp-system-prompt-len", str(sys_len)),
        *("--gsp-question-len", str(q_len), "--gsp-output-len", "5"),
        *("--request-rate", "inf,40", "--plot", str(png), "--seed", "7"),
    )
    assert report["server"]["vocab_size"] == VOCAB
    assert report["vocab_range"] == [3, MOCK_FAIL_ID]
    assert report["request_rates"] == ["inf", 40.0] and len(report["runs"]) == 2
    n, length = groups * per_group, sys_len + q_len
    for run in report["runs"]:
        check_metric_keys(run)
        assert run["completed"] == n and run["failed"] == 0 and run["failure_reasons"] == {}
        assert run["total_input_tokens"] == n * length
        assert run["total_output_tokens"] == n * 5 and run["itl_ms"]["count"] == n * 4
        assert run["cached_tokens"] == n * (length // 2)
        assert run["prefix_cache_hit_rate"] == pytest.approx((length // 2) / length)
        details = run["cached_tokens_details"]
        if details is not None:  # servers that split cached tokens by tier
            assert details["device"] + details["host"] == run["cached_tokens"]
    assert png.read_bytes().startswith(PNG_MAGIC)
    # Each run's prompts: groups sharing their system prompt, a fresh dataset per run.
    prompts = [
        tuple(r.input_ids) for r in mock.engine.requests.values() if len(r.input_ids) == length
    ]
    prefixes = Counter(p[:sys_len] for p in prompts[-2 * n :])
    assert sorted(prefixes.values()) == [per_group] * (2 * groups)


def test_mock_multi_turn_prompts_grow_by_the_previous_output(mock, tmp_path, capsys):
    convs, turns, q, out = 3, 3, 10, 4
    # Printable ASCII bytes only: each output token is whole text, so the server streams
    # every chunk's token_ids (a chunk ending inside a UTF-8 character is held back).
    report = run_bench(
        tmp_path,
        capsys,
        *("--backend", "openai", "--base-url", mock.server.url),
        *("--vocab-low", str(3 + 32), "--vocab-high", str(3 + 127)),
        *("--dataset-name", "multi-turn", "--num-prompts", str(convs)),
        *("--multi-turn-turns", str(turns), "--random-input-len", str(q)),
        *("--random-output-len", str(out), "--random-range-ratio", "1", "--seed", "3"),
        *("--max-concurrency", "2", "--warmup-requests", "0"),
    )
    assert report["model"] == "tiny-bench"  # from /v1/models
    (run,) = report["runs"]
    assert run["requests"] == convs * turns and run["completed"] == convs * turns
    assert run["multi_turn_outputs_approximated"] == 0  # the server streams token_ids
    lens = [q + k * (q + out) for k in range(turns)]
    assert run["total_input_tokens"] == convs * sum(lens)
    assert run["cached_tokens"] == convs * sum(n // 2 for n in lens)
    assert run["prefix_cache_hit_rate"] == pytest.approx(sum(n // 2 for n in lens) / sum(lens))
    sent = [list(r.input_ids) for r in list(mock.engine.requests.values())[-convs * turns :]]
    for k in range(1, turns):
        for p in (p for p in sent if len(p) == lens[k]):
            prev = [s for s in sent if len(s) == lens[k - 1] and p[: lens[k - 1]] == s]
            assert len(prev) == 1, "turn k's prompt starts with turn k-1's"
            assert p[lens[k - 1] : lens[k - 1] + out] == echo_ids(prev[0], out)


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_mock_chat_text_prompts_sized_by_tokenizer_or_estimated(
    mock, tok_dir, tmp_path, capsys, with_tokenizer
):
    n, length, out = 4, 24, 3
    report = run_bench(
        tmp_path,
        capsys,
        *("--backend", "openai-chat", "--base-url", mock.server.url),
        *("--num-prompts", str(n), "--random-input-len", str(length)),
        *("--random-output-len", str(out), "--random-range-ratio", "1"),
        *(("--tokenizer", str(tok_dir)) if with_tokenizer else ()),
    )
    assert report["input_lens_are_estimates"] is (not with_tokenizer)
    (run,) = report["runs"]
    assert run["completed"] == n and run["input_tokens_source"] == "server"
    assert run["total_output_tokens"] == n * out  # usage.completion_tokens
    assert run["client_input_tokens"] == n * length
    # The byte tokenizer: one token per character, plus the template's markers.
    tok = load_tokenizer(tok_dir)
    assert tok is not None
    empty = load_chat_template(tok_dir).render([{"role": "user", "content": ""}])
    overhead = len(tok.encode(empty))
    if with_tokenizer:
        assert run["total_input_tokens"] == n * (length + overhead)
    else:  # 4 characters per estimated token (the last word may lose its last letter)
        chars = bs.CHARS_PER_TOKEN * length
        lo, hi = n * (chars - 1 + overhead), n * (chars + overhead)
        assert lo <= run["total_input_tokens"] <= hi


# ---- the real unified server on the tiny model ----------------------------------------------


@pytest.fixture(scope="module")
def unified(tiny_checkpoints) -> Iterator[str]:
    """The unified (`--disaggregation-mode null`) server on the tiny checkpoint; one
    running request (its warm-up then compiles only the batch-1 shapes: ~20 s on 2 cores)."""
    from serving.server import build_server
    from serving.server_args import ServerArgs

    path = tiny_checkpoints("glm_moe_dsa")
    args = ServerArgs.from_cli(
        [
            *("--model-path", str(path), "--dtype", "float32", "--page-size", "16"),
            *("--disaggregation-mode", "null", "--kv-pool-size", "2MiB"),
            *("--max-running-requests", "1"),
        ]
    )
    server = build_server(args)
    served = Served(server.app)
    yield served.url
    served.stop()
    asyncio.run(server.loop.shutdown(0.0))
    server.close()


@pytest.mark.parametrize("backend", ["sglang", "openai"])
def test_unified_server_generated_shared_prefix(unified, tmp_path, capsys, backend):
    # 12 + 5 = 17 tokens: a prompt length the server's warm-up compiled (page_size + 1).
    groups, per_group, sys_len, q_len, out = 2, 3, 12, 5, 4
    png = tmp_path / "unified.png"
    report = run_bench(
        tmp_path,
        capsys,
        *("--backend", backend, "--base-url", unified, "--request-timeout", "120"),
        *("--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(groups)),
        *("--gsp-prompts-per-group", str(per_group), "--gsp-system-prompt-len", str(sys_len)),
        *("--gsp-question-len", str(q_len), "--gsp-output-len", str(out), "--plot", str(png)),
    )
    assert report["server"]["vocab_size"] > 0 and report["server"]["context_length"] > 0
    assert report["warmup"] == {"requests": 1, "failed": 0}
    (run,) = report["runs"]
    check_metric_keys(run)
    n = groups * per_group
    assert run["completed"] == n and run["failed"] == 0, run["failure_reasons"]
    assert run["total_input_tokens"] == n * (sys_len + q_len)
    assert run["input_tokens_source"] == "server"
    assert run["total_output_tokens"] == n * out
    assert run["ttft_ms"]["count"] == n and run["tpot_ms"]["count"] == n
    # A chunk may carry several tokens (the first one too): at most out - 1 gaps each.
    assert 0 < run["itl_ms"]["count"] <= n * (out - 1)
    assert 0 < run["ttft_ms"]["median"] <= run["e2e_ms"]["median"]
    assert run["cached_tokens"] is not None  # no assertion on the hit rate: see the docstring
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_bench_first_request_against_the_unified_server(unified, tmp_path, capsys):
    """`benchmarks.bench_first_request`: one row per length, the server's compiles while
    serving from `/server_info` (17 tokens: a warmed shape, so no compile there; a 40-token
    prompt is a new prefill bucket, compiled by its first request only)."""
    from benchmarks import bench_first_request

    out = tmp_path / "first.json"
    argv = ["--base-url", unified, "--server-info", unified, "--lengths", "17", "40"]
    assert bench_first_request.main([*argv, "--vocab", "200", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["tokens"] for r in report["rows"]] == [17, 40]
    assert all(r["first_ttft_s"] > 0 and r["repeat_ttft_s"] > 0 for r in report["rows"])
    assert report["serving_compiles"][unified] >= 1  # the 40-token bucket's first use
    assert json.loads(capsys.readouterr().out) == report
