"""Non-causal attention over packed variable-length segments: the vision towers' attention (Qwen2-VL's
frames, Qwen2.5-VL's windows), images of different sizes in one call without padding.

``packed_attention(q, k, v, segments, scale)``: q, k, v [num_tokens, heads, head_dim], the tokens of
consecutive segments laid end to end (``PackedSegments``: their boundaries ``cu_seqlens``); each token
attends, with no mask, to every token of its own segment and to no other: out[i] = softmax(q[i] .
k[seg]^T * scale) . v[seg], per head. Two paths, one result:

- CUDA, float16 / bfloat16, a head_dim flash attention takes (a multiple of 8, at most 256): one launch of
  PyTorch's flash varlen kernel (``torch.nn.attention.varlen.varlen_attn``) over every segment, whatever
  their sizes. If that call fails (a PyTorch build without flash varlen), the failure is logged once and
  the shape falls back to the next path for the rest of the process.
- Otherwise (CPU, float32): one SDPA call per run of consecutive segments of equal length (a batch of
  same-sized images is one call; every SDPA backend stays usable, and no work is spent on the zero
  blocks a block-diagonal mask over all tokens would carry). Exact on CPU.

``packed_attention_reference`` is the pure-torch twin: per segment, explicit softmax in float32.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger("chorus.encoders")

FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes the flash varlen kernel takes."""
FLASH_MAX_HEAD_DIM = 256
"""The largest head_dim the flash varlen kernel takes (it also needs a multiple of 8)."""


def _load_varlen_attn() -> Optional[Callable]:
    """PyTorch's flash varlen attention, or None where this PyTorch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


_VARLEN_ATTN: Optional[Callable] = _load_varlen_attn()
"""``torch.nn.attention.varlen.varlen_attn`` (None: this PyTorch has none)."""
_VARLEN_TAKES_SCALE = _VARLEN_ATTN is not None and "scale" in inspect.signature(_VARLEN_ATTN).parameters
"""Whether ``varlen_attn`` takes ``scale`` (later PyTorch releases; earlier ones use head_dim ** -0.5)."""
_FAILED_SHAPES: set[tuple[torch.dtype, int]] = set()
"""(dtype, head_dim) whose flash varlen call failed once: they take the per-run SDPA path from then on."""


@dataclass(frozen=True)
class SegmentRun:
    """Consecutive attention segments (frames; windows in Qwen2.5-VL) of the same number of tokens:
    they attend in one batched SDPA call."""

    first_patch: int  # index of the run's first token in the packed sequence
    num_segments: int  # segments in the run; each attends only to its own tokens
    patches_per_segment: int  # tokens in every segment of the run


def join_runs(segments: Iterable[tuple[int, int]]) -> list[SegmentRun]:
    """Consecutive attention segments, given as (count, tokens each) groups in order, as runs: groups
    of equal length that follow each other join into one run."""
    runs: list[SegmentRun] = []
    first_patch = 0
    for count, length in segments:
        if runs and runs[-1].patches_per_segment == length:
            last = runs[-1]
            runs[-1] = SegmentRun(last.first_patch, last.num_segments + count, length)
        elif count > 0:
            runs.append(SegmentRun(first_patch, count, length))
        first_patch += count * length
    return runs


@dataclass(frozen=True)
class PackedSegments:
    """The segments of one packed call, built once per tower forward and read by every layer."""

    runs: list[SegmentRun]  # the segments as runs of equal length, in order (the per-run SDPA path)
    cu_seqlens: torch.Tensor  # [num_segments + 1] int32 on the tokens' device: each segment's first token
    max_seqlen: int  # tokens of the longest segment


def packed_segments(runs: list[SegmentRun], device: torch.device) -> PackedSegments:
    """``PackedSegments`` of ``runs`` (covering the packed tokens in order), cu_seqlens built on the host
    and copied to ``device``."""
    lengths = [run.patches_per_segment for run in runs for _ in range(run.num_segments)]
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)  # [num_segments + 1]
    cu_seqlens[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    if device.type == "cuda":
        cu_seqlens = cu_seqlens.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        cu_seqlens = cu_seqlens.to(device)
    return PackedSegments(runs=runs, cu_seqlens=cu_seqlens, max_seqlen=max(lengths, default=0))


def flash_varlen_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``packed_attention`` takes the flash varlen path for tokens of this device, dtype and
    head_dim (this PyTorch has ``varlen_attn`` and no call of the shape has failed)."""
    return (_VARLEN_ATTN is not None and device.type == "cuda" and dtype in FLASH_DTYPES
            and head_dim % 8 == 0 and head_dim <= FLASH_MAX_HEAD_DIM
            and (dtype, head_dim) not in _FAILED_SHAPES)


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: PackedSegments,
                  scale: float) -> torch.Tensor:
    """One ``varlen_attn`` call (q, k, v [num_tokens, heads, head_dim] -> the same shape). PyTorch builds
    whose ``varlen_attn`` takes no ``scale`` (its default is head_dim ** -0.5) get q pre-scaled instead."""
    cu, longest = segments.cu_seqlens, segments.max_seqlen
    if _VARLEN_TAKES_SCALE:
        return _VARLEN_ATTN(q, k, v, cu, cu, longest, longest, scale=scale)
    default = q.shape[-1] ** -0.5
    if scale != default:
        q = q * (scale / default)
    return _VARLEN_ATTN(q, k, v, cu, cu, longest, longest)


