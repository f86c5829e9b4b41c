"""The OpenAI endpoints over the serving layer: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``.

Each handler maps its body to :class:`~pagedserve.serving.generation.GenerateCall` (or embedding inputs), runs it
through the same services the gRPC front end uses, and shapes OpenAI's response or server-sent-event chunks.
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
from collections.abc import AsyncIterator

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..embedding.interface import EmbedInputs
from ..errors import PagedServeError
from ..outputs import CompletionDelta
from ..serving.caller_errors import FieldNames
from ..serving.generation import GenerateCall, GenerationService
from ..serving.prompts import TextPrompt
from ..serving.services import Services
from ..tool_calls import plan_tools
from . import convert as cv
from .chat_shaper import ChatShaper
from .errors import OpenAIError, error_body, from_exception
from .protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest


class OpenAIServing:
    """The handlers, bound to the services and the names they are served under.

    Args:
        services: the process's services; ``model`` must carry their served names (a missing ``model`` takes it).
        auto_tool_parser: the --tool-call-parser when --enable-auto-tool-choice is on (``tool_choice: auto``),
            else None.
    """

    def __init__(self, services: Services, auto_tool_parser: str | None = None):
        self.services = services
        self.auto_tool_parser = auto_tool_parser
        self.generation_name = services.generation_name
        self.embedding_name = services.embedding_name

    # ---- model names -------------------------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        names = []
        if self.services.generation is not None and self.generation_name:
            names.append(self.generation_name)
        if self.services.embedding is not None and self.embedding_name and self.embedding_name not in names:
            names.append(self.embedding_name)
        return names

    def _check_model(self, model: str | None, served: str | None, kind: str) -> str:
        if model is None or model == served:
            return served or ""
        raise OpenAIError(404, f"The model `{model}` does not exist (this server's {kind} model is `{served}`)",
                          "not_found_error", "model", "model_not_found")

    # ---- chat / completions ------------------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request):
        """``/v1/chat/completions``; an error names the body field as sent."""
        fields = cv.chat_fields(body)
        return await _naming_fields(self._chat(body, request), fields)

    async def completions(self, body: CompletionRequest, request: Request):
        """``/v1/completions``; an error names the body field as sent."""
        fields = cv.completion_fields(body)
        return await _naming_fields(self._completions(body, request), fields)

    async def embeddings(self, body: EmbeddingRequest) -> dict:
        """``/v1/embeddings``; an error names the body field as sent (``input``, ``input[i]``)."""
        return await _naming_fields(self._embeddings(body), cv.embedding_fields(body))

    async def _chat(self, body: ChatCompletionRequest, request: Request):
        cv.check_unsupported(body)
        _check_stream_options(body)
        generation = self.services.require_generation()
        model = self._check_model(body.model, self.generation_name, "generation")
        k = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.auto_tool_parser)
        max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        params = cv.sampling_params(body, max_tokens, k)
        if plan is not None and plan.schema is not None:
            params = cv.with_tool_constraint(body, params, plan.schema)
        calls = [GenerateCall(cv.chat_prompt(body), params, body.request_id, body.priority, body.cache_salt)]
        stream = _Stream(generation, calls, params.n)
        await stream.open()
        shaper = ChatShaper(cv.new_id("chatcmpl"), model, cv.TokenText(generation.tokenizer), params.n,
                            k is not None, plan)
        if body.stream:
            return _sse(stream, shaper, body.stream_options)
        return _json_or_gone(await _collect(stream, shaper, request))

    async def _completions(self, body: CompletionRequest, request: Request):
        cv.check_unsupported(body)
        _check_stream_options(body)
        generation = self.services.require_generation()
        model = self._check_model(body.model, self.generation_name, "generation")
        prompts = cv.completion_prompts(body.prompt)
        echo_lps = body.logprobs if body.echo and body.logprobs is not None else None
        prompt_only = body.echo and body.max_tokens == 0  # vLLM's scoring path: the prompt and its logprobs only
        params = cv.sampling_params(body, 1 if prompt_only else body.max_tokens, body.logprobs, echo_lps)
        rid = body.request_id
        calls = [GenerateCall(p, params, f"{rid}-{i}" if rid and len(prompts) > 1 else rid, body.priority,
                              body.cache_salt) for i, p in enumerate(prompts)]
        stream = _Stream(generation, calls, params.n)
        prompt_ids = await stream.open()
        text = cv.TokenText(generation.tokenizer)
        echo = [(p.text if isinstance(p, TextPrompt) else text.decode(ids), ids)
                for p, ids in zip(prompts, prompt_ids)] if body.echo else None
        shaper = _CompletionShaper(cv.new_id("cmpl"), model, text, params.n, body.logprobs is not None, echo,
                                   prompt_only)
        if body.stream:
            return _sse(stream, shaper, body.stream_options)
        return _json_or_gone(await _collect(stream, shaper, request))

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


def _check_stream_options(body) -> None:
    """``stream_options`` goes with ``stream: true`` only (OpenAI and vLLM refuse it alone)."""
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "is only allowed with stream: true", param="stream_options")


async def _naming_fields(work, fields: FieldNames):
    """``await work``, with an engine error it raises answered as the OpenAI error naming the field as ``fields``
    spell it."""
    try:
        return await work
    except PagedServeError as exc:
        raise from_exception(exc, fields) from None


class _Stream:
    """The engine streams of one HTTP request's prompts, merged; choice index = prompt index * n + completion."""

    def __init__(self, generation: GenerationService, calls: list[GenerateCall], n: int):
        self.generation, self.calls, self.n = generation, calls, n
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._first: list = []

    async def open(self) -> list[list[int]]:
        """Render the prompts and start every request; waits for the first delta so that admission errors
        (raised before any delta) surface here, as an exception, not inside a started stream. Returns the
        prompts' token ids."""
        prompt_ids = [await self.generation.prepare(c) for c in self.calls]
        for i, (call, ids) in enumerate(zip(self.calls, prompt_ids)):
            self._tasks.append(asyncio.ensure_future(self._pump(i, call, ids)))
        try:
            self._first = [await self._next()]
        except BaseException:
            await self.close()
            raise
        return prompt_ids

    async def _pump(self, i: int, call: GenerateCall, ids: list[int]) -> None:
        try:
            async for delta in self.generation.generate(call, ids):
                self._queue.put_nowait((i, delta))
            self._queue.put_nowait((i, None))
        except BaseException as exc:  # handed to the consumer
            self._queue.put_nowait((i, exc))

    async def _next(self):
        item = await self._queue.get()
        if isinstance(item[1], BaseException):
            raise item[1]
        return item

    async def deltas(self) -> AsyncIterator[tuple[int, CompletionDelta]]:
        """(prompt index, delta) pairs until every request has finished."""
        open_requests = len(self.calls)
        pending = self._first
        self._first = []
        while open_requests:
            i, delta = pending.pop(0) if pending else await self._next()
            if delta is None:
                open_requests -= 1
                continue
            yield i, delta

    async def close(self) -> None:
        """Cancel whatever still runs (its engine requests are aborted)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class _CompletionShaper:
    """Text completion responses and chunks; ``echo`` (per prompt) prepends each prompt's text; ``prompt_only``
    (echo with max_tokens 0) drops the one token the engine sampled: text, logprobs and usage show the prompt
    alone."""

    def __init__(self, rid: str, model: str, text: cv.TokenText, n: int, logprobs: bool,
                 echo: list[tuple[str, list[int]]] | None, prompt_only: bool = False):
        self.rid, self.model, self.text, self.n, self.logprobs = rid, model, text, n, logprobs
        self.echo = echo                   # per prompt: (its text, its token ids), when echo was asked for
        self.prompt_only = prompt_only
        self.created = cv.now_s()
        self.usage = cv.UsageSum()
        self._seen: set[int] = set()
        self._lps: dict[int, cv.CompletionLogprobs] = {}
        self._prompt_lps: dict[int, list] = {}
        self._choices: dict[int, dict] = {}

    def _choice_lps(self, prompt_index: int, d: CompletionDelta) -> tuple[str, cv.CompletionLogprobs | None]:
        """(echoed prompt text or "", the choice's logprobs builder) for this delta."""
        index = prompt_index * self.n + d.index
        if d.prompt_logprobs:  # on the request's first delta
            self._prompt_lps[prompt_index] = d.prompt_logprobs
        lps = self._lps.setdefault(index, cv.CompletionLogprobs(self.text)) if self.logprobs else None
        prefix = ""
        if index not in self._seen:
            self._seen.add(index)
            if self.echo is not None:
                prefix, ids = self.echo[prompt_index]
                if lps is not None:  # the first prompt token has no logprob
                    by_pos = dict(enumerate(self._prompt_lps.get(prompt_index, []), start=1))
                    for pos, tid in enumerate(ids):
                        lp = by_pos.get(pos)
                        lps.add_token(tid, None if lp is None else lp.logprob, None if lp is None else lp.top)
        if lps is not None and not self.prompt_only:
            lps.add(d.logprobs or [])
        return prefix, lps

    def _text_of(self, prefix: str, d: CompletionDelta) -> str:
        return prefix if self.prompt_only else prefix + d.text

    def _add_usage(self, d: CompletionDelta) -> None:
        if d.usage is not None:
            self.usage.add(d.usage)
            if self.prompt_only:
                self.usage.completion = 0

    def chunks(self, prompt_index: int, d: CompletionDelta) -> list[dict]:
        prefix, lps = self._choice_lps(prompt_index, d)
        self._add_usage(d)
        choice = {"index": prompt_index * self.n + d.index, "text": self._text_of(prefix, d),
                  "logprobs": lps.take() if lps is not None else None, "finish_reason": d.finish_reason}
        if d.finish_reason is not None:
            choice["stop_reason"] = d.matched_stop
        return [{"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                 "system_fingerprint": cv.FINGERPRINT, "choices": [choice]}]

    def usage_chunk(self) -> dict:
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": cv.FINGERPRINT, "choices": [], "usage": self.usage.as_dict()}

    def add(self, prompt_index: int, d: CompletionDelta) -> None:
        prefix, _ = self._choice_lps(prompt_index, d)
        index = prompt_index * self.n + d.index
        c = self._choices.setdefault(index, {"index": index, "text": [], "finish": None, "stop": None})
        c["text"].append(self._text_of(prefix, d))
        if d.finish_reason is not None:
            c["finish"], c["stop"] = d.finish_reason, d.matched_stop
        self._add_usage(d)

    def response(self) -> dict:
        choices = [{"index": i, "text": "".join(c["text"]),
                    "logprobs": self._lps[i].as_dict() if self.logprobs else None,
                    "finish_reason": c["finish"], "stop_reason": c["stop"]}
                   for i, c in sorted(self._choices.items())]
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": cv.FINGERPRINT, "choices": choices, "usage": self.usage.as_dict()}


async def _collect(stream: _Stream, shaper, request: Request) -> dict | None:
    """Run the whole request and return the response body; a client that disconnects first cancels it (None)."""
    async def consume() -> None:
        async for i, delta in stream.deltas():
            shaper.add(i, delta)

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            return None  # the client went away: nothing to answer (the finally aborts the requests)
        work.result()  # re-raises what failed
        return shaper.response()
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


def _sse(stream: _Stream, shaper, options) -> StreamingResponse:
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)

    async def events() -> AsyncIterator[str]:
        try:
            async for i, delta in stream.deltas():
                for chunk in shaper.chunks(i, delta):
                    if continuous:
                        chunk["usage"] = shaper.usage.as_dict()
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            if include_usage:
                yield f"data: {json.dumps(shaper.usage_chunk())}\n\n"
        except Exception as exc:  # mid-stream: the status line is gone, so the error travels as an event
            err = from_exception(exc)
            yield f"data: {json.dumps(error_body(err.status, err.message, err.type, err.param))}\n\n"
        finally:
            await stream.close()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
