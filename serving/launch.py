"""`cpkv-serve` (also `python -m serving.launch`): start a server, or check a launch line.

    cpkv-serve --model-path DIR [--disaggregation-mode null|prefill|decode] [flags ...]
    cpkv-serve --model-path DIR [flags ...] --check-config

Serving. The model and tokenizer load once; the mode picks the engine behind the HTTP
API (`serving.http.app`):
- `null` (unified, cp_size 1): `DecodeEngine` prefills and decodes on one device;
- `prefill`: `PrefillModeEngine`, the CP prefill scheduler on the `cp` mesh, which ships
  each request's KV to the decode server the router names (`--transfer-backend`);
- `decode`: a `transfer.receiver.Receiver` (gRPC on `--transfer-port`, plus the Mooncake
  data plane with `--transfer-backend mooncake`) fills a `DecodeEngine`'s pool.
Compiles are warmed up (one request through the engine) before the server answers
`/health` with 200; startup logs the effective configuration and the per-rank KV
capacity. SIGTERM (or Ctrl-C) drains: new requests get 503, running ones get
`--shutdown-drain-timeout` seconds to finish, the rest are aborted (their pages freed),
and the last log line states the KV pages free per rank (all of them, unless a leak).

`--check-config` reads the model config (with the NSA / JSON overrides merged, SPEC S11),
runs `ServerArgs.validate`, prints the effective configuration as one JSON object (every
server arg, `"model_overrides"`, a `"model"` summary with the derived indexer schedule, and
`"warnings"`) and exits 0. It does not touch devices: the device count is checked when the
server starts. Any error prints one line `error: ...` to stderr and exits 2.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from cpkv_jax.cli_logging import configure_logging
from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import CpkvError
from serving.prefill.memory_plan import XLA_CLIENT_MEM_FRACTION, XLA_CLIENT_MEM_FRACTION_ENV
from serving.server_args import ServerArgs, as_flags
from transfer.capabilities import TransferBackendRegistry

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_USAGE = 2  # argparse's convention for a bad command line


def model_summary(model: ModelConfig) -> dict[str, Any]:
    """The few model-config facts a launch line depends on."""
    return {
        "model_type": model.model_type,
        "architecture": model.architecture,
        "num_hidden_layers": model.num_hidden_layers,
        "kv_cache_dim": model.kv_cache_dim,
        "index_head_dim": model.index_head_dim,
        "index_topk": model.index_topk,
        # Same letters as --nsa-index-topk-pattern: F = full indexer, S = shared top-k.
        "indexer_pattern": "".join("F" if t == "full" else "S" for t in model.indexer_types),
        "full_indexer_layers": list(model.full_indexer_layers),
    }


def effective_configuration(
    args: ServerArgs, model: ModelConfig, warnings: Sequence[str] = ()
) -> dict[str, Any]:
    return {
        **args.to_dict(),
        "model_overrides": args.effective_model_overrides(),
        "model": model_summary(model),
        "warnings": list(warnings),
    }


def _fail(message: str) -> int:
    print("error: " + " ".join(as_flags(message).split()), file=sys.stderr)
    return EXIT_USAGE


def main(
    argv: Sequence[str] | None = None,
    *,
    backends: TransferBackendRegistry | None = None,
    device_count: int | None = None,
) -> int:
    """Entry point. `backends` (default: `default_backend_registry()`) and `device_count`
    (default: not checked) are injection points for tests and embedding launchers."""
    try:
        args = ServerArgs.from_cli(argv, backends)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except CpkvError as e:
        return _fail(str(e))
    configure_logging(args.log_level)
    try:
        model = args.model_config()
        warnings = args.validate(model, device_count=device_count, backends=backends)
    except (CpkvError, OSError) as e:
        return _fail(str(e))
    if args.check_config:
        print(json.dumps(effective_configuration(args, model, warnings), indent=2))
        return EXIT_OK
    try:
        args.refuse_unbuilt()
    except CpkvError as e:
        return _fail(str(e))
    logger.info(
        "effective configuration: %s",
        json.dumps(effective_configuration(args, model, warnings), sort_keys=True),
    )
    # XLA's GPU allocator takes 75% of the device by default; weights, KV pools and
    # step buffers all come out of that one pool, so give it the device minus a margin
    # (the memory plan budgets `--mem-fraction-static` of the whole device within it).
    # Read when the backend starts, which is after this point.
    os.environ.setdefault(XLA_CLIENT_MEM_FRACTION_ENV, str(XLA_CLIENT_MEM_FRACTION))
    try:
        from serving.server import run_server

        return run_server(args)
    except (CpkvError, OSError) as e:
        logger.error("server failed to start: %s", e)
        return _fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
