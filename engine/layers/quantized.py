"""Weight-only int8 quantization for CPU decode: the weights stay int8 in memory (a quarter of float32's
bytes, which is what a batch-1 decode step reads), activations stay float.

Per output channel, symmetric: ``q = round(w / s)``, ``s = max|w_row| / 127``. A projection runs as
``x @ (q * s).T`` in one of two ways, by the number of rows of ``x``: up to ``PACKED_MAX_TOKENS`` rows,
torch's ``_weight_int8pack_mm`` (bfloat16 activations, the int8 weight read once: bandwidth-bound decode
steps); above, the weight is dequantized to ``x``'s dtype for one ``F.linear`` (compute-bound prefill,
where the packed kernel is slower than float32 on CPUs without AMX).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_MAX_TOKENS = 32
"""Rows up to which ``int8_linear`` takes the packed int8 kernel (2-core Xeon: 2.3x float32 at 1 row,
2x at 8; at 64 rows even, at 512 half float32's speed; RESULTS.md "CPU")."""


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] (float) -> (q [out, in] int8, scales [out] float32), symmetric per output row."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0                      # [out]
    q = torch.clamp(torch.round(w / scales[:, None]), -127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q [out, in] int8, scales [out]) -> [out, in] in ``dtype``."""
    return (q.to(torch.float32) * scales[:, None]).to(dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, scales_bf16: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out] = x @ (q * scales).T + bias, in x's dtype (see the module docstring)."""
    if x.shape[0] <= PACKED_MAX_TOKENS and x.device.type == "cpu":
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16), q, scales_bf16).to(x.dtype)
        return y if bias is None else y + bias
    return F.linear(x, dequantize_int8(q, scales, x.dtype), bias)


class Int8Embedding(torch.nn.Module):
    """A token embedding kept as int8 rows (a tied embedding that is also the LM head): ``forward(ids)``
    dequantizes the looked-up rows; ``logits(hidden)`` is the head's ``int8_linear``."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.q, self.scales = quantize_int8(weight)
        self.scales_bf16 = self.scales.to(torch.bfloat16)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, hidden] in ``dtype``."""
        return (self.q[ids].to(torch.float32) * self.scales[ids][:, None]).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> [R, vocab]."""
        return int8_linear(hidden, self.q, self.scales, self.scales_bf16)
