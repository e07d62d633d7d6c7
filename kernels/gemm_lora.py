"""GEMM with the batch's LoRA update in its epilogue: y = x @ W.T + (x @ A_slot(t).T) @ B_slot(t).T, one launch.

Why: in a decode step with adapters, the split pair (``kernels.lora_shrink`` on a side stream
beside the base GEMM, then ``kernels.lora_expand`` adding into the GEMM's output) puts one
latency-bound launch after every projection GEMM (5-16 us at batch 64 on an H200 for ~1-3 MB
of traffic). This kernel computes the base product and adds the update before its single store,
so the expand's launch, its read-modify-write of y and its dependence on the GEMM disappear.

One grid, two kinds of program:

- Programs ``0 .. num_shrink - 1`` do the shrink. Each walks the active segments (tokens grouped
  by adapter slot, ``LoRAKernelMeta``) ``a = pid, pid + num_shrink, ...`` and stores, for each
  token of the segment, ``h[t, s * BLOCK_R + r] = x[t] @ A[s, slot][r]`` for every slice s (the
  slices' A rows stacked into one dot), fp32. Then it bumps ``sync[0]`` (release).
- Programs ``num_shrink ..`` each own one [BLOCK_M, BLOCK_N] output tile inside one slice
  (tiles never straddle slices: a packed q/k/v output is three column ranges with their own B).
  The K loop is a plain tiled GEMM. Then the program waits until ``sync[0] == num_shrink``
  (acquire; the shrink programs have lower ids, so the GPU dispatched them first and they
  finish while the GEMM programs stream their weights), reads its rows' h and adds the update
  as dots over chunks of the step's active slots: with ``act`` the chunk's slot ids,
  ``H[m, c * BLOCK_R + r] = h[m, r] if slot(m) == act[c] else 0`` and
  ``Bc[n, c * BLOCK_R + r] = B[act[c], n, r]``, acc += H @ Bc.T. Every B byte of the step's
  adapters is read once per M tile, all addresses known from one vector load. Last, the final
  GEMM program (``sync[1]`` counts them) resets both counters, so the next launch starts at 0.

Numerics: fp32 accumulation of the base product; h in fp32, rounded to B's dtype before its dot
on float16/bfloat16 GPUs (as PEFT's ``lora_B(lora_A(x))`` rounds ``lora_A(x)``; fp32 under the
interpreter and for float32); base and update summed in fp32 and rounded once (PEFT rounds the
base output and the update separately, then adds: within one rounding of it).

Used by ``lora.layers.LinearLoRASlots`` for steps of at most CHORUS_LORA_GEMM_MAX_TOKENS tokens
(default 0: off). Measured on an H200 (``benchmarks/gemm_lora_sweep.py``, 64 tokens, bf16,
benchmarks/RESULTS.md "Seventh session"): slower than the split path today. On a step without
adapter rows (the GEMM and the handshake only) it takes 24.4 / 22.0 / 49.5 us on Llama-3-8B's
qkv / o / down against cuBLAS' 16.4 / 11.7 / 35.1 (a plain ``kernels.gemm`` launch with the same
tiles: 16.5-17.8 / 15.3 / 45.2), while the LoRA work of 16 adapters adds only ~1 us to that
(25.4 / 22.6 / 50.0). So the GEMM part, not the LoRA work, is what must get faster before this
path pays. Open problem: with the path on, the engine-level GPU parity test (tiny Llama, CUDA
graphs) did not finish within 200 s on the H200 (a hang or a crawl, not yet located); keep it off.
The torch twin is ``kernels.reference.gemm_lora_ref``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

import triton
import triton.language as tl

from kernels.lora_expand import MAX_SLICES, _slice_of, check_b_slices
from kernels.lora_meta import LoRAKernelMeta
from kernels.lora_shrink import ConfigOverride, _check_launch, _check_meta, _check_pow2
from kernels.utils import FLOAT_DTYPES, cdiv, check_tensor, is_interpreted, next_power_of_2


@triton.jit
def _gemm_lora_shrink(x_ptr, a_ptr, h_ptr, sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr,
                      slot_start_ptr, pid, num_shrink, num_active, K, rank, stride_xm, stride_a_slice,
                      stride_a_slot, stride_a_rank, stride_hm,
                      NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_SR: tl.constexpr,
                      SHRINK_M: tl.constexpr, SHRINK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                      PRECISION: tl.constexpr):
    """h[t, s * BLOCK_R + r] = sum_k x[t, k] * A[s, slot(t), r, k] (fp32; columns past the slices
    and ranks store 0) for the tokens of segments pid, pid + num_shrink, ... < num_active."""
    offs_i = tl.arange(0, BLOCK_SR)                    # stacked A row i: slice i // BLOCK_R, rank i % BLOCK_R
    a_s = offs_i // BLOCK_R
    a_r = offs_i % BLOCK_R
    i_ok = (a_s < NUM_SLICES) & (a_r < rank)
    a_rows = a_s.to(tl.int64) * stride_a_slice + a_r * stride_a_rank                   # [BLOCK_SR]
    offs_k = tl.arange(0, SHRINK_K)
    for a in range(pid, num_active, num_shrink):
        slot = tl.load(active_slots_ptr + a)
        count = tl.load(num_tokens_per_slot_ptr + a)
        start = tl.load(slot_start_ptr + a)
        if slot >= 0:
            a_base = a_ptr + slot.to(tl.int64) * stride_a_slot + a_rows                 # [BLOCK_SR]
            for t0 in range(0, count, SHRINK_M):
                offs_m = t0 + tl.arange(0, SHRINK_M)
                m_ok = offs_m < count
                tok = tl.load(sorted_token_ids_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
                acc = tl.zeros([SHRINK_M, BLOCK_SR], dtype=tl.float32)
                for k0 in range(0, K, SHRINK_K):
                    if EVEN_K:
                        xt = tl.load(x_ptr + tok[:, None] * stride_xm + (k0 + offs_k)[None, :],
                                     mask=m_ok[:, None], other=0.0)                     # [SHRINK_M, SHRINK_K]
                        at = tl.load(a_base[:, None] + (k0 + offs_k)[None, :],
                                     mask=i_ok[:, None], other=0.0)                     # [BLOCK_SR, SHRINK_K]
                    else:
                        k_ok = (k0 + offs_k) < K
                        xt = tl.load(x_ptr + tok[:, None] * stride_xm + (k0 + offs_k)[None, :],
                                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                        at = tl.load(a_base[:, None] + (k0 + offs_k)[None, :],
                                     mask=i_ok[:, None] & k_ok[None, :], other=0.0)
                    if UPCAST:
                        xt = xt.to(tl.float32)
                        at = at.to(tl.float32)
                    acc = tl.dot(xt, tl.trans(at), acc, input_precision=PRECISION)
                tl.store(h_ptr + tok[:, None] * stride_hm + offs_i[None, :], acc, mask=m_ok[:, None])


@triton.jit
def _chunk_row(acts, ci, NUM_CHUNKS: tl.constexpr):
    """Row ci of the [NUM_CHUNKS, LORA_CHUNK] slot-id table held in registers."""
    rows = tl.arange(0, NUM_CHUNKS)
    return tl.sum(tl.where(rows[:, None] == ci, acts, 0), axis=0)


@triton.jit
def _load_b_chunk(b_ptr, act, offs_n, n_ok, n_out, rank, BLOCK_N: tl.constexpr, LORA_CHUNK: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    """Bc[n, c * BLOCK_R + r] = B[act[c], n, r] ([BLOCK_N, LORA_CHUNK * BLOCK_R]; 0 for act < 0, r >= rank)."""
    offs_r = tl.arange(0, BLOCK_R)
    b_ptrs = (b_ptr + act[None, :, None].to(tl.int64) * n_out * rank + offs_n[:, None, None] * rank
              + offs_r[None, None, :])                                          # [BLOCK_N, LORA_CHUNK, BLOCK_R]
    b_ok = n_ok[:, None, None] & (act >= 0)[None, :, None] & (offs_r < rank)[None, None, :]
    return tl.reshape(tl.load(b_ptrs, mask=b_ok, other=0.0), (BLOCK_N, LORA_CHUNK * BLOCK_R))


@triton.jit
def _lora_chunk_dot(acc, h, tslot, act, bc, BLOCK_M: tl.constexpr, LORA_CHUNK: tl.constexpr,
                    BLOCK_R: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + H @ Bc.T with H[m, c * BLOCK_R + r] = h[m, r] where row m runs adapter act[c], else 0."""
    pick = (tslot[:, None, None] == act[None, :, None]) & (act >= 0)[None, :, None]   # [BLOCK_M, LORA_CHUNK, 1]
    hc = tl.reshape(tl.where(pick, h[:, None, :], 0.0), (BLOCK_M, LORA_CHUNK * BLOCK_R))
    if UPCAST:
        return tl.dot(hc, tl.trans(bc.to(tl.float32)), acc, input_precision=PRECISION)
    return tl.dot(hc, tl.trans(bc), acc)


