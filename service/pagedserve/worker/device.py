"""Where and in what precision the model runs: ``EngineConfig.device`` / ``dtype`` resolved."""
from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """``"auto"``: CUDA when available, else the CPU; otherwise ``torch.device(name)``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"``: bfloat16 on CUDA, float32 elsewhere; otherwise ``torch.<name>``."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def rank_device(device_name: str, local_rank: int) -> torch.device:
    """The device of a tensor-parallel rank: ``cuda:local_rank`` when the server runs on CUDA, else the CPU."""
    return torch.device("cuda", local_rank) if resolve_device(device_name).type == "cuda" else torch.device("cpu")
