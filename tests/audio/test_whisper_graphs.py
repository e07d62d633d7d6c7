"""Whisper decode steps over static cross-attention buffers (``engine.runner.cross_buffers``), as CUDA graphs
run them.

On CPU: the metadata a step fills (real rows, then padding rows of a decode graph's batch) and the views a
capture holds, which see every later step's values; padding rows change no real row's attention; and the
runner's graph path with a stand-in for the graphs (``_EagerReplay``: it "captures" the metadata views and
"replays" by running the forward over them eagerly, so a replay reads only the static buffers) gives the
same tokens and logprobs as eager steps, with requests finishing mid-batch and new ones joining; with LoRA
too (two PEFT adapters and base requests, the LoRA and base graph variants).

On CUDA (``gpu``): the real tiny.en with CUDA graphs equals the same engine with ``enforce_eager`` on speech
clips of different lengths, requests finishing and joining mid-batch, and the steps took the graphs; the tiny
random Whisper with LoRA likewise.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
import torch

from engine.attention import cross_attention_torch
from engine.cuda_graphs import GraphKey, StepGraphs
from engine.llm import LLM
from engine.runner.cross_buffers import CrossAttentionBuffers
from engine.sampling_params import SamplingParams
from lora.request import LoRARequest
from tests.audio.whisper_reference import load_wav

BLOCKS = 5


def _tables(rows: list[list[int]]) -> np.ndarray:
    out = np.zeros((len(rows), BLOCKS), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def test_prepare_fills_real_then_padding_rows():
    buf = CrossAttentionBuffers(8, BLOCKS, 20, torch.device("cpu"))
    tables = _tables([[3, 4, 5], [7, 8], [9]])
    meta = buf.prepare(tables, np.array([11, 8, 2], np.int32), np.array([1, 1, 1]), num_reqs_padded=6)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert meta.seq_lens.tolist() == [11, 8, 2, 1, 1, 1]
    assert meta.block_tables[:3].tolist() == tables.tolist()
    assert not meta.block_tables[3:].any()
    assert (meta.max_query_len, meta.max_seq_len, meta.num_decode_reqs) == (1, 11, 6)
    assert meta.query_start_loc_cpu == meta.query_start_loc.tolist()
    # An eager mixed step: no padding, its own bounds; rows left from the padded step are not in its views.
    meta = buf.prepare(tables[:2], np.array([11, 8], np.int32), np.array([1, 4]))
    assert meta.query_start_loc.tolist() == [0, 1, 5] and meta.seq_lens.tolist() == [11, 8]
    assert (meta.max_query_len, meta.num_decode_reqs, meta.block_tables.shape[0]) == (4, 1, 2)
    with pytest.raises(RuntimeError, match="does not fit"):
        buf.prepare(tables, np.array([1, 1, 1], np.int32), np.array([1, 1, 1]), num_reqs_padded=9)


def test_capture_views_read_each_later_step():
    buf = CrossAttentionBuffers(8, BLOCKS, 20, torch.device("cpu"))
    captured = buf.capture_metadata(4)
    assert captured.captured and (captured.max_query_len, captured.max_seq_len) == (1, 20)
    assert captured.seq_lens.tolist() == [1, 1, 1, 1] and captured.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    for step, lengths in enumerate(([5, 6, 7], [9, 2], [20, 20, 20, 20])):
        n = len(lengths)
        buf.prepare(_tables([[step + 1 + i] for i in range(n)]), np.array(lengths, np.int32),
                    np.ones(n, np.int64), num_reqs_padded=4)
        assert captured.seq_lens.tolist() == lengths + [1] * (4 - n)
        assert captured.block_tables[:, 0].tolist() == [step + 1 + i for i in range(n)] + [0] * (4 - n)


def test_padding_rows_change_no_real_row():
    torch.manual_seed(0)
    block_size, heads, dim = 4, 2, 8
    k_cache = torch.randn(12, block_size, heads, dim)
    v_cache = torch.randn(12, block_size, heads, dim)
    tables = _tables([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]])
    lengths = np.array([10, 7, 19], np.int32)
    q = torch.randn(3, heads, dim)
    buf = CrossAttentionBuffers(8, BLOCKS, 20, torch.device("cpu"))
    eager = cross_attention_torch(q, k_cache, v_cache, buf.prepare(tables, lengths, np.ones(3, np.int64)), 0.3)
    padded_q = torch.cat([q, torch.randn(5, heads, dim)])
    padded = cross_attention_torch(padded_q, k_cache, v_cache,
                                   buf.prepare(tables, lengths, np.ones(3, np.int64), num_reqs_padded=8), 0.3)
    torch.testing.assert_close(padded[:3], eager, rtol=0, atol=0)
    # Each real row attends over its own blocks only: request 1 over blocks 4, 5 (7 positions).
    k = k_cache[[4, 5]].reshape(-1, heads, dim)[:7]
    v = v_cache[[4, 5]].reshape(-1, heads, dim)[:7]
    ref = torch.softmax(torch.einsum("hd,shd->hs", q[1], k) * 0.3, dim=-1)
    torch.testing.assert_close(eager[1], torch.einsum("hs,shd->hd", ref, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("counts", [[1, 1, 1], [1, 1, 3]], ids=["decodes", "mixed"])
def test_cpu_decode_kernel_rows_equal_sdpa(counts):
    """The CPU backend attends every token through the decode kernel as a one-query request over its request's
    blocks, in place: the gather + SDPA path's values, in decode steps and with a multi-token prompt."""
    from engine import envs
    from engine.attention import select_backend
    backend = select_backend(torch.device("cpu"), cpu_kernel_dir=envs.cpu_kernel_dir())
    if backend.cpu_decode is None:
        pytest.skip("the CPU decode kernel cannot be built here")
    torch.manual_seed(1)
    k_cache = torch.randn(12, 8, 2, 16)
    v_cache = torch.randn(12, 8, 2, 16)
    buf = CrossAttentionBuffers(8, BLOCKS, 40, torch.device("cpu"))
    meta = buf.prepare(_tables([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]), np.array([20, 9, 37], np.int32),
                       np.array(counts))
    q = torch.randn(sum(counts), 4, 16)
    got = backend.attend_cross(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(got, cross_attention_torch(q, k_cache, v_cache, meta, 0.25), rtol=1e-5, atol=1e-5)


class _EagerReplay(StepGraphs):
    """CPU stand-in for the captured graphs: ``capture`` keeps each decode key's capture-time metadata (views of
    the static buffers, bounds of the bucket), ``replay`` runs the forward over exactly those objects."""

    def capture(self) -> None:
        for key in self.keys_to_capture():
            self._fill_padding(key)
            self.graphs[key] = (self.graph_metadata(key), self.cross_metadata(key.size))
        self.replayed_keys: list[GraphKey] = []

    @property
    def replayed_sizes(self) -> list[int]:
        return [key.size for key in self.replayed_keys]

    def replay(self, key) -> torch.Tensor:
        meta, cross_meta = self.graphs[key]
        self.num_replays += 1
        self.replayed_keys.append(key)
        return self._forward(key, meta, cross_meta)

    @classmethod
    def install(cls, llm: LLM) -> "_EagerReplay":
        """Put the stand-in in place of ``llm``'s runner graphs (with its LoRA manager, if any) and capture."""
        runner = llm.llm_engine.core.runner
        runner.graphs = cls(runner.model, runner.buffers, runner.max_model_len, runner._graph_sizes, [],
                            runner.config.scheduler_config.max_num_seqs, lora_manager=runner.lora_manager,
                            policy=runner.policy, cross_metadata=runner.cross_attention.buffers.capture_metadata)
        runner.graphs.capture()
        return runner.graphs


def _requests(n: int) -> tuple[list[dict], list[SamplingParams]]:
    """n transcription requests over three committed clips, with max_tokens of 3..14 (finishing at
    different steps)."""
    clips = [load_wav(name)[0] for name in ("fox", "hello", "weather")]
    prompts = [{"prompt_token_ids": None, "multi_modal_data": {"audio": (clips[i % 3], 16000)}} for i in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + (5 * i) % 12, logprobs=1) for i in range(n)]
    return prompts, params


