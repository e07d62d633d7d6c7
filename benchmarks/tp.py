"""Tensor parallelism through the engine's own ``LLM(..., tensor_parallel_size=N)`` (issue #25): decode
step time against its bytes floor, offline throughput per GPU, with and without adapters, and the
collectives' share of a step.

Examples:
    # 2 x H200 (h200_run.sh's `tp` phase): Llama-3-70B shape at TP=2; Llama-3-8B at TP=1 and 2, 16 adapters
    python benchmarks/tp.py --model llama3-70b --tp 2 --out benchmarks/out/tp_llama3_70b.json
    python benchmarks/tp.py --model llama3-8b --tp 1 2 --lora-adapters 0 16 \
        --out benchmarks/out/tp_llama3_8b.json
    # CPU, gloo, a tiny random config in well under a minute (tests/distributed/test_tp_benchmark.py)
    python benchmarks/tp.py --model tiny --device cpu --tp 1 2

Random weights (``load_format="dummy"``; bfloat16 on CUDA, float32 on CPU) from a config-only
checkpoint (``throughput.dummy_checkpoint``). Each configuration (TP size x adapter count) runs in a
process of its own, so that GPU memory and the process group start clean, and builds one engine on
which it measures, in this order:

  * decode: B requests of ``--context-len`` random prompt ids are prefilled, then wall ms per
    ``LLMEngine.step()`` over ``--steps`` steady decode steps, at each of ``--batch-sizes``;
  * floor: the bytes ONE GPU reads per decode step (its shard of every weight once, the embedding
    for B rows only, its KV heads' cache over the contexts) / ``H200_HBM_BYTES_S``; the ranks read
    in parallel, so that is the step's floor. "floor (copy)" divides by the device-to-device copy
    bandwidth measured first (``latency.measure_copy_bandwidth``, as the `latency` phase does);
  * collectives: ``--profile-steps`` more decode steps under ``torch.profiler`` in rank 0's process:
    device time of the NCCL all-reduce / all-gather kernels (CUDA) or the gloo worker thread's
    all_reduce / all_gather work (CPU), and the gloo broadcast of each step's ``SchedulerOutput``, per
    step; the all-reduce's share is of the unprofiled step time above (tracing slows rank 0's host:
    ``profiled_step_ms`` in the JSON). NOTE: a collective's time includes waiting for the slower rank;
  * throughput: ``throughput.make_workload`` with throughput.py's defaults for the Llama shapes
    (1,000 requests, prompts uniform in [128, 1024], outputs in [64, 512], seed 0: the requests of
    the `throughput` phase), one timed ``LLM.generate`` after an untimed warm-up
    (``throughput.timed_generate``); output tok/s, and per GPU (/ TP).

With N adapters, request i runs adapter i % N: random rank-``--lora-rank`` PEFT adapters on all 7
projections (``multi_lora.write_random_adapter``, 4 weight files shared round-robin by N names, each
name its own slot). "vs TP=1" compares with the TP=1 row of the same model and adapter count. A
configuration whose weights do not fit one GPU's memory (the 70B shape at TP=1) is skipped. Prints
tables, writes JSON (after every configuration).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue as queue_lib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.latency import _random_prompts, _run_steps, floor_bytes, measure_copy_bandwidth  # noqa: E402
from benchmarks.latency import sync  # noqa: E402
from benchmarks.multi_lora import TINY, write_random_adapter  # noqa: E402
from benchmarks.throughput import LLAMA3_8B, dummy_checkpoint, make_workload, parse_range  # noqa: E402
from benchmarks.throughput import timed_generate  # noqa: E402

LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                  rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B, "tiny": TINY}

H200_HBM_BYTES_S = 4.8e12
"""One H200's memory bandwidth: 4.8 TB/s of HBM3e, NVIDIA's H200 (SXM) datasheet figure. A peak,
not reached by copies (the `latency` phase measured 4.26 TB/s, bytes read + written)."""
FIT_FRACTION = 0.8
"""A configuration runs only when its weights per GPU take at most this share of one GPU's memory
(the rest: KV cache and activations). Llama-3-70B in bf16 is ~141 GB: not at TP=1 on a 141 GB H200."""
COLLECTIVES = ("all_reduce", "all_gather", "broadcast")
WARM_DECODE_STEPS = 4
"""Untimed decode steps after the prefill, before the timed ones."""

SIZED_OPTIONS = {   # option: (type, default for the Llama shapes, default for tiny, help)
    "batch-sizes": (str, "1,128", "1,4", "decode batches, comma-separated"),
    "context-len": (int, 512, 32, "decode prompts' tokens"),
    "steps": (int, 32, 4, "timed decode steps"),
    "profile-steps": (int, 8, 3, "profiled decode steps"),
    "num-prompts": (int, 1000, 12, "throughput requests"),
    "input-len": (str, "128:1024", "16:48", "throughput prompt tokens, N or MIN:MAX (uniform)"),
    "output-len": (str, "64:512", "4:12", "throughput output tokens, N or MIN:MAX (uniform)"),
    "warmup-prompts": (int, 32, 4, "untimed throughput requests first"),
    "max-model-len": (int, 2048, 256, "the engine's"),
}


@dataclass
class Case:
    """One configuration, measured in a process of its own (``run_case``)."""

    model: str
    """A key of ``SHAPES``."""
    model_dir: str
    """The config-only checkpoint (``load_format="dummy"``)."""
    tp: int
    """``tensor_parallel_size``."""
    num_adapters: int
    """Distinct adapters (0: an engine without LoRA); request i runs adapter i % N."""
    adapter_dirs: list[str]
    """PEFT directories the adapter names share round-robin."""
    settings: dict
    """The parsed command line (``vars(args)``)."""


@dataclass
class CollectiveTimes:
    """What the collectives took over some profiled decode steps, per step."""

    profiled_step_ms: float
    """Wall ms per step under the profiler (synchronized at the end)."""
    ms: dict[str, float]
    """Collective kind (``COLLECTIVES``) -> ms per step."""
    calls: dict[str, float]
    """Collective kind -> calls per step."""


# ----------------------------------------------------------------------------------------
# One configuration (its own process)
# ----------------------------------------------------------------------------------------
def run_case(case: Case, results) -> None:
    """Process entry: measure ``case`` and put its row, or its error, on ``results``."""
    try:
        row = measure_case(case)
    except Exception as e:  # noqa: BLE001 - reported in the row, the next configuration still runs
        import traceback
        traceback.print_exc()
        row = dict(_label(case), error=f"{type(e).__name__}: {e}")
    results.put(row)


def measure_case(case: Case) -> dict:
    from engine import LLM

    s = case.settings
    row = _label(case)
    too_big = _does_not_fit(case)
    if too_big:
        return dict(row, skipped=too_big)
    cuda = s["device"] == "cuda"
    copy_bw = measure_copy_bandwidth() if cuda else None
    t0 = time.perf_counter()
    llm = LLM(case.model_dir, **_engine_kwargs(case))
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    try:
        loras = _register_adapters(engine, case)
        decode = [decode_row(engine, case, b, loras, copy_bw) for b in s["batch_sizes"]]
        throughput = None
        if not s["skip_throughput"]:
            throughput = _throughput(llm, case, loras)
            print(f"  {_name(case)}: {throughput['output_tok_s']:.1f} output tok/s over "
                  f"{throughput['requests']} requests", flush=True)
        return dict(row, device=torch.cuda.get_device_name() if cuda else f"cpu x{torch.get_num_threads()}",
                    graphs=engine.runner.graphs is not None, load_s=load_s, copy_bandwidth_bytes_s=copy_bw,
                    decode=decode, throughput=throughput)
    finally:
        engine.core.shutdown()


def _label(case: Case) -> dict:
    return dict(model=case.model, tp=case.tp, num_adapters=case.num_adapters)


def _name(case: Case) -> str:
    return f"{case.model} TP={case.tp}" + (f" {case.num_adapters} adapters" if case.num_adapters else "")


def _engine_kwargs(case: Case) -> dict:
    s = case.settings
    kw = dict(load_format="dummy", dtype=s["dtype"], device=s["device"], tensor_parallel_size=case.tp, seed=0,
              max_model_len=s["max_model_len"], enforce_eager=s["enforce_eager"])
    if s["gpu_memory_utilization"] is not None:
        kw["gpu_memory_utilization"] = s["gpu_memory_utilization"]
    if case.num_adapters:
        kw.update(enable_lora=True, max_loras=case.num_adapters, max_lora_rank=s["lora_rank"],
                  max_cpu_loras=case.num_adapters)
    return kw


def _does_not_fit(case: Case) -> Optional[str]:
    """Why the configuration cannot run on these GPUs (None: it can, or it runs on the CPU)."""
    if case.settings["device"] != "cuda":
        return None
    elem_bytes = torch.finfo(getattr(torch, case.settings["dtype"])).bits // 8
    per_gpu = estimated_weight_bytes(SHAPES[case.model], elem_bytes) / case.tp
    total = torch.cuda.get_device_properties(0).total_memory
    if per_gpu <= FIT_FRACTION * total:
        return None
    return (f"{per_gpu / 1e9:.0f} GB of weights per GPU > {FIT_FRACTION:.0%} of the GPU's "
            f"{total / 1e9:.0f} GB; use more ranks")


def estimated_weight_bytes(shape: dict, elem_bytes: int) -> int:
    """Bytes of a Llama-shaped model's weights (projections, norms, embedding, LM head)."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter + 2 * h
    embeddings = shape["vocab_size"] * h * (1 if shape.get("tie_word_embeddings") else 2)
    return (layers * per_layer + embeddings + h) * elem_bytes


