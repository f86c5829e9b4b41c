"""Start-up checks of a decoder config: what a family cannot run exactly is refused naming the config field
(:class:`UnsupportedConfig`), and each layer's sliding window (:func:`layer_windows`).
A leaf: :mod:`.decoder`, :mod:`.rope` and the family files import it."""
from __future__ import annotations


class UnsupportedConfig(ValueError):
    """A checkpoint's config asks for something this engine does not run exactly. The message starts with the
    config field (``sliding_window=4096: ...``)."""


def require(cfg, name: str, allowed, what: str = "") -> None:
    """Raise :class:`UnsupportedConfig` naming ``name`` when ``cfg.name`` is set to a value outside ``allowed``."""
    value = getattr(cfg, name, None)
    if value is not None and value not in allowed:
        raise UnsupportedConfig(f"{name}={value!r}: {what or 'not supported'} (supported: {list(allowed)})")


def layer_windows(cfg) -> tuple[int | None, ...] | None:
    """Each layer's sliding window in tokens (None: full attention), or None when no layer has one.

    transformers masks key ``j`` for query ``i`` when ``i - j >= sliding_window`` (``masking_utils``'
    ``sliding_window_overlay``: a query sees itself and the ``sliding_window - 1`` keys before it). Layers with a
    window: those ``layer_types`` marks ``"sliding_attention"`` (Qwen2/3 from ``max_window_layers``, SmolLM3, Gemma);
    without ``layer_types``, all of them when ``sliding_window`` is set and ``use_sliding_window`` is not False
    (Mistral, Mixtral, Phi-3).

    Raises:
        UnsupportedConfig: ``sliding_window`` not a positive integer, or ``layer_types`` not one entry per layer of
            ``"full_attention"`` / ``"sliding_attention"``.
    """
    window = getattr(cfg, "sliding_window", None)
    if window is None or window is False:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnsupportedConfig(f"sliding_window={window!r}: must be a positive integer")
    types = getattr(cfg, "layer_types", None)
    if types is None:
        if getattr(cfg, "use_sliding_window", True) is False:
            return None
        return (int(window),) * cfg.num_hidden_layers
    if len(types) != cfg.num_hidden_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise UnsupportedConfig(f"layer_types={list(types)!r}: one of 'full_attention' / 'sliding_attention' per "
                                f"layer ({cfg.num_hidden_layers})")
    if "sliding_attention" not in types:
        return None
    return tuple(int(window) if t == "sliding_attention" else None for t in types)
