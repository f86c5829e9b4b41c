"""Dynamic batching of Embed calls (and cross-encoder Rerank/Score calls): the inputs of every waiting call share
micro-batches grouped by length.

Each call's texts are tokenized off the event loop, then every input becomes a pending item in one pool, kept
sorted by token length. A single worker thread repeatedly takes one micro-batch from the pool and runs it through
:meth:`Embedder.encode_micro_batch`; new calls join the pool between micro-batches, so a call's inputs can ride
with another call's (as text-embeddings-inference batches across requests).

Choosing a micro-batch: calls take turns (round robin) to anchor one: the anchor is the first pending input of the
call whose turn it is, so a small call is never stuck behind a large one and no call starves. The batch then
grows around the anchor in length order, one neighbour at a time (the one adding the least padding), while its
padded size ``rows * longest`` stays within ``max_batch_tokens`` and padding stays at most a set fraction of it
(the model runs packed, so padding costs attention work only). A single input longer than the budget runs alone.
Padded keys are masked, so the grouping never changes a vector.

Each call gets its vectors in its own input order; cancelling a call (client cancel, deadline) drops its inputs
that have not run yet. The model is anything with ``encode_micro_batch(inputs) -> [b, dimension]`` and
``dimension`` whose inputs have a length in tokens (:class:`MicroBatchModel`): an :class:`Embedder` (token id
lists), or a :class:`~pagedserve.embedding.cross_encoder.CrossEncoder` (tokenized pairs, one row of scores each),
whose calls go through :meth:`EmbedBatcher.run`.
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from typing import Protocol

import structlog
import torch

from ..errors import EngineUnavailableError
from .encoder import Embedder
from .interface import EmbeddingModelInfo, EmbedInputs, EmbedResult, is_token_id_inputs

log = structlog.get_logger(__name__)


class MicroBatchModel(Protocol):
    """What the batcher runs on its worker thread."""

    dimension: int   # width of one output row

    def encode_micro_batch(self, inputs: list) -> torch.Tensor:
        """``[len(inputs), dimension]`` float32 on CPU, row i for input i (each input has a ``len`` in tokens)."""
        ...


class _Call:
    """One call in flight: its inputs (token ids, or tokenized pairs) and the rows filled in as micro-batches
    finish."""

    __slots__ = ("loop", "future", "token_ids", "finish", "vectors", "remaining", "cancelled", "items", "cursor")

    def __init__(self, loop: asyncio.AbstractEventLoop, token_ids: list[Sized], dimension: int,
                 finish: Callable[[torch.Tensor], torch.Tensor] | None):
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()     # resolves to the finished [N, D'] rows
        self.token_ids = token_ids                              # per input, special tokens included
        self.finish = finish                                    # post-processing on the worker (Embedder.finish)
        self.vectors = torch.empty(len(token_ids), dimension)   # [N, dimension] float32, row i for input i
        self.remaining = len(token_ids)                         # inputs not yet embedded (worker thread only)
        self.cancelled = False                                  # set on the loop when the caller goes away
        self.items: list[_Item] = []                            # its pool items, in input order
        self.cursor = 0                                         # items before it have left the pool

    def next_pending(self) -> _Item | None:
        """Its first input still in the pool (under the batcher's lock), None when none is left."""
        while self.cursor < len(self.items) and self.items[self.cursor].taken:
            self.cursor += 1
        return self.items[self.cursor] if self.cursor < len(self.items) else None

    def post(self, outcome: torch.Tensor | BaseException) -> None:
        """From the worker thread: hand the finished vectors (or the failure) to the caller's event loop."""
        try:
            self.loop.call_soon_threadsafe(self._resolve, outcome)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _resolve(self, outcome: torch.Tensor | BaseException) -> None:
        if self.future.done():
            return
        if isinstance(outcome, BaseException):
            self.future.set_exception(outcome)
        else:
            self.future.set_result(outcome)


@dataclass(order=True, slots=True)
class _Item:
    """One pending input; pool order is (length, arrival)."""

    length: int                                        # tokens, special tokens included
    seq: int                                           # global arrival number (ties broken by arrival)
    call: _Call = field(compare=False)
    index: int = field(compare=False)                  # the input's position in its call
    taken: bool = field(default=False, compare=False)  # left the pool (ran, or its call was cancelled)


def default_num_threads(shares_cpu_with_generation: bool, device: torch.device | str = "cpu") -> int | None:
    """Intra-op threads for the embed worker: on CPU next to a generation engine, half of torch's threads (at
    least 1), so the engine thread and the embed worker each keep cores of their own instead of both
    oversubscribing every core (OpenMP teams that outnumber the cores stall at each barrier). None (torch's own
    setting) on a GPU or with no generation engine."""
    if torch.device(device).type != "cpu" or not shares_cpu_with_generation:
        return None
    return max(1, torch.get_num_threads() // 2)


class EmbedBatcher:
    """Batches the inputs of concurrent :meth:`embed` calls into micro-batches run by one worker thread.

    Args:
        embedder: the model (an :class:`Embedder` for :meth:`embed`, any :class:`MicroBatchModel` for :meth:`run`);
            only its ``encode_micro_batch`` runs on the worker thread.
        max_batch_tokens: padded tokens (rows * longest input) per micro-batch; a longer single input runs alone.
        max_padding_fraction: a neighbour joins a micro-batch only if padding stays at most this fraction of its
            padded tokens (or the batch stays within ``small_batch_tokens``); padding costs attention work only.
        small_batch_tokens: padded size under which any neighbour may join (per-batch overhead dominates there).
        tokenize_executor: where texts are tokenized (off the event loop); default: a private 1-thread pool.
        num_threads: torch intra-op threads of the worker thread alone (see :func:`default_num_threads`); None
            keeps torch's setting. Threads that exist already keep theirs, and threads started later get the
            process setting of before.
    """

    def __init__(self, embedder: Embedder | MicroBatchModel, max_batch_tokens: int = 2048, *, max_padding_fraction: float = 0.5,
                 small_batch_tokens: int = 128, tokenize_executor: concurrent.futures.Executor | None = None,
                 num_threads: int | None = None):
        if max_batch_tokens <= 0:
            raise ValueError(f"max_batch_tokens must be positive, got {max_batch_tokens}")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if not 0.0 <= max_padding_fraction < 1.0:
            raise ValueError(f"max_padding_fraction must be in [0, 1), got {max_padding_fraction}")
        self.embedder = embedder
        self.max_batch_tokens = max_batch_tokens
        self._max_padding_fraction = max_padding_fraction
        self._small_batch_tokens = small_batch_tokens
        self._own_executor = tokenize_executor is None
        self._tokenize_executor = tokenize_executor or concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pagedserve-embed-tokenize")
        self._cond = threading.Condition()
        self._pool: list[_Item] = []                      # pending items sorted by (length, seq)
        self._calls: collections.deque[_Call] = collections.deque()  # calls with pending inputs, in turn order
        self._next_seq = 0
        self._stopping = False
        self.num_micro_batches = 0                        # micro-batches run so far (for tests and logs)
        self.num_shared_micro_batches = 0                 # of which held inputs of more than one call
        self.num_padded_tokens = 0                        # sum over micro-batches of rows * longest
        self.num_real_tokens = 0                          # sum of their inputs' lengths (the rest is padding)
        self.num_threads = num_threads
        process_threads = torch.get_num_threads()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="pagedserve-embed-worker",
                                        daemon=True)
        self._thread.start()
        started.wait()
        if num_threads is not None:     # torch.set_num_threads also set the default of threads not started yet
            torch.set_num_threads(process_threads)

    # ---- event-loop side ---------------------------------------------------------------------------------------
    @property
    def info(self) -> EmbeddingModelInfo:
        """The encoder's model facts."""
        return self.embedder.info

    async def embed(self, inputs: EmbedInputs, normalize: bool = True, truncate: bool = False,
                    dimensions: int | None = None) -> EmbedResult:
        """Embed texts (or token id sequences) as :meth:`Embedder.embed` (:meth:`Embedder.embed_token_ids`) does:
        same vectors, same ``prompt_tokens``, batched with whatever other calls are waiting.

        Raises:
            InvalidInputError: as :meth:`Embedder.embed` (empty list, too long without truncate, bad dimensions).
            EngineUnavailableError: the batcher is closed.
            asyncio.CancelledError: the caller was cancelled; its pending inputs are dropped.
        """
        self.embedder.check_dimensions(dimensions)
        self._check_open()
        if is_token_id_inputs(inputs):
            token_ids = self.embedder.check_token_ids(list(inputs), truncate)
        else:
            token_ids = await self.tokenize(self.embedder.tokenize, inputs, truncate)
        vectors = await self.run(token_ids, lambda v: Embedder.finish(v, normalize, dimensions))
        return EmbedResult(vectors, sum(map(len, token_ids)))

    async def tokenize(self, fn: Callable, *args):
        """``fn(*args)`` on the tokenizing thread (off the event loop), e.g. the model's tokenizer."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_executor, fn, *args)

    async def run(self, inputs: list[Sized], finish: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> torch.Tensor:
        """Run already tokenized ``inputs`` (each as long as ``len`` says) through the model's micro-batches,
        sharing them with every other waiting call: ``[N, dimension]`` float32 CPU rows in input order, or what
        ``finish`` makes of them (run on the worker thread, no torch work on the event loop).

        Raises:
            EngineUnavailableError: the batcher is closed.
            asyncio.CancelledError: the caller was cancelled; its pending inputs are dropped.
        """
        self._check_open()
        call = _Call(asyncio.get_running_loop(), inputs, self.embedder.dimension, finish)
        self._enqueue(call)
        try:
            return await call.future
        except asyncio.CancelledError:
            self._drop(call)
            raise

    def close(self) -> None:
        """Stop the worker after its current micro-batch; calls still waiting get EngineUnavailableError."""
        with self._cond:
            self._stopping = True
            pending = {id(it.call): it.call for it in self._pool}
            self._pool.clear()
            self._calls.clear()
            self._cond.notify_all()
        for call in pending.values():
            call.post(EngineUnavailableError("the embedder is shutting down"))
        if self._own_executor:
            self._tokenize_executor.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        """:meth:`close` (the worker thread exits after its current micro-batch, not awaited)."""
        self.close()

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the worker thread to exit (after :meth:`close`)."""
        self._thread.join(timeout_s)

    @property
    def num_pending_inputs(self) -> int:
        """Inputs waiting in the pool (not yet in a micro-batch)."""
        with self._cond:
            return len(self._pool)

    def _check_open(self) -> None:
        if self._stopping:
            raise EngineUnavailableError("the embedder is shutting down")

    def _enqueue(self, call: _Call) -> None:
        with self._cond:
            self._check_open()
            for index, seq in enumerate(call.token_ids):
                item = _Item(len(seq), self._next_seq, call, index)
                self._next_seq += 1
                bisect.insort(self._pool, item)
                call.items.append(item)
            self._calls.append(call)
            self._cond.notify()

    def _drop(self, call: _Call) -> None:
        """Forget a call's pending inputs (its caller went away, or its micro-batch failed). Any thread."""
        call.cancelled = True
        with self._cond:
            for item in call.items:
                item.taken = True
            self._pool = [item for item in self._pool if not item.taken]

    # ---- worker thread -----------------------------------------------------------------------------------------
    def _run(self, started: threading.Event) -> None:
        if self.num_threads is not None:
            torch.get_num_threads()                   # torch's lazy per-thread init first, or it would undo this
            torch.set_num_threads(self.num_threads)   # OpenMP / MKL: this thread's teams only
        started.set()
        while True:
            with self._cond:
                while not self._stopping and not self._pool:
                    self._cond.wait()
                if self._stopping:
                    return
                batch = self._take_micro_batch()
            self._run_micro_batch(batch)

    def _take_micro_batch(self) -> list[_Item]:
        """Remove and return the next micro-batch from the pool (caller holds the lock; the pool is not empty)."""
        while (anchor := self._calls[0].next_pending()) is None:
            self._calls.popleft()
        self._calls.rotate(-1)                                      # its turn is used: to the back of the line
        pool = self._pool
        lo = bisect.bisect_left(pool, anchor)
        hi = lo + 1                                                 # the batch is pool[lo:hi]
        longest, real = anchor.length, anchor.length
        while True:
            rows = hi - lo + 1                                      # rows once one more joins
            options = []                                            # (padding added, side, longest after)
            if lo > 0:                                              # a shorter one: padded to the longest
                options.append((longest - pool[lo - 1].length, -1, longest))
            if hi < len(pool):                                      # a longer one: pads every row already in
                options.append(((rows - 1) * (pool[hi].length - longest), 1, pool[hi].length))
            for _, side, new_longest in sorted(options):
                length = pool[lo - 1].length if side < 0 else pool[hi].length
                if self._fits(rows * new_longest, real + length):
                    lo, hi = (lo - 1, hi) if side < 0 else (lo, hi + 1)
                    longest, real = new_longest, real + length
                    break
            else:
                break
        batch = pool[lo:hi]
        del pool[lo:hi]
        for item in batch:
            item.taken = True
        return batch

    def _fits(self, padded: int, real: int) -> bool:
        if padded > self.max_batch_tokens:
            return False
        return padded <= self._small_batch_tokens or padded - real <= self._max_padding_fraction * padded

    def _run_micro_batch(self, batch: list[_Item]) -> None:
        started = time.perf_counter()
        try:
            vectors = self.embedder.encode_micro_batch([it.call.token_ids[it.index] for it in batch])
        except Exception as exc:  # a bug or out of memory: fail the calls in this batch, keep serving others
            log.exception("embed_micro_batch_failed", rows=len(batch))
            for call in {id(it.call): it.call for it in batch}.values():
                self._drop(call)
                call.post(exc)
            return
        calls = {id(it.call): it.call for it in batch}
        padded, real = len(batch) * batch[-1].length, sum(it.length for it in batch)
        self.num_micro_batches += 1
        self.num_shared_micro_batches += len(calls) > 1
        self.num_padded_tokens += padded
        self.num_real_tokens += real
        log.debug("embed_micro_batch", rows=len(batch), calls=len(calls), padded_tokens=padded, real_tokens=real,
                  pending=len(self._pool), seconds=round(time.perf_counter() - started, 4))
        for row, item in enumerate(batch):
            call = item.call
            if call.cancelled:
                continue
            call.vectors[item.index] = vectors[row]
            call.remaining -= 1
            if call.remaining == 0:   # post-processing here too: no torch work on the event loop
                call.post(call.vectors if call.finish is None else call.finish(call.vectors))