def _register_adapters(engine, case: Case) -> list:
    from lora import LoRARequest

    names = [LoRARequest(f"lora-{i}", i + 1, case.adapter_dirs[i % len(case.adapter_dirs)])
             for i in range(case.num_adapters)]
    for r in names:
        engine.add_lora(r)
    return names


# ----------------------------------------------------------------------------------------
# Decode steps: time, floor, collectives
# ----------------------------------------------------------------------------------------
def decode_row(engine, case: Case, batch: int, loras: list, copy_bw: Optional[float]) -> dict:
    """``batch`` requests decoding together: step time, rank 0's bytes floor, collectives."""
    from engine import SamplingParams

    s = case.settings
    runner = engine.runner
    cfg = runner.model.config
    params = SamplingParams(temperature=0.0, ignore_eos=True,
                            max_tokens=WARM_DECODE_STEPS + s["steps"] + s["profile_steps"] + 17)
    ids = [f"tp{batch}-{i}" for i in range(batch)]
    prompts = _random_prompts(batch, s["context_len"], cfg.vocab_size, seed=batch)
    for i, (rid, p) in enumerate(zip(ids, prompts)):
        engine.add_request(rid, {"prompt_token_ids": p}, params,
                           lora_request=loras[i % len(loras)] if loras else None)
    while not (len(engine.scheduler.waiting) == 0 and engine.scheduler.last_num_scheduled_tokens == batch):
        engine.step()   # prefill (chunked) until every request decodes
    _run_steps(engine, WARM_DECODE_STEPS)
    step_ms = _run_steps(engine, s["steps"]) * 1e3
    coll = collective_times(engine, s["profile_steps"], s["device"] == "cuda")
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    fb = rank_floor_bytes(runner, case.tp, batch, s["context_len"] + 6 + s["steps"] / 2)
    floor_ms = fb["total_bytes"] / H200_HBM_BYTES_S * 1e3 if s["device"] == "cuda" else None
    row = dict(batch=batch, context_len=s["context_len"], step_ms=step_ms, tok_s=batch / step_ms * 1e3,
               tok_s_per_gpu=batch / step_ms * 1e3 / case.tp, floor_ms=floor_ms,
               step_over_floor=step_ms / floor_ms if floor_ms else None,
               floor_copy_ms=fb["total_bytes"] / copy_bw * 1e3 if copy_bw else None, **fb,
               profiled_step_ms=coll.profiled_step_ms,
               **{f"{k}_ms": coll.ms[k] for k in COLLECTIVES},
               **{f"{k}_calls": coll.calls[k] for k in COLLECTIVES},
               all_reduce_share=coll.ms["all_reduce"] / step_ms)
    print(f"  {_name(case)} batch {batch}: step {step_ms:.2f} ms, all-reduce {coll.ms['all_reduce']:.2f} ms "
          f"({coll.calls['all_reduce']:.0f} calls) per step, {row['all_reduce_share']:.1%} of the step "
          f"({coll.profiled_step_ms:.2f} ms profiled)", flush=True)
    return row


