"""Multi-adapter throughput: Chorus with 0, 1, 4, 16, 64 distinct LoRA adapters in one batch,
as a fraction of the base model, against transformers + PEFT mixed-adapter ``generate``.

Examples:
    # H200: Llama-3-8B shape, random bf16 weights (no download), rank-16 adapters on all 7 projections
    python benchmarks/multi_lora.py --batch-size 64 --input-len 512 --output-len 128
    # the same with a larger batch and a shorter transformers run (its tok/s is a rate)
    python benchmarks/multi_lora.py --batch-size 256 --hf-output-len 32
    # CPU smoke run on a tiny config
    python benchmarks/multi_lora.py --tiny

Each run decodes ``--batch-size`` requests of ``--input-len`` random prompt tokens and
``--output-len`` new tokens (EOS ignored, greedy). With N adapters, request i runs adapter
i % N. Adapters are random rank-``--rank`` PEFT directories (``--unique-adapter-files`` distinct
weight files, shared round-robin by N distinct adapter *names*: each name takes its own slot,
so the kernels read N distinct slots exactly as with N distinct weights). Chorus runs with
``max_loras`` = the largest N, prefix caching off (the same prompts are reused across runs),
and a warm-up that puts the run's adapters in their slots first. "base" is an engine without
LoRA; "x base" is each run's tok/s over it. transformers + PEFT holds every adapter and runs
one padded batch with ``adapter_names`` (``__base__`` for N = 0). Prints a table, writes JSON.
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

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024, tie_word_embeddings=False)
TARGETS = {"self_attn.q_proj": ("hidden", "q"), "self_attn.k_proj": ("hidden", "kv"),
           "self_attn.v_proj": ("hidden", "kv"), "self_attn.o_proj": ("q", "hidden"),
           "mlp.gate_proj": ("hidden", "inter"), "mlp.up_proj": ("hidden", "inter"),
           "mlp.down_proj": ("inter", "hidden")}


# ----------------------------------------------------------------------------------------
# Checkpoint and adapters on disk
# ----------------------------------------------------------------------------------------
def dummy_checkpoint(out_dir: Path, shape: dict, dtype: str) -> Path:
    """A config-only HF directory (``load_format=dummy``) with a minimal tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**shape, dtype=dtype, architectures=["LlamaForCausalLM"]).save_pretrained(out_dir)
    # Prompts are token ids; the tokenizer only has to exist (unknown ids detokenize to "").
    tk = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(out_dir)
    return out_dir


