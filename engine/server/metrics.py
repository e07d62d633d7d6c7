"""Prometheus metrics at /metrics, with vLLM's names under a ``chorus:`` prefix.

Two sources:
- per-step and per-request events from ``AsyncLLM`` (``PrometheusStatLogger`` implements
  ``engine.request_metrics.StatLogger``): token counters, finished requests by reason, TTFT /
  inter-token / end-to-end latency histograms;
- the engine's latest ``SchedulerStats`` snapshot, read at scrape time (``EngineStatsCollector``):
  running/waiting requests, KV cache usage, prefix-cache queries/hits, encoder-cache usage and
  queries/hits (images), preemptions, and
  ``chorus:max_num_reqs_per_step`` (most requests batched into one step; proves batching);
- what is held now, for leak checks (``benchmarks/soak.py``; every ``*_in_use`` gauge, the running,
  waiting and tracked requests are 0 on an idle server): KV blocks in use and total (a prefix-cached
  block no request holds counts as free), adapter slots in use and total, adapters registered,
  encoder-cache entries (held, referenced) and referenced embeddings.

Each app gets its own ``CollectorRegistry`` so several servers can live in one process (tests).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.sampling_params import SamplingParams

PREFIX = "chorus:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
"""Content-Type of /metrics (Prometheus text format)."""
LABELS = ("model_name", "engine")

TTFT_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0]
E2E_BUCKETS_S = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                 240.0, 480.0, 960.0, 1920.0, 7680.0]


HELD_GAUGES = (
    ("num_kv_blocks_in_use", "KV cache blocks held by requests (prefix-cached blocks no request holds count "
     "as free).", "num_kv_blocks_in_use"),
    ("num_kv_blocks_total", "KV cache blocks that can be handed out.", "num_kv_blocks"),
    ("num_lora_slots_in_use", "Adapter slots with running requests.", "num_lora_slots_in_use"),
    ("num_lora_slots_total", "Adapter slots (max_loras).", "num_lora_slots"),
    ("num_loras_registered", "Adapters the engine holds in host memory (loaded, or being unloaded while "
     "their requests finish).", "num_loras_registered"),
    ("num_encoder_cache_entries", "Encoder outputs held, referenced or kept for reuse.",
     "num_encoder_cache_entries"),
    ("num_encoder_cache_entries_in_use", "Encoder outputs referenced by a request.",
     "num_encoder_cache_entries_in_use"),
    ("num_encoder_cache_embeds_in_use", "Encoder embeddings of the referenced entries.",
     "num_encoder_cache_embeds_in_use"),
    ("encoder_cache_size_embeds", "Encoder embeddings the encoder cache holds at most.",
     "encoder_cache_size"),
)
"""(gauge name, help, ``SchedulerStats`` field): what the engine holds now (leak checks)."""

LORA_COUNTERS = (
    ("lora_slot_loads", "Adapters copied into a GPU slot (prefetches included).", "num_lora_slot_loads"),
    ("lora_slot_evictions", "Slot loads that evicted another (idle) adapter.", "num_lora_slot_evictions"),
    ("lora_slot_prefetches", "Slot loads for requests admitted in a later step.", "num_lora_slot_prefetches"),
    ("lora_reloads_while_running", "Slot loads that evicted or reloaded an adapter with running requests "
     "(a check: stays 0).", "num_lora_reloads_while_running"),
    ("lora_host_loads", "Adapters put in the host-memory store (--max-cpu-loras).", "num_lora_host_loads"),
    ("lora_host_evictions", "Adapters the host-memory store dropped for room.", "num_lora_host_evictions"),
    ("lora_disk_reads", "Adapter reads from disk the engine's loader threads finished.",
     "num_lora_disk_reads"),
    ("lora_disk_read_bytes", "Bytes of adapter weights read from disk.", "lora_disk_read_bytes"),
    ("lora_disk_read_seconds", "Seconds adapter reads took on their loader threads (summed).",
     "lora_disk_read_s"),
    ("lora_disk_read_queued_seconds", "Seconds adapter reads waited for a loader thread (summed).",
     "lora_disk_read_queued_s"),
    ("lora_step_rank_rows", "Rank rows of each step's distinct adapters, summed over steps (the least the "
     "steps' LoRA kernels read, in rank rows).", "num_lora_step_rank_rows"),
)
"""(counter name, help, ``SchedulerStats`` field): adapter movement between disk, host memory and slots."""


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class PrometheusStatLogger:
    """Per-request metrics, fed by ``AsyncLLM`` on the event loop."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        labels = {"model_name": model_name, "engine": "0"}
        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, LABELS + extra, registry=registry)

        def histogram(name: str, doc: str, buckets: list) -> Any:
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=registry).labels(**labels)

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.").labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Generation tokens produced.").labels(**labels)
        self._request_success = counter("request_success", "Finished requests, by finish reason.",
                                        ("finished_reason",))
        self._labels = labels
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS_S)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive outputs of a request.",
                             ITL_BUCKETS_S)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS_S)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "(e2e - TTFT) / (generated tokens - 1), per finished request.", ITL_BUCKETS_S)
        self.req_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                           token_buckets)
        self.req_generation_tokens = histogram("request_generation_tokens",
                                               "Generated tokens per finished request.", token_buckets)
        self.req_params_n = histogram("request_params_n", "The n of each finished request.",
                                      [1, 2, 5, 10, 20])
        self.req_params_max_tokens = histogram("request_params_max_tokens",
                                               "The max_tokens of each finished request.", token_buckets)

    def on_step(self, num_prompt_tokens: int, num_generation_tokens: int, ttfts_s: list[float],
                itls_s: list[float]) -> None:
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens)
        if num_generation_tokens:
            self.generation_tokens.inc(num_generation_tokens)
        for t in ttfts_s:
            self.ttft.observe(t)
        for t in itls_s:
            self.itl.observe(t)

    def on_finished(self, finish_reason: Optional[str], num_prompt_tokens: int, num_generation_tokens: int,
                    e2e_s: float, ttft_s: Optional[float], params: SamplingParams) -> None:
        self._request_success.labels(**self._labels, finished_reason=finish_reason or "unknown").inc()
        self.e2e.observe(e2e_s)
        self.req_prompt_tokens.observe(num_prompt_tokens)
        self.req_generation_tokens.observe(num_generation_tokens)
        self.req_params_n.observe(params.n)
        if params.max_tokens is not None:
            self.req_params_max_tokens.observe(params.max_tokens)
        if ttft_s is not None and num_generation_tokens > 1:
            self.tpot.observe((e2e_s - ttft_s) / (num_generation_tokens - 1))


