"""Builds the executor an engine configuration asks for: the model loaded (or sharded over tensor-parallel ranks)
on the configured device and dtype, inside its worker."""
from __future__ import annotations

from ..attention.base import AttentionBackend
from ..config import EngineConfig
from ..models.registry import build_model
from ..worker.device import resolve_device, resolve_dtype
from ..worker.worker import Worker
from .base import Executor
from .tensor_parallel import start_tensor_parallel
from .uniproc import UniProcExecutor


def build_executor(config: EngineConfig, source, hf_config, model=None, backend: AttentionBackend | None = None,
                   tp_init_method: str | None = None) -> Executor:
    """The executor for ``config``: tensor parallel when ``config.tensor_parallel_size > 1`` and no ``model`` is
    given (``tp_init_method``: the group's init method when the other ranks exist already, torchrun's ``env://``;
    None spawns them), else one process over ``model`` or the model loaded from ``source``
    (:class:`pagedserve.models.loader.ModelSource`) with ``hf_config``. ``backend`` overrides the attention backend
    ``config.attention_backend`` selects (tests run the emulated CUDA backend on CPU).

    Raises:
        ValueError: unsupported architecture or quantization; a size the model does not split by.
        TensorParallelError: the ranks did not all start.
    """
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if model is None and config.tensor_parallel_size > 1:
        return start_tensor_parallel(config, hf_config, tp_init_method)
    if model is None:
        model = build_model(source, hf_config, dtype, device, config.quantization, config.quant_group_size,
                            linear_kernels=config.linear_kernels)
    return UniProcExecutor(Worker(model, config, device, backend, dtype=dtype), dtype)
