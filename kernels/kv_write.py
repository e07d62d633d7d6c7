"""Store this step's K/V rows into the paged cache at their slots (one Triton kernel).

One program per token copies all of its KV heads for both K and V; padding tokens
(slot < 0) are skipped. The torch twin is ``kernels.reference.write_kv_ref``.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from kernels.utils import FLOAT_DTYPES, check_tensor, next_power_of_2


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                     stride_c_blk, stride_c_slot, stride_c_head,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    """Semantics:

        for t in range(num_tokens):                 # one program each
          slot = slot_mapping[t]
          if slot < 0: continue                     # padding token
          k_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = k[t]   # all heads, cast to the cache dtype
          v_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = v[t]
    """
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    c_off = ((slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot
             + heads[:, None] * stride_c_head + dims[None, :])
    k = tl.load(k_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    # NOTE: via fp32 (exact for every supported dtype); the interpreter mishandles raw bf16 values.
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    tl.store(k_cache_ptr + c_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + c_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write K/V rows into the paged cache in place.

    Args:
        k, v: [num_tokens, num_kv_heads, head_dim], float16/bfloat16/float32, last dim contiguous
            (token and head strides are free, so views of a fused qkv output work).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, one dtype.
        slot_mapping: [num_tokens] int64; slot = block_id * block_size + offset, < 0 to skip.
    """
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, num_kv_heads, head_dim = k.shape
    dev = k.device
    check_tensor("v", v, dtypes=FLOAT_DTYPES, shape=tuple(k.shape), device=dev, last_dim_contiguous=True)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, device=dev, contiguous=True)
    check_tensor("k_cache", k_cache, shape=(None, None, num_kv_heads, head_dim))
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape), device=dev,
                 contiguous=True)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(num_tokens,), device=dev,
                 contiguous=True)
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        HEADS_PAD=next_power_of_2(num_kv_heads), DIM_PAD=next_power_of_2(head_dim),
        num_warps=4,
    )
