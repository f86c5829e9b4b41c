"""CUDA graphs for decode-only steps: the model's forward captured once per padded batch size, replayed per step.

A decode-only step of ``n`` sequences (every sequence one new token, ``n`` <= the largest size) runs the graph of
the smallest captured size ``s >= n``: the step's input ids, positions, slot mapping, context lengths and block
table rows are copied into static buffers that the graph reads, rows ``n..s-1`` are padding (input id 0,
position 0, slot ``-1`` so no KV is written, context length 0 so attention reads nothing and returns zeros), and
the first ``n`` rows of the graph's output hidden states are returned. Steps with a prefill chunk, more sequences
than the largest size, or a block table wider than the static one run the eager model.

What makes replay correct: everything the captured kernels read per step lives in the static buffers (device
memory at fixed addresses), and no launch geometry depends on host-side per-step values. The metadata of a
captured step carries ``fixed_context_capacity`` (max_model_len rounded up to whole blocks), and an attention
backend that :attr:`~pagedserve.attention.base.AttentionBackend.supports_cuda_graphs` then launches its decode
kernel on the fixed grid of :func:`pagedserve.kernels.geometry.plan_decode_fixed`. The CuPy kernels launch on
torch's current stream (:mod:`pagedserve.kernels.launch`), which ``torch.cuda.graph`` makes its capture stream.

Capture follows the CUDA programming guide's stream capture and torch's ``torch.cuda.graph`` (all sizes share one
memory pool, largest first, as vLLM does); each size runs once eagerly before its capture so that NVRTC
compiles, module loads and cuBLAS initialisation happen outside the capture.
"""
from __future__ import annotations

import contextlib
import time

import structlog
import torch

from ..attention.base import AttentionBackend, AttentionMetadata
from ..config import EngineConfig
from .compiled import DEFAULT_COMPILE_SIZES, PaddedForward

log = structlog.get_logger(__name__)


