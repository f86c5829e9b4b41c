"""The compiled forward: ``torch.compile`` of the whole model with attention opaque, over padded token counts.

A step of ``T`` new tokens runs the graph compiled for the smallest size in :attr:`CompiledForward.sizes` that holds
it: input ids and positions are padded with zeros and the slot mapping with ``-1``, so the padded rows write no KV
(see :mod:`pagedserve.attention.opaque`), and only the first ``T`` rows of the hidden states are returned (padded
rows produce no logits). Each size is compiled once with static shapes (``dynamic=False``) during warm-up, before
the server reports SERVING; a step larger than the largest size runs the eager model, so serving never compiles.
Inductor's on-disk caches (FX graph and AOTAutograd caches, under ``TORCHINDUCTOR_CACHE_DIR``) make a second start
with the same model and sizes much faster than the first.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import time

import structlog
import torch

from ..attention.base import AttentionBackend, AttentionMetadata
from ..attention.opaque import step_context
from ..kv_layout import kv_layout_of

log = structlog.get_logger(__name__)

#: Padded token counts compiled by default: every decode batch up to 64 requests and short prefill chunks.
DEFAULT_COMPILE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def compile_supported(backend: AttentionBackend, device: torch.device, tensor_parallel_size: int = 1,
                      model=None) -> str | None:
    """Why the forward cannot run compiled with ``backend`` on ``device`` (None when it can). On CUDA "compiled"
    means CUDA graphs of decode-only steps (:mod:`pagedserve.worker.cuda_graphs`), which need a backend that
    ``supports_cuda_graphs`` (the cuda one); on CPU it means ``torch.compile`` (this module), which needs traceable
    elementwise layers (torch ops or custom ops with fakes; dynamo cannot trace the CuPy kernels). A ``model`` whose
    forward reads the host mid-step (its ``host_sync_reason``: mixture-of-experts layers) runs eager."""
    if tensor_parallel_size > 1:
        return "tensor parallelism runs its shards eagerly (the collectives are not traced)"
    if getattr(model, "host_sync_reason", None):
        return model.host_sync_reason
    if model is not None and kv_layout_of(model).hybrid:
        return "a model with full and sliding-window layers runs one block table per layer group (eager only)"
    kind = torch.device(device).type
    if kind == "cuda":
        if not backend.supports_cuda_graphs:
            return (f"CUDA graphs need the cuda attention backend (the {backend.name} backend plans each step on "
                    "the host); torch.compile is CPU only")
        return None
    if not backend.elementwise.traceable:
        return f"the {backend.name} backend's elementwise kernels are not traceable"
    if kind != "cpu":
        return f"compilation is implemented for CPU (torch.compile) and CUDA (graphs) only, not {device}"
    return None


#: Whether the forward compiles when ``enforce_eager`` is None, where it is supported (CPU). Off, from
#: ``bench/compiled.py`` (README "Compiled forward"): with torch's default thread count (all cores) the compiled
#: step measured 0.67-1.06x of eager on the shared 2-core machine (faster, 1.22-1.35x, only with one thread),
#: and a cold compile takes minutes per size.
COMPILE_BY_DEFAULT_ON_CPU = False
#: Whether decode steps run as CUDA graphs when ``enforce_eager`` is None on CUDA (vLLM's default; the issue asks
#: for it). Not yet measured here: tests/gpu/test_cuda_graphs_gpu.py prints TPOT with and without graphs.
CUDA_GRAPHS_BY_DEFAULT = True


def use_compiled(enforce_eager: bool | None, backend: AttentionBackend, device, tensor_parallel_size: int = 1,
                 model=None) -> bool:
    """Whether to compile (CPU) or capture CUDA graphs (CUDA): never with ``enforce_eager=True``; with False
    wherever supported (RuntimeError when not, saying why); with None where supported and on by default
    (:data:`COMPILE_BY_DEFAULT_ON_CPU`, :data:`CUDA_GRAPHS_BY_DEFAULT`)."""
    if enforce_eager:
        return False
    reason = compile_supported(backend, device, tensor_parallel_size, model)
    if enforce_eager is False and reason is not None:
        raise RuntimeError(f"enforce_eager=False: cannot compile the forward: {reason}")
    by_default = CUDA_GRAPHS_BY_DEFAULT if torch.device(device).type == "cuda" else COMPILE_BY_DEFAULT_ON_CPU
    return reason is None and (enforce_eager is False or by_default)


def empty_meta(num_tokens: int, device) -> AttentionMetadata:
    """Metadata of a step with no sequence and ``num_tokens`` padded rows (every slot ``-1``): what warm-up runs."""
    i32 = dict(dtype=torch.int32, device=device)
    return AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros((0, 1), **i32), context_lens=torch.zeros(0, **i32),
        query_start_loc=torch.zeros(1, **i32), query_lens=torch.zeros(0, **i32), max_query_len=0,
        max_context_len=0, num_decode_seqs=0, query_lens_cpu=[], context_lens_cpu=[])


class PaddedForward:
    """What the compiled forward and the CUDA-graph forward share: a sorted list of padded sizes (token counts,
    batch sizes) where a step runs at the smallest size that holds it, or eagerly above the largest, and what the
    runner and the ``ready`` line read back: ``compile_s`` (seconds warm-up took; None before it), ``compile_cache``
    ("warm"/"cold" for inductor's on-disk cache; None where there is none), ``steps_by_size`` (steps run per
    padded size since warm-up) and ``num_eager_steps``.

    Args:
        sizes: sizes, any order; duplicates are dropped.
        what: how the error message names them ("compile sizes", "CUDA graph sizes").
        unit: what a size counts ("token count", "batch size").

    Raises:
        ValueError: ``sizes`` empty or holding a size < 1.
    """

    def __init__(self, sizes, what: str, unit: str):
        sizes = sorted(set(int(s) for s in sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"{what} {sizes}: need at least one {unit} >= 1")
        self.sizes = sizes
        self.compile_s: float | None = None
        self.compile_cache: str | None = None
        self.steps_by_size: collections.Counter = collections.Counter()
        self.num_eager_steps = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, n: int) -> int | None:
        """The size a step of ``n`` (tokens or sequences) runs at; None when it is larger than every size."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None


