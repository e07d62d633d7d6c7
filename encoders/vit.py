"""The ViT pieces the CLIP and SigLIP vision towers share, and the checkpoint loading every tower uses.

- ``ACTIVATIONS``: the MLP activations of transformers' ``ACT2FN`` that vision towers use, bit-exact.
- ``ViTAttention`` (one packed q/k/v Linear + SDPA), ``ViTMLP``, ``ViTEncoderLayer`` (pre-norm),
  ``ViTEncoder`` (the layer stack, returning the requested hidden states and stopping after the
  deepest one).
- ``resolve_feature_layers``: transformers' ``hidden_states`` indexing (0 = the embeddings, i = the
  output of layer i, negative from the end of the full stack) checked against the built layers.
- ``TowerWeights``: copies checkpoint tensors into a tower's parameters (whole or as one row block of
  a packed parameter) and names what was unknown, misshapen or never loaded.
- ``ViTTower``: the CLIP / SigLIP tower minus what differs (class token, pre-layernorm, skipped heads).

The projections are ``engine.layers.linear.Linear``s, so LoRA slots attach to them as to a language
model's (``lora.manager``); ``ViTTower.lora_slices`` maps transformers' module names onto them.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.layers.linear import Linear


class FeatureLayerError(ValueError):
    """A requested feature layer does not exist in the tower, or was not built."""


class WeightLoadError(ValueError):
    """A checkpoint tensor has no place in the tower, has the wrong shape, or a parameter was never loaded."""


def quick_gelu_torch(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 * x) as transformers computes it (three torch ops, bit-exact)."""
    return x * torch.sigmoid(1.702 * x)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """QuickGELU: one Triton launch on CUDA (``kernels.quick_gelu``, float32 math), torch's ops elsewhere."""
    if x.is_cuda and x.is_contiguous():
        from kernels.quick_gelu import quick_gelu
        return quick_gelu(x)
    return quick_gelu_torch(x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_new,
    "silu": F.silu,
}
"""``config.hidden_act`` -> the function transformers' ``ACT2FN`` computes for that name."""


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation ``config.hidden_act`` names; ValueError naming the supported ones otherwise."""
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act={name!r} is not supported by the vision towers; "
                         f"use one of {sorted(ACTIVATIONS)}.")
    return ACTIVATIONS[name]


class ViTAttention(nn.Module):
    """Bidirectional multi-head self-attention over [N, S, hidden] with q/k/v packed into one Linear.

    ``qkv.weight`` is [3 * hidden, hidden]: rows [0, hidden) are q_proj's, then k_proj's, then v_proj's
    (its output slices 0, 1, 2). The scale is head_dim ** -0.5, as in CLIP and SigLIP.
    """

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} is not a multiple of "
                             f"num_attention_heads={num_heads}.")
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv, self.out_proj = self.build_projections(hidden_size)

    def build_projections(self, hidden_size: int) -> tuple[nn.Module, nn.Module]:
        """(qkv [hidden -> q | k | v slices], out_proj [hidden -> hidden]), both with bias, as adapter-ready
        ``Linear``s; a subclass may build them as other layers taking [..., hidden]."""
        qkv = Linear(hidden_size, [hidden_size] * 3, bias=True)   # q | k | v slices
        return qkv, Linear(hidden_size, [hidden_size], bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, S, hidden] -> [N, S, hidden]."""
        batch, seq_len, hidden = hidden_states.shape
        qkv = self.qkv(hidden_states).view(batch, seq_len, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [N, heads, S, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)  # [N, heads, S, head_dim]
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq_len, hidden))


