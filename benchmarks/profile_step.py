"""Where one engine step's device time goes: kernel table per step kind (torch.profiler).

Example (H200, Llama-3-8B shape, random bf16 weights):
    python benchmarks/profile_step.py --llama3-8b-dummy --batch-sizes 1,256 --context-len 512
    python benchmarks/profile_step.py --shape qwen3-30b-a3b --quantization fp8 --batch-sizes 1,64 --skip-mixed

For each batch size B: B requests with ``--context-len``-token prompts are prefilled, decode runs
a few warm steps, then ``--steps`` decode steps are profiled; then one more request with a
``--prefill-len`` prompt arrives (on the first adapter with ``--lora-adapters``) and the mixed
step (B decodes + one prefill) is profiled, with CUDA graphs (as the engine runs it) and eagerly. Prints, per case, the device time per step and
the kernels by total time (us per step, launches per step); writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.shapes import add_shape_args, engine_quantization, resolve_shape_args  # noqa: E402
from benchmarks.throughput import llama3_8b_dummy  # noqa: E402


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def _profile(engine, steps: int) -> tuple[dict, float, dict]:
    """Kernel name -> (device us, launches) per step, and wall ms per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans = []   # (start us, end us, name) of every device event
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name[:90]
            table[name][0] += ev.device_time / steps if hasattr(ev, "device_time") else ev.cuda_time / steps
            table[name][1] += 1 / steps
            spans.append((ev.time_range.start, ev.time_range.end, name))
    return dict(table), wall_ms, _gaps(spans, steps)


def _gaps(spans: list, steps: int) -> dict:
    """Idle device time between consecutive device events (sorted by start; overlaps count as
    no gap): per step in total, by size, and by (previous kernel -> next kernel) pair."""
    spans.sort()
    pairs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    sizes = {"<2us": 0.0, "2-5us": 0.0, "5-20us": 0.0, ">=20us": 0.0}
    end, prev = None, None
    for start, stop, name in spans:
        if end is not None and start > end:
            gap = start - end
            key = f"{prev[:40]} -> {name[:40]}"
            pairs[key][0] += gap / steps
            pairs[key][1] += 1 / steps
            sizes["<2us" if gap < 2 else "2-5us" if gap < 5 else "5-20us" if gap < 20 else ">=20us"] += gap / steps
        if end is None or stop > end:
            end, prev = stop, name
    total = sum(v[0] for v in pairs.values())
    top = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:12]
    return dict(idle_us_per_step=total, by_size_us=sizes,
                top_pairs=[dict(pair=k, us_per_step=v[0], per_step=v[1]) for k, v in top])


def _show(label: str, table: dict, wall_ms: float, gaps: dict, top: int) -> dict:
    total = sum(v[0] for v in table.values())
    launches = sum(v[1] for v in table.values())
    print(f"\n== {label}: device {total / 1e3:.2f} ms/step, wall {wall_ms:.2f} ms/step, "
          f"{launches:.0f} kernels/step")
    print(f"{'kernel':90s} {'us/step':>9s} {'n/step':>7s} {'share':>6s}")
    rows = sorted(table.items(), key=lambda kv: -kv[1][0])
    for name, (us, n) in rows[:top]:
        print(f"{name:90s} {us:9.1f} {n:7.1f} {us / max(total, 1e-9):6.1%}")
    sizes = ", ".join(f"{k} {v:.0f}" for k, v in gaps["by_size_us"].items())
    print(f"idle between device events: {gaps['idle_us_per_step']:.0f} us/step ({sizes}); largest pairs:")
    for p in gaps["top_pairs"][:8]:
        print(f"  {p['us_per_step']:8.1f} us/step {p['per_step']:6.1f}x  {p['pair']}")
    return dict(label=label, device_ms=total / 1e3, wall_ms=wall_ms, kernels_per_step=launches, gaps=gaps,
                kernels=[dict(name=k, us_per_step=v[0], per_step=v[1]) for k, v in rows])


def _adapters(engine, args) -> list:
    """``--lora-adapters`` random PEFT adapters on disk, registered with the engine."""
    import tempfile

    from benchmarks.multi_lora import write_random_adapter
    from lora import LoRARequest

    cfg = engine.runner.model.config
    shape = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                 num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                 num_key_value_heads=cfg.num_key_value_heads)
    root = Path(tempfile.mkdtemp(prefix="chorus-profile-lora-"))
    dirs = [write_random_adapter(root / f"a{i}", shape, args.lora_rank, seed=i) for i in range(min(4, args.lora_adapters))]
    reqs = [LoRARequest(f"lora-{i}", i + 1, str(dirs[i % len(dirs)])) for i in range(args.lora_adapters)]
    for r in reqs:
        engine.add_lora(r)
    return reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    add_shape_args(ap)
    ap.add_argument("--batch-sizes", default="1,256")
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--lora-adapters", type=int, default=0,
                    help="N > 0: a LoRA engine, request i runs random rank-16 adapter i %% N (7 projections)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--skip-mixed", action="store_true", help="profile decode steps only")
    ap.add_argument("--out", default="benchmarks/out/profile_step.json")
    args = ap.parse_args()
    resolve_shape_args(args)
    from engine import LLM, SamplingParams

    model = args.model or llama3_8b_dummy()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    lora_kw = {}
    if args.lora_adapters:
        lora_kw = dict(enable_lora=True, max_loras=args.lora_adapters, max_lora_rank=args.lora_rank,
                       max_cpu_loras=args.lora_adapters)
    llm = LLM(model, load_format="dummy" if args.model is None else args.load_format,
              quantization=engine_quantization(args), kv_cache_dtype=args.kv_cache_dtype,
              max_num_seqs=max(batch_sizes) + 1, max_model_len=2048, enable_prefix_caching=False,
              gpu_memory_utilization=0.9, seed=0, **lora_kw)
    engine = llm.llm_engine
    loras = _adapters(engine, args) if args.lora_adapters else []
    vocab = engine.runner.model.shape.vocab_size
    report = []
    for b in batch_sizes:
        params = SamplingParams(temperature=0.0, max_tokens=4 * args.steps + 64, ignore_eos=True)
        ids = [f"p{b}-{i}" for i in range(b)]
        for i, (rid, p) in enumerate(zip(ids, _prompts(b, args.context_len, vocab, b))):
            engine.add_request(rid, {"prompt_token_ids": p}, params,
                               lora_request=loras[i % len(loras)] if loras else None)
        while not (len(engine.scheduler.waiting) == 0 and engine.scheduler.last_num_scheduled_tokens == b):
            engine.step()
        for _ in range(4):
            engine.step()
        table, wall, gaps = _profile(engine, args.steps)
        lora = f", {args.lora_adapters} adapters" if loras else ""
        report.append(_show(f"decode batch {b}{lora} (graph)", table, wall, gaps, args.top))
        for mode in () if args.skip_mixed else ("graph", "eager"):
            graphs = engine.runner.graphs
            if mode == "eager":
                engine.runner.graphs = None
            rid = f"mixed-{b}-{mode}"
            engine.add_request(rid, {"prompt_token_ids": _prompts(1, args.prefill_len, vocab, 7)[0]}, params,
                               lora_request=loras[0] if loras else None)
            # The step after the arrival: b decodes + the new prompt (async scheduling: one step ahead).
            table, wall, gaps = _profile(engine, 2)
            engine.runner.graphs = graphs
            report.append(_show(f"mixed: {b} decodes + {args.prefill_len}-token prefill ({mode}), "
                                f"2 steps averaged", table, wall, gaps, args.top))
            engine.abort_request([rid])
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
