"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B layout): Qwen2's attention (bias on q/k/v, none on o) and a sparse
MoE block with a gated shared expert (``engine.layers.moe.SparseMoeBlock``) in the layers the config makes sparse.

As transformers' ``Qwen2MoeDecoderLayer``: the sparse layers are Qwen3-MoE's rule (``is_sparse_layer``:
``mlp_only_layers`` and ``decoder_sparse_step``), each with ``num_experts`` experts of ``moe_intermediate_size``,
top ``num_experts_per_tok`` of the softmax over all experts (renormalized when ``norm_topk_prob``), plus
``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` with a SwiGLU shared expert of
``shared_expert_intermediate_size``; dense layers a SwiGLU MLP of ``intermediate_size``. ``qkv_bias`` (default
True) sets the q/k/v bias. With ``use_sliding_window`` the layers whose ``layer_types`` entry is sliding
attend within ``sliding_window`` (``engine.models.sliding_window``).
Checkpoints: ``mlp.gate.weight`` (router), ``mlp.experts.E.gate_proj|up_proj|down_proj.weight`` or transformers
5's stacked ``mlp.experts.gate_up_proj`` / ``down_proj``, ``mlp.shared_expert.gate_proj|up_proj|down_proj.weight``
and ``mlp.shared_expert_gate.weight`` (``engine.models.mixtral``).
"""

from __future__ import annotations

import torch.nn as nn

from engine.layers.moe import SparseMoeBlock
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import LlamaAttention, LlamaMLP
from engine.models.mixtral import MoEForCausalLM
from engine.models.qwen3_moe import is_sparse_layer


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE: Qwen2 attention, sparse blocks with a shared expert."""

    def build_attention(self, config, rotary_emb: RotaryEmbedding) -> LlamaAttention:
        return LlamaAttention(config, rotary_emb, qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False,
                              tp=self.tp)

    def build_mlp(self, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config, bias=False, tp=self.tp)
        return SparseMoeBlock.from_config(config, config.num_experts, config.moe_intermediate_size,
                                          renormalize=bool(getattr(config, "norm_topk_prob", False)), tp=self.tp)
