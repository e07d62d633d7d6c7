"""Qwen3 (dense): the Llama layout with a per-head RMSNorm on q and on k before rotary.

Differences from Llama (``engine.models.llama``), as transformers' ``Qwen3Attention``:

- ``q_norm`` / ``k_norm``: RMSNorm over ``head_dim`` (weight [head_dim]), applied to every head of q and
  of k after the q/k/v projection and before rotary;
- ``head_dim`` comes from the config and may differ from hidden_size / num_attention_heads (the
  projections are [heads * head_dim, hidden], o_proj [hidden, heads * head_dim]);
- one ``attention_bias`` flag for q/k/v and o (False in the released checkpoints);
- tied or untied embeddings (``tie_word_embeddings``), as Llama.

Because the norms sit between the projection and the rotary, the q/k/v projection's adapter update is added
when the projection runs (``Feeds.ANY``): it never waits for the fused rotary + KV write, which would rotate
un-normalized q and k. ``Qwen3Attention`` is shared with Qwen3-MoE (``engine.models.qwen3_moe``).
"""

from __future__ import annotations

import torch

from engine.distributed.group import TensorParallelGroup
from engine.layers.adapter import Feeds
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.interfaces import QKVConsumer
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    """Qwen3's self-attention over this rank's heads: ``LlamaAttention`` (packed q|k|v column-parallel, o_proj
    row-parallel, KV heads split or replicated) plus ``q_norm`` and ``k_norm``.

    Args:
        config: the (text) config: hidden_size, num_attention_heads, num_key_value_heads, head_dim
            (default hidden_size / num_attention_heads), rms_norm_eps, attention_bias (default False: a
            bias on q/k/v and o alike).
        rotary_emb: the ``RotaryEmbedding`` every layer shares (built over ``head_dim``).
        tp: this rank's tensor-parallel group (``TensorParallelGroup.single()`` unsharded).

    Modules, under transformers' names: ``qkv_proj`` (q_proj | k_proj | v_proj, packed; ``Feeds.ANY``),
    ``o_proj`` (``Feeds.ADD_RMS_NORM``: its output goes to the next residual add + RMSNorm), ``q_norm`` and
    ``k_norm`` ([head_dim] weights, the same on every rank), ``attn`` (``PagedAttention``). A decoder layer
    calls ``forward(positions, qkv_proj(norm(hidden)))`` (``engine.layers.fused.norm_linear``) and gets
    [T, hidden] back.
    """

    def __init__(self, config, rotary_emb: RotaryEmbedding, tp: TensorParallelGroup) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, rotary_emb, qkv_bias=bias, o_bias=bias, tp=tp)
        # The q/k norms read the projection's output before rotary: its adapter update is added when it runs.
        self.qkv_proj.feeds = Feeds.ANY
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """positions: [T] (or [3, T] with an M-RoPE rotary); qkv: [T, q + 2 kv], the output of ``qkv_proj``
        -> [T, hidden], for the post-attention add + RMSNorm."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Each head's row normalized: [T * heads, head_dim] (a copy: q and k are strided views of qkv).
        q = self.q_norm(q.reshape(num_tokens * self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens * self.num_kv_heads, self.head_dim))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))

    def rotary_qkv_consumer(self) -> QKVConsumer:
        """None of Qwen3's: its q/k/v projection never leaves its update to the rotary + KV write."""
        raise NotImplementedError("Qwen3's q/k/v projection adds its adapter update itself (Feeds.ANY): "
                                  "no rotary + KV write consumes it")


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer (SwiGLU MLP, pre-norms) whose self-attention is ``Qwen3Attention``."""

    def build_attention(self, config, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                        tp: TensorParallelGroup) -> Qwen3Attention:
        return Qwen3Attention(config, rotary_emb, tp)   # its biases follow config.attention_bias


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense). Module and checkpoint names as transformers' (``model.layers.N.self_attn.q_norm.weight``,
    ...); q/k/v and gate/up packed as Llama's, so PEFT adapters on q/k/v/o/gate/up/down map the same way
    (``lora_layout``). With ``use_sliding_window`` the layers from ``max_window_layers`` on attend within
    ``sliding_window`` (``engine.models.sliding_window``, set by ``LlamaForCausalLM``)."""

    decoder_layer_cls = Qwen3DecoderLayer
