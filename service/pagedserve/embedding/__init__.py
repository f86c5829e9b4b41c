"""Embeddings behind one interface (:class:`EmbeddingService`): a BERT-family encoder with a cross-call batcher
(:mod:`.encoder`, :mod:`.batcher`), or a decoder model's last-token pooling through a generation engine
(:mod:`.decoder`). The front ends only see the interface."""
from .interface import EmbeddingModelInfo, EmbeddingService, EmbedInputs, EmbedResult

__all__ = ["EmbeddingModelInfo", "EmbeddingService", "EmbedInputs", "EmbedResult"]
