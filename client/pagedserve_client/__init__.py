"""pagedserve_client: a light Python client for the pagedserve gRPC API (grpcio + protobuf only).

    from pagedserve_client import PagedServeClient
    with PagedServeClient("127.0.0.1:50051", timeout_s=60) as client:
        for response in client.generate("Hello", max_tokens=32, temperature=0):
            print(response.text, end="", flush=True)

AsyncPagedServeClient has the same methods as coroutines (grpc.aio). The generated messages live in
pagedserve_client.v1.inference_pb2 (re-exported here as `pb`). The CLI is `pagedserve-client` (cli.py).
"""
from ._convert import (
    DEFAULT_TARGET,
    GenerationResult,
    chat_messages,
    finish_reason_name,
    generate_request,
    sampling_params,
    service_config_json,
    tls_credentials,
)
from ._stream import AsyncResponseStream, ResponseStream
from .aio import AsyncPagedServeClient
from .client import PagedServeClient
from .v1 import inference_pb2 as pb

__all__ = [
    "DEFAULT_TARGET",
    "AsyncPagedServeClient",
    "AsyncResponseStream",
    "GenerationResult",
    "PagedServeClient",
    "ResponseStream",
    "chat_messages",
    "finish_reason_name",
    "generate_request",
    "pb",
    "sampling_params",
    "service_config_json",
    "tls_credentials",
]
