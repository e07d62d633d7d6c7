"""Real-format quantized checkpoints (tests/quantization/formats.py) served end to end, against transformers
(float32) on the same weights dequantized (``formats.write_dequantized_checkpoint``).

For every variant the scheme reader accepts (all but 8-bit GPTQ, which must stop start-up with one line):

* greedy tokens and top-5 logprobs against transformers, vLLM's rule (tokens equal, or where they part
  each side's token is in the other's top-5; logprobs before that within a tolerance per path);
* every projection is the format's weight object (``W4A16Weight`` / ``Fp8Weight``, no float ``weight``),
  dequantizes to the checkpoint's weights exactly (packed q/k/v and gate/up: the slices stacked), and its
  ``linear`` computes with them;
* ``--quantization none`` loads exactly those weights as float weights: transformers' tokens, and
  logprobs within 1e-4.

Then PEFT adapters on a GPTQ act-order base and on a compressed-tensors FP8 base against transformers +
PEFT on the dequantized checkpoint, GPTQ v1 zero points of 0, and the start-up errors.

Tolerances (CPU, float32 model), measured on these prompts:

* FP8 (``EXACT_ATOL`` = 1e-4): the CPU path runs the dequantized weight in float32 (``engine.layers.fp8``),
  the reference's weights: only the summation order differs. Measured max |logprob difference| 4.7e-5
  (also with an adapter), the same as ``--quantization none``'s; 1e-4 is the float32 parity bound of the
  other tests.
* 4-bit: GPTQ, AWQ and compressed-tensors pack-quantized run torch's packed int4 kernel on CPU
  (``_weight_int4pack_mm_for_cpu``), which rounds the activations, each group's scale and zero value and
  the output to bfloat16 (bit for bit that emulation here): 2.6e-3 to 7.2e-3 error per projection,
  relative to its largest output (bound ``INT4_LINEAR_RTOL`` = 2e-2). Through two layers of the tiny
  random model that is up to 0.35 in a logprob before greedy paths part (gptq-channel-asym-actorder;
  0.47 seen on other prompts over 12 tokens): ``INT4_ATOL`` = 1.0 keeps a 2x margin across CPUs, whose
  int4 kernels may sum in another order. The 4-bit weights themselves are checked exactly (dequantized),
  and so is the adapter math on a 4-bit base (its base GEMM on the dequantized float32 weight).
"""

from __future__ import annotations

import functools
import gc
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.fp8 import Fp8Weight
from engine.layers.linear import Linear
from engine.layers.w4a16 import W4A16Weight
from lora import LoRARequest
from tests.lora.utils import ALL_TARGETS, build_peft_adapter, peft_greedy, peft_reference_model
from tests.models.utils import RefOutput, check_logprobs_close, hf_greedy, ours_as_ref
from tests.quantization import formats as F

UNSUPPORTED = {"gptq-8bit-g128-asym": "quantization_config.bits=8 is not supported"}
"""Variants that must stop start-up, with the one-line error's text."""
SERVED = [name for name in F.FORMATS if name not in UNSUPPORTED]
FP8_VARIANTS = frozenset(name for name in SERVED if name.startswith(("ct-fp8", "fp8-block")))

PROMPTS = ["The quick brown fox", "Paged attention keeps the KV cache in fixed-size blocks.",
           "def add(a, b):"]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
"""As ``hf_greedy``: EOS ignored."""
LLM_ARGS = dict(device="cpu", dtype="float32", max_model_len=128)

EXACT_ATOL = 1e-4
"""FP8 on CPU and ``--quantization none``: the reference's weights in float32 (module docstring)."""
INT4_ATOL = 1.0
"""4-bit on CPU: bfloat16 activations, scales, zero values and outputs (module docstring: measured 0.35)."""
INT4_LINEAR_RTOL = 2e-2
"""One 4-bit projection's output against float32 with its exact weights, relative to the output's largest
magnitude (module docstring: measured 2.6e-3 to 7.2e-3; a wrong input order or group is O(1))."""


