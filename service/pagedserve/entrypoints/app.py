"""The server process: one asyncio loop serving the grpc.aio server (:mod:`pagedserve.grpc_api`: InferenceService,
health, reflection v1 and v1alpha) on one port, the OpenAI-compatible HTTP API (:mod:`pagedserve.http`) on another,
Prometheus metrics, graceful shutdown. The models come from :class:`~pagedserve.serving.factory.ServiceFactory`;
this module only serves them. :func:`pagedserve.cli.serve` runs it.

Health (grpc.health.v1): ``""`` is SERVING while the process runs and can take work; ``pagedserve.v1.InferenceService``
is NOT_SERVING until the models are loaded and warmed up, and again once shutdown begins or the engine dies.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve_client.v1 import inference_pb2 as pb
from pagedserve_client.v1 import inference_pb2_grpc as pb_grpc

from ..config import EngineConfig, ServerConfig
from ..serving.factory import ServiceFactory
from ..serving.metrics import ServerMetrics
from ..serving.services import Services, served_names
from ..serving.auth import ApiKeys
from ..grpc_api.interceptors import AuthInterceptor, CallTrackingInterceptor, ErrorMappingInterceptor
from ..grpc_api.reflection import enable_reflection
from ..grpc_api.servicer import InferenceServicer

log = structlog.get_logger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# After the drain, the final ABORT messages of cut-off streams get this long to reach their clients.
FLUSH_S = 2.0


class App:
    """One server process: call :meth:`start` (binds the ports), then :meth:`load_models`, then :meth:`stop`.

    Args:
        server_config, engine_config: the settings.
        factory: builds the services; default ``ServiceFactory(server_config, engine_config)`` (tests pass one
            with their own engine builder).
    """

    def __init__(self, server_config: ServerConfig, engine_config: EngineConfig,
                 factory: ServiceFactory | None = None):
        self.server_config = server_config
        self.engine_config = engine_config
        self.factory = factory or ServiceFactory(server_config, engine_config)
        self.services = Services(*served_names(server_config, engine_config.model))
        self.metrics = ServerMetrics()
        self.health = health.aio.HealthServicer()
        self.api_keys = ApiKeys(server_config.api_key, server_config.api_key_file)
        self.calls = CallTrackingInterceptor(self.metrics, self._refusal, SERVICE_NAME)
        interceptors = [self.calls, ErrorMappingInterceptor()]
        if self.api_keys.enabled:
            interceptors.insert(1, AuthInterceptor(self.api_keys, SERVICE_NAME))
        self.server = grpc.aio.server(interceptors=interceptors, options=server_config.grpc_options())
        pb_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(self.services, server_config.auto_tool_parser), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME), self.server)
        self.http = None
        if server_config.http_port != 0:
            from ..http.server import HttpServer

            self.http = HttpServer(server_config, self.services, self.metrics, self.api_keys)
        self.port = 0
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self._end_grace = asyncio.Event()

    def _refusal(self, method: str) -> str | None:
        if self.services.shutting_down and method.startswith(f"/{SERVICE_NAME}/"):
            return "the server is shutting down"
        return None

    async def start(self) -> int:
        """Bind and start serving (the HTTP API and the metrics endpoint when configured); returns the bound gRPC
        port. InferenceService stays NOT_SERVING until loaded. Raises OSError when a port cannot be bound."""
        cfg = self.server_config
        address = f"{cfg.host}:{cfg.port}"
        if cfg.tls:
            self.port = self.server.add_secure_port(address, server_credentials(cfg))
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {cfg.host}:{cfg.port}")
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.start_http(cfg.metrics_host or cfg.host, cfg.metrics_port)
        await self.health.set("", SERVING)
        await self.health.set(SERVICE_NAME, NOT_SERVING)
        await self.server.start()
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
            await self.health.set(SERVICE_NAME, SERVING)

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
                          prefill_attention_dtype=info.prefill_attention_dtype,
                          compile_s=None if info.compile_s is None else round(info.compile_s, 2))
        if embedding is not None:
            fields.update(embedding_model=embedding.info.name, embedding_dim=embedding.info.dimension)
        host = self.server_config.host
        log.info("ready", **fields, served_model_name=self.services.generation_name, grpc=f"{host}:{self.port}",
                 http=f"{host}:{self.http_port}" if self.http_port is not None else None,
                 tls=self.server_config.tls, mutual_tls=self.server_config.ssl_ca_certs is not None,
                 api_keys=self.api_keys.enabled, metrics_port=self.metrics_port, load_s=round(load_s, 2))

    def _on_engine_dead(self, exc: BaseException) -> None:
        asyncio.ensure_future(self.health.set(SERVICE_NAME, NOT_SERVING))
        asyncio.ensure_future(self.health.set("", NOT_SERVING))

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
        await self.health.enter_graceful_shutdown()
        log.info("shutdown_started", in_flight=self._num_in_flight(), grace_s=grace_s)
        deadline = time.monotonic() + grace_s
        while self._num_in_flight() and time.monotonic() < deadline and not self._end_grace.is_set():
            try:
                await asyncio.wait_for(self._end_grace.wait(), min(0.05, max(0.0, deadline - time.monotonic())))
            except asyncio.TimeoutError:
                pass
        cut = self._num_in_flight()
        await self.services.aclose()  # aborts what is still live: those streams get their ABORT message
        if self.http is not None:
            await self.http.stop(FLUSH_S)
        await self.server.stop(FLUSH_S)
        self.metrics.stop_http()
        log.info("server_stopped", calls_cut_at_grace_end=cut)

    def _num_in_flight(self) -> int:
        return self.calls.num_in_flight + (self.http.num_in_flight if self.http is not None else 0)


def server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials:
    """TLS credentials from ``ssl_certfile`` / ``ssl_keyfile``; client certificates required when ``ssl_ca_certs``
    is given. Raises OSError when a file cannot be read."""
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    ca = read(cfg.ssl_ca_certs) if cfg.ssl_ca_certs else None
    return grpc.ssl_server_credentials([(read(cfg.ssl_keyfile), read(cfg.ssl_certfile))], root_certificates=ca,
                                       require_client_auth=ca is not None)


async def create_server(server_config: ServerConfig, engine_config: EngineConfig,
                        factory: ServiceFactory | None = None) -> tuple[App, int]:
    """Build, bind and start a server (port 0 picks a free one); models are not loaded yet. Returns (app, port)."""
    app = App(server_config, engine_config, factory)
    port = await app.start()
    return app, port
