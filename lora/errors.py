"""Errors raised while reading, checking and loading LoRA adapters.

Both are ``ValueError``s (bad user input), so callers that only know ``ValueError`` still
report them as client errors. The server maps ``LoRAAdapterNotFoundError`` to 404 and
``InvalidLoRAAdapterError`` to 400; at start-up either one stops the server with its message.
"""

from __future__ import annotations


class LoRAAdapterError(ValueError):
    """Base class of every adapter error; the message names the adapter and what to fix."""


class LoRAAdapterNotFoundError(LoRAAdapterError):
    """The adapter's path, ``adapter_config.json`` or weights file is missing or unreadable,
    or the adapter name is unknown / being unloaded (HTTP 404)."""


class InvalidLoRAAdapterError(LoRAAdapterError):
    """The adapter exists but cannot be served: unsupported options (DoRA, modules_to_save,
    bias, embedding or lm_head LoRA), rank above ``max_lora_rank``, unknown target modules, or
    tensors whose shapes do not fit the base model (HTTP 400)."""
