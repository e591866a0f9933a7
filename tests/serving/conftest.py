"""Fixtures shared by the tests of one serving part, split over several files.

- router (test_router_*.py): `pd_deployment`, `deployment` (`support.router_fakes`);
- HTTP API (test_http_*.py): `tokenizer_dir`, `tok`, `srv`, `bare` (`support.http_client`);
- ServerArgs (test_server_args_*.py): `tiny_config_dir`;
- buffer estimator (test_buffer_estimator*.py): `cfg`, `mesh`, `estimator`.
- PD prefill server (test_prefill_server_*.py): `tiny_checkpoint` (session-scoped).
- CP mesh servers (test_unified_cp.py, test_pd_cp_decode.py, test_speculative_cp.py):
  `cp_checkpoint` (session-scoped).

Module-scoped fixtures are built once per test file that uses them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from support.buffer_estimator_cases import CP, cpu_estimator
from support.http_client import CONTEXT, start_server, stop_server
from support.router_fakes import (
    KV_WAIT_S,
    PREFILL_CP,
    Deployment,
    MockPD,
    Served,
    router_config,
    wait_until,
)

from cpkv_jax.config import ModelConfig
from cpkv_jax.mesh import make_cp_mesh
from cpkv_jax.model.weights import load_model
from cpkv_jax.tokenizer import Tokenizer, load_tokenizer
from cpkv_jax.tools.make_tiny_checkpoint import write_tokenizer_files
from cpkv_jax.tools.tiny_config import tiny_config_dict
from serving.engine.mock import MockRooms
from serving.http.chat_template import load_chat_template
from serving.prefill.buffer_estimator import BufferEstimator
from serving.router import build_router_app

# ---- router: a PD deployment of mock servers ------------------------------------------------


@pytest.fixture(scope="module")
def pd_deployment(tokenizer_dir, tok) -> Iterator[Deployment]:
    """Two prefill (CP 8 and 4) and two decode servers (the real app over `MockEngine`s
    sharing one `MockRooms`) behind one router."""
    rooms = MockRooms(wait_s=KV_WAIT_S)
    template = load_chat_template(tokenizer_dir)
    common = {"tokenizer": tok, "chat_template": template}
    prefill = [MockPD(f"p{i}", rooms, cp_size=cp, **common) for i, cp in enumerate(PREFILL_CP)]
    decode = [
        MockPD(f"d{i}", rooms, transfer_target=f"10.0.0.{i}:1700{i}", **common) for i in range(2)
    ]
    cfg = router_config(prefill=tuple(s.url for s in prefill), decode=tuple(s.url for s in decode))
    router = Served(build_router_app(cfg))
    client = httpx.Client(base_url=router.url, timeout=10.0, trust_env=False)
    yield Deployment(rooms, prefill, decode, router, client, tok)
    client.close()
    router.stop()
    for s in (*prefill, *decode):
        s.stop()


@pytest.fixture
def deployment(pd_deployment: Deployment) -> Iterator[Deployment]:
    """The module's `pd_deployment`, reset (switches, health, load) after each test."""
    pd = pd_deployment
    yield pd
    pd.reset()
    # The next test starts from a router that has seen the reset state.
    wait_until(
        lambda: all(s["healthy"] and s["load"] == 0 for s in pd.servers().values()),
        what="servers healthy and idle",
    )


# ---- HTTP API: live servers around MockEngine ------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The tiny checkpoint's tokenizer files (and chat template), no config or weights."""
    return write_tokenizer_files(tmp_path_factory.mktemp("tiny"), model_max_length=CONTEXT)


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    loaded = load_tokenizer(tokenizer_dir)
    assert loaded is not None
    return loaded


@pytest.fixture(scope="module")
def srv(tokenizer_dir, tok, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """The tiny tokenizer and chat template from the model dir, as a launcher loads them."""
    s = start_server(
        tmp_path_factory.mktemp("srv"),
        tokenizer=tok,
        template=load_chat_template(tokenizer_dir),
        name="tok",
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """A server without tokenizer or chat template (token ids only)."""
    s = start_server(tmp_path_factory.mktemp("bare"), tokenizer=None, template=None, name="bare")
    yield s
    stop_server(s)


# ---- ServerArgs ------------------------------------------------------------------------------


@pytest.fixture
def tiny_config_dir(tmp_path: Path) -> Path:
    """Tiny GLM-5-style config (explicit indexer_types list FFSFSS, 6 layers: the schedule
    tests need a longer one than the tiny model's 3), no weights."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_config_dict("glm_moe_dsa", num_layers=6)))
    return d


# ---- buffer estimator ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    """The tiny GLM-5-style (glm_moe_dsa) model config."""
    return ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))


@pytest.fixture(scope="module")
def mesh():
    """The 8-rank cp mesh over the virtual CPU devices."""
    return make_cp_mesh(CP)


@pytest.fixture(scope="module")
def estimator(cfg) -> BufferEstimator:
    """The `XLA_CPU`-profile estimator of `cfg` (`support.buffer_estimator_cases`)."""
    return cpu_estimator(cfg)


# ---- PD prefill server -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoints):
    """`(path, cfg, model)`: the tiny GLM-5-shaped checkpoint on disk and its model, made
    once per session (~9 s on 2 cores); tests only read them."""
    path = tiny_checkpoints("glm_moe_dsa")
    cfg, model = load_model(path, progress=False)
    return path, cfg, model


@pytest.fixture(scope="session")
def cp_checkpoint(tiny_checkpoints):
    """The CP mesh servers' FP8 checkpoint, its config and one-device reference generator
    (`support.unified_server.fp8_moe_checkpoint`), loaded once per test process."""
    from support.unified_server import fp8_moe_checkpoint  # the server stack: only here

    return fp8_moe_checkpoint(tiny_checkpoints)
