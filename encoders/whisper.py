"""Whisper's audio encoder, exact against transformers' ``WhisperEncoder`` (``last_hidden_state``).

log-mel [B, num_mel_bins, 2 * max_source_positions] -> conv1 (k3, pad 1) + GELU -> conv2 (k3, stride 2,
pad 1) + GELU -> + ``embed_positions.weight`` (sinusoids in the released checkpoints; loaded like any
tensor) -> ``encoder_layers`` pre-norm layers -> ``layer_norm`` -> [B, max_source_positions, d_model].
A layer is x + out_proj(attention(self_attn_layer_norm(x))), then x + fc2(act(fc1(final_layer_norm(x)))),
with q/k/v packed into one Linear (``encoders.vit.ViTAttention``, SDPA). Whisper's k_proj has no bias:
the k block of the packed bias is zero, and ``load_weights`` sets it so.

The projections are ``engine.layers.linear.Linear``s, so LoRA slots attach to them as to the decoder's
(``lora.manager``); the runner gives the encoder's rows their request's adapter slot
(``ModelRunner._run_encoders``). ``LORA_TARGET_MODULES`` names the projections an adapter may target,
``WhisperEncoderTower.packed_modules_mapping`` says which block of which packed Linear each of q/k/v is
(as in ``engine.models.llama``), and ``WhisperEncoderTower.lora_targets()`` maps every transformers module
name to its Linear and row block here.

CUDA graphs: a window always has ``2 * max_source_positions`` frames, so ``capture_graphs`` captures the
forward at a few batch sizes (``encoders.encoder_graphs``) and the forward replays them from then on, padding
a call's windows up to the next captured size. A call in which an adapter updates a projection (inside a
``LoRAManager.rows_batch`` with adapter rows) runs eagerly: the graphs hold the base projections only.
"""

from __future__ import annotations

import re
from typing import Iterable, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from encoders.encoder_graphs import BatchGraphs, encoder_graph_sizes
from encoders.varlen_attention import PackedSegments, packed_attention
from encoders.vit import TowerWeights, ViTAttention, activation
from engine.layers.linear import Linear

_TOWER = "WhisperEncoderTower"
_EXPECTED_NAMES = "transformers' WhisperEncoder.state_dict()"
_QKV = re.compile(r"layers\.(\d+)\.self_attn\.(q_proj\.weight|q_proj\.bias|k_proj\.weight|v_proj\.weight"
                  r"|v_proj\.bias)")

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
"""The per-layer projections (transformers' names) a LoRA adapter on the encoder may target."""


class LoRATarget(NamedTuple):
    """Where one transformers projection lives in the tower."""

    module: str
    """Our ``Linear`` (relative to the tower), e.g. ``layers.0.self_attn.qkv``."""
    shard: int
    """The row block of ``module``'s output that is this projection's."""
    num_shards: int
    """How many equal row blocks ``module``'s output has (3 for qkv, else 1)."""


class WhisperEncoderAttention(ViTAttention):
    """``ViTAttention`` with its projections as ``Linear``s (q | k | v slices), which take adapters; it also
    attends over packed sequences of different lengths (Qwen2-Audio's clips)."""

    def build_projections(self, hidden_size: int) -> tuple[nn.Module, nn.Module]:
        return Linear(hidden_size, [hidden_size] * 3, bias=True), Linear(hidden_size, [hidden_size], bias=True)

    def forward(self, hidden_states: torch.Tensor, segments: Optional[PackedSegments] = None) -> torch.Tensor:
        """hidden_states [N, S, hidden] -> [N, S, hidden]; with ``segments``, [T, hidden] packed sequences
        (each attends within its own segment, ``encoders.varlen_attention``) -> [T, hidden]."""
        if segments is None:
            return super().forward(hidden_states)
        num_tokens, hidden = hidden_states.shape
        qkv = self.qkv(hidden_states).view(num_tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)                                      # each [T, heads, head_dim]
        out = packed_attention(q, k, v, segments, self.scale)         # [T, heads, head_dim]
        return self.out_proj(out.reshape(num_tokens, hidden))


