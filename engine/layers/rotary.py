"""Rotary position embeddings (neox / rotate-half layout, as HF checkpoints store q and k).

Every rope variant a config may carry (default, linear, dynamic, yarn, longrope, llama3) gets
its inverse frequencies from transformers' ``ROPE_INIT_FUNCTIONS``, so the numbers match the
reference exactly; the cos/sin table is computed once for ``max_position`` positions.
On CUDA one Triton kernel (``kernels.layer_ops.rotary_embedding_``) rotates q and k in place;
``forward_torch`` is its twin and the CPU path.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def rope_parameters(config) -> dict:
    """The config's rope dict in transformers-5 form ({'rope_type', 'rope_theta', ...})."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    if params["rope_type"] == "mrope":
        params["rope_type"] = "default"   # Qwen2-VL's old spelling: default frequencies, sections below
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_position: int) -> None:
        super().__init__()
        params = rope_parameters(config)
        rotary_dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
        rope_type = params["rope_type"]
        if rope_type == "default":
            base = float(params["rope_theta"])
            inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, "
                                 f"{', '.join(ROPE_INIT_FUNCTIONS)}")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        self.rotary_dim = rotary_dim
        positions = torch.arange(max_position, dtype=torch.float32)
        inv_freq = inv_freq.float().to(positions.device)
        freqs = positions[:, None] * inv_freq[None, :]                   # [max_position, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)                          # [max_position, rotary_dim]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        sign = torch.ones(rotary_dim)
        sign[:rotary_dim // 2] = -1.0
        # sin with its first half negated: rotate_half(x) * sin == x.roll(rotary_dim / 2) * sin_signed
        self.register_buffer("sin_signed", self.sin * sign, persistent=False)
        self._step_cache = None

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x [T, H, r] -> x * cos + rotate_half(x) * sin, as x * cos + roll(x, r / 2) * sin_signed: three
        kernels instead of rotate_half's slices, neg and cat (RESULTS.md "What sets the CPU defaults")."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [T]; q: [T, H, D], k: [T, Hkv, D] -> rotated (q, k) (in place on CUDA)."""
        if q.is_cuda:
            from kernels.layer_ops import rotary_embedding_
            half = self.rotary_dim // 2
            rotary_embedding_(positions, q, k, self.cos[:, :half], self.sin[:, :half], self.rotary_dim)
            return q, k
        return self.forward_torch(positions, q, k)

    def apply_and_write_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           pending_update=None, *, k_scale: float = 1.0, v_scale: float = 1.0,
                           qk_norm=None) -> None:
        """CUDA: rotate q and k in place and write the rotated k and v into the paged cache, in one
        kernel (``kernels.kv_write.rotary_write_kv``); with ``pending_update`` (the q/k/v projection's
        adapter update still to add, an ``engine.pending_update.PendingUpdate``) the adapter's
        variant of that kernel adds it first. ``k_scale`` / ``v_scale``: an FP8 cache's scales.
        ``qk_norm`` (``kernels.kv_write.QKNormWeights``, never with ``pending_update``): q and k
        RMS-normalized per head first, in the same kernel."""
        half = self.rotary_dim // 2
        args = (positions, q, k, v, self.cos[:, :half], self.sin[:, :half], self.rotary_dim, k_cache, v_cache,
                slot_mapping)
        if pending_update is not None:
            assert qk_norm is None, "the adapter's rotary + KV write has no q/k norm"
            pending_update.finish_rotary_write_kv(*args, k_scale=k_scale, v_scale=v_scale)
            return
        from kernels.kv_write import rotary_write_kv
        rotary_write_kv(*args, k_scale=k_scale, v_scale=v_scale, qk_norm=qk_norm)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [T] -> cos, sin_signed [T, 1, rotary_dim] in ``dtype``."""
        # Every layer of one forward passes the same positions tensor: gather cos/sin once.
        cached = self._step_cache
        if cached is not None and cached[0] is positions and cached[1].dtype == dtype:
            return cached[1], cached[2]
        cos = self.cos[positions].to(dtype)[:, None, :]                 # [T, 1, rotary_dim]
        sin = self.sin_signed[positions].to(dtype)[:, None, :]
        self._step_cache = (positions, cos, sin)
        return cos, sin

    def forward_torch(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self._cos_sin(positions, q.dtype)
        r = self.rotary_dim
        if r == q.shape[-1]:
            return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        qr, qp = q[..., :r], q[..., r:]
        kr, kp = k[..., :r], k[..., r:]
        return torch.cat((self._rotate(qr, cos, sin), qp), -1), torch.cat((self._rotate(kr, cos, sin), kp), -1)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary (Qwen2-VL's M-RoPE): positions are [3, T] (temporal, height, width) and
    the rotary dims are split into ``mrope_section`` (halves, e.g. [16, 24, 24]): section i takes
    its angles from row i. Text tokens have three equal rows, where this is plain rotary at that
    position, so [T] positions (the runner's 1-D steps, CUDA graphs included) take the parent's
    paths; [3, T] positions (steps with image tokens) rotate in torch."""

    def __init__(self, config, head_dim: int, max_position: int) -> None:
        super().__init__(config, head_dim, max_position)
        sections = list(rope_parameters(config).get("mrope_section") or [])
        half = self.rotary_dim // 2
        if len(sections) != 3 or sum(sections) != half:
            raise ValueError(f"mrope_section={sections} must be 3 sizes summing to rotary_dim / 2 = {half}.")
        row = torch.repeat_interleave(torch.arange(3), torch.tensor(sections))   # [rotary_dim / 2]
        self.register_buffer("section_row", torch.cat((row, row)), persistent=False)  # [rotary_dim]

    def _cos_sin_3d(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [3, T] -> cos, sin_signed [T, 1, rotary_dim], each dim from its section's row."""
        cached = self._step_cache
        if cached is not None and cached[0] is positions and cached[1].dtype == dtype:
            return cached[1], cached[2]
        num_tokens = positions.shape[1]
        index = self.section_row.view(1, 1, -1).expand(1, num_tokens, -1)              # [1, T, rotary_dim]
        cos = self.cos[positions].gather(0, index)[0].to(dtype)[:, None, :]             # [T, 1, rotary_dim]
        sin = self.sin_signed[positions].gather(0, index)[0].to(dtype)[:, None, :]
        self._step_cache = (positions, cos, sin)
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        return self.forward_torch(positions, q, k)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        if positions.dim() == 1:
            return super()._cos_sin(positions, dtype)
        return self._cos_sin_3d(positions, dtype)
