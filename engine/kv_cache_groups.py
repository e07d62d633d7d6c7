"""KV cache groups: how a model's attention layers share the paged KV cache when some slide and some do not.

Every layer of one group has the same window (None: the whole context), and every group has the same number
of layers, ``group_size``. A block id names one block of ``group_size`` layers' K and V: the KV tensors are
``group_size`` pairs ("slots"), and layer ``j`` of every group reads and writes slot ``j``. The groups share
one block pool; a request holds one block list per group, so a sliding group returns the blocks before its
window while a full group keeps them (``engine.kv_cache_manager``), and each group's layers read their own
block table (``engine.attention.AttentionMetadata.for_group``).

When every layer has the same window (or none) there is one group of every layer, each layer with its own
slot: the cache as without groups. Otherwise ``group_size`` is the fewest layers of one window, and each window
takes ceil(its layers / group_size) groups; slots of a group with fewer layers stay unused (Gemma 3 12B: 40
sliding and 8 global layers -> 5 sliding groups and 1 global group of 8 layers, no slot unused).

Pure ints; shared by the runner (which tensors each layer binds) and the scheduler (the groups' windows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class KVCacheGroups:
    """Each attention layer's group and slot, and each group's window."""

    group_windows: tuple[Optional[int], ...]
    """Each group's sliding window in positions (None: the whole context), group 0 first."""
    layer_group: tuple[int, ...]
    """Each attention layer's group (layer order)."""
    layer_slot: tuple[int, ...]
    """Each attention layer's KV tensor pair, 0..group_size-1 (shared with the same slot of other groups)."""
    group_size: int
    """KV tensor pairs: the layers one block holds."""

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)


def kv_cache_groups(windows: Sequence[Optional[int]], layer_shapes: Optional[Sequence[tuple[int, ...]]] = None
                    ) -> KVCacheGroups:
    """The groups of layers with ``windows`` (each layer's window, None: the whole context; ``layer_shapes``:
    each layer's KV shape, e.g. (num_kv_heads, head_dim); None: all alike). Layers of different shapes cannot
    share slots: they stay one group, with no window unless all have the same (nothing is returned early)."""
    n = len(windows)
    kinds = list(dict.fromkeys(windows))            # distinct windows, in order of first layer
    if len(kinds) <= 1 or (layer_shapes is not None and len(set(layer_shapes)) > 1):
        window = kinds[0] if len(kinds) == 1 else None
        return KVCacheGroups((window,), (0,) * n, tuple(range(n)), max(n, 1))
    members = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    size = min(len(m) for m in members.values())
    group_windows: list[Optional[int]] = []
    layer_group, layer_slot = [0] * n, [0] * n
    for w in kinds:
        layers = members[w]
        for start in range(0, len(layers), size):
            g = len(group_windows)
            group_windows.append(w)
            for slot, layer in enumerate(layers[start:start + size]):
                layer_group[layer], layer_slot[layer] = g, slot
    return KVCacheGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)
