"""Turn a GGUF file (Llama, Qwen2, Qwen3, Qwen3-MoE, Gemma 3, Mixtral) into a cached Hugging Face checkpoint
directory.

Parsing a GGUF is slow in pure Python (transformers' tokenizer and model loads decode every entry on
each load), so the first use converts the file once into
``cache_dir()/converted/<stem>-<key>/`` holding ``config.json``, the tokenizer files and
``model.safetensors`` (float32, dequantized, q/k rows in HF order; files of ``SHARD_BYTES`` and an index
where larger, so the conversion never holds the whole model in memory); every later use reads that
directory like any HF checkpoint.

Conversion algorithm:
  1. ``gguf.GGUFReader`` memory-maps the file (tensor bytes are read lazily).
  2. The config is rebuilt from the metadata the way transformers' ``load_gguf_checkpoint`` does
     (same key renames, ``tie_word_embeddings`` = no ``output.weight``), but without decoding the
     49k-entry vocabulary arrays, which is what makes transformers slow; what llama.cpp leaves implicit
     per architecture (Gemma 3's layer pattern and rope bases, Qwen3-MoE's dense layers, ...) is added by
     ``gguf_arch``, which also maps the tensor names. A file lacking tensors its model needs is refused
     before anything is written (``gguf_arch.check_tensors``).
  3. Each tensor is dequantized with ``gguf.quants.dequantize`` to float32; for Llama and Mixtral,
     ``attn_q`` / ``attn_k`` rows are un-permuted from llama.cpp's rope layout (``_unpermute_rope_rows``);
     Gemma's norms lose the 1 llama.cpp adds; stacked experts become one HF tensor per expert.
  4. The tokenizer is built by transformers (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``).
  5. Everything is written to a temporary directory that is renamed into place
     (``atomic_cache.atomic_entry``), so a crash, a full disk or a concurrent process never leaves
     a half-written cache (the loser of a race drops its copy; a crash's leftover is removed later).

NOTE: the cache key is the file's absolute path, size and mtime: editing or replacing the file
creates a new entry; old entries are never deleted automatically.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from engine import envs
from engine.loader.atomic_cache import atomic_entry
from engine.loader.gguf_arch import GgufArch, GgufFacts, arch_for, check_tensors, hf_tensors, is_ignored

# Bump when the layout of a converted directory changes: old entries are then ignored.
CACHE_FORMAT_VERSION = 3
SOURCE_FILE = "chorus_gguf_source.json"
_REQUIRED_FILES = ("config.json", "tokenizer_config.json", SOURCE_FILE)
_WEIGHTS, _WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
SHARD_BYTES = 2 << 30
"""Float32 bytes per converted weight file: the conversion holds one file's tensors in memory at a time."""


@dataclass
class GgufMetadata:
    """What the conversion needs from a GGUF header (no tensor data)."""

    architecture: str
    """``general.architecture``, e.g. "llama"."""
    config_dict: dict[str, Any]
    """The HF config as a dict (``model_type`` included), as transformers would build it."""
    tensor_names: list[str]
    """GGUF tensor names, e.g. "blk.0.attn_q.weight"."""
    arch: GgufArch
    """How this architecture's tensors and config map to HF (Mixtral for a ``llama`` file with experts)."""


def converted_dir_for(gguf_path: Path) -> Path:
    """The cache directory for ``gguf_path`` (it may not exist yet); keyed by path, size and mtime."""
    gguf_path = Path(gguf_path).resolve()
    st = gguf_path.stat()
    key = f"v{CACHE_FORMAT_VERSION}|{gguf_path}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return envs.cache_dir() / "converted" / f"{gguf_path.stem}-{digest}"


def is_converted(out_dir: Path) -> bool:
    """True when ``out_dir`` is a complete conversion (it only ever appears complete, by rename)."""
    weights = (out_dir / _WEIGHTS).is_file() or (out_dir / _WEIGHTS_INDEX).is_file()
    return weights and all((out_dir / name).is_file() for name in _REQUIRED_FILES)


