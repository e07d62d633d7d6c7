"""Decode step time vs its memory-bandwidth floor, and transformers' per-token time, in one run.

Examples:
    # H200: Llama-3-8B shape, random bf16 weights, 512-token contexts
    python benchmarks/latency.py --llama3-8b-dummy --batch-sizes 1,32,128,256 --context-len 512
    # another shape (benchmarks/shapes.py), FP8 weights in the engine; --tiny: its small variant, for CPU
    python benchmarks/latency.py --shape qwen3-30b-a3b --batch-sizes 1,64
    python benchmarks/latency.py --shape llama3-8b --quantization fp8 --batch-sizes 1,64,256
    # int4: a GPTQ checkpoint of random 4-bit weights (groups of 128) through the W4A16 layer
    python benchmarks/latency.py --shape llama3-8b --quantization int4 --batch-sizes 1,16,64
    # Llama-3-70B shape on one H200: FP8 weights (drawn and quantized one projection at a time), FP8 KV cache
    python benchmarks/latency.py --shape llama3-70b --quantization fp8 --kv-cache-dtype fp8 --batch-sizes 1,64 \
        --gpu-memory-utilization 0.9 --skip-hf
    # CPU smoke test on a small checkpoint
    python benchmarks/latency.py --model PATH --batch-sizes 1,4 --context-len 32 --steps 4

Per batch size B: B requests with random ``--context-len``-token prompts are prefilled, then the
engine runs decode-only steps (a CUDA graph each on CUDA, with async scheduling). Reported:
  * step ms: wall time per ``LLMEngine.step()`` in steady decode (what a user sees per token);
  * gpu ms: device time of one step (CUDA events around each step's work);
  * graph ms: the batch's decode graph replayed alone, back to back (to compare with gpu ms,
    which adds the step's input copies and sampling);
  * busy: GPU-busy fraction of wall time over those steps (sum of step intervals / span);
  * eager ms: the same steps with CUDA graphs off (the runner's eager path);
  * floor ms: (weight bytes + KV bytes read per step) / copy bandwidth, the bandwidth measured
    first as a device-to-device copy (bytes read + written); the bytes from the config
    (``benchmarks.shapes.decode_bytes``): every weight once but the embedding (B rows of it), with
    ``--quantization fp8`` the projections at 1 byte per weight + their scales, with ``int4`` at half a byte
    + a bf16 scale and zero point per 128 inputs (the embedding and LM head in bf16), with ``--kv-cache-dtype fp8``
    the KV at 1 byte per element; of a MoE layer the
    router and the experts B tokens select, E * (1 - (1 - k/E)^B) of E experts at top-k under uniform
    routing (an expectation: real routing is not uniform); the KV of every context token, at most
    the window in a sliding-window layer;
  * HF ms/token: transformers ``generate`` on the same shapes, (t(1 + k new) - t(1 new)) / k.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.shapes import (add_shape_args, decode_bytes, engine_quantization, int4_group_size,  # noqa: E402
                               kv_elem_bytes, resolve_shape_args)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_copy_bandwidth(num_bytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    if not torch.cuda.is_available():
        return float("nan")
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    stop.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(stop) / 1e3 / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / seconds


def floor_bytes(hf_cfg, weight_bytes: int, embed_bytes: int, batch: int, context_len: float,
                elem_bytes: int = 2) -> dict:
    """Bytes a decode step must read: every weight once (the embedding only for B rows) + the KV, from the
    built weights (tp.py's floor of one rank's shard; a dense model; this script's own is ``decode_bytes``)."""
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    kv_per_token = 2 * hf_cfg.num_hidden_layers * hf_cfg.num_key_value_heads * head_dim * elem_bytes
    weights = weight_bytes - embed_bytes + batch * hf_cfg.hidden_size * elem_bytes
    kv = int(batch * context_len * kv_per_token)
    return dict(weight_bytes=weights, kv_bytes=kv, total_bytes=weights + kv)


def _random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def _run_steps(engine, steps: int) -> float:
    """Wall seconds per engine step over ``steps`` steady steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps


def _graph_replay_ms(runner, batch: int, reps: int) -> float:
    """Device ms of the batch's decode graph replayed alone, back to back over the last step's
    inputs (it rewrites the same KV slots with the same values)."""
    if runner.graphs is None:
        return float("nan")
    key = runner.graphs.key_for(batch, batch, True, 0)
    if key is None:
        return float("nan")
    runner.graphs.replay(key)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        runner.graphs.replay(key)
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / reps


def chorus_llm(args, model_dir: str, max_num_seqs: int, max_model_len: int, **engine_kw):
    """The engine the decode rows run on (``args``: this script's flags; ``engine_kw`` adds or overrides)."""
    from engine import LLM
    kw = dict(load_format=args.load_format, dtype=args.dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              gpu_memory_utilization=args.gpu_memory_utilization, quantization=engine_quantization(args),
              kv_cache_dtype=args.kv_cache_dtype, seed=0)
    return LLM(model_dir, **{**kw, **engine_kw})


def chorus_rows(args, model_dir: str, batch_sizes: list[int], bandwidth: float) -> list[dict]:
    llm = chorus_llm(args, model_dir, max(batch_sizes), args.context_len + 2 * args.steps + 64)
    rows = decode_rows(llm, args, batch_sizes, bandwidth)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def decode_rows(llm, args, batch_sizes: list[int], bandwidth: float) -> list[dict]:
    """One row per batch size of steady decode on ``llm`` at ``args.context_len`` tokens (module docstring)."""
    from engine import SamplingParams
    from benchmarks.step_timer import StepTimer

    engine = llm.llm_engine
    runner = engine.runner
    hf_cfg = engine.runner.model.config
    elem = torch.finfo(engine.runner.dtype).bits // 8
    cuda = torch.cuda.is_available()
    rows = []
    for b in batch_sizes:
        prompts = _random_prompts(b, args.context_len, hf_cfg.vocab_size, seed=b)
        params = SamplingParams(temperature=0.0, max_tokens=4 * args.steps + 16, ignore_eos=True)
        ids = [f"lat{b}-{i}" for i in range(b)]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, {"prompt_token_ids": p}, params)
        while True:   # prefill (chunked) until every request decodes
            engine.step()
            st = engine.scheduler
            if len(st.waiting) == 0 and st.last_num_scheduled_tokens == b:
                break
        _run_steps(engine, 4)                                   # warm decode
        if cuda:
            runner.step_observer = StepTimer()
        step_s = _run_steps(engine, args.steps)
        timing = runner.step_observer.summary() if cuda else {}
        runner.step_observer = None
        graph_ms = _graph_replay_ms(runner, b, args.steps) if cuda else float("nan")
        graphs, runner.graphs = runner.graphs, None             # same steps, eager
        _run_steps(engine, 2)
        eager_s = _run_steps(engine, max(4, args.steps // 4))
        runner.graphs = graphs
        mean_ctx = args.context_len + 6 + args.steps / 2
        fb = decode_bytes(hf_cfg, b, mean_ctx, elem, kv_elem_bytes(args.kv_cache_dtype, elem),
                          fp8=args.quantization == "fp8",
                          int4_group_size=int4_group_size(args.tiny) if args.quantization == "int4" else None)
        floor_ms = fb["total_bytes"] / bandwidth * 1e3 if cuda else float("nan")
        gpu_ms = timing.get("gpu_busy_ms", float("nan")) / max(1, timing.get("steps", 1))
        rows.append(dict(batch=b, context_len=args.context_len, step_ms=step_s * 1e3, gpu_ms=gpu_ms,
                         graph_ms=graph_ms,
                         busy_fraction=timing.get("busy_fraction", float("nan")), eager_step_ms=eager_s * 1e3,
                         floor_ms=floor_ms, step_over_floor=step_s * 1e3 / floor_ms,
                         tok_s=b / step_s, graphs=graphs is not None, **fb))
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        print(f"chorus batch {b}: step {step_s * 1e3:.2f} ms, gpu {gpu_ms:.2f} ms, graph {graph_ms:.2f} ms, "
              f"floor {floor_ms:.2f} ms, "
              f"eager {eager_s * 1e3:.2f} ms, busy {timing.get('busy_fraction', float('nan')):.3f}",
              flush=True)
    return rows


def hf_rows(args, model_dir: str, batch_sizes: list[int]) -> list[dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = AutoConfig.from_pretrained(model_dir)
    if args.quantization == "int4":          # transformers runs the float model of the shape (random weights)
        del cfg.quantization_config
    if args.load_format == "dummy" or args.quantization == "int4":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        from engine.loader import checkpoint_dir, resolve_model
        model = AutoModelForCausalLM.from_pretrained(checkpoint_dir(resolve_model(model_dir)), dtype=dtype)
        model.to(device)
    model.eval()
    model.generation_config.eos_token_id = None
    k = args.hf_new_tokens
    rows = []

    def gen(ids, n):
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t0

    for b in batch_sizes:
        ids = torch.tensor(_random_prompts(b, args.context_len, cfg.vocab_size, seed=b), device=device)
        gen(ids[:, :16], 2)                                     # warm-up
        t1 = gen(ids, 1)
        tk = gen(ids, 1 + k)
        per_token = (tk - t1) / k
        rows.append(dict(batch=b, hf_ms_per_token=per_token * 1e3, hf_tok_s=b / per_token, hf_prefill_s=t1))
        print(f"hf batch {b}: {per_token * 1e3:.2f} ms/token ({b / per_token:.1f} tok/s)", flush=True)
    model = None   # frees it (``gen`` reads the name)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    add_shape_args(ap)
    ap.add_argument("--batch-sizes", default="1,32,128,256")
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--hf-new-tokens", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default="benchmarks/out/latency.json")
    args = ap.parse_args()
    resolve_shape_args(args)
    if args.model is None:
        ap.error("--model, --shape or --llama3-8b-dummy is required")
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    device, bandwidth = device_and_bandwidth()
    rows = chorus_rows(args, args.model, batch_sizes, bandwidth)
    hf = {} if args.skip_hf else {r["batch"]: r for r in hf_rows(args, args.model, batch_sizes)}
    for r in rows:
        r.update(hf.get(r["batch"], {}))
        if "hf_ms_per_token" in r:
            r["speedup_vs_hf"] = r["hf_ms_per_token"] / r["step_ms"]

    name = f"{args.shape}-dummy{'-tiny' if args.tiny else ''}" if args.shape else args.model
    name += f", {args.quantization} weights" if args.quantization else ""
    name += f", {args.kv_cache_dtype} KV cache" if args.kv_cache_dtype != "auto" else ""
    print(f"\ncontext {args.context_len} tokens, model {name}, {device}, copy bw {bandwidth / 1e12:.2f} TB/s")
    print(f"{'batch':>5s} {'step ms':>8s} {'gpu ms':>7s} {'graph ms':>8s} {'floor ms':>8s} {'x floor':>7s} {'busy':>6s} "
          f"{'eager ms':>8s} {'tok/s':>8s} {'HF ms/tok':>9s} {'x HF':>6s}")
    for r in rows:
        print(f"{r['batch']:5d} {r['step_ms']:8.2f} {r['gpu_ms']:7.2f} {r['graph_ms']:8.2f} {r['floor_ms']:8.2f} "
              f"{r['step_over_floor']:7.2f} {r['busy_fraction']:6.3f} {r['eager_step_ms']:8.2f} "
              f"{r['tok_s']:8.1f} "
              f"{r.get('hf_ms_per_token', float('nan')):9.2f} {r.get('speedup_vs_hf', float('nan')):6.1f}")
    write_report(args, device, bandwidth, rows)


def device_and_bandwidth() -> tuple[str, float]:
    """The device's name and its copy bandwidth (``measure_copy_bandwidth``), printed."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()}"
    bandwidth = measure_copy_bandwidth()
    print(f"device {device}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    return device, bandwidth


def write_report(args, device: str, bandwidth: float, rows: list[dict]) -> None:
    """The JSON at ``args.out``: the flags, the device, its bandwidth and the rows."""
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(args=vars(args), device=device, copy_bandwidth_bytes_s=bandwidth, rows=rows,
                       date=time.strftime("%Y-%m-%d")), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
