"""Each format's tensors of one projection -> a canonical slice, and the stream that groups a checkpoint's
tensors by projection.

Canonical forms (what ``engine.layers.w4a16`` / ``engine.layers.fp8`` build their weights from):

- ``Int4Slice``: ``q`` uint8 [out, in] (0..15, inputs in checkpoint order), ``scales`` and ``zeros`` float32
  [out, groups] (zero points in q units), ``group_of_input`` (act order: each input's group; None: input
  k is in group k // group_size). W[n, k] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)].
- ``Fp8Slice``: ``weight`` float8_e4m3fn [out, in], ``scale`` float32 [out] (per channel; a per-tensor scale
  expanded) or [ceil(out / bo), ceil(in / bi)] for ``block`` (bo, bi); W = weight * scale; ``input_scale``
  the static activation scale (None: dynamic).

Packing of the formats read (``scheme.FORMATS``):

- GPTQ: ``qweight`` int32 [in / 8, out], input 8r + i in bits 4i..4i+3 of row r; ``qzeros`` int32
  [groups, out / 8], output 8c + i in bits 4i of column c, stored as is (v2) or as zero - 1 (v1: 0x11111111
  subtracted from each word, so a zero of 0 borrows from the next nibble; ``gptq_v1_to_v2_zeros``);
  ``scales`` [groups, out]; ``g_idx`` int32 [in] (each input's group);
- AWQ (GEMM): ``qweight`` int32 [in, out / 8] and ``qzeros`` int32 [groups, out / 8], output
  8c + AWQ_ORDER[i] in bits 4i of column c; ``scales`` [groups, out];
- compressed-tensors ``pack-quantized``: ``weight_packed`` int32 [out, in / 8], input 8c + i in bits 4i
  of column c, the signed value + 8; ``weight_scale`` [out, groups]; ``weight_zero_point`` [out, groups]
  (signed; packed int32 [out / 8, groups] like the weight when the checkpoint stores it packed);
  ``weight_g_idx`` [in] with group act order;
- FP8 (compressed-tensors ``float-quantized`` and HF ``fp8``): ``weight`` float8_e4m3fn [out, in];
  ``weight_scale`` / ``weight_scale_inv`` (a multiplier in both) [out, 1], [1] or per block;
  ``input_scale`` [1] with static activations.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Optional, Union

import torch

from engine.quantization.scheme import FP8, CheckpointQuantization

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ's GEMM layout: nibble i of a packed int32 holds output column 8c + AWQ_ORDER[i]."""
FLOAT8_DTYPES = (torch.float8_e4m3fn,)
"""Weight dtypes read as FP8."""

QUANTIZED_SUFFIXES = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                           "input_scale"),
    "fp8": ("weight_scale_inv", "weight_scale", "input_scale", "activation_scale"),
}
"""Tensor names (after the projection's prefix) that belong to a quantized projection, per format (an FP8
``weight`` is recognised by its dtype)."""


@dataclass
class Int4Slice:
    """One projection's 4-bit weight (module docstring)."""

    q: torch.Tensor
    """uint8 [out, in], 0..15."""
    scales: torch.Tensor
    """float32 [out, groups]."""
    zeros: torch.Tensor
    """float32 [out, groups], in q units."""
    group_size: int
    """Inputs per group (``in`` for one scale per channel)."""
    group_of_input: Optional[torch.Tensor] = None
    """int64 [in]: each input's group (act order); None: input k is in group k // group_size."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def groups_of_inputs(self) -> torch.Tensor:
        """int64 [in]: each input's group."""
        if self.group_of_input is not None:
            return self.group_of_input
        return torch.arange(self.q.shape[1], device=self.q.device) // self.group_size

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]."""
        g = self.groups_of_inputs()
        return (self.q.float() - self.zeros[:, g]) * self.scales[:, g]


@dataclass
class Fp8Slice:
    """One projection's FP8 weight (module docstring)."""

    weight: torch.Tensor
    """float8_e4m3fn [out, in]."""
    scale: torch.Tensor
    """float32 [out], or [ceil(out / bo), ceil(in / bi)] with ``block``."""
    block: Optional[tuple[int, int]] = None
    """(bo, bi) rows and columns per scale; None: per channel."""
    input_scale: Optional[torch.Tensor] = None
    """float32 scalar: the static activation scale; None: dynamic."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]."""
        w = self.weight.float()
        if self.block is None:
            return w * self.scale[:, None]
        bo, bi = self.block
        s = self.scale.repeat_interleave(bo, 0)[:w.shape[0]].repeat_interleave(bi, 1)[:, :w.shape[1]]
        return w * s


