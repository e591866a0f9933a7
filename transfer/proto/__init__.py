"""The PD transfer wire protocol: `kv_transfer.proto` and its committed generated modules.

Kept free of imports so `python -m transfer.proto.generate` runs even when the generated
modules are missing or stale. Import `transfer.proto.kv_transfer_pb2` (messages) and
`transfer.proto.kv_transfer_pb2_grpc` (client stub) directly.
"""
