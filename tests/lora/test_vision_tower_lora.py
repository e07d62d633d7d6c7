"""LoRA on the vision tower and projector (``--enable-tower-connector-lora``) of tiny random LLaVA and
Qwen2-VL checkpoints, float32 on CPU, against PEFT's merged model: adapters on the tower's attention and
MLP projections, the projector (LLaVA's linear_1 / linear_2, Qwen2-VL's merger) and the language model;
an LM-only adapter beside them. One encoder call carries images of several adapters; the encoder-cache
key carries a tower adapter and not an LM-only one; without the flag a tower adapter is a 400."""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import pytest
import torch

from engine.llm import LLM
from lora.errors import InvalidLoRAAdapterError
from lora.peft_adapter import TOWER_LORA_FLAG, LoRATargets
from lora.request import LoRARequest
from tests.models.utils import check_logprobs_close, ours_as_ref
from tests.vision.conftest import build_tiny_llava, build_tiny_qwen2_vl, make_image
from tests.vision.test_llava_parity import hf_llava_greedy, params, save_llava_processor
from tests.vision.test_qwen2_vl_parity import hf_inputs
from tests.vision.utils import hf_generate_greedy

QWEN_IMG = "<|vision_start|><|image_pad|><|vision_end|>"
TOWER_TARGETS = {
    "llava": (r".*(vision_tower.*\.(q_proj|k_proj|v_proj|out_proj|fc1|fc2)"
              r"|multi_modal_projector\.(linear_1|linear_2)|language_model.*\.(q_proj|v_proj|down_proj))"),
    "qwen2_vl": (r".*(visual\.blocks.*\.(qkv|proj|fc1|fc2)|visual\.merger\.mlp\.(0|2)"
                 r"|language_model.*\.(q_proj|o_proj))"),
    "qwen2_5_vl": (r".*(visual\.blocks.*\.(qkv|proj|gate_proj|up_proj|down_proj)|visual\.merger\.mlp\.(0|2)"
                   r"|language_model.*\.(k_proj|up_proj))"),
}
LM_TARGETS = r".*language_model.*\.(q_proj|v_proj|o_proj|gate_proj|down_proj)"
NUM_TOKENS = 8
"""Greedy tokens per request (``params()``); ``check_logprobs_close`` returning it: every token equal."""


def _hf_class(family: str):
    from transformers import (LlavaForConditionalGeneration, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLForConditionalGeneration)
    return {"llava": LlavaForConditionalGeneration, "qwen2_vl": Qwen2VLForConditionalGeneration,
            "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}[family]


def _build_adapter(model_dir: Path, family: str, out_dir: Path, targets: str, seed: int) -> Path:
    """A PEFT adapter with random A and B (``init_lora_weights=False``), saved by ``save_pretrained``."""
    from peft import LoraConfig, get_peft_model

    base = _hf_class(family).from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=targets)
    get_peft_model(base, cfg).save_pretrained(out_dir)
    return out_dir


@functools.lru_cache(maxsize=8)
def _merged(model_dir: str, family: str, adapter_dir: str):
    """PEFT's merged model: the adapter folded into the checkpoint's weights (None: the checkpoint)."""
    from peft import PeftModel

    base = _hf_class(family).from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir == "":
        return base.eval()
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "qwen2_5_vl"])
def setup(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"tower-lora-{family}")
    if family == "llava":
        model_dir = build_tiny_llava(root / "model")
        save_llava_processor(model_dir)
    else:
        model_dir = build_tiny_qwen2_vl(root / "model", version="2.5" if family == "qwen2_5_vl" else "2")
    adapters = {"tower": _build_adapter(model_dir, family, root / "tower", TOWER_TARGETS[family], seed=5),
                "lm": _build_adapter(model_dir, family, root / "lm", LM_TARGETS, seed=6)}
    return family, model_dir, adapters


