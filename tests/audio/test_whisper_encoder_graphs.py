"""Whisper's encoder in CUDA graphs (encoders/encoder_graphs.py, ``WhisperEncoderTower.capture_graphs``).

On CPU: the batch sizes captured, the chunks a call replays, and the tower's graph path with each replay run
eagerly over the same static rows (``use_graphs=False``): a call's windows padded up to the next captured
size (padding rows holding an earlier call's windows) give the rows of the unpadded call; a call in which an
adapter updates a projection runs eagerly.

On CUDA (``gpu``): graph replay equals the eager forward, and a tiny random Whisper engine with CUDA graphs
transcribes as the same engine with ``enforce_eager`` while its encoder replays graphs.
"""

from __future__ import annotations

import pytest
import torch
from transformers import WhisperConfig

from encoders.encoder_graphs import encoder_graph_sizes, plan_chunks
from encoders.whisper import WhisperEncoderTower
from engine.layers.linear import Linear

SIZES = [1, 2, 4, 8]


@pytest.mark.parametrize("max_items,expected", [
    (0, []), (1, [1]), (5, [1, 2, 4, 5]), (32, [1, 2, 4, 8, 16, 32]), (100, [1, 2, 4, 8, 16, 32]),
])
def test_encoder_graph_sizes(max_items, expected):
    assert encoder_graph_sizes(max_items) == expected


@pytest.mark.parametrize("num_items,expected", [
    (1, [(0, 1, 1)]),
    (3, [(0, 3, 4)]),
    (8, [(0, 8, 8)]),
    (19, [(0, 8, 8), (8, 8, 8), (16, 3, 4)]),
])
def test_plan_chunks_pads_the_remainder_to_the_next_size(num_items, expected):
    assert plan_chunks(num_items, SIZES) == expected


def _tower(seed: int = 0) -> WhisperEncoderTower:
    """A tiny random encoder (50 positions a window, float32)."""
    config = WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                           num_mel_bins=16, max_source_positions=50)
    tower = WhisperEncoderTower(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in tower.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return tower


def _windows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 16, 100, generator=torch.Generator().manual_seed(seed))   # [n, mel, frames]


def test_padded_replays_equal_the_unpadded_call():
    tower = _tower()
    assert tower.capture_graphs(8, use_graphs=False) == [1, 2, 4, 8]
    with torch.no_grad():
        tower(_windows(8, seed=1) * 3)            # leaves other windows in the padding rows
        for n in (3, 8, 11, 1):
            windows = _windows(n, seed=10 + n)
            replays = tower.graphs.num_replays
            got = tower(windows)
            want = tower._forward_eager(windows)
            assert tower.graphs.num_replays - replays == len(plan_chunks(n, [1, 2, 4, 8]))
            assert got.shape == (n, 50, 32)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert tower.graphs.static_input[3:4].abs().sum() > 0   # the padding held real windows, harmlessly


def test_results_are_not_overwritten_by_later_replays():
    tower = _tower()
    tower.capture_graphs(4, use_graphs=False)
    with torch.no_grad():
        first = tower(_windows(3, seed=1))
        kept = first.clone()
        tower(_windows(3, seed=2))
    assert torch.equal(first, kept)


class _AddOne:
    """A stand-in adapter that updates its projection (doubles its output)."""

    def adds_nothing(self) -> bool:
        return False

    def run(self, layer: Linear, x: torch.Tensor, defer: bool):
        return layer.forward_base(x) * 2, None


