"""Gemma 3 (text-only, ``Gemma3ForCausalLM``): the Qwen3 attention layout (per-head q/k norms) inside
Gemma's decoder, as transformers' ``modeling_gemma3``.

Differences from Llama / Qwen3 (``engine.models.llama``, ``engine.models.qwen3``):

- every RMSNorm (the four of each layer, the final one, q_norm and k_norm) scales by ``1 + w``: the
  checkpoint stores w, ``load_weights`` stores ``w + 1``, so every norm path of the engine (torch, the CPU C
  op, the CUDA kernels, the fused norm -> GEMV, the q/k norms inside the rotary + KV write that
  ``Qwen3Attention`` declares) computes Gemma's norm unchanged;
- the token embeddings are scaled by sqrt(hidden_size) (in the embedding's dtype, as transformers);
- GeGLU MLP: ``gelu_pytorch_tanh(gate) * up``;
- four norms per layer: ``h = h + post_attention_layernorm(attn(input_layernorm(h)))``, then
  ``h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``; the residual adds run fused
  with the next pre-norm (``engine.layers.fused.norm_linear``) as Llama's;
- attention scale ``query_pre_attn_scalar ** -0.5`` (not head_dim's);
- interleaved sliding-window and global layers (``layer_types``, or the older ``sliding_window_pattern``
  from which transformers derives them), each kind with its own rotary: ``rope_parameters
  ['sliding_attention']`` (``rope_local_base_freq``) and ``rope_parameters['full_attention']``
  (``rope_theta`` + ``rope_scaling``);
- final logit soft-capping ``tanh(logits / c) * c`` where ``final_logit_softcapping`` is set;
- tied embeddings (``tie_word_embeddings``, True in the released checkpoints).

Sliding layers attend within ``sliding_window`` (``engine.models.sliding_window``: each layer's
``PagedAttention.sliding_window``), global layers to the whole context. Attention-logit
soft-capping (``attn_logit_softcapping``, None in every released Gemma 3) and bidirectional attention
(``use_bidirectional_attention``) are refused (a ValueError at construction).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.distributed.group import TensorParallelGroup
from engine.layers.adapter import Feeds
from engine.layers.fused import norm_linear
from engine.layers.norm import RMSNorm
from engine.layers.parallel import VocabParallelEmbedding, column_parallel_linear, row_parallel_linear
from engine.layers.rotary import RotaryEmbedding
from engine.models.interfaces import ModelShape
from engine.models.llama import LlamaForCausalLM, _head_dim
from engine.models.qwen3 import Qwen3Attention
from engine.models.sliding_window import FULL, layer_types, layer_windows, set_layer_windows


def check_gemma3_config(config) -> None:
    """ValueError for what Chorus does not compute (see the module docstring)."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"attn_logit_softcapping={config.attn_logit_softcapping} is not supported "
                         f"(no attention backend soft-caps attention logits).")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported (causal attention only).")
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation={act!r} is not supported (Gemma 3 uses 'gelu_pytorch_tanh').")


class _RopeOf:
    """``config`` seen by one layer kind: ``rope_parameters`` is that kind's flat dict, so that
    ``RotaryEmbedding`` (and transformers' ``ROPE_INIT_FUNCTIONS``, called without ``layer_type``) read it."""

    def __init__(self, config, layer_type: str) -> None:
        params = getattr(config, "rope_parameters", None) or {}
        if layer_type in params:
            params = params[layer_type]
        else:   # an older config: rope_theta / rope_scaling for global layers, rope_local_base_freq for local
            params = dict(getattr(config, "rope_scaling", None) or {}) if layer_type == FULL else {}
            params.setdefault("rope_theta", getattr(config, "rope_theta", 1_000_000.0) if layer_type == FULL
                              else getattr(config, "rope_local_base_freq", 10_000.0))
        self.__dict__["_config"] = config
        self.__dict__["rope_parameters"] = dict(params)
        self.__dict__["rope_scaling"] = None

    def __getattr__(self, name):
        return getattr(self.__dict__["_config"], name)