class ViTMLP(nn.Module):
    """fc1 -> activation -> fc2."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.act = activation(hidden_act)
        self.fc1 = Linear(hidden_size, [intermediate_size], bias=True)
        self.fc2 = Linear(intermediate_size, [hidden_size], bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden_states)))


class ViTEncoderLayer(nn.Module):
    """Pre-norm transformer layer: x + attn(ln1(x)), then x + mlp(ln2(x)) (CLIP's and SigLIP's layer)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ViTAttention(config.hidden_size, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ViTMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, S, hidden] -> [N, S, hidden]."""
        hidden_states = hidden_states + self.self_attn(self.layer_norm1(hidden_states))
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


class ViTEmbeddings(nn.Module):
    """Patchify [N, C, H, W] with a stride == kernel Conv2d, prepend the class token (CLIP), add the
    learned position embeddings (one per position of a config-sized image; no interpolation)."""

    def __init__(self, config, class_token: bool, patch_bias: bool) -> None:
        super().__init__()
        num_positions = (config.image_size // config.patch_size) ** 2 + int(class_token)
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size)) if class_token else None
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size,
                                         kernel_size=config.patch_size, stride=config.patch_size,
                                         bias=patch_bias)
        self.position_embedding = nn.Embedding(num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, image_size, image_size] (any float dtype) -> [N, S, hidden] in the
        parameters' dtype; S = patches (+ 1 with the class token)."""
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(dtype=weight.dtype))  # [N, hidden, grid, grid]
        embeddings = patches.flatten(2).transpose(1, 2)  # [N, grid * grid, hidden]
        if self.class_embedding is not None:
            class_token = self.class_embedding.expand(embeddings.shape[0], 1, -1)  # [N, 1, hidden]
            embeddings = torch.cat([class_token, embeddings], dim=1)
        return embeddings + self.position_embedding.weight


class ViTEncoder(nn.Module):
    """The first ``num_layers`` encoder layers of a CLIP / SigLIP vision config."""

    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ViTEncoderLayer(config) for _ in range(num_layers))

    def forward(self, hidden_states: torch.Tensor, layer_indices: Sequence[int]) -> list[torch.Tensor]:
        """hidden_states [N, S, hidden] (the encoder input) -> one [N, S, hidden] per index of
        ``layer_indices`` (0 = the input, i = the output of layer i); no layer past the deepest runs."""
        outputs = {0: hidden_states}
        for index in range(1, max(layer_indices) + 1):
            hidden_states = self.layers[index - 1](hidden_states)
            outputs[index] = hidden_states
        return [outputs[i] for i in layer_indices]


def resolve_feature_layers(feature_layers: Sequence[int], num_hidden_layers: int, num_built: int,
                           tower: str) -> list[int]:
    """Map ``feature_layers`` (transformers' ``hidden_states`` indices over a ``num_hidden_layers``
    stack: 0 = the embeddings, i = the output of layer i, negative counts from the end) to indices in
    [0, num_built]; FeatureLayerError for an empty list, an index outside the stack, or a layer not built."""
    if isinstance(feature_layers, int) or len(feature_layers) == 0:
        raise FeatureLayerError(f"{tower}: feature_layers must be a non-empty sequence of layer indices, "
                                f"got {feature_layers!r}.")
    num_states = num_hidden_layers + 1
    resolved = []
    for layer in feature_layers:
        if not -num_states <= layer < num_states:
            raise FeatureLayerError(f"{tower}: feature layer {layer} is outside the {num_states} hidden "
                                    f"states of a {num_hidden_layers}-layer tower "
                                    f"(valid: {-num_states}..{num_states - 1}).")
        index = layer % num_states
        if index > num_built:
            raise FeatureLayerError(f"{tower}: feature layer {layer} needs {index} layers but the tower was "
                                    f"built with num_layers={num_built}; build it with "
                                    f"num_layers >= {index}.")
        resolved.append(index)
    return resolved


LoRASlices = dict[str, Optional[tuple[str, int]]]
"""transformers module name of a projection (relative to a tower or projector) -> (our ``Linear`` holding it,
relative to the same module, and its output slice), or None for one never run (a layer past the deepest
feature layer, not built): what a tower's ``lora_slices()`` returns."""


