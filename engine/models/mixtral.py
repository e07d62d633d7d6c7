"""Mixtral, and the decoder every mixture-of-experts model here shares (``MoEForCausalLM``).

A MoE decoder layer is a Llama layer whose MLP is a ``engine.layers.moe.SparseMoeBlock`` (router, routed
experts with stacked weights, optional shared expert), or, in the layers a config keeps dense (Qwen3-MoE's
``mlp_only_layers`` / ``decoder_sparse_step``), a ``LlamaMLP``. Mixtral: Llama (Mistral) attention, every layer
sparse, ``num_local_experts`` experts of ``intermediate_size``, the top-k routing weights renormalized.

Checkpoints: HF's per-expert tensors (``model.layers.N.block_sparse_moe.experts.E.w1|w2|w3.weight``, the
router ``block_sparse_moe.gate.weight``; Qwen-MoE's ``mlp.experts.E.gate_proj|up_proj|down_proj.weight``) and
transformers 5's stacked ones (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I],
what ``save_pretrained(save_original_format=False)`` writes) both load into the stacked ``w13`` / ``w2``.

Capabilities: tensor parallelism (attention and dense MLPs as Llama's; each expert's intermediate rows split
over the ranks, the routers replicated, the routed output all-reduced); no weight quantization yet. LoRA adapters
reach the attention projections, a dense layer's or a shared expert's gate/up/down, the router (``gate``) and
the routed experts: per expert (PEFT's ``experts.N.w1`` / ``gate_proj`` ... names) or through PEFT's
``target_parameters`` on the stacked ``gate_up_proj`` / ``down_proj``, run inside the fused MoE path
(``engine.layers.moe.fused_moe_lora``); with tensor parallelism each rank holds its rows of gate/up B and its
columns of down A (S-LoRA), the partial update riding on the all-reduce.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Optional, Union

import torch
import torch.nn as nn

from engine.distributed.group import TensorParallelGroup
from engine.distributed.sharding import Shard
from engine.layers.adapter import Feeds
from engine.layers.attention import PagedAttention
from engine.layers.fused import norm_linear
from engine.layers.lora_layout import LoRALayout
from engine.layers.moe import FusedMoE, SparseMoeBlock
from engine.layers.parallel import VocabParallelEmbedding, copy_rows, parallel_logits
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.interfaces import LogitsRules, ModelCapabilities, ModelShape, QKVConsumer
from engine.models.llama import DecoderStack, LlamaAttention, LlamaForCausalLM, LlamaMLP, _head_dim
from engine.models.sliding_window import layer_windows, set_layer_windows

_EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
"""A per-expert checkpoint tensor: ``<layer>.mlp.experts.<E>.<proj>.weight``."""
_EXPERT_PROJECTIONS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0),                 # Mixtral
                       "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}  # Qwen-MoE
"""Checkpoint expert projection -> (our stacked parameter, its shard: gate rows 0, up rows 1)."""
_STACKED_TENSORS = {"gate_up_proj": "w13", "down_proj": "w2"}
"""transformers 5's stacked expert tensor (``<layer>.mlp.experts.<name>``) -> our parameter."""


def check_full_attention(config, max_position: int) -> None:
    """ValueError for a config with a sliding window smaller than the context: every layer here attends to
    the whole context, which equals sliding-window attention only while the context fits in the window."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return
    if window and max_position > window:
        raise ValueError(f"this checkpoint uses sliding-window attention (window {window}), which Chorus does "
                         f"not implement; --max-model-len {window} or less serves it exactly (asked for "
                         f"{max_position}).")


class MoEDecoderLayer(nn.Module):
    """Pre-norm attention + a sparse MoE block or a dense ``LlamaMLP``, residual adds fused into the norms."""

    def __init__(self, config, self_attn: LlamaAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [T, hidden] (the embeddings when ``residual`` is None) -> (output, residual), the output
        for the next add + RMSNorm."""
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn(positions, qkv)
        if isinstance(self.mlp, LlamaMLP):
            gate_up, residual = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, hidden, residual)
            return self.mlp(gate_up), residual
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(normed), residual


