"""Server assembly: grpc.aio server with InferenceService, health and reflection on one port; model loading; shutdown.

Health (grpc.health.v1): ``""`` is SERVING while the process runs and can take work; ``pagedserve.v1.InferenceService``
is NOT_SERVING until the models are loaded and warmed up, and again once shutdown begins or the engine dies.
"""
from __future__ import annotations

import asyncio

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve_client.v1 import inference_pb2 as pb
from pagedserve_client.v1 import inference_pb2_grpc as pb_grpc

from ..config import EngineConfig, ServerConfig
from .interceptors import ErrorMappingInterceptor
from .servicer import InferenceServicer
from .state import ServerState

log = structlog.get_logger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class App:
    """One server process: call :meth:`start` (binds the port), then :meth:`load_models`, then
    :meth:`wait_for_termination` or :meth:`stop`."""

    def __init__(self, server_config: ServerConfig, engine_config: EngineConfig | None):
        self.server_config = server_config
        self.engine_config = engine_config
        self.state = ServerState()
        self.health = health.aio.HealthServicer()
        limit = server_config.max_message_bytes
        self.server = grpc.aio.server(
            interceptors=[ErrorMappingInterceptor()],
            options=[("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)])
        pb_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(self.state), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        self.port = 0

    async def start(self) -> int:
        """Bind and start serving; returns the bound port. InferenceService stays NOT_SERVING until loaded."""
        self.port = self.server.add_insecure_port(f"{self.server_config.host}:{self.server_config.port}")
        if self.port == 0:
            raise OSError(f"could not bind {self.server_config.host}:{self.server_config.port}")
        await self.health.set("", SERVING)
        await self.health.set(SERVICE_NAME, NOT_SERVING)
        await self.server.start()
        log.info("server_listening", host=self.server_config.host, port=self.port)
        return self.port

    async def load_models(self) -> None:
        """Load the generation engine and the embedder (on worker threads), warm up, then report SERVING."""
        from ..engine.async_engine import AsyncEngine
        from ..engine.builder import build_engine

        if self.engine_config is not None:
            engine, info = await asyncio.to_thread(build_engine, self.engine_config)
            await asyncio.to_thread(_warm_up, engine)
            self.state.engine = AsyncEngine(engine, on_dead=self._on_engine_dead)
            self.state.engine.start()
            self.state.engine_info = info
        if self.server_config.embedding_model != "":
            self.state.embedder = await asyncio.to_thread(_load_embedder, self.server_config.embedding_model)
        self.state.loading = False
        info = self.state.engine_info
        log.info("ready", model=info.name if info else None, dtype=info.dtype if info else None,
                 device=info.device if info else None, backend=info.attention_backend if info else None,
                 kv_blocks=info.num_kv_blocks if info else None, max_model_len=info.max_model_len if info else None,
                 embedding_model=getattr(self.state.embedder, "name", None))
        await self.health.set(SERVICE_NAME, SERVING)

    def _on_engine_dead(self, exc: BaseException) -> None:
        asyncio.ensure_future(self.health.set(SERVICE_NAME, NOT_SERVING))
        asyncio.ensure_future(self.health.set("", NOT_SERVING))

    async def stop(self, grace_s: float | None = None) -> None:
        """Shutdown: health NOT_SERVING -> refuse new calls -> let in-flight calls finish up to the grace period ->
        stop the engine."""
        grace_s = self.server_config.shutdown_grace_s if grace_s is None else grace_s
        self.state.shutting_down = True
        await self.health.enter_graceful_shutdown()
        engine = self.state.engine
        if engine is not None and grace_s > 0:
            deadline = asyncio.get_running_loop().time() + grace_s
            while engine.num_live_requests and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
        if engine is not None:
            await engine.shutdown()
        await self.server.stop(1.0)
        self.state.embed_executor.shutdown(wait=False, cancel_futures=True)
        log.info("server_stopped")


def _warm_up(engine) -> None:
    """One tiny request through the whole step path, so the first client request does not pay for it."""
    from ..engine.sampling_params import SamplingParams

    engine.add_request("__warmup__", [0, 1, 2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.kv_cache.reset_stats()


def _load_embedder(path: str | None):
    from ..engine.embedder import Embedder
    from ..models.loader import embedded_embedding_path

    return Embedder.from_pretrained(path or embedded_embedding_path())


async def create_server(server_config: ServerConfig, engine_config: EngineConfig | None) -> tuple[App, int]:
    """Build, bind and start a server (port 0 picks a free one); models are not loaded yet. Returns (app, port)."""
    app = App(server_config, engine_config)
    port = await app.start()
    return app, port
