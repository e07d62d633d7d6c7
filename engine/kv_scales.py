"""A checkpoint's FP8 KV cache scales: which tensors they are, and their values per decoder layer.

An FP8 KV cache (``--kv-cache-dtype fp8``) stores K / k_scale and V / v_scale, one scale per tensor per
layer, as vLLM does. Checkpoints quantized for it carry the scales under one of these names (the prefix
before ``layers.N`` is the decoder's: ``model.``, ``model.language_model.``, ``language_model.model.``,
``model.decoder.``; encoder and vision-tower layers have no KV cache and are not matched):

    layers.N.self_attn.k_scale, .v_scale              vLLM, AutoFP8, ModelOpt, llm-compressor (current)
    layers.N.self_attn.attn.k_scale, .v_scale         vLLM's own module path
    layers.N.self_attn.kv_scale                       older AutoFP8: one scale for K and V
    layers.N.self_attn.k_proj.output_scale, v_proj.   compressed-tensors ``kv_cache_scheme``, Quark
    layers.N.self_attn.k_proj.k_scale, v_proj.v_scale older ModelOpt

``q_scale`` / ``prob_scale`` / ``q_proj.output_scale`` (FP8 attention's query and probability scales) are
recognized too, so a loader can skip them, and are not used. Nothing here imports the model or the runner:
the model's load path and ``engine.runner.kv_cache`` both use it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional

import torch

_ATTENTION_SCALE = re.compile(
    r"^(?:(?:language_model\.)?model\.(?:language_model\.|decoder\.)?)?layers\.(\d+)\.self_attn\."
    r"(?:attn\.)?(?:(?P<direct>k|v|kv|q|prob)_scale|(?P<proj>[kqv])_proj\.(?:output_scale|(?P<proj_kind>[kv])_scale))$")


FP8_KV_DTYPE = torch.float8_e4m3fn
"""The FP8 KV cache's element type (``kernels.kv_write.FP8_KV_DTYPE``; named here too because this module
imports no Triton)."""


class KVScales(NamedTuple):
    """One layer's FP8 KV cache scales: the cache stores K / k_scale and V / v_scale."""

    k_scale: float
    v_scale: float


UNIT_KV_SCALES = KVScales(1.0, 1.0)
"""The scales of a layer without checkpoint scales, and of every float cache."""


@dataclass(frozen=True)
class AttentionScaleName:
    """What a checkpoint's attention activation scale tensor is."""

    layer: int
    """Decoder layer index N (``layers.N``): the position in ``ModelForCausalLM.attention_layers``."""
    kind: str
    """"k", "v", "kv" (one scale for both), or "q" / "prob" (not used)."""


def attention_scale_name(name: str) -> Optional[AttentionScaleName]:
    """``name`` as a decoder layer's attention activation scale (the module docstring's names); None for any
    other checkpoint tensor."""
    m = _ATTENTION_SCALE.match(name)
    if m is None:
        return None
    if m["direct"] is not None:
        kind = m["direct"]
    elif m["proj_kind"] is not None:                  # k_proj.k_scale / v_proj.v_scale; k_proj.v_scale is not one
        if m["proj_kind"] != m["proj"]:
            return None
        kind = m["proj"]
    else:                                             # *_proj.output_scale
        kind = m["proj"]
    return AttentionScaleName(layer=int(m.group(1)), kind=kind)


def kv_scales_from_checkpoint(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[int, KVScales]:
    """Per-layer KV cache scales from a checkpoint's tensors (any of them; only the scale names are read):
    {layer index N: KVScales}. A layer with one scale (``kv_scale``, or only one of k/v) uses it for both,
    as vLLM does. Raises ValueError for a scale that is not one positive finite number (per-head scales
    are not supported) or a layer given the same scale twice."""
    found: dict[int, dict[str, float]] = {}
    for name, tensor in named_tensors:
        what = attention_scale_name(name)
        if what is None or what.kind not in ("k", "v", "kv"):
            continue
        if tensor.numel() != 1:
            raise ValueError(f"{name}: a KV cache scale of shape {tuple(tensor.shape)}; only per-tensor scales "
                             f"(one number) are supported.")
        value = float(tensor.detach().reshape(()).float().item())
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: KV cache scale {value} must be positive and finite.")
        layer = found.setdefault(what.layer, {})
        for kind in ("k", "v") if what.kind == "kv" else (what.kind,):
            if kind in layer:
                raise ValueError(f"{name}: layer {what.layer} already has a {kind}_scale ({layer[kind]}).")
            layer[kind] = value
    return {n: KVScales(s.get("k", s.get("v")), s.get("v", s.get("k"))) for n, s in sorted(found.items())}
