"""LoRA expand: y[t, slice] += buf[s, t] @ B_s[slot(t)].T (Punica SGMV, one Triton kernel).

The counterpart of ``kernels.lora_shrink``: same segment walk over ``LoRAKernelMeta``, one
program per (token tile of one adapter segment, output-column tile, slice). Slices are the
parts of a packed projection (q, k, v of qkv_proj; gate, up of gate_up_proj), each with its own
B tensor and output width, written side by side into y at ``slice_offsets``. Up to
``MAX_SLICES`` slices go through one launch (their B pointers are separate kernel arguments).

The torch twin is ``kernels.reference.lora_expand_ref``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

import triton
import triton.language as tl

from kernels.lora_meta import LoRAKernelMeta
from kernels.lora_shrink import _check_meta, _find_segment
from kernels.utils import FLOAT_DTYPES, check_int, check_tensor, is_interpreted, next_power_of_2

MAX_SLICES = 3


# NOTE: no int specialization of sizes/offsets: the slice branches must agree on types.
@triton.jit(do_not_specialize=["n0", "n1", "n2", "off0", "off1", "off2"])
def _lora_expand_kernel(
    buf_ptr, y_ptr, b0_ptr, b1_ptr, b2_ptr,
    sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr,
    num_active, rank, n0, n1, n2, off0, off1, off2,
    stride_buf_slice, stride_buf_tok, stride_y_tok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, MAX_LORAS_PAD: tl.constexpr,
    ADD_INPUTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Semantics (B_s = [b0, b1, b2][s], each [max_loras, n_s, rank] contiguous):

        for s in range(num_slices), t in range(num_tokens):
          if slot(t) >= 0:
            delta = buf[s, t, :] @ B_s[slot(t)].T                         # fp32, [n_s]
            y[t, off_s:off_s + n_s] = (y[t, off_s:off_s + n_s] if ADD_INPUTS else 0) + delta
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    if pid_s == 0:
        b_ptr = b0_ptr
        n_out = n0
        col0 = off0
    elif pid_s == 1:
        b_ptr = b1_ptr
        n_out = n1
        col0 = off1
    else:
        b_ptr = b2_ptr
        n_out = n2
        col0 = off2
    if pid_n * BLOCK_N >= n_out:
        return
    slot, count, start, tile = _find_segment(active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr, pid_m,
                                             num_active, BLOCK_M, MAX_LORAS_PAD)
    if slot < 0 or tile * BLOCK_M >= count:
        return

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    tok = tl.load(sorted_token_ids_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)  # [BLOCK_M]
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out

    buf_rows = buf_ptr + pid_s.to(tl.int64) * stride_buf_slice + tok[:, None] * stride_buf_tok
    a = tl.load(buf_rows + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :],
                other=0.0).to(tl.float32)                                             # [BLOCK_M, BLOCK_R]
    b_base = b_ptr + slot.to(tl.int64) * n_out * rank
    b_t = tl.load(b_base + offs_n[None, :] * rank + offs_r[:, None],
                  mask=n_ok[None, :] & r_ok[:, None], other=0.0).to(tl.float32)       # [BLOCK_R, BLOCK_N]
    delta = tl.dot(a, b_t, input_precision=DOT_PRECISION)                             # [BLOCK_M, BLOCK_N]

    y_ptrs = y_ptr + tok[:, None] * stride_y_tok + (col0 + offs_n)[None, :]
    y_mask = m_ok[:, None] & n_ok[None, :]
    if ADD_INPUTS:
        delta += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, delta.to(y_ptr.dtype.element_ty), mask=y_mask)


@dataclass(frozen=True)
class _ExpandConfig:
    block_m: int     # tokens per tile
    block_n: int     # output columns per tile
    block_r: int     # rank, padded to a power of two >= 16
    num_warps: int
    num_stages: int = 3


def _expand_config(device: torch.device, num_tokens: int, num_active: int, max_out: int,
                   rank: int, fixed_grid: bool = False) -> _ExpandConfig:
    block_r = max(16, next_power_of_2(rank))
    if is_interpreted(device):
        return _ExpandConfig(16, min(64, max(16, next_power_of_2(max_out))), block_r, 4)
    tokens_per_slot = 1 if fixed_grid else num_tokens / max(num_active, 1)
    block_m = 16 if tokens_per_slot <= 16 else (32 if tokens_per_slot <= 64 else 64)
    return _ExpandConfig(block_m, 128, block_r, 4)


def lora_expand(buf: torch.Tensor, lora_b_slices: Sequence[torch.Tensor], meta: LoRAKernelMeta,
                y: torch.Tensor, slice_offsets: Sequence[int], add_inputs: bool = True) -> None:
    """Add each LoRA token's B-projection of ``buf`` into its columns of y, in place.

    Args:
        buf: [num_slices, num_tokens, rank] float32 (the shrink output), contiguous.
        lora_b_slices: num_slices (1..3) tensors [max_loras, out_dim_s, rank] in y's dtype, contiguous.
        meta: this step's ``LoRAKernelMeta``.
        y: [num_tokens, total_out] float16/bfloat16/float32, last dim contiguous.
        slice_offsets: num_slices host ints, column of y where slice s starts
            (off_s + out_dim_s <= total_out).
        add_inputs: True adds to y (fp32 sum, then cast); False overwrites those columns.
            Rows of base-model tokens are never touched.
    """
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, total_out = y.shape
    dev = y.device
    if not isinstance(lora_b_slices, (list, tuple)) or not 1 <= len(lora_b_slices) <= MAX_SLICES:
        raise ValueError(f"lora_b_slices: expected a list/tuple of 1..{MAX_SLICES} tensors.")
    num_slices = len(lora_b_slices)
    check_tensor("buf", buf, ndim=3, dtypes=(torch.float32,), device=dev, contiguous=True)
    rank = buf.shape[2]
    check_tensor("buf", buf, shape=(num_slices, num_tokens, rank))
    max_loras = lora_b_slices[0].shape[0] if isinstance(lora_b_slices[0], torch.Tensor) else -1
    for s, b in enumerate(lora_b_slices):
        check_tensor(f"lora_b_slices[{s}]", b, ndim=3, dtypes=(y.dtype,), shape=(max_loras, None, rank),
                     device=dev, contiguous=True)
    if len(slice_offsets) != num_slices:
        raise ValueError(f"slice_offsets: {len(slice_offsets)} offsets for {num_slices} slices.")
    for s, (b, off) in enumerate(zip(lora_b_slices, slice_offsets)):
        check_int(f"slice_offsets[{s}]", off)
        if off + b.shape[1] > total_out:
            raise ValueError(f"slice_offsets[{s}]: columns [{off}, {off + b.shape[1]}) exceed y's "
                             f"{total_out}.")
    _check_meta(meta, num_tokens, max_loras, dev)
    if meta.no_lora or num_tokens == 0:
        return

    out_dims = [b.shape[1] for b in lora_b_slices]
    cfg = _expand_config(dev, num_tokens, meta.num_active, max(out_dims), rank, meta.fixed_grid)
    pad = MAX_SLICES - num_slices
    b_args = list(lora_b_slices) + [lora_b_slices[0]] * pad
    n_args = out_dims + [0] * pad
    off_args = [int(o) for o in slice_offsets] + [0] * pad
    grid = (num_tokens // cfg.block_m + meta.num_active, triton.cdiv(max(out_dims), cfg.block_n), num_slices)
    _lora_expand_kernel[grid](
        buf, y, *b_args,
        meta.sorted_token_ids, meta.active_slots, meta.num_tokens_per_slot, meta.slot_start,
        meta.num_active, rank, *n_args, *off_args,
        buf.stride(0), buf.stride(1), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r,
        MAX_LORAS_PAD=next_power_of_2(max_loras),
        ADD_INPUTS=bool(add_inputs), DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
