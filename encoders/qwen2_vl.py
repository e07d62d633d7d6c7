"""The Qwen2-VL vision transformer, exact against transformers' Qwen2VisionTransformerPretrainedModel.

Patches come flattened by the image processor ([num_patches, C * temporal_patch * patch * patch], each
image's patches in spatial-merge block order). The stride == kernel Conv3d patch embedding is one
Linear; every block applies the 2-D rotary (h / w patch coordinates) to q and k in float32 and attends
within one frame of one image only; the PatchMerger turns each merge x merge block of patches into one
language-model token.

Attention is ``encoders.varlen_attention.packed_attention`` over the frames as packed segments: one
flash varlen launch for any mix of image sizes on CUDA (bf16 / fp16), one SDPA call per run of
consecutive equal frames elsewhere (exact on CPU). On CUDA the rotary is one kernel that rotates q and
k in place in the packed q/k/v output (``kernels.layer_ops.rotary_embedding_``, neox layout: the cos /
sin rows' two halves are equal), instead of the float32 copies, halves and concatenations of the torch
ops.

The blocks' and the merger's projections are ``engine.layers.linear.Linear``s (LoRA slots attach to them,
``lora_slices`` maps transformers' module names onto them); the patch embedding is not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn as nn

from encoders.varlen_attention import PackedSegments, SegmentRun, join_runs, packed_attention, packed_segments
from encoders.vit import LoRASlices, TowerWeights, ViTMLP, WeightLoadError
from engine.layers.linear import Linear

_TOWER = "Qwen2VLVisionTransformer"
_EXPECTED_NAMES = "transformers' Qwen2VisionTransformerPretrainedModel.state_dict()"
_NORM_EPS = 1e-6  # transformers hard-codes LayerNorm(eps=1e-6) in the blocks and the merger


class GridError(ValueError):
    """pixel_values and grid_thw disagree, or a grid is not a whole number of merge blocks."""


@dataclass(frozen=True)
class VisionBatch:
    """What every block needs about the packed images, computed once per forward."""

    cos: torch.Tensor  # [num_patches, head_dim] float32, the rotary cos per patch (its two halves equal)
    sin: torch.Tensor  # [num_patches, head_dim] float32
    segments: PackedSegments  # the attention segments, in order, covering every patch once
    patch_index: Optional[torch.Tensor] = None  # [num_patches] int64 (CUDA): each patch's cos / sin row for
    #   the fused rotary kernel; None: the rotary runs as torch ops (CPU, exact)


def rotary_patch_index(num_patches: int, device: torch.device) -> Optional[torch.Tensor]:
    """``VisionBatch.patch_index`` for packed patches on ``device``: 0..num_patches-1 on CUDA, else None."""
    return torch.arange(num_patches, device=device) if device.type == "cuda" else None


def frame_runs(grid_thw: list[list[int]]) -> list[SegmentRun]:
    """The frames of ``grid_thw`` rows ([t, h, w] per image) as runs of consecutive equal-size frames
    (transformers' cu_seqlens segments, batched where they are the same length)."""
    return join_runs((t, h * w) for t, h, w in grid_thw)


def rotary_position_ids(grid_thw: list[list[int]], merge_size: int) -> torch.Tensor:
    """[num_patches, 2] (row, column) of every patch, on the CPU, in the processor's order: frames, then merge
    blocks row-major, then the merge x merge patches of a block row-major."""
    position_ids = []
    for t, h, w in grid_thw:
        rows = torch.arange(h)[:, None].expand(h, w)  # [h, w]
        cols = torch.arange(w)[None, :].expand(h, w)  # [h, w]
        block_shape = (h // merge_size, merge_size, w // merge_size, merge_size)
        rows = rows.reshape(block_shape).transpose(1, 2).flatten()
        cols = cols.reshape(block_shape).transpose(1, 2).flatten()
        position_ids.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(position_ids)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d]: (x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_vision_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_patches, heads, head_dim] rotated in float32 by cos / sin [num_patches, head_dim], cast back."""
    x_float = x.float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [num_patches, 1, head_dim]
    return (x_float * cos + rotate_half(x_float) * sin).to(x.dtype)


class VisionRotary(nn.Module):
    """Axial 2-D rotary: head_dim / 4 frequencies, the first half of each rotated pair turns with the
    patch row, the second with the column."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        spatial_dim = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim / 4]

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [num_patches, 2] -> cos, sin [num_patches, head_dim] float32."""
        inv_freq = self.inv_freq.to(device=position_ids.device, dtype=torch.float)
        freqs = (position_ids[..., None].float() * inv_freq).flatten(1)  # [num_patches, head_dim / 2] (h | w)
        angles = torch.cat([freqs, freqs], dim=-1)  # [num_patches, head_dim]
        return angles.cos(), angles.sin()


class VisionAttention(nn.Module):
    """Self-attention over the packed patches, per frame of each image, with the 2-D rotary on q and k."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"{_TOWER}: embed_dim={embed_dim} is not a multiple of num_heads={num_heads}.")
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = Linear(embed_dim, [3 * embed_dim], bias=True)   # one projection, as in transformers
        self.proj = Linear(embed_dim, [embed_dim], bias=True)

    def forward(self, hidden_states: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        """hidden_states [num_patches, embed_dim] -> [num_patches, embed_dim]."""
        num_patches, embed_dim = hidden_states.shape
        qkv = self.qkv(hidden_states).view(num_patches, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # each [num_patches, heads, head_dim]
        if batch.patch_index is not None:   # CUDA: q and k rotated in place in one kernel (float32 math)
            from kernels.layer_ops import rotary_embedding_
            half = self.head_dim // 2
            rotary_embedding_(batch.patch_index, q, k, batch.cos[:, :half], batch.sin[:, :half],
                              self.head_dim)
        else:
            q = apply_vision_rotary(q, batch.cos, batch.sin)
            k = apply_vision_rotary(k, batch.cos, batch.sin)
        out = packed_attention(q, k, v, batch.segments, self.scale)  # [num_patches, heads, head_dim]
        out = out.reshape(num_patches, embed_dim)
        return self.proj(out)


class VisionBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, config) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.embed_dim, eps=_NORM_EPS)
        self.norm2 = nn.LayerNorm(config.embed_dim, eps=_NORM_EPS)
        self.attn = VisionAttention(config.embed_dim, config.num_heads)
        self.mlp = ViTMLP(config.embed_dim, int(config.embed_dim * config.mlp_ratio), config.hidden_act)

    def forward(self, hidden_states: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        """hidden_states [num_patches, embed_dim] -> [num_patches, embed_dim]."""
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states), batch)
        return hidden_states + self.mlp(self.norm2(hidden_states))


