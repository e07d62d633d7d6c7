"""LoRA adapters on Whisper against PEFT (CPU, float32, a tiny random Whisper): PEFT adapters on q/k/v/out_proj
and fc1/fc2, one on the decoder only and one on encoder and decoder, in one batch with the base model on the
same audio. Greedy tokens equal PEFT's merged model and logprobs within 1e-3; the encoder runs once for the
base and the decoder-only adapter (they share its output) and once more for the encoder adapter; nothing is
held after."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from lora.errors import InvalidLoRAAdapterError
from lora.peft_adapter import LoRATargets, load_peft_adapter
from lora.request import LoRARequest
from tests.audio.whisper_reference import build_tiny_random_whisper
from tests.lora.utils import edit_adapter_config
from tests.models.test_whisper_engine import hf_greedy

TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
DECODER_ONLY = r".*decoder\.layers\.\d+\.(self_attn|encoder_attn)\.(q_proj|k_proj|v_proj|out_proj)|.*decoder\.layers\.\d+\.fc[12]"
RANK = 8
MAX_NEW = 10


def _hf_whisper(path):
    from transformers import WhisperForConditionalGeneration
    return WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def _adapter(base_dir, out_dir, target_modules, seed: int):
    """Save a PEFT adapter with random A and B (B scaled up so the update shows in the greedy tokens);
    return (its directory, transformers' model with the adapter merged)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=target_modules, lora_dropout=0.0,
                     init_lora_weights=False)
    peft_model = get_peft_model(_hf_whisper(base_dir), cfg)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    peft_model.save_pretrained(out_dir)
    return out_dir, peft_model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("whisper-lora")
    base_dir = build_tiny_random_whisper(root)
    dec_dir, dec_ref = _adapter(base_dir, root / "dec", DECODER_ONLY, seed=1)
    both_dir, both_ref = _adapter(base_dir, root / "both", TARGETS, seed=2)
    return dict(base=base_dir, dec=dec_dir, both=both_dir,
                refs={None: _hf_whisper(base_dir), "dec": dec_ref, "both": both_ref})


def _prompt(path) -> list[int]:
    from transformers import WhisperConfig
    cfg = WhisperConfig.from_pretrained(path)
    return [cfg.decoder_start_token_id, cfg.no_timestamps_token_id]


def test_targets_map_transformers_names(setup):
    """Every PEFT projection name lands in its Linear and slice, the encoder's marked; the adapter on the
    decoder only does not adapt the encoder, the other does; an o_proj (LLaMA's name) is unknown here."""
    from engine.models.whisper import WhisperForConditionalGeneration
    from transformers import WhisperConfig

    config = WhisperConfig.from_pretrained(setup["base"])
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config, 448)
    targets = LoRATargets.from_model(model)
    slices = targets.slices
    assert targets.suffixes == tuple(TARGETS)

    def place(name: str) -> tuple[str, int, bool]:
        target = slices[name]
        return target.module_name, target.slice_idx, target.in_encoder

    dec = "model.decoder.layers"
    assert place(f"{dec}.1.self_attn.k_proj") == (f"{dec}.1.self_attn.qkv_proj", 1, False)
    assert place(f"{dec}.0.encoder_attn.q_proj") == (f"{dec}.0.encoder_attn.q_proj", 0, False)
    assert place(f"{dec}.0.encoder_attn.v_proj") == (f"{dec}.0.encoder_attn.kv_proj", 1, False)
    assert place(f"{dec}.1.encoder_attn.out_proj") == (f"{dec}.1.encoder_attn.out_proj", 0, False)
    assert place(f"{dec}.0.fc2") == (f"{dec}.0.fc2", 0, False)
    assert place("model.encoder.layers.1.self_attn.q_proj") == ("model.encoder.layers.1.self_attn.qkv", 0, True)
    assert place("model.encoder.layers.0.fc2") == ("model.encoder.layers.0.fc2", 0, True)
    # 2 encoder layers x 6 projections, 2 decoder layers x (4 + 4 + 2)
    assert len(slices) == 2 * 6 + 2 * 10
    decoder_only = load_peft_adapter("dec", str(setup["dec"]), targets, RANK, torch.float32)
    both = load_peft_adapter("both", str(setup["both"]), targets, RANK, torch.float32)
    assert not decoder_only.adapts_encoder and both.adapts_encoder
    assert len(decoder_only.weights) == 2 * 10 and len(both.weights) == 2 * 6 + 2 * 10
    bad = setup["both"].parent / "bad"
    shutil.copytree(setup["both"], bad)
    edit_adapter_config(bad, target_modules=["q_proj", "o_proj"])
    with pytest.raises(InvalidLoRAAdapterError, match=r"unknown target modules \['o_proj'\]"):
        load_peft_adapter("bad", str(bad), targets, RANK, torch.float32)


