"""Rotary position embedding tables for every rope type the decoder families use.

Each type computes the inverse frequencies and the cos/sin scale ("attention factor") as transformers'
``ROPE_INIT_FUNCTIONS`` do (``modeling_rope_utils``: ``default``, ``linear`` (kaiokendev's position interpolation),
``dynamic`` (NTK-aware, Reddit /u/bloc97), ``yarn`` (Peng et al. 2023, arXiv:2309.00071), ``longrope`` (Ding et al.
2024, arXiv:2402.13753, Phi-3) and ``llama3`` (Meta's Llama 3.1 frequency smoothing)); written from those formulas,
not imported (private helpers move between releases). The math runs in float64 and the table is stored float32.

Two types change with the sequence length in transformers (``dynamic`` past ``max_position_embeddings``,
``longrope`` past ``original_max_position_embeddings``). A paged cache rotates each key once, so those are exact
only below that length: :func:`inv_freq_and_factor` says up to where, and the model caps its context there.
"""
from __future__ import annotations

import math

import torch

from ..kernels.elementwise_ref import cos_sin_table
from .config_checks import UnsupportedConfig

#: rope types this module computes (transformers' names)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def rope_parameters(cfg) -> dict:
    """The config's rope parameters as one dict with ``rope_type`` and ``rope_theta`` (transformers 5 keeps them
    in ``rope_parameters``; older configs in ``rope_scaling`` plus ``rope_theta``), and the config's
    ``original_max_position_embeddings`` where the parameters lack it (Phi-3 keeps it on the config)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    legacy = getattr(cfg, "rope_scaling", None) or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default") or "default"
    if params.get("rope_theta") is None:
        params["rope_theta"] = float(getattr(cfg, "rope_theta", None) or 10000.0)
    original = getattr(cfg, "original_max_position_embeddings", None)
    if params.get("original_max_position_embeddings") is None and original:
        params["original_max_position_embeddings"] = original
    return params


def rotary_dim_of(cfg, head_dim: int, params: dict | None = None) -> int:
    """Features per head that rotate: ``int(head_dim * partial_rotary_factor)`` (Phi-3/Phi-4-mini, GPT-NeoX
    style; the factor may sit in the rope parameters or on the config)."""
    params = rope_parameters(cfg) if params is None else params
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    return head_dim if factor is None else int(head_dim * float(factor))


def inv_freq_and_factor(params: dict, rotary_dim: int, max_position_embeddings: int
                        ) -> tuple[torch.Tensor, float, int | None]:
    """``(inv_freq [rotary_dim // 2] float64, attention_factor, exact_max_len)`` for one rope parameter dict.

    Raises:
        UnsupportedConfig: an unknown ``rope_type`` or a missing parameter, naming ``rope_parameters.<key>``.
    """
    kind = params.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise UnsupportedConfig(f"rope_parameters.rope_type={kind!r} is not supported; supported: {list(ROPE_TYPES)}")

    def need(key: str):
        if params.get(key) is None:
            raise UnsupportedConfig(f"rope_parameters.{key} is required for rope_type {kind!r}")
        return params[key]

    base = float(params["rope_theta"])
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv_freq = 1.0 / base ** exponent
    factor_attn, exact = 1.0, None
    if kind == "linear":
        inv_freq = inv_freq / float(need("factor"))
    elif kind == "dynamic":
        # transformers rescales the base only once a sequence passes max_position_embeddings; below it the table is
        # the default one, and the engine never runs past max_position_embeddings
        exact = max_position_embeddings
    elif kind == "llama3":
        factor = float(need("factor"))
        low, high = float(need("low_freq_factor")), float(need("high_freq_factor"))
        old_len = float(need("original_max_position_embeddings"))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        original = int(need("original_max_position_embeddings"))
        factor = params.get("factor")
        factor = float(factor) if factor is not None else max_position_embeddings / original
        factor_attn = _yarn_attention_factor(params, factor)
        beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

        def correction_dim(rotations: float) -> float:
            return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        extrapolate = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
    elif kind == "longrope":
        original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
        factor = params.get("factor")
        factor = float(factor) if factor is not None else max_position_embeddings / original
        factor_attn = params.get("attention_factor")
        if factor_attn is None:
            factor_attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        short = torch.tensor(need("short_factor"), dtype=torch.float64)
        if short.numel() != rotary_dim // 2:
            raise UnsupportedConfig(f"rope_parameters.short_factor has {short.numel()} entries, "
                                    f"expected {rotary_dim // 2}")
        inv_freq = inv_freq / short
        # past the original length transformers switches every position to long_factor: not a per-key rotation
        exact = original
    return inv_freq, float(factor_attn), exact


def _yarn_attention_factor(params: dict, factor: float) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, float(m)) / mscale(factor, float(m_all))
    return mscale(factor)


def rope_table(params: dict, rotary_dim: int, max_position_embeddings: int,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """The rotary table of ``params`` (:func:`rope_parameters`): ``[max_position_embeddings, rotary_dim]`` float32,
    cos then sin, both times the rope type's attention factor
    (:func:`~pagedserve.kernels.elementwise_ref.cos_sin_table`).

    Raises:
        UnsupportedConfig: see :func:`inv_freq_and_factor`.
    """
    inv_freq, scale, _ = inv_freq_and_factor(params, rotary_dim, max_position_embeddings)
    return cos_sin_table(inv_freq, max_position_embeddings, device, scale)
