"""benchmarks/adapter_scale.py: Zipf popularity favours the first adapters, each adapter directory's files are
hard links to one random file of its rank, and the tiny run gives the base row and a row per (N, popularity)
with positive ratios to the base, TTFT and cold-start percentiles and the engine's LoRA counters."""

from __future__ import annotations

import json
import math
import sys
from collections import Counter

from tests.benchmark_module import load_benchmark


def _bench():
    return load_benchmark("adapter_scale.py", "bench_adapter_scale_unit")


def test_zipf_favours_the_first_adapters_and_uniform_does_not():
    bench = _bench()
    zipf = Counter(bench.request_adapters(4000, 100, "zipf", 1.0, seed=0))
    uniform = Counter(bench.request_adapters(4000, 100, "uniform", 1.0, seed=0))
    # Zipf(1) over 100: adapter 0 takes 1 / H(100) ~ 19% of the requests, adapter 1 half of that.
    assert 0.16 < zipf[0] / 4000 < 0.22 and zipf[0] > 1.6 * zipf[1]
    assert max(uniform.values()) < 0.03 * 4000 and len(uniform) == 100


def test_adapter_directories_are_hard_links_to_their_ranks_files(tmp_path):
    bench = _bench()
    files = {8: [tmp_path / "w8a", tmp_path / "w8b"], 64: [tmp_path / "w64a"]}
    for dirs in files.values():
        for d in dirs:
            d.mkdir()
            (d / "adapter_config.json").write_text(d.name)
            (d / "adapter_model.safetensors").write_bytes(d.name.encode())
    names = bench.adapter_names(3, "zipf")
    assert names == ["zipf3-0000", "zipf3-0001", "zipf3-0002"]
    bench.link_adapters(tmp_path / "loras", names, [8, 8, 64], files)
    sources = [files[8][0], files[8][1], files[64][0]]
    for name, src in zip(names, sources):
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            assert (tmp_path / "loras" / name / f).stat().st_ino == (src / f).stat().st_ino
    ranks = bench.adapter_ranks(200, [8, 16, 64], seed=0)
    assert set(ranks) == {8, 16, 64} and ranks == bench.adapter_ranks(200, [8, 16, 64], seed=0)


def test_tiny_run_reports_each_row_against_the_base(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["adapter_scale.py", "--tiny", "--num-adapters", "1,3", "--num-prompts", "8",
                                      "--workdir", str(tmp_path / "w"), "--out", str(out)])
    _bench().main()
    report = json.loads(out.read_text())
    assert report["rate_req_s"] > 0 and report["base_closed_loop"]["requests"] == 8
    rows = {(r["num_adapters"], r["popularity"]): r for r in report["rows"]}
    assert list(rows) == [(0, "-"), (1, "zipf"), (1, "uniform"), (3, "zipf"), (3, "uniform")]
    for (n, _), r in rows.items():
        assert r["output_tokens"] == 8 * 4 and r["requests"] == 8
        assert r["x_base"] > 0 and math.isfinite(r["x_base"])
        assert math.isclose(r["x_base"], r["output_tok_s"] / rows[(0, "-")]["output_tok_s"])
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        assert r["lora_reloads_while_running"] == 0
        if n == 0:
            assert r["cold_start_ms"] is None and r["host_loads"] == r["slot_loads"] == 0
            continue
        # Every row names adapters of its own: each is read from disk by its first request at least.
        assert 1 <= r["distinct_adapters"] <= n and r["cold_requests"] >= r["distinct_adapters"]
        assert 0 < r["cold_start_ms"]["p50"] <= r["cold_start_ms"]["p99"]
        assert 0 < r["cold_resolve_ms"]["p99"] <= r["cold_start_ms"]["p99"]   # the read is part of the cold start
        assert r["host_loads"] >= r["distinct_adapters"] and r["slot_loads"] >= r["distinct_adapters"]