class EngineStatsCollector(Collector):
    """Reads ``engine_client.get_stats()`` at scrape time."""

    def __init__(self, engine_client: Any, model_name: str) -> None:
        self.engine_client = engine_client
        self.label_values = [model_name, "0"]

    def collect(self) -> Iterable[Metric]:
        s = self.engine_client.get_stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            g.add_metric(self.label_values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            c.add_metric(self.label_values, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running_reqs)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting_reqs)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = 100%).", s.kv_cache_usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield gauge("encoder_cache_usage_perc", "Fraction of the encoder cache (image embeddings) held by "
                    "entries, referenced or kept for reuse (1 = 100%).", s.encoder_cache_usage)
        yield counter("encoder_cache_queries", "Media items looked up in the encoder cache.",
                      s.encoder_cache_queries)
        yield counter("encoder_cache_hits", "Media items found in the encoder cache (not encoded again).",
                      s.encoder_cache_hits)
        yield counter("num_preemptions", "Preemptions (requests freed to recompute later).",
                      s.num_preemptions)
        yield counter("engine_steps", "Engine steps run.", s.num_steps)
        yield gauge("max_num_reqs_per_step", "Most requests scheduled in one engine step since start.",
                    s.max_reqs_per_step)
        yield gauge("num_active_loras", "Adapters resident in GPU slots.", s.num_active_loras)
        for name, doc, attr in LORA_COUNTERS:
            yield counter(name, doc, getattr(s, attr))
        yield gauge("num_requests_tracked", "Requests the server's engine client tracks (added, stream not "
                    "closed yet).", getattr(self.engine_client, "num_tracked_requests", 0))
        for name, doc, attr in HELD_GAUGES:
            yield gauge(name, doc, getattr(s, attr))
        yield gauge("engine_healthy", "1 while the engine loop runs, 0 once it died.",
                    0.0 if self.engine_client.errored else 1.0)


def make_registry(engine_client: Any, model_name: str) -> tuple[CollectorRegistry, PrometheusStatLogger]:
    disable_created_metrics()  # no *_created samples (as vLLM)
    registry = CollectorRegistry()
    stat_logger = PrometheusStatLogger(registry, model_name, engine_client.max_model_len)
    registry.register(EngineStatsCollector(engine_client, model_name))
    return registry, stat_logger


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
