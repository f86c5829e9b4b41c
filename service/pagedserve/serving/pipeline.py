"""The one request pipeline both APIs call: a :class:`GenerationRequest` in, a stream of :class:`ChoiceDelta` out.

:func:`open_generation` is the entry. It applies the request's tool plan (:mod:`.tools`), checks and renders each
prompt (:meth:`GenerationService.prepare`), starts the engine requests and waits for the first delta, so that an
admission error (bad value, full queue, duplicate id) is raised before the front end sends a byte. Then
:class:`GenerationStream` yields each delta with its choice index, its content and tool-call pieces (the tool
parser's reading of the text), the choice's finish reason (``"tool_calls"`` for a choice that called tools) and
the usage so far; it logs each request and records its metrics. Leaving the stream early (or :meth:`close`) aborts
what still runs, which frees its KV blocks. The request carries the caller's field names (``request.fields``):
:func:`~.caller_errors.caller_error` with them tells any error of the request as the caller spelled the field.

With the server's --reasoning-parser and ``request.reasoning`` (chat, gRPC), each choice's text is split into
reasoning and content first (:mod:`.reasoning`); the tool parser reads the content only, and the usage counts the
reasoning's tokens.

The front ends only translate: wire request -> :class:`GenerationRequest`, :class:`ChoiceDelta` -> wire message.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from ..errors import PagedServeError
from ..outputs import CompletionDelta, Usage
from ..tool_calls import ToolPlan
from .caller_errors import ENGINE_NAMES, FieldNames
from .call_trace import CallTrace
from .generation import GenerateCall, GenerationService
from .prompts import ChatPrompt
from .reasoning import StreamedReasoning, prompt_tail
from .tools import StreamedToolCalls, apply_tools, finish_reason, reads_tools

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One API request: its engine calls and what the pipeline does around them."""

    calls: tuple[GenerateCall, ...]    # one per prompt (the completions API takes several; all with the same n)
    tools: ToolPlan | None = None      # the request's tools (None: none)
    fields: FieldNames = ENGINE_NAMES  # how the caller spells the fields errors name
    stream_tools: bool = True          # read each delta for tool calls (False: the caller reads the whole text)
    reasoning: bool = False            # split each choice's reasoning (chat, with the server's --reasoning-parser)
    include_reasoning: bool = True     # False: the reasoning text is dropped (still counted in usage)


@dataclass(slots=True)
class UsageTotal:
    """Token counts over the engine requests of one API request (several prompts)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    reasoning_tokens: int = 0          # completion tokens of the reasoning part (with a reasoning parser)

    def add(self, usage: Usage) -> None:
        """Count one engine request's final usage."""
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.cached_prompt_tokens += usage.cached_prompt_tokens


@dataclass(slots=True)
class ChoiceDelta:
    """One engine delta as the front ends shape it."""

    index: int                         # the choice: prompt index * n + completion index
    prompt_index: int
    delta: CompletionDelta             # as the engine sent it (tokens, logprobs, usage, matched stop)
    content: str                       # the text to show: the delta's, less what the tool parser read as calls
    finish_reason: str | None          # the delta's; "tool_calls" for a choice that called tools and stopped
    tool_calls: list[dict] = field(default_factory=list)  # new tool-call pieces (index, id, type, function)
    reasoning: str | None = None       # new reasoning text (None: this piece was not read as reasoning)


async def open_generation(generation: GenerationService, request: GenerationRequest,
                          trace: CallTrace | None = None) -> GenerationStream:
    """Start ``request`` and return its stream once the first delta is in. With ``trace`` (the call's, tracing
    on) the call's span is described, its engine requests record their timings and its usage is set on close.

    Raises (naming the engine's fields; ``caller_error(exc, request.fields)`` names the caller's):
        InvalidInputError: a bad prompt, sampling value or tool choice for this model (naming the field).
        DuplicateRequestError, QueueFullError: from admission.
        EngineUnavailableError: shutting down or the engine died.
    """
    stream = GenerationStream(generation, request, trace)
    await stream.open()
    return stream


