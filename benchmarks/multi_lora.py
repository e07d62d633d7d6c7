"""Multi-adapter throughput: Chorus with 0, 1, 4, 16, 64 distinct LoRA adapters in one batch,
as a fraction of the base model, against transformers + PEFT mixed-adapter ``generate``.

Examples:
    # H200: Llama-3-8B shape, random bf16 weights (no download), rank-16 adapters on all 7 projections
    python benchmarks/multi_lora.py --batch-sizes 64,256 --input-len 512 --output-len 128
    # the FP8 base (--quantization fp8), and Qwen3-30B-A3B with adapters on attention and every routed expert
    python benchmarks/multi_lora.py --quantization fp8 --batch-sizes 64 --num-adapters 0,16,64 --skip-hf
    python benchmarks/multi_lora.py --shape qwen3-30b-a3b --batch-sizes 64 --num-adapters 0,16 --max-loras 16 \
        --gpu-memory-utilization 0.85 --skip-hf
    # CPU smoke run on a tiny config
    python benchmarks/multi_lora.py --tiny

Each run decodes ``--batch-sizes`` requests of ``--input-len`` random prompt tokens and
``--output-len`` new tokens (EOS ignored, greedy). With N adapters, request i runs adapter
i % N. Adapters are random rank-``--rank`` PEFT directories (``--unique-adapter-files`` distinct
weight files, shared round-robin by N distinct adapter *names*: each name takes its own slot,
so the kernels read N distinct slots exactly as with N distinct weights). ``--shape`` (benchmarks/shapes.py,
default llama3-8b; random weights) sets the model: adapters on q/k/v/o and the MLP's gate/up/down, on a MoE shape
on every routed expert's (PEFT's per-expert form ``mlp.experts.N.gate_proj``); ``--quantization fp8`` quantizes
the base of both engines (the adapters stay float). Chorus runs with
``max_loras`` = the largest N (``--max-loras`` sets it), prefix caching off (the same prompts are reused across runs),
and a warm-up that puts the run's adapters in their slots first; one LoRA engine serves every
adapter count (decode steps replay CUDA graphs with the LoRA kernels inside). "base" is an engine
without LoRA; "x base" is each run's tok/s over it at the same batch ("x base dev": the same over
the steps' device time, CUDA only, without the host's share of the wall clock, which moves "x base"
by a few percent between runs). transformers + PEFT holds
every adapter and runs one padded batch with ``adapter_names`` (``__base__`` for N = 0); its
time for the full output is extrapolated from two short runs (``--hf-output-lens``) to keep it
within minutes. Prints a table, writes JSON (after every row).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.shapes import SHAPES, dummy_model, shape_fields  # noqa: E402
from engine.dtypes import TORCH_DTYPES  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024, tie_word_embeddings=False)
TARGETS = {"self_attn.q_proj": ("hidden", "q"), "self_attn.k_proj": ("hidden", "kv"),
           "self_attn.v_proj": ("hidden", "kv"), "self_attn.o_proj": ("q", "hidden"),
           "mlp.gate_proj": ("hidden", "inter"), "mlp.up_proj": ("hidden", "inter"),
           "mlp.down_proj": ("inter", "hidden")}


# ----------------------------------------------------------------------------------------
# Checkpoint and adapters on disk
# ----------------------------------------------------------------------------------------
def adapter_modules(shape: dict) -> list[tuple[str, int, int]]:
    """(module under a decoder layer, fan in, fan out) of each projection the adapters of ``shape`` (config fields)
    target: ``TARGETS``' 7; on a MoE (``num_experts``) the gate/up/down of every routed expert instead of the MLP's
    (PEFT's per-expert names ``mlp.experts.N.gate_proj``, which it stacks when it loads them)."""
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    dims = dict(hidden=shape["hidden_size"], inter=shape["intermediate_size"],
                q=shape["num_attention_heads"] * head_dim, kv=shape["num_key_value_heads"] * head_dim)
    modules = [(m, dims[d_in], dims[d_out]) for m, (d_in, d_out) in TARGETS.items()]
    if not shape.get("num_experts"):
        return modules
    h, inter = shape["hidden_size"], shape["moe_intermediate_size"]
    experts = [(f"mlp.experts.{e}.{proj}", *((inter, h) if proj == "down_proj" else (h, inter)))
               for e in range(shape["num_experts"]) for proj in ("gate_proj", "up_proj", "down_proj")]
    return [m for m in modules if m[0].startswith("self_attn.")] + experts


def write_random_adapter(out_dir: Path, shape: dict, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory: rank ``rank`` on every ``adapter_modules`` projection of every layer, random A and B."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        for module, n_in, n_out in adapter_modules(shape):
            key = f"base_model.model.model.layers.{layer}.{module}"
            a = torch.randn(rank, n_in, generator=g) / math.sqrt(n_in)
            tensors[f"{key}.lora_A.weight"] = a.bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * 0.02).bfloat16()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                  target_modules=[m.rpartition(".")[2] for m in TARGETS], bias="none", use_rslora=False,
                  fan_in_fan_out=False, use_dora=False, modules_to_save=None)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out_dir


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


