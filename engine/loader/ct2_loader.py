"""Read CTranslate2 (faster-whisper) Whisper directories natively: weights, config and tokenizer.

A faster-whisper directory holds ``model.bin`` (or ``model.bin.part1``, ``model.bin.part2``, ...),
``config.json`` (suppress lists, language ids, alignment heads), ``tokenizer.json`` and
``vocabulary.txt`` / ``vocabulary.json``. This module turns it into what transformers'
``WhisperForConditionalGeneration`` loads, without CTranslate2 installed.

Public API::

    model = read_ct2_model(path)                          # CT2Model: dequantized tensors + scalar flags
    config, weights = ct2_whisper_to_hf(model, dtype)     # WhisperConfig, iterator of (hf_name, tensor)
    generation_config = ct2_whisper_generation_config(config)
    tokenizer = load_ct2_tokenizer(path)                  # PreTrainedTokenizerFast with timestamp tokens
    ids = read_whisper_token_ids(path)                    # sot, eot, no_timestamps, languages, ...
    is_ct2_whisper_dir(path)                              # model.bin header says "WhisperSpec"

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
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

MODEL_BIN = "model.bin"
CONFIG_JSON = "config.json"
TOKENIZER_JSON = "tokenizer.json"
VOCABULARY_FILES = ("vocabulary.json", "vocabulary.txt")
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

# CTranslate2 activation ids (common_spec.Activation) -> transformers activation names.
_ACTIVATIONS = {0: "relu", 1: "gelu_pytorch_tanh", 2: "silu", 3: "gelu", 4: "quick_gelu", 5: "tanh"}

# Seconds between two timestamp tokens, and how many there are (<|0.00|> .. <|30.00|>).
TIMESTAMP_STEP_S = 0.02
NUM_TIMESTAMP_TOKENS = 1501
# The tokens after the language tokens, in the order of every Whisper vocabulary.
_TASK_TOKENS = ("<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>",
                ("<|nospeech|>", "<|nocaptions|>"), "<|notimestamps|>")
_LANGUAGE_TOKEN_RE = re.compile(r"^<\|([a-z]{2,3})\|>$")
# transformers' rule for a multilingual Whisper (generation_whisper, modeling_whisper).
_MULTILINGUAL_MIN_VOCAB = 51865


# ------------------------------------------------------------------------------------- model.bin

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


# ------------------------------------------------------------------------- vocabulary and token ids

@dataclass(frozen=True)
class WhisperTokenIds:
    """The ids of Whisper's special tokens, as placed in the model's vocabulary."""

    vocab_size: int
    """Number of tokens (51864 English-only, 51865 multilingual, 51866 large-v3)."""
    eot: int
    """``<|endoftext|>``: end of transcript; also the eos and pad token."""
    sot: int
    """``<|startoftranscript|>``: the decoder's first token."""
    language_ids: dict[str, int]
    """Language code ("en", "zh", ...) -> id of ``<|en|>`` ..., in vocabulary order."""
    translate: int
    """``<|translate|>``."""
    transcribe: int
    """``<|transcribe|>``."""
    start_of_lm: int
    """``<|startoflm|>``."""
    start_of_prev: int
    """``<|startofprev|>``: starts the previous-text prompt."""
    no_speech: int
    """``<|nospeech|>`` (``<|nocaptions|>`` in English-only vocabularies)."""
    no_timestamps: int
    """``<|notimestamps|>``."""
    timestamp_begin: int
    """``<|0.00|>``; timestamp ``i`` (``i * 0.02`` s) is ``timestamp_begin + i``, up to ``<|30.00|>``."""

    @property
    def is_multilingual(self) -> bool:
        """transformers' rule: a multilingual Whisper has at least 51865 tokens."""
        return self.vocab_size >= _MULTILINGUAL_MIN_VOCAB

    @property
    def special_ids(self) -> list[int]:
        """Every special (non-text, non-timestamp) id, from eot to no_timestamps."""
        return list(range(self.eot, self.no_timestamps + 1))


