"""Synchronous pagedserve client over a grpc channel (grpcio + protobuf only).

Every method raises grpc.RpcError (its .code() and .details() carry the server's status) when the call fails.
Unary methods are retried by gRPC itself on UNAVAILABLE (service config in _convert.service_config_json);
Generate never is.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

from . import _convert
from .targets import channel_target
from ._convert import GenerationResult, Message
from ._stream import ResponseStream
from .v1 import inference_pb2 as pb
from .v1 import inference_pb2_grpc as pb_grpc

_UNSET: Any = object()


class PagedServeClient:
    """Blocking client for pagedserve.v1.InferenceService and grpc.health.v1.Health.

    target: "host:port", or several replicas ("dns:///name:port", "ipv4:a:port,b:port" or "a:port,b:port"), which
    get round-robin load balancing (see pagedserve_client.targets; ValueError for a list of host names).
    timeout_s: default deadline in seconds for every call (None: no deadline); each method takes timeout= to
    override it (for generate the deadline covers the whole stream). channel_options: extra grpc channel arguments,
    overriding the defaults by key. credentials: grpc.ChannelCredentials for TLS (see tls_credentials), else an
    insecure channel. api_key: sent as `authorization: Bearer <key>` metadata on InferenceService calls (default:
    the PAGEDSERVE_API_KEY environment variable; health checks need none). Use as a context manager or call close().
    """

    def __init__(self, target: str = _convert.DEFAULT_TARGET, *, timeout_s: float | None = None,
                 channel_options: Iterable[tuple[str, Any]] | None = None,
                 credentials: grpc.ChannelCredentials | None = None, api_key: str | None = None) -> None:
        target, round_robin = channel_target(target)
        options = _convert.channel_options(list(channel_options or ()), round_robin)
        self._metadata = _convert.auth_metadata(api_key)
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=options)
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
                 **sampling: Any) -> ResponseStream[pb.GenerateResponse]:
        """Stream the GenerateResponse messages of one prompt as the server produces them.

        Exactly one of prompt / prompt_token_ids / messages; `sampling` takes sampling_params()'s keywords
        (max_tokens, temperature, top_p, top_k, min_p, seed, stop, n, logprobs, ...) and tools / tool_choice /
        parallel_tool_calls in OpenAI's shapes (calls come back in GenerateResponse.tool_calls). close() on the returned
        stream (or `with`) cancels the RPC, and the server aborts the request. `metadata`: (key, value) pairs sent
        with this call after the API key's, e.g. W3C `("traceparent", ...)` / `("tracestate", ...)` so the server's
        span joins the caller's trace (`--otlp-traces-endpoint`), or the header a `--fair-share-by header:NAME`
        server reads the caller from. Raises ValueError/TypeError for bad arguments (a metadata key that is not
        lower case included) before any call, grpc.RpcError while iterating.
        """
        request = _convert.generate_request(prompt, prompt_token_ids=prompt_token_ids, messages=messages,
                                            request_id=request_id, priority=priority, cache_salt=cache_salt,
                                            **sampling)
        call = self.stub.Generate(request, **self._call_options(timeout, metadata))
        return ResponseStream(call)

    def generate_text(self, prompt: str | None = None, *, prompt_token_ids: Iterable[int] | None = None,
                      messages: Iterable[Message] | None = None, timeout: float | None = _UNSET,
                      **kwargs: Any) -> GenerationResult:
        """Run generate() to the end for one completion: (text, finish_reason name, usage, reasoning_text).

        Raises ValueError when n > 1 is asked for, grpc.RpcError on failure.
        """
        _convert.check_single_completion(kwargs)
        acc = _convert.TextAccumulator()
        for response in self.generate(prompt, prompt_token_ids=prompt_token_ids, messages=messages,
                                      timeout=timeout, **kwargs):
            acc.add(response)
        return acc.result()

    def embed(self, inputs: str | Iterable[str], normalize: bool | None = None, truncate: bool | None = None,
              dimensions: int | None = None, *, timeout: float | None = _UNSET) -> pb.EmbedResponse:
        """Embed a batch of texts: EmbedResponse.embeddings[i].values is input i's float32 vector.

        None leaves normalize (server default true), truncate (false) and dimensions (all) unset.
        """
        request = _convert.embed_request(inputs, normalize, truncate, dimensions)
        return self.stub.Embed(request, **self._call_options(timeout))

    def embed_stream(self, requests: Iterable[pb.EmbedRequest], *,
                     timeout: float | None = _UNSET) -> ResponseStream[pb.EmbedResponse]:
        """Send many EmbedRequests on one EmbedStream; responses carry request_id and stream_index."""
        return ResponseStream(self.stub.EmbedStream(iter(requests), **self._call_options(timeout)))

    def rerank(self, query: str, texts: str | Iterable[str], *, top_n: int | None = None, return_text: bool = False,
               truncate: bool = False, timeout: float | None = _UNSET) -> pb.RerankResponse:
        """Score every text against the query (the server's cross-encoder, else its embedding cosine):
        RerankResponse.results best first, each with its index in texts, its score and (return_text) the text;
        at most top_n of them. truncate cuts a pair longer than the model's limit (else INVALID_ARGUMENT)."""
        request = _convert.rerank_request(query, texts, top_n, return_text, truncate)
        return self.stub.Rerank(request, **self._call_options(timeout))

    def score(self, text_1: str | Iterable[str], text_2: str | Iterable[str], *, truncate: bool = False,
              timeout: float | None = _UNSET) -> list[float]:
        """Scores of the pairs: one text_1 against every text_2, or text_1[i] with text_2[i]; input order."""
        request = _convert.score_request(text_1, text_2, truncate)
        return list(self.stub.Score(request, **self._call_options(timeout)).scores)

    def tokenize(self, text: str | None = None, *, messages: Iterable[Message] | None = None,
                 add_special_tokens: bool | None = None, add_generation_prompt: bool | None = None,
                 timeout: float | None = _UNSET) -> pb.TokenizeResponse:
        """Text or chat messages to token ids (and token pieces) with the generation model's tokenizer."""
        request = _convert.tokenize_request(text, messages=messages, add_special_tokens=add_special_tokens,
                                            add_generation_prompt=add_generation_prompt)
        return self.stub.Tokenize(request, **self._call_options(timeout))

    def detokenize(self, token_ids: Iterable[int], skip_special_tokens: bool | None = None, *,
                   timeout: float | None = _UNSET) -> str:
        """Token ids to text."""
        request = _convert.detokenize_request(token_ids, skip_special_tokens)
        return self.stub.Detokenize(request, **self._call_options(timeout)).text

    def model_info(self, *, timeout: float | None = _UNSET) -> pb.GetModelInfoResponse:
        """The served models and live KV-cache counters."""
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), **self._call_options(timeout))

    def abort(self, request_ids: str | Iterable[str], *, timeout: float | None = _UNSET) -> list[str]:
        """Abort requests by id; returns the ids that were live and are now aborted (unknown ids are no error)."""
        response = self.stub.Abort(_convert.abort_request(request_ids), **self._call_options(timeout))
        return list(response.aborted_request_ids)

    def health(self, service: str = "", *, timeout: float | None = _UNSET) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN".

        service "" is the process; "pagedserve.v1.InferenceService" is SERVING once the models are loaded.
        Raises grpc.RpcError (NOT_FOUND for a service the server does not know), ImportError without
        grpcio-health-checking.
        """
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self._timeout(timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> PagedServeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

