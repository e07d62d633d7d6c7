"""Where a model's projections sit for LoRA: the layout a model declares (``lora_layout()``) and
``lora.peft_adapter.LoRATargets`` reads to map PEFT module names onto the model's ``Linear`` modules."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LoRALayout:
    """How PEFT's (transformers') module names map onto a model's packed ``Linear`` modules."""

    packed_modules: Mapping[str, tuple[str, int]]
    """PEFT module suffix -> (the suffix of the ``Linear`` that holds it, its output slice), e.g.
    ``k_proj -> (qkv_proj, 1)``; a suffix absent here maps onto a ``Linear`` of the same suffix."""
    checkpoint_prefixes: tuple[tuple[str, str], ...] = ()
    """(theirs, ours) module-name prefixes of a model whose checkpoints name modules differently (LLaVA's
    ``model.language_model.`` for our ``language_model.model.``): adapters may use either."""
    exact_slices: Optional[Mapping[str, tuple[str, int]]] = None
    """PEFT module name -> (our ``Linear``'s module name, output slice), for a model whose one suffix lands
    in different packed Linears (Whisper's q_proj in self_attn.qkv_proj vs encoder_attn.q_proj); when set,
    it is the whole mapping and ``packed_modules`` is not read."""
    encoder_prefix: Optional[str] = None
    """Module-name prefix of the encoder's Linears (encoder-decoder models): adapters on them change the
    encoder output."""
    encoder_slices: Optional[Mapping[str, Optional[tuple[str, int]]]] = None
    """PEFT module name -> (our ``Linear``'s module name, output slice) of the projections of a multimodal
    model's encoder side (a vision tower and its projector), by every name transformers gives them; added
    to the suffix mapping (which skips these Linears) when the engine serves tower LoRA
    (``--enable-tower-connector-lora``). Adapters on them change the encoder output. None: a projection the
    model never runs (a tower layer past the deepest feature layer): an adapter's update there changes
    nothing and is skipped."""
    expert_projections: tuple[tuple[str, int], ...] = ()
    """A MoE model's routed experts (``engine.layers.moe.FusedMoE``): PEFT per-expert module suffix -> slice of
    the experts update (0 gate, 1 up, 2 down), e.g. Mixtral's ``(("w1", 0), ("w3", 1), ("w2", 2))`` for
    ``experts.N.w1``; empty: no adapter reaches the experts. Their stacked form (``target_parameters``) comes
    with it."""
    router_modules: tuple[str, ...] = ()
    """Suffixes of the router ``Linear`` beside each routed-experts module (``gate``) that adapters may target."""
    module_renames: tuple[tuple[str, str], ...] = ()
    """(theirs, ours) infixes of expert and router module names in transformers 4's layout (Mixtral's
    ``.block_sparse_moe.`` for our ``.mlp.``): adapters may use either."""
