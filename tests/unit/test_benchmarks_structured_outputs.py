"""benchmarks/structured_outputs.py on the tiny Llama: 4 requests offline and through ``chorus serve``, each
side's tokens and rates, the replayed lengths, the engine's grammar work, and the compile times of the schema
set, all in the JSON it writes."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_module import load_benchmark
from tests.conftest import build_tiny_checkpoint
from tests.structured_output.schemas import SCHEMAS


@pytest.fixture(scope="module")
def long_context_llama(tmp_path_factory):
    """The tiny Llama with room for the set's prompts (its 384-token BPE spells them in ~500-900 ids)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-2k"), "llama",
                                 max_position_embeddings=2048)


def test_structured_outputs_benchmark_writes_both_sides(long_context_llama, tmp_path):
    bench = load_benchmark("structured_outputs.py", "bench_structured_outputs_unit")
    out = tmp_path / "so.json"
    result = bench.main(["--model", str(long_context_llama), "--num-prompts", "4", "--batch-size", "2",
                         "--output-len", "8", "--max-model-len", "2048", "--serve-clients", "2",
                         "--compile-rounds", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    for mode in ("offline", "served"):
        s = result[mode]
        for key in ("constrained_tok_s", "unconstrained_tok_s", "ratio", "median_round_ratio",
                    "overhead_us_per_request_step", "mean_output_len_constrained",
                    "mean_output_len_unconstrained"):
            assert key in s, (mode, key)
        (r,) = s["rounds"]
        c, f = r["constrained"], r["unconstrained"]
        assert c["requests"] == f["requests"] == 4
        assert c["output_tokens"] == f["output_tokens"] > 0   # the free side replays the constrained lengths
        assert s["ratio"] == pytest.approx(c["output_tok_s"] / f["output_tok_s"])
        assert 0 <= c["valid_json"] <= 4
    offline = result["offline"]
    constrained = offline["rounds"][0]["constrained"]
    assert constrained["steps"] > 0
    # Every constrained row of every sampling step went through the engine's grammar (timed in the engine).
    assert constrained["bitmask_rows"] >= constrained["output_tokens"]
    assert offline["host_grammar_us_per_row"] > 0
    assert result["served"]["clients"] == 2
    compile_ = result["compile"]
    n = len(SCHEMAS)
    assert compile_["cold_ms"]["n"] == compile_["cached_ms"]["n"] == n
    assert 0 < compile_["cold_ms"]["p50"] <= compile_["cold_ms"]["p99"]
    assert compile_["cached_ms"]["p50"] < compile_["cold_ms"]["p50"]
    assert compile_["compiled_by"] == {"xgrammar": n - 1, "guidance": 1}   # the allOf schema: guidance
    assert compile_["cache_hits"] == n and compile_["cache_misses"] == n + 2
    assert set(compile_["backend_setup_s"]) == {"pool", "xgrammar", "guidance"}
