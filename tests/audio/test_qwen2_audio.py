"""Qwen2-Audio (``Qwen2AudioForConditionalGeneration``) against transformers on a tiny random checkpoint
(Whisper-style encoder, 2 layers, 128 mel bins, and a tiny Qwen2), fed the committed speech clips, float32
on CPU: greedy tokens equal and logprobs within 1e-3; one and two clips per prompt, a batch with text and an
adapter, chunked prefill with prefix caching, and ``/v1/chat/completions`` with audio parts."""

from __future__ import annotations

import base64
import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.audio.whisper_reference import AUDIO_DIR, load_wav
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


def test_chunked_prefill_and_prefix_caching(qwen2_audio_dir, clips):
    """A 32-token budget prefills the prompt (its audio run split over steps); the second request shares the
    audio prefix from the cache; both equal transformers."""
    llm = LLM(str(qwen2_audio_dir), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
              enable_prefix_caching=True, max_num_batched_tokens=32, block_size=16)
    prompt = "Some words first " + PROMPTS[0]
    first = llm.generate(audio_prompt(prompt, clips[:1]), params(), use_tqdm=False)
    second = llm.generate(audio_prompt(prompt + " again", clips[:1]), params(), use_tqdm=False)
    for p, out in ((prompt, first), (prompt + " again", second)):
        check_logprobs_close(hf_greedy(qwen2_audio_dir, p, clips[:1]), ours_as_ref(out[0].outputs[0]), p)
    audio_offset = len(llm.get_tokenizer().encode(prompt[:prompt.index(AUDIO)], add_special_tokens=False))
    assert second[0].num_cached_tokens >= audio_offset + 64   # the audio's blocks came from the cache
    other = llm.generate(audio_prompt(prompt, clips[1:2]), params(), use_tqdm=False)   # another clip
    assert other[0].num_cached_tokens <= audio_offset          # shares the text before the audio only
    check_logprobs_close(hf_greedy(qwen2_audio_dir, prompt, clips[1:2]), ours_as_ref(other[0].outputs[0]), "other")


def test_audio_text_and_adapter_in_one_batch_equal_each_alone(tmp_path, qwen2_audio_dir, clips):
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
    reqs = [(PROMPTS[0], clips[:1], lora), (PROMPTS[0], clips[:1], None), (PROMPTS[2], [], lora),
            (PROMPTS[2], [], None)]
    prompts = [audio_prompt(p, a) if a else {"prompt": p} for p, a, _ in reqs]
    together = llm.generate(prompts, params(), lora_request=[lr for _, _, lr in reqs], use_tqdm=False)
    for (prompt, audios, lr), prompt_in, out in zip(reqs, prompts, together, strict=True):
        name = f"{prompt} audio={bool(audios)} lora={lr is not None}"
        ref = hf_greedy(qwen2_audio_dir, prompt, audios, model=ref_model if lr else _hf(str(qwen2_audio_dir))[0])
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name)
        alone = llm.generate(prompt_in, params(), lora_request=lr, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids, name
        check_logprobs_close(ours_as_ref(alone.outputs[0]), ours_as_ref(out.outputs[0]), name, atol=1e-4)
    assert together[0].outputs[0].token_ids != together[1].outputs[0].token_ids   # the adapter matters


def wav_base64(name: str) -> str:
    return base64.b64encode((AUDIO_DIR / name).read_bytes()).decode()


def test_llm_chat_with_audio_parts(llm, qwen2_audio_dir, clips):
    """LLM.chat with an input_audio part and an offline (array, rate) audio part: the processor's chat
    template, then transformers' greedy continuation with those clips."""
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": wav_base64("fox.wav"), "format": "wav"}},
        {"type": "audio", "audio": (clips[1], 16000)},
        {"type": "text", "text": "Which one is louder?"}]}]
    _, processor = _hf(str(qwen2_audio_dir))
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "audio", "audio_url": "a"}, {"type": "audio", "audio_url": "b"},
        {"type": "text", "text": "Which one is louder?"}]}], add_generation_prompt=True, tokenize=False)
    assert text.count(AUDIO) == 2
    out = llm.chat(messages, params(), use_tqdm=False)
    check_logprobs_close(hf_greedy(qwen2_audio_dir, text, clips[:2]), ours_as_ref(out[0].outputs[0]), "chat")


# ------------------------------------------------------------------------------------------------ server
MODEL = "tiny-qwen2-audio"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    """--allowed-local-media-path: fox.wav inside, and a symlink inside that points outside (to hello.wav)."""
    d = tmp_path_factory.mktemp("allowed-media")
    (d / "fox.wav").write_bytes((AUDIO_DIR / "fox.wav").read_bytes())
    (d / "escape.wav").symlink_to(AUDIO_DIR / "hello.wav")
    return d


@pytest.fixture(scope="module")
def server(qwen2_audio_dir, media_dir):
    from tests.server.conftest import start_server
    srv = start_server(str(qwen2_audio_dir), served_model_name=[MODEL], dtype="float32", device="cpu",
                       max_model_len=MAX_MODEL_LEN, max_num_seqs=4, limit_mm_per_prompt={"audio": 2},
                       allowed_local_media_path=str(media_dir))
    yield srv
    srv.stop()


def chat(srv, parts: list[dict], model: str = MODEL):
    import httpx
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "messages": [{"role": "user", "content": parts}]}
    return httpx.post(srv.base_url + "/chat/completions", json=body, timeout=60)


