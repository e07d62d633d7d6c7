"""A checkpoint's ``quantization_config`` -> ``CheckpointQuantization`` (or a ValueError naming the field,
the value and what is supported).

Formats read:

- ``compressed-tensors`` (llmcompressor's output): ``float-quantized`` FP8 weights (per channel, per tensor
  or 128x128 blocks) with dynamic per-token or static per-tensor FP8 activations; ``pack-quantized``
  4-bit weights (per group or per channel, symmetric or with zero points) with 16-bit activations;
- ``gptq``: 4-bit, per group or per channel (``group_size: -1``), ``sym`` or not, ``desc_act`` (``g_idx``);
- ``awq``: 4-bit GEMM layout (``version: gemm``) with zero points;
- ``fp8``: HF's block-wise FP8 (``weight_block_size``, ``weight_scale_inv``; Qwen3 / DeepSeek FP8 releases).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Optional

W4A16, FP8 = "w4a16", "fp8"
"""``CheckpointQuantization.kind`` values."""
FORMATS = ("compressed-tensors", "gptq", "awq", "fp8")
"""``quant_method`` values read."""


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a checkpoint's projections are stored."""

    kind: str
    """W4A16 (4-bit weights, 16-bit activations) or FP8 (e4m3 weights)."""
    format: str
    """``quant_method``: which tensor names and packing (``FORMATS``)."""
    group_size: Optional[int] = None
    """W4A16: inputs per scale; None: one scale per output channel."""
    symmetric: bool = True
    """W4A16: zero point 8 (no zero-point tensors); else per-group zero points are stored."""
    act_order: bool = False
    """GPTQ ``desc_act``: the inputs' group assignment is ``g_idx`` (a permutation makes groups contiguous)."""
    gptq_v2: bool = False
    """GPTQ ``checkpoint_format: gptq_v2``: zero points stored as they are (v1 stores zero - 1)."""
    weight_block: Optional[tuple[int, int]] = None
    """FP8: (output rows, input columns) per weight scale; None: one scale per output channel (a
    per-tensor scale is expanded to every channel)."""
    activation_scheme: Optional[str] = None
    """FP8: "dynamic" (per token; per token and 128 inputs with block weights) or "static" (the
    checkpoint's per-tensor ``input_scale``); None for W4A16."""
    ignore: tuple[str, ...] = field(default_factory=tuple)
    """Module names (or ``re:`` patterns, compressed-tensors' form) left unquantized."""

    def quantizes(self, module_name: str) -> bool:
        """Whether ``module_name`` (e.g. ``model.layers.0.mlp.down_proj``) is stored quantized."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module_name):
                    return False
            elif module_name == pattern or module_name.endswith("." + pattern) or fnmatch.fnmatch(module_name, pattern):
                return False
        return True


def _fail(field_name: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"quantization_config.{field_name}={value!r} is not supported; {supported}.")


def read_checkpoint_quantization(hf_config: Any) -> Optional[CheckpointQuantization]:
    """The checkpoint's quantization (``hf_config.quantization_config``, a dict or a transformers config
    object), None for a float checkpoint. ValueError for a scheme Chorus cannot serve."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        text = getattr(hf_config, "get_text_config", lambda: None)()
        raw = getattr(text, "quantization_config", None) if text is not None else None
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(vars(raw))
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "gptq":
        return _gptq(raw)
    if method == "awq":
        return _awq(raw)
    if method == "fp8":
        return _hf_fp8(raw)
    raise _fail("quant_method", method, f"Chorus reads {', '.join(FORMATS)} checkpoints")


def _four_bit(raw: dict, key: str = "bits") -> None:
    if raw.get(key) != 4:
        raise _fail(key, raw.get(key), "4-bit weights are (3- and 8-bit integer GPTQ/AWQ are not)")


def _group(raw: dict) -> Optional[int]:
    size = raw.get("group_size")
    if size in (None, -1):
        return None
    if not isinstance(size, int) or size < 16 or size & (size - 1):
        raise _fail("group_size", size, "a power of two >= 16 or -1 (per channel) is")
    return size


