"""How a request's prompt KV gets into the decode engine's pool: the engine's intakes.

`DecodeEngine` runs the batch (decode steps, draws, stop checks, chunks) the same way
whatever the server mode; what differs is how an admitted request gets its prompt's KV
and its first token, and that is an `Intake`:

- `LocalPrefill` (a unified server with `--disable-radix-cache`): the engine admits the
  head of the wait queue, its pages are allocated, and its prompt is prefilled whole in
  one step, or over several with `--chunked-prefill-size` (on a DP mesh, one request
  per rank in one step); a request asking for prompt log-probs is prefilled by the
  steps' scoring twins, which score every fed token against the next prompt token (a
  speculative engine's too: its admission program's twin);
- `TransferIntake` (a PD decode server): an admitted request's pages are registered as
  a transfer room with the receiver, which the prefill server's ranks write into; the
  room's success carries the first token, its failure fails the request;
- `serving.decode.cached.CachedPrefill` (the unified server's default): the CP prefill
  scheduler at cp 1 with the radix prefix cache (and the host cache) prefills;
- `serving.decode.dp_prefix.DPPrefixPrefill` (the unified default on a DP mesh): as
  `LocalPrefill`, from a prefix cache per rank.

An intake drives its engine through the engine's admission and production methods
(`queue`, `fits_now` / `rank_for`, `admit`, `start`, `produce` / `sample`, `fail` /
`end`, `step_failed`, `free_pages`), and the engine asks it only what `Intake` lists;
neither branches on the other's kind.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import CpkvError
from cpkv_jax.paging import pages_for_tokens
from cpkv_jax.scores import PromptScores
from serving.decode.request import DecodeRequest
from serving.engine.api import EngineStats, GenerateRequest, ServerMode, prompt_scores
from serving.engine.step_failures import step_failure

if TYPE_CHECKING:
    from serving.decode.engine import DecodeEngine, Touched

logger = logging.getLogger(__name__)

# Room states as `transfer.protocol.RoomState` names them: compared by name so this
# module needs neither the transfer receiver nor its generated protobuf code.
_ROOM_SUCCESS = "SUCCESS"
_ROOM_FAILED = "FAILED"


def check_prompt_logprobs_from(engine: DecodeEngine, req: GenerateRequest) -> None:
    """Refuse a `logprob_start_len` outside the prompt (400)."""
    start = req.prompt_logprobs_from
    if start is not None and not 0 <= start < len(req.input_ids):
        raise engine.reject(
            "prompt_logprobs",
            f"logprob_start_len {start} is outside the prompt's {len(req.input_ids)} "
            f"tokens [0, {len(req.input_ids)})",
        )


@runtime_checkable
class Intake(Protocol):
    """What the engine asks of an intake (see the module docstring)."""

    mode: ServerMode
    # Whether the engine's own steps prefill (their prefill shapes are reachable).
    prefills_with_engine_steps: bool
    # Whether a first token is drawn from a host logit row (its sampler program is warmed).
    first_token_on_host: bool
    # Prompt tokens its engine-step prefills feed at most a step (None: whole prompts).
    prefill_chunk: int | None

    # PD transfer counters (0 without transfers): failed rooms, KV bytes received.
    failures: int
    bytes_received: int

    def bind(self, engine: DecodeEngine) -> None: ...

    def counts(self) -> tuple[int, int]:
        """Requests this intake holds as (waiting, running) in the engine's stats."""
        ...

    def validate(self, req: GenerateRequest) -> None:
        """Refuse (`InputError` via `engine.reject`) what this intake cannot serve."""
        ...

    def add(self, r: DecodeRequest) -> bool:
        """Take `r` at once (nobody waits before it and it fits); False: the engine queues
        it. An error here is the caller's (nothing held)."""
        ...

    def advance(self, touched: Touched, idle: bool) -> None:
        """Before the decode step: move queued requests on and bring in the KV of
        admitted ones (`idle`: nothing else happens this step, so it may wait a little)."""
        ...

    def lookup(self, rid: str) -> DecodeRequest | None: ...

    def in_flight(self) -> Iterable[DecodeRequest]:
        """Requests admitted and not decoding yet."""
        ...

    def discard(self, r: DecodeRequest, why: str) -> bool:
        """Stop bringing `r` in and free what it holds; False when it was not here."""
        ...

    def release(self, r: DecodeRequest) -> None:
        """Free a decoding (or finished) request's pages."""
        ...

    def stats(self, base: EngineStats) -> EngineStats: ...


