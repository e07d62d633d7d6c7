"""Read a Hugging Face checkpoint directory: its config, its dtype, and its weights one tensor at a time.

Weight files, in order of preference:
  1. ``model.safetensors.index.json`` (sharded; each shard opened lazily with ``safe_open``);
  2. ``model.safetensors``;
  3. any other ``*.safetensors`` in the directory (sorted by name);
  4. ``pytorch_model.bin.index.json`` / ``pytorch_model.bin`` (``torch.load``, weights only, mmap).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from engine.distributed.sharding import Shard
from engine.dtypes import TORCH_DTYPES

ShardOf = Callable[[str], Optional[Shard]]
"""Checkpoint tensor name -> the range this rank reads (None: the whole tensor)."""

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

# Buffers some old checkpoints saved that every model recomputes; never yielded.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class WeightFiles:
    """The weight files of one checkpoint directory."""

    format: str
    """"safetensors" or "bin" (a pickled torch state dict)."""
    paths: list[Path]
    """Files to read, in order; every tensor name appears in exactly one of them."""


def find_weight_files(model_dir: Path) -> WeightFiles:
    """Pick the weight files of ``model_dir`` (see the module docstring for the order)."""
    if (model_dir / SAFE_INDEX).is_file():
        return WeightFiles("safetensors", _shards_from_index(model_dir, SAFE_INDEX))
    if (model_dir / SAFE_SINGLE).is_file():
        return WeightFiles("safetensors", [model_dir / SAFE_SINGLE])
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        return WeightFiles("safetensors", others)
    if (model_dir / BIN_INDEX).is_file():
        return WeightFiles("bin", _shards_from_index(model_dir, BIN_INDEX))
    if (model_dir / BIN_SINGLE).is_file():
        return WeightFiles("bin", [model_dir / BIN_SINGLE])
    raise ValueError(
        f"No weights in {str(model_dir)!r}: expected model.safetensors, a sharded "
        f"model.safetensors.index.json, or pytorch_model.bin.")


def iter_checkpoint_tensors(model_dir: Path, dtype: torch.dtype, skip_lm_head: bool,
                            device: torch.device | str = "cpu", shard_of: Optional[ShardOf] = None,
                            keep_dtype: Optional[Callable[[str, torch.Tensor], bool]] = None
                            ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, floating tensors cast to ``dtype``.

    Args:
        model_dir: a Hugging Face checkpoint directory.
        dtype: the dtype floating-point tensors are cast to (integer tensors are left alone).
        skip_lm_head: drop ``lm_head.weight`` (the model ties it to the embeddings).
        device: where safetensors tensors are materialized (e.g. "cuda": read straight to the
            GPU, then cast there); pickled ``.bin`` checkpoints are always read on the CPU.
        shard_of: tensor parallelism: the range of each tensor this rank keeps; safetensors files
            read only that range (``get_slice``), so no rank holds the whole model.
        keep_dtype: tensors it accepts keep their stored dtype (a quantized checkpoint's weights and
            scales: ``engine.quantization.slices.QuantizedTensorStream.belongs``).
    """
    files = find_weight_files(model_dir)
    for path in files.paths:
        for name, tensor in _iter_file(path, files.format, str(device), shard_of):
            if name.endswith(_SKIPPED_SUFFIXES) or (skip_lm_head and name == "lm_head.weight"):
                continue
            if (tensor.is_floating_point() and tensor.dtype != dtype
                    and (keep_dtype is None or not keep_dtype(name, tensor))):
                tensor = tensor.to(dtype)
            yield name, tensor


def config_dtype(model_dir: Path) -> torch.dtype:
    """The checkpoint's dtype from config.json (``dtype`` or the older ``torch_dtype``); float32 if absent."""
    with open(model_dir / "config.json") as f:
        cfg = json.load(f)
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if name is None:
        text = cfg.get("text_config") or {}
        name = text.get("dtype") or text.get("torch_dtype")
    if isinstance(name, str):
        name = name.removeprefix("torch.")
    return TORCH_DTYPES.get(name, torch.float32) if name else torch.float32


def _shards_from_index(model_dir: Path, index_name: str) -> list[Path]:
    """The distinct shard files named by an index json, in first-appearance order."""
    with open(model_dir / index_name) as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    shards = list(dict.fromkeys(weight_map.values()))
    missing = [s for s in shards if not (model_dir / s).is_file()]
    if missing:
        raise ValueError(f"{index_name} in {str(model_dir)!r} names missing shard files: {missing}")
    return [model_dir / s for s in shards]


def _iter_file(path: Path, fmt: str, device: str = "cpu", shard_of: Optional[ShardOf] = None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors of one file (each cut to ``shard_of(name)`` when given); safetensors files are
    read one tensor (or range) at a time, on ``device``."""
    if fmt == "safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():
                shard = shard_of(name) if shard_of is not None else None
                if shard is None:
                    yield name, f.get_tensor(name)
                else:
                    part = f.get_slice(name)
                    yield name, part[shard.start:shard.stop] if shard.dim == 0 else part[:, shard.start:shard.stop]
    else:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        for name, tensor in state.items():   # memory-mapped: slicing reads only the shard's pages
            yield name, narrow_to(tensor, shard_of(name) if shard_of is not None else None)


def narrow_to(tensor: torch.Tensor, shard: Optional[Shard]) -> torch.Tensor:
    """A copy of ``shard``'s range of ``tensor`` (the tensor itself when ``shard`` is None)."""
    return tensor if shard is None else tensor.narrow(shard.dim, shard.start, shard.size).clone()