@triton.jit(do_not_specialize=["num_active"])
def _gemm_lora_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, a_ptr, b0_ptr, b1_ptr, b2_ptr, h_ptr, sync_ptr,
    token_lora_slots_ptr, sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr,
    M, K, num_active, rank, n0, n1, n2, off0, off1, off2, tiles0, tiles01, num_shrink, num_gemm,
    stride_xm, stride_wn, stride_ym, stride_a_slice, stride_a_slot, stride_a_rank, stride_hm,
    HAS_BIAS: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_SR: tl.constexpr, SHRINK_M: tl.constexpr,
    SHRINK_K: tl.constexpr, LORA_CHUNK: tl.constexpr, MAX_LORAS_PAD: tl.constexpr, EVEN_K: tl.constexpr,
    SHRINK_EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Semantics (slice s of column n: off_s <= n < off_s + n_s; B_s = [b0, b1, b2][s]):

        h[t, s, :] = x[t] @ A[s, slot(t)].T                                    # fp32, LoRA rows
        y[t, n] = dtype(x[t] @ W[n] (+ bias[n]) + (slot(t) >= 0 ? rnd(h[t, s]) @ B_s[slot(t), n - off_s] : 0))

    rnd: to B's dtype on float16/bfloat16 GPUs (identity when UPCAST). Programs < num_shrink
    compute h, the others one output tile each (see the module docstring for the handshake).
    """
    pid = tl.program_id(0)
    if pid < num_shrink:
        _gemm_lora_shrink(x_ptr, a_ptr, h_ptr, sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr,
                          slot_start_ptr, pid, num_shrink, num_active, K, rank, stride_xm, stride_a_slice,
                          stride_a_slot, stride_a_rank, stride_hm, NUM_SLICES, BLOCK_R, BLOCK_SR, SHRINK_M,
                          SHRINK_K, SHRINK_EVEN_K, UPCAST, PRECISION)
        tl.debug_barrier()                               # every thread's h stores precede the release
        tl.atomic_add(sync_ptr, 1, sem="release")
        return

    g = pid - num_shrink
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = g % num_m_tiles
    tile = g // num_m_tiles
    pid_s = tl.where(tile < tiles0, 0, tl.where(tile < tiles01, 1, 2))
    first = tl.where(pid_s == 0, 0, tl.where(pid_s == 1, tiles0, tiles01))
    b_ptr, n_out, col0 = _slice_of(pid_s, b0_ptr, b1_ptr, b2_ptr, n0, n1, n2, off0, off1, off2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile - first) * BLOCK_N + tl.arange(0, BLOCK_N)                  # column within the slice
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < n_out
    # The epilogue's slot ids, loaded before the K loop so their latency hides behind it.
    tslot = tl.load(token_lora_slots_ptr + offs_m, mask=m_ok, other=-1)        # [BLOCK_M]
    NUM_CHUNKS: tl.constexpr = (MAX_LORAS_PAD + LORA_CHUNK - 1) // LORA_CHUNK
    all_a = tl.arange(0, NUM_CHUNKS * LORA_CHUNK)
    acts = tl.load(active_slots_ptr + all_a, mask=all_a < num_active, other=-1)   # [NUM_CHUNKS * LORA_CHUNK]
    n_real = tl.sum((acts >= 0).to(tl.int32))
    acts = tl.reshape(acts, (NUM_CHUNKS, LORA_CHUNK))

    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + (col0 + offs_n)[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:   # no column mask: the loads stay fully vectorized
            xt = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)                  # [BLOCK_M, BLOCK_K]
            wt = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)                  # [BLOCK_N, BLOCK_K]
        else:
            k_ok = (k0 + offs_k) < K
            xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:   # the interpreter's bf16 arithmetic is wrong: compute in fp32 there
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col0 + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]

    # Chunk 0's B is loaded before the wait (it does not depend on the shrink).
    act = _chunk_row(acts, 0, NUM_CHUNKS)
    bc = _load_b_chunk(b_ptr, act, offs_n, n_ok, n_out, rank, BLOCK_N, LORA_CHUNK, BLOCK_R)
    # Wait for the shrink programs; the acquire orders the h loads after their release.
    done = tl.atomic_add(sync_ptr, 0, sem="acquire")
    while done < num_shrink:
        done = tl.atomic_add(sync_ptr, 0, sem="acquire")
    offs_r = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + (pid_s * BLOCK_R + offs_r)[None, :],
                mask=m_ok[:, None], other=0.0, cache_modifier=".cg")           # [BLOCK_M, BLOCK_R] f32
    if not UPCAST:
        h = h.to(b_ptr.dtype.element_ty)
    acc = _lora_chunk_dot(acc, h, tslot, act, bc, BLOCK_M, LORA_CHUNK, BLOCK_R, UPCAST, PRECISION)
    for ci in range(1, tl.cdiv(n_real, LORA_CHUNK)):
        act = _chunk_row(acts, ci, NUM_CHUNKS)
        bc = _load_b_chunk(b_ptr, act, offs_n, n_ok, n_out, rank, BLOCK_N, LORA_CHUNK, BLOCK_R)
        acc = _lora_chunk_dot(acc, h, tslot, act, bc, BLOCK_M, LORA_CHUNK, BLOCK_R, UPCAST, PRECISION)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + (col0 + offs_n)[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    # The last GEMM program resets the counters for the next launch (every GEMM program has
    # passed its wait by then).
    finished = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel")
    if finished == num_gemm - 1:
        tl.atomic_xchg(sync_ptr, 0)
        tl.atomic_xchg(sync_ptr + 1, 0)


@dataclass(frozen=True)
class GemmLoRAConfig:
    """Launch parameters of ``gemm_lora`` (``CHORUS_LORA_GEMM_CONFIG`` field names)."""

    block_m: int = 64
    """Token rows per GEMM program (power of two >= 16)."""
    block_n: int = 64
    """Output columns per GEMM program (power of two >= 16); smaller where a slice needs it."""
    block_k: int = 128
    """Input columns per K step of the GEMM loop (power of two >= 16)."""
    num_warps: int = 4
    num_stages: int = 5
    """Software-pipelining depth of the K loops."""
    shrink_programs: int = 32
    """Most programs doing the shrink (fewer when fewer segments exist)."""
    shrink_m: int = 16
    """Token rows per shrink tile (power of two >= 16)."""
    shrink_k: int = 128
    """Input columns per shrink K step (power of two >= 16)."""
    lora_chunk: int = 16
    """Adapters per epilogue dot (power of two >= 1): the dot's inner dim is lora_chunk * BLOCK_R."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "shrink_m", "shrink_k"):
            _check_pow2(name, getattr(self, name), 16)
        _check_pow2("lora_chunk", self.lora_chunk, 1, 64)
        _check_launch(self.num_warps, self.num_stages)
        if isinstance(self.shrink_programs, bool) or not isinstance(self.shrink_programs, int) \
                or self.shrink_programs < 1:
            raise ValueError(f"shrink_programs: {self.shrink_programs!r} must be an int >= 1.")


