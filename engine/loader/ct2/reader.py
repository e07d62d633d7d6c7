"""Read a CTranslate2 ``model.bin`` natively (without CTranslate2 installed): dequantized tensors and
scalar flags (``read_ct2_model``), and whether a directory holds a Whisper model (``is_ct2_whisper_dir``).

``model.bin`` layout (little endian; the writer is CTranslate2's ``model_spec.py::_serialize``, the
reader ``src/models/model.cc``). A ``str`` is a u16 length that counts a trailing NUL, the UTF-8
bytes, then the NUL::

    u32 binary_version
    str spec_name ; u32 spec_revision               (version >= 2)
    u32 num_variables, then per variable:
      str name ; u8 rank ; u32 dims[rank]
      u8 dtype_id ; u32 num_bytes                   (version >= 4)
      u8 item_size ; u32 num_items                  (versions 1-3: 4 = float32, 2 = int16, 1 = int8)
      bytes data[num_bytes]                         (row-major)
    u32 num_aliases, then per alias: str alias ; str target      (version >= 3)

Supported binary versions: 1 to 6. Versions 4, 5 and 6 share the record layout above (model.cc reads
them with one code path); 1-3 use the old item-size records, 1 has no spec name, and 1-2 no alias
table. Whisper files are written by CTranslate2 >= 3 (version 6); the older versions are read by
``read_ct2_model`` for completeness, and ``ct2_whisper_to_hf`` needs the spec name (version >= 2).

dtype ids: 0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16. A quantized weight ``W``
comes with ``W_scale``: int8 has one float32 scale per row (``W = q / scale[:, None]``), int16 one
float32 scalar (an int16 weight without a saved scale uses CTranslate2's global scale 1000).
Rank-0 variables are scalar flags (``decoder/activation``, ``{encoder,decoder}/num_heads``, ...).

The file is memory-mapped and each tensor is copied out of the map with ``numpy.frombuffer``, so
nothing beyond the tensors themselves is held in memory; a split ``model.bin.part1``/``part2``
pair is read as one byte stream (only a tensor that straddles the cut is assembled from both).
"""

from __future__ import annotations

import bisect
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

MODEL_BIN = "model.bin"
CONFIG_JSON = "config.json"
WHISPER_SPEC = "WhisperSpec"
SUPPORTED_BINARY_VERSIONS = range(1, 7)

# dtype_id -> (name, numpy dtype of the stored bytes). bfloat16 is read as raw uint16 and viewed.
_DTYPES: dict[int, tuple[str, np.dtype]] = {
    0: ("float32", np.dtype("<f4")), 1: ("int8", np.dtype("i1")), 2: ("int16", np.dtype("<i2")),
    3: ("int32", np.dtype("<i4")), 4: ("float16", np.dtype("<f2")), 5: ("bfloat16", np.dtype("<u2")),
}
# Binary versions 1-3 stored an item size instead of a dtype id (CTranslate2's old, lossy rule).
_ITEM_SIZE_DTYPE_IDS = {4: 0, 2: 2, 1: 1}
# CTranslate2's scale for int16 weights saved without one (ops::Quantize::global_int16_scale).
_GLOBAL_INT16_SCALE = 1000.0
# Smallest possible variable record: u16 name length + 1 byte + NUL, u8 rank, u8 dtype, u32 size.
_MIN_RECORD_BYTES = 2 + 2 + 1 + 1 + 4

@dataclass
class CT2Model:
    """The content of a CTranslate2 ``model.bin`` (and the directory's ``config.json``)."""

    path: Path
    """The model directory (config.json, tokenizer.json and vocabulary.* are looked up here)."""
    files: list[Path]
    """The files read as one byte stream: ``[model.bin]`` or ``[model.bin.part1, model.bin.part2, ...]``."""
    binary_version: int
    """``model.bin`` binary version (1-6)."""
    spec_name: str
    """Model specification, e.g. "WhisperSpec" ("" for binary version 1)."""
    spec_revision: int
    """Specification revision (1 for binary version 1)."""
    variables: dict[str, torch.Tensor] = field(default_factory=dict)
    """Non-scalar variables by CT2 name. int8/int16 weights are dequantized to float32 (their
    ``*_scale`` entries consumed); float16/bfloat16/float32 are as stored; aliases point to the same
    tensor object as their target."""
    flags: dict[str, int | float] = field(default_factory=dict)
    """Rank-0 variables (e.g. ``decoder/activation`` = 3, ``encoder/num_heads`` = 6), aliases included."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Alias name -> target name, as stored ("decoder/projection/weight" -> "decoder/embeddings/weight")."""
    stored_dtypes: dict[str, str] = field(default_factory=dict)
    """On-disk dtype per variable name before dequantization ("int8", "float16", ...), aliases included."""
    config: dict[str, Any] = field(default_factory=dict)
    """The directory's ``config.json`` ({} when there is none)."""


