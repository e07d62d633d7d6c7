"""The paged KV cache: its element type, bytes per block, how many blocks fit beside the weights and
activations, and its allocation into every attention layer (with each layer's FP8 scales), by KV cache group
(``engine.kv_cache_groups``: layers of the same slot in different groups share one K and V tensor)."""

from __future__ import annotations

import logging
import math
from typing import Optional

import numpy as np
import torch

from engine.attention import AttentionBackend
from engine.config import FP8_KV_CACHE_DTYPES, CacheConfig, SchedulerConfig
from engine.dtypes import TORCH_DTYPES
from engine.kv_cache_groups import KVCacheGroups, kv_cache_groups
from engine.kv_scales import FP8_KV_DTYPE, UNIT_KV_SCALES, KVScales
from engine.layers.attention import PagedAttention
from engine.models.interfaces import ModelShape

logger = logging.getLogger("chorus.runner")

FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability from which Triton converts to and from e4m3 (Ada, Hopper and later)."""


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device,
                   bf16_weights: bool) -> torch.dtype:
    """``CacheConfig.cache_dtype`` as a dtype: auto is the model's, or bfloat16 on a CPU whose quantized
    weights multiply in bfloat16 (``bf16_weights``: their activations are rounded to bfloat16 already; the
    decode step reads half the KV bytes: RESULTS.md "What sets the CPU defaults"). fp8 / fp8_e4m3: e4m3 with
    per-layer scales (half the bytes of bfloat16), CUDA only: the Triton attention kernels quantize and
    dequantize it, the CPU paths do not."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cpu" and bf16_weights else model_dtype
    if name in FP8_KV_CACHE_DTYPES:
        if device.type != "cuda":
            raise ValueError(f"kv_cache_dtype={name}: an FP8 KV cache is a CUDA feature (the Triton attention "
                             f"kernels quantize and dequantize it); on {device.type} use auto, bfloat16 or "
                             f"float32.")
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            raise ValueError(f"kv_cache_dtype={name}: an FP8 KV cache needs a GPU of compute capability "
                             f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or later (Ada, Hopper), this one "
                             f"is {capability[0]}.{capability[1]}; use auto.")
        return FP8_KV_DTYPE
    dtype = TORCH_DTYPES[name]
    if device.type == "cuda" and dtype != model_dtype:
        raise ValueError(f"kv_cache_dtype={name}: on CUDA the KV cache takes the model's dtype "
                         f"({model_dtype}) or fp8; use auto or fp8.")
    return dtype


