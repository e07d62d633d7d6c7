"""Offline throughput: Chorus ``LLM.generate`` vs transformers on the same model and prompts, one run.

Examples:
    # CPU, the default SmolLM2-135M-Instruct, 64 prompts of 128 tokens, 64 new tokens each
    python benchmarks/throughput.py --num-prompts 64 --input-len 128 --output-len 64
    # H200, a Llama-3-8B-shaped model with random bf16 weights, lengths drawn per request
    python benchmarks/throughput.py --llama3-8b-dummy --num-prompts 1000 --input-len 128:1024 \
        --output-len 64:512 --hf-batch-size 64 --hf-max-prompts 64 --hf-continuous
    # another shape (benchmarks/shapes.py; --tiny: its small variant, for CPU); FP8 weights in the engine
    python benchmarks/throughput.py --shape qwen3-30b-a3b --num-prompts 1000 ...
    python benchmarks/throughput.py --shape llama3-8b --quantization fp8 --num-prompts 1000 ...
    # Llama-3-70B shape on one H200: FP8 weights and KV cache, no transformers (its bf16 model does not fit)
    python benchmarks/throughput.py --shape llama3-70b --quantization fp8 --kv-cache-dtype fp8 --skip-hf ...

Transformers runs padded batched ``generate`` (left padding, batches of ``--hf-batch-size``, each
batch runs to its longest output; only requested tokens count) and, with ``--hf-continuous``,
its continuous-batching ``generate_batch``. EOS is ignored everywhere. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.shapes import (LLAMA3_8B, add_shape_args, dummy_model, resolve_shape_args,  # noqa: E402
                               shape_fields, write_checkpoint)  # noqa: E402
from engine.dtypes import TORCH_DTYPES  # noqa: E402

def parse_range(s: str) -> tuple[int, int]:
    if ":" in s:
        a, b = s.split(":")
        return int(a), int(b)
    return int(s), int(s)


def make_workload(n: int, in_range, out_range, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        plen = rng.randint(*in_range)
        prompts.append([rng.randrange(100, vocab - 100) for _ in range(plen)])
        outs.append(rng.randint(*out_range))
    return prompts, outs


def dummy_checkpoint(out_dir: Path, dtype: str, shape: dict = LLAMA3_8B) -> Path:
    """A config-only Llama directory of ``shape``'s sizes for ``load_format=dummy`` (and the same config for
    transformers), with ``benchmarks.shapes.write_tokenizer``'s tokenizer of one token per id."""
    return write_checkpoint(out_dir, "llama", "LlamaForCausalLM", shape, dtype)


def llama3_8b_dummy() -> str:
    """The Llama-3-8B-shaped checkpoint of ``--llama3-8b-dummy`` (config and tokenizer; random bf16
    weights through ``load_format=dummy``), under $TMPDIR (default /tmp)."""
    return dummy_model("llama3-8b")


def run_chorus(args, prompts, outs) -> dict:
    from engine import LLM
    kw = dict(dtype=args.dtype, seed=0, enforce_eager=args.enforce_eager)
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    if args.enable_prefix_caching is not None:
        kw["enable_prefix_caching"] = args.enable_prefix_caching
    if args.load_format == "dummy":
        kw["load_format"] = "dummy"
    if args.quantization:
        kw["quantization"] = args.quantization
    if args.kv_cache_dtype != "auto":
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    load_s = time.perf_counter() - t0
    run = timed_generate(llm, prompts, outs, args.warmup_prompts)
    sc = llm.llm_engine.engine_config.scheduler_config
    del llm
    return dict(system="chorus" + (f" ({args.quantization})" if args.quantization else "")
                + (f" ({args.kv_cache_dtype} KV)" if args.kv_cache_dtype != "auto" else "")
                + (" (eager)" if args.enforce_eager else ""), **run, load_s=load_s,
                max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens)


