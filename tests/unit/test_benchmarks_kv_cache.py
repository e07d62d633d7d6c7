"""benchmarks/kv_cache.py at tiny sizes on the CPU: the capacity of a cache of half the bytes per element is twice
the blocks under the same budget (the H200 run compares bf16 with FP8; the CPU has no FP8 cache, so float32 with
bfloat16), and a long prompt's KV blocks on the tiny Gemma 3 with and without its windows (KV cache groups),
against what its layers' windows need."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests.benchmark_module import load_benchmark


def _run(monkeypatch, tmp_path, *argv: str) -> dict:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["kv_cache.py", *argv, "--tiny", "--steps", "2", "--out", str(out)])
    load_benchmark("kv_cache.py", "bench_kv_cache_unit").main()
    return json.loads(out.read_text())


def test_half_the_bytes_per_element_doubles_the_blocks_and_decode_rows_run(monkeypatch, tmp_path):
    report = _run(monkeypatch, tmp_path, "fp8", "--shape", "llama3-8b", "--kv-cache-dtypes", "auto,bfloat16",
                  "--batch-sizes", "2", "--context-len", "16", "--kv-cache-space", "0.01")
    full, half = report["rows"]
    assert (full["kv_dtype"], half["kv_dtype"]) == ("float32", "bfloat16")
    assert 2 * half["bytes_per_block"] == full["bytes_per_block"]
    budget_blocks = int(0.01 * (1 << 30) // full["bytes_per_block"])         # the CPU budget, null block included
    assert full["blocks"] == budget_blocks == full["usable_blocks"] + 1 and not full["capped"]
    assert half["blocks"] == int(0.01 * (1 << 30) // half["bytes_per_block"]) in (2 * budget_blocks, 2 * budget_blocks + 1)
    assert half["capacity_x_first"] == pytest.approx(2.0, abs=1e-3)
    for r in report["rows"]:
        (row,) = r["decode"]
        assert row["batch"] == 2 and row["step_ms"] > 0
        assert row["kv_bytes"] == row["total_bytes"] - row["weight_bytes"] > 0


def test_a_long_prompt_holds_only_the_windows_of_its_sliding_layers(monkeypatch, tmp_path):
    """Tiny Gemma 3: 6 layers, window 16, one global; 2 KV heads of 16, float32. With windows its layers are 6 KV
    cache groups of one layer (5 sliding, 1 global; a block holds one layer): at its first decode step the global
    group holds the prompt's 17 blocks and each sliding group the 2 its window reaches (the others went back to
    the pool), against 17 six-layer blocks without windows; its windows need 5 x 16 + 256 tokens' KV per layer,
    without windows 6 x 256. The prefill (one chunk) held every group's blocks of the prompt."""
    report = _run(monkeypatch, tmp_path, "window", "--shape", "gemma3-12b", "--prompt-len", "256",
                  "--batch-sizes", "2", "--context-len", "40")
    on, off = report["rows"]
    assert (on["windows"], on["sliding_layers"], off["windows"], off["sliding_layers"]) == (True, 5, False, 0)
    assert (on["kv_groups"], on["group_layers"], off["kv_groups"], off["group_layers"]) == (6, 1, 1, 6)
    per_token_layer = 2 * 2 * 16 * 4
    assert on["window_need_bytes"] == (5 * 16 + 256) * per_token_layer
    assert off["window_need_bytes"] == 6 * 256 * per_token_layer
    blocks = math.ceil(257 / 16)                                               # the prompt and its first token
    assert off["blocks_held"] == off["blocks_peak"] == blocks
    assert off["held_bytes"] == blocks * 16 * 6 * per_token_layer
    assert on["blocks_held"] == blocks + 5 * 2 and on["blocks_peak"] == 6 * (256 // 16)
    assert on["held_bytes"] == (blocks + 5 * 2) * 16 * per_token_layer
    assert on["window_need_bytes"] <= on["held_bytes"] < off["held_bytes"]
    assert on["held_x_off"] == pytest.approx((blocks + 10) / (6 * blocks))
    for r in (on, off):
        (row,) = r["decode"]
        assert row["batch"] == 2 and row["step_ms"] > 0
    assert on["decode"][0]["kv_bytes"] < off["decode"][0]["kv_bytes"]         # sliding layers read their window
