"""Serving load generator: TTFT, inter-token latency and throughput under a request rate.

    python -m benchmarks.bench_serving --backend sglang --base-url http://127.0.0.1:PORT \\
        --dataset-name generated-shared-prefix --request-rate 1,4,inf \\
        --output-file serving.json --plot serving.png

An async HTTP client (httpx, streaming) in the shape of `python -m sglang.bench_serving` /
`vllm bench serve`, for this project's servers and router or any other server with one
of these APIs (`--backend`):

- `sglang`: SGLang's native `POST /generate` with `input_ids` (token ids: no tokenizer is
  needed on either side); stream events carry the cumulative `output_ids` (or
  `meta_info.completion_tokens`, or the cumulative `text`) and `meta_info`;
- `openai` / `sglang-oai`: `POST /v1/completions` with `prompt` as a list of token ids
  (OpenAI's API allows it; this server's too); chunks carry `choices[0].text` and, as an
  extension here and in vLLM / SGLang, `token_ids`;
- `openai-chat`: `POST /v1/chat/completions`, which needs text: prompts are random common
  words, sized with `--tokenizer DIR` (a `tokenizer.json`, `cpkv_jax.tokenizer`) when given,
  else at ~4 characters per token (`input_lens_are_estimates: true` in the JSON).
OpenAI requests ask for `stream_options.include_usage`, so the last chunk has the usage.

Datasets (`--dataset-name`), token ids drawn uniformly from `[--vocab-low, --vocab-high)`
(`--vocab-high` defaults to the `vocab_size` of the server's `/server_info`, else 259, the
tiny checkpoint's byte tokens; ids 0-2 are its specials and never sent):
- `random`: `--num-prompts` prompts of `U[max(1, L * ratio), L]` tokens with
  `L = --random-input-len`, outputs likewise (`--random-output-len`, `--random-range-ratio`);
- `generated-shared-prefix` (SGLang's): `--gsp-num-groups` random system prompts of
  `--gsp-system-prompt-len` tokens, each followed by `--gsp-prompts-per-group` random
  questions of `--gsp-question-len` tokens, output `--gsp-output-len`, shuffled;
- `multi-turn`: `--num-prompts` conversations of `--multi-turn-turns` turns; the first
  prompt and every later question are `random`-sized; each later turn's prompt is the
  previous prompt + the previous output + a new question (chat: the message history),
  sent when the previous turn completes. A failed turn ends its conversation (the rest
  are `skipped_turns`). Where a server streams no output ids (text-only OpenAI servers),
  the output part of the next prompt is random ids of the output's length
  (`multi_turn_outputs_approximated`).

Arrivals: Poisson at `--request-rate` requests/s (first turns only, for multi-turn), `inf`
sends everything at once; a comma list (`1,4,inf`) runs once per rate, each run on a fresh
dataset drawn from `--seed` and the run's index (so a run does not find its prompts in
the prefix cache the run before left). `--max-concurrency` bounds the requests in flight.
Greedy (`--temperature 0`) with `ignore_eos` (unless `--disable-ignore-eos`), so outputs
have their requested lengths. Untimed warm-up requests first (`--warmup-requests`, 1):
prompts drawn like the dataset's, 4 output tokens, so that a server's first-use compiles
of those shapes are not timed.

Metrics per run: TTFT = time to the first chunk carrying a token; ITL = the gaps between
token-bearing chunks (a chunk carrying k tokens - counted from the cumulative ids of
`/generate`, or `token_ids` - gives k gaps of gap / k, as SGLang's client does); TPOT =
(e2e - ttft) / (output tokens - 1); E2E from send to `[DONE]`. Mean, median, p90, p99, std
and max in ms. Input tokens are the server's (`meta_info.prompt_tokens`,
`usage.prompt_tokens`) where reported, else the client's count (`input_tokens_source`);
output tokens likewise (`completion_tokens`). Cached tokens: the sum of
`meta_info.cached_tokens` or `usage.prompt_tokens_details.cached_tokens`, with
`meta_info.cached_tokens_details` (`device` / `host`) summed where given, and
`prefix_cache_hit_rate` = cached / input tokens of the requests that reported them.
Only completed requests count in the throughputs. A bad response never stops the run:
it is a failure counted by reason in `failure_reasons` (`HTTP <status>: <message>`,
`connection error: ...`, `timeout (> --request-timeout s)`, `malformed SSE: ...`,
`stream error: <the error event's message>`, `stream ended before [DONE]`).

Output: one JSON object on stdout (`runs`: one entry per rate; also written indented to
`--output-file`), a tqdm bar per run and a summary table on stderr, and with `--plot PNG`
the CDFs of TTFT, ITL and E2E (one line per rate) and, with several rates, latency vs
achieved throughput (median and p99 TTFT, ITL and E2E). Exit status 0, or 1 when no
request completed at all.

Against `make demo`'s servers: the demo starts a decode server, a CP=8 prefill server and
`cpkv-router` on free ports, checks them and stops; to benchmark that deployment start the
same three commands it runs (`serving/demo.py`) and point `--base-url` at the router (it
forwards `/generate` and the OpenAI routes, and answers `/v1/models`):

    python -m benchmarks.bench_serving --backend sglang --base-url http://127.0.0.1:ROUTER \\
        --dataset-name generated-shared-prefix --gsp-num-groups 4 --gsp-prompts-per-group 8 \\
        --gsp-system-prompt-len 512 --gsp-question-len 64 --gsp-output-len 16

Against SGLang or vLLM on their default ports: `--backend sglang --port 30000`, or
`--backend openai --port 8000 --model NAME --vocab-high N` (their `/server_info` does not
give this one's `vocab_size`: set `--vocab-high` to the model's, or leave the default).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

logger = logging.getLogger("bench_serving")

BACKENDS = {
    "sglang": "/generate",
    "sglang-oai": "/v1/completions",
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
DATASETS = ("random", "generated-shared-prefix", "multi-turn")
DEFAULT_VOCAB_HIGH = 259  # the tiny checkpoint's byte tokens end at 258 (3 + 255)
CHARS_PER_TOKEN = 4  # the usual rule of thumb for English text, without a tokenizer
MAX_REASONS = 30  # distinct failure reasons kept; the rest are counted as "other"
PROBE_TIMEOUT_S = 10.0
WORDS = (  # noqa: SIM905 (one word list, easier to read as text)
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her all she there would their we him been has when "
    "who will more no if out so said what up its about into than them can only other new "
    "some could time these two may then do first any my now such like our over man me "
    "even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very "
    "make world still own see men work long get here between both life being under never "
    "day same another know while last might us great old year off come since against go "
    "came right used take three cache page token prefill decode model server request"
).split()


# ---- what is sent ---------------------------------------------------------------------------


@dataclasses.dataclass
class Prompt:
    """One turn's new input: token ids (`sglang`, `openai`) or text (`openai-chat`)."""

    ids: list[int] | None
    text: str | None
    input_len: int  # tokens, as the client counts them (an estimate for untokenized text)
    output_len: int
    system: str | None = None  # openai-chat, generated-shared-prefix: the group's prompt
    system_len: int = 0