class LocalPrefill:
    """Prompt prefill by the engine's own steps (see the module docstring).

    `chunk` (`--chunked-prefill-size`, whole pages; None: whole prompts): a prompt
    longer than that is prefilled over several steps, `chunk` tokens each, the decode
    step of the running requests between every two, so a long prompt delays them by at
    most one chunk's step. A rank prefills one request at a time; the admitted request
    holds all its pages from the start and counts as running (`in_flight`)."""

    mode: ServerMode = "null"
    prefills_with_engine_steps = True
    first_token_on_host = True  # a unified server warms the one-row draw as before
    failures = 0
    bytes_received = 0

    def __init__(self, chunk: int | None = None):
        if chunk is not None and chunk < 1:
            raise ValueError(f"a prefill chunk must be >= 1 token, got {chunk}")
        self.prefill_chunk = chunk
        # Admitted requests whose prefill has not reached the prompt's end, one per rank.
        self.prefilling: dict[str, DecodeRequest] = {}

    def bind(self, engine: DecodeEngine) -> None:
        self.engine = engine

    def counts(self) -> tuple[int, int]:
        return 0, len(self.prefilling)  # prefilling requests count as running

    def validate(self, req: GenerateRequest) -> None:
        check_prompt_logprobs_from(self.engine, req)

    def add(self, r: DecodeRequest) -> bool:
        return False

    def advance(self, touched: Touched, idle: bool) -> None:
        """Admit queue heads in order while a rank not prefilling can take the next,
        then run one prefill step: every prefilling request's next chunk (each rank its
        own), the first tokens of those whose prompt it ends."""
        e = self.engine
        busy = {q.rank for q in self.prefilling.values()}
        while (r := e.queue.head()) is not None and len(busy) < e.dp_size:
            rank = self._rank_for(r, busy)
            if rank is None or not e.penalty_slot_free(r):
                break  # FIFO: nobody overtakes the head
            self._admit(r, rank)
            e.queue.pop(r.rid)
            if r.req.prompt_logprobs_from is not None:  # its prefill steps score the prompt
                r.scoring = PromptScores(len(r.prompt))
            self.prefilling[r.rid] = r
            busy.add(rank)
        if not self.prefilling:
            return
        ends = {rid: self._chunk_end(q) for rid, q in self.prefilling.items()}
        # Requests whose prompt this step ends lead the step: their logit rows come first.
        batch = sorted(self.prefilling.values(), key=lambda q: ends[q.rid] < len(q.prompt))
        try:
            picks = e.first_tokens(batch, [ends[q.rid] for q in batch])
        except Exception as exc:
            e.step_failed("the prefill step", exc, batch, touched)
            return
        done = batch[: len(picks)]
        for q in batch[len(picks) :]:
            q.prefill_from = ends[q.rid]
        for q in done:
            del self.prefilling[q.rid]
            if q.scoring is not None:  # sent with its first token's chunk
                scored = q.scoring.result(q.req.prompt_logprobs_from or 0)
                q.prompt_scores, q.scoring = prompt_scores(scored, q.req.top_logprobs), None
            e.start(q)
        self._prefilled(done)
        for q, pick in zip(done, picks, strict=True):  # a failed draw fails that request alone
            e.produce(q, touched, pick)

    def _chunk_end(self, r: DecodeRequest) -> int:
        """Where `r`'s next prefill step stops: a chunk on, or the prompt's end."""
        if self.prefill_chunk is None:
            return len(r.prompt)
        return min(len(r.prompt), r.prefill_from + self.prefill_chunk)

    def _rank_for(self, r: DecodeRequest, busy: set[int]) -> int | None:
        """The rank `r` goes to now, or None; a rank in `busy` is prefilling (it takes
        the next request once that prefill is done: one per rank)."""
        rank = self.engine.rank_for(r)
        return None if rank in busy else rank

    def _admit(self, r: DecodeRequest, rank: int) -> None:
        self.engine.admit(r, rank)

    def _prefilled(self, done: list[DecodeRequest]) -> None:
        """After the prefill step that ended the prompts of `done` (their first tokens
        not drawn yet)."""

    def lookup(self, rid: str) -> DecodeRequest | None:
        return self.prefilling.get(rid)

    def in_flight(self) -> Iterable[DecodeRequest]:
        return self.prefilling.values()

    def discard(self, r: DecodeRequest, why: str) -> bool:
        """A request still prefilling: its pages back (its chunks' KV is never read)."""
        if self.prefilling.pop(r.rid, None) is None:
            return False
        self.release(r)
        return True

    def release(self, r: DecodeRequest) -> None:
        self.engine.free_pages(r)

    def stats(self, base: EngineStats) -> EngineStats:
        return base


