"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, ``head_dim`` from the config, no bias) and a sparse MoE
MLP (``engine.layers.moe.SparseMoeBlock``) in the layers the config makes sparse.

As transformers' ``Qwen3MoeDecoderLayer``: layer i is sparse unless i is in ``mlp_only_layers`` or
(i + 1) is not a multiple of ``decoder_sparse_step`` (or ``num_experts`` is 0); sparse layers have
``num_experts`` experts of ``moe_intermediate_size``, top ``num_experts_per_tok`` of the softmax over all experts,
renormalized when ``norm_topk_prob``; dense layers a SwiGLU MLP of ``intermediate_size``. A config with a
``shared_expert_intermediate_size`` (Qwen2-MoE style) gets a gated shared expert in each sparse layer.
Checkpoints: ``model.layers.N.mlp.gate.weight`` (router), ``mlp.experts.E.gate_proj|up_proj|down_proj.weight``
or transformers 5's stacked ``mlp.experts.gate_up_proj`` / ``down_proj`` (``engine.models.mixtral``).
With ``use_sliding_window`` every layer attends within ``sliding_window``, as transformers' Qwen3-MoE (which
has no ``max_window_layers``): ``engine.models.sliding_window``.
"""

from __future__ import annotations

import torch.nn as nn

from engine.layers.moe import SparseMoeBlock
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import LlamaMLP
from engine.models.mixtral import MoEForCausalLM
from engine.models.qwen3 import Qwen3Attention


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether transformers builds layer ``layer_idx`` of this config with a sparse MoE block."""
    num_experts = int(getattr(config, "num_experts", 0) or 0)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and num_experts > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B layout)."""

    def build_attention(self, config, rotary_emb: RotaryEmbedding) -> Qwen3Attention:
        return Qwen3Attention(config, rotary_emb, self.tp)

    def build_mlp(self, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config, bias=False, tp=self.tp)
        return SparseMoeBlock.from_config(config, config.num_experts, config.moe_intermediate_size,
                                          renormalize=bool(getattr(config, "norm_topk_prob", False)), tp=self.tp)
