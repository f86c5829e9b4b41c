"""The OpenAI endpoints over the serving layer: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``.

Each handler maps its body to a :class:`~pagedserve.serving.pipeline.GenerationRequest` (or embedding inputs), runs
it through the request pipeline the gRPC front end uses too, and shapes OpenAI's response or server-sent-event
chunks; an error names the body field as sent (the request's :class:`~pagedserve.serving.caller_errors.FieldNames`).
Errors the engine raises at admission (bad values, full queue) surface before any byte of a stream is sent, so
they get their HTTP status; a failure mid-stream becomes an ``error`` event followed by ``data: [DONE]``.

A client that goes away (closed connection, stream left early) cancels the handler, which aborts its engine
requests and frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..embedding.interface import EmbedInputs
from ..errors import PagedServeError
from ..serving.caller_errors import FieldNames
from ..serving.generation import GenerateCall
from ..serving.pipeline import GenerationRequest, GenerationStream, open_generation
from ..serving.prompts import TextPrompt
from ..serving.services import Services
from ..serving.tracing import current_call_trace
from ..tool_calls import plan_tools
from . import convert as cv
from .chat_shaper import ChatShaper
from .completion_shaper import CompletionShaper
from .errors import OpenAIError, error_body, from_exception
from .protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest


class OpenAIServing:
    """The handlers, bound to the services and the names they are served under.

    Args:
        services: the process's services; ``model`` must carry their served names (a missing ``model`` takes it).
        auto_tool_parser: the --tool-call-parser when --enable-auto-tool-choice is on (``tool_choice: auto``),
            else None.
    """

    def __init__(self, services: Services, auto_tool_parser: str | None = None,
                 callers: Callable[[Mapping[str, str]], str] | None = None):
        self.services = services
        self.auto_tool_parser = auto_tool_parser
        self.callers = callers  # request headers -> the caller's name (fair shares; serving/callers.py)
        self.generation_name = services.generation_name
        self.embedding_name = services.embedding_name

    # ---- model names -------------------------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        names = []
        if self.services.generation is not None and self.generation_name:
            names.append(self.generation_name)
        if self.services.embedding is not None and self.embedding_name and self.embedding_name not in names:
            names.append(self.embedding_name)
        if self.services.rerank is not None and self.services.rerank_name not in names:
            names.append(self.services.rerank_name)   # a cross-encoder (the cosine fallback is the embedding's)
        return names

    def max_model_len(self, name: str) -> int | None:
        """The longest context of the model served as ``name``, in tokens (an embedding model's longest input)."""
        if self.services.generation is not None and name == self.generation_name:
            return self.services.generation.info.max_model_len
        if self.services.embedding is not None and name == self.embedding_name:
            return self.services.embedding.info.max_input_tokens
        return None

    def model_details(self, name: str) -> dict:
        """What the generation model served as ``name`` is (beside vLLM's card fields; {} for another model):
        ``architecture`` (the HF name), ``sliding_windows`` (the distinct windows in tokens; [] with none),
        ``num_experts`` / ``num_experts_per_token`` (0: dense) and ``kv_layout`` (``num_layers``, ``num_kv_heads``,
        ``head_dim``, ``kv_cache_dtype``, ``block_size``), as ``GetModelInfo`` gives them."""
        if self.services.generation is None or name != self.generation_name:
            return {}
        info = self.services.generation.info
        return {"architecture": info.architecture, "sliding_windows": sorted({w for w in info.sliding_windows if w}),
                "num_experts": info.num_experts, "num_experts_per_token": info.num_experts_per_token,
                "kv_layout": {"num_layers": info.num_layers, "num_kv_heads": info.num_kv_heads,
                              "head_dim": info.head_dim, "kv_cache_dtype": info.kv_cache_dtype,
                              "block_size": info.block_size}}

    def _check_model(self, model: str | None, served: str | None, kind: str) -> str:
        if model is None or model == served:
            return served or ""
        raise OpenAIError(404, f"The model `{model}` does not exist (this server's {kind} model is `{served}`)",
                          "not_found_error", "model", "model_not_found")

    # ---- chat / completions ------------------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request):
        """``/v1/chat/completions``; an error names the body field as sent."""
        fields = cv.chat_fields(body)
        return await _naming_fields(self._chat(body, request, fields), fields)

    async def completions(self, body: CompletionRequest, request: Request):
        """``/v1/completions``; an error names the body field as sent."""
        fields = cv.completion_fields(body)
        return await _naming_fields(self._completions(body, request, fields), fields)

    async def embeddings(self, body: EmbeddingRequest) -> dict:
        """``/v1/embeddings``; an error names the body field as sent (``input``, ``input[i]``)."""
        return await _naming_fields(self._embeddings(body), cv.embedding_fields(body))

    async def _chat(self, body: ChatCompletionRequest, request: Request, fields: FieldNames):
        cv.check_unsupported(body)
        cv.check_best_of(body)
        _check_stream_options(body)
        generation = self.services.require_generation()
        model = self._check_model(body.model, self.generation_name, "generation")
        k = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.auto_tool_parser)
        max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        params = cv.sampling_params(body, max_tokens, k)
        call = GenerateCall(cv.chat_prompt(body), params, body.request_id, body.priority, body.cache_salt,
                            _deadline(body), self._caller(request))
        reasoning = generation.reasoning is not None
        wanted = GenerationRequest((call,), plan, fields, body.stream, reasoning, body.include_reasoning)
        stream = await open_generation(generation, wanted, current_call_trace())
        text = cv.TokenText(generation.tokenizer, body.return_tokens_as_token_ids)
        shaper = ChatShaper(cv.new_id("chatcmpl"), model, text, k is not None, plan,
                            reasoning and body.include_reasoning, reasoning)
        return await _respond(stream, shaper, body, request)

    async def _completions(self, body: CompletionRequest, request: Request, fields: FieldNames):
        cv.check_unsupported(body)
        cv.check_best_of(body)
        _check_stream_options(body)
        generation = self.services.require_generation()
        model = self._check_model(body.model, self.generation_name, "generation")
        prompts = cv.completion_prompts(body.prompt)
        echo_lps = body.logprobs if body.echo and body.logprobs is not None else None
        prompt_only = body.echo and body.max_tokens == 0  # vLLM's scoring path: the prompt and its logprobs only
        params = cv.sampling_params(body, 1 if prompt_only else body.max_tokens, body.logprobs, echo_lps)
        rid = body.request_id
        calls = tuple(GenerateCall(p, params, f"{rid}-{i}" if rid and len(prompts) > 1 else rid, body.priority,
                                   body.cache_salt, _deadline(body), self._caller(request))
                      for i, p in enumerate(prompts))
        stream = await open_generation(generation, GenerationRequest(calls, None, fields), current_call_trace())
        text = cv.TokenText(generation.tokenizer, body.return_tokens_as_token_ids)
        echo = [(p.text if isinstance(p, TextPrompt) else text.decode(ids), ids)
                for p, ids in zip(prompts, stream.prompt_ids)] if body.echo else None
        shaper = CompletionShaper(cv.new_id("cmpl"), model, text, body.logprobs is not None, echo, prompt_only)
        return await _respond(stream, shaper, body, request)

    def _caller(self, request: Request) -> str:
        return self.callers(request.headers) if self.callers is not None else ""

    # ---- embeddings --------------------------------------------------------------------------------------------
    async def _embeddings(self, body: EmbeddingRequest) -> dict:
        embedding = self.services.require_embedding()
        model = self._check_model(body.model, self.embedding_name, "embedding")
        inputs: EmbedInputs
        if isinstance(body.input, str):
            inputs = [body.input]
        elif body.input and all(isinstance(t, int) for t in body.input):
            inputs = [list(body.input)]
        else:
            inputs = list(body.input)
        result = await embedding.embed(inputs, normalize=True, truncate=body.truncate_prompt_tokens is not None,
                                       dimensions=body.dimensions)
        vectors = result.vectors.numpy().astype(np.float32)
        data = []
        for i, row in enumerate(vectors):
            value = base64.b64encode(row.tobytes()).decode() if body.encoding_format == "base64" else row.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        return {"object": "list", "model": model, "data": data,
                "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}}


async def _naming_fields(work, fields: FieldNames):
    """``await work``, with an engine error it raises answered as the OpenAI error naming the field as ``fields``
    spell it."""
    try:
        return await work
    except PagedServeError as exc:
        raise from_exception(exc, fields) from None


def _deadline(body) -> float | None:
    """The body's ``timeout`` (seconds) as an absolute ``time.monotonic()`` deadline; None without one."""
    return time.monotonic() + body.timeout if body.timeout is not None else None


def _check_stream_options(body) -> None:
    """``stream_options`` goes with ``stream: true`` only (OpenAI and vLLM refuse it alone)."""
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "is only allowed with stream: true", param="stream_options")


