"""Mixture-of-experts MLP block: a router, top-k routed experts with stacked weights, an optional shared expert.

    router_logits = gate(x)                                  [T, E]   (a ``Linear``, model dtype)
    topk_weights, topk_ids = select_experts(router_logits)   [T, K]   softmax in float32, top-k, optional renorm
                                                                      (``kernels.moe_router`` on CUDA: opt-in)
    y = fused_moe(x, w13, w2, topk_weights, topk_ids)        [T, H]   sum_k w_k * expert_{id_k}(x)
    y += sigmoid(shared_expert_gate(x)) * shared_expert(x)           (Qwen2-MoE style, where the config has one)

Expert weights are stacked, as transformers 5 stores them in memory (and as a fused MoE kernel reads them):
``w13`` [E, 2 * I, H] holds each expert's gate rows then its up rows (HF ``w1``|``w3``, ``gate_proj``|``up_proj``),
``w2`` [E, H, I] its down projection (HF ``w2``, ``down_proj``). ``FusedMoE.load_expert`` copies one
checkpoint expert tensor into its rows; ``load_stacked`` a transformers-5 fused tensor whole. FP8 experts
(an FP8 checkpoint's, or ``--quantization fp8``: ``engine.layers.fp8_experts``) hold e4m3 ``w13`` / ``w2`` and
their scales on CUDA, which every fused path below takes; on CPU their dequantized weights.

The compute is one entry point, ``fused_moe(hidden, w13, w2, topk_weights, topk_ids)``. On CPU it runs
``fused_moe_ref``, the pure-torch "sorted by expert" grouped computation: the T * K (token, expert) pairs
are sorted by expert, each expert with tokens runs one gate|up matmul, SiLU-and-mul and one down matmul on its
contiguous segment, and the results, scaled by their routing weights, are scatter-added back to their tokens.
On CUDA ``fused_moe`` runs ``kernels.fused_moe`` (the same sorted pairs padded to the block size per expert on
the device, one grouped GEMM launch for gate|up with SiLU-and-mul and one for down with the routing weight), or
for calls of few pairs (decode steps, ``KernelPolicy.moe_decode_max_pairs``) ``kernels.fused_moe_decode`` (no
sort: each pair's programs read its own expert's rows); ``fused_moe_ref`` is the twin of both and the CPU path. The reference reads the per-expert token counts on the host
(one sync per layer); the kernel reads nothing on the host, so CUDA graphs capture it as it is.

LoRA: a ``FusedMoE`` whose ``adapter`` (``ExpertsAdapter``, the LoRA slots) has an update this step runs
``fused_moe_lora`` instead: each token's adapter on every expert it routes to (``ExpertLoRAWeights``: per
(slot, expert) A and B of gate, up and down), ``kernels.fused_moe_lora`` on CUDA, the vectorised twin
``fused_moe_lora_ref`` elsewhere. Tensor parallelism: each expert's intermediate rows are split over the ranks
(``FusedMoE.intermediate_range``), the router replicated, and ``SparseMoeBlock`` all-reduces the routed output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.distributed.group import TensorParallelGroup
from engine.distributed.sharding import even_part
from engine.forward_context import current_policy
from engine.kernel_policy import KernelPolicy
from engine.layers.adapter import Feeds
from engine.layers.fp8_experts import Fp8Experts
from engine.layers.fused import silu_mul_linear
from engine.layers.linear import Linear, weights_deferred
from engine.layers.parallel import column_parallel_linear, row_parallel_linear
from engine.quantization.slices import Fp8Slice, Int4Slice
from kernels.moe_router import fits_router_kernel, topk_softmax, topk_softmax_ref

if TYPE_CHECKING:
    from engine.layers.quantized import QuantizedWeight
    from engine.layers.w4a16 import W4A16Weight

ExpertWeights = Union[torch.Tensor, Sequence["QuantizedWeight | W4A16Weight"]]
"""An MoE layer's gate|up or down weights: stacked [E, out, in], or on CPU one weight-only quantized weight
per expert (``engine.layers.quantized``'s int8 / int4 / fp16, a 4-bit checkpoint's ``W4A16Weight``), each
run by its ``linear``."""

# ----------------------------------------------------------------------------------------
# Routing and the expert computation (pure functions: the seam a fused kernel slots into)
# ----------------------------------------------------------------------------------------


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, K] float32, topk_ids [T, K] int64): the softmax over all
    experts (in float32), its top ``top_k``, and with ``renormalize`` those K divided by their sum (Mixtral;
    Qwen-MoE's ``norm_topk_prob``), which equals the softmax over the top-K logits. On CUDA with
    ``KernelPolicy.moe_router_kernel`` one ``kernels.moe_router`` launch (equal probabilities go to the lower
    expert id); else its twin, torch's ops as transformers runs them."""
    if router_logits.is_cuda and current_policy().moe_router_kernel and fits_router_kernel(
            router_logits.shape[-1], top_k):
        return topk_softmax(router_logits, top_k, renormalize)
    return topk_softmax_ref(router_logits, top_k, renormalize)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, fp8: Optional[Fp8Experts] = None) -> torch.Tensor:
    """The routed experts' output [T, H] (see ``fused_moe_ref`` for the arguments). On CUDA (eager and in CUDA
    graphs: neither kernel reads the device on the host) calls of at most ``KernelPolicy.moe_decode_max_pairs``
    (token, expert) pairs run ``kernels.fused_moe_decode`` (each pair reads its own expert), larger ones
    ``kernels.fused_moe`` (pairs sorted by expert); the reference elsewhere. ``fp8``: w13 / w2 are its e4m3
    weights and the kernels take its scales (CUDA only: on CPU FP8 experts hold their dequantized weights)."""
    scales = fp8.kernel_scales() if fp8 is not None else {}
    if hidden.is_cuda:
        if uses_moe_decode(topk_ids.numel(), current_policy()):
            from kernels.fused_moe_decode import fused_moe_decode_triton
            return fused_moe_decode_triton(hidden, w13, w2, topk_weights, topk_ids, **scales)
        from kernels.fused_moe import fused_moe_triton
        return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, **scales)
    return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids)


