"""LoRA shrink: x @ A.T per token with the token's adapter (Punica SGMV, one Triton kernel).

Tokens are grouped by adapter slot in ``LoRAKernelMeta`` (one segment per active slot of
``sorted_token_ids``). One program computes a tile of ``BLOCK_M`` tokens of one segment for
one slice and one of ``split_k`` contiguous chunks of the input dim: it gathers the tokens' rows
of x and multiplies them by that slot's A, so each adapter's A is streamed once per step for all
of its tokens; a decode row is a segment of one token. Programs find their segment by counting
entries of the first-tile column ``slot_start // BLOCK_M + a`` (the grid is ``num_tokens //
BLOCK_M + num_active`` tiles, an upper bound on the tiles of all segments), so no per-segment host
work is needed. With a fixed-grid meta (CUDA graphs) ``num_active`` is ``max_loras``: padding
entries (slot -1) and tiles past a segment's end return at once, so the launch never depends on
the batch's adapter mix.

Split-K without atomics: each split stores its own fp32 partial, ``out[slice, split, token]``,
with plain stores, and ``kernels.lora_expand`` sums the ``split_k`` partials when it loads its
input. So there is no memset and no atomic add; ``split_k`` is ``out.shape[1]``.

Launch configs (``LoRAShrinkConfig``) come from ``lora_shrink_config``: tile sizes from the
tokens per segment, and split_k so that the programs with work fill a few waves of the GPU even
when every segment is as small as it can be (with a fixed grid: ``max_loras`` segments).
``KernelPolicy.lora_shrink`` overrides fields of ``LoRAShrinkConfig`` (``CHORUS_KERNEL_POLICY``
items such as ``lora_shrink.block_k=256,lora_shrink.split_k=4``; split_k is clamped to
``max_split_k``, so a reserved buffer always fits). ``lora.layers`` passes the engine's overrides
to every launch; the kernel wrappers read no configuration of their own.

The torch twin is ``kernels.reference.lora_shrink_ref``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch

import triton
import triton.language as tl

from kernels.lora_meta import MAX_SPLIT_K, LoRAKernelMeta, max_split_k
from kernels.lora_pages import LoRASlotPages, padded_pages
from kernels.utils import FLOAT_DTYPES, cdiv, check_tensor, is_interpreted, next_power_of_2, num_sms

PROGRAMS_PER_SM = 2
"""Programs with work the default configs aim for, per SM, with the smallest possible segments."""

ConfigOverride = tuple[tuple[str, int], ...]
"""Parsed ``field=int`` overrides of a launch config (hashable, so configs can be cached)."""


# ----------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------
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
def _tile_tokens(sorted_token_ids_ptr, start, count, tile, BLOCK_M: tl.constexpr):
    """Token rows of tile ``tile`` of the segment at ``start`` (``count`` tokens): (tok [BLOCK_M]
    int64, m_ok [BLOCK_M])."""
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    tok = tl.load(sorted_token_ids_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
    return tok, m_ok


@triton.jit
def _slot_rows(page_table_ptr, slot_ranks_ptr, slot, rank, max_pages, BLOCK_R: tl.constexpr,
               PAGE_ROWS: tl.constexpr, IDENTITY_PAGES: tl.constexpr):
    """(page [BLOCK_R] int64, sub [BLOCK_R], r_ok [BLOCK_R]): rank row r of slot ``slot`` is row ``sub``
    of pool page ``page`` (``kernels.lora_pages``); r_ok: r is below both the slot's own rank and
    ``rank`` (none for slot < 0). IDENTITY_PAGES (the padded layout, ``padded_pages``): page l is slot l
    and every slot has ``rank`` rows, so neither table is read: a decode-sized call is a chain of
    dependent loads, and two fewer links are two fewer memory round trips."""
    offs_r = tl.arange(0, BLOCK_R)
    # NOTE: the slot test broadcast to a vector (the interpreter rejects scalar-bool masks).
    has = tl.zeros([BLOCK_R], tl.int32) + slot >= 0
    slot0 = tl.maximum(slot, 0).to(tl.int64)
    if IDENTITY_PAGES:
        r_ok = has & (offs_r < rank)
        page = tl.zeros([BLOCK_R], tl.int64) + slot0
    else:
        slot_rank = tl.load(slot_ranks_ptr + slot0)
        r_ok = has & (offs_r < rank) & (offs_r < slot_rank)
        if PAGE_ROWS >= BLOCK_R:
            # One page holds every row the tile reads: the page is one scalar load splat over the rows,
            # so the compiler still sees B's rank columns as contiguous and loads them as vectors.
            page = tl.zeros([BLOCK_R], tl.int64) + tl.load(page_table_ptr + slot0 * max_pages).to(tl.int64)
        else:
            page = tl.load(page_table_ptr + slot0 * max_pages + offs_r // PAGE_ROWS, mask=r_ok,
                           other=0).to(tl.int64)
    return page, offs_r % PAGE_ROWS, r_ok


@triton.jit
def _shrink_tile(x_ptr, lora_a_ptr, tok, m_ok, page, sub, r_ok, pid_s, k_lo, k_end, in_dim,
                 stride_x_tok, stride_a_slice, stride_a_page, stride_a_row,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                 UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """[BLOCK_M, BLOCK_R] fp32 = x[tok, K] @ A[:, K].T, K = [k_lo, min(k_end, in_dim)), A's row r at
    page[r] * stride_a_page + sub[r] * stride_a_row of slice pid_s (``_slot_rows``; 0 where not r_ok)."""
    a_rows = (lora_a_ptr + pid_s.to(tl.int64) * stride_a_slice + page[:, None] * stride_a_page
              + sub[:, None] * stride_a_row)                                            # [BLOCK_R, 1]
    x_rows = x_ptr + tok[:, None] * stride_x_tok                                        # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_end, in_dim), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # NOTE: two bounds, each divisible by 16 (no min()), so the loads stay vectorized.
        k_ok = (offs_k < in_dim) & (offs_k < k_end)
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)   # [BM, BK]
        a = tl.load(a_rows + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)   # [BR, BK]
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, tl.trans(a), input_precision=DOT_PRECISION)                   # [BLOCK_M, BLOCK_R]
    return acc


@triton.jit(do_not_specialize=["num_active"])   # eager steps vary it: one binary for all
def _lora_shrink_kernel(
    x_ptr, lora_a_ptr, out_ptr,
    sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr, page_table_ptr, slot_ranks_ptr,
    num_active, in_dim, rank, k_per_split, scale, max_pages,
    stride_x_tok, stride_a_slice, stride_a_page, stride_a_row, stride_o_slice, stride_o_split, stride_o_tok,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, MAX_LORAS_PAD: tl.constexpr,
    PAGE_ROWS: tl.constexpr, IDENTITY_PAGES: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Semantics (K_j = [j * k_per_split, (j + 1) * k_per_split) clipped to [0, in_dim); A_l: slot l's
    rank_l = slot_ranks[l] rows of the pool, ``kernels.lora_pages``):

        for s in range(num_slices), j in range(split_k), t in range(num_tokens):
          if slot(t) >= 0:
            out[s, j, t, :rank_l] = scale * x[t, K_j] @ A_l[s][:, K_j].T   # fp32 accumulation, l = slot(t)

    Every split of a LoRA token is stored (zero for an empty K_j), so the sum over j is the full
    product and nothing needs zeroing first. Rows of base-model tokens, and columns at or past the
    slot's rank, are not written.
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot, count, start, tile = _find_segment(active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr, pid_m,
                                             num_active, BLOCK_M, MAX_LORAS_PAD)
    if slot < 0 or tile * BLOCK_M >= count:
        return
    tok, m_ok = _tile_tokens(sorted_token_ids_ptr, start, count, tile, BLOCK_M)         # [BLOCK_M]
    k_lo = pid_k * k_per_split
    page, sub, r_ok = _slot_rows(page_table_ptr, slot_ranks_ptr, slot, rank, max_pages, BLOCK_R, PAGE_ROWS,
                                 IDENTITY_PAGES)
    acc = _shrink_tile(x_ptr, lora_a_ptr, tok, m_ok, page, sub, r_ok, pid_s, k_lo, k_lo + k_per_split, in_dim,
                       stride_x_tok, stride_a_slice, stride_a_page, stride_a_row,
                       BLOCK_M, BLOCK_K, BLOCK_R, UPCAST, DOT_PRECISION) * scale              # [BM, BR] f32
    offs_r = tl.arange(0, BLOCK_R)
    o_ptrs = (out_ptr + pid_s.to(tl.int64) * stride_o_slice + pid_k.to(tl.int64) * stride_o_split
              + tok[:, None] * stride_o_tok + offs_r[None, :])
    tl.store(o_ptrs, acc, mask=m_ok[:, None] & r_ok[None, :])


# ----------------------------------------------------------------------------------------
# Launch configs
# ----------------------------------------------------------------------------------------
def _check_pow2(name: str, value: int, min_value: int, max_value: int = 1 << 30) -> None:
    if (isinstance(value, bool) or not isinstance(value, int) or not min_value <= value <= max_value
            or value & (value - 1)):
        raise ValueError(f"{name}: {value!r} must be a power of two in [{min_value}, {max_value}].")


def _check_launch(num_warps: int, num_stages: int) -> None:
    _check_pow2("num_warps", num_warps, 1, 16)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages: {num_stages!r} must be an int >= 1.")


@dataclass(frozen=True)
class LoRAShrinkConfig:
    """Launch parameters of the shrink kernel (``KernelPolicy.lora_shrink`` overrides these fields)."""

    block_m: int = 16
    """Tokens per tile: a power of two >= 16 (the smallest tl.dot tile)."""
    block_k: int = 256
    """Input-dim elements per inner step: a power of two >= 16."""
    split_k: int = 1
    """Programs splitting one tile's input dim, each storing its own fp32 partial (a power of two
    <= MAX_SPLIT_K); the partials buffer's dim 1."""
    num_warps: int = 4
    """Warps per program (1..16, a power of two)."""
    num_stages: int = 3
    """Software-pipelining depth of the input-dim loop (>= 1)."""

    def __post_init__(self) -> None:
        _check_pow2("block_m", self.block_m, 16)
        _check_pow2("block_k", self.block_k, 16)
        _check_pow2("split_k", self.split_k, 1, MAX_SPLIT_K)
        _check_launch(self.num_warps, self.num_stages)


