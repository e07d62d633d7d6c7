"""Pure-torch twins of every kernel: slow, simple and obviously right (the test oracle).

Each twin computes exactly the "Semantics:" loop of its kernel with plain indexing, in
float64 (attention) or float32 (LoRA), and returns a new tensor instead of writing in place.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kernels.lora_pages import LoRASlotPages, slot_a, slot_b

NO_LORA = -1


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, scale: float, window: Optional[int] = None,
                        key_limit: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Twin of ``kernels.paged_attention.paged_attention`` (and of its ``window`` and ``key_limit``).

    q: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim] in q's dtype; rows no request owns are zero.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)  # [T, H, D]
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        ctx = seq_len - (end - start)
        positions = torch.arange(seq_len)
        slots = block_tables[i].cpu().long()[positions // block_size] * block_size + positions % block_size
        slots = slots.to(k_cache.device)
        k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].cpu().double()   # [L, KVH, D]
        v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].cpu().double()
        k = k.repeat_interleave(group, dim=1)                  # [L, H, D]: head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        qi = q[start:end].cpu().double()                       # [qlen, H, D]
        scores = torch.einsum("qhd,lhd->hql", qi, k) * scale   # [H, qlen, L]
        # Query j sits at absolute position ctx + j and sees keys 0..ctx + j (up to key_limit[t] where
        # given), the last ``window`` of them under a sliding window.
        qpos = ctx + torch.arange(end - start)                                      # [qlen]
        hi = qpos if key_limit is None else key_limit[start:end].cpu().long()
        visible = positions[None, :] <= hi[:, None]                                 # [qlen, L]
        if window is not None:
            visible &= positions[None, :] > (qpos - window)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)
    return out.to(q.dtype).to(q.device)


def rotary_ref(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               rotary_dim: int) -> torch.Tensor:
    """Twin of ``kernels.layer_ops.rotary_embedding_`` on one tensor: a rotated float32 copy of x
    ([num_tokens, heads, head_dim]); cos/sin: [max_position, >= rotary_dim / 2]."""
    half = rotary_dim // 2
    out = x.float().clone()
    c = cos[positions.long(), :half].float()[:, None, :]                   # [T, 1, half]
    s = sin[positions.long(), :half].float()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
    out[..., :half] = x1 * c - x2 * s
    out[..., half:2 * half] = x2 * c + x1 * s
    return out


def qk_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor:
    """Twin of the per-head RMSNorm of ``kernels.kv_write.QKNormWeights``: x [T, heads, head_dim] -> each
    head row dtype(w' * dtype(x / sqrt(mean(x^2) + eps))), w' = weight (1 + weight with ``plus_one``), in
    float32, dtype = x's."""
    h = x.float()
    n = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).float()
    return ((weight.float() + 1.0 if plus_one else weight.float()) * n).to(x.dtype)


def rotary_write_kv_ref(positions, q, k, v, cos, sin, rotary_dim: int, k_cache, v_cache, slot_mapping,
                        qk_norm=None):
    """Twin of ``kernels.kv_write.rotary_write_kv`` (``qk_norm``: its ``QKNormWeights``, applied by
    ``qk_norm_ref`` before rotary): returns (q, k, k_cache, v_cache) updated copies."""
    if qk_norm is not None:
        q = qk_norm_ref(q, qk_norm.q_weight, qk_norm.eps, qk_norm.plus_one)
        k = qk_norm_ref(k, qk_norm.k_weight, qk_norm.eps, qk_norm.plus_one)
    q_out = rotary_ref(positions, q, cos, sin, rotary_dim).to(q.dtype)
    k_out = rotary_ref(positions, k, cos, sin, rotary_dim).to(k.dtype)
    k_cache_out, v_cache_out = write_kv_ref(k_out, v, k_cache, v_cache, slot_mapping)
    return q_out, k_out, k_cache_out, v_cache_out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """Twin of ``kernels.layer_ops.add_rms_norm`` (and the engine's CPU RMSNorm,
    ``engine.layers.norm.RMSNorm.forward_torch``). Without ``residual``: norm(x). With it:
    (norm(s), s), s = x + residual rounded to the dtype.

    x: [num_tokens, hidden], or with ``residual`` split-K partials [num_parts, num_tokens, hidden]
    summed in float32 in order, then + residual, rounded once to residual's dtype. The norm:
    n = dtype(s / sqrt(mean(s^2) + eps)) in float32, out = weight * n in the weight's and s's dtype.
    """
    if x.dim() == 3:
        total = x[0].float()
        for part in x[1:]:
            total = total + part.float()
        x = (total + residual.float()).to(residual.dtype)
        residual = x
    elif residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Twin of ``kernels.layer_ops.silu_and_mul`` (and the engine's CPU path,
    ``engine.layers.activation.silu_and_mul_torch``): x [..., 2 * d] (gate | up) -> [..., d] =
    silu(gate) * up in x's dtype."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]).mul_(x[..., d:])      # in place: one [.., d] pass less


