"""Qwen2-Audio (``Qwen2AudioForConditionalGeneration``) against transformers on a tiny random checkpoint
(Whisper-style encoder, 2 layers, 128 mel bins, and a tiny Qwen2), fed the committed speech clips, float32
on CPU: greedy tokens equal and logprobs within 1e-3; one and two clips per prompt, a batch with text and an
adapter, chunked prefill with prefix caching, and ``/v1/chat/completions`` with audio parts."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.audio.whisper_reference import load_wav
from tests.conftest import build_tokenizer
from tests.models.utils import RefOutput, check_logprobs_close, ours_as_ref
from tests.vision.utils import hf_generate_greedy

MAX_TOKENS = 6
MAX_MODEL_LEN = 512
BOS, AUDIO, EOS = "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"
CLIP = f"{BOS}{AUDIO}{EOS}"
PROMPTS = [f"Listen: {CLIP} What is said?", f"First {CLIP} then {CLIP} compare", "The quick brown fox"]


def build_tiny_qwen2_audio(out_dir: Path, seed: int = 0) -> Path:
    """transformers' own ``Qwen2AudioForConditionalGeneration`` with its processor (Whisper's feature
    extractor, 128 mel bins; the tokenizer with the three audio tokens; the processor's chat template)."""
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    tok = build_tokenizer((BOS, AUDIO, EOS))
    cfg = Qwen2AudioConfig(
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                          num_mel_bins=128, max_source_positions=1500),
        text_config=dict(model_type="qwen2", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=0.2, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id),
        audio_token_index=tok.convert_tokens_to_ids(AUDIO))
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(cfg).eval()
    with torch.no_grad():   # make the audio matter next to the text embeddings
        model.model.multi_modal_projector.linear.weight.normal_(0.0, 0.5)
        model.model.audio_tower.embed_positions.weight.normal_(0.0, 0.2)
    model.save_pretrained(out_dir)
    processor = Qwen2AudioProcessor(WhisperFeatureExtractor(feature_size=128), tok)
    tok.chat_template = processor.chat_template
    processor.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def qwen2_audio_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2_audio(tmp_path_factory.mktemp("tiny-qwen2-audio"))


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    """Three committed 16 kHz speech clips (3.6 - 4.4 s)."""
    return [load_wav(name)[0] for name in ("fox", "hello", "weather")]


@pytest.fixture(scope="module")
def llm(qwen2_audio_dir):
    return LLM(str(qwen2_audio_dir), device="cpu", dtype="float32", max_num_seqs=8, max_model_len=MAX_MODEL_LEN)


@functools.lru_cache(maxsize=2)
def _hf(model_dir: str):
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration
    model = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def hf_inputs(model_dir: Path, prompt: str, audios: list[np.ndarray]) -> dict:
    _, processor = _hf(str(model_dir))
    if not audios:
        ids = processor.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    inputs = processor(text=prompt, audio=audios, sampling_rate=16000, return_tensors="pt")
    return dict(inputs)


def hf_greedy(model_dir: Path, prompt: str, audios: list[np.ndarray], model=None) -> RefOutput:
    return hf_generate_greedy(model or _hf(str(model_dir))[0], hf_inputs(model_dir, prompt, audios), MAX_TOKENS)


def params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True)


def audio_prompt(prompt: str, audios: list[np.ndarray]) -> dict:
    return {"prompt": prompt, "multi_modal_data": {"audio": [(a, 16000) for a in audios]}}


def test_placeholder_expansion_matches_processor(llm, qwen2_audio_dir, clips):
    """<|AUDIO|> expands to transformers' count (mel frames -> conv stride 2 -> pool 2), in the same ids."""
    processor = llm.llm_engine.processor.mm_processor
    _, hf_processor = _hf(str(qwen2_audio_dir))
    tok = hf_processor.tokenizer
    for prompt, audios in ((PROMPTS[0], clips[:1]), (PROMPTS[1], clips[1:])):
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


def llm_audio(samples: np.ndarray):
    from multimodal.audio import load_audio
    return load_audio((samples, 16000))


def test_audio_embeddings_equal_transformers(llm, qwen2_audio_dir, clips):
    """The encoder + projector rows of two clips of different lengths (one batched call) equal the audio
    features transformers merges into the prompt."""
    model, _ = _hf(str(qwen2_audio_dir))
    inputs = hf_inputs(qwen2_audio_dir, PROMPTS[1], clips[1:])
    captured = {}
    hook = model.model.multi_modal_projector.register_forward_hook(lambda m, a, out: captured.update(out=out))
    with torch.no_grad():
        model(**inputs)
    hook.remove()
    _, items = llm.llm_engine.processor.mm_processor.process(
        inputs["input_ids"][0].tolist(), [llm_audio(a) for a in clips[1:]])
    ours = llm.llm_engine.runner.model.embed_multimodal("audio", [it.data for it in items])
    for k, (row, item) in enumerate(zip(ours, items)):
        ref = captured["out"][k, :item.length]
        assert row.shape == ref.shape
        torch.testing.assert_close(row, ref, atol=1e-4, rtol=1e-4)


def test_one_clip(llm, qwen2_audio_dir, clips):
    for clip in clips[:2]:
        ref = hf_greedy(qwen2_audio_dir, PROMPTS[0], [clip])
        out = llm.generate(audio_prompt(PROMPTS[0], [clip]), params(), use_tqdm=False)
        check_logprobs_close(ref, ours_as_ref(out[0].outputs[0]), f"one clip {len(clip)}")


def test_two_clips_and_text_in_one_batch(llm, qwen2_audio_dir, clips):
    reqs = [(PROMPTS[1], [clips[0], clips[2]]), (PROMPTS[0], [clips[1]]), (PROMPTS[2], [])]
    outs = llm.generate([audio_prompt(p, a) if a else {"prompt": p} for p, a in reqs], params(), use_tqdm=False)
    for (prompt, audios), out in zip(reqs, outs, strict=True):
        check_logprobs_close(hf_greedy(qwen2_audio_dir, prompt, audios), ours_as_ref(out.outputs[0]), prompt)
