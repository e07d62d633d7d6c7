"""Whisper and Qwen2-Audio on ``--quantization fp8`` (tiny random checkpoints, float32, CPU: FP8 weights run
dequantized): every intended projection is an ``Fp8Weight`` (Whisper: both stacks; Qwen2-Audio: the language
model, its audio tower and projector float), and greedy tokens and logprobs equal the same float model whose
weights of exactly those projections are replaced by their FP8-dequantized values (vLLM's top-5 rule, 1e-3);
what Whisper cannot take stops start-up with one line naming the setting and what it supports."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.fp8 import Fp8Weight
from engine.layers.linear import Linear
from tests.audio.conftest import audio_clips, qwen2_audio_dir, tiny_random_whisper_dir  # noqa: F401
from tests.models.utils import check_logprobs_close, ours_as_ref

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)


def _whisper_projections(config) -> set[str]:
    """Module names of every projection ``--quantization fp8`` quantizes in our Whisper."""
    names = set()
    for i in range(config.decoder_layers):
        layer = f"model.decoder.layers.{i}"
        names |= {f"{layer}.self_attn.qkv_proj", f"{layer}.self_attn.out_proj", f"{layer}.encoder_attn.q_proj",
                  f"{layer}.encoder_attn.kv_proj", f"{layer}.encoder_attn.out_proj", f"{layer}.fc1", f"{layer}.fc2"}
    for i in range(config.encoder_layers):
        layer = f"model.encoder.layers.{i}"
        names |= {f"{layer}.self_attn.qkv", f"{layer}.self_attn.out_proj", f"{layer}.fc1", f"{layer}.fc2"}
    return names


@torch.no_grad()
def _dequantize_in_place(model: torch.nn.Module, names: set[str]) -> None:
    """The FP8 round trip of ``names``' weights, kept as float weights."""
    modules = dict(model.named_modules())
    for name in names:
        weight = modules[name].weight
        weight.copy_(Fp8Weight.from_float(weight, weight.dtype).dequantize(weight.dtype))


def _transcribe(llm: LLM, clips, lora_request=None) -> list:
    """Greedy decoder runs (English, no timestamps) over ``clips``, each with ``lora_request``."""
    ids = llm.llm_engine.processor.transcriber.ids
    prompts = [{"prompt_token_ids": [ids.sot, ids.no_timestamps], "multi_modal_data": {"audio": (clip, 16000)}}
               for clip in clips]
    return llm.generate(prompts, PARAMS, lora_request=lora_request, use_tqdm=False)


def test_whisper_fp8_equals_its_dequantized_weights(tiny_random_whisper_dir, audio_clips):  # noqa: F811
    kw = dict(model=str(tiny_random_whisper_dir), device="cpu", dtype="float32", max_num_seqs=4)
    llm = LLM(quantization="fp8", **kw)
    model = llm.llm_engine.core.runner.model
    intended = _whisper_projections(model.config)
    fp8 = {name for name, m in model.named_modules() if isinstance(m, Linear) and isinstance(m.weight_q, Fp8Weight)}
    assert fp8 == intended
    assert isinstance(model.model.encoder.conv1.weight, torch.nn.Parameter)   # the conv stem stays float
    outs = _transcribe(llm, audio_clips)

    ref_llm = LLM(**kw)   # dequantized before any request: the encoder cache holds no float encoder output
    ref_model = ref_llm.llm_engine.core.runner.model
    before = {name: m.weight.clone() for name, m in ref_model.named_modules() if name in intended}
    _dequantize_in_place(ref_model, intended)
    assert all(not torch.equal(before[name], m.weight) for name, m in ref_model.named_modules() if name in intended)
    refs = _transcribe(ref_llm, audio_clips)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert check_logprobs_close(ours_as_ref(ref.outputs[0]), ours_as_ref(out.outputs[0]), f"clip {i}") == 8


def test_whisper_fp8_with_lora(tiny_random_whisper_dir, audio_clips, tmp_path):  # noqa: F811
    """An adapter on both stacks (cross K/V included) runs over the FP8 projections as over their dequantized
    float weights."""
    from lora.request import LoRARequest
    from tests.lora.test_whisper_lora import TARGETS, _adapter
    adapter, _ = _adapter(tiny_random_whisper_dir, tmp_path / "both", TARGETS, seed=2)
    request = LoRARequest("both", 1, str(adapter))
    kw = dict(model=str(tiny_random_whisper_dir), device="cpu", dtype="float32", max_num_seqs=4, enable_lora=True,
              max_loras=1, max_lora_rank=8)
    llm = LLM(quantization="fp8", **kw)
    ref = LLM(**kw)
    _dequantize_in_place(ref.llm_engine.core.runner.model, _whisper_projections(ref.llm_engine.core.runner.model.config))
    for i, (out, want) in enumerate(zip(_transcribe(llm, audio_clips, request), _transcribe(ref, audio_clips, request))):
        assert check_logprobs_close(ours_as_ref(want.outputs[0]), ours_as_ref(out.outputs[0]), f"clip {i}") == 8


