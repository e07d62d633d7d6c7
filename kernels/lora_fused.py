"""LoRA shrink and expand in one launch: y[t, slice] += (x[t] @ A_s[slot(t)].T) @ B_s[slot(t)].T.

The decode alternative to ``kernels.lora_shrink`` followed by ``kernels.lora_expand``: the same
segment walk over ``LoRAKernelMeta`` and the same grid as the expand (token tile of one adapter
segment x column range x slice), but each program computes its tokens' shrink itself, over the
full input dim in ``block_k`` chunks (fp32 accumulation, kept in registers), then walks its
``n_tiles`` column tiles of ``block_n`` adding the B-projection into y. One launch instead of two,
no partials buffer, no atomics.

When it should win: decode steps, where each segment holds a few tokens and the split pair is
bound by launch latency and the dependency between its two kernels, not by bytes (an H200 runs
the 8 split launches of a Llama-3-8B decoder layer at ~8x their byte bound at batch 64).

Its cost: every column program of a token tile recomputes that tile's shrink, so the step does
~``T * in_dim * rank * num_column_programs`` multiply-adds (and re-reads x and A from L2 that
many times) where the split pair does ``T * in_dim * rank``, and each program walks the whole
input dim serially (the split shrink spreads it over ``split_k`` programs). So it is only for
small steps: ``lora.layers`` takes it for every step with ``CHORUS_LORA_KERNEL=fused``, and for
steps of at most ``FUSED_MAX_TOKENS`` tokens with ``auto``.

Launch configs (``LoRAFusedConfig``) come from ``lora_fused_config``;
``CHORUS_LORA_FUSED_CONFIG`` overrides fields, e.g. ``"block_m=16,block_k=256,block_n=128,
n_tiles=4,num_warps=4,num_stages=3"`` (fields of ``LoRAFusedConfig``); ``lora.layers`` reads it
(through ``engine.envs``) once per layer.

The torch twin is ``kernels.reference.lora_shrink_expand_ref``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

import triton
import triton.language as tl

from kernels.lora_expand import MAX_N_TILES, MAX_SLICES, _expand_tile, _slice_of, check_b_slices, widest_n_tiles
from kernels.lora_meta import LoRAKernelMeta
from kernels.lora_shrink import (ConfigOverride, _check_launch, _check_meta, _check_pow2, _find_segment,
                                 _shrink_tile, _tile_tokens, tile_m_for)
from kernels.utils import FLOAT_DTYPES, cdiv, check_tensor, is_interpreted, next_power_of_2

FUSED_MAX_TOKENS = 256
"""With ``CHORUS_LORA_KERNEL=auto``, steps of at most this many tokens take the fused kernel (the
decode batches the engine captures in CUDA graphs); larger steps take the split pair, whose shrink
is not recomputed per column program. NOTE: a guess, unmeasured: set it from the fused vs split
rows of ``benchmarks/kernels.py --lora-only``."""


@triton.jit(do_not_specialize=["num_active"])   # eager steps vary it: one binary for all
def _lora_fused_kernel(
    x_ptr, lora_a_ptr, y_ptr, b0_ptr, b1_ptr, b2_ptr,
    sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr,
    num_active, in_dim, rank, n0, n1, n2, off0, off1, off2, cols_per_program,
    stride_x_tok, stride_a_slice, stride_a_slot, stride_a_rank, stride_y_tok,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    MAX_LORAS_PAD: tl.constexpr, UPCAST: tl.constexpr, SHRINK_PRECISION: tl.constexpr,
    EXPAND_PRECISION: tl.constexpr,
):
    """Semantics (B_s = [b0, b1, b2][s], each [max_loras, n_s, rank] contiguous):

        for s in range(num_slices), t in range(num_tokens):
          if slot(t) >= 0:
            h = x[t, :] @ lora_a[s, slot(t)].T                                # fp32 accumulation, [rank]
            delta = h @ B_s[slot(t)].T                                        # fp32, [n_s]
            y[t, off_s:off_s + n_s] = y[t, off_s:off_s + n_s] + delta         # fp32 add, cast to y's dtype

    Program (m, n, s) covers columns [n * cols_per_program, (n + 1) * cols_per_program) of slice s
    and computes h for its token tile itself (every column program of a tile recomputes it).
    Rows of base-model tokens and columns outside the slices are not touched.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    b_ptr, n_out, col0 = _slice_of(pid_s, b0_ptr, b1_ptr, b2_ptr, n0, n1, n2, off0, off1, off2)
    n_lo = pid_n * cols_per_program
    if n_lo >= n_out:
        return
    slot, count, start, tile = _find_segment(active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr, pid_m,
                                             num_active, BLOCK_M, MAX_LORAS_PAD)
    if slot < 0 or tile * BLOCK_M >= count:
        return
    tok, m_ok = _tile_tokens(sorted_token_ids_ptr, start, count, tile, BLOCK_M)         # [BLOCK_M]
    # Shrink over the whole input dim (h = x[tok] @ A[s, slot].T, fp32), then expand this
    # program's columns: y[tok, cols] += h @ B_s[slot][cols].T.
    h = _shrink_tile(x_ptr, lora_a_ptr, tok, m_ok, slot, pid_s, 0, in_dim, in_dim, rank,
                     stride_x_tok, stride_a_slice, stride_a_slot, stride_a_rank,
                     BLOCK_M, BLOCK_K, BLOCK_R, UPCAST, SHRINK_PRECISION)                 # [BM, BR] f32
    _expand_tile(h, b_ptr, y_ptr, slot, tok, m_ok, rank, n_out, col0, n_lo, cols_per_program, stride_y_tok,
                 BLOCK_N, BLOCK_R, True, UPCAST, EXPAND_PRECISION)