def atol_of(name: str) -> float:
    return EXACT_ATOL if name in FP8_VARIANTS else INT4_ATOL


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny tensors: a second intra-op thread only adds synchronization (see test_formats.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------
# Checkpoints and references, each built once per module
# ------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Checkpoint:
    name: str
    path: Path
    """The quantized checkpoint."""
    dequantized: dict[str, torch.Tensor]
    """The float32 weights it represents, in HF names."""
    reference_path: Path
    """Those weights as a float32 checkpoint (transformers' reference)."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``checkpoints(name) -> Checkpoint``."""
    @functools.cache
    def get(name: str) -> Checkpoint:
        if name in F.NEEDS_COMPRESSED_TENSORS:
            pytest.importorskip("compressed_tensors")
        path, dequantized = F.build(name, tmp_path_factory.mktemp(name))
        return Checkpoint(name, path, dequantized, F.write_dequantized_checkpoint(path, dequantized))
    return get


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    """The prompts in the checkpoints' tokenizer (tests/conftest.py's, which every builder saves)."""
    from tests.conftest import build_tokenizer

    tok = build_tokenizer()
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def references(prompt_ids):
    """``references(checkpoint) -> [RefOutput]``: transformers' greedy run of the dequantized weights."""
    from transformers import AutoModelForCausalLM

    @functools.cache
    def get(ckpt: Checkpoint) -> list[RefOutput]:
        model = AutoModelForCausalLM.from_pretrained(ckpt.reference_path, dtype=torch.float32).eval()
        return [hf_greedy(model, ids, MAX_TOKENS) for ids in prompt_ids]
    return get


@pytest.fixture(scope="module", params=SERVED)
def variant(request, checkpoints) -> Checkpoint:
    """One variant at a time (module-scoped and parametrized: pytest runs each variant's tests together)."""
    return checkpoints(request.param)


@pytest.fixture(scope="module")
def quantized_llm(variant):
    llm = LLM(model=str(variant.path), **LLM_ARGS)
    yield llm
    llm.close()
    gc.collect()


def projections(llm: LLM) -> dict[str, Linear]:
    model = llm.llm_engine.core.runner.model
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def expected_weights(dequantized: dict[str, torch.Tensor], num_layers: int = 2) -> dict[str, torch.Tensor]:
    """Each of our projections' [out, in] weight from the checkpoint's per-slice ones (q/k/v and gate/up
    stacked along the outputs)."""
    out = {}
    for i in range(num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        out[f"{attn}.qkv_proj"] = torch.cat([dequantized[f"{attn}.{p}_proj.weight"] for p in "qkv"])
        out[f"{attn}.o_proj"] = dequantized[f"{attn}.o_proj.weight"]
        out[f"{mlp}.gate_up_proj"] = torch.cat([dequantized[f"{mlp}.{p}_proj.weight"]
                                                for p in ("gate", "up")])
        out[f"{mlp}.down_proj"] = dequantized[f"{mlp}.down_proj.weight"]
    return out


# ------------------------------------------------------------------------------------------
# Every served variant
# ------------------------------------------------------------------------------------------
def test_greedy_matches_transformers_on_the_dequantized_weights(variant, quantized_llm, references,
                                                                prompt_ids):
    outs = quantized_llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    for prompt, ref, out in zip(PROMPTS, references(variant), outs):
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), f"{variant.name} {prompt!r}",
                             atol=atol_of(variant.name))


def test_projections_hold_the_checkpoint_weights(variant, quantized_llm):
    weight_class = Fp8Weight if variant.name in FP8_VARIANTS else W4A16Weight
    linears = projections(quantized_llm)
    expected = expected_weights(variant.dequantized)
    assert set(linears) == set(expected)
    torch.manual_seed(0)
    for name, linear in linears.items():
        w = expected[name]
        assert isinstance(linear.weight_q, weight_class) and linear.weight is None, name
        assert torch.equal(linear.weight_q.dequantize(torch.float32), w), name
        x = torch.randn(3, w.shape[1])
        y = linear.weight_q.linear(x)
        if weight_class is Fp8Weight:                      # CPU: the dequantized weight in float32
            assert torch.equal(y, torch.nn.functional.linear(x, w)), name
        else:                                              # the int4 kernel, bfloat16 (module docstring)
            exact = x @ w.T
            err = ((y - exact).abs().max() / exact.abs().max()).item()
            assert err < INT4_LINEAR_RTOL, f"{name}: relative error {err:.3g}"
    if "actorder" in variant.name and "channel" not in variant.name:
        assert all(m.weight_q.input_order is not None for m in linears.values())   # act order exercised


def test_quantization_none_runs_the_dequantized_weights_exactly(variant, references, prompt_ids):
    llm = LLM(model=str(variant.path), quantization="none", **LLM_ARGS)
    try:
        expected = expected_weights(variant.dequantized)
        for name, linear in projections(llm).items():
            assert linear.weight_q is None and torch.equal(linear.weight, expected[name]), name
        outs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    finally:
        llm.close()
    for prompt, ref, out in zip(PROMPTS, references(variant), outs):
        ours = ours_as_ref(out.outputs[0])
        assert ours.token_ids == ref.token_ids, f"{variant.name} {prompt!r}"
        check_logprobs_close(ref, ours, f"{variant.name} --quantization none {prompt!r}", atol=EXACT_ATOL)


# ------------------------------------------------------------------------------------------
# Adapters on a quantized base
# ------------------------------------------------------------------------------------------
def _adapter_and_base_outputs(path: Path, prompt_ids: list[list[int]], lora: LoRARequest) -> list[RefOutput]:
    """One batch: every prompt under the adapter, then every prompt on the base."""
    llm = LLM(model=str(path), enable_lora=True, max_loras=2, max_lora_rank=8, **LLM_ARGS)
    try:
        assert all(m.weight is None and m.weight_q is not None for m in projections(llm).values())
        n = len(prompt_ids)
        outs = llm.generate(prompt_ids * 2, GREEDY, lora_request=[lora] * n + [None] * n, use_tqdm=False)
    finally:
        llm.close()
    return [ours_as_ref(out.outputs[0]) for out in outs]


