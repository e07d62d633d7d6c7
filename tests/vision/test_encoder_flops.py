"""The encoders' analytic FLOPs the benchmarks divide by (benchmarks/vision.py ``vit_flops``,
benchmarks/whisper.py ``encoder_flops``) against PyTorch's FLOP counter on tiny towers (SDPA's math path is
bmm, so attention is counted), and the full shapes' per-call totals."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import CLIPVisionConfig, WhisperConfig

from benchmarks import vision, whisper
from encoders.clip import CLIPVisionTower
from encoders.whisper import WhisperEncoderTower


def _counted(module: torch.nn.Module, *args) -> int:
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        module(*args)
    return counter.get_total_flops()


def test_vit_flops_equal_the_flop_counter_on_clip():
    fields = {k: v for k, v in vision.LLAVA_TINY.vision.items() if k != "projection_dim"}
    config = CLIPVisionConfig(**fields)
    tower = vision.random_weights(CLIPVisionTower(config, num_layers=1), torch.float32, "cpu")
    pixels = torch.randn(3, 3, config.image_size, config.image_size)
    assert _counted(tower, pixels, [-2]) == vision.vit_flops(3, fields, 1)
    # CLIP ViT-L/14-336 as LLaVA-1.5 runs it (23 layers): ~0.366 TFLOP per image.
    full = {k: v for k, v in vision.LLAVA_15_7B.vision.items() if k != "projection_dim"}
    assert 0.36e12 < vision.vit_flops(1, full, 23) < 0.37e12


def test_whisper_encoder_flops_equal_the_flop_counter():
    shape = dict(whisper.TINY_ENCODER_SHAPE, max_source_positions=40)
    tower = WhisperEncoderTower(WhisperConfig(**shape)).eval()
    features = torch.randn(2, shape["num_mel_bins"], 80)
    assert _counted(tower, features) == whisper.encoder_flops(shape, 2)
    # The large-v3-turbo shape: ~2.27 TFLOP per 30 s window.
    assert 2.26e12 < whisper.encoder_flops(whisper.TURBO_SHAPE, 1) < 2.28e12