# ----------------------------------------------------------------------------------------
# Chorus
# ----------------------------------------------------------------------------------------
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def chorus_engine(args, enable_lora: bool):
    from engine import LLM

    kw = dict(load_format="dummy", dtype=args.dtype, max_num_seqs=max(args.batch_sizes), seed=0,
              max_model_len=args.input_len + args.output_len + 16, enable_prefix_caching=False,
              quantization=args.quantization)
    if torch.cuda.is_available():
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if enable_lora:
        slots = args.max_loras or max(max(args.num_adapters), 1)
        kw.update(enable_lora=True, max_loras=slots, max_lora_rank=args.rank, max_cpu_loras=slots)
    return LLM(args.model, **kw)


def run_chorus(llm, args, prompts, lora_requests: list, label: str) -> dict:
    from engine import SamplingParams

    n = len(lora_requests)
    per_request = [lora_requests[i % n] if n else None for i in range(len(prompts))]
    warm = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    # Warm-up on the run's own prompts (prefill shapes compile, cuBLAS picks its kernels) and
    # adapters (they move into their slots), so the timed run measures steady serving.
    llm.generate([{"prompt_token_ids": p} for p in prompts], warm, lora_request=per_request, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine = llm.llm_engine
    steps0 = engine.get_stats().num_steps
    graphs = engine.runner.graphs
    replays0 = graphs.num_replays if graphs is not None else 0
    timer = retries0 = None
    if torch.cuda.is_available():
        from benchmarks.throughput import alloc_retries
        from benchmarks.step_timer import StepTimer
        timer = engine.runner.step_observer = StepTimer()
        retries0 = alloc_retries()
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=per_request,
                        use_tqdm=False)
    _sync()
    dt = time.perf_counter() - t0
    by_kind, retries = None, None
    if timer is not None:
        by_kind = timer.summary()["by_kind"]
        engine.runner.step_observer = None
        retries = alloc_retries() - retries0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == len(prompts) * args.output_len, n_out
    device_s = sum(k["gpu_ms"] for k in by_kind.values()) / 1e3 if by_kind else None
    return dict(system=label, batch=len(prompts), num_adapters=n, seconds=dt, device_seconds=device_s,
                output_tokens=n_out, output_tok_s=n_out / dt, steps=engine.get_stats().num_steps - steps0,
                graph_steps=(graphs.num_replays if graphs is not None else 0) - replays0,
                steps_by_kind=by_kind, alloc_retries=retries)



def chorus_rows(args, prompts, adapter_dirs, report) -> list[dict]:
    """One LoRA-off engine for the base rows and one LoRA engine reused for every adapter count;
    the LoRA-off engine first unless ``--base-last``."""
    order = (_lora_rows, _base_rows) if args.base_last else (_base_rows, _lora_rows)
    for run in order:
        run(args, prompts, adapter_dirs, report)
    return report["rows"]


