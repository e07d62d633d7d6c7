"""FP8 (e4m3) routed-expert weights of a ``FusedMoE`` (``engine.layers.moe``): from FP8 checkpoints (HF block-wise
``fp8`` as the FP8 releases of Qwen3-MoE ship, compressed-tensors ``float-quantized``: each expert's gate, up and
down projection an ``engine.quantization.slices.Fp8Slice``) or quantized at load (``--quantization fp8``: per
output channel, amax / 448, as ``engine.layers.fp8.Fp8Weight.from_float``).

    w13 [E, 2I, H] float8_e4m3fn, w13_scale float32 [E, 2I] (per channel) or [E, 2I / bn, ceil(H / bk)] (blocks)
    w2  [E, H, I]  float8_e4m3fn, w2_scale  float32 [E, H]                or [E, ceil(H / bn), ceil(I / bk)]
    W[e, n, k] = float(w[e, n, k]) * scale[e, n]   (or scale[e, n // bn, k // bk])

On CUDA the fused MoE kernels read the e4m3 weights (half the bytes of bfloat16) and widen them to the
activations' dtype in registers (W8A16: ``kernels.fused_moe``'s FP8 form); the activations are not quantized,
so a checkpoint's static ``input_scale`` is not used. On CPU the experts hold the dequantized weights in the
model's dtype (the checkpoint's values, for correctness anywhere, as ``Fp8Weight`` does for projections).
Gate and up rows stack into w13, so with block scales each expert's I must be a multiple of the block's rows
(Qwen3-30B-A3B: 768 = 6 x 128).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.quantization.slices import Fp8Slice

FP8_MAX = 448.0
"""Largest e4m3 magnitude."""


@dataclass
class Fp8Experts:
    """A layer's routed experts as FP8 weights and their scales (module docstring)."""

    w13: torch.Tensor
    """float8_e4m3fn [E, 2I, H]: each expert's gate rows, then its up rows."""
    w2: torch.Tensor
    """float8_e4m3fn [E, H, I]: each expert's down projection."""
    w13_scale: torch.Tensor
    """float32 [E, 2I] per channel, or [E, 2I / bn, ceil(H / bk)] per (bn, bk) block."""
    w2_scale: torch.Tensor
    """float32 [E, H] per channel, or [E, ceil(H / bn), ceil(I / bk)] per block."""
    block: Optional[tuple[int, int]]
    """(bn, bk): output rows and input columns per scale; None: one scale per output channel."""

    @classmethod
    def from_float(cls, w13: torch.Tensor, w2: torch.Tensor, block: Optional[tuple[int, int]] = None
                   ) -> "Fp8Experts":
        """``--quantization fp8``: per (expert, output channel) scales amax / 448; with ``block`` (bn, bk) one
        scale per block instead (the layout of block-wise FP8 checkpoints; benchmarks draw such weights)."""
        q13, s13 = quantize_per_channel(w13) if block is None else quantize_per_block(w13, block)
        q2, s2 = quantize_per_channel(w2) if block is None else quantize_per_block(w2, block)
        return cls(q13, q2, s13, s2, block)

    @classmethod
    def from_slices(cls, gate: list[Fp8Slice], up: list[Fp8Slice], down: list[Fp8Slice]) -> "Fp8Experts":
        """Stack a checkpoint's per-expert slices (expert order); ValueError for slices that cannot stack (mixed
        per-channel and block scales, or gate / up rows that do not fill whole scale blocks)."""
        block = gate[0].block
        if any(s.block != block for s in (*gate, *up, *down)):
            raise ValueError("an MoE layer's FP8 expert weights mix per-channel and per-block scales "
                             f"({sorted({str(s.block) for s in (*gate, *up, *down)})}).")
        inter = gate[0].shape[0]
        if block is not None and inter % block[0]:
            raise ValueError(f"FP8 expert gate / up projections of {inter} rows do not fill whole "
                             f"{block[0]}-row scale blocks, so they cannot be stacked into one gate|up weight; "
                             "serve the float checkpoint with --quantization fp8 instead.")
        w13 = torch.stack([torch.cat([g.weight, u.weight]) for g, u in zip(gate, up)])        # [E, 2I, H]
        s13 = torch.stack([torch.cat([g.scale, u.scale]) for g, u in zip(gate, up)])          # [E, 2I(/bn), ...]
        w2 = torch.stack([d.weight for d in down])                                            # [E, H, I]
        s2 = torch.stack([d.scale for d in down])
        return cls(w13.contiguous(), w2.contiguous(), s13.float().contiguous(), s2.float().contiguous(), block)

    def dequantize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) in ``dtype``: the float weights these FP8 ones represent."""
        from kernels.fused_moe import dequantize_fp8_experts

        return (dequantize_fp8_experts(self.w13, self.w13_scale, self.block, dtype),
                dequantize_fp8_experts(self.w2, self.w2_scale, self.block, dtype))

    def kernel_scales(self) -> dict:
        """The fused MoE kernels' FP8 keywords (``kernels.fused_moe.fused_moe_triton``)."""
        return dict(w13_scale=self.w13_scale, w2_scale=self.w2_scale, scale_block=self.block)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] float -> (float8_e4m3fn [E, N, K], float32 scales [E, N] = amax over K / 448)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=2) / FP8_MAX).clamp(min=1e-12)                                 # [E, N]
    q = (wf / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_per_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] float -> (float8_e4m3fn [E, N, K], float32 scales [E, ceil(N / bn), ceil(K / bk)] = each
    block's amax / 448)."""
    bn, bk = block
    e, n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    scale = padded.view(e, nb, bn, kb, bk).abs().amax(dim=(2, 4)).div(FP8_MAX).clamp(min=1e-12)   # [E, nb, kb]
    full = scale.repeat_interleave(bn, dim=1)[:, :n].repeat_interleave(bk, dim=2)[:, :, :k]
    q = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale
