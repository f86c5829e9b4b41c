"""A tensor-parallel worker (ranks 1..N-1): builds its shard of the model and its own KV cache (its KV heads, the
same number of blocks as rank 0, so rank 0's block tables index it), then runs whatever rank 0 broadcasts.

Messages (tuples, tensors on CPU):
- ``("kv", num_blocks)``: agree on the block count (the minimum over ranks) and allocate the KV cache.
- ``("step", scheduler_output)``: one engine step on this rank's worker (:class:`.worker.Worker`; it joins the
  forward's all-reduces and the LM head's gathers, and samples nothing).
- ``("forward", input_ids, positions, meta)`` / ``("logits", hidden)``: a bare forward or LM head outside the step
  path (rank 0's tests and profiling run).
- ``("ping",)``: nothing (health and timing). ``("stop",)``: leave the group and exit.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

from ..attention.base import AttentionMetadata
from ..config import EngineConfig
from ..kv_layout import kv_layout_of
from . import tp_group as group
from .device import rank_device as _rank_device, resolve_dtype
from .kv_tensors import allocate_kv_caches, kv_block_bytes, kv_cache_dtype
from .worker import Worker

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to start (pickled to a spawned process)."""

    config: EngineConfig   # the server's engine config (model path, dtype, device, block size, timeouts)
    rank: int              # 1..size-1
    size: int              # tensor_parallel_size
    init_method: str       # tcp://127.0.0.1:PORT (spawned) or env:// (torchrun)
    local_rank: int        # CUDA device index on this machine


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """The device of a rank: ``cuda:local_rank`` when the server runs on CUDA, else the CPU."""
    return _rank_device(config.device, local_rank)


def build_shard(config: EngineConfig, tp, device: torch.device):
    """This rank's shard of ``config.model`` (weights cut as they are read). Raises ValueError when the model does
    not split by the size (head counts) or quantized weights it cannot shard (see :func:`check_quantization`)."""
    from ..models.loader import ModelSource
    from ..models.registry import build_model

    source = ModelSource.resolve(config.model)
    check_quantization(config, source, device)
    return build_model(source, source.load_config(), resolve_dtype(config.dtype, device), device,
                       config.quantization, config.quant_group_size, tp=tp, linear_kernels=config.linear_kernels)


def check_quantization(config: EngineConfig, source, device: torch.device, hf_config=None) -> None:
    """Quantized weights shard along their groups: with a size > 1 and a quantizing ``--quantization`` (``auto`` on a
    GGUF file, ``int4``, ``int8``; on CPU, where the kernels run), each row-parallel shard's input columns
    (``hidden_size / size`` for o_proj, ``intermediate_size / size`` for down_proj) must be whole groups (32 for GGUF
    blocks, ``quant_group_size`` for int4 at load), and the vocabulary must divide by the size (a quantized LM head
    has no padding rows). Raises ValueError naming the sizes and saying what to pass."""
    from ..models.quant_load import resolve_scheme

    size = config.tensor_parallel_size
    scheme = resolve_scheme(config.quantization, source.gguf_file is not None, device)
    if size == 1 or scheme == "none":
        return
    hf_config = hf_config or source.load_config()
    group = max(32, config.quant_group_size if scheme == "int4" else 32)
    sizes = {"hidden_size": hf_config.hidden_size, "intermediate_size": hf_config.intermediate_size}
    for name, total in sizes.items():
        if total % size or (total // size) % group:
            raise ValueError(f"quantization {config.quantization!r} (scheme {scheme!r}) with tensor_parallel_size "
                             f"{size}: the model's {name} {total} does not split into shards of whole groups of "
                             f"{group}; pass --quantization none")
    if hf_config.vocab_size % size:
        raise ValueError(f"quantization {config.quantization!r} (scheme {scheme!r}) with tensor_parallel_size {size}: "
                         f"the vocabulary ({hf_config.vocab_size}) does not divide by it; pass --quantization none")


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a spawned or torchrun-launched worker; returns when rank 0 says stop, exits on failure."""
    group.die_with_parent()
    device = rank_device(spec.config, spec.local_rank)
    tp, control = group.init_groups(spec.rank, spec.size, device, spec.init_method, spec.config.collective_timeout_s)
    try:
        model = build_shard(spec.config, tp, device)
        group.wait_for_all_ranks()
        serve_steps(Worker(model, spec.config, device, rank=spec.rank), control)
    except Exception:
        log.exception("tp_worker_failed", rank=spec.rank)
        os._exit(1)  # a collective may be half done: leave without waiting for the group
    dist.destroy_process_group()


@torch.inference_mode()
def serve_steps(worker: Worker, control) -> None:
    """The worker loop: run each message rank 0 broadcasts until ``("stop",)``."""
    model, config, device, backend = worker.model, worker.config, worker.device, worker.backend
    while True:
        message = group.receive(control)
        kind = message[0]
        if kind == "stop":
            return
        if kind == "step":
            worker.execute(message[1])
        elif kind == "forward":
            input_ids, positions, meta = message[1:]
            caches = worker.kv_caches if worker.runner is not None else allocate_kv_caches(
                model.num_layers, 1, config.block_size, model.num_kv_heads, model.head_dim, worker.kv_dtype,
                device)  # profiling run
            model(input_ids.to(device), positions.to(device), caches, meta_to(meta, device), backend)
        elif kind == "logits":
            model.compute_logits(message[1].to(device))
        elif kind == "kv":
            worker.initialize_kv_cache(agree_num_blocks(min(message[1], own_block_limit(config, model, device)),
                                                        control))
        elif kind != "ping":
            raise ValueError(f"unknown tensor-parallel message {kind!r}")


def agree_num_blocks(num_blocks: int, control) -> int:
    """The minimum over ranks of each rank's KV block count (all ranks call it, on the gloo control group)."""
    t = torch.tensor([num_blocks], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control)
    return int(t.item())


def own_block_limit(config: EngineConfig, model, device: torch.device) -> int:
    """KV blocks this rank's memory allows: on CUDA without an explicit size, what ``gpu_memory_utilization``
    leaves after the weights and the profiled forward (peak so far); otherwise no limit of its own."""
    if device.type != "cuda" or config.num_kv_blocks or config.kv_cache_memory_bytes:
        return 1 << 62
    free = int(torch.cuda.get_device_properties(device).total_memory * config.gpu_memory_utilization) \
        - int(torch.cuda.max_memory_allocated(device))
    block = kv_block_bytes(kv_layout_of(model).layers_per_group, config.block_size, model.num_kv_heads, model.head_dim,
                           kv_cache_dtype(config.kv_cache_dtype, model.norm.dtype, device))
    return max(1, free // block)


def meta_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """``meta`` with its tensors on ``device``."""
    if device.type == "cpu":
        return meta
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(device)
                                         for f in dataclasses.fields(meta)
                                         if isinstance(getattr(meta, f.name), torch.Tensor)})
