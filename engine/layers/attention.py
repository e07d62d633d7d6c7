"""Attention layer over the paged KV cache (the math lives in engine/attention.py)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from engine.attention import AttentionBackend, get_attention_metadata


class PagedAttention(nn.Module):
    """Writes this step's K/V into the layer's cache, then attends over each request's context.

    The runner binds ``k_cache``/``v_cache`` ([num_blocks, block_size, num_kv_heads, head_dim])
    and ``backend`` after allocating the KV cache.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None
        self.backend: Optional[AttentionBackend] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: Optional[torch.Tensor] = None,
                rotary=None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H * D]. With ``rotary`` (a RotaryEmbedding) and
        ``positions`` ([T]), q and k are rotated first (fused with the KV write on CUDA)."""
        meta = get_attention_metadata()
        if rotary is not None and q.is_cuda and self.backend.name == "triton":
            rotary.apply_and_write_kv(positions, q, k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        else:
            if rotary is not None:
                q, k = rotary(positions, q, k)
            self.backend.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale, k, v)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
