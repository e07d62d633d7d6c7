"""What the runner may ask of a model: the base interface every model implements, and the capabilities a
model class declares in its ``capabilities`` (``ModelCapabilities``).

The runner reads ``model.capabilities`` once, at construction, and from then on calls only the
methods of the protocols the model declared: it never probes a model for attributes, and it knows
no model family's attribute names. A new architecture (or a MoE block, sliding-window layers, q/k
norms, a quantized linear method) is a change under ``engine/models/`` (and its line in
``engine.models.registry``): it implements ``ModelForCausalLM`` plus what it declares.

    ModelForCausalLM        every model: forward, logits, token embeddings, the attention layers whose
                            KV cache the runner allocates, its activation shape and warm-up facts
    SupportsMultiModal      capabilities.multimodal: encodes media items into embeddings
    SupportsMRoPE           capabilities.mrope: 3-D rotary positions of prompts with media
    SupportsEncoderDecoder  capabilities.encoder_decoder: cross-attention K/V written per request
    SupportsWeightQuantization  capabilities.weight_quantization: weight-only quantized projections
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Optional, Protocol, Union

import numpy as np
import torch

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from engine.layers.attention import PagedAttention
    from engine.layers.lora_layout import LoRALayout
    from engine.pending_update import PendingUpdate
    from engine.request import MultiModalFeature


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model class supports beyond ``ModelForCausalLM``; each flag names the protocol it implements."""

    multimodal: bool = False
    """Encodes media items (``SupportsMultiModal``): the runner runs its encoders and caches their outputs."""
    mrope: bool = False
    """Rotates prompts with media by 3-D positions (``SupportsMRoPE``): its forward takes [3, T] positions."""
    encoder_decoder: bool = False
    """Its decoder cross-attends to the request's encoder output (``SupportsEncoderDecoder``)."""
    cross_attention_graphs: bool = False
    """Encoder-decoder models: its cross-attention reads nothing but the forward context's
    ``cross_attn_metadata`` (no host values of it beyond ``max_query_len`` / ``max_seq_len``), so its decode
    steps may run in CUDA graphs over the runner's static cross-attention buffers."""
    tensor_parallel: bool = False
    """``tensor_parallel_size`` > 1 shards it: its constructor takes ``tp``, it has ``checkpoint_shard``."""
    weight_quantization: bool = False
    """Its projections quantize to weight-only int8 / int4 (``SupportsWeightQuantization``)."""
    fp8_weights: bool = False
    """``--quantization fp8`` turns its projections (``engine.layers.linear.Linear``) into ``Fp8Weight``s at
    load (and an MoE's experts into ``engine.layers.fp8_experts.Fp8Experts``), though it takes no int8 / int4 /
    fp16 (``weight_quantization`` models take fp8 as well)."""
    fp8_checkpoints: bool = False
    """Loads FP8 checkpoints (compressed-tensors ``float-quantized``, HF block-wise ``fp8``) though no 4-bit ones
    (``weight_quantization`` models load both)."""
    bidirectional_media: bool = False
    """The placeholder tokens of one media item attend to each other both ways (the model's forward fills
    ``AttentionMetadata.key_limit``): the scheduler never ends a prefill chunk inside a placeholder."""


@dataclass(frozen=True)
class ModelShape:
    """The widths the runner sizes its activation reserve and media buffers by (the whole model's, before
    any tensor-parallel split)."""

    hidden_size: int
    """Width of the decoder's hidden states and token embeddings ([T, hidden])."""
    intermediate_size: int
    """Width of one token's MLP activations ([T, intermediate]; a MoE block: its routed experts' together)."""
    vocab_size: int
    """Logits per sampled row ([R, vocab])."""


@dataclass(frozen=True)
class MediaWarmUp:
    """One media item a multimodal model serves, encoded and prefilled once at start-up (CUDA) so that the
    first requests with media find the encoder's kernels compiled (``engine.runner.warm_up.warm_up_media``)."""

    modality: str
    """'image' or 'audio'."""
    data: Any
    """The encoder input, as a request's ``MultiModalFeature.data`` holds it (what ``embed_multimodal`` takes)."""
    num_embeds: int
    """Encoder output rows of the item."""
    prompt_token_ids: tuple[int, ...]
    """The warm-up request's prompt: placeholders and a text token after them, or an encoder-decoder model's
    decoder prompt."""
    placeholder_offset: Optional[int]
    """Where the item's ``num_embeds`` placeholder tokens start in the prompt; None: a cross-attention input."""

    @classmethod
    def at_placeholders(cls, modality: str, data: Any, num_embeds: int, placeholder_token_id: int,
                        text_token_id: int = 0) -> "MediaWarmUp":
        """An item whose embeddings replace ``num_embeds`` placeholder tokens at the start of the prompt,
        followed by one text token (the one whose logits are sampled)."""
        return cls(modality, data, num_embeds, (placeholder_token_id,) * num_embeds + (text_token_id,), 0)


