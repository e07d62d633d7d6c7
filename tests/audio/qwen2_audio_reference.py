"""The Qwen2-Audio test model and its transformers reference: a tiny random
``Qwen2AudioForConditionalGeneration`` saved with its processor, and transformers' greedy runs on it."""

from __future__ import annotations

import base64
import functools
from pathlib import Path

import numpy as np
import torch

from engine.sampling_params import SamplingParams
from tests.audio.whisper_reference import AUDIO_DIR, load_wav
from tests.conftest import build_tokenizer
from tests.models.utils import RefOutput
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


def load_clips() -> list[np.ndarray]:
    """Three committed 16 kHz speech clips (fox, hello, weather: 3.6 - 4.4 s)."""
    return [load_wav(name)[0] for name in ("fox", "hello", "weather")]


@functools.lru_cache(maxsize=2)
def hf_model(model_dir: str):
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration
    model = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def hf_inputs(model_dir: Path, prompt: str, audios: list[np.ndarray]) -> dict:
    _, processor = hf_model(str(model_dir))
    if not audios:
        ids = processor.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    inputs = processor(text=prompt, audio=audios, sampling_rate=16000, return_tensors="pt")
    return dict(inputs)


def hf_greedy(model_dir: Path, prompt: str, audios: list[np.ndarray], model=None) -> RefOutput:
    return hf_generate_greedy(model or hf_model(str(model_dir))[0], hf_inputs(model_dir, prompt, audios), MAX_TOKENS)


def params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True)


def audio_prompt(prompt: str, audios: list[np.ndarray]) -> dict:
    return {"prompt": prompt, "multi_modal_data": {"audio": [(a, 16000) for a in audios]}}


def llm_audio(samples: np.ndarray):
    from multimodal.audio import load_audio
    return load_audio((samples, 16000))


def wav_base64(name: str) -> str:
    return base64.b64encode((AUDIO_DIR / name).read_bytes()).decode()
