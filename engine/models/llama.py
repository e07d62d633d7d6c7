"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style) and Qwen2 (q/k/v bias).

Flat batches: every forward takes ``input_ids`` [num_tokens] and ``positions`` [num_tokens] of a
mixed prefill/decode step; attention finds each request's context through the step's
``AttentionMetadata``. q/k/v and gate/up are packed into one matmul each.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Union

import torch
import torch.nn as nn

from engine.distributed.group import TensorParallelGroup
from engine.distributed.sharding import Shard, attention_shard, column_shard
from engine.layers.adapter import Feeds
from engine.layers.attention import PagedAttention
from engine.layers.fused import norm_linear, silu_mul_linear
from engine.layers.linear import Linear
from engine.layers.lora_layout import LoRALayout
from engine.layers.norm import RMSNorm
from engine.layers.parallel import (VocabParallelEmbedding, column_parallel_linear, copy_rows, linear_shard_of,
                                    parallel_logits, row_parallel_linear)
from engine.layers.rotary import RotaryEmbedding
from engine.models.interfaces import LogitsRules, ModelCapabilities, ModelShape, QKVConsumer
from engine.models.sliding_window import layer_windows, set_layer_windows
from engine.pending_update import PendingUpdate


def _num_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads (all of them at tensor_parallel_size 1; see
    ``engine.distributed.sharding.attention_shard``): q|k|v column-parallel, o_proj row-parallel."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        num_heads, num_kv_heads = config.num_attention_heads, _num_kv_heads(config)
        self.head_dim = _head_dim(config)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        shard = attention_shard(num_heads, num_kv_heads, tp.rank, tp.size)
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=qkv_bias,
                               feeds=Feeds.ROTARY_KV_WRITE)
        if tp.size > 1:   # KV heads may be replicated: ranges of their own
            q_start, kv_start = tp.rank * self.q_size, shard.kv_head_start * self.head_dim
            kv_range = (kv_start, kv_start + self.kv_size)
            self.qkv_proj.tp_shard = column_shard(
                config.hidden_size, [num_heads * self.head_dim, num_kv_heads * self.head_dim,
                                     num_kv_heads * self.head_dim],
                [(q_start, q_start + self.q_size), kv_range, kv_range])
        self.o_proj = row_parallel_linear(num_heads * self.head_dim, config.hidden_size, o_bias, tp,
                                          feeds=Feeds.ADD_RMS_NORM)
        self.rotary_emb = rotary_emb  # NOTE: one instance shared by every layer (one cos/sin gather per step)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """qkv: [T, q + 2 kv], the output of ``qkv_proj`` (run fused with the input norm by the
        decoder layer) -> [T, hidden], for the post-attention add + RMSNorm."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))

    def rotary_qkv_consumer(self) -> QKVConsumer:
        """The rotary + KV write of a decode step on a [T, q + 2 kv] q/k/v projection output with its
        pending adapter update added first (split, heads, ``rotary_emb.apply_and_write_kv``), at
        position 0 with every cache write skipped (slot -1): ``LoRAManager.warm_up_kernels`` compiles it."""
        paged = self.attn

        def consume(pending: PendingUpdate, qkv: torch.Tensor) -> None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            num_tokens = qkv.shape[0]
            positions = torch.zeros(num_tokens, dtype=torch.int64, device=qkv.device)          # [T]
            slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=qkv.device)  # [T]: none
            self.rotary_emb.apply_and_write_kv(
                positions, q.reshape(-1, paged.num_heads, paged.head_dim),
                k.reshape(-1, paged.num_kv_heads, paged.head_dim),
                v.reshape(-1, paged.num_kv_heads, paged.head_dim),
                paged.k_cache, paged.v_cache, slot_mapping, pending)
        return consume