def timed_generate(llm, prompts: list[list[int]], outs: list[int], warmup_prompts: int,
                   lora_requests: Optional[list] = None) -> dict:
    """One timed ``llm.generate`` of every prompt (token ids) to ``outs[i]`` new tokens (greedy, EOS
    ignored), after an untimed warm-up on the first ``warmup_prompts`` prompts reversed.

    ``lora_requests``: one per prompt (None entries or None: the base model). Returns seconds, token
    and request rates, the engine's step and preemption counts and, on CUDA, the device time by step
    kind (``StepTimer``) and allocator retries.
    """
    from engine import SamplingParams
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outs]
    # Warm-up outside the timed run: Triton compiles its prefill / mixed-batch variants, the
    # allocator grows, adapters move into their slots. Prompts reversed so the prefix cache does
    # not serve the timed run.
    warm = [{"prompt_token_ids": p[::-1]} for p in prompts[:warmup_prompts]]
    llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False,
                 lora_request=lora_requests[:warmup_prompts] if lora_requests else None)
    timer = None
    if torch.cuda.is_available():
        from benchmarks.step_timer import StepTimer
        torch.cuda.synchronize()
        timer = llm.llm_engine.runner.step_observer = StepTimer()
    retries0 = alloc_retries()
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                       lora_request=lora_requests)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    busy = timer.summary() if timer is not None else {}
    llm.llm_engine.runner.step_observer = None
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    assert n_out == sum(outs), (n_out, sum(outs))
    stats = llm.llm_engine.get_stats()
    return dict(seconds=dt, output_tokens=n_out, requests=len(prompts), output_tok_s=n_out / dt,
                req_s=len(prompts) / dt, preemptions=stats.num_preemptions, steps=stats.num_steps,
                gpu_busy_fraction=busy.get("busy_fraction"), gpu_busy_ms=busy.get("gpu_busy_ms"),
                gpu_span_ms=busy.get("span_ms"), steps_by_kind=busy.get("by_kind"),
                alloc_retries=None if retries0 is None else alloc_retries() - retries0)


def alloc_retries() -> Optional[int]:
    """cudaMalloc retries (the caching allocator freed its cache to fit): >0 means memory thrash."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def print_steps_by_kind(by_kind: Optional[dict]) -> None:
    """Device time per step kind (decode graph / mixed graph / eager): where a run's time went."""
    if not by_kind:
        return
    print(f"{'step kind':14s} {'steps':>6s} {'GPU s':>7s} {'ms/step':>8s} {'tokens':>9s} {'run (padded)':>13s}")
    for kind, k in sorted(by_kind.items()):
        print(f"{kind:14s} {k['steps']:6d} {k['gpu_ms'] / 1e3:7.2f} {k['gpu_ms'] / max(1, k['steps']):8.2f} "
              f"{k['tokens']:9d} {k['tokens_run']:13d}")


