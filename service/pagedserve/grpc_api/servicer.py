"""The InferenceService servicer: thin; conversion lives in :mod:`.convert`, errors map in :mod:`.interceptors`,
generation runs through the request pipeline (:mod:`pagedserve.serving.pipeline`)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping

from pagedserve_client.v1 import inference_pb2 as pb
from pagedserve_client.v1 import inference_pb2_grpc as pb_grpc

from ..errors import InvalidInputError
from ..serving.pipeline import open_generation
from ..serving.rerank import rerank, score
from ..serving.services import Services
from ..serving.tracing import current_call_trace
from . import convert


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """Implements pagedserve.v1.InferenceService over :class:`~pagedserve.serving.services.Services` (filled in
    once the models are loaded): each method maps proto to plain types and back, nothing more."""

    def __init__(self, services: Services, auto_tool_parser: str | None = None,
                 callers: Callable[[Mapping[str, str]], str] | None = None, fair_share_by: str | None = None):
        self.services = services
        self.auto_tool_parser = auto_tool_parser  # --tool-call-parser when --enable-auto-tool-choice is on
        self.callers = callers                    # metadata -> the caller's name (fair shares; serving/callers.py)
        self.fair_share_by = fair_share_by        # --fair-share-by (GetModelInfo says it)

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        generation = self.services.require_generation()
        remaining = context.time_remaining()  # seconds until the call's deadline; None without one
        deadline = time.monotonic() + remaining if remaining is not None else None
        caller = self.callers(dict(context.invocation_metadata() or ())) if self.callers else ""
        stream = await open_generation(generation, convert.generation_request_from_proto(
            request, self.auto_tool_parser, deadline, caller, generation.reasoning is not None),
            current_call_trace())
        try:
            async for choice in stream:
                yield convert.choice_to_proto(choice, generation.tokenizer, stream.usage.reasoning_tokens)
        finally:
            await stream.close()

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        return await self._embed(request, 0)

    async def EmbedStream(self, request_iterator, context) -> AsyncIterator[pb.EmbedResponse]:
        """Requests are embedded concurrently (up to 64 in flight; the stream reads no further until one is
        answered), so they batch together; responses go out in request order, each with its request_id and
        stream_index. A failing request ends the stream with its status; leaving the stream cancels the requests
        still in flight."""
        window = asyncio.Semaphore(64)
        in_flight: asyncio.Queue = asyncio.Queue()   # tasks in request order, then None (end of requests)

        async def read() -> None:
            try:
                index = 0
                async for request in request_iterator:
                    await window.acquire()
                    in_flight.put_nowait(asyncio.ensure_future(self._embed(request, index)))
                    index += 1
            finally:
                in_flight.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (task := await in_flight.get()) is not None:
                response = await task
                window.release()
                yield response
            await reader                                  # re-raises a failure to read the requests
        finally:
            reader.cancel()
            while not in_flight.empty():
                if (task := in_flight.get_nowait()) is not None:
                    task.cancel()

    async def _embed(self, request: pb.EmbedRequest, stream_index: int) -> pb.EmbedResponse:
        embedding = self.services.require_embedding()
        if not request.inputs:
            raise InvalidInputError("needs at least one text", "inputs")
        result = await embedding.embed(list(request.inputs), **convert.embed_options(request))
        resp = pb.EmbedResponse(request_id=request.request_id, stream_index=stream_index)
        resp.embeddings.extend(pb.Embedding(values=row) for row in result.vectors.tolist())
        resp.usage.prompt_tokens = result.prompt_tokens
        return resp

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        generation = self.services.require_generation()
        ids, tokens = await generation.tokenize(convert.tokenize_prompt_from_proto(request))
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        generation = self.services.require_generation()
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text=generation.detokenize(list(request.token_ids), skip))

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        resp = pb.GetModelInfoResponse()
        generation, embedding = self.services.generation, self.services.embedding
        if generation is not None:
            config = generation.engine.engine.config
            resp.scheduling.CopyFrom(pb.SchedulingInfo(
                deadline_scheduling=config.deadline_scheduling, max_queue_time_s=config.max_queue_time_s,
                fair_share_by=self.fair_share_by or "", fair_share_weights=config.fair_share()))
        tracing = self.services.tracing
        resp.tracing.CopyFrom(pb.TracingInfo(enabled=True, **tracing.info()) if tracing is not None else
                              pb.TracingInfo(enabled=False))
        if generation is not None:
            info = generation.info
            resp.generation.CopyFrom(pb.GenerationModelInfo(
                name=info.name, architecture=info.architecture, dtype=info.dtype, max_model_len=info.max_model_len,
                vocab_size=info.vocab_size, block_size=info.block_size, num_kv_blocks=info.num_kv_blocks,
                kv_block_bytes=info.kv_block_bytes, attention_backend=info.attention_backend, device=info.device,
                prefix_caching=info.prefix_caching, quantization=info.quantization,
                tensor_parallel_size=info.tensor_parallel_size, compiled=info.compiled,
                kv_cache_dtype=info.kv_cache_dtype, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
                head_dim=info.head_dim, sliding_windows=info.sliding_windows, num_experts=info.num_experts,
                num_experts_per_token=info.num_experts_per_token,
                reasoning_parser=getattr(generation, "reasoning_parser", None) or "",
                batch_invariant=info.batch_invariant, kernels=info.kernels))
            fields = pb.KVCacheStats.DESCRIPTOR.fields_by_name  # (the engine's stats hold more, e.g. spec decode)
            resp.kv_cache.CopyFrom(pb.KVCacheStats(**{k: v for k, v in generation.kv_cache_stats().items()
                                                      if k in fields}))
        if embedding is not None:
            emb = embedding.info
            resp.embedding.CopyFrom(pb.EmbeddingModelInfo(
                name=emb.name, architecture=emb.architecture, dtype=emb.dtype, max_input_tokens=emb.max_input_tokens,
                embedding_dimension=emb.dimension, pooling=emb.pooling))
        if self.services.rerank is not None:
            info = self.services.rerank.info
            resp.rerank.CopyFrom(pb.RerankModelInfo(
                name=info.name, kind=info.kind, architecture=info.architecture, dtype=info.dtype,
                max_input_tokens=info.max_input_tokens, activation=info.activation))
        return resp

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        generation = self.services.require_generation()
        return pb.AbortResponse(aborted_request_ids=await generation.abort(list(request.request_ids)))

    async def Rerank(self, request: pb.RerankRequest, context) -> pb.RerankResponse:
        scorer = self.services.require_rerank()
        top_n = request.top_n if request.HasField("top_n") else None
        result = await rerank(scorer, request.query, list(request.texts), top_n, request.truncate)
        resp = pb.RerankResponse()
        for ranked in result.results:
            entry = resp.results.add(index=ranked.index, score=ranked.score)
            if request.return_text:
                entry.text = request.texts[ranked.index]
        resp.usage.prompt_tokens = result.prompt_tokens
        return resp

    async def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        scorer = self.services.require_rerank()
        result = await score(scorer, list(request.text_1), list(request.text_2), request.truncate)
        return pb.ScoreResponse(scores=result.scores, usage=pb.EmbedUsage(prompt_tokens=result.prompt_tokens))