class LlamaMLP(nn.Module):
    """SwiGLU over this rank's intermediate columns: gate|up column-parallel, down_proj row-parallel."""

    def __init__(self, config, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={act!r} is not supported (Llama-family models use 'silu').")
        self.gate_up_proj = column_parallel_linear(config.hidden_size, [config.intermediate_size] * 2, bias, tp,
                                                   feeds=Feeds.SILU_MUL)
        self.down_proj = row_parallel_linear(config.intermediate_size, config.hidden_size, bias, tp,
                                             feeds=Feeds.ADD_RMS_NORM)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2 * intermediate], the output of ``gate_up_proj`` (run fused with the
        post-attention norm by the decoder layer) -> [T, hidden], for the next add + RMSNorm."""
        return silu_mul_linear(self.down_proj, gate_up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        self.self_attn = self.build_attention(config, rotary_emb, qkv_bias, o_bias, tp)
        self.mlp = LlamaMLP(config, mlp_bias, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [T, hidden] (the embeddings when ``residual`` is None) -> (output, residual); the
        output is for the next add + RMSNorm (the next layer's input norm or the final norm)."""
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn(positions, qkv)
        gate_up, residual = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, hidden, residual)
        return self.mlp(gate_up), residual

    def build_attention(self, config, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                        tp: TensorParallelGroup) -> LlamaAttention:
        """The layer's self-attention: a subclass's hook (Qwen3's takes q/k norms: ``engine.models.qwen3``)."""
        return LlamaAttention(config, rotary_emb, qkv_bias, o_bias, tp)


class DecoderStack(nn.Module):
    """Token embedding (vocab-parallel under tensor parallelism), pre-norm decoder layers with a carried
    residual, final RMSNorm: the body Llama-family and MoE models share."""

    def __init__(self, config, layers: Iterable[nn.Module], tp: TensorParallelGroup) -> None:
        super().__init__()
        if tp.size == 1:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.embed_tokens.weight.requires_grad_(False)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaModel(DecoderStack):
    def __init__(self, config, max_position: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 rotary_cls: type[RotaryEmbedding] = RotaryEmbedding,
                 tp: Optional[TensorParallelGroup] = None,
                 layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer) -> None:
        tp = tp or TensorParallelGroup.single()
        rotary_emb = rotary_cls(config, _head_dim(config), max_position)
        super().__init__(config, [layer_cls(config, rotary_emb, qkv_bias, o_bias, mlp_bias, tp)
                                  for _ in range(config.num_hidden_layers)], tp)


