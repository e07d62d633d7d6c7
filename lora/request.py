"""``LoRARequest``: which adapter a request runs with (vLLM's shape)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from lora.peft_adapter import LoRAAdapter


@dataclass(frozen=True)
class LoRARequest:
    """An adapter named by the user.

    Equality and hashing use ``lora_name`` only, as vLLM: the name is the identity users see,
    and the prefix-cache key carries it so two adapters never share KV blocks.
    """

    lora_name: str
    """Name users pass as the OpenAI ``model`` field."""
    lora_int_id: int
    """Engine-wide id, >= 1 (0 would mean the base model)."""
    lora_path: str = ""
    """PEFT directory: adapter_config.json + adapter_model.safetensors (or .bin)."""
    base_model_name: Optional[str] = field(default=None, compare=False)
    """The base model this adapter was trained on (shown as ``root``/``parent`` in /v1/models)."""
    adapter: Optional["LoRAAdapter"] = field(default=None, compare=False, repr=False)
    """The adapter's weights, read by the engine's client (``lora.adapter_uploads``) and carried to the
    engine with the first request or ``add_lora`` that names it; the engine puts them in its host store
    and keeps the request without them (``without_adapter``). None: the engine holds it already."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string.")

    def with_adapter(self, adapter: "LoRAAdapter") -> "LoRARequest":
        """A copy carrying ``adapter`` (this one is left as it is)."""
        return dataclasses.replace(self, adapter=adapter)

    def without_adapter(self) -> "LoRARequest":
        """This request without its weights (itself when it carries none)."""
        return self if self.adapter is None else dataclasses.replace(self, adapter=None)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_name == self.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    # vLLM spells these as properties too.
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
