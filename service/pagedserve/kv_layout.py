"""How a model's layers share the KV cache: layer groups with one block table each (vLLM v1's hybrid KV cache
allocator, ``vllm/v1/core/kv_cache_utils.py``; written from its description, not its code).

A model whose layers all attend the same way has one group: every layer reads the request's one block table, and
each layer has its own cache tensor. A model with full-attention layers beside sliding-window layers (Gemma 2/3,
gpt-oss, Qwen2 from ``max_window_layers``) gets groups of ``layers_per_group`` layers, each all-full or all-window:
a request has one block table per group, the window groups' tables give back the blocks behind their window while
it runs (:class:`~pagedserve.core.kv_cache.manager.KVCacheManager`), the full groups keep the whole context. Memory: there are only
``layers_per_group`` cache tensors (K and V each); layer ``j`` of every group uses tensor ``j`` (its
:attr:`KVLayout.layer_slot`), so a block id held by one group's table occupies one block of each tensor, for that
group's layers. A request of ``n`` context blocks thus holds ``n`` blocks for a full group and about
``window / block_size + 1`` for a window group, where a single table would keep ``n`` blocks in every layer.

A request's block table is sent and kept as one flat list, the groups interleaved: entry ``i * num_groups + g`` is
logical block ``i`` of group ``g`` (with one group, the plain table).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """Attributes:
        group_windows: per group its sliding window in tokens (the largest of its layers'), None for full attention.
        layer_group: per layer its group.
        layer_slot: per layer its index within the group: the cache tensor it uses.
        layers_per_group: cache tensors (K and V each); a block spans this many layers.
    """

    group_windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    layers_per_group: int

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def hybrid(self) -> bool:
        """Whether there is more than one group (several block tables per request)."""
        return len(self.group_windows) > 1


def single_group(num_layers: int, window: int | None = None) -> KVLayout:
    """Every layer in one group (``window``: every layer windowed, the largest window; None: full attention)."""
    return KVLayout((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def kv_layout(windows: tuple[int | None, ...] | None, num_layers: int) -> KVLayout:
    """The layout of a model whose layer ``l`` has sliding window ``windows[l]`` (None: full attention; ``windows``
    None: no layer has one).

    One group when every layer attends alike. Otherwise ``layers_per_group`` is the smaller of the full and the
    window layer counts; the full layers fill groups of that size in order, then the window layers (the last group of
    each kind may have fewer layers: its tensors past them are unused by it). A window group's window is the largest
    of its layers'.
    """
    if not windows or all(w is None for w in windows):
        return single_group(num_layers)
    if all(w is not None for w in windows):
        return single_group(num_layers, max(windows))
    full = [i for i, w in enumerate(windows) if w is None]
    windowed = [i for i, w in enumerate(windows) if w is not None]
    size = min(len(full), len(windowed))
    group_windows: list[int | None] = []
    layer_group, layer_slot = [0] * num_layers, [0] * num_layers
    for layers, is_window in ((full, False), (windowed, True)):
        for start in range(0, len(layers), size):
            members = layers[start:start + size]
            group = len(group_windows)
            group_windows.append(max(windows[i] for i in members) if is_window else None)
            for slot, layer in enumerate(members):
                layer_group[layer], layer_slot[layer] = group, slot
    return KVLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)


def kv_layout_of(model) -> KVLayout:
    """:func:`kv_layout` of a model's per-layer windows (``model.spec.sliding_windows``; a model without a spec
    has one full-attention group)."""
    windows = getattr(getattr(model, "spec", None), "sliding_windows", None)
    return kv_layout(windows, model.num_layers)
