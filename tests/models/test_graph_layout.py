"""The runner's CUDA-graph path, run on CPU: padded decode and mixed-step layouts give the eager result.

``EagerReplayGraphs`` keeps everything of ``StepGraphs`` but the capture: graph choice per step,
requests padded to the bucket (decode) or to max_num_seqs with zero-token requests and padding
tokens that belong to no request (mixed), KV slot -1 and adapter -1 for padding, hidden states
of the whole bucket and logits gathered at the sampled rows. Outputs must equal the plain eager
engine's (same float32 kernels; vLLM's top-5 rule and 1e-3 logprobs).
"""

from __future__ import annotations

from engine import LLM, SamplingParams
from tests.models.utils import EagerReplayGraphs, check_logprobs_close, ours_as_ref

MAX_TOKENS = 12


def _params():
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def test_graph_layouts_match_eager(tiny_llama_dir, tiny_prompts):
    kw = dict(max_num_seqs=6, max_num_batched_tokens=40, block_size=16, enable_prefix_caching=False)
    ref = LLM(str(tiny_llama_dir), **kw).generate(tiny_prompts, _params(), use_tqdm=False)

    llm = LLM(str(tiny_llama_dir), **kw)
    graphs = EagerReplayGraphs.install(llm, token_sizes=[16, 24, 40])
    outs = llm.generate(tiny_prompts, _params(), use_tqdm=False)
    for i, (o, r) in enumerate(zip(outs, ref)):
        check_logprobs_close(ours_as_ref(r.outputs[0]), ours_as_ref(o.outputs[0]), name=f"prompt {i}")
    # Chunked prefill with 6 running requests: mixed steps and decode-only steps both replayed.
    assert graphs.num_mixed_replays > 0
    assert graphs.num_replays - graphs.num_mixed_replays > 0
    stats = llm.llm_engine.get_stats()
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0
