"""Rope scaling a GGUF file stores as tensors, read back into transformers' rope parameters.

- llama ``rope_freqs.weight`` (float32 ``[head_dim / 2]``): llama.cpp's ``LlamaModel.generate_extra_tensors``
  writes, for a ``llama3`` rope (Llama 3.1-3.3), each frequency's divisor: 1 for wavelengths under
  ``original / high_freq_factor``, ``factor`` over ``original / low_freq_factor``, ``1 / ((1 - s) / factor + s)``
  with ``s = (original / wavelength - low) / (high - low)`` between. Only the ratios ``original / low`` and
  ``original / high`` shape that curve, so :func:`llama3_from_freq_factors` recovers ``factor``, ``high`` and
  ``original`` at ``low_freq_factor = 1`` (the released models' value) from the smoothed band, and checks that
  those parameters give back every stored divisor (rtol 1e-5).
- phi3 ``rope_factors_short.weight`` / ``rope_factors_long.weight`` (float32 ``[rotary_dim / 2]``): Phi-3's
  ``longrope`` ``short_factor`` / ``long_factor`` as stored by ``Phi3MiniModel.generate_extra_tensors``, with
  ``rope.scaling.attn_factor`` the cos/sin scale and ``rope.scaling.original_context_length`` the original length.
"""
from __future__ import annotations

import math

import numpy as np

#: tensors read into the config (not weights), by architecture
CONFIG_TENSORS = {"llama": frozenset({"rope_freqs.weight"}),
                  "phi3": frozenset({"rope_factors_short.weight", "rope_factors_long.weight"})}


def _floats(tensor) -> np.ndarray:
    if tensor.tensor_type.name != "F32":
        raise ValueError(f"GGUF tensor {tensor.name!r}: type {tensor.tensor_type.name}, expected F32")
    return np.asarray(tensor.data, dtype=np.float64).reshape(-1)


def _nice(x: float) -> float:
    """``x`` rounded to the nearest integer when within 1e-6 of it, relatively (the fit's float32 noise)."""
    r = round(float(x))
    return float(r) if abs(x - r) <= 1e-6 * abs(x) else float(x)


def llama3_from_freq_factors(divisors: np.ndarray, theta: float, head_dim: int) -> dict:
    """transformers ``llama3`` rope parameters giving the divisors ``divisors`` (``[head_dim / 2]``, llama.cpp's
    ``rope_freqs``) of the base frequencies ``theta ** (-2i / head_dim)``; ``default`` when every divisor is 1.

    Raises:
        ValueError: divisors that are not a llama3 curve (or fewer than two in its smoothed band), naming
            ``rope_freqs.weight``.
    """
    if divisors.shape != (head_dim // 2,):
        raise ValueError(f"rope_freqs.weight: {divisors.shape[0]} factors, expected {head_dim // 2}")
    if np.allclose(divisors, 1.0, rtol=0, atol=1e-7):
        return {"rope_type": "default", "rope_theta": theta}
    factor = float(divisors.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    band = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if band.sum() < 2:
        raise ValueError("rope_freqs.weight: fewer than two frequencies in the llama3 smoothed band; its "
                         "parameters cannot be recovered")
    smooth = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)   # s = A / wavelength + B
    slope, intercept = np.polyfit(1 / wavelen[band], smooth, 1)
    high = _nice(1 - 1 / intercept)            # at low = 1: B = -1 / (high - 1), A = original / (high - 1)
    original = _nice(slope * (high - 1))
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
              "original_max_position_embeddings": int(original) if original.is_integer() else original,
              "rope_theta": theta}
    s = (original / wavelen - 1) / (high - 1)
    want = np.where(wavelen < original / high, 1.0, np.where(wavelen > original, factor,
                                                             1 / ((1 - s) / factor + s)))
    if not np.allclose(divisors, want, rtol=1e-5, atol=0):
        raise ValueError("rope_freqs.weight: the factors are not a llama3 rope curve")
    return params


def rope_from_tensors(arch: str, hp: dict, tensors: dict, rope: dict, head_dim: int, rotary: int) -> dict:
    """``rope`` (the metadata's parameters) replaced by what ``arch``'s rope tensors say, if the file has them.

    Raises:
        ValueError: see :func:`llama3_from_freq_factors`; phi3 factors without the other one, of the wrong length,
            or next to a rope scaling type.
    """
    if arch == "llama" and "rope_freqs.weight" in tensors:
        if rope["rope_type"] != "default":
            raise ValueError(f"llama.rope.scaling.type={hp.get('rope.scaling.type')!r}: not read next to "
                             f"rope_freqs.weight")
        return llama3_from_freq_factors(_floats(tensors["rope_freqs.weight"]), rope["rope_theta"], head_dim)
    names = CONFIG_TENSORS["phi3"]
    if arch == "phi3" and names & set(tensors):
        if not names <= set(tensors):
            raise ValueError(f"GGUF tensors {sorted(names & set(tensors))}: phi3 longrope needs both of "
                             f"{sorted(names)}")
        short, long = (_floats(tensors[n]).tolist() for n in sorted(names, reverse=True))
        if len(short) != rotary // 2 or len(long) != rotary // 2:
            raise ValueError(f"rope_factors_short.weight: {len(short)} factors, expected {rotary // 2}")
        params = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                  "rope_theta": rope["rope_theta"]}
        if "rope.scaling.attn_factor" in hp:
            params["attention_factor"] = float(hp["rope.scaling.attn_factor"])
        return params
    return rope
