"""Whisper: the audio encoder (``encoders.whisper``) and a text decoder with cross-attention, in the engine.

The decoder runs like any decoder-only model: flat batches of prefill chunks and decodes, its
self-attention over the paged KV cache. Cross-attention reads K/V of the encoder output that the runner
writes once per request, before its first token (``write_cross_kv``), into the request's *cross blocks*:
blocks of the same per-layer KV cache tensors, taken by the scheduler with the request's first allocation
and freed with its other blocks. Each query token attends to all of its request's encoder positions, so
the forward context's ``cross_attn_metadata`` holds the step's requests over their cross blocks, and
``AttentionBackend.attend_cross`` attends without a causal mask (on CUDA: the paged kernel's decode path,
one single-query "request" per token).

Names follow transformers' ``WhisperForConditionalGeneration`` (``model.encoder.*``, ``model.decoder.*``,
``proj_out``), with the self-attention's q/k/v packed into ``qkv_proj`` and the cross-attention's k/v into
``kv_proj``. Whisper's k projections have no bias: that block of the packed bias is zero.

Tensor parallelism: the decoder is sharded like a Llama (heads split, q/k/v/fc1 column-parallel,
out_proj/fc2 row-parallel, token embedding and head vocab-parallel); the encoder is replicated on every
rank, which encodes the step's audio itself (no collective per encoder layer).

LoRA: every projection of both stacks (q/k/v/out_proj, fc1/fc2) is a ``Linear`` an adapter may update;
``lora_target_slices`` maps PEFT's (transformers') module names onto them, since one suffix lands in
different Linears (q_proj: a slice of ``self_attn.qkv_proj``, or ``encoder_attn.q_proj``). The decoder's
rows are the step's tokens; ``write_cross_kv`` and the encoder run on encoder rows, whose adapter slots the
runner sets for those calls.

Quantization: ``--quantization fp8`` quantizes every ``Linear`` at load (``Fp8Weight``, per-channel scales,
dynamic per-token activations on CUDA; CPU runs the dequantized weights): the decoder's self-attention
qkv/out, cross-attention q/out and cross K/V, fc1/fc2, and the encoder's qkv/out, fc1/fc2 (the encoder
holds most of Whisper's FLOPs). The conv stem, embeddings, layer norms and the LM head (tied to the token
embeddings) stay float. int8 / int4 / fp16 and quantized checkpoints are refused at start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch
import torch.nn as nn

from encoders.vit import activation
from encoders.whisper import WhisperEncoderTower
from engine.distributed.group import TensorParallelGroup
from engine.distributed.sharding import Shard
from engine.forward_context import get_forward_context
from engine.layers.attention import PagedAttention
from engine.layers.lora_layout import LoRALayout
from engine.layers.parallel import (VocabParallelEmbedding, column_parallel_linear, copy_rows, linear_shard_of,
                                    parallel_logits, row_parallel_linear)
from engine.models.interfaces import LogitsRules, MediaWarmUp, ModelCapabilities, ModelShape, QKVConsumer

_ENCODER_PREFIX = "model.encoder."


class WhisperSelfAttention(nn.Module):
    """Causal self-attention over the paged KV cache (no rotary: positions are learned embeddings)."""

    def __init__(self, d_model: int, num_heads: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.num_heads = num_heads // tp.size                  # this rank's heads
        self.head_dim = d_model // num_heads
        self.qkv_proj = column_parallel_linear(d_model, [d_model] * 3, True, tp)
        self.out_proj = row_parallel_linear(d_model, d_model, True, tp)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, d_model] -> [T, d_model]."""
        q, k, v = self.qkv_proj(hidden).view(-1, 3, self.num_heads, self.head_dim).unbind(1)   # [T, H, D] each
        return self.out_proj(self.attn(q, k, v))


