"""Helpers shared by the PD transfer tests (tests/transfer; tests/serving uses a few).

- Constants of the tiny-model transfers: page size, CP size, index K dtype, prompt
  lengths, decode-side timeouts, the gRPC sender's config.
- Receiver core: a fake clock, random page bytes, the decode pool's bytes at pages.
- End to end: `Prefill` (the CP shared-KV prefill of the tiny model on 8 virtual
  devices, two requests prefilled and held) and `Decode` (a receiver served on
  loopback), `run_transfer` between them, and checks that the decode-side layout equals
  the prefill full view bitwise and decodes like the single-device reference.

The fixtures built from these are in tests/transfer/conftest.py; fault plans and the
randomized runs' helpers in `support.transfer_faults`, Mooncake's in `support.mooncake`.
"""

from __future__ import annotations

import dataclasses

import grpc
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpkv_jax.buckets import pow2_at_least
from cpkv_jax.config import CPConfig, ModelConfig
from cpkv_jax.cp_prefill import CPPrefillRunner
from cpkv_jax.generate import ReferenceGenerator
from cpkv_jax.lane_allocator import RequestPageTable
from cpkv_jax.mesh import make_cp_mesh
from cpkv_jax.model.forward_batch import ForwardBatch
from cpkv_jax.model.kv_cache import KVPool
from cpkv_jax.model.transformer import CausalLM, forward_step
from cpkv_jax.paging import padded_page_table, pages_for_tokens, slots_for_positions
from transfer.backends.grpc_backend import GrpcBackend, GrpcBackendConfig
from transfer.hold import TransferHold
from transfer.page_plan import LayoutDescriptor, RankPlan
from transfer.page_source import CPPoolPageSource, HostPoolPageSource, PageSource
from transfer.proto import kv_transfer_pb2 as pb
from transfer.protocol import Aux, RoomSnapshot, TransferTimeouts, kind_from_pb
from transfer.receiver import Receiver
from transfer.sender import rank_jobs, send_request

P = 16
CP = 8
INDEX_K = "fp8_e4m3"
LENGTHS = (5 * P, 5 * P + 3)  # a page multiple and one with a partial tail page
# Decode-side timeouts (s): short, so faults resolve fast; the heartbeat limit (20 beats)
# leaves room for GIL and compile stalls on 2 cores.
TIMEOUTS = TransferTimeouts(bootstrap=5.0, waiting=5.0, heartbeat=2.0, heartbeat_interval=0.1)
# The senders' control plane in every transfer test, both backends: fast beats, a 5 s
# loss deadline (2 s was cut by a 2.2 s stall in a loaded suite, after a room had
# succeeded), and quick retries.
CONTROL: dict[str, float | int] = dict(
    rpc_timeout_s=10.0,
    max_retries=2,
    retry_backoff_s=0.02,
    heartbeat_interval_s=0.1,
    heartbeat_timeout_s=5.0,
    bootstrap_timeout_s=3.0,
)
SENDER = GrpcBackendConfig(
    chunk_bytes=4096,  # small, so streams carry several chunks (tiny-model pages are KiBs)
    channels_per_rank=2,
    **CONTROL,
)
WAIT = 30.0  # upper bound on any single transfer here; never reached when green


