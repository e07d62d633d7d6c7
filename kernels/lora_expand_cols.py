"""LoRA expand for small steps: one program per column block of all tokens, looping over the adapters.

Same semantics as ``kernels.lora_expand`` (y[t, slice] += (sum_j buf[s, j, t]) @ B_s[slot(t)].T
for LoRA tokens), another decomposition. ``lora_expand`` gives each (adapter segment, column
range) its own program: at decode sizes most of its programs find an empty segment and exit, and
each working one pays a chain of dependent loads (segment search, token ids, partials) for a few
kilobytes of B. Here a program owns ``block_t`` tokens (all of a decode step's) and ``block_n``
columns of one slice: it loads the tokens' slots and summed partials once, walks the step's
active adapters (``meta.active_slots``; the count is taken on the device from the -1 padding,
so a fixed-grid launch loops over the active ones only), and for each streams that adapter's
[block_n, rank] block of B and adds ``h[tokens of that adapter] @ B.T`` into a [block_t,
block_n] fp32 tile; then one coalesced read-modify-write of y. So every program has work, each
adapter's B is read once per column block, and the loads of successive adapters pipeline.

It pays while one token tile covers the step: the B of every active adapter is read once per
token tile, so ``lora.layers`` takes it for steps of at most ``EXPAND_COLS_MAX_TOKENS`` tokens
(``CHORUS_LORA_EXPAND_COLS_MAX_TOKENS`` overrides; 0 turns it off) and ``lora_expand`` above.
``CHORUS_LORA_EXPAND_COLS_CONFIG`` overrides ``LoRAExpandColsConfig`` fields (e.g.
``"block_n=64,num_warps=4,num_stages=3"``).

The torch twin is ``kernels.reference.lora_expand_ref`` (the same function as ``lora_expand``'s).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

import triton
import triton.language as tl

from kernels.lora_expand import MAX_SLICES, _slice_of, check_b_slices
from kernels.lora_meta import LoRAKernelMeta
from kernels.lora_shrink import ConfigOverride, _check_launch, _check_meta, _check_pow2
from kernels.utils import FLOAT_DTYPES, cdiv, check_tensor, is_interpreted, next_power_of_2, num_sms

EXPAND_COLS_MAX_TOKENS = 128
"""Steps of at most this many tokens take this kernel by default (``lora.layers``)."""

MAX_BLOCK_T = 256
"""The largest token tile (the fp32 accumulator is block_t x block_n registers)."""


@triton.jit(do_not_specialize=["num_tokens"])   # eager steps vary it: one binary for all
def _lora_expand_cols_kernel(
    buf_ptr, y_ptr, b0_ptr, b1_ptr, b2_ptr,
    token_lora_slots_ptr, active_slots_ptr,
    num_tokens, max_loras, rank, n0, n1, n2, off0, off1, off2,
    stride_buf_slice, stride_buf_split, stride_buf_tok, stride_y_tok,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
    MAX_LORAS_PAD: tl.constexpr, ADD_INPUTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Semantics (B_s = [b0, b1, b2][s], each [max_loras, n_s, rank] contiguous):

        for s in range(num_slices), t in range(num_tokens):
          if slot(t) >= 0:
            h = sum(buf[s, j, t, :] for j in range(SPLIT_K))                 # fp32, [rank]
            y[t, off_s:off_s + n_s] = (y[t, off_s:off_s + n_s] if ADD_INPUTS else 0) + h @ B_s[slot(t)].T

    Program (t, n, s) covers tokens [t * BLOCK_T, (t + 1) * BLOCK_T) and columns
    [n * BLOCK_N, (n + 1) * BLOCK_N) of slice s. Rows of base-model tokens are not written.
    """
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    b_ptr, n_out, col0 = _slice_of(pid_s, b0_ptr, b1_ptr, b2_ptr, n0, n1, n2, off0, off1, off2)
    n_lo = pid_n * BLOCK_N
    if n_lo >= n_out:
        return
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < num_tokens
    tslot = tl.load(token_lora_slots_ptr + offs_t, mask=t_ok, other=-1)              # [BLOCK_T]
    lora_row = tslot >= 0
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    h_ptrs = (buf_ptr + pid_s.to(tl.int64) * stride_buf_slice + offs_t.to(tl.int64)[:, None] * stride_buf_tok
              + offs_r[None, :])                                                     # [BLOCK_T, BLOCK_R]
    h_mask = lora_row[:, None] & r_ok[None, :]
    h = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    for j in tl.static_range(SPLIT_K):                     # unrolled: the partial loads overlap
        h += tl.load(h_ptrs + j * stride_buf_split, mask=h_mask, other=0.0)

    # Active slots are a prefix of active_slots (padding is -1): count them here, so that a
    # fixed-grid launch (max_loras entries) loops over the active ones only.
    a_idx = tl.arange(0, MAX_LORAS_PAD)
    num_active = tl.sum((tl.load(active_slots_ptr + a_idx, mask=a_idx < max_loras, other=-1) >= 0).to(tl.int32),
                        axis=0)
    offs_n = n_lo + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    b_mask = n_ok[:, None] & r_ok[None, :]
    b_cols = b_ptr + offs_n[:, None] * rank + offs_r[None, :]                           # [BLOCK_N, BLOCK_R]
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for a in range(0, num_active):
        slot = tl.load(active_slots_ptr + a)
        b = tl.load(b_cols + slot.to(tl.int64) * n_out * rank, mask=b_mask, other=0.0).to(tl.float32)
        h_a = tl.where((tslot == slot)[:, None], h, 0.0)                                # [BLOCK_T, BLOCK_R]
        acc += tl.dot(h_a, tl.trans(b), input_precision=DOT_PRECISION)                 # [BLOCK_T, BLOCK_N]

    y_ptrs = y_ptr + offs_t.to(tl.int64)[:, None] * stride_y_tok + col0 + offs_n[None, :]
    y_mask = lora_row[:, None] & n_ok[None, :]
    if ADD_INPUTS:
        acc += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@dataclass(frozen=True)
