"""A CI-sized soak (``benchmarks/soak.py``): 200 mixed requests on the tests' tiny random LLaVA, its
adapters and a tiny random Whisper, served by ``chorus serve`` in a subprocess on CPU, with 10% of the
clients disconnecting. Every request not cancelled answers 200 with the same greedy output as when it
runs alone, and afterwards /metrics shows nothing held (requests, KV blocks, adapter slots and
adapters, referenced encoder-cache entries)."""

from __future__ import annotations

import pytest

from benchmarks.soak import (IDLE_GAUGES, MemorySample, RequestSpec, SoakConfig, build_tiny_models,
                             growth_per_1k, parse_gauges, parse_stream, soak_with_server)
from tests.unit.fakes import FakeRunner, lora, make_request, make_scheduler, mm_feature

NUM_REQUESTS = 200


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    models = build_tiny_models(root)
    cfg = SoakConfig(num_requests=NUM_REQUESTS, concurrency=16, disconnect_frac=0.1, seed=0, max_tokens=8,
                     num_lora_churns=4)
    return soak_with_server(models, cfg, root), models


def test_soak_outputs_match_and_nothing_leaks(report):
    report, models = report
    assert report.num_requests == NUM_REQUESTS
    assert report.num_failed == 0 and report.num_5xx == 0, report.failures
    assert not report.adapter_errors, report.adapter_errors
    assert report.num_mismatches == 0, report.mismatches
    assert report.num_compared == report.num_completed == NUM_REQUESTS - report.num_cancelled
    assert not report.leaked, report.leaked
    assert report.ok


def test_soak_covered_the_mix(report):
    """The run had what it claims: disconnects, every route streamed and not, batching, preemptions, and
    the held-resource gauges with their totals."""
    report, models = report
    assert report.num_cancelled >= 5
    routes = {"completions", "completions-stream", "chat", "chat-stream"}
    if models.whisper:
        routes |= {"transcriptions", "transcriptions-stream"}
    assert routes <= set(report.by_route)
    assert report.max_num_reqs_per_step > 1 and report.num_preemptions > 0
    gauges = report.gauges_after_reference
    assert gauges["chorus:num_kv_blocks_total"] > 0 and gauges["chorus:num_lora_slots_total"] == 4
    assert gauges["chorus:encoder_cache_size_embeds"] > 0
    assert gauges["chorus:encoder_cache_hits_total"] > 0   # images repeat
    assert report.rss_start_mib is not None and report.rss_growth_mib_per_1k is not None


def test_checks_can_fail():
    """The soak's own checks: a gauge left above 0, an in-band stream error, memory growth."""
    text = ('chorus:num_kv_blocks_in_use{model_name="a",engine="0"} 3.0\n'
            'chorus:num_kv_blocks_in_use{model_name="b",engine="0"} 1.0\n# HELP x\n')
    assert parse_gauges(text)["chorus:num_kv_blocks_in_use"] == 4.0
    assert "chorus:num_kv_blocks_in_use" in IDLE_GAUGES
    spec = RequestSpec(0, "chat", {}, stream=True)
    output, error = parse_stream(spec, ['{"error": {"message": "boom"}}', "[DONE]"])
    assert output is None and "boom" in error
    unfinished = '{"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": null}]}'
    assert parse_stream(spec, [unfinished])[1]   # no [DONE]
    samples = [MemorySample(n, (100 + n) << 20, None) for n in range(0, 500, 50)]
    assert growth_per_1k(samples, "rss_bytes", 100) == pytest.approx(1000.0)
    assert growth_per_1k(samples, "gpu_bytes", 100) is None


def test_held_stats_count_what_requests_hold():
    """The snapshot behind the gauges: blocks, adapter slots and encoder entries count while requests hold
    them, and read 0 once they finish, though the prefix cache still keeps their full blocks (free)."""
    sched = make_scheduler(block_size=4, num_blocks=64, max_loras=2, max_num_batched_tokens=16)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", prompt_len=4, max_tokens=3, ignore_eos=True, lora_request=lora("x")))
    sched.add_request(make_request("b", prompt_len=20, max_tokens=3, ignore_eos=True,
                                   mm_features=[mm_feature("img-1", 10, 8)]))
    runner.step()   # a: its 4 tokens; b: 12 of 20 (the image's placeholders 10..17 half computed)
    held = sched.get_stats()
    assert held.num_kv_blocks == 63 and held.num_kv_blocks_in_use == 1 + 3
    assert held.num_lora_slots == 2 and held.num_lora_slots_in_use == 1 and held.num_active_loras == 1
    assert held.num_encoder_cache_entries == held.num_encoder_cache_entries_in_use == 1
    assert held.num_encoder_cache_embeds_in_use == 8 and held.encoder_cache_size >= 8
    while sched.has_unfinished_requests():
        runner.step()
    idle = sched.get_stats()
    assert idle.num_kv_blocks_in_use == 0 and sched.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert idle.num_lora_slots_in_use == 0 and idle.num_active_loras == 1     # idle adapter stays resident
    assert idle.num_encoder_cache_entries == 1 and idle.num_encoder_cache_entries_in_use == 0
    assert idle.num_encoder_cache_embeds_in_use == 0
