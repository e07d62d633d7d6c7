"""Thousands of adapters through ``--lora-dir``: GPU slots, the host-memory store and disk, on CPU.

2,000 PEFT adapters (ranks 4-64, four target sets) lie in one directory, resolved by name as
``--lora-dir`` does (``FilesystemLoRAResolver``); the engine has 16 slots and a host store of 64.
Random requests across all of them, base requests mixed in, each answer the same as the request
alone (and a few as PEFT's); nothing is held afterwards; no slot load ever evicted or reloaded an
adapter with running requests (``num_lora_reloads_while_running``). With a loader that sleeps on
every read, base requests and requests of ready adapters keep stepping and no step waits on disk.
Eviction by recency and pending demand is checked on the store and the slot manager directly.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.server.lora_resolver import FilesystemLoRAResolver
from lora import LoRARequest
from lora.adapter_store import AdapterStore
from lora.slot_manager import LoRASlotManager
from tests.lora.utils import build_peft_adapter, peft_greedy, peft_reference_model
from tests.unit.fakes import FakeRunner, assert_no_leaks, lora, make_request, make_scheduler

NUM_ADAPTERS = 2000
RANKS = (4, 8, 16, 32, 64)
TARGET_SETS = (["q_proj", "v_proj"], ["o_proj", "down_proj"], ["gate_proj", "up_proj", "k_proj"],
               ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
PROMPTS = ("The quick brown fox", "Hello, my name is", "In a distant land", "Once upon a time", "One two three")
MAX_TOKENS = 4


def _name(i: int) -> str:
    return f"ad{i:04d}"


@pytest.fixture(scope="module")
def lora_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """DIR/adNNNN for NNNN < 2000: one adapter per target set saved by PEFT is the template (key names,
    config); the others are written from it with torch at their own rank and random weights."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("many-adapters")
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    templates = []
    for t, targets in enumerate(TARGET_SETS):
        d = build_peft_adapter(tiny_llama_dir, root / f"template{t}", r=4, lora_alpha=8, target_modules=targets,
                               seed=t, base_model=base)
        templates.append((json.loads((d / "adapter_config.json").read_text()),
                          load_file(str(d / "adapter_model.safetensors"))))
    loras = root / "loras"
    loras.mkdir()
    gen = torch.Generator().manual_seed(0)
    for i in range(NUM_ADAPTERS):
        config, tensors = templates[i % len(TARGET_SETS)]
        r = RANKS[(i * 7 + i // len(TARGET_SETS)) % len(RANKS)]
        d = loras / _name(i)
        d.mkdir()
        weights = {}
        for key, t in tensors.items():     # lora_A [r, in], lora_B [out, r]
            shape = (r, t.shape[1]) if ".lora_A." in key else (t.shape[0], r)
            weights[key] = torch.randn(shape, generator=gen) * (0.3 if ".lora_A." in key else 0.5)
        save_file(weights, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({**config, "r": r, "lora_alpha": 2 * r}))
    return loras


def _params(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _lora(resolver: FilesystemLoRAResolver, i: int) -> LoRARequest:
    path = resolver.resolve(_name(i))
    assert path is not None
    return LoRARequest(_name(i), i + 1, path)


def _run(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.error is None, o.error
            if o.finished:
                done[o.request_id] = o
    return done


def _assert_nothing_held(engine: LLMEngine) -> None:
    stats = engine.get_stats()
    assert stats.num_kv_blocks_in_use == 0 and stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.num_lora_slots_in_use == 0                       # no slot pinned by a request
    assert not engine.lora_manager.adapter_reads_pending()         # no read queued or untaken
    assert len(engine.lora_manager.store) <= 64
    assert stats.num_lora_reloads_while_running == 0


def _scrape(engine: LLMEngine) -> dict[str, float]:
    """The ``chorus:lora_*`` counters /metrics shows for this engine's stats."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    from engine.server.metrics import EngineStatsCollector, render

    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(SimpleNamespace(get_stats=engine.get_stats, errored=False), "m"))
    return {f.name.removeprefix("chorus:"): f.samples[0].value
            for f in text_string_to_metric_families(render(registry).decode()) if f.name.startswith("chorus:lora_")}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    eng = LLMEngine.from_engine_args(model=str(tiny_llama_dir), max_model_len=128, enable_lora=True,
                                     max_loras=16, max_cpu_loras=64, max_lora_rank=64, max_num_seqs=16)
    yield eng
    eng.close()


def test_random_requests_over_2000_adapters_match_alone_and_peft(engine, lora_dir, tiny_llama_dir):
    resolver = FilesystemLoRAResolver(str(lora_dir))
    assert len(resolver.list_names()) == NUM_ADAPTERS
    rng = random.Random(0)
    requests = {}
    for k in range(200):
        adapter = None if k % 5 == 0 else rng.randrange(NUM_ADAPTERS)   # a fifth are base requests
        requests[f"r{k}"] = (PROMPTS[rng.randrange(len(PROMPTS))], adapter)
    for rid, (prompt, adapter) in requests.items():
        engine.add_request(rid, prompt, _params(),
                           lora_request=None if adapter is None else _lora(resolver, adapter))
    done = _run(engine)
    assert set(done) == set(requests)
    stats = engine.get_stats()
    distinct = len({a for _, a in requests.values() if a is not None})
    assert stats.num_lora_slot_loads >= distinct > 16          # slots cycled through the adapters
    assert stats.num_lora_slot_evictions >= distinct - 16
    assert stats.num_lora_host_evictions >= distinct - 64      # the host store cycled too
    # Each adapter is read by the client, and at most about once more by the engine (the store dropped it
    # before its request ran): no read is evicted before its request is admitted and read again.
    assert distinct + (distinct - 64) <= stats.num_lora_host_loads <= distinct + (distinct - 64) + 16
    # The engine's own reads (its loader threads) are the host loads the client did not send.
    assert stats.num_lora_disk_reads == stats.num_lora_host_loads - distinct
    assert stats.lora_disk_read_bytes > 0 and stats.lora_disk_read_s > 0
    assert stats.max_reqs_per_step == 16                       # batched across many adapters at once
    assert stats.num_lora_slot_prefetches > 0                  # copies ahead of the admitting step
    _assert_nothing_held(engine)
    scraped = _scrape(engine)
    assert scraped["lora_slot_loads"] == stats.num_lora_slot_loads
    assert scraped["lora_host_evictions"] == stats.num_lora_host_evictions
    assert scraped["lora_reloads_while_running"] == 0
    assert scraped["lora_disk_reads"] == stats.num_lora_disk_reads
    assert scraped["lora_disk_read_bytes"] == stats.lora_disk_read_bytes

    # Every answer equals the same request alone (a sample; adapters reloaded from disk as needed).
    sample = rng.sample(sorted(requests), 20)
    for rid in sample:
        prompt, adapter = requests[rid]
        engine.add_request("alone", prompt, _params(),
                           lora_request=None if adapter is None else _lora(resolver, adapter))
        alone = _run(engine)["alone"]
        assert alone.outputs[0].token_ids == done[rid].outputs[0].token_ids, rid
    _assert_nothing_held(engine)

    # A few against PEFT.
    picked = [rid for rid in sorted(requests) if requests[rid][1] is not None][:3]
    pm = peft_reference_model(tiny_llama_dir, {_name(requests[rid][1]): lora_dir / _name(requests[rid][1])
                                               for rid in picked})
    for rid in picked:
        ref = peft_greedy(pm, _name(requests[rid][1]), list(done[rid].prompt_token_ids), MAX_TOKENS)
        assert list(done[rid].outputs[0].token_ids) == ref.token_ids, rid
    base_rid = next(rid for rid in sorted(requests) if requests[rid][1] is None)
    assert list(done[base_rid].outputs[0].token_ids) == peft_greedy(
        pm, None, list(done[base_rid].prompt_token_ids), MAX_TOKENS).token_ids
    # The adapters change the answers (the comparison above is not base against base).
    outs = {tuple(done[rid].outputs[0].token_ids) for rid in requests if requests[rid][0] == PROMPTS[0]}
    assert len(outs) > 3


class _GatedReader:
    """An ``AdapterReader`` whose reads block until the test opens ``gate`` (a disk as slow as the test
    wants): while it is closed, every read is provably still under way."""

    def __init__(self, reader) -> None:
        self.reader, self.num_reads = reader, 0
        self.gate, self.reading = threading.Event(), threading.Event()

    def read(self, lora_request):
        self.reading.set()
        if not self.gate.wait(60):
            raise RuntimeError("the test never opened the gate")
        self.num_reads += 1
        return self.reader.read(lora_request)


def test_slow_loader_never_blocks_the_step_loop(engine, lora_dir):
    """Adapters the engine must read itself (the client's record says they were sent) go through a
    loader whose reads block for at least CLOSED_S, and at least 8x the slowest step (the machine may be
    busy): meanwhile base requests and a request of an adapter in host memory keep stepping (tokens
    produced while no read has finished), every step is far shorter than the reads, and the blocked
    requests finish once the reads do."""
    closed_s, min_steps, max_closed_s = 1.0, 20, 20.0
    resolver = FilesystemLoRAResolver(str(lora_dir))
    manager = engine.lora_manager
    loader = manager.loader
    slow = _GatedReader(loader.reader)
    loader.reader = slow
    try:
        ready = _lora(resolver, 1999)
        engine.add_lora(ready)                                 # in host memory before the requests
        slow_loras = [_lora(resolver, i) for i in range(1000, 1999) if _name(i) not in manager.store][:4]
        for lr in slow_loras:
            engine.processor.adapter_uploads.mark_sent(lr)     # the engine reads them itself
            engine.add_request(f"slow-{lr.lora_name}", PROMPTS[0], _params(), lora_request=lr)
        engine.add_request("ready", PROMPTS[1], _params(60), lora_request=ready)
        step_s, tokens, done, base_ids = [], {}, {}, []
        t_closed = time.perf_counter()
        while (len(step_s) < min_steps or time.perf_counter() - t_closed < max(closed_s, 8 * max(step_s))) \
                and time.perf_counter() - t_closed < max_closed_s:
            if all(rid in done for rid in base_ids):
                base_ids.append(f"base{len(base_ids)}")        # keep base work flowing while reads block
                engine.add_request(base_ids[-1], PROMPTS[3], _params(20))
            t0 = time.perf_counter()
            outs = engine.step()
            step_s.append(time.perf_counter() - t0)
            for o in outs:
                assert o.error is None, o.error
                tokens[o.request_id] = len(o.outputs[0].token_ids)
                if o.finished:
                    done[o.request_id] = o
        closed_for_s = time.perf_counter() - t_closed
        assert slow.reading.is_set() and slow.num_reads == 0 and manager.adapter_reads_pending()
        assert not any(rid.startswith("slow-") for rid in tokens)   # they wait for their reads...
        assert tokens.get("ready", 0) > 0 and sum(tokens.get(rid, 0) for rid in base_ids) > 0   # ...the others run
        assert len(step_s) >= min_steps                                   # no step waited for the disk
        assert max(step_s) < closed_for_s / 4, (max(step_s), closed_for_s, len(step_s))
        slow.gate.set()
        while engine.has_unfinished_requests():
            for o in engine.step():
                assert o.error is None, o.error
                if o.finished:
                    done[o.request_id] = o
        assert slow.num_reads == len(slow_loras)
        assert all(len(done[f"slow-{lr.lora_name}"].outputs[0].token_ids) == MAX_TOKENS for lr in slow_loras)
        assert len(done["ready"].outputs[0].token_ids) == 60
        _assert_nothing_held(engine)
    finally:
        slow.gate.set()
        loader.reader = slow.reader


def test_store_evicts_by_recency_then_latest_demand():
    class _A:
        def __init__(self, name):
            self.name = name

        def pin_memory(self):
            return self

    store = AdapterStore(3)
    for n in "abc":
        store.put(_A(n))
    store.get("a")                                      # LRU order now b, c, a
    assert store.put(_A("d"), demand={"b": 0}) == ["c"]      # b is waited for: c (unwanted) goes
    assert store.put(_A("e"), demand={"b": 0, "a": 5, "d": 2, "e": 1}) == ["a"]   # all wanted: latest
    assert store.put(_A("f"), demand={"b": 0, "d": 2, "e": 1, "f": 9}) == ["f"]   # itself, needed last
    assert store.put(_A("g")) == ["b"]                  # no demand: plain LRU
    assert store.num_evictions == 4


def test_slot_eviction_and_prefetch_respect_pending_demand():
    def lr(n):
        return LoRARequest(n, ord(n))

    m = LoRASlotManager(3)
    for n in "abc":
        m.acquire(lr(n))
    for n in "abc":
        m.release(lr(n))                                # all idle; LRU order a, b, c
    grant = m.acquire(lr("d"), demand={"a": 0})
    assert grant.evicted == "b" and m.slot_of("a") == 0      # a is waited for: kept
    assert m.prefetch(lr("e"), demand={"a": 0, "c": 1, "e": 2}) is None   # every idle slot is waited for
    grant = m.prefetch(lr("e"), demand={"a": 0, "e": 2})
    assert grant.evicted == "c" and grant.load_needed and m.num_running(grant.lora_slot) == 0
    assert m.prefetch(lr("e"), demand={}) is None             # resident already
    assert m.acquire(lr("e")).load_needed is False            # its admission loads nothing
    m.acquire(lr("a"))
    m.release(lr("d"))
    # a and e run, d is idle: only d's slot can go, though it is waited for
    assert m.acquire(lr("f"), demand={"d": 0}).evicted == "d"
    assert m.acquire(lr("g")) is None                         # every slot has running requests
    assert (m.num_loads, m.num_evictions, m.num_prefetches) == (6, 3, 1)


def test_scheduler_prefetches_slots_for_the_next_admissions():
    """Requests held back by max_num_seqs get their adapters' slot loads in the step before the one that
    admits them (``LoRASlotLoad.prefetch``), which then loads nothing."""
    sched = make_scheduler(max_loras=3, max_num_seqs=1)
    runner = FakeRunner(sched)
    for rid, name in (("a", "PA"), ("b", "PB"), ("c", "PC"), ("d", "PD")):
        sched.add_request(make_request(rid, lora_request=lora(name), max_tokens=2))
    so = runner.step().scheduler_output
    assert [r.req_id for r in so.scheduled_new_reqs] == ["a"]
    assert [(ld.lora_request.lora_name, ld.prefetch) for ld in so.lora_loads] == [
        ("PA", False), ("PB", True), ("PC", True)]                # no slot left for PD: A runs, B and C wait
    admitted_loads = {}
    while sched.has_unfinished_requests():
        so = runner.step().scheduler_output
        for r in so.scheduled_new_reqs:
            admitted_loads[r.req_id] = [ld.lora_request.lora_name for ld in so.lora_loads if not ld.prefetch]
    assert admitted_loads["b"] == [] and admitted_loads["c"] == []   # prefetched: admitted without a load
    assert sched.lora_slots.num_prefetches >= 3                     # PD too, once a's slot idled
    assert sched.num_lora_reloads_while_running == 0
    assert_no_leaks(sched)


def test_cuda_slot_copies_wait_on_the_right_event(tiny_llama_dir, monkeypatch):
    """The stream bookkeeping of ``LoRAManager.load_slots`` on CUDA, with torch.cuda's streams and events
    replaced by recorders (the copies themselves run on CPU tensors): copies go to the side stream after
    the work launched before; a step's own loads are waited for at once; prefetch loads only by the
    next step's ``set_batch``, including when a step ran ``load_slots`` without ``set_batch``."""
    from transformers import AutoConfig

    from engine.config import LoRAConfig
    from engine.models.llama import LlamaForCausalLM
    from engine.outputs import LoRASlotLoad
    from lora.manager import LoRAManager
    from lora.peft_adapter import LoRAAdapter, PEFTAdapterConfig

    log = []

    class Event:
        count = 0

        def __init__(self):
            Event.count += 1
            self.id = Event.count

        def record(self, stream):
            log.append(("record", stream.name, self.id))

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

        def wait_event(self, event):
            log.append(("wait_event", self.name, event.id))

    main = Stream("main")
    mgr = LoRAManager(LoRAConfig(max_loras=4, max_lora_rank=8), LlamaForCausalLM(
        AutoConfig.from_pretrained(tiny_llama_dir), 512), torch.device("cpu"), torch.float32)
    for name in "vwxyz":
        mgr.store.put(LoRAAdapter(name, "/x", 2, PEFTAdapterConfig(r=2, lora_alpha=2), {}))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream("side"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: __import__("contextlib").nullcontext())
    mgr.device = torch.device("cuda")

    def load(name, slot, prefetch):
        return LoRASlotLoad(slot, LoRARequest(name, ord(name)), prefetch=prefetch)

    def drain():
        out = list(log)
        log.clear()
        return out

    mgr.load_slots([load("v", 0, False)])                  # this step's own load: waited for now
    assert drain() == [("wait_stream", "side", "main"), ("record", "side", 1), ("wait_event", "main", 1)]
    mgr.load_slots([load("w", 1, True)])                   # a prefetch: this step does not wait...
    mgr.set_batch(None)
    assert drain() == [("wait_stream", "side", "main"), ("record", "side", 2)]
    mgr.set_batch(None)                                    # ...the next one does
    assert drain() == [("wait_event", "main", 2)]
    mgr.set_batch(None)
    assert drain() == []
    mgr.load_slots([load("x", 2, True)])                   # a step that never reached set_batch
    mgr.load_slots([load("y", 3, True)])                   # the next step's prefetch
    mgr.set_batch(None)                                    # waits for x's copy, not y's
    assert drain()[-1] == ("wait_event", "main", 3)
    mgr.load_slots([load("z", 0, False)])                  # an own load waits for every copy before it too
    assert drain()[-1] == ("wait_event", "main", 5)
    mgr.set_batch(None)
    assert drain() == [] and mgr.slot_of("z") == 0 and mgr.num_slot_loads == 5


def test_reload_while_running_counter_sees_what_the_slot_counts_miss():
    """The counter checks slot loads against the running requests themselves: with the slot manager's
    count of a slot's running requests wrongly at 0, the load that evicts that slot is counted."""
    sched = make_scheduler(max_loras=1, max_num_seqs=4)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", lora_request=lora("CA"), max_tokens=8))
    runner.step()
    assert sched.num_lora_reloads_while_running == 0
    sched.lora_slots._num_running[0] = 0                # a bookkeeping fault: CA's slot looks idle
    sched.add_request(make_request("b", lora_request=lora("CB"), max_tokens=2))
    with pytest.raises(AssertionError, match="runs without a resident adapter"):
        sched.schedule()                                # the step message refuses it too
    assert sched.lora_slots.slot_of("CB") == 0
    assert sched.num_lora_reloads_while_running == 1 and sched.get_stats().num_lora_reloads_while_running == 1


def test_disk_reads_go_to_the_adapters_asked_first_in_a_step(tiny_llama_dir):
    """``host_ready`` queues reads only for the first max(max_cpu_loras - max_loras, max_cpu_loras / 2)
    adapters asked in a step (ready ones count) and while fewer than half the store's capacity are queued."""
    from transformers import AutoConfig

    from engine.config import LoRAConfig
    from engine.models.llama import LlamaForCausalLM
    from lora.manager import LoRAManager
    from lora.peft_adapter import LoRAAdapter, PEFTAdapterConfig

    class Loader:
        def __init__(self):
            self.asked, self.num_pending = [], 0

        def request(self, lora_request):
            self.asked.append(lora_request.lora_name)

        def take_done(self):
            return []

    mgr = LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=8), LlamaForCausalLM(
        AutoConfig.from_pretrained(tiny_llama_dir), 512), torch.device("cpu"), torch.float32)
    mgr.loader = Loader()
    mgr.store.put(LoRAAdapter("h", "/x", 2, PEFTAdapterConfig(r=2, lora_alpha=2), {}))
    assert mgr.host_ready(LoRARequest("h", 1))
    assert not any(mgr.host_ready(LoRARequest(n, ord(n))) for n in "abcdefg")
    assert mgr.loader.asked == list("abcde")                # 8 - 2 = 6 asked, h among them
    assert not mgr.host_ready(LoRARequest("f", 9)) and mgr.loader.asked == list("abcde")
    assert mgr.take_reads() == {}                            # the next step
    mgr.loader.num_pending = 4                               # half the store's capacity queued
    assert not mgr.host_ready(LoRARequest("f", 9)) and mgr.loader.asked == list("abcde")
    mgr.loader.num_pending = 3
    assert not mgr.host_ready(LoRARequest("f", 9)) and mgr.loader.asked == list("abcdef")