def test_qwen2_audio_fp8_language_model(qwen2_audio_dir, audio_clips):  # noqa: F811
    from tests.audio.qwen2_audio_reference import MAX_MODEL_LEN
    messages = [{"role": "user", "content": [{"type": "audio", "audio": (audio_clips[0], 16000)},
                                             {"type": "text", "text": "What is said?"}]}]
    kw = dict(model=str(qwen2_audio_dir), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    llm = LLM(quantization="fp8", **kw)
    model = llm.llm_engine.core.runner.model
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    lm = {name for name in linears if name.startswith("language_model.")}
    assert lm and all(isinstance(linears[n].weight_q, Fp8Weight) for n in lm)
    assert all(linears[n].weight_q is None for n in set(linears) - lm)   # the audio tower stays float
    assert isinstance(model.multi_modal_projector.linear.weight, torch.nn.Parameter)
    out = llm.chat(messages, PARAMS, use_tqdm=False)[0].outputs[0]

    ref = LLM(**kw)
    _dequantize_in_place(ref.llm_engine.core.runner.model, lm)
    expect = ref.chat(messages, PARAMS, use_tqdm=False)[0].outputs[0]
    assert check_logprobs_close(ours_as_ref(expect), ours_as_ref(out), "chat") == PARAMS.max_tokens


@pytest.mark.parametrize("flag", ["int8", "int4", "fp16"])
def test_whisper_refuses_weight_only_quantization(tiny_random_whisper_dir, flag):  # noqa: F811
    with pytest.raises(ValueError, match=rf"^--quantization {flag} supports .* not WhisperForConditionalGeneration; "
                                         r"use --quantization fp8 or leave --quantization unset\.$"):
        LLM(model=str(tiny_random_whisper_dir), device="cpu", dtype="float32", quantization=flag)


@pytest.mark.parametrize("quantization_config", [
    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
     "checkpoint_format": "gptq"}], ids=["fp8", "gptq"])
def test_whisper_refuses_a_quantized_checkpoint(tiny_random_whisper_dir, tmp_path, quantization_config):  # noqa: F811
    path = tmp_path / "whisper-quantized"
    shutil.copytree(tiny_random_whisper_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    with pytest.raises(ValueError, match=r"^WhisperForConditionalGeneration cannot load a quantized \(\w+\) "
                                         r"checkpoint; serve a float checkpoint of it \(--quantization fp8"):
        LLM(model=str(path), device="cpu", dtype="float32")



def test_fp8_weight_takes_encoder_rows_on_the_gemm_path():
    """``Fp8Weight.linear`` on its FP8 GEMM path (``kernels.fp8_linear``, interpreted on CPU) takes the
    encoder's [B, S, in] rows: [B, S, out], the values of the flat [B * S, in] rows."""
    from kernels.fp8_linear import PER_TOKEN, fp8_linear_ref, quantize_weight_fp8_per_channel
    g = torch.Generator().manual_seed(0)
    w_fp8, scale = quantize_weight_fp8_per_channel(torch.randn(72, 96, generator=g) / 10)   # [72, 96], [72]
    weight = Fp8Weight(w_fp8, scale, None, None, torch.float32)
    weight.weight, weight.cuda = w_fp8, True          # the CUDA path's state, run by the interpreter
    x = torch.randn(2, 5, 96, generator=g)             # [B, S, in]
    bias = torch.randn(72, generator=g)
    out = weight.linear(x, bias)
    assert out.shape == (2, 5, 72)
    torch.testing.assert_close(out, weight.linear(x.reshape(10, 96), bias).view(2, 5, 72), rtol=0, atol=0)
    ref = fp8_linear_ref(x.reshape(10, 96), w_fp8, scale, activation_scheme=PER_TOKEN, bias=bias)
    torch.testing.assert_close(out.reshape(10, 72), ref, rtol=1e-4, atol=1e-4)
