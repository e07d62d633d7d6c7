"""Qwen3 (dense): the Llama layout with a per-head RMSNorm on q and on k before rotary.

Differences from Llama (``engine.models.llama``), as transformers' ``Qwen3Attention``:

- ``q_norm`` / ``k_norm``: RMSNorm over ``head_dim`` (weight [head_dim]), applied to every head of q and
  of k after the q/k/v projection and before rotary. The attention layer applies them
  (``PagedAttention.qk_norm``, declared here): on CUDA inside the kernels that rotate q and k and write the
  KV cache (the decode step's fused attention included), so they cost no launch of their own;
- ``head_dim`` comes from the config and may differ from hidden_size / num_attention_heads (the
  projections are [heads * head_dim, hidden], o_proj [hidden, heads * head_dim]);
- one ``attention_bias`` flag for q/k/v and o (False in the released checkpoints);
- tied or untied embeddings (``tie_word_embeddings``), as Llama.

Because the norms sit between the projection and the rotary, the q/k/v projection's adapter update is added
when the projection runs (``Feeds.ANY``): the adapter's rotary + KV write kernel (``kernels.lora_rotary_write_kv``)
has no q/k norm. ``Qwen3Attention`` is shared with Qwen3-MoE (``engine.models.qwen3_moe``).
"""

from __future__ import annotations

from engine.distributed.group import TensorParallelGroup
from engine.layers.adapter import Feeds
from engine.layers.norm import RMSNorm
from engine.layers.qk_norm import QKNorm
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
    ``k_norm`` ([head_dim] weights, the same on every rank), ``attn`` (``PagedAttention``, which applies
    q_norm and k_norm: ``attn.qk_norm``). A decoder layer calls ``forward(positions, qkv_proj(norm(hidden)))``
    (``engine.layers.fused.norm_linear``, Llama's ``forward``) and gets [T, hidden] back.
    """

    def __init__(self, config, rotary_emb: RotaryEmbedding, tp: TensorParallelGroup) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, rotary_emb, qkv_bias=bias, o_bias=bias, tp=tp)
        # The q/k norms read the projection's output before rotary: its adapter update is added when it runs.
        self.qkv_proj.feeds = Feeds.ANY
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn.qk_norm = QKNorm(self.q_norm, self.k_norm)

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