def _base_rows(args, prompts, adapter_dirs, report) -> None:
    t0 = time.perf_counter()
    llm = chorus_engine(args, enable_lora=False)
    print(f"  base engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    for b in args.batch_sizes:
        report["rows"].append(run_chorus(llm, args, prompts[:b], [], "chorus base (LoRA off)"))
        _show(report["rows"][-1], report)
    llm.close()
    del llm
    _free()


def _lora_rows(args, prompts, adapter_dirs, report) -> None:
    from lora import LoRARequest

    t0 = time.perf_counter()
    llm = chorus_engine(args, enable_lora=True)
    mgr = llm.llm_engine.lora_manager
    names = [LoRARequest(f"lora-{i}", i + 1, str(adapter_dirs[i % len(adapter_dirs)]))
             for i in range(max(args.num_adapters))]
    for r in names:
        llm.llm_engine.add_lora(r)
    print(f"  LoRA engine ready, {len(names)} adapters registered in {time.perf_counter() - t0:.1f} s",
          flush=True)
    for b in args.batch_sizes:
        for n in args.num_adapters:
            if n > b:
                continue
            report["rows"].append(run_chorus(llm, args, prompts[:b], names[:n], f"chorus {n} adapters"))
            _show(report["rows"][-1], report)
    report["lora_slot_mib"] = mgr.slot_nbytes() / (1 << 20)
    report["lora_host_store_mib"] = mgr.store.nbytes() / (1 << 20)
    llm.close()
    del llm, mgr
    _free()


def _show(row: dict, report: dict) -> None:
    print(f"  {row['system']} batch {row['batch']}: {row['output_tok_s']:.1f} tok/s "
          f"({row.get('steps', '-')} steps, {row.get('graph_steps', '-')} graph)", flush=True)
    for kind, k in sorted((row.get("steps_by_kind") or {}).items()):
        print(f"    {kind:13s} {k['steps']:5d} steps  GPU {k['gpu_ms'] / 1e3:6.2f} s  "
              f"{k['gpu_ms'] / max(1, k['steps']):7.2f} ms/step", flush=True)
    if row.get("alloc_retries"):
        print(f"    allocator retries: {row['alloc_retries']}", flush=True)
    _dump(report)


def _dump(report: dict) -> None:
    """Write the JSON after every row, so a run cut short still leaves its numbers."""
    out = Path(report["args"]["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------
# transformers + PEFT
# ----------------------------------------------------------------------------------------
def hf_rows(args, prompts, adapter_dirs, report) -> list[dict]:
    """PEFT mixed-adapter ``generate``; its time for ``output_len`` tokens is extrapolated from two
    short runs: t(n) = t(n1) + (n - n1) * (t(n2) - t(n1)) / (n2 - n1) (prefill plus per-token decode).

    Adapter 0 is read from disk; the others are added with ``add_adapter`` and random weights (speed
    does not depend on the values, and reading 64 files through PEFT would take minutes).
    """
    from peft import LoraConfig, PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = TORCH_DTYPES[args.dtype]
    t_start = time.perf_counter()
    cfg = AutoConfig.from_pretrained(args.model)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    n_max = max(args.num_adapters)
    pm = PeftModel.from_pretrained(base, str(adapter_dirs[0]), adapter_name="lora-0")
    lcfg = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=[m.rpartition(".")[2] for m in TARGETS],
                      init_lora_weights=False, lora_dropout=0.0)
    with torch.device(device):   # NOTE: LoRA weights created on the GPU: CPU init of 63 adapters took ~100 s
        for i in range(1, n_max):
            pm.add_adapter(f"lora-{i}", lcfg)
    pm.to(device=device, dtype=dtype).eval()
    print(f"  hf+peft ready with {n_max} adapters in {time.perf_counter() - t_start:.1f} s", flush=True)
    hb = args.hf_batch_size
    ids = torch.tensor(prompts[:hb], device=device)                   # [batch, input_len]; equal lengths
    n1, n2 = args.hf_output_lens
    rows = report["rows"]
    out = []
    for n in args.num_adapters:
        if time.perf_counter() - t_start > args.hf_time_budget:
            print(f"  hf+peft: time budget ({args.hf_time_budget} s) spent, skipping {n} adapters", flush=True)
            continue
        names = [f"lora-{i % n}" if n else "__base__" for i in range(hb)]
        times = []
        with torch.no_grad():
            pm.generate(input_ids=ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]), adapter_names=names,
                        max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0, eos_token_id=None)
            for new in (n1, n2):
                _sync()
                t0 = time.perf_counter()
                pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names,
                            max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                            eos_token_id=None)
                _sync()
                times.append(time.perf_counter() - t0)
        per_token = (times[1] - times[0]) / (n2 - n1)
        dt = times[0] + (args.output_len - n1) * per_token
        n_out = hb * args.output_len
        row = dict(system=f"hf+peft {n} adapters", batch=hb, num_adapters=n, seconds=dt, output_tokens=n_out,
                   output_tok_s=n_out / dt, measured=f"t({n1})={times[0]:.2f}s t({n2})={times[1]:.2f}s, "
                   f"extrapolated to {args.output_len} new tokens")
        rows.append(row)
        out.append(row)
        _show(row, report)
    del pm, base
    _free()
    return out