def test_a_call_with_an_adapter_runs_eagerly():
    tower = _tower()
    tower.capture_graphs(4, use_graphs=False)
    windows = _windows(2, seed=3)
    with torch.no_grad():
        base = tower(windows)
        tower.layers[0].fc2.adapter = _AddOne()
        replays = tower.graphs.num_replays
        adapted = tower(windows)
    assert tower.graphs.num_replays == replays
    assert not torch.allclose(adapted, base, atol=1e-3)
    with pytest.raises(RuntimeError, match="inside an adapter batch"):
        tower.capture_graphs(4, use_graphs=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_eager_on_cuda():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tower = _tower().cuda()
    assert tower.capture_graphs(8) == [1, 2, 4, 8]
    with torch.no_grad():
        for n in (1, 3, 8, 13):
            windows = _windows(n, seed=20 + n).cuda()
            torch.testing.assert_close(tower(windows), tower._forward_eager(windows), atol=1e-4, rtol=1e-4)
    assert tower.graphs.num_replays == 1 + 1 + 1 + 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_whisper_engine_encoder_graphs_equal_eager(tmp_path):
    """Seven clips, at most four windows encoded per step: the encoder replays graphs of 1, 2 and 4 windows
    and the transcripts equal those of the same engine with ``enforce_eager`` (logprobs within 2e-3)."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from tests.audio.whisper_reference import build_tiny_random_whisper
    from tests.models.test_whisper_engine import _audios, _prompt
    from tests.models.utils import check_logprobs_close, ours_as_ref

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path = build_tiny_random_whisper(tmp_path)
    audios = _audios(7, [3.0, 8.0, 17.0, 29.0, 12.0, 5.0, 21.0])
    prompts = [{"prompt_token_ids": _prompt(path), "multi_modal_data": {"audio": (audio, 16000)}} for audio in audios]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outputs = {}
    for eager in (True, False):
        llm = LLM(model=str(path), device="cuda", dtype="float32", max_num_seqs=8, enforce_eager=eager,
                  gpu_memory_utilization=0.3, max_num_encoder_input_tokens=4 * 1500)
        outputs[eager] = llm.generate(prompts, params, use_tqdm=False)
        graphs = llm.llm_engine.runner.model.model.encoder.graphs
        if eager:
            assert graphs is None
        else:
            assert graphs is not None and graphs.sizes == [1, 2, 4] and graphs.num_replays >= 2
        del llm
    for i, (with_graphs, eager) in enumerate(zip(outputs[False], outputs[True])):
        check_logprobs_close(ours_as_ref(eager.outputs[0]), ours_as_ref(with_graphs.outputs[0]), f"clip {i}",
                             atol=2e-3)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs CUDA")])])
def test_encoder_adapters_with_encoder_graphs_match_peft(tmp_path, device):
    """With encoder graphs, a step encoding a window under an encoder adapter runs the encoder eagerly (its
    adapter applies) and a step of base windows replays: both equal PEFT's merged models. On CPU the engine's
    tower gets graphs whose replays run eagerly over the static rows (the LoRA manager's real rows batches);
    on CUDA the runner captured real ones."""
    import numpy as np

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from lora.request import LoRARequest
    from tests.audio.whisper_reference import build_tiny_random_whisper
    from tests.lora.test_whisper_lora import MAX_NEW, RANK, TARGETS, _adapter, _hf_whisper
    from tests.models.test_whisper_engine import _prompt, hf_greedy

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    base_dir = build_tiny_random_whisper(tmp_path)
    both_dir, both_ref = _adapter(base_dir, tmp_path / "both", TARGETS, seed=2)
    refs = {None: _hf_whisper(base_dir), "both": both_ref}
    adapters = {"both": LoRARequest("both", 1, str(both_dir))}
    llm = LLM(model=str(base_dir), device=device, dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=RANK, gpu_memory_utilization=0.3)
    tower = llm.llm_engine.runner.model.model.encoder
    if device == "cpu":
        tower.capture_graphs(4, use_graphs=False)
    graphs, eager_forward, eager_calls = tower.graphs, tower._forward_eager, []
    assert graphs is not None

    def counted_eager(features):
        eager_calls.append(features.shape[0])
        return eager_forward(features)

    tower._forward_eager = counted_eager
    prompt = _prompt(base_dir)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=1)
    rng = np.random.default_rng(0)
    for plan in (["both"], [None]):     # an adapted encoder call, then a base one
        audio = (0.1 * rng.standard_normal(16000 * 6)).astype(np.float32)
        replays, eager_before = graphs.num_replays, len(eager_calls)
        outs = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"audio": (audio, 16000)}}]
                            * len(plan), params, use_tqdm=False,
                            lora_request=[None if a is None else adapters[a] for a in plan])
        if "both" in plan:                                       # its window's encoder call ran eagerly
            assert len(eager_calls) > eager_before
        else:
            assert len(eager_calls) == eager_before and graphs.num_replays > replays
        for adapter, out in zip(plan, outs):
            ref_tokens, ref_logprobs = hf_greedy(refs[adapter], audio, prompt, MAX_NEW)
            tokens = list(out.outputs[0].token_ids)
            assert tokens == ref_tokens, adapter
            ours = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens)]
            np.testing.assert_allclose(ours, ref_logprobs, atol=2e-3, err_msg=str(adapter))