def uses_moe_decode(num_pairs: int, policy: KernelPolicy) -> bool:
    """Whether a CUDA call of ``num_pairs`` (token, expert) pairs (a shape: the same at every replay of a
    captured graph) takes the decode path."""
    return 0 < num_pairs <= policy.moe_decode_max_pairs


def fused_moe_lora(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, lora: "ExpertLoRAWeights", fp8: Optional[Fp8Experts] = None
                   ) -> torch.Tensor:
    """The routed experts' output with each token's adapter on its experts (``fused_moe_lora_ref``'s
    semantics): ``kernels.fused_moe_lora`` on CUDA (FP8 experts: ``fp8``'s scales on the base GEMMs, the
    adapters in the activations' dtype), the reference elsewhere."""
    if hidden.is_cuda:
        from kernels.fused_moe_lora import fused_moe_lora_triton
        return fused_moe_lora_triton(hidden, w13, w2, topk_weights, topk_ids, lora.token_slots, lora.a13,
                                     lora.b13, lora.a2, lora.b2, **(fp8.kernel_scales() if fp8 is not None else {}))
    return fused_moe_lora_ref(hidden, w13, w2, topk_weights, topk_ids, lora)


def fused_moe_ref(hidden: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, k], grouped by
    expert (pure torch; the twin of the fused MoE kernel).

    Args:
        hidden: [T, H] the MLP input (after the post-attention norm).
        w13: [E, 2 * I, H] each expert's gate rows, then its up rows (or E quantized weights:
            ``ExpertWeights``).
        w2: [E, H, I] each expert's down projection (likewise).
        topk_weights: [T, K] routing weights (any float dtype; products are taken in float32).
        topk_ids: [T, K] int expert ids in [0, E).

    Returns:
        [T, H] in hidden's dtype.
    """
    return _experts_ref(hidden, w13, w2, topk_weights, topk_ids, None)


@dataclass(frozen=True)
class ExpertLoRAWeights:
    """One step's LoRA update of a layer's routed experts: every slot's per-expert A/B (the scale folded into
    B, ranks zero-padded to R, zero where an adapter does not target an expert) and each token's slot."""

    token_slots: torch.Tensor
    """[T] int32 adapter slot per token of the step, -1 for the base model."""
    a13: torch.Tensor
    """[L, E, 2R, H] per (slot, expert): the gate projection's A rows, then the up projection's."""
    b13: torch.Tensor
    """[L, E, 2, I, R] per (slot, expert): the gate projection's B, then the up projection's."""
    a2: torch.Tensor
    """[L, E, R, I] per (slot, expert): the down projection's A."""
    b2: torch.Tensor
    """[L, E, H, R] per (slot, expert): the down projection's B."""