Conversation = list[Prompt]  # one Prompt for the single-turn datasets


class TextMaker:
    """Text of about `n` tokens from random common words: exact with a tokenizer (the
    words' ids cut at `n` and decoded), else `CHARS_PER_TOKEN` characters per token."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    def make(self, rng: np.random.Generator, n: int) -> tuple[str, int]:
        """(text, its length in tokens: counted, or estimated without a tokenizer)."""
        if self.tokenizer is None:
            words: list[str] = []
            chars = 0
            while chars < CHARS_PER_TOKEN * n:
                w = WORDS[int(rng.integers(len(WORDS)))]
                words.append(w)
                chars += len(w) + 1
            return " ".join(words)[: CHARS_PER_TOKEN * n], n
        k = max(n, 1)
        while True:
            text = " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), k))
            ids = self.tokenizer.encode(text)
            if len(ids) >= n:
                break
            k *= 2
        text = self.tokenizer.decode(ids[:n])
        return text, len(self.tokenizer.encode(text))


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float
    gsp_num_groups: int
    gsp_prompts_per_group: int
    gsp_system_prompt_len: int
    gsp_question_len: int
    gsp_output_len: int
    turns: int
    vocab_low: int
    vocab_high: int


def dataset_flags(spec: DatasetSpec) -> dict[str, int | float]:
    """The flags that shape `spec`'s dataset, by flag name."""
    if spec.name == "generated-shared-prefix":
        return {
            "gsp_num_groups": spec.gsp_num_groups,
            "gsp_prompts_per_group": spec.gsp_prompts_per_group,
            "gsp_system_prompt_len": spec.gsp_system_prompt_len,
            "gsp_question_len": spec.gsp_question_len,
            "gsp_output_len": spec.gsp_output_len,
        }
    out: dict[str, int | float] = {
        "num_prompts": spec.num_prompts,
        "random_input_len": spec.input_len,
        "random_output_len": spec.output_len,
        "random_range_ratio": spec.range_ratio,
    }
    if spec.name == "multi-turn":
        out["multi_turn_turns"] = spec.turns
    return out


def sample_len(rng: np.random.Generator, n: int, ratio: float) -> int:
    """SGLang's random length: uniform in `[max(1, int(n * ratio)), n]`."""
    return int(rng.integers(max(int(n * ratio), 1), n + 1))


