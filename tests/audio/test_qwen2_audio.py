"""Qwen2-Audio (``Qwen2AudioForConditionalGeneration``) against transformers on a tiny random checkpoint
(Whisper-style encoder, 2 layers, 128 mel bins, and a tiny Qwen2; ``tests.audio.qwen2_audio_reference``), fed
the committed speech clips, float32 on CPU: greedy tokens equal and logprobs within 1e-3; the placeholder rule,
the audio embeddings, one and two clips per prompt, a batch with text and an adapter, chunked prefill with
prefix caching, TP 2, the transformers 4.x layout."""

from __future__ import annotations


import pytest
import torch

from engine.llm import LLM
from tests.audio.qwen2_audio_reference import (AUDIO, MAX_MODEL_LEN, PROMPTS, audio_prompt, hf_greedy, hf_inputs,
                                               hf_model, llm_audio, params)
from tests.models.utils import check_logprobs_close, ours_as_ref



def test_placeholder_expansion_matches_processor(audio_llm, qwen2_audio_dir, audio_clips):
    """<|AUDIO|> expands to transformers' count (mel frames -> conv stride 2 -> pool 2), in the same ids."""
    processor = audio_llm.llm_engine.processor.mm_processor
    _, hf_processor = hf_model(str(qwen2_audio_dir))
    tok = hf_processor.tokenizer
    for prompt, audios in ((PROMPTS[0], audio_clips[:1]), (PROMPTS[1], audio_clips[1:])):
        ref = hf_inputs(qwen2_audio_dir, prompt, audios)
        ids, items = processor.process(tok(prompt, add_special_tokens=False)["input_ids"],
                                       [llm_audio(a) for a in audios])
        assert ids == ref["input_ids"][0].tolist()
        frames = ref["feature_attention_mask"].sum(-1).tolist()
        assert [it.data.num_frames for it in items] == frames
        assert [it.length for it in items] == [(((f - 1) // 2 + 1) - 2) // 2 + 1 for f in frames]
        again, _ = processor.process(ids, [llm_audio(a) for a in audios])   # pre-expanded: kept
        assert again == ids
    assert processor.max_embeds_per_item() == 750


def test_audio_embeddings_equal_transformers(audio_llm, qwen2_audio_dir, audio_clips):
    """The encoder + projector rows of two audio_clips of different lengths (one batched call) equal the audio
    features transformers merges into the prompt."""
    model, _ = hf_model(str(qwen2_audio_dir))
    inputs = hf_inputs(qwen2_audio_dir, PROMPTS[1], audio_clips[1:])
    captured = {}
    hook = model.model.multi_modal_projector.register_forward_hook(lambda m, a, out: captured.update(out=out))
    with torch.no_grad():
        model(**inputs)
    hook.remove()
    _, items = audio_llm.llm_engine.processor.mm_processor.process(
        inputs["input_ids"][0].tolist(), [llm_audio(a) for a in audio_clips[1:]])
    ours = audio_llm.llm_engine.runner.model.embed_multimodal("audio", [it.data for it in items])
    for k, (row, item) in enumerate(zip(ours, items)):
        ref = captured["out"][k, :item.length]
        assert row.shape == ref.shape
        torch.testing.assert_close(row, ref, atol=1e-4, rtol=1e-4)


def test_one_clip(audio_llm, qwen2_audio_dir, audio_clips):
    for clip in audio_clips[:2]:
        ref = hf_greedy(qwen2_audio_dir, PROMPTS[0], [clip])
        out = audio_llm.generate(audio_prompt(PROMPTS[0], [clip]), params(), use_tqdm=False)
        check_logprobs_close(ref, ours_as_ref(out[0].outputs[0]), f"one clip {len(clip)}")


def test_two_clips_and_text_in_one_batch(audio_llm, qwen2_audio_dir, audio_clips):
    reqs = [(PROMPTS[1], [audio_clips[0], audio_clips[2]]), (PROMPTS[0], [audio_clips[1]]), (PROMPTS[2], [])]
    prompts = [audio_prompt(p, a) if a else {"prompt": p} for p, a in reqs]
    outs = audio_llm.generate(prompts, params(), use_tqdm=False)
    for (prompt, audios), out in zip(reqs, outs, strict=True):
        check_logprobs_close(hf_greedy(qwen2_audio_dir, prompt, audios), ours_as_ref(out.outputs[0]), prompt)


def test_chunked_prefill_and_prefix_caching(qwen2_audio_dir, audio_clips):
    """A 32-token budget prefills the prompt (its audio run split over steps); the second request shares the
    audio prefix from the cache; both equal transformers."""
    llm = LLM(str(qwen2_audio_dir), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
              enable_prefix_caching=True, max_num_batched_tokens=32, block_size=16)
    prompt = "Some words first " + PROMPTS[0]
    first = llm.generate(audio_prompt(prompt, audio_clips[:1]), params(), use_tqdm=False)
    second = llm.generate(audio_prompt(prompt + " again", audio_clips[:1]), params(), use_tqdm=False)
    for p, out in ((prompt, first), (prompt + " again", second)):
        check_logprobs_close(hf_greedy(qwen2_audio_dir, p, audio_clips[:1]), ours_as_ref(out[0].outputs[0]), p)
    audio_offset = len(llm.get_tokenizer().encode(prompt[:prompt.index(AUDIO)], add_special_tokens=False))
    assert second[0].num_cached_tokens >= audio_offset + 64   # the audio's blocks came from the cache
    other = llm.generate(audio_prompt(prompt, audio_clips[1:2]), params(), use_tqdm=False)   # another clip
    assert other[0].num_cached_tokens <= audio_offset          # shares the text before the audio only
    ref = hf_greedy(qwen2_audio_dir, prompt, audio_clips[1:2])
    check_logprobs_close(ref, ours_as_ref(other[0].outputs[0]), "other")


def test_audio_text_and_adapter_in_one_batch_equal_each_alone(tmp_path, qwen2_audio_dir, audio_clips):
    """A PEFT adapter on the language model, with and without audio, beside base audio and text requests in
    one generate call: each equals transformers (+ PEFT) and the same request run alone."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import Qwen2AudioForConditionalGeneration

    from lora.request import LoRARequest

    base = Qwen2AudioForConditionalGeneration.from_pretrained(qwen2_audio_dir, dtype=torch.float32)
    torch.manual_seed(3)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                     target_modules=r".*language_model.*\.(q_proj|v_proj|o_proj|gate_proj|down_proj)")
    get_peft_model(base, cfg).save_pretrained(tmp_path / "ad")
    ref_model = PeftModel.from_pretrained(
        Qwen2AudioForConditionalGeneration.from_pretrained(qwen2_audio_dir, dtype=torch.float32),
        tmp_path / "ad").eval()
    llm = LLM(str(qwen2_audio_dir), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8,
              max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
    lora = LoRARequest("ad", 1, str(tmp_path / "ad"))
    reqs = [(PROMPTS[0], audio_clips[:1], lora), (PROMPTS[0], audio_clips[:1], None), (PROMPTS[2], [], lora),
            (PROMPTS[2], [], None)]
    prompts = [audio_prompt(p, a) if a else {"prompt": p} for p, a, _ in reqs]
    together = llm.generate(prompts, params(), lora_request=[lr for _, _, lr in reqs], use_tqdm=False)
    for (prompt, audios, lr), prompt_in, out in zip(reqs, prompts, together, strict=True):
        name = f"{prompt} audio={bool(audios)} lora={lr is not None}"
        ref = hf_greedy(qwen2_audio_dir, prompt, audios, model=ref_model if lr else None)
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name)
        alone = llm.generate(prompt_in, params(), lora_request=lr, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids, name
        check_logprobs_close(ours_as_ref(alone.outputs[0]), ours_as_ref(out.outputs[0]), name, atol=1e-4)
    assert together[0].outputs[0].token_ids != together[1].outputs[0].token_ids   # the adapter matters


def test_tensor_parallel_2_equals_transformers(qwen2_audio_dir, audio_clips):
    """TP 2 (gloo, float32): the language model sharded, the audio encoder and projector whole on each rank."""
    llm = LLM(str(qwen2_audio_dir), tensor_parallel_size=2, device="cpu", dtype="float32",
              max_model_len=MAX_MODEL_LEN, seed=0)
    try:
        out = llm.generate(audio_prompt(PROMPTS[1], audio_clips[:2]), params(), use_tqdm=False)
    finally:
        llm.llm_engine.core.shutdown()
    ref = hf_greedy(qwen2_audio_dir, PROMPTS[1], audio_clips[:2])
    check_logprobs_close(ref, ours_as_ref(out[0].outputs[0]), "tp2")


def test_transformers_4_layout_loads(tmp_path, qwen2_audio_dir, audio_clips):
    """The 4.x tensor names (language_model.model.*, language_model.lm_head.*, audio_tower.*,
    multi_modal_projector.*) give transformers' output too."""
    import shutil

    from tests.vision.conftest import _rename_tensors
    d = tmp_path / "legacy"
    shutil.copytree(qwen2_audio_dir, d)
    _rename_tensors(d, [("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                        ("model.audio_tower.", "audio_tower."),
                        ("model.multi_modal_projector.", "multi_modal_projector.")])
    llm = LLM(str(d), device="cpu", dtype="float32", max_num_seqs=2, max_model_len=MAX_MODEL_LEN)
    out = llm.generate(audio_prompt(PROMPTS[0], audio_clips[2:]), params(), use_tqdm=False)
    ref = hf_greedy(qwen2_audio_dir, PROMPTS[0], audio_clips[2:])
    check_logprobs_close(ref, ours_as_ref(out[0].outputs[0]), "4.x")


def test_frame_and_embedding_counts_match_the_processor(audio_llm, qwen2_audio_dir):
    """Lengths around the hop and the window: frames = the feature extractor's mask, embeddings = the
    processor's count; too short for one embedding or longer than the window is refused."""
    import numpy as np
    _, hf_processor = hf_model(str(qwen2_audio_dir))
    ours = audio_llm.llm_engine.processor.mm_processor
    for num_samples in (480, 481, 639, 640, 16_000, 16_001, 479_999, 480_000):
        mask = hf_processor.feature_extractor(np.zeros(num_samples, np.float32), sampling_rate=16000,
                                              return_attention_mask=True, padding="max_length")["attention_mask"]
        frames = int(mask.sum())
        assert ours.num_frames(num_samples) == frames, num_samples
        assert ours.num_embeds(num_samples) == (((frames - 1) // 2 + 1) - 2) // 2 + 1, num_samples
    tok = hf_processor.tokenizer
    ids = tok(PROMPTS[0], add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="too short"):
        ours.process(ids, [llm_audio(np.zeros(320, np.float32))])
    with pytest.raises(ValueError, match="longer than the model's 30 s window"):
        ours.process(ids, [llm_audio(np.zeros(480_001, np.float32))])