class TorchCudaGraph:
    """One ``torch.cuda.CUDAGraph``: :meth:`capture` records ``fn``'s kernels (without running them) into the
    graph on capture stream ``stream``, using memory from ``pool``; :meth:`replay` reruns them on the current
    stream and returns the tensor ``fn`` returned at capture (its contents rewritten by the replay)."""

    def __init__(self, pool, stream) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool, self.stream = pool, stream
        self.output: torch.Tensor | None = None

    def capture(self, fn) -> None:
        # thread_local: CUDA calls of other threads (an embedding model loading beside us) do not void the capture
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            self.output = fn()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class CudaGraphForward(PaddedForward):
    """The model's forward as CUDA graphs for decode-only steps of the padded sizes; eager for other steps.

    Called like :class:`pagedserve.worker.compiled.CompiledForward` (the model runner holds either as
    ``runner.compiled``): ``forward(input_ids, positions, meta) -> hidden [T, hidden]``.

    Args:
        model: the model (``forward(input_ids, positions, kv_caches, meta, backend)``).
        backend: an attention backend with ``supports_cuda_graphs`` (the cuda one).
        kv_caches: the runner's per layer ``(k_cache, v_cache)`` ``[num_blocks, block_size, num_kv_heads,
            head_dim]``; their device is where the static buffers live.
        max_model_len: the longest context a request may reach, in tokens (sets the static block-table width and
            the decode kernel's fixed grid).
        block_size: tokens per KV block.
        sizes: batch sizes (decode sequences) to capture; duplicates are dropped.
        graph_factory: ``factory(pool, stream) -> graph`` with ``capture(fn)`` / ``replay() -> Tensor``; default
            :class:`TorchCudaGraph` (tests pass a host stand-in to run the same plumbing on CPU).

    Raises:
        ValueError: the backend cannot be captured, ``sizes`` is empty or holds a size < 1, or ``max_model_len``
            < 1.
    """

    def __init__(self, model, backend: AttentionBackend, kv_caches, max_model_len: int, block_size: int,
                 sizes=DEFAULT_COMPILE_SIZES, graph_factory=None):
        if not backend.supports_cuda_graphs:
            raise ValueError(f"attention backend {backend.name!r} cannot be captured in CUDA graphs")
        super().__init__(sizes, "CUDA graph sizes", "batch size")
        if max_model_len < 1:
            raise ValueError(f"max_model_len: must be >= 1, got {max_model_len}")
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.max_blocks = -(-max_model_len // block_size)   # static block-table width, blocks
        self.capacity = self.max_blocks * block_size         # fixed-grid context capacity, tokens
        self.graph_factory = graph_factory or TorchCudaGraph   # compile_s: eager runs + captures; no compile_cache
        self._graphs: dict[int, object] = {}
        dev, most = kv_caches[0][0].device, self.max_size
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
        self._input_ids = torch.zeros(most, **i64)
        self._positions = torch.zeros(most, **i64)
        self._slot_mapping = torch.full((most,), -1, **i64)
        self._context_lens = torch.zeros(most, **i32)
        self._block_tables = torch.zeros((most, self.max_blocks), **i32)
        self._query_start_loc = torch.arange(most + 1, **i32)   # one token per sequence, for every size
        self._query_lens = torch.ones(most, **i32)
        self._metas = {s: self._static_meta(s) for s in self.sizes}

    def _static_meta(self, size: int) -> AttentionMetadata:
        """Metadata over the first ``size`` rows of the static buffers; its host values are placeholders."""
        return AttentionMetadata(
            slot_mapping=self._slot_mapping[:size], block_tables=self._block_tables[:size],
            context_lens=self._context_lens[:size], query_start_loc=self._query_start_loc[:size + 1],
            query_lens=self._query_lens[:size], max_query_len=1, max_context_len=self.capacity,
            num_decode_seqs=size, query_lens_cpu=[1] * size, context_lens_cpu=[self.capacity] * size,
            fixed_context_capacity=self.capacity)

    def _graph_size(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> int | None:
        """The captured size this step replays, or None when it must run eager."""
        n = input_ids.shape[0]
        if not (n == meta.num_seqs == meta.num_decode_seqs) or meta.block_tables.shape[1] > self.max_blocks:
            return None
        if meta.max_context_len > self.capacity:
            return None
        size = self.padded_size(n)
        return size if size in self._graphs else None

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copy a step of ``n`` rows into the static buffers; rows ``n..size-1`` become padding."""
        n = input_ids.shape[0]
        self._input_ids[:n].copy_(input_ids)
        self._positions[:n].copy_(positions)
        self._slot_mapping[:n].copy_(meta.slot_mapping)
        self._context_lens[:n].copy_(meta.context_lens[:n])
        self._block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables[:n])
        self._pad(n, size)

    def _pad(self, start: int, size: int) -> None:
        """Rows ``start..size-1`` become padding. Their stale block-table rows stay: with context length 0 the
        kernels never read them."""
        if start < size:
            self._input_ids[start:size].zero_()
            self._positions[start:size].zero_()
            self._slot_mapping[start:size].fill_(-1)
            self._context_lens[start:size].zero_()

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self._input_ids[:size], self._positions[:size], self.kv_caches, self._metas[size],
                          self.backend)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the step (``input_ids``/``positions`` ``[T]`` int64): a graph replay
        for a decode-only step that fits a captured size, the eager model otherwise."""
        size = self._graph_size(input_ids, meta)
        if size is None:
            self.num_eager_steps += 1
            return self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        self._load(input_ids, positions, meta, size)
        self.steps_by_size[size] += 1
        return self._graphs[size].replay()[:input_ids.shape[0]]

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Capture every size, largest first, into one shared memory pool: each size runs once eagerly on padding
        only (no KV written), then is captured. Both happen on one side stream (torch's advice for capture), so
        the CuPy view of that stream (:mod:`pagedserve.kernels.launch`) exists before any capture. Returns the
        seconds it took (also :attr:`compile_s`).

        Raises:
            RuntimeError: from CUDA when a capture fails (the graphs captured so far are dropped).
        """
        started = time.monotonic()
        device = self._input_ids.device
        on_cuda = device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if on_cuda else None
        stream = torch.cuda.Stream(device) if on_cuda else None
        if on_cuda:
            stream.wait_stream(torch.cuda.current_stream(device))
        try:
            for size in sorted(self.sizes, reverse=True):
                with torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext():
                    self._pad(0, size)
                    self._forward(size)  # kernels compiled and loaded, cuBLAS initialised: none of that in capture
                if on_cuda:
                    torch.cuda.synchronize(device)
                graph = self.graph_factory(pool, stream)
                graph.capture(lambda s=size: self._forward(s))
                self._graphs[size] = graph
        except BaseException:
            self._graphs.clear()
            raise
        finally:
            if on_cuda:
                torch.cuda.current_stream(device).wait_stream(stream)
        self.compile_s = time.monotonic() - started
        self.steps_by_size.clear()
        log.info("cuda_graphs_captured", sizes=self.sizes, capture_s=round(self.compile_s, 2),
                 max_blocks_per_seq=self.max_blocks)
        return self.compile_s


def capture_cuda_graphs(config: EngineConfig, model, backend, kv_caches, max_model_len: int,
                        sizes=None) -> CudaGraphForward | None:
    """CUDA graphs of decode steps for the padded batch sizes up to the first one >= ``max_num_seqs`` (no larger
    decode batch can be scheduled). A failed capture fails start-up under ``enforce_eager=False``; with the
    default (None) it is logged and the engine runs eager (returns None)."""
    sizes = sorted(set(sizes or DEFAULT_COMPILE_SIZES))
    sizes = [s for s in sizes if s < config.max_num_seqs] + [s for s in sizes if s >= config.max_num_seqs][:1]
    graphs = CudaGraphForward(model, backend, kv_caches, max_model_len, config.block_size, sizes)
    try:
        graphs.warm_up()
    except Exception as exc:
        if config.enforce_eager is False:
            raise
        log.warning("cuda_graphs_failed", error=str(exc), fallback="eager")
        return None
    return graphs
