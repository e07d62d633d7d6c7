"""Paged attention for pure-decode batches (one query token per request): one Triton kernel.

Why a kernel of its own: at large decode batches ``kernels.paged_attention`` streams the KV cache
at the H200's read bandwidth but pays a fixed cost per wave of programs. On an H200 (Llama-3-8B
heads, batch 256) its time fits 14 us + ctx x 0.232 us per call: the slope is 4.5 TB/s of KV,
the intercept is ~3 us per wave of programs (2048 programs, ~5 waves), the chain of dependent
loads each program waits for before its first KV tile (its request from ``query_start_loc``, the
request's rows, ``seq_lens``, the block table, then K/V). At 534-token contexts that is ~10% of
the call.

This kernel cuts the chain:
  * the batch is pure decode (token i is request i), so a program knows its request and query
    row from its grid position: no ``query_start_loc`` loads;
  * optionally one program runs ``HEADS_PER_PROG`` KV heads of one request in a single loop over
    (head, tile) pairs, so the chain is paid once per program. Measured (H200, batch 256,
    534-token contexts): 1 head 135.9 us, 2 heads 138.2, 4 heads 142.9, so the default is 1
    (``kernels.paged_attention.DEFAULT_HEADS_PER_PROG``).

Grid: (num_kv_heads / HEADS_PER_PROG, num_reqs); KV-head groups on axis 0, so one request's
programs run together and read neighbouring rows of the [block, slot, kv_head, dim] cache.
Hardware scheduling of programs keeps the balance when contexts differ.

The torch twin is ``kernels.reference.paged_attention_ref`` (the same semantics as the general
kernel restricted to one query token per request).
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from kernels.attention_tile import load_kv_tile, online_softmax_step
from kernels.pdl import launch_kwargs, pdl_wait_then_release, use_pdl
from kernels.utils import is_interpreted

MAX_DECODE_REQS = 65535
"""Grid axis 1 holds the requests (CUDA allows < 2**16 there); larger batches take the general kernel."""


@triton.jit
def _paged_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, seq_lens_ptr, block_tables_ptr, qk_scale_log2,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_blk, stride_c_slot, stride_c_head, stride_bt_req,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_M: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    """Semantics (scores in log2 units, qk_scale_log2 = scale * log2(e)): for request r (query
    token r) and each query head h of KV heads [g * HEADS_PER_PROG, (g + 1) * HEADS_PER_PROG),
    kvh = h // GROUP, keys p = 0 .. seq_lens[r] - 1,
    K[p] = k_cache[block_tables[r, p // BLOCK_SIZE], p % BLOCK_SIZE, kvh]:

        s[p] = q[r, h] . K[p] * qk_scale_log2
        out[r, h] = sum_p 2^(s[p] - max s) V[p] / sum_p 2^(s[p] - max s)   (fp32, stored in out's dtype)

    A request with seq_lens[r] == 0 gets zeros. PDL: launched with programmatic dependent launch
    (``kernels.pdl``): ``seq_lens`` (a step input) loads before the wait, q and the cache after it.
    """
    kvh0 = tl.program_id(0) * HEADS_PER_PROG
    req = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    num_tiles = tl.maximum(tl.cdiv(seq_len, TILE_N), 1)
    pdl_wait_then_release(PDL)

    rows = tl.arange(0, BLOCK_M)                                    # query heads of one KV head
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    tok = req.to(tl.int64)
    q_row = q_ptr + tok * stride_q_tok + dims[None, :]
    o_row = out_ptr + tok * stride_o_tok + dims[None, :]
    io_mask = row_ok[:, None] & dim_ok[None, :]
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt_req
    if HEADS_PER_PROG == 1:
        q = tl.load(q_row + (kvh0 * GROUP + rows)[:, None] * stride_q_head, mask=io_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    for it in range(0, HEADS_PER_PROG * num_tiles):
        h_local = it // num_tiles
        tile = it - h_local * num_tiles
        kv_head = kvh0 + h_local
        head = kv_head * GROUP + rows                                   # [BLOCK_M]
        if HEADS_PER_PROG > 1:
            q = tl.load(q_row + head[:, None] * stride_q_head, mask=io_mask, other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
        kpos = tile * TILE_N + tl.arange(0, TILE_N)                     # [TILE_N]
        k_ok = kpos < seq_len
        k_t, v = load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, kpos, k_ok, kv_head, dims, dim_ok,
                              stride_c_blk, stride_c_slot, stride_c_head, BLOCK_SIZE, UPCAST)
        m_i, l_i, acc = online_softmax_step(q, k_t, v, k_ok[None, :], m_i, l_i, acc, qk_scale_log2, DOT_PRECISION)
        if HEADS_PER_PROG > 1:
            # The head's last tile: store it and start the next head from scratch (branch-free,
            # so the loop stays one software-pipelined loop).
            last = tile == num_tiles - 1
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            # NOTE: the test is broadcast over rows before the & (a scalar bool & a vector gives
            # ints under TRITON_INTERPRET=1, which tl.store rejects as a mask).
            store_ok = (row_ok & ((rows * 0 + tile) == num_tiles - 1))[:, None] & dim_ok[None, :]
            tl.store(o_row + head[:, None] * stride_o_head, o.to(out_ptr.dtype.element_ty), mask=store_ok)
            m_i = tl.where(last, float("-inf"), m_i)
            l_i = tl.where(last, 0.0, l_i)
            acc = tl.where(last, 0.0, acc)
    if HEADS_PER_PROG == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_row + (kvh0 * GROUP + rows)[:, None] * stride_o_head, o.to(out_ptr.dtype.element_ty),
                 mask=io_mask)


def launch_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, scale: float, out: torch.Tensor, *, block_m: int, head_pad: int,
                        tile_n: int, heads_per_prog: int, num_warps: int, num_stages: int) -> None:
    """One launch over a pure-decode batch (q row i is request i's only token). The caller
    (``kernels.paged_attention.paged_attention``) has checked the inputs and picked the tiles;
    ``heads_per_prog`` must divide num_kv_heads and num_reqs be <= ``MAX_DECODE_REQS``."""
    num_reqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_kv_heads % heads_per_prog or num_reqs > MAX_DECODE_REQS or q.shape[0] != num_reqs:
        raise ValueError(f"paged decode: heads_per_prog {heads_per_prog} must divide {num_kv_heads} KV heads, "
                         f"and {q.shape[0]} query rows must be the {num_reqs} requests (<= {MAX_DECODE_REQS}).")
    upcast = is_interpreted(q.device) or q.dtype == torch.float32
    pdl = use_pdl(q.device)
    grid = (num_kv_heads // heads_per_prog, num_reqs)
    _paged_decode_kernel[grid](
        out, q, k_cache, v_cache, seq_lens, block_tables, float(scale) * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        TILE_N=tile_n, BLOCK_M=block_m, HEADS_PER_PROG=heads_per_prog, UPCAST=upcast,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, **launch_kwargs(pdl),
    )