def _exact_w4a16_linear(self, x, bias=None):
    """``W4A16Weight.linear`` with its dequantized weight in float32 (the CPU kernel's bfloat16 aside)."""
    return torch.nn.functional.linear(x, self.dequantize(x.dtype), bias)


@pytest.mark.parametrize("name", ["gptq-g128-asym-actorder", "ct-fp8-dynamic"])
def test_adapters_on_a_quantized_base_match_peft_on_its_weights(checkpoints, prompt_ids, name, tmp_path,
                                                                monkeypatch):
    """A batch of the adapter's requests and the base's against transformers + PEFT on the dequantized
    checkpoint (the adapter trained on those float weights, as users train on the float model).

    FP8: the CPU base is the dequantized weight, so tokens are equal and logprobs within 1e-4. 4-bit: the
    int4 kernel's bfloat16 arithmetic lets greedy paths part at near-ties (vLLM's rule, ``INT4_ATOL``;
    measured: the adapter's paths part after 2 and 4 tokens, max difference 0.24); the same engine with
    the base GEMM run on its dequantized weight in float32 (everything else -- the adapter's shrink and
    expand beside the quantized base, act order's input permutation -- unchanged) then gives PEFT's
    tokens exactly and logprobs within 1e-4."""
    ckpt = checkpoints(name)
    adapter = build_peft_adapter(ckpt.reference_path, tmp_path / "a", r=8, lora_alpha=16,
                                 target_modules=ALL_TARGETS, seed=3)
    pm = peft_reference_model(ckpt.reference_path, {"a": adapter})
    n = len(prompt_ids)
    refs = [peft_greedy(pm, which, ids, MAX_TOKENS) for which in ("a", None) for ids in prompt_ids]
    lora = LoRARequest("a", 1, str(adapter))
    exact = name in FP8_VARIANTS
    runs = [("", _adapter_and_base_outputs(ckpt.path, prompt_ids, lora), atol_of(name), exact)]
    if not exact:
        monkeypatch.setattr(W4A16Weight, "linear", _exact_w4a16_linear)
        runs.append((" (base GEMM in float32)", _adapter_and_base_outputs(ckpt.path, prompt_ids, lora),
                     EXACT_ATOL, True))
    for label, outputs, atol, same_tokens in runs:
        for i, (ref, ours) in enumerate(zip(refs, outputs)):
            what = f"{name}{label} adapter={'a' if i < n else None} {PROMPTS[i % n]!r}"
            if same_tokens:
                assert ours.token_ids == ref.token_ids, what
            check_logprobs_close(ref, ours, what, atol=atol)


# ------------------------------------------------------------------------------------------
# GPTQ v1 zero points
# ------------------------------------------------------------------------------------------
def test_gptq_v1_zero_points_of_zero_are_read_as_gptqmodel_writes_them():
    """A v1 checkpoint stores each packed qzeros word minus 0x11111111 (zero - 1 per nibble), so a zero
    point of 0 borrows from the nibble above: the loader must add the word back, not 1 per nibble. (The
    fixtures keep zero points in 1..15, as real per-nibble readers need; asymmetric GPTQ can produce 0.)"""
    from engine.quantization.scheme import W4A16, CheckpointQuantization
    from engine.quantization.slices import to_slice

    out_f, in_f, gs = 64, 256, 128
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen)
    scales = (torch.rand(in_f // gs, out_f, generator=gen) * 0.01 + 1e-3).half().float()
    zeros = torch.randint(1, 16, (in_f // gs, out_f), generator=gen)
    zeros[0, [3, 8, 15]] = 0                      # a middle, the lowest and the top nibble of a word
    zeros[1, [7, 20]] = 0
    g_idx = torch.randperm(in_f, generator=gen).to(torch.int32) // gs
    qweight, qzeros = F.gptq_pack(codes, scales, zeros, g_idx, bits=4)
    scheme = CheckpointQuantization(W4A16, "gptq", group_size=gs, symmetric=False, act_order=True)
    piece = to_slice("proj", {"qweight": qweight, "qzeros": qzeros, "scales": scales.half(), "g_idx": g_idx},
                     scheme)
    assert torch.equal(piece.zeros, zeros.T.float())
    assert torch.equal(piece.dequantize(), F.dequantize_gptq_codes(codes, scales, zeros, g_idx))


# ------------------------------------------------------------------------------------------
# Start-up errors
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_variant_stops_start_up_with_one_line(checkpoints, name):
    with pytest.raises(ValueError, match=UNSUPPORTED[name]) as e:
        LLM(model=str(checkpoints(name).path), **LLM_ARGS)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flag", ["int8", "int4", "fp8"])
def test_quantizing_an_already_quantized_checkpoint_is_refused(checkpoints, flag):
    with pytest.raises(ValueError, match="already quantized") as e:
        LLM(model=str(checkpoints("gptq-g128-sym").path), quantization=flag, **LLM_ARGS)
    assert f"--quantization {flag}" in str(e.value)
