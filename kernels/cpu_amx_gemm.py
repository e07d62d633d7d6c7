"""Weight-only int4 and int8 GEMMs on CPUs with AMX: ``csrc/amx_gemm.c`` through ctypes.

Semantics (the C file's header has the record layout), float32 sums and outputs:

- ``int4``: ``out = bf16(x) @ W.T`` with ``W[n, k] = bf16(q[n, k] * scale[n, k // 32] + low[n, k // 32])``
  (float32 math, the multiply-add possibly fused); twin ``kernels.reference.int4_gemm_ref``.
- ``int8``: ``out = (bf16(x) @ q.T) * scale[n]`` (int8 values are exact in bfloat16); twin
  ``kernels.reference.int8_gemm_ref``.

Why: a decode step is bound by reading the weights. oneDNN's bfloat16 GEMM reads two bytes per weight (and the
fp16 LM head two); these kernels read the quantized bytes (0.75 per int4 weight with its group's scale and low
value, 1 per int8 weight), dequantize each 16 x 32 tile in registers, multiply it on AMX tiles and return
float32 (benchmarks/RESULTS.md, "What sets the CPU defaults").
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from kernels import cpu_native
from kernels.utils import check_tensor

GROUP_SIZE = 32
"""int4 inputs per scale and low value (one AMX tile's depth: GGUF's Q4 block)."""
GROUP_BLOCKS = 4
"""Column blocks of 16 per work item: its C tiles (the C file's GROUP_BLOCKS)."""
INT4_RECORD_BYTES = 384
"""Bytes per (16 columns, 32 inputs) int4 record: 256 of nibbles, 64 of scales, 64 of low values."""
INT8_RECORD_BYTES = 512
"""Bytes per (16 columns, 32 inputs) int8 record."""

_CPU = torch.device("cpu")
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


def supports(out_features: int, in_features: int) -> bool:
    """Whether the kernels take a weight of this shape (else the caller's other paths)."""
    return out_features % 16 == 0 and in_features % 32 == 0


def _check_shape(n: int, k: int) -> None:
    if not supports(n, k):
        raise ValueError(f"AMX GEMM: weight [{n}, {k}] needs N % 16 == 0 and K % 32 == 0.")


def _vnni(values: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16, K / 32, 16 rows, 32]: each (16 columns, 32 inputs) tile in AMX's B layout (row r: inputs
    2r and 2r + 1 of each column in turn)."""
    n, k = values.shape
    return values.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32)


def _grouped(records: torch.Tensor) -> torch.Tensor:
    """[N / 16, K / 32, record bytes] -> flat, ordered [group of GROUP_BLOCKS blocks][K / 32][block]."""
    blocks = records.shape[0]
    return torch.cat([records[b:b + GROUP_BLOCKS].transpose(0, 1).reshape(-1)
                      for b in range(0, blocks, GROUP_BLOCKS)]).contiguous()


class CpuAmxGemm:
    """The loaded kernels (``load``): pack a weight once (``pack_int4`` / ``pack_int8``), then call ``int4`` /
    ``int8`` on activations."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._int4 = lib.chorus_int4_amx_gemm
        self._int4.argtypes = [_P, _I64, _P, _P, _I64, _I64, _I64, _I32]
        self._int4.restype = None
        self._int8 = lib.chorus_int8_amx_gemm
        self._int8.argtypes = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I32]
        self._int8.restype = None

    @classmethod
    def load(cls, build_dir: Path) -> Optional["CpuAmxGemm"]:
        """Build (once per host, into ``build_dir``) and load the kernels; None where they cannot be built or
        the CPU (or the OS) grants no AMX tiles."""
        lib = cpu_native.load("amx_gemm", build_dir)
        if lib is None or lib.chorus_amx_init() != 0:
            return None
        return cls(lib)

    @staticmethod
    def pack_int4(q: torch.Tensor, scales: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        """q: [N, K] uint8 (values 0..15); scales, low: [N, K / 32] float32 -> the int4 records (flat uint8)."""
        n, k = q.shape
        _check_shape(n, k)
        check_tensor("q", q, dtypes=(torch.uint8,), device=_CPU)
        blocks, depth = n // 16, k // GROUP_SIZE
        for name, t in (("scales", scales), ("low", low)):
            check_tensor(name, t, dtypes=(torch.float32,), shape=(n, depth), device=_CPU)
        pairs = _vnni(q).view(blocks, depth, 8, 2, 32)                         # row pairs (2p, 2p + 1)
        nibbles = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(blocks, depth, 256)
        per_tile = lambda t: t.reshape(blocks, 16, depth).transpose(1, 2)                 # [blocks, depth, 16]
        sl = torch.cat([per_tile(scales), per_tile(low)], dim=2).contiguous().view(torch.uint8)
        return _grouped(torch.cat([nibbles, sl], dim=2))

    @staticmethod
    def pack_int8(q: torch.Tensor) -> torch.Tensor:
        """q: [N, K] int8 -> the int8 records (flat uint8)."""
        n, k = q.shape
        _check_shape(n, k)
        check_tensor("q", q, dtypes=(torch.int8,), device=_CPU)
        return _grouped(_vnni(q).reshape(n // 16, k // 32, INT8_RECORD_BYTES).view(torch.uint8))

    def int4(self, x: torch.Tensor, records: torch.Tensor, out_features: int,
             num_threads: Optional[int] = None) -> torch.Tensor:
        """x: [M, K] float32 (rows may be strided), ``pack_int4``'s records -> out [M, out_features] float32."""
        out = self._output(x, records, out_features, INT4_RECORD_BYTES)
        if out.numel():
            self._int4(x.data_ptr(), x.stride(0), records.data_ptr(), out.data_ptr(), x.shape[0], out_features,
                       x.shape[1], num_threads or torch.get_num_threads())
        return out

    def int8(self, x: torch.Tensor, records: torch.Tensor, scales: torch.Tensor,
             num_threads: Optional[int] = None) -> torch.Tensor:
        """x: [M, K] float32 (rows may be strided), ``pack_int8``'s records, scales [N] float32 -> out [M, N]
        float32."""
        check_tensor("scales", scales, ndim=1, dtypes=(torch.float32,), device=_CPU, contiguous=True)
        out = self._output(x, records, scales.shape[0], INT8_RECORD_BYTES)
        if out.numel():
            self._int8(x.data_ptr(), x.stride(0), records.data_ptr(), scales.data_ptr(), out.data_ptr(),
                       x.shape[0], scales.shape[0], x.shape[1], num_threads or torch.get_num_threads())
        return out

    @staticmethod
    def _output(x: torch.Tensor, records: torch.Tensor, n: int, record_bytes: int) -> torch.Tensor:
        check_tensor("x", x, ndim=2, dtypes=(torch.float32,), device=_CPU, last_dim_contiguous=True)
        m, k = x.shape
        if records.dtype != torch.uint8 or not supports(n, k) or records.numel() != n * k // 512 * record_bytes:
            raise ValueError(f"records: {records.numel()} bytes do not pack a [{n}, {k}] weight "
                             f"(CpuAmxGemm.pack_int4 / pack_int8).")
        return torch.empty(m, n)