def _run(llm: LLM, prompt_ids: list[int], n: int, lora_requests: Optional[list] = None) -> list:
    prompts, params = _requests(n)
    for p in prompts:
        p["prompt_token_ids"] = prompt_ids
    return llm.generate(prompts, params, lora_request=lora_requests, use_tqdm=False)


def _assert_same(outs, ref, atol: float) -> None:
    for got, want in zip(outs, ref):
        tokens = list(got.outputs[0].token_ids)
        assert tokens == list(want.outputs[0].token_ids)
        ours = [step[t].logprob for step, t in zip(got.outputs[0].logprobs, tokens)]
        theirs = [step[t].logprob for step, t in zip(want.outputs[0].logprobs, tokens)]
        np.testing.assert_allclose(ours, theirs, atol=atol, rtol=0)


def _decoder_prompt(llm: LLM) -> list[int]:
    ids = llm.llm_engine.processor.transcriber.ids
    return [ids.sot, ids.no_timestamps]


def test_graph_path_over_static_buffers_equals_eager(tiny_random_whisper_dir):
    """The runner's decode-graph path (buffers padded to the bucket, the forward reading only the capture's
    metadata views) gives eager's tokens and logprobs; 7 requests through 4 rows: rows finish and new requests
    join while others decode, so buckets of 1, 2 and 4 rows run with padding."""
    kw = dict(model=str(tiny_random_whisper_dir), device="cpu", dtype="float32", max_num_seqs=4)
    eager = LLM(**kw)
    prompt = _decoder_prompt(eager)
    ref = _run(eager, prompt, 7)
    llm = LLM(**kw)
    graphs = _EagerReplay.install(llm)
    outs = _run(llm, prompt, 7)
    _assert_same(outs, ref, atol=1e-5)
    sizes = graphs.replayed_sizes
    assert len(sizes) >= 10 and {1, 2, 4} <= set(sizes)
    assert any(len(set(o.outputs[0].token_ids)) > 1 for o in outs)   # not one repeated token


