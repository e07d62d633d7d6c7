"""Whisper on CUDA (tiny random checkpoint, float32 with TF32 off so the comparison is tight): the Triton
paged kernels for the decoder's self-attention and for cross-attention (decodes, and multi-token prompts
expanded to one query per token), the log-mel on the GPU, against transformers on the CPU."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from tests.audio.whisper_reference import build_tiny_random_whisper
from tests.models.test_whisper_engine import _assert_released, _audios, _check_against_hf, _prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_whisper_cuda_matches_transformers(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False           # the encoder's convolutions
    path = build_tiny_random_whisper(tmp_path)
    llm = LLM(model=str(path), device="cuda", dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3)
    from transformers import WhisperConfig
    cfg = WhisperConfig.from_pretrained(path)
    long_prompt = [cfg.prev_sot_token_id, *range(400, 430), cfg.decoder_start_token_id, cfg.no_timestamps_token_id]
    audios = _audios(5, [3.0, 8.0, 17.0, 29.0])
    # float32 on two devices (TF32 off): reductions in another order, as the vision GPU tests.
    _check_against_hf(path, llm, audios, [_prompt(path), long_prompt, _prompt(path), long_prompt], atol=2e-3)
    _assert_released(llm)