def materialize_deferred(module: nn.Module) -> None:
    """Give the deferred (meta) weights of ``module``'s ``Linear``s memory where its other parameters live:
    a tower built under ``engine.layers.linear.deferred_weights`` (a quantized checkpoint's model) loads
    float weights."""
    device = next((p.device for p in module.parameters() if not p.is_meta), None)
    for sub in module.modules():
        if isinstance(sub, Linear) and device is not None:
            sub.materialize(device)


class TowerWeights:
    """Copies checkpoint tensors into a module's parameters and reports what did not fit.

    A tensor fills a whole parameter, or row block ``shard`` of ``num_shards`` equal row blocks of a
    packed one (q/k/v). ``finish`` raises WeightLoadError naming parameters (or blocks) never loaded.
    """

    def __init__(self, module: nn.Module, tower: str, expected_names: str,
                 outer_prefixes: str = "'vision_tower.' or 'visual.'") -> None:
        materialize_deferred(module)
        self.tower = tower
        self.expected_names = expected_names  # a hint for error messages: whose state_dict names we take
        self.outer_prefixes = outer_prefixes  # a hint for error messages: prefixes the caller should strip
        self._params = dict(module.named_parameters())
        self._loaded_rows: dict[str, set[tuple[int, int]]] = {name: set() for name in self._params}

    def unknown(self, checkpoint_name: str) -> WeightLoadError:
        return WeightLoadError(f"{self.tower}: checkpoint tensor {checkpoint_name!r} has no place in the "
                               f"tower; names must be as in {self.expected_names} (strip any outer prefix "
                               f"such as {self.outer_prefixes} first).")

    @torch.no_grad()
    def load(self, checkpoint_name: str, param_name: str, tensor: torch.Tensor, shard: int = 0,
             num_shards: int = 1) -> None:
        """Copy ``tensor`` (cast to the parameter's dtype and device) into ``param_name``, or into its
        row block ``shard`` of ``num_shards``."""
        param = self._params.get(param_name)
        if param is None:
            raise self.unknown(checkpoint_name)
        rows = param.shape[0] // num_shards
        start, stop = shard * rows, (shard + 1) * rows
        target = param.data[start:stop]
        if tuple(tensor.shape) != tuple(target.shape):
            raise WeightLoadError(f"{self.tower}: checkpoint tensor {checkpoint_name!r} has shape "
                                  f"{list(tensor.shape)}, expected {list(target.shape)} for {param_name!r}; "
                                  f"the checkpoint does not match the config the tower was built from.")
        target.copy_(tensor)
        self._loaded_rows[param_name].add((start, stop))

    def finish(self, optional_modules: tuple[str, ...] = ()) -> list[str]:
        """WeightLoadError naming up to five parameters not (fully) loaded, except that the modules named
        in ``optional_modules`` may be absent from the checkpoint as a whole: those are returned."""
        missing = [name for name, param in self._params.items()
                   if sum(stop - start for start, stop in self._loaded_rows[name]) != param.shape[0]]
        absent = [module for module in optional_modules if not any(
            self._loaded_rows[name] for name in self._params if name.startswith(f"{module}."))]
        missing = [name for name in missing if not name.startswith(tuple(f"{module}." for module in absent))]
        if missing:
            listed = ", ".join(repr(name) for name in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise WeightLoadError(f"{self.tower}: the checkpoint left {len(missing)} parameter(s) unset: "
                                  f"{listed}{more}; pass every tensor of {self.expected_names}.")
        return absent


_PACKED_QKV = re.compile(r"encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)")
_LAYER = re.compile(r"encoder\.layers\.(\d+)\.")


class ViTTower(nn.Module):
    """What the CLIP and SigLIP towers share: patch embeddings, the first ``num_layers`` layers of the
    config's stack, hidden states picked by transformers' index, loading by transformers' names."""

    name = "ViTTower"  # the tower in error messages
    expected_names = ""  # whose state_dict names load_weights takes, for error messages

    def __init__(self, config, num_layers: Optional[int], class_token: bool, patch_bias: bool) -> None:
        super().__init__()
        if num_layers is not None and not 0 <= num_layers <= config.num_hidden_layers:
            raise ValueError(f"{self.name}: num_layers={num_layers} must be between 0 and the config's "
                             f"num_hidden_layers={config.num_hidden_layers}.")
        self.num_hidden_layers = config.num_hidden_layers  # of the full config: negative layers count from it
        self.num_layers = config.num_hidden_layers if num_layers is None else num_layers  # layers built
        self.image_size_px = config.image_size
        self.num_channels = config.num_channels
        self.embeddings = ViTEmbeddings(config, class_token=class_token, patch_bias=patch_bias)
        self.encoder = ViTEncoder(config, self.num_layers)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, H, W] -> hidden state 0 [N, S, hidden]."""
        return self.embeddings(pixel_values)

    def skipped_prefixes(self) -> tuple[str, ...]:
        """Checkpoint names (besides unbuilt layers) that load_weights skips."""
        return ()

    def optional_modules(self) -> tuple[str, ...]:
        """Built modules that the forward never uses: a checkpoint without them loads, and load_weights
        sets them to None."""
        return ()

    def forward(self, pixel_values: torch.Tensor, feature_layers: Sequence[int]) -> list[torch.Tensor]:
        """pixel_values [N, C, image_size, image_size] (any float dtype, cast to the parameters') -> one
        [N, S, hidden] per entry of ``feature_layers``, indexed like transformers' ``hidden_states``:
        0 = the embeddings, i = the output of layer i, negative from the end of the full config's stack
        (-2 of 24 layers = 23). No layer past the deepest requested one runs."""
        indices = resolve_feature_layers(feature_layers, self.num_hidden_layers, self.num_layers, self.name)
        expected = (self.num_channels, self.image_size_px, self.image_size_px)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"{self.name}: pixel_values must be [N, {', '.join(map(str, expected))}] (the "
                             f"config's num_channels and image_size; resize in preprocessing), "
                             f"got {list(pixel_values.shape)}.")
        return self.encoder(self.embed(pixel_values), indices)

    def lora_slices(self) -> LoRASlices:
        """The projections an adapter may update, by transformers' module names (with and without
        transformers 4's ``vision_model.`` prefix): q/k/v_proj are slices of ``self_attn.qkv``; those of
        layers not built (past the deepest feature layer, whose outputs nothing reads) are None."""
        slices: LoRASlices = {}
        for index in range(self.num_hidden_layers):
            layer = f"encoder.layers.{index}"
            built = index < self.num_layers
            for idx, name in enumerate(("q_proj", "k_proj", "v_proj")):
                slices[f"{layer}.self_attn.{name}"] = (f"{layer}.self_attn.qkv", idx) if built else None
            for name in ("self_attn.out_proj", "mlp.fc1", "mlp.fc2"):
                slices[f"{layer}.{name}"] = (f"{layer}.{name}", 0) if built else None
        return {**slices, **{f"vision_model.{name}": target for name, target in slices.items()}}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load tensors named as in transformers' vision model's ``state_dict()`` (with or without the
        ``vision_model.`` prefix of transformers 4); each layer's q/k/v are packed into ``self_attn.qkv``;
        tensors of unbuilt layers and ``skipped_prefixes()`` are skipped. WeightLoadError for an unknown
        name, a wrong shape, or a parameter left unset."""
        loader = TowerWeights(self, self.name, self.expected_names)
        for checkpoint_name, tensor in weights:
            name = checkpoint_name.removeprefix("vision_model.")
            layer = _LAYER.match(name)
            if name.startswith(self.skipped_prefixes()) or (layer and int(layer.group(1)) >= self.num_layers):
                continue
            packed = _PACKED_QKV.fullmatch(name)
            if packed:
                index, which, kind = packed.groups()
                loader.load(checkpoint_name, f"encoder.layers.{index}.self_attn.qkv.{kind}", tensor,
                            shard="qkv".index(which), num_shards=3)
            else:
                loader.load(checkpoint_name, name, tensor)
        for module in loader.finish(optional_modules=self.optional_modules()):
            setattr(self, module, None)