def build_dataset(
    spec: DatasetSpec, rng: np.random.Generator, text: TextMaker | None
) -> list[Conversation]:
    """The conversations of one run: token ids when `text` is None, else text prompts."""

    def prompt(n: int, out: int) -> Prompt:
        if text is None:
            ids = rng.integers(spec.vocab_low, spec.vocab_high, n).tolist()
            return Prompt(ids, None, n, out)
        s, k = text.make(rng, n)
        return Prompt(None, s, k, out)

    if spec.name == "random":
        return [
            [
                prompt(
                    sample_len(rng, spec.input_len, spec.range_ratio),
                    sample_len(rng, spec.output_len, spec.range_ratio),
                )
            ]
            for _ in range(spec.num_prompts)
        ]
    if spec.name == "multi-turn":
        return [
            [
                prompt(
                    sample_len(rng, spec.input_len, spec.range_ratio),
                    sample_len(rng, spec.output_len, spec.range_ratio),
                )
                for _ in range(spec.turns)
            ]
            for _ in range(spec.num_prompts)
        ]
    if spec.name != "generated-shared-prefix":
        raise ValueError(f"unknown dataset {spec.name!r}")
    convs: list[Conversation] = []
    for _ in range(spec.gsp_num_groups):
        system = prompt(spec.gsp_system_prompt_len, 0)
        for _ in range(spec.gsp_prompts_per_group):
            q = prompt(spec.gsp_question_len, spec.gsp_output_len)
            if text is None:
                assert system.ids is not None and q.ids is not None
                p = Prompt(system.ids + q.ids, None, len(system.ids) + len(q.ids), q.output_len)
            else:
                p = Prompt(
                    None,
                    q.text,
                    system.input_len + q.input_len,
                    q.output_len,
                    system=system.text,
                    system_len=system.input_len,
                )
            convs.append([p])
    order = rng.permutation(len(convs))
    return [convs[int(i)] for i in order]


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (seconds from the start) of `n` requests arriving as a Poisson process of
    `rate` per second: exponential gaps, the first request at its first gap; all 0 for
    `rate == inf`."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0 or inf, got {rate}")
    return np.cumsum(rng.exponential(1.0 / rate, n))


# ---- one request ----------------------------------------------------------------------------


