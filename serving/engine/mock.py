"""`MockEngine`: a deterministic `StepEngine` with no model, shipped with the package (as
JetStream ships its mock engine) so that tests of the HTTP app and of the router run the
real app, the real `EngineLoop` and real HTTP against it instead of hand-written fakes.

    engine = MockEngine(tokenizer)           # or MockEngine(None): token ids only
    loop = engine.loop()                     # the real EngineLoop around it
    app = build_app(loop, ...)

The output is closed-form, so a test recomputes every expected value itself:

- output token `i` is `prompt[i % len(prompt)]` (`echo_ids`), one token per `step`, with
  log-prob `mock_logprob(token, i)` when the request asks for log-probs;
- it finishes with "stop" on a stop token id, on `eos_id` (unless `ignore_eos`), or once
  the decoded output contains a stop string (the engine-side check the contract asks
  for; needs a tokenizer); with "length" at `max_new_tokens`; with "error" when the
  prompt starts with `fail_id` (as a failed KV transfer would); with "abort" on the step
  after `abort`;
- `add` refuses a prompt containing `refuse_id` with `InputError` (an engine-side
  validation, HTTP 400), and every request while `queue_full` is set with
  `QueueFullError` (HTTP 503 with `Retry-After: 7`);
- the final chunk's `meta` has `cached_tokens == len(prompt) // 2`.

PD modes behave as the real engines do at the contract: mode "prefill" needs
`bootstrap_room` and `decode_transfer_target` and answers only the first token (finish
"length", as after a delivered transfer); mode "decode" needs `bootstrap_room` and
`bootstrap_cp_size >= 1` and then echoes like "null". Every accepted request is kept in
`requests` (PD fields included), so a router test can check what reached the server.

Thread-safe: the loop thread calls `add` / `step` / `abort`, a test reads the counters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from cpkv_jax.errors import InputError
from cpkv_jax.tokenizer import Tokenizer
from serving.engine.api import EngineStats, FinishReason, GenerateRequest, OutputChunk, ServerMode
from serving.engine.loop import EngineLoop
from serving.engine.wait_queue import QueueFullError

# The tiny checkpoint's EOS and pad ids, and byte 0xff of its byte tokenizer (never in
# UTF-8 text, so only a test that means it sends it): the defaults of `MockEngine`.
MOCK_EOS_ID = 1
MOCK_REFUSE_ID = 2
MOCK_FAIL_ID = 3 + 255
MOCK_PAGES = (64, 48)
MOCK_RETRY_AFTER_S = 7
MODES: tuple[ServerMode, ...] = ("null", "prefill", "decode")


def mock_logprob(token: int, i: int) -> float:
    """The log-prob `MockEngine` reports for output token `token` at position `i`."""
    return -(((token * 7 + i) % 11) / 10.0) - 0.05


def echo_ids(prompt: Sequence[int], n: int) -> list[int]:
    """The first `n` output tokens `MockEngine` gives for `prompt` (before any stop)."""
    return [prompt[i % len(prompt)] for i in range(n)]


class MockEngine:
    """A deterministic `StepEngine` (see the module docstring for its rules).

    `step_delay` (seconds each `step` sleeps, so a stream takes time and the loop does not
    spin) and `queue_full` may be changed while it runs. `added` lists the accepted rids
    in order, `aborted` the rids aborted while running, `finished` maps rid -> tokens
    produced, `requests` rid -> the accepted `GenerateRequest`.

    `stats()` reports `pages` as the KV pages per rank (rank 0 loses one page per running
    request) and `kv_bytes_per_page`; `stats_extra` fills the other `EngineStats` fields
    (transfer counters, queue stats, ...), so `/metrics` tests can check known values.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        mode: ServerMode = "null",
        eos_id: int | None = MOCK_EOS_ID,
        refuse_id: int | None = MOCK_REFUSE_ID,
        fail_id: int | None = MOCK_FAIL_ID,
        step_delay: float = 0.0005,
        pages: tuple[int, ...] = MOCK_PAGES,
        kv_bytes_per_page: int = 4096,
        stats_extra: Mapping[str, Any] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not pages:
            raise ValueError("pages needs one entry per rank, got none")
        self.mode: ServerMode = mode
        self._tok = tokenizer
        self.eos_id = eos_id
        self.refuse_id = refuse_id
        self.fail_id = fail_id
        self.step_delay = step_delay
        self.pages = tuple(pages)
        self.kv_bytes_per_page = kv_bytes_per_page
        self.stats_extra = dict(stats_extra or {})
        self.queue_full = False  # refuse adds as a server whose wait queue is full
        self._lock = threading.Lock()
        self._active: dict[str, dict[str, Any]] = {}  # guarded by _lock
        self.added: list[str] = []
        self.aborted: set[str] = set()
        self.finished: dict[str, int] = {}
        self.requests: dict[str, GenerateRequest] = {}

    def loop(self, *, idle_wait_s: float = 0.01, name: str = "mock-engine") -> EngineLoop:
        """The real `EngineLoop` (an `EngineClient`) stepping this engine."""
        return EngineLoop(self, idle_wait_s=idle_wait_s, name=name)

    # ---- StepEngine ------------------------------------------------------------------

    def add(self, req: GenerateRequest) -> None:
        if not req.input_ids:
            raise InputError(f"request {req.rid}: the prompt is empty")
        if self.refuse_id is not None and self.refuse_id in req.input_ids:
            raise InputError(
                f"request {req.rid}: the prompt contains the pad token {self.refuse_id}"
            )
        self._check_pd_fields(req)
        if self.queue_full:
            raise QueueFullError(
                "the mock server's wait queue is full", retry_after_s=MOCK_RETRY_AFTER_S
            )
        with self._lock:
            if req.rid in self._active:
                raise InputError(f"request id {req.rid!r} is already running here")
            self._active[req.rid] = {"req": req, "out": [], "abort": False, "t0": time.monotonic()}
            self.added.append(req.rid)
            self.requests[req.rid] = req

    def _check_pd_fields(self, req: GenerateRequest) -> None:
        """The PD fields the real engine of this mode refuses a request without."""
        if self.mode == "prefill":
            missing = [
                n for n in ("bootstrap_room", "decode_transfer_target") if not getattr(req, n)
            ]
            if missing:
                raise InputError(
                    f"request {req.rid!r}: a prefill server needs {' and '.join(missing)}"
                )
        elif self.mode == "decode" and (
            not req.bootstrap_room or req.bootstrap_cp_size is None or req.bootstrap_cp_size < 1
        ):
            raise InputError(
                f"request {req.rid!r}: a decode server needs bootstrap_room and "
                f"bootstrap_cp_size >= 1 (got {req.bootstrap_room!r}, {req.bootstrap_cp_size!r})"
            )

    def abort(self, rid: str) -> None:
        with self._lock:
            if rid in self._active:
                self._active[rid]["abort"] = True
                self.aborted.add(rid)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._active)

    def stats(self) -> EngineStats:
        with self._lock:
            running = len(self._active)
        fields: dict[str, Any] = {
            "mode": self.mode,
            "waiting": 0,
            "running": running,
            "kv_pages_total": self.pages,
            "kv_pages_free": (max(self.pages[0] - running, 0), *self.pages[1:]),
            "kv_bytes_per_page": self.kv_bytes_per_page,
        }
        return EngineStats(**{**fields, **self.stats_extra})

    def step(self) -> list[OutputChunk]:
        time.sleep(self.step_delay)  # a step takes time (and the loop must not spin)
        chunks = []
        with self._lock:
            for rid, state in list(self._active.items()):
                chunk = self._advance(state)
                chunks.append(chunk)
                if chunk.finished:
                    del self._active[rid]
                    self.finished[rid] = len(state["out"])
        return chunks

    # ---- one request -----------------------------------------------------------------

    def _advance(self, state: dict[str, Any]) -> OutputChunk:
        req: GenerateRequest = state["req"]
        out: list[int] = state["out"]
        meta: dict[str, float | int] = {
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(out),
            "cached_tokens": len(req.input_ids) // 2,
            "ttft_s": 0.0,
            "e2e_s": time.monotonic() - state["t0"],
        }
        if state["abort"]:
            return OutputChunk(req.rid, finished=True, finish_reason="abort", meta=meta)
        if self.fail_id is not None and req.input_ids[0] == self.fail_id:
            return OutputChunk(
                req.rid,
                finished=True,
                finish_reason="error",
                error="the KV transfer of this request failed",
                meta=meta,
            )
        i = len(out)
        tok = req.input_ids[i % len(req.input_ids)]
        out.append(tok)
        meta["completion_tokens"] = len(out)
        reason = self.finish_reason(req, out)
        return OutputChunk(
            req.rid,
            token_ids=(tok,),
            logprobs=(mock_logprob(tok, i),) if req.return_logprob else None,
            finished=reason is not None,
            finish_reason=reason,
            meta=meta if reason else {},
        )

    def finish_reason(self, req: GenerateRequest, out: Sequence[int]) -> FinishReason | None:
        """Why the output `out` of `req` ends here, or None to go on."""
        sp = req.sampling
        if out[-1] in sp.stop_token_ids or (out[-1] == self.eos_id and not sp.ignore_eos):
            return "stop"
        if sp.stop and self._tok is not None:
            text = self._tok.decode(list(out))
            if any(s in text for s in sp.stop):
                return "stop"
        if self.mode == "prefill" or len(out) >= sp.max_new_tokens:
            return "length"  # a prefill server's only output is the first token
        return None
