"""Reference runs with transformers and vLLM's comparison rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RefOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    """Per generated token: top-k {token_id: logprob} of the raw log-softmax (+ the chosen token)."""


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, topk: int = 5) -> RefOutput:
    """transformers' ``generate`` (greedy, EOS ignored) with each step's raw logits."""
    gen_cfg = model.generation_config
    gen_cfg.eos_token_id = None
    gen_cfg.pad_token_id = model.config.pad_token_id
    with torch.no_grad():
        ids = torch.tensor([prompt_ids], device=model.device)
        # An explicit mask: otherwise generate() masks prompt tokens equal to pad_token_id.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, generation_config=gen_cfg)
    toks = out.sequences[0, len(prompt_ids):].tolist()
    lps = []
    for step, logits in enumerate(out.logits):
        lp = torch.log_softmax(logits[0].float(), dim=-1)
        top = torch.topk(lp, topk)
        d = {int(i): float(v) for i, v in zip(top.indices, top.values)}
        d[toks[step]] = float(lp[toks[step]])
        lps.append(d)
    return RefOutput(toks, lps)


def ours_as_ref(completion) -> RefOutput:
    """A Chorus CompletionOutput (with logprobs) in the same shape."""
    lps = [{tid: lp.logprob for tid, lp in d.items()} for d in completion.logprobs]
    return RefOutput(list(completion.token_ids), lps)


def hf_float32(model_dir):
    """transformers' model of ``model_dir`` in float32, in eval mode (the reference of the parity tests)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def check_outputs_close(outputs, refs: list[RefOutput], names: list[str]) -> int:
    """``check_logprobs_close`` for each engine ``RequestOutput`` against its reference; returns how many
    match the reference token for token."""
    exact = 0
    for out, ref, name in zip(outputs, refs, names):
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name=name)
        exact += list(out.outputs[0].token_ids) == ref.token_ids
    return exact


def check_logprobs_close(ref: RefOutput, ours: RefOutput, name: str, atol: float = 1e-3) -> int:
    """vLLM's rule: tokens match, or at the first divergence each side's token is in the other's
    top-k; logprobs of the common prefix agree within ``atol``. Returns the matching length."""
    assert len(ours.token_ids) == len(ref.token_ids), f"{name}: lengths {len(ours.token_ids)} vs {len(ref.token_ids)}"
    for i, (a, b) in enumerate(zip(ref.token_ids, ours.token_ids)):
        ref_lp, our_lp = ref.logprobs[i], ours.logprobs[i]
        if a != b:
            assert b in ref_lp, f"{name}: step {i}: our token {b} not in HF top-k {sorted(ref_lp)}"
            assert a in our_lp, f"{name}: step {i}: HF token {a} not in our top-k {sorted(our_lp)}"
            return i
        assert abs(ref_lp[a] - our_lp[b]) <= atol, \
            f"{name}: step {i}: logprob {our_lp[b]:.6f} vs HF {ref_lp[a]:.6f}"
        for tid, v in our_lp.items():
            if tid in ref_lp:
                assert abs(ref_lp[tid] - v) <= atol, \
                    f"{name}: step {i}: top token {tid} logprob {v:.6f} vs HF {ref_lp[tid]:.6f}"
    return len(ref.token_ids)


class EagerReplayGraphs:
    """Stands in for ``engine.cuda_graphs.StepGraphs`` on CPU: same graph choice, same padded
    step layout and the same captured metadata, but "replay" runs the forward eagerly over what
    the buffers hold. Tests the runner's graph path (padding, LoRA variants, logits gathering)
    where no CUDA graph can be captured."""

    @staticmethod
    def install(llm, token_sizes: list[int]):
        from engine.cuda_graphs import StepGraphs

        class _Graphs(StepGraphs):
            def capture(self) -> None:
                for key in self.keys_to_capture():
                    self.graphs[key] = None

            def replay(self, key):
                self.num_replays += 1
                self.num_mixed_replays += key.mixed
                return self._forward(key, self.graph_metadata(key))

        runner = llm.llm_engine.runner
        graphs = _Graphs(runner.model, runner.buffers, runner.max_model_len, runner._graph_sizes, token_sizes,
                         runner.config.scheduler_config.max_num_seqs, lora_manager=runner.lora_manager,
                         policy=runner.policy)
        graphs.capture()
        runner.graphs = graphs
        return graphs


def spy_split_k(monkeypatch) -> list[int]:
    """Record ``num_parts`` of every ``Linear.forward_split_k`` call (the split-K path of
    ``Linear.forward_base``) into the returned list; the calls still run."""
    from engine.layers.linear import Linear

    calls: list[int] = []
    split = Linear.forward_split_k

    def spy(self, x, num_parts):
        calls.append(num_parts)
        return split(self, x, num_parts)
    monkeypatch.setattr(Linear, "forward_split_k", spy)
    return calls
