"""Tiny *real-format* quantized checkpoints, for the engine's quantized loaders.

Each builder writes an HF directory -- config.json with the format's real ``quantization_config``,
one ``model.safetensors``, the tiny BPE tokenizer of tests/conftest.py -- from a tiny random model
(tests/conftest.py's, with hidden 256 and intermediate 512, so that every quantized dimension is a
multiple of 128: int4 groups of 128 and FP8 128x128 blocks), and returns ``(directory, dequantized)``:
the float32 state dict, in the unquantized model's HF names (``model.layers.0.self_attn.q_proj.weight``),
of the weights the checkpoint represents, decoded back from the files just written
(``dequantize_checkpoint``). ``write_dequantized_checkpoint`` saves that state dict as a plain float
checkpoint (same config, no ``quantization_config``) for transformers to run as the reference.

Who writes each format (see each builder for the details):

* ``compressed-tensors`` (``build_ct_*``): the library itself, as llm-compressor drives it:
  ``apply_quantization_config``, scales from its ``calculate_qparams`` (what llm-compressor's min-max
  observers call; static input scales from a calibration pass over the tests' corpus), then
  ``ModelCompressor.compress_model`` + ``save_pretrained`` + ``ModelCompressor.update_config``
  (llm-compressor's ``save_pretrained_wrapper``). Needs ``pip install compressed-tensors``.
* ``fp8`` block-wise (``build_fp8_block``): transformers' own FP8 quantize op (``Fp8Quantize``, the
  reverse op of its FineGrainedFP8 loader) computes each 128x128 block's scale and the FP8 weight.
* ``gptq`` and ``awq`` (``build_gptq``, ``build_awq``): small writers here. GPTQModel (which now holds
  both GPTQ's and AutoAWQ's code, and which transformers 5 loads both formats through) requires
  torch>=2.14.1 (pip would swap our CPU torch 2.13 for a CUDA build and its NVIDIA libraries), datasets,
  pyarrow, pandas and torchao, and AutoAWQ's package does not import without ``datasets``, so neither
  is a dependency of the builders. The writers follow the tools' quantize and pack formulas exactly
  (the function each mirrors is cited on it), and tests/quantization/test_formats.py checks, where
  GPTQModel / AutoAWQ are installed (``pip install --no-deps``, see there), that the tools' own packers
  write the same bytes, their own dequantizers read the same weights, and transformers' GPTQ/AWQ
  loaders run them.

Quantization here is round-to-nearest (what GPTQ/AWQ's error-compensating searches produce is still
the same format): the fixtures test loaders and kernels, not quantization quality.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

QUANT_SIZES = dict(hidden_size=256, intermediate_size=512)
"""The tiny model's sizes here: every Linear's dims are multiples of 128 (q/o 256x256, k/v 128x256,
gate/up 512x256, down 256x512), so int4 groups of 128 and FP8 128x128 blocks tile them exactly."""

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)      # 448
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)                        # AutoAWQ's nibble order in a packed int32
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

SAFETENSORS_FILE = "model.safetensors"


# ------------------------------------------------------------------------------------------
# The float model the formats come from
# ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _tokenizer():
    from tests.conftest import build_tokenizer

    return build_tokenizer()


def tiny_float_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.bfloat16, **overrides):
    """``(model, tokenizer)``: tests/conftest.py's tiny random ``arch`` (same kwargs, same seeding) at
    ``QUANT_SIZES``, in ``dtype``. A builder called with the same arguments quantizes exactly these
    weights, so tests regenerate the float weights a checkpoint came from with this."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = _tokenizer()
    kwargs = dict(vocab_size=len(tok), num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  initializer_range=0.2, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                  bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id, **QUANT_SIZES)
    kwargs.update(overrides)
    cfg = AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval(), tok


def quantized_linear_names(model: torch.nn.Module) -> list[str]:
    """The Linear modules every format here quantizes: all of them but the LM head (the formats'
    usual ``ignore: ["lm_head"]``); embeddings and norms stay in the model's dtype."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.split(".")[-1] != "lm_head"]


@torch.no_grad()
def _calibrate(model, tok, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Per Linear: the min and max of its inputs, and the sum of squares of each input feature (the
    diagonal of GPTQ's Hessian ``2 X^T X``, up to a constant), over the tests' corpus."""
    from tests.conftest import CORPUS

    stats, hooks = {}, []
    for name in names:
        module = model.get_submodule(name)
        stats[name] = {"min": torch.tensor(math.inf), "max": torch.tensor(-math.inf),
                       "sq": torch.zeros(module.in_features, dtype=torch.float64)}

        def hook(_mod, args, name=name):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            s = stats[name]
            s["min"] = torch.minimum(s["min"], x.min())
            s["max"] = torch.maximum(s["max"], x.max())
            s["sq"] += (x.double() ** 2).sum(0)

        hooks.append(module.register_forward_pre_hook(hook))
    try:
        for text in dict.fromkeys(CORPUS):
            model(tok(text, return_tensors="pt").input_ids)
    finally:
        for h in hooks:
            h.remove()
    return stats


def _write_checkpoint(out_dir: Path, model, tok, tensors: dict[str, torch.Tensor],
                      quantization_config: dict, quantize_config_json: bool = False) -> Path:
    """config.json (the model's, plus ``quantization_config``), generation_config.json, one
    model.safetensors and the tokenizer; ``quantize_config.json`` too where the tool writes one."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if quantize_config_json:
        (out_dir / "quantize_config.json").write_text(json.dumps(quantization_config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / SAFETENSORS_FILE),
              metadata={"format": "pt"})
    tok.save_pretrained(out_dir)
    return out_dir


def _unquantized_tensors(model, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Everything in the state dict but the quantized Linears' weights (their biases stay), in ``dtype``."""
    skip = {f"{n}.weight" for n in names}
    return {k: v.detach().to(dtype) for k, v in model.state_dict().items() if k not in skip}


