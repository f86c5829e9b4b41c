"""Server assembly: grpc.aio server with InferenceService, health and reflection on one port; model loading;
Prometheus metrics; graceful shutdown.

Health (grpc.health.v1): ``""`` is SERVING while the process runs and can take work; ``pagedserve.v1.InferenceService``
is NOT_SERVING until the models are loaded and warmed up, and again once shutdown begins or the engine dies.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve_client.v1 import inference_pb2 as pb
from pagedserve_client.v1 import inference_pb2_grpc as pb_grpc

from ..config import EngineConfig, ServerConfig
from .interceptors import CallTrackingInterceptor, ErrorMappingInterceptor
from .metrics import ServerMetrics
from .request_metrics import MeteredEngine
from .servicer import InferenceServicer
from .state import ServerState

LLM_EMBEDDING = "llm"  # --embedding-model value: embed with the generation model (last-token pooling)

log = structlog.get_logger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# After the drain, the final ABORT messages of cut-off streams get this long to reach their clients.
FLUSH_S = 2.0


class App:
    """One server process: call :meth:`start` (binds the port), then :meth:`load_models`, then :meth:`stop`."""

    def __init__(self, server_config: ServerConfig, engine_config: EngineConfig | None):
        self.server_config = server_config
        self.engine_config = engine_config
        self.state = ServerState()
        self.metrics = ServerMetrics()
        self.health = health.aio.HealthServicer()
        self.calls = CallTrackingInterceptor(self.metrics, self._refusal, SERVICE_NAME)
        self.server = grpc.aio.server(interceptors=[self.calls, ErrorMappingInterceptor()],
                                      options=server_config.grpc_options())
        pb_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(self.state), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        self.port = 0
        self.metrics_port: int | None = None
        self._end_grace = asyncio.Event()

    def _refusal(self, method: str) -> str | None:
        if self.state.shutting_down and method.startswith(f"/{SERVICE_NAME}/"):
            return "the server is shutting down"
        return None

    async def start(self) -> int:
        """Bind and start serving (and the metrics endpoint when configured); returns the bound gRPC port.
        InferenceService stays NOT_SERVING until loaded. Raises OSError when a port cannot be bound."""
        cfg = self.server_config
        self.port = self.server.add_insecure_port(f"{cfg.host}:{cfg.port}")
        if self.port == 0:
            raise OSError(f"could not bind {cfg.host}:{cfg.port}")
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.start_http(cfg.metrics_host, cfg.metrics_port)
        await self.health.set("", SERVING)
        await self.health.set(SERVICE_NAME, NOT_SERVING)
        await self.server.start()
        log.info("server_listening", host=cfg.host, port=self.port, metrics_port=self.metrics_port)
        return self.port

    async def load_models(self) -> None:
        """Load the generation engine and the embedder (on a daemon thread, with a progress bar on a terminal),
        warm up, log the one-line summary, then report SERVING."""
        from tqdm import tqdm

        from ..engine.async_engine import AsyncEngine
        from ..engine.builder import build_engine

        started = time.monotonic()
        stages = (["generation model", "warm-up"] if self.engine_config is not None else []) + \
            (["embedding model"] if self.server_config.embedding_model != "" else [])
        with tqdm(total=len(stages), desc="loading", unit="stage", disable=None, leave=False) as bar:
            if self.engine_config is not None:
                bar.set_postfix_str(stages[0])
                engine, info = await _in_daemon_thread(build_engine, self.engine_config)
                bar.update()
                bar.set_postfix_str(stages[1])
                await _in_daemon_thread(_warm_up, engine)
                bar.update()
                inner = AsyncEngine(engine, on_dead=self._on_engine_dead)
                self.state.engine = MeteredEngine(inner, self.metrics, info.name)
                self.metrics.bind_engine(engine.stats, info.name)
                inner.start()
                self.state.engine_info = info
            if self.server_config.embedding_model == LLM_EMBEDDING:
                if self.state.engine is None:
                    raise ValueError('--embedding-model llm needs a generation model (it embeds through its engine)')
                from ..engine.llm_embedder import LLMEmbedder

                info = self.state.engine_info
                self.state.embedder = self.state.embed_batcher = LLMEmbedder(
                    inner, name=info.name, architecture=info.architecture, dtype=info.dtype, device=info.device)
                bar.update()
            elif self.server_config.embedding_model and \
                    (decoder := await _in_daemon_thread(_decoder_embedding, self.server_config.embedding_model)):
                bar.set_postfix_str(stages[-1])
                from ..engine.llm_embedder import LLMEmbedder, build_decoder_engine

                engine, emb_info = await _in_daemon_thread(build_decoder_engine, decoder, self.engine_config)
                await _in_daemon_thread(_warm_up, engine)
                emb_engine = AsyncEngine(engine)
                emb_engine.start()
                self.state.embedder = self.state.embed_batcher = LLMEmbedder(
                    emb_engine, name=self.server_config.embedding_model, architecture=emb_info.architecture,
                    dtype=emb_info.dtype, device=emb_info.device, normalize_module=decoder.normalize,
                    max_input_tokens=decoder.max_seq_length, owns_engine=True)
                bar.update()
            elif self.server_config.embedding_model != "":
                bar.set_postfix_str(stages[-1])
                self.state.embedder = await _in_daemon_thread(_load_embedder, self.server_config.embedding_model)
                from ..engine.embed_batcher import EmbedBatcher, default_num_threads

                self.state.embed_batcher = EmbedBatcher(
                    self.state.embedder, self.server_config.max_embed_batch_tokens,
                    tokenize_executor=self.state.embed_executor, num_threads=self.server_config.embed_threads
                    or default_num_threads(self.state.engine is not None, self.state.embedder.device))
                bar.update()
        self.state.loading = False
        self._log_summary(time.monotonic() - started)
        if not self.state.shutting_down:
            await self.health.set(SERVICE_NAME, SERVING)

    def _log_summary(self, load_s: float) -> None:
        info, emb = self.state.engine_info, self.state.embedder
        fields = {}
        if info is not None:
            fields.update(model=info.name, dtype=info.dtype, device=info.device, backend=info.attention_backend,
                          kv_blocks=info.num_kv_blocks, block_size=info.block_size, max_model_len=info.max_model_len)
        if emb is not None:
            fields.update(embedding_model=emb.name, embedding_dim=emb.dimension)
        log.info("ready", **fields, grpc=f"{self.server_config.host}:{self.port}", metrics_port=self.metrics_port,
                 load_s=round(load_s, 2))

    def _on_engine_dead(self, exc: BaseException) -> None:
        asyncio.ensure_future(self.health.set(SERVICE_NAME, NOT_SERVING))
        asyncio.ensure_future(self.health.set("", NOT_SERVING))

    def end_grace_now(self) -> None:
        """Cut a running :meth:`stop`'s drain short (a second SIGTERM/SIGINT)."""
        self._end_grace.set()

    async def stop(self, grace_s: float | None = None) -> None:
        """Shutdown: health NOT_SERVING -> new InferenceService calls get UNAVAILABLE -> in-flight calls get up to
        ``grace_s`` (default ``shutdown_grace_s``) to finish -> generation streams still open end with ABORT
        -> the gRPC server stops -> the metrics endpoint closes."""
        grace_s = self.server_config.shutdown_grace_s if grace_s is None else grace_s
        self.state.shutting_down = True
        await self.health.enter_graceful_shutdown()
        log.info("shutdown_started", in_flight=self.calls.num_in_flight, grace_s=grace_s)
        deadline = time.monotonic() + grace_s
        while self.calls.num_in_flight and time.monotonic() < deadline and not self._end_grace.is_set():
            try:
                await asyncio.wait_for(self._end_grace.wait(), min(0.05, max(0.0, deadline - time.monotonic())))
            except asyncio.TimeoutError:
                pass
        cut = self.calls.num_in_flight
        engine = self.state.engine
        if engine is not None:
            await engine.shutdown()  # aborts what is still live: those streams get their ABORT message
        await self.server.stop(FLUSH_S)
        if self.state.embed_batcher is not None:
            self.state.embed_batcher.close()
            if hasattr(self.state.embed_batcher, "aclose"):  # a decoder embedding model's own engine
                await self.state.embed_batcher.aclose()
        self.state.embed_executor.shutdown(wait=False, cancel_futures=True)
        self.metrics.stop_http()
        log.info("server_stopped", calls_cut_at_grace_end=cut)


