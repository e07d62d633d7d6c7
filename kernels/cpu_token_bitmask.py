"""A grammar's token bitmask applied to CPU logits: ``csrc/token_bitmask.c`` through ctypes (semantics in the
C file's header; twin: ``engine.structured_output.bitmask.apply_token_bitmask_torch``).

Why: xgrammar's CPU kernel tests every token's bit on one thread, so a row that disallows most of the
vocabulary (a structural position of a JSON grammar) costs a few ms at a 49,152-token vocabulary; this one
skips the words whose 32 tokens are all allowed, writes the rest's disallowed ones and spreads (row,
word-chunk) items over torch's threads (figures: RESULTS.md "What sets the CPU defaults").
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional, Sequence

import torch

from kernels import cpu_native

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class CpuTokenBitmask:
    """The loaded kernel (``load``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._apply = lib.chorus_apply_token_bitmask
        self._apply.argtypes = [_P, _I64, _P, _I64, _P, _I64, _I64, _I32]
        self._apply.restype = None

    @classmethod
    def load(cls, build_dir: Path) -> Optional["CpuTokenBitmask"]:
        """Build (once per host, into ``build_dir``) and load the kernel; None where it cannot be built."""
        lib = cpu_native.load("token_bitmask", build_dir)
        return cls(lib) if lib is not None else None

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int], vocab_size: int,
              num_threads: Optional[int] = None) -> None:
        """Set logits[r, v] = -inf, in place, for each r in ``rows`` and each v < ``vocab_size`` whose bit in
        bitmask row r is 0. logits: [B, V] float32 CPU, rows contiguous; bitmask: [M, words] int32 CPU, rows
        contiguous; every r < B and < M; vocab_size <= min(V, 32 * words)."""
        if (logits.dtype != torch.float32 or logits.dim() != 2 or logits.device.type != "cpu"
                or (logits.shape[1] > 1 and logits.stride(1) != 1)):
            raise ValueError(f"logits: expected a 2-D float32 CPU tensor with contiguous rows, got "
                             f"{logits.dtype} {tuple(logits.shape)} strides {logits.stride()} on "
                             f"{logits.device}.")
        if (bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu"
                or (bitmask.shape[1] > 1 and bitmask.stride(1) != 1)):
            raise ValueError(f"bitmask: expected a 2-D int32 CPU tensor with contiguous rows, got "
                             f"{bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}.")
        if not 0 <= vocab_size <= min(logits.shape[1], 32 * bitmask.shape[1]):
            raise ValueError(f"vocab_size {vocab_size}: at most the logits' {logits.shape[1]} columns and "
                             f"the bitmask's {32 * bitmask.shape[1]} bits.")
        rows_t = torch.as_tensor(list(rows), dtype=torch.int64)
        if rows_t.numel() == 0:
            return
        if int(rows_t.min()) < 0 or int(rows_t.max()) >= min(logits.shape[0], bitmask.shape[0]):
            limit = min(logits.shape[0], bitmask.shape[0])
            raise ValueError(f"rows: each in [0, {limit}), got {rows_t.tolist()}.")
        self._apply(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
                    rows_t.data_ptr(), rows_t.numel(), vocab_size, num_threads or torch.get_num_threads())