def test_manager_rows_batch(setup):
    """``rows_batch``: one slot per encoder row for the call, no batch after it (nor when every row runs the
    base model), no nesting."""
    from engine.config import LoRAConfig
    from engine.models.whisper import WhisperForConditionalGeneration
    from lora.manager import LoRAManager
    from transformers import WhisperConfig

    model = WhisperForConditionalGeneration(WhisperConfig.from_pretrained(setup["base"]), 448)
    manager = LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=RANK), model, torch.device("cpu"), torch.float32)
    both, dec = LoRARequest("both", 1, str(setup["both"])), LoRARequest("dec", 2, str(setup["dec"]))
    manager.register(both)
    manager.register(dec)
    manager.load_slot(1, both)
    with manager.rows_batch(np.full(3000, -1, dtype=np.int32)):
        assert manager.state.batch is None
    with manager.rows_batch(np.repeat(np.array([-1, 1], dtype=np.int32), 1500)):
        batch = manager.state.batch
        assert batch.num_tokens == 3000 and not batch.no_lora
        assert [(seg.lora_slot, len(seg.token_ids)) for seg in batch.segments] == [(1, 1500)]
        with pytest.raises(RuntimeError, match="does not nest"):
            with manager.rows_batch(None):
                pass
    assert manager.state.batch is None


def test_processor_decides_the_encoder_cache_key(setup):
    """The key of the audio is final when ``Processor.process`` returns: the content hash for the base
    model and the decoder-only adapter, the hash and the adapter's name for the encoder adapter (read by
    the client), the first time and again from the client's record."""
    audio = (0.1 * np.random.default_rng(1).standard_normal(16000 * 2)).astype(np.float32)
    llm = LLM(model=str(setup["base"]), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=RANK)
    processor = llm.llm_engine.processor
    prompt = {"prompt_token_ids": _prompt(setup["base"]), "multi_modal_data": {"audio": (audio, 16000)}}
    both, dec = LoRARequest("both", 1, str(setup["both"])), LoRARequest("dec", 2, str(setup["dec"]))

    def key(request_id: str, lora_request):
        _, children = processor.process(request_id, prompt, SamplingParams(max_tokens=1), lora_request)
        feature, = children[0].mm_features
        return feature.identifier, feature.encoder_lora_name

    content_hash, _ = key("base", None)
    assert key("dec", dec) == (content_hash, None)
    assert key("both", both) == (f"{content_hash}+lora:both#1", "both")
    assert key("both-again", both) == (f"{content_hash}+lora:both#1", "both")
    assert key("dec-again", dec) == (content_hash, None)
    # The same name loaded again (a new id): its own key, never the replaced adapter's encoder output.
    assert key("both-reloaded", LoRARequest("both", 7, str(setup["both"]))) == (f"{content_hash}+lora:both#7",
                                                                               "both")


def test_mixed_batch_matches_peft(setup):
    audio = (0.1 * np.random.default_rng(0).standard_normal(16000 * 6)).astype(np.float32)
    prompt = _prompt(setup["base"])
    llm = LLM(model=str(setup["base"]), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=RANK)
    adapters = {"dec": LoRARequest("dec", 1, str(setup["dec"])), "both": LoRARequest("both", 2, str(setup["both"]))}
    plan = [None, "dec", "both", None]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"audio": (audio, 16000)}}] * len(plan),
                        params, lora_request=[None if a is None else adapters[a] for a in plan], use_tqdm=False)
    got = {}
    for adapter, out in zip(plan, outs):
        ref_tokens, ref_logprobs = hf_greedy(setup["refs"][adapter], audio, prompt, MAX_NEW)
        tokens = list(out.outputs[0].token_ids)
        assert tokens == ref_tokens, adapter
        ours = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=1e-3, err_msg=str(adapter))
        got[adapter] = (tokens, ours)
    # Each adapter changes the output (so the comparisons above test the adapters).
    assert got["dec"] != got[None] and got["both"] != got[None] and got["dec"] != got["both"]
    core = llm.llm_engine.core
    # The base and the decoder-only adapter share one encoder output; the encoder adapter has its own.
    assert core.runner.num_encoded_items == 2
    assert sorted(k.rpartition("+lora:")[2] for k in core.runner.encoder_cache if "+lora:" in k) == ["both#2"]
    # The encoder adapter's entry stays cached: the same audio under it again is not encoded again.
    again = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"audio": (audio, 16000)}}, params,
                         lora_request=adapters["both"], use_tqdm=False)[0]
    assert list(again.outputs[0].token_ids) == got["both"][0]
    assert core.runner.num_encoded_items == 2
    scheduler = core.scheduler
    assert not scheduler.requests
    assert scheduler.kv_cache_manager.usage == 0.0
    assert not scheduler.kv_cache_manager.req_to_cross_blocks
    assert all(not refs for refs in scheduler.encoder_cache_manager.cached.values())
