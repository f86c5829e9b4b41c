"""Configuration: frozen, slotted dataclasses checked in ``__post_init__``. The CLI builds them from flags."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{field}: {msg}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the generation engine needs.

    Attributes:
        model: path to an HF model directory or GGUF file; None for the embedded SmolLM2-135M-Instruct.
        dtype: "float32", "float16" or "bfloat16"; "auto" is float32 on CPU and bfloat16 on CUDA.
        device: "cpu", "cuda" or "cuda:N"; "auto" picks cuda when available.
        attention_backend: "auto", "cuda" or "torch".
        block_size: tokens per KV block.
        max_model_len: context length at most (prompt + output); None: the model's, capped to the KV capacity.
        max_num_seqs: running requests at most.
        max_num_batched_tokens: new tokens per step at most.
        long_prefill_token_threshold: tokens one prefill may take in a step (0: the whole budget).
        max_waiting_requests: waiting requests at most before RESOURCE_EXHAUSTED (0: unbounded).
        kv_cache_memory_bytes: bytes for K and V over all layers; None: 1 GiB on CPU, and on CUDA what
            ``gpu_memory_utilization`` leaves after a profiled forward pass.
        gpu_memory_utilization: fraction of the GPU's memory this process may use (weights, activations, KV cache).
        num_kv_blocks: overrides the memory sizing when set.
        enable_prefix_caching: reuse cached full KV blocks across requests.
        max_logprobs: largest logprobs / prompt_logprobs k accepted.
        seed: seed of the shared generator used by unseeded sampling.
        quantization: weight-only quantization of the linears: "none" (every weight dequantized to ``dtype``),
            "int8" (per output channel), "int4" (per group of ``quant_group_size``; GGUF Q4_0/Q4_1 blocks as
            stored) or "auto" (a GGUF file keeps its own scheme where a kernel exists: Q4_0/Q4_1 as int4, Q8_0 as
            int8, others dequantized; an HF checkpoint stays unquantized). Activations stay in ``dtype`` around
            the kernels (torch's CPU kernels; on CUDA the weights are dequantized, with a log line).
        quant_group_size: weights per int4 scale/zero along the input dimension when quantizing at load
            (32, 64 or 128); GGUF blocks keep their own (32).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    max_waiting_requests: int = 1024
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    seed: int = 0
    quantization: str = "auto"
    quant_group_size: int = 32

    def __post_init__(self) -> None:
        _check(self.quantization in ("auto", "none", "int8", "int4"), "quantization",
               f"unknown scheme {self.quantization!r}; one of auto, none, int8, int4")
        _check(self.quant_group_size in (32, 64, 128), "quant_group_size", "must be 32, 64 or 128")
        _check(self.dtype in ("auto", "float32", "float16", "bfloat16"), "dtype", f"unknown dtype {self.dtype!r}")
        _check(self.attention_backend in ("auto", "cuda", "torch"), "attention_backend",
               f"unknown backend {self.attention_backend!r}")
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"), "device",
               f"unknown device {self.device!r}")
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", "must be a power of two <= 128")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2")
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _check(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold", "must be >= 0")
        _check(self.max_waiting_requests >= 0, "max_waiting_requests", "must be >= 0")
        _check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes",
               "must be > 0")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        _check(0 <= self.max_logprobs <= 1024, "max_logprobs", "must be in [0, 1024]")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The gRPC server around the engines.

    Attributes:
        host, port: where to listen (port 0 picks a free port).
        embedding_model: HF/sentence-transformers directory (a BERT-family encoder, or a decoder embedding model
            served by an engine of its own); None for the embedded all-MiniLM-L6-v2; "" for none; "llm" to embed
            with the generation model (last-token pooling through its engine).
        max_embed_batch_tokens: padded tokens (rows * longest input) per embedding micro-batch, across calls.
        embed_threads: torch intra-op threads of the embedding worker; None: half of torch's threads when a
            generation model shares the CPU, else torch's setting (engine.embed_batcher.default_num_threads).
        generation: False serves no generation model (Embed only).
        shutdown_grace_s: seconds in-flight calls get to finish after SIGTERM before open streams end with ABORT.
        max_send_message_bytes, max_receive_message_bytes: largest gRPC message sent / accepted
            (``grpc.max_send_message_length`` / ``grpc.max_receive_message_length``).
        keepalive_time_ms: the server pings an idle connection after this long (``grpc.keepalive_time_ms``).
        keepalive_timeout_ms: and closes it when the ping is not answered within this (``grpc.keepalive_timeout_ms``).
        keepalive_permit_without_calls: keepalive pings are allowed on connections with no open call: the
            server sends them and accepts the client's (``grpc.keepalive_permit_without_calls``).
        http2_min_ping_interval_without_data_ms: shortest interval between client pings the server accepts while
            it sends no data; a faster ping is a strike (``grpc.http2.min_ping_interval_without_data_ms``).
        http2_max_ping_strikes: strikes before the server closes the connection with GOAWAY "too_many_pings";
            0 means no limit (``grpc.http2.max_ping_strikes``).
        http2_max_pings_without_data: pings the server sends with no data in between; 0 means no limit
            (``grpc.http2.max_pings_without_data``).
        metrics_host, metrics_port: Prometheus text exposition over HTTP at ``/metrics``; port None: off,
            0: a free port.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    embedding_model: str | None = None
    max_embed_batch_tokens: int = 2048
    embed_threads: int | None = None
    generation: bool = True
    shutdown_grace_s: float = 10.0
    max_send_message_bytes: int = 16 * 1024 * 1024
    max_receive_message_bytes: int = 16 * 1024 * 1024
    keepalive_time_ms: int = 30_000
    keepalive_timeout_ms: int = 10_000
    keepalive_permit_without_calls: bool = True
    http2_min_ping_interval_without_data_ms: int = 1_000
    http2_max_ping_strikes: int = 2
    http2_max_pings_without_data: int = 0
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", "must be in [0, 65535]")
        _check(self.max_embed_batch_tokens >= 1, "max_embed_batch_tokens", "must be >= 1")
        _check(self.embed_threads is None or self.embed_threads >= 1, "embed_threads", "must be >= 1")
        _check(self.shutdown_grace_s >= 0, "shutdown_grace_s", "must be >= 0")
        _check(self.max_send_message_bytes >= 1024, "max_send_message_bytes", "must be >= 1024")
        _check(self.max_receive_message_bytes >= 1024, "max_receive_message_bytes", "must be >= 1024")
        _check(self.keepalive_time_ms >= 1, "keepalive_time_ms", "must be >= 1")
        _check(self.keepalive_timeout_ms >= 1, "keepalive_timeout_ms", "must be >= 1")
        for name in ("http2_min_ping_interval_without_data_ms", "http2_max_ping_strikes",
                     "http2_max_pings_without_data"):
            _check(getattr(self, name) >= 0, name, "must be >= 0")
        _check(self.metrics_port is None or 0 <= self.metrics_port <= 65535, "metrics_port",
               "must be in [0, 65535]")
        _check(self.metrics_port is None or self.metrics_port == 0 or self.metrics_port != self.port,
               "metrics_port", "must differ from port")

    def grpc_options(self) -> list[tuple[str, int]]:
        """The grpc.aio server channel arguments these settings map to (gRPC core's own option names)."""
        return [
            ("grpc.max_send_message_length", self.max_send_message_bytes),
            ("grpc.max_receive_message_length", self.max_receive_message_bytes),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(self.keepalive_permit_without_calls)),
            ("grpc.http2.min_ping_interval_without_data_ms", self.http2_min_ping_interval_without_data_ms),
            ("grpc.http2.max_ping_strikes", self.http2_max_ping_strikes),
            ("grpc.http2.max_pings_without_data", self.http2_max_pings_without_data),
        ]


ENV_PREFIX = "PAGEDSERVE_"


def environment_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``PAGEDSERVE_*`` environment variables, keyed by the lower-cased rest of the name
    (``PAGEDSERVE_MAX_NUM_SEQS=8`` -> ``{"max_num_seqs": "8"}``). The only place the server reads the environment;
    :mod:`pagedserve.cli` turns the values into flag defaults.
    """
    environ = os.environ if environ is None else environ
    return {k[len(ENV_PREFIX):].lower(): v for k, v in environ.items() if k.startswith(ENV_PREFIX) and k != ENV_PREFIX}