def _prompt(family: str) -> str:
    return "Look: <image> what is it?" if family == "llava" else f"Look: {QWEN_IMG} what is it?"


def _reference(family: str, model_dir: Path, adapter: str, image):
    model = _merged(str(model_dir), family, adapter)
    if family == "llava":
        return hf_llava_greedy(model_dir, _prompt(family), [image], model=model)
    return hf_generate_greedy(model, hf_inputs(model_dir, _prompt(family), [image]), 8)


def _llm(model_dir: Path, **kwargs) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=2,
               max_model_len=256, **kwargs)


def test_targets_split_tower_from_language_model(setup):
    """The tower's and projector's projections are encoder targets, the language model's not; without
    the flag the tower's are only recorded (refused), and none lands in the suffix mapping."""
    family, model_dir, _ = setup
    llm = _llm(model_dir, enable_tower_connector_lora=True)
    model = llm.llm_engine.runner.model
    on, off = LoRATargets.from_model(model, tower_lora=True), LoRATargets.from_model(model)
    tower = {name for name, t in on.slices.items() if t.in_encoder}
    assert tower and tower | on.unused_modules == off.tower_modules
    assert on.adapts_encoder and not off.adapts_encoder
    # LLaVA reads layer -2 of the 3-layer tower: the last layer is never built, an update there is skipped.
    unused_layers = {name.split(".layers.")[1].split(".")[0] for name in on.unused_modules}
    assert unused_layers == ({"2"} if family == "llava" else set())
    # transformers 4's names too (LLaVA's tower under vision_model., Qwen's under visual. at the top).
    legacy, ours = {"llava": ("vision_tower.vision_model.encoder.layers.0.self_attn.k_proj",
                              ("vision_tower.encoder.layers.0.self_attn.qkv", 1)),
                    "qwen2_vl": ("visual.blocks.1.attn.qkv", ("visual.blocks.1.attn.qkv", 0)),
                    "qwen2_5_vl": ("visual.blocks.1.mlp.up_proj",
                                   ("visual.blocks.1.mlp.gate_up_proj", 1))}[family]
    target = on.slices[legacy]
    assert (target.module_name, target.slice_idx) == ours and target.in_encoder
    assert not any(t.in_encoder for t in off.slices.values()) and set(off.slices) == set(on.slices) - tower
    enc_modules = {t.module_name for t in on.slices.values() if t.in_encoder}
    assert all(m.startswith(("vision_tower.", "multi_modal_projector.", "visual.")) for m in enc_modules)
    assert not any(m.startswith(("vision_tower.", "multi_modal_projector.", "visual."))
                   for m in {t.module_name for t in off.slices.values()})


def test_tower_and_lm_adapters_equal_peft_merged_in_one_batch(setup):
    """Base, LM-only and tower requests on the same image (and a tower request on a second image of
    another size) in one generate call: one encoder call holds images of two adapters and the base, each
    request equals PEFT's merged model, and equals the same request run alone."""
    family, model_dir, adapters = setup
    img, img2 = make_image(64, 48, 0), make_image(90, 90, 2)
    tower = LoRARequest("tower", 1, str(adapters["tower"]))
    lm = LoRARequest("lm", 2, str(adapters["lm"]))
    reqs = [(img, tower, "tower"), (img, lm, "lm"), (img, None, ""), (img2, tower, "tower")]
    prompts = [{"prompt": _prompt(family), "multi_modal_data": {"image": im}} for im, _, _ in reqs]

    llm = _llm(model_dir, enable_tower_connector_lora=True)
    outs = llm.generate(prompts, params(), lora_request=[lr for _, lr, _ in reqs], use_tqdm=False)
    # One step encodes img under the base (shared by the LM-only request), img and img2 under the tower
    # adapter.
    cache = llm.llm_engine.runner.encoder_cache
    assert llm.llm_engine.runner.num_encoded_items == 3 and len(cache) == 3
    (base_key,) = [key for key in cache if "+lora:" not in key]
    # The tower adapter changes the encoder output.
    assert not torch.allclose(cache[base_key], cache[f"{base_key}+lora:tower#1"], atol=1e-3)
    for (im, _, adapter), out in zip(reqs, outs):
        ref = _reference(family, model_dir, str(adapters[adapter]) if adapter else "", im)
        name = f"{family} adapter={adapter or 'base'}"
        assert check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name) == NUM_TOKENS
    base_tokens = outs[2].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids != base_tokens and outs[1].outputs[0].token_ids != base_tokens

    alone_llm = _llm(model_dir, enable_tower_connector_lora=True)
    for (prompt, (_, lr, adapter)), out in zip(zip(prompts, reqs), outs):
        alone = alone_llm.generate(prompt, params(), lora_request=lr, use_tqdm=False)[0]
        assert check_logprobs_close(ours_as_ref(alone.outputs[0]), ours_as_ref(out.outputs[0]),
                                    f"{family} alone adapter={adapter or 'base'}") == NUM_TOKENS


