"""Read an adapter's ``adapter_model.safetensors`` into one buffer, grouped by shape, with few torch calls.

An adapter of an 8B model holds hundreds of tensors (448 on Llama-3-8B's 7 projections). The engine reads
adapters on loader threads beside its step loop, and every torch call releases the GIL and must take it back
from the busy step loop (up to the interpreter's 5 ms switch interval each): per-tensor views, dtype casts
and scale multiplies made a read many times slower beside a busy Python thread than alone
(``benchmarks/RESULTS.md``, "Adapters at scale"). So the read:

- lays the tensors out by (dtype, shape) group rather than in file order, and reads the file into that
  layout with scatter reads (``os.preadv``: one call per 1,024 tensors, one GIL release);
- makes one stacked view per group and each tensor a view of it by indexing (``group[i]``: no GIL release);
- folds each B's scale (``fold``) with one multiply per run of equal scales in a group, and casts a group to
  the slot dtype with one copy: float32 maths rounded once, the values ``peft_adapter._scaled`` gives.

An adapter of the 8B shape (5 groups) takes ~20 torch calls instead of ~1,600.
A check from the header alone (``read_grouped_meta``: ``meta`` tensors, on the server's threads beside its
busy event loop) makes one call per group the same way.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16}
"""safetensors header dtype names -> torch dtypes (what adapters hold)."""

_IOV_MAX = 1024
"""Buffers per ``os.preadv`` call (Linux's IOV_MAX)."""
_READ_CALL_BYTES = 1 << 30
"""Bytes asked per ``os.preadv`` call (Linux returns at most ~2 GiB per read)."""


@dataclass(frozen=True)
class _Entry:
    """One tensor of the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Byte offset in the file's data section."""
    nbytes: int


@dataclass
class GroupedRead:
    """A safetensors file's tensors, read by ``read_grouped``."""

    tensors: dict[str, torch.Tensor]
    """Name -> tensor: views of one buffer (page-locked if asked), in ``dtype`` where one was given."""
    folded: set[str]
    """Names whose scale ``fold`` gave was multiplied in."""


def read_header(handle) -> tuple[dict, int, int]:
    """(the header's JSON object, the data section's offset in the file, its bytes) of an open safetensors
    file; ValueError for a header that does not fit the file."""
    header_bytes = int.from_bytes(handle.read(8), "little")
    data_bytes = os.fstat(handle.fileno()).st_size - 8 - header_bytes
    if header_bytes <= 0 or data_bytes < 0:
        raise ValueError(f"a header of {header_bytes} bytes does not fit the file")
    header = json.loads(handle.read(header_bytes))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, 8 + header_bytes, data_bytes


def read_grouped(f: Path, dtype: Optional[torch.dtype] = None, pin_memory: bool = False,
                 fold: Optional[Callable[[str], Optional[float]]] = None) -> Optional[GroupedRead]:
    """Every tensor of the safetensors file ``f``, read as the module docstring says.

    Args:
        dtype: the floating dtype to return every tensor in (None: the file's).
        pin_memory: page-locked buffers (CUDA engines).
        fold: tensor name -> the scale to multiply it by (None: none); maths in float32 unless the tensor
            is in ``dtype`` already, rounded once.

    Returns:
        None when a tensor's dtype is not an adapter's, or tensors overlap (``safetensors.torch.load_file``
        then reads the file, or says what is wrong). Raises ValueError for a header that does not fit the
        file.
    """
    with open(f, "rb") as handle:
        header, data_start, data_bytes = read_header(handle)
        entries = _entries(header, data_bytes)
        if entries is None:
            return None
        fold_of = {e.name: (fold(e.name) if fold is not None else None) for e in entries}
        # Groups by (dtype, shape), largest itemsize first so every group starts aligned to its elements;
        # in a group the unscaled members first, then equal scales next to each other (a multiply per run).
        groups: dict[tuple[torch.dtype, tuple[int, ...]], list[_Entry]] = {}
        for e in entries:
            groups.setdefault((e.dtype, e.shape), []).append(e)
        order = sorted(groups, key=lambda k: -k[0].itemsize)
        for key in order:
            groups[key].sort(key=lambda e: (fold_of[e.name] is not None, fold_of[e.name] or 0.0))
        dest, offset = {}, 0
        for key in order:
            for e in groups[key]:
                dest[e.name] = offset
                offset += e.nbytes
        buf = torch.empty(offset, dtype=torch.uint8, pin_memory=pin_memory)           # [data_bytes]
        if offset:
            _scatter_read(handle.fileno(), data_start, entries, dest, memoryview(buf.numpy()))
    want = {key: dtype or key[0] for key in order}
    cast_numel = {key: len(groups[key]) * math.prod(key[1]) for key in order if want[key] != key[0]}
    cast_buf = (torch.empty(sum(cast_numel.values()), dtype=dtype, pin_memory=pin_memory)
                if cast_numel else None)                                           # [cast elements]
    tensors: dict[str, torch.Tensor] = {}
    folded: set[str] = set()
    cast_at = 0
    for key in order:
        group_dtype, shape = key
        members = groups[key]
        first = dest[members[0].name]
        nbytes = sum(e.nbytes for e in members)
        stacked = buf[first:first + nbytes].view(group_dtype).view(len(members), *shape)     # [n, *shape]
        out = stacked
        if key in cast_numel:                                                     # [n, *shape] in ``dtype``
            out = cast_buf[cast_at:cast_at + cast_numel[key]].view(len(members), *shape)
            cast_at += cast_numel[key]
        for i, j, scale in _runs(members, fold_of):
            _fold_and_cast(stacked[i:j], out[i:j], scale, cast=key in cast_numel)
            if scale is not None:
                folded.update(e.name for e in members[i:j])
        for i, e in enumerate(members):
            tensors[e.name] = out[i]
    return GroupedRead(tensors, folded)


def read_grouped_meta(f: Path, dtype: Optional[torch.dtype] = None) -> Optional[dict[str, torch.Tensor]]:
    """The safetensors file's tensors as ``meta`` tensors (in ``dtype``, else the file's), from its header
    alone: views of one meta tensor per (dtype, shape) group, so a check of an 8B-shape adapter makes a few
    torch calls. None and ValueError as ``read_grouped``."""
    with open(f, "rb") as handle:
        header, _, data_bytes = read_header(handle)
    entries = _entries(header, data_bytes)
    if entries is None:
        return None
    groups: dict[tuple[torch.dtype, tuple[int, ...]], list[_Entry]] = {}
    for e in entries:
        groups.setdefault((dtype or e.dtype, e.shape), []).append(e)
    tensors = {}
    for (group_dtype, shape), members in groups.items():
        stacked = torch.empty((len(members), *shape), dtype=group_dtype, device="meta")       # [n, *shape]
        for i, e in enumerate(members):
            tensors[e.name] = stacked[i]
    return tensors


def _runs(members: list[_Entry], fold_of: dict[str, Optional[float]]
          ) -> Iterator[tuple[int, int, Optional[float]]]:
    """(start, end, scale) of each run of members with one scale (None: unscaled)."""
    i = 0
    while i < len(members):
        scale = fold_of[members[i].name]
        j = i
        while j < len(members) and fold_of[members[j].name] == scale:
            j += 1
        yield i, j, scale
        i = j


def _fold_and_cast(src: torch.Tensor, out: torch.Tensor, scale: Optional[float], cast: bool) -> None:
    """``src * scale`` rounded once: in place in ``src`` without ``cast``; else into ``out`` (another dtype),
    in float32 maths (``peft_adapter._scaled``'s values; ``src`` may be overwritten)."""
    scaled = scale is not None and scale != 1.0
    if not cast:
        if scaled:
            src.mul_(scale)
        return
    if not scaled:
        out.copy_(src)                                  # one rounding, as ``Tensor.to``
    elif out.dtype == torch.float32:
        out.copy_(src)
        out.mul_(scale)
    else:
        wide = src if src.dtype == torch.float32 else src.float()
        out.copy_(wide.mul_(scale))


def _entries(header: dict, data_bytes: int) -> Optional[list[_Entry]]:
    """The header's tensors in file order; None for a dtype adapters do not hold, misaligned or overlapping
    data; ValueError for offsets that do not fit a tensor's shape or the file."""
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        start, end = (int(x) for x in info["data_offsets"])
        shape = tuple(int(x) for x in info["shape"])
        if dtype is None:
            return None
        if not 0 <= start <= end <= data_bytes or end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: offsets {start}..{end} do not fit its shape or the file")
        if start % dtype.itemsize:
            return None
        entries.append(_Entry(name, dtype, shape, start, end - start))
    entries.sort(key=lambda e: e.start)
    if any(a.start + a.nbytes > b.start for a, b in zip(entries, entries[1:])):
        return None
    return entries


def _scatter_read(fd: int, data_start: int, entries: list[_Entry], dest: dict[str, int],
                  out: memoryview) -> None:
    """Read the data section's tensors (file order) into ``out`` at their ``dest`` offsets; gaps between
    tensors go to a scratch buffer. ValueError when the file ends first."""
    views: list[memoryview] = []
    position = 0
    for e in entries:
        if e.start > position:
            views.append(memoryview(bytearray(e.start - position)))
        if e.nbytes:
            views.append(out[dest[e.name]:dest[e.name] + e.nbytes])
        position = e.start + e.nbytes
    file_offset, i = data_start, 0
    while i < len(views):
        batch, asked = [], 0
        while i + len(batch) < len(views) and len(batch) < _IOV_MAX and asked < _READ_CALL_BYTES:
            batch.append(views[i + len(batch)])
            asked += len(batch[-1])
        got = os.preadv(fd, batch, file_offset)
        if got <= 0:
            raise ValueError("the file ended before its data")
        file_offset += got
        for v in batch:                      # consume ``got`` bytes: whole buffers, then part of one
            if got >= len(v):
                got -= len(v)
                i += 1
            else:
                views[i] = v[got:]
                break
