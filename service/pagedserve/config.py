"""Configuration: frozen, slotted dataclasses checked in ``__post_init__``. The CLI builds them from flags."""
from __future__ import annotations

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
        kv_cache_memory_bytes: bytes for K and V over all layers; None: 1 GiB on CPU.
        num_kv_blocks: overrides the memory sizing when set.
        enable_prefix_caching: reuse cached full KV blocks across requests.
        max_logprobs: largest logprobs / prompt_logprobs k accepted.
        seed: seed of the shared generator used by unseeded sampling.
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
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
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
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        _check(0 <= self.max_logprobs <= 1024, "max_logprobs", "must be in [0, 1024]")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The gRPC server around the engines.

    Attributes:
        host, port: where to listen (port 0 picks a free port).
        embedding_model: HF/sentence-transformers directory; None for the embedded all-MiniLM-L6-v2; "" for none.
        generation: False serves no generation model (Embed only).
        shutdown_grace_s: seconds in-flight calls get to finish after SIGTERM.
        max_message_bytes: largest gRPC message accepted or sent.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    embedding_model: str | None = None
    generation: bool = True
    shutdown_grace_s: float = 10.0
    max_message_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", "must be in [0, 65535]")
        _check(self.shutdown_grace_s >= 0, "shutdown_grace_s", "must be >= 0")
        _check(self.max_message_bytes >= 1024, "max_message_bytes", "must be >= 1024")
