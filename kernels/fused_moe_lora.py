"""Fused MoE experts with per-token LoRA adapters on every expert: grouped GEMMs over (slot, expert) groups.

Semantics (``engine.layers.moe.fused_moe_lora_ref``, the torch twin), dtype = hidden's, l = token_slots[t]
(no update where l < 0), e = topk_ids[t, k]:

    gate|up = dtype(x_t @ w13[e].T);   gate += dtype(dtype(x_t @ A_gate[l, e].T) @ B_gate[l, e].T)  (up alike)
    act = dtype(dtype(silu(gate)) * up)
    y = dtype(act @ w2[e].T);          y += dtype(dtype(act @ A_down[l, e].T) @ B_down[l, e].T)
    out[t] = sum_k dtype(y * topk_weights[t, k])        (summed in float32, rounded once)

The sorted-by-expert layout of ``kernels.fused_moe`` is extended with the adapter slot: pair (t, k) goes to
group g = (l + 1) * E + e (g = e without an adapter), ``moe_align`` sorts the pairs by group and pads each
group to the block size, so every block of sorted slots has one (slot, expert). Then, with
``kernels.fused_moe.grouped_gemm`` (one kernel, its modes):

1. gate|up for every slot, w13[g % E] (gather x rows);                                       [P, 2I]
2. LoRA shrink, A13[g - E] (blocks of base groups exit): h13 = x @ [A_gate | A_up].T;        [P, 2R]
3. LoRA expand, twice (gate columns, up columns), B[g - E], added into gate|up;
4. SiLU-and-mul (torch);                                                                       [P, I]
5. down for every slot, w2[g % E]; 6. its LoRA shrink and 7. expand, added;                    [P, H]
8. the routing weight and the scatter back to pairs (torch), the sum over K.

FP8 expert weights (``w13_scale`` / ``w2_scale`` given): only the base GEMMs (steps 1 and 5) take them, w13 /
w2 float8_e4m3fn widened in registers and scaled per output channel or per (BN, BK) block exactly as in
``kernels.fused_moe`` (W = dequantized weight in the formulas above); the LoRA A / B stay in hidden's dtype
(scale mode 0). The twin is ``fused_moe_lora_ref`` on ``kernels.fused_moe.dequantize_fp8_experts``' weights.

No host read: every size is a function of the shapes, the groups' sizes stay on the device.
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels.fused_moe import (FP8_DTYPE, FusedMoEConfig, check_fp8_scales, fused_moe_config, grouped_gemm,
                               moe_align)
from kernels.utils import FLOAT_DTYPES, check_tensor


def moe_lora_groups(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, K] int64 group of each (token, expert) pair: (slot + 1) * E + e where the token's slot >= 0, else e.

    topk_ids: [T, K] expert ids; token_slots: [T] int adapter slot per token (-1: none).
    """
    slots = token_slots.to(torch.int64)[:, None]                                    # [T, 1]
    ids = topk_ids.to(torch.int64)                                                  # [T, K]
    return torch.where(slots >= 0, (slots + 1) * num_experts + ids, ids)