INTERPRETER_CONFIG = GemmLoRAConfig(16, 16, 16, 1, 1, 2, 16, 16, 2)
"""Tiny tiles for CPU tensors under TRITON_INTERPRET=1 (tests)."""


def gemm_lora_config(num_tokens: int, device: torch.device, override: ConfigOverride = (),
                     dtype: torch.dtype = torch.bfloat16) -> GemmLoRAConfig:
    """Default launch config for a step of num_tokens rows, with ``override`` fields applied last.

    GPU default (H200 sweep of the plain GEMM at 64 rows, benchmarks/gemm_sweep.py: 64-column
    tiles with 128-deep K steps run qkv at 16.5 us vs cuBLAS' 17.1): one M tile up to 64 rows.
    """
    if is_interpreted(device):
        cfg = INTERPRETER_CONFIG
    else:
        block_m = min(64, max(16, next_power_of_2(num_tokens)))
        if dtype == torch.float32:   # 4-byte tiles: shallower K steps and pipeline (shared memory)
            cfg = GemmLoRAConfig(block_m=block_m, block_k=64, num_stages=2, shrink_k=64, lora_chunk=8)
        else:
            cfg = GemmLoRAConfig(block_m=block_m)
    return dataclasses.replace(cfg, **dict(override))


def h_columns(num_slices: int, rank: int) -> int:
    """Columns of the shrink-output scratch ``h`` for num_slices slices of rank ``rank``."""
    return next_power_of_2(num_slices * max(16, next_power_of_2(rank)))


