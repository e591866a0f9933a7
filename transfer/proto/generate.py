"""Regenerate the committed protobuf / gRPC modules from `kv_transfer.proto`.

    python -m transfer.proto.generate            # rewrite transfer/proto/kv_transfer_pb2*.py
    python -m transfer.proto.generate --out DIR  # write DIR/transfer/proto/... instead

Uses `grpc_tools.protoc` (the `grpcio-tools` test extra), so no system `protoc` is
needed. The proto is compiled with the repository root as include path, so the generated
gRPC module imports `transfer.proto.kv_transfer_pb2` by its package path.
`tests/transfer/test_grpc_wire.py` regenerates into a temporary directory and checks that the
committed files are up to date.
"""

from __future__ import annotations

import argparse
import importlib.resources
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO = Path("transfer/proto/kv_transfer.proto")
GENERATED = (
    Path("transfer/proto/kv_transfer_pb2.py"),
    Path("transfer/proto/kv_transfer_pb2_grpc.py"),
)


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Compile `kv_transfer.proto` into `out_dir`; returns the generated module paths."""
    from grpc_tools import protoc  # test/dev extra only: runtime code never imports it

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with exit code {rc}: {' '.join(args)}")
    paths = [out_dir / p for p in GENERATED]
    for p in paths:
        logger.info("wrote %s", p)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m transfer.proto.generate", description=__doc__)
    ap.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: repo)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