def tile_m_for(num_tokens: int, num_segments: int) -> tuple[int, int]:
    """(block_m, upper bound on the tiles with work) when num_tokens fall into num_segments segments.

    The tiles are sized for the mean segment; ``num_segments`` is ``meta.num_active`` (with a fixed
    grid: ``max_loras``, i.e. the worst case of as many segments as can exist).
    """
    segs = max(1, min(num_segments, num_tokens))
    per_seg = num_tokens / segs
    block_m = 16 if per_seg <= 16 else (32 if per_seg <= 64 else 64)
    # Segment i has cdiv(c_i, block_m) <= 1 + (c_i - 1) / block_m tiles.
    return block_m, segs + (num_tokens - segs) // block_m


@functools.lru_cache(maxsize=4096)
def lora_shrink_config(num_tokens: int, num_segments: int, num_slices: int, in_dim: int,
                       device: torch.device, override: ConfigOverride = ()) -> LoRAShrinkConfig:
    """The default launch config for one shrink, with ``override`` fields applied last.

    Args:
        num_tokens: rows of x.
        num_segments: ``meta.num_active`` (max_loras with a fixed grid: sized for the worst case).
        num_slices, in_dim: of lora_a.
        device: where it runs (SM count; CPU means the interpreter: small tiles).
        override: (field, value) pairs, e.g. ``KernelPolicy.lora_shrink`` (split_k is clamped to
            ``max_split_k``).
    """
    block_m, tiles = tile_m_for(num_tokens, num_segments)
    if is_interpreted(device):
        # Small tiles; two splits whenever in_dim has two chunks, so every caller's tests meet them.
        split_k = 2 if in_dim > 16 and max_split_k(num_tokens) >= 2 else 1
        cfg = LoRAShrinkConfig(16, min(64, max(16, next_power_of_2(cdiv(in_dim, split_k)))), split_k, 4)
    else:
        # NOTE: defaults from benchmarks/sweeps/lora_prefill_sweep.py on an H200. Decode (--tokens
        # 64,256, 1-64 adapters): one-token segments want block_k 128 and ~8 split programs per SM
        # (split_k 8 on every Llama-3-8B projection), not the 2 per SM that suit long segments.
        # Prefill-length segments (block_m 64; 16384 tokens, 16 adapters) of packed projections
        # (q/k/v, gate/up) were faster with block_k 64; o and down found no better config than 128
        # (benchmarks/RESULTS.md, "Launch configs and constants inside the kernels").
        block_k = 128 if block_m <= 16 else (256 if block_m <= 32 else (64 if num_slices >= 2 else 128))
        per_sm = 8 if block_m <= 16 else PROGRAMS_PER_SM
        # Fewest splits that give per_sm programs with work per SM, each split >= 2 steps.
        split_k, k_steps, target = 1, cdiv(in_dim, block_k), per_sm * num_sms(device)
        while (tiles * num_slices * split_k < target and split_k * 2 <= max_split_k(num_tokens)
               and 2 * split_k * 2 <= k_steps):
            split_k *= 2
        cfg = LoRAShrinkConfig(block_m, block_k, split_k, 4, 3)
    cfg = dataclasses.replace(cfg, **dict(override))
    return dataclasses.replace(cfg, split_k=min(cfg.split_k, max_split_k(num_tokens)))


