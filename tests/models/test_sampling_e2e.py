"""Sampling through the whole engine: seeds, top_k=1, stop strings, n > 1, penalties, bad input."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), seed=0)


def _gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_seeded_sampling_reproducible_and_batch_independent(llm, tiny_prompts):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = _gen(llm, [tiny_prompts[0]], p)[0].outputs[0].token_ids
    # Same request, now in the middle of a batch of unseeded companions.
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = _gen(llm, tiny_prompts[1:4] + [tiny_prompts[0]] + tiny_prompts[4:],
                 [others] * 3 + [p] + [others] * 4)
    assert batch[3].outputs[0].token_ids == alone
    again = _gen(llm, [tiny_prompts[0]], p)[0].outputs[0].token_ids
    assert again == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99, ignore_eos=True)
    assert _gen(llm, [tiny_prompts[0]], other_seed)[0].outputs[0].token_ids != alone


def test_top_k_1_equals_greedy(llm, tiny_prompts):
    greedy = _gen(llm, tiny_prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    topk1 = _gen(llm, tiny_prompts, SamplingParams(temperature=0.8, top_k=1, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_stop_string_cut_exactly(llm, tiny_prompts):
    base = _gen(llm, [tiny_prompts[2]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    text = base.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    first = text.find(stop)
    out = _gen(llm, [tiny_prompts[2]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                      stop=[stop]))[0].outputs[0]
    assert out.text == text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    keep = _gen(llm, [tiny_prompts[2]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                       include_stop_str_in_output=True))[0].outputs[0]
    assert keep.text == text[:first + len(stop)]


def test_stop_token_ids_and_min_tokens(llm, tiny_prompts):
    base = _gen(llm, [tiny_prompts[0]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    ids = base.outputs[0].token_ids
    stop_id = ids[4]
    out = _gen(llm, [tiny_prompts[0]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                      stop_token_ids=[stop_id]))[0].outputs[0]
    cut = ids.index(stop_id)
    assert out.token_ids == ids[:cut + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_n_samples_share_prompt_blocks(llm, tiny_prompts):
    prompt = tiny_prompts[5]  # long enough for several full blocks
    before = llm.llm_engine.get_stats().prefix_cache_hits
    out = _gen(llm, [prompt], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    n_prompt = len(out.prompt_token_ids)
    full_blocks = (n_prompt - 1) // 16
    # Samples 1 and 2 read the prompt's full blocks computed for sample 0.
    assert llm.llm_engine.get_stats().prefix_cache_hits - before >= 2 * full_blocks * 16
    assert out.num_cached_tokens >= full_blocks * 16


def test_repetition_penalty_matches_transformers(tiny_llama_dir, llm, tiny_prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt in tiny_prompts[:3]:
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, repetition_penalty=1.3,
                              pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        ours = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                  repetition_penalty=1.3))[0].outputs[0].token_ids
        assert ours == ref


def test_logprobs_and_prompt_logprobs(llm, tiny_llama_dir, tiny_prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    out = _gen(llm, [tiny_prompts[2]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2,
                                                      ignore_eos=True))[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        d = out.prompt_logprobs[pos]
        assert abs(d[ids[pos]].logprob - lp[pos - 1, ids[pos]].item()) < 1e-3
        top = torch.topk(lp[pos - 1], 2).indices.tolist()
        assert all(t in d for t in top)
    c = out.outputs[0]
    assert len(c.logprobs) == 4 and all(len(d) >= 3 for d in c.logprobs)
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
    assert all(d[t].rank == 1 for d, t in zip(c.logprobs, c.token_ids))  # greedy picks rank 1


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(n=0), "n"), (dict(min_p=2.0), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_engine_untouched(llm, tiny_prompts):
    long_prompt = [i % 300 + 10 for i in range(600)]  # max_model_len is 512
    for bad, field in [("", "prompt"), ([], "prompt"), (long_prompt, "max_model_len")]:
        with pytest.raises(ValueError, match=field):
            _gen(llm, [tiny_prompts[0], bad], SamplingParams(max_tokens=4))
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="logprobs"):
        _gen(llm, [tiny_prompts[0]], SamplingParams(max_tokens=2, logprobs=1000))
    with pytest.raises(ValueError, match="n: at most 256"):   # no fan-out into millions of requests
        _gen(llm, [tiny_prompts[0]], SamplingParams(max_tokens=2, n=10**6))
    # The engine still serves everyone else.
    outs = _gen(llm, tiny_prompts[:2], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]


def test_unknown_architecture_and_missing_path(tmp_path, tiny_llama_dir):
    import json
    import shutil

    with pytest.raises(ValueError, match="does not exist|not exist"):
        LLM(str(tmp_path / "no-such-model"))
    d = tmp_path / "weird"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(d))


def test_generation_config_defaults(tmp_path, tiny_llama_dir, tiny_prompts):
    """vLLM's --generation-config auto: the checkpoint's sampling fields are the defaults."""
    import json
    import shutil

    from engine.server.protocol import CompletionRequest
    from engine.server.serving_base import to_sampling_params

    d = tmp_path / "with-gen-config"
    shutil.copytree(tiny_llama_dir, d)
    gc = json.loads((d / "generation_config.json").read_text())
    gc.update(temperature=0.0, top_p=0.5, max_new_tokens=5)
    (d / "generation_config.json").write_text(json.dumps(gc))
    llm = LLM(str(d))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    outs = [llm.generate([tiny_prompts[0]], use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) <= 5
    # Server side: unset request fields take the defaults, set ones win.
    eng = llm.llm_engine.default_sampling_params
    p = to_sampling_params(CompletionRequest(model="m", prompt="x"), max_tokens=4, logprobs=None, defaults=eng)
    assert (p.temperature, p.top_p) == (0.0, 1.0)  # greedy neutralizes top_p
    p = to_sampling_params(CompletionRequest(model="m", prompt="x", temperature=0.7), max_tokens=4, logprobs=None,
                           defaults=eng)
    assert (p.temperature, p.top_p) == (0.7, 0.5)


def test_min_tokens_masks_eos_in_the_sampler(tiny_llama_dir, tiny_prompts):
    """With min_tokens, EOS is masked (not merely ignored): no EOS id appears before min_tokens."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tiny_llama_dir).eos_token_id
    llm = LLM(str(tiny_llama_dir))
    # Find a prompt whose greedy continuation hits EOS early.
    early = None
    for prompt in tiny_prompts:
        ids = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
        if ids.finish_reason == "stop" and len(ids.token_ids) < 20:
            early = (prompt, len(ids.token_ids))
            break
    if early is None:
        pytest.skip("no prompt reaches EOS early on this checkpoint")
    prompt, n = early
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, min_tokens=n + 3),
                       use_tqdm=False)[0].outputs[0]
    assert eos not in out.token_ids[:n + 3]
    assert len(out.token_ids) >= n + 3