class WhisperCrossAttention(nn.Module):
    """Attention of the decoder tokens over their request's encoder output.

    K/V live in the decoder layer's own KV cache (``cache``: its self-attention's ``PagedAttention``),
    at the request's cross blocks; ``write_kv`` fills them, ``forward`` reads them through the forward
    context's ``cross_attn_metadata``.
    """

    def __init__(self, d_model: int, num_heads: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.num_heads = num_heads // tp.size                  # this rank's heads
        self.head_dim = d_model // num_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = column_parallel_linear(d_model, [d_model], True, tp)
        self.kv_proj = column_parallel_linear(d_model, [d_model] * 2, True, tp)
        self.out_proj = row_parallel_linear(d_model, d_model, True, tp)

    def forward(self, hidden: torch.Tensor, cache: PagedAttention) -> torch.Tensor:
        """hidden [T, d_model] -> [T, d_model]."""
        meta = get_forward_context().cross_attn_metadata
        if meta is None:
            raise RuntimeError("a cross-attention layer ran without cross_attn_metadata; the runner sets it "
                               "for encoder-decoder models.")
        q = self.q_proj(hidden).view(-1, self.num_heads, self.head_dim)                      # [T, H, D]
        out = cache.backend.attend_cross(q, cache.k_cache, cache.v_cache, meta, self.scale)   # [T, H, D]
        return self.out_proj(out.reshape(q.shape[0], -1))

    def write_kv(self, encoder_out: torch.Tensor, slot_mapping: torch.Tensor, cache: PagedAttention) -> None:
        """encoder_out [N, d_model] (encoder positions of one or more requests, flat), slot_mapping [N]
        int64: the cache slot of each position."""
        k, v = self.kv_proj(encoder_out).view(-1, 2, self.num_heads, self.head_dim).unbind(1)
        cache.backend.write_kv(k, v, cache.k_cache, cache.v_cache, slot_mapping)


class WhisperDecoderLayer(nn.Module):
    """Pre-norm: self-attention, cross-attention, MLP, each added to the residual."""

    def __init__(self, config, tp: TensorParallelGroup) -> None:
        super().__init__()
        d_model = config.d_model
        self.self_attn = WhisperSelfAttention(d_model, config.decoder_attention_heads, tp)
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.encoder_attn = WhisperCrossAttention(d_model, config.decoder_attention_heads, tp)
        self.encoder_attn_layer_norm = nn.LayerNorm(d_model)
        self.act = activation(config.activation_function)
        self.fc1 = column_parallel_linear(d_model, [config.decoder_ffn_dim], True, tp)
        self.fc2 = row_parallel_linear(config.decoder_ffn_dim, d_model, True, tp)
        self.final_layer_norm = nn.LayerNorm(d_model)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, d_model] -> [T, d_model]."""
        hidden = hidden + self.self_attn(self.self_attn_layer_norm(hidden))
        hidden = hidden + self.encoder_attn(self.encoder_attn_layer_norm(hidden), self.self_attn.attn)
        return hidden + self.fc2(self.act(self.fc1(self.final_layer_norm(hidden))))


class WhisperDecoder(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup) -> None:
        super().__init__()
        if config.d_model % config.decoder_attention_heads:
            raise ValueError(f"Whisper: d_model={config.d_model} is not a multiple of decoder_attention_heads="
                             f"{config.decoder_attention_heads}; fix the config.")
        for name in ("decoder_attention_heads", "decoder_ffn_dim"):
            if getattr(config, name) % tp.size:
                raise ValueError(f"Whisper: {name}={getattr(config, name)} is not divisible by "
                                 f"--tensor-parallel-size {tp.size}; use a size that divides it.")
        if tp.size == 1:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.d_model, tp)
        self.embed_positions = nn.Embedding(config.max_target_positions, config.d_model)
        # NOTE: transformers' Whisper reads ``scale_embedding`` into an ``embed_scale`` it never applies;
        # neither do we (every released Whisper has it False).
        self.layers = nn.ModuleList(WhisperDecoderLayer(config, tp) for _ in range(config.decoder_layers))
        self.layer_norm = nn.LayerNorm(config.d_model)
        for p in (self.embed_tokens.weight, self.embed_positions.weight):
            p.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, d_model]."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        hidden = hidden + self.embed_positions(positions)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.layer_norm(hidden)


class _WhisperModel(nn.Module):
    """transformers' ``WhisperModel`` naming: ``encoder`` and ``decoder``."""

    def __init__(self, config, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.encoder = WhisperEncoderTower(config)      # replicated on every rank
        self.decoder = WhisperDecoder(config, tp)


class WhisperForConditionalGeneration(nn.Module):
    """Whisper speech recognition / translation as an engine model (see the module docstring).

    ``forward(input_ids, positions)`` runs the decoder over a flat step; ``embed_multimodal("audio",
    features)`` runs the encoder; ``write_cross_kv`` fills the cross-attention K/V of new requests.
    """

    capabilities = ModelCapabilities(multimodal=True, encoder_decoder=True, tensor_parallel=True,
                                     cross_attention_graphs=True, fp8_weights=True)
    """The decoder is sharded at ``tensor_parallel_size`` > 1 (the encoder is replicated); cross-attention
    reads only ``cross_attn_metadata`` (``AttentionBackend.attend_cross``), so decode steps run in CUDA graphs;
    ``--quantization fp8`` turns every projection of both stacks into an ``Fp8Weight`` (module docstring)."""
    rotary_dim: Optional[int] = None
    """Positions are learned embeddings: no rotary."""
    packed_modules_mapping = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    """Self-attention projections -> (our packed Linear, its row block); the cross-attention's are in
    ``cross_packed_modules_mapping``."""
    cross_packed_modules_mapping = {"q_proj": ("q_proj", 0), "k_proj": ("kv_proj", 0), "v_proj": ("kv_proj", 1)}

    def __init__(self, config, max_position: int, tp: Optional[TensorParallelGroup] = None) -> None:
        super().__init__()
        self.config = config
        self.shape = ModelShape(config.d_model, config.decoder_ffn_dim, config.vocab_size)
        self.tp = tp or TensorParallelGroup.single()
        self.model = _WhisperModel(config, self.tp)
        self.num_source_positions = config.max_source_positions
        """Encoder output rows per audio item (1500: a 30 s window)."""
        self.logits_rules: Optional[LogitsRules] = None
        """Set by ``configure_decoding`` once the tokenizer's special ids are known."""
        from multimodal.word_timing import alignment_heads_of

        self.alignment_heads: list[tuple[int, int]] = alignment_heads_of(config)
        """(decoder layer, head) of the cross-attention heads that time words (``alignment_scores``); a
        generation_config's list replaces them (``configure_decoding``)."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.proj_out = None
        if not self.tie_word_embeddings and self.tp.size > 1:
            self.proj_out = VocabParallelEmbedding(config.vocab_size, config.d_model, self.tp)   # its rows only
        elif not self.tie_word_embeddings:
            self.proj_out = nn.Linear(config.d_model, config.vocab_size, bias=False)
            self.proj_out.weight.requires_grad_(False)

    # ------------------------------------------------------------------ engine interface
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids, positions [T] -> decoder hidden states [T, d_model]."""
        return self.model.decoder(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, d_model] -> logits [R, vocab] in the model's dtype."""
        weight = self.model.decoder.embed_tokens.weight if self.proj_out is None else self.proj_out.weight
        if self.tp.size > 1:
            return parallel_logits(hidden, weight, self.tp, self.config.vocab_size)
        return torch.matmul(hidden, weight.t())

    def checkpoint_shard(self, name: str) -> Optional[Shard]:
        """The range of checkpoint tensor ``name`` this rank reads (None: all of it; the encoder's)."""
        if self.tp.size == 1 or name.startswith(_ENCODER_PREFIX):
            return None
        if name == "model.decoder.embed_tokens.weight" or (name == "proj_out.weight" and self.proj_out is not None):
            return (self.model.decoder.embed_tokens if name.startswith("model.") else self.proj_out).shard()
        target, block, _ = self._place(name)
        module_name, _, param = target.rpartition(".")
        try:
            shard = linear_shard_of(self.get_submodule(module_name))
        except AttributeError:
            return None   # load_weights names the stray tensor
        return shard.weight_shard(block, param) if shard is not None else None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.decoder.embed_tokens(input_ids)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.decoder.layers]

    def lora_qkv_warmup_consumer(self) -> Optional[QKVConsumer]:
        """None: no rotary + KV write consumes the self-attention's q/k/v projection."""
        return None

    def embed_multimodal(self, modality: str, items: list) -> list[torch.Tensor]:
        """Encode audio items (``multimodal.audio_processing.AudioInput``: log-mel computed here, batched,
        on the model's device) -> one [num_source_positions, d_model] encoder output per item."""
        if modality != "audio":
            raise ValueError(f"Whisper takes audio, not {modality!r}.")
        encoder = self.model.encoder
        features = type(items[0]).features(items, encoder.conv1.weight.device)   # [B, num_mel_bins, frames]
        return list(encoder(features).unbind(0))

    def media_warm_up(self) -> list[MediaWarmUp]:
        """One 30 s window of silence (Whisper's default feature settings with the model's mel bins), under a
        decoder prompt of the start token."""
        from multimodal.audio_processing import AudioInput, AudioPromptProcessor

        processor = AudioPromptProcessor.for_whisper(self.config, None)
        audio = AudioInput(np.zeros(processor.log_mel.window_samples, dtype=np.float32), processor.log_mel,
                           processor.settings.padding)
        return [MediaWarmUp("audio", audio, self.num_source_positions,
                            (int(self.config.decoder_start_token_id),), None)]

    def capture_encoder_graphs(self, max_items: int) -> None:
        """The encoder's CUDA graphs for up to ``max_items`` 30 s windows per replay
        (``WhisperEncoderTower.capture_graphs``)."""
        self.model.encoder.capture_graphs(max_items)

    def write_cross_kv(self, encoder_out: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Project encoder outputs [N, d_model] (positions of new requests, flat) into every decoder
        layer's cross-attention K/V, stored at ``slot_mapping`` [N] of each layer's KV cache."""
        for layer in self.model.decoder.layers:
            layer.encoder_attn.write_kv(encoder_out, slot_mapping, layer.self_attn.attn)

    def configure_decoding(self, token_ids, suppress_tokens: list[int], begin_suppress_tokens: list[int],
                           max_initial_timestamp_index: int = 50,
                           alignment_heads: Optional[list[list[int]]] = None) -> None:
        """Set ``logits_rules``: Whisper's token suppression, timestamp and language-detection rules the
        runner applies before sampling (as transformers' Whisper ``generate``); ``alignment_heads`` (the
        checkpoint's generation_config) replace the config's or the built-in ones."""
        from multimodal.whisper_decoding import WhisperLogitsRules

        if alignment_heads:
            self.alignment_heads = [(int(layer), int(head)) for layer, head in alignment_heads]

        self.logits_rules = WhisperLogitsRules(token_ids, suppress_tokens, begin_suppress_tokens,
                                               max_initial_timestamp_index)

    @torch.inference_mode()
    def alignment_scores(self, encoder_out: torch.Tensor, token_ids: torch.Tensor,
                         num_positions: int) -> torch.Tensor:
        """Word timestamps' input: one teacher-forced decoder pass over ``token_ids`` [T] with explicit
        attention, giving the scaled ``Q K^T`` of the ``alignment_heads`` over the first ``num_positions``
        rows of ``encoder_out`` [num_source_positions, d_model] (one request's encoder output) -> float32
        [len(alignment_heads), T, num_positions], before softmax (``multimodal.word_timing``).

        Outside the paged path: no KV cache, no forward context, only the layers up to the last alignment
        head; the projections' base weights (``Linear.forward_base``: no adapter); one rank
        (``tensor_parallel_size`` 1).
        """
        if self.tp.size > 1:
            raise ValueError("word timestamps need --tensor-parallel-size 1 (the alignment pass runs on one rank).")
        if not 0 < num_positions <= encoder_out.shape[0]:
            raise ValueError(f"num_positions {num_positions} is outside (0, {encoder_out.shape[0]}].")
        decoder = self.model.decoder
        positions = torch.arange(token_ids.shape[0], device=token_ids.device)
        hidden = decoder.embed_tokens(token_ids) + decoder.embed_positions(positions)      # [T, d_model]
        wanted: dict[int, list[int]] = {}
        for layer_index, head in self.alignment_heads:
            wanted.setdefault(layer_index, []).append(head)
        scores: dict[tuple[int, int], torch.Tensor] = {}
        for layer_index, layer in enumerate(decoder.layers[:max(wanted) + 1]):
            attn = layer.self_attn
            q, k, v = attn.qkv_proj.forward_base(layer.self_attn_layer_norm(hidden)).view(
                -1, 3, attn.num_heads, attn.head_dim).unbind(1)                            # [T, H, D] each
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)    # [H, T, D]
            hidden = hidden + attn.out_proj.forward_base(out.transpose(0, 1).reshape(q.shape[0], -1))
            cross = layer.encoder_attn
            q = cross.q_proj.forward_base(layer.encoder_attn_layer_norm(hidden)).view(-1, cross.num_heads, cross.head_dim)
            k, v = cross.kv_proj.forward_base(encoder_out).view(-1, 2, cross.num_heads, cross.head_dim).unbind(1)  # [S, H, D]
            logits = torch.einsum("thd,shd->hts", q.float(), k.float()) * cross.scale       # [H, T, S]
            for head in wanted.get(layer_index, []):
                scores[(layer_index, head)] = logits[head, :, :num_positions]
            out = torch.einsum("hts,shd->thd", logits.softmax(dim=-1).to(v.dtype), v)       # [T, H, D]
            hidden = hidden + cross.out_proj.forward_base(out.reshape(q.shape[0], -1))
            hidden = hidden + layer.fc2.forward_base(layer.act(layer.fc1.forward_base(layer.final_layer_norm(hidden))))
        return torch.stack([scores[h] for h in self.alignment_heads])

    def make_prompt_processor(self, checkpoint_dir: Path):
        """Audio -> log-mel features and content hashes (``multimodal.audio_processing``)."""
        from multimodal.audio_processing import AudioPromptProcessor

        return AudioPromptProcessor.for_whisper(self.config, checkpoint_dir)

    def lora_layout(self) -> LoRALayout:
        """Exact: one suffix lands in different Linears (self- vs cross-attention q_proj); our modules under
        the encoder prefix run in the encoder, so an adapter updating any of them changes its output."""
        return LoRALayout(self.packed_modules_mapping, exact_slices=self._lora_slices(),
                          encoder_prefix=_ENCODER_PREFIX)

    def _lora_slices(self) -> dict[str, tuple[str, int]]:
        """PEFT module name of every projection an adapter may update (transformers' names, e.g.
        ``model.decoder.layers.0.encoder_attn.k_proj``) -> (our Linear, its output slice)."""
        slices = {}
        for name, target in self.model.encoder.lora_targets().items():
            slices[_ENCODER_PREFIX + name] = (_ENCODER_PREFIX + target.module, target.shard)
        for i in range(len(self.model.decoder.layers)):
            layer = f"model.decoder.layers.{i}"
            for attn, mapping in (("self_attn", self.packed_modules_mapping),
                                  ("encoder_attn", self.cross_packed_modules_mapping)):
                for projection, (module, shard) in mapping.items():
                    slices[f"{layer}.{attn}.{projection}"] = (f"{layer}.{attn}.{module}", shard)
                slices[f"{layer}.{attn}.out_proj"] = (f"{layer}.{attn}.out_proj", 0)
            for module in ("fc1", "fc2"):
                slices[f"{layer}.{module}"] = (f"{layer}.{module}", 0)
        return slices

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors (``model.encoder.*`` to the encoder tower, ``model.decoder.*``
        and ``proj_out.weight`` here); every parameter must be set and every tensor placed."""
        params = dict(self.named_parameters())
        params = {n: p for n, p in params.items() if not n.startswith("model.encoder.")}
        loaded: set[str] = set()
        encoder_weights: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if name.startswith(_ENCODER_PREFIX):
                encoder_weights.append((name[len(_ENCODER_PREFIX):], tensor))
                continue
            if name == "proj_out.weight" and self.proj_out is None:
                continue   # tied to the token embeddings
            target, shard, num_shards = self._place(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            if self.tp.size > 1 and name in ("model.decoder.embed_tokens.weight", "proj_out.weight"):
                copy_rows(param, tensor, name)   # this rank's vocabulary rows, padded
                loaded.add(f"{target}#0")
                continue
            rows = param.shape[0] // num_shards
            dest = param.data[shard * rows:(shard + 1) * rows] if num_shards > 1 else param.data
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                                 f"{tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(f"{target}#{shard}")
        self.model.encoder.load_weights(encoder_weights)
        # k projections have no bias: zero their block of the packed biases.
        for i, layer in enumerate(self.model.decoder.layers):
            for target, module, shard, num_shards in (
                    (f"model.decoder.layers.{i}.self_attn.qkv_proj.bias", layer.self_attn.qkv_proj, 1, 3),
                    (f"model.decoder.layers.{i}.encoder_attn.kv_proj.bias", layer.encoder_attn.kv_proj, 0, 2)):
                rows = module.bias.shape[0] // num_shards
                module.bias.data[shard * rows:(shard + 1) * rows].zero_()
                loaded.add(f"{target}#{shard}")
        missing = []
        for target, param in params.items():
            num_shards = self._num_shards(target)
            for shard in range(num_shards):
                if f"{target}#{shard}" not in loaded:
                    missing.append(f"{target} (block {shard})" if num_shards > 1 else target)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} Whisper tensors, e.g. {missing[:3]}")

    def _place(self, name: str) -> tuple[str, int, int]:
        """transformers name -> (our parameter name, row block, number of blocks)."""
        parts = name.split(".")
        if len(parts) >= 3 and parts[-3] in ("self_attn", "encoder_attn") and parts[-2] in self.packed_modules_mapping:
            mapping = self.packed_modules_mapping if parts[-3] == "self_attn" else self.cross_packed_modules_mapping
            module, shard = mapping[parts[-2]]
            target = ".".join(parts[:-2] + [module, parts[-1]])
            return target, shard, self._num_shards(target)
        return name, 0, 1

    @staticmethod
    def _num_shards(target: str) -> int:
        if ".qkv_proj." in target:
            return 3
        if ".kv_proj." in target:
            return 2
        return 1