def per_run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list[SegmentRun],
                      scale: float) -> torch.Tensor:
    """q, k, v [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim]: one SDPA call per run."""
    outputs = []
    heads, head_dim = q.shape[1:]
    for run in runs:
        span = slice(run.first_patch, run.first_patch + run.num_segments * run.patches_per_segment)
        shape = (run.num_segments, run.patches_per_segment, heads, head_dim)
        # each [segments, heads, tokens_per_segment, head_dim]
        q_run, k_run, v_run = (x[span].view(shape).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q_run, k_run, v_run, scale=scale)  # same shape
        outputs.append(out.transpose(1, 2).reshape(-1, heads, head_dim))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: PackedSegments,
                     scale: float) -> torch.Tensor:
    """q, k, v [num_tokens, heads, head_dim] (the segments of ``segments`` end to end) -> [num_tokens,
    heads, head_dim]: each token attends to its own segment only (see the module docstring for the
    paths). ValueError when q's tokens are not the segments' or q, k, v disagree in shape."""
    num_tokens = int(sum(run.num_segments * run.patches_per_segment for run in segments.runs))
    if q.dim() != 3 or q.shape != k.shape or q.shape != v.shape or q.shape[0] != num_tokens:
        raise ValueError(f"packed_attention: q, k, v must be [num_tokens={num_tokens}, heads, head_dim] "
                         f"alike, got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}.")
    if flash_varlen_supported(q.device, q.dtype, q.shape[-1]):
        try:
            return _flash_varlen(q, k, v, segments, scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as error:   # a build without flash varlen for this device: fall back, once
            _FAILED_SHAPES.add((q.dtype, q.shape[-1]))
            logger.warning("Flash varlen attention failed for %s head_dim %d (%s); the vision towers "
                           "attend with one SDPA call per run of equal segments instead.",
                           q.dtype, q.shape[-1], error)
    return per_run_attention(q, k, v, segments.runs, scale)


def packed_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """The pure-torch twin of ``packed_attention``: q, k, v [num_tokens, heads, head_dim], cu_seqlens
    [num_segments + 1] -> [num_tokens, heads, head_dim], softmax(q k^T * scale) v per segment and head,
    in float32, cast to q's dtype."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[start:stop].float().transpose(0, 1) for x in (q, k, v))   # [heads, len, head_dim]
        probs = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)          # [heads, len, len]
        out[start:stop] = (probs @ vs).transpose(0, 1).to(q.dtype)
    return out