# ----------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------
def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta, out: torch.Tensor,
                scale: float = 1.0, *, config: Optional[LoRAShrinkConfig] = None,
                pages: Optional[LoRASlotPages] = None) -> None:
    """out[s, j, t, :rank_l] = scale * x[t, K_j] @ A_l[s][:, K_j].T for every LoRA token (l = its slot,
    A_l its rank_l rows), in place.

    Args:
        x: [num_tokens, in_dim] float16/bfloat16/float32, last dim contiguous.
        lora_a: the pool [num_slices, num_pages * page_rows, in_dim] (``kernels.lora_pages``), or the padded
            [num_slices, max_loras, max_rank, in_dim] (any strides but the last; its pages: ``padded_pages``);
            x's dtype, last dim contiguous.
        meta: this step's ``LoRAKernelMeta`` (num_tokens and max_loras must match).
        out: [num_slices, split_k, num_tokens, rank] float32, contiguous (rank: at least every slot's):
            split j holds the partial product over input chunk K_j (``split_chunk(in_dim, split_k)``
            elements each); their sum over dim 1 is the product (``lora_expand`` sums them). Rows of
            base-model tokens, and columns at or past a token's slot rank, are left as they were. If
            ``meta.no_lora`` nothing is launched.
        scale: multiplies the result (the alpha/r scale usually lives in B instead).
        config: launch config; its split_k must be out.shape[1]. None: ``lora_shrink_config``'s
            default with out.shape[1] splits.
        pages: the slots' page table (None: the padded layout, ``kernels.lora_pages.padded_pages``).
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, in_dim = x.shape
    dev = x.device
    if lora_a.dim() == 4:                 # padded: page l is slot l's [rank, in] (any strides, no copy)
        check_tensor("lora_a", lora_a, ndim=4, dtypes=(x.dtype,), device=dev, last_dim_contiguous=True)
        check_tensor("lora_a", lora_a, shape=(None, None, None, in_dim))
        max_loras = lora_a.shape[1]
        a_strides = (lora_a.stride(0), lora_a.stride(1), lora_a.stride(2))
    else:
        check_tensor("lora_a", lora_a, ndim=3, dtypes=(x.dtype,), device=dev, last_dim_contiguous=True)
        check_tensor("lora_a", lora_a, shape=(None, None, in_dim))
        max_loras = meta.max_loras
        a_strides = (lora_a.stride(0), pages.page_rows * lora_a.stride(1), lora_a.stride(1))
    num_slices = lora_a.shape[0]
    check_tensor("out", out, ndim=4, dtypes=(torch.float32,), device=dev, contiguous=True)
    split_k, rank = out.shape[1], out.shape[3]
    check_tensor("out", out, shape=(num_slices, split_k, num_tokens, rank))
    _check_pow2("out.shape[1] (split_k)", split_k, 1)
    _check_meta(meta, num_tokens, max_loras, dev)
    if pages is None:
        pages = padded_pages(max_loras, lora_a.shape[2], dev)
    pages.check(max_loras, dev)
    if lora_a.dim() == 4 and pages.page_rows != lora_a.shape[2]:
        raise ValueError(f"pages: {pages.page_rows} rows per page, the padded lora_a has rank {lora_a.shape[2]}.")
    if config is None:
        config = dataclasses.replace(
            lora_shrink_config(num_tokens, meta.num_active, num_slices, in_dim, dev), split_k=split_k)
    elif config.split_k != split_k:
        raise ValueError(f"config.split_k {config.split_k} != out.shape[1] {split_k}.")
    if meta.no_lora or num_tokens == 0:
        return
    grid = (num_tokens // config.block_m + meta.num_active, num_slices, split_k)
    _lora_shrink_kernel[grid](
        x, lora_a, out,
        meta.sorted_token_ids, meta.active_slots, meta.num_tokens_per_slot, meta.slot_start, pages.page_table,
        pages.slot_ranks, meta.num_active, in_dim, rank, split_chunk(in_dim, split_k), float(scale), pages.max_pages,
        x.stride(0), *a_strides,
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=config.block_m, BLOCK_K=config.block_k, BLOCK_R=max(16, next_power_of_2(rank)),
        MAX_LORAS_PAD=next_power_of_2(max_loras), PAGE_ROWS=pages.page_rows, IDENTITY_PAGES=pages.identity,
        UPCAST=is_interpreted(dev) or x.dtype == torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def split_chunk(in_dim: int, split_k: int) -> int:
    """Input-dim elements per split: cdiv(in_dim, split_k) rounded up to 16 (aligned loads).

    NOTE: ``kernels.reference.lora_shrink_ref`` computes the same chunks.
    """
    return cdiv(cdiv(in_dim, split_k), 16) * 16


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
