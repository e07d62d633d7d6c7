"""Attention layer over the paged KV cache (the math lives in engine/attention.py)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from engine.attention import AttentionBackend
from engine.forward_context import current_cpu_ops, get_forward_context
from engine.layers.adapter import take_update
from engine.layers.qk_norm import QKNorm
from kernels.cpu_native import CACHE_DTYPES


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
        self.qk_norm: Optional[QKNorm] = None
        """The per-head q and k RMSNorms this layer applies before rotary (``engine.layers.qk_norm``; fused
        into the rotary + KV write kernels on CUDA); None: q and k arrive ready. Set by the model."""
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None
        self.backend: Optional[AttentionBackend] = None
        self.k_scale: float = 1.0
        """An FP8 cache's K scale (the cache stores k / k_scale); 1.0 for float caches. Set by the runner's
        ``KVCache.allocate``."""
        self.v_scale: float = 1.0
        """An FP8 cache's V scale."""
        self.sliding_window: Optional[int] = None
        """This layer's sliding window in positions (a query sees itself and the window - 1 keys before it);
        None: the whole context. Set by the model (``engine.models.sliding_window``)."""
        self.kv_group: int = 0
        """The layer's KV cache group (``engine.kv_cache_groups``), whose block table and slots it reads; set by
        the runner's ``KVCache.allocate``."""

    def fuses_rotary_write(self, x: torch.Tensor) -> bool:
        """Inputs like x take the fused rotary + KV write (CUDA with the Triton backend), which
        can also add the q/k/v projection's pending adapter update."""
        return x.is_cuda and self.backend is not None and self.backend.name == "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: Optional[torch.Tensor] = None,
                rotary=None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H * D]. With ``rotary`` (a RotaryEmbedding) and
        ``positions`` ([T], or [3, T] for M-RoPE steps with image tokens), q and k are rotated first
        (fused with the KV write on CUDA for [T] positions).

        When q, k, v are views of a packed q | k | v projection output whose adapter update is
        still pending (``engine.layers.adapter``, ``Feeds.ROTARY_KV_WRITE``), the fused rotary + KV
        write adds it first; elsewhere it is added in place before anything reads q, k, v.
        With ``qk_norm`` q and k arrive before their norms: the fused kernels apply them (no pending
        update then), elsewhere the norm modules run first.
        """
        meta = get_forward_context().attn_metadata
        if self.kv_group:
            meta = meta.for_group(self.kv_group)
        pending = take_update(q)
        fused = rotary is not None and positions.dim() == 1 and self.fuses_rotary_write(q)
        if pending is not None and (not fused or self.qk_norm is not None):
            pending.finish()                        # in place: q, k, v view its output
            pending = None
        norm = None                                 # the q/k norms, for the fused kernels
        if self.qk_norm is not None:
            if fused:
                norm = self.qk_norm.weights()
            else:
                q, k = self.qk_norm(q, k)           # the norm modules (on CPU: the model's norms, exactly)
        if fused:
            if pending is None:
                out = self.backend.attend_decode_rotary(q, k, v, positions, rotary, self.k_cache, self.v_cache,
                                                        meta, self.scale, k_scale=self.k_scale,
                                                        v_scale=self.v_scale, window=self.sliding_window,
                                                        qk_norm=norm)
                if out is not None:                 # a pure-decode step: rotary + KV write + attention in one kernel
                    return out.reshape(q.shape[0], self.num_heads * self.head_dim)
            rotary.apply_and_write_kv(positions, q, k, v, self.k_cache, self.v_cache, meta.slot_mapping, pending,
                                      k_scale=self.k_scale, v_scale=self.v_scale, qk_norm=norm)
        elif self._cpu_rotary_write(q, k, v, positions, rotary, meta):
            pass                                    # q and k rotated in place, k and v in the cache
        else:
            if rotary is not None:
                q, k = rotary(positions, q, k)
            self.backend.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, meta.slots_padded,
                                  k_scale=self.k_scale, v_scale=self.v_scale)
        out = self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale, k, v, k_scale=self.k_scale,
                                  v_scale=self.v_scale, window=self.sliding_window)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _cpu_rotary_write(self, q, k, v, positions, rotary, meta) -> bool:
        """On CPU with the C layer ops: rotary on q and k in place and the KV write as one op
        (``kernels.cpu_layer_ops``); False where it does not apply (no rotary, M-RoPE's [3, T] positions,
        non-float32 tensors, a float16 cache): the caller rotates and writes in torch."""
        ops = current_cpu_ops() if rotary is not None else None
        if (ops is None or positions.dim() != 1 or q.dtype != torch.float32
                or self.k_cache.dtype not in CACHE_DTYPES
                or any(t.stride(-1) != 1 or t.stride(-2) != self.head_dim for t in (q, k, v))):
            return False
        ops.rotary_write_kv(positions, q, k, v, rotary.cos, rotary.sin, rotary.rotary_dim, self.k_cache,
                            self.v_cache, meta.slot_mapping)
        return True