class LoRAExpandColsConfig:
    """Launch parameters of the column-block expand (``CHORUS_LORA_EXPAND_COLS_CONFIG`` field names)."""

    block_t: int = 64
    """Tokens per program: a power of two in [16, MAX_BLOCK_T] (the fp32 tile is block_t x block_n)."""
    block_n: int = 64
    """Output columns per program: a power of two >= 16."""
    num_warps: int = 4
    """Warps per program (1..16, a power of two)."""
    num_stages: int = 3
    """Software-pipelining depth of the adapter loop (>= 1)."""

    def __post_init__(self) -> None:
        _check_pow2("block_t", self.block_t, 16, MAX_BLOCK_T)
        _check_pow2("block_n", self.block_n, 16)
        _check_launch(self.num_warps, self.num_stages)


@functools.lru_cache(maxsize=4096)
def lora_expand_cols_config(num_tokens: int, out_dims: tuple[int, ...], device: torch.device,
                            override: ConfigOverride = ()) -> LoRAExpandColsConfig:
    """The default launch config, with ``override`` fields applied last.

    One token tile covers the step (up to MAX_BLOCK_T tokens); the column block is the widest of
    32..128 that still gives a program per SM, so narrow projections (o, down) get more, smaller
    programs and the wide gate_up fewer, larger ones.
    """
    block_t = min(MAX_BLOCK_T, max(16, next_power_of_2(num_tokens)))
    if is_interpreted(device):
        cfg = LoRAExpandColsConfig(block_t, min(32, max(16, next_power_of_2(max(out_dims)))), 4, 1)
    else:
        tiles = cdiv(num_tokens, block_t)
        block_n = 128 if block_t <= 64 else 8192 // block_t          # the fp32 tile <= 64 x 128
        while block_n > 32 and tiles * sum(cdiv(n, block_n) for n in out_dims) < num_sms(device):
            block_n //= 2
        cfg = LoRAExpandColsConfig(block_t, block_n, 8 if block_t * block_n >= 128 * 128 else 4, 3)
    return dataclasses.replace(cfg, **dict(override))


def lora_expand_cols(buf: torch.Tensor, lora_b_slices: Sequence[torch.Tensor], meta: LoRAKernelMeta,
                     y: torch.Tensor, slice_offsets: Sequence[int], add_inputs: bool = True, *,
                     config: Optional[LoRAExpandColsConfig] = None) -> None:
    """``kernels.lora_expand.lora_expand`` with the column-block decomposition (same arguments,
    same result): y[t, off_s:off_s + n_s] (+)= (sum_j buf[s, j, t]) @ B_s[slot(t)].T for LoRA rows.

    Args:
        buf: [num_slices, split_k, num_tokens, rank] float32 (``lora_shrink``'s partials), contiguous.
        lora_b_slices: num_slices (1..3) tensors [max_loras, out_dim_s, rank] in y's dtype, contiguous.
        meta: this step's ``LoRAKernelMeta`` (its token_lora_slots and active_slots are read).
        y: [num_tokens, total_out] float16/bfloat16/float32, last dim contiguous.
        slice_offsets: num_slices host ints, column of y where slice s starts.
        add_inputs: True adds to y (fp32 sum, then cast); False overwrites those columns.
            Rows of base-model tokens are never touched.
        config: launch config; None: ``lora_expand_cols_config``'s default.
    """
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens = y.shape[0]
    dev = y.device
    if not isinstance(lora_b_slices, (list, tuple)) or not 1 <= len(lora_b_slices) <= MAX_SLICES:
        raise ValueError(f"lora_b_slices: expected a list/tuple of 1..{MAX_SLICES} tensors.")
    num_slices = len(lora_b_slices)
    check_tensor("buf", buf, ndim=4, dtypes=(torch.float32,), device=dev, contiguous=True)
    split_k, rank = buf.shape[1], buf.shape[3]
    check_tensor("buf", buf, shape=(num_slices, split_k, num_tokens, rank))
    if split_k < 1:
        raise ValueError("buf: split_k (dim 1) must be >= 1.")
    max_loras = lora_b_slices[0].shape[0] if isinstance(lora_b_slices[0], torch.Tensor) else -1
    out_dims = check_b_slices(lora_b_slices, y, max_loras, rank, slice_offsets)
    _check_meta(meta, num_tokens, max_loras, dev)
    if config is None:
        config = lora_expand_cols_config(num_tokens, out_dims, dev)
    if meta.no_lora or num_tokens == 0:
        return

    pad = MAX_SLICES - num_slices
    b_args = list(lora_b_slices) + [lora_b_slices[0]] * pad
    n_args = list(out_dims) + [0] * pad
    off_args = [int(o) for o in slice_offsets] + [0] * pad
    grid = (cdiv(num_tokens, config.block_t), cdiv(max(out_dims), config.block_n), num_slices)
    _lora_expand_cols_kernel[grid](
        buf, y, *b_args,
        meta.token_lora_slots, meta.active_slots,
        num_tokens, max_loras, rank, *n_args, *off_args,
        buf.stride(0), buf.stride(1), buf.stride(2), y.stride(0),
        BLOCK_T=config.block_t, BLOCK_N=config.block_n, BLOCK_R=max(16, next_power_of_2(rank)),
        SPLIT_K=split_k, MAX_LORAS_PAD=next_power_of_2(max_loras),
        ADD_INPUTS=bool(add_inputs), DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
