"""Reading checkpoints and tokenizers: HF directories (safetensors / .bin), GGUF files and
faster-whisper (CTranslate2) Whisper directories.

Public API (the model runner calls these)::

    resolved = resolve_model(model, tokenizer)        # where is it, what kind
    config = load_config(resolved)                    # transformers.PretrainedConfig
    for name, tensor in iter_weights(resolved, dtype) # HF parameter names, cast to dtype
    tokenizer = load_tokenizer(resolved, chat_template)

A GGUF model is converted once into a cached HF directory (``gguf_loader.ensure_converted``), after
which every call reads that directory exactly like an HF checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from engine.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from engine.loader.resolve import ResolvedModel, resolve_model
from engine.loader.tokenizer import load_tokenizer, read_chat_template

__all__ = [
    "DEFAULT_MODEL_NAME", "ResolvedModel", "checkpoint_dir", "checkpoint_dtype", "default_model_path",
    "iter_weights", "load_config", "load_tokenizer", "read_chat_template", "resolve_model",
]


def checkpoint_dir(resolved: ResolvedModel) -> Path:
    """The HF checkpoint dir of ``resolved``: itself, or the GGUF's converted cache (made on first use)."""
    if resolved.kind == "gguf":
        from engine.loader.gguf_loader import ensure_converted

        return ensure_converted(resolved.path)
    return resolved.path


def load_config(resolved: ResolvedModel, trust_remote_code: bool = False):
    """The ``transformers.PretrainedConfig`` of ``resolved`` (for a GGUF: the config transformers builds;
    for a CTranslate2 Whisper: the ``WhisperConfig`` its tensors describe)."""
    from transformers import AutoConfig

    if resolved.kind == "ct2":
        from engine.loader.ct2 import ct2_whisper_to_hf, read_ct2_model
        return ct2_whisper_to_hf(read_ct2_model(resolved.path), torch.float32)[0]
    return AutoConfig.from_pretrained(str(checkpoint_dir(resolved)), trust_remote_code=trust_remote_code)


def iter_weights(resolved: ResolvedModel, dtype: torch.dtype, device: torch.device | str = "cpu",
                 shard_of=None, keep_dtype=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_parameter_name, tensor)`` for every weight, floating tensors cast to ``dtype``.

    ``lm_head.weight`` is never yielded when the config ties it to the embeddings. Safetensors
    tensors are read straight onto ``device`` (and cast there). ``shard_of`` (tensor parallelism:
    name -> ``engine.distributed.sharding.Shard`` or None) cuts each tensor to this rank's range as it
    is read (GGUF: from its converted directory, the same way; a CTranslate2 Whisper file is converted whole
    in memory, then cut). ``keep_dtype(name, tensor)`` true: that tensor keeps its stored dtype.
    """
    from engine.loader.safetensors_loader import iter_checkpoint_tensors

    if resolved.kind == "ct2":
        from engine.loader.ct2 import ct2_whisper_to_hf, read_ct2_model
        from engine.loader.safetensors_loader import narrow_to
        _, weights = ct2_whisper_to_hf(read_ct2_model(resolved.path), dtype)
        return ((name, narrow_to(tensor, shard_of(name) if shard_of else None).to(device)) for name, tensor in weights)
    model_dir = checkpoint_dir(resolved)
    tied = bool(getattr(load_config(resolved), "tie_word_embeddings", False))
    return iter_checkpoint_tensors(model_dir, dtype, skip_lm_head=tied, device=device, shard_of=shard_of,
                                   keep_dtype=keep_dtype)


def checkpoint_dtype(resolved: ResolvedModel) -> torch.dtype:
    """The dtype the checkpoint was saved in (config.json ``dtype``/``torch_dtype``); float32 for GGUF."""
    if resolved.kind == "gguf":
        return torch.float32
    if resolved.kind == "ct2":
        return torch.float16   # the released faster-whisper models (int8 ones dequantize to it too)
    from engine.loader.safetensors_loader import config_dtype

    return config_dtype(resolved.path)
