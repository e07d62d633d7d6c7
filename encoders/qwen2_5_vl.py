"""The Qwen2.5-VL vision transformer, exact against transformers' Qwen2_5_VisionTransformerPretrainedModel.

Qwen2-VL's tower (see ``encoders.qwen2_vl``) with RMSNorm, a gated SiLU MLP (gate and up packed into
one Linear here) and window attention: every block except ``fullatt_block_indexes`` attends only
within windows of ``window_size`` pixels (``window_size / patch_size / merge`` merge blocks a side;
edge windows are smaller). The patches are reordered once so that each window's patches are
contiguous, the blocks run on that order, and the merged tokens are put back in the processor's
order at the end.

LoRA: the blocks' and the merger's projections take adapters as Qwen2-VL's do; an adapter's gate_proj and
up_proj are the two output slices of ``gate_up_proj`` (``lora_slices``).

Attention is ``encoders.varlen_attention.packed_attention`` over the windows (or, in the full-attention
blocks, the frames) as packed segments. Within each frame, windows are ordered by size (full windows
first), so that where attention runs one SDPA call per run of equal segments (CPU), windows of one
size are contiguous and attend in one call; the order of windows and of the patches inside one does
not change the result. Frames stay contiguous, so the full-attention blocks still attend per frame.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn

from encoders.qwen2_vl import (
    PatchMerger, VisionAttention, VisionBatch, VisionRotary, check_grids, conv3d_as_linear, frame_runs,
    patch_shape, rope_theta, rotary_patch_index, rotary_position_ids, vision_lora_slices,
)
from encoders.varlen_attention import SegmentRun, join_runs, packed_segments
from encoders.vit import LoRASlices, TowerWeights, activation
from engine.layers.linear import Linear

_TOWER = "Qwen2_5_VLVisionTransformer"
_EXPECTED_NAMES = "transformers' Qwen2_5_VisionTransformerPretrainedModel.state_dict()"
_NORM_EPS = 1e-6  # transformers hard-codes RMSNorm(eps=1e-6) in the blocks and the merger


class RMSNorm(nn.Module):
    """x / rms(x) in float32, cast back, times the weight (transformers' Qwen2_5_VLRMSNorm)."""

    def __init__(self, dim: int, eps: float = _NORM_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(hidden_states.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); ``gate_up_proj.weight`` is [2 * intermediate, dim], gate rows first (its
    output slices 0 and 1)."""

    def __init__(self, dim: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.act = activation(hidden_act)
        self.silu = hidden_act == "silu"  # on CUDA, act(gate) * up is one kernel (kernels.layer_ops)
        self.gate_up_proj = Linear(dim, [intermediate_size] * 2, bias=True)
        self.down_proj = Linear(intermediate_size, [dim], bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [num_patches, dim] -> [num_patches, dim]."""
        gate_up = self.gate_up_proj(hidden_states)  # [num_patches, 2 * intermediate]
        if self.silu and gate_up.is_cuda:
            from kernels.layer_ops import silu_and_mul
            return self.down_proj(silu_and_mul(gate_up))   # silu rounded to the dtype, then * up
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class VisionBlock(nn.Module):
    """Pre-RMSNorm block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, config) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size)
        self.norm2 = RMSNorm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, hidden_states: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        """hidden_states [num_patches, hidden] -> [num_patches, hidden]."""
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states), batch)
        return hidden_states + self.mlp(self.norm2(hidden_states))


@dataclass(frozen=True)
class WindowLayout:
    """The window order of the merge blocks of a batch of images, and its attention segments."""

    unit_order: torch.Tensor  # [num_patches / merge**2] int64: the processor's merge-block index at each slot
    runs: list[SegmentRun]  # the windows as attention segments, in the window order


def window_layout(grids: list[list[int]], merge_size: int, window_blocks: int) -> WindowLayout:
    """Windows of ``window_blocks`` x ``window_blocks`` merge blocks tiling each frame from the top left
    (the last row / column of windows may be smaller); within a frame, windows by size (largest first),
    then row-major; inside a window, its merge blocks row-major."""
    orders: list[torch.Tensor] = []
    segments: list[tuple[int, int]] = []  # (windows, patches per window), in order
    first_block = 0
    for t, h, w in grids:
        rows_b, cols_b = h // merge_size, w // merge_size  # the frame in merge blocks
        row = torch.arange(rows_b)[:, None].expand(rows_b, cols_b)
        col = torch.arange(cols_b)[None, :].expand(rows_b, cols_b)
        window_row, window_col = row // window_blocks, col // window_blocks
        windows_per_row = -(-cols_b // window_blocks)
        num_windows = -(-rows_b // window_blocks) * windows_per_row
        # [rows_b, cols_b]: the merge blocks in each block's window, and the window's row-major index
        window_size = ((rows_b - window_row * window_blocks).clamp(max=window_blocks)
                       * (cols_b - window_col * window_blocks).clamp(max=window_blocks))
        window_id = window_row * windows_per_row + window_col
        window_key = (window_blocks ** 2 - window_size) * num_windows + window_id  # larger windows first
        frame_order = (window_key * (rows_b * cols_b) + row * cols_b + col).flatten().argsort()
        window_rows = [min(window_blocks, rows_b - start) for start in range(0, rows_b, window_blocks)]
        window_cols = [min(window_blocks, cols_b - start) for start in range(0, cols_b, window_blocks)]
        windows_by_size = Counter(rows * cols for rows in window_rows for cols in window_cols)
        frame_segments = [(count, size * merge_size ** 2) for size, count in sorted(windows_by_size.items(),
                                                                                     reverse=True)]
        for frame in range(t):
            orders.append(frame_order + first_block + frame * rows_b * cols_b)
            segments.extend(frame_segments)
        first_block += t * rows_b * cols_b
    return WindowLayout(unit_order=torch.cat(orders), runs=join_runs(segments))


class Qwen2_5_VLVisionTransformer(nn.Module):
    """Qwen2.5-VL's vision encoder built from a transformers ``Qwen2_5_VLVisionConfig``: patch embedding,
    ``depth`` rotary blocks (window attention except ``fullatt_block_indexes``), PatchMerger to
    ``config.out_hidden_size`` (the language model's width)."""

    def __init__(self, vision_config) -> None:
        super().__init__()
        config = vision_config
        self.merge_size = config.spatial_merge_size
        self.window_blocks = config.window_size // config.spatial_merge_size // config.patch_size
        if self.window_blocks < 1:
            block_px = config.spatial_merge_size * config.patch_size
            raise ValueError(f"{_TOWER}: window_size={config.window_size} must cover at least one merge "
                             f"block (spatial_merge_size * patch_size = {block_px} pixels).")
        self.full_attention_blocks = frozenset(config.fullatt_block_indexes)
        self.patch_shape = patch_shape(config)  # transformers' Conv3d kernel (C, T, P, P)
        self.patch_dim = math.prod(self.patch_shape)  # values per flattened patch
        self.patch_embed = nn.Linear(self.patch_dim, config.hidden_size, bias=False)
        self.rotary = VisionRotary(config.hidden_size // config.num_heads, rope_theta(config))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.out_hidden_size, config.hidden_size, config.spatial_merge_size,
                                  norm=RMSNorm(config.hidden_size))

    def _to_window_order(self, x: torch.Tensor, unit_order: torch.Tensor) -> torch.Tensor:
        """x [num_patches, ...] in the processor's order -> the same rows, merge blocks in window order."""
        blocks = x.reshape(x.shape[0] // self.merge_size ** 2, self.merge_size ** 2, *x.shape[1:])
        return blocks[unit_order].reshape(x.shape)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [num_patches, C * temporal_patch_size * patch_size**2] (any float dtype), grid_thw
        [num_images, 3] (t, h, w in patches) -> [num_patches / spatial_merge_size**2, out_hidden_size], the
        images' embeddings concatenated in order."""
        grids = check_grids(pixel_values, grid_thw, self.merge_size, self.patch_dim, _TOWER)
        layout = window_layout(grids, self.merge_size, self.window_blocks)  # built on the CPU
        position_ids = self._to_window_order(rotary_position_ids(grids, self.merge_size), layout.unit_order)
        unit_order = layout.unit_order.to(pixel_values.device)
        cos, sin = self.rotary(position_ids.to(pixel_values.device))
        device = pixel_values.device
        patch_index = rotary_patch_index(cos.shape[0], device)
        full = VisionBatch(cos=cos, sin=sin, segments=packed_segments(frame_runs(grids), device),
                           patch_index=patch_index)
        windowed = VisionBatch(cos=cos, sin=sin, segments=packed_segments(layout.runs, device),
                               patch_index=patch_index)
        hidden_states = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))  # [P, hidden]
        hidden_states = self._to_window_order(hidden_states, unit_order)
        for index, block in enumerate(self.blocks):
            hidden_states = block(hidden_states, full if index in self.full_attention_blocks else windowed)
        merged = self.merger(hidden_states)  # [P / merge**2, out_hidden_size], window order
        return torch.empty_like(merged).index_copy_(0, unit_order, merged)

    def lora_slices(self) -> LoRASlices:
        """The projections an adapter may update (``vision_lora_slices``): each block's mlp.gate_proj and
        mlp.up_proj are slices 0 and 1 of ``mlp.gate_up_proj``."""
        slices = vision_lora_slices(len(self.blocks), ("mlp.down_proj",))
        for index in range(len(self.blocks)):
            for idx, name in enumerate(("gate_proj", "up_proj")):
                slices[f"blocks.{index}.mlp.{name}"] = (f"blocks.{index}.mlp.gate_up_proj", idx)
        return slices

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load tensors named as in transformers' ``Qwen2_5_VisionTransformerPretrainedModel.state_dict()``
        (strip the checkpoint's ``visual.`` / ``model.visual.`` prefix first); the Conv3d patch weight is
        flattened to the Linear's, each block's gate_proj and up_proj are packed into ``gate_up_proj``."""
        loader = TowerWeights(self, _TOWER, _EXPECTED_NAMES)
        for name, tensor in weights:
            if name == "patch_embed.proj.weight":
                weight = conv3d_as_linear(name, tensor, self.patch_shape, _TOWER)
                loader.load(name, "patch_embed.weight", weight)
            elif name.endswith((".mlp.gate_proj.weight", ".mlp.gate_proj.bias", ".mlp.up_proj.weight",
                                ".mlp.up_proj.bias")):
                prefix, proj, kind = name.rsplit(".", 2)
                loader.load(name, f"{prefix}.gate_up_proj.{kind}", tensor, shard=int(proj == "up_proj"),
                            num_shards=2)
            else:
                loader.load(name, name, tensor)
        loader.finish()
