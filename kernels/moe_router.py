"""MoE routing in one launch: each token's softmax over its router logits, its top-k experts and their
optional renormalisation.

torch runs the same routing as five or more kernels per MoE layer (softmax, topk's gather and sort, the sum
and the division, and copies), a visible share of a batch-1 decode step of a many-layer MoE. One program holds one token's E logits in registers
(E <= ``MAX_EXPERTS``), takes the float32 softmax, then selects the K largest probabilities one at a time
(K <= ``MAX_TOP_K``). ``topk_softmax_ref`` is the pure-torch twin (``torch.softmax`` + ``torch.topk``, the
CPU path's routing); ``tests/kernels/test_kernel_moe_router.py`` compares the two.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from kernels.utils import FLOAT_DTYPES, check_tensor

MAX_EXPERTS = 1024
"""The most experts one program holds (a power of two; routers today have 8-512)."""
MAX_TOP_K = 32
"""The most experts one token may select."""


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_t, TOP_K: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Semantics, program t (one token):

        p[e] = exp(logits[t, e] - max_e logits[t]) / sum_e exp(...)        (float32), e < E
        for k < TOP_K: ids[t, k] = the expert with the k-th largest p (equal p: the lower id first),
                       weights[t, k] = p[ids[t, k]]
        with RENORMALIZE: weights[t, k] /= sum_k weights[t, k]
    """
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    in_row = offs_e < E
    x = tl.load(logits_ptr + t * stride_t + offs_e, mask=in_row, other=float("-inf")).to(tl.float32)
    num = tl.where(in_row, tl.exp(x - tl.max(x, axis=0)), 0.0)
    p = tl.where(in_row, num / tl.sum(num, axis=0), -1.0)                  # [BLOCK_E]; lanes past E never win
    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_id = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        best_id = tl.minimum(tl.min(tl.where(p == best, offs_e, BLOCK_E), axis=0), E - 1)   # NaN rows: E - 1
        top_w = tl.where(offs_k == k, best, top_w)
        top_id = tl.where(offs_k == k, best_id.to(tl.int64), top_id)
        p = tl.where(offs_e == best_id, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)                                 # lanes past TOP_K hold 0
    in_k = offs_k < TOP_K
    tl.store(weights_ptr + t * TOP_K + offs_k, top_w, mask=in_k)
    tl.store(ids_ptr + t * TOP_K + offs_k, top_id, mask=in_k)


def fits_router_kernel(num_experts: int, top_k: int) -> bool:
    """Whether ``topk_softmax`` takes a router of ``num_experts`` experts selecting ``top_k``."""
    return 1 <= num_experts <= MAX_EXPERTS and 1 <= top_k <= min(num_experts, MAX_TOP_K)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (float32 / float16 / bfloat16, last dim contiguous, 1 <= E <= ``MAX_EXPERTS``)
    -> (topk_weights [T, K] float32, topk_ids [T, K] int64), K = ``top_k`` in [1, min(E, ``MAX_TOP_K``)]: the
    K largest of the float32 softmax over each row, descending, divided by their sum with ``renormalize``.
    Equal probabilities go to the lower expert id (``torch.topk`` leaves their order open)."""
    check_tensor("router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, num_experts = router_logits.shape
    if not fits_router_kernel(num_experts, top_k):
        raise ValueError(f"router_logits: {num_experts} experts, top_k={top_k}; this kernel takes 1-"
                         f"{MAX_EXPERTS} experts and top_k 1-{MAX_TOP_K} (at most the experts): route with "
                         "topk_softmax_ref.")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        block_e = triton.next_power_of_2(num_experts)
        _topk_softmax_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k, BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=bool(renormalize),
            num_warps=1 if block_e <= 128 else 2 if block_e <= 256 else 4)
    return weights, ids


def topk_softmax_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pure-torch twin of ``topk_softmax`` (any device, any E and K): ``torch.softmax`` in float32,
    ``torch.topk``, and with ``renormalize`` the K weights divided by their sum, as transformers routes."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)          # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)                 # [T, K]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
