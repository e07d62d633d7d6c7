"""Paged attention for a mixed batch of prefill chunks and decodes (one Triton kernel).

Algorithm: the flat query tokens of each request are cut into q-blocks of ``BLOCK_Q`` tokens;
one program takes one q-block and one KV head, stacks the ``group`` query heads that share that
KV head into the rows of its tile (``BLOCK_M = BLOCK_Q * group`` rows, GQA without repeating
K/V) and runs a flash-attention online softmax over KV tiles of ``TILE_N`` keys, gathered from
the cache through the request's block table. The grid is ``num_tokens // BLOCK_Q + num_reqs``
q-block programs (an upper bound; vLLM's unified-attention layout) and each program finds its
request from ``query_start_loc`` on the device, so no host sync is needed.

Split-KV (flash-decoding): with ``num_splits > 1`` the KV range of every q-block is cut into
``num_splits`` segments, each program writes an unnormalized partial (acc, running max, sum),
and a second kernel merges them. The wrapper turns it on by itself for pure-decode batches
too small to fill the GPU; the kernel itself is correct for any batch (tests force it).

FP8 caches (``kernels.kv_write.FP8_KV_DTYPE``) are read as stored and dequantized through the
scales (``kernels.attention_tile``): the result is attention over k_cache * k_scale and
v_cache * v_scale.

The torch twin is ``kernels.reference.paged_attention_ref`` (on the dequantized caches for FP8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

import triton
import triton.language as tl

from kernels.attention_tile import (NO_WINDOW, load_kv_tile, online_softmax_step, scale_values,
                                    score_scale_log2, store_partials, window_tiles)
from kernels.kv_write import FP8_KV_DTYPE, check_kv_scales
from kernels.paged_decode import MAX_DECODE_REQS, DecodeRotary, launch_paged_decode
from kernels.utils import (FLOAT_DTYPES, cdiv, check_int, check_tensor, is_interpreted,
                           next_power_of_2, num_sms)

MAX_SPLITS = 16
ALL_ROWS, DECODE_ROWS, PREFILL_ROWS = 0, 1, 2
"""Which requests one launch of the kernel serves (see ``_paged_attention_kernel``)."""
SMALL_DECODE_TILE_WAVES = 6
"""Pure-decode batches with at least this many programs (requests x KV heads) per SM take the
small decode tiles (see ``_choose_config``)."""
SMALL_DECODE_TILES = (32, 1, 3)
"""(tile_n, num_warps, num_stages) of ``kernels.paged_decode`` for pure-decode batches of at least
``SMALL_DECODE_TILE_WAVES`` waves of programs; fewer take ``DECODE_TILES``."""
DECODE_TILES = (64, 2, 3)
DEFAULT_HEADS_PER_PROG = 1
"""KV heads per program of ``kernels.paged_decode`` for pure-decode batches without split-KV
(0: this module's kernel). 1 because on an H200 (``benchmarks/sweeps/attention_sweep.py``, batch
256, 534-token contexts, best tiles each) every grouping of more heads per program was slower,
and this module's kernel slower still than one head per program (``benchmarks/RESULTS.md``,
"Launch configs and constants inside the kernels")."""


@triton.jit
def _find_request(query_start_loc_ptr, pid_qb, num_reqs, BLOCK_Q: tl.constexpr, CHUNK: tl.constexpr):
    """The request whose q-blocks include program ``pid_qb``.

    Request i owns programs [qsl[i] // BLOCK_Q + i, qsl[i + 1] // BLOCK_Q + i + 1), at least
    cdiv(qlen_i, BLOCK_Q) of them; that first-program column strictly increases, so the answer
    is #{i : qsl[i] // BLOCK_Q + i <= pid_qb} - 1. NOTE: counted with CHUNK-wide vector loads
    (one memory round trip up to CHUNK requests) instead of a binary search's log2(num_reqs)
    dependent loads.
    """
    n = 0
    for c0 in range(0, num_reqs, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        ok = i < num_reqs
        first = tl.load(query_start_loc_ptr + i, mask=ok, other=0) // BLOCK_Q + i
        n += tl.sum(((first <= pid_qb) & ok).to(tl.int32), axis=0)
    return n - 1


@triton.jit(do_not_specialize=["num_reqs", "num_heads", "window"])   # one binary whatever the request count or window
def _paged_attention_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, key_limit_ptr,
    qk_scale_log2, v_scale, num_reqs, num_heads, window,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_blk, stride_c_slot, stride_c_head, stride_bt_req,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, FIND_CHUNK: tl.constexpr,
    ROWS: tl.constexpr, HEADS_FIRST: tl.constexpr, HAS_LIMIT: tl.constexpr = False,
):
    """Semantics (NUM_SPLITS == 1; scores in log2 units, qk_scale_log2 = scale * log2(e)):

        for each request i, qlen = qsl[i+1] - qsl[i], ctx = seq_lens[i] - qlen:
          for j in range(qlen), h in range(num_heads):
            t = qsl[i] + j; kvh = h // GROUP
            keys p with ctx + j - window < p <= hi, hi = key_limit[t] if HAS_LIMIT else ctx + j,
            K[p] = k_cache[block_tables[i, p // BLOCK_SIZE], p % BLOCK_SIZE, kvh]
            s[p] = q[t, h] . K[p] * qk_scale_log2
            out[t, h] = sum_p 2^(s[p] - max s) V[p] / sum_p 2^(s[p] - max s)   (fp32, stored in out's dtype)

    An FP8 cache: K[p] and V[p] are the stored values times k_scale and v_scale (k_scale is inside
    qk_scale_log2, v_scale multiplies the accumulated output: ``kernels.attention_tile``). ``window``:
    the sliding window (``NO_WINDOW``: none); keys before the q-block's first window are never read (their
    blocks may belong to another request by now). ``key_limit`` ([num_tokens] int32, HAS_LIMIT): each query
    token's last visible key (bidirectional image spans), at most seq_lens[i] - 1.

    With NUM_SPLITS > 1, program (qb, kvh, seg) covers only its segment of the key tiles and
    stores acc = sum_p 2^(s[p] - m) V[p], m = max s, l = sum_p 2^(s[p] - m) into the partials
    ([num_tokens, num_heads, NUM_SPLITS, (HEAD_PAD)]) for ``_merge_splits_kernel``.

    ROWS picks the requests a launch serves: ALL_ROWS (grid: the q-block layout above);
    DECODE_ROWS (grid: one program per request; only requests with exactly one query token);
    PREFILL_ROWS (the q-block grid; only requests with more than one query token). A mixed batch
    runs DECODE_ROWS with small tiles and PREFILL_ROWS with large ones: together they cover it.

    HEADS_FIRST puts the KV head on grid axis 0 (launched fastest), so the programs of one q-block's
    KV heads run together and read neighbouring rows of the [block, slot, kv_head, dim] cache (one
    slot's heads are contiguous); otherwise the q-block is axis 0.
    """
    pid_qb = tl.program_id(1) if HEADS_FIRST else tl.program_id(0)
    kv_head = tl.program_id(0) if HEADS_FIRST else tl.program_id(1)
    seg = tl.program_id(2)

    if ROWS == 1:   # DECODE_ROWS
        req = pid_qb
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        if q_len != 1:
            return
        qb_local = 0
    else:
        req = _find_request(query_start_loc_ptr, pid_qb, num_reqs, BLOCK_Q, FIND_CHUNK)
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        qb_local = pid_qb - (q_start // BLOCK_Q + req)
        if qb_local * BLOCK_Q >= q_len:
            return
        if ROWS == 2 and q_len == 1:   # PREFILL_ROWS
            return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    # Rows of the tile: (query token, query head in this KV head's group).
    rows = tl.arange(0, BLOCK_M)
    q_tok = qb_local * BLOCK_Q + rows // GROUP                      # [BLOCK_M] index within the request
    head = kv_head * GROUP + rows % GROUP                           # [BLOCK_M]
    row_ok = (rows < BLOCK_Q * GROUP) & (q_tok < q_len)
    q_pos = ctx_len + q_tok                                         # absolute position of each row
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM

    q_off = (q_start + q_tok).to(tl.int64) * stride_q_tok + head * stride_q_head
    q = tl.load(q_ptr + q_off[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys [key_lo, kv_end) are visible to at least one row of this q-block.
    if HAS_LIMIT:
        hi = tl.load(key_limit_ptr + q_start + q_tok, mask=row_ok, other=0)           # [BLOCK_M]
        kv_end = tl.minimum(tl.max(tl.where(row_ok, hi, 0), axis=0) + 1, seq_len)
    else:
        hi = q_pos
        kv_end = ctx_len + tl.minimum((qb_local + 1) * BLOCK_Q, q_len)
    key_lo = tl.maximum(ctx_len + qb_local * BLOCK_Q - window + 1, 0)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tile_lo, tile_hi = window_tiles(key_lo, num_tiles, seg, TILE_N, NUM_SPLITS)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt_req
    for tile in range(tile_lo, tile_hi):
        kpos = tile * TILE_N + tl.arange(0, TILE_N)                 # [TILE_N]
        k_ok = (kpos < kv_end) & (kpos >= key_lo)
        k_t, v = load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, kpos, k_ok, kv_head, dims, dim_ok,
                              stride_c_blk, stride_c_slot, stride_c_head, BLOCK_SIZE, q.dtype)
        visible = ((kpos[None, :] <= hi[:, None]) & (kpos[None, :] > q_pos[:, None] - window)
                   & k_ok[None, :])
        m_i, l_i, acc = online_softmax_step(q, k_t, v, visible, m_i, l_i, acc, qk_scale_log2, DOT_PRECISION)

    acc = scale_values(acc, v_scale, v_cache_ptr)
    tok = (q_start + q_tok).to(tl.int64)
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = tok * stride_o_tok + head * stride_o_head
        tl.store(out_ptr + o_off[:, None] + dims[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part = (tok * num_heads + head) * NUM_SPLITS + seg                 # [BLOCK_M]
        store_partials(part_acc_ptr, part_max_ptr, part_sum_ptr, part, m_i, l_i, acc, row_ok, dims, HEAD_PAD)


@triton.jit
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_heads,
                         stride_o_tok, stride_o_head,
                         HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Semantics: for each token t and head h (one program each), over segments g:

        M = max_g m[t, h, g]
        out[t, h] = sum_g 2^(m_g - M) acc[t, h, g] / sum_g 2^(m_g - M) l[t, h, g]
    """
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    segs = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_PAD)
    base = (tok * num_heads + head) * NUM_SPLITS
    m = tl.load(part_max_ptr + base + segs)                                # [NUM_SPLITS]
    l = tl.load(part_sum_ptr + base + segs)
    acc = tl.load(part_acc_ptr + (base + segs)[:, None] * HEAD_PAD + dims[None, :])  # [NUM_SPLITS, HEAD_PAD]
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)
    denom = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + dims, o.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@dataclass(frozen=True)
class _LaunchConfig:
    """Tile sizes for one launch (all compile-time constants of the kernel)."""

    block_m: int        # rows per program: BLOCK_Q query tokens x GROUP query heads (padded)
    block_q: int        # query tokens per program
    tile_n: int         # keys per inner-loop tile
    head_pad: int       # head_dim rounded up to a power of two
    num_splits: int     # KV segments per q-block (1: no split-KV)
    num_warps: int
    num_stages: int = 3
    heads_first: bool = True   # KV head on grid axis 0 (see the kernel); False: q-block on axis 0
    heads_per_prog: int = 0    # > 0: a pure-decode batch runs kernels.paged_decode with this many
                               # KV heads per program (0: this module's kernel)


def _choose_config(device: torch.device, group: int, head_dim: int, num_reqs: int, num_kv_heads: int,
                   max_query_len: int, max_seq_len: int, num_splits: Optional[int],
                   decode_tiles: Optional[dict] = None, pure_decode: bool = False) -> _LaunchConfig:
    """Launch constants for one call; ``pure_decode``: every row is its request's only token (the
    batch may take ``kernels.paged_decode`` when it needs no split-KV)."""
    interpreted = is_interpreted(device)
    head_pad = max(16, next_power_of_2(head_dim))
    min_m = 16 if (interpreted or max_query_len < 64) else 64
    block_m = max(min_m, next_power_of_2(group))
    block_q = block_m // group
    tile_n = 32 if interpreted else (64 if head_pad <= 128 else 32)
    num_warps, num_stages = (4 if head_pad <= 128 else 8), 3
    heads_per_prog = 0
    o = (decode_tiles or {}) if max_query_len == 1 else {}
    if max_query_len == 1 and not interpreted:
        # This module's kernel at decode: 2 stages beat 3 at batch 1 (16 splits) and at batch 256
        # (benchmarks/sweeps/attention_sweep.py on an H200, Llama-3-8B heads, 534-token contexts;
        # benchmarks/RESULTS.md, "Launch configs and constants inside the kernels").
        # Pure-decode batches without split-KV take kernels.paged_decode's tiles below.
        num_stages = 2
    programs = num_reqs * num_kv_heads
    sms = num_sms(device)
    if num_splits is None:
        num_splits = 1
        if not interpreted and max_query_len == 1 and programs < sms:
            # Flash-decoding: enough segments for about one wave, each at least one KV tile
            # (on an H200 with Llama-3-8B shapes and 512-token contexts: batch 1 -> 8, 8 -> 4, 32 -> 1).
            want = next_power_of_2(cdiv(sms, max(programs, 1)))
            max_useful = max(1, cdiv(max_seq_len, o.get("tile_n", tile_n)))
            while want > 1 and want > max_useful:
                want //= 2
            num_splits = min(want, MAX_SPLITS)
    if pure_decode and num_splits == 1:
        heads_per_prog = DEFAULT_HEADS_PER_PROG
        if not interpreted and head_pad <= 128:
            # kernels.paged_decode tiles, timed in the engine's step on an H200 (Llama-3-8B; large
            # decode batches run at the board's power cap, below full SM clock): one warp per
            # program with 32 keys and 3 stages where programs fill >= SMALL_DECODE_TILE_WAVES waves
            # of SMs (faster steps at batch 128 and 256, at 512- and 1024-token contexts), else 64
            # keys, 2 warps, 3 stages (faster at batch 32 and 64). Alone at full clock the two
            # large-batch tiles differ less (``benchmarks/sweeps/power_probe.py``): the one-warp
            # tiles win in the step by spending less energy per call. Step times:
            # benchmarks/RESULTS.md (``KernelPolicy.attn_decode``, which overrides these tiles).
            tile_n, num_warps, num_stages = (SMALL_DECODE_TILES if programs >= SMALL_DECODE_TILE_WAVES * sms
                                             else DECODE_TILES)
    tile_n, num_warps, num_stages = (o.get("tile_n", tile_n), o.get("num_warps", num_warps),
                                     o.get("num_stages", num_stages))
    heads_first = bool(o.get("heads_first", True))
    if heads_per_prog:
        heads_per_prog = o.get("heads_per_prog", heads_per_prog)
        while heads_per_prog > 1 and num_kv_heads % heads_per_prog:
            heads_per_prog //= 2
    return _LaunchConfig(block_m=block_m, block_q=block_q, tile_n=tile_n, head_pad=head_pad,
                         num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                         heads_first=heads_first, heads_per_prog=heads_per_prog)


def min_reqs_for_small_decode_tiles(device: torch.device, num_kv_heads: int) -> int:
    """Pure-decode batches of at least this many requests take ``kernels.paged_decode``'s small
    tiles (``SMALL_DECODE_TILES``: a compile of their own, see ``_choose_config``)."""
    return cdiv(SMALL_DECODE_TILE_WAVES * num_sms(device), max(num_kv_heads, 1))


def find_chunk(num_reqs: int) -> int:
    """``_find_request``'s vector width: 16 up to 16 requests, else 256 (one masked load covers up to
    256). NOTE: two values only, since each is a compile of its own (a compile stalls the step
    that first needs it; ``engine.attention.AttentionBackend.warm_up`` compiles both at start-up)."""
    return 16 if num_reqs <= 16 else 256


def _check_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                  max_query_len, max_seq_len, scale, out, num_splits, k_scale, v_scale, window=None,
                  key_limit=None) -> tuple[float, float]:
    """Raise ValueError on a bad argument; returns (k_scale, v_scale) as floats."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, num_heads, head_dim = q.shape
    dev = q.device
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype, FP8_KV_DTYPE), device=dev,
                 last_dim_contiguous=True)
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_tensor("k_cache", k_cache, shape=(None, block_size, num_kv_heads, head_dim))
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape), device=dev)
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache: strides {v_cache.stride()} differ from k_cache's {k_cache.stride()} "
                         f"(the kernel addresses both with k_cache's).")
    if block_size & (block_size - 1):
        raise ValueError(f"k_cache: block_size {block_size} must be a power of two.")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"q: num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}.")
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=dev,
                 contiguous=True)
    num_reqs = query_start_loc.shape[0] - 1
    if num_reqs < 0:
        raise ValueError("query_start_loc: needs num_reqs + 1 >= 1 entries.")
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), shape=(num_reqs,), device=dev,
                 contiguous=True)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=dev,
                 last_dim_contiguous=True)
    if block_tables.shape[0] != num_reqs:
        raise ValueError(f"block_tables: {block_tables.shape[0]} rows for {num_reqs} requests.")
    check_int("max_query_len", max_query_len)
    check_int("max_seq_len", max_seq_len)
    if block_tables.shape[1] * block_size < max_seq_len:
        raise ValueError(f"block_tables: {block_tables.shape[1]} blocks of {block_size} cannot hold "
                         f"max_seq_len {max_seq_len}.")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale!r}.")
    if out is not None:
        check_tensor("out", out, dtypes=(q.dtype,), shape=tuple(q.shape), device=dev,
                     last_dim_contiguous=True)
    if num_splits is not None:
        check_int("num_splits", num_splits, min_value=1)
        if num_splits & (num_splits - 1) or num_splits > MAX_SPLITS:
            raise ValueError(f"num_splits: {num_splits} must be a power of two <= {MAX_SPLITS}.")
    if window is not None:
        check_int("window", window, min_value=1)
    if key_limit is not None:
        check_tensor("key_limit", key_limit, dtypes=(torch.int32,), shape=(num_tokens,), device=dev, contiguous=True)
    return check_kv_scales(k_cache.dtype, k_scale, v_scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    max_query_len: int, max_seq_len: int, scale: float,
                    out: Optional[torch.Tensor] = None, *, num_splits: Optional[int] = None,
                    split_decodes: Optional[bool] = None, has_decodes: bool = True,
                    decode_tiles: Optional[dict] = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, window: Optional[int] = None,
                    key_limit: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context (within a sliding window,
    up to per-token key limits, where given).

    Args:
        q: [num_tokens, num_heads, head_dim] float16/bfloat16/float32 (last dim contiguous).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype or both
            ``FP8_KV_DTYPE``, last dim contiguous, both with the same strides (contiguous, or e.g.
            the permuted view of a [num_blocks, num_kv_heads, block_size, head_dim] tensor); this
            step's K/V must already be written.
        query_start_loc: [num_reqs + 1] int32; request i owns q rows [qsl[i], qsl[i + 1]).
        seq_lens: [num_reqs] int32; context after this step (cached prefix + new tokens).
        block_tables: [num_reqs, max_num_blocks] int32 block ids per request.
        max_query_len, max_seq_len: host ints (upper bounds; pick tiles and split-KV only).
        scale: softmax scale, usually head_dim ** -0.5.
        out: optional [num_tokens, num_heads, head_dim] output in q's dtype.
        num_splits: KV segments per q-block (power of two <= 16) of a one-launch batch; None picks
            one (split-KV only for pure-decode batches too small to fill the GPU; always 1 under
            the interpreter).
        split_decodes: for a batch with prefill chunks (max_query_len > 1), run its one-token
            requests in a launch of their own with decode-sized tiles, and the rest with prefill
            tiles (no split-KV in either). None: when the prefill tiles are larger than a
            decode's (max_query_len >= 64 on a GPU).
        has_decodes: False skips the decode launch of a split batch (the caller knows no request
            has one query token).
        decode_tiles: overrides of the decode launches' tiles ({"tile_n", "num_warps",
            "num_stages", "heads_first", "heads_per_prog"}; the engine passes
            its kernel policy's ``attn_decode``).
        k_scale, v_scale: an FP8 cache's per-tensor scales (K = k_cache * k_scale, V likewise);
            1.0 for caches of q's dtype.
        window: the query at position p sees keys p - window < k <= p (None: all keys up to p); keys
            before a query's window are never read.
        key_limit: [num_tokens] int32, the last key each query token sees instead of its own position
            (>= it, < its request's seq_len); None: causal. Read by the launches with prefill chunks: a
            pure-decode batch is causal (a decode token's limit is its own position).

    Returns:
        out, [num_tokens, num_heads, head_dim] in q's dtype. Rows past qsl[num_reqs] (padding
        tokens) hold undefined values.
    """
    scales = _check_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                           max_query_len, max_seq_len, scale, out, num_splits, k_scale, v_scale, window, key_limit)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_reqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)                                  # [num_tokens, num_heads, head_dim]
    if num_tokens == 0 or num_reqs == 0:
        return out

    pure_decode = max_query_len <= 1 and num_tokens == num_reqs and num_reqs <= MAX_DECODE_REQS
    cfg = _choose_config(q.device, group, head_dim, num_reqs, num_kv_heads, max_query_len, max_seq_len,
                         num_splits, decode_tiles, pure_decode=pure_decode)
    if pure_decode and cfg.heads_per_prog > 0:
        # Pure decode (one token per request, token i = request i): the kernel without the q-block lookup.
        launch_paged_decode(q, k_cache, v_cache, seq_lens, block_tables, scale, out, block_m=cfg.block_m,
                            head_pad=cfg.head_pad, tile_n=cfg.tile_n, heads_per_prog=cfg.heads_per_prog,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages, kv_scales=scales, window=window)
        return out
    if split_decodes is None:
        split_decodes = max_query_len > 1 and num_splits is None and cfg.block_m > max(16, next_power_of_2(group))
    step = (query_start_loc, seq_lens, block_tables, scale, scales, out, window, key_limit)
    if max_query_len <= 1 or not split_decodes:
        _launch(q, k_cache, v_cache, *step, cfg, ALL_ROWS)
        return out
    if has_decodes:
        dcfg = _choose_config(q.device, group, head_dim, num_reqs, num_kv_heads, 1, max_seq_len, 1, decode_tiles)
        _launch(q, k_cache, v_cache, *step, dcfg, DECODE_ROWS)
    if cfg.num_splits > 1:
        cfg = _choose_config(q.device, group, head_dim, num_reqs, num_kv_heads, max_query_len, max_seq_len, 1)
    _launch(q, k_cache, v_cache, *step, cfg, PREFILL_ROWS)
    return out


