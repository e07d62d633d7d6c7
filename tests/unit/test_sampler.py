"""Sampler: penalties and filters against transformers' logits processors, seeding, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sampler import (
    Sampler,
    apply_penalties,
    compute_prompt_logprobs,
    process_for_sampling,
)
from engine.sampling_metadata import build_sampling_metadata
from engine.sampling_params import SamplingParams

VOCAB = 50
CPU = torch.device("cpu")


def make_meta(params, *, prompts=None, outputs=None, eos=None, seeds=None, vocab=VOCAB,
              device=CPU, mode="raw_logprobs"):
    n = len(params)
    seeds = seeds if seeds is not None else [p.seed for p in params]
    gens = [None if s is None else torch.Generator(device).manual_seed(s) for s in seeds]
    return build_sampling_metadata(
        params, gens,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        eos if eos is not None else [set() for _ in range(n)],
        vocab, device, logprobs_mode=mode)


def rand_logits(rows, vocab=VOCAB, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale  # [rows, vocab]


def sample(logits, params, **kw):
    return Sampler()(logits, make_meta(params, **kw))


# ----------------------------------------------------------------------------------------
# Greedy
# ----------------------------------------------------------------------------------------
def test_greedy_fast_path_is_argmax():
    logits = rand_logits(7)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 7)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist() == out.sampled_token_id_list
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs is None


def test_temperature_zero_and_top_k_1_are_greedy_in_mixed_batch():
    logits = rand_logits(6, seed=1)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=1.5),
              SamplingParams(temperature=1.0), SamplingParams(top_k=1, seed=3),
              SamplingParams(temperature=0.0, presence_penalty=0.5), SamplingParams(temperature=2.0)]
    for _ in range(5):
        out = sample(logits, params, outputs=[[], [], [], [], [], []])
        ids = out.sampled_token_id_list
        assert [ids[0], ids[1], ids[3], ids[4]] == logits.argmax(-1)[[0, 1, 3, 4]].tolist()


def test_top_k_1_equals_greedy_with_penalties():
    logits = rand_logits(4, seed=2)
    outputs = [[int(logits[i].argmax())] * 2 for i in range(4)]
    pen = dict(repetition_penalty=1.3, frequency_penalty=0.7)
    greedy = sample(logits, [SamplingParams(temperature=0.0, **pen)] * 4, outputs=outputs)
    topk1 = sample(logits, [SamplingParams(top_k=1, temperature=0.8, **pen)] * 4, outputs=outputs)
    assert greedy.sampled_token_id_list == topk1.sampled_token_id_list
    assert greedy.sampled_token_id_list != logits.argmax(-1).tolist()  # the penalties moved it


def test_empty_batch_and_input_not_modified():
    out = sample(torch.zeros(0, VOCAB), [])
    assert out.sampled_token_id_list == []
    logits = rand_logits(3)
    before = logits.clone()
    sample(logits, [SamplingParams(repetition_penalty=2.0, temperature=0.5, top_p=0.5, logprobs=2)] * 3,
           outputs=[[1, 2], [3], []], prompts=[[4], [5], [6]])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_half_precision_logits_sample_as_their_float32_upcast(mode):
    """The models hand over logits in their own dtype; every path must act as on the float32 copy."""
    logits = rand_logits(6, seed=21).bfloat16()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.0, repetition_penalty=1.4), SamplingParams(temperature=0.9, seed=5),
              SamplingParams(top_p=0.8, seed=6, logprobs=2), SamplingParams(top_k=3, min_p=0.1, seed=7)]
    outputs = [[int(logits[i].float().argmax())] for i in range(6)]
    for rows in (slice(0, 1), slice(0, 6)):   # the greedy fast path alone, then every path
        half = sample(logits[rows], params[rows], outputs=outputs[rows], mode=mode)
        full = sample(logits[rows].float(), params[rows], outputs=outputs[rows], mode=mode)
        assert half.sampled_token_id_list == full.sampled_token_id_list
        assert (half.logprobs is None) == (full.logprobs is None)
        if full.logprobs is not None:
            assert half.logprobs.token_ids == full.logprobs.token_ids
            assert half.logprobs.logprobs == full.logprobs.logprobs
            assert half.logprobs.ranks == full.logprobs.ranks
    assert half.sampled_token_id_list[2] != outputs[2][0]   # the penalty moved row 2 off its argmax


# ----------------------------------------------------------------------------------------
# Penalties
# ----------------------------------------------------------------------------------------
def test_repetition_penalty_matches_hf():
    logits = rand_logits(3, seed=4)
    prompts = [[1, 2, 3, 3], [10, 49], []]
    outputs = [[5, 1], [], [7, 7, 8]]
    reps = [1.5, 0.7, 2.0]
    params = [SamplingParams(repetition_penalty=r) for r in reps]
    got = apply_penalties(logits.clone(), make_meta(params, prompts=prompts, outputs=outputs))
    for i, r in enumerate(reps):
        ids = torch.tensor([prompts[i] + outputs[i]])
        want = RepetitionPenaltyLogitsProcessor(penalty=r)(ids, logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], want)


def test_presence_frequency_penalties_match_openai_formula():
    logits = rand_logits(3, seed=5)
    outputs = [[5, 5, 5, 9], [], [0, 49, 49]]
    prompts = [[6, 7], [1], [2]]  # the prompt must not count for presence/frequency
    pens = [(0.5, 0.3), (1.0, 1.0), (-0.4, 1.2)]
    params = [SamplingParams(presence_penalty=p, frequency_penalty=f) for p, f in pens]
    got = apply_penalties(logits.clone(), make_meta(params, prompts=prompts, outputs=outputs))
    want = logits.clone()
    for i, (pres, freq) in enumerate(pens):
        for tok in set(outputs[i]):
            count = outputs[i].count(tok)
            want[i, tok] -= freq * count + pres
    torch.testing.assert_close(got, want)


def test_all_penalties_in_vllm_order():
    logits = rand_logits(1, seed=6)
    prompt, output = [3, 4], [4, 4, 8]
    params = [SamplingParams(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2)]
    got = apply_penalties(logits.clone(), make_meta(params, prompts=[prompt], outputs=[output]))
    want = RepetitionPenaltyLogitsProcessor(penalty=1.4)(torch.tensor([prompt + output]), logits.clone())
    for tok in set(output):
        want[0, tok] -= 0.2 * output.count(tok) + 0.3
    torch.testing.assert_close(got, want)


def test_greedy_uses_penalized_logits():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8] = 2.0, 1.9
    out = sample(logits, [SamplingParams(temperature=0.0, presence_penalty=0.5)], outputs=[[7]])
    assert out.sampled_token_id_list == [8]


# ----------------------------------------------------------------------------------------
# Temperature and filters
# ----------------------------------------------------------------------------------------
FILTER_CASES = [
    dict(temperature=0.7),
    dict(top_k=5),
    dict(top_k=5, temperature=1.8),
    dict(top_p=0.6),
    dict(top_p=0.9, temperature=0.5),
    dict(min_p=0.1),
    dict(min_p=0.05, temperature=1.3),
    dict(top_k=10, top_p=0.8, min_p=0.02, temperature=0.9),
]


def hf_chain(row_logits, kw):
    scores = row_logits[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    if kw.get("temperature", 1.0) != 1.0:
        scores = TemperatureLogitsWarper(kw["temperature"])(ids, scores)
    if kw.get("top_k", 0):
        scores = TopKLogitsWarper(kw["top_k"])(ids, scores)
    if kw.get("top_p", 1.0) < 1.0:
        scores = TopPLogitsWarper(kw["top_p"])(ids, scores)
    if kw.get("min_p", 0.0) > 0.0:
        scores = MinPLogitsWarper(kw["min_p"])(ids, scores)
    return scores[0]


def test_filters_match_hf_warpers_in_one_mixed_batch():
    logits = rand_logits(len(FILTER_CASES) + 1, seed=7)
    params = [SamplingParams(**kw) for kw in FILTER_CASES] + [SamplingParams(temperature=0.0)]
    got = process_for_sampling(logits.clone(), make_meta(params))
    for i, kw in enumerate(FILTER_CASES):
        want = hf_chain(logits[i], kw)
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(want)), kw
        keep = torch.isfinite(want)
        torch.testing.assert_close(got[i][keep], want[keep])
    assert torch.equal(got[-1], logits[-1])  # temperature-0 row: untouched
    survivors = [int(torch.isfinite(got[i]).sum()) for i in range(len(FILTER_CASES))]
    assert survivors[1] == 5 and all(0 < s < VOCAB for s in survivors[1:])


def test_sampled_tokens_stay_in_hf_surviving_set():
    kw = dict(top_k=10, top_p=0.7, min_p=0.05, temperature=1.2)
    logits = rand_logits(1, seed=8).expand(500, VOCAB).contiguous()
    allowed = set(torch.isfinite(hf_chain(logits[0], kw)).nonzero().flatten().tolist())
    torch.manual_seed(0)
    got = set(sample(logits, [SamplingParams(**kw)] * 500).sampled_token_id_list)
    assert got <= allowed and len(got) > 1


def test_distribution_matches_softmax_over_temperature():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0]])
    temp, draws = 0.7, 20000
    want = (logits[0] / temp).softmax(-1)
    torch.manual_seed(1234)
    out = sample(logits.expand(draws, 5).contiguous(), [SamplingParams(temperature=temp)] * draws)
    freq = torch.bincount(torch.tensor(out.sampled_token_id_list), minlength=5).float() / draws
    assert (freq - want).abs().max() < 0.015, (freq, want)
    # One seeded row over many calls draws from the same distribution.
    meta = make_meta([SamplingParams(temperature=temp, seed=99)], vocab=5)
    sampler, calls = Sampler(), 3000
    ids = [sampler(logits, meta).sampled_token_id_list[0] for _ in range(calls)]
    freq = torch.bincount(torch.tensor(ids), minlength=5).float() / calls
    assert (freq - want).abs().max() < 0.03, (freq, want)


def test_distribution_with_top_k_is_renormalized():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    draws = 20000
    torch.manual_seed(7)
    out = sample(logits.expand(draws, 5).contiguous(), [SamplingParams(top_k=2)] * draws, vocab=5)
    freq = torch.bincount(torch.tensor(out.sampled_token_id_list), minlength=5).float() / draws
    want = torch.cat([logits[0, :2].softmax(-1), torch.zeros(3)])
    assert (freq - want).abs().max() < 0.015, (freq, want)


# ----------------------------------------------------------------------------------------
# Seeds
# ----------------------------------------------------------------------------------------
def seeded_run(logits_rows, params, steps=4):
    """Sample `steps` times with fresh generators built once (state advances across steps)."""
    meta = make_meta(params)
    return [Sampler()(logits_rows, meta).sampled_token_id_list for _ in range(steps)]


def test_seeded_rows_repeat_across_calls():
    logits = rand_logits(2, seed=9, scale=0.5)  # flat: draws vary
    params = [SamplingParams(seed=42), SamplingParams(seed=43, top_p=0.9)]
    assert seeded_run(logits, params) == seeded_run(logits, params)


def test_seeded_rows_independent_of_companions_and_position():
    row = rand_logits(1, seed=10, scale=0.5)
    seeded = SamplingParams(seed=1234, temperature=0.9)
    alone = [s[0] for s in seeded_run(row, [seeded], steps=6)]
    others = rand_logits(4, seed=11)
    companions = [SamplingParams(), SamplingParams(seed=7), SamplingParams(temperature=0.0),
                  SamplingParams(top_k=3, presence_penalty=1.0)]
    for pos in (0, 2, 4):
        batch = torch.cat([others[:pos], row, others[pos:]])
        params = companions[:pos] + [seeded] + companions[pos:]
        torch.manual_seed(pos)  # unseeded companions draw differently each time
        assert [s[pos] for s in seeded_run(batch, params, steps=6)] == alone


def test_different_seeds_differ():
    logits = rand_logits(1, seed=12, scale=0.1)
    runs = [tuple(s[0] for s in seeded_run(logits, [SamplingParams(seed=seed)], steps=8))
            for seed in range(4)]
    assert len(set(runs)) == 4


# ----------------------------------------------------------------------------------------
# min_tokens
# ----------------------------------------------------------------------------------------
def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    eos, stop = 3, 17
    logits = torch.zeros(1, VOCAB)
    logits[0, eos], logits[0, stop], logits[0, 20] = 10.0, 9.0, 1.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])]
    picks = [sample(logits, params, outputs=[[0] * n], eos=[{eos}]).sampled_token_id_list[0]
             for n in range(5)]
    assert picks == [20, 20, 20, eos, eos]


def test_min_tokens_with_ignore_eos_masks_only_stop_ids():
    eos, stop = 3, 17
    logits = torch.zeros(2, VOCAB)
    logits[:, stop], logits[:, eos], logits[:, 20] = 10.0, 9.0, 1.0
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop], ignore_eos=True),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop])]
    out = sample(logits, params, outputs=[[1], [1, 2]], eos=[{eos}, {eos}])
    assert out.sampled_token_id_list == [eos, stop]


def test_min_tokens_applies_to_random_rows():
    eos = 3
    logits = torch.zeros(200, VOCAB)
    logits[:, eos] = 8.0
    out = sample(logits, [SamplingParams(min_tokens=1)] * 200, eos=[{eos}] * 200)
    assert eos not in out.sampled_token_id_list


# ----------------------------------------------------------------------------------------
# Logprobs
# ----------------------------------------------------------------------------------------
def check_row(lp_lists, i, logprobs_row, n):
    ids, lps, rank = lp_lists.token_ids[i], lp_lists.logprobs[i], lp_lists.ranks[i]
    assert len(ids) == len(lps) == n + 1
    sampled = ids[0]
    assert lps[0] == pytest.approx(float(logprobs_row[sampled]), abs=1e-6)
    assert rank == int((logprobs_row > logprobs_row[sampled]).sum()) + 1
    top_vals, top_ids = logprobs_row.topk(n)
    assert ids[1:] == top_ids.tolist()
    assert lps[1:] == pytest.approx(top_vals.tolist(), abs=1e-6)
    assert lps[1:] == sorted(lps[1:], reverse=True)


def test_raw_logprobs_values_ranks_and_top_n():
    logits = rand_logits(4, seed=13)
    params = [SamplingParams(logprobs=3, temperature=0.0), SamplingParams(logprobs=5, temperature=1.0),
              SamplingParams(), SamplingParams(logprobs=0, repetition_penalty=1.5)]
    torch.manual_seed(0)
    out = sample(logits, params, outputs=[[1], [2], [3], [int(logits[3].argmax())]])
    raw = logits.log_softmax(-1)
    assert out.logprobs is not None
    check_row(out.logprobs, 0, raw[0], 3)
    check_row(out.logprobs, 1, raw[1], 5)
    check_row(out.logprobs, 3, raw[3], 0)
    assert out.logprobs.token_ids[2] == [] and out.logprobs.logprobs[2] == [] and out.logprobs.ranks[2] == 0
    sampled = out.sampled_token_id_list
    assert [ids[0] for ids in out.logprobs.token_ids if ids] == [sampled[i] for i in (0, 1, 3)]
    assert out.logprobs.ranks[0] == 1  # greedy of unpenalized logits


def test_sampled_rank_not_one_when_random():
    logits = torch.zeros(300, VOCAB)
    torch.manual_seed(0)
    out = sample(logits + rand_logits(1, seed=14, scale=0.3), [SamplingParams(logprobs=2)] * 300)
    assert max(out.logprobs.ranks) > 1
    raw = (logits + rand_logits(1, seed=14, scale=0.3)).log_softmax(-1)
    for i in range(0, 300, 37):
        check_row(out.logprobs, i, raw[i], 2)


def test_processed_logprobs_differ_from_raw_under_penalties():
    logits = rand_logits(2, seed=15)
    params = [SamplingParams(temperature=0.0, logprobs=4, frequency_penalty=1.5),
              SamplingParams(temperature=0.0, logprobs=4, frequency_penalty=1.5)]
    outputs = [[int(logits[0].argmax())] * 2, [int(logits[1].argmax())]]
    raw = sample(logits, params, outputs=outputs, mode="raw_logprobs")
    proc = sample(logits, params, outputs=outputs, mode="processed_logprobs")
    assert raw.sampled_token_id_list == proc.sampled_token_id_list
    assert raw.logprobs.logprobs != proc.logprobs.logprobs
    want = apply_penalties(logits.clone(), make_meta(params, outputs=outputs)).log_softmax(-1)
    for i in range(2):
        check_row(proc.logprobs, i, want[i], 4)
        assert proc.logprobs.ranks[i] == 1


def test_processed_logprobs_include_temperature_and_filters():
    logits = rand_logits(1, seed=16)
    params = [SamplingParams(temperature=0.5, top_k=4, logprobs=6)]
    out = sample(logits, params, mode="processed_logprobs")
    want = process_for_sampling(logits.clone(), make_meta(params)).log_softmax(-1)
    check_row(out.logprobs, 0, want[0], 6)
    assert math.isinf(out.logprobs.logprobs[0][-1])  # only 4 tokens survive top-k
    logits_mode = sample(logits, params, mode="raw_logits")
    assert logits_mode.logprobs.logprobs[0][1] == pytest.approx(float(logits.max()))


def test_compute_prompt_logprobs():
    logits = rand_logits(6, seed=17)
    targets = torch.tensor([0, 5, 49, 7, 7, 12])
    got = compute_prompt_logprobs(logits, targets, num_logprobs=3)
    want = logits.log_softmax(-1)
    assert len(got.token_ids) == 6
    for i in range(6):
        assert got.token_ids[i][0] == int(targets[i])
        check_row(got, i, want[i], 3)
    zero = compute_prompt_logprobs(logits, targets, num_logprobs=0)
    assert zero.token_ids == [[t] for t in targets.tolist()]


# ----------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_seeded_and_logprobs():
    dev = torch.device("cuda")
    logits = rand_logits(3, seed=18, scale=0.5).to(dev)
    params = [SamplingParams(seed=5, logprobs=2), SamplingParams(temperature=0.0, presence_penalty=1.0),
              SamplingParams(top_p=0.8, top_k=7, min_p=0.01)]
    a = Sampler()(logits, make_meta(params, outputs=[[1], [2], [3]], device=dev))
    b = Sampler()(logits[:1], make_meta(params[:1], outputs=[[1]], device=dev))
    assert a.sampled_token_id_list[0] == b.sampled_token_id_list[0]
    assert a.sampled_token_ids.device.type == "cuda"
    check_row(a.logprobs, 0, logits.log_softmax(-1)[0].cpu(), 2)
