"""Start-up checks of a decoder config: what a family cannot run exactly is refused naming the config field
(:class:`UnsupportedConfig`), and how far a sliding window lets full attention stand in for it (:func:`window_limit`).
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


def window_limit(cfg) -> tuple[int | None, str]:
    """(tokens, field) up to which a config's sliding-window attention equals full attention (None: no window).

    transformers masks key ``j`` for query ``i`` when ``i - j >= sliding_window``, so while a sequence holds at
    most ``sliding_window`` tokens every key is inside the window. Layers with a window: those ``layer_types``
    marks ``"sliding_attention"``; without ``layer_types``, all of them when ``sliding_window`` is set and
    ``use_sliding_window`` is not False (Mistral, Phi-3)."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None, ""
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        if "sliding_attention" not in types:
            return None, ""
    elif getattr(cfg, "use_sliding_window", True) is False:
        return None, ""
    return int(window), f"sliding_window={int(window)} (sliding-window attention is run as full attention only " \
                        f"while a sequence fits in the window)"
