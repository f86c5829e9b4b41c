"""The asyncio front of the engine: the step loop runs on its own thread and never blocks the event loop.

Callers on the event loop submit typed commands (:class:`AddRequest`, :class:`AddPoolingRequest`,
:class:`AbortRequests`) through a thread-safe queue; the engine thread wakes on an event (no polling), runs them
between steps, runs steps while there is work, and hands each step's deltas back to the loop in one
``call_soon_threadsafe``. Each request has an asyncio queue its ``generate()`` iterator reads. Leaving the iterator
early (client cancel, deadline) aborts the request, which frees its KV blocks at the next step.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import structlog
import torch

from ..errors import DuplicateRequestError, EngineUnavailableError
from ..outputs import CompletionDelta, EngineTimings, Usage
from ..sampling_params import SamplingParams
from .llm_engine import LLMEngine
from .timings import TimingRecorder

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a generation request (:meth:`LLMEngine.add_request`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    deadline: float | None = None   # time.monotonic() seconds
    caller: str = ""                # fair shares: who sent it
    timings: EngineTimings | None = None   # tracing: record the request's step times here (None: not traced)


@dataclass(frozen=True, slots=True)
class AddPoolingRequest:
    """Queue a pooling (embedding) request (:meth:`LLMEngine.add_pooling_request`)."""

    request_id: str
    token_ids: list[int]
    priority: int = 0
    cache_salt: str | None = None
    field: str = "inputs"        # the request field errors name


@dataclass(frozen=True, slots=True)
class AbortRequests:
    """Abort live requests; ``quiet``: their final deltas go to their streams and nobody awaits the result."""

    request_ids: tuple[str, ...]
    quiet: bool = False


EngineCommand = AddRequest | AddPoolingRequest | AbortRequests


class AsyncEngine:
    """Runs an :class:`LLMEngine` on a background thread.

    Args:
        engine: the engine (owned by the thread from :meth:`start` on).
        on_dead: called on the event loop once, with the exception, if the step loop dies.
    """

    def __init__(self, engine: LLMEngine, on_dead: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self._on_dead = on_dead
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: BaseException | None = None
        self.timings = TimingRecorder()   # the traced requests' step times (engine thread)

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort everything still live and stop the thread."""
        if self._thread is None:
            return
        await self.abort(list(self._streams))
        self._stopping = True
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        await asyncio.to_thread(self.engine.close)   # tensor-parallel workers stop with the engine

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    # ---- what the front ends may read of the engine (fixed at start-up) --------------------------------------
    @property
    def tokenizer(self):
        """The model's transformers tokenizer."""
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_waiting_requests(self) -> int:
        """The waiting queue's cap (0: unbounded)."""
        return self.engine.config.max_waiting_requests

    @property
    def hidden_size(self) -> int:
        """Width of the model's final hidden states (a pooling request's embedding)."""
        return self.engine.hidden_size

    def stats(self) -> dict[str, float]:
        """The engine's counters (:meth:`LLMEngine.stats`; read from the event loop, racing the step harmlessly)."""
        return self.engine.stats()

    # ---- API for the servicer ----------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       deadline: float | None = None, caller: str = "", timings: EngineTimings | None = None
                       ) -> AsyncIterator[CompletionDelta]:
        """Queue a request and yield its deltas until every completion has finished. ``deadline``: the call's, in
        ``time.monotonic()`` seconds (see :mod:`pagedserve.core.sched.deadlines`); ``caller``: who sent it (fair
        shares). With ``timings`` (tracing), the engine thread records the request's step times there (not for
        beam search), complete once the last delta is out.

        Raises (before the first delta):
            DuplicateRequestError, InvalidInputError, QueueFullError: from validation.
            DeadlineError: it cannot finish before ``deadline`` (also as the first delta's error, when refused
                while waiting).
            EngineUnavailableError: shutting down or the engine died (also raised mid-stream).
        """
        command = AddRequest(request_id, prompt_token_ids, params, priority, cache_salt, deadline, caller, timings)
        async for delta in self._stream(request_id, params.n, command):
            yield delta

    async def embed(self, request_id: str, token_ids: list[int], priority: int = 0, cache_salt: str | None = None,
                    field: str = "inputs") -> tuple[torch.Tensor, Usage]:
        """Run ``token_ids`` through the engine's prefill as a pooling request (batched with generation).

        Returns:
            The final hidden state of the last token ``[hidden]`` float32 on CPU (not normalized), and the usage.

        Raises:
            InvalidInputError (naming ``field``), DuplicateRequestError, QueueFullError: from validation.
            EngineUnavailableError: shutting down or the engine died.
        """
        command = AddPoolingRequest(request_id, token_ids, priority, cache_salt, field)
        async with contextlib.aclosing(self._stream(request_id, 1, command)) as deltas:
            async for delta in deltas:
                if delta.finish_reason is not None and delta.embedding is not None:
                    return delta.embedding, delta.usage
        raise EngineUnavailableError(f"request {request_id!r} ended without an embedding (aborted)")

    async def _stream(self, request_id: str, num_completions: int, command: EngineCommand
                      ) -> AsyncIterator[CompletionDelta]:
        """Queue a request with ``command`` on the engine thread and yield its deltas until its
        ``num_completions`` completions have finished; a consumer that stops early aborts it."""
        self._check_alive()
        if request_id in self._streams:
            raise DuplicateRequestError(f"request {request_id!r} is already running", "request_id")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        finished = False
        try:
            await self._submit(command)
            remaining = num_completions
            while remaining:
                delta = await stream.get()
                if isinstance(delta, BaseException):
                    raise delta
                if delta.error is not None:  # one completion failed: the finally aborts its siblings too
                    raise delta.error
                if delta.finish_reason is not None:
                    remaining -= 1
                finished = remaining == 0
                yield delta
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.dead is None and not self._stopping:
                self._commands.put((AbortRequests((request_id,), quiet=True), None))
                self._wakeup.set()

    async def abort(self, request_ids: list[str]) -> list[str]:
        """Abort live requests; returns the ids that were live. Idempotent."""
        if self.dead is not None or self._thread is None:
            return []
        aborted, deltas = await self._submit(AbortRequests(tuple(request_ids)))
        self._dispatch(deltas)
        return aborted

    # ---- internals ---------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineUnavailableError(f"the engine has failed: {self.dead!r}")
        if self._stopping or self._thread is None:
            raise EngineUnavailableError("the engine is shutting down")

    async def _submit(self, command: EngineCommand):
        self._check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((command, fut))
        self._wakeup.set()
        return await asyncio.wrap_future(fut)

    def _execute(self, command: EngineCommand):
        """Run one command on the engine thread; returns what the engine method returned."""
        if isinstance(command, AddRequest):
            children = self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                               command.priority, command.cache_salt, command.deadline,
                                               command.caller)
            if command.timings is not None and command.params.beam_search is None:
                self.timings.add(children, command.timings)
            return children
        if isinstance(command, AddPoolingRequest):
            return self.engine.add_pooling_request(command.request_id, command.token_ids, command.priority,
                                                   command.cache_salt, command.field)
        if isinstance(command, AbortRequests):
            aborted, deltas = self.engine.abort(list(command.request_ids))
            if command.quiet:
                if deltas:
                    self._loop.call_soon_threadsafe(self._dispatch, deltas)
                return None
            return aborted, deltas
        raise TypeError(f"unknown engine command {type(command).__name__}")

    def _drain_commands(self) -> None:
        while True:
            try:
                command, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut is not None and not fut.set_running_or_notify_cancel():
                continue  # the caller was cancelled before the command ran (its generate() queued an abort)
            try:
                result = self._execute(command)
            except Exception as exc:
                if fut is None:
                    log.exception("engine_command_failed")
                else:
                    fut.set_exception(exc)
            else:
                if fut is not None:
                    fut.set_result(result)

    def _run(self) -> None:
        try:
            while not self._stopping:
                if not self.engine.has_unfinished():
                    self._wakeup.wait()
                self._wakeup.clear()
                self._drain_commands()
                if self.engine.has_unfinished() and not self._stopping:
                    start = time.monotonic() if self.timings else 0.0
                    deltas = self.engine.step()
                    if self.timings:   # before the deltas go out: a final delta finds its timings complete
                        self.timings.on_step(start, time.monotonic(), self.engine.last_step_composition)
                    if deltas:
                        self._loop.call_soon_threadsafe(self._dispatch, deltas)
        except BaseException as exc:  # the step loop died: every open and new call gets UNAVAILABLE
            log.exception("engine_loop_died")
            self.dead = exc
            self._loop.call_soon_threadsafe(self._fail_all, exc)
        finally:
            self._fail_pending_commands()

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut is not None and not fut.done():
                fut.set_exception(EngineUnavailableError("the engine stopped"))

    def _dispatch(self, deltas: list[CompletionDelta]) -> None:
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is not None:
                stream.put_nowait(d)

    def _fail_all(self, exc: BaseException) -> None:
        err = EngineUnavailableError(f"the engine has failed: {exc!r}")
        for stream in self._streams.values():
            stream.put_nowait(err)
        if self._on_dead is not None:
            self._on_dead(exc)