async def _in_daemon_thread(fn, *args):
    """``fn(*args)`` on a daemon thread (a process told to stop mid-load need not wait for it)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def run() -> None:
        try:
            outcome = (True, fn(*args))
        except BaseException as exc:  # handed to the awaiting coroutine
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass

    threading.Thread(target=run, name=f"pagedserve-load-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return await future


def _warm_up(engine) -> None:
    """One tiny request through the whole step path, so the first client request does not pay for it."""
    from ..engine.sampling_params import SamplingParams

    engine.add_request("__warmup__", [0, 1, 2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.kv_cache.reset_stats()


def _decoder_embedding(path: str):
    """sentence-transformers pipeline of ``path`` when it is a decoder embedding model directory, else None."""
    from ..engine.llm_embedder import decoder_embedding_config

    return decoder_embedding_config(path) if os.path.isdir(path) else None


def _load_embedder(path: str | None):
    from ..engine.embedder import Embedder
    from ..models.loader import embedded_embedding_path

    return Embedder.from_pretrained(path or embedded_embedding_path())


async def create_server(server_config: ServerConfig, engine_config: EngineConfig | None) -> tuple[App, int]:
    """Build, bind and start a server (port 0 picks a free one); models are not loaded yet. Returns (app, port)."""
    app = App(server_config, engine_config)
    port = await app.start()
    return app, port
