"""SiLU-and-mul for gated MLPs."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d] = silu(gate) * up."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