def _launch(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float,
            kv_scales: tuple[float, float], out: torch.Tensor, window: Optional[int],
            key_limit: Optional[torch.Tensor], cfg: _LaunchConfig, rows: int) -> None:
    """One launch of the attention kernel (+ the split-KV merge) over the requests ``rows`` picks;
    ``kv_scales``: the caches' (k_scale, v_scale); ``window``, ``key_limit``: ``paged_attention``'s."""
    k_scale, v_scale = kv_scales
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_reqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if cfg.num_splits > 1:
        if rows != ALL_ROWS:
            raise ValueError("split-KV runs only in one-launch batches (the merge covers every row).")
        part_acc, part_max, part_sum = _partials(q, cfg)
    else:
        part_acc = part_max = part_sum = out                           # unused
    upcast = is_interpreted(q.device) or q.dtype == torch.float32
    num_programs = num_reqs if rows == DECODE_ROWS else num_tokens // cfg.block_q + num_reqs
    heads_first = cfg.heads_first and num_programs < 65536   # grid axes 1 and 2 hold < 2**16
    grid = (num_kv_heads, num_programs, cfg.num_splits) if heads_first else (num_programs, num_kv_heads, cfg.num_splits)
    _paged_attention_kernel[grid](
        out, part_acc, part_max, part_sum,
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
        key_limit if key_limit is not None else seq_lens,
        score_scale_log2(scale, k_scale, k_cache.dtype), v_scale, num_reqs, num_heads,
        NO_WINDOW if window is None else window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=cfg.head_pad,
        BLOCK_SIZE=block_size, TILE_N=cfg.tile_n, BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m,
        NUM_SPLITS=cfg.num_splits, UPCAST=upcast, FIND_CHUNK=find_chunk(num_reqs),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ROWS=rows, HEADS_FIRST=heads_first,
        HAS_LIMIT=key_limit is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.num_splits > 1:
        _merge(out, (part_acc, part_max, part_sum), cfg)


def _partials(q: torch.Tensor, cfg: _LaunchConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split-KV partials for ``cfg.num_splits`` segments: acc [T, H, splits, head_pad], max and sum
    [T, H, splits], float32."""
    num_tokens, num_heads, _ = q.shape
    part_acc = torch.empty(num_tokens, num_heads, cfg.num_splits, cfg.head_pad, dtype=torch.float32,
                           device=q.device)                            # [T, H, splits, head_pad]
    part_max = torch.empty(num_tokens, num_heads, cfg.num_splits, dtype=torch.float32, device=q.device)
    return part_acc, part_max, torch.empty_like(part_max)             # [T, H, splits] each


def _merge(out: torch.Tensor, partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cfg: _LaunchConfig) -> None:
    """Merge the split-KV partials into out ([T, H, head_dim]): one program per (token, head)."""
    num_tokens, num_heads, head_dim = out.shape
    part_acc, part_max, part_sum = partials
    _merge_splits_kernel[(num_tokens, num_heads)](
        out, part_acc, part_max, part_sum, num_heads, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_PAD=cfg.head_pad, NUM_SPLITS=cfg.num_splits,
    )


def decode_rotary_pays(num_reqs: int, num_kv_heads: int, device: torch.device) -> bool:
    """Whether a pure-decode batch should take ``paged_decode_rotary`` when
    ``KernelPolicy.decode_fuse_rotary`` is ``auto``: when its programs (requests x KV heads) do not
    fill the SMs, i.e. the split-KV batches, whose steps are chains of short, latency-bound
    launches, so the launch saved shortens the step. Measured on an H200 with the Llama-3-8B shape:
    small batches gain, batches of 32 and 128 neither gain nor lose, and batch 256 loses, because
    there the extra rotary work of every (request, KV head) program costs more than the launch it
    saves (``benchmarks/RESULTS.md``, "What sets each ``KernelPolicy`` default":
    ``decode_fuse_rotary``)."""
    return num_reqs * num_kv_heads < num_sms(device)


def paged_decode_rotary(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int, scale: float,
                        out: Optional[torch.Tensor] = None, *, num_splits: Optional[int] = None,
                        decode_tiles: Optional[dict] = None, k_scale: float = 1.0,
                        v_scale: float = 1.0, window: Optional[int] = None, qk_norm=None) -> torch.Tensor:
    """``kv_write.rotary_write_kv`` then ``paged_attention`` for a pure-decode batch (token i is
    request i's only query token), as one launch of ``kernels.paged_decode`` (plus the split-KV
    merge when the batch is too small to fill the GPU): q and k are rotated in registers, the
    rotated k and v are written to the cache at ``slot_mapping`` and the newest key is taken from
    registers, so no kernel waits for the write.

    Args: those of ``rotary_write_kv`` (q, k, v before rotary; q is not written back) and of
    ``paged_attention`` with max_query_len 1. ``decode_tiles`` may override tile_n / num_warps /
    num_stages; this path always runs one KV head per program. An FP8 cache (``k_scale``,
    ``v_scale``) gets the new k and v quantized as ``rotary_write_kv`` writes them, and the newest
    key and value are attended as stored. ``window``: ``paged_attention``'s. ``qk_norm``
    (``kv_write.QKNormWeights``): q and k RMS-normalized per head before rotary, as ``rotary_write_kv``'s.

    Returns:
        out [num_tokens, num_heads, head_dim] in q's dtype.
    """
    from kernels.kv_write import check_qk_norm, check_rotary_write_args

    half = check_rotary_write_args(positions, q, k, v, cos, sin, rotary_dim, k_cache, v_cache, slot_mapping)
    if qk_norm is not None:
        check_qk_norm(qk_norm, q)
    scales = _check_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, 1, max_seq_len, scale,
                           out, num_splits, k_scale, v_scale, window)
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens != num_reqs or num_reqs > MAX_DECODE_REQS:
        raise ValueError(f"paged_decode_rotary: {num_tokens} query tokens must be the {num_reqs} requests' "
                         f"only ones (a pure-decode batch of <= {MAX_DECODE_REQS}).")
    if out is None:
        out = torch.empty_like(q)                                  # [num_tokens, num_heads, head_dim]
    if num_tokens == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    cfg = _choose_config(q.device, num_heads // num_kv_heads, head_dim, num_reqs, num_kv_heads, 1, max_seq_len,
                         num_splits, decode_tiles, pure_decode=True)
    partials = _partials(q, cfg) if cfg.num_splits > 1 else None
    launch_paged_decode(q, k_cache, v_cache, seq_lens, block_tables, scale, out, block_m=cfg.block_m,
                        head_pad=cfg.head_pad, tile_n=cfg.tile_n, heads_per_prog=1, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages, num_splits=cfg.num_splits, partials=partials,
                        rotary=DecodeRotary(k, v, slot_mapping, positions, cos, sin, half, qk_norm),
                        kv_scales=scales, window=window)
    if partials is not None:
        _merge(out, partials, cfg)
    return out