def fused_moe_lora_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, token_slots: torch.Tensor, a13: torch.Tensor, b13: torch.Tensor,
                          a2: torch.Tensor, b2: torch.Tensor, config: Optional[FusedMoEConfig] = None, *,
                          w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                          scale_block: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """The routed experts' output with each token's adapter on its experts (the module docstring).

    Args:
        hidden: [T, H] float16/bfloat16/float32, last dim contiguous.
        w13: [E, 2I, H], w2: [E, H, I]: the experts (``kernels.fused_moe.fused_moe_triton``), contiguous;
            hidden's dtype, or float8_e4m3fn with w13_scale / w2_scale.
        topk_weights: [T, K] routing weights (any float dtype); topk_ids: [T, K] int ids in [0, E).
        token_slots: [T] int32/int64 adapter slot per token in [-1, L) (-1: the base model; not checked on the
            host).
        a13: [L, E, 2R, H] per (slot, expert) the gate A rows then the up A rows; b13: [L, E, 2, I, R] the gate
            and up B; a2: [L, E, R, I]; b2: [L, E, H, R]. hidden's dtype and device, contiguous.
        config: launch config; None: ``fused_moe_config`` for the (L + 1) * E groups. With block scales the
            base GEMMs' block_k is capped to divide BK (``kernels.fused_moe.scale_block_k``).
        w13_scale, w2_scale, scale_block: the FP8 base weights' scales, as ``fused_moe_triton``'s (float32,
            contiguous; per channel [E, 2I] / [E, H], or per (BN, BK) = scale_block block
            [E, cdiv(2I, BN), cdiv(H, BK)] / [E, cdiv(H, BN), cdiv(I, BK)]); both scales or neither.

    Returns:
        A new [T, H] tensor in hidden's dtype.
    """
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    T, H = hidden.shape
    dev, dt = hidden.device, hidden.dtype
    w_dt = FP8_DTYPE if w13_scale is not None or w2_scale is not None else dt
    check_tensor("w13", w13, ndim=3, dtypes=(w_dt,), device=dev, contiguous=True)
    E, two_i = w13.shape[0], w13.shape[1]
    if w13.shape[2] != H or two_i % 2 or two_i == 0 or E == 0:
        raise ValueError(f"w13: expected shape (E >= 1, 2 * I >= 2, {H}), got {tuple(w13.shape)}.")
    inter = two_i // 2
    check_tensor("w2", w2, dtypes=(w_dt,), shape=(E, H, inter), device=dev, contiguous=True)
    scale_block = check_fp8_scales(hidden, E, H, inter, w13_scale, w2_scale, scale_block)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64), device=dev)
    top_k = topk_ids.shape[1]
    if topk_ids.shape[0] != T or not 1 <= top_k <= E:
        raise ValueError(f"topk_ids: expected shape ({T}, K) with 1 <= K <= {E}, got {tuple(topk_ids.shape)}.")
    check_tensor("topk_weights", topk_weights, dtypes=FLOAT_DTYPES, shape=(T, top_k), device=dev)
    check_tensor("token_slots", token_slots, dtypes=(torch.int32, torch.int64), shape=(T,), device=dev)
    check_tensor("a13", a13, ndim=4, dtypes=(dt,), device=dev, contiguous=True)
    L, two_r = a13.shape[0], a13.shape[2]
    if a13.shape[1] != E or a13.shape[3] != H or two_r % 2 or two_r == 0 or L == 0:
        raise ValueError(f"a13: expected shape (L >= 1, {E}, 2 * R >= 2, {H}), got {tuple(a13.shape)}.")
    rank = two_r // 2
    check_tensor("b13", b13, dtypes=(dt,), shape=(L, E, 2, inter, rank), device=dev, contiguous=True)
    check_tensor("a2", a2, dtypes=(dt,), shape=(L, E, rank, inter), device=dev, contiguous=True)
    check_tensor("b2", b2, dtypes=(dt,), shape=(L, E, H, rank), device=dev, contiguous=True)
    if config is None:
        config = fused_moe_config(T, (L + 1) * E, H, inter, top_k, dev)
    elif not isinstance(config, FusedMoEConfig):
        raise ValueError(f"config: expected a FusedMoEConfig, got {type(config).__name__}.")
    if T == 0 or H == 0:
        return torch.zeros_like(hidden, memory_format=torch.contiguous_format)
    num_pairs = T * top_k
    groups = moe_lora_groups(topk_ids, token_slots, E)                                # [T, K]
    sorted_pair_ids, group_of_block, num_valid = moe_align(groups, (L + 1) * E, config.block_m)
    P = sorted_pair_ids.numel()
    topk_w = topk_weights.reshape(-1).contiguous()                                   # [T*K]
    common = dict(sorted_pair_ids=sorted_pair_ids, expert_of_block=group_of_block, num_valid=num_valid,
                  topk_w=topk_w, num_pairs=num_pairs, top_k=top_k, silu_mul=False, config=config,
                  num_experts=E, scatter=False, mul_weight=False)
    gate_up = torch.empty(P, two_i, dtype=dt, device=dev)                            # [P, 2I]
    grouped_gemm(hidden, w13, gate_up, N=two_i, K=H, gather=True, w_scale=w13_scale, scale_block=scale_block,
                 **common)
    h13 = torch.empty(P, two_r, dtype=dt, device=dev)                                # [P, 2R]
    grouped_gemm(hidden, a13.view(L * E, two_r, H), h13, N=two_r, K=H, gather=True, lora=True, **common)
    b13_flat = b13.view(L * E, 2, inter, rank)
    for s in range(2):                                                               # gate, up
        grouped_gemm(h13[:, s * rank:(s + 1) * rank], b13_flat[:, s], gate_up[:, s * inter:(s + 1) * inter],
                     N=inter, K=rank, gather=False, lora=True, add_out=True, **common)
    act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]          # [P, I]
    down = torch.empty(P, H, dtype=dt, device=dev)                                   # [P, H]
    grouped_gemm(act, w2, down, N=H, K=inter, gather=False, w_scale=w2_scale, scale_block=scale_block,
                 **common)
    h2 = torch.empty(P, rank, dtype=dt, device=dev)                                  # [P, R]
    grouped_gemm(act, a2.view(L * E, rank, inter), h2, N=rank, K=inter, gather=False, lora=True, **common)
    grouped_gemm(h2, b2.view(L * E, H, rank), down, N=H, K=rank, gather=False, lora=True, add_out=True, **common)
    # Slots past a group's pairs hold the sentinel num_pairs: they land in the extra row, which is dropped.
    w_ext = torch.cat([topk_w.to(torch.float32), topk_w.new_zeros(1, dtype=torch.float32)])   # [T*K + 1]
    weighted = torch.empty(num_pairs + 1, H, dtype=dt, device=dev)                  # [T*K + 1, H]
    weighted.index_copy_(0, sorted_pair_ids, (down.float() * w_ext[sorted_pair_ids, None]).to(dt))
    return weighted[:num_pairs].view(T, top_k, H).sum(dim=1, dtype=torch.float32).to(dt)
