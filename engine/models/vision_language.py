"""The shape every vision-language model here shares: a vision tower (and projector) that
``embed_multimodal`` runs for the images a step must encode, and a paged-KV language model
(``language_model``) that runs the step over token embeddings with the image embeddings merged in.

Subclasses build ``language_model`` and their vision parts, and list in ``weight_parts`` the
top-level modules checkpoint tensors are routed to (after ``checkpoint_prefixes`` maps either
transformers layout onto ours).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn

from engine.distributed.sharding import Shard
from engine.layers.attention import PagedAttention
from engine.layers.lora_layout import LoRALayout
from engine.models.interfaces import LogitsRules, ModelCapabilities, ModelShape, QKVConsumer


def map_checkpoint_name(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint tensor or PEFT module name under our module tree (unchanged if no prefix matches)."""
    for theirs, ours in prefixes:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def image_token_id(config) -> int:
    """The image placeholder token (``image_token_id`` in transformers 5, ``image_token_index`` in 4)."""
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    raise ValueError("the model config names no image token (image_token_id / image_token_index).")


def load_plain(module: nn.Module, weights: list[tuple[str, torch.Tensor]], what: str) -> None:
    """Copy tensors into ``module``'s parameters by name; every parameter must be set, shapes must match."""
    params = dict(module.named_parameters())
    loaded = set()
    for name, tensor in weights:
        if name not in params:
            raise ValueError(f"checkpoint tensor {what}.{name} has no place in {type(module).__name__}")
        if tuple(params[name].shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {what}.{name} has shape {tuple(tensor.shape)}, the model "
                             f"expects {tuple(params[name].shape)}")
        params[name].data.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors of {what}, e.g. {missing[:3]}")


class VisionLanguageModel(nn.Module):
    """Delegates the language-model side to ``self.language_model``; routes checkpoint tensors.

    Tensor parallelism: the language model is sharded (a subclass passes its ``tp`` on); the vision
    tower and projector are replicated on every rank, which encodes the step's images itself (a tower
    is small next to the language model, and replication costs no collective per encoder layer)."""

    capabilities = ModelCapabilities(multimodal=True, tensor_parallel=True, weight_quantization=True)
    logits_rules: Optional[LogitsRules] = None
    checkpoint_prefixes: tuple[tuple[str, str], ...] = ()
    """(their prefix, ours) pairs, most specific first; also used to match PEFT module names."""
    weight_parts: tuple[str, ...] = ()
    """Top-level submodules that take checkpoint tensors (each loads its own and checks completeness)."""
    encoder_lora_parts: tuple[str, ...] = ()
    """Top-level submodules of the encoder side (a vision tower, a projector) whose ``lora_slices()``
    projections an adapter may update (with ``--enable-tower-connector-lora``)."""
    language_model: nn.Module

    def quantize(self, kind) -> None:
        """Weight-only quantization of the language model (``SupportsWeightQuantization``; the vision side
        stays float): ``kind`` "int8" / "int4" / "fp16", or a plan by checkpoint tensor name."""
        if not isinstance(kind, str):
            kind = {map_checkpoint_name(name, self.checkpoint_prefixes).partition(".")[2]: k
                    for name, k in kind.items()
                    if map_checkpoint_name(name, self.checkpoint_prefixes).startswith("language_model.")}
        self.language_model.quantize(kind)

    @property
    def float_parts(self) -> tuple[str, ...]:
        """Top-level submodules whose projections stay float whatever ``--quantization`` asks: every part but
        the language model (the encoder side: a vision or audio tower and its projector)."""
        return tuple(part for part in self.weight_parts if part != "language_model")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> token embeddings [T, hidden]."""
        return self.language_model.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def lora_layout(self) -> LoRALayout:
        return LoRALayout(self.language_model.packed_modules_mapping, self.checkpoint_prefixes,
                          encoder_slices=self.encoder_lora_slices())

    def encoder_lora_slices(self) -> dict[str, Optional[tuple[str, int]]]:
        """Every PEFT module name (either transformers layout) of an ``encoder_lora_parts`` projection ->
        (our Linear, its output slice), None for one never run (``LoRALayout.encoder_slices``)."""
        slices: dict[str, Optional[tuple[str, int]]] = {}
        for part in self.encoder_lora_parts:
            ours = f"{part}."
            theirs = [t for t, o in self.checkpoint_prefixes if o == ours]
            for name, target in getattr(self, part).lora_slices().items():
                for prefix in theirs:
                    slices[prefix + name] = None if target is None else (ours + target[0], target[1])
        return slices

    @property
    def shape(self) -> ModelShape:
        return self.language_model.shape

    @property
    def rotary_dim(self) -> int:
        return self.language_model.rotary_dim

    def attention_layers(self) -> list[PagedAttention]:
        return self.language_model.attention_layers()

    def lora_qkv_warmup_consumer(self) -> Optional[QKVConsumer]:
        return self.language_model.lora_qkv_warmup_consumer()

    def checkpoint_shard(self, name: str) -> Optional[Shard]:
        """This rank's range of checkpoint tensor ``name``: the language model's shard, the whole of a
        vision-side tensor."""
        part, _, rest = map_checkpoint_name(name, self.checkpoint_prefixes).partition(".")
        return self.language_model.checkpoint_shard(rest) if part == "language_model" else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Route each checkpoint tensor (either transformers layout) to its part; each part checks
        that every one of its parameters was set."""
        parts: dict[str, list[tuple[str, torch.Tensor]]] = {p: [] for p in self.weight_parts}
        for name, tensor in weights:
            part, _, rest = map_checkpoint_name(name, self.checkpoint_prefixes).partition(".")
            if part not in parts:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            parts[part].append((rest, tensor))
        for part, tensors in parts.items():
            module = getattr(self, part)
            if hasattr(module, "load_weights"):
                module.load_weights(tensors)
            else:
                load_plain(module, tensors, part)
