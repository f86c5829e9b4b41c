"""Configuration: frozen, slotted dataclasses checked in ``__post_init__``.

These classes are the one source of every setting: :mod:`pagedserve.cli` derives one ``--flag`` and one
``PAGEDSERVE_<FIELD>`` environment variable per field, with the default from the field and the help text from the
class docstring's ``Attributes`` entry. A new setting is a field, a docstring line and (when it has a range) a check.
A field's ``metadata["choices"]`` lists its allowed values.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .config_checks import _check, _check_choices
from .config_speculative import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS, SpeculativeConfig  # noqa: F401

DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "cpu", "cuda", "torch")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
LINEAR_KERNELS = ("auto", "int8-activations", "float-activations", "torch")
LOG_LEVELS = ("debug", "info", "warning", "error")
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # pagedserve.tool_calls.PARSERS' names (a test keeps them equal)
REASONING_PARSERS = ("deepseek_r1", "qwen3", "gpt_oss")  # pagedserve.reasoning.PARSERS' names (a test too)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the generation engine needs.

    Attributes:
        model: path to an HF model directory or GGUF file; None for the embedded SmolLM2-135M-Instruct.
        dtype: "float32", "float16" or "bfloat16"; "auto" is float32 on CPU and bfloat16 on CUDA.
        device: "cpu", "cuda" or "cuda:N"; "auto" picks cuda when available.
        attention_backend: "auto", "cpu", "cuda" or "torch" (the reference). "auto" is cuda on a GPU, and on CPU
            "cpu" (decodes on pagedserve's C++ paged-attention kernel, prefills on torch) where the kernels load.
        block_size: tokens per KV block.
        max_model_len: context length at most (prompt + output); None: the model's, capped to the KV capacity.
        max_num_seqs: running requests at most.
        max_num_batched_tokens: new tokens per step at most (vLLM's ``--max-num-batched-tokens``): the prefill
            budget a step shares with its decodes. 1,024 by measurement (bench/README.md, "Prefill budget"): 16
            streams of 256-token prompts on 2 cores, budget 512 / 1,024 / 2,048: output 165 / 169 / 165 tok/s,
            TTFT p50 1.2 / 1.5 / 2.4 s, TPOT p50 81 / 73 / 61 ms; of 1,024-token prompts: 47 / 52 / 52 tok/s,
            TTFT p50 2.6 / 2.8 / 5.2 s.
        long_prefill_token_threshold: tokens one prefill may take in a step (0: the whole budget).
        max_waiting_requests: waiting requests at most before RESOURCE_EXHAUSTED (0: unbounded).
        max_queue_time_s: seconds a request without a deadline may wait unscheduled before it is refused with
            DEADLINE_EXCEEDED (HTTP 504) and a retry hint; None: unbounded.
        fair_share_weights: per-caller weights of the fair share (core/sched/fairness.py) as a JSON object, name
            -> weight > 0 (e.g. ``{"search": 2, "batch": 0.5}``); callers not named weigh 1. Callers are named by
            the server's fair_share_by.
        deadline_scheduling: keep calls' deadlines (gRPC deadline, HTTP ``timeout``): earliest deadline first
            within a priority, and a request that cannot finish in time refused before any prefill
            (core/sched/deadlines.py); off: deadlines only abort calls when they expire.
        kv_cache_memory_bytes: bytes for K and V over all layers; None: 2 GiB on CPU, and on CUDA what
            ``gpu_memory_utilization`` leaves after a profiled forward pass.
        gpu_memory_utilization: fraction of the GPU's memory this process may use (weights, activations, KV cache).
        num_kv_blocks: overrides the memory sizing when set.
        enable_prefix_caching: reuse cached full KV blocks across requests.
        max_logprobs: largest logprobs / prompt_logprobs k accepted.
        seed: seed of the generator shared by requests that give no seed of their own (the sampler's); None seeds
            it from the OS at start.
        quantization: weight-only quantization of the linears: "none" (every weight dequantized to ``dtype``),
            "int8" (per output channel), "int4" (per group of ``quant_group_size``; GGUF Q4_0/Q4_1 blocks as
            stored) or "auto" (a GGUF file keeps its own scheme where a kernel exists: Q4_0/Q4_1 as int4, Q8_0 as
            int8, others dequantized; an HF checkpoint stays unquantized). Activations stay in ``dtype`` around
            the kernels (see ``linear_kernels``; on CUDA the weights are dequantized, with a log line).
        kv_cache_dtype: element type of the paged KV cache (vLLM's ``--kv-cache-dtype``): "auto" is ``dtype``, but
            float16 for a float32 model on CPU that runs a GGUF file's quantized weights as stored (llama.cpp's
            default cache type; ``quantization="none"`` keeps ``dtype``); "float32" keeps such a model's cache in
            float32. "float16" or "bfloat16" halve the cache of a float32 model (twice the blocks for the same
            ``kv_cache_memory_bytes``, half the bytes each decode step's attention reads). K/V rows are rounded to
            it when written (round to nearest even) and widened exactly when read; attention math stays in float32.
            A cache type other than ``dtype`` is supported on CPU only (ValueError on CUDA).
        quant_group_size: weights per int4 scale/zero along the input dimension when quantizing at load
            (32, 64 or 128); GGUF blocks keep their own (32).
        linear_kernels: what runs the linears on CPU: "auto" (pagedserve's AVX2 kernels for float32, int4 and
            int8 weights, compiled with the system C++ compiler at first start and cached; torch's where the CPU
            lacks AVX2/FMA or no compiler is found, with a log line; at every call the int4/int8 linears quantize
            activations per token in blocks of 32 for integer dot products, as llama.cpp does, but to 16 bits held
            as two int8 digits, so results stay within 0.1% top-1 of float32 activations),
            "int8-activations" (one level, as llama.cpp: faster, about 3% of top-1 tokens differ),
            "float-activations" (the same kernels, activations always float32) or "torch" (torch's own).
        speculative_config: speculative decoding as vLLM's JSON, e.g. ``{"method": "ngram",
            "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
            "disable_by_batch_size": 8}`` (prompt lookup drafts verified by the target model; output unchanged in
            distribution); None: off.
        tensor_parallel_size: ranks one model is split over (Megatron-style: attention heads, MLP columns and the
            vocabulary); rank 0 is this process, ranks 1..N-1 spawned workers (or torchrun's other processes),
            talking over torch.distributed (gloo on CPU, NCCL on CUDA, one device per rank).
        collective_timeout_s: seconds a tensor-parallel collective may wait for a rank before the engine fails
            (a dead or hung worker then ends open calls with UNAVAILABLE).
        enforce_eager: True runs the model eagerly (vLLM's ``--enforce-eager``); False compiles the forward
            wherever it is supported: on CPU with torch.compile (attention opaque, token counts padded to fixed
            sizes, compiled at warm-up), on CUDA as CUDA graphs of decode-only steps (batch sizes padded to fixed
            sizes, captured at warm-up; the cuda attention backend); None (default) captures CUDA graphs on CUDA
            and compiles on CPU only where it measured faster (see README "Compiled forward", "CUDA graphs").
        reasoning_parser: how a reasoning model's thinking is read from its text (vLLM's --reasoning-parser):
            "deepseek_r1" (up to ``</think>``), "qwen3" (``<think>...</think>`` first) or "gpt_oss" (harmony
            ``analysis`` channel); chat responses carry it as ``reasoning_content``, and structured output and
            tool calls apply to the rest only. None: off (the text is all content).
    """

    model: str | None = None
    dtype: str = field(default="auto", metadata={"choices": DTYPES})
    device: str = "auto"
    attention_backend: str = field(default="auto", metadata={"choices": ATTENTION_BACKENDS})
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    long_prefill_token_threshold: int = 0
    max_waiting_requests: int = 1024
    max_queue_time_s: float | None = None
    deadline_scheduling: bool = True
    fair_share_weights: str | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    seed: int | None = None
    quantization: str = field(default="auto", metadata={"choices": QUANTIZATIONS})
    kv_cache_dtype: str = field(default="auto", metadata={"choices": KV_CACHE_DTYPES})
    quant_group_size: int = field(default=32, metadata={"choices": (32, 64, 128)})
    linear_kernels: str = field(default="auto", metadata={"choices": LINEAR_KERNELS})
    speculative_config: str | None = None
    tensor_parallel_size: int = 1
    collective_timeout_s: float = 60.0
    enforce_eager: bool | None = None
    reasoning_parser: str | None = field(default=None, metadata={"choices": REASONING_PARSERS})

    def __post_init__(self) -> None:
        _check_choices(self)
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        _check(self.collective_timeout_s > 0, "collective_timeout_s", "must be > 0")
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"), "device",
               f"unknown device {self.device!r}")
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", "must be a power of two <= 128")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2")
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _check(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold", "must be >= 0")
        _check(self.max_waiting_requests >= 0, "max_waiting_requests", "must be >= 0")
        _check(self.max_queue_time_s is None or self.max_queue_time_s > 0, "max_queue_time_s", "must be > 0")
        self.fair_share()  # parse and check now: a bad value fails at start-up
        _check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes",
               "must be > 0")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        _check(0 <= self.max_logprobs <= 1024, "max_logprobs", "must be in [0, 1024]")
        _check(self.seed is None or 0 <= self.seed < 2 ** 64, "seed", "must be in [0, 2**64)")
        self.speculative()  # parse and check now: a bad value fails at start-up

    def fair_share(self) -> dict[str, float]:
        """The parsed ``fair_share_weights`` ({} when unset). Raises ValueError naming the field."""
        if not self.fair_share_weights:
            return {}
        try:
            weights = json.loads(self.fair_share_weights)
        except json.JSONDecodeError as exc:
            raise ValueError(f"fair_share_weights: not JSON: {exc}") from None
        _check(isinstance(weights, dict), "fair_share_weights", "must be a JSON object of name -> weight")
        for name, w in weights.items():
            _check(not isinstance(w, bool) and isinstance(w, (int, float)) and w > 0, "fair_share_weights",
                   f"weight of {name!r} must be a number > 0, got {w!r}")
        return {str(k): float(v) for k, v in weights.items()}

    def speculative(self) -> SpeculativeConfig | None:
        """The parsed ``speculative_config`` (None when off). Raises ValueError naming the field."""
        if self.speculative_config is None or not self.speculative_config.strip():
            return None
        return SpeculativeConfig.from_json(self.speculative_config)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The servers around the engines: gRPC, the OpenAI-compatible HTTP API, metrics, logging.

    Attributes:
        host: address the gRPC and HTTP ports bind.
        port: gRPC port (0 picks a free port).
        http_port: OpenAI-compatible HTTP API port (same host); 0 turns the HTTP API off.
        served_model_name: the model name the HTTP API lists at /v1/models and accepts in ``model``, also the
            metrics' model_name label; None: --model as given, or SmolLM2-135M-Instruct for the embedded model.
        api_key: when set (or api_key_file is), every InferenceService call needs ``authorization: Bearer <key>``
            metadata (UNAUTHENTICATED otherwise) and every HTTP ``/v1/*`` request the same header (401); health,
            reflection and HTTP /health stay open.
        api_key_file: a file of accepted keys, one per line (``#`` comments), re-read when it changes, so keys
            rotate without a restart; used together with api_key when both are set.
        ssl_certfile: PEM certificate (chain) of the server: TLS on the gRPC and HTTP ports (with ssl_keyfile).
        ssl_keyfile: PEM private key of ssl_certfile.
        ssl_ca_certs: PEM CA bundle: clients must present a certificate signed by it (mutual TLS), on both ports.
        max_request_body_bytes: largest HTTP request body accepted (413 above it).
        generation_model: serve the generation model; --no-generation-model serves Embed only.
        embedding_model: HF/sentence-transformers directory (a BERT-family encoder, or a decoder embedding model
            served by an engine of its own with last-token pooling); None: the embedded all-MiniLM-L6-v2; "none"
            (or ""): no embedding model; "llm": embed with the generation model through its engine.
        max_embed_batch_tokens: padded tokens (rows * longest input) per embedding micro-batch; inputs of
            concurrent Embed calls share micro-batches grouped by length.
        embed_threads: torch intra-op threads of the embedding worker; None: half of torch's threads when a
            generation model shares the CPU, else torch's setting.
        rerank_model: cross-encoder directory for Rerank / Score (a Bert-, Roberta-, XLMRoberta- or
            ModernBertForSequenceClassification checkpoint with one label, scored as sentence-transformers'
            CrossEncoder does, batched across calls like embeddings); None or "none": Rerank / Score use the cosine
            of the embedding model's vectors.
        shutdown_grace_s: seconds in-flight calls get to finish after SIGTERM/SIGINT before open streams end with
            ABORT.
        max_send_message_bytes: largest gRPC message sent (``grpc.max_send_message_length``).
        max_receive_message_bytes: largest gRPC message accepted (``grpc.max_receive_message_length``).
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
        metrics_host: address the Prometheus endpoint binds; None: the same as host. It speaks plaintext HTTP and
            needs no key (for scrapers); keep it off (no metrics_port) or on a private address when that matters.
        metrics_port: Prometheus text exposition over HTTP at ``/metrics`` on this port; None: off, 0: a free
            port. The HTTP API serves the same registry at ``/metrics`` too.
        log_level: the lowest level logged.
        log_json: JSON log lines; None: when stdout is not a TTY.
        chat_template: a Jinja chat template (a file path, or the template itself) used instead of the model's
            own, e.g. one that renders ``tools`` (vLLM's --chat-template).
        enable_auto_tool_choice: let the model decide when to call tools (``tool_choice: auto``, the default
            when a request has tools); needs tool_call_parser. Without it such requests are a 400 (as in vLLM).
        tool_call_parser: how tool calls are read from the model's text under ``tool_choice: auto``: "hermes"
            (``<tool_call>{...}</tool_call>``, Hermes/Qwen2 templates) or "llama3_json" (Llama 3.1/3.2 JSON).
        allowed_origins: CORS: origins a browser page may call the HTTP API from, as a JSON list (vLLM's
            default ``["*"]``).
        allowed_methods: CORS: methods allowed cross-origin, as a JSON list (default ``["*"]``).
        allowed_headers: CORS: request headers allowed cross-origin, as a JSON list (default ``["*"]``).
        allow_credentials: CORS: allow cookies and Authorization on cross-origin requests.
        fair_share_by: who a call's sender is for fair shares among equal priorities (core/sched/fairness.py):
            "api-key" (the name of the key presented: a key-file line ``<key> <name>``, else ``key-<sha256
            prefix>``; ``default`` for --api-key) or "header:NAME" (a header / metadata key the mesh sets after
            authenticating upstream, e.g. ``header:x-caller``); None: off (arrival order within a priority).
        otlp_traces_endpoint: OpenTelemetry traces go to this OTLP collector URL (vLLM's flag): gRPC, or HTTP
            (protobuf) when the path ends in /v1/traces or OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says so; None: off.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    api_key_file: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    max_request_body_bytes: int = 16 * 1024 * 1024
    generation_model: bool = True
    embedding_model: str | None = None
    max_embed_batch_tokens: int = 2048
    embed_threads: int | None = None
    rerank_model: str | None = None
    shutdown_grace_s: float = 10.0
    max_send_message_bytes: int = 16 * 1024 * 1024
    max_receive_message_bytes: int = 16 * 1024 * 1024
    keepalive_time_ms: int = 30_000
    keepalive_timeout_ms: int = 10_000
    keepalive_permit_without_calls: bool = True
    http2_min_ping_interval_without_data_ms: int = 1_000
    http2_max_ping_strikes: int = 2
    http2_max_pings_without_data: int = 0
    metrics_host: str | None = None
    metrics_port: int | None = None
    log_level: str = field(default="info", metadata={"choices": LOG_LEVELS})
    log_json: bool | None = None
    chat_template: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = field(default=None, metadata={"choices": TOOL_CALL_PARSERS})
    allowed_origins: str = '["*"]'
    allowed_methods: str = '["*"]'
    allowed_headers: str = '["*"]'
    allow_credentials: bool = False
    fair_share_by: str | None = None
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if self.embedding_model is not None and self.embedding_model.lower() == "none":
            object.__setattr__(self, "embedding_model", "")
        if self.rerank_model is not None and self.rerank_model.lower() in ("none", ""):
            object.__setattr__(self, "rerank_model", None)
        for name in ("port", "http_port", "metrics_port"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= 65535, name, "must be in [0, 65535]")
        _check(self.api_key is None or len(self.api_key) > 0, "api_key", "must not be empty")
        by = self.fair_share_by
        _check(by is None or by == "api-key" or (by.startswith("header:") and len(by) > len("header:")),
               "fair_share_by", f"must be 'api-key' or 'header:NAME', got {by!r}")
        _check((self.ssl_certfile is None) == (self.ssl_keyfile is None), "ssl_keyfile",
               "ssl_certfile and ssl_keyfile go together")
        _check(self.ssl_ca_certs is None or self.ssl_certfile is not None, "ssl_ca_certs",
               "client certificates need TLS: give ssl_certfile and ssl_keyfile too")
        _check(self.served_model_name is None or len(self.served_model_name) > 0, "served_model_name",
               "must not be empty")
        _check(self.max_request_body_bytes >= 1024, "max_request_body_bytes", "must be >= 1024")
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
        for name, other in (("http_port", "port"), ("metrics_port", "port"), ("metrics_port", "http_port")):
            a, b = getattr(self, name), getattr(self, other)
            _check(not a or a != b, name, f"must differ from {other}")
        _check_choices(self)
        _check(not self.enable_auto_tool_choice or self.tool_call_parser is not None, "tool_call_parser",
               "--enable-auto-tool-choice needs --tool-call-parser")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            self.cors_list(name)
        url = urlsplit(self.otlp_traces_endpoint or "http://x")
        _check(url.scheme in ("http", "https") and bool(url.hostname), "otlp_traces_endpoint",
               f"must be an http:// or https:// URL, got {self.otlp_traces_endpoint!r}")

    def cors_list(self, name: str) -> list[str]:
        """A CORS setting (``allowed_origins`` ...) parsed. Raises ValueError naming it unless a JSON list of
        strings."""
        try:
            value = json.loads(getattr(self, name))
        except ValueError:
            value = None
        _check(isinstance(value, list) and all(isinstance(v, str) for v in value), name,
               f"must be a JSON list of strings, got {getattr(self, name)!r}")
        return value

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser of ``tool_choice: auto`` output: tool_call_parser when enable_auto_tool_choice is on."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    @property
    def tls(self) -> bool:
        """Both ports speak TLS."""
        return self.ssl_certfile is not None

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