async def _respond(stream: GenerationStream, shaper, body, request: Request) -> Response:
    """The stream as server-sent events (``stream: true``), or the whole response."""
    if body.stream:
        return _sse(stream, shaper, body.stream_options)
    return _json_or_gone(await _collect(stream, shaper, request))


async def _collect(stream: GenerationStream, shaper, request: Request) -> dict | None:
    """Run the whole request and return the response body; a client that disconnects first cancels it (None)."""
    async def consume() -> None:
        async for choice in stream:
            shaper.add(choice)

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            return None  # the client went away: nothing to answer (the finally aborts the requests)
        work.result()  # re-raises what failed
        return shaper.response(shaper.usage(stream.usage))
    finally:
        gone.cancel()
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        await stream.close()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _json_or_gone(body: dict | None) -> Response:
    """The response body, or for a client that left, an empty 499 (nginx's "client closed request"; never sent)."""
    return Response(status_code=499) if body is None else JSONResponse(body)


def _sse(stream: GenerationStream, shaper, options) -> StreamingResponse:
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)

    async def events() -> AsyncIterator[str]:
        try:
            async for choice in stream:
                for chunk in shaper.chunks(choice):
                    if continuous:
                        chunk["usage"] = shaper.usage(stream.usage)
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            if include_usage:
                yield f"data: {json.dumps(shaper.usage_chunk(shaper.usage(stream.usage)))}\n\n"
        except Exception as exc:  # mid-stream: the status line is gone, so the error travels as an event
            err = from_exception(exc, stream.request.fields)
            yield f"data: {json.dumps(error_body(err.status, err.message, err.type, err.param))}\n\n"
        finally:
            await stream.close()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
