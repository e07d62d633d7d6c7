"""Per-head RMSNorm of q and of k before rotary (Qwen3, Qwen3-MoE and Gemma 3's ``q_norm`` / ``k_norm``).

A model whose attention has these norms declares them on its attention layer (``PagedAttention.qk_norm``,
set in the model's constructor); the layer then applies them itself, so that on CUDA they run inside the
kernels that already rotate q and k and write the KV cache (``kernels.kv_write.rotary_write_kv``, the
pure-decode ``kernels.paged_attention.paged_decode_rotary``) instead of as two launches of their own per
layer. Elsewhere (CPU, M-RoPE steps with [3, T] positions) the norm modules run first, as the model would run
them: the CPU path computes exactly what it computes without the declaration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers.norm import RMSNorm
from kernels.kv_write import QKNormWeights


@dataclass(frozen=True)
class QKNorm:
    """The q and k norms of one attention layer: an RMSNorm over ``head_dim`` whose weight every head shares.

    The modules stay the model's (their weights load under the model's names, ``self_attn.q_norm.weight``);
    this holds them without registering them again. A checkpoint whose norms scale by 1 + w (Gemma) has
    ``1 + w`` stored in the weights at load (``engine.models.gemma3``), so the kernels' ``plus_one`` stays off.
    """

    q_norm: RMSNorm     # weight [head_dim]
    k_norm: RMSNorm     # weight [head_dim], the same eps as q_norm's

    def __post_init__(self) -> None:
        if self.q_norm.eps != self.k_norm.eps or self.q_norm.weight.shape != self.k_norm.weight.shape:
            raise ValueError(f"q/k norms: one eps and head_dim expected, got eps {self.q_norm.eps} / "
                             f"{self.k_norm.eps}, weights {tuple(self.q_norm.weight.shape)} / "
                             f"{tuple(self.k_norm.weight.shape)}.")

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, head_dim], k: [T, Hkv, head_dim] (views of a packed q/k/v output) -> normed copies of
        the same shapes, through the norm modules over [T * heads, head_dim] rows."""
        num_tokens, num_heads, head_dim = q.shape
        q = self.q_norm(q.reshape(num_tokens * num_heads, head_dim)).view(num_tokens, num_heads, head_dim)
        k = self.k_norm(k.reshape(num_tokens * k.shape[1], head_dim)).view(num_tokens, k.shape[1], head_dim)
        return q, k

    def weights(self) -> QKNormWeights:
        """The norms as the fused kernels take them."""
        return QKNormWeights(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
