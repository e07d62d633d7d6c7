"""benchmarks/cpu.py on the tiny Llama: the decode step breakdown (one row per batch size whose parts add up) and
the alternating rounds against a stand-in llama-bench."""

from __future__ import annotations

from tests.benchmark_module import load_benchmark


class _Queue(list):
    def put(self, item) -> None:
        self.append(item)


def _cpu_module():
    return load_benchmark("cpu.py", "bench_cpu_unit")


def test_step_rows_split_each_step_into_forward_head_and_engine(tiny_llama_dir):
    cpu = _cpu_module()
    queue = _Queue()
    cpu.step_rows([1, 3], dict(model=str(tiny_llama_dir), threads=0, context_len=20, step_count=4), queue)
    (rows,) = queue
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["forward_ms"] > 0 and r["logits_ms"] > 0 and r["engine_ms"] > 0
        assert abs(r["forward_ms"] + r["logits_ms"] + r["engine_ms"] - r["step_ms"]) < 1e-6
        assert abs(r["tok_s"] - r["batch"] / r["step_ms"] * 1e3) < 1e-6


def test_alternate_rows_pair_each_llama_bench_round_with_a_chorus_round(tiny_llama_dir, tmp_path):
    """Each round runs the given llama-bench (here a script that checks its arguments and reports 50 tok/s) on
    the model's file at the context depth, then times Chorus's batch-1 decode; the ratio is the pair's."""
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\n"
                    f'[ "$2" = "{tiny_llama_dir}" ] && echo "$@" | grep -q -- "-n 64 -d 20 -r 1" || exit 3\n'
                    "echo '[{\"avg_ts\": 50.0}]'\n")
    fake.chmod(0o755)
    queue = _Queue()
    _cpu_module().alternate_rows(2, dict(model=str(tiny_llama_dir), threads=0, context_len=20,
                                         llama_bench=str(fake)), queue)
    (rows,) = queue
    assert [r["round"] for r in rows] == [0, 1]
    for r in rows:
        assert r["llama_cpp_tok_s"] == 50.0 and r["chorus_tok_s"] > 0
        assert abs(r["ratio"] - r["chorus_tok_s"] / 50.0) < 1e-9


def test_serve_rows_pair_each_served_run_with_a_llama_bench_round(tiny_llama_dir, tmp_path):
    """``chorus serve`` on the tiny Llama: each round's stand-in llama-bench (60 tok/s at the context depth) is
    followed by the served run, whose ratio is its output rate over 3x llama.cpp's."""
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\n"
                    f'[ "$2" = "{tiny_llama_dir}" ] && echo "$@" | grep -q -- "-n 64 -d 24 -r 1" || exit 3\n'
                    "echo '[{\"avg_ts\": 60.0}]'\n")
    fake.chmod(0o755)
    served = _cpu_module().serve_rows(2, 0, "--max-model-len 128", input_len=8, output_len=4, rounds=2,
                                      llama_bench=str(fake), context_len=24, model=str(tiny_llama_dir))
    assert served["health_s"] <= served["first_answer_s"]
    assert [r["round"] for r in served["rounds"]] == [0, 1]
    for r in served["rounds"]:
        assert r["requests"] == 8 and r["failed"] == 0 and r["llama_cpp_tok_s"] == 60.0
        assert abs(r["ratio"] - r["output_tok_s"] / 180.0) < 1e-9
