"""FP8 (e4m3) weights: ``Fp8Weight``, from compressed-tensors / HF ``fp8`` checkpoints
(``engine.quantization.slices.Fp8Slice``) or quantized at load (``--quantization fp8``: per output channel,
amax / 448, as llmcompressor's FP8_DYNAMIC).

- CUDA, decode steps of at most ``KernelPolicy.decode_gemv_max_tokens`` rows without an adapter update
  (``Linear.uses_decode_gemv``), on scale blocks it takes (``decode_gemv_applies``): ``kernels.gemv``'s
  decode GEMV reads the e4m3 weight and its scales, rounds the rows to e4m3 per token in the kernel for an
  e4m3 x e4m3 MMA (W8A8 as the GEMM below, without its quantization launch; ``KernelPolicy.gemv`` fp8_math
  picks the other maths: the weight widened to bfloat16 or float16 against unquantized rows), with the
  RMSNorm / SiLU-and-mul before it fused in as for bf16 layers (``engine.layers.fused``);
- CUDA, other steps: ``kernels.fp8_linear``'s W8A8 GEMM (``fp8_linear``): the activations quantized per
  token, per token and 128 inputs for block weights, or by the checkpoint's static scale; steps of up to
  ``FP8_TRITON_MAX_TOKENS`` rows run the Triton GEMM (on the H200 it beats ``torch._scaled_mm`` there:
  RESULTS.md "Quantized weights"), larger ones ``fp8_linear``'s pick;
- CPU: the dequantized weight (float copy) through ``F.linear``: the checkpoint's values, for correctness
  anywhere, not for speed.

A packed projection's slices stack along the outputs: per-channel scales stack; block scales need every
slice's rows to be a multiple of the block; static activation scales take the largest of the slices'.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from engine.quantization.slices import Fp8Slice

FP8_TRITON_MAX_TOKENS = 16
"""Rows up to which CUDA runs the Triton W8A8 GEMM whatever the scales (decode steps)."""
FP8_MAX = 448.0
"""Largest e4m3 magnitude."""


def decode_gemv_applies(out_features: int, in_features: int, block: Optional[tuple[int, int]]) -> bool:
    """Whether a decode step reads an [out, in] FP8 weight through ``kernels.gemv`` rather than the W8A8 GEMM:
    scale blocks the GEMV takes (any shape of weight).

    Measured on an H200 at one row (``benchmarks/sweeps/fp8_sweep.py --maths``, Llama-3-8B shapes, us per call,
    per-channel scales): the GEMV's default maths (``kernels.gemv`` E4M3_DOT: the rows rounded to e4m3 per
    token inside the kernel, e4m3 x e4m3 wgmma) o 10.9, down 27.5, qkv 11.0, gate_up 31.6 against the W8A8
    GEMM with its activation quantization 12.8 / 37.3 / 15.0 / 33.8 (at two rows 10.7 / 28.7 / 11.4 / 32.4
    against 13.7 / 37.8 / 15.1 / 33.9); the GEMV also fuses the RMSNorm / SiLU-and-mul before it."""
    from kernels.gemv import fp8_scale_block_supported

    return fp8_scale_block_supported(block)


class Fp8Weight:
    """A [out, in] FP8 weight with per-channel or per-block scales (module docstring)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]],
                 input_scale: Optional[torch.Tensor], dtype: torch.dtype) -> None:
        self.weight = weight
        """float8_e4m3fn [out, in]."""
        self.scale = scale.float().contiguous()
        """float32 [out] or [ceil(out / bo), ceil(in / bi)]."""
        self.block = (int(block[0]), int(block[1])) if block is not None else None
        """(bo, bi) per scale; None: per channel."""
        self.input_scale = input_scale.float().reshape(1) if input_scale is not None else None
        """Static activation scale (float32 [1]); None: dynamic."""
        self.cuda = weight.is_cuda
        self.decode_gemv = False
        """Whether decode steps read this weight through ``kernels.gemv`` (CUDA, ``decode_gemv_applies``)."""
        if self.cuda:
            from kernels.fp8_linear import scaled_mm_works
            scaled_mm_works(weight.device)   # probed now, before CUDA graph capture
            self.decode_gemv = decode_gemv_applies(weight.shape[0], weight.shape[1], self.block)
        self.float_weight: Optional[torch.Tensor] = None
        """CPU: the dequantized weight [out, in] in the model's dtype."""
        if not self.cuda:
            self.float_weight = Fp8Slice(weight, self.scale, block).dequantize().to(dtype)
            self.weight = None

    @classmethod
    def from_slices(cls, slices: list[Fp8Slice], dtype: torch.dtype) -> "Fp8Weight":
        first = slices[0]
        block = first.block
        if any(s.block != block for s in slices):
            raise ValueError("packed FP8 slices mix per-channel and per-block scales.")
        if block is not None and any(s.shape[0] % block[0] for s in slices[:-1]):
            raise ValueError(f"packed FP8 slices of {[s.shape[0] for s in slices]} rows do not align with "
                             f"{block[0]}-row scale blocks.")
        weight = torch.cat([s.weight for s in slices])
        scale = torch.cat([s.scale for s in slices])
        input_scale = None
        if first.input_scale is not None:
            input_scale = torch.stack([s.input_scale for s in slices]).max()
        return cls(weight, scale, block, input_scale, dtype)

    @classmethod
    def from_float(cls, weight: torch.Tensor, dtype: torch.dtype) -> "Fp8Weight":
        """``--quantization fp8``: per-output-channel scales amax / 448, dynamic per-token activations."""
        w = weight.float()
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)                     # [out]
        q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return cls(q, scale, None, None, dtype)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., in] (a Whisper encoder's [B, S, in]) -> [..., out] = x @ W.T + bias, in x's dtype."""
        if not self.cuda:
            return F.linear(x, self.float_weight.to(x.dtype), bias)
        if x.dim() != 2:
            return self.linear(x.reshape(-1, x.shape[-1]), bias).view(*x.shape[:-1], -1)
        from kernels.fp8_linear import PER_TOKEN, PER_TOKEN_GROUP, STATIC, fp8_linear
        backend = "triton" if x.shape[0] <= FP8_TRITON_MAX_TOKENS else "auto"
        if self.input_scale is not None:
            return fp8_linear(x, self.weight, self.scale, activation_scheme=STATIC, input_scale=self.input_scale,
                              block_size=self.block, bias=bias, backend=backend)
        scheme = PER_TOKEN_GROUP if self.block is not None else PER_TOKEN
        return fp8_linear(x, self.weight, self.scale, activation_scheme=scheme, block_size=self.block, bias=bias,
                          backend=backend)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [out, in]."""
        if self.float_weight is not None:
            return self.float_weight.to(dtype)
        return Fp8Slice(self.weight, self.scale, self.block).dequantize().to(dtype)