class WhisperEncoderLayer(nn.Module):
    """Pre-norm layer; parameter names are transformers' except q/k/v packed in ``self_attn.qkv``."""

    def __init__(self, d_model: int, num_heads: int, ffn_dim: int, act: str) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.self_attn = WhisperEncoderAttention(d_model, num_heads)
        self.final_layer_norm = nn.LayerNorm(d_model)
        self.act = activation(act)
        self.fc1 = Linear(d_model, [ffn_dim], bias=True)
        self.fc2 = Linear(ffn_dim, [d_model], bias=True)

    def forward(self, hidden_states: torch.Tensor, segments: Optional[PackedSegments] = None) -> torch.Tensor:
        """hidden_states [B, S, d_model] -> [B, S, d_model]; with ``segments``, [T, d_model] packed sequences
        (``WhisperEncoderAttention``) -> [T, d_model]."""
        hidden_states = hidden_states + self.self_attn(self.self_attn_layer_norm(hidden_states), segments)
        hidden_states = hidden_states + self.fc2(self.act(self.fc1(self.final_layer_norm(hidden_states))))
        if hidden_states.dtype == torch.float16:  # transformers clamps float16 activations after each layer
            clamp = torch.finfo(torch.float16).max - 1000
            hidden_states = hidden_states.clamp(min=-clamp, max=clamp)
        return hidden_states


