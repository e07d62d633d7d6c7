"""Mixture-of-experts MLP block: a router, top-k routed experts with stacked weights, an optional shared expert.

    router_logits = gate(x)                                  [T, E]   (a ``Linear``, model dtype)
    topk_weights, topk_ids = select_experts(router_logits)   [T, K]   softmax in float32, top-k, optional renorm
    y = fused_moe(x, w13, w2, topk_weights, topk_ids)        [T, H]   sum_k w_k * expert_{id_k}(x)
    y += sigmoid(shared_expert_gate(x)) * shared_expert(x)           (Qwen2-MoE style, where the config has one)

Expert weights are stacked, as transformers 5 stores them in memory (and as a fused MoE kernel reads them):
``w13`` [E, 2 * I, H] holds each expert's gate rows then its up rows (HF ``w1``|``w3``, ``gate_proj``|``up_proj``),
``w2`` [E, H, I] its down projection (HF ``w2``, ``down_proj``). ``FusedMoE.load_expert`` copies one
checkpoint expert tensor into its rows; ``load_stacked`` a transformers-5 fused tensor whole.

The compute is one entry point, ``fused_moe(hidden, w13, w2, topk_weights, topk_ids)``. Today it runs
``fused_moe_ref``, the pure-torch "sorted by expert" grouped computation: the T * K (token, expert) pairs
are sorted by expert, each expert with tokens runs one gate|up matmul, SiLU-and-mul and one down matmul on its
contiguous segment, and the results, scaled by their routing weights, are scatter-added back to their tokens.
On CUDA ``fused_moe`` runs ``kernels.fused_moe`` (the same sorted pairs padded to the block size per expert on
the device, one grouped GEMM launch for gate|up with SiLU-and-mul and one for down with the routing weight);
``fused_moe_ref`` is its twin and the CPU path. The reference reads the per-expert token counts on the host
(one sync per layer). While a CUDA graph is being captured ``fused_moe`` runs ``fused_moe_dense_ref`` (every
expert on every row, weighted by a zero where a row did not pick it: exact, sync-free, E / K times the work),
until the kernel's own capture is checked on a GPU.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.layers.adapter import Feeds
from engine.layers.fused import silu_mul_linear
from engine.layers.linear import Linear

# ----------------------------------------------------------------------------------------
# Routing and the expert computation (pure functions: the seam a fused kernel slots into)
# ----------------------------------------------------------------------------------------


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, K] float32, topk_ids [T, K] int64): the softmax over all
    experts (in float32), its top ``top_k``, and with ``renormalize`` those K divided by their sum (Mixtral;
    Qwen-MoE's ``norm_topk_prob``), which equals the softmax over the top-K logits. Ties go as ``torch.topk``'s
    do, as in transformers."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)          # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)                 # [T, K]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' output [T, H] (see ``fused_moe_ref`` for the arguments): ``kernels.fused_moe`` on
    CUDA (the dense form inside CUDA graph capture), the reference elsewhere."""
    if hidden.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            return fused_moe_dense_ref(hidden, w13, w2, topk_weights, topk_ids)
        from kernels.fused_moe import fused_moe_triton
        return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids)
    return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids)


def fused_moe_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, k], grouped by
    expert (pure torch; the twin of the fused MoE kernel).

    Args:
        hidden: [T, H] the MLP input (after the post-attention norm).
        w13: [E, 2 * I, H] each expert's gate rows, then its up rows.
        w2: [E, H, I] each expert's down projection.
        topk_weights: [T, K] routing weights (any float dtype; products are taken in float32).
        topk_ids: [T, K] int expert ids in [0, E).

    Returns:
        [T, H] in hidden's dtype.
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(hidden)                                           # [T, H]
    if num_tokens == 0:
        return out
    flat_ids = topk_ids.reshape(-1)                                          # [T*K] pair -> expert
    order = torch.argsort(flat_ids, stable=True)                             # pairs sorted by expert
    token_of = order // top_k                                                # [T*K] each sorted pair's token
    pair_weights = topk_weights.reshape(-1)[order].to(torch.float32)         # [T*K]
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()       # host: tokens per expert
    x = hidden.index_select(0, token_of)                                     # [T*K, H] grouped by expert
    y = torch.empty_like(x)                                                  # [T*K, H]
    intermediate = w2.shape[2]
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        seg = slice(start, start + n)
        gate_up = F.linear(x[seg], w13[expert])                             # [n, 2I]
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]  # [n, I]
        y[seg] = F.linear(act, w2[expert])                                   # [n, H]
        start += n
    y = (y.to(torch.float32) * pair_weights[:, None]).to(hidden.dtype)
    return out.index_add_(0, token_of, y)


