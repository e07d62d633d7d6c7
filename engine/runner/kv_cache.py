"""The paged KV cache: its element type, bytes per block, how many blocks fit beside the weights and
activations, and its allocation into every attention layer."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from engine.attention import AttentionBackend
from engine.config import CacheConfig, SchedulerConfig
from engine.dtypes import TORCH_DTYPES
from engine.layers.attention import PagedAttention
from engine.models.interfaces import ModelShape

logger = logging.getLogger("chorus.runner")


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device,
                   bf16_weights: bool) -> torch.dtype:
    """``CacheConfig.cache_dtype`` as a dtype: auto is the model's, or bfloat16 on a CPU whose quantized
    weights multiply in bfloat16 (``bf16_weights``: their activations are rounded to bfloat16 already; the
    decode step reads half the KV bytes: RESULTS.md "What sets the CPU defaults")."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cpu" and bf16_weights else model_dtype
    dtype = TORCH_DTYPES[name]
    if device.type == "cuda" and dtype != model_dtype:
        raise ValueError(f"kv_cache_dtype={name}: on CUDA the KV cache takes the model's dtype "
                         f"({model_dtype}); use auto.")
    return dtype


class KVCache:
    """One [num_blocks, block_size, num_kv_heads, head_dim] K and V tensor per attention layer.

    Args:
        layers: the model's attention layers (``ModelForCausalLM.attention_layers``); each may have its
            own KV heads and head size.
        block_size: tokens per block.
        dtype: the cache's element type (``kv_cache_dtype``).
        device: where it lives.
    """

    def __init__(self, layers: list[PagedAttention], block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layers = layers
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.num_blocks = 0
        """Blocks allocated (0: not yet)."""

    def bytes_per_block(self) -> int:
        elem_bytes = torch.finfo(self.dtype).bits // 8
        per_token = sum(2 * a.num_kv_heads * a.head_dim for a in self.layers) * elem_bytes
        return per_token * self.block_size

    def blocks_that_fit(self, cc: CacheConfig, max_needed_blocks: int, activation_reserve_bytes: int) -> int:
        """Blocks the budget holds (``num_gpu_blocks_override``, else CUDA: the memory left under
        ``gpu_memory_utilization`` after the weights and ``activation_reserve_bytes``; CPU:
        ``kv_cache_space``), at most ``max_needed_blocks``."""
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        per_block = self.bytes_per_block()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * cc.gpu_memory_utilization - (total - free) - activation_reserve_bytes
            budget = max(budget, 0)
        else:
            budget = cc.kv_cache_space * (1 << 30)
        num = int(budget // per_block)
        num = min(num, max_needed_blocks)
        if num < 2:
            raise ValueError(
                f"The KV cache budget fits only {num} blocks of {self.block_size} tokens "
                f"({per_block} bytes each); raise kv_cache_space (CPU) or gpu_memory_utilization (CUDA).")
        return num

    def allocate(self, num_blocks: int, backend: AttentionBackend) -> None:
        """Bind zeroed K and V tensors of ``num_blocks`` blocks and ``backend`` to every layer."""
        self.num_blocks = num_blocks
        for attn in self.layers:
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            # Zeroed: padded block-table entries point at block 0 and are masked, but must not be NaN.
            attn.k_cache = zeros(shape, self.dtype, self.device)
            attn.v_cache = zeros(shape, self.dtype, self.device)
            attn.backend = backend
        logger.info("KV cache: %d blocks x %d tokens (%.2f GiB)", num_blocks, self.block_size,
                    num_blocks * self.bytes_per_block() / (1 << 30))


def activation_reserve_bytes(shape: ModelShape, sc: SchedulerConfig, dtype: torch.dtype, graph_tokens: int,
                             encoder_cache_size: int) -> int:
    """Device memory the steps need beside the weights and the KV cache: activations of a full step (and of
    the largest CUDA graph's, ``graph_tokens``, which the graph pool keeps while eager steps need their own),
    float32 logits, the encoder cache's ``encoder_cache_size`` embeddings, and a fixed margin."""
    elem = torch.finfo(dtype).bits // 8
    per_token = (4 * shape.hidden_size + 3 * shape.intermediate_size) * elem
    logits = sc.max_num_seqs * shape.vocab_size * 4 * 3
    tokens = sc.max_num_batched_tokens + graph_tokens
    encoder_cache = encoder_cache_size * shape.hidden_size * elem   # one hidden-size row per embedding
    return int(tokens * per_token + logits + encoder_cache + (512 << 20))


_NUMPY_OF = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}
"""Same-width numpy dtypes (bfloat16: its bits as uint16, viewed back)."""


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU from numpy's calloc, whose pages the OS maps as zeros when first touched, so a
    4 GiB KV cache costs nothing until used (``torch.zeros`` writes every byte; RESULTS.md "What sets the CPU
    defaults")."""
    if device.type != "cpu" or dtype not in _NUMPY_OF:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(shape, dtype=_NUMPY_OF[dtype])).view(dtype)


def max_blocks_needed(max_num_seqs: int, max_model_len: int, block_size: int, cross_tokens: int = 0) -> int:
    """Blocks that could ever be in use at once (+1 for the reserved null block); ``cross_tokens``: the
    cross-attention K/V positions each request of an encoder-decoder model holds."""
    per_request = math.ceil(max_model_len / block_size) + math.ceil(cross_tokens / block_size)
    return max_num_seqs * per_request + 1