@runtime_checkable
class TransferRooms(Protocol):
    """The receiver side of PD transfer the decode mode needs (`Receiver` has it)."""

    def register_room(self, room: str, dst_pages: Any, num_tokens: int, cp_size: int) -> Any: ...

    def status(self, room: str) -> Any: ...

    def abort(self, room: str, reason: str, sender_rank: int | None = None) -> Any: ...

    def staging_refusal(self, n_pages: int) -> str | None: ...

    def wait_for_change(self, timeout: float) -> None: ...


class TransferIntake:
    """Prompt KV through PD transfer rooms (see the module docstring).

    A request waits in the engine's bounded FIFO queue until its pages and a batch slot
    are free, then its pages are allocated and its room registered with the receiver (at
    once in `add` when it fits; else by a later step, in arrival order). The prefill
    side's handshake waits for the room, and the prefill server prefills a request only
    once every rank's handshake is accepted, so a request queued here holds no prefill
    pages. Each step polls the rooms without blocking (with nothing else to do, it waits
    up to `idle_wait_s` for a room to change)."""

    mode: ServerMode = "decode"
    prefills_with_engine_steps = False
    first_token_on_host = False
    prefill_chunk = None

    def __init__(self, rooms: TransferRooms, idle_wait_s: float):
        self.rooms = rooms
        self.idle_wait_s = idle_wait_s
        self._transferring: dict[str, DecodeRequest] = {}  # admitted, waiting for KV
        self.failures = 0
        self.bytes_received = 0  # KV pages of successful rooms

    def bind(self, engine: DecodeEngine) -> None:
        self.engine = engine

    def counts(self) -> tuple[int, int]:
        return len(self._transferring), 0  # admitted, still waiting for their KV

    def validate(self, req: GenerateRequest) -> None:
        e = self.engine
        check_prompt_logprobs_from(e, req)  # the prefill server scores, the aux brings them
        if not req.bootstrap_room or req.bootstrap_cp_size is None or req.bootstrap_cp_size < 1:
            raise e.reject(
                "no_room",
                f"request {req.rid!r}: a decode server needs bootstrap_room and "
                f"bootstrap_cp_size >= 1 (got {req.bootstrap_room!r}, "
                f"{req.bootstrap_cp_size!r}); send it through the router",
            )
        # The prompt's pages stage whole on the way in.
        why = self.rooms.staging_refusal(pages_for_tokens(len(req.input_ids), e.page_size))
        if why is not None:
            raise e.reject("staging_capacity", f"request {req.rid!r}: {why}")

    def add(self, r: DecodeRequest) -> bool:
        e = self.engine
        if e.queue or not e.fits_now(r):
            return False
        self._register(r)  # its errors are the caller's (400)
        return True

    def advance(self, touched: Touched, idle: bool) -> None:
        self._register_queued(touched)
        self._poll(touched)
        if idle and not touched:
            # Only transfers in flight: sleep until a room changes, not spin.
            self.rooms.wait_for_change(self.idle_wait_s)
            self._poll(touched)

    def _register_queued(self, touched: Touched) -> None:
        """Register the rooms of queued requests, in arrival order, while they fit."""
        e = self.engine
        while (r := e.queue.head()) is not None and e.fits_now(r):
            e.queue.pop(r.rid)
            try:
                self._register(r)
            except CpkvError as exc:  # e.g. the room id is taken: this request fails alone
                e.fail(r, str(exc), touched)
            except Exception as exc:  # a bug: still this request's alone (its pages are back)
                logger.exception(
                    "request %s: registering room %s failed", r.rid, r.req.bootstrap_room
                )
                e.end(r, step_failure("registering its transfer room", exc), touched)

    def _register(self, r: DecodeRequest) -> None:
        e = self.engine
        rank = e.rank_for(r)
        assert rank is not None, "register only what fits now"
        e.admit(r, rank)
        try:
            self.rooms.register_room(
                r.req.bootstrap_room, r.pages, len(r.prompt), r.req.bootstrap_cp_size
            )
        except CpkvError as exc:
            e.free_pages(r)
            raise e.reject("bad_room", f"request {r.rid!r}: {exc}") from exc
        except BaseException:
            e.free_pages(r)
            raise
        self._transferring[r.rid] = r

    def _poll(self, touched: Touched) -> None:
        e = self.engine
        for rid, r in list(self._transferring.items()):
            room = r.req.bootstrap_room
            try:
                snap = self.rooms.status(room)
            except CpkvError as exc:  # the room is gone: nobody can say who owns its pages
                self._transferring.pop(rid)
                logger.error("request %s: room %s status failed: %s", rid, room, exc)
                r.pages = None
                self.failures += 1
                e.fail(r, f"KV transfer state lost: {exc}", touched)
                continue
            state = snap.state.name
            if state == _ROOM_FAILED:
                self._transferring.pop(rid)
                r.pages = None  # the receiver freed the failed room's pages (`_retire`)
                self.failures += 1
                e.fail(r, f"KV transfer failed: {snap.reason}", touched)
            elif state == _ROOM_SUCCESS:
                self._transferring.pop(rid)
                aux = snap.aux
                if aux is None:
                    e.free_pages(r)
                    e.fail(r, "KV transfer succeeded without the first token", touched)
                    continue
                if r.req.prompt_logprobs_from is not None and aux.prompt_scores is None:
                    e.free_pages(r)
                    e.fail(r, "the prefill server sent no prompt log-probs", touched)
                    continue
                e.start(r)
                r.cached_tokens, r.host_cached_tokens = aux.cached_tokens, aux.host_cached_tokens
                if aux.prompt_scores is not None:  # sent with the first token's chunk
                    r.prompt_scores = prompt_scores(aux.prompt_scores, r.req.top_logprobs)
                n_prompt_pages = pages_for_tokens(len(r.prompt), e.page_size)
                self.bytes_received += n_prompt_pages * e.bytes_per_page
                first = (int(aux.first_token), aux.logprob, aux.top)
                if e.spec is None:
                    e.produce(r, touched, lambda first=first: first)
                elif (why := _hidden_refusal(hidden := aux.hidden_state(), e.cfg)) is not None:
                    e.discard(r, why)
                    e.fail(r, why, touched)
                else:  # its drafts start from the prefill's last hidden state
                    e.draft_from_token(r, first, hidden, touched)

    def lookup(self, rid: str) -> DecodeRequest | None:
        return self._transferring.get(rid)

    def in_flight(self) -> Iterable[DecodeRequest]:
        return self._transferring.values()

    def discard(self, r: DecodeRequest, why: str) -> bool:
        """Abort `r`'s room; the receiver frees its pages unless its KV already arrived."""
        if self._transferring.pop(r.rid, None) is None:
            return False
        assert r.pages is not None
        try:
            snap = self.rooms.abort(r.req.bootstrap_room, why)
        except CpkvError as exc:  # the room is gone: who owns its pages is unknown
            logger.error(
                "request %s: abort of room %s failed: %s", r.rid, r.req.bootstrap_room, exc
            )
        else:
            if snap.state.name == _ROOM_SUCCESS:
                self.engine.kv.free_pages(r.pages)  # KV arrived before the abort: ours to free
        r.pages = None  # a failed room's pages went back with the room
        return True

    def release(self, r: DecodeRequest) -> None:
        self.engine.free_pages(r)

    def stats(self, base: EngineStats) -> EngineStats:
        return base


def _hidden_refusal(hidden: np.ndarray | None, cfg: ModelConfig) -> str | None:
    """Why a speculative decode server cannot draft from a room's aux hidden state (the
    trunk's final hidden state at the prompt's last position), or None."""
    if hidden is None:
        return (
            "this decode server drafts with the MTP layer (--speculative-algorithm), and the "
            "prefill server sent no hidden state to draft from: start it with the same "
            "--speculative-algorithm flags"
        )
    if hidden.shape != (cfg.hidden_size,):
        return (
            f"the prefill server's hidden state has {hidden.size} values, not hidden_size="
            f"{cfg.hidden_size}: the two servers run different models"
        )
    return None
