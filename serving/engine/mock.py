"""`MockEngine`: a deterministic `StepEngine` with no model, shipped with the package (as
JetStream ships its mock engine) so that tests of the HTTP app and of the router run the
real app, the real `EngineLoop` and real HTTP against it instead of hand-written fakes.

    engine = MockEngine(tokenizer)           # or MockEngine(None): token ids only
    loop = engine.loop()                     # the real EngineLoop around it
    app = build_app(loop, ...)

The output is closed-form, so a test recomputes every expected value itself:

- output token `i` is `prompt[i % len(prompt)]` (`echo_ids`), one token per `step`, with
  log-prob `mock_logprob(token, i)` when the request asks for log-probs, and
  `mock_top_logprobs(token, i, n)` when it asks for `n` top log-probs; with
  `prompt_logprobs_from`, the first chunk scores prompt token `p` from there on with
  `mock_prompt_logprob(token, p)` (None for token 0) and alternatives
  `mock_top_logprobs` of the same value's position `-p` (in PD mode the decode side's
  first chunk, as the real decode server's from the transfer's aux; the prefill side's
  answer has none, as the real one's: SGLang's gateway merges the two);
- it finishes with "stop" on a stop token id, on `eos_id` (unless `ignore_eos`; neither
  before `min_new_tokens` output tokens), or once
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

With a shared `MockRooms` (an in-process stand-in for the KV transfer), a prefill mock and
a decode mock depend on each other as the real pair does: the prefill mock, when it
answers a request, publishes the room's KV (its first token, that token's log-prob and
its `cp_size`) for the request's `decode_transfer_target`; a decode mock (built with its
advertised `transfer_target`) holds a request, producing nothing, until the KV of its room
is published for that target, then gives the published token as output token 0 and goes
on with the echo (so the output is `echo_ids` again when the wiring is right). A room
published for another target is never seen; a `bootstrap_cp_size` other than the
prefill's, a failed room (`MockRooms.fail`) or no KV within `MockRooms.wait_s` ends the
decode request with "error". `MockRooms.prefill_delay` holds every prefill request that
long before it answers; `MockRooms.prefill_fail` makes it answer "error" (HTTP 500)
without publishing, as a crashed CP step would (the decode side keeps waiting), or, with
`prefill_fail_after_kv_s`, publish first and answer "error" that much later.

Thread-safe: the loop thread calls `add` / `step` / `abort`, a test reads the counters.
"""

from __future__ import annotations

import dataclasses
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


def mock_prompt_logprob(token: int, p: int) -> float:
    """The log-prob `MockEngine` reports for prompt token `token` at position `p >= 1`."""
    return mock_logprob(token, -p)


def mock_top_logprobs(token: int, i: int, n: int) -> tuple[tuple[int, float], ...]:
    """The `n` top log-probs `MockEngine` reports at output position `i`: the chosen token
    first, then `token + 1, token + 2, ...`, each 0.5 less likely than the one before."""
    first = mock_logprob(token, i)
    return tuple((token + k, first - 0.5 * k) for k in range(n))


def echo_ids(prompt: Sequence[int], n: int) -> list[int]:
    """The first `n` output tokens `MockEngine` gives for `prompt` (before any stop)."""
    return [prompt[i % len(prompt)] for i in range(n)]


@dataclasses.dataclass(frozen=True)
class RoomKV:
    """What a prefill mock publishes for one room: the first token and its log-prob."""

    token: int
    logprob: float
    cp_size: int
    prefill_rid: str