QKVConsumer = Callable[["PendingUpdate", torch.Tensor], None]
"""f(pending, qkv): what a decode step does with a [T, q + 2 kv] q/k/v projection output whose adapter update
is still pending (``lora.manager.LoRAManager.warm_up_kernels`` compiles it at start-up)."""


class LogitsRules(Protocol):
    """Per-row rules a model applies to its logits before sampling (Whisper's token suppression and
    timestamp rules)."""

    def needs_history(self, prompt: list[int]) -> bool:
        """Whether the rules read a row's generated ids (else only whether there is one: such rows get ``[]``
        before their first id and ``[-1]`` after it)."""

    def apply(self, logits: torch.Tensor, prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
        """logits [R, vocab] -> logits [R, vocab] with each row's rules applied (its prompt and outputs)."""


class ModelForCausalLM(Protocol):
    """Every model the engine runs: a decoder over the paged KV cache of its ``attention_layers``."""

    capabilities: ClassVar[ModelCapabilities]
    """What the class supports beyond this protocol."""
    config: Any
    """The checkpoint's (transformers) config the model was built from."""
    shape: ModelShape
    """Its widths (``ModelShape``)."""
    rotary_dim: Optional[int]
    """Dims of each head that rotary rotates, for the attention kernels' warm-up (None: no rotary)."""
    logits_rules: Optional[LogitsRules]
    """Rules applied to the logits before sampling (None for most models)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids [T], positions [T] (or [3, T]: ``SupportsMRoPE``), inputs_embeds [T, hidden] or None
        -> hidden states [T, hidden]."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, vocab] in the model's dtype."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> token embeddings [T, hidden] (what ``forward`` takes as ``inputs_embeds``)."""

    def attention_layers(self) -> list[PagedAttention]:
        """The layers whose KV cache the runner allocates and binds, in order."""

    def lora_qkv_warmup_consumer(self) -> Optional[QKVConsumer]:
        """The rotary + KV write a decode step runs on a q/k/v projection with its adapter update pending,
        where that write is fused (KV cache bound, fused backend); else None."""

    def lora_layout(self) -> LoRALayout:
        """Where PEFT's module names land in the model's packed Linears (what adapters may target)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the checkpoint's tensors into the parameters; every parameter must be set."""


class SupportsMultiModal(Protocol):
    """``capabilities.multimodal``: media items become embeddings (at placeholder tokens, or a decoder's
    cross-attention input)."""

    def embed_multimodal(self, modality: str, items: list) -> list[torch.Tensor]:
        """One [num_embeds, hidden] encoder output per item (one batched encoder call)."""

    def make_prompt_processor(self, checkpoint_dir: Path) -> Any:
        """The prompt side of the model (``multimodal.processing``), with the settings its checkpoint
        directory holds (an image processor, audio features): media -> encoder inputs, placeholders."""

    def media_warm_up(self) -> list[MediaWarmUp]:
        """The media items start-up encodes and prefills once (CUDA): those of the sizes it serves (an image
        at the processor's default size, a full audio window), built without the checkpoint directory."""


class SupportsMRoPE(Protocol):
    """``capabilities.mrope``: prompts with media rotate by 3-D (t, h, w) positions."""

    def mrope_positions(self, num_prompt_tokens: int, features: list[MultiModalFeature]
                        ) -> tuple[np.ndarray, int]:
        """The prompt's positions [3, P] int64 and the delta of every later token (index + delta)."""


class SupportsEncoderDecoder(Protocol):
    """``capabilities.encoder_decoder``: each request's encoder output is projected once, before its first
    token, into every decoder layer's cross-attention K/V (blocks of the same KV cache)."""

    num_source_positions: int
    """Encoder output rows per media item (the cross-attention positions of a request)."""

    def write_cross_kv(self, encoder_out: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """encoder_out [N, hidden] (positions of one or more requests, flat) -> every decoder layer's
        cross-attention K/V at slot_mapping [N] int64."""

    def capture_encoder_graphs(self, max_items: int) -> None:
        """CUDA: capture the encoder's forward in CUDA graphs for calls of up to ``max_items`` media items
        (each item has a fixed shape); ``embed_multimodal`` replays them from then on, eagerly in calls where
        an adapter updates the encoder. The runner calls it outside any adapter batch."""


class SupportsWeightQuantization(Protocol):
    """``capabilities.weight_quantization``: weight-only quantized projections (CPU)."""

    def quantize(self, kind: Union[str, Mapping[str, Optional[str]]]) -> None:
        """Quantize every projection ("int8" / "int4") or those a plan names (checkpoint tensor -> kind)."""


DECLARED_PROTOCOLS: dict[str, type] = {
    "multimodal": SupportsMultiModal,
    "mrope": SupportsMRoPE,
    "encoder_decoder": SupportsEncoderDecoder,
    "weight_quantization": SupportsWeightQuantization,
}
"""``ModelCapabilities`` flag -> the protocol a class declaring it implements."""
