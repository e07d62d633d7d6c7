"""Qwen2-VL / Qwen2.5-VL language models with ``use_sliding_window``: the layers from ``max_window_layers`` on
attend within ``sliding_window``, as transformers' text model does; prompts longer than the window with an
image, float32 on CPU, greedy tokens equal and logprobs within 1e-3."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from engine.llm import LLM
from engine.models.sliding_window import layer_windows
from tests.models.utils import check_logprobs_close, ours_as_ref
from tests.vision.conftest import build_tiny_qwen2_vl
from tests.vision.test_qwen2_vl_parity import IMG, hf_qwen2_vl_greedy, params

WINDOW = 8


def _windowed(path, version: str):
    """A tiny checkpoint whose text layers from 1 on slide with an 8-position window."""
    d = build_tiny_qwen2_vl(path, version=version)
    config = AutoConfig.from_pretrained(d)
    text = config.text_config
    text.use_sliding_window, text.sliding_window, text.max_window_layers = True, WINDOW, 1
    text.layer_types = ["full_attention"] + ["sliding_attention"] * (text.num_hidden_layers - 1)
    config.save_pretrained(d)
    return d


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_windowed_text_layers_match_transformers(tmp_path, images, version):
    d = _windowed(tmp_path / "m", version)
    windows = layer_windows(AutoConfig.from_pretrained(d).get_text_config())
    assert windows[0] is None and windows[1:] == [WINDOW] * (len(windows) - 1)
    llm = LLM(str(d), device="cpu", dtype="float32", max_num_seqs=4)
    prompts = [(f"{IMG}What is in the picture? Tell me about the colours and the shapes.", [images[1]]),
               ("The quick brown fox jumps over the lazy dog, then runs far away into the woods.", [])]
    for prompt, imgs in prompts:
        request = {"prompt": prompt, "multi_modal_data": {"image": imgs}} if imgs else prompt
        out = llm.generate(request, params(), use_tqdm=False)[0]
        assert len(out.prompt_token_ids) > 2 * WINDOW
        ref = hf_qwen2_vl_greedy(d, prompt, imgs)
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), f"qwen{version}-vl window {prompt[:12]!r}")