# ------------------------------------------------------------------------------------------
# compressed-tensors (written by the library)
# ------------------------------------------------------------------------------------------
def _ct_observe(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """min and max of ``w`` per the strategy's scope, as llm-compressor's MinMax observer takes them."""
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "tensor":
        return w.amin(), w.amax()
    if strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if strategy == "group":
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    if strategy == "block":
        bo, bi = args.block_structure
        b = w.unflatten(0, (-1, bo)).unflatten(-1, (-1, bi))        # [O/bo, bo, I/bi, bi]
        return b.amin((1, 3)), b.amax((1, 3))
    raise ValueError(f"no observer here for strategy {strategy}")


def _build_ct(out_dir: Path, scheme, *, arch: str, seed: int, dtype: torch.dtype) -> tuple[Path, dict]:
    """Quantize with compressed-tensors as llm-compressor does (one scheme, ``ignore: ["lm_head"]``)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    model, tok = tiny_float_model(arch, seed, dtype)
    names = quantized_linear_names(model)
    static_inputs = scheme.input_activations is not None and not scheme.input_activations.dynamic
    stats = _calibrate(model, tok, names) if static_inputs else None
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    with torch.no_grad():
        for name in names:
            module = model.get_submodule(name)
            args = module.quantization_scheme.weights
            scale, zero_point = calculate_qparams(*_ct_observe(module.weight.detach().float(), args), args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
            if static_inputs:
                in_args = module.quantization_scheme.input_activations
                scale, zero_point = calculate_qparams(stats[name]["min"], stats[name]["max"], in_args)
                module.input_scale.copy_(scale.reshape(module.input_scale.shape))
                if hasattr(module, "input_zero_point"):
                    module.input_zero_point.copy_(zero_point.reshape(module.input_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
    tok.save_pretrained(out_dir)
    return out_dir, dequantize_checkpoint(out_dir)


def build_ct_fp8_dynamic(out_dir: Path, *, arch: str = "llama", seed: int = 0,
                         dtype: torch.dtype = torch.bfloat16) -> tuple[Path, dict]:
    """compressed-tensors ``FP8_DYNAMIC`` (llm-compressor's scheme): float8_e4m3fn weights with a
    per-channel ``weight_scale`` [out, 1] (amax / 448), dynamic per-token FP8 activations, format
    ``float-quantized``. Scales are in the model's dtype (bf16), as llm-compressor writes them."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return _build_ct(out_dir, preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]), arch=arch, seed=seed, dtype=dtype)


def build_ct_fp8_static(out_dir: Path, *, arch: str = "llama", seed: int = 0,
                        dtype: torch.dtype = torch.bfloat16) -> tuple[Path, dict]:
    """compressed-tensors ``FP8`` (static per-tensor): float8_e4m3fn weights with one ``weight_scale``
    [1] per Linear and one static ``input_scale`` [1] (the calibration inputs' amax / 448, as the
    ``static_minmax`` observer gives), format ``float-quantized``. q/k/v (and gate/up) have different
    scales, as real checkpoints do: a loader that fuses them must requantize to one scale."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return _build_ct(out_dir, preset_name_to_scheme("FP8", ["Linear"]), arch=arch, seed=seed, dtype=dtype)


def build_ct_w4a16(out_dir: Path, *, symmetric: bool = True, group_size: Optional[int] = 128,
                   arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> tuple[Path, dict]:
    """compressed-tensors ``W4A16`` (``symmetric``) / ``W4A16_ASYM``: int4 weights, format
    ``pack-quantized``: ``weight_packed`` int32 [out, in/8] (value + 8 in nibble ``i % 8`` of word
    ``i // 8``), ``weight_scale`` [out, in/group] in the model's dtype, ``weight_shape`` int64 [2],
    and for the asymmetric variant ``weight_zero_point`` int32 [out/8, in/group] (packed the same way
    along the output dim). ``group_size=None`` is the per-channel strategy instead."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    preset = preset_name_to_scheme("W4A16" if symmetric else "W4A16_ASYM", ["Linear"])
    if group_size != 128:
        fields = preset.weights.model_dump()
        fields.update(group_size=group_size, strategy="group" if group_size else "channel")
        preset = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**fields))
    return _build_ct(out_dir, preset, arch=arch, seed=seed, dtype=dtype)


# ------------------------------------------------------------------------------------------
# HF block-wise FP8 (quant_method "fp8"), written by transformers' own quantize op
# ------------------------------------------------------------------------------------------
def build_fp8_block(out_dir: Path, *, block: tuple[int, int] = (128, 128),
                    scale_dtype: torch.dtype = torch.bfloat16, arch: str = "llama", seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16) -> tuple[Path, dict]:
    """Block-wise FP8 as Qwen3-FP8 (and DeepSeek-V3) releases ship it: ``quantization_config``
    ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
    [128, 128]}``, each Linear's ``weight`` float8_e4m3fn [out, in] and ``weight_scale_inv``
    [out/128, in/128] (the dequantization multiplier: ``W = weight * weight_scale_inv`` per block).

    The FP8 weight and the float32 block scales come from transformers' ``Fp8Quantize`` (the
    FineGrainedFP8 quantizer's own op: scale = 448 / block amax, ``weight_scale_inv`` = 1 / scale).
    Qwen3's dense FP8 releases store ``weight_scale_inv`` in bf16 (DeepSeek-V3's in float32), so with
    ``scale_dtype`` other than float32 the scale is rounded to it and the weight requantized with the
    rounded scale (``weight = fp8(clamp(W / weight_scale_inv, +-448))``), keeping ``weight *
    weight_scale_inv`` the block's best FP8 approximation."""
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    bo, bi = block
    quantize = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=[bo, bi])).get_quantize_ops()
    model, tok = tiny_float_model(arch, seed, dtype)
    names = quantized_linear_names(model)
    tensors = _unquantized_tensors(model, names, dtype)
    for name in names:
        w = model.get_submodule(name).weight.detach()
        if w.shape[0] % bo or w.shape[1] % bi:
            raise ValueError(f"{name}: {tuple(w.shape)} is not a multiple of the {block} blocks")
        out = quantize.convert({f"{name}.weight": w})
        q, inv = out[f"{name}.weight"], out[f"{name}.weight_scale_inv"]
        if scale_dtype != torch.float32:
            inv = inv.to(scale_dtype)
            expanded = inv.float().repeat_interleave(bo, 0).repeat_interleave(bi, 1)
            q = (w.float() / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.weight_scale_inv"] = inv
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [bo, bi]}
    out_dir = _write_checkpoint(out_dir, model, tok, tensors, qc)
    return out_dir, dequantize_checkpoint(out_dir)