def ensure_converted(gguf_path: Path) -> Path:
    """Return the converted HF directory of ``gguf_path``, converting it on first use.

    Raises:
        CacheWriteError: the disk holding ``CHORUS_CACHE`` is full (nothing half-written is left).
        ValueError: the file's architecture is not supported or it lacks tensors its model needs (one line,
            before anything is printed or written).
    """
    import gguf

    gguf_path = Path(gguf_path).resolve()
    out_dir = converted_dir_for(gguf_path)
    if is_converted(out_dir):
        return out_dir
    start = time.perf_counter()
    reader = gguf.GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    print(f"Chorus: converting {gguf_path.name} into a cached checkpoint at {out_dir} "
          f"(first use only)...", file=sys.stderr, flush=True)
    with atomic_entry(out_dir, f"the converted checkpoint of {gguf_path.name}", is_converted) as tmp_dir:
        _convert_into(gguf_path, tmp_dir, reader, meta)
    print(f"Chorus: converted {gguf_path.name} in {time.perf_counter() - start:.1f} s.",
          file=sys.stderr, flush=True)
    return out_dir


def read_metadata(reader) -> GgufMetadata:
    """Build the HF config dict from a ``gguf.GGUFReader``, mirroring transformers' GGUF loader.

    Raises:
        ValueError: the architecture is not supported, or the file lacks tensors its model needs (one line
            naming them).
    """
    from transformers import integrations as hf_integrations

    config_mapping = hf_integrations.GGUF_CONFIG_MAPPING
    # NOTE: GGUF_CONFIG_DEFAULTS_MAPPING is absent in older transformers.
    defaults_mapping = getattr(hf_integrations, "GGUF_CONFIG_DEFAULTS_MAPPING", {})
    fields = reader.fields
    architecture = _scalar(fields["general.architecture"])
    # NOTE: only this architecture's own keys are decoded (never the vocabulary arrays: fast).
    metadata = {key: _scalar(field) for key, field in fields.items() if key.startswith(f"{architecture}.")}
    arch = arch_for(architecture, metadata)
    tensor_names = [t.name for t in reader.tensors]
    cfg: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in defaults_mapping.get(arch.config_prefix, {}).items():
        cfg.setdefault(key, value)
    for gguf_key, field in fields.items():
        prefix, _, rest = gguf_key.partition(".")
        if prefix == architecture:
            renames = config_mapping.get(arch.config_prefix, {})
        else:
            renames = config_mapping.get(prefix, {}) if prefix in ("general", "tokenizer") else {}
        hf_key = renames.get(rest)
        if hf_key is None or hf_key == -1:
            continue  # NOTE: skipping before decoding keeps the vocabulary arrays undecoded (fast)
        cfg[hf_key] = _scalar(field)
    if "vocab_size" not in cfg and "tokenizer.ggml.tokens" in fields:
        cfg["vocab_size"] = len(fields["tokenizer.ggml.tokens"].data)
    cfg["model_type"] = arch.model_type
    if arch.architectures:
        cfg["architectures"] = list(arch.architectures)
    arch.finish_config(cfg, GgufFacts(architecture, metadata, tuple(tensor_names)))
    check_tensors(arch, int(cfg["num_hidden_layers"]), tuple(tensor_names))
    return GgufMetadata(architecture=architecture, config_dict=cfg, tensor_names=tensor_names, arch=arch)


