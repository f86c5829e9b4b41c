"""The services one server process holds, and the lifecycle flags both front ends check before using them."""
from __future__ import annotations

from dataclasses import dataclass

from ..embedding import EmbeddingService
from ..errors import EngineUnavailableError, ModelNotLoadedError
from .generation import GenerationService


@dataclass
class Services:
    """Filled in by :class:`~pagedserve.serving.factory.ServiceFactory` once the models are loaded."""

    generation: GenerationService | None = None
    embedding: EmbeddingService | None = None
    loading: bool = True          # models still loading
    shutting_down: bool = False   # shutdown has begun: new work is refused

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
        """Stop the generation engine (live requests end with "abort") and the embedding service."""
        if self.generation is not None:
            await self.generation.shutdown()
        if self.embedding is not None:
            await self.embedding.aclose()