# ------------------------------------------------------------------------------------------
# FP8 MoE checkpoints (per-expert tensors, as the FP8 releases of Qwen3-MoE store them)
# ------------------------------------------------------------------------------------------
def moe_projection_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The weights an FP8 MoE checkpoint quantizes: attention and MLP projections and every expert's gate / up /
    down (Qwen-MoE ``experts.N.gate_proj``, Mixtral ``experts.N.w1``); routers (``.gate.weight``), embeddings,
    norms and the LM head stay float, as in the Qwen3-MoE FP8 releases and llm-compressor's MoE recipes
    (``ignore: ["lm_head", "re:.*mlp.gate$"]``)."""
    return [n for n in tensors if n.endswith("_proj.weight") or
            (".experts." in n and n.rsplit(".", 2)[-2] in ("w1", "w2", "w3"))]


def build_moe_fp8(out_dir: Path, float_dir: Path, *, fmt: str = "fp8-block",
                  block: tuple[int, int] = (32, 32)) -> tuple[Path, dict]:
    """An FP8 checkpoint of the float MoE checkpoint ``float_dir`` (per-expert tensor names, as transformers
    saves them): ``fmt`` "fp8-block" quantizes each projection with transformers' ``Fp8Quantize`` op (``block``
    scales as ``weight_scale_inv``, float32), "ct-fp8-dynamic" with compressed-tensors' FP8_DYNAMIC weight
    args (``calculate_qparams`` over each channel's min / max, ``quantize``; per-channel ``weight_scale``
    [out, 1]) and its ``quantization_config`` ignoring the routers. Returns ``(directory, dequantized)``."""
    float_dir = Path(float_dir)
    tensors = read_tensors(float_dir)
    names = moe_projection_names(tensors)
    if fmt == "fp8-block":
        from transformers import FineGrainedFP8Config
        from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

        op = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=list(block))).get_quantize_ops()
        for name in names:
            out = op.convert({name: tensors[name]})
            tensors[name] = out[name]
            tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = out[name.removesuffix(".weight")
                                                                               + ".weight_scale_inv"]
        qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": list(block)}
    elif fmt == "ct-fp8-dynamic":
        from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
        from compressed_tensors.quantization.lifecycle.forward import quantize
        from compressed_tensors.quantization.utils import calculate_qparams

        scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
        args = scheme.weights
        for name in names:
            w = tensors[name].float()
            scale, zero_point = calculate_qparams(*_ct_observe(w, args), args)
            scale = scale.reshape(-1, 1).to(torch.bfloat16)      # the model dtype's parameter, as llm-compressor
            tensors[name] = quantize(w, scale.float(), zero_point, args).to(args.pytorch_dtype())
            tensors[name.removesuffix(".weight") + ".weight_scale"] = scale
        qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head", "re:.*mlp.gate$"],
                                format="float-quantized", quantization_status="compressed").model_dump()
        qc["quant_method"] = "compressed-tensors"
    else:
        raise ValueError(f"no FP8 MoE format {fmt!r}")
    return _rewrite_moe_checkpoint(out_dir, float_dir, tensors, qc)


def build_moe_int4(out_dir: Path, float_dir: Path, *, fmt: str = "gptq", group_size: int = 32,
                   seed: int = 0) -> tuple[Path, dict]:
    """A 4-bit checkpoint of the float MoE checkpoint ``float_dir``, the projections of
    ``moe_projection_names`` quantized as the GPTQ / AWQ MoE releases quantize them (attention and every
    expert's gate / up / down; routers, embeddings, norms and the LM head float): ``fmt`` "gptq" (v1,
    symmetric, ``gptq_quantize`` + ``gptq_pack``), "gptq-actorder" (asymmetric, ``desc_act``: each
    projection's groups over a random permutation of its inputs, one per input, so gate and up of an expert
    share it, as calibration gives them) or "awq" (``awq_quantize`` + ``awq_pack``, GEMM layout); groups of
    ``group_size`` inputs. Returns ``(directory, dequantized)``."""
    float_dir = Path(float_dir)
    tensors = read_tensors(float_dir)
    g = torch.Generator().manual_seed(seed)
    perms: dict[tuple, torch.Tensor] = {}      # (parent module, output side, inputs) -> permutation
    for name in [n.removesuffix(".weight") for n in moe_projection_names(tensors)]:
        w = tensors.pop(f"{name}.weight").float()
        if fmt == "awq":
            codes, scales, zeros = awq_quantize(w, group_size=group_size)
            qweight, qzeros = awq_pack(codes, scales, zeros, group_size=group_size)
            tensors.update({f"{name}.qweight": qweight, f"{name}.qzeros": qzeros, f"{name}.scales": scales.half()})
            continue
        if fmt not in ("gptq", "gptq-actorder"):
            raise ValueError(f"no 4-bit MoE format {fmt!r}")
        perm = None
        if fmt == "gptq-actorder":
            key = (name.rsplit(".", 1)[0], name.endswith(("down_proj", ".w2", "o_proj")), w.shape[1])
            perm = perms.setdefault(key, torch.randperm(w.shape[1], generator=g))
        codes, scales, zeros, g_idx = gptq_quantize(w, bits=4, group_size=group_size, sym=fmt == "gptq", perm=perm)
        qweight, qzeros = gptq_pack(codes, scales, zeros, g_idx, bits=4)
        tensors.update({f"{name}.qweight": qweight, f"{name}.qzeros": qzeros, f"{name}.scales": scales.half(),
                        f"{name}.g_idx": g_idx})
    if fmt == "awq":
        qc = {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4, "version": "gemm",
              "modules_to_not_convert": ["gate"]}
    else:
        qc = {"bits": 4, "group_size": group_size, "desc_act": fmt == "gptq-actorder", "sym": fmt == "gptq",
              "lm_head": False, "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32"}
    return _rewrite_moe_checkpoint(out_dir, float_dir, tensors, qc)


def _rewrite_moe_checkpoint(out_dir: Path, float_dir: Path, tensors: dict[str, torch.Tensor], qc: dict
                            ) -> tuple[Path, dict]:
    """``float_dir`` copied to ``out_dir`` with ``tensors`` as its weights and ``qc`` as its
    ``quantization_config``; returns ``(out_dir, dequantize_checkpoint(out_dir))``."""
    out_dir = Path(out_dir)
    shutil.copytree(float_dir, out_dir, dirs_exist_ok=True)
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    for file in out_dir.glob("*.safetensors"):
        file.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / SAFETENSORS_FILE),
              metadata={"format": "pt"})
    return out_dir, dequantize_checkpoint(out_dir)


# ------------------------------------------------------------------------------------------
# Packing helpers (int64 math, stored as int32 bit patterns)
# ------------------------------------------------------------------------------------------
def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 ``x`` as int32 (two's complement), as the tools' ``|=`` on int32 gives."""
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2 ** 31, x - 2 ** 32, x).to(torch.int32)