def rank_floor_bytes(runner, tp: int, batch: int, context_len: float) -> dict:
    """``latency.floor_bytes`` for rank 0's shard: its weights (as built) and its KV heads."""
    from engine.distributed.sharding import attention_shard

    cfg = runner.model.config
    elem = torch.finfo(runner.dtype).bits // 8
    weight_bytes = sum(p.numel() for p in runner.model.parameters()) * elem
    embed_bytes = runner.model.model.embed_tokens.weight.numel() * elem
    heads = attention_shard(cfg.num_attention_heads, cfg.num_key_value_heads, 0, tp)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rank_cfg = SimpleNamespace(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                               num_attention_heads=heads.num_heads, num_key_value_heads=heads.num_kv_heads,
                               head_dim=head_dim)
    return floor_bytes(rank_cfg, weight_bytes, embed_bytes, batch, context_len, elem)


def collective_times(engine, steps: int, cuda: bool) -> CollectiveTimes:
    """Profile ``steps`` engine steps in this (rank 0's) process and sum the collectives' own events."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities):   # NOTE: a first profile starts the tracer inside its step
        _run_steps(engine, 1)
    sync()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        _run_steps(engine, steps)
        sync()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    us, calls = dict.fromkeys(COLLECTIVES, 0.0), dict.fromkeys(COLLECTIVES, 0)
    for ev in prof.events():
        kind = collective_kind(ev.name, ev.device_type == torch.autograd.DeviceType.CUDA)
        if kind is not None:
            us[kind] += ev.time_range.elapsed_us()
            calls[kind] += 1
    return CollectiveTimes(wall_ms, {k: v / 1e3 / steps for k, v in us.items()},
                           {k: v / steps for k, v in calls.items()})


def collective_kind(name: str, on_device: bool) -> Optional[str]:
    """The kind (``COLLECTIVES``) of a collective's own profiler event, else None: an NCCL kernel on the
    device (e.g. ``ncclDevKernel_AllReduce_Sum_bf16_RING_LL``) or gloo's work on its thread
    (``gloo:all_reduce``). The dispatcher's ``c10d::allreduce_`` and NCCL's host-side ``nccl:all_reduce``
    only enqueue the work, and the device-side copy of ``nccl:all_reduce`` (a GPU user annotation) spans
    the kernel: counting either would count each call twice."""
    low = name.lower()
    nccl_kernel = on_device and low.startswith("nccl") and "kernel" in low
    if not (nccl_kernel or (not on_device and low.startswith("gloo:"))):
        return None
    flat = low.replace("_", "")
    return next((k for k in COLLECTIVES if k.replace("_", "") in flat), None)


def _throughput(llm, case: Case, loras: list) -> dict:
    s = case.settings
    vocab = llm.llm_engine.runner.model.shape.vocab_size
    prompts, outs = make_workload(s["num_prompts"], parse_range(s["input_len"]), parse_range(s["output_len"]),
                                  vocab, s["seed"])
    per_request = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    run = timed_generate(llm, prompts, outs, s["warmup_prompts"], per_request)
    return dict(run, output_tok_s_per_gpu=run["output_tok_s"] / case.tp)


# ----------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------
def run_in_process(case: Case) -> dict:
    """``run_case`` in a fresh spawned process; its row, or an error row when it died without one."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=run_case, args=(case, results), name=f"chorus-tp-bench-{case.tp}")
    proc.start()
    row = None
    while row is None:
        try:
            row = results.get(timeout=1.0)
        except queue_lib.Empty:
            if proc.is_alive():
                continue
            try:
                row = results.get(timeout=5.0)
            except queue_lib.Empty:
                row = dict(_label(case), error=f"its process exited with code {proc.exitcode}, no result")
    proc.join()
    return row


