"""Embeddings from a decoder (Llama-family) model through the generation engine's own prefill.

Each input becomes a pooling request of the :class:`~pagedserve.engine.llm_engine.LLMEngine`: it is scheduled,
chunked, prefix-cached and batched with Generate traffic like any prompt, and its output is the final hidden state
of its last token (last-token pooling, as decoder embedding models such as E5-Mistral or GTE-Qwen2 use it; the
sentence-transformers ``pooling_mode_lasttoken`` semantics). Nothing is sampled and its KV blocks are freed (and
stay reusable through the prefix cache) when its prompt is done.

Served with ``--embedding-model llm`` (the ``--model`` itself).
"""
from __future__ import annotations

import asyncio
import uuid

import torch

from ..errors import InvalidInputError
from .embedder import EmbedResult, Embedder


class LLMEmbedder:
    """The Embed API over an :class:`~pagedserve.engine.async_engine.AsyncEngine`, last-token pooling.

    It stands where :class:`~pagedserve.engine.embed_batcher.EmbedBatcher` stands (``await embed(...)``) and
    carries the model facts :class:`~pagedserve.engine.embedder.Embedder` exposes for GetModelInfo. Batching
    across calls is the engine's continuous batching.

    Args:
        engine: the running async engine (its ``engine`` attribute is the :class:`LLMEngine`).
        name: served model name.
        architecture: ``config.architectures[0]`` of the model.
        dtype: the model's dtype name, e.g. ``"float32"``.
        device: where the model runs.
        normalize_module: the model's own pipeline ends in a Normalize module (its vectors are unit length).
    """

    pooling = "lasttoken"

    def __init__(self, engine, *, name: str, architecture: str, dtype: str, device, normalize_module: bool = True):
        self._engine = engine
        inner = engine.engine
        self.tokenizer = inner.tokenizer
        self.name, self.architecture, self.dtype, self.device = name, architecture, dtype, torch.device(device)
        self.normalize_module = normalize_module
        self.max_input_tokens = inner.max_model_len
        self.dimension = int(inner.runner.model.config.hidden_size)

    def check_dimensions(self, dimensions: int | None) -> None:
        """Raises InvalidInputError (field "dimensions") unless ``dimensions`` is None or in ``[1, dimension]``."""
        if dimensions is not None and not 0 < dimensions <= self.dimension:
            raise InvalidInputError(f"must be in [1, {self.dimension}], got {dimensions}", field="dimensions")

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Token ids per text with the model's special tokens (``add_special_tokens=True``).

        Raises:
            InvalidInputError: "inputs" for an empty list; "inputs[i]" for a non-string, an empty tokenization, or
                more than ``max_input_tokens`` tokens without ``truncate`` (with it, the first tokens are kept).
        """
        if not texts:
            raise InvalidInputError("at least one input is required", field="inputs")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidInputError(f"must be a string, got {type(text).__name__}", field=f"inputs[{i}]")
        limit = self.max_input_tokens
        ids = self.tokenizer(list(texts), add_special_tokens=True, truncation=truncate,
                             max_length=limit if truncate else None, verbose=False)["input_ids"]
        for i, seq in enumerate(ids):
            if not seq:
                raise InvalidInputError("tokenizes to no tokens", field=f"inputs[{i}]")
            if len(seq) > limit:
                raise InvalidInputError(f"input has {len(seq)} tokens, more than the model's limit of {limit} "
                                        f"tokens (set truncate to keep the first {limit})", field=f"inputs[{i}]")
        return ids

    async def embed(self, texts: list[str], normalize: bool = True, truncate: bool = False,
                    dimensions: int | None = None) -> EmbedResult:
        """Embed texts: ``[N, D']`` float32 vectors in input order (``Embedder.embed`` semantics for
        ``normalize`` and ``dimensions``), ``prompt_tokens`` = tokens run, special tokens included.

        Raises:
            InvalidInputError: see :meth:`tokenize`; "dimensions" out of range.
            QueueFullError, EngineUnavailableError: from the engine. Cancelling aborts every input's request.
        """
        self.check_dimensions(dimensions)
        token_ids = await asyncio.to_thread(self.tokenize, texts, truncate)  # long texts must not stall the loop
        call_id = uuid.uuid4().hex
        tasks = [asyncio.ensure_future(self._engine.embed(f"embed-{call_id}-{i}", seq, field=f"inputs[{i}]"))
                 for i, seq in enumerate(token_ids)]
        try:
            outcomes = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # a failed or cancelled call takes its other inputs out of the engine
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        vectors = torch.stack([vec for vec, _ in outcomes])
        if self.normalize_module:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=-1)
        return EmbedResult(Embedder.finish(vectors, normalize, dimensions), sum(map(len, token_ids)))

    def close(self) -> None:
        """Nothing of its own to stop: the engine's shutdown ends its requests."""
