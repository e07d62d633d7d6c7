"""Elementwise layer ops on CPU: ``csrc/layer_ops.c`` through ctypes (semantics in the C file's header).

``add_rms_norm`` (the residual add fused with RMSNorm), ``silu_mul`` (SiLU-and-mul) and ``rotary_write_kv``
(rotary on q and k in place, then k and v into the paged cache, float32 or bfloat16), float32 otherwise. Twins:
``kernels.reference.rms_norm_ref``, ``silu_and_mul_ref`` and ``rotary_write_kv_ref``. Why: at decode sizes
torch's versions are several small kernels each, and their per-call cost is most of their time (RESULTS.md
"What sets the CPU defaults").

The per-step tensors are checked on every call; a layer's fixed tensors (norm weights, KV caches, rotary
tables) once, by address, shape and dtype.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from kernels import cpu_native
from kernels.cpu_native import CACHE_DTYPES
from kernels.utils import check_tensor

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


def _check_rows(name: str, x: torch.Tensor, width: Optional[int] = None) -> None:
    """x: a 2-D float32 CPU tensor whose rows are contiguous (``width`` columns when given)."""
    if (x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu" or (x.shape[1] > 1 and x.stride(1) != 1)
            or (width is not None and x.shape[1] != width)):
        raise ValueError(f"{name}: expected a 2-D float32 CPU tensor with contiguous rows"
                         f"{'' if width is None else f' of {width} columns'}, got {x.dtype} {tuple(x.shape)} "
                         f"strides {x.stride()} on {x.device}.")


class CpuLayerOps:
    """The loaded ops (``load``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._checked: set[tuple] = set()
        """Per-layer tensors (caches, rotary tables, norm weights: by address, shape, dtype) already checked."""
        self._norm = lib.chorus_add_rms_norm
        self._norm.argtypes = [_P, _I64, _P, _P, _F, _P, _I64, _I64, _I32]
        self._norm.restype = None
        self._silu = lib.chorus_silu_mul
        self._silu.argtypes = [_P, _I64, _P, _I64, _I64, _I32]
        self._silu.restype = None
        self._rotary = lib.chorus_rotary_write_kv
        self._rotary.argtypes = [_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _I64,
                                 _P, _P, _I32, _P, _I32]
        self._rotary.restype = None

    @classmethod
    def load(cls, build_dir: Path) -> Optional["CpuLayerOps"]:
        """Build (once per host, into ``build_dir``) and load the ops; None where they cannot be built."""
        lib = cpu_native.load("layer_ops", build_dir)
        return cls(lib) if lib is not None else None

    def add_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: Optional[torch.Tensor] = None, num_threads: Optional[int] = None) -> torch.Tensor:
        """x: [T, N] (rows may be strided); weight: [N]; residual: None or [T, N] contiguous, overwritten with
        x + residual. Returns RMSNorm(x + residual) * weight, a new [T, N] tensor. All float32."""
        _check_rows("x", x)
        num_tokens, n = x.shape
        key = (weight.data_ptr(), weight.shape, weight.dtype, weight.stride(), n)
        if key not in self._checked:
            check_tensor("weight", weight, dtypes=(torch.float32,), shape=(n,), contiguous=True)
            self._checked.add(key)
        if residual is not None and (residual.shape != x.shape or residual.dtype != torch.float32
                                     or not residual.is_contiguous()):
            raise ValueError(f"residual: expected a contiguous float32 {tuple(x.shape)} tensor, got "
                             f"{residual.dtype} {tuple(residual.shape)} strides {residual.stride()}.")
        out = torch.empty(num_tokens, n)
        self._norm(x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
                   weight.data_ptr(), float(eps), out.data_ptr(), num_tokens, n,
                   num_threads or torch.get_num_threads())
        return out

    def silu_mul(self, x: torch.Tensor, num_threads: Optional[int] = None) -> torch.Tensor:
        """x: [T, 2 d] (gate | up; rows may be strided) -> silu(gate) * up, a new [T, d] tensor. float32."""
        _check_rows("x", x)
        num_tokens, two_d = x.shape
        if two_d % 2:
            raise ValueError(f"x: last dim {two_d} is not gate | up (even).")
        out = torch.empty(num_tokens, two_d // 2)
        self._silu(x.data_ptr(), x.stride(0), out.data_ptr(), num_tokens, two_d // 2,
                   num_threads or torch.get_num_threads())
        return out

    def rotary_write_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        num_threads: Optional[int] = None) -> None:
        """Rotate q [T, H, D] and k [T, Hkv, D] in place (neox layout, the first ``rotary_dim`` dims) and
        store k and v [T, Hkv, D] at their ``slot_mapping`` [T] int64 slots (-1: skipped) of the caches
        [num_blocks, block_size, Hkv, D] (float32 or bfloat16; all else float32); q, k, v rows may be strided
        (each row's heads contiguous, as views of a packed q | k | v output). positions: [T] int64; cos, sin: [max_position,
        >= rotary_dim / 2] float32 (their first rotary_dim / 2 columns are read)."""
        num_tokens, num_heads, head_dim = q.shape
        key = (k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape, v_cache.shape, k_cache.dtype, v_cache.dtype,
               cos.data_ptr(), sin.data_ptr(), cos.shape, sin.shape, cos.stride(), sin.stride(), rotary_dim,
               head_dim)
        if key not in self._checked:                   # a layer's caches and tables: checked once
            self._check_rotary_tables(k_cache, v_cache, cos, sin, rotary_dim, head_dim)
            self._checked.add(key)
        num_kv_heads = k_cache.shape[2]
        for name, t, heads in (("q", q, num_heads), ("k", k, num_kv_heads), ("v", v, num_kv_heads)):
            if t.dtype != torch.float32 or t.shape != (num_tokens, heads, head_dim):
                raise ValueError(f"{name}: expected float32 [{num_tokens}, {heads}, {head_dim}], got {t.dtype} "
                                 f"{tuple(t.shape)}.")
            if t.stride(2) != 1 or t.stride(1) != head_dim:
                raise ValueError(f"{name}: each row's heads must be contiguous, got strides {t.stride()}.")
        check_tensor("positions", positions, dtypes=(torch.int64,), shape=(num_tokens,), contiguous=True)
        check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(num_tokens,), contiguous=True)
        self._rotary(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), num_tokens,
                     num_heads, num_kv_heads, head_dim, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                     cos.stride(0), rotary_dim, k_cache.data_ptr(), v_cache.data_ptr(),
                     k_cache.dtype == torch.bfloat16, slot_mapping.data_ptr(), num_threads or torch.get_num_threads())

    @staticmethod
    def _check_rotary_tables(k_cache, v_cache, cos, sin, rotary_dim: int, head_dim: int) -> None:
        check_tensor("k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES, contiguous=True)
        check_tensor("k_cache", k_cache, shape=(None, None, None, head_dim))
        check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape), contiguous=True)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim={rotary_dim}: use an even size in (0, head_dim={head_dim}].")
        for name, t in (("cos", cos), ("sin", sin)):
            check_tensor(name, t, ndim=2, dtypes=(torch.float32,), last_dim_contiguous=True)
            if t.shape[1] < rotary_dim // 2:
                raise ValueError(f"{name}: {t.shape[1]} columns, fewer than rotary_dim / 2 = {rotary_dim // 2}.")
        if sin.stride(0) != cos.stride(0):
            raise ValueError("cos and sin: rows must be equally strided (slices of one table each).")
