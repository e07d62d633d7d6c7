"""What the engine reads off a checkpoint's config before any model is built, under each family's names
(an encoder-decoder model names its decoder's sizes ``decoder_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ShardedSizes:
    """The sizes tensor parallelism splits over its ranks (the decoder's, for an encoder-decoder model)."""

    num_heads: int
    """Attention (query) heads."""
    num_kv_heads: int
    """Key/value heads (split over the ranks, or replicated when fewer than the ranks)."""
    mlp_name: str
    """The config key of the MLP's width, for messages ("intermediate_size", "decoder_ffn_dim")."""
    mlp_size: Optional[int]
    """The MLP's intermediate width (None: the config names none)."""


def sharded_sizes(text_config: Any) -> ShardedSizes:
    """The heads and MLP width of ``text_config`` (the checkpoint's text config) that a shard divides."""
    heads = getattr(text_config, "decoder_attention_heads", None) or text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    mlp = "decoder_ffn_dim" if getattr(text_config, "decoder_ffn_dim", None) else "intermediate_size"
    return ShardedSizes(heads, kv_heads, mlp, getattr(text_config, mlp, None))
