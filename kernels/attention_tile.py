"""One KV tile of paged flash attention: the gather through the block table and the online-softmax
update, and the split-KV bookkeeping (a program's segment of the tiles, its partials). Shared by
``kernels.paged_attention`` (mixed batches) and ``kernels.paged_decode`` (pure decode); both
inline these (Triton jit functions), so each kernel compiles as if written out.

FP8 caches (``kernels.kv_write.FP8_KV_DTYPE``) hold K / k_scale and V / v_scale. The tiles are read
as stored (each e4m3 value is exact in float16, bfloat16 and float32) and the scales are applied
where they cost one multiply per row instead of one per element: k_scale inside the score scale
(``score_scale_log2``: q . (K_stored * k_scale) * scale = q . K_stored * (scale * k_scale)) and v_scale
on the accumulated output (``scale_values``), which is linear in V.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from kernels.kv_write import FP8_KV_DTYPE


LOG2E = 1.4426950408889634


def score_scale_log2(scale: float, k_scale: float, cache_dtype: torch.dtype) -> float:
    """The kernels' ``qk_scale_log2``: the softmax scale in log2 units, times an FP8 cache's k_scale."""
    qk = float(scale) * LOG2E
    return qk * k_scale if cache_dtype == FP8_KV_DTYPE else qk


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, kpos, k_ok, kv_head, dims, dim_ok,
                 stride_c_blk, stride_c_slot, stride_c_head,
                 BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Keys ``kpos`` [TILE_N] of KV head ``kv_head`` through the request's block-table row ``bt_row``:
    K[p] = k_cache[bt_row[p // BLOCK_SIZE], p % BLOCK_SIZE, kv_head] (V likewise) for p with
    ``k_ok``, 0 elsewhere and on dims past ``dim_ok``. Returns K^T [HEAD_PAD, TILE_N] and
    V [TILE_N, HEAD_PAD] in ``DOT_DTYPE`` (the dot's operand type: the query's, float32 when
    upcast); an FP8 cache's values as stored, unscaled."""
    blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    kv_off = blk * stride_c_blk + (kpos % BLOCK_SIZE) * stride_c_slot + kv_head * stride_c_head
    k_t = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None],
                  mask=k_ok[None, :] & dim_ok[:, None], other=0.0)       # [HEAD_PAD, TILE_N]
    v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :],
                mask=k_ok[:, None] & dim_ok[None, :], other=0.0)         # [TILE_N, HEAD_PAD]
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:   # via float32 (exact), as vLLM's Triton attention
        k_t = k_t.to(tl.float32)
        v = v.to(tl.float32)
    return k_t.to(DOT_DTYPE), v.to(DOT_DTYPE)


@triton.jit
def scale_values(acc, v_scale, v_cache_ptr):
    """acc (a sum of weights times V rows as stored) times the V cache's scale where it is FP8 (it
    stores V / v_scale); acc itself for float caches."""
    if v_cache_ptr.dtype.element_ty == tl.float8e4nv:
        acc = acc * v_scale
    return acc


@triton.jit
def online_softmax_step(q, k_t, v, visible, m_i, l_i, acc, qk_scale_log2, DOT_PRECISION: tl.constexpr):
    """Fold one tile into the running state (scores in log2 units):

        s = q @ k_t * qk_scale_log2, -inf where not ``visible``       [BLOCK_M, TILE_N]
        m' = max(m, rowmax s);  p = 2^(s - m');  alpha = 2^(m - m')
        l' = l * alpha + rowsum p;  acc' = acc * alpha + p @ v          (fp32)

    Returns (m', l', acc'). A row with no visible key yet keeps m = -inf and is shifted by 0,
    not by -inf (no inf - inf)."""
    s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale_log2   # [BLOCK_M, TILE_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def segment_tiles(num_tiles, seg, NUM_SPLITS: tl.constexpr):
    """[tile_lo, tile_hi): the key tiles segment ``seg`` of ``NUM_SPLITS`` covers (all of them at 1
    split; else cdiv(num_tiles, NUM_SPLITS) each, the last ones possibly short or empty)."""
    if NUM_SPLITS == 1:
        tile_lo = num_tiles * 0              # a tensor either way (folds to the constant 0)
        tile_hi = num_tiles
    else:
        tiles_per_seg = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = seg * tiles_per_seg
        tile_hi = tl.minimum(tile_lo + tiles_per_seg, num_tiles)
    return tile_lo, tile_hi


@triton.jit
def store_partials(part_acc_ptr, part_max_ptr, part_sum_ptr, part, m_i, l_i, acc, row_ok, dims,
                   HEAD_PAD: tl.constexpr):
    """Split-KV partials of rows ``part`` ([BLOCK_M] flat (token, head, segment) indices): the
    running max, sum and unnormalized acc, for ``paged_attention._merge_splits_kernel``."""
    tl.store(part_max_ptr + part, m_i, mask=row_ok)
    tl.store(part_sum_ptr + part, l_i, mask=row_ok)
    tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_ok[:, None])


NO_WINDOW = 1 << 30
"""The ``window`` the kernels take for a layer without a sliding window (every key is within it)."""


@triton.jit
def window_tiles(key_lo, num_tiles, seg, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """[tile_lo, tile_hi) (absolute tile indices) of the key tiles segment ``seg`` covers among those from the
    one holding key ``key_lo`` (a sliding window's first key; 0: all) up to ``num_tiles``."""
    tile0 = key_lo // TILE_N
    tile_lo, tile_hi = segment_tiles(num_tiles - tile0, seg, NUM_SPLITS)
    return tile_lo + tile0, tile_hi + tile0
