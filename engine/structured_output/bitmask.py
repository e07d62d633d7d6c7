"""The token bitmask: filled on the host by the matchers, applied to the logits on the device.

Layout (xgrammar's, which llguidance shares): ``[rows, ceil(vocab_size / 32)]`` int32; token ``i`` of a
row is allowed when bit ``i % 32`` of word ``i // 32`` is set. Row ``r`` of the bitmask constrains row
``r`` of the logits. Logits columns past the bitmask's ``32 * words`` (a logits width padded beyond the
vocabulary the bitmask was built for) are always masked; ids past the tokenizer's vocabulary inside it
are masked by the matchers, which never allow them.

``apply_token_bitmask`` runs xgrammar's kernels (its Triton kernel on CUDA, its C++ kernel on the host) or,
given one, ``kernels.cpu_token_bitmask``'s C kernel on CPU float32 logits (the runner's, ``KernelPolicy.
cpu_token_bitmask``: it skips fully allowed words, where xgrammar's tests every token on one thread);
``apply_token_bitmask_torch`` is the pure-torch twin they are tested against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Optional, Sequence, Union

import torch

if TYPE_CHECKING:
    from kernels.cpu_token_bitmask import CpuTokenBitmask

BITS_PER_WORD = 32
"""Tokens per int32 word of the bitmask."""
_XGRAMMAR_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Logits dtypes xgrammar's kernels take."""

RowIndices = Optional[Union[Sequence[int], torch.Tensor]]
"""Rows of the logits (and of the bitmask) to mask; None: every row of the logits."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens."""
    return (int(vocab_size) + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_bitmask(max_rows: int, vocab_size: int, pin_memory: Optional[bool] = None) -> torch.Tensor:
    """The host bitmask, every token allowed: ``[max_rows, ceil(vocab_size / 32)]`` int32, pinned when
    CUDA is available (so its copy to the device overlaps the forward)."""
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    bitmask = torch.empty(max_rows, bitmask_words(vocab_size), dtype=torch.int32,
                          pin_memory=pin_memory)  # [max_rows, words]
    bitmask.fill_(-1)
    return bitmask


def _rows_tensor(row_indices: RowIndices, num_rows: int, device: torch.device) -> torch.Tensor:
    if row_indices is None:
        return torch.arange(num_rows, device=device)
    if isinstance(row_indices, torch.Tensor):
        return row_indices.to(device=device, dtype=torch.long)
    return torch.tensor(list(row_indices), dtype=torch.long, device=device)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``bitmask`` ``[R, words]`` as booleans ``[R, vocab_size]`` (True: allowed); columns past
    ``32 * words`` are False."""
    num_rows, words = bitmask.shape
    shifts = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=torch.int32)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, words, 32]
    allowed = bits.reshape(num_rows, words * BITS_PER_WORD).bool()  # [R, 32 * words]
    covered = min(vocab_size, words * BITS_PER_WORD)
    if covered == vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(num_rows, vocab_size - covered, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed[:, :covered], pad], dim=1)  # [R, vocab_size]


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor,
                              row_indices: RowIndices = None) -> None:
    """Set the disallowed logits to -inf, in place: the pure-torch twin of ``apply_token_bitmask``.

    Args:
        logits: ``[B, V]`` float logits.
        bitmask: ``[M, words]`` int32 on ``logits``' device; row ``r`` masks logits row ``r``.
        row_indices: the rows to mask (each < B and < M); None: rows ``0 .. B-1``.
    """
    rows = _rows_tensor(row_indices, logits.shape[0], logits.device)  # [R]
    if rows.numel() == 0:
        return
    allowed = unpack_bitmask(bitmask.index_select(0, rows.to(bitmask.device)), logits.shape[-1])  # [R, V]
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: RowIndices = None,
                        kernel: Literal["auto", "xgrammar", "torch"] = "auto",
                        cpu_kernel: Optional["CpuTokenBitmask"] = None) -> None:
    """Set the disallowed logits to -inf, in place: with ``cpu_kernel`` on CPU float32 logits, else with
    xgrammar's kernel for the device (its C++ kernel on the CPU, Triton on CUDA) where it applies, else the
    torch twin.

    Args:
        logits: ``[B, V]`` float logits (on the device).
        bitmask: ``[M, words]`` int32; copied to ``logits``' device when it is elsewhere (the caller
            normally copies the step's rows itself, ``non_blocking`` from the pinned host buffer).
        row_indices: the rows to mask (each < B and < M); None: rows ``0 .. B-1``.
        kernel: ``auto`` (``cpu_kernel`` or xgrammar where they apply), ``xgrammar`` (raises where it does
            not), ``torch``.
        cpu_kernel: the loaded C kernel (None: not used).
    """
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if (kernel == "auto" and cpu_kernel is not None and logits.device.type == "cpu"
            and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(-1) == 1
            and bitmask.stride(-1) == 1):
        vocab_size = logits.shape[-1]
        covered = min(vocab_size, bitmask.shape[-1] * BITS_PER_WORD)
        rows = range(logits.shape[0]) if row_indices is None else (
            row_indices.tolist() if isinstance(row_indices, torch.Tensor) else list(row_indices))
        cpu_kernel.apply(logits, bitmask, rows, covered)
        if covered < vocab_size and len(rows):
            logits[list(rows), covered:] = float("-inf")
        return
    use_xgrammar = kernel == "xgrammar" or (
        kernel == "auto" and logits.dtype in _XGRAMMAR_DTYPES and logits.device.type in ("cpu", "cuda")
        and logits.dim() == 2 and logits.stride(-1) == 1)
    if not use_xgrammar:
        apply_token_bitmask_torch(logits, bitmask, row_indices)
        return
    import xgrammar as xgr

    vocab_size = logits.shape[-1]
    covered = min(vocab_size, bitmask.shape[-1] * BITS_PER_WORD)
    if row_indices is None:
        indices = None
        bitmask = bitmask[:logits.shape[0]]  # xgrammar pairs the rows one to one
    elif isinstance(row_indices, torch.Tensor):
        indices = row_indices.tolist() if logits.device.type == "cpu" else row_indices
    else:
        indices = list(row_indices)
    if indices is not None and len(indices) == 0:
        return
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=covered, indices=indices)
    if covered < vocab_size:
        rows = _rows_tensor(row_indices, logits.shape[0], logits.device)
        logits[rows, covered:] = float("-inf")
