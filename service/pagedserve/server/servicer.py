"""The InferenceService servicer: thin; conversion lives in :mod:`.convert`, errors map in :mod:`.interceptors`."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import structlog

from pagedserve_client.v1 import inference_pb2 as pb
from pagedserve_client.v1 import inference_pb2_grpc as pb_grpc

from ..errors import EngineUnavailableError, InvalidInputError, ModelNotLoadedError
from . import convert
from .state import ServerState

log = structlog.get_logger(__name__)


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """Implements pagedserve.v1.InferenceService over a :class:`ServerState` (engines filled in once loaded)."""

    def __init__(self, state: ServerState):
        self.state = state

    def _llm(self):
        if self.state.shutting_down:
            raise EngineUnavailableError("the server is shutting down")
        if self.state.engine is None:
            if self.state.loading:
                raise EngineUnavailableError("the models are still loading")
            raise ModelNotLoadedError("no generation model is loaded")
        return self.state.engine

    def _embedder(self):
        if self.state.shutting_down:
            raise EngineUnavailableError("the server is shutting down")
        if self.state.embedder is None:
            if self.state.loading:
                raise EngineUnavailableError("the models are still loading")
            raise ModelNotLoadedError("no embedding model is loaded")
        return self.state.embedder

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        engine = self._llm()
        request_id = request.request_id or uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            params = convert.sampling_from_proto(request.sampling)
            tokenizer = engine.engine.tokenizer
            # Off the event loop: tokenizing a multi-megabyte prompt must not stall other calls (tokenizers
            # releases the GIL).
            prompt_ids = await asyncio.to_thread(convert.prompt_from_proto, request, tokenizer)
            log.info("generate_start", prompt_tokens=len(prompt_ids), max_tokens=params.max_tokens, n=params.n)
            num_tokens = 0
            async for delta in engine.generate(request_id, prompt_ids, params, request.priority,
                                               request.cache_salt or None):
                num_tokens += len(delta.token_ids)
                if delta.finish_reason is not None:
                    log.info("completion_finished", index=delta.index, finish_reason=delta.finish_reason,
                             completion_tokens=num_tokens)
                yield convert.delta_to_proto(delta, tokenizer)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

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
        embedder = self._embedder()
        if not request.inputs:
            raise InvalidInputError("needs at least one text", "inputs")
        options = convert.embed_options(request)
        batcher = getattr(self.state, "embed_batcher", None)
        if batcher is not None:
            result = await batcher.embed(list(request.inputs), **options)
        else:  # no batcher wired: one call at a time on the embed executor
            result = await asyncio.get_running_loop().run_in_executor(
                self.state.embed_executor, lambda: embedder.embed(list(request.inputs), **options))
        resp = pb.EmbedResponse(request_id=request.request_id, stream_index=stream_index)
        resp.embeddings.extend(pb.Embedding(values=row) for row in result.vectors.tolist())
        resp.usage.prompt_tokens = result.prompt_tokens
        return resp

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        tokenizer = self._llm().engine.tokenizer
        return await asyncio.to_thread(self._tokenize, request, tokenizer)  # long texts must not stall the loop

    @staticmethod
    def _tokenize(request: pb.TokenizeRequest, tokenizer) -> pb.TokenizeResponse:
        which = request.WhichOneof("input")
        add_gen = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
        if which == "messages":
            ids = convert.apply_chat_template(tokenizer, convert.messages_to_dicts(request.messages, "messages"),
                                              "messages", add_gen)
        elif which == "text":
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = tokenizer.encode(request.text, add_special_tokens=add_special)
        else:
            raise InvalidInputError("exactly one of text or messages is required", "input")
        return pb.TokenizeResponse(token_ids=ids, tokens=tokenizer.convert_ids_to_tokens(ids))

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        engine = self._llm().engine
        bad = [t for t in request.token_ids if t >= engine.vocab_size]
        if bad:
            raise InvalidInputError(f"token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})",
                                    "token_ids")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text=engine.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip))

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        resp = pb.GetModelInfoResponse()
        info = self.state.engine_info
        if info is not None:
            resp.generation.CopyFrom(pb.GenerationModelInfo(
                name=info.name, architecture=info.architecture, dtype=info.dtype, max_model_len=info.max_model_len,
                vocab_size=info.vocab_size, block_size=info.block_size, num_kv_blocks=info.num_kv_blocks,
                kv_block_bytes=info.kv_block_bytes, attention_backend=info.attention_backend, device=info.device,
                prefix_caching=info.prefix_caching, quantization=info.quantization))
        emb = self.state.embedder
        if emb is not None:
            resp.embedding.CopyFrom(pb.EmbeddingModelInfo(
                name=emb.name, architecture=emb.architecture, dtype=emb.dtype, max_input_tokens=emb.max_input_tokens,
                embedding_dimension=emb.dimension, pooling=emb.pooling))
        if self.state.engine is not None:
            resp.kv_cache.CopyFrom(pb.KVCacheStats(**self.state.engine.engine.stats()))
        return resp

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        engine = self._llm()
        return pb.AbortResponse(aborted_request_ids=await engine.abort(list(request.request_ids)))