def fused_moe_dense_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """``fused_moe_ref``'s result without a host read (for CUDA graph capture): every expert runs on every
    row, weighted by the row's routing weight for it (zero where the row did not pick it)."""
    num_experts, intermediate = w13.shape[0], w2.shape[2]
    # [T, E]: each row's weight per expert (a row picks an expert at most once)
    dense = torch.zeros(topk_ids.shape[0], num_experts, dtype=torch.float32, device=hidden.device)
    dense.scatter_(1, topk_ids, topk_weights.to(torch.float32))
    out = torch.zeros_like(hidden, dtype=torch.float32)
    for expert in range(num_experts):
        gate_up = F.linear(hidden, w13[expert])
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        out.add_(F.linear(act, w2[expert]).to(torch.float32) * dense[:, expert, None])
    return out.to(hidden.dtype)


# ----------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------
class FusedMoE(nn.Module):
    """The routed experts of one layer, their weights stacked (``w13`` [E, 2I, H], ``w2`` [E, H, I])."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], router_logits [T, E] -> [T, H]."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        return fused_moe(hidden, self.w13, self.w2, topk_weights, topk_ids)

    def load_expert(self, param_name: str, expert: int, shard: int, tensor: torch.Tensor) -> None:
        """Copy one checkpoint expert tensor: ``w13`` shard 0 (gate) or 1 (up) [I, H], or ``w2`` [H, I]."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the config has {self.num_experts} experts")
        size = self.intermediate_size
        if param_name == "w13":
            want, dst = (size, self.hidden_size), self.w13.data[expert, shard * size:(shard + 1) * size]
        else:
            want, dst = (self.hidden_size, size), self.w2.data[expert]
        if tuple(tensor.shape) != want:
            raise ValueError(f"expert {expert} {param_name} tensor has shape {tuple(tensor.shape)}, "
                             f"expected {want}")
        dst.copy_(tensor)

    def load_stacked(self, param_name: str, tensor: torch.Tensor) -> None:
        """Copy a transformers-5 stacked tensor: ``gate_up_proj`` [E, 2I, H] into ``w13``, ``down_proj``
        [E, H, I] into ``w2``."""
        param = getattr(self, param_name)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"stacked {param_name} tensor has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.data.copy_(tensor)


class SharedExpertMLP(nn.Module):
    """A dense SwiGLU expert every token takes (Qwen2-MoE's ``shared_expert``); gate|up packed."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2, feeds=Feeds.SILU_MUL)
        self.down_proj = Linear(intermediate_size, [hidden_size])    # scaled by its gate: Feeds.ANY

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_mul_linear(self.down_proj, self.gate_up_proj(x))


class SparseMoeBlock(nn.Module):
    """Router (``gate``) + routed experts (``experts``) + optional shared expert, in HF's module names."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, shared_expert_intermediate_size: int = 0, hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={hidden_act!r} is not supported by the MoE block (only 'silu').")
        self.gate = Linear(hidden_size, [num_experts])
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize)
        self.shared_expert: Optional[SharedExpertMLP] = None
        self.shared_expert_gate: Optional[Linear] = None
        if shared_expert_intermediate_size:
            self.shared_expert = SharedExpertMLP(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, [1])

    @classmethod
    def from_config(cls, config, num_experts: int, intermediate_size: int, renormalize: bool
                    ) -> "SparseMoeBlock":
        return cls(config.hidden_size, num_experts, config.num_experts_per_tok, intermediate_size,
                   renormalize,
                   int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
                   getattr(config, "hidden_act", "silu"))

    def activation_width(self) -> int:
        """Per-token activation width of this block (``ModelShape.intermediate_size``): the routed experts'
        intermediate rows together plus the shared expert's, or the K gathered [H] rows of the sorted pairs
        (``fused_moe_ref``'s, and a fused kernel's, [T * K, H] buffers), whichever is wider."""
        shared = self.shared_expert.down_proj.input_size if self.shared_expert is not None else 0
        experts = self.experts
        return max(experts.top_k * experts.intermediate_size + shared, experts.top_k * experts.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (normed) -> [T, H], for the next residual add + RMSNorm."""
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * shared
        return out