class ExpertsAdapter(Protocol):
    """A per-token update of a ``FusedMoE``'s experts (``lora.expert_layers.ExpertLoRASlots`` implements it),
    attached as the module's ``adapter``."""

    def step_weights(self) -> Optional[ExpertLoRAWeights]:
        """This step's update; None when it adds nothing (the plain fused path runs)."""


_LORA_CHUNK_ELEMENTS = 1 << 24
"""``_add_lora_rows`` gathers each row's A / B; it takes rows in chunks of at most this many gathered elements."""


def _add_lora_rows(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, slot: torch.Tensor, expert: torch.Tensor,
                   a: torch.Tensor, bs: list[torch.Tensor]) -> None:
    """y[rows, slice s] = dtype(y + dtype(dtype(x[rows] @ A[slot, e].T)[s-th R] @ B_s[slot, e].T)), vectorised
    (batched matmuls over gathered weights, in chunks of rows).

    y: [P, sum out_s]; x: [P, in]; rows, slot, expert: [n] int64; a: [L, E, S * R, in]; bs: S x [L, E, out_s, R].
    """
    rank = bs[0].shape[-1]
    per_row = a.shape[2] * a.shape[3] + sum(b.shape[2] * rank for b in bs)
    step = max(1, _LORA_CHUNK_ELEMENTS // per_row)
    for start in range(0, rows.numel(), step):
        r, sl, ex = rows[start:start + step], slot[start:start + step], expert[start:start + step]
        h = torch.bmm(a[sl, ex], x[r].unsqueeze(2)).squeeze(2)                         # [n, S * R]
        h = h.to(y.dtype)
        deltas = [torch.bmm(b[sl, ex], h[:, s * rank:(s + 1) * rank].unsqueeze(2)).squeeze(2).to(y.dtype)
                  for s, b in enumerate(bs)]                                                # S x [n, out_s]
        y[r] = y[r] + torch.cat(deltas, dim=1)


def fused_moe_lora_ref(hidden: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, lora: ExpertLoRAWeights
                       ) -> torch.Tensor:
    """``fused_moe_ref`` with each token's adapter (slot l = lora.token_slots[t], none when -1) on every
    expert it runs (pure torch, vectorised over the adapted pairs; the twin of
    ``kernels.fused_moe_lora.fused_moe_lora_triton``), dtype = hidden's:

        gate|up = dtype(x @ w13[e].T);   gate += dtype(dtype(x @ A_gate[l, e].T) @ B_gate[l, e].T) (up alike)
        act = dtype(dtype(silu(gate)) * up)
        y = dtype(act @ w2[e].T);        y += dtype(dtype(act @ A_down[l, e].T) @ B_down[l, e].T)
        out[t] = sum_k dtype(y * topk_weights[t, k])

    Args: as ``fused_moe_ref``'s, and ``lora`` (its shapes: ``ExpertLoRAWeights``).
    """
    return _experts_ref(hidden, w13, w2, topk_weights, topk_ids, lora)


def _experts_ref(hidden: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, lora: Optional[ExpertLoRAWeights]) -> torch.Tensor:
    """``fused_moe_ref`` (lora None) and ``fused_moe_lora_ref``."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(hidden)                                           # [T, H]
    if num_tokens == 0:
        return out
    flat_ids = topk_ids.reshape(-1)                                          # [T*K] pair -> expert
    order = torch.argsort(flat_ids, stable=True)                             # pairs sorted by expert
    token_of = order // top_k                                                # [T*K] each sorted pair's token
    pair_weights = topk_weights.reshape(-1)[order].to(torch.float32)         # [T*K]
    counts = torch.bincount(flat_ids, minlength=len(w13)).tolist()       # host: tokens per expert
    x = hidden.index_select(0, token_of)                                     # [T*K, H] grouped by expert
    adapted = None
    if lora is not None:
        slot_of = lora.token_slots.to(torch.int64).index_select(0, token_of)   # [T*K] each sorted pair's slot
        rows = (slot_of >= 0).nonzero().flatten()                             # [n] adapted sorted pairs
        if rows.numel():
            adapted = (rows, slot_of[rows], flat_ids[order][rows].to(torch.int64))
    gate_up = _per_expert_linear(x, w13, counts)                             # [T*K, 2I]
    if adapted is not None:
        _add_lora_rows(gate_up, x, *adapted, lora.a13, [lora.b13[:, :, 0], lora.b13[:, :, 1]])
    intermediate = gate_up.shape[1] // 2
    act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]      # [T*K, I]
    y = _per_expert_linear(act, w2, counts)                                  # [T*K, H]
    if adapted is not None:
        _add_lora_rows(y, act, *adapted, lora.a2, [lora.b2])
    y = (y.to(torch.float32) * pair_weights[:, None]).to(hidden.dtype)
    return out.index_add_(0, token_of, y)


def _per_expert_linear(x: torch.Tensor, w: ExpertWeights, counts: list[int]) -> torch.Tensor:
    """x [P, in] grouped by expert (counts[e] rows each, in order) -> [P, out]: each segment @ W_e.T, with
    ``w`` stacked [E, out, in] or one weight-only quantized weight per expert (its ``linear``)."""
    stacked = isinstance(w, torch.Tensor)
    parts, start = [], 0
    for expert, n in enumerate(counts):
        if n:
            segment = x[start:start + n]
            parts.append(F.linear(segment, w[expert]) if stacked else w[expert].linear(segment).to(x.dtype))
            start += n
    return torch.cat(parts) if len(parts) > 1 else parts[0]          # P > 0 rows: at least one part


# ----------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------
class FusedMoE(nn.Module):
    """The routed experts of one layer, their weights stacked (``w13`` [E, 2I, H], ``w2`` [E, H, I]).

    With tensor parallelism (``tp`` of size n > 1) every expert is split as the dense MLP is: this rank holds
    rows [r * I / n, (r + 1) * I / n) of each expert's gate and up projections and the same columns of its
    down projection, so its output is a partial sum that the caller all-reduces (``SparseMoeBlock``)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, tp: Optional[TensorParallelGroup] = None) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        tp = tp or TensorParallelGroup.single()
        if intermediate_size % tp.size:
            raise ValueError(f"the experts' intermediate size {intermediate_size} is not divisible by "
                             f"--tensor-parallel-size {tp.size}; use a size that divides it.")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.full_intermediate_size = intermediate_size
        """I of the checkpoint."""
        self.intermediate_range: Optional[tuple[int, int]] = (
            even_part(intermediate_size, tp.rank, tp.size) if tp.size > 1 else None)
        """Tensor parallelism: the (start, stop) intermediate rows of every expert this rank holds; None: all."""
        intermediate_size //= tp.size
        self.intermediate_size = intermediate_size
        """I on this rank (each expert's gate/up rows, down columns)."""
        self.renormalize = renormalize
        meta = "meta" if weights_deferred() else None   # a quantized checkpoint's: filled by finish_quantized
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, device=meta),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, device=meta),
                               requires_grad=False)
        self.adapter: Optional[ExpertsAdapter] = None
        """A per-token update of the experts (LoRA slots), attached by the adapter manager; None: none."""
        self.fp8: Optional[Fp8Experts] = None
        """CUDA, FP8 experts (``engine.layers.fp8_experts``): their scales (``w13`` / ``w2`` then hold its e4m3
        weights); None: float weights (on CPU FP8 experts are dequantized into ``w13`` / ``w2``)."""
        self.quantized_slices: dict[tuple[str, int, int], "Fp8Slice | Int4Slice"] = {}
        """A quantized checkpoint's expert slices as loaded ((param, expert, shard) -> slice), until
        ``finish_quantized``."""
        self.cpu_quantized: Optional[tuple[list, list]] = None
        """CPU, weight-only quantized experts (``quantize_cpu``; a 4-bit checkpoint's): per expert its
        gate|up [2I, H] and its down [H, I] weight (``ExpertWeights``); ``w13`` / ``w2`` are then empty.
        None: float."""

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], router_logits [T, E] -> [T, H]."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        lora = None if self.adapter is None else self.adapter.step_weights()
        w13, w2 = self.cpu_quantized or (self.w13, self.w2)
        if lora is not None:
            return fused_moe_lora(hidden, w13, w2, topk_weights, topk_ids, lora, self.fp8)
        return fused_moe(hidden, w13, w2, topk_weights, topk_ids, self.fp8)

    def load_expert(self, param_name: str, expert: int, shard: int,
                    tensor: "torch.Tensor | Fp8Slice | Int4Slice") -> None:
        """Copy one checkpoint expert tensor (whole: this rank takes its rows): ``w13`` shard 0 (gate) or 1 (up)
        [I, H], or ``w2`` [H, I]; an FP8 checkpoint's ``Fp8Slice``, and on CPU a 4-bit checkpoint's
        ``Int4Slice``, are kept for ``finish_quantized``; on CUDA an ``Int4Slice`` is copied dequantized (no
        4-bit expert kernel)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the config has {self.num_experts} experts")
        size, full = self.intermediate_size, self.full_intermediate_size
        want = (full, self.hidden_size) if param_name == "w13" else (self.hidden_size, full)
        if tuple(tensor.shape) != want:
            raise ValueError(f"expert {expert} {param_name} tensor has shape {tuple(tensor.shape)}, "
                             f"expected {want}")
        if isinstance(tensor, Int4Slice) and tensor.q.is_cuda:
            tensor = tensor.dequantize()                                 # float32 [out, in]
        if isinstance(tensor, (Fp8Slice, Int4Slice)):
            self.quantized_slices[(param_name, expert, shard)] = tensor
            return
        self.materialize(tensor.device)
        if param_name == "w13":
            dst = self.w13.data[expert, shard * size:(shard + 1) * size]
        else:
            dst = self.w2.data[expert]
        dst.copy_(self._part(tensor, 0 if param_name == "w13" else 1))

    def materialize(self, device: torch.device) -> None:
        """Give deferred (meta) expert weights memory on ``device`` (``deferred_weights``); no-op otherwise."""
        for name in ("w13", "w2"):
            param = getattr(self, name)
            if param.is_meta:
                setattr(self, name, nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                                 requires_grad=False))

    def finish_quantized(self, dtype: torch.dtype, dequantize: bool = False) -> None:
        """Build the experts from the loaded slices (every expert's gate, up and down must be there). FP8: on
        CUDA ``w13`` / ``w2`` hold the e4m3 weights and ``fp8`` their scales; on CPU, or with ``dequantize``
        (``--quantization none``), the dequantized weights in ``dtype``. 4-bit (CPU): ``cpu_quantized`` holds
        each expert's ``W4A16Weight``s, or with ``dequantize`` ``w13`` / ``w2`` the dequantized weights. No-op
        for float experts."""
        if not self.quantized_slices:
            return
        want = {(p, e, s) for e in range(self.num_experts) for p, s in (("w13", 0), ("w13", 1), ("w2", 0))}
        missing = sorted(want - set(self.quantized_slices))
        if missing:
            raise ValueError(f"the quantized checkpoint lacks {len(missing)} expert projections of an MoE "
                             f"layer, e.g. {missing[:3]} ((param, expert, 0 gate / 1 up))")
        q = self.quantized_slices
        gate, up, down = ([q[(p, e, s)] for e in range(self.num_experts)]
                          for p, s in (("w13", 0), ("w13", 1), ("w2", 0)))
        self.quantized_slices = {}
        if isinstance(gate[0], Int4Slice):
            self._set_int4(gate, up, down, dtype, dequantize)
            return
        self._set_fp8(Fp8Experts.from_slices(gate, up, down), dtype, dequantize)

    def _set_int4(self, gate: list[Int4Slice], up: list[Int4Slice], down: list[Int4Slice], dtype: torch.dtype,
                  dequantize: bool) -> None:
        if dequantize:
            w13 = torch.stack([torch.cat([g.dequantize(), u.dequantize()]) for g, u in zip(gate, up)])
            self.w13 = nn.Parameter(w13.to(dtype), requires_grad=False)                 # [E, 2I, H]
            self.w2 = nn.Parameter(torch.stack([d.dequantize() for d in down]).to(dtype), requires_grad=False)
            return
        from engine.layers.w4a16 import W4A16Weight
        self._set_cpu_quantized([W4A16Weight.from_slices([g, u], dtype) for g, u in zip(gate, up)],
                                [W4A16Weight.from_slices([d], dtype) for d in down], dtype)

    def quantize_cpu(self, kind: str) -> None:
        """``--quantization int8|int4|fp16`` or a GGUF file's quantized experts on CPU: each expert's float
        gate|up and down weights as ``engine.layers.quantized`` weights of ``kind``."""
        from engine.layers.quantized import quantize_weight
        self._set_cpu_quantized([quantize_weight(w, kind) for w in self.w13.data],
                                [quantize_weight(w, kind) for w in self.w2.data], self.w13.dtype)

    def _set_cpu_quantized(self, w13: list, w2: list, dtype: torch.dtype) -> None:
        self.cpu_quantized = (w13, w2)
        self.w13 = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def quantize_fp8(self) -> None:
        """``--quantization fp8``: the experts as FP8 with per (expert, output channel) scales (on CPU: the
        dequantized values of those, in the weights' dtype)."""
        self._set_fp8(Fp8Experts.from_float(self.w13.data, self.w2.data), self.w13.dtype, False)

    def _set_fp8(self, experts: Fp8Experts, dtype: torch.dtype, dequantize: bool) -> None:
        if dequantize or not experts.w13.is_cuda:
            w13, w2 = experts.dequantize(dtype)
            self.fp8 = None
        else:
            w13, w2 = experts.w13, experts.w2
            self.fp8 = experts
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)

    def load_stacked(self, param_name: str, tensor: torch.Tensor) -> None:
        """Copy a transformers-5 stacked tensor (whole: this rank takes its rows): ``gate_up_proj`` [E, 2I, H]
        into ``w13``, ``down_proj`` [E, H, I] into ``w2``."""
        E, H, full = self.num_experts, self.hidden_size, self.full_intermediate_size
        want = (E, 2 * full, H) if param_name == "w13" else (E, H, full)
        if tuple(tensor.shape) != want:
            raise ValueError(f"stacked {param_name} tensor has shape {tuple(tensor.shape)}, expected {want}")
        self.materialize(tensor.device)
        if param_name == "w13":
            gate, up = tensor.split(full, dim=1)                                   # [E, I, H] each
            tensor = torch.cat([self._part(gate, 1), self._part(up, 1)], dim=1)   # [E, 2 * I / n, H]
        else:
            tensor = self._part(tensor, 2)                                         # [E, H, I / n]
        getattr(self, param_name).data.copy_(tensor)

    def _part(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's ``intermediate_range`` of ``tensor`` along ``dim`` (all of it unsharded)."""
        if self.intermediate_range is None:
            return tensor
        start, stop = self.intermediate_range
        return tensor.narrow(dim, start, stop - start)


class SharedExpertMLP(nn.Module):
    """A dense SwiGLU expert every token takes (Qwen2-MoE's ``shared_expert``); gate|up packed (column-parallel,
    down row-parallel under tensor parallelism, as ``LlamaMLP``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.gate_up_proj = column_parallel_linear(hidden_size, [intermediate_size] * 2, False, tp,
                                                   feeds=Feeds.SILU_MUL)
        self.down_proj = row_parallel_linear(intermediate_size, hidden_size, False, tp)   # scaled by its gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_mul_linear(self.down_proj, self.gate_up_proj(x))


class SparseMoeBlock(nn.Module):
    """Router (``gate``) + routed experts (``experts``) + optional shared expert, in HF's module names. Under
    tensor parallelism the router (and the shared expert's gate) is replicated, the experts and the shared
    expert are split along their intermediate size, and the routed output is all-reduced."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, shared_expert_intermediate_size: int = 0, hidden_act: str = "silu",
                 tp: Optional[TensorParallelGroup] = None) -> None:
        super().__init__()
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={hidden_act!r} is not supported by the MoE block (only 'silu').")
        self.tp = tp or TensorParallelGroup.single()
        self.gate = Linear(hidden_size, [num_experts], keep_float=True)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, self.tp)
        self.shared_expert: Optional[SharedExpertMLP] = None
        self.shared_expert_gate: Optional[Linear] = None
        if shared_expert_intermediate_size:
            self.shared_expert = SharedExpertMLP(hidden_size, shared_expert_intermediate_size, self.tp)
            self.shared_expert_gate = Linear(hidden_size, [1], keep_float=True)

    @classmethod
    def from_config(cls, config, num_experts: int, intermediate_size: int, renormalize: bool,
                    tp: Optional[TensorParallelGroup] = None) -> "SparseMoeBlock":
        return cls(config.hidden_size, num_experts, config.num_experts_per_tok, intermediate_size,
                   renormalize,
                   int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
                   getattr(config, "hidden_act", "silu"), tp)

    def activation_width(self) -> int:
        """Per-token activation width of this block (``ModelShape.intermediate_size``): the routed experts'
        intermediate rows together plus the shared expert's, or the K gathered [H] rows of the sorted pairs
        (``fused_moe_ref``'s, and a fused kernel's, [T * K, H] buffers), whichever is wider."""
        shared = self.shared_expert.down_proj.input_size if self.shared_expert is not None else 0
        experts = self.experts
        return max(experts.top_k * experts.intermediate_size + shared, experts.top_k * experts.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (normed) -> [T, H], for the next residual add + RMSNorm."""
        out = self.tp.all_reduce(self.experts(hidden, self.gate(hidden)))   # [T, H] (a no-op unsharded)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * shared
        return out