def compare_with_tp1(rows: list[dict]) -> None:
    """Each row's ratios to the TP=1 row of the same model and adapter count, in place."""
    ok = [r for r in rows if "decode" in r]
    for r in ok:
        ref = next((x for x in ok if x["tp"] == 1 and x["model"] == r["model"]
                    and x["num_adapters"] == r["num_adapters"]), None)
        if ref is None:
            continue
        ref_steps = {d["batch"]: d["step_ms"] for d in ref["decode"]}
        for d in r["decode"]:
            if d["batch"] in ref_steps:
                d["step_vs_tp1"] = d["step_ms"] / ref_steps[d["batch"]]
        if r.get("throughput") and ref.get("throughput"):
            r["throughput"]["per_gpu_vs_tp1"] = (r["throughput"]["output_tok_s_per_gpu"]
                                                 / ref["throughput"]["output_tok_s_per_gpu"])


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def print_tables(report: dict) -> None:
    rows = report["rows"]
    args = report["args"]
    print(f"\nmodel {args['model']} ({args['dtype']}, random weights), device {args['device']}; decode: "
          f"{args['context_len']}-token prompts, {args['steps']} timed steps, {args['profile_steps']} "
          f"profiled; floor = one GPU's bytes / {H200_HBM_BYTES_S / 1e12:.1f} TB/s (H200 datasheet)")
    print(f"{'TP':>2s} {'adapters':>8s} {'batch':>5s} {'step ms':>8s} {'vs TP=1':>7s} {'floor ms':>8s} "
          f"{'x floor':>7s} {'floor(copy)':>11s} {'tok/s/GPU':>9s} {'AR ms':>6s} {'AR/step':>7s} "
          f"{'AR share':>8s} {'AG ms':>6s} {'bcast ms':>8s}")
    for r in rows:
        if "decode" not in r:
            print(f"{r['tp']:2d} {r['num_adapters']:8d}  {r.get('skipped') or r.get('error')}")
            continue
        for d in r["decode"]:
            print(f"{r['tp']:2d} {r['num_adapters']:8d} {d['batch']:5d} {d['step_ms']:8.2f} "
                  f"{_fmt(d.get('step_vs_tp1')):>7s} {_fmt(d['floor_ms']):>8s} "
                  f"{_fmt(d['step_over_floor']):>7s} {_fmt(d['floor_copy_ms']):>11s} "
                  f"{d['tok_s_per_gpu']:9.1f} {d['all_reduce_ms']:6.2f} {d['all_reduce_calls']:7.0f} "
                  f"{d['all_reduce_share']:8.1%} {d['all_gather_ms']:6.2f} {d['broadcast_ms']:8.2f}")
    if args["skip_throughput"]:
        return
    print(f"\nthroughput: {args['num_prompts']} requests, input {args['input_len']}, "
          f"output {args['output_len']} tokens")
    print(f"{'TP':>2s} {'adapters':>8s} {'seconds':>8s} {'out tok/s':>10s} {'per GPU':>9s} {'vs TP=1':>7s} "
          f"{'GPU busy':>8s} {'steps':>6s} {'preempt':>7s} {'graphs':>6s} {'load s':>7s}")
    for r in rows:
        t = r.get("throughput")
        if not t:
            continue
        print(f"{r['tp']:2d} {r['num_adapters']:8d} {t['seconds']:8.2f} {t['output_tok_s']:10.1f} "
              f"{t['output_tok_s_per_gpu']:9.1f} {_fmt(t.get('per_gpu_vs_tp1')):>7s} "
              f"{_fmt(t['gpu_busy_fraction'], '.3f'):>8s} {t['steps']:6d} {t['preemptions']:7d} "
              f"{str(r['graphs']):>6s} {r['load_s']:7.1f}")