QuantizedSlice = Union[Int4Slice, Fp8Slice]


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] packed along rows (row 8r + i in bits 4i of row r) -> uint8 [8R, C]."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)          # [8]
    q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF                            # [R, 8, C]
    return q.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_columns(packed: torch.Tensor, order: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """int32 [R, C] packed along columns (column 8c + order[i] in bits 4i of column c) -> uint8 [R, 8C]."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)          # [8]
    q = (packed[:, :, None] >> shifts[None, None, :]) & 0xF                            # [R, C, 8]
    if order is not None:
        inverse = [0] * 8
        for i, column in enumerate(order):
            inverse[column] = i
        q = q[:, :, inverse]
    return q.reshape(packed.shape[0], -1).to(torch.uint8)


GPTQ_V1_ZERO_OFFSETS = 0x11111111
"""One in every nibble: what a GPTQ v1 checkpoint subtracted from each packed ``qzeros`` word (zero - 1)."""


def gptq_v1_to_v2_zeros(qzeros: torch.Tensor) -> torch.Tensor:
    """GPTQ v1 ``qzeros`` (each 4-bit zero point stored as zero - 1) -> the zero points as they are (v2).

    The v1 writers (GPTQModel's ``convert_gptq_v2_to_v1_format_module``) subtract 0x11111111 from each
    packed int32 word, so a zero point of 0 borrows from the nibble above it; adding the word back (as
    GPTQModel's v1 -> v2 load does) undoes that exactly, where adding 1 to each unpacked nibble would read
    that zero as 16 and its neighbour one too low."""
    words = (qzeros.to(torch.int64) & 0xFFFFFFFF) + GPTQ_V1_ZERO_OFFSETS
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _scale_per_channel_or_block(scale: torch.Tensor, out_features: int, in_features: int,
                                block: Optional[tuple[int, int]], name: str
                                ) -> tuple[torch.Tensor, Optional[tuple[int, int]]]:
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1).expand(out_features).contiguous(), None
    if scale.numel() == out_features and (scale.dim() == 1 or scale.shape[-1] == 1):
        return scale.reshape(out_features).contiguous(), None
    if block is not None:
        expect = (-(-out_features // block[0]), -(-in_features // block[1]))
        if tuple(scale.shape) == expect:
            return scale.contiguous(), block
    raise ValueError(f"{name} has shape {tuple(scale.shape)}: not one scale, one per output channel "
                     f"({out_features}) or one per {block} block of a [{out_features}, {in_features}] weight.")


def to_slice(prefix: str, tensors: dict[str, torch.Tensor], scheme: CheckpointQuantization) -> QuantizedSlice:
    """The canonical slice of projection ``prefix`` from its tensors (suffix -> tensor); ValueError naming the
    projection for a missing or misshapen tensor."""
    def need(suffix: str) -> torch.Tensor:
        if suffix not in tensors:
            raise ValueError(f"{prefix}: the {scheme.format} checkpoint lacks {prefix}.{suffix} "
                             f"(has {sorted(tensors)}).")
        return tensors[suffix]

    if scheme.kind == FP8:
        weight = need("weight")
        scale_name = "weight_scale_inv" if "weight_scale_inv" in tensors else "weight_scale"
        out_features, in_features = weight.shape
        scale, block = _scale_per_channel_or_block(need(scale_name), out_features, in_features,
                                                   scheme.weight_block, f"{prefix}.{scale_name}")
        input_scale = None
        if scheme.activation_scheme == "static":
            input_scale = need("activation_scale" if "activation_scale" in tensors else "input_scale"
                               ).float().reshape(-1).max()
        return Fp8Slice(weight.contiguous(), scale, block, input_scale)
    if scheme.format == "gptq":
        q = unpack_rows(need("qweight")).t().contiguous()                                # [out, in]
        qzeros = need("qzeros")
        if not scheme.gptq_v2:
            qzeros = gptq_v1_to_v2_zeros(qzeros)
        zeros = unpack_columns(qzeros).t().float()                                        # [out, groups]
        scales = need("scales").float().t().contiguous()
        g_idx = tensors.get("g_idx")
        group_of_input = g_idx.long() if scheme.act_order and g_idx is not None else None
    elif scheme.format == "awq":
        q = unpack_columns(need("qweight"), AWQ_ORDER).t().contiguous()                 # [out, in]
        scales = need("scales").float().t().contiguous()
        zeros = (unpack_columns(need("qzeros"), AWQ_ORDER).t().float() if "qzeros" in tensors
                 else torch.full_like(scales, 8.0))
        group_of_input = None
    else:   # compressed-tensors pack-quantized
        packed = need("weight_packed")
        q = unpack_columns(packed)                                                       # [out, in (padded)]
        if "weight_shape" in tensors:
            out_features, in_features = (int(v) for v in tensors["weight_shape"].reshape(-1).tolist())
            q = q[:out_features, :in_features].contiguous()
        scales = need("weight_scale").float()
        if scales.dim() == 1:
            scales = scales[:, None]
        zp = tensors.get("weight_zero_point")
        if zp is None or scheme.symmetric:
            zeros = torch.full_like(scales, 8.0)
        else:
            if zp.dtype == torch.int32 and zp.shape[0] * 8 >= q.shape[0] and zp.shape[0] != q.shape[0]:
                zp = unpack_rows(zp)[:q.shape[0]].to(torch.int16) - 8                   # packed signed values
            zeros = zp.float().reshape(scales.shape) + 8.0
        g_idx = tensors.get("weight_g_idx")
        group_of_input = g_idx.long() if scheme.act_order and g_idx is not None else None
    out_features, in_features = q.shape
    num_groups = scales.shape[1]
    if scales.shape[0] != out_features or zeros.shape != scales.shape or in_features % num_groups:
        raise ValueError(f"{prefix}: scales {tuple(scales.shape)} / zero points {tuple(zeros.shape)} do not fit a "
                         f"[{out_features}, {in_features}] weight.")
    if group_of_input is not None and (group_of_input.shape != (in_features,)
                                       or int(group_of_input.max()) >= num_groups):
        raise ValueError(f"{prefix}: g_idx of shape {tuple(group_of_input.shape)} does not fit {in_features} inputs "
                         f"in {num_groups} groups.")
    return Int4Slice(q, scales, zeros, in_features // num_groups, group_of_input)


class QuantizedTensorStream:
    """Wraps a checkpoint's ``(name, tensor)`` stream: float tensors pass through; the tensors of quantized
    projections are held and, once the stream ends, yielded as ``(f"{prefix}.weight", slice)``."""

    def __init__(self, scheme: CheckpointQuantization) -> None:
        self.scheme = scheme
        """The checkpoint's quantization."""
        self._suffixes = QUANTIZED_SUFFIXES[scheme.format]

    def belongs(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether ``name`` is a tensor of a quantized projection."""
        prefix, _, suffix = name.rpartition(".")
        if suffix == "weight":
            return tensor.dtype in FLOAT8_DTYPES
        return suffix in self._suffixes and self.scheme.quantizes(prefix)

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, Union[torch.Tensor, QuantizedSlice]]]:
        held: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            if self.belongs(name, tensor):
                prefix, _, suffix = name.rpartition(".")
                held.setdefault(prefix, {})[suffix] = tensor
            else:
                yield name, tensor
        for prefix, tensors in held.items():
            yield f"{prefix}.weight", to_slice(prefix, tensors, self.scheme)