# ----------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b",
                    help="the model shape (benchmarks/shapes.py), random weights")
    ap.add_argument("--tiny", action="store_true", help="the shape's tiny variant, CPU-friendly sizes")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="the base model's weights in both Chorus engines (transformers keeps the float weights)")
    ap.add_argument("--batch-sizes", default=None, help="comma-separated requests per run (default 64)")
    ap.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 512; tiny: 32)")
    ap.add_argument("--output-len", type=int, default=None, help="new tokens (default 128; tiny: 8)")
    ap.add_argument("--hf-batch-size", type=int, default=64, help="requests in transformers + PEFT's batch")
    ap.add_argument("--hf-output-lens", default="1,9",
                    help="two short transformers runs (new tokens) extrapolated to --output-len")
    ap.add_argument("--hf-time-budget", type=float, default=150.0,
                    help="seconds for transformers + PEFT; adapter counts past it are skipped")
    ap.add_argument("--num-adapters", default="0,1,4,16,64", help="comma-separated distinct adapter counts")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=None,
                    help="GPU adapter slots of the LoRA engine (default: the largest --num-adapters); "
                         "decode steps of at most 16 adapters launch over 16 slots when it is larger")
    ap.add_argument("--unique-adapter-files", type=int, default=4,
                    help="distinct random weight files written (names beyond reuse them round-robin)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                    help="per Chorus engine (transformers runs after them in the same process)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--base-last", action="store_true",
                    help="run the LoRA-off engine after the LoRA engine (its batch-256 run has been slower "
                         "than the LoRA engine without adapters when it ran first; this checks the order)")
    ap.add_argument("--workdir", default="/tmp/chorus-multi-lora", help="where the config and adapters go")
    ap.add_argument("--out", default="benchmarks/out/multi_lora.json")
    args = ap.parse_args()
    shape = shape_fields(args.shape, args.tiny)[2]
    defaults = dict(batch_sizes="8" if args.tiny else "64", input_len=32 if args.tiny else 512,
                    output_len=8 if args.tiny else 128)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.batch_sizes = [int(x) for x in str(args.batch_sizes).split(",")]
    args.hf_batch_size = min(args.hf_batch_size, max(args.batch_sizes))
    args.hf_output_lens = [int(x) for x in args.hf_output_lens.split(",")]
    args.dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    args.num_adapters = [int(x) for x in args.num_adapters.split(",")]
    if args.max_loras is not None and args.max_loras < max(max(args.num_adapters), 1):
        raise SystemExit(f"--max-loras {args.max_loras} < --num-adapters {max(args.num_adapters)}: "
                         "a run's adapters must all fit in the GPU slots at once.")
    if max(args.num_adapters) > max(args.batch_sizes):
        raise SystemExit(f"--num-adapters {max(args.num_adapters)} > the largest batch: "
                         "some adapters would get no request.")
    if shape.get("num_experts") and not args.skip_hf:
        raise SystemExit(f"--shape {args.shape}: transformers + PEFT runs the dense shapes only; add --skip-hf.")
    work = Path(args.workdir) / f"{args.shape}{'-tiny' if args.tiny else ''}"
    args.model = dummy_model(args.shape, args.tiny, args.dtype)
    n_files = max(1, min(args.unique_adapter_files, max(args.num_adapters)))
    t0 = time.perf_counter()
    adapter_dirs = [write_random_adapter(work / f"adapter-r{args.rank}-{i}", shape, args.rank, seed=i)
                    if not (work / f"adapter-r{args.rank}-{i}" / "adapter_config.json").exists()
                    else work / f"adapter-r{args.rank}-{i}" for i in range(n_files)]
    print(f"adapters ready in {time.perf_counter() - t0:.1f} s", flush=True)
    prompts = make_prompts(max(args.batch_sizes), args.input_len, shape["vocab_size"], seed=0)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()}"
    targets = "q/k/v/o and every routed expert's gate/up/down" if shape.get("num_experts") else "all 7 projections"
    report = dict(args=vars(args), device=device, date=time.strftime("%Y-%m-%d"), targets=targets, rows=[])

    rows = chorus_rows(args, prompts, adapter_dirs, report)
    hf = [] if args.skip_hf else hf_rows(args, prompts, adapter_dirs, report)
    _finish(args, report, rows, hf)