def gemm_lora(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], lora_a: torch.Tensor,
              lora_b_slices: Sequence[torch.Tensor], meta: LoRAKernelMeta, slice_offsets: Sequence[int],
              h: torch.Tensor, sync: torch.Tensor, *, config: Optional[GemmLoRAConfig] = None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias) + each LoRA token's (x @ A.T) @ B.T, one launch.

    Args:
        x: [M, K] float16/bfloat16/float32, last dim contiguous.
        weight: [N, K] in x's dtype, contiguous; N = sum of the slices' widths.
        bias: optional [N] in x's dtype.
        lora_a: [num_slices, max_loras, rank, K] in x's dtype, last dim contiguous.
        lora_b_slices: num_slices (1..3) tensors [max_loras, n_s, rank] in x's dtype, contiguous.
        meta: this step's ``LoRAKernelMeta`` (M tokens, max_loras slots).
        slice_offsets: column of y where slice s starts; slices must tile [0, N) in order.
        h: float32 scratch, last dim contiguous, [>= M, >= h_columns(num_slices, rank)].
        sync: int32 [2] zeros on x's device, used by one launch at a time (the kernel leaves it zero).
        config: launch config; None: ``gemm_lora_config``.
        out: optional [M, N] destination in x's dtype, last dim contiguous.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    m, k = x.shape
    dev = x.device
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), shape=(None, k), device=dev, contiguous=True)
    n = weight.shape[0]
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), shape=(n,), device=dev, contiguous=True)
    check_tensor("lora_a", lora_a, ndim=4, dtypes=(x.dtype,), device=dev, last_dim_contiguous=True)
    num_slices, max_loras, rank, _ = lora_a.shape
    check_tensor("lora_a", lora_a, shape=(num_slices, max_loras, rank, k))
    if not isinstance(lora_b_slices, (list, tuple)) or len(lora_b_slices) != num_slices \
            or not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"lora_b_slices: expected {num_slices} tensors (one per slice of lora_a, 1..{MAX_SLICES}).")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=dev)
    else:
        check_tensor("out", out, ndim=2, dtypes=(x.dtype,), shape=(m, n), device=dev, last_dim_contiguous=True)
    out_dims = check_b_slices(lora_b_slices, out, max_loras, rank, slice_offsets)
    expect = 0
    for s, (off, width) in enumerate(zip(slice_offsets, out_dims)):
        if off != expect:
            raise ValueError(f"slice_offsets[{s}] = {off}: slices must tile the output in order (expected {expect}).")
        expect += width
    if expect != n:
        raise ValueError(f"slices cover {expect} columns, weight has {n}.")
    _check_meta(meta, m, max_loras, dev)
    block_r = max(16, next_power_of_2(rank))
    block_sr = h_columns(num_slices, rank)
    check_tensor("h", h, ndim=2, dtypes=(torch.float32,), device=dev, last_dim_contiguous=True)
    if h.shape[0] < m or h.shape[1] < block_sr:
        raise ValueError(f"h: needs at least [{m}, {block_sr}], got {tuple(h.shape)}.")
    check_tensor("sync", sync, ndim=1, dtypes=(torch.int32,), shape=(2,), device=dev)
    cfg = config or gemm_lora_config(m, dev)
    if m == 0 or n == 0:
        return out
    pad = MAX_SLICES - num_slices
    b_args = list(lora_b_slices) + [lora_b_slices[0]] * pad
    n_args = list(out_dims) + [0] * pad
    off_args = [int(o) for o in slice_offsets] + [0] * pad
    tiles = [cdiv(d, cfg.block_n) for d in out_dims] + [0] * pad
    num_gemm = cdiv(m, cfg.block_m) * sum(tiles)
    num_shrink = max(1, min(cfg.shrink_programs, meta.num_active))
    upcast = is_interpreted(dev) or x.dtype == torch.float32
    _gemm_lora_kernel[(num_shrink + num_gemm,)](
        x, weight, bias if bias is not None else weight, out, lora_a, *b_args, h, sync,
        meta.token_lora_slots, meta.sorted_token_ids, meta.active_slots, meta.num_tokens_per_slot, meta.slot_start,
        m, k, meta.num_active, rank, *n_args, *off_args, tiles[0], tiles[0] + tiles[1], num_shrink, num_gemm,
        x.stride(0), weight.stride(0), out.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        h.stride(0),
        HAS_BIAS=bias is not None, NUM_SLICES=num_slices, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, BLOCK_R=block_r, BLOCK_SR=block_sr, SHRINK_M=cfg.shrink_m, SHRINK_K=cfg.shrink_k,
        LORA_CHUNK=cfg.lora_chunk, MAX_LORAS_PAD=next_power_of_2(max_loras), EVEN_K=k % cfg.block_k == 0,
        SHRINK_EVEN_K=k % cfg.shrink_k == 0, UPCAST=upcast,
        PRECISION="ieee" if upcast else "tf32", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