def load_hf(args):
    from transformers import AutoModelForCausalLM
    dtype = None if args.dtype == "auto" else TORCH_DTYPES[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.load_format == "dummy":
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(args.model)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        from engine.loader import checkpoint_dir, resolve_model
        model = AutoModelForCausalLM.from_pretrained(checkpoint_dir(resolve_model(args.model)), dtype=dtype)
        model.to(device)
    model.eval()
    model.generation_config.eos_token_id = None
    return model, device


def run_hf_padded(model, device, prompts, outs, batch_size: int) -> dict:
    pad = 0
    total_out = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        bp, bo = prompts[i:i + batch_size], outs[i:i + batch_size]
        width = max(len(p) for p in bp)
        ids = torch.full((len(bp), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(bp):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.no_grad():
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(bo),
                           min_new_tokens=max(bo), do_sample=False, pad_token_id=pad)
        total_out += sum(bo)
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return dict(system=f"hf-generate-padded(bs={batch_size})", seconds=dt, output_tokens=total_out,
                requests=len(prompts), output_tok_s=total_out / dt, req_s=len(prompts) / dt)


def run_hf_continuous(model, device, prompts, outs) -> dict:
    from transformers import GenerationConfig
    gc = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate_batch(inputs=prompts, generation_config=gc)
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    total = len(prompts) * max(outs)  # generate_batch has one max_new_tokens for all
    return dict(system="hf-generate_batch(continuous)", seconds=dt, output_tokens=total,
                requests=len(prompts), output_tok_s=total / dt, req_s=len(prompts) / dt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    add_shape_args(ap)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", default="128", help="N or MIN:MAX (uniform)")
    ap.add_argument("--output-len", default="64", help="N or MIN:MAX (uniform)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's (vLLM's rule)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="default: the engine's (on)")
    ap.add_argument("--warmup-prompts", type=int, default=32, help="untimed requests run first")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--hf-max-prompts", type=int, default=None,
                    help="run transformers on only the first N prompts (its tok/s is a rate)")
    ap.add_argument("--hf-continuous", action="store_true", help="also run transformers' generate_batch")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-workload", default=None,
                    help="also write the requests as .jsonl ({prompt: token ids, output_len}), for "
                         "benchmarks/serve.py --dataset: the same requests over HTTP")
    ap.add_argument("--out", default="benchmarks/out/throughput.json")
    args = ap.parse_args()
    resolve_shape_args(args)
    if args.shape and args.max_model_len is None:
        args.max_model_len = 2048
    vocab = shape_fields(args.shape, args.tiny)[2]["vocab_size"] if args.shape else 49152
    if args.model and not args.shape:
        from engine.loader import load_config, resolve_model
        vocab = load_config(resolve_model(args.model)).vocab_size
    prompts, outs = make_workload(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len),
                                  vocab, args.seed)
    if args.save_workload:
        with open(args.save_workload, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"prompt": p, "output_len": o}) + "\n" for p, o in zip(prompts, outs))
    rows = [run_chorus(args, prompts, outs)]
    if not args.skip_hf:
        import gc
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        model, device = load_hf(args)
        k = args.hf_max_prompts or len(prompts)
        rows.append(run_hf_padded(model, device, prompts[:k], outs[:k], args.hf_batch_size))
        if args.hf_continuous:
            try:
                rows.append(run_hf_continuous(model, device, prompts[:k], outs[:k]))
            except Exception as e:   # NOTE: generate_batch's API moves between transformers releases
                print(f"transformers generate_batch failed: {type(e).__name__}: {e}", flush=True)
    best_hf = max((r["output_tok_s"] for r in rows[1:]), default=None)
    for r in rows:
        r["vs_best_hf"] = r["output_tok_s"] / best_hf if best_hf else None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()}"
    print(f"\nworkload: {args.num_prompts} prompts, input {args.input_len}, output {args.output_len}, "
          f"model {args.model or 'SmolLM2-135M-Instruct'}, device {device}")
    print(f"{'system':40s} {'requests':>8s} {'seconds':>9s} {'out tok/s':>10s} {'req/s':>8s} "
          f"{'x best HF':>9s} "
          f"{'GPU busy':>8s}")
    for r in rows:
        ratio = f"{r['vs_best_hf']:.2f}" if r["vs_best_hf"] else "-"
        busy = f"{r['gpu_busy_fraction']:.3f}" if r.get("gpu_busy_fraction") is not None else "-"
        print(f"{r['system']:40s} {r['requests']:8d} {r['seconds']:9.2f} {r['output_tok_s']:10.1f} "
              f"{r['req_s']:8.2f} {ratio:>9s} {busy:>8s}")
    print(f"Chorus limits: max_num_seqs {rows[0]['max_num_seqs']}, max_num_batched_tokens "
          f"{rows[0]['max_num_batched_tokens']}, {rows[0]['preemptions']} preemptions")
    print_steps_by_kind(rows[0].get("steps_by_kind"))
    if rows[0].get("alloc_retries") is not None:
        print(f"allocator retries during the Chorus run: {rows[0]['alloc_retries']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(args=vars(args), device=device, rows=rows, date=time.strftime("%Y-%m-%d")), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