class Gemma3Attention(Qwen3Attention):
    """Qwen3's attention (packed q|k|v, per-head q/k norms before rotary) with Gemma's scale
    (``query_pre_attn_scalar ** -0.5``) and its layer kind's rotary; o_proj feeds the post-attention norm
    (``Feeds.ANY``: a norm without residual, which takes neither split-K partials nor a pending update)."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, tp: TensorParallelGroup) -> None:
        super().__init__(config, rotary_emb, tp)
        self.o_proj.feeds = Feeds.ANY
        self.attn.scale = float(config.query_pre_attn_scalar) ** -0.5


class Gemma3MLP(nn.Module):
    """GeGLU (tanh GELU) over this rank's intermediate columns: gate|up column-parallel, down row-parallel."""

    def __init__(self, config, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.gate_up_proj = column_parallel_linear(config.hidden_size, [config.intermediate_size] * 2, False,
                                                   tp)
        self.down_proj = row_parallel_linear(config.intermediate_size, config.hidden_size, False, tp)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2 * intermediate] -> [T, hidden]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_type: str, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Gemma3Attention(config, rotary_emb, tp)
        self.mlp = Gemma3MLP(config, tp)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [T, hidden] (the scaled embeddings when ``residual`` is None) -> (output, residual), the
        output to be added to the residual by the next norm (next layer's input norm, or the final norm)."""
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, qkv))
        gate_up, residual = norm_linear(self.pre_feedforward_layernorm, self.mlp.gate_up_proj, hidden,
                                        residual)
        return self.post_feedforward_layernorm(self.mlp(gate_up)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config, max_position: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        if tp.size == 1:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.embed_tokens.weight.requires_grad_(False)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.embed_scale = float(config.hidden_size) ** 0.5
        types = layer_types(config)
        head_dim = _head_dim(config)
        # One rotary per layer kind, shared by that kind's layers (one cos/sin gather per kind per step).
        rotary = {kind: RotaryEmbedding(_RopeOf(config, kind), head_dim, max_position)
                  for kind in sorted(set(types))}
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, rotary[kind], kind, tp) for kind in types)
        set_layer_windows((layer.self_attn.attn for layer in self.layers), layer_windows(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> embeddings x sqrt(hidden_size) [T, hidden] (the scale rounded to their dtype)."""
        emb = self.embed_tokens(input_ids)
        return emb * torch.tensor(self.embed_scale, dtype=emb.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds    # [T, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3, text only. Module and checkpoint names as transformers'
    (``model.layers.N.pre_feedforward_layernorm.weight``, ...); q/k/v and gate/up packed as Llama's
    (``packed_modules_mapping``, ``lora_layout``), so the inherited loading, sharding, quantization and
    adapter layout apply."""

    def __init__(self, config, max_position: int, tp: Optional[TensorParallelGroup] = None) -> None:
        check_gemma3_config(config)
        nn.Module.__init__(self)
        self.config = config
        self.shape = ModelShape(config.hidden_size, config.intermediate_size, config.vocab_size)
        self.tp = tp or TensorParallelGroup.single()
        self.model = Gemma3Model(config, max_position, self.tp)
        self.quantized_head = None
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head = None
        elif self.tp.size > 1:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.tp)
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> token embeddings x sqrt(hidden_size) [T, hidden] (what ``forward`` takes as
        ``inputs_embeds``)."""
        return self.model.embed(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, vocab], soft-capped where ``final_logit_softcapping`` is set."""
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``LlamaForCausalLM.load_weights`` with every RMSNorm weight stored as ``1 + w`` (Gemma's norm
        scales by 1 + w; the engine's norms by their weight). 1 + w is computed in float32 and handed on in
        float32 (the copy into the parameter rounds it once, to the model's dtype): a bfloat16 checkpoint
        served in float32 keeps transformers' float32 ``1 + w`` exactly."""
        def shifted():
            for name, tensor in weights:
                if name.endswith("norm.weight") and isinstance(tensor, torch.Tensor):
                    tensor = 1.0 + tensor.float()
                yield name, tensor
        super().load_weights(shifted())