def _finish(args, report: dict, rows: list[dict], hf: list[dict]) -> None:
    """Fractions of the base run (same batch) and ratios to transformers + PEFT; table; JSON."""
    chorus = [r for r in rows if r["system"].startswith("chorus")]
    base = {r["batch"]: r["output_tok_s"] for r in chorus if "LoRA off" in r["system"]}
    base_dev = {r["batch"]: r.get("device_seconds") for r in chorus if "LoRA off" in r["system"]}
    hf_by_n = {r["num_adapters"]: r["output_tok_s"] for r in hf}
    hf_base = hf_by_n.get(0)
    for r in chorus:
        r["x_base"] = r["output_tok_s"] / base[r["batch"]] if r["batch"] in base else None
        # The same ratio over device time (the steps' CUDA events): without the host's share of
        # the wall clock, which moves the wall ratio by a few percent from run to run.
        b, d = base_dev.get(r["batch"]), r.get("device_seconds")
        r["x_base_device"] = b / d if b and d else None
        if "LoRA off" not in r["system"] and r["num_adapters"] in hf_by_n and r["batch"] == args.hf_batch_size:
            r["x_hf_peft"] = r["output_tok_s"] / hf_by_n[r["num_adapters"]]
    for r in hf:
        r["x_base"] = r["output_tok_s"] / hf_base if hf_base else None
    print(f"\nworkload: batch {args.batch_sizes}, input {args.input_len}, output {args.output_len}, rank "
          f"{args.rank} on {report['targets']}, {args.shape}{' tiny' if args.tiny else ''}-shaped {args.dtype}"
          f"{', fp8 base' if args.quantization else ''}, "
          f"device {report['device']}; hf+peft: batch {args.hf_batch_size}, t({args.output_len}) extrapolated "
          f"from {args.hf_output_lens[0]} and {args.hf_output_lens[1]} new tokens")
    print(f"{'system':24s} {'batch':>5s} {'adapters':>8s} {'seconds':>8s} {'device s':>8s} {'out tok/s':>10s} "
          f"{'x base':>7s} {'x base dev':>10s} {'x hf+peft':>9s} {'steps':>6s} {'graph':>6s}")
    for r in rows:
        xb = f"{r['x_base']:.3f}" if r.get("x_base") is not None else "-"
        xd = f"{r['x_base_device']:.3f}" if r.get("x_base_device") is not None else "-"
        xh = f"{r['x_hf_peft']:.1f}" if r.get("x_hf_peft") is not None else "-"
        ds = f"{r['device_seconds']:.2f}" if r.get("device_seconds") is not None else "-"
        print(f"{r['system']:24s} {r['batch']:5d} {r['num_adapters']:8d} {r['seconds']:8.2f} {ds:>8s} "
              f"{r['output_tok_s']:10.1f} {xb:>7s} {xd:>10s} {xh:>9s} {r.get('steps', '-'):>6} "
              f"{r.get('graph_steps', '-'):>6}")
    _dump(report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