# ----------------------------------------------------------------------------------------
# Launch configs
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoRAFusedConfig:
    """Launch parameters of the fused kernel (``CHORUS_LORA_FUSED_CONFIG`` field names)."""

    block_m: int = 16
    """Tokens per tile: a power of two >= 16 (the smallest tl.dot tile)."""
    block_k: int = 256
    """Input-dim elements per step of the shrink loop: a power of two >= 16."""
    block_n: int = 128
    """Output columns per step of the expand loop: a power of two >= 16."""
    n_tiles: int = 2
    """Column tiles one program walks (a power of two <= MAX_N_TILES): a program covers
    block_n * n_tiles columns of one slice, and every program recomputes its tile's shrink, so
    more columns per program means less recomputation but fewer programs."""
    num_warps: int = 4
    """Warps per program (1..16, a power of two)."""
    num_stages: int = 3
    """Software-pipelining depth of the loops (>= 1)."""

    def __post_init__(self) -> None:
        _check_pow2("block_m", self.block_m, 16)
        _check_pow2("block_k", self.block_k, 16)
        _check_pow2("block_n", self.block_n, 16)
        _check_pow2("n_tiles", self.n_tiles, 1, MAX_N_TILES)
        _check_launch(self.num_warps, self.num_stages)


@functools.lru_cache(maxsize=4096)
def lora_fused_config(num_tokens: int, num_segments: int, in_dim: int, out_dims: tuple[int, ...],
                      device: torch.device, override: ConfigOverride = ()) -> LoRAFusedConfig:
    """The default launch config for one fused shrink + expand, with ``override`` fields applied last.

    Args:
        num_tokens: rows of x and y.
        num_segments: ``meta.num_active`` (max_loras with a fixed grid: sized for the worst case).
        in_dim: of x and lora_a.
        out_dims: output width of each slice.
        device: where it runs (SM count; CPU means the interpreter: small tiles).
        override: from ``kernels.lora_shrink.parse_config_override``.
    """
    block_m, tiles = tile_m_for(num_tokens, num_segments)
    if is_interpreted(device):
        # Small tiles, several input chunks and two column tiles, so tests meet every loop.
        cfg = LoRAFusedConfig(16, min(32, max(16, next_power_of_2(in_dim))),
                              min(32, max(16, next_power_of_2(max(out_dims)))), 2, 4)
    else:
        # NOTE: unmeasured guesses (no GPU run of this kernel yet): block_k 256 as the shrink's long
        # segments; block_n 128 as the expand; then the most columns per program (least shrink
        # recomputation) that still leave PROGRAMS_PER_SM programs with work per SM.
        cfg = LoRAFusedConfig(block_m, 256, 128, widest_n_tiles(tiles, out_dims, 128, device), 4, 3)
    return dataclasses.replace(cfg, **dict(override))


