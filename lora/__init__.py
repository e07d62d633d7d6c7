"""Multi-LoRA serving: PEFT adapter reading, slots, batched adapter compute."""

from lora.errors import InvalidLoRAAdapterError, LoRAAdapterError, LoRAAdapterNotFoundError
from lora.request import LoRARequest

NO_LORA = -1
"""``lora_slot`` of a token or request that runs the base model only."""

__all__ = ["InvalidLoRAAdapterError", "LoRAAdapterError", "LoRAAdapterNotFoundError", "LoRARequest", "NO_LORA"]