class CompiledForward(PaddedForward):
    """The model's forward compiled by inductor for a fixed list of token counts.

    Args:
        model: a model whose ``forward(input_ids, positions, kv_caches, meta=None, backend)`` calls the
            ``pagedserve::paged_attention`` op (:class:`~pagedserve.models.llama.LlamaForCausalLM`).
        backend: the attention backend the op runs.
        kv_caches: the runner's per layer ``(k_cache, v_cache)``.
        sizes: token counts to compile, any order; duplicates are dropped.

    Raises:
        ValueError: ``sizes`` empty or holding a count < 1.
    """

    def __init__(self, model, backend: AttentionBackend, kv_caches, sizes=DEFAULT_COMPILE_SIZES):
        super().__init__(sizes, "compile sizes", "token count")
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self._no_caches = [None] * model.num_layers
        # One frame compiled for len(sizes) static shapes: allow that many entries without dynamo giving up or
        # turning the token dimension dynamic.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, len(self.sizes) + 8)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 4 * len(self.sizes) + 64)
        self._compiled = torch.compile(self._graph, dynamic=False, fullgraph=True)

    def _graph(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self._no_caches, None, self.backend)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the step (``input_ids``/``positions`` ``[T]`` int64, ``meta`` for T
        rows), from the graph of the padded size; the eager model when ``T > max_size``."""
        num_tokens = input_ids.shape[0]
        size = self.padded_size(num_tokens)
        if size is None:
            self.num_eager_steps += 1
            return self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        self.steps_by_size[size] += 1
        pad = size - num_tokens
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            positions = torch.nn.functional.pad(positions, (0, pad))
            meta = dataclasses.replace(meta, slot_mapping=torch.nn.functional.pad(meta.slot_mapping, (0, pad),
                                                                                  value=-1))
        with step_context(self.backend, meta, self.kv_caches, num_tokens):
            hidden = self._compiled(input_ids, positions)
        return hidden[:num_tokens] if pad else hidden

    @torch.inference_mode()
    def warm_up(self, progress: bool = True) -> float:
        """Compile every size (largest first) by running a step of padding only; returns the seconds it took and
        keeps them in :attr:`compile_s` (and whether inductor's FX graph cache held every graph in
        :attr:`compile_cache`). ``progress`` shows a tqdm bar on a terminal."""
        from tqdm import tqdm

        from torch._dynamo.utils import counters

        started = time.monotonic()
        misses = counters["inductor"]["fxgraph_cache_miss"]
        device = self.model.norm.device
        for size in tqdm(sorted(self.sizes, reverse=True), desc="compiling", unit="size",
                         disable=None if progress else True, leave=False):
            meta = empty_meta(size, device)
            ids = torch.zeros(size, dtype=torch.int64, device=device)
            with step_context(self.backend, meta, self.kv_caches, 0):
                self._compiled(ids, ids.clone())
        self.compile_s = time.monotonic() - started
        self.compile_cache = "cold" if counters["inductor"]["fxgraph_cache_miss"] > misses else "warm"
        self.steps_by_size.clear()
        log.info("compiled_forward", sizes=self.sizes, compile_s=round(self.compile_s, 2),
                 compile_cache=self.compile_cache)
        return self.compile_s
