"""Whisper in the engine against transformers on tiny random checkpoints (CPU, float32): greedy tokens equal
and logprobs within 1e-3, several requests batched, preemption, chunked decoder prompts, configs a real
checkpoint may carry; the cross blocks and encoder-cache references are released; bad input is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.audio.whisper_reference import build_tiny_random_whisper, hf_features

MAX_NEW = 12


def _audios(seed: int, seconds: list[float]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(0.1 * rng.standard_normal(int(16000 * s))).astype(np.float32) for s in seconds]


def _hf_model(path):
    from transformers import WhisperForConditionalGeneration
    return WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(hf, audio: np.ndarray, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """transformers' Whisper greedy decode without timestamps: its own suppress processors on the logits
    of its forward pass (what ``generate`` does with ``<|notimestamps|>`` in the prompt)."""
    from transformers.generation.logits_process import (SuppressTokensAtBeginLogitsProcessor,
                                                        SuppressTokensLogitsProcessor)

    cfg = hf.generation_config
    processors = [SuppressTokensLogitsProcessor(cfg.suppress_tokens),
                  SuppressTokensAtBeginLogitsProcessor(cfg.begin_suppress_tokens, begin_index=len(prompt))]
    features = hf_features(audio, hf.config.num_mel_bins)
    encoded = hf.model.encoder(features).last_hidden_state
    ids = torch.tensor([prompt])
    tokens, logprobs = [], []
    for _ in range(max_new):
        logits = hf(encoder_outputs=(encoded,), decoder_input_ids=ids).logits[:, -1].float()
        for p in processors:
            logits = p(ids, logits)
        lp = torch.log_softmax(logits, dim=-1)[0]
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(float(lp[token]))
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        if token == cfg.eos_token_id:
            break
    return tokens, logprobs


def _prompt(path) -> list[int]:
    from transformers import WhisperConfig
    cfg = WhisperConfig.from_pretrained(path)
    return [cfg.decoder_start_token_id, cfg.no_timestamps_token_id]


def _check_against_hf(path, llm: LLM, audios: list[np.ndarray], prompts: list[list[int]],
                      atol: float = 1e-3) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p, "multi_modal_data": {"audio": (a, 16000)}}
                         for a, p in zip(audios, prompts)], params, use_tqdm=False)
    hf = _hf_model(path)
    for audio, prompt, out in zip(audios, prompts, outs):
        ref_tokens, ref_logprobs = hf_greedy(hf, audio, prompt, MAX_NEW)
        got = list(out.outputs[0].token_ids)
        assert got == ref_tokens
        ours = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, got)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=atol)
    return outs


def _assert_released(llm: LLM) -> None:
    core = llm.llm_engine.core
    scheduler = core.scheduler
    assert not scheduler.requests
    assert scheduler.kv_cache_manager.usage == 0.0
    assert not scheduler.kv_cache_manager.req_to_cross_blocks
    ecm = scheduler.encoder_cache_manager
    assert all(not refs for refs in ecm.cached.values())


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory):
    return build_tiny_random_whisper(tmp_path_factory.mktemp("whisper"))


def test_batched_requests_match_transformers(tiny_whisper):
    llm = LLM(model=str(tiny_whisper), device="cpu", dtype="float32", max_num_seqs=8)
    audios = _audios(0, [3.0, 7.5, 12.0, 29.9])
    audios.append(audios[1].copy())                      # identical audio: encoded once
    outs = _check_against_hf(tiny_whisper, llm, audios, [_prompt(tiny_whisper)] * len(audios))
    assert outs[1].outputs[0].token_ids == outs[4].outputs[0].token_ids
    runner = llm.llm_engine.core.runner
    assert runner.num_encoded_items == 4
    stats = llm.llm_engine.core.scheduler.get_stats()
    assert stats.max_reqs_per_step >= 4                   # decoded together in one step
    assert stats.encoder_cache_hits >= 1
    _assert_released(llm)


def test_preemption_and_chunked_decoder_prompts_match(tiny_whisper):
    from transformers import WhisperConfig
    cfg = WhisperConfig.from_pretrained(tiny_whisper)
    # Room to admit all three (each holds 1500 cross positions = 375 blocks of 4, + its decoder tokens) but not
    # for all of them to grow: the last admitted is preempted and recomputed. 8-token steps.
    llm = LLM(model=str(tiny_whisper), device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=1137,
              max_num_batched_tokens=8, max_num_seqs=4, max_num_encoder_input_tokens=1500)
    previous_text = list(range(400, 420))                # a 20-token <|startofprev|> prompt: chunked
    prompts = [[cfg.prev_sot_token_id, *previous_text, cfg.decoder_start_token_id, cfg.no_timestamps_token_id],
               _prompt(tiny_whisper), _prompt(tiny_whisper)]
    _check_against_hf(tiny_whisper, llm, _audios(1, [4.0, 9.0, 20.0]), prompts)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    _assert_released(llm)


@pytest.mark.parametrize("variant", [
    dict(decoder_heads=2, encoder_heads=4, decoder_ffn=96),
    dict(tie=False, scale_embedding=True),
    dict(multilingual=True, decoder_layers=3),
])
def test_checkpoint_variants_match(tmp_path, variant):
    path = build_tiny_random_whisper(tmp_path, **variant)
    llm = LLM(model=str(path), device="cpu", dtype="float32")
    prompt = _prompt(path)
    if variant.get("multilingual"):
        from transformers import WhisperConfig
        cfg = WhisperConfig.from_pretrained(path)
        prompt = [cfg.decoder_start_token_id, cfg.lang_to_id["<|de|>"], cfg.task_to_id["translate"],
                  cfg.no_timestamps_token_id]
    _check_against_hf(path, llm, _audios(2, [5.0, 11.0]), [prompt, prompt])


def test_bad_requests_are_refused_and_leave_nothing(tiny_whisper):
    llm = LLM(model=str(tiny_whisper), device="cpu", dtype="float32")
    prompt = _prompt(tiny_whisper)
    with pytest.raises(ValueError, match="transcribes audio"):
        llm.generate({"prompt_token_ids": prompt}, use_tqdm=False)
    with pytest.raises(ValueError, match="takes audio, not image"):
        llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": b"x"}}, use_tqdm=False)
    with pytest.raises(ValueError, match="longer than the model's 30 s window"):
        llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"audio": (np.zeros(16000 * 31, np.float32),
                                                                                 16000)}}, use_tqdm=False)
    with pytest.raises(ValueError, match="audio"):
        llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"audio": b"not audio at all"}}, use_tqdm=False)
    _assert_released(llm)
    out = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"audio": (_audios(3, [2.0])[0], 16000)}},
                       SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0


def test_chat_model_refuses_audio(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="text-only and takes no audio"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"audio": (np.zeros(1600, np.float32), 16000)}},
                     use_tqdm=False)