class GenerationStream:
    """The deltas of one :class:`GenerationRequest`, merged over its calls (see :func:`open_generation`)."""

    def __init__(self, generation: GenerationService, request: GenerationRequest, trace: CallTrace | None = None):
        self.generation, self.request, self.trace = generation, request, trace
        self._finish_reasons: dict[int, str] = {}   # choice index -> finish reason (kept for the trace)
        self.n = request.calls[0].params.n
        self.usage = UsageTotal()
        self.prompt_ids: list[list[int]] = []   # each call's prompt token ids, once open
        self._tools = StreamedToolCalls(request.tools) if request.stream_tools and reads_tools(request.tools) \
            else None
        self._reasoning: StreamedReasoning | None = None   # set once the prompts are rendered
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._direct: AsyncIterator[CompletionDelta] | None = None   # one call: iterated in the caller's task
        self._first: list[tuple[int, CompletionDelta | None]] = []

    async def open(self) -> None:
        """Prepare every call, start it and wait for the first delta (see :func:`open_generation`)."""
        calls = [apply_tools(c, self.request.tools, self.request.fields) for c in self.request.calls]
        if self.trace is not None:
            operation = "chat" if isinstance(calls[0].prompt, ChatPrompt) else "text_completion"
            self.trace.describe(operation, self.generation.served_name, calls[0].params)
        self.prompt_ids = [await self.generation.prepare(c) for c in calls]
        parser = getattr(self.generation, "reasoning", None)
        if self.request.reasoning and parser is not None:
            tails = [prompt_tail(self.generation.tokenizer, ids) for ids in self.prompt_ids]
            self._reasoning = StreamedReasoning(parser, tails, self.request.include_reasoning)
        if len(calls) == 1:
            self._direct = self._run(calls[0], self.prompt_ids[0])
        else:
            self._tasks = [asyncio.ensure_future(self._pump(i, c, ids))
                           for i, (c, ids) in enumerate(zip(calls, self.prompt_ids))]
        try:
            self._first = [await self._next()]
        except BaseException:
            await self.close()
            raise

    async def __aiter__(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas until all have finished."""
        open_calls = len(self.request.calls)
        pending, self._first = self._first, []
        while open_calls:
            prompt_index, delta = pending.pop() if pending else await self._next()
            if delta is None:
                open_calls -= 1
                continue
            yield self._choice(prompt_index, delta)

    async def close(self) -> None:
        """Abort whatever still runs (idempotent); a traced call gets its usage and finish reasons."""
        if self.trace is not None:
            u = self.usage
            self.trace.set_result(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens,
                                  [self._finish_reasons[i] for i in sorted(self._finish_reasons)])
        if self._direct is not None:
            await self._direct.aclose()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _choice(self, prompt_index: int, d: CompletionDelta) -> ChoiceDelta:
        if d.usage is not None:
            self.usage.add(d.usage)
        index = prompt_index * self.n + d.index
        if d.finish_reason is not None and self.trace is not None:
            self._finish_reasons[index] = d.finish_reason
        text, reasoning, final = d.text, None, d.finish_reason is not None
        if self._reasoning is not None:
            text, reasoning = self._reasoning.feed(index, prompt_index, text, len(d.token_ids), final)
            self.usage.reasoning_tokens = self._reasoning.reasoning_tokens
        if self._tools is None:
            return ChoiceDelta(index, prompt_index, d, text, d.finish_reason, reasoning=reasoning)
        content, calls, called = self._tools.feed(index, text, final)
        return ChoiceDelta(index, prompt_index, d, content, finish_reason(d.finish_reason, called), calls,
                           reasoning)

    async def _next(self) -> tuple[int, CompletionDelta | None]:
        """The next (prompt index, delta); a delta of None: that call has ended."""
        if self._direct is not None:
            try:
                return 0, await self._direct.__anext__()
            except StopAsyncIteration:
                return 0, None
        prompt_index, item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return prompt_index, item

    async def _pump(self, prompt_index: int, call: GenerateCall, ids: list[int]) -> None:
        try:
            async for delta in self._run(call, ids):
                self._queue.put_nowait((prompt_index, delta))
            self._queue.put_nowait((prompt_index, None))
        except BaseException as exc:  # handed to the consumer
            self._queue.put_nowait((prompt_index, exc))

    async def _run(self, call: GenerateCall, ids: list[int]) -> AsyncIterator[CompletionDelta]:
        """One engine request's deltas, logged and metered; leaving early aborts it."""
        request_id = call.request_id or uuid.uuid4().hex
        params, metrics = call.params, self.generation.request_metrics
        log.info("generate_start", request_id=request_id, prompt_tokens=len(ids), max_tokens=params.max_tokens,
                 n=params.n)
        times = metrics.start(params.n, len(ids))
        timings = self.trace.engine_timings(request_id) if self.trace is not None else None
        engine_stream = self.generation.engine.generate(request_id, ids, params, call.priority, call.cache_salt,
                                                        call.deadline, call.caller, timings)
        num_tokens, refused = 0, False
        try:
            async for delta in engine_stream:
                metrics.on_delta(delta, times)
                num_tokens += len(delta.token_ids)
                if delta.finish_reason is not None:
                    log.info("completion_finished", request_id=request_id, index=delta.index,
                             finish_reason=delta.finish_reason, completion_tokens=num_tokens)
                yield delta
        except PagedServeError:
            refused = True
            raise
        finally:
            await engine_stream.aclose()
            metrics.on_end(times, refused)
            if times.open_completions > 0:  # the consumer left (cancel, deadline, disconnect) or the request failed
                log.info("generate_cancelled", request_id=request_id, open_completions=times.open_completions,
                         completion_tokens=num_tokens)
