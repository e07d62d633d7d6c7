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

from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import LlamaAttention
from engine.models.qwen3_moe import Qwen3MoeForCausalLM


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2-MoE: Qwen3-MoE's layers (the same sparse-layer rule, routing and shared expert) with Qwen2's
    attention."""

    def build_attention(self, config, rotary_emb: RotaryEmbedding) -> LlamaAttention:
        return LlamaAttention(config, rotary_emb, qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False,
                              tp=self.tp)
