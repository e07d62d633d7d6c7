"""CTranslate2 Whisper -> transformers: the ``WhisperConfig`` and the weights under HF parameter names
(``ct2_whisper_to_hf``), and the ``GenerationConfig`` (``ct2_whisper_generation_config``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from engine.loader.ct2.reader import WHISPER_SPEC, CT2Model
from engine.loader.ct2.token_ids import (WhisperTokenIds, default_whisper_token_ids, read_whisper_token_ids,
                                         vocabulary_file)

# CTranslate2 activation ids (common_spec.Activation) -> transformers activation names.
_ACTIVATIONS = {0: "relu", 1: "gelu_pytorch_tanh", 2: "silu", 3: "gelu", 4: "quick_gelu", 5: "tanh"}

# Per-layer CT2 module -> HF module(s). Fused modules are split by rows in the listed order.
_LAYER_MODULES = {
    "self_attention/linear_1": "self_attn.out_proj", "self_attention/layer_norm": "self_attn_layer_norm",
    "attention/linear_0": "encoder_attn.q_proj", "attention/linear_2": "encoder_attn.out_proj",
    "attention/layer_norm": "encoder_attn_layer_norm",
    "ffn/linear_0": "fc1", "ffn/linear_1": "fc2", "ffn/layer_norm": "final_layer_norm",
}
_FUSED_MODULES = {
    "self_attention/linear_0": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention/linear_1": ("encoder_attn.k_proj", "encoder_attn.v_proj"),
}
_GLOBAL_MODULES = {
    "encoder/conv1": "model.encoder.conv1", "encoder/conv2": "model.encoder.conv2",
    "encoder/position_encodings": "model.encoder.embed_positions",
    "encoder/layer_norm": "model.encoder.layer_norm",
    "decoder/embeddings": "model.decoder.embed_tokens",
    "decoder/position_encodings": "model.decoder.embed_positions",
    "decoder/layer_norm": "model.decoder.layer_norm",
}
_PARAMS = {"weight": "weight", "bias": "bias", "gamma": "weight", "beta": "bias", "encodings": "weight"}
_LAYER_RE = re.compile(r"^(encoder|decoder)/layer_(\d+)/(\w+/\w+)/(\w+)$")
_GLOBAL_RE = re.compile(r"^(\w+/\w+)/(\w+)$")
# HF keys with no bias: the k slice of a fused CT2 bias is zero and dropped.
_NO_BIAS = ("self_attn.k_proj", "encoder_attn.k_proj")
_ENCODER_LAYER_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
                          "self_attn_layer_norm", "fc1", "fc2", "final_layer_norm")
_DECODER_LAYER_MODULES = _ENCODER_LAYER_MODULES + (
    "encoder_attn.q_proj", "encoder_attn.k_proj", "encoder_attn.v_proj", "encoder_attn.out_proj",
    "encoder_attn_layer_norm")

# Scalar flags: those that must hold one value for transformers' Whisper to compute the same thing.
_REQUIRED_FLAGS = {"decoder/pre_norm": 1, "decoder/alibi": 0, "decoder/start_from_zero_embedding": 0,
                   "encoder/multi_query_attention": 0, "decoder/multi_query_attention": 0}
# Flags read elsewhere (num_heads, activation, scale_embeddings) or that do not change the math:
# CT2's own alignment defaults (the real heads are in config.json), ALiBi options with ALiBi off.
_KNOWN_FLAGS = {"encoder/num_heads", "decoder/num_heads", "decoder/activation", "decoder/scale_embeddings",
                "decoder/alignment_heads", "decoder/alignment_layer", "decoder/alibi_use_positive_positions",
                "decoder/scale_alibi"}


@dataclass(frozen=True)
class _Placement:
    """Where one HF tensor comes from."""

    hf_name: str
    """transformers parameter name, e.g. "model.decoder.layers.0.self_attn.q_proj.weight"."""
    ct2_name: str
    """CT2 variable name, e.g. "decoder/layer_0/self_attention/linear_0/weight"."""
    rows: tuple[int, int] | None
    """Row range [start, end) of a fused CT2 tensor, or None for the whole tensor."""


def ct2_whisper_to_hf(model: CT2Model, dtype: torch.dtype) -> tuple[Any, Iterator[tuple[str, torch.Tensor]]]:
    """transformers' ``WhisperConfig`` and the weights of ``model`` under HF parameter names.

    Floating tensors are cast to ``dtype`` (a tensor already in ``dtype`` may share storage with
    ``model.variables``). ``proj_out.weight`` is not yielded: it is tied to ``embed_tokens``
    (``tie_word_embeddings``) when the CT2 projection aliases or equals the embeddings; otherwise
    it is yielded and the config unties it. Token ids: decoder_start = ``<|startoftranscript|>``;
    eos, pad and bos = ``<|endoftext|>`` (as the tokenizer's; transformers' multilingual configs do the
    same, its tiny.en config puts sot in bos). The config also carries what
    ``ct2_whisper_generation_config`` needs: ``alignment_heads``, ``lang_to_id``, ``task_to_id``,
    ``no_timestamps_token_id``, ``prev_sot_token_id``, ``is_multilingual``.

    Raises:
        ValueError: not a WhisperSpec model, a flag transformers' Whisper cannot reproduce, a CT2
            variable the mapping does not place, or an HF parameter no variable provides.
    """
    from transformers import WhisperConfig

    source = " + ".join(str(f) for f in model.files)
    if model.spec_name != WHISPER_SPEC:
        raise ValueError(f"{source}: spec {model.spec_name or '(none, binary version 1)'!r} is not "
                         f"{WHISPER_SPEC}; only CTranslate2 Whisper models map to transformers' Whisper.")
    activation, scale_embedding = _check_flags(model, source)
    placements, tie_word_embeddings = _plan(model, source)
    variables = model.variables

    encoder_layers, decoder_layers = (_layer_counts(model)[stack] for stack in ("encoder", "decoder"))
    if not encoder_layers or not decoder_layers:
        raise ValueError(f"{source}: {encoder_layers} encoder and {decoder_layers} decoder layers; a Whisper "
                         f"model has at least one of each.")
    embeddings = variables["decoder/embeddings/weight"]                  # [vocab, d_model]
    conv1 = variables["encoder/conv1/weight"]                            # [d_model, mel_bins, 3]
    vocab_size, d_model = embeddings.shape
    ids = _token_ids(model, vocab_size)
    ct2_config = model.config
    alignment_heads = ct2_config.get("alignment_heads") or [
        [layer, head] for layer in range(decoder_layers // 2, decoder_layers)
        for head in range(int(model.flags["decoder/num_heads"]))]      # OpenAI's default: upper half
    config = WhisperConfig(
        vocab_size=vocab_size, d_model=d_model, num_mel_bins=conv1.shape[1],
        encoder_layers=encoder_layers, decoder_layers=decoder_layers,
        encoder_attention_heads=int(model.flags["encoder/num_heads"]),
        decoder_attention_heads=int(model.flags["decoder/num_heads"]),
        encoder_ffn_dim=variables["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=variables["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=variables["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=variables["decoder/position_encodings/encodings"].shape[0],
        activation_function=activation, scale_embedding=scale_embedding,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=ids.eot, eos_token_id=ids.eot, pad_token_id=ids.eot, decoder_start_token_id=ids.sot,
        suppress_tokens=list(ct2_config.get("suppress_ids", [])),
        begin_suppress_tokens=list(ct2_config.get("suppress_ids_begin", [220, ids.eot])),
        alignment_heads=[list(h) for h in alignment_heads],
        lang_to_id={f"<|{code}|>": i for code, i in ids.language_ids.items()},
        task_to_id={"translate": ids.translate, "transcribe": ids.transcribe},
        no_timestamps_token_id=ids.no_timestamps, prev_sot_token_id=ids.start_of_prev,
        is_multilingual=ids.is_multilingual,
    )
    for what in ("encoder", "decoder"):
        heads = getattr(config, f"{what}_attention_heads")
        if heads <= 0 or d_model % heads:
            raise ValueError(f"{source}: {what}/num_heads = {heads} does not divide d_model = {d_model}.")

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for p in placements:
            tensor = variables[p.ct2_name]
            if p.rows is not None:
                tensor = tensor[p.rows[0]:p.rows[1]]
            yield p.hf_name, tensor.to(dtype) if tensor.is_floating_point() else tensor

    return config, weights()


def ct2_whisper_generation_config(config):
    """A ``transformers.GenerationConfig`` for ``WhisperForConditionalGeneration.generate``.

    ``config`` comes from ``ct2_whisper_to_hf``. Greedy, no timestamps, OpenAI's limits
    (``max_initial_timestamp_index`` 50, ``max_length`` = max target positions); ``lang_to_id`` and
    ``task_to_id`` only for multilingual models (transformers refuses them on English-only ones).
    """
    from transformers import GenerationConfig

    extra = {}
    if config.is_multilingual:
        extra = {"lang_to_id": dict(config.lang_to_id), "task_to_id": dict(config.task_to_id)}
    return GenerationConfig(
        decoder_start_token_id=config.decoder_start_token_id, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        suppress_tokens=list(config.suppress_tokens or []),
        begin_suppress_tokens=list(config.begin_suppress_tokens or []),
        alignment_heads=[list(h) for h in config.alignment_heads],
        no_timestamps_token_id=config.no_timestamps_token_id, prev_sot_token_id=config.prev_sot_token_id,
        is_multilingual=config.is_multilingual, max_initial_timestamp_index=50,
        max_length=config.max_target_positions, return_timestamps=False, **extra)


def _check_flags(model: CT2Model, source: str) -> tuple[str, bool]:
    """Check the scalar flags; return (HF activation name, scale_embedding)."""
    for name, value in model.flags.items():
        if name in _REQUIRED_FLAGS:
            if value != _REQUIRED_FLAGS[name]:
                raise ValueError(f"{source}: flag {name} = {value}; transformers' Whisper needs "
                                 f"{_REQUIRED_FLAGS[name]}, so this model cannot be mapped.")
        elif name not in _KNOWN_FLAGS and not name.endswith("/keep_in_float32"):
            known = ", ".join(sorted(_KNOWN_FLAGS | set(_REQUIRED_FLAGS)))
            raise ValueError(f"{source}: scalar variable {name} = {value} is not one the Whisper mapping "
                             f"knows ({known}); a newer CTranslate2 spec may need support here.")
    for name in ("encoder/num_heads", "decoder/num_heads", "decoder/activation"):
        if name not in model.flags:
            raise ValueError(f"{source}: the scalar flag {name} is missing.")
    activation_id = int(model.flags["decoder/activation"])
    if activation_id not in _ACTIVATIONS:
        raise ValueError(f"{source}: decoder/activation = {activation_id} is not a CTranslate2 activation id "
                         f"({_ACTIVATIONS}).")
    return _ACTIVATIONS[activation_id], bool(model.flags.get("decoder/scale_embeddings", 0))


def _plan(model: CT2Model, source: str) -> tuple[list[_Placement], bool]:
    """Map every CT2 variable to HF names, checking nothing is left over or missing; (placements, tied)."""
    variables = model.variables
    placements: list[_Placement] = []
    tie_word_embeddings = True
    for name, tensor in variables.items():
        if name.startswith("decoder/projection/"):
            tie_word_embeddings &= _check_projection(model, name, source)
            if name == "decoder/projection/weight" and not tie_word_embeddings:
                placements.append(_Placement("proj_out.weight", name, None))
            continue
        layer = _LAYER_RE.match(name)
        if layer is not None:
            stack, index, module, param = layer.groups()
            prefix = f"model.{stack}.layers.{index}."
            if module in _FUSED_MODULES and param in ("weight", "bias"):
                parts = _FUSED_MODULES[module]
                rows = tensor.shape[0] // len(parts)
                if rows * len(parts) != tensor.shape[0]:
                    raise ValueError(f"{source}: {name} has {tensor.shape[0]} rows, not a multiple of "
                                     f"{len(parts)} (fused {', '.join(parts)}).")
                for k, hf_module in enumerate(parts):
                    span = (k * rows, (k + 1) * rows)
                    if param == "bias" and hf_module in _NO_BIAS:
                        if torch.count_nonzero(tensor[span[0]:span[1]]):
                            raise ValueError(f"{source}: {name} rows {span[0]}:{span[1]} (the key bias) "
                                             f"are not zero, but transformers' Whisper {hf_module} has no "
                                             f"bias.")
                        continue
                    placements.append(_Placement(f"{prefix}{hf_module}.{param}", name, span))
                continue
            if module in _LAYER_MODULES and param in _PARAMS:
                hf_name = f"{prefix}{_LAYER_MODULES[module]}.{_PARAMS[param]}"
                placements.append(_Placement(hf_name, name, None))
                continue
        top = _GLOBAL_RE.match(name)
        if top is not None and top.group(1) in _GLOBAL_MODULES and top.group(2) in _PARAMS:
            hf_name = f"{_GLOBAL_MODULES[top.group(1)]}.{_PARAMS[top.group(2)]}"
            placements.append(_Placement(hf_name, name, None))
            continue
        raise ValueError(f"{source}: variable {name} ({list(tensor.shape)}) has no place in transformers' "
                         f"WhisperForConditionalGeneration; this CTranslate2 Whisper variant is not "
                         f"supported.")

    expected = _expected_hf_names(model, tie_word_embeddings)
    by_name = {p.hf_name: p for p in placements}
    unexpected = [p for p in placements if p.hf_name not in expected]
    if unexpected:
        p = unexpected[0]
        raise ValueError(f"{source}: variable {p.ct2_name} maps to {p.hf_name}, which transformers' "
                         f"WhisperForConditionalGeneration does not have.")
    missing = sorted(expected - set(by_name))
    if missing:
        raise ValueError(f"{source}: no CT2 variable provides {len(missing)} transformers parameter(s), e.g. "
                         f"{missing[:3]}; the file lacks tensors a Whisper model needs.")
    return placements, tie_word_embeddings


def _check_projection(model: CT2Model, name: str, source: str) -> bool:
    """Whether ``decoder/projection/*`` is the tied output projection (True) or a separate weight (False)."""
    tensor = model.variables[name]
    if name == "decoder/projection/weight":
        embeddings = model.variables.get("decoder/embeddings/weight")
        return embeddings is not None and (tensor is embeddings or torch.equal(tensor, embeddings))
    if name == "decoder/projection/bias" and not torch.count_nonzero(tensor):
        return True                     # a zero bias: transformers' proj_out has none
    raise ValueError(f"{source}: {name} has no place in transformers' Whisper (proj_out has only a weight).")


def _expected_hf_names(model: CT2Model, tie_word_embeddings: bool) -> set[str]:
    """The parameter names of ``WhisperForConditionalGeneration`` for the layer counts in ``model``."""
    names = {f"{module}.{param}" for module in _GLOBAL_MODULES.values() for param in ("weight", "bias")
             if not module.endswith(("embed_positions", "embed_tokens")) or param == "weight"}
    layer_counts = _layer_counts(model)
    for stack, modules in (("encoder", _ENCODER_LAYER_MODULES), ("decoder", _DECODER_LAYER_MODULES)):
        for i in range(layer_counts[stack]):
            for module in modules:
                names.add(f"model.{stack}.layers.{i}.{module}.weight")
                if module not in _NO_BIAS:
                    names.add(f"model.{stack}.layers.{i}.{module}.bias")
    if not tie_word_embeddings:
        names.add("proj_out.weight")
    return names


def _layer_counts(model: CT2Model) -> dict[str, int]:
    """Number of encoder and decoder layers: one more than the highest ``layer_<i>`` index of each."""
    counts = {"encoder": 0, "decoder": 0}
    for m in filter(None, map(_LAYER_RE.match, model.variables)):
        counts[m.group(1)] = max(counts[m.group(1)], int(m.group(2)) + 1)
    return counts


def _token_ids(model: CT2Model, vocab_size: int) -> WhisperTokenIds:
    """Special ids from the directory's vocabulary file, else the released layout for ``vocab_size``."""
    vocab_file = vocabulary_file(model.path)
    if not vocab_file.is_file():
        return default_whisper_token_ids(vocab_size)
    ids = read_whisper_token_ids(model.path)
    if ids.vocab_size != vocab_size:
        raise ValueError(f"{vocab_file} has {ids.vocab_size} tokens but decoder/embeddings/weight has "
                         f"{vocab_size} rows: the vocabulary belongs to another model.")
    return ids
