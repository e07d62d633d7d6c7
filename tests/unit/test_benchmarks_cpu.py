"""benchmarks/cpu.py's decode step breakdown on the tiny Llama: one row per batch size whose parts add up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class _Queue(list):
    def put(self, item) -> None:
        self.append(item)


def test_step_rows_split_each_step_into_forward_head_and_engine(tiny_llama_dir):
    spec = importlib.util.spec_from_file_location("bench_cpu_unit", ROOT / "benchmarks" / "cpu.py")
    cpu = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = cpu
    spec.loader.exec_module(cpu)
    queue = _Queue()
    cpu.step_rows([1, 3], dict(model=str(tiny_llama_dir), threads=0, context_len=20, step_count=4), queue)
    (rows,) = queue
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["forward_ms"] > 0 and r["logits_ms"] > 0 and r["engine_ms"] > 0
        assert abs(r["forward_ms"] + r["logits_ms"] + r["engine_ms"] - r["step_ms"]) < 1e-6
        assert abs(r["tok_s"] - r["batch"] / r["step_ms"] * 1e3) < 1e-6
