"""Fixtures of the PD transfer tests; their helpers are in tests/support/transfer.py and
tests/support/mooncake.py.

Built once per session, as they are costly and every user leaves them as it found them:
the CP prefill runner (building it and its first prefill compile, several seconds on 2
cores), the Mooncake receiver endpoint and sender engine (closing each takes ~1 s).
Every test that sends from the runner checks `prefill_free` is back at its start, and
every Mooncake decode side starts by checking the staging arena is entirely free. Each
module gets its own `prefill` (two requests prefilled and held on the shared runner), as
the end-to-end tests send, and so release, those.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax.numpy as jnp
import pytest
from support.mooncake import ARENA_BYTES, AVAILABLE, CONFIG, QUARANTINE_S, REASON, MooncakeDecode
from support.transfer import (
    INDEX_K,
    TIMEOUTS,
    Decode,
    P,
    Prefill,
    make_cp_runner,
    prefill_requests,
)

from cpkv_jax.config import ModelConfig
from cpkv_jax.cp_prefill import CPPrefillRunner
from cpkv_jax.decode_mesh import DPPoolLayout, init_dp_pool
from cpkv_jax.mesh import make_dp_mesh
from cpkv_jax.model.kv_cache import init_pool
from cpkv_jax.model.mtp import mtp_config
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.paging import PageAllocator
from cpkv_jax.tools.tiny_config import tiny_config_dict
from transfer.backends.mooncake_backend import MooncakeBackend, MooncakeReceiverEndpoint
from transfer.backends.mooncake_engine import MooncakeEngine
from transfer.backends.mooncake_sender import MooncakeSenderFaults
from transfer.page_plan import LayoutDescriptor
from transfer.receiver import Receiver, serve


@pytest.fixture(scope="session")
def cfg() -> ModelConfig:
    return ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))


@pytest.fixture(scope="session")
def pool_cfg(cfg) -> ModelConfig:
    """The config the pools of both sides are laid out for: a drafting PD pair's
    (speculative decoding, issue 39), whose MTP layer's KV is one more layer, so every
    transfer and fault test here moves those buffers too."""
    return mtp_config(cfg)


@pytest.fixture(scope="session")
def layout(pool_cfg) -> LayoutDescriptor:
    return LayoutDescriptor.from_model(pool_cfg, P, "float32", INDEX_K)


@pytest.fixture(scope="session")
def cp_runner(cfg) -> tuple[CausalLM, CPPrefillRunner]:
    """The tiny model and its CP prefill runner, shared by every module's `prefill`."""
    return make_cp_runner(cfg)


@pytest.fixture(scope="module")
def prefill(cfg, layout, cp_runner) -> Iterator[Prefill]:
    """Two requests prefilled and held on the session's runner (`Prefill.tables`);
    released at the end of the module unless a test sent them."""
    pre = prefill_requests(cfg, layout, *cp_runner)
    yield pre
    for table in pre.tables:
        pre.runner.release(table)  # a no-op for a table a transfer released


@pytest.fixture
def decode(pool_cfg, layout):
    """A receiver on loopback; `Decode.server` may be stopped by a test."""

    def make(pages: int, dp: int = 1) -> Decode:
        """`dp > 1`: a data-parallel decode pool, `pages` per rank (issue 36)."""
        if dp == 1:
            pool = init_pool(pool_cfg, pages, P, jnp.float32, INDEX_K)
        else:
            pool = init_dp_pool(
                pool_cfg, DPPoolLayout(dp, pages, P), make_dp_mesh(dp), jnp.float32, INDEX_K
            )
        allocator = PageAllocator(dp * pages, ranks=dp)
        rx = Receiver(layout, pool, allocator, timeouts=TIMEOUTS).start(interval=0.02)
        server, port = serve(rx)
        made.append(Decode(rx, server, f"127.0.0.1:{port}", rx.num_free_pages))
        return made[-1]

    made: list[Decode] = []
    yield make
    for d in made:
        d.server.stop(0)
        d.receiver.close()


# ---- Mooncake --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def endpoint():
    if not AVAILABLE:
        pytest.skip(f"Mooncake Transfer Engine unavailable: {REASON}")
    ep = MooncakeReceiverEndpoint(
        ARENA_BYTES, quarantine_timeout_s=QUARANTINE_S, transfer_timeout_s=5.0
    )
    yield ep
    ep.close()


@pytest.fixture(scope="session")
def sender_engine():
    if not AVAILABLE:
        pytest.skip(f"Mooncake Transfer Engine unavailable: {REASON}")
    engine = MooncakeEngine(transfer_timeout_s=5.0)
    yield engine
    engine.close()


@pytest.fixture
def mooncake_decode(pool_cfg, layout, endpoint):
    """A receiver with the session's Mooncake endpoint, served on loopback."""

    def make(pages: int) -> MooncakeDecode:
        pool = init_pool(pool_cfg, pages, P, jnp.float32, INDEX_K)
        rx = Receiver(
            layout, pool, PageAllocator(pages), timeouts=TIMEOUTS, mooncake=endpoint
        ).start(interval=0.02)
        server, port = serve(rx)
        made.append(
            MooncakeDecode(rx, server, f"127.0.0.1:{port}", rx.num_free_pages, endpoint.arena)
        )
        return made[-1]

    made: list[MooncakeDecode] = []
    assert endpoint.arena.free_bytes == endpoint.arena.nbytes
    yield make
    for d in made:
        d.server.stop(0)
        d.receiver.close()


@pytest.fixture
def backends(sender_engine):
    """`make(faults)`: a Mooncake backend on the session's sender engine."""
    made: list[MooncakeBackend] = []

    def make(faults: MooncakeSenderFaults | None = None) -> MooncakeBackend:
        made.append(MooncakeBackend(CONFIG, faults, engine=sender_engine))
        return made[-1]

    yield make
    for b in made:
        b.close()
