"""Linear layers with packed output slices, their fast base paths, and the adapter seam.

``Linear.forward`` picks the base computation by the step (``engine.kernel_policy``): on CUDA,
decode steps of a few tokens run one ``kernels.gemv`` launch (a float weight, or an FP8 one read as
e4m3 with its scales); a projection that feeds a residual add + RMSNorm may return split-K partials
the norm sums (decode-sized bf16 steps, where the GEMM alone would leave SMs idle); everything else
is one ``F.linear`` (a quantized weight's own ``linear``). With an adapter attached
(``engine.layers.adapter``) and active in the step, the adapter runs the projection and adds
its update, or leaves it to the consumer the layer ``feeds``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.forward_context import current_policy
from engine.kernel_policy import KernelPolicy
from engine.layers.adapter import Feeds, LinearAdapter, defer_update
from engine.layers.fp8 import Fp8Weight
from engine.quantization.slices import Fp8Slice, Int4Slice, QuantizedSlice


_DEFERRED = threading.local()


@contextlib.contextmanager
def deferred_weights() -> Iterator[None]:
    """Linear layers built inside take a weight on the meta device (no memory): a quantized checkpoint's
    projections never hold float weights, so loading needs only the quantized model's memory. A float
    tensor loaded into such a weight (an unquantized projection) gets memory then (``load_slice``,
    ``materialize``)."""
    _DEFERRED.active = True
    try:
        yield
    finally:
        _DEFERRED.active = False


def weights_deferred() -> bool:
    """Whether modules built now take their weights on the meta device (inside ``deferred_weights``)."""
    return getattr(_DEFERRED, "active", False)


class Linear(nn.Module):
    """``y = x @ W.T + b`` whose output is the concatenation of ``output_sizes`` slices.

    A packed projection (q/k/v, or gate/up) is one matmul; checkpoints store the slices
    separately, so ``load_slice`` copies each into its rows.

    Args:
        input_size: input features.
        output_sizes: the packed output slices (e.g. [q, kv, kv]).
        bias: with a bias.
        feeds: what reads the output (``Feeds``): the consumer an adapter update may be fused into.
        keep_float: ``--quantization fp8`` leaves it float (an MoE router: its logits pick the experts, and
            vLLM keeps routers unquantized too).
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 feeds: Feeds = Feeds.ANY, keep_float: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.feeds = feeds
        self.keep_float = keep_float
        """``--quantization fp8`` leaves this projection float."""
        weight = torch.empty(self.output_size, input_size, device="meta" if weights_deferred() else None)  # [out, in]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.output_size), requires_grad=False) if bias else None
        self.adapter: Optional[LinearAdapter] = None
        """The per-token update attached to this layer (``lora.layers.LinearLoRASlots``), or None."""
        self.weight_q = None
        """The weight kept quantized (``quantize``: ``engine.layers.quantized.Int8Weight`` / ``Int4Weight`` /
        ``Fp16Weight``; a quantized checkpoint's ``engine.layers.w4a16.W4A16Weight`` /
        ``engine.layers.fp8.Fp8Weight``; ``--quantization fp8``'s ``Fp8Weight``): anything with
        ``linear(x, bias)``. ``weight`` is then None."""
        self.quantized_slices: dict[int, QuantizedSlice] = {}
        """A quantized checkpoint's slices as loaded (slice index -> slice), until ``finish_quantized``."""

    def quantize(self, kind: str) -> None:
        """Keep the weight as weight-only ``kind`` ("int8" or "int4", ``engine.layers.quantized``); frees
        the float one."""
        from engine.layers.quantized import quantize_weight
        self.weight_q = quantize_weight(self.weight, kind)
        self.weight = None

    def slice_offsets(self) -> list[int]:
        offs, acc = [], 0
        for s in self.output_sizes:
            offs.append(acc)
            acc += s
        return offs

    def finish_quantized(self, dtype: torch.dtype) -> None:
        """Build ``weight_q`` from the loaded quantized slices (every slice must be there) and free the float
        weight; no-op for a float projection."""
        if not self.quantized_slices:
            return
        missing = sorted(set(range(len(self.output_sizes))) - set(self.quantized_slices))
        if missing:
            raise ValueError(f"quantized projection lacks slice(s) {missing} of {len(self.output_sizes)}")
        slices = [self.quantized_slices[i] for i in range(len(self.output_sizes))]
        if all(isinstance(s, Int4Slice) for s in slices):
            from engine.layers.w4a16 import W4A16Weight
            self.weight_q = W4A16Weight.from_slices(slices, dtype)
        elif all(isinstance(s, Fp8Slice) for s in slices):
            from engine.layers.fp8 import Fp8Weight
            self.weight_q = Fp8Weight.from_slices(slices, dtype)
        else:
            raise ValueError("a projection mixes quantization formats across its slices")
        self.quantized_slices = {}
        self.weight = None

    def quantize_fp8(self) -> None:
        """``--quantization fp8``: keep the weight as FP8 with per-channel scales; frees the float one."""
        from engine.layers.fp8 import Fp8Weight
        self.weight_q = Fp8Weight.from_float(self.weight, self.weight.dtype)
        self.weight = None

    def materialize(self, device: torch.device) -> None:
        """Give a deferred (meta) weight memory on ``device`` (``deferred_weights``); no-op otherwise."""
        if self.weight is not None and self.weight.is_meta:
            self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=self.weight.dtype, device=device),
                                       requires_grad=False)

    def load_slice(self, param_name: str, slice_idx: int, tensor: "torch.Tensor | QuantizedSlice") -> None:
        """Copy one checkpoint tensor (``weight`` or ``bias``) into slice ``slice_idx``; a quantized
        checkpoint's weight slice (``engine.quantization.slices``) is kept for ``finish_quantized``."""
        if isinstance(tensor, (Int4Slice, Fp8Slice)):
            if param_name != "weight" or tuple(tensor.shape) != (self.output_sizes[slice_idx], self.input_size):
                raise ValueError(f"quantized {param_name} of shape {tuple(tensor.shape)} does not fit slice "
                                 f"{slice_idx} ({self.output_sizes[slice_idx]} x {self.input_size})")
            self.quantized_slices[slice_idx] = tensor
            return
        if param_name == "weight":
            self.materialize(tensor.device)
        param = getattr(self, param_name)
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} for a projection built without one")
        start = self.slice_offsets()[slice_idx]
        size = self.output_sizes[slice_idx]
        if tensor.shape[0] != size or tensor.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape {tuple(tensor.shape)} does not fit slice {slice_idx} "
                             f"({size} rows of {tuple(param.shape[1:])})")
        param.data[start:start + size].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, input_size] -> [num_tokens, output_size] (or, for ``Feeds.ADD_RMS_NORM``,
        possibly split-K partials [num_parts, num_tokens, output_size], see ``forward_base``)."""
        adapter = self.adapter
        if adapter is None or adapter.adds_nothing():
            return self.forward_base(x)
        num_tokens = x.numel() // max(1, x.shape[-1])
        defer = self.feeds is not Feeds.ANY and adapter.defers(num_tokens, self.feeds)
        y, pending = adapter.run(self, x, defer)
        if pending is not None:
            defer_update(pending)           # the consumer ``feeds`` names completes it
        return y

    def forward_base(self, x: torch.Tensor) -> torch.Tensor:
        """The projection without adapter update: one ``kernels.gemv`` launch for a decode step of a
        few tokens (``uses_decode_gemv``), split-K partials for a layer feeding the add + RMSNorm
        (``split_k_parts``), else ``F.linear``."""
        policy = current_policy()
        if self.uses_decode_gemv(x, policy):
            from kernels.gemv import gemv
            weight, scale, block = self.decode_gemv_weight()
            return gemv(x, weight, self.bias, weight_scale=scale, scale_block=block, override=policy.gemv)
        if self.weight_q is not None:
            return self.weight_q.linear(x, self.bias)
        if self.feeds is Feeds.ADD_RMS_NORM:
            parts = self.split_k_parts(x, policy)
            if parts > 1:
                return self.forward_split_k(x, parts)
        return F.linear(x, self.weight, self.bias)  # [num_tokens, output_size]

    def uses_decode_gemv(self, x: torch.Tensor, policy: KernelPolicy) -> bool:
        """Whether this layer of x runs as ``kernels.gemv`` (CUDA, at most
        ``policy.decode_gemv_max_tokens`` rows, row-contiguous, no adapter update in the step; a float
        weight in x's dtype, or an FP8 one the GEMV takes, ``Fp8Weight.decode_gemv``, under
        ``policy.fp8_decode_gemv``)."""
        if not (x.is_cuda and 0 < x.shape[0] <= policy.decode_gemv_max_tokens
                and x.dim() == 2 and x.stride(-1) == 1 and (self.adapter is None or self.adapter.adds_nothing())):
            return False
        if self.weight is not None:
            return x.dtype == self.weight.dtype
        return (policy.fp8_decode_gemv and isinstance(self.weight_q, Fp8Weight) and self.weight_q.decode_gemv
                and (self.bias is None or self.bias.dtype == x.dtype))

    def decode_gemv_weight(self) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[tuple[int, int]]]:
        """What ``kernels.gemv`` reads for this layer (where ``uses_decode_gemv``): (weight [out, in],
        FP8 scales or None, FP8 scale block (rows, inputs) or None: per channel)."""
        if self.weight is not None:
            return self.weight, None, None
        return self.weight_q.weight, self.weight_q.scale, self.weight_q.block

    def split_k_parts(self, x: torch.Tensor, policy: KernelPolicy) -> int:
        """Partial products to run this layer of x as (1: a plain GEMM). Only on CUDA, in bfloat16
        (float32's range, so an unrounded half cannot overflow where the sum does not), without bias
        or adapter update; then by shape (``KernelPolicy.split_k_parts``). The caller guarantees a
        consumer that sums partials (``Feeds.ADD_RMS_NORM``)."""
        if not (x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16 and self.weight is not None
                and self.weight.dtype == x.dtype
                and x.is_contiguous() and self.bias is None
                and (self.adapter is None or self.adapter.adds_nothing())):
            return 1
        return policy.split_k_parts(x.shape[0], self.input_size, self.output_size)

    def forward_split_k(self, x: torch.Tensor, num_parts: int) -> torch.Tensor:
        """The product without bias or adapter as ``num_parts`` partial products over equal slices
        of the input features: x [num_tokens, input_size] -> [num_parts, num_tokens, output_size],
        whose sum over dim 0 is ``x @ W.T``. One batched GEMM on strided views of x and W (no
        copies); the consumer sums the partials (``kernels.layer_ops.add_rms_norm``). Policy:
        ``split_k_parts``."""
        num_tokens, k = x.shape
        part_k = k // num_parts
        xs = x.view(num_tokens, num_parts, part_k).transpose(0, 1)                # [P, T, K/P]
        ws = self.weight.view(self.output_size, num_parts, part_k).permute(1, 2, 0)  # [P, K/P, N]
        return torch.bmm(xs, ws)                                                   # [P, T, N]