def test_encoder_cache_keys_carry_a_tower_adapter_only(setup):
    """The same image: the LM-only adapter hits the base encoder output; the tower adapter misses it
    and gets its own entry, which its next request hits (prefix caching off: a prompt whose KV blocks hit
    needs no encoder output at all)."""
    family, model_dir, adapters = setup
    if family == "qwen2_5_vl":
        pytest.skip("the cache key does not depend on the tower: LLaVA and Qwen2-VL show it")
    img = make_image(64, 48, 0)
    llm = _llm(model_dir, enable_tower_connector_lora=True, enable_prefix_caching=False)
    runner, cache = llm.llm_engine.runner, llm.llm_engine.core.scheduler.encoder_cache_manager
    prompt = {"prompt": _prompt(family), "multi_modal_data": {"image": img}}

    def run(lora):
        llm.generate(prompt, params(), lora_request=lora, use_tqdm=False)
        return runner.num_encoded_items, cache.num_hits

    assert run(None) == (1, 0)
    assert run(LoRARequest("lm", 1, str(adapters["lm"]))) == (1, 1)          # shared
    assert run(LoRARequest("tower", 2, str(adapters["tower"]))) == (2, 1)    # its own key
    assert run(LoRARequest("tower", 2, str(adapters["tower"]))) == (2, 2)
    keys = set(runner.encoder_cache)
    assert len(keys) == 2 and sum(key.endswith("+lora:tower#2") for key in keys) == 1


def test_the_flag_needs_enable_lora():
    from engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="--enable-lora"):
        EngineArgs(model="unused", enable_tower_connector_lora=True).create_engine_config(max_model_len=256)
    args = EngineArgs(model="unused", enable_lora=True, enable_tower_connector_lora=True)
    config = args.create_engine_config(max_model_len=256)
    assert config.lora_config.enable_tower_connector_lora