def _dump(report: dict) -> None:
    """Write the JSON (after every configuration, so a run cut short keeps what it measured)."""
    out = Path(report["args"]["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="llama3-8b",
                    help="Llama-3 shape with random weights, or a tiny random config (CPU)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor_parallel_size values")
    ap.add_argument("--lora-adapters", type=int, nargs="+", default=[0],
                    help="adapter counts (0: an engine without LoRA), each at every --tp")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    for name, (kind, big, tiny, help_) in SIZED_OPTIONS.items():
        ap.add_argument(f"--{name}", type=kind, default=None, help=f"{help_} (default {big}; tiny {tiny})")
    ap.add_argument("--seed", type=int, default=0, help="the throughput workload's")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None, help="default: the engine's")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="CUDA graphs off at TP=1 too (TP > 1 runs eagerly either way)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--workdir", default=str(Path(os.environ.get("TMPDIR", "/tmp")) / "chorus-tp"),
                    help="where the config-only checkpoints and adapters go")
    ap.add_argument("--out", default="benchmarks/out/tp.json")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda without a CUDA GPU")
    for name, (_, big, tiny, _) in SIZED_OPTIONS.items():
        key = name.replace("-", "_")
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.model == "tiny" else big)
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    shape = SHAPES[args.model]
    work = Path(args.workdir)
    model_dir = str(dummy_checkpoint(work / args.model, "bfloat16", shape))
    adapter_dirs = []
    if max(args.lora_adapters) > 0:
        for i in range(min(4, max(args.lora_adapters))):
            d = work / f"{args.model}-adapter-r{args.lora_rank}-{i}"
            if not (d / "adapter_config.json").exists():
                write_random_adapter(d, shape, args.lora_rank, seed=i)
            adapter_dirs.append(str(d))
    report = dict(args=vars(args), bandwidth_bytes_s=H200_HBM_BYTES_S, date=time.strftime("%Y-%m-%d"),
                  rows=[])
    for n in args.lora_adapters:
        for tp in args.tp:
            case = Case(args.model, model_dir, tp, n, adapter_dirs, vars(args))
            print(f"== {_name(case)}", flush=True)
            t0 = time.perf_counter()
            report["rows"].append(dict(run_in_process(case), wall_s=time.perf_counter() - t0))
            compare_with_tp1(report["rows"])
            _dump(report)
    print_tables(report)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    sys.exit(1 if any("error" in r for r in main()["rows"]) else 0)