def ct2_model_files(path: str | Path) -> list[Path]:
    """The file(s) holding the model: ``model.bin``, else ``model.bin.part1``, ``part2``, ... in order.

    ``path`` is a model directory, a ``model.bin`` file or a ``model.bin.part1`` file.
    """
    path = Path(path)
    if path.is_dir():
        if (path / MODEL_BIN).is_file():
            return [path / MODEL_BIN]
        first = path / f"{MODEL_BIN}.part1"
    elif path.is_file():
        if not path.name.endswith(".part1"):
            return [path]
        first = path
    else:
        raise ValueError(f"{path}: no such file or directory (expected a CTranslate2 model directory).")
    if not first.is_file():
        raise ValueError(f"{path}: no {MODEL_BIN} (nor {MODEL_BIN}.part1, .part2, ...) in this directory; "
                         f"a CTranslate2 model directory holds model.bin, config.json and the vocabulary.")
    stem = first.name[: -len("1")]
    parts = []
    while (first.parent / f"{stem}{len(parts) + 1}").is_file():
        parts.append(first.parent / f"{stem}{len(parts) + 1}")
    return parts


class _ByteStream:
    """The concatenation of memory-mapped files, read by absolute offset without joining them."""

    def __init__(self, files: list[Path]):
        self.name = str(files[0]) if len(files) == 1 else " + ".join(str(f) for f in files)
        self._maps: list[mmap.mmap | None] = []
        self._starts: list[int] = []   # byte offset of each file in the stream
        self.size = 0                  # total bytes
        for f in files:
            with open(f, "rb") as fh:
                n_bytes = os.fstat(fh.fileno()).st_size
                self._maps.append(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if n_bytes else None)
            self._starts.append(self.size)
            self.size += n_bytes

    def close(self) -> None:
        for m in self._maps:
            if m is not None:
                m.close()

    def _pieces(self, offset: int, n_bytes: int) -> Iterator[tuple[mmap.mmap, int, int]]:
        """(map, start, end) pieces covering ``[offset, offset + n_bytes)``, in order."""
        i = bisect.bisect_right(self._starts, offset) - 1
        end = offset + n_bytes
        while offset < end:
            m, start = self._maps[i], self._starts[i]
            if m is not None and offset < start + len(m):
                stop = min(end, start + len(m))
                yield m, offset - start, stop - start
                offset = stop
            i += 1

    def bytes(self, offset: int, n_bytes: int) -> bytes:
        """A copy of ``n_bytes`` at ``offset`` (small header fields)."""
        return b"".join(m[a:b] for m, a, b in self._pieces(offset, n_bytes))

    def array(self, offset: int, n_bytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A writable copy of the tensor stored at ``offset`` (``frombuffer`` over the map, then one copy)."""
        pieces = list(self._pieces(offset, n_bytes))
        if len(pieces) != 1:            # straddles two parts: assemble this tensor only
            joined = bytearray(b"".join(m[a:b] for m, a, b in pieces))
            return np.frombuffer(joined, dtype=dtype).reshape(shape)
        m, a, b = pieces[0]
        with memoryview(m) as view:
            stored = np.frombuffer(view, dtype=dtype, count=n_bytes // dtype.itemsize, offset=a)
            out = stored.reshape(shape).copy()
            del stored                  # release the export so the map can be closed
        return out


class _Cursor:
    """Sequential reads of the header fields, with truncation errors that name the file and field."""

    def __init__(self, stream: _ByteStream):
        self.stream = stream
        self.offset = 0

    def take(self, n_bytes: int, what: str) -> int:
        """Advance past ``n_bytes``; return where they start. Raises ValueError if the file ends first."""
        if self.offset + n_bytes > self.stream.size:
            raise ValueError(
                f"{self.stream.name}: truncated file: {what} needs {n_bytes} bytes at byte {self.offset}, "
                f"but only {self.stream.size - self.offset} are left. The download or conversion is "
                f"incomplete; fetch or convert the model again.")
        start = self.offset
        self.offset += n_bytes
        return start

    def unpack(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.stream.bytes(self.take(size, what), size))[0]

    def string(self, what: str) -> str:
        n_bytes = self.unpack("<H", f"the length of {what}")
        if n_bytes == 0:
            raise ValueError(f"{self.stream.name}: {what} at byte {self.offset - 2} has length 0 (a stored "
                             f"string always counts its trailing NUL): the file is corrupt.")
        raw = self.stream.bytes(self.take(n_bytes, what), n_bytes)
        try:
            return raw.split(b"\0", 1)[0].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.stream.name}: {what} at byte {self.offset - n_bytes} is not UTF-8 "
                             f"({e}): the file is corrupt.") from None


def read_ct2_model(path: str | Path) -> CT2Model:
    """Read a CTranslate2 ``model.bin`` (or its parts) and the directory's ``config.json``.

    Args:
        path: the model directory, its ``model.bin``, or its ``model.bin.part1``.

    Raises:
        ValueError: not a CTranslate2 file (bad binary version), truncated or trailing bytes,
            an unknown dtype id, sizes that disagree with the shapes, or a dangling alias.
    """
    files = ct2_model_files(path)
    directory = files[0].parent
    stream = _ByteStream(files)
    try:
        model = _read_stream(stream, directory, files)
    finally:
        stream.close()
    config_path = directory / CONFIG_JSON
    if config_path.is_file():
        try:
            model.config = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path}: not valid JSON ({e}).") from None
    return model


def _read_stream(stream: _ByteStream, directory: Path, files: list[Path]) -> CT2Model:
    cur = _Cursor(stream)
    version = cur.unpack("<I", "the binary version")
    if version not in SUPPORTED_BINARY_VERSIONS:
        raise ValueError(
            f"{stream.name}: binary version {version} is not one this reader knows "
            f"({SUPPORTED_BINARY_VERSIONS.start}-{SUPPORTED_BINARY_VERSIONS.stop - 1}): either this is not a "
            f"CTranslate2 model.bin, or a CTranslate2 newer than this reader wrote it (convert the model "
            f"with a CTranslate2 release that writes binary version 6).")
    spec_name, spec_revision = "", 1
    if version >= 2:
        spec_name = cur.string("the spec name")
        spec_revision = cur.unpack("<I", "the spec revision")
    num_variables = cur.unpack("<I", "the variable count")
    if num_variables * _MIN_RECORD_BYTES > stream.size - cur.offset:
        raise ValueError(f"{stream.name}: truncated or corrupt file: the header announces {num_variables} "
                         f"variables, more than the {stream.size - cur.offset} remaining bytes can hold.")

    raw: dict[str, torch.Tensor] = {}       # every variable as stored (flags and int16 scales: rank 0)
    model = CT2Model(path=directory, files=files, binary_version=version, spec_name=spec_name,
                     spec_revision=spec_revision)
    for index in range(num_variables):
        name = cur.string(f"the name of variable #{index}")
        rank = cur.unpack("<B", f"the rank of {name!r}")
        shape = tuple(cur.unpack("<I", f"dimension {d} of {name!r}") for d in range(rank))
        if version >= 4:
            dtype_id = cur.unpack("<B", f"the dtype of {name!r}")
            n_bytes = cur.unpack("<I", f"the byte size of {name!r}")
            if dtype_id not in _DTYPES:
                raise ValueError(f"{stream.name}: variable {name!r} has unknown dtype id {dtype_id} (known: "
                                 + ", ".join(f"{i} {n}" for i, (n, _) in _DTYPES.items()) + ").")
        else:
            item_size = cur.unpack("<B", f"the item size of {name!r}")
            if item_size not in _ITEM_SIZE_DTYPE_IDS:
                raise ValueError(f"{stream.name}: variable {name!r} has item size {item_size}; binary "
                                 f"version {version} knows 4 (float32), 2 (int16) and 1 (int8).")
            dtype_id = _ITEM_SIZE_DTYPE_IDS[item_size]
            n_bytes = cur.unpack("<I", f"the item count of {name!r}") * item_size
        dtype_name, np_dtype = _DTYPES[dtype_id]
        expected_bytes = math.prod(shape) * np_dtype.itemsize
        if n_bytes != expected_bytes:
            raise ValueError(f"{stream.name}: variable {name!r} of shape {list(shape)} and dtype "
                             f"{dtype_name} should take {expected_bytes} bytes but the file says {n_bytes}: "
                             f"corrupt file.")
        if name in raw:
            raise ValueError(f"{stream.name}: variable {name!r} is stored twice: corrupt file.")
        start = cur.take(n_bytes, f"the data of {name!r}")
        tensor = torch.from_numpy(stream.array(start, n_bytes, np_dtype, shape))
        raw[name] = tensor.view(torch.bfloat16) if dtype_name == "bfloat16" else tensor
        model.stored_dtypes[name] = dtype_name

    if version >= 3:
        num_aliases = cur.unpack("<I", "the alias count")
        for index in range(num_aliases):
            alias = cur.string(f"the name of alias #{index}")
            model.aliases[alias] = cur.string(f"the target of alias {alias!r}")
    if cur.offset != stream.size:
        raise ValueError(f"{stream.name}: {stream.size - cur.offset} unexpected bytes after the "
                         f"{'alias table' if version >= 3 else 'last variable'} (byte {cur.offset}): "
                         f"corrupt file, or the wrong parts were put together.")

    for name, tensor in _dequantize(raw, stream.name, model.stored_dtypes).items():
        if tensor.dim() == 0:
            model.flags[name] = tensor.item()
        else:
            model.variables[name] = tensor
    for alias, target in model.aliases.items():
        if alias in model.variables or alias in model.flags:
            raise ValueError(f"{stream.name}: alias {alias!r} has the name of a stored variable: "
                             f"corrupt file.")
        if target in model.variables:
            model.variables[alias] = model.variables[target]
        elif target in model.flags:
            model.flags[alias] = model.flags[target]
        else:
            raise ValueError(f"{stream.name}: alias {alias!r} points to {target!r}, which is not stored.")
        model.stored_dtypes[alias] = model.stored_dtypes[target]
    return model


def _dequantize(raw: dict[str, torch.Tensor], source: str,
                stored_dtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """Replace each int8/int16 weight and its ``*_scale`` (rank 0 for int16) by the float32 weight (CT2's
    Dequantize op); everything else, scalars included, is returned as stored."""
    out: dict[str, torch.Tensor] = {}
    scales = {n for n in raw if n.endswith("_scale") and n[: -len("_scale")] in raw}
    for name, q in raw.items():
        if name in scales:
            continue
        scale_name = f"{name}_scale"
        if scale_name not in raw:
            if q.dtype == torch.int16 and q.dim() and name.endswith("weight"):
                out[name] = q.float() / _GLOBAL_INT16_SCALE      # old int16 files saved no scale
            elif q.dtype == torch.int8 and q.dim() and name.endswith("weight"):
                raise ValueError(f"{source}: int8 weight {name!r} has no {scale_name!r}: corrupt file.")
            else:
                out[name] = q                                    # floats as stored; other integer tensors
            continue
        scale = raw[scale_name].float()
        if q.dtype == torch.int16 and scale.numel() == 1:
            out[name] = q.float() / scale.reshape(())
        elif q.dtype == torch.int8 and scale.shape == q.shape[:1] + q.shape[2:]:
            out[name] = q.float() / scale.unsqueeze(1)           # [rows, ...] / [rows, 1, ...]
        else:
            raise ValueError(
                f"{source}: {name!r} is {stored_dtypes[name]} {list(q.shape)} with a {list(scale.shape)} "
                f"scale; expected int8 with one scale per row or int16 with one scalar scale.")
    return out


def is_ct2_whisper_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory whose ``model.bin`` (or ``.part1``) header says ``WhisperSpec``."""
    if not Path(path).is_dir():
        return False
    try:
        stream = _ByteStream(ct2_model_files(path))      # the header may straddle split parts
    except (OSError, ValueError):
        return False
    try:
        cur = _Cursor(stream)
        version = cur.unpack("<I", "the binary version")
        if version not in SUPPORTED_BINARY_VERSIONS or version < 2:
            return False
        return cur.string("the spec name") == WHISPER_SPEC
    except ValueError:
        return False
    finally:
        stream.close()