class PatchMerger(nn.Module):
    """Normalize each patch (LayerNorm, or the ``norm`` given), concatenate each merge x merge block,
    2-layer GELU MLP to the LM's width."""

    def __init__(self, out_dim: int, embed_dim: int, merge_size: int,
                 norm: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.merged_dim = embed_dim * merge_size ** 2
        self.ln_q = nn.LayerNorm(embed_dim, eps=_NORM_EPS) if norm is None else norm
        self.mlp = nn.Sequential(Linear(self.merged_dim, [self.merged_dim], bias=True), nn.GELU(),
                                 Linear(self.merged_dim, [out_dim], bias=True))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [num_patches, embed_dim] -> [num_patches / merge**2, out_dim]."""
        return self.mlp(self.ln_q(hidden_states).view(-1, self.merged_dim))


def check_grids(pixel_values: torch.Tensor, grid_thw: torch.Tensor, merge_size: int, patch_dim: int,
                tower: str) -> list[list[int]]:
    """grid_thw [num_images, 3] as lists of (t, h, w); GridError unless every grid is whole merge blocks
    and pixel_values is [sum of t * h * w, patch_dim]."""
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise GridError(f"{tower}: grid_thw must be [num_images, 3] (t, h, w in patches), "
                        f"got {list(grid_thw.shape)}.")
    grids = grid_thw.tolist()
    for t, h, w in grids:
        if t < 1 or h < 1 or w < 1 or h % merge_size or w % merge_size:
            raise GridError(f"{tower}: grid (t={t}, h={h}, w={w}) must have t >= 1 and h, w positive "
                            f"multiples of spatial_merge_size={merge_size}.")
    num_patches = sum(t * h * w for t, h, w in grids)
    if tuple(pixel_values.shape) != (num_patches, patch_dim):
        raise GridError(f"{tower}: pixel_values must be [{num_patches}, {patch_dim}] for grid_thw {grids} "
                        f"(patches, C * temporal_patch_size * patch_size**2), "
                        f"got {list(pixel_values.shape)}.")
    return grids


def conv3d_as_linear(name: str, weight: torch.Tensor, patch_shape: tuple[int, ...],
                     tower: str) -> torch.Tensor:
    """transformers' patch Conv3d weight [embed_dim, C, T, P, P] -> the Linear's [embed_dim, C * T * P * P]
    (stride == kernel: the conv is a matmul over the flattened patch)."""
    if tuple(weight.shape[1:]) != patch_shape:
        raise WeightLoadError(f"{tower}: checkpoint tensor {name!r} has shape {list(weight.shape)}, expected "
                              f"[embed_dim, {', '.join(map(str, patch_shape))}] (the config's in_channels, "
                              f"temporal_patch_size, patch_size, patch_size).")
    return weight.reshape(weight.shape[0], -1)


def vision_lora_slices(num_blocks: int, mlp: tuple[str, ...]) -> LoRASlices:
    """A Qwen2-VL-style tower's projections an adapter may update, by transformers' module names (relative
    to the tower): each block's attn.qkv (one projection here as there), attn.proj and the MLP
    projections ``mlp`` names (relative to the block, each one Linear of ours), the merger's mlp.0 and
    mlp.2."""
    slices: LoRASlices = {}
    for index in range(num_blocks):
        for name in ("attn.qkv", "attn.proj", *mlp):
            slices[f"blocks.{index}.{name}"] = (f"blocks.{index}.{name}", 0)
    for name in ("merger.mlp.0", "merger.mlp.2"):
        slices[name] = (name, 0)
    return slices


def patch_shape(config) -> tuple[int, int, int, int]:
    """(C, T, P, P): transformers' Conv3d kernel; a flattened patch is in this order."""
    return (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)


def rope_theta(config) -> float:
    """The vision rotary base (``rope_parameters`` in transformers 5; 10000 before)."""
    return (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)


class Qwen2VLVisionTransformer(nn.Module):
    """Qwen2-VL's vision encoder built from a transformers ``Qwen2VLVisionConfig``: patch embedding,
    ``depth`` rotary ViT blocks, PatchMerger to ``config.hidden_size`` (the language model's width)."""

    def __init__(self, vision_config) -> None:
        super().__init__()
        config = vision_config
        self.merge_size = config.spatial_merge_size
        self.patch_shape = patch_shape(config)  # transformers' Conv3d kernel (C, T, P, P)
        self.patch_dim = math.prod(self.patch_shape)  # values per flattened patch
        # The Conv3d of transformers (stride == kernel) as a matmul over the flattened patch.
        self.patch_embed = nn.Linear(self.patch_dim, config.embed_dim, bias=False)
        self.rotary = VisionRotary(config.embed_dim // config.num_heads, rope_theta(config))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.hidden_size, config.embed_dim, config.spatial_merge_size)

    def _batch(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionBatch:
        grids = check_grids(pixel_values, grid_thw, self.merge_size, self.patch_dim, _TOWER)
        position_ids = rotary_position_ids(grids, self.merge_size).to(pixel_values.device)  # built on the CPU
        cos, sin = self.rotary(position_ids)
        device = pixel_values.device
        return VisionBatch(cos=cos, sin=sin, segments=packed_segments(frame_runs(grids), device),
                           patch_index=rotary_patch_index(cos.shape[0], device))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [num_patches, C * temporal_patch_size * patch_size**2] (any float dtype), grid_thw
        [num_images, 3] (t, h, w in patches) -> [num_patches / spatial_merge_size**2, hidden_size], the
        images' embeddings concatenated in order."""
        batch = self._batch(pixel_values, grid_thw)
        hidden_states = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))  # [P, embed_dim]
        for block in self.blocks:
            hidden_states = block(hidden_states, batch)
        return self.merger(hidden_states)

    def lora_slices(self) -> LoRASlices:
        """The projections an adapter may update (``vision_lora_slices``; the MLP's fc1 and fc2)."""
        return vision_lora_slices(len(self.blocks), ("mlp.fc1", "mlp.fc2"))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load tensors named as in transformers' ``Qwen2VisionTransformerPretrainedModel.state_dict()``
        (strip the checkpoint's ``visual.`` / ``model.visual.`` prefix first); the Conv3d patch weight
        [embed_dim, C, T, P, P] is flattened to the Linear's [embed_dim, C * T * P * P]."""
        loader = TowerWeights(self, _TOWER, _EXPECTED_NAMES)
        for name, tensor in weights:
            if name == "patch_embed.proj.weight":
                weight = conv3d_as_linear(name, tensor, self.patch_shape, _TOWER)
                loader.load(name, "patch_embed.weight", weight)
            else:
                loader.load(name, name, tensor)
        loader.finish()