class Failure(Exception):
    """A bad response: `reason` is its key in the failure histogram."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass
class Result:
    """What one request measured (times in seconds, `perf_counter`)."""

    input_len: int  # the client's count
    output_len: int  # requested
    start: float = 0.0
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None  # the server's count
    cached_tokens: int | None = None
    cached_details: dict[str, int] | None = None
    output_ids: list[int] | None = None
    output_text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.input_len


def token_timing(
    start: float, events: Sequence[tuple[float, int]]
) -> tuple[float | None, list[float]]:
    """(TTFT, ITL) from `(time, cumulative tokens so far)` per stream event: the first event
    with tokens gives the TTFT; each later event carrying k new tokens gives k gaps of
    (its time - the previous token event's) / k. Events without new tokens are skipped."""
    ttft: float | None = None
    itl: list[float] = []
    last_t = start
    last_n = 0
    for t, n in events:
        new = n - last_n
        if new <= 0:
            continue
        if ttft is None:
            ttft = t - start
        else:
            itl.extend([(t - last_t) / new] * new)
        last_t, last_n = t, n
    return ttft, itl


_HEX_ID = re.compile(r"\b(?=[0-9a-f-]*\d)[0-9a-f][0-9a-f-]{7,}\b")


def error_message(raw: bytes, limit: int = 160) -> str:
    """The message of an error body (OpenAI `{"error": {"message"}}`, `{"error": str}`,
    FastAPI `{"detail"}`, `{"message"}`, or the text), one line, request ids masked."""
    text = raw.decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    msg: Any = text
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            msg = err.get("message", err)
        elif err is not None:
            msg = err
        elif "detail" in body:
            msg = body["detail"]
        elif "message" in body:
            msg = body["message"]
    msg = " ".join(str(msg).split()) or "(empty body)"
    return _HEX_ID.sub("<id>", msg)[:limit]


async def sse_data(resp: httpx.Response) -> AsyncIterator[dict[str, Any] | None]:
    """The JSON objects of an SSE body, then None for `data: [DONE]` (and stop). An error
    event (`{"error": ...}`) and anything that is not a JSON object raise `Failure`."""
    async for raw_line in resp.aiter_lines():
        line = raw_line.strip()
        if not line or line.startswith(":"):
            continue  # event separator or SSE comment (keep-alive)
        if not line.startswith("data:"):
            if line.split(":", 1)[0] in ("event", "id", "retry"):
                continue
            raise Failure("malformed SSE: a line that is not 'data: ...'")
        payload = line[5:].strip()
        if payload == "[DONE]":
            yield None
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            raise Failure("malformed SSE: data is not JSON") from None
        if not isinstance(obj, dict):
            raise Failure("malformed SSE: data is not a JSON object")
        if obj.get("error") is not None:
            raise Failure(f"stream error: {error_message(json.dumps(obj).encode())}")
        yield obj


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Failure(f"malformed SSE: {what} is not an int")
    return value


class EventReader:
    """Turns one backend's stream events into token counts and server-reported fields."""

    def __init__(self, backend: str, result: Result) -> None:
        self.backend = backend
        self.r = result
        self.events: list[tuple[float, int]] = []
        self.tokens = 0
        self.ids: list[int] = []
        self.ids_seen = False
        self.text_parts: list[str] = []
        self.reported_completion: int | None = None

    def feed(self, ev: dict[str, Any], t: float) -> None:
        if self.backend == "sglang":
            self._generate(ev)
        else:
            self._openai(ev)
        self.events.append((t, self.tokens))

    def _generate(self, ev: dict[str, Any]) -> None:
        meta = ev.get("meta_info") or {}
        if not isinstance(meta, dict):
            raise Failure("malformed SSE: meta_info is not an object")
        if "output_ids" in ev:
            ids = ev["output_ids"]
            if not isinstance(ids, list):
                raise Failure("malformed SSE: output_ids is not a list")
            self.ids = [_int(t, "an output id") for t in ids]
            self.ids_seen = True
            self.tokens = max(self.tokens, len(ids))
        elif meta.get("completion_tokens") is not None:
            self.tokens = max(self.tokens, _int(meta["completion_tokens"], "completion_tokens"))
        elif isinstance(ev.get("text"), str) and len(ev["text"]) > len("".join(self.text_parts)):
            self.tokens += 1
        if isinstance(ev.get("text"), str):
            self.text_parts = [ev["text"]]
        self._reported(meta)

    def _openai(self, ev: dict[str, Any]) -> None:
        choices = ev.get("choices") or []
        if not isinstance(choices, list):
            raise Failure("malformed SSE: choices is not a list")
        if choices:
            c = choices[0]
            if not isinstance(c, dict):
                raise Failure("malformed SSE: a choice is not an object")
            if self.backend == "openai-chat":
                delta = c.get("delta") or {}
                text = delta.get("content") if isinstance(delta, dict) else None
                tids = None
            else:
                text = c.get("text")
                tids = c.get("token_ids")
            text = text if isinstance(text, str) else ""
            if isinstance(tids, list) and tids:
                self.ids.extend(_int(t, "a token id") for t in tids)
                self.ids_seen = True
                self.tokens += len(tids)
            elif text:
                self.tokens += 1
            self.text_parts.append(text)
        usage = ev.get("usage")
        if isinstance(usage, dict):
            self._reported(usage)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                self.r.cached_tokens = _int(details["cached_tokens"], "cached_tokens")

    def _reported(self, fields: dict[str, Any]) -> None:
        """prompt / completion / cached tokens, from `meta_info` or `usage`."""
        if fields.get("prompt_tokens") is not None:
            self.r.prompt_tokens = _int(fields["prompt_tokens"], "prompt_tokens")
        if fields.get("completion_tokens") is not None:
            self.reported_completion = _int(fields["completion_tokens"], "completion_tokens")
        if self.backend == "sglang" and fields.get("cached_tokens") is not None:
            self.r.cached_tokens = _int(fields["cached_tokens"], "cached_tokens")
        details = fields.get("cached_tokens_details")
        if isinstance(details, dict):
            self.r.cached_details = {
                k: _int(details.get(k, 0) or 0, f"cached_tokens_details.{k}")
                for k in ("device", "host")
            }

    def finish(self) -> None:
        r = self.r
        r.ttft, r.itl = token_timing(r.start, self.events)
        r.output_tokens = (
            self.reported_completion if self.reported_completion is not None else self.tokens
        )
        # Streamed ids that do not add up to the reported count are not the output's.
        complete = self.reported_completion in (None, len(self.ids))
        r.output_ids = self.ids if self.ids_seen and complete else None
        r.output_text = "".join(self.text_parts)
        if r.ttft is None or r.output_tokens < 1:
            raise Failure("no output tokens")


async def send_request(
    client: httpx.AsyncClient,
    backend: str,
    url: str,
    body: dict[str, Any],
    result: Result,
    timeout_s: float,
) -> Result:
    """POST one streaming request and measure it into `result`; never raises for a bad
    response (`result.error` says what went wrong)."""
    reader = EventReader(backend, result)
    result.start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    raw = await resp.aread()
                    raise Failure(f"HTTP {resp.status_code}: {error_message(raw)}")
                done = False
                async for ev in sse_data(resp):
                    t = time.perf_counter()
                    if ev is None:
                        done = True
                        break
                    try:
                        reader.feed(ev, t)
                    except (TypeError, ValueError, KeyError, AttributeError) as e:
                        raise Failure(
                            f"malformed SSE: unexpected event ({type(e).__name__})"
                        ) from None
                if not done:
                    raise Failure("stream ended before [DONE]")
        result.e2e = time.perf_counter() - result.start
        reader.finish()
        result.ok = True
    except Failure as f:
        result.error = f.reason
    except (TimeoutError, httpx.TimeoutException):
        result.error = f"timeout (> {timeout_s:g} s)"
    except httpx.HTTPError as e:
        result.error = f"connection error: {type(e).__name__}: {str(e)[:100]}".rstrip(": ")
    except Exception as e:  # whatever else a bad response causes: a failure, not a crash
        result.error = f"client error: {type(e).__name__}: {str(e)[:100]}"
    if not result.ok:
        result.e2e = None
    return result


# ---- one run --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RequestConfig:
    backend: str
    url: str
    model: str | None
    temperature: float
    ignore_eos: bool
    timeout_s: float
    extra_body: dict[str, Any]


def request_body(cfg: RequestConfig, ids: list[int] | None, messages: list | None, out: int):
    if cfg.backend == "sglang":
        sampling: dict[str, Any] = {"max_new_tokens": out, "temperature": cfg.temperature}
        if cfg.ignore_eos:
            sampling["ignore_eos"] = True
        body: dict[str, Any] = {"input_ids": ids, "sampling_params": sampling, "stream": True}
    else:
        body = {
            "max_tokens": out,
            "temperature": cfg.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if cfg.backend == "openai-chat":
            body["messages"] = list(messages)  # the history grows after this request
        else:
            body["prompt"] = ids
        if cfg.model is not None:
            body["model"] = cfg.model
        if cfg.ignore_eos:
            body["ignore_eos"] = True
    return {**body, **cfg.extra_body}


@dataclasses.dataclass
class RunData:
    rate: float
    results: list[Result]
    duration: float
    skipped_turns: int
    outputs_approximated: int
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)


async def run_conversations(
    cfg: RequestConfig,
    convs: list[Conversation],
    rate: float,
    max_concurrency: int | None,
    rng: np.random.Generator,
    vocab: tuple[int, int],
    progress: tqdm | None,
) -> RunData:
    """Send every conversation (first turns at Poisson arrival times, later turns when the
    one before completes) and collect the results."""
    arrivals = poisson_arrivals(len(convs), rate, rng)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[Result] = []
    skipped = 0
    approximated = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_concurrency or 256)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.timeout_s), limits=limits, trust_env=False
    ) as client:
        t0 = time.perf_counter()

        async def conversation(i: int, conv: Conversation) -> None:
            nonlocal skipped, approximated
            await asyncio.sleep(max(0.0, t0 + float(arrivals[i]) - time.perf_counter()))
            ids: list[int] = []
            messages: list[dict[str, str]] = []
            history_len = 0
            for k, p in enumerate(conv):
                if cfg.backend == "openai-chat":
                    if p.system is not None:
                        messages.append({"role": "system", "content": p.system})
                    messages.append({"role": "user", "content": p.text or ""})
                else:
                    ids = ids + list(p.ids or ())
                input_len = history_len + p.input_len
                body = request_body(cfg, ids, messages, p.output_len)
                result = Result(input_len=input_len, output_len=p.output_len)
                if sem is not None:
                    async with sem:
                        await send_request(
                            client, cfg.backend, cfg.url, body, result, cfg.timeout_s
                        )
                else:
                    await send_request(client, cfg.backend, cfg.url, body, result, cfg.timeout_s)
                results.append(result)
                if progress is not None:
                    progress.update(1)
                if not result.ok:
                    skipped += len(conv) - k - 1
                    if progress is not None:
                        progress.update(len(conv) - k - 1)
                    return
                if k + 1 == len(conv):
                    return
                # The next turn: this prompt + this output + the next question.
                history_len = input_len + result.output_tokens
                if cfg.backend == "openai-chat":
                    messages.append({"role": "assistant", "content": result.output_text})
                elif result.output_ids is not None:
                    ids = ids + result.output_ids
                else:
                    approximated += 1
                    ids = ids + rng.integers(vocab[0], vocab[1], result.output_tokens).tolist()

        await asyncio.gather(*(conversation(i, c) for i, c in enumerate(convs)))
        duration = time.perf_counter() - t0
    return RunData(rate, results, duration, skipped, approximated)


