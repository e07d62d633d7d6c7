"""Elementwise layer ops on CPU: ``csrc/layer_ops.c`` through ctypes (semantics in the C file's header).

``add_rms_norm`` (the residual add fused with RMSNorm) and ``silu_mul`` (SiLU-and-mul), each one pass over a
row that reads and writes float32 or bfloat16. Twins: ``kernels.reference.rms_norm_ref`` and
``silu_and_mul_ref``. Why: at decode sizes torch's versions are several small kernels each (with casts around
the bfloat16 projections), and their per-call cost is most of theirs (RESULTS.md "CPU").
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from kernels import cpu_native
from kernels.utils import check_tensor

IO_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes the ops read and write (their math is float32)."""

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class CpuLayerOps:
    """The loaded ops (``load``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = lib.chorus_add_rms_norm
        self._norm.argtypes = [_P, _I32, _I64, _P, _P, _F, _P, _I32, _I64, _I64, _I64, _I32]
        self._norm.restype = None
        self._silu = lib.chorus_silu_mul
        self._silu.argtypes = [_P, _I32, _I64, _P, _I32, _I64, _I64, _I64, _I32]
        self._silu.restype = None

    @classmethod
    def load(cls, build_dir: Path) -> Optional["CpuLayerOps"]:
        """Build (once per host, into ``build_dir``) and load the ops; None where they cannot be built."""
        lib = cpu_native.load("layer_ops", build_dir)
        return cls(lib) if lib is not None else None

    def add_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                     num_threads: Optional[int] = None) -> torch.Tensor:
        """x: [T, N] float32 / bfloat16 (rows may be strided); weight: [N] float32; residual: None or [T, N]
        float32 contiguous, overwritten with x + residual. Returns RMSNorm(x + residual) * weight as a new
        [T, N] tensor of ``out_dtype`` (None: x's)."""
        check_tensor("x", x, ndim=2, dtypes=IO_DTYPES, last_dim_contiguous=True)
        num_tokens, n = x.shape
        check_tensor("weight", weight, dtypes=(torch.float32,), shape=(n,), contiguous=True)
        if residual is not None:
            check_tensor("residual", residual, dtypes=(torch.float32,), shape=(num_tokens, n), contiguous=True)
        out_dtype = out_dtype or x.dtype
        if out_dtype not in IO_DTYPES:
            raise ValueError(f"out_dtype: {out_dtype} not supported; expected one of {IO_DTYPES}.")
        out = torch.empty(num_tokens, n, dtype=out_dtype)
        self._norm(x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0),
                   residual.data_ptr() if residual is not None else None, weight.data_ptr(), float(eps),
                   out.data_ptr(), out_dtype == torch.bfloat16, n, num_tokens, n,
                   num_threads or torch.get_num_threads())
        return out

    def silu_mul(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
                 num_threads: Optional[int] = None) -> torch.Tensor:
        """x: [T, 2 d] (gate | up) float32 / bfloat16 (rows may be strided) -> silu(gate) * up, a new [T, d]
        tensor of ``out_dtype`` (None: x's)."""
        check_tensor("x", x, ndim=2, dtypes=IO_DTYPES, last_dim_contiguous=True)
        num_tokens, two_d = x.shape
        if two_d % 2:
            raise ValueError(f"x: last dim {two_d} is not gate | up (even).")
        out_dtype = out_dtype or x.dtype
        if out_dtype not in IO_DTYPES:
            raise ValueError(f"out_dtype: {out_dtype} not supported; expected one of {IO_DTYPES}.")
        d = two_d // 2
        out = torch.empty(num_tokens, d, dtype=out_dtype)
        self._silu(x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0), out.data_ptr(),
                   out_dtype == torch.bfloat16, d, num_tokens, d, num_threads or torch.get_num_threads())
        return out
