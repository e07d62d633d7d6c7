"""LoRA shrink: x @ A.T per token with the token's adapter (Punica SGMV, one Triton kernel).

Tokens are grouped by adapter slot in ``LoRAKernelMeta`` (one segment per active slot of
``sorted_token_ids``). One program computes a tile of ``BLOCK_M`` tokens of one segment for
one slice (and one split of the input dim with split-K): it gathers the tokens' rows of x and
multiplies them by that slot's A, so each adapter's A is streamed once per step for all of its
tokens; a decode row is a segment of one token. Programs find their segment by counting entries
of the first-tile column ``slot_start // BLOCK_M + a`` (the grid is ``num_tokens // BLOCK_M
+ num_active`` tiles, an upper bound on the tiles of all segments), so no per-segment host work
is needed and a program wastes no launch on another segment's empty tiles. With a fixed-grid meta
(CUDA graphs) ``num_active`` is ``max_loras``: padding entries (slot -1) and tiles past a
segment's end return at once, so the launch never depends on the batch's adapter mix.

The torch twin is ``kernels.reference.lora_shrink_ref``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import triton
import triton.language as tl

from kernels.lora_meta import LoRAKernelMeta
from kernels.utils import FLOAT_DTYPES, cdiv, check_tensor, is_interpreted, next_power_of_2, num_sms


@triton.jit
def _find_segment(active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr, pid_m, num_active,
                  BLOCK_M: tl.constexpr, MAX_LORAS_PAD: tl.constexpr):
    """Which segment (active index a) and which of its token tiles program ``pid_m`` takes.

    Active index a owns tile programs [start_a // BLOCK_M + a, start_{a+1} // BLOCK_M + a + 1),
    at least cdiv(count_a, BLOCK_M) of them; that first-program column strictly increases, so
    a = #{a : first_a <= pid_m} - 1. NOTE: one vector load of the per-slot columns instead of
    a binary search: one memory round trip instead of log2(max_loras) dependent ones.
    Returns (slot, count, start, tile); tile * BLOCK_M >= count means nothing to do.
    """
    a = tl.arange(0, MAX_LORAS_PAD)
    ok = a < num_active
    starts = tl.load(slot_start_ptr + a, mask=ok, other=0)
    counts = tl.load(num_tokens_per_slot_ptr + a, mask=ok, other=0)
    slots = tl.load(active_slots_ptr + a, mask=ok, other=-1)
    first = starts // BLOCK_M + a
    seg = tl.sum(((first <= pid_m) & ok).to(tl.int32), axis=0) - 1
    pick = a == seg
    start = tl.sum(tl.where(pick, starts, 0), axis=0)
    count = tl.sum(tl.where(pick, counts, 0), axis=0)
    slot = tl.sum(tl.where(pick, slots, 0), axis=0)
    tile = pid_m - (start // BLOCK_M + seg)
    return slot, count, start, tile


@triton.jit
def _lora_shrink_kernel(
    x_ptr, lora_a_ptr, out_ptr,
    sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr,
    num_active, in_dim, rank, scale,
    stride_x_tok, stride_a_slice, stride_a_slot, stride_a_rank, stride_o_slice, stride_o_tok,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
    MAX_LORAS_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Semantics (with SPLIT_K > 1 the wrapper zeroes out first and the splits add atomically):

        for s in range(num_slices), t in range(num_tokens):
          if slot(t) >= 0:
            out[s, t, :] = scale * x[t, :] @ lora_a[s, slot(t)].T      # fp32 accumulation
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot, count, start, tile = _find_segment(active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr, pid_m,
                                             num_active, BLOCK_M, MAX_LORAS_PAD)
    if slot < 0 or tile * BLOCK_M >= count:
        return

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    tok = tl.load(sorted_token_ids_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)  # [BLOCK_M]
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    a_base = lora_a_ptr + pid_s.to(tl.int64) * stride_a_slice + slot.to(tl.int64) * stride_a_slot

    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, in_dim, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < in_dim
        x = tl.load(x_ptr + tok[:, None] * stride_x_tok + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)      # [BLOCK_M, BLOCK_K]
        a_t = tl.load(a_base + offs_r[None, :] * stride_a_rank + offs_k[:, None],
                      mask=r_ok[None, :] & k_ok[:, None], other=0.0).to(tl.float32)    # [BLOCK_K, BLOCK_R]
        acc += tl.dot(x, a_t, input_precision=DOT_PRECISION)
    acc = acc * scale

    o_ptrs = out_ptr + pid_s.to(tl.int64) * stride_o_slice + tok[:, None] * stride_o_tok + offs_r[None, :]
    o_mask = m_ok[:, None] & r_ok[None, :]
    if SPLIT_K == 1:
        tl.store(o_ptrs, acc, mask=o_mask)
    else:
        tl.atomic_add(o_ptrs, acc, mask=o_mask)


@dataclass(frozen=True)
class _ShrinkConfig:
    block_m: int     # tokens per tile
    block_k: int     # input-dim chunk per inner step
    block_r: int     # rank, padded to a power of two >= 16
    split_k: int     # programs sharing one tile's input dim (atomic fp32 adds)
    num_warps: int
    num_stages: int = 3


def _shrink_config(device: torch.device, num_tokens: int, num_active: int, num_slices: int,
                   in_dim: int, rank: int, split_k: int | None, fixed_grid: bool = False) -> _ShrinkConfig:
    """Tile sizes from the batch's shape; with ``fixed_grid`` only from num_tokens (the same for
    every adapter mix, so a captured graph fits all): small tiles, split-K sized for one segment."""
    block_r = max(16, next_power_of_2(rank))
    if is_interpreted(device):
        return _ShrinkConfig(16, min(128, max(16, next_power_of_2(in_dim))), block_r, split_k or 1, 4)
    tokens_per_slot = 1 if fixed_grid else num_tokens / max(num_active, 1)
    block_m = 16 if tokens_per_slot <= 16 else (32 if tokens_per_slot <= 64 else 64)
    block_k = 128 if block_m <= 32 else 64
    if split_k is None:
        # Fixed grid: programs with work are unknown; size split-K for the fewest (one segment).
        programs = (num_tokens // block_m + (1 if fixed_grid else num_active)) * num_slices
        sms = num_sms(device)
        split_k = 1
        k_steps = cdiv(in_dim, block_k)
        while programs * split_k < 2 * sms and split_k * 2 <= min(16, k_steps // 2):
            split_k *= 2
    return _ShrinkConfig(block_m, block_k, block_r, split_k, 4)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta, out: torch.Tensor,
                scale: float = 1.0, *, split_k: int | None = None) -> None:
    """out[s, t] = scale * x[t] @ lora_a[s, slot(t)].T for every LoRA token, in place.

    Args:
        x: [num_tokens, in_dim] float16/bfloat16/float32, last dim contiguous.
        lora_a: [num_slices, max_loras, rank, in_dim], x's dtype, contiguous.
        meta: this step's ``LoRAKernelMeta`` (num_tokens and max_loras must match).
        out: [num_slices, num_tokens, rank] float32, contiguous. Only rows of LoRA tokens are
            defined afterwards: rows of base-model tokens are unspecified (left as they were, or
            zeroed with split-K), since ``lora_expand`` never reads them. If ``meta.no_lora``
            nothing is launched.
        scale: multiplies the result (the alpha/r scale usually lives in B instead).
        split_k: programs per tile along in_dim (power of two); None picks one.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, in_dim = x.shape
    dev = x.device
    check_tensor("lora_a", lora_a, ndim=4, dtypes=(x.dtype,), device=dev, contiguous=True)
    num_slices, max_loras, rank, _ = lora_a.shape
    check_tensor("lora_a", lora_a, shape=(num_slices, max_loras, rank, in_dim))
    check_tensor("out", out, dtypes=(torch.float32,), shape=(num_slices, num_tokens, rank), device=dev,
                 contiguous=True)
    _check_meta(meta, num_tokens, max_loras, dev)
    if split_k is not None and (split_k < 1 or split_k & (split_k - 1)):
        raise ValueError(f"split_k: {split_k} must be a power of two >= 1.")
    if meta.no_lora or num_tokens == 0:
        return
    cfg = _shrink_config(dev, num_tokens, meta.num_active, num_slices, in_dim, rank, split_k, meta.fixed_grid)
    if cfg.split_k > 1:
        out.zero_()                                  # the splits accumulate with atomic adds
    grid = (num_tokens // cfg.block_m + meta.num_active, num_slices, cfg.split_k)
    _lora_shrink_kernel[grid](
        x, lora_a, out,
        meta.sorted_token_ids, meta.active_slots, meta.num_tokens_per_slot, meta.slot_start,
        meta.num_active, in_dim, rank, float(scale),
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_R=cfg.block_r, SPLIT_K=cfg.split_k,
        MAX_LORAS_PAD=next_power_of_2(max_loras),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _check_meta(meta: LoRAKernelMeta, num_tokens: int, max_loras: int, device: torch.device) -> None:
    """The meta must describe this batch: same token count, same slot count, same device."""
    if not isinstance(meta, LoRAKernelMeta):
        raise ValueError(f"meta: expected LoRAKernelMeta, got {type(meta).__name__}.")
    if meta.num_tokens != num_tokens:
        raise ValueError(f"meta: built for {meta.num_tokens} tokens, the input has {num_tokens}.")
    if meta.max_loras != max_loras:
        raise ValueError(f"meta: built for max_loras={meta.max_loras}, the weights have {max_loras} slots.")
    for name in ("sorted_token_ids", "active_slots", "num_tokens_per_slot", "slot_start"):
        t = getattr(meta, name)
        if t.device != device or t.dtype != torch.int32:
            raise ValueError(f"meta.{name}: expected int32 on {device}, got {t.dtype} on {t.device}.")