def _as_uint32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int64) & 0xFFFFFFFF


def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight: [in, out] codes -> int32 [in * bits / 32, out]; code ``in`` row ``8r + j`` (4-bit)
    in bits ``4j`` of row ``r``."""
    pf = 32 // bits
    rows = codes.to(torch.int64).unflatten(0, (-1, pf))                         # [in/pf, pf, out]
    shifts = (torch.arange(pf, dtype=torch.int64) * bits).view(1, pf, 1)
    return _as_int32((rows << shifts).sum(1))


def _pack_cols(codes: torch.Tensor, bits: int, order: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """[r, c] codes -> int32 [r, c * bits / 32]; nibble ``i`` of word ``k`` holds column
    ``k * pf + order[i]`` (``order`` the identity for GPTQ's qzeros, ``AWQ_ORDER`` for AWQ)."""
    pf = 32 // bits
    cols = codes.to(torch.int64).unflatten(1, (-1, pf))                         # [r, c/pf, pf]
    if order is not None:
        cols = cols[..., list(order)]
    shifts = torch.arange(pf, dtype=torch.int64) * bits
    return _as_int32((cols << shifts).sum(-1))


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    pf = 32 // bits
    shifts = (torch.arange(pf, dtype=torch.int64) * bits).view(1, pf, 1)
    return ((_as_uint32(packed).unsqueeze(1) >> shifts) & (2 ** bits - 1)).flatten(0, 1)


def _unpack_cols(packed: torch.Tensor, bits: int, order: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    pf = 32 // bits
    shifts = torch.arange(pf, dtype=torch.int64) * bits
    nibbles = (_as_uint32(packed).unsqueeze(-1) >> shifts) & (2 ** bits - 1)  # [r, c/pf, pf]: nibble i
    if order is not None:                                                      # column j = nibble inverse[j]
        inverse = [list(order).index(j) for j in range(pf)]
        nibbles = nibbles[..., inverse]
    return nibbles.flatten(-2)


def _zero_offsets(bits: int) -> int:
    """One in every ``bits``-wide field of an int32: what GPTQ v1 subtracts from the packed qzeros
    (0x11111111 for 4 bits; GPTQModel's convert_gptq_v2_to_v1_format_module)."""
    return sum(1 << (bits * j) for j in range(32 // bits))


# ------------------------------------------------------------------------------------------
# GPTQ (quant_method "gptq", checkpoint_format "gptq" = v1)
# ------------------------------------------------------------------------------------------
def gptq_quantize(w: torch.Tensor, *, bits: int, group_size: int, sym: bool,
                  perm: Optional[torch.Tensor] = None):
    """Round-to-nearest GPTQ quantization of ``w`` [out, in] (float32).

    Mirrors GPTQModel 7.7's ``Quantizer.find_params`` (gptqmodel/quantization/quantizer.py: per output
    row and group, ``xmin = min(x.min(), 0)``, ``xmax = max(x.max(), 0)``; sym: ``xmax = max(|xmin|,
    xmax)``, ``xmin = -xmax``; ``scale = (xmax - xmin) / maxq``; ``zero = (maxq + 1) / 2`` if sym else
    ``round(-xmin / scale)``) and ``Quantizer.quantize`` (``q = clamp(round(x / scale) + zero, 0,
    maxq)``), and GPTQ's act-order bookkeeping (gptqmodel/quantization/gptq.py: groups are taken over
    the input columns in ``perm`` order, ``g_idx[perm[j]] = j // group_size``).

    Two choices of ours, both inside the format: scales are rounded to float16 (what is stored) before
    quantizing, so the stored scale is the one the codes were rounded with; and asymmetric zero points
    are kept in ``1..maxq``: a v1 checkpoint stores ``zero - 1`` by subtracting 0x11111111 from the
    packed word, so a zero of 0 would borrow from its neighbour, which GPTQModel undoes by adding the
    word back but per-nibble readers (vLLM's kernels) do not.

    Returns ``codes`` [out, in] (int64, 0..maxq), ``scales`` [groups, out] (float32 holding float16
    values), ``zeros`` [groups, out] (int64, GPTQ v2: the real zero point), ``g_idx`` [in] (int32)."""
    out_f, in_f = w.shape
    maxq = 2 ** bits - 1
    gs = in_f if group_size == -1 else group_size
    if in_f % gs:
        raise ValueError(f"in_features {in_f} is not a multiple of group_size {gs}")
    perm = torch.arange(in_f) if perm is None else perm
    n_groups = in_f // gs
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[perm] = (torch.arange(in_f) // gs).to(torch.int32)
    scales = torch.empty(n_groups, out_f)
    zeros = torch.empty(n_groups, out_f)
    for g in range(n_groups):
        x = w[:, perm[g * gs:(g + 1) * gs]]
        xmin = torch.minimum(x.amin(1), torch.zeros(out_f))
        xmax = torch.maximum(x.amax(1), torch.zeros(out_f))
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = torch.where(xmin < 0, -xmax, xmin)
        both_zero = xmax == 0 if sym else (xmin == 0) & (xmax == 0)
        xmin = torch.where(both_zero, xmin - 1, xmin)
        xmax = torch.where(both_zero, xmax + 1, xmax)
        scale = (xmax - xmin) / maxq
        scales[g] = scale
        zeros[g] = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    scales = scales.half().float()
    if not sym:
        zeros = zeros.clamp(1, maxq)
    gi = g_idx.long()
    codes = torch.clamp(torch.round(w / scales[gi].T) + zeros[gi].T, 0, maxq)
    return codes.long(), scales, zeros.long(), g_idx


def gptq_pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, *,
              bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight, qzeros)`` of a GPTQ v1 checkpoint: qweight int32 [in * bits / 32, out], qzeros int32
    [groups, out * bits / 32].

    Mirrors GPTQModel 7.7's ``PackableQuantLinear.pack_block`` (gptqmodel/nn_modules/qlinear/__init__.py;
    its Python path, which its native extension matches): the codes are recomputed from the dequantized
    weight as ``clamp(round((W + zeros * scales) / scales), 0, maxq)`` (asserted here to give back
    ``codes``), packed 32 // bits to an int32 down the input dim, the zeros across the output dim; then
    ``convert_gptq_v2_to_v1_format_module`` (gptqmodel/utils/model.py) subtracts ``_zero_offsets`` from
    the packed qzeros, the v1 convention (``zero - 1``) that AutoGPTQ checkpoints and vLLM expect."""
    gi = g_idx.long()
    maxq = 2 ** bits - 1
    dequant = dequantize_gptq_codes(codes, scales, zeros, g_idx)
    again = torch.clamp(torch.round((dequant + (zeros * scales)[gi].T) / scales[gi].T), 0, maxq).long()
    assert torch.equal(again, codes), "GPTQModel's pack formula would not give back the codes"
    qweight = _pack_rows(codes.T, bits)
    qzeros = _as_int32(_as_uint32(_pack_cols(zeros, bits)) - _zero_offsets(bits))
    return qweight, qzeros


def dequantize_gptq_codes(codes, scales, zeros, g_idx) -> torch.Tensor:
    """[out, in] float32 ``scales[g_idx] * (codes - zeros[g_idx])`` (GPTQModel's
    ``PackableQuantLinear._dequantize_from_codes``, transposed)."""
    gi = g_idx.long()
    return (scales[gi] * (codes.T - zeros[gi]).float()).T.contiguous()


def build_gptq(out_dir: Path, *, bits: int = 4, group_size: int = 128, sym: bool = True,
               desc_act: bool = False, arch: str = "llama", seed: int = 0,
               dtype: torch.dtype = torch.float16) -> tuple[Path, dict]:
    """A GPTQ checkpoint as GPTQModel (and AutoGPTQ before it) saves one, ``checkpoint_format: "gptq"``
    (v1): per Linear ``qweight`` int32 [in/8, out], ``qzeros`` int32 [groups, out/8] (``zero - 1``),
    ``scales`` float16 [groups, out], ``g_idx`` int32 [in]; ``group_size=-1`` is one group per output
    channel. ``desc_act=True`` is act-order: groups taken over the input columns in decreasing order
    of the calibration Hessian's diagonal (GPTQ's ``perm = argsort(diag(H), descending=True)``), so
    ``g_idx`` is a nontrivial permutation of the group ids -- the same one for q/k/v and for gate/up,
    which share their input, as in real checkpoints. The other tensors are in ``dtype`` (float16, as
    GPTQ checkpoints usually are); config.json and quantize_config.json hold the config."""
    if bits not in (2, 4, 8):
        raise ValueError("GPTQ packing here is for 2, 4 or 8 bits")
    model, tok = tiny_float_model(arch, seed, dtype)
    names = quantized_linear_names(model)
    stats = _calibrate(model, tok, names) if desc_act and group_size != -1 else None
    tensors = _unquantized_tensors(model, names, dtype)
    for name in names:
        w = model.get_submodule(name).weight.detach().float()
        perm = torch.argsort(stats[name]["sq"], descending=True, stable=True) if stats else None
        codes, scales, zeros, g_idx = gptq_quantize(w, bits=bits, group_size=group_size, sym=sym, perm=perm)
        qweight, qzeros = gptq_pack(codes, scales, zeros, g_idx, bits=bits)
        tensors.update({f"{name}.qweight": qweight, f"{name}.qzeros": qzeros,
                        f"{name}.scales": scales.half(), f"{name}.g_idx": g_idx})
    qc = {"bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym, "lm_head": False,
          "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32",
          "damp_percent": 0.01, "static_groups": False, "true_sequential": True,
          "meta": {"quantizer": ["chorus-tests:0.1.0"], "uri": "tests/quantization/formats.py",
                   "method": "round-to-nearest, packed as gptqmodel 7.7.0 packs"}}
    out_dir = _write_checkpoint(out_dir, model, tok, tensors, qc, quantize_config_json=True)
    return out_dir, dequantize_checkpoint(out_dir)


# ------------------------------------------------------------------------------------------
# AWQ (quant_method "awq", version "gemm")
# ------------------------------------------------------------------------------------------
def awq_quantize(w: torch.Tensor, *, group_size: int = 128, bits: int = 4):
    """Round-to-nearest AWQ (zero point) quantization of ``w`` [out, in] (float32).

    Mirrors AutoAWQ 0.2.9's ``AwqQuantizer.pseudo_quantize_tensor`` (awq/quantize/quantizer.py, with
    ``zero_point=True``): per output row and group of ``group_size`` inputs, ``scales = (max - min)
    .clamp(min=1e-5) / 15``, ``zeros = clamp(-round(min / scales), 0, 15)``, ``q = clamp(round(w /
    scales) + zeros, 0, 15)`` -- with the scales rounded to float16 (what is stored) first.
    Returns ``codes`` [out, in], ``scales`` [groups, out] (float32 holding float16 values),
    ``zeros`` [groups, out] (the real zero points; AWQ stores them as is)."""
    out_f, in_f = w.shape
    max_int = 2 ** bits - 1
    g = w.reshape(-1, group_size)
    max_val, min_val = g.amax(1, keepdim=True), g.amin(1, keepdim=True)
    scales = ((max_val - min_val).clamp(min=1e-5) / max_int).half().float()
    zeros = (-torch.round(min_val / scales)).clamp(0, max_int)
    codes = torch.clamp(torch.round(g / scales) + zeros, 0, max_int)
    return (codes.reshape(out_f, in_f).long(), scales.reshape(out_f, -1).T.contiguous(),
            zeros.reshape(out_f, -1).T.contiguous().long())


def awq_pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, group_size: int,
             bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight, qzeros)`` of AutoAWQ's GEMM layout: qweight int32 [in, out/8], qzeros int32
    [groups, out/8], eight 4-bit values per word along the output dim in ``AWQ_ORDER``
    (0, 2, 4, 6, 1, 3, 5, 7).

    Mirrors AutoAWQ 0.2.9's ``WQLinear_GEMM.from_linear`` (awq/modules/linear/gemm.py): codes are
    recomputed from the fake-quantized weight as ``round((W + zeros * scales) / scales)`` (asserted to
    give back ``codes``), transposed to [in, out], and each word ``qweight[:, col] |= intweight[:, col *
    8 + order_map[i]] << (i * 4)``; qzeros likewise (GPTQModel's ``pack_awq_columns`` writes the same)."""
    gidx = torch.arange(codes.shape[1]) // group_size
    dequant = dequantize_awq_codes(codes, scales, zeros, group_size=group_size)
    again = torch.round((dequant.T + (zeros * scales)[gidx]) / scales[gidx]).long().T
    assert torch.equal(again, codes), "AutoAWQ's pack formula would not give back the codes"
    return _pack_cols(codes.T, bits, AWQ_ORDER), _pack_cols(zeros, bits, AWQ_ORDER)


def dequantize_awq_codes(codes, scales, zeros, *, group_size: int) -> torch.Tensor:
    """[out, in] float32 ``(codes - zeros[group]) * scales[group]`` (AutoAWQ's ``dequantize_gemm``)."""
    gidx = torch.arange(codes.shape[1]) // group_size
    return ((codes.T - zeros[gidx]).float() * scales[gidx]).T.contiguous()


def build_awq(out_dir: Path, *, group_size: int = 128, arch: str = "llama", seed: int = 0,
              dtype: torch.dtype = torch.float16) -> tuple[Path, dict]:
    """An AutoAWQ GEMM checkpoint: ``quantization_config`` ``{"quant_method": "awq", "version": "gemm",
    "bits": 4, "group_size": 128, "zero_point": true, "modules_to_not_convert": null}`` (what
    AutoAWQ's ``to_transformers_dict`` writes), per Linear ``qweight`` int32 [in, out/8] (AWQ's nibble
    order), ``qzeros`` int32 [groups, out/8], ``scales`` float16 [groups, out]; the other tensors in
    ``dtype`` (float16, AutoAWQ's)."""
    model, tok = tiny_float_model(arch, seed, dtype)
    names = quantized_linear_names(model)
    tensors = _unquantized_tensors(model, names, dtype)
    for name in names:
        w = model.get_submodule(name).weight.detach().float()
        codes, scales, zeros = awq_quantize(w, group_size=group_size)
        qweight, qzeros = awq_pack(codes, scales, zeros, group_size=group_size)
        tensors.update({f"{name}.qweight": qweight, f"{name}.qzeros": qzeros, f"{name}.scales": scales.half()})
    qc = {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4, "version": "gemm",
          "modules_to_not_convert": None}
    out_dir = _write_checkpoint(out_dir, model, tok, tensors, qc)
    return out_dir, dequantize_checkpoint(out_dir)


# ------------------------------------------------------------------------------------------
# Reading a checkpoint back: the float weights it represents
# ------------------------------------------------------------------------------------------
def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, as stored."""
    tensors = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def _prefixes(tensors: dict, suffix: str) -> list[str]:
    return [k[: -len(suffix)] for k in tensors if k.endswith(suffix)]


def _decode_ct(tensors: dict, qc: dict) -> tuple[dict, set]:
    """compressed-tensors ``float-quantized`` / ``pack-quantized`` (one config group)."""
    groups = list(qc["config_groups"].values())
    if len(groups) != 1:
        raise NotImplementedError("one config group only")
    args = groups[0]["weights"]
    bits, strategy = args["num_bits"], args["strategy"]
    out, used = {}, set()

    def expand(scale: torch.Tensor, shape) -> torch.Tensor:
        scale = scale.float()
        if strategy == "tensor":
            return scale.reshape(()).expand(shape)
        if strategy == "channel":
            return scale.reshape(-1, 1).expand(shape)
        if strategy == "group":
            return scale.repeat_interleave(args["group_size"], 1)[:, : shape[1]]
        if strategy == "block":
            bo, bi = args["block_structure"]
            return scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[: shape[0], : shape[1]]
        raise NotImplementedError(strategy)

    for p in _prefixes(tensors, ".weight_packed"):
        shape = tuple(tensors[f"{p}.weight_shape"].tolist())
        offset = 2 ** (bits - 1)                                    # stored as value + offset
        codes = _unpack_cols(tensors[f"{p}.weight_packed"], bits)[:, : shape[1]] - offset
        scale = expand(tensors[f"{p}.weight_scale"], shape)
        zp = tensors.get(f"{p}.weight_zero_point")
        if zp is not None:                                          # packed along the output dim
            zp = _unpack_cols(zp.T.contiguous(), bits)[:, : shape[0]].T - offset
            zp = expand(zp.float(), shape)
        out[f"{p}.weight"] = (codes.float() - (zp if zp is not None else 0.0)) * scale
        used |= {f"{p}.weight_packed", f"{p}.weight_shape", f"{p}.weight_scale", f"{p}.weight_zero_point"}
    for p in _prefixes(tensors, ".weight_scale"):
        w = tensors.get(f"{p}.weight")
        if w is None or w.dtype != torch.float8_e4m3fn:
            continue
        out[f"{p}.weight"] = w.float() * expand(tensors[f"{p}.weight_scale"], w.shape)
        used |= {f"{p}.weight", f"{p}.weight_scale", f"{p}.input_scale"}
    return out, used


def _decode_fp8_block(tensors: dict, qc: dict) -> tuple[dict, set]:
    bo, bi = qc["weight_block_size"]
    out, used = {}, set()
    for p in _prefixes(tensors, ".weight_scale_inv"):
        w, inv = tensors[f"{p}.weight"], tensors[f"{p}.weight_scale_inv"].float()
        scale = inv.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[: w.shape[0], : w.shape[1]]
        out[f"{p}.weight"] = w.float() * scale
        used |= {f"{p}.weight", f"{p}.weight_scale_inv", f"{p}.activation_scale"}
    return out, used


def _decode_gptq(tensors: dict, qc: dict) -> tuple[dict, set]:
    bits = qc["bits"]
    v1 = qc.get("checkpoint_format", "gptq") == "gptq"
    out, used = {}, set()
    for p in _prefixes(tensors, ".qweight"):
        qzeros = tensors[f"{p}.qzeros"]
        if v1:                                     # GPTQModel's convert_gptq_v1_to_v2_format_module
            qzeros = _as_int32(_as_uint32(qzeros) + _zero_offsets(bits))
        scales = tensors[f"{p}.scales"].float()
        codes = _unpack_rows(tensors[f"{p}.qweight"], bits).T
        zeros = _unpack_cols(qzeros, bits)[:, : scales.shape[1]]
        out[f"{p}.weight"] = dequantize_gptq_codes(codes, scales, zeros, tensors[f"{p}.g_idx"])
        used |= {f"{p}.qweight", f"{p}.qzeros", f"{p}.scales", f"{p}.g_idx"}
    return out, used


def _decode_awq(tensors: dict, qc: dict) -> tuple[dict, set]:
    bits, group_size = qc["bits"], qc["group_size"]
    out, used = {}, set()
    for p in _prefixes(tensors, ".qweight"):
        codes = _unpack_cols(tensors[f"{p}.qweight"], bits, AWQ_ORDER).T
        zeros = _unpack_cols(tensors[f"{p}.qzeros"], bits, AWQ_ORDER)
        scales = tensors[f"{p}.scales"].float()
        out[f"{p}.weight"] = dequantize_awq_codes(codes, scales, zeros, group_size=group_size)
        used |= {f"{p}.qweight", f"{p}.qzeros", f"{p}.scales"}
    return out, used


_DECODERS: dict[str, Callable] = {"compressed-tensors": _decode_ct, "fp8": _decode_fp8_block,
                                  "gptq": _decode_gptq, "awq": _decode_awq}


def dequantize_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """The float32 state dict a checkpoint of one of these formats represents, in the unquantized
    model's names: each quantized Linear's ``weight`` decoded, every other tensor upcast. A reference
    decoder written from the formats' definitions (the tests check it against the tools' own)."""
    path = Path(path)
    qc = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    tensors = read_tensors(path)
    method = qc.get("quant_method")
    if method is None:
        return {k: v.float() for k, v in tensors.items()}
    decoded, used = _DECODERS[method](tensors, qc)
    decoded.update({k: v.float() for k, v in tensors.items() if k not in used and k not in decoded})
    return dict(sorted(decoded.items()))


def write_dequantized_checkpoint(quantized_dir: Path, state_dict: dict[str, torch.Tensor],
                                 out_dir: Optional[Path] = None, dtype: torch.dtype = torch.float32) -> Path:
    """Save ``state_dict`` (a builder's dequantized weights) as a plain float HF checkpoint beside
    ``quantized_dir`` (``<name>-dequantized`` unless ``out_dir``): the same config.json without
    ``quantization_config`` and with ``dtype`` set to the saved dtype (float32 by default, so that
    transformers runs exactly the weights the format represents), the same tokenizer and generation
    config."""
    quantized_dir = Path(quantized_dir)
    out_dir = Path(out_dir) if out_dir is not None else quantized_dir.with_name(quantized_dir.name + "-dequantized")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((quantized_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    dtype_name = str(dtype).removeprefix("torch.")
    cfg["dtype"] = dtype_name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype_name
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for file in quantized_dir.iterdir():
        if file.is_file() and file.name not in ("config.json", "quantize_config.json") \
                and not file.name.startswith("model.safetensors") and file.suffix != ".safetensors":
            shutil.copy2(file, out_dir / file.name)
    save_file({k: v.to(dtype).contiguous() for k, v in state_dict.items()}, str(out_dir / SAFETENSORS_FILE),
              metadata={"format": "pt"})
    return out_dir


# ------------------------------------------------------------------------------------------
# Named variants
# ------------------------------------------------------------------------------------------
FORMATS: dict[str, Callable[..., tuple[Path, dict]]] = {
    "ct-fp8-dynamic": build_ct_fp8_dynamic,
    "ct-fp8-static": build_ct_fp8_static,
    "ct-w4a16": build_ct_w4a16,
    "ct-w4a16-asym": functools.partial(build_ct_w4a16, symmetric=False),
    "ct-w4a16-channel": functools.partial(build_ct_w4a16, group_size=None),
    "ct-w4a16-channel-asym": functools.partial(build_ct_w4a16, group_size=None, symmetric=False),
    "fp8-block": build_fp8_block,
    "fp8-block-f32-scales": functools.partial(build_fp8_block, scale_dtype=torch.float32),
    "gptq-g128-sym": build_gptq,
    "gptq-g128-asym-actorder": functools.partial(build_gptq, sym=False, desc_act=True),
    "gptq-g128-sym-actorder": functools.partial(build_gptq, desc_act=True),
    "gptq-channel-sym": functools.partial(build_gptq, group_size=-1),
    "gptq-channel-asym-actorder": functools.partial(build_gptq, group_size=-1, sym=False, desc_act=True),
    "gptq-8bit-g128-asym": functools.partial(build_gptq, bits=8, sym=False),
    "awq-g128": build_awq,
}
"""Every variant by name: ``FORMATS[name](out_dir, **kwargs) -> (directory, dequantized)``."""

NEEDS_COMPRESSED_TENSORS = frozenset(name for name in FORMATS if name.startswith("ct-"))
"""The variants that need ``compressed-tensors`` installed (the others need only torch/transformers)."""


def build(name: str, out_dir: Path, **kwargs) -> tuple[Path, dict]:
    """``FORMATS[name](out_dir, **kwargs)``."""
    return FORMATS[name](out_dir, **kwargs)


def source_state_dict(name: str, **kwargs) -> dict[str, torch.Tensor]:
    """The float32 state dict of the float model that ``FORMATS[name](out_dir, **kwargs)`` quantizes
    (the builder's ``arch``, ``seed`` and ``dtype``, defaults included)."""
    params = inspect.signature(FORMATS[name]).parameters
    arch, seed, dtype = (kwargs.get(k, params[k].default) for k in ("arch", "seed", "dtype"))
    model, _ = tiny_float_model(arch, seed, dtype)
    return {k: v.detach().float() for k, v in model.state_dict().items()}
