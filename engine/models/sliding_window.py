"""Which decoder layers of a checkpoint attend within a sliding window, as transformers reads its config.

- Mistral, Mixtral, Qwen3-MoE: every layer, when ``sliding_window`` is set (transformers'
  ``create_sliding_window_causal_mask`` for the whole model; Qwen3-MoE's config keeps ``sliding_window`` only
  with ``use_sliding_window`` and has no ``max_window_layers``);
- Gemma 3 (text, and the text model of ``gemma3``), Qwen2 (also the language model of Qwen2-Audio and of a
  LLaVA over Qwen2), Qwen2-MoE, the language models of Qwen2-VL and Qwen2.5-VL, and Qwen3: the layers whose
  ``layer_types`` entry is ``"sliding_attention"``; the others attend to the whole context. transformers
  fills ``layer_types`` from Gemma 3's ``sliding_window_pattern`` (every pattern-th layer global) and from
  Qwen's ``max_window_layers`` (layers i >= max_window_layers slide, when ``use_sliding_window``;
  ``sliding_window`` is None without it; Qwen2-MoE's config instead makes the even layers below
  ``max_window_layers`` slide, and ``sliding_window`` 0 without ``use_sliding_window``).

A windowed layer's query at position p sees keys p - window < k <= p (``engine.attention``). The runner groups
the layers by window (``engine.kv_cache_groups``, from the ``sliding_window`` each layer is given here): a
sliding group's KV blocks before a request's window are returned to the pool while it runs, a global group's
are kept (the scheduler's ``KVCacheManager``). ``kv_free_window``: the window of every layer, when they share
one.
"""

from __future__ import annotations

from typing import Iterable, Optional

from engine.layers.attention import PagedAttention

SLIDING, FULL = "sliding_attention", "full_attention"
"""transformers' ``layer_types`` entries."""
_EVERY_LAYER = ("mistral", "mixtral", "qwen3_moe")
"""Families whose ``sliding_window`` applies to every layer."""
_BY_LAYER_TYPE = ("gemma3_text", "qwen2", "qwen2_moe", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3")
"""Families whose ``layer_types`` say which layers slide."""


def layer_types(config) -> list[str]:
    """Each decoder layer's kind, "sliding_attention" or "full_attention" (``layer_types``, or derived as
    transformers does: from Qwen's ``max_window_layers``, layers from it on sliding; else from
    ``sliding_window_pattern``, every pattern-th layer global)."""
    types = list(getattr(config, "layer_types", None) or [])
    first_sliding = getattr(config, "max_window_layers", None)
    if not types and first_sliding is not None:
        types = [SLIDING if i >= first_sliding else FULL for i in range(config.num_hidden_layers)]
    if not types:
        pattern = int(getattr(config, "sliding_window_pattern", None) or 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]
    if len(types) != config.num_hidden_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types={types} must name {config.num_hidden_layers} layers, each "
                         f"{SLIDING!r} or {FULL!r}")
    return types


def layer_windows(text_config) -> list[Optional[int]]:
    """Each decoder layer's sliding window in positions (None: the whole context), for the families above;
    every layer None for the others and for a config without ``sliding_window`` (or with Qwen's
    ``use_sliding_window`` false)."""
    window = getattr(text_config, "sliding_window", None)
    if not getattr(text_config, "use_sliding_window", True):
        window = None
    model_type = getattr(text_config, "model_type", "")
    n = text_config.num_hidden_layers
    if not window or model_type not in _EVERY_LAYER + _BY_LAYER_TYPE:
        return [None] * n
    window = int(window)
    if model_type in _EVERY_LAYER:
        return [window] * n
    return [window if kind == SLIDING else None for kind in layer_types(text_config)]


def kv_free_window(hf_config) -> Optional[int]:
    """The window outside of which a request's KV is never read again, when every layer has that window
    (None: some layer attends to the whole context, or none slides)."""
    windows = layer_windows(hf_config.get_text_config())
    if windows and windows[0] is not None and all(w == windows[0] for w in windows):
        return windows[0]
    return None


def set_layer_windows(layers: Iterable[PagedAttention], windows: list[Optional[int]]) -> None:
    """Give each attention layer its window (``layer_windows``' order: decoder layer order)."""
    layers = list(layers)
    if len(layers) != len(windows):
        raise ValueError(f"{len(layers)} attention layers for {len(windows)} windows")
    for layer, window in zip(layers, windows):
        layer.sliding_window = window