def write_random_adapter(out_dir: Path, shape: dict, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory: rank ``rank`` on all 7 projections of every layer, random A and B."""
    from safetensors.torch import save_file

    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    dims = dict(hidden=shape["hidden_size"], inter=shape["intermediate_size"],
                q=shape["num_attention_heads"] * head_dim, kv=shape["num_key_value_heads"] * head_dim)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        for module, (d_in, d_out) in TARGETS.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            n_in, n_out = dims[d_in], dims[d_out]
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

    kw = dict(load_format="dummy", dtype=args.dtype, max_num_seqs=args.batch_size, seed=0,
              max_model_len=args.input_len + args.output_len + 16, enable_prefix_caching=False)
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if enable_lora:
        kw.update(enable_lora=True, max_loras=max(max(args.num_adapters), 1), max_lora_rank=args.rank,
                  max_cpu_loras=max(max(args.num_adapters), 1))
    return LLM(args.model, **kw)


def run_chorus(llm, args, prompts, lora_requests: list, label: str) -> dict:
    from engine import SamplingParams

    n = len(lora_requests)
    per_request = [lora_requests[i % n] if n else None for i in range(len(prompts))]
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    # Warm-up: compile kernels and put this run's adapters into their slots.
    llm.generate([{"prompt_token_ids": p[:16]} for p in prompts[:max(n, 1)]], warm,
                 lora_request=per_request[:max(n, 1)], use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    steps0 = llm.llm_engine.get_stats().num_steps
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=per_request,
                        use_tqdm=False)
    _sync()
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == len(prompts) * args.output_len, n_out
    return dict(system=label, num_adapters=n, seconds=dt, output_tokens=n_out, output_tok_s=n_out / dt,
                steps=llm.llm_engine.get_stats().num_steps - steps0)


def chorus_rows(args, prompts, adapter_dirs) -> list[dict]:
    from lora import LoRARequest

    rows = []
    llm = chorus_engine(args, enable_lora=False)
    rows.append(run_chorus(llm, args, prompts, [], "chorus base (LoRA off)"))
    del llm
    _free()
    llm = chorus_engine(args, enable_lora=True)
    mgr = llm.llm_engine.lora_manager
    names = [LoRARequest(f"lora-{i}", i + 1, str(adapter_dirs[i % len(adapter_dirs)]))
             for i in range(max(args.num_adapters))]
    for r in names:
        llm.llm_engine.add_lora(r)
    for n in args.num_adapters:
        rows.append(run_chorus(llm, args, prompts, names[:n], f"chorus {n} adapters"))
        print(f"  {rows[-1]['system']}: {rows[-1]['output_tok_s']:.1f} tok/s", flush=True)
    rows[-1]["slot_mib"] = mgr.slot_nbytes() / (1 << 20)
    rows[-1]["host_store_mib"] = mgr.store.nbytes() / (1 << 20)
    del llm, mgr
    _free()
    return rows


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------
# transformers + PEFT
# ----------------------------------------------------------------------------------------
def hf_rows(args, prompts, adapter_dirs) -> list[dict]:
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    cfg = AutoConfig.from_pretrained(args.model)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    n_max = max(args.num_adapters)
    pm = PeftModel.from_pretrained(base, str(adapter_dirs[0]), adapter_name="lora-0")
    for i in range(1, n_max):
        pm.load_adapter(str(adapter_dirs[i % len(adapter_dirs)]), adapter_name=f"lora-{i}")
    pm.to(device=device, dtype=dtype).eval()
    ids = torch.tensor(prompts, device=device)                       # [batch, input_len]; equal lengths
    rows = []
    for n in args.num_adapters:
        names = [f"lora-{i % n}" if n else "__base__" for i in range(len(prompts))]
        kw = dict(max_new_tokens=args.hf_output_len, min_new_tokens=args.hf_output_len, do_sample=False,
                  pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            pm.generate(input_ids=ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]),
                        adapter_names=names, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
            _sync()
            t0 = time.perf_counter()
            pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names, **kw)
            _sync()
        dt = time.perf_counter() - t0
        n_out = len(prompts) * args.hf_output_len
        rows.append(dict(system=f"hf+peft {n} adapters", num_adapters=n, seconds=dt, output_tokens=n_out,
                         output_tok_s=n_out / dt))
        print(f"  {rows[-1]['system']}: {rows[-1]['output_tok_s']:.1f} tok/s", flush=True)
    del pm, base
    _free()
    return rows


# ----------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny random config, CPU-friendly sizes")
    ap.add_argument("--batch-size", type=int, default=None, help="requests per run (default 64)")
    ap.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 512; tiny: 32)")
    ap.add_argument("--output-len", type=int, default=None, help="new tokens (default 128; tiny: 8)")
    ap.add_argument("--hf-output-len", type=int, default=None,
                    help="new tokens for transformers + PEFT (default: --output-len); its tok/s is a rate")
    ap.add_argument("--num-adapters", default="0,1,4,16,64", help="comma-separated distinct adapter counts")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--unique-adapter-files", type=int, default=8,
                    help="distinct random weight files written (names beyond reuse them round-robin)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--workdir", default="/tmp/chorus-multi-lora", help="where the config and adapters go")
    ap.add_argument("--out", default="benchmarks/out/multi_lora.json")
    args = ap.parse_args()
    shape = TINY if args.tiny else LLAMA3_8B
    defaults = dict(batch_size=64, input_len=32, output_len=8) if args.tiny else \
        dict(batch_size=64, input_len=512, output_len=128)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.hf_output_len = args.hf_output_len or args.output_len
    args.dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    args.num_adapters = [int(x) for x in args.num_adapters.split(",")]
    if max(args.num_adapters) > args.batch_size:
        raise SystemExit(f"--num-adapters {max(args.num_adapters)} > --batch-size {args.batch_size}: "
                         "some adapters would get no request.")
    work = Path(args.workdir) / ("tiny" if args.tiny else "llama3-8b")
    args.model = str(dummy_checkpoint(work / "model", shape, args.dtype))
    n_files = max(1, min(args.unique_adapter_files, max(args.num_adapters)))
    t0 = time.perf_counter()
    adapter_dirs = [write_random_adapter(work / f"adapter-r{args.rank}-{i}", shape, args.rank, seed=i)
                    if not (work / f"adapter-r{args.rank}-{i}" / "adapter_config.json").exists()
                    else work / f"adapter-r{args.rank}-{i}" for i in range(n_files)]
    print(f"adapters ready in {time.perf_counter() - t0:.1f} s", flush=True)
    prompts = make_prompts(args.batch_size, args.input_len, shape["vocab_size"], seed=0)

    rows = chorus_rows(args, prompts, adapter_dirs)
    base = rows[0]["output_tok_s"]
    for r in rows:
        r["x_base"] = r["output_tok_s"] / base
    if not args.skip_hf:
        hf = hf_rows(args, prompts, adapter_dirs)
        hf_base = hf[0]["output_tok_s"] if hf[0]["num_adapters"] == 0 else None
        for r in hf:
            r["x_base"] = r["output_tok_s"] / hf_base if hf_base else None
            ours = next((c for c in rows[1:] if c["num_adapters"] == r["num_adapters"]), None)
            if ours is not None:
                ours["x_hf_peft"] = ours["output_tok_s"] / r["output_tok_s"]
        rows += hf

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()}"
    print(f"\nworkload: batch {args.batch_size}, input {args.input_len}, output {args.output_len} "
          f"(hf+peft: {args.hf_output_len}), rank {args.rank} on all 7 projections, "
          f"{'tiny' if args.tiny else 'Llama-3-8B'}-shaped {args.dtype}, device {device}")
    print(f"{'system':28s} {'adapters':>8s} {'seconds':>9s} {'out tok/s':>10s} {'x base':>7s} "
          f"{'x hf+peft':>9s}")
    for r in rows:
        xb = f"{r['x_base']:.3f}" if r.get("x_base") is not None else "-"
        xh = f"{r['x_hf_peft']:.1f}" if r.get("x_hf_peft") is not None else "-"
        print(f"{r['system']:28s} {r['num_adapters']:8d} {r['seconds']:9.2f} {r['output_tok_s']:10.1f} "
              f"{xb:>7s} {xh:>9s}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(args=vars(args), device=device, rows=rows, date=time.strftime("%Y-%m-%d")), f,
                  indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
