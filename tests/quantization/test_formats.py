"""Tests of the quantized-checkpoint fixtures (tests/quantization/formats.py).

For every variant: the directory holds the format's config (``quantization_config``), tensor names,
dtypes and shapes, and a tokenizer; its dequantized weights are within the format's quantization
error of the float weights they came from, and the unquantized tensors are those weights exactly.
Then our decoding against the tools' own:

* compressed-tensors: its decompressors, and transformers' loader (``run_compressed=False``), in process;
* block FP8: transformers' loader (which dequantizes on a machine without an FP8 GPU);
* GPTQ and AWQ: GPTQModel's packer (``pack_block`` + its v2 -> v1 conversion) and dequantizer, AutoAWQ's
  ``WQLinear_GEMM.from_linear`` and ``dequantize_gemm``, and transformers' GPTQ/AWQ loaders (which go
  through GPTQModel's CPU kernels), in a subprocess, where the tools are installed -- in the venv or in
  ``CHORUS_QUANT_TOOLS`` (default ``.cache/quant-tools``; README: ``pip install --no-deps --target``).
  Not imported here: importing ``gptqmodel`` patches safetensors' ``save_file`` and triton's autotuner
  and sets environment variables for the whole process, and AutoAWQ's package does not import without
  ``datasets`` (the subprocess loads its modules past its ``__init__``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from tests.quantization import formats as F

REPO = Path(__file__).resolve().parents[2]
TOOLS_DIR = Path(os.environ.get("CHORUS_QUANT_TOOLS") or REPO / ".cache" / "quant-tools")
PROMPT_IDS = [[1, 17, 42, 99, 5, 250, 3, 77]]

CT_VARIANTS = sorted(F.NEEDS_COMPRESSED_TENSORS)
FP8_BLOCK_VARIANTS = [n for n in F.FORMATS if n.startswith("fp8-block")]
GPTQ_VARIANTS = [n for n in F.FORMATS if n.startswith("gptq")]
AWQ_VARIANTS = [n for n in F.FORMATS if n.startswith("awq")]
LOADER_VARIANTS = ("gptq-g128-asym-actorder", "gptq-g128-sym", "awq-g128")
"""Run through transformers' GPTQ/AWQ loaders too (GPTQModel's CPU int4 kernel takes groups of at most
256, so not the per-channel variants: down_proj's group would be 512)."""


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The tensors here are tiny: a second intra-op thread only adds synchronization, and on a busy
    machine (``-n 0`` with torch's default threads) its spin-waits multiply the module's time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(name) -> (directory, dequantized)``, each variant built once per module."""
    built = {}

    def get(name: str):
        if name in F.NEEDS_COMPRESSED_TENSORS:
            pytest.importorskip("compressed_tensors")
        if name not in built:
            built[name] = F.build(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# ------------------------------------------------------------------------------------------
# What each variant must hold
# ------------------------------------------------------------------------------------------
def expected_tensors(name: str, out_f: int, in_f: int) -> dict[str, tuple[torch.dtype, tuple]]:
    """A quantized Linear's tensors in variant ``name``: suffix -> (dtype, shape)."""
    i32, bf16, f16 = torch.int32, torch.bfloat16, torch.float16
    if name in ("ct-fp8-dynamic", "ct-fp8-static"):
        spec = {"weight": (torch.float8_e4m3fn, (out_f, in_f)),
                "weight_scale": (bf16, (out_f, 1) if name == "ct-fp8-dynamic" else (1,))}
        if name == "ct-fp8-static":
            spec["input_scale"] = (bf16, (1,))
        return spec
    if name.startswith("ct-w4a16"):
        groups = 1 if "channel" in name else in_f // 128
        spec = {"weight_packed": (i32, (out_f, in_f // 8)), "weight_scale": (bf16, (out_f, groups)),
                "weight_shape": (torch.int64, (2,))}
        if name.endswith("asym"):
            spec["weight_zero_point"] = (i32, (out_f // 8, groups))
        return spec
    if name.startswith("fp8-block"):
        return {"weight": (torch.float8_e4m3fn, (out_f, in_f)),
                "weight_scale_inv": (torch.float32 if name.endswith("f32-scales") else bf16,
                                     (out_f // 128, in_f // 128))}
    if name.startswith("gptq"):
        bits = 8 if "8bit" in name else 4
        groups = 1 if "channel" in name else in_f // 128
        return {"qweight": (i32, (in_f * bits // 32, out_f)), "qzeros": (i32, (groups, out_f * bits // 32)),
                "scales": (f16, (groups, out_f)), "g_idx": (i32, (in_f,))}
    if name.startswith("awq"):
        return {"qweight": (i32, (in_f, out_f // 8)), "qzeros": (i32, (in_f // 128, out_f // 8)),
                "scales": (f16, (in_f // 128, out_f))}
    raise KeyError(name)


def check_quantization_config(name: str, path: Path):
    qc = _config(path)["quantization_config"]
    if name.startswith("ct-"):
        assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
        assert qc["ignore"] == ["lm_head"]
        (group,) = qc["config_groups"].values()
        assert group["targets"] == ["Linear"]
        w, a = group["weights"], group["input_activations"]
        if name.startswith("ct-fp8"):
            assert qc["format"] == "float-quantized"
            assert (w["num_bits"], w["type"], w["symmetric"]) == (8, "float", True)
            if name == "ct-fp8-dynamic":
                assert w["strategy"] == "channel" and (a["strategy"], a["dynamic"], a["type"]) == ("token", True, "float")
            else:
                assert w["strategy"] == "tensor" and (a["strategy"], a["dynamic"], a["type"]) == ("tensor", False, "float")
        else:
            assert qc["format"] == "pack-quantized" and a is None
            assert (w["num_bits"], w["type"], w["symmetric"]) == (4, "int", not name.endswith("asym"))
            assert (w["strategy"], w["group_size"]) == (("channel", None) if "channel" in name else ("group", 128))
    elif name.startswith("fp8-block"):
        assert qc == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    elif name.startswith("gptq"):
        assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq" and qc["pack_dtype"] == "int32"
        assert qc["bits"] == (8 if "8bit" in name else 4)
        assert qc["group_size"] == (-1 if "channel" in name else 128)
        assert qc["sym"] == ("asym" not in name) and qc["desc_act"] == ("actorder" in name)
        assert json.loads((path / "quantize_config.json").read_text()) == qc
    elif name.startswith("awq"):
        assert qc == {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 128, "zero_point": True,
                      "modules_to_not_convert": None}


def element_steps(name: str, tensors: dict, prefix: str, out_f: int, in_f: int) -> torch.Tensor:
    """[out, in]: each weight's quantization step (the scale that multiplies its code)."""
    if name.startswith("fp8-block"):
        s = tensors[f"{prefix}.weight_scale_inv"].float()
        return s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    if name.startswith("ct-"):
        s = tensors[f"{prefix}.weight_scale"].float()
        if s.numel() == 1:
            return s.reshape(()).expand(out_f, in_f)
        return s.repeat_interleave(in_f // s.shape[1], 1)
    s = tensors[f"{prefix}.scales"].float()                                 # [groups, out] (GPTQ, AWQ)
    if name.startswith("gptq"):
        return s[tensors[f"{prefix}.g_idx"].long()].T
    return s.repeat_interleave(128, 0).T


# ------------------------------------------------------------------------------------------
# The fixtures themselves
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(F.FORMATS))
def test_checkpoint_holds_the_format(checkpoint, name):
    from transformers import AutoConfig, AutoTokenizer

    path, dequantized = checkpoint(name)
    check_quantization_config(name, path)
    assert AutoConfig.from_pretrained(path).model_type == "llama"
    assert AutoTokenizer.from_pretrained(path)("Hello world").input_ids
    tensors = F.read_tensors(path)
    source = F.source_state_dict(name)
    quantized = {k[: -len(".weight")] for k in source if k.endswith("_proj.weight")}
    assert len(quantized) == 14 and "lm_head" not in quantized
    for prefix in quantized:
        out_f, in_f = source[f"{prefix}.weight"].shape
        want = expected_tensors(name, out_f, in_f)
        have = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        assert {k: (v.dtype, tuple(v.shape)) for k, v in have.items()} == want, prefix
    # the rest is the float model's, in the checkpoint's dtype; the dequantized dict has its names
    rest = {k for k in tensors if k.rsplit(".", 1)[0] not in quantized}
    assert rest == {k for k in source if k.rsplit(".", 1)[0] not in quantized}
    assert set(dequantized) == set(source)
    assert all(v.dtype == torch.float32 for v in dequantized.values())


@pytest.mark.parametrize("name", list(F.FORMATS))
def test_dequantized_weights_within_quantization_error(checkpoint, name):
    path, dequantized = checkpoint(name)
    tensors = F.read_tensors(path)
    source = F.source_state_dict(name)
    for key, w in source.items():
        prefix = key[: -len(".weight")]
        deq = dequantized[key]
        if not key.endswith("_proj.weight"):
            assert torch.equal(deq, w), key                    # stored in the source dtype: exact
            continue
        err = (deq - w).abs()
        step = element_steps(name, tensors, prefix, *w.shape)
        if "fp8" in name:
            # e4m3: 3 mantissa bits (half an ulp <= |w| / 16), subnormals spaced 2**-9 * scale
            bound = w.abs() / 16 + step * 2.0 ** -9
        else:
            # round to nearest: half a step; where an end code clamps, the stored scale's rounding
            # (bf16: up to 2**-8 relative, times up to 15 steps) adds up to (|w| + step) * 2**-8
            bound = 0.5 * step + (w.abs() + step) * 2.0 ** -7
        assert (err <= bound + 1e-7).all(), (key, (err - bound).max().item())
        assert (deq - w).norm() / w.norm() < (0.04 if "fp8" in name else 0.01 if "8bit" in name else 0.15)


def test_gptq_act_order_g_idx(checkpoint):
    """desc_act: a nontrivial permutation of the group ids, shared by the Linears that share an input."""
    path, _ = checkpoint("gptq-g128-asym-actorder")
    t = F.read_tensors(path)
    g = t["model.layers.0.self_attn.q_proj.g_idx"]
    assert torch.equal(torch.bincount(g), torch.full((2,), 128))
    assert not torch.equal(g, torch.arange(256) // 128)
    assert torch.equal(g, t["model.layers.0.self_attn.k_proj.g_idx"])
    assert torch.equal(t["model.layers.0.mlp.gate_proj.g_idx"], t["model.layers.0.mlp.up_proj.g_idx"])
    assert not torch.equal(g, t["model.layers.0.self_attn.o_proj.g_idx"])
    path, _ = checkpoint("gptq-g128-sym")
    assert torch.equal(F.read_tensors(path)["model.layers.0.self_attn.q_proj.g_idx"], torch.arange(256) // 128)
    # symmetric v1: every stored zero is 8 - 1
    assert (F.read_tensors(path)["model.layers.0.self_attn.q_proj.qzeros"] == 0x77777777).all()


@pytest.mark.parametrize("name", ["ct-fp8-static", "fp8-block", "gptq-g128-asym-actorder", "awq-g128"])
def test_write_dequantized_checkpoint(checkpoint, name, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, dequantized = checkpoint(name)
    out = F.write_dequantized_checkpoint(path, dequantized, tmp_path / "deq")
    cfg = _config(out)
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    assert not (out / "quantize_config.json").exists()
    assert AutoTokenizer.from_pretrained(out)("Hello world").input_ids
    model = AutoModelForCausalLM.from_pretrained(out)
    state = model.state_dict()
    assert set(state) == set(dequantized)
    assert all(state[k].dtype == torch.float32 and torch.equal(state[k], v) for k, v in dequantized.items())
    assert F.write_dequantized_checkpoint(path, dequantized) == path.with_name(path.name + "-dequantized")


# ------------------------------------------------------------------------------------------
# Ours against the tools' own decoders and loaders, in process
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CT_VARIANTS)
def test_ct_matches_compressed_tensors_decompressor(checkpoint, name):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    path, dequantized = checkpoint(name)
    qc = _config(path)["quantization_config"]
    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    tensors = F.read_tensors(path)
    prefixes = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")}
    assert len(prefixes) == 14
    for prefix in prefixes:
        local = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        local["weight_scale"] = local["weight_scale"].float()      # float32 out: the exact products
        theirs = compressor.decompress(local, scheme)["weight"]
        assert theirs.dtype == torch.float32 and torch.equal(theirs, dequantized[f"{prefix}.weight"]), prefix


def _quantized_linears(model):
    return {n: m for n, m in model.named_modules() if n.endswith("_proj")}


@pytest.mark.parametrize("name", CT_VARIANTS + FP8_BLOCK_VARIANTS)
def test_transformers_loader_reads_our_weights(checkpoint, name, tmp_path):
    """transformers' own loader (decompressing / dequantizing on CPU) reads each Linear as we do, and
    runs the same logits as the dequantized float checkpoint. (Without ``run_compressed=False``,
    transformers 5.24 cannot load the asymmetric pack-quantized variant: it expects unpacked
    ``weight_zero_point`` shapes.)"""
    from transformers import AutoModelForCausalLM

    path, dequantized = checkpoint(name)
    kwargs = {}
    if name.startswith("ct-"):
        pytest.importorskip("compressed_tensors")
        from transformers import CompressedTensorsConfig

        kwargs["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    else:                                           # dequantize on an FP8 GPU too
        from transformers import FineGrainedFP8Config

        kwargs["quantization_config"] = FineGrainedFP8Config(weight_block_size=[128, 128], dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    linears = _quantized_linears(model)
    assert len(linears) == 14
    expected = dict(dequantized)
    if name.startswith("ct-"):
        # compressed-tensors decompresses in the scales' dtype (bf16): our products, rounded to it
        expected.update({f"{n}.weight": dequantized[f"{n}.weight"].to(torch.bfloat16).float() for n in linears})
    for n, m in linears.items():
        assert m.weight.dtype == torch.float32 and torch.equal(m.weight, expected[f"{n}.weight"]), n
    reference = AutoModelForCausalLM.from_pretrained(F.write_dequantized_checkpoint(path, expected, tmp_path / "d"))
    ids = torch.tensor(PROMPT_IDS)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


def test_fp8_block_f32_scales_are_transformers_quantize_op(checkpoint):
    """With float32 scales the stored FP8 weights and scales are exactly transformers' Fp8Quantize's."""
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    path, _ = checkpoint("fp8-block-f32-scales")
    op = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=[128, 128])).get_quantize_ops()
    tensors = F.read_tensors(path)
    source_model, _ = F.tiny_float_model()
    for n, m in _quantized_linears(source_model).items():
        ref = op.convert({f"{n}.weight": m.weight.detach()})
        assert torch.equal(ref[f"{n}.weight"].view(torch.uint8), tensors[f"{n}.weight"].view(torch.uint8))
        assert torch.equal(ref[f"{n}.weight_scale_inv"], tensors[f"{n}.weight_scale_inv"])


# ------------------------------------------------------------------------------------------
# GPTQModel and AutoAWQ, in a subprocess
# ------------------------------------------------------------------------------------------
def _tool_pythonpath(module: str) -> Optional[str]:
    """'' when ``module`` is importable here, TOOLS_DIR when it is installed there, else None."""
    if importlib.util.find_spec(module) is not None:
        return ""
    if (TOOLS_DIR / module).is_dir():
        return str(TOOLS_DIR)
    return None


def _run_oracle(tool: str, items: list[str], out: Path) -> dict:
    extra = _tool_pythonpath("gptqmodel" if tool == "gptqmodel" else "awq")
    if extra is None:
        pytest.skip(f"{tool} is not installed (README: pip install --no-deps --target {TOOLS_DIR} ...)")
    env = dict(os.environ, GPTQMODEL_DISABLE_PACK_EXT="1", TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, str(REPO), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-m", "tests.quantization.test_formats", tool, str(out), *items],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def gptqmodel_results(checkpoint, tmp_path_factory):
    """GPTQModel's view of every GPTQ and AWQ variant (one subprocess: importing it takes seconds)."""
    if _tool_pythonpath("gptqmodel") is None:
        pytest.skip(f"gptqmodel is not installed (README: pip install --no-deps --target {TOOLS_DIR} ...)")
    tmp = tmp_path_factory.mktemp("gptqmodel")
    items, loaded = [], LOADER_VARIANTS
    for name in GPTQ_VARIANTS + AWQ_VARIANTS:
        path, dequantized = checkpoint(name)
        deq = F.write_dequantized_checkpoint(path, dequantized, tmp / f"{name}-deq") if name in loaded else None
        items.append(f"{path}::{deq or ''}")
    results = _run_oracle("gptqmodel", items, tmp / "results.pt")
    return {name: results[str(checkpoint(name)[0])] for name in GPTQ_VARIANTS + AWQ_VARIANTS}


def _check_tool_view(view: dict, path: Path, dequantized: dict, stored: tuple[str, ...]):
    tensors = F.read_tensors(path)
    assert len(view["modules"]) == 14
    for prefix, theirs in view["modules"].items():
        assert torch.equal(theirs["weight"], dequantized[f"{prefix}.weight"]), f"{prefix}: their dequantization"
        for key in stored:
            assert torch.equal(theirs[key], tensors[f"{prefix}.{key}"]), f"{prefix}.{key}: their packing"


@pytest.mark.parametrize("name", GPTQ_VARIANTS)
def test_gptq_matches_gptqmodel(checkpoint, gptqmodel_results, name):
    """GPTQModel's dequantize_weight (after its v1 -> v2 load conversion) reads our weights; its
    pack_block (+ v2 -> v1 save conversion) writes our qweight / qzeros / scales."""
    path, dequantized = checkpoint(name)
    _check_tool_view(gptqmodel_results[name], path, dequantized, ("qweight", "qzeros", "scales"))


@pytest.mark.parametrize("name", AWQ_VARIANTS)
def test_awq_matches_gptqmodel(checkpoint, gptqmodel_results, name):
    path, dequantized = checkpoint(name)
    _check_tool_view(gptqmodel_results[name], path, dequantized, ("qweight", "qzeros", "scales"))


@pytest.mark.parametrize("name", AWQ_VARIANTS)
def test_awq_matches_autoawq(checkpoint, name, tmp_path):
    """AutoAWQ's own WQLinear_GEMM.from_linear writes our qweight / qzeros / scales, and its
    dequantize_gemm reads our weights."""
    path, dequantized = checkpoint(name)
    results = _run_oracle("autoawq", [f"{path}::"], tmp_path / "results.pt")
    _check_tool_view(results[str(path)], path, dequantized, ("qweight", "qzeros", "scales"))


@pytest.mark.parametrize("name", LOADER_VARIANTS)
def test_transformers_gptq_awq_loaders_run_our_checkpoints(gptqmodel_results, name):
    """transformers (through GPTQModel's CPU kernels, float16) runs the quantized checkpoint to the
    logits of the dequantized float32 checkpoint, within float16 compute error."""
    logits = gptqmodel_results[name].get("logits")
    if isinstance(logits, str):
        pytest.skip(logits)
    quantized, reference = logits
    assert torch.isfinite(quantized).all()
    err = (quantized.float() - reference).abs().max() / reference.abs().max()
    assert err < 2e-2, err


# ------------------------------------------------------------------------------------------
# The subprocess side: python -m tests.quantization.test_formats TOOL OUT QDIR::DEQDIR...
# ------------------------------------------------------------------------------------------
def _oracle_gptqmodel_gptq(tensors: dict, qc: dict) -> dict:
    from gptqmodel import QuantizeConfig
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module, convert_gptq_v2_to_v1_format_module

    bits, gs, sym, desc = qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]
    cfg = QuantizeConfig(bits=bits, group_size=gs, sym=sym, desc_act=desc, offload_to_disk=False)
    modules = {}
    for prefix in [k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")]:
        qweight, qzeros, scales, g_idx = (tensors[f"{prefix}.{n}"] for n in ("qweight", "qzeros", "scales", "g_idx"))
        kw = dict(bits=bits, group_size=gs, sym=sym, desc_act=desc, in_features=g_idx.numel(),
                  out_features=scales.shape[1], bias=False, pack_dtype=torch.int32)
        m = TorchLinear(**kw)
        m.qweight.copy_(qweight)
        m.qzeros.copy_(qzeros)
        m.g_idx.copy_(g_idx)
        m.scales = scales.float()                 # float32: their formula without float16 products
        convert_gptq_v1_to_v2_format_module(m, bits=bits, pack_dtype=torch.int32)   # their v1 load step
        weight = PackableQuantLinear.dequantize_weight(m).T.contiguous()            # [out, in]
        zeros = F._unpack_cols(m.qzeros, bits)[:, : scales.shape[1]]               # v2 zeros [groups, out]
        linear = torch.nn.Linear(kw["in_features"], kw["out_features"], bias=False)
        linear.weight.data = weight
        packer = TorchLinear(**kw)
        packer.pack_block(linear, scales.float().T.contiguous(), zeros.T.contiguous(), g_idx)
        convert_gptq_v2_to_v1_format_module(packer, cfg)                            # their v1 save step
        modules[prefix] = {"weight": weight, "qweight": packer.qweight.clone(), "qzeros": packer.qzeros.clone(),
                           "scales": packer.scales.clone()}
    return modules


def _oracle_awq(tool: str, tensors: dict, qc: dict) -> dict:
    if tool == "autoawq":
        import importlib.util as iu
        import types

        # awq/__init__.py imports its quantizer, which needs `datasets`: a bare package object on
        # the same path lets its modules load without it
        pkg = types.ModuleType("awq")
        pkg.__path__ = list(iu.find_spec("awq").submodule_search_locations)
        sys.modules["awq"] = pkg
        from awq.modules.linear.gemm import WQLinear_GEMM
        from awq.utils.packing_utils import dequantize_gemm, reverse_awq_order, unpack_awq
    else:
        from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
        from gptqmodel.quantization.awq.utils.packing_utils import (
            dequantize_gemm,
            reverse_awq_order,
            unpack_awq,
        )

    bits, gs = qc["bits"], qc["group_size"]
    modules = {}
    for prefix in [k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")]:
        qweight, qzeros, scales = (tensors[f"{prefix}.{n}"] for n in ("qweight", "qzeros", "scales"))
        weight = dequantize_gemm(qweight, qzeros, scales.float(), bits, gs).T.contiguous()   # [out, in]
        out_f, in_f = weight.shape
        try:
            _, izeros = unpack_awq(qweight, qzeros, bits)
        except TypeError:                                    # GPTQModel's takes the column count too
            _, izeros = unpack_awq(qweight, qzeros, bits, out_f)
        _, izeros = reverse_awq_order(torch.zeros(1, out_f, dtype=torch.int32), izeros, bits)
        izeros = torch.bitwise_and(izeros, 2 ** bits - 1).float()                         # [groups, out]
        linear = torch.nn.Linear(in_f, out_f, bias=False)
        linear.weight.data = weight
        if tool == "autoawq":
            packer = WQLinear_GEMM.from_linear(linear, bits, gs, scales=scales.float(), zeros=izeros)
        else:
            packer = AwqTorchLinear(bits=bits, group_size=gs, sym=False, desc_act=False, in_features=in_f,
                                    out_features=out_f)
            packer.pack(linear, scales.float().T.contiguous(), izeros.T.contiguous())
        modules[prefix] = {"weight": weight, "qweight": packer.qweight.clone(), "qzeros": packer.qzeros.clone(),
                           "scales": packer.scales.clone()}
    return modules


def _oracle_logits(quantized_dir: Path, dequantized_dir: Path):
    from transformers import AutoModelForCausalLM

    try:
        quantized = AutoModelForCausalLM.from_pretrained(quantized_dir, dtype=torch.float16)
    except ImportError as e:                                  # e.g. GPTQ without optimum
        return f"transformers cannot load it here: {e}"
    reference = AutoModelForCausalLM.from_pretrained(dequantized_dir, dtype=torch.float32)
    ids = torch.tensor(PROMPT_IDS)
    with torch.no_grad():
        return quantized(ids).logits.float(), reference(ids).logits


def _oracle_main(argv: list[str]) -> None:
    tool, out, items = argv[0], argv[1], argv[2:]
    results = {}
    for item in items:
        qdir, _, deqdir = item.partition("::")
        qc = _config(Path(qdir))["quantization_config"]
        tensors = F.read_tensors(Path(qdir))
        if qc["quant_method"] == "gptq":
            view = {"modules": _oracle_gptqmodel_gptq(tensors, qc)}
        else:
            view = {"modules": _oracle_awq(tool, tensors, qc)}
        if deqdir:
            view["logits"] = _oracle_logits(Path(qdir), Path(deqdir))
        results[qdir] = view
    torch.save(results, out)


if __name__ == "__main__":
    _oracle_main(sys.argv[1:])
