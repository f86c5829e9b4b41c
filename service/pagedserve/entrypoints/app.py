"""The server process: one asyncio loop serving the gRPC API (:mod:`pagedserve.grpc_api`) on one port, the
OpenAI-compatible HTTP API (:mod:`pagedserve.http`) on another, Prometheus metrics, health, graceful shutdown. The
models come from :class:`~pagedserve.serving.factory.ServiceFactory`; both APIs run requests through
:mod:`pagedserve.serving`. :func:`pagedserve.cli.serve` runs it.

Health: gRPC's (see :mod:`pagedserve.grpc_api.server`) and HTTP ``/health`` follow :meth:`App.load_models` and
:meth:`App.stop`.
"""
from __future__ import annotations

import asyncio
import time

import structlog

from ..config import EngineConfig, ServerConfig
from ..grpc_api.server import GrpcServer
from ..serving.auth import ApiKeys
from ..serving.calls import CallTracker
from ..serving.factory import ServiceFactory
from ..serving.metrics import ServerMetrics
from ..serving.services import Services, served_names
from ..serving.tracing import Tracing

log = structlog.get_logger(__name__)

# After the drain, the final ABORT messages of cut-off streams get this long to reach their clients.
FLUSH_S = 2.0


class App:
    """One server process: call :meth:`start` (binds the ports), then :meth:`load_models`, then :meth:`stop`.

    Args:
        server_config, engine_config: the settings.
        factory: builds the services; default ``ServiceFactory(server_config, engine_config)`` (tests pass one
            with their own engine builder).

    Raises ValueError for a bad ``OTEL_*`` variable when tracing is on (naming it).
    """

    def __init__(self, server_config: ServerConfig, engine_config: EngineConfig,
                 factory: ServiceFactory | None = None):
        self.server_config = server_config
        self.engine_config = engine_config
        self.factory = factory or ServiceFactory(server_config, engine_config)
        self.services = Services(*served_names(server_config, engine_config.model),
                                 tracing=Tracing.from_config(server_config.otlp_traces_endpoint))
        self.metrics = ServerMetrics()
        self.api_keys = ApiKeys(server_config.api_key, server_config.api_key_file)
        self.calls = CallTracker(self.services)   # API calls in flight over both ports
        self.grpc = GrpcServer(server_config, self.services, self.metrics, self.api_keys, self.calls)
        self.http = None
        if server_config.http_port != 0:
            from ..http.server import HttpServer

            self.http = HttpServer(server_config, self.services, self.metrics, self.api_keys, self.calls)
        self.port = 0
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self._end_grace = asyncio.Event()

    async def start(self) -> int:
        """Bind and start serving (the HTTP API and the metrics endpoint when configured); returns the bound gRPC
        port. InferenceService stays NOT_SERVING until loaded. Raises OSError when a port cannot be bound."""
        cfg = self.server_config
        self.port = await self.grpc.start()
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.start_http(cfg.metrics_host or cfg.host, cfg.metrics_port)
        if self.http is not None:
            self.http_port = await self.http.start()
        log.info("server_listening", host=cfg.host, port=self.port, http_port=self.http_port,
                 metrics_port=self.metrics_port)
        return self.port

    async def load_models(self) -> None:
        """Load and warm up the configured models (see :class:`ServiceFactory`), log the one-line summary, then
        report SERVING."""
        started = time.monotonic()
        await self.factory.load(self.services, self.metrics, self._on_engine_dead)
        self.services.loading = False
        self._log_summary(time.monotonic() - started)
        if not self.services.shutting_down:
            await self.grpc.set_serving(True)

    def _log_summary(self, load_s: float) -> None:
        generation, embedding = self.services.generation, self.services.embedding
        fields = {}
        if generation is not None:
            info = generation.info
            fields.update(model=info.name, dtype=info.dtype, device=info.device, backend=info.attention_backend,
                          kv_blocks=info.num_kv_blocks, block_size=info.block_size, max_model_len=info.max_model_len,
                          tensor_parallel_size=info.tensor_parallel_size, compiled=info.compiled,
                          compile_cache=info.compile_cache, cuda_graphs=info.cuda_graphs,
                          quantization=info.quantization, linear_kernels=info.linear_kernels,
                          speculative=info.speculative, kv_cache_dtype=info.kv_cache_dtype,
                          prefill_attention_dtype=info.prefill_attention_dtype, architecture=info.architecture,
                          sliding_windows=sorted({w for w in info.sliding_windows if w}),   # as /v1/models:
                          num_experts=info.num_experts,                                      # [] and 0 if dense
                          compile_s=None if info.compile_s is None else round(info.compile_s, 2),
                          deadline_scheduling=generation.engine.engine.config.deadline_scheduling,
                          max_queue_time_s=generation.engine.engine.config.max_queue_time_s,
                          reasoning_parser=generation.engine.engine.config.reasoning_parser,
                          batch_invariant=info.batch_invariant, kernels=info.kernels)
        if embedding is not None:
            fields.update(embedding_model=embedding.info.name, embedding_dim=embedding.info.dimension)
        if self.services.rerank is not None:
            rerank = self.services.rerank.info
            fields.update(rerank_model=rerank.name, rerank_kind=rerank.kind)
        host = self.server_config.host
        log.info("ready", **fields, served_model_name=self.services.generation_name, grpc=f"{host}:{self.port}",
                 http=f"{host}:{self.http_port}" if self.http_port is not None else None,
                 tls=self.server_config.tls, mutual_tls=self.server_config.ssl_ca_certs is not None,
                 api_keys=self.api_keys.enabled, metrics_port=self.metrics_port,
                 fair_share_by=self.server_config.fair_share_by,
                 tracing=self.services.tracing.info() if self.services.tracing is not None else None,
                 load_s=round(load_s, 2))

    def _on_engine_dead(self, exc: BaseException) -> None:
        asyncio.ensure_future(self.grpc.set_serving(False, process_too=True))

    def end_grace_now(self) -> None:
        """Cut a running :meth:`stop`'s drain short (a second SIGTERM/SIGINT)."""
        self._end_grace.set()

    async def stop(self, grace_s: float | None = None) -> None:
        """Shutdown: health NOT_SERVING, HTTP /health 503 -> new InferenceService calls get UNAVAILABLE and new HTTP
        requests 503 -> in-flight calls and streams of both APIs get up to ``grace_s`` (default
        ``shutdown_grace_s``) to finish -> generation streams still open end with ABORT -> the servers stop -> the
        metrics endpoint closes."""
        grace_s = self.server_config.shutdown_grace_s if grace_s is None else grace_s
        self.services.shutting_down = True
        await self.grpc.enter_graceful_shutdown()
        log.info("shutdown_started", in_flight=self.calls.num_in_flight, grace_s=grace_s)
        cut = await self.calls.drain(grace_s, self._end_grace)
        await self.services.aclose()  # aborts what is still live: those streams get their ABORT message
        if self.http is not None:
            await self.http.stop(FLUSH_S)
        await self.grpc.stop(FLUSH_S)
        self.metrics.stop_http()
        if self.services.tracing is not None:   # the spans still batched are exported
            await asyncio.to_thread(self.services.tracing.shutdown)
        log.info("server_stopped", calls_cut_at_grace_end=cut)


async def create_server(server_config: ServerConfig, engine_config: EngineConfig,
                        factory: ServiceFactory | None = None) -> tuple[App, int]:
    """Build, bind and start a server (port 0 picks a free one); models are not loaded yet. Returns (app, port)."""
    app = App(server_config, engine_config, factory)
    port = await app.start()
    return app, port