def test_without_the_flag_a_tower_adapter_is_refused(setup):
    """Offline: the adapter error names the flag; an LM-only adapter still serves. Over HTTP,
    /v1/load_lora_adapter answers 400 naming the flag (and nothing of the adapter's files)."""
    from tests.server.conftest import start_server

    family, model_dir, adapters = setup
    if family == "qwen2_5_vl":
        pytest.skip("the refusal does not depend on the tower: LLaVA and Qwen2-VL show it")
    llm = _llm(model_dir)
    prompt = {"prompt": _prompt(family), "multi_modal_data": {"image": make_image(64, 48, 0)}}
    with pytest.raises(InvalidLoRAAdapterError, match=TOWER_LORA_FLAG):
        llm.generate(prompt, params(), lora_request=LoRARequest("tower", 1, str(adapters["tower"])),
                     use_tqdm=False)
    out = llm.generate(prompt, params(), lora_request=LoRARequest("lm", 2, str(adapters["lm"])),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == NUM_TOKENS
    if family != "llava":
        return
    srv = start_server(str(model_dir), served_model_name=["tiny"], max_model_len=256, enable_lora=True,
                       allow_runtime_lora_updating=True, max_lora_rank=8)
    try:
        r = httpx.post(srv.url + "/v1/load_lora_adapter",
                       json={"lora_name": "tower", "lora_path": str(adapters["tower"])})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert TOWER_LORA_FLAG in message
        # The same words for a path that holds nothing: the answer tells nothing of the server's files.
        r = httpx.post(srv.url + "/v1/load_lora_adapter",
                       json={"lora_name": "tower", "lora_path": "/no/such/dir"})
        assert r.status_code == 400 and r.json()["error"]["message"] == message
        r = httpx.post(srv.url + "/v1/load_lora_adapter",
                       json={"lora_name": "lm", "lora_path": str(adapters["lm"])})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()


def test_tower_rows_beyond_the_step_buffers(setup):
    """A 16-token step: the tower runs an image on more rows than the LoRA step buffers hold (LLaVA: 1 + 16
    patches, Qwen: 36 patches), on meta buffers of its own (the step's stay where CUDA graphs read them);
    the output equals PEFT's merged model."""
    family, model_dir, adapters = setup
    img2 = make_image(90, 90, 2)
    llm = _llm(model_dir, enable_tower_connector_lora=True, max_num_batched_tokens=16)
    prompt = {"prompt": _prompt(family), "multi_modal_data": {"image": img2}}
    out = llm.generate(prompt, params(), lora_request=LoRARequest("tower", 1, str(adapters["tower"])),
                       use_tqdm=False)[0]
    assert check_logprobs_close(_reference(family, model_dir, str(adapters["tower"]), img2),
                                ours_as_ref(out.outputs[0]), f"{family} 16-token steps") == NUM_TOKENS
    manager = llm.llm_engine.runner.lora_manager
    assert manager._step_rows == 16 and manager._rows_meta.max_num_tokens > 16


def test_triton_lora_path_through_the_tower(setup, monkeypatch):
    """The Triton LoRA backend forced on CPU (the interpreter): one encoder call over images of the tower
    adapter and of the base, in 32-token steps (the tower's rows beyond the step buffers, the shrink
    scratch of their own), equals PEFT's merged model."""
    from lora.manager import LoRAManager

    family, model_dir, adapters = setup
    if family != "qwen2_vl":
        pytest.skip("one family shows the kernels' side; the others share it")
    init = LoRAManager.__init__

    def triton_backend(self, *args, backend=None, **kwargs):
        init(self, *args, backend="triton", **kwargs)
    monkeypatch.setattr(LoRAManager, "__init__", triton_backend)
    img, img2 = make_image(64, 48, 0), make_image(90, 90, 2)
    tower = LoRARequest("tower", 1, str(adapters["tower"]))
    reqs = [(img2, tower, "tower"), (img, None, "")]
    llm = _llm(model_dir, enable_tower_connector_lora=True, max_num_batched_tokens=32)
    assert llm.llm_engine.runner.lora_manager.backend == "triton"
    media = llm.llm_engine.runner.media
    encode, calls = media.encode, []
    monkeypatch.setattr(media, "encode", lambda *args: calls.append(encode(*args)) or calls[-1])
    outs = llm.generate([{"prompt": _prompt(family), "multi_modal_data": {"image": im}} for im, _, _ in reqs],
                        params(), lora_request=[lr for _, lr, _ in reqs], use_tqdm=False)
    for (im, _, adapter), out in zip(reqs, outs):
        ref = _reference(family, model_dir, str(adapters[adapter]) if adapter else "", im)
        name = f"triton {adapter or 'base'}"
        assert check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name) == NUM_TOKENS
    assert calls == [2] and llm.llm_engine.runner.lora_manager._rows_meta.max_num_tokens > 32