# ---- receiver core ---------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def random_pages(layout: LayoutDescriptor, n_pages: int, seed: int) -> list[np.ndarray]:
    """Random page bytes `[n_pages, page_bytes]` per buffer, finite in every dtype."""
    rng = np.random.default_rng(seed)
    out = []
    for kind, layer in layout.buffers():
        nb = layout.page_bytes(kind, layer)
        dt = {"latent": layout.latent_dtype, "index_k": layout.index_k_dtype}.get(kind, "float32")
        vals = rng.uniform(-2, 2, size=(n_pages, nb // np.dtype(dt).itemsize)).astype(dt)
        out.append(vals.view(np.uint8).reshape(n_pages, nb))
    return out


def decode_pages(rx: Receiver, dst: np.ndarray) -> list[np.ndarray]:
    """The decode pool's bytes at `dst`, per buffer (layout order), `[n, page_bytes]`."""
    pool = rx.pool
    out = []
    for kind, layer in rx.layout.buffers():
        leaf = np.asarray(getattr(pool, kind)[rx.layout.leaf_index(kind, layer)])
        out.append(leaf[dst].reshape(len(dst), -1).view(np.uint8))
    return out


def section_spans(
    msg: pb.PageChunk, layout: LayoutDescriptor
) -> list[tuple[pb.PageSection, int, int]]:
    """(section, first byte, end) of each section of a chunk in its `data`."""
    out, lo = [], 0
    for section in msg.sections:
        hi = lo + len(section.positions) * layout.page_bytes(
            kind_from_pb(section.kind), section.layer
        )
        out.append((section, lo, hi))
        lo = hi
    assert lo == len(msg.data)
    return out


def with_positions(plan: RankPlan, positions: list[int], src: list[int]) -> RankPlan:
    return dataclasses.replace(
        plan,
        positions=np.asarray(positions, np.int64),
        src_pages=np.asarray(src, np.int64),
        dst_pages=np.zeros(len(positions), np.int64),
    )


# ---- end to end: the CP prefill, the decode side, a transfer between them --------------------


@dataclasses.dataclass
class Prefill:
    cfg: ModelConfig
    model: CausalLM
    runner: CPPrefillRunner
    layout: LayoutDescriptor
    prompts: list[np.ndarray]
    tables: list[RequestPageTable]
    aux: list[Aux]


def make_cp_runner(cfg: ModelConfig) -> tuple[CausalLM, CPPrefillRunner]:
    """The tiny model (seed 0) with its MTP layer and its CP 8 shared-KV prefill runner,
    8 pages per rank, drafting: it runs the MTP layer over the prompts (the MTP layer's
    KV is one more layer of the pool and the transfer layout) and keeps their last hidden
    states, as a PD prefill server for speculative decoding does (issue 39)."""
    model = CausalLM(cfg, rngs=nnx.Rngs(0), mtp=True)
    cp = CPConfig(cp_size=CP, shared_kv=True, page_size=P)
    runner = CPPrefillRunner(
        cfg, model, make_cp_mesh(CP), cp, pages_per_rank=8, index_k_dtype=INDEX_K, mtp=True
    )
    return model, runner


def prefill_requests(
    cfg: ModelConfig, layout: LayoutDescriptor, model: CausalLM, runner: CPPrefillRunner
) -> Prefill:
    """Prefill prompts of `LENGTHS` tokens (held: `Prefill.tables`, with their first
    token and log-prob) and one of 300 tokens, released at once: it only fills pages
    with real KV for the fault tests."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).astype(np.int32) for n in (*LENGTHS, 300)]
    result = runner.prefill(prompts)
    runner.release(result.tables[2])  # only fills pages with real KV for the fault tests
    logp = jax.nn.log_softmax(jnp.asarray(result.last_logits), axis=-1)
    hidden = runner.last_hidden  # one unchunked step: a row per prompt
    assert hidden is not None and len(hidden) >= len(prompts)
    aux = []
    for i in range(2):
        tok = int(np.argmax(result.last_logits[i]))
        aux.append(Aux.with_hidden(hidden[i], first_token=tok, logprob=float(logp[i, tok])))
    return Prefill(cfg, model, runner, layout, prompts[:2], result.tables[:2], aux)


@dataclasses.dataclass
class Decode:
    receiver: Receiver
    server: grpc.Server
    target: str
    free0: int


def run_transfer(
    pre: Prefill,
    dec: Decode,
    table: RequestPageTable,
    room: str,
    aux: Aux,
    *,
    backend: GrpcBackend | None = None,
    layout: LayoutDescriptor | None = None,
    extra_pages: int = 0,
    seed: int = 0,
    sources: list[PageSource] | None = None,
) -> tuple[TransferHold, np.ndarray]:
    """Register the room at shuffled decode pages and send it from all 8 ranks (from
    the CP pool, or from `sources`)."""
    n_pages = table.num_pages
    rng = np.random.default_rng(seed)
    dst = dec.receiver.allocate_pages(n_pages + extra_pages)
    dst[:n_pages] = rng.permutation(dst[:n_pages])  # non-contiguous, out of order
    dec.receiver.register_room(room, dst, table.num_tokens, CP)
    if sources is None:
        sources = [CPPoolPageSource(lambda: pre.runner.pool, pre.layout, r) for r in range(CP)]
    jobs = rank_jobs(
        room, dec.target, layout or pre.layout, table.num_tokens, table.local_pages(), sources, aux
    )
    hold = send_request(backend or GrpcBackend(SENDER), jobs, lambda _: pre.runner.release(table))
    return hold, dst


def new_table(pre: Prefill, num_tokens: int) -> RequestPageTable:
    table = RequestPageTable(CP)
    table.extend(pre.runner.allocator, num_tokens, P)
    return table


def prefill_free(pre: Prefill) -> int:
    return int(pre.runner.allocator.num_free_per_lane().sum())


def finish(hold: TransferHold) -> RoomSnapshot:
    outcome = hold.wait(WAIT)
    assert hold.released, "the prefill hold was never released"
    assert outcome is not None
    return outcome


def settle(rx: Receiver, room: str) -> RoomSnapshot:
    return rx.wait(room, WAIT)


def host_pool_sources(pre: Prefill, seed: int) -> list[HostPoolPageSource]:
    """Per rank, a host KV pool shaped like its CP pool shard, of fresh random bytes."""
    rng = np.random.default_rng(seed)
    pages = pre.runner.pool.latent[0].shape[0] // CP
    out = []
    for _ in range(CP):
        leaves = {
            (kind, layer): rng.integers(
                0, 256, (pages, pre.layout.page_bytes(kind, layer)), np.uint8
            )
            for kind, layer in pre.layout.buffers()
        }
        out.append(HostPoolPageSource(pre.layout, leaves))
    return out


def expected_pages(
    sources: list[HostPoolPageSource], layout: LayoutDescriptor, table: RequestPageTable
) -> list[np.ndarray]:
    """The request's pages from host pools, per buffer `[n_pages, page_bytes]` by
    position (position p lives on rank p mod cp at its local page)."""
    local = table.local_pages()
    owner = np.arange(table.num_pages) % CP
    return [
        np.stack(
            [
                sources[int(r)].read(kind, layer, np.array([int(q)])).reshape(-1).view(np.uint8)
                for r, q in zip(owner, local, strict=True)
            ]
        )
        for kind, layer in layout.buffers()
    ]


# ---- checks of the decode side ---------------------------------------------------------------


def decode_layout(rx: Receiver, dst: np.ndarray, num_tokens: int) -> KVPool:
    """The decode pool gathered by the request's page table: leaves `[num_tokens, ...]`."""
    n = pages_for_tokens(num_tokens, P)
    pages = jnp.asarray(dst[:n])

    def gather(leaf):
        rows = jnp.take(leaf, pages, axis=0)
        return rows.reshape((n * P, *leaf.shape[2:]))[:num_tokens]

    return jax.tree_util.tree_map(gather, rx.pool)


def assert_decode_layout_is(rx: Receiver, dst: np.ndarray, view: KVPool, *where) -> None:
    """The decode pool gathered by `dst` equals the prefill full view `view` bitwise
    (`where`: context for the failure message)."""
    num_tokens = jax.tree_util.tree_leaves(view)[0].shape[0]
    got = decode_layout(rx, dst, num_tokens)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(view), strict=True):
        assert bitwise_equal(x, y), where


def greedy_decode(
    pre: Prefill, rx: Receiver, pages: np.ndarray, prompt_len: int, aux: Aux, steps: int
):
    """Decode `steps` tokens from the transferred pool, as `ReferenceGenerator` does."""
    graphdef, state = nnx.split(pre.model)
    row = padded_page_table(pages, pow2_at_least(len(pages)))
    ids, lps = [aux.first_token], [aux.logprob]
    for i in range(steps - 1):
        pos = prompt_len + i
        batch = ForwardBatch(
            input_ids=jnp.asarray([[ids[-1]]], jnp.int32),
            positions=jnp.asarray([[pos]], jnp.int32),
            valid=jnp.ones((1, 1), bool),
            write_slots=jnp.asarray(slots_for_positions(row, np.asarray([pos]), P)[None]),
            page_table=jnp.asarray(row[None]),
            kv_lens=jnp.asarray([pos + 1], jnp.int32),
        )

        def step(pool, batch=batch):
            return forward_step(
                graphdef, state, batch, pool, index_k_dtype=INDEX_K, form="absorbed"
            )

        logits = rx.update_pool(step)
        logp = np.asarray(jax.nn.log_softmax(logits[0]))
        ids.append(int(np.argmax(logp)))
        lps.append(float(logp[ids[-1]]))
    return ids, lps


def assert_decodes_like_reference(pre, rx: Receiver, dst, prompt, view, aux, steps) -> None:
    """The decode pool's layout equals the prefill full view bitwise, and decoding from it
    gives the single-device reference's greedy tokens (log-probs within 1e-5)."""
    n = len(prompt)
    assert_decode_layout_is(rx, dst, view)
    ids, lps = greedy_decode(pre, rx, dst, n, aux, steps)
    ref = ReferenceGenerator(pre.cfg, pre.model, page_size=P, index_k_dtype=INDEX_K).generate(
        prompt.tolist(), steps, ignore_eos=True
    )
    assert ids == ref.output_ids
    np.testing.assert_allclose(lps, ref.output_logprobs, atol=1e-5)


def bitwise_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
