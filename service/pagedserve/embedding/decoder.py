"""Embeddings from a decoder (Llama-family) model through the generation engine's own prefill.

Each input becomes a pooling request of the :class:`~pagedserve.engine.llm_engine.LLMEngine`: it is scheduled,
chunked, prefix-cached and batched with Generate traffic like any prompt, and its output is the final hidden state
of its last token (last-token pooling, as decoder embedding models such as E5-Mistral or GTE-Qwen2 use it; the
sentence-transformers ``pooling_mode_lasttoken`` semantics). Nothing is sampled and its KV blocks are freed (and
stay reusable through the prefix cache) when its prompt is done.

Served with ``--embedding-model llm`` (the ``--model`` itself), or with ``--embedding-model DIR`` for a decoder
embedding model directory (HF config with a registered causal-LM architecture, optionally a sentence-transformers
``modules.json`` asking for lasttoken pooling), which gets an engine of its own (:func:`build_decoder_engine`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import uuid

import torch

from ..config import EngineConfig
from .interface import (EmbeddingModelInfo, EmbedInputs, EmbedResult, check_dimensions, check_token_id_inputs,
                        finish_vectors, is_token_id_inputs, tokenize_inputs)
from .st_config import SentenceTransformersConfig, read_sentence_transformers_config

DECODER_EMBEDDING_KV_CACHE_BYTES = 256 * 2 ** 20  # a pooling request frees its blocks once its prompt is done
MAX_INPUTS_IN_FLIGHT = 256  # pooling requests one embedder keeps in the engine at once (at most half its queue)


class LLMEmbedder:
    """The Embed API over an :class:`~pagedserve.engine.async_engine.AsyncEngine`, last-token pooling.

    An :class:`~pagedserve.embedding.interface.EmbeddingService`, like
    :class:`~pagedserve.embedding.batcher.EmbedBatcher`. Batching across calls is the engine's continuous
    batching.

    Args:
        engine: the running async engine (its ``engine`` attribute is the :class:`LLMEngine`).
        name: served model name.
        architecture: ``config.architectures[0]`` of the model.
        dtype: the model's dtype name, e.g. ``"float32"``.
        device: where the model runs.
        normalize_module: the model's own pipeline ends in a Normalize module (its vectors are unit length).
    """

    pooling = "lasttoken"

    def __init__(self, engine, *, name: str, architecture: str, dtype: str, device, normalize_module: bool = True,
                 max_input_tokens: int | None = None, owns_engine: bool = False):
        self._engine = engine
        self._owns_engine = owns_engine
        self.tokenizer = engine.tokenizer
        self.name, self.architecture, self.dtype, self.device = name, architecture, dtype, torch.device(device)
        self.normalize_module = normalize_module
        self.max_input_tokens = min(max_input_tokens or engine.max_model_len, engine.max_model_len)
        # Inputs in the engine at once, over all calls: a call with thousands of texts must not fill the engine's
        # waiting queue (QueueFullError for everyone); the rest wait here.
        waiting_cap = engine.max_waiting_requests
        self.max_inputs_in_flight = min(MAX_INPUTS_IN_FLIGHT, max(1, waiting_cap // 2)) if waiting_cap else \
            MAX_INPUTS_IN_FLIGHT
        self._slots = asyncio.Semaphore(self.max_inputs_in_flight)
        self.dimension = engine.hidden_size
        self._vocab_size = engine.vocab_size

    def check_dimensions(self, dimensions: int | None) -> None:
        """Raises InvalidInputError (field "dimensions") unless ``dimensions`` is None or in ``[1, dimension]``."""
        check_dimensions(dimensions, self.dimension)

    @property
    def info(self) -> EmbeddingModelInfo:
        """The model facts GetModelInfo reports."""
        return EmbeddingModelInfo(self.name, self.architecture, self.dtype, self.max_input_tokens, self.dimension,
                                  self.pooling)

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Token ids per text with the model's special tokens; see
        :func:`~pagedserve.embedding.interface.tokenize_inputs` (limit ``max_input_tokens``) for truncation and the
        InvalidInputError raised."""
        return tokenize_inputs(self.tokenizer, texts, self.max_input_tokens, truncate)

    async def embed(self, inputs: EmbedInputs, normalize: bool = True, truncate: bool = False,
                    dimensions: int | None = None) -> EmbedResult:
        """Embed texts or token id sequences: ``[N, D']`` float32 vectors in input order (``Embedder.embed``
        semantics for ``normalize`` and ``dimensions``), ``prompt_tokens`` = tokens run, special tokens included.

        Raises:
            InvalidInputError: see :meth:`tokenize` and
                :func:`~pagedserve.embedding.interface.check_token_id_inputs`; "dimensions" out of range.
            QueueFullError, EngineUnavailableError: from the engine. Cancelling aborts every input's request.
        """
        self.check_dimensions(dimensions)
        if is_token_id_inputs(inputs):
            token_ids = check_token_id_inputs(list(inputs), self.max_input_tokens, self._vocab_size, truncate)
        else:  # long texts must not stall the loop
            token_ids = await asyncio.to_thread(self.tokenize, inputs, truncate)
        call_id = uuid.uuid4().hex
        tasks = [asyncio.ensure_future(self._embed_one(f"embed-{call_id}-{i}", seq, f"inputs[{i}]"))
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
        return EmbedResult(finish_vectors(vectors, normalize, dimensions), sum(map(len, token_ids)))

    async def _embed_one(self, request_id: str, token_ids: list[int], field: str) -> tuple[torch.Tensor, object]:
        async with self._slots:
            return await self._engine.embed(request_id, token_ids, field=field)

    async def aclose(self) -> None:
        """Stop the engine when it is this embedder's own (a decoder embedding directory), not the generation one."""
        if self._owns_engine:
            await self._engine.shutdown()


def decoder_embedding_config(path: str) -> SentenceTransformersConfig | None:
    """The pipeline of a decoder embedding model directory, or None when ``path`` is not one (no config.json, or
    an architecture that is not a registered causal LM: e.g. a BERT encoder).

    Without ``modules.json`` the pooling is lasttoken and there is no Normalize module.

    Raises:
        ValueError: the sentence-transformers pipeline asks for a pooling other than lasttoken (mean or CLS over a
            decoder would need the hidden states of prefix-cached tokens, which are not recomputed).
    """
    from ..models.registry import MODEL_REGISTRY

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        return None
    st = read_sentence_transformers_config(path)
    with open(os.path.join(st.model_dir, "config.json")) as f:
        architectures = json.load(f).get("architectures") or []
    if not architectures or architectures[0] not in MODEL_REGISTRY:
        return None
    if not os.path.isfile(os.path.join(path, "modules.json")):
        return dataclasses.replace(st, pooling="lasttoken", normalize=False)
    if st.pooling != "lasttoken":
        raise ValueError(f"{path}: decoder embedding models support lasttoken pooling only, not {st.pooling!r}")
    return st


def build_decoder_engine(st: SentenceTransformersConfig, base: EngineConfig | None):
    """Build (on the calling thread) the engine of a decoder embedding model: ``base``'s device, dtype and
    attention backend (defaults when None), its own KV cache of :data:`DECODER_EMBEDDING_KV_CACHE_BYTES`.

    Returns:
        ``(LLMEngine, EngineInfo)`` from :func:`pagedserve.engine.builder.build_engine` (not warmed up).
    """
    from ..engine.builder import build_engine

    base = base or EngineConfig()
    return build_engine(dataclasses.replace(base, model=st.model_dir, max_model_len=None, num_kv_blocks=None,
                                            kv_cache_memory_bytes=DECODER_EMBEDDING_KV_CACHE_BYTES))