class LlamaForCausalLM(nn.Module):
    """Causal LM over a paged KV cache. Module names follow HF's, with q/k/v and gate/up packed."""

    # checkpoint projection name -> (our packed module, slice index)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    qkv_bias_default = False
    rotary_cls: type[RotaryEmbedding] = RotaryEmbedding
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    """What each decoder layer is (built with ``LlamaDecoderLayer``'s arguments): a subclass's hook."""
    capabilities = ModelCapabilities(tensor_parallel=True, weight_quantization=True)
    logits_rules: Optional[LogitsRules] = None

    def __init__(self, config, max_position: int, tp: Optional[TensorParallelGroup] = None) -> None:
        super().__init__()
        self.config = config
        self.shape = ModelShape(config.hidden_size, config.intermediate_size, config.vocab_size)
        self.tp = tp or TensorParallelGroup.single()
        """This rank's group: at size > 1 every projection, the embedding and the head hold this rank's shard."""
        qkv_bias = bool(getattr(config, "attention_bias", self.qkv_bias_default)) or self.qkv_bias_default
        o_bias = bool(getattr(config, "attention_bias", False)) and not self.qkv_bias_default
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.model = LlamaModel(config, max_position, qkv_bias, o_bias, mlp_bias, self.rotary_cls, self.tp,
                                self.decoder_layer_cls)
        # Mistral's, Qwen2's and Qwen3's windowed layers (engine.models.sliding_window); None for Llama.
        set_layer_windows(self.attention_layers(), layer_windows(config))
        self.quantized_head = None
        """The LM head kept quantized (``quantize``), or None."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        elif self.tp.size > 1:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.tp)   # its rows only
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> token embeddings [T, hidden]."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] -> logits [R, vocab] in the model's dtype (as transformers computes
        them; the sampler upcasts to float32 where it needs more than an argmax, so a greedy decode
        step skips writing and re-reading a float32 copy of the [R, vocab] logits)."""
        if self.quantized_head is not None:
            return self.quantized_head.logits(hidden)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.tp.size > 1:
            return parallel_logits(hidden, weight, self.tp, self.config.vocab_size)
        return torch.matmul(hidden, weight.t())

    def checkpoint_shard(self, name: str) -> Optional[Shard]:
        """The range of checkpoint tensor ``name`` this rank reads (None: all of it), so that no rank
        materializes more than its shard (``engine.loader.iter_weights``)."""
        if self.tp.size == 1:
            return None
        if name == "model.embed_tokens.weight" or (name == "lm_head.weight" and self.lm_head is not None):
            return (self.model.embed_tokens if name.startswith("model.") else self.lm_head).shard()
        parts = name.split(".")
        if len(parts) < 3:
            return None
        packed, idx = self.packed_modules_mapping.get(parts[-2], (parts[-2], 0))
        try:
            module = self.get_submodule(".".join(parts[:-2] + [packed]))
        except AttributeError:
            return None   # load_weights names the stray tensor
        shard = linear_shard_of(module)
        return shard.weight_shard(idx, parts[-1]) if shard is not None else None

    def quantize(self, kind: Union[str, Mapping[str, Optional[str]]]) -> None:
        """Weight-only quantization (``--quantization``, CPU; ``engine.layers.quantized``): ``kind`` is "int8" /
        "int4" for every projection and the LM head, or a plan: checkpoint tensor name -> kind (None keeps
        that tensor float; a packed projection takes the most precise kind of its parts). A quantized tied
        embedding becomes a ``QuantizedEmbedding`` serving both lookups and the head. Norms and the
        projections marked ``keep_float`` (MoE routers) stay float."""
        from engine.layers.quantized import QuantizedEmbedding, most_precise
        inverse = {}
        for part, (packed, _) in self.packed_modules_mapping.items():
            inverse.setdefault(packed, []).append(part)

        def kind_of(module_name: str) -> Optional[str]:
            if isinstance(kind, str):
                return kind
            prefix, dot, leaf = module_name.rpartition(".")
            parts = inverse.get(leaf, [leaf])
            return most_precise([kind.get(f"{prefix}{dot}{p}.weight") for p in parts])

        for name, module in self.named_modules():
            if isinstance(module, Linear) and not module.keep_float and (module_kind := kind_of(name)):
                module.quantize(module_kind)
        head_name = "model.embed_tokens" if self.lm_head is None else "lm_head"
        head_kind = kind_of(head_name)
        if head_kind is None:
            return
        if self.lm_head is None:
            self.quantized_head = QuantizedEmbedding(self.model.embed_tokens.weight, head_kind)
            self.model.embed_tokens = self.quantized_head
        else:
            self.quantized_head = QuantizedEmbedding(self.lm_head.weight, head_kind)
            self.lm_head = None   # the head is quantized_head; embed_tokens stays float (lookups read a few rows)

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that rotary rotates (head_dim x partial_rotary_factor)."""
        return self.model.layers[0].self_attn.rotary_emb.rotary_dim

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def lora_layout(self) -> LoRALayout:
        return LoRALayout(self.packed_modules_mapping)

    def lora_qkv_warmup_consumer(self) -> Optional[QKVConsumer]:
        """The first layer's ``LlamaAttention.rotary_qkv_consumer`` where its rotary + KV write is fused
        (KV cache bound, Triton attention backend on CUDA) and takes the q/k/v projection's adapter update
        (``Feeds.ROTARY_KV_WRITE``: not Qwen3's, whose q/k norms come between); else None."""
        attn = self.model.layers[0].self_attn
        if attn.qkv_proj.feeds is not Feeds.ROTARY_KV_WRITE:
            return None
        if attn.attn.k_cache is None or not attn.attn.fuses_rotary_write(attn.attn.k_cache):
            return None
        return attn.rotary_qkv_consumer()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into our (packed) parameters; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            parts = name.split(".")
            # e.g. model.layers.3.self_attn.q_proj.weight
            if len(parts) >= 3 and parts[-2] in self.packed_modules_mapping:
                packed, idx = self.packed_modules_mapping[parts[-2]]
                module_name = ".".join(parts[:-2] + [packed])
                module = self.get_submodule(module_name)
                module.load_slice(parts[-1], idx, tensor)
                loaded.add(f"{module_name}.{parts[-1]}")
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if not isinstance(tensor, torch.Tensor):   # a quantized checkpoint's projection (slices.py)
                self.get_submodule(name.rpartition(".")[0]).load_slice("weight", 0, tensor)
                loaded.add(name)
                continue
            param = params[name]
            if param.is_meta:   # a deferred Linear weight (engine.layers.linear.deferred_weights)
                module = self.get_submodule(name.rpartition(".")[0])
                module.materialize(tensor.device)
                param = module.weight
            if self.tp.size > 1 and name in ("model.embed_tokens.weight", "lm_head.weight"):
                copy_rows(param, tensor, name)   # this rank's vocabulary rows, padded
                loaded.add(name)
                continue
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on q/k/v (none on o); with ``use_sliding_window`` the layers from
    ``max_window_layers`` on attend within ``sliding_window`` (``engine.models.sliding_window``)."""

    qkv_bias_default = True


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama layout; with ``sliding_window`` set every layer attends within it
    (``engine.models.sliding_window``)."""