class MoEForCausalLM(nn.Module):
    """A causal LM of ``MoEDecoderLayer``s over a paged KV cache; subclasses pick each layer's attention and
    MLP (``build_attention``, ``build_mlp``) and the checkpoint's module renames. Module names follow
    transformers 5's (``model.layers.N.mlp.gate``, ``model.layers.N.mlp.experts``), with q/k/v and gate/up
    packed and the experts stacked."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    """(theirs, ours) substrings of checkpoint tensor names (Mixtral's ``.block_sparse_moe.`` is our ``.mlp.``)."""
    expert_projections: tuple[tuple[str, int], ...] = (("gate_proj", 0), ("up_proj", 1), ("down_proj", 2))
    """PEFT per-expert module suffix -> slice of the experts' LoRA update (``LoRALayout.expert_projections``)."""
    capabilities = ModelCapabilities(tensor_parallel=True, weight_quantization=True)
    logits_rules: Optional[LogitsRules] = None

    def __init__(self, config, max_position: int, tp: Optional[TensorParallelGroup] = None) -> None:
        super().__init__()
        self.tp = tp or TensorParallelGroup.single()
        """This rank's group: at size > 1 attention heads, dense MLPs, every expert's intermediate rows, the
        embedding and the head hold this rank's shard; routers are replicated."""
        windows = layer_windows(config)
        if not any(windows):
            check_full_attention(config, max_position)
        self.config = config
        rotary_emb = RotaryEmbedding(config, _head_dim(config), max_position)
        layers = [MoEDecoderLayer(config, self.build_attention(config, rotary_emb), self.build_mlp(config, i))
                  for i in range(config.num_hidden_layers)]
        self.model = DecoderStack(config, layers, self.tp)
        set_layer_windows(self.attention_layers(), windows)
        widths = [m.activation_width() if isinstance(m, SparseMoeBlock) else config.intermediate_size
                  for m in (layer.mlp for layer in layers)]
        self.shape = ModelShape(config.hidden_size, max(widths), config.vocab_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.quantized_head = None
        """The LM head (or tied embedding) as weight-only int8 / int4 on CPU (``quantize``); None: float."""
        if self.tie_word_embeddings:
            self.lm_head = None
        elif self.tp.size > 1:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.tp)   # its rows only
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)

    # -- what a subclass picks ------------------------------------------------------------
    def build_attention(self, config, rotary_emb: RotaryEmbedding) -> LlamaAttention:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaAttention(config, rotary_emb, qkv_bias=bias, o_bias=bias, tp=self.tp)

    def build_mlp(self, config, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    # -- ModelForCausalLM -----------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] -> logits [R, vocab] in the model's dtype (float32 from a quantized head)."""
        if self.quantized_head is not None:
            return self.quantized_head.logits(hidden)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.tp.size > 1:
            return parallel_logits(hidden, weight, self.tp, self.config.vocab_size)
        return torch.matmul(hidden, weight.t())

    def checkpoint_shard(self, name: str) -> Optional[Shard]:
        """The range of checkpoint tensor ``name`` this rank reads (None: all of it): attention, dense MLPs,
        the embedding and the head as Llama's (``LlamaForCausalLM.checkpoint_shard``, whose rules read only
        what this class has too); expert tensors are read whole and cut by ``FusedMoE`` (a stacked gate|up
        tensor's rows are two ranges)."""
        for theirs, ours in self.checkpoint_renames:
            name = name.replace(theirs, ours)
        if ".experts." in name:
            return None
        return LlamaForCausalLM.checkpoint_shard(self, name)

    def quantize(self, kind: Union[str, Mapping[str, Optional[str]]]) -> None:
        """Weight-only quantization on CPU (``SupportsWeightQuantization``): the projections and the LM head
        as ``LlamaForCausalLM.quantize`` (routers stay float), and each MoE layer's routed experts
        (``FusedMoE.quantize_cpu``) with ``kind``, or with a plan (checkpoint tensor name -> kind) the most
        precise kind of that layer's expert tensors (None: float)."""
        from engine.layers.quantized import most_precise
        LlamaForCausalLM.quantize(self, kind)
        plan = kind
        if not isinstance(kind, str):
            plan = {}
            for name, tensor_kind in kind.items():
                for theirs, ours in self.checkpoint_renames:
                    name = name.replace(theirs, ours)
                plan[name] = tensor_kind
        for i, layer in enumerate(self.model.layers):
            if not isinstance(layer.mlp, SparseMoeBlock):
                continue
            experts = layer.mlp.experts
            if not isinstance(plan, str):
                names = [f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"
                         for e in range(experts.num_experts) for proj, _ in self.expert_projections]
                layer_kind = most_precise([plan.get(n) for n in names])
            else:
                layer_kind = plan
            if layer_kind is not None:
                experts.quantize_cpu(layer_kind)

    @property
    def rotary_dim(self) -> int:
        return self.model.layers[0].self_attn.rotary_emb.rotary_dim

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def lora_layout(self) -> LoRALayout:
        """Attention, dense / shared-expert MLP projections (``Linear``), the routed experts (per expert, or
        their stacked parameters) and the router (``gate``)."""
        return LoRALayout(self.packed_modules_mapping, expert_projections=self.expert_projections,
                          router_modules=("gate",), module_renames=self.checkpoint_renames)

    def lora_qkv_warmup_consumer(self) -> Optional[QKVConsumer]:
        """The first layer's rotary + KV write where it is fused and takes the q/k/v adapter update
        (``Feeds.ROTARY_KV_WRITE``: not Qwen3-MoE's, whose q/k norms come between); else None."""
        attn = self.model.layers[0].self_attn
        if attn.qkv_proj.feeds is not Feeds.ROTARY_KV_WRITE:
            return None
        if attn.attn.k_cache is None or not attn.attn.fuses_rotary_write(attn.attn.k_cache):
            return None
        return attn.rotary_qkv_consumer()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into our parameters: q/k/v and gate/up into their packed slices,
        per-expert or stacked expert tensors into ``w13`` / ``w2``; every parameter must be set in full."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pieces: dict[str, set[tuple[int, int]]] = {}     # packed / stacked param -> (expert or 0, slice) loaded
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            for theirs, ours in self.checkpoint_renames:
                name = name.replace(theirs, ours)
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            m = _EXPERT_TENSOR.match(name)
            if m is not None and m["proj"] in _EXPERT_PROJECTIONS:
                param, shard = _EXPERT_PROJECTIONS[m["proj"]]
                expert = int(m["expert"])
                self._experts(m["experts"], name).load_expert(param, expert, shard, tensor)
                pieces.setdefault(f"{m['experts']}.{param}", set()).add((expert, shard))
                continue
            prefix, _, leaf = name.rpartition(".")
            if leaf in _STACKED_TENSORS and prefix.endswith(".experts"):
                self._experts(prefix, name).load_stacked(_STACKED_TENSORS[leaf], tensor)
                loaded.add(f"{prefix}.{_STACKED_TENSORS[leaf]}")
                continue
            parts = name.split(".")
            if len(parts) >= 3 and parts[-2] in self.packed_modules_mapping:
                packed, idx = self.packed_modules_mapping[parts[-2]]
                module_name = ".".join(parts[:-2] + [packed])
                try:
                    module = self.get_submodule(module_name)
                except AttributeError:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                     f"{type(self).__name__}") from None
                module.load_slice(parts[-1], idx, tensor)
                pieces.setdefault(f"{module_name}.{parts[-1]}", set()).add((0, idx))
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
        for key, got in pieces.items():
            owner = self.get_submodule(key.rpartition(".")[0])
            if isinstance(owner, FusedMoE):
                shards = range(2) if key.endswith(".w13") else range(1)
                want = {(e, s) for e in range(owner.num_experts) for s in shards}
            else:
                want = {(0, s) for s in range(len(owner.output_sizes))}
            if got >= want:
                loaded.add(key)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors (or parts of them), e.g. {missing[:3]}")

    def _experts(self, module_name: str, tensor_name: str) -> FusedMoE:
        try:
            module = self.get_submodule(module_name)
        except AttributeError:
            module = None
        if not isinstance(module, FusedMoE):
            raise ValueError(f"checkpoint tensor {tensor_name!r} has no place in {type(self).__name__} "
                             f"({module_name} is not a sparse MoE layer of this config)")
        return module


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral: Llama attention; every layer's MLP a sparse block of ``num_local_experts`` SwiGLU experts of
    ``intermediate_size``, top ``num_experts_per_tok`` with renormalized weights (the softmax over the top-k
    router logits)."""

    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)
    expert_projections = (("w1", 0), ("w3", 1), ("w2", 2))

    def build_mlp(self, config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock.from_config(config, config.num_local_experts, config.intermediate_size,
                                          renormalize=True, tp=self.tp)