class WhisperEncoderTower(nn.Module):
    """Whisper's encoder built from a transformers ``WhisperConfig``.

    ``forward(input_features [B, num_mel_bins, 2 * max_source_positions])`` ->
    [B, max_source_positions, d_model]; ``load_weights`` takes ``WhisperEncoder.state_dict()`` names
    (strip the checkpoint's ``model.encoder.`` first).
    """

    packed_modules_mapping = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2)}
    """transformers projection name -> (our packed Linear under ``self_attn``, its row block)."""

    def __init__(self, config) -> None:
        super().__init__()
        if config.d_model % config.encoder_attention_heads:
            raise ValueError(f"{_TOWER}: d_model={config.d_model} is not a multiple of "
                             f"encoder_attention_heads={config.encoder_attention_heads}; fix the config.")
        self.d_model = config.d_model
        self.num_mel_bins = config.num_mel_bins
        self.max_source_positions = config.max_source_positions
        self.num_frames = 2 * config.max_source_positions  # conv2's stride halves the frames
        self.conv1 = nn.Conv1d(config.num_mel_bins, config.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(config.d_model, config.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, config.d_model)
        self.embed_positions.requires_grad_(False)
        self.layers = nn.ModuleList(
            WhisperEncoderLayer(config.d_model, config.encoder_attention_heads, config.encoder_ffn_dim,
                                config.activation_function)
            for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(config.d_model)
        self.graphs: Optional[BatchGraphs] = None
        """The forward's captured CUDA graphs (``capture_graphs``); None: every call runs eagerly."""

    def capture_graphs(self, max_items: int, use_graphs: bool = True) -> list[int]:
        """Capture the forward in CUDA graphs for calls of up to ``max_items`` windows (batch sizes
        ``encoder_graph_sizes(max_items)``; larger calls replay in chunks) and replay them from then on.
        Capture outside any adapter batch (the graphs run the base projections). ``use_graphs=False``: the
        same chunking and padding, each chunk eager (CPU tests). Returns the batch sizes captured."""
        self.graphs = None
        if self._adapter_active():
            raise RuntimeError(f"{_TOWER}.capture_graphs ran inside an adapter batch: the graphs would hold "
                               "its adapters; capture outside LoRAManager.rows_batch.")
        sizes = encoder_graph_sizes(max_items)
        if sizes:
            weight = self.conv1.weight
            graphs = BatchGraphs(self._forward_eager, (self.num_mel_bins, self.num_frames), weight.dtype,
                                 weight.device, sizes, use_graphs)
            graphs.capture()
            self.graphs = graphs
        return sizes

    def _adapter_active(self) -> bool:
        """Whether an adapter updates some projection of this call (a ``rows_batch`` with adapter rows)."""
        return any(module.adapter is not None and not module.adapter.adds_nothing()
                   for module in self.modules() if isinstance(module, Linear))

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        """input_features [B, num_mel_bins, 2 * max_source_positions] (any float dtype, cast to the
        parameters') -> [B, max_source_positions, d_model] in the parameters' dtype; replayed from the
        captured graphs (``capture_graphs``) unless an adapter updates a projection of this call."""
        expected = (self.num_mel_bins, self.num_frames)
        if input_features.dim() != 3 or tuple(input_features.shape[1:]) != expected:
            raise ValueError(f"{_TOWER}: input_features must be [B, {expected[0]}, {expected[1]}] (the "
                             f"config's num_mel_bins, and 2 * max_source_positions frames: pad or trim the "
                             f"log-mel as WhisperFeatureExtractor does), got {list(input_features.shape)}.")
        if self.graphs is not None and not self._adapter_active():
            return self.graphs(input_features)
        return self._forward_eager(input_features)

    def _forward_eager(self, input_features: torch.Tensor) -> torch.Tensor:
        """``forward`` without the graphs (its input checked)."""
        features = input_features.to(self.conv1.weight.dtype)
        features = F.gelu(self.conv1(features))  # [B, d_model, frames]
        features = F.gelu(self.conv2(features))  # [B, d_model, positions]
        hidden_states = (features.transpose(1, 2) + self.embed_positions.weight).contiguous()  # [B, S, d]
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.layer_norm(hidden_states)

    def lora_targets(self) -> dict[str, LoRATarget]:
        """transformers module name of every ``LORA_TARGET_MODULES`` projection, relative to the encoder
        (``layers.0.self_attn.k_proj``; a PEFT adapter of WhisperForConditionalGeneration prefixes
        ``model.encoder.``) -> its Linear and row block here."""
        targets = {}
        for index in range(len(self.layers)):
            for name in LORA_TARGET_MODULES:
                parent = f"layers.{index}.self_attn" if name.endswith("_proj") else f"layers.{index}"
                module, shard = self.packed_modules_mapping.get(name, (name, 0))
                num_shards = 3 if name in self.packed_modules_mapping else 1
                targets[f"{parent}.{name}"] = LoRATarget(f"{parent}.{module}", shard, num_shards)
        return targets

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load tensors named as in transformers' ``WhisperEncoder.state_dict()``; each layer's q/k/v go
        into row blocks of ``self_attn.qkv`` and the k block of its bias is zeroed. WeightLoadError (a
        ValueError) for an unknown name, a wrong shape, or a parameter left unset."""
        loader = TowerWeights(self, _TOWER, _EXPECTED_NAMES, outer_prefixes="'model.encoder.'")
        k_shard = self.packed_modules_mapping["k_proj"][1]
        for index, layer in enumerate(self.layers):
            bias = layer.self_attn.qkv.bias
            loader.load(f"layers.{index}.self_attn.k_proj (no bias)", f"layers.{index}.self_attn.qkv.bias",
                        torch.zeros(self.d_model, dtype=bias.dtype, device=bias.device),
                        shard=k_shard, num_shards=3)
        for name, tensor in weights:
            packed = _QKV.fullmatch(name)
            if packed:
                projection, kind = packed.group(2).split(".")
                module, shard = self.packed_modules_mapping[projection]
                loader.load(name, f"layers.{packed.group(1)}.self_attn.{module}.{kind}", tensor,
                            shard=shard, num_shards=3)
            else:
                loader.load(name, name, tensor)
        loader.finish()