def build_config(meta: GgufMetadata):
    """The ``transformers.PretrainedConfig`` for ``meta`` (e.g. a ``LlamaConfig``)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[meta.config_dict["model_type"]].from_dict(dict(meta.config_dict))


def iter_dequantized(reader, meta: GgufMetadata) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every tensor of the file, in HF layout."""
    from gguf.quants import dequantize

    permutes = meta.arch.permutes_qk
    num_heads = int(meta.config_dict["num_attention_heads"])
    num_kv_heads = int(meta.config_dict.get("num_key_value_heads") or num_heads)
    for t in reader.tensors:
        if is_ignored(t.name):
            continue
        w = dequantize(t.data, t.tensor_type)  # [out, in] (numpy order; experts [n_expert, out, in]), float32
        if permutes and ".attn_q." in t.name:
            w = _unpermute_rope_rows(w, num_heads)
        elif permutes and ".attn_k." in t.name:
            w = _unpermute_rope_rows(w, num_kv_heads)
        for hf_name, part in hf_tensors(meta.arch, t.name, w):
            # NOTE: copy: F32 tensors come back as read-only views of the memory-mapped file.
            yield hf_name, torch.from_numpy(np.array(part, dtype=np.float32, copy=True))


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rope pairs interleaved per head -> HF's half split).

    llama.cpp stores each head's rows as (dim/2, 2) pairs; HF stores them as (2, dim/2).
    ``w`` is [n_head * head_dim, in] (or [n_head * head_dim] for a bias).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert_into(gguf_path: Path, out_dir: Path, reader, meta: GgufMetadata) -> None:
    """Write config.json, model.safetensors, the tokenizer and the source record into ``out_dir`` (``reader``:
    the file's ``gguf.GGUFReader``; ``meta``: its ``read_metadata``)."""
    from transformers import AutoTokenizer

    build_config(meta).save_pretrained(out_dir)
    _write_weights(iter_dequantized(reader, meta), out_dir)
    # NOTE: a zero-stride stand-in: only the names (and the expert count) are wanted, not the values.
    tensor_types = {hf_name: t.tensor_type.name for t in reader.tensors if not is_ignored(t.name)
                    for hf_name, _ in hf_tensors(meta.arch, t.name, _stand_in(t.data.shape))}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
    _load_tokenizer_as_saved(out_dir)
    st = gguf_path.stat()
    source = {"gguf_path": str(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
              "format_version": CACHE_FORMAT_VERSION, "architecture": meta.architecture,
              "tensor_types": tensor_types}
    (out_dir / SOURCE_FILE).write_text(json.dumps(source, indent=2))


def _write_weights(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path) -> None:
    """``model.safetensors``, or where the tensors pass ``SHARD_BYTES``, ``model-NNNNN.safetensors`` files of
    at most that much each (a tensor larger alone gets its own) and ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    files: list[str] = []
    weight_map: dict[str, str] = {}     # tensor name -> its file
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total_bytes = 0

    def flush() -> None:
        files.append(f"model-{len(files) + 1:05d}.safetensors")
        save_file(pending, str(out_dir / files[-1]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(pending, files[-1]))
        pending.clear()

    for name, tensor in tensors:
        if pending and pending_bytes + tensor.nbytes > SHARD_BYTES:
            flush()
            pending_bytes = 0
        pending[name] = tensor
        pending_bytes += tensor.nbytes
        total_bytes += tensor.nbytes
    if not files:
        save_file(pending, str(out_dir / _WEIGHTS), metadata={"format": "pt"})
        return
    flush()
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out_dir / _WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))


def _stand_in(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array of ``shape`` that takes no memory (zero strides)."""
    return np.broadcast_to(np.float32(0), shape)


def _load_tokenizer_as_saved(out_dir: Path) -> None:
    """Make ``out_dir``'s tokenizer load as the backend transformers built from the GGUF metadata
    (``tokenizer.json`` verbatim), not as its model class rebuilt: a class such as ``Qwen2Tokenizer`` or
    ``GemmaTokenizer`` re-derives its own pre-tokenizer and unknown token on load, which a file's own
    vocabulary need not share (a byte-level BPE in a ``gemma3`` file, a ``default`` pre-tokenizer in a
    ``qwen3`` one)."""
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def stored_tensor_types(converted_dir: Path) -> dict[str, str]:
    """HF tensor name -> the GGUF type it was stored as (e.g. "Q4_1", "Q8_0", "F32"), for a converted dir."""
    source = json.loads((Path(converted_dir) / SOURCE_FILE).read_text())
    return dict(source.get("tensor_types", {}))


def _scalar(field) -> Any:
    """Decode a scalar (or string) GGUF metadata field to a Python value."""
    value = field.contents()
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return value
