"""benchmarks/compare.py: which benchmark a JSON comes from, rows matched across runs, ratios."""

from __future__ import annotations

import pytest

from tests.benchmark_module import load_benchmark


def _load_compare():
    return load_benchmark("compare.py", "bench_compare_unit")


def test_latency_rows_matched_by_batch_with_ratios():
    cmp = _load_compare()
    old = {"device": "H200", "rows": [{"batch": 1, "step_ms": 4.0, "gpu_ms": 4.0, "step_over_floor": 1.2},
                                      {"batch": 256, "step_ms": 12.0, "gpu_ms": 12.0, "step_over_floor": 1.5}]}
    new = {"device": "H200", "rows": [{"batch": 256, "step_ms": 11.0, "gpu_ms": 10.0, "step_over_floor": 1.4},
                                      {"batch": 8, "step_ms": 5.0, "gpu_ms": 5.0, "step_over_floor": 1.3}]}
    lines = cmp.compare(old, new)
    assert lines[0].startswith("latency:")
    rows = lines[2:]
    assert len(rows) == 1 and rows[0].startswith("batch 256")   # batch 8 has no old row
    assert "0.917" in rows[0] and "0.833" in rows[0]             # 11 / 12 and 10 / 12


def test_multi_lora_and_throughput_kinds():
    cmp = _load_compare()
    decode = {"decode graph": {"steps": 100, "gpu_ms": 700.0}}
    ml = {"rows": [{"system": "chorus 16 adapters", "batch": 64, "num_adapters": 16, "output_tok_s": 5000.0,
                    "x_base": 0.9, "steps_by_kind": decode},
                   {"system": "hf+peft 16 adapters", "batch": 64, "num_adapters": 16, "output_tok_s": 90.0}]}
    assert cmp.kind_of(ml) == "multi_lora"
    assert list(cmp.keyed_rows(ml, "multi_lora")) == ["batch 64, 16 adapters"]
    assert cmp._decode_ms(ml["rows"][0]) == pytest.approx(7.0)
    tp = {"rows": [{"system": "chorus", "output_tok_s": 10000.0, "seconds": 28.0},
                   {"system": "hf-generate_batch(continuous)", "output_tok_s": 380.0, "seconds": 85.0}]}
    assert cmp.kind_of(tp) == "throughput"
    with pytest.raises(SystemExit):
        cmp.compare(ml, tp)


def test_vision_and_whisper_kinds():
    cmp = _load_compare()
    old = {"llava": {"rows": [{"system": "chorus", "requests": 1000, "output_tok_s": 4000.0, "req_s": 31.0},
                              {"system": "transformers generate (bs 32)", "requests": 64, "output_tok_s": 700.0}]}}
    new = {"llava": {"rows": [{"system": "chorus", "requests": 1000, "output_tok_s": 4100.0, "req_s": 32.0}]}}
    assert cmp.kind_of(new) == "vision"
    lines = cmp.compare(old, new)
    assert len(lines) == 3 and lines[2].startswith("llava, 1000 requests") and "1.025" in lines[2]
    wh = {"rows": [{"system": "chorus", "model": "turbo", "clips": 1000, "rtf": 3800.0, "out_tok_s": 12000.0},
                   {"system": "transformers b64", "model": "turbo", "clips": 256, "rtf": 600.0}]}
    assert cmp.kind_of(wh) == "whisper"
    assert list(cmp.keyed_rows(wh, "whisper")) == ["turbo, 1000 clips"]