@pytest.fixture(scope="module")
def whisper_adapters(tiny_random_whisper_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    """Two PEFT adapters of the tiny random Whisper: "dec" on the decoder's projections only, "both" on the
    encoder's and the decoder's (cross K/V included)."""
    from tests.lora.test_whisper_lora import DECODER_ONLY, TARGETS, _adapter
    root = tmp_path_factory.mktemp("whisper-graph-lora")
    dec, _ = _adapter(tiny_random_whisper_dir, root / "dec", DECODER_ONLY, seed=1)
    both, _ = _adapter(tiny_random_whisper_dir, root / "both", TARGETS, seed=2)
    return {"dec": LoRARequest("dec", 1, str(dec)), "both": LoRARequest("both", 2, str(both))}


LORA_PLANS = ([None, "dec", "both", None, "dec", "both", "dec", None],
              ["both", None, "both", "dec", None, "dec", None, "both"])
"""Each request's adapter (None: the base model), one list per ``generate`` call: the adapters of the rows
running together change from step to step as requests finish and join."""


def test_graph_path_with_lora_equals_eager(tiny_random_whisper_dir, whisper_adapters):
    """With LoRA on, the decode-graph path (the LoRA meta buffers filled with the fixed grid a LoRA graph is
    captured with, the cross-attention metadata from the capture's views) gives eager's tokens and logprobs:
    two adapters (one adapting the encoder and the cross K/V) and base requests, 8 per call through 4 rows;
    steps with an adapter replay the LoRA variant, base-only steps the variant without LoRA."""
    kw = dict(model=str(tiny_random_whisper_dir), device="cpu", dtype="float32", max_num_seqs=4,
              enable_lora=True, max_loras=2, max_lora_rank=8)
    eager, llm = LLM(**kw), LLM(**kw)
    prompt = _decoder_prompt(eager)
    graphs = _EagerReplay.install(llm)
    assert {k.lora for k in graphs.graphs} == {True, False}
    differs = 0   # requests of one clip under different adapters whose first tokens differ
    # The second call's one-token prompts: a request's first step is a decode step, whose graph replays right
    # after the request's cross K/V are written under its adapter.
    for plan, prompt_ids in zip(LORA_PLANS, (prompt, prompt[:1])):
        lora_requests = [None if a is None else whisper_adapters[a] for a in plan]
        ref = _run(eager, prompt_ids, len(plan), lora_requests)
        outs = _run(llm, prompt_ids, len(plan), lora_requests)
        _assert_same(outs, ref, atol=1e-5)
        first = [tuple(o.outputs[0].token_ids[:3]) for o in outs]
        differs += sum(first[i] != first[j] for i in range(len(plan)) for j in range(i + 3, len(plan), 3)
                       if plan[i] != plan[j])
    assert differs > 0
    assert eager.llm_engine.core.runner.graphs is None
    keys = graphs.replayed_keys
    assert len(keys) >= 20 and {1, 2, 4} <= {k.size for k in keys}
    assert any(k.lora for k in keys) and not all(k.lora for k in keys)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_dir", ["tiny_en_dir", "tiny_random_whisper_dir"])
def test_tiny_en_cuda_graphs_equal_eager(model_dir, request):
    """Real tiny.en (and the tests' tiny random Whisper, which needs no weights) on CUDA (float32, TF32 off): 12
    transcriptions through 8 rows with CUDA graphs equal the same engine with enforce_eager; decode steps
    replayed graphs (padded buckets included)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    kw = dict(model=str(request.getfixturevalue(model_dir)), device="cuda", dtype="float32", max_num_seqs=8,
              gpu_memory_utilization=0.3)
    eager = LLM(enforce_eager=True, **kw)
    prompt = _decoder_prompt(eager)
    ref = _run(eager, prompt, 12)
    assert eager.llm_engine.core.runner.graphs is None
    eager.close()
    llm = LLM(**kw)
    graphs = llm.llm_engine.core.runner.graphs
    assert graphs is not None and graphs.num_mixed_replays == 0
    outs = _run(llm, prompt, 12)
    _assert_same(outs, ref, atol=1e-3)
    assert graphs.num_replays >= 10 and graphs.num_mixed_replays == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_with_lora_equal_eager(tiny_random_whisper_dir, whisper_adapters):
    """The tests' tiny random Whisper on CUDA (float32, TF32 off) with LoRA on: 12 transcriptions of two adapters
    and the base model through 8 rows with CUDA graphs equal the same engine with enforce_eager; decode steps
    replayed graphs, those with an adapter the LoRA variants."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    kw = dict(model=str(tiny_random_whisper_dir), device="cuda", dtype="float32", max_num_seqs=8,
              gpu_memory_utilization=0.3, enable_lora=True, max_loras=2, max_lora_rank=8)
    plan = (LORA_PLANS[0] + LORA_PLANS[1])[:12]
    lora_requests = [None if a is None else whisper_adapters[a] for a in plan]
    eager = LLM(enforce_eager=True, **kw)
    prompt = _decoder_prompt(eager)
    ref = _run(eager, prompt, 12, lora_requests)
    assert eager.llm_engine.core.runner.graphs is None
    eager.close()
    llm = LLM(**kw)
    graphs = llm.llm_engine.core.runner.graphs
    assert graphs is not None and any(k.lora for k in graphs.graphs)
    replayed: list[GraphKey] = []
    replay = graphs.replay

    def spy(key: GraphKey) -> torch.Tensor:
        replayed.append(key)
        return replay(key)
    graphs.replay = spy
    outs = _run(llm, prompt, 12, lora_requests)
    _assert_same(outs, ref, atol=1e-3)
    assert len(replayed) >= 10 and any(k.lora for k in replayed)