# ----------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------
def lora_shrink_expand(x: torch.Tensor, lora_a: torch.Tensor, lora_b_slices: Sequence[torch.Tensor],
                       meta: LoRAKernelMeta, y: torch.Tensor, slice_offsets: Sequence[int], *,
                       config: Optional[LoRAFusedConfig] = None) -> None:
    """y[t, off_s:off_s + n_s] += (x[t] @ lora_a[s, slot(t)].T) @ lora_b_slices[s][slot(t)].T, in place.

    The result of ``lora_shrink(x, lora_a, meta, buf, 1.0)`` then ``lora_expand(buf, lora_b_slices,
    meta, y, slice_offsets, add_inputs=True)`` (up to fp32 summation order), in one launch.

    Args:
        x: [num_tokens, in_dim] float16/bfloat16/float32, last dim contiguous.
        lora_a: [num_slices, max_loras, rank, in_dim], x's dtype, last dim contiguous.
        lora_b_slices: num_slices (1..3) tensors [max_loras, out_dim_s, rank] in y's dtype, contiguous.
        meta: this step's ``LoRAKernelMeta`` (num_tokens and max_loras must match).
        y: [num_tokens, total_out] float16/bfloat16/float32, last dim contiguous; the update is
            added (fp32 sum, then cast). Rows of base-model tokens are never touched; if
            ``meta.no_lora`` nothing is launched.
        slice_offsets: num_slices host ints, column of y where slice s starts
            (off_s + out_dim_s <= total_out).
        config: launch config; None: ``lora_fused_config``'s default.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, in_dim = x.shape
    dev = x.device
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES, shape=(num_tokens, None), device=dev,
                 last_dim_contiguous=True)
    if not isinstance(lora_b_slices, (list, tuple)) or not 1 <= len(lora_b_slices) <= MAX_SLICES:
        raise ValueError(f"lora_b_slices: expected a list/tuple of 1..{MAX_SLICES} tensors.")
    num_slices = len(lora_b_slices)
    check_tensor("lora_a", lora_a, ndim=4, dtypes=(x.dtype,), device=dev, last_dim_contiguous=True)
    max_loras, rank = lora_a.shape[1], lora_a.shape[2]
    check_tensor("lora_a", lora_a, shape=(num_slices, max_loras, rank, in_dim))
    out_dims = check_b_slices(lora_b_slices, y, max_loras, rank, slice_offsets)
    _check_meta(meta, num_tokens, max_loras, dev)
    if config is None:
        config = lora_fused_config(num_tokens, meta.num_active, in_dim, out_dims, dev)
    elif not isinstance(config, LoRAFusedConfig):
        raise ValueError(f"config: expected LoRAFusedConfig, got {type(config).__name__}.")
    if meta.no_lora or num_tokens == 0:
        return

    pad = MAX_SLICES - num_slices
    cols_per_program = config.block_n * config.n_tiles
    grid = (num_tokens // config.block_m + meta.num_active, cdiv(max(out_dims), cols_per_program), num_slices)
    _lora_fused_kernel[grid](
        x, lora_a, y, *lora_b_slices, *[lora_b_slices[0]] * pad,
        meta.sorted_token_ids, meta.active_slots, meta.num_tokens_per_slot, meta.slot_start,
        meta.num_active, in_dim, rank, *out_dims, *[0] * pad, *[int(o) for o in slice_offsets], *[0] * pad,
        cols_per_program,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), y.stride(0),
        BLOCK_M=config.block_m, BLOCK_K=config.block_k, BLOCK_N=config.block_n,
        BLOCK_R=max(16, next_power_of_2(rank)), MAX_LORAS_PAD=next_power_of_2(max_loras),
        UPCAST=is_interpreted(dev) or x.dtype == torch.float32,
        SHRINK_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EXPAND_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