def read_ct2_vocabulary(path: str | Path) -> list[str]:
    """The tokens of ``vocabulary.json`` (a JSON list) or ``vocabulary.txt`` (one per line), by id."""
    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    json_path, txt_path = (directory / n for n in VOCABULARY_FILES)
    if json_path.is_file():
        try:
            tokens = json.loads(json_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{json_path}: not valid JSON ({e}).") from None
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ValueError(f"{json_path}: expected a JSON list of token strings.")
        return tokens
    if txt_path.is_file():
        tokens = txt_path.read_text(encoding="utf-8").split("\n")
        return tokens[:-1] if tokens and tokens[-1] == "" else tokens
    raise ValueError(f"{directory}: no vocabulary.json or vocabulary.txt; a faster-whisper directory holds "
                     f"one of them next to model.bin.")


def whisper_token_ids(vocabulary: list[str], source: str = "vocabulary") -> WhisperTokenIds:
    """Find and check the special tokens in a Whisper vocabulary.

    Raises:
        ValueError: a special token is missing or out of Whisper's fixed order, or the timestamp
            tokens are not ``<|0.00|>`` .. ``<|30.00|>`` at the end of the vocabulary.
    """
    def index(token: str) -> int:
        try:
            return vocabulary.index(token)
        except ValueError:
            raise ValueError(f"{source}: no {token} token; this is not a Whisper vocabulary.") from None

    eot, sot, translate = index("<|endoftext|>"), index("<|startoftranscript|>"), index("<|translate|>")
    if sot != eot + 1:
        raise ValueError(f"{source}: <|startoftranscript|> is at {sot}, expected right after <|endoftext|> "
                         f"({eot}).")
    languages = {}
    for i in range(sot + 1, translate):
        match = _LANGUAGE_TOKEN_RE.match(vocabulary[i])
        if match is None:
            raise ValueError(f"{source}: token {i} {vocabulary[i]!r} sits between <|startoftranscript|> and "
                             f"<|translate|>, where Whisper has only language tokens.")
        languages[match.group(1)] = i
    ids = [translate]
    for offset, names in enumerate(_TASK_TOKENS[1:], start=1):
        names = names if isinstance(names, tuple) else (names,)
        i = translate + offset
        if i >= len(vocabulary) or vocabulary[i] not in names:
            raise ValueError(f"{source}: expected {' or '.join(names)} at id {i} (after <|translate|> at "
                             f"{translate}), found {vocabulary[i] if i < len(vocabulary) else 'the end'!r}.")
        ids.append(i)
    timestamp_begin = ids[-1] + 1
    expected_timestamps = [f"<|{i * TIMESTAMP_STEP_S:.2f}|>" for i in range(NUM_TIMESTAMP_TOKENS)]
    if vocabulary[timestamp_begin:] != expected_timestamps:
        raise ValueError(f"{source}: the tokens after <|notimestamps|> ({timestamp_begin - 1}) should be "
                         f"exactly <|0.00|> .. <|30.00|> ({NUM_TIMESTAMP_TOKENS} tokens), ending the "
                         f"vocabulary; found {len(vocabulary) - timestamp_begin} tokens starting with "
                         f"{vocabulary[timestamp_begin:timestamp_begin + 2]}.")
    _, transcribe, start_of_lm, start_of_prev, no_speech, no_timestamps = ids
    return WhisperTokenIds(vocab_size=len(vocabulary), eot=eot, sot=sot, language_ids=languages,
                           translate=translate, transcribe=transcribe, start_of_lm=start_of_lm,
                           start_of_prev=start_of_prev, no_speech=no_speech, no_timestamps=no_timestamps,
                           timestamp_begin=timestamp_begin)


def default_whisper_token_ids(vocab_size: int) -> WhisperTokenIds:
    """The special ids every released Whisper has for ``vocab_size`` (used when no vocabulary file exists).

    English-only (51864): eot 50256; multilingual: eot 50257. Then sot, the languages in OpenAI's
    order (99, or 100 for large-v3's 51866), the 6 task tokens and 1501 timestamps.
    """
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    eot = 50256 + (vocab_size >= _MULTILINGUAL_MIN_VOCAB)
    num_languages = vocab_size - NUM_TIMESTAMP_TOKENS - len(_TASK_TOKENS) - (eot + 2)
    if not 1 <= num_languages <= len(LANGUAGES):
        raise ValueError(f"A Whisper vocabulary of {vocab_size} tokens does not fit the released layouts "
                         f"(51864-51866); add the model's vocabulary.json or vocabulary.txt.")
    vocabulary = [f"t{i}" for i in range(eot)] + ["<|endoftext|>", "<|startoftranscript|>"]
    vocabulary += [f"<|{code}|>" for code in list(LANGUAGES)[:num_languages]]
    vocabulary += [t if isinstance(t, str) else t[0] for t in _TASK_TOKENS]
    vocabulary += [f"<|{i * TIMESTAMP_STEP_S:.2f}|>" for i in range(NUM_TIMESTAMP_TOKENS)]
    return whisper_token_ids(vocabulary, f"the default {vocab_size}-token Whisper layout")


def read_whisper_token_ids(path: str | Path) -> WhisperTokenIds:
    """The checked special ids of the Whisper model directory ``path`` (from its vocabulary file)."""
    return whisper_token_ids(read_ct2_vocabulary(path), source=str(_vocabulary_file(path)))


def _vocabulary_file(path: str | Path) -> Path:
    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    for name in VOCABULARY_FILES:
        if (directory / name).is_file():
            return directory / name
    return directory / VOCABULARY_FILES[-1]


def load_ct2_tokenizer(path: str | Path):
    """A ``transformers.PreTrainedTokenizerFast`` for the Whisper model directory ``path``.

    Built from ``tokenizer.json``, plus the timestamp tokens ``<|0.00|>`` .. ``<|30.00|>`` (as non-special
    added tokens at their vocabulary ids; faster-whisper's tokenizer.json often lacks them). Decoding
    does not clean up tokenization spaces (as OpenAI's and faster-whisper's tokenizers). bos, eos, unk
    and pad are ``<|endoftext|>``; Whisper's special tokens are marked special (dropped by
    ``skip_special_tokens``). Every vocabulary token is checked to map to its vocabulary id.

    NOTE: tokenizer.json's post-processor adds ``<|startoftranscript|><|notimestamps|>`` ...
    ``<|endoftext|>``; encode plain text with ``add_special_tokens=False``.

    Raises:
        ValueError: tokenizer.json or the vocabulary is missing, or they disagree on an id.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    vocabulary = read_ct2_vocabulary(directory)
    vocab_source = _vocabulary_file(directory)
    ids = whisper_token_ids(vocabulary, source=str(vocab_source))
    tokenizer_path = directory / TOKENIZER_JSON
    if not tokenizer_path.is_file():
        raise ValueError(f"{directory}: no {TOKENIZER_JSON}; faster-whisper directories carry the Hugging "
                         f"Face tokenizer file next to model.bin (copy it from the original Whisper "
                         f"checkpoint).")
    try:
        spec = json.loads(tokenizer_path.read_text(encoding="utf-8"))
        added_tokens = spec["added_tokens"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{tokenizer_path}: not a tokenizers JSON file ({e!r}).") from None

    specials = set(ids.special_ids)
    present = set()
    for token in added_tokens:
        i = token["id"]
        if i >= len(vocabulary) or vocabulary[i] != token["content"]:
            raise ValueError(f"{tokenizer_path}: added token {token['content']!r} has id {i}, but "
                             f"{vocab_source} has {vocabulary[i] if i < len(vocabulary) else 'no token'!r} "
                             f"there.")
        token["special"] = i in specials          # Whisper's specials special, timestamps not
        present.add(i)
    for i in range(ids.timestamp_begin, ids.vocab_size):
        if i not in present:
            added_tokens.append({"id": i, "content": vocabulary[i], "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": True, "special": False})
    backend = Tokenizer.from_str(json.dumps(spec))
    eot = vocabulary[ids.eot]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=eot, eos_token=eot, unk_token=eot,
                                        pad_token=eot, clean_up_tokenization_spaces=False)
    got = tokenizer.convert_tokens_to_ids(vocabulary)
    if len(tokenizer) != len(vocabulary) or got != list(range(len(vocabulary))):
        bad = next((i for i, g in enumerate(got) if g != i), len(vocabulary))
        detail = (f"{vocabulary[bad]!r} (id {bad} in {vocab_source}) gets id {got[bad]}"
                  if bad < len(vocabulary)
                  else f"it has {len(tokenizer)} tokens, {vocab_source} {len(vocabulary)}")
        raise ValueError(f"{tokenizer_path} and {vocab_source} disagree: {detail}.")
    return tokenizer


# ------------------------------------------------------------------------------- CT2 -> transformers

# Per-layer CT2 module -> HF module(s). Fused modules are split by rows in the listed order.
_LAYER_MODULES = {
    "self_attention/linear_1": "self_attn.out_proj", "self_attention/layer_norm": "self_attn_layer_norm",
    "attention/linear_0": "encoder_attn.q_proj", "attention/linear_2": "encoder_attn.out_proj",
    "attention/layer_norm": "encoder_attn_layer_norm",
    "ffn/linear_0": "fc1", "ffn/linear_1": "fc2", "ffn/layer_norm": "final_layer_norm",
}
_FUSED_MODULES = {
    "self_attention/linear_0": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention/linear_1": ("encoder_attn.k_proj", "encoder_attn.v_proj"),
}
_GLOBAL_MODULES = {
    "encoder/conv1": "model.encoder.conv1", "encoder/conv2": "model.encoder.conv2",
    "encoder/position_encodings": "model.encoder.embed_positions",
    "encoder/layer_norm": "model.encoder.layer_norm",
    "decoder/embeddings": "model.decoder.embed_tokens",
    "decoder/position_encodings": "model.decoder.embed_positions",
    "decoder/layer_norm": "model.decoder.layer_norm",
}
_PARAMS = {"weight": "weight", "bias": "bias", "gamma": "weight", "beta": "bias", "encodings": "weight"}
_LAYER_RE = re.compile(r"^(encoder|decoder)/layer_(\d+)/(\w+/\w+)/(\w+)$")
_GLOBAL_RE = re.compile(r"^(\w+/\w+)/(\w+)$")
# HF keys with no bias: the k slice of a fused CT2 bias is zero and dropped.
_NO_BIAS = ("self_attn.k_proj", "encoder_attn.k_proj")
_ENCODER_LAYER_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
                          "self_attn_layer_norm", "fc1", "fc2", "final_layer_norm")
_DECODER_LAYER_MODULES = _ENCODER_LAYER_MODULES + (
    "encoder_attn.q_proj", "encoder_attn.k_proj", "encoder_attn.v_proj", "encoder_attn.out_proj",
    "encoder_attn_layer_norm")

# Scalar flags: those that must hold one value for transformers' Whisper to compute the same thing.
_REQUIRED_FLAGS = {"decoder/pre_norm": 1, "decoder/alibi": 0, "decoder/start_from_zero_embedding": 0,
                   "encoder/multi_query_attention": 0, "decoder/multi_query_attention": 0}
# Flags read elsewhere (num_heads, activation, scale_embeddings) or that do not change the math:
# CT2's own alignment defaults (the real heads are in config.json), ALiBi options with ALiBi off.
_KNOWN_FLAGS = {"encoder/num_heads", "decoder/num_heads", "decoder/activation", "decoder/scale_embeddings",
                "decoder/alignment_heads", "decoder/alignment_layer", "decoder/alibi_use_positive_positions",
                "decoder/scale_alibi"}


@dataclass(frozen=True)
class _Placement:
    """Where one HF tensor comes from."""

    hf_name: str
    """transformers parameter name, e.g. "model.decoder.layers.0.self_attn.q_proj.weight"."""
    ct2_name: str
    """CT2 variable name, e.g. "decoder/layer_0/self_attention/linear_0/weight"."""
    rows: tuple[int, int] | None
    """Row range [start, end) of a fused CT2 tensor, or None for the whole tensor."""


def ct2_whisper_to_hf(model: CT2Model, dtype: torch.dtype) -> tuple[Any, Iterator[tuple[str, torch.Tensor]]]:
    """transformers' ``WhisperConfig`` and the weights of ``model`` under HF parameter names.

    Floating tensors are cast to ``dtype`` (a tensor already in ``dtype`` may share storage with
    ``model.variables``). ``proj_out.weight`` is not yielded: it is tied to ``embed_tokens``
    (``tie_word_embeddings``) when the CT2 projection aliases or equals the embeddings; otherwise
    it is yielded and the config unties it. Token ids: decoder_start = ``<|startoftranscript|>``;
    eos, pad and bos = ``<|endoftext|>`` (as the tokenizer's; transformers' multilingual configs do the
    same, its tiny.en config puts sot in bos). The config also carries what
    ``ct2_whisper_generation_config`` needs: ``alignment_heads``, ``lang_to_id``, ``task_to_id``,
    ``no_timestamps_token_id``, ``prev_sot_token_id``, ``is_multilingual``.

    Raises:
        ValueError: not a WhisperSpec model, a flag transformers' Whisper cannot reproduce, a CT2
            variable the mapping does not place, or an HF parameter no variable provides.
    """
    from transformers import WhisperConfig

    source = " + ".join(str(f) for f in model.files)
    if model.spec_name != WHISPER_SPEC:
        raise ValueError(f"{source}: spec {model.spec_name or '(none, binary version 1)'!r} is not "
                         f"{WHISPER_SPEC}; only CTranslate2 Whisper models map to transformers' Whisper.")
    activation, scale_embedding = _check_flags(model, source)
    placements, tie_word_embeddings = _plan(model, source)
    variables = model.variables

    encoder_layers, decoder_layers = (_layer_counts(model)[stack] for stack in ("encoder", "decoder"))
    if not encoder_layers or not decoder_layers:
        raise ValueError(f"{source}: {encoder_layers} encoder and {decoder_layers} decoder layers; a Whisper "
                         f"model has at least one of each.")
    embeddings = variables["decoder/embeddings/weight"]                  # [vocab, d_model]
    conv1 = variables["encoder/conv1/weight"]                            # [d_model, mel_bins, 3]
    vocab_size, d_model = embeddings.shape
    ids = _token_ids(model, vocab_size)
    ct2_config = model.config
    alignment_heads = ct2_config.get("alignment_heads") or [
        [layer, head] for layer in range(decoder_layers // 2, decoder_layers)
        for head in range(int(model.flags["decoder/num_heads"]))]      # OpenAI's default: upper half
    config = WhisperConfig(
        vocab_size=vocab_size, d_model=d_model, num_mel_bins=conv1.shape[1],
        encoder_layers=encoder_layers, decoder_layers=decoder_layers,
        encoder_attention_heads=int(model.flags["encoder/num_heads"]),
        decoder_attention_heads=int(model.flags["decoder/num_heads"]),
        encoder_ffn_dim=variables["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=variables["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=variables["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=variables["decoder/position_encodings/encodings"].shape[0],
        activation_function=activation, scale_embedding=scale_embedding,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=ids.eot, eos_token_id=ids.eot, pad_token_id=ids.eot, decoder_start_token_id=ids.sot,
        suppress_tokens=list(ct2_config.get("suppress_ids", [])),
        begin_suppress_tokens=list(ct2_config.get("suppress_ids_begin", [220, ids.eot])),
        alignment_heads=[list(h) for h in alignment_heads],
        lang_to_id={f"<|{code}|>": i for code, i in ids.language_ids.items()},
        task_to_id={"translate": ids.translate, "transcribe": ids.transcribe},
        no_timestamps_token_id=ids.no_timestamps, prev_sot_token_id=ids.start_of_prev,
        is_multilingual=ids.is_multilingual,
    )
    for what in ("encoder", "decoder"):
        heads = getattr(config, f"{what}_attention_heads")
        if heads <= 0 or d_model % heads:
            raise ValueError(f"{source}: {what}/num_heads = {heads} does not divide d_model = {d_model}.")

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for p in placements:
            tensor = variables[p.ct2_name]
            if p.rows is not None:
                tensor = tensor[p.rows[0]:p.rows[1]]
            yield p.hf_name, tensor.to(dtype) if tensor.is_floating_point() else tensor

    return config, weights()


def ct2_whisper_generation_config(config):
    """A ``transformers.GenerationConfig`` for ``WhisperForConditionalGeneration.generate``.

    ``config`` comes from ``ct2_whisper_to_hf``. Greedy, no timestamps, OpenAI's limits
    (``max_initial_timestamp_index`` 50, ``max_length`` = max target positions); ``lang_to_id`` and
    ``task_to_id`` only for multilingual models (transformers refuses them on English-only ones).
    """
    from transformers import GenerationConfig

    extra = {}
    if config.is_multilingual:
        extra = {"lang_to_id": dict(config.lang_to_id), "task_to_id": dict(config.task_to_id)}
    return GenerationConfig(
        decoder_start_token_id=config.decoder_start_token_id, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        suppress_tokens=list(config.suppress_tokens or []),
        begin_suppress_tokens=list(config.begin_suppress_tokens or []),
        alignment_heads=[list(h) for h in config.alignment_heads],
        no_timestamps_token_id=config.no_timestamps_token_id, prev_sot_token_id=config.prev_sot_token_id,
        is_multilingual=config.is_multilingual, max_initial_timestamp_index=50,
        max_length=config.max_target_positions, return_timestamps=False, **extra)


def _check_flags(model: CT2Model, source: str) -> tuple[str, bool]:
    """Check the scalar flags; return (HF activation name, scale_embedding)."""
    for name, value in model.flags.items():
        if name in _REQUIRED_FLAGS:
            if value != _REQUIRED_FLAGS[name]:
                raise ValueError(f"{source}: flag {name} = {value}; transformers' Whisper needs "
                                 f"{_REQUIRED_FLAGS[name]}, so this model cannot be mapped.")
        elif name not in _KNOWN_FLAGS and not name.endswith("/keep_in_float32"):
            known = ", ".join(sorted(_KNOWN_FLAGS | set(_REQUIRED_FLAGS)))
            raise ValueError(f"{source}: scalar variable {name} = {value} is not one the Whisper mapping "
                             f"knows ({known}); a newer CTranslate2 spec may need support here.")
    for name in ("encoder/num_heads", "decoder/num_heads", "decoder/activation"):
        if name not in model.flags:
            raise ValueError(f"{source}: the scalar flag {name} is missing.")
    activation_id = int(model.flags["decoder/activation"])
    if activation_id not in _ACTIVATIONS:
        raise ValueError(f"{source}: decoder/activation = {activation_id} is not a CTranslate2 activation id "
                         f"({_ACTIVATIONS}).")
    return _ACTIVATIONS[activation_id], bool(model.flags.get("decoder/scale_embeddings", 0))


def _plan(model: CT2Model, source: str) -> tuple[list[_Placement], bool]:
    """Map every CT2 variable to HF names, checking nothing is left over or missing; (placements, tied)."""
    variables = model.variables
    placements: list[_Placement] = []
    tie_word_embeddings = True
    for name, tensor in variables.items():
        if name.startswith("decoder/projection/"):
            tie_word_embeddings &= _check_projection(model, name, source)
            if name == "decoder/projection/weight" and not tie_word_embeddings:
                placements.append(_Placement("proj_out.weight", name, None))
            continue
        layer = _LAYER_RE.match(name)
        if layer is not None:
            stack, index, module, param = layer.groups()
            prefix = f"model.{stack}.layers.{index}."
            if module in _FUSED_MODULES and param in ("weight", "bias"):
                parts = _FUSED_MODULES[module]
                rows = tensor.shape[0] // len(parts)
                if rows * len(parts) != tensor.shape[0]:
                    raise ValueError(f"{source}: {name} has {tensor.shape[0]} rows, not a multiple of "
                                     f"{len(parts)} (fused {', '.join(parts)}).")
                for k, hf_module in enumerate(parts):
                    span = (k * rows, (k + 1) * rows)
                    if param == "bias" and hf_module in _NO_BIAS:
                        if torch.count_nonzero(tensor[span[0]:span[1]]):
                            raise ValueError(f"{source}: {name} rows {span[0]}:{span[1]} (the key bias) "
                                             f"are not zero, but transformers' Whisper {hf_module} has no "
                                             f"bias.")
                        continue
                    placements.append(_Placement(f"{prefix}{hf_module}.{param}", name, span))
                continue
            if module in _LAYER_MODULES and param in _PARAMS:
                hf_name = f"{prefix}{_LAYER_MODULES[module]}.{_PARAMS[param]}"
                placements.append(_Placement(hf_name, name, None))
                continue
        top = _GLOBAL_RE.match(name)
        if top is not None and top.group(1) in _GLOBAL_MODULES and top.group(2) in _PARAMS:
            hf_name = f"{_GLOBAL_MODULES[top.group(1)]}.{_PARAMS[top.group(2)]}"
            placements.append(_Placement(hf_name, name, None))
            continue
        raise ValueError(f"{source}: variable {name} ({list(tensor.shape)}) has no place in transformers' "
                         f"WhisperForConditionalGeneration; this CTranslate2 Whisper variant is not "
                         f"supported.")

    expected = _expected_hf_names(model, tie_word_embeddings)
    by_name = {p.hf_name: p for p in placements}
    unexpected = [p for p in placements if p.hf_name not in expected]
    if unexpected:
        p = unexpected[0]
        raise ValueError(f"{source}: variable {p.ct2_name} maps to {p.hf_name}, which transformers' "
                         f"WhisperForConditionalGeneration does not have.")
    missing = sorted(expected - set(by_name))
    if missing:
        raise ValueError(f"{source}: no CT2 variable provides {len(missing)} transformers parameter(s), e.g. "
                         f"{missing[:3]}; the file lacks tensors a Whisper model needs.")
    return placements, tie_word_embeddings


def _check_projection(model: CT2Model, name: str, source: str) -> bool:
    """Whether ``decoder/projection/*`` is the tied output projection (True) or a separate weight (False)."""
    tensor = model.variables[name]
    if name == "decoder/projection/weight":
        embeddings = model.variables.get("decoder/embeddings/weight")
        return embeddings is not None and (tensor is embeddings or torch.equal(tensor, embeddings))
    if name == "decoder/projection/bias" and not torch.count_nonzero(tensor):
        return True                     # a zero bias: transformers' proj_out has none
    raise ValueError(f"{source}: {name} has no place in transformers' Whisper (proj_out has only a weight).")


def _expected_hf_names(model: CT2Model, tie_word_embeddings: bool) -> set[str]:
    """The parameter names of ``WhisperForConditionalGeneration`` for the layer counts in ``model``."""
    names = {f"{module}.{param}" for module in _GLOBAL_MODULES.values() for param in ("weight", "bias")
             if not module.endswith(("embed_positions", "embed_tokens")) or param == "weight"}
    layer_counts = _layer_counts(model)
    for stack, modules in (("encoder", _ENCODER_LAYER_MODULES), ("decoder", _DECODER_LAYER_MODULES)):
        for i in range(layer_counts[stack]):
            for module in modules:
                names.add(f"model.{stack}.layers.{i}.{module}.weight")
                if module not in _NO_BIAS:
                    names.add(f"model.{stack}.layers.{i}.{module}.bias")
    if not tie_word_embeddings:
        names.add("proj_out.weight")
    return names


def _layer_counts(model: CT2Model) -> dict[str, int]:
    """Number of encoder and decoder layers: one more than the highest ``layer_<i>`` index of each."""
    counts = {"encoder": 0, "decoder": 0}
    for m in filter(None, map(_LAYER_RE.match, model.variables)):
        counts[m.group(1)] = max(counts[m.group(1)], int(m.group(2)) + 1)
    return counts


def _token_ids(model: CT2Model, vocab_size: int) -> WhisperTokenIds:
    """Special ids from the directory's vocabulary file, else the released layout for ``vocab_size``."""
    vocab_file = _vocabulary_file(model.path)
    if not vocab_file.is_file():
        return default_whisper_token_ids(vocab_size)
    ids = read_whisper_token_ids(model.path)
    if ids.vocab_size != vocab_size:
        raise ValueError(f"{vocab_file} has {ids.vocab_size} tokens but decoder/embeddings/weight has "
                         f"{vocab_size} rows: the vocabulary belongs to another model.")
    return ids