def int4_gemm_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, low: torch.Tensor,
                  group_size: int = 32) -> torch.Tensor:
    """Twin of ``kernels.cpu_amx_gemm``'s int4: x [M, K] float32, q [N, K] (0..15), scales and low [N, K / group_size]
    float32 -> [M, N] float32 = bf16(x) @ bf16(q * scale + low).T with float32 sums."""
    n, k = q.shape
    w = q.float().view(n, k // group_size, group_size) * scales[..., None] + low[..., None]
    w = w.view(n, k).to(torch.bfloat16).float()
    return x.to(torch.bfloat16).float() @ w.T


def int8_gemm_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Twin of ``kernels.cpu_amx_gemm``'s int8: x [M, K] float32, q [N, K] int8, scales [N] float32 -> [M, N]
    float32 = (bf16(x) @ q.T) * scales, float32 sums."""
    return (x.to(torch.bfloat16).float() @ q.float().T) * scales


def lora_rotary_write_kv_ref(positions, q, k, v, cos, sin, rotary_dim: int, k_cache, v_cache, slot_mapping,
                             buf, lora_b_slices, token_lora_slots, pages: Optional[LoRASlotPages] = None):
    """Twin of ``kernels.lora_rotary_write_kv.lora_rotary_write_kv`` (buf: each token's own h, no
    slot stride; pages as ``lora_expand_ref``'s): the expand into q | k | v, then ``rotary_write_kv_ref``.
    Returns updated copies (q, k, v, k_cache, v_cache)."""
    T = q.shape[0]
    qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=1)
    widths = [b.shape[1] for b in lora_b_slices]
    qkv = lora_expand_ref(buf, lora_b_slices, token_lora_slots, qkv, [0, widths[0], widths[0] + widths[1]],
                          pages=pages)
    q2, k2, v2 = (x.reshape(orig.shape) for x, orig in zip(qkv.split(widths, dim=1), (q, k, v)))
    q_out, k_out, kc, vc = rotary_write_kv_ref(positions, q2, k2, v2, cos, sin, rotary_dim, k_cache, v_cache,
                                               slot_mapping)
    return q_out, k_out, v2, kc, vc


def lora_expand_add_rms_norm_ref(buf, lora_b, token_lora_slots, x, weight, eps: float, residual=None,
                                 pages: Optional[LoRASlotPages] = None):
    """Twin of ``kernels.lora_expand_norm.lora_expand_add_rms_norm`` (buf: each row's own h, no slot
    stride; pages as ``lora_expand_ref``'s): the expand into x, then add + RMSNorm with add_rms_norm's
    roundings. Returns (out, s), s the stored sum."""
    p = lora_expand_ref(buf, [lora_b], token_lora_slots, x, [0], pages=pages)      # [T, hidden], x's dtype
    s = p if residual is None else (p.float() + residual.float()).to(x.dtype)
    s32 = s.float()
    n = (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * n.float()).to(x.dtype), s


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``kernels.kv_write.write_kv``: returns updated copies of (k_cache, v_cache)."""
    k_out, v_out = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_out[slot // block_size, slot % block_size] = k[t].to(k_cache.dtype)
        v_out[slot // block_size, slot % block_size] = v[t].to(v_cache.dtype)
    return k_out, v_out


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, token_lora_slots: torch.Tensor,
                    scale: float = 1.0, split_k: Optional[int] = None, pages: Optional[LoRASlotPages] = None,
                    rank: Optional[int] = None) -> torch.Tensor:
    """Twin of ``kernels.lora_shrink.lora_shrink``.

    x: [T, in_dim]; lora_a: [num_slices, max_loras, rank, in_dim], or with ``pages`` the pool
    [num_slices, rows, in_dim] (``kernels.lora_pages``: slot l's A is its rank_l rows).
    Returns float32 scale * x[t] @ A_l[s].T (l = slot(t)) in the first rank_l columns, zero past them
    and for base rows (the kernel leaves those as they were): [num_slices, T, rank] with split_k None;
    else the kernel's partials [num_slices, split_k, T, rank], split j over inputs [j * c, (j + 1) * c)
    with c = cdiv(in_dim, split_k) rounded up to 16 (``kernels.lora_shrink.split_chunk``). rank: with
    pages, the output's width (None: the largest slot rank).
    """
    if pages is None:
        num_slices, _, rank, in_dim = lora_a.shape
    else:
        num_slices, _, in_dim = lora_a.shape
        rank = rank or int(pages.slot_ranks.max())
    splits = split_k or 1
    chunk = (in_dim + splits - 1) // splits
    chunk = (chunk + 15) // 16 * 16
    out = torch.zeros(num_slices, splits, x.shape[0], rank, dtype=torch.float32, device=x.device)
    for t, slot in enumerate(token_lora_slots.tolist()):
        if slot == NO_LORA:
            continue
        a = lora_a[:, slot] if pages is None else slot_a(lora_a, pages, slot)      # [S, rank_l, in]
        for s in range(num_slices):
            for j in range(splits):
                ks = slice(j * chunk, (j + 1) * chunk)
                out[s, j, t, :a.shape[1]] = scale * (a[s, :, ks].float() @ x[t, ks].float())
    return out if split_k else out[:, 0]


def lora_expand_ref(buf: torch.Tensor, lora_b_slices: Sequence[torch.Tensor],
                    token_lora_slots: torch.Tensor, y: torch.Tensor, slice_offsets: Sequence[int],
                    add_inputs: bool = True, pages: Optional[LoRASlotPages] = None) -> torch.Tensor:
    """Twin of ``kernels.lora_expand.lora_expand``: returns an updated copy of y.

    buf: [num_slices, T, rank] or split partials [num_slices, split_k, T, rank] (summed), float32;
    lora_b_slices[s]: [max_loras, out_dim_s, rank], or with ``pages`` the pools [num_pages, out_dim_s,
    page_rows] (``kernels.lora_pages``: slot l's B is its rank_l rows); y: [T, total_out].
    y[t, off_s:off_s+out_s] (+)= buf[s, t, :rank_l] @ B_s[l].T for LoRA rows (l = slot(t)); h's columns
    past rank_l are never read.
    """
    h = buf.float().sum(1) if buf.dim() == 4 else buf.float()        # [num_slices, T, rank]
    y_out = y.clone()
    for t, slot in enumerate(token_lora_slots.tolist()):
        if slot == NO_LORA:
            continue
        for s, (b, off) in enumerate(zip(lora_b_slices, slice_offsets)):
            b_l = b[slot] if pages is None else slot_b(b, pages, slot)             # [out_dim_s, rank_l]
            delta = b_l.float() @ h[s, t, :b_l.shape[1]]                            # [out_dim_s]
            cols = slice(off, off + b.shape[1])
            base = y_out[t, cols].float() if add_inputs else 0.0
            y_out[t, cols] = (base + delta).to(y.dtype)
    return y_out


def lora_expand_silu_mul_ref(buf: torch.Tensor, lora_b_slices: Sequence[torch.Tensor],
                             token_lora_slots: torch.Tensor, y: torch.Tensor,
                             pages: Optional[LoRASlotPages] = None) -> torch.Tensor:
    """Twin of ``kernels.lora_expand_silu_mul.lora_expand_silu_mul``: a new [T, d] tensor.

    ``lora_expand_ref`` into a copy of y (gate | up, slices at columns 0 and d; pages as its), then
    out = dtype(dtype(silu(gate)) * up) in float32 math.
    """
    d = y.shape[1] // 2
    gu = lora_expand_ref(buf, lora_b_slices, token_lora_slots, y, [0, d], pages=pages).float()   # [T, 2d]
    act = torch.nn.functional.silu(gu[:, :d]).to(y.dtype).float()
    return (act * gu[:, d:]).to(y.dtype)
