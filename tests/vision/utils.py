"""The transformers reference of a vision-language prompt: greedy generate, each step's top-5 logprobs."""

from __future__ import annotations

import torch

from tests.models.utils import RefOutput


def hf_generate_greedy(model, inputs: dict, max_new_tokens: int) -> RefOutput:
    """``model.generate(**inputs)`` greedily with EOS ignored; per step the chosen token's and the
    top-5 raw logprobs (the shape ``check_logprobs_close`` compares)."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    toks = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    lps = []
    for step, logits in enumerate(out.logits):
        lp = torch.log_softmax(logits[0].float(), dim=-1)
        top = torch.topk(lp, 5)
        d = {int(i): float(v) for i, v in zip(top.indices, top.values)}
        d[toks[step]] = float(lp[toks[step]])
        lps.append(d)
    return RefOutput(toks, lps)
