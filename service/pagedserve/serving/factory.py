"""Builds the services from the configuration: the generation engine, the embedding service, their model facts.

The front ends (gRPC app, HTTP app) only serve what this hands them. Loading runs on daemon threads (a process
told to stop mid-load need not wait), with a progress bar on a terminal. Tests build servers through this same
factory, passing their own engine builder (e.g. one that reuses already loaded weights).
"""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable

import structlog

from ..config import EngineConfig, ServerConfig
from ..embedding import EmbeddingService
from ..embedding.scoring import CrossEncoderScorer, EmbeddingScorer, ScoringService
from ..engine import builder
from ..engine.async_engine import AsyncEngine
from ..sampling_params import SamplingParams
from .generation import GenerationService
from .metrics import ServerMetrics
from .prompts import template_renders_tools
from .services import Services

log = structlog.get_logger(__name__)

LLM_EMBEDDING = "llm"  # --embedding-model value: embed with the generation model (last-token pooling)


class ServiceFactory:
    """Builds :class:`Services` from the two configs.

    Args:
        server_config: which models to serve (``generation_model``, ``embedding_model``, ``rerank_model``) and
            the embedder's batching settings.
        engine_config: the generation engine's settings (also the base of a decoder embedding model's engine).
        build_engine: ``build_engine(EngineConfig) -> (LLMEngine, EngineInfo)``; default
            :func:`pagedserve.engine.builder.build_engine`.
    """

    def __init__(self, server_config: ServerConfig, engine_config: EngineConfig,
                 build_engine: Callable = builder.build_engine):
        self.server_config = server_config
        self.engine_config = engine_config
        self.build_engine = build_engine

    async def load(self, services: Services, metrics: ServerMetrics,
                   on_engine_dead: Callable[[BaseException], None] | None = None) -> None:
        """Load every configured model into ``services`` (warmed up), binding engine stats to ``metrics``.

        Without ``rerank_model``, Rerank / Score use the embedding model's cosine (when one is loaded).

        Raises:
            FileNotFoundError, ValueError: a missing or unsupported model, ``--embedding-model llm`` without
                a generation model, or a rerank model with more than one label.
        """
        from tqdm import tqdm

        cfg = self.server_config
        stages = (["generation model"] if cfg.generation_model else []) + \
            (["embedding model"] if cfg.embedding_model != "" else []) + \
            (["rerank model"] if cfg.rerank_model else [])
        with tqdm(total=len(stages), desc="loading", unit="stage", disable=None, leave=False) as bar:
            if cfg.generation_model:
                bar.set_postfix_str("generation model")
                services.generation = await self._generation(metrics, on_engine_dead, services.generation_name)
                bar.update()
            if cfg.embedding_model != "":
                bar.set_postfix_str("embedding model")
                services.embedding = await self._embedding(services.generation)
                bar.update()
            if cfg.rerank_model:
                bar.set_postfix_str("rerank model")
                services.rerank = await in_daemon_thread(self._cross_encoder, cfg.rerank_model,
                                                         services.generation is not None)
                services.rerank_name = cfg.rerank_model
                bar.update()
            elif services.embedding is not None:
                services.rerank = EmbeddingScorer(services.embedding)
                services.rerank_name = services.embedding_name

    async def _generation(self, metrics: ServerMetrics, on_dead, served_name: str) -> GenerationService:
        engine, info = await in_daemon_thread(self.build_engine, self.engine_config)
        await in_daemon_thread(warm_up, engine)
        front = AsyncEngine(engine, on_dead=on_dead)
        front.start()
        metrics.bind_engine(engine.stats, served_name, info.tensor_parallel_size)
        template = load_chat_template(self.server_config.chat_template)
        if self.server_config.enable_auto_tool_choice:
            warn_if_template_ignores_tools(template or getattr(front.tokenizer, "chat_template", None))
        return GenerationService(front, info, metrics, served_name, template, self.engine_config.reasoning_parser)

    async def _embedding(self, generation: GenerationService | None) -> EmbeddingService:
        from ..embedding.decoder import LLMEmbedder, build_decoder_engine, decoder_embedding_config

        path = self.server_config.embedding_model
        if path == LLM_EMBEDDING:
            if generation is None:
                raise ValueError("--embedding-model llm needs a generation model (it embeds through its engine)")
            info = generation.info
            return LLMEmbedder(generation.engine, name=info.name, architecture=info.architecture, dtype=info.dtype,
                               device=info.device)
        decoder = await in_daemon_thread(decoder_embedding_config, path) if path and os.path.isdir(path) else None
        if decoder is not None:
            engine, info = await in_daemon_thread(build_decoder_engine, decoder, self.engine_config)
            await in_daemon_thread(warm_up, engine)
            front = AsyncEngine(engine)
            front.start()
            return LLMEmbedder(front, name=path, architecture=info.architecture, dtype=info.dtype, device=info.device,
                               normalize_module=decoder.normalize, max_input_tokens=decoder.max_seq_length,
                               owns_engine=True)
        return await in_daemon_thread(self._encoder, path, generation is not None)

    def _encoder(self, path: str | None, shares_cpu: bool) -> EmbeddingService:
        from ..embedding.batcher import EmbedBatcher, default_num_threads
        from ..embedding.encoder import Embedder
        from ..models.loader import embedded_embedding_path

        embedder = Embedder.from_pretrained(path or embedded_embedding_path())
        threads = self.server_config.embed_threads or default_num_threads(shares_cpu, embedder.device)
        return EmbedBatcher(embedder, self.server_config.max_embed_batch_tokens, num_threads=threads)


    def _cross_encoder(self, path: str, shares_cpu: bool) -> ScoringService:
        from ..embedding.batcher import EmbedBatcher, default_num_threads
        from ..embedding.cross_encoder import CrossEncoder

        model = CrossEncoder.from_pretrained(path, max_batch_tokens=self.server_config.max_embed_batch_tokens)
        threads = self.server_config.embed_threads or default_num_threads(shares_cpu, model.device)
        batcher = EmbedBatcher(model, self.server_config.max_embed_batch_tokens, num_threads=threads)
        try:
            return CrossEncoderScorer(batcher)
        except ValueError:
            batcher.close()
            raise


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it is a template (has ``{{`` or ``{%``) as vLLM
    accepts. Raises ValueError (naming the flag) for a path that is not a readable file."""
    if value is None or "{{" in value or "{%" in value:
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"chat_template: cannot read {value!r}: {exc.strerror}") from None


def warn_if_template_ignores_tools(template: str | dict | None) -> bool:
    """With auto tool choice on: log a warning when the chat template in use never references ``tools``, so
    requests' tools never reach the prompt (the model cannot know them). Returns whether it warned."""
    if template_renders_tools(template):
        return False
    log.warning("chat_template_ignores_tools", hint="tool_choice auto needs a template that renders the tools "
                "variable: pass --chat-template FILE (named or required tool_choice still work, via the grammar)")
    return True


async def in_daemon_thread(fn, *args):
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


def warm_up(engine) -> None:
    """One tiny request through the whole step path, so the first client request does not pay for it."""
    engine.add_request("__warmup__", [0, 1, 2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.kv_cache.reset_stats()
