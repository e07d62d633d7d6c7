"""An int4 weight-only GEMM on CPUs with AMX: ``csrc/int4_amx_gemm.c`` through ctypes.

Semantics (the C file's header has the layout): ``out = bf16(x) @ W.T`` in float32, with
``W[n, k] = bf16(q[n, k] * scale[n, k // 32] + low[n, k // 32])`` (float32 math, the multiply-add possibly
fused); the torch twin is ``kernels.reference.int4_gemm_ref``.

Why: a decode step of 5-19 rows is bound by reading the weights. oneDNN's bfloat16 GEMM reads two bytes per
weight; this kernel reads the int4 values and their group's scale and low value (0.75 bytes per weight) and
dequantizes each 16 x 32 tile in registers for one AMX tile multiply, with float32 outputs (RESULTS.md "CPU").
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from kernels import cpu_native
from kernels.utils import check_tensor

GROUP_SIZE = 32
"""Inputs per scale and low value (one AMX tile's depth: GGUF's Q4 block)."""
GROUP_BLOCKS = 4
"""Column blocks of 16 per work item: its C tiles (the C file's GROUP_BLOCKS)."""
RECORD_BYTES = 384
"""Bytes per (16 columns, 32 inputs) record: 256 of nibbles, 64 of scales, 64 of low values."""

_CPU = torch.device("cpu")
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


def supports(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the kernel takes a weight of this shape and int4 group size (else the caller's other paths)."""
    return out_features % 16 == 0 and in_features % GROUP_SIZE == 0 and group_size == GROUP_SIZE


class CpuInt4Gemm:
    """The loaded kernel (``load``): ``pack`` a weight once, then call it on activations."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.chorus_int4_amx_gemm
        self._fn.argtypes = [_P, _I64, _P, _P, _I64, _I64, _I64, _I32]
        self._fn.restype = None

    @classmethod
    def load(cls, build_dir: Path) -> Optional["CpuInt4Gemm"]:
        """Build (once per host, into ``build_dir``) and load the kernel; None where it cannot be built or the
        CPU (or the OS) grants no AMX tiles."""
        lib = cpu_native.load("int4_amx_gemm", build_dir)
        if lib is None or lib.chorus_int4_amx_init() != 0:
            return None
        return cls(lib)

    @staticmethod
    def pack(q: torch.Tensor, scales: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        """q: [N, K] uint8 (values 0..15); scales, low: [N, K / 32] float32 -> the kernel's records, a flat
        uint8 tensor (the C file's layout). N % 16 == 0, K % 32 == 0."""
        n, k = q.shape
        if not supports(n, k, GROUP_SIZE):
            raise ValueError(f"int4 AMX GEMM: weight [{n}, {k}] needs N % 16 == 0 and K % {GROUP_SIZE} == 0.")
        check_tensor("q", q, dtypes=(torch.uint8,), device=_CPU)
        blocks, depth = n // 16, k // GROUP_SIZE
        for name, t in (("scales", scales), ("low", low)):
            check_tensor(name, t, dtypes=(torch.float32,), shape=(n, depth), device=_CPU)
        # element e of tile row r: column e // 2, input 2 r + e % 2 (VNNI)
        e = q.view(blocks, 16, depth, 16, 2).permute(0, 2, 3, 1, 4).reshape(blocks, depth, 8, 2, 32)
        nibbles = (e[:, :, :, 0] | (e[:, :, :, 1] << 4)).reshape(blocks, depth, 256)
        per_tile = lambda t: t.reshape(blocks, 16, depth).transpose(1, 2)                 # [blocks, depth, 16]
        sl = torch.cat([per_tile(scales), per_tile(low)], dim=2).contiguous().view(torch.uint8)
        records = torch.cat([nibbles, sl], dim=2)                                       # [blocks, depth, 384]
        groups = [records[b:b + GROUP_BLOCKS].transpose(0, 1).reshape(-1) for b in range(0, blocks, GROUP_BLOCKS)]
        return torch.cat(groups).contiguous()

    def __call__(self, x: torch.Tensor, records: torch.Tensor, out_features: int,
                 num_threads: Optional[int] = None) -> torch.Tensor:
        """x: [M, K] float32 (rows may be strided) -> out [M, out_features] float32, a new tensor."""
        check_tensor("x", x, ndim=2, dtypes=(torch.float32,), device=_CPU, last_dim_contiguous=True)
        m, k = x.shape
        if records.dtype != torch.uint8 or records.numel() != out_features * k // GROUP_SIZE * RECORD_BYTES // 16 \
                or not supports(out_features, k, GROUP_SIZE):
            raise ValueError(f"records: {records.numel()} bytes do not pack a [{out_features}, {k}] weight "
                             f"(CpuInt4Gemm.pack).")
        out = torch.empty(m, out_features)
        if m:
            self._fn(x.data_ptr(), x.stride(0), records.data_ptr(), out.data_ptr(), m, out_features, k,
                     num_threads or torch.get_num_threads())
        return out
