"""asyncio pagedserve client over a grpc.aio channel (grpcio + protobuf only).

Same methods and arguments as the sync PagedServeClient, as coroutines; generate() and embed_stream() return
async iterators. Failures raise grpc.aio.AioRpcError (a grpc.RpcError).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
import grpc.aio

from . import _convert
from .targets import channel_target
from ._convert import GenerationResult, Message
from ._stream import AsyncResponseStream
from .v1 import inference_pb2 as pb
from .v1 import inference_pb2_grpc as pb_grpc

_UNSET: Any = object()


class AsyncPagedServeClient:
    """Non-blocking client for pagedserve.v1.InferenceService and grpc.health.v1.Health.

    Arguments as PagedServeClient: target "host:port" (or several replicas, balanced round robin), timeout_s
    default deadline (seconds) per call, channel_options overriding the defaults by key, credentials for TLS,
    api_key (default: PAGEDSERVE_API_KEY).
    Use `async with` or `await close()`.
    """

    def __init__(self, target: str = _convert.DEFAULT_TARGET, *, timeout_s: float | None = None,
                 channel_options: Iterable[tuple[str, Any]] | None = None,
                 credentials: grpc.ChannelCredentials | None = None, api_key: str | None = None) -> None:
        target, round_robin = channel_target(target)
        options = _convert.channel_options(list(channel_options or ()), round_robin)
        self._metadata = _convert.auth_metadata(api_key)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=options)
        self.target = target
        self.timeout_s = timeout_s
        self.stub = pb_grpc.InferenceServiceStub(self._channel)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout_s if timeout is _UNSET else timeout

    def _call_options(self, timeout: float | None, metadata: Iterable[tuple[str, str]] | None = None) -> dict:
        """Deadline and metadata (the API key, then ``metadata``) of one InferenceService call."""
        return {"timeout": self._timeout(timeout), "metadata": _convert.call_metadata(self._metadata, metadata)}

    def generate(self, prompt: str | None = None, *, prompt_token_ids: Iterable[int] | None = None,
                 messages: Iterable[Message] | None = None, request_id: str = "", priority: int = 0,
                 cache_salt: str = "", timeout: float | None = _UNSET,
                 metadata: Iterable[tuple[str, str]] | None = None,
                 **sampling: Any) -> AsyncResponseStream[pb.GenerateResponse]:
        """Async-iterate the GenerateResponse messages of one prompt as the server produces them.

        Arguments as PagedServeClient.generate. aclose() on the returned stream (or
        `async with`) cancels the RPC.
        Raises ValueError/TypeError for bad arguments at once, grpc.aio.AioRpcError while iterating.
        """
        request = _convert.generate_request(prompt, prompt_token_ids=prompt_token_ids, messages=messages,
                                            request_id=request_id, priority=priority, cache_salt=cache_salt,
                                            **sampling)
        return AsyncResponseStream(self.stub.Generate(request, **self._call_options(timeout, metadata)))

    async def generate_text(self, prompt: str | None = None, *, prompt_token_ids: Iterable[int] | None = None,
                            messages: Iterable[Message] | None = None, timeout: float | None = _UNSET,
                            **kwargs: Any) -> GenerationResult:
        """Run generate() to the end for one completion: (text, finish_reason name, usage, reasoning_text)."""
        _convert.check_single_completion(kwargs)
        acc = _convert.TextAccumulator()
        async for response in self.generate(prompt, prompt_token_ids=prompt_token_ids, messages=messages,
                                            timeout=timeout, **kwargs):
            acc.add(response)
        return acc.result()

    async def embed(self, inputs: str | Iterable[str], normalize: bool | None = None,
                    truncate: bool | None = None, dimensions: int | None = None, *,
                    timeout: float | None = _UNSET) -> pb.EmbedResponse:
        """Embed a batch of texts: EmbedResponse.embeddings[i].values is input i's float32 vector."""
        request = _convert.embed_request(inputs, normalize, truncate, dimensions)
        return await self.stub.Embed(request, **self._call_options(timeout))

    def embed_stream(self, requests: Iterable[pb.EmbedRequest] | AsyncIterator[pb.EmbedRequest], *,
                     timeout: float | None = _UNSET) -> AsyncResponseStream[pb.EmbedResponse]:
        """Send many EmbedRequests on one EmbedStream; responses carry request_id and stream_index."""
        return AsyncResponseStream(self.stub.EmbedStream(requests, **self._call_options(timeout)))

    async def rerank(self, query: str, texts: str | Iterable[str], *, top_n: int | None = None,
                     return_text: bool = False, truncate: bool = False,
                     timeout: float | None = _UNSET) -> pb.RerankResponse:
        """Score every text against the query: RerankResponse.results best first (see PagedServeClient.rerank)."""
        request = _convert.rerank_request(query, texts, top_n, return_text, truncate)
        return await self.stub.Rerank(request, **self._call_options(timeout))

    async def score(self, text_1: str | Iterable[str], text_2: str | Iterable[str], *, truncate: bool = False,
                    timeout: float | None = _UNSET) -> list[float]:
        """Scores of the pairs, input order (see PagedServeClient.score)."""
        request = _convert.score_request(text_1, text_2, truncate)
        return list((await self.stub.Score(request, **self._call_options(timeout))).scores)

    async def tokenize(self, text: str | None = None, *, messages: Iterable[Message] | None = None,
                       add_special_tokens: bool | None = None, add_generation_prompt: bool | None = None,
                       timeout: float | None = _UNSET) -> pb.TokenizeResponse:
        """Text or chat messages to token ids (and token pieces) with the generation model's tokenizer."""
        request = _convert.tokenize_request(text, messages=messages, add_special_tokens=add_special_tokens,
                                            add_generation_prompt=add_generation_prompt)
        return await self.stub.Tokenize(request, **self._call_options(timeout))

    async def detokenize(self, token_ids: Iterable[int], skip_special_tokens: bool | None = None, *,
                         timeout: float | None = _UNSET) -> str:
        """Token ids to text."""
        request = _convert.detokenize_request(token_ids, skip_special_tokens)
        return (await self.stub.Detokenize(request, **self._call_options(timeout))).text

    async def model_info(self, *, timeout: float | None = _UNSET) -> pb.GetModelInfoResponse:
        """The served models and live KV-cache counters."""
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), **self._call_options(timeout))

    async def abort(self, request_ids: str | Iterable[str], *, timeout: float | None = _UNSET) -> list[str]:
        """Abort requests by id; returns the ids that were live and are now aborted."""
        response = await self.stub.Abort(_convert.abort_request(request_ids), **self._call_options(timeout))
        return list(response.aborted_request_ids)

    async def health(self, service: str = "", *, timeout: float | None = _UNSET) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN"."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        request = health_pb2.HealthCheckRequest(service=service)
        response = await stub.Check(request, timeout=self._timeout(timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncPagedServeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