def assert_nothing_held(srv) -> None:
    from tests.server.conftest import wait_until
    client = srv.engine_client
    assert wait_until(lambda: client.num_tracked_requests == 0 and client.num_sequences_in_flight == 0)
    assert client.processor.media_budget.num_bytes == 0


def test_chat_completions_input_audio_and_audio_url(server, qwen2_audio_dir, clips):
    """input_audio (base64 wav) and audio_url (data URL) parts: the reply is transformers' greedy continuation
    of the rendered conversation with both clips, and the prompt is as long as transformers' input ids."""
    url = "data:audio/wav;base64," + wav_base64("hello.wav")
    parts = [{"type": "input_audio", "input_audio": {"data": wav_base64("fox.wav"), "format": "wav"}},
             {"type": "audio_url", "audio_url": {"url": url}}, {"type": "text", "text": "Same speaker?"}]
    _, processor = _hf(str(qwen2_audio_dir))
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "audio", "audio_url": "a"}, {"type": "audio", "audio_url": "b"},
        {"type": "text", "text": "Same speaker?"}]}], add_generation_prompt=True, tokenize=False)
    ref = hf_greedy(qwen2_audio_dir, text, clips[:2])
    r = chat(server, parts)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == processor.tokenizer.decode(ref.token_ids,
                                                                                      skip_special_tokens=True)
    assert r.json()["usage"]["prompt_tokens"] == hf_inputs(qwen2_audio_dir, text, clips[:2])["input_ids"].shape[1]
    assert_nothing_held(server)


def test_file_url_guard(server, media_dir):
    """file:// audio URLs: a file under --allowed-local-media-path is read; a path outside it, a symlink
    inside that leads outside, and '..' out of it are 400s that read nothing."""
    inside = chat(server, [{"type": "audio_url", "audio_url": {"url": (media_dir / "fox.wav").as_uri()}},
                           {"type": "text", "text": "hi"}])
    assert inside.status_code == 200, inside.text
    for url in ((AUDIO_DIR / "fox.wav").as_uri(), (media_dir / "escape.wav").as_uri(),
                f"file://{media_dir}/../{media_dir.name}/../../etc/passwd", "file:///etc/passwd"):
        r = chat(server, [{"type": "audio_url", "audio_url": {"url": url}}, {"type": "text", "text": "hi"}])
        assert r.status_code == 400, (url, r.text)
        assert "outside the allowed media directory" in r.json()["error"]["message"], r.text
    assert_nothing_held(server)


def test_file_urls_refused_without_the_flag():
    """Where no directory is allowed, a file:// audio URL is refused before any path is touched."""
    from multimodal.media import MediaError, MediaLimits, read_audio_source
    with pytest.raises(MediaError, match="file:// URLs are not enabled"):
        read_audio_source((AUDIO_DIR / "fox.wav").as_uri(), MediaLimits(), 1 << 20)


@pytest.mark.parametrize("parts, reason", [
    ([{"type": "input_audio", "input_audio": {"data": base64.b64encode(b"no audio here" * 50).decode(),
                                              "format": "wav"}}], "not audio"),
    ([{"type": "input_audio", "input_audio": {"data": "%%%not base64", "format": "wav"}}], "not valid base64"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "needs 'input_audio'"),
    ([{"type": "audio_url", "audio_url": {"url": " "}}], "an audio_url part needs 'audio_url'"),
    ([{"type": "audio", "audio": "/etc/passwd"}], "only accepted by the offline LLM.chat"),
    ([{"type": "audio_url", "audio_url": {"url": "data:image/png;base64,AAAA"}}], "must hold audio"),
    ([{"type": "audio_url", "audio_url": {"url": "ftp://example.com/a.wav"}}], "unsupported audio URL"),
    ([{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}] * 3, "at most 2 audio(s)"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], "takes audio, not image"),
])
def test_bad_audio_is_a_400_with_the_reason(server, parts, reason):
    r = chat(server, parts + [{"type": "text", "text": "hi"}])
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"], r.text
    assert_nothing_held(server)


def test_audio_to_a_model_without_audio_is_a_400(tiny_llama_dir):
    from tests.server.conftest import start_server
    srv = start_server(str(tiny_llama_dir), served_model_name=["tiny-llama"], max_model_len=128)
    try:
        r = chat(srv, [{"type": "input_audio", "input_audio": {"data": wav_base64("fox.wav"), "format": "wav"}}],
                 model="tiny-llama")
        assert r.status_code == 400, r.text
        assert "does not take audio" in r.json()["error"]["message"]
        assert_nothing_held(srv)
    finally:
        srv.stop()


def test_limit_mm_per_prompt_takes_audio(qwen2_audio_dir, clips):
    """--limit-mm-per-prompt audio=N (either form) reaches the engine; a prompt over it is refused."""
    import argparse

    from engine.server.args import add_serve_args, engine_kwargs
    p = add_serve_args(argparse.ArgumentParser(prog="chorus serve"))
    for flag in ("audio=1", '{"audio": 1}', "image=0,audio=1"):
        assert engine_kwargs(p.parse_args(["--limit-mm-per-prompt", flag]))["limit_mm_per_prompt"]["audio"] == 1
    llm = LLM(str(qwen2_audio_dir), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
              limit_mm_per_prompt={"audio": 1})
    with pytest.raises(ValueError, match=r"at most 1 audio\(s\) per prompt"):
        llm.generate(audio_prompt(PROMPTS[1], clips[:2]), params(), use_tqdm=False)
