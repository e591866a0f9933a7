"""PD transfer backends behind `transfer.sender.TransferBackend`.

- `grpc_backend.GrpcBackend` ("grpc"): page streams to `transfer.receiver` over gRPC;
  needs nothing beyond pip.

Each backend declares its `transfer.capabilities.BackendCapabilities`; startup refuses
CP shared-KV prefill with a backend lacking owner filtering or position-addressed
destinations (SPEC S2.3).
"""
