"""The grpc.aio server of one process: InferenceService behind the interceptors, health (grpc.health.v1) and
reflection v1 and v1alpha, on ``--port`` of ``--host`` (TLS when configured).

Health: ``""`` is SERVING while the process runs and can take work; ``pagedserve.v1.InferenceService`` is
NOT_SERVING until the models are loaded and warmed up, and again once shutdown begins or the engine dies (the
process, :mod:`pagedserve.entrypoints.app`, says when).
"""
from __future__ import annotations

import functools

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve_client.v1 import inference_pb2 as pb
from pagedserve_client.v1 import inference_pb2_grpc as pb_grpc

from ..config import ServerConfig
from ..serving.auth import ApiKeys
from ..serving.callers import caller_of
from ..serving.calls import CallTracker
from ..serving.metrics import ServerMetrics
from ..serving.services import Services
from .interceptors import AuthInterceptor, CallTrackingInterceptor, ErrorMappingInterceptor, TracingInterceptor
from .reflection import enable_reflection
from .servicer import InferenceServicer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class GrpcServer:
    """The gRPC API of one server process.

    Args:
        config: ``host``, ``port``, TLS files, ``grpc_options()``, ``auto_tool_parser``.
        services: the process's services (filled in once loaded).
        metrics: where the gRPC server metrics go.
        api_keys: the accepted keys (shared with the HTTP port).
        tracker: the process's call tracker (shared with the HTTP port).
    """

    def __init__(self, config: ServerConfig, services: Services, metrics: ServerMetrics, api_keys: ApiKeys,
                 tracker: CallTracker):
        self.config = config
        self.health = health.aio.HealthServicer()
        interceptors = [CallTrackingInterceptor(metrics, tracker, SERVICE_NAME), ErrorMappingInterceptor()]
        if api_keys.enabled:
            interceptors.insert(1, AuthInterceptor(api_keys, SERVICE_NAME))
        if services.tracing is not None:   # outside auth: a refused call has its span too
            interceptors.insert(1, TracingInterceptor(services.tracing, (f"/{SERVICE_NAME}/Generate",)))
        self.server = grpc.aio.server(interceptors=interceptors, options=config.grpc_options())
        callers = functools.partial(caller_of, config.fair_share_by, keys=api_keys)
        pb_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(services, config.auto_tool_parser, callers,
                                                                         config.fair_share_by),
                                                       self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME), self.server)

    async def start(self) -> int:
        """Bind and start serving, InferenceService NOT_SERVING; returns the bound port. Raises OSError when the
        port cannot be bound."""
        cfg = self.config
        address = f"{cfg.host}:{cfg.port}"
        port = self.server.add_secure_port(address, server_credentials(cfg)) if cfg.tls else \
            self.server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"could not bind {cfg.host}:{cfg.port}")
        await self.health.set("", SERVING)
        await self.health.set(SERVICE_NAME, NOT_SERVING)
        await self.server.start()
        return port

    async def set_serving(self, serving: bool, process_too: bool = False) -> None:
        """InferenceService's health (and with ``process_too`` the process's, ``""``)."""
        status = SERVING if serving else NOT_SERVING
        await self.health.set(SERVICE_NAME, status)
        if process_too:
            await self.health.set("", status)

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING from now on."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; calls still running get ``grace_s``, then are cancelled."""
        await self.server.stop(grace_s)


def server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials:
    """TLS credentials from ``ssl_certfile`` / ``ssl_keyfile``; client certificates required when ``ssl_ca_certs``
    is given. Raises OSError when a file cannot be read."""
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    ca = read(cfg.ssl_ca_certs) if cfg.ssl_ca_certs else None
    return grpc.ssl_server_credentials([(read(cfg.ssl_keyfile), read(cfg.ssl_certfile))], root_certificates=ca,
                                       require_client_auth=ca is not None)
