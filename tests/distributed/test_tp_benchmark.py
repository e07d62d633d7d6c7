"""``benchmarks/tp.py`` (issue #25's measurements, run on 2 x H200 by the `tp` phase of
``benchmarks/h200_run.sh``) on the CPU at tiny sizes: a row per tensor-parallel size with decode step
times, the collectives found in the profile (none at TP=1; at TP=2 one all-reduce per row-parallel layer
and one for the embedding, one logits all-gather; as many with adapters) and a throughput run; and the
profiler event names it counts, NCCL's included, which only a GPU run produces."""

from __future__ import annotations

import json

import pytest

from benchmarks import tp as tp_bench
from benchmarks.multi_lora import TINY


# Fewer timed and profiled steps and throughput requests than the tiny defaults: each is still measured.
SMALL = ["--model", "tiny", "--device", "cpu", "--steps", "2", "--profile-steps", "1", "--num-prompts", "4",
         "--warmup-prompts", "1", "--context-len", "16", "--output-len", "2:4"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-bench")
    return tp_bench.main([*SMALL, "--tp", "1", "2", "--workdir", str(out / "work"),
                          "--out", str(out / "tp.json")])


def test_rows_for_both_sizes(report):
    rows = {r["tp"]: r for r in report["rows"]}
    assert sorted(rows) == [1, 2]
    for size, r in rows.items():
        assert "error" not in r and "skipped" not in r, r
        assert r["model"] == "tiny" and r["num_adapters"] == 0
        assert [d["batch"] for d in r["decode"]] == [1, 4]
        for d in r["decode"]:
            assert d["step_ms"] > 0 and d["profiled_step_ms"] > 0 and d["tok_s_per_gpu"] > 0
            assert d["total_bytes"] == d["weight_bytes"] + d["kv_bytes"] > 0
            assert d["floor_ms"] is None   # the H200 bandwidth floor is for CUDA runs only
        t = r["throughput"]
        assert t["requests"] == 4 and t["output_tok_s"] > 0
        assert t["output_tok_s_per_gpu"] == pytest.approx(t["output_tok_s"] / size)
    assert "per_gpu_vs_tp1" in rows[2]["throughput"] and "step_vs_tp1" in rows[2]["decode"][0]
    # Rank 0 holds half of each sharded weight (norms replicated): fewer bytes to read than TP=1.
    assert rows[2]["decode"][0]["weight_bytes"] < 0.6 * rows[1]["decode"][0]["weight_bytes"]


def test_collectives_in_the_profile(report):
    rows = {r["tp"]: r for r in report["rows"]}
    for d in rows[1]["decode"]:
        assert d["all_reduce_share"] == 0 and d["all_reduce_calls"] == 0 and d["broadcast_calls"] == 0
    for d in rows[2]["decode"]:
        assert d["all_reduce_share"] > 0 and 0 < d["all_reduce_ms"] <= d["profiled_step_ms"]
        assert d["all_reduce_calls"] == 2 * TINY["num_hidden_layers"] + 1   # o_proj, down_proj; embedding
        assert d["all_gather_calls"] == 1 and d["broadcast_calls"] >= 1   # logits; the step message


def test_adapters_ride_on_the_base_all_reduces(tmp_path):
    """Two adapters at TP=2 (request i runs adapter i % 2, in the decode batches and the throughput
    run): the same collectives per step as without adapters (S-LoRA: no collective of their own)."""
    report = tp_bench.main([*SMALL, "--tp", "2", "--lora-adapters", "2", "--workdir", str(tmp_path / "work"),
                            "--out", str(tmp_path / "tp_lora.json")])
    [row] = report["rows"]
    assert "error" not in row and row["num_adapters"] == 2, row
    for d in row["decode"]:
        assert d["step_ms"] > 0 and d["all_reduce_share"] > 0
        assert d["all_reduce_calls"] == 2 * TINY["num_hidden_layers"] + 1 and d["all_gather_calls"] == 1
    assert row["throughput"]["output_tok_s"] > 0


def test_json_on_disk(report):
    on_disk = json.loads(open(report["args"]["out"]).read())
    assert [(r["tp"], r["decode"][0]["step_ms"]) for r in on_disk["rows"]] == \
        [(r["tp"], r["decode"][0]["step_ms"]) for r in report["rows"]]


@pytest.mark.parametrize("name,on_device,kind", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", True, "all_reduce"),
    ("ncclKernel_AllReduce_RING_LL_Sum_bfloat16(ncclWorkElem)", True, "all_reduce"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", True, "all_gather"),
    ("gloo:all_reduce", False, "all_reduce"),
    ("gloo:all_gather", False, "all_gather"),
    ("gloo:broadcast", False, "broadcast"),
    ("c10d::allreduce_", False, None),          # enqueues the work: counting it too would count twice
    ("nccl:all_reduce", False, None),
    ("nccl:all_reduce", True, None),            # its GPU annotation: spans the kernel (seen on 2 H200s)
    ("sm90_xmma_gemm_bf16bf16_bf16f32", True, None),
])
def test_collective_kind(name, on_device, kind):
    assert tp_bench.collective_kind(name, on_device) == kind