def _gptq(raw: dict) -> CheckpointQuantization:
    _four_bit(raw)
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _fail("checkpoint_format", fmt, "gptq and gptq_v2 are")
    return CheckpointQuantization(W4A16, "gptq", group_size=_group(raw), symmetric=bool(raw.get("sym", True)),
                                  act_order=bool(raw.get("desc_act", False)), gptq_v2=fmt == "gptq_v2",
                                  ignore=tuple(raw.get("modules_to_not_convert") or ()))


def _awq(raw: dict) -> CheckpointQuantization:
    _four_bit(raw, "bits" if "bits" in raw else "w_bit")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _fail("version", raw.get("version"), "the GEMM layout (version: gemm) is")
    raw = dict(raw, group_size=raw.get("group_size", raw.get("q_group_size")))
    return CheckpointQuantization(W4A16, "awq", group_size=_group(raw),
                                  symmetric=not bool(raw.get("zero_point", True)),
                                  ignore=tuple(raw.get("modules_to_not_convert") or ()))


def _hf_fp8(raw: dict) -> CheckpointQuantization:
    block = raw.get("weight_block_size")
    if block is not None and (len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block)):
        raise _fail("weight_block_size", block, "two positive sizes ([128, 128]) or null are")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _fail("activation_scheme", scheme, "dynamic and static are")
    if block is not None and scheme != "dynamic":
        raise _fail("activation_scheme", scheme, "block-wise FP8 weights take dynamic activations")
    return CheckpointQuantization(FP8, "fp8", weight_block=tuple(block) if block else None,
                                  activation_scheme=scheme, ignore=tuple(raw.get("modules_to_not_convert") or ()))


def _compressed_tensors(raw: dict) -> CheckpointQuantization:
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise _fail("config_groups", sorted(groups), "one quantization group (one scheme for every Linear) is")
    (name, group), = groups.items()
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    fmt = raw.get("format")
    ignore = tuple(raw.get("ignore") or ())
    where = f"config_groups.{name}"
    if weights.get("type") == "float" and weights.get("num_bits") == 8:
        if fmt not in ("float-quantized", "naive-quantized"):
            raise _fail("format", fmt, "FP8 weights are read in the float-quantized format")
        strategy = weights.get("strategy")
        block = None
        if strategy == "block":
            block = tuple(weights.get("block_structure") or ())
            if len(block) != 2:
                raise _fail(f"{where}.weights.block_structure", block, "two sizes are")
        elif strategy not in ("channel", "tensor"):
            raise _fail(f"{where}.weights.strategy", strategy, "FP8 weights per channel, per tensor or per block are")
        if acts is None:
            raise _fail(f"{where}.input_activations", None, "FP8 weights need FP8 activations (W8A8)")
        if acts.get("type") != "float" or acts.get("num_bits") != 8:
            raise _fail(f"{where}.input_activations", acts, "FP8 activations are")
        scheme = "dynamic" if acts.get("dynamic") else "static"
        if scheme == "static" and acts.get("strategy") != "tensor":
            raise _fail(f"{where}.input_activations.strategy", acts.get("strategy"),
                        "static activations per tensor are")
        return CheckpointQuantization(FP8, "compressed-tensors", weight_block=block, activation_scheme=scheme,
                                      ignore=ignore)
    if weights.get("type") == "int" and weights.get("num_bits") == 4:
        if fmt != "pack-quantized":
            raise _fail("format", fmt, "4-bit weights are read in the pack-quantized format")
        if acts is not None:
            raise _fail(f"{where}.input_activations", acts, "4-bit weights run with 16-bit activations (W4A16)")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise _fail(f"{where}.weights.strategy", strategy, "4-bit weights per group or per channel are")
        if weights.get("actorder") not in (None, False, "static", "weight", "group"):
            raise _fail(f"{where}.weights.actorder", weights.get("actorder"), "group, static or weight act order is")
        group_size = _group({"group_size": weights.get("group_size")}) if strategy == "group" else None
        return CheckpointQuantization(W4A16, "compressed-tensors", group_size=group_size,
                                      symmetric=bool(weights.get("symmetric", True)),
                                      act_order=weights.get("actorder") == "group", ignore=ignore)
    raise _fail(f"{where}.weights", {k: weights.get(k) for k in ("type", "num_bits", "strategy")},
                "FP8 (float, 8 bits) and 4-bit integer weights are")