# ---- statistics and reports -----------------------------------------------------------------


def summarize(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """mean / median / p90 / p99 / std / max in ms of values in seconds (numpy's linear
    percentiles); None where there are no values."""
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    if ms.size == 0:
        return {k: None for k in ("mean", "median", "p90", "p99", "std", "max")} | {"count": 0}
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
        "std": float(ms.std()),
        "max": float(ms.max()),
        "count": int(ms.size),
    }


def failure_histogram(reasons: Sequence[str]) -> dict[str, int]:
    """Reason -> count, most common first; past `MAX_REASONS` distinct reasons the rest
    are counted under "other"."""
    counts = Counter(reasons).most_common()
    out = dict(counts[:MAX_REASONS])
    rest = sum(n for _, n in counts[MAX_REASONS:])
    if rest:
        out["other"] = rest
    return out


def rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def summarize_run(run: RunData) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    failed = [r for r in run.results if not r.ok]
    dur = max(run.duration, 1e-9)
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    served = sum(r.prompt_tokens is not None for r in ok)
    source = "server" if ok and served == len(ok) else "client" if served == 0 else "mixed"
    with_cache = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in with_cache) if with_cache else None
    cache_input = sum(r.input_tokens for r in with_cache)
    with_details = [r.cached_details for r in ok if r.cached_details is not None]
    details = (
        {k: sum(d[k] for d in with_details) for k in ("device", "host")} if with_details else None
    )
    e2e = [r.e2e for r in ok if r.e2e is not None]
    hit_rate = cached / cache_input if cached is not None and cache_input else None
    return {
        "request_rate": rate_json(run.rate),
        "requests": len(run.results),
        "completed": len(ok),
        "failed": len(failed),
        "skipped_turns": run.skipped_turns,
        "failure_reasons": failure_histogram([r.error or "unknown" for r in failed]),
        "duration_s": run.duration,
        "request_throughput": len(ok) / dur,
        "input_throughput": input_tokens / dur,
        "output_throughput": output_tokens / dur,
        "total_token_throughput": (input_tokens + output_tokens) / dur,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "input_tokens_source": source,
        "client_input_tokens": sum(r.input_len for r in ok),
        "requested_output_tokens": sum(r.output_len for r in ok),
        "concurrency": sum(e2e) / dur,
        "ttft_ms": summarize([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": summarize([g for r in ok for g in r.itl]),
        "tpot_ms": summarize([t for r in ok if (t := r.tpot) is not None]),
        "e2e_ms": summarize(e2e),
        "cached_tokens": cached,
        "cached_tokens_details": details,
        "prefix_cache_hit_rate": hit_rate,
        "multi_turn_outputs_approximated": run.outputs_approximated,
    }


def log_summary(s: dict[str, Any]) -> None:
    def ms(key: str) -> str:
        st = s[key]
        if st["count"] == 0:
            return "-"
        return f"mean {st['mean']:.1f} / median {st['median']:.1f} / p99 {st['p99']:.1f} ms"

    hit = s["prefix_cache_hit_rate"]
    lines = [
        f"request rate {s['request_rate']}: {s['completed']} completed, {s['failed']} failed "
        f"in {s['duration_s']:.2f} s",
        f"  throughput: {s['request_throughput']:.2f} req/s, input {s['input_throughput']:.1f} "
        f"tok/s, output {s['output_throughput']:.1f} tok/s",
        f"  TTFT {ms('ttft_ms')}",
        f"  ITL  {ms('itl_ms')}",
        f"  TPOT {ms('tpot_ms')}",
        f"  E2E  {ms('e2e_ms')}",
        f"  cached tokens {s['cached_tokens']}"
        + (f" (hit rate {hit:.1%})" if hit is not None else ""),
    ]
    for reason, n in s["failure_reasons"].items():
        lines.append(f"  failed x{n}: {reason}")
    logger.info("\n".join(lines))


def plot(runs: Sequence[RunData], path: str | Path) -> None:
    """CDFs of TTFT, ITL and E2E per run; with several runs, latency vs throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    several = len(runs) > 1
    fig, axes = plt.subplots(
        2 if several else 1, 3, figsize=(16, 9 if several else 4.8), squeeze=False
    )
    samples: list[tuple[str, Callable[[RunData], list[float]], str]] = [
        ("TTFT", lambda run: [r.ttft for r in run.results if r.ok and r.ttft is not None], "req"),
        ("ITL", lambda run: [g for r in run.results if r.ok for g in r.itl], "gaps"),
        ("E2E latency", lambda run: [r.e2e for r in run.results if r.ok and r.e2e], "req"),
    ]
    for ax, (name, get, unit) in zip(axes[0], samples, strict=True):
        for run in runs:
            vals = np.sort(np.asarray(get(run), dtype=np.float64)) * 1e3
            if vals.size:
                frac = np.arange(1, vals.size + 1) / vals.size
                ax.step(vals, frac, where="post", label=f"rate {run.rate:g}")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel(f"fraction of {'requests' if unit == 'req' else 'token gaps'}")
        ax.set_title(f"{name} CDF")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if several:
        curves = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("E2E latency", "e2e_ms"))
        for ax, (name, key) in zip(axes[1], curves, strict=True):
            xs = [run.summary["output_throughput"] for run in runs]
            for stat, style in (("median", "o-"), ("p99", "s--")):
                ys = [run.summary[key][stat] for run in runs]
                pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, label=f"{stat} {name}")
            for run, x in zip(runs, xs, strict=True):
                y = run.summary[key]["median"]
                if y is not None:
                    ax.annotate(f"{run.rate:g}", (x, y), fontsize=7)
            ax.set_xlabel("output throughput (tok/s)")
            ax.set_ylabel(f"{name} (ms)")
            ax.set_title(f"{name} vs throughput (labels: request rate)")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- the server -----------------------------------------------------------------------------


def probe_server(base_url: str) -> dict[str, Any]:
    """What the server says about itself: `/server_info` (this project's servers:
    `vocab_size`, `context_length`, `model_name`) and `/v1/models` (`id`, `max_model_len`);
    missing endpoints are fine."""
    out: dict[str, Any] = {}
    with httpx.Client(base_url=base_url, timeout=PROBE_TIMEOUT_S, trust_env=False) as http:
        try:
            r = http.get("/server_info")
            info = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            info = None
        if isinstance(info, dict):
            for key in ("vocab_size", "context_length", "model_name"):
                if info.get(key) is not None:
                    out[key] = info[key]
        try:
            r = http.get("/v1/models")
            models = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            models = None
        data = models.get("data") if isinstance(models, dict) else None
        if isinstance(data, list) and data and isinstance(data[0], dict):
            out.setdefault("model_name", data[0].get("id"))
            if data[0].get("max_model_len") is not None:
                out.setdefault("context_length", data[0]["max_model_len"])
    return out


# ---- command line ---------------------------------------------------------------------------


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        rate = float(part)  # "inf" parses too
        if not (rate > 0):
            raise ValueError(f"request rates must be > 0 or inf, got {part!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("no request rate given")
    return rates


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--backend", choices=sorted(BACKENDS), default="sglang")
    ap.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--model", default=None, help="OpenAI backends (default: /v1/models' first)")
    ap.add_argument("--tokenizer", default=None, help="dir with tokenizer.json (openai-chat)")
    ap.add_argument("--dataset-name", choices=DATASETS, default="random")
    ap.add_argument("--num-prompts", type=int, default=200, help="(multi-turn: conversations)")
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--gsp-num-groups", type=int, default=64)
    ap.add_argument("--gsp-prompts-per-group", type=int, default=16)
    ap.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    ap.add_argument("--gsp-question-len", type=int, default=128)
    ap.add_argument("--gsp-output-len", type=int, default=256)
    ap.add_argument("--multi-turn-turns", type=int, default=3)
    ap.add_argument("--vocab-low", type=int, default=3, help="smallest token id sent")
    ap.add_argument(
        "--vocab-high",
        type=int,
        default=None,
        help=f"token ids sent are < this (default: /server_info vocab_size, else "
        f"{DEFAULT_VOCAB_HIGH})",
    )
    ap.add_argument(
        "--request-rate", default="inf", help="requests/s, Poisson; inf; or a list: 1,4,inf"
    )
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--disable-ignore-eos", action="store_true")
    ap.add_argument("--extra-request-body", default=None, help="JSON merged into every body")
    ap.add_argument("--warmup-requests", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--output-file", default=None, help="also write the JSON here")
    ap.add_argument("--plot", default=None, help="PNG of latency CDFs (and curves)")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object (default: also)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    try:
        rates = parse_rates(args.request_rate)
    except ValueError as e:
        ap.error(f"--request-rate {args.request_rate!r}: {e}")
    positive = {
        "--num-prompts": args.num_prompts,
        "--random-input-len": args.random_input_len,
        "--random-output-len": args.random_output_len,
        "--gsp-num-groups": args.gsp_num_groups,
        "--gsp-prompts-per-group": args.gsp_prompts_per_group,
        "--gsp-question-len": args.gsp_question_len,
        "--gsp-output-len": args.gsp_output_len,
        "--multi-turn-turns": args.multi_turn_turns,
        "--request-timeout": args.request_timeout,
    }
    if bad := [k for k, v in positive.items() if not v > 0]:
        ap.error(f"{', '.join(bad)} must be > 0")
    if args.gsp_system_prompt_len < 0 or args.warmup_requests < 0:
        ap.error("--gsp-system-prompt-len and --warmup-requests must be >= 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error("--max-concurrency must be >= 1")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        ap.error("--random-range-ratio must be in [0, 1]")
    extra: dict[str, Any] = {}
    if args.extra_request_body:
        try:
            extra = json.loads(args.extra_request_body)
        except ValueError as e:
            ap.error(f"--extra-request-body is not JSON: {e}")
        if not isinstance(extra, dict):
            ap.error("--extra-request-body must be a JSON object")

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    server = probe_server(base_url)
    if args.vocab_high is not None:
        vocab_high, vocab_source = args.vocab_high, "--vocab-high"
        if "vocab_size" in server and vocab_high > server["vocab_size"]:
            ap.error(
                f"--vocab-high {vocab_high} is over the server's vocab_size {server['vocab_size']}"
            )
    elif isinstance(server.get("vocab_size"), int):
        vocab_high, vocab_source = server["vocab_size"], "/server_info vocab_size"
    else:
        vocab_high, vocab_source = DEFAULT_VOCAB_HIGH, "default (the tiny checkpoint's bytes)"
    if not 0 <= args.vocab_low < vocab_high:
        ap.error(f"token ids [{args.vocab_low}, {vocab_high}) is an empty range")
    model = args.model
    if model is None and args.backend != "sglang":
        model = server.get("model_name")

    tokenizer = None
    if args.backend == "openai-chat" and args.tokenizer:
        from cpkv_jax.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
        if tokenizer is None:
            ap.error(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
    text = TextMaker(tokenizer) if args.backend == "openai-chat" else None
    estimates = text is not None and tokenizer is None

    spec = DatasetSpec(
        name=args.dataset_name,
        num_prompts=args.num_prompts,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        gsp_num_groups=args.gsp_num_groups,
        gsp_prompts_per_group=args.gsp_prompts_per_group,
        gsp_system_prompt_len=args.gsp_system_prompt_len,
        gsp_question_len=args.gsp_question_len,
        gsp_output_len=args.gsp_output_len,
        turns=args.multi_turn_turns if args.dataset_name == "multi-turn" else 1,
        vocab_low=args.vocab_low,
        vocab_high=vocab_high,
    )
    cfg = RequestConfig(
        backend=args.backend,
        url=base_url + BACKENDS[args.backend],
        model=model,
        temperature=args.temperature,
        ignore_eos=not args.disable_ignore_eos,
        timeout_s=args.request_timeout,
        extra_body=extra,
    )
    report: dict[str, Any] = {
        "benchmark": "bench_serving",
        "backend": args.backend,
        "base_url": base_url,
        "endpoint": BACKENDS[args.backend],
        "model": model,
        "server": server,
        "dataset_name": args.dataset_name,
        "dataset": dataset_flags(spec),
        "vocab_range": [args.vocab_low, vocab_high],
        "vocab_source": vocab_source,
        "input_lens_are_estimates": estimates,
        "seed": args.seed,
        "request_rates": [rate_json(r) for r in rates],
        "max_concurrency": args.max_concurrency,
        "request_timeout_s": args.request_timeout,
        "temperature": args.temperature,
        "ignore_eos": cfg.ignore_eos,
        "host": os.uname().nodename,
    }
    if estimates:
        report["input_len_estimate"] = (
            f"text prompts sized at {CHARS_PER_TOKEN} characters per token (no --tokenizer); "
            "total_input_tokens uses the server's prompt_tokens where reported"
        )

    # Warm-up: untimed, prompts of the dataset's kind and size (their own draw, so that
    # they share no prefix with the runs'), 4 output tokens at most.
    if args.warmup_requests:
        drawn = build_dataset(spec, np.random.default_rng([args.seed, 99]), text)
        wconvs = [
            [dataclasses.replace(c[0], output_len=min(4, c[0].output_len))]
            for c in drawn[: args.warmup_requests]
        ]
        wrun = asyncio.run(
            run_conversations(cfg, wconvs, math.inf, None, np.random.default_rng(0), (0, 1), None)
        )
        werr = [r.error for r in wrun.results if not r.ok]
        report["warmup"] = {"requests": len(wrun.results), "failed": len(werr)}
        if werr:
            report["warmup"]["failure_reasons"] = failure_histogram([e or "" for e in werr])
            logger.warning("warm-up request failed: %s (going on)", werr[0])

    runs: list[RunData] = []
    context = server.get("context_length")
    for i, rate in enumerate(rates):
        convs = build_dataset(spec, np.random.default_rng([args.seed, i]), text)
        n_requests = sum(len(c) for c in convs)
        if isinstance(context, int):
            first_over = sum(c[0].input_len + c[0].output_len > context for c in convs if c)
            if first_over:
                logger.warning(
                    "%d prompts + outputs are over the server's context length %d: they will fail",
                    first_over,
                    context,
                )
        logger.info(
            "run %d/%d: %d requests (%s) at rate %s to %s",
            i + 1,
            len(rates),
            n_requests,
            args.dataset_name,
            rate_json(rate),
            cfg.url,
        )
        bar = tqdm(
            total=n_requests,
            desc=f"rate {rate_json(rate)}",
            disable=args.disable_tqdm,
            file=sys.stderr,
        )
        try:
            run = asyncio.run(
                run_conversations(
                    cfg,
                    convs,
                    rate,
                    args.max_concurrency,
                    np.random.default_rng([args.seed, i, 1]),
                    (args.vocab_low, vocab_high),
                    bar,
                )
            )
        finally:
            bar.close()
        run.summary = summarize_run(run)
        log_summary(run.summary)
        runs.append(run)
    report["runs"] = [run.summary for run in runs]
    if args.plot:
        plot(runs, args.plot)
        logger.info("plot written to %s", args.plot)
    report["plot"] = args.plot
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))
    return 0 if any(run.summary["completed"] for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
