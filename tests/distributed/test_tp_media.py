"""Media models at tensor_parallel_size 2 (gloo, 2 processes, float32): the language model (the Whisper
decoder) is sharded, the vision tower (the audio encoder) replicated on both ranks. Image and text
requests in one batch (tiny LLaVA with a CLIP tower, tiny Qwen2-VL with M-RoPE), and two audio requests
with and without a LoRA adapter on every projection of encoder and decoder (tiny random Whisper, untied
head), give the tokens of size 1 and logprobs within 1e-3."""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from lora.request import LoRARequest
from tests.audio.whisper_reference import build_tiny_random_whisper
from tests.models.utils import check_logprobs_close, ours_as_ref
from tests.vision.conftest import build_tiny_llava, build_tiny_qwen2_vl, make_image

MAX_TOKENS = 6
IMAGE_TOKENS = {"llava": "<image>", "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>"}


def _requests(arch: str) -> list:
    img = IMAGE_TOKENS[arch]
    images = [make_image(64, 48, seed=s) for s in range(3)]
    return [{"prompt": f"{img}\nWhat is in the picture?", "multi_modal_data": {"image": images[0]}},
            {"prompt": f"Hello {img} and {img} again", "multi_modal_data": {"image": [images[1], images[2]]}},
            "The quick brown fox"]


def _audio_requests(model_dir) -> list:
    """Two clips, each twice: [a, b, a, b] (the last two run the adapter)."""
    from transformers import WhisperConfig
    cfg = WhisperConfig.from_pretrained(model_dir)
    rng = np.random.default_rng(0)
    audios = [(0.1 * rng.standard_normal(int(16000 * s))).astype(np.float32) for s in (1.5, 3.0)]
    return [{"prompt_token_ids": [cfg.decoder_start_token_id, cfg.no_timestamps_token_id],
             "multi_modal_data": {"audio": (a, 16000)}} for a in audios * 2]


def _generate(model_dir, arch: str, tp: int, adapter=None) -> list:
    lora = dict(enable_lora=True, max_lora_rank=8) if adapter is not None else {}
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=4,
              max_model_len=None if arch == "whisper" else 512, tensor_parallel_size=tp,
              num_gpu_blocks_override=None if arch == "whisper" else 64, **lora)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)
        requests = _audio_requests(model_dir) if arch == "whisper" else _requests(arch)
        loras = None
        if adapter is not None:
            loras = [None, None] + [LoRARequest("both", 1, str(adapter))] * 2
        return [o.outputs[0] for o in llm.generate(requests, params, use_tqdm=False, lora_request=loras)]
    finally:
        llm.llm_engine.core.shutdown()


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "whisper"])
def test_tp2_media_models_equal_tp1(arch, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tp-{arch}")
    adapter = None
    if arch == "whisper":
        from tests.lora.test_whisper_lora import TARGETS, _adapter
        model_dir = build_tiny_random_whisper(out, tie=False)
        adapter, _ = _adapter(model_dir, out / "both", TARGETS, seed=2)
    else:
        model_dir = build_tiny_llava(out) if arch == "llava" else build_tiny_qwen2_vl(out)
    ref, ours = _generate(model_dir, arch, tp=1, adapter=adapter), _generate(model_dir, arch, tp=2, adapter=adapter)
    if adapter is not None:   # the adapter changes the tokens: the comparison covers its shards
        assert any(list(a.token_ids) != list(b.token_ids) for a, b in zip(ref[:2], ref[2:]))
    for i, (a, b) in enumerate(zip(ref, ours)):
        assert list(a.token_ids) == list(b.token_ids), f"{arch} request {i}"
        assert check_logprobs_close(ours_as_ref(a), ours_as_ref(b), f"{arch} request {i}") == MAX_TOKENS