class MockRooms:
    """The KV transfer between a prefill `MockEngine` and a decode `MockEngine` in one
    process: `(transfer target, room) -> RoomKV` (or the error a failed room gives).
    Thread-safe (each engine steps in its own loop thread); the switches may be changed
    while the engines run."""

    def __init__(self, wait_s: float = 10.0) -> None:
        self.wait_s = wait_s  # how long a decode request waits for its room's KV
        self._lock = threading.Lock()
        self._kv: dict[tuple[str, str], RoomKV | str] = {}  # guarded by _lock
        self.reset()

    def reset(self) -> None:
        """Back to the default switches (published rooms are kept)."""
        self.prefill_delay = 0.0  # seconds each prefill request is held before it answers
        self.prefill_fail = False  # prefill requests answer "error" and publish nothing
        # With `prefill_fail`: publish the KV first, then answer "error" this much later
        # (a prefill that fails after its transfer went out; the decode stream has begun).
        self.prefill_fail_after_kv_s: float | None = None

    def publish(self, target: str, room: str, kv: RoomKV) -> None:
        with self._lock:
            self._kv[(target, room)] = kv

    def fail(self, target: str, room: str, why: str = "the KV transfer failed") -> None:
        """The decode request of `room` at `target` ends with "error" saying `why`."""
        with self._lock:
            self._kv[(target, room)] = why

    def get(self, target: str, room: str) -> RoomKV | str | None:
        with self._lock:
            return self._kv.get((target, room))

    def targets(self, room: str) -> list[str]:
        """The transfer targets `room` was published (or failed) for."""
        with self._lock:
            return [t for (t, r) in self._kv if r == room]


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
        rooms: MockRooms | None = None,
        transfer_target: str | None = None,
        cp_size: int = 1,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if rooms is not None and mode == "null":
            raise ValueError("rooms are for a prefill or decode mock, not mode 'null'")
        if rooms is not None and mode == "decode" and not transfer_target:
            raise ValueError("a decode mock with rooms needs its transfer_target")
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
        self.rooms = rooms
        self.transfer_target = transfer_target
        self.cp_size = cp_size
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
        if req.prompt_logprobs_from is not None and not (
            0 <= req.prompt_logprobs_from < len(req.input_ids)
        ):
            raise InputError(f"request {req.rid!r}: logprob_start_len is outside the prompt")
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
                if chunk is None:
                    continue  # held: waiting for its KV, or a slow prefill
                chunks.append(chunk)
                if chunk.finished:
                    del self._active[rid]
                    self.finished[rid] = len(state["out"])
        return chunks

    # ---- one request -----------------------------------------------------------------

    def _advance(self, state: dict[str, Any]) -> OutputChunk | None:
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
        logprob = mock_logprob(tok, i)
        if self.rooms is not None:
            held = self._room_step(state, i, meta)
            if isinstance(held, OutputChunk):
                return held
            if held is False:
                return None
            if isinstance(held, RoomKV):
                tok, logprob = held.token, held.logprob
        prompt_lps = prompt_tops = None
        if not out and req.prompt_logprobs_from is not None and self.mode != "prefill":
            prompt_lps, prompt_tops = self._prompt_scores(req)
        out.append(tok)
        meta["completion_tokens"] = len(out)
        reason = self.finish_reason(req, out)
        if reason == "stop" and self._stop_token(req, out):
            meta["matched_stop_token"] = tok  # as the decode engine's chunk says it
        if self.rooms is not None and self.mode == "prefill":
            assert req.decode_transfer_target and req.bootstrap_room  # checked by `add`
            kv = RoomKV(tok, logprob, self.cp_size, req.rid)
            self.rooms.publish(req.decode_transfer_target, req.bootstrap_room, kv)
        return OutputChunk(
            req.rid,
            token_ids=(tok,),
            logprobs=(logprob,) if req.return_logprob else None,
            top_logprobs=(
                (mock_top_logprobs(tok, i, req.top_logprobs),)
                if req.return_logprob and req.top_logprobs
                else None
            ),
            prompt_logprobs=prompt_lps,
            prompt_top_logprobs=prompt_tops,
            finished=reason is not None,
            finish_reason=reason,
            meta=meta if reason else {},
        )

    @staticmethod
    def _prompt_scores(req: GenerateRequest) -> tuple[tuple, tuple]:
        start = req.prompt_logprobs_from
        assert start is not None
        lps: list[float | None] = []
        tops: list[tuple[tuple[int, float], ...]] = []
        for p in range(start, len(req.input_ids)):
            tok = req.input_ids[p]
            lps.append(None if p == 0 else mock_prompt_logprob(tok, p))
            tops.append(() if p == 0 else mock_top_logprobs(tok, -p, req.top_logprobs))
        return tuple(lps), tuple(tops)

    def _room_step(
        self, state: dict[str, Any], i: int, meta: dict[str, float | int]
    ) -> OutputChunk | RoomKV | bool:
        """With `rooms`: False to hold the request this step, an error chunk to end it, the
        room's KV for decode output token 0, else True (go on as without rooms)."""
        assert self.rooms is not None
        req: GenerateRequest = state["req"]
        waited = time.monotonic() - state["t0"]
        room = req.bootstrap_room
        assert room is not None  # checked by `add`

        def error(why: str) -> OutputChunk:
            return OutputChunk(req.rid, finished=True, finish_reason="error", error=why, meta=meta)

        if self.mode == "prefill":
            if waited < self.rooms.prefill_delay:
                return False
            if self.rooms.prefill_fail:
                after = self.rooms.prefill_fail_after_kv_s
                if after is not None:
                    if not state.get("published"):
                        assert req.decode_transfer_target is not None  # checked by `add`
                        tok = req.input_ids[0]
                        kv = RoomKV(tok, mock_logprob(tok, 0), self.cp_size, req.rid)
                        self.rooms.publish(req.decode_transfer_target, room, kv)
                        state["published"] = True
                    if waited < self.rooms.prefill_delay + after:
                        return False
                return error(f"room {room}: the CP prefill step failed")
            return True
        if i > 0:
            return True
        assert self.transfer_target is not None
        kv = self.rooms.get(self.transfer_target, room)
        if kv is None:
            if waited > self.rooms.wait_s:
                return error(f"room {room}: timed out waiting for the KV")
            return False
        if isinstance(kv, str):
            return error(f"room {room}: {kv}")
        if kv.cp_size != req.bootstrap_cp_size:
            return error(
                f"room {room}: the KV came from a CP {kv.cp_size} prefill, the request says "
                f"bootstrap_cp_size {req.bootstrap_cp_size}"
            )
        return kv

    def _stop_token(self, req: GenerateRequest, out: Sequence[int]) -> bool:
        """Whether `out` ends on a stop token that stops it. Not before `min_new_tokens`:
        the real engines never draw one there; the mock's echoed token stays an ordinary
        output token."""
        sp, tok = req.sampling, out[-1]
        is_stop = tok in sp.stop_token_ids or (tok == self.eos_id and not sp.ignore_eos)
        return is_stop and len(out) > sp.min_new_tokens

    def finish_reason(self, req: GenerateRequest, out: Sequence[int]) -> FinishReason | None:
        """Why the output `out` of `req` ends here, or None to go on."""
        sp = req.sampling
        if self._stop_token(req, out):
            return "stop"
        if sp.stop and self._tok is not None:
            text = self._tok.decode(list(out))
            if any(s in text for s in sp.stop):
                return "stop"
        if self.mode == "prefill" or len(out) >= sp.max_new_tokens:
            return "length"  # a prefill server's only output is the first token
        return None