class KVCache:
    """One [num_blocks, block_size, num_kv_heads, head_dim] K and V tensor per slot of the KV cache groups
    (``groups``: with one group, per attention layer), and for an FP8 cache each layer's scales.

    Args:
        layers: the model's attention layers (``ModelForCausalLM.attention_layers``); each may have its
            own KV heads and head size.
        block_size: tokens per block.
        dtype: the cache's element type (``kv_cache_dtype``).
        device: where it lives.
        checkpoint_scales: the checkpoint's FP8 KV scales by layer index
            (``engine.kv_scales.kv_scales_from_checkpoint``); None or {}: none. Used by an FP8 cache only.
    """

    def __init__(self, layers: list[PagedAttention], block_size: int, dtype: torch.dtype,
                 device: torch.device, checkpoint_scales: Optional[dict[int, KVScales]] = None) -> None:
        self.layers = layers
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.num_blocks = 0
        """Blocks allocated (0: not yet)."""
        self.scales = layer_kv_scales(checkpoint_scales or {}, len(layers), dtype)
        """Each layer's (k_scale, v_scale), bound to it at ``allocate`` (1.0 for float caches)."""
        self.groups: KVCacheGroups = kv_cache_groups([a.sliding_window for a in layers],
                                                     [(a.num_kv_heads, a.head_dim) for a in layers])
        """The layers' KV cache groups, from the windows the model gave them (``engine.models.sliding_window``)."""
        self.slot_layers = [layers[self.groups.layer_slot.index(j)] for j in range(self.groups.group_size)]
        """A layer of each slot (its K/V shape is the slot's)."""

    def bytes_per_block(self) -> int:
        """Bytes of one block: ``block_size`` tokens of every slot's K and V (one group's layers)."""
        elem_bytes = torch.finfo(self.dtype).bits // 8
        per_token = sum(2 * a.num_kv_heads * a.head_dim for a in self.slot_layers) * elem_bytes
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
        """Bind zeroed K and V tensors of ``num_blocks`` blocks, their scales (``k_scale``, ``v_scale``:
        floats the layer passes to every backend call that reads or writes them) and ``backend`` to every
        layer."""
        if self.dtype == FP8_KV_DTYPE and backend.name != "triton":
            raise ValueError(f"An FP8 KV cache needs the triton attention backend, not {backend.name!r}.")
        self.num_blocks = num_blocks
        slots = []
        for attn in self.slot_layers:
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            # Zeroed: padded block-table entries point at block 0 and are masked, but must not be NaN.
            slots.append((zeros(shape, self.dtype, self.device), zeros(shape, self.dtype, self.device)))
        for attn, scales, group, slot in zip(self.layers, self.scales, self.groups.layer_group,
                                             self.groups.layer_slot):
            attn.k_cache, attn.v_cache = slots[slot]
            attn.k_scale, attn.v_scale = scales
            attn.kv_group = group
            attn.backend = backend
        num_groups = self.groups.num_groups
        logger.info("KV cache: %d blocks x %d tokens = %d tokens%s, %s (%.2f GiB)", num_blocks, self.block_size,
                    num_blocks * self.block_size // num_groups,
                    f" of every layer ({num_groups} groups of {self.groups.group_size} layers: a sliding group "
                    f"holds only its window, so longer contexts fit)" if num_groups > 1 else "",
                    str(self.dtype).removeprefix("torch."), num_blocks * self.bytes_per_block() / (1 << 30))


def layer_kv_scales(checkpoint_scales: dict[int, KVScales], num_layers: int,
                    dtype: torch.dtype) -> list[KVScales]:
    """Each of ``num_layers`` layers' scales: for an FP8 cache the checkpoint's, else 1.0 with one warning
    that counts the layers without (as vLLM; their K and V saturate beyond +-448); 1.0 for float caches,
    whose checkpoint scales go unused."""
    beyond = sorted(n for n in checkpoint_scales if not 0 <= n < num_layers)
    if beyond:
        raise ValueError(f"The checkpoint has KV cache scales for layers {beyond[:4]}, the model {num_layers} "
                         f"attention layers.")
    if dtype != FP8_KV_DTYPE:
        if checkpoint_scales:
            logger.info("The checkpoint's FP8 KV cache scales are unused: the KV cache is %s "
                        "(--kv-cache-dtype fp8 uses them).", str(dtype).removeprefix("torch."))
        return [UNIT_KV_SCALES] * num_layers
    missing = [n for n in range(num_layers) if n not in checkpoint_scales]
    if missing:
        which = "any layer" if len(missing) == num_layers else f"{len(missing)} of {num_layers} layers"
        logger.warning("FP8 KV cache: the checkpoint has no k_scale/v_scale for %s; those use 1.0 (K and V "
                       "beyond +-448 saturate). A checkpoint calibrated for an FP8 KV cache carries them.", which)
    return [checkpoint_scales.get(n, UNIT_KV_SCALES) for n in range(num_layers)]


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


def max_blocks_needed(max_num_seqs: int, max_model_len: int, block_size: int, cross_tokens: int = 0,
                      num_groups: int = 1) -> int:
    """Blocks that could ever be in use at once (+1 for the reserved null block); ``cross_tokens``: the
    cross-attention K/V positions each request of an encoder-decoder model holds; ``num_groups``: KV cache
    groups, each holding a block list per request."""
    per_request = num_groups * math.ceil(max_model_len / block_size) + math.ceil(cross_tokens / block_size)
    return max_num_seqs * per_request + 1
