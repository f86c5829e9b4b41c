"""The services one server process holds, and the lifecycle flags both front ends check before using them."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ServerConfig
from ..embedding import EmbeddingService
from ..embedding.scoring import ScoringService
from ..errors import EngineUnavailableError, ModelNotLoadedError
from .generation import GenerationService
from .tracing import Tracing


EMBEDDED_GENERATION_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_EMBEDDING_NAME = "all-MiniLM-L6-v2"


def served_names(config: ServerConfig, engine_model: str | None) -> tuple[str, str]:
    """(generation name, embedding name) the models are served under: what the HTTP API lists and accepts in
    ``model`` and the metrics' ``model_name`` label. ``--served-model-name``, else ``--model`` as given (vLLM's
    rule), else the embedded model's name; the embedding model's directory as given, or its embedded name."""
    generation = config.served_model_name or engine_model or EMBEDDED_GENERATION_NAME
    embedding = generation if config.embedding_model == "llm" else config.embedding_model or EMBEDDED_EMBEDDING_NAME
    return generation, embedding


@dataclass
class Services:
    """Filled in by :class:`~pagedserve.serving.factory.ServiceFactory` once the models are loaded."""

    generation_name: str = EMBEDDED_GENERATION_NAME   # see served_names
    embedding_name: str = EMBEDDED_EMBEDDING_NAME
    generation: GenerationService | None = None
    embedding: EmbeddingService | None = None
    rerank: ScoringService | None = None   # the cross-encoder, else the embedding model's cosine, else None
    rerank_name: str = ""                  # its served name: --rerank-model as given, or the embedding name
    loading: bool = True          # models still loading
    shutting_down: bool = False   # shutdown has begun: new work is refused
    tracing: Tracing | None = None  # OpenTelemetry tracing (--otlp-traces-endpoint); None: off

    def require_generation(self) -> GenerationService:
        """The generation service.

        Raises:
            EngineUnavailableError: still loading, or shutting down.
            ModelNotLoadedError: this server serves no generation model.
        """
        return self._require(self.generation, "generation")

    def require_embedding(self) -> EmbeddingService:
        """The embedding service; raises as :meth:`require_generation` does."""
        return self._require(self.embedding, "embedding")

    def require_rerank(self) -> ScoringService:
        """The scoring service of Rerank / Score; raises as :meth:`require_generation` does."""
        return self._require(self.rerank, "rerank (or embedding)")

    def _require(self, service, kind: str):
        self._check_open()
        if service is None:
            if self.loading:
                raise EngineUnavailableError("the models are still loading")
            raise ModelNotLoadedError(f"no {kind} model is loaded")
        return service

    def _check_open(self) -> None:
        if self.shutting_down:
            raise EngineUnavailableError("the server is shutting down")

    async def aclose(self) -> None:
        """Stop the generation engine (live requests end with "abort"), the rerank and embedding services."""
        if self.generation is not None:
            await self.generation.shutdown()
        if self.rerank is not None:
            await self.rerank.aclose()
        if self.embedding is not None:
            await self.embedding.aclose()
